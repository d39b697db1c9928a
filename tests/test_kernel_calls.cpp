// The seam between layers and backends: tensor references, kernel calls chosen by kind and dtype, what a backend
// says it has, and the compositions a Stream runs for a fused kernel its backend lacks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/stream.h"
#include "common/error.h"
#include "kernels/cpu/batchnorm.h"
#include "kernels/cpu/fixed_point.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/kernels.h"
#include "nn/layer.h"
#include "nn/model.h"
#include "partial_stream.h"

namespace dpar {
namespace {

namespace k = kernels::cpu;

std::vector<float> randn(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  std::vector<float> v(n);
  for (float& x : v) x = normal(gen);
  return v;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

template <class F>
std::string error_of(F&& f, Status expected) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), expected) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return {};
}

// ---- Tensor references ----------------------------------------------------------------------------------------

TEST(TensorRef, ContiguousViewsAndTransposedViews) {
  float x[6] = {0, 1, 2, 3, 4, 5};
  const TensorRef r = TensorRef::of(x, {2, 3});
  EXPECT_EQ(r.dtype, DType::kF32);
  EXPECT_EQ(r.strides[0], 3);
  EXPECT_EQ(r.strides[1], 1);
  EXPECT_EQ(r.numel(), 6);
  EXPECT_EQ(r.leading(), 2);
  EXPECT_EQ(r.size(-1), 3);
  EXPECT_TRUE(r.is_contiguous());
  EXPECT_EQ(r.view({3, 2}).str(), "f32 (3, 2)");
  const TensorRef t = r.transposed(0, 1);
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_EQ(t.str(), "f32 (3, 2) strides (1, 3)");
  // Element (i, j) of the transposed view is x[j * 3 + i].
  EXPECT_EQ(static_cast<float*>(t.data)[2 * t.strides[0] + 1 * t.strides[1]], 5.0f);
  EXPECT_EQ(r.contiguous_as<float>("test"), x);
  EXPECT_EQ(TensorRef{}.contiguous_as<float>("test"), nullptr) << "an absent argument reads as null";
  const std::string strided = error_of([&] { t.contiguous_as<float>("linear_forward"); }, Status::kInvalidArgument);
  EXPECT_NE(strided.find("linear_forward: this kernel reads contiguous memory, got the strided view f32 (3, 2) "
                         "strides (1, 3)"),
            std::string::npos)
      << strided;
  const std::string dtype = error_of([&] { r.contiguous_as<double>("batchnorm_stats"); }, Status::kInvalidArgument);
  EXPECT_NE(dtype.find("batchnorm_stats: expected f64, got f32"), std::string::npos) << dtype;
}

TEST(DType, OneListForTensorsBuffersAndCollectives) {
  EXPECT_EQ(dtype_size(DType::kF32), 4u);
  EXPECT_EQ(dtype_size(DType::kBF16), 2u);
  EXPECT_EQ(dtype_size(DType::kF16), 2u);
  EXPECT_EQ(dtype_size(DType::kF64), 8u);
  EXPECT_EQ(dtype_size(DType::kI64), 8u);
  EXPECT_STREQ(dtype_name(DType::kBF16), "bf16");
  error_of([] { dtype_size(static_cast<DType>(4)); }, Status::kInvalidArgument);
}

// ---- What the CPU backend has, and kernels chosen by dtype ------------------------------------------------------

