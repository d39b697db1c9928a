// Mixed precision in f16 (IEEE half) on cuda: the conversions (the CPU's bits, common/f16.h), the f16 linear kernels
// (cublasGemmEx with CUDA_R_16F operands, f32 accumulation), the f16 convolution through cuDNN, and the engine
// training in f16 with dynamic loss scaling, where a planted overflow (an initial scale so large that the gradient
// rounded to f16 is infinite inside the linear layers' backward) is skipped on every replica and backs the scale
// off, after which training proceeds; and two replicas train as one, within f32 summation order.
//
// References, as tests/test_cuda_bf16.cpp's: an f16 product is exact in f32 (11-bit significands), so an f16 GEMM's
// only error is the f32 sum: the reference is the sum in double of the products of the f16-rounded operands, and
// an element may differ from it by 1e-5 of the sum of its terms' magnitudes. The f16 convolution is compared with
// the f32 cuDNN convolution (strict FP32) of the same f16-rounded operands.
//
// Every test here but the first needs a GPU and skips without one (DPAR_REQUIRE_GPU).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/kernel_calls.h"
#include "backend/stream.h"
#include "common/error.h"
#include "common/f16.h"
#include "cuda_test_util.h"
#include "engine/engine.h"
#include "engine_test_util.h"
#include "kernels/cuda/kernels.h"
#include "platform/cuda/cublas_library.h"
#include "platform/cuda/cuda_check.h"

namespace dpar {
namespace {

using test::DeviceBuffer;
using test::on_gpu;
using test::round_f16;
using test::widen_f16;
using test::normalised_error;
using test::random_vector;
using Vec = std::vector<float>;
using Bits = std::vector<uint16_t>;

const Device kGpu{DeviceKind::kCuda, 0};

// ---- No GPU needed --------------------------------------------------------------------------------------------------

// The f16 kernels are compiled in: their argument checks run before any launch.
TEST(CudaF16Library, TheF16KernelsRefuseBadArgumentsWithoutAGpu) {
  EXPECT_NE(cuda::cublas().gemm_ex, nullptr);
  EXPECT_THROW(kernels::cuda::to_f16(nullptr, nullptr, -1, nullptr), Error);
  EXPECT_THROW(kernels::cuda::from_low(DType::kF32, nullptr, nullptr, 1, nullptr), Error);
  EXPECT_THROW(kernels::cuda::linear_forward_mixed(DType::kF32, nullptr, nullptr, nullptr, nullptr, 1, 1, 1, false,
                                                   nullptr, nullptr),
               Error);
}

// ---- Helpers --------------------------------------------------------------------------------------------------------

TensorRef f32_ref(const DeviceBuffer<float>& b, int64_t rows, int64_t cols) {
  return TensorRef::of(b.get(), {rows, cols});
}
// f16 bits held as uint16_t, typed f16.
TensorRef f16_ref(const DeviceBuffer<uint16_t>& b, int64_t rows, int64_t cols) {
  const int64_t dims[2] = {rows, cols};
  return TensorRef::contiguous(b.get(), DType::kF16, dims, 2);
}

::testing::AssertionResult within(const Vec& got, const std::vector<double>& want, const std::vector<double>& scale,
                                  double tol) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << "sizes " << got.size() << " vs " << want.size();
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(err <= tol * scale[i] + 1e-30))
      return ::testing::AssertionFailure() << "element " << i << ": " << got[i] << " vs reference " << want[i]
                                           << " (error " << err << ", allowed " << tol * scale[i] << ")";
  }
  return ::testing::AssertionSuccess();
}

constexpr double kF32Sum = 1e-5;
constexpr double kConvTolerance = 5e-5;  // test_cuda_cudnn.cpp's

class CudaF16 : public ::testing::Test {
 protected:
  void SetUp() override {
    DPAR_REQUIRE_GPU();
    gpu_ = cuda_backend().open_stream(kGpu);
  }
  std::unique_ptr<Stream> gpu_;
};

// ---- Conversions ----------------------------------------------------------------------------------------------------