TEST(KernelCalls, TheCpuBackendSaysWhatItHasAndRefusesTheRestNamingKernelAndDtype) {
  auto stream = cpu_backend().open_stream(Device{});
  EXPECT_TRUE(stream->supports({Op::kLinearForward, DType::kF32, Epilogue::kRelu}));
  EXPECT_FALSE(stream->supports({Op::kLinearForward, DType::kF32, Epilogue::kGelu}));
  EXPECT_TRUE(stream->can_run({Op::kLinearForward, DType::kF32, Epilogue::kGelu})) << "composed";
  EXPECT_TRUE(stream->supports({Op::kConvert, DType::kBF16}));
  // bf16 linear layers where oneDNN runs bf16 natively (tests/test_bf16_kernels.cpp), LayerNorm nowhere (only its
  // f32 kernel writing a rounded output).
  EXPECT_EQ(stream->supports({Op::kLinearForward, DType::kBF16}), k::bf16_support(nullptr));
  EXPECT_FALSE(stream->supports({Op::kLayerNormForward, DType::kBF16}));
  EXPECT_FALSE(stream->can_run({Op::kLayerNormForward, DType::kBF16}));
  uint16_t x[4] = {};
  double mean_rstd[4] = {};
  float w[2] = {}, b[2] = {}, y[4] = {};
  const std::string e = error_of(
      [&] {
        stream->run(call::LayerNormForward{
            TensorRef::of(y, {2, 2}), TensorRef::of(mean_rstd, {2, 2}),
            TensorRef::contiguous(x, DType::kBF16, {2, 2}), TensorRef::of(w, {2}), TensorRef::of(b, {2})});
      },
      Status::kNotSupported);
  EXPECT_NE(e.find("layernorm_forward (bf16) on cpu:0: this backend has no such kernel and no composition of "
                   "others stands in for it"),
            std::string::npos)
      << e;
}

// Convert is one kernel for both directions: the dtypes of its references choose the conversion.
TEST(KernelCalls, ConvertChoosesItsDirectionByDtype) {
  auto stream = cpu_backend().open_stream(Device{});
  const std::vector<float> x = {1.0f, -2.5f, 3.14159f, 1e-3f};
  std::vector<uint16_t> bits(4);
  std::vector<float> back(4);
  stream->run(call::Convert{TensorRef::of(bits.data(), {4}), TensorRef::of(x.data(), {4})});
  stream->run(call::Convert{TensorRef::of(back.data(), {4}), TensorRef::of(bits.data(), {4})});
  std::vector<uint16_t> want(4);
  std::vector<float> want_back(4);
  k::to_bf16(want.data(), x.data(), 4);
  k::from_bf16(want_back.data(), want.data(), 4);
  EXPECT_EQ(bits, want);
  EXPECT_TRUE(same_bits(back, want_back));
  EXPECT_EQ(back[0], 1.0f);
}

// ---- The reproducible mode's fixed point (engine/reproducible.cpp) as kernel calls ----------------------------------

// The CPU stream runs MaxExponent, ToGrid and FromGrid with kernels/cpu/fixed_point.h's kernels and Fill with
// kernels.h's: the same bits, the sentinels included.
TEST(KernelCalls, TheFixedPointCallsGiveTheBitsOfTheCpuKernels) {
  auto stream = cpu_backend().open_stream(Device{});
  for (Op op : {Op::kMaxExponent, Op::kToGrid, Op::kFromGrid, Op::kFill}) {
    EXPECT_TRUE(stream->supports({op, DType::kF32})) << op_name(op);
    EXPECT_FALSE(stream->supports({op, DType::kF64})) << op_name(op);
  }
  EXPECT_STREQ(op_name(Op::kMaxExponent), "max_exponent");
  EXPECT_STREQ(op_name(Op::kToGrid), "to_grid");
  EXPECT_STREQ(op_name(Op::kFromGrid), "from_grid");
  EXPECT_STREQ(op_name(Op::kFill), "fill");

  // Values over many magnitudes, an odd count (the vector loops' tails).
  const int64_t n = 1001;
  std::vector<float> a = randn(n, 21), b = randn(n, 22);
  for (size_t i = 0; i < a.size(); ++i) a[i] = std::ldexp(a[i], static_cast<int>(i % 40) - 20);
  const auto exponent_of = [&](const std::vector<float>& x, int64_t count) {
    int64_t out = 12345;
    stream->run(call::MaxExponent{TensorRef::of(&out, {1}), TensorRef::of(x.data(), {count})});
    return out;
  };
  EXPECT_EQ(exponent_of(a, n), k::max_exponent(a.data(), n));
  EXPECT_EQ(exponent_of(b, n), k::max_exponent(b.data(), n));
  EXPECT_EQ(exponent_of(a, 0), kFixedPointAllZero) << "no values";
  EXPECT_EQ(exponent_of(std::vector<float>(37, 0.0f), 37), kFixedPointAllZero);
  EXPECT_EQ(exponent_of(std::vector<float>(37, -0.0f), 37), kFixedPointAllZero);
  EXPECT_EQ(exponent_of(std::vector<float>{0.0f, std::numeric_limits<float>::denorm_min()}, 2), -125);
  for (float bad : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<float> x = b;
    x[500] = bad;
    EXPECT_EQ(exponent_of(x, n), kFixedPointNotFinite) << bad;
  }

  // Onto the grid of the larger exponent: written over garbage, then accumulated.
  const int e = std::max(k::max_exponent(a.data(), n), k::max_exponent(b.data(), n));
  const int down = kFixedPointBits - 1 - e;  // two values summed stay below 2^51
  std::vector<int64_t> sum(static_cast<size_t>(n), 777), want(static_cast<size_t>(n), 777);
  stream->run(call::ToGrid{TensorRef::of(sum.data(), {n}), TensorRef::of(a.data(), {n}), down, false});
  k::to_grid(want.data(), a.data(), n, down, false);
  EXPECT_EQ(sum, want) << "written";
  EXPECT_EQ(std::count(sum.begin(), sum.end(), int64_t{777}), 0) << "nothing of the garbage kept";
  stream->run(call::ToGrid{TensorRef::of(sum.data(), {n}), TensorRef::of(b.data(), {n}), down, true});
  k::to_grid(want.data(), b.data(), n, down, true);
  EXPECT_EQ(sum, want) << "accumulated";

  // Back to f32: the grid step over a sample count, as the engine scales it.
  const double factor = std::ldexp(1.0, -down) / 3.0;
  std::vector<float> back(static_cast<size_t>(n), 9.0f), want_back(static_cast<size_t>(n));
  stream->run(call::FromGrid{TensorRef::of(back.data(), {n}), TensorRef::of(sum.data(), {n}), factor});
  k::from_grid(want_back.data(), sum.data(), n, factor);
  EXPECT_TRUE(same_bits(back, want_back));
  EXPECT_NEAR(back[7], (a[7] + b[7]) / 3.0f, 1e-6f * std::abs(a[7] + b[7]) + 1e-30f);

  // A parameter whose gradient held a NaN or an infinity: NaN in every element, the quiet NaN's bits.
  stream->run(call::Fill{TensorRef::of(back.data(), {n}), std::numeric_limits<float>::quiet_NaN()});
  EXPECT_TRUE(same_bits(back, std::vector<float>(static_cast<size_t>(n), std::numeric_limits<float>::quiet_NaN())));
  stream->run(call::Fill{TensorRef::of(back.data(), {3}), -2.5f});
  EXPECT_EQ(back[2], -2.5f);
  EXPECT_TRUE(std::isnan(back[3])) << "only the reference's elements";
}