TEST_F(CudaF16, ConvertGivesTheCpusBitsForEveryF16AndForRoundingCases) {
  Bits all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  Vec floats = widen_f16(all);
  // Ties and their neighbours, subnormals, overflow, NaNs: every f16's midpoint with the next and one float either
  // side, and a million random floats around f16's range.
  for (uint32_t h = 0; h < 0x7bff; ++h) {
    const float v = from_f16(static_cast<uint16_t>(h)), next = from_f16(static_cast<uint16_t>(h + 1));
    const float mid = v + (next - v) / 2;
    for (float f : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f)})
      floats.push_back(f), floats.push_back(-f);
  }
  std::mt19937 gen(7);
  for (int i = 0; i < 1000000; ++i) {
    uint32_t b = gen();
    b = (b & 0x807fffffu) | ((101u + (b >> 23) % 44u) << 23);
    float f;
    std::memcpy(&f, &b, sizeof f);
    floats.push_back(f);
  }
  for (float f : {65520.0f, 65519.996f, 1e30f, std::numeric_limits<float>::infinity(), std::ldexp(1.0f, -25)})
    floats.push_back(f), floats.push_back(-f);
  const int64_t n = static_cast<int64_t>(floats.size());
  auto d_src = on_gpu(floats);
  auto d_low = on_gpu(Bits(floats.size(), 0));
  auto d_back = on_gpu(Vec(floats.size(), 0.0f));
  gpu_->run(call::Convert{TensorRef::contiguous(d_low->get(), DType::kF16, &n, 1), TensorRef::of(d_src->get(), {n})});
  gpu_->run(call::Convert{TensorRef::of(d_back->get(), {n}), TensorRef::contiguous(d_low->get(), DType::kF16, &n, 1)});
  const Bits low = d_low->download();
  EXPECT_EQ(low, round_f16(floats));
  const Vec back = d_back->download();
  const Vec want = widen_f16(low);
  EXPECT_EQ(0, std::memcmp(back.data(), want.data(), back.size() * sizeof(float))) << "from_f16";
}

// ---- Linear ---------------------------------------------------------------------------------------------------------

TEST_F(CudaF16, TheStreamListsTheF16Kernels) {
  for (Op op : {Op::kLinearForward, Op::kLinearBackward}) {
    EXPECT_TRUE(gpu_->supports({op, DType::kF16, Epilogue::kNone}));
    EXPECT_TRUE(gpu_->supports({op, DType::kF16, Epilogue::kRelu}));
    EXPECT_TRUE(gpu_->can_run({op, DType::kF16, Epilogue::kGelu}));  // composed, as bf16's
  }
  EXPECT_TRUE(gpu_->supports({Op::kConvert, DType::kF16, Epilogue::kNone}));
  EXPECT_FALSE(gpu_->supports({Op::kActivationForward, DType::kF16, Epilogue::kNone}));
}

struct LinearCase {
  int64_t B, C_in, C_out;
};
const LinearCase kCases[] = {{1, 1, 1}, {3, 5, 7}, {17, 33, 9}, {64, 784, 256}, {257, 129, 65}, {0, 4, 3}, {4, 0, 3}};