// The fixed-point calls read contiguous memory of their dtypes: anything else is refused, naming the call, and
// nothing is written.
TEST(KernelCalls, TheFixedPointCallsRefuseStridedAndMistypedArgumentsNamingTheCall) {
  auto stream = cpu_backend().open_stream(Device{});
  std::vector<float> x(6, 1.0f);
  std::vector<int64_t> sum(6, 5);
  std::vector<double> wide(6, 0.0);
  std::vector<int32_t> narrow(6, 0);
  int64_t two[2] = {0, 0};
  const auto refused = [&](const KernelCall& call, Status status, const std::string& want) {
    const std::string e = error_of([&] { stream->run(call); }, status);
    EXPECT_NE(e.find(want), std::string::npos) << e;
  };
  const TensorRef strided_x = TensorRef::of(x.data(), {2, 3}).transposed(0, 1);
  const TensorRef strided_sum = TensorRef::of(sum.data(), {2, 3}).transposed(0, 1);
  refused(call::MaxExponent{TensorRef::of(two, {1}), strided_x}, Status::kInvalidArgument,
          "max_exponent: this kernel reads contiguous memory, got the strided view f32 (3, 2) strides (1, 3)");
  refused(call::MaxExponent{TensorRef::of(narrow.data(), {1}), TensorRef::of(x.data(), {6})},
          Status::kInvalidArgument, "max_exponent: expected i64, got i32");
  refused(call::MaxExponent{TensorRef::of(two, {2}), TensorRef::of(x.data(), {6})}, Status::kInvalidArgument,
          "max_exponent: out holds one exponent, got i64 (2)");
  refused(call::ToGrid{strided_sum, TensorRef::of(x.data(), {3, 2}), 0, false}, Status::kInvalidArgument,
          "to_grid: this kernel reads contiguous memory");
  refused(call::ToGrid{TensorRef::of(wide.data(), {6}), TensorRef::of(x.data(), {6}), 0, false},
          Status::kInvalidArgument, "to_grid: expected i64, got f64");
  refused(call::ToGrid{TensorRef::of(sum.data(), {5}), TensorRef::of(x.data(), {6}), 0, false},
          Status::kInvalidArgument, "to_grid: its arguments differ in element count: i64 (5) and f32 (6)");
  refused(call::FromGrid{strided_x, TensorRef::of(sum.data(), {3, 2}), 1.0}, Status::kInvalidArgument,
          "from_grid: this kernel reads contiguous memory");
  refused(call::FromGrid{TensorRef::of(x.data(), {6}), TensorRef::of(narrow.data(), {6}), 1.0},
          Status::kInvalidArgument, "from_grid: expected i64, got i32");
  refused(call::Fill{strided_x, 0.0f}, Status::kInvalidArgument, "fill: this kernel reads contiguous memory");
  // The f32 side is the call's dtype: another is a kernel the backend does not have.
  refused(call::ToGrid{TensorRef::of(sum.data(), {6}), TensorRef::of(wide.data(), {6}), 0, false},
          Status::kNotSupported, "to_grid (f64) on cpu:0: this backend has no such kernel");
  refused(call::FromGrid{TensorRef::of(wide.data(), {6}), TensorRef::of(sum.data(), {6}), 1.0}, Status::kNotSupported,
          "from_grid (f64) on cpu:0: this backend has no such kernel");
  refused(call::MaxExponent{TensorRef::of(two, {1}), TensorRef::of(wide.data(), {6})}, Status::kNotSupported,
          "max_exponent (f64) on cpu:0: this backend has no such kernel");
  EXPECT_EQ(two[0], 0);
  EXPECT_TRUE(std::all_of(sum.begin(), sum.end(), [](int64_t v) { return v == 5; })) << "nothing written";
  EXPECT_TRUE(std::all_of(x.begin(), x.end(), [](float v) { return v == 1.0f; })) << "nothing written";
}

// SiLU is defined once (kernels/pointwise.h): its Activation number, name and both backends' kernels follow from
// its line in the list. A layer of it runs through the Stream as the four written-out activations do.
TEST(KernelCalls, APointwiseActivationDefinedOnceRunsAsALayer) {
  auto layer = make_activation(Activation::kSilu);
  EXPECT_EQ(layer->describe(), "silu");
  EXPECT_EQ(static_cast<int>(Activation::kSilu), 4);
  auto stream = cpu_backend().open_stream(Device{});
  ReplicaContext ctx;
  ctx.stream = stream.get();
  Tensor x = Tensor::empty(DType::kF32, Shape{3, 4}, Device{}), y = Tensor::empty(DType::kF32, Shape{3, 4}, Device{});
  Tensor dy = Tensor::empty(DType::kF32, Shape{3, 4}, Device{}), dx = Tensor::empty(DType::kF32, Shape{3, 4}, Device{});
  const std::vector<float> xs = randn(12, 5), dys = randn(12, 6);
  x.copy_from_host(xs.data());
  dy.copy_from_host(dys.data());
  layer->forward(ctx, x, y);
  layer->backward(ctx, x, y, dy, dx, false);
  std::vector<float> want_y(12), want_dx(12);
  k::pointwise_forward<kernels::Silu>(want_y.data(), xs.data(), 12);
  k::pointwise_backward<kernels::Silu>(want_dx.data(), dys.data(), xs.data(), nullptr, 12);
  EXPECT_TRUE(same_bits(std::vector<float>(y.f32(), y.f32() + 12), want_y));
  EXPECT_TRUE(same_bits(std::vector<float>(dx.f32(), dx.f32() + 12), want_dx));
  EXPECT_NE(want_y[0], xs[0]);
}

// A linear layer takes (*, C) as nn.Linear does: a sequence's positions are rows. Over (B, T, C) it gives the bits
// of the same layer over the (B*T, C) rows, forward and backward, with a GELU epilogue fused after it.
TEST(KernelCalls, ALinearLayerTakesSequencesAsRows) {
  const auto model = [] {
    Model m(3);
    m.add(make_linear(5, 6, true));
    m.add(make_activation(Activation::kGelu));
    m.add(make_linear(6, 4, true));
    return m;
  };
  const Model seq = model(), rows = model();
  EXPECT_EQ(seq.output_shape(Shape{2, 3, 5}), (Shape{2, 3, 4}));
  auto stream = cpu_backend().open_stream(Device{});
  ReplicaContext ctx;
  ctx.stream = stream.get();
  const std::vector<float> x = randn(30, 11), dy = randn(24, 12);
  std::vector<std::vector<float>> outs, grads;
  for (const auto& [m, in, out] : {std::tuple{&seq, Shape{2, 3, 5}, Shape{2, 3, 4}},
                                   std::tuple{&rows, Shape{6, 5}, Shape{6, 4}}}) {
    ReplicaModel r(*m, ctx);
    EXPECT_EQ(r.num_fused(), 1u);
    Tensor t = Tensor::empty(DType::kF32, in, Device{}), g = Tensor::empty(DType::kF32, out, Device{});
    t.copy_from_host(x.data());
    g.copy_from_host(dy.data());
    const Tensor y = r.forward(ctx, t);
    EXPECT_EQ(y.shape(), out);
    outs.emplace_back(y.f32(), y.f32() + y.numel());
    r.backward(ctx, g, false);
    grads.emplace_back(r.grads(), r.grads() + m->num_param_elements());
  }
  EXPECT_TRUE(same_bits(outs[0], outs[1]));
  EXPECT_TRUE(same_bits(grads[0], grads[1]));
  const std::string e = error_of([&] { seq.output_shape(Shape{2, 3, 4}); }, Status::kInvalidArgument);
  EXPECT_NE(e.find("expects (batch, ..., 5), got (2, 3, 4)"), std::string::npos) << e;
}

// ---- Epilogues: fused where the backend fuses, composed where it does not, the same bits either way ---------------

struct LinearCase {
  int64_t B = 5, C_in = 7, C_out = 6;
  std::vector<float> x = randn(35, 1), w = randn(42, 2), b = randn(6, 3), dy = randn(30, 4);
};

// The kernels one by one: the GEMM, then the activation; backward the activation's, then the GEMMs'.
void linear_then(Activation act, const LinearCase& c, std::vector<float>& out, std::vector<float>& dx,
                 std::vector<float>& dw, std::vector<float>& db) {
  std::vector<float> pre(30), dpre(30);
  out.assign(30, 0.0f), dx.assign(35, 0.0f), dw.assign(42, 0.0f), db.assign(6, 0.0f);
  k::linear_forward(pre.data(), c.x.data(), c.w.data(), c.b.data(), c.B, c.C_in, c.C_out);
  if (act == Activation::kRelu) {
    k::relu_forward(out.data(), pre.data(), 30);
    k::relu_backward(dpre.data(), c.dy.data(), out.data(), 30);
  } else {
    k::gelu_forward(out.data(), pre.data(), 30);
    k::gelu_backward(dpre.data(), c.dy.data(), pre.data(), 30);
  }
  k::linear_backward(dx.data(), dw.data(), db.data(), dpre.data(), c.x.data(), c.w.data(), c.B, c.C_in, c.C_out,
                     false);
}