TEST_F(CudaF16, LinearForwardAndBackwardAccumulateExactF16ProductsInF32) {
  uint64_t seed = 1;
  for (const auto& c : kCases) {
    for (Epilogue e : {Epilogue::kNone, Epilogue::kRelu}) {
      SCOPED_TRACE(::testing::Message() << "B " << c.B << " C_in " << c.C_in << " C_out " << c.C_out << " "
                                        << epilogue_name(e));
      const size_t nx = static_cast<size_t>(c.B * c.C_in), nw = static_cast<size_t>(c.C_out * c.C_in),
                   ny = static_cast<size_t>(c.B * c.C_out), nb = static_cast<size_t>(c.C_out);
      const Bits x = round_f16(random_vector(nx, seed++)), w = round_f16(random_vector(nw, seed++));
      const Vec b = random_vector(nb, seed++), dy = random_vector(ny, seed++);
      const Vec xw = widen_f16(x), ww = widen_f16(w);
      // Forward: out = act(x @ w^T + b).
      std::vector<double> want(ny, 0.0), mag(ny, 0.0);
      for (int64_t r = 0; r < c.B; ++r)
        for (int64_t j = 0; j < c.C_out; ++j) {
          double s = b[static_cast<size_t>(j)], m = std::fabs(s);
          for (int64_t i = 0; i < c.C_in; ++i) {
            const double t = static_cast<double>(xw[static_cast<size_t>(r * c.C_in + i)]) *
                             ww[static_cast<size_t>(j * c.C_in + i)];
            s += t, m += std::fabs(t);
          }
          want[static_cast<size_t>(r * c.C_out + j)] = e == Epilogue::kRelu && s < 0 ? 0.0 : s;
          mag[static_cast<size_t>(r * c.C_out + j)] = m + 1e-6;
        }
      auto dx = on_gpu(x), dw = on_gpu(w);
      auto db = on_gpu(b), d_out = on_gpu(Vec(ny, NAN));
      call::LinearForward f;
      f.out = f32_ref(*d_out, c.B, c.C_out), f.inp = f16_ref(*dx, c.B, c.C_in);
      f.weight = f16_ref(*dw, c.C_out, c.C_in);
      f.bias = TensorRef::of(db->get(), {c.C_out}), f.epilogue = e;
      ASSERT_EQ(f.dtype(), DType::kF16);
      gpu_->run(f);
      const Vec out = d_out->download();
      EXPECT_TRUE(within(out, want, mag, kF32Sum)) << "out";

      // Backward from dy: the gradient before the GEMMs (dy, or ReLU's backward of it) rounded to f16 once.
      auto d_dy = on_gpu(dy), d_dinp = on_gpu(Vec(nx, NAN)), d_dw = on_gpu(Vec(nw, NAN)), d_db = on_gpu(Vec(nb, NAN));
      auto d_dpre = on_gpu(Vec(ny, NAN));
      auto d_low = on_gpu(Bits(ny, 0xffff));
      call::LinearBackward g;
      g.dinp = f32_ref(*d_dinp, c.B, c.C_in), g.dweight = f32_ref(*d_dw, c.C_out, c.C_in);
      g.dbias = TensorRef::of(d_db->get(), {c.C_out}), g.dout = f32_ref(*d_dy, c.B, c.C_out);
      g.inp = f16_ref(*dx, c.B, c.C_in), g.weight = f16_ref(*dw, c.C_out, c.C_in);
      g.dout_low = f16_ref(*d_low, c.B, c.C_out), g.epilogue = e;
      if (e == Epilogue::kRelu) g.dpre = f32_ref(*d_dpre, c.B, c.C_out), g.out = f32_ref(*d_out, c.B, c.C_out);
      gpu_->run(g);
      Vec grad = dy;
      if (e == Epilogue::kRelu)
        for (size_t i = 0; i < ny; ++i) grad[i] = out[i] <= 0.0f ? 0.0f : dy[i];
      EXPECT_EQ(d_low->download(), round_f16(grad)) << "dout_low: the gradient rounded to f16";
      const Vec lw = widen_f16(round_f16(grad));
      std::vector<double> wi(nx, 0.0), mi(nx, 0.0), ww_(nw, 0.0), mw(nw, 0.0), wb(nb, 0.0), mb(nb, 0.0);
      for (int64_t r = 0; r < c.B; ++r)
        for (int64_t j = 0; j < c.C_out; ++j) {
          const double gl = lw[static_cast<size_t>(r * c.C_out + j)];
          for (int64_t i = 0; i < c.C_in; ++i) {
            const double ti = gl * ww[static_cast<size_t>(j * c.C_in + i)];
            wi[static_cast<size_t>(r * c.C_in + i)] += ti, mi[static_cast<size_t>(r * c.C_in + i)] += std::fabs(ti);
            const double tw = gl * xw[static_cast<size_t>(r * c.C_in + i)];
            ww_[static_cast<size_t>(j * c.C_in + i)] += tw, mw[static_cast<size_t>(j * c.C_in + i)] += std::fabs(tw);
          }
          const double tb = grad[static_cast<size_t>(r * c.C_out + j)];  // the bias's from the f32 gradient
          wb[static_cast<size_t>(j)] += tb, mb[static_cast<size_t>(j)] += std::fabs(tb);
        }
      EXPECT_TRUE(within(d_dinp->download(), wi, mi, kF32Sum)) << "dinp";
      EXPECT_TRUE(within(d_dw->download(), ww_, mw, kF32Sum)) << "dweight";
      EXPECT_TRUE(within(d_db->download(), wb, mb, kF32Sum)) << "dbias";
    }
  }
}

// A gradient beyond f16's range becomes infinite in dout_low, and the GEMMs carry it into dinp and dweight (what
// loss scaling detects); the bias gradient, summed from the f32 gradient, stays finite.
TEST_F(CudaF16, AGradientBeyondF16sRangeOverflowsToInfinityInTheGemms) {
  const int64_t B = 4, C = 8;
  const size_t n = static_cast<size_t>(B * C);
  const Bits x = round_f16(random_vector(n, 3)), w = round_f16(random_vector(n, 4));
  Vec dy = random_vector(n, 5);
  dy[5] = 1e6f;
  auto dx = on_gpu(x), dw = on_gpu(w), d_low = on_gpu(Bits(n));
  auto d_dy = on_gpu(dy);
  auto d_dinp = on_gpu(Vec(n, 0.0f)), d_dw = on_gpu(Vec(n, 0.0f)), d_db = on_gpu(Vec(static_cast<size_t>(C), 0.0f));
  call::LinearBackward g;
  g.dinp = f32_ref(*d_dinp, B, C), g.dweight = f32_ref(*d_dw, C, C), g.dbias = TensorRef::of(d_db->get(), {C});
  g.dout = f32_ref(*d_dy, B, C), g.inp = f16_ref(*dx, B, C), g.weight = f16_ref(*dw, C, C);
  g.dout_low = f16_ref(*d_low, B, C);
  gpu_->run(g);
  EXPECT_EQ(d_low->download()[5], 0x7c00) << "1e6 rounds to +inf in f16";
  bool inf_in_dinp = false, inf_in_dw = false;
  for (float v : d_dinp->download()) inf_in_dinp = inf_in_dinp || !std::isfinite(v);
  for (float v : d_dw->download()) inf_in_dw = inf_in_dw || !std::isfinite(v);
  EXPECT_TRUE(inf_in_dinp);
  EXPECT_TRUE(inf_in_dw);
  for (float v : d_db->download()) EXPECT_TRUE(std::isfinite(v));
}

// ---- Convolution ----------------------------------------------------------------------------------------------------