TEST(KernelCalls, ALinearEpilogueGivesTheBitsOfTheGemmAndTheActivationApart) {
  const LinearCase c;
  auto stream = cpu_backend().open_stream(Device{});
  for (Epilogue e : {Epilogue::kRelu, Epilogue::kGelu}) {
    SCOPED_TRACE(epilogue_name(e));
    std::vector<float> want_out, want_dx, want_dw, want_db;
    linear_then(epilogue_activation(e), c, want_out, want_dx, want_dw, want_db);
    std::vector<float> out(30), pre(30), dpre(30), dx(35), dw(42), db(6);
    const TensorRef pre_ref = e == Epilogue::kGelu ? TensorRef::of(pre.data(), {5, 6}) : TensorRef{};
    stream->run(call::LinearForward{TensorRef::of(out.data(), {5, 6}), TensorRef::of(c.x.data(), {5, 7}),
                                    TensorRef::of(c.w.data(), {6, 7}), TensorRef::of(c.b.data(), {6}), pre_ref, e});
    stream->run(call::LinearBackward{TensorRef::of(dx.data(), {5, 7}), TensorRef::of(dw.data(), {6, 7}),
                                     TensorRef::of(db.data(), {6}), TensorRef::of(dpre.data(), {5, 6}),
                                     TensorRef::of(c.dy.data(), {5, 6}), TensorRef::of(c.x.data(), {5, 7}),
                                     TensorRef::of(c.w.data(), {6, 7}), TensorRef::of(out.data(), {5, 6}), pre_ref, e});
    EXPECT_TRUE(same_bits(out, want_out));
    EXPECT_TRUE(same_bits(dx, want_dx));
    EXPECT_TRUE(same_bits(dw, want_dw));
    EXPECT_TRUE(same_bits(db, want_db));
  }
}

TEST(KernelCalls, BatchNormTakesItsReluInItsOwnPassWithTheSameBits) {
  const int64_t N = 3, C = 4, L = 5;
  const std::vector<float> x = randn(60, 7), w = randn(4, 8), b = randn(4, 9);
  std::vector<double> sums(9), mi(8);
  std::vector<float> rm(4, 0.0f), rv(4, 1.0f);
  k::batchnorm_stats(sums.data(), x.data(), N, C, L);
  k::batchnorm_moments(mi.data(), rm.data(), rv.data(), nullptr, sums.data(), 15.0, C, 1e-5f, 0.1f);
  std::vector<float> plain(60), want(60), fused(60);
  k::batchnorm_apply(plain.data(), x.data(), mi.data(), w.data(), b.data(), N, C, L);
  k::relu_forward(want.data(), plain.data(), 60);
  auto stream = cpu_backend().open_stream(Device{});
  stream->run(call::BatchNormApply{TensorRef::of(fused.data(), {N, C, L}), TensorRef::of(x.data(), {N, C, L}),
                                   TensorRef::of(mi.data(), {8}), TensorRef::of(w.data(), {4}),
                                   TensorRef::of(b.data(), {4}), Epilogue::kRelu});
  EXPECT_TRUE(same_bits(fused, want));
  EXPECT_GT(std::count(fused.begin(), fused.end(), 0.0f), 10) << "the ReLU should cut a good part";
}