TEST_F(CudaF16, ConvolutionInF16MatchesTheF32ConvolutionOfTheRoundedOperands) {
  Conv2dSpec s;
  s.in_channels = 8, s.out_channels = 16, s.kernel_h = s.kernel_w = 3, s.pad_h = s.pad_w = 1;
  const int64_t N = 3, H = 11, W = 9, OH = s.out_h(H), OW = s.out_w(W);
  Conv2dSpec s16 = s;
  s16.dtype = DType::kF16;
  std::unique_ptr<Conv2dOp> op16, op32;
  try {
    op16 = gpu_->make_conv2d(s16);
    op32 = gpu_->make_conv2d(s);
  } catch (const Error& e) {
    if (e.status() == Status::kNotSupported && !test::gpu_required()) GTEST_SKIP() << e.what();
    throw;
  }
  const size_t nx = static_cast<size_t>(N * 8 * H * W), nw = 16 * 8 * 9, ny = static_cast<size_t>(N * 16 * OH * OW);
  const Vec x = random_vector(nx, 11), w = random_vector(nw, 12), b = random_vector(16, 13), dy = random_vector(ny, 14);
  const int64_t xd[4] = {N, 8, H, W}, wd[4] = {16, 8, 3, 3}, yd[4] = {N, 16, OH, OW};
  auto x16 = on_gpu(round_f16(x)), w16 = on_gpu(round_f16(w));
  auto x32 = on_gpu(widen_f16(round_f16(x))), w32 = on_gpu(widen_f16(round_f16(w)));
  auto d_b = on_gpu(b), d_dy = on_gpu(dy), d_dyr = on_gpu(widen_f16(round_f16(dy)));
  struct Out {
    Vec y, dx, dw, db;
  };
  auto run = [&](Conv2dOp& op, bool low) {
    auto y = on_gpu(Vec(ny, NAN)), dx = on_gpu(Vec(nx, NAN)), dwt = on_gpu(Vec(nw, NAN)), db = on_gpu(Vec(16, NAN));
    const TensorRef xin = low ? TensorRef::contiguous(x16->get(), DType::kF16, xd, 4)
                              : TensorRef::contiguous(x32->get(), DType::kF32, xd, 4);
    const TensorRef win = low ? TensorRef::contiguous(w16->get(), DType::kF16, wd, 4)
                              : TensorRef::contiguous(w32->get(), DType::kF32, wd, 4);
    // The f16 op rounds the f32 gradient itself; the reference is given it rounded.
    const TensorRef g = TensorRef::contiguous(low ? d_dy->get() : d_dyr->get(), DType::kF32, yd, 4);
    op.forward(TensorRef::contiguous(y->get(), DType::kF32, yd, 4), xin, win, TensorRef::of(d_b->get(), {16}));
    op.backward_data(TensorRef::contiguous(dx->get(), DType::kF32, xd, 4), g, win);
    op.backward_weights(TensorRef::contiguous(dwt->get(), DType::kF32, wd, 4), TensorRef::of(db->get(), {16}), g, xin,
                        false);
    return Out{y->download(), dx->download(), dwt->download(), db->download()};
  };
  const Out got = run(*op16, true), ref = run(*op32, false);
  EXPECT_LT(normalised_error(got.y, ref.y), kConvTolerance) << "forward";
  EXPECT_LT(normalised_error(got.dx, ref.dx), kConvTolerance) << "backward_data";
  EXPECT_LT(normalised_error(got.dw, ref.dw), kConvTolerance) << "backward_weights";
  EXPECT_LT(normalised_error(got.db, ref.db), kConvTolerance) << "dbias";
}

// ---- The engine in f16 with loss scaling ----------------------------------------------------------------------------

constexpr int64_t kIn = 12, kHidden = 32, kClasses = 5;

Model mlp() {
  Model m(21);
  m.add(make_linear(kIn, kHidden, true));
  m.add(make_activation(Activation::kRelu));
  m.add(make_linear(kHidden, kClasses, true));
  return m;
}

OptimizerConfig adam() {
  OptimizerConfig c;
  c.kind = OptimizerKind::kAdam;
  c.lr = 1e-2f;
  return c;
}

EngineConfig gpus(size_t n) {
  EngineConfig c;
  for (size_t i = 0; i < n; ++i) c.devices.push_back(Device{DeviceKind::kCuda, 0});  // replicas may share a GPU
  c.timeout_seconds = 60;
  return c;
}

struct Batch {
  Tensor x, y;
};
Batch batch(uint32_t seed, int64_t rows = 32) {
  Batch b{test::host_tensor(test::randn(static_cast<size_t>(rows * kIn), seed), Shape{rows, kIn}),
          Tensor::empty(DType::kI32, Shape{rows}, Device{})};
  for (int64_t i = 0; i < rows; ++i) b.y.i32()[i] = static_cast<int32_t>((seed + 3 * i) % kClasses);
  return b;
}

// 2^40 times a gradient of order 1e-2 is about 1e10: finite in f32, infinite once rounded to f16 (above 65504) in
// the linear layers' backward. Every replica skips the step (parameters, Adam's state and the step count as they
// were), the scale halves, until it is small enough (about 2^22 here); then training proceeds, and the loss falls.
// The same scale in f32 compute overflows nothing: the overflow is f16's.
TEST(CudaF16Engine, AnF16OverflowSkipsTheStepOnEveryReplicaAndTheScaleBacksOff) {
  DPAR_REQUIRE_GPU();
  const float huge = std::ldexp(1.0f, 40);
  LossScaling scaling;
  scaling.init_scale = huge;
  {
    Engine f32(mlp(), adam(), gpus(2));
    f32.set_loss_scaling(scaling);
    const Batch b = batch(1);
    f32.train_step(b.x, b.y);
    EXPECT_FALSE(f32.loss_scaler().last_step_skipped()) << "2^40 overflows nothing in f32";
  }
  Engine e(mlp(), adam(), gpus(2));
  e.set_compute_dtype(DType::kF16);
  ASSERT_EQ(e.compute_dtype(), DType::kF16);
  e.set_loss_scaling(scaling);
  int skipped = 0;
  uint32_t s = 0;
  for (; s < 60; ++s) {
    std::vector<std::vector<float>> before;
    for (size_t r = 0; r < e.num_replicas(); ++r) before.push_back(e.params(r));
    const int64_t steps = e.step_count();
    const float scale = e.loss_scaler().scale();
    const Batch b = batch(100 + s);
    EXPECT_TRUE(std::isfinite(e.train_step(b.x, b.y))) << "the loss is reported unscaled";
    if (!e.loss_scaler().last_step_skipped()) break;
    ++skipped;
    for (size_t r = 0; r < e.num_replicas(); ++r)
      EXPECT_EQ(e.params(r), before[r]) << "replica " << r << ", step " << s;
    EXPECT_EQ(e.step_count(), steps);
    EXPECT_EQ(e.loss_scaler().scale(), scale * 0.5f);
  }
  ASSERT_GE(skipped, 2) << "the planted overflow did not overflow";
  ASSERT_LT(s, 60u) << "training never proceeded";
  EXPECT_LT(e.loss_scaler().scale(), 65504.0f * 1024.0f);
  EXPECT_EQ(e.params(0), e.params(1));
  // Training proceeds: the loss on a fixed batch falls.
  const Batch fixed = batch(7);
  const double first = e.train_step(fixed.x, fixed.y);
  double last = first;
  for (int t = 0; t < 30; ++t) last = e.train_step(fixed.x, fixed.y);
  EXPECT_LT(last, first);
  for (float v : e.params(0)) ASSERT_TRUE(std::isfinite(v));
}

// Two replicas in f16 train as one (the same global batch): the same f16 roundings of the same values, the sums in
// another order.
TEST(CudaF16Engine, TwoReplicasTrainAsOneWithinF32SummationOrder) {
  DPAR_REQUIRE_GPU();
  Engine one(mlp(), adam(), gpus(1)), two(mlp(), adam(), gpus(2));
  LossScaling scaling;
  scaling.init_scale = 1024.0f;
  for (Engine* e : {&one, &two}) {
    e->set_compute_dtype(DType::kF16);
    e->set_loss_scaling(scaling);
  }
  for (uint32_t s = 0; s < 5; ++s) {
    const Batch b = batch(300 + s);
    const double l1 = one.train_step(b.x, b.y), l2 = two.train_step(b.x, b.y);
    EXPECT_NEAR(l1, l2, 1e-3 * std::fabs(l1)) << "step " << s;
  }
  EXPECT_FALSE(one.loss_scaler().last_step_skipped());
  // Adam's first steps move each parameter by about lr whatever the gradient's size, so an f32 difference in a sum
  // can move an f16 rounding of the next forward's operands by one f16 ulp (2^-11 relative): within 1e-3.
  EXPECT_LT(test::max_relative_error(two.params(0), one.params(0)), 1e-3);
  EXPECT_LT(test::max_relative_error(two.params(1), one.params(0)), 1e-3);
}

}  // namespace
}  // namespace dpar