// A backend that fuses no epilogue: Stream::run runs the kernel without it, then the activation, in that order,
// on the memory the call names; backward the activation's backward into dpre, then the GEMMs from it.
TEST(KernelCalls, AnEpilogueTheBackendDoesNotFuseIsComposedFromKernelsItHas) {
  test::PartialStream stream([](const KernelKey& key) { return key.epilogue == Epilogue::kNone; });
  float out[6], pre[6], inp[6], w[4], dpre[6], dout[6], dinp[6], dw[4];
  const auto r = [](float* p, std::initializer_list<int64_t> d) { return TensorRef::of(p, d); };
  stream.run(call::LinearForward{r(out, {3, 2}), r(inp, {3, 2}), r(w, {2, 2}), {}, r(pre, {3, 2}), Epilogue::kGelu});
  stream.run(call::LinearBackward{r(dinp, {3, 2}), r(dw, {2, 2}), {}, r(dpre, {3, 2}), r(dout, {3, 2}), r(inp, {3, 2}),
                                  r(w, {2, 2}), r(out, {3, 2}), r(pre, {3, 2}), Epilogue::kGelu});
  stream.run(call::BatchNormApply{r(out, {1, 2, 3}), r(inp, {1, 2, 3}), r(w, {4}), {}, {}, Epilogue::kRelu});
  ASSERT_EQ(stream.ran.size(), 6u);
  const auto& f = std::get<call::LinearForward>(stream.ran[0]);
  EXPECT_EQ(f.out.data, pre) << "the GEMM writes the pre-activation GELU's backward reads";
  EXPECT_EQ(f.epilogue, Epilogue::kNone);
  const auto& a = std::get<call::ActivationForward>(stream.ran[1]);
  EXPECT_EQ(a.kind, Activation::kGelu);
  EXPECT_EQ(a.out.data, out);
  EXPECT_EQ(a.inp.data, pre);
  const auto& ab = std::get<call::ActivationBackward>(stream.ran[2]);
  EXPECT_EQ(ab.dinp.data, dpre);
  EXPECT_EQ(ab.dout.data, dout);
  EXPECT_EQ(ab.inp.data, pre);
  const auto& b = std::get<call::LinearBackward>(stream.ran[3]);
  EXPECT_EQ(b.dout.data, dpre);
  EXPECT_EQ(b.epilogue, Epilogue::kNone);
  EXPECT_EQ(std::get<call::BatchNormApply>(stream.ran[4]).epilogue, Epilogue::kNone);
  const auto& relu = std::get<call::ActivationForward>(stream.ran[5]);
  EXPECT_EQ(relu.kind, Activation::kRelu);
  EXPECT_EQ(relu.out.data, out);
  EXPECT_EQ(relu.inp.data, out) << "in place";
}

TEST(KernelCalls, WithoutTheKernelsOfACompositionTheErrorNamesWhatIsMissing) {
  test::PartialStream stream(
      [](const KernelKey& key) { return key.op == Op::kLinearForward && key.epilogue == Epilogue::kNone; });
  float out[4], inp[4], w[4];
  const std::string e = error_of(
      [&] {
        stream.run(call::LinearForward{TensorRef::of(out, {2, 2}), TensorRef::of(inp, {2, 2}),
                                       TensorRef::of(w, {2, 2}), {}, {}, Epilogue::kRelu});
      },
      Status::kNotSupported);
  EXPECT_NE(e.find("linear_forward (f32, relu epilogue) on cuda:0: this backend has no such kernel and cannot "
                   "compose it (it lacks activation_forward (f32))"),
            std::string::npos)
      << e;
  EXPECT_TRUE(stream.ran.empty()) << "nothing runs when the composition cannot";
  EXPECT_FALSE(stream.can_run({Op::kLinearForward, DType::kF32, Epilogue::kRelu}));
}

// A model asks its replica's stream for every kernel its nodes will run when the replica is made: a device that
// lacks one is named, with the node, before any step.
TEST(KernelCalls, AModelOnADeviceThatLacksAKernelIsRefusedWhenItsReplicaIsMade) {
  Model m(1);
  m.add(make_linear(4, 4, true));
  m.add(make_activation(Activation::kGelu));
  m.add(make_layernorm(4, 1e-5f, true));
  test::PartialStream lacks_layernorm([](const KernelKey& key) {
    return key.op != Op::kLayerNormBackward && key.epilogue == Epilogue::kNone;
  });
  ReplicaContext ctx;
  ctx.stream = &lacks_layernorm;
  const std::string e = error_of([&] { ReplicaModel replica(m, ctx); }, Status::kNotSupported);
  EXPECT_NE(e.find("(layernorm(4))"), std::string::npos) << e;
  EXPECT_NE(e.find("needs the kernel layernorm_backward (f32), which cuda:0's backend does not have"),
            std::string::npos)
      << e;
  // With every kernel but the fused GELU, the model is made: the epilogue is composed.
  test::PartialStream unfused([](const KernelKey& key) { return key.epilogue == Epilogue::kNone; });
  ctx.stream = &unfused;
  ReplicaModel replica(m, ctx);
  EXPECT_EQ(replica.num_fused(), 1u);
}

}  // namespace
}  // namespace dpar
