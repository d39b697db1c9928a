// The CPU's mixed-precision kernels (backend/kernel_calls.h's LinearForward and LinearBackward in bf16, Conv2dSpec's
// dtype bf16), through a CPU stream as a layer calls them. The products of bf16 values are exact in f32, so a bf16
// kernel must equal, up to f32 accumulation's rounding, the exact result on the bf16-rounded operands: the linear
// against a double-precision sum of those, the convolution against the f32 op run on them; the tolerance is a
// small multiple of f32's epsilon times the sum of the terms' magnitudes, not bf16's 1e-2. Where oneDNN has no
// native bf16 on this CPU (kernels::cpu::bf16_support), each test skips with the reason.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "common/bf16.h"
#include "common/error.h"
#include "kernels/cpu/dnnl_ops.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/kernels.h"
#include "op_calls.h"

namespace dpar {
namespace {

namespace k = kernels::cpu;
using Vec = std::vector<float>;
using Bits = std::vector<uint16_t>;

// f32 accumulation of n exact products: each addition rounds once, so the error is within a few units of f32's
// epsilon (6e-8) times the sum of the magnitudes for any order oneDNN picks.
constexpr double kAccumulation = 1e-5;

#define SKIP_WITHOUT_BF16()                            \
  do {                                                 \
    const char* why = "";                              \
    if (!k::bf16_support(&why)) GTEST_SKIP() << why;   \
  } while (0)

Vec randn(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  Vec v(n);
  for (float& x : v) x = normal(gen) * scale;
  return v;
}

Bits to_bits(const Vec& v) {
  Bits b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = to_bf16(v[i]);
  return b;
}
Vec from_bits(const Bits& b) {
  Vec v(b.size());
  for (size_t i = 0; i < b.size(); ++i) v[i] = from_bf16(b[i]);
  return v;
}
Vec abs_of(const Vec& v) {
  Vec a(v.size());
  for (size_t i = 0; i < v.size(); ++i) a[i] = std::fabs(v[i]);
  return a;
}

TensorRef ref(const float* p, const std::vector<int64_t>& dims) {
  return TensorRef::contiguous(const_cast<float*>(p), DType::kF32, dims.data(), static_cast<int>(dims.size()));
}
TensorRef ref(const uint16_t* p, const std::vector<int64_t>& dims) {
  return TensorRef::contiguous(const_cast<uint16_t*>(p), DType::kBF16, dims.data(), static_cast<int>(dims.size()));
}

double gelu_ref(double x) { return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))); }
double gelu_grad_ref(double x) {
  return 0.5 * (1.0 + std::erf(x / std::sqrt(2.0))) + x * std::exp(-0.5 * x * x) / std::sqrt(2.0 * M_PI);
}

// ---- Linear ----------------------------------------------------------------------------------------------------

struct LinearCase {
  std::vector<int64_t> lead;  // the input's leading extents: (B) or (B, T)
  int64_t C_in, C_out;
  Epilogue epilogue;
  bool accumulate;
  bool bias = true;
};

std::string case_name(const LinearCase& c) {
  std::string s;
  for (int64_t d : c.lead) s += std::to_string(d) + "x";
  return s + std::to_string(c.C_in) + "->" + std::to_string(c.C_out) + " " + epilogue_name(c.epilogue) +
         (c.accumulate ? " accumulate" : "") + (c.bias ? "" : " no bias");
}

void check_linear(const LinearCase& c, uint32_t seed) {
  SCOPED_TRACE(case_name(c));
  int64_t B = 1;
  for (int64_t d : c.lead) B *= d;
  const int64_t Ci = c.C_in, Co = c.C_out;
  auto dims = [&](int64_t last) {
    std::vector<int64_t> d = c.lead;
    d.push_back(last);
    return d;
  };
  const Bits x = to_bits(randn(static_cast<size_t>(B * Ci), seed));
  const Bits w = to_bits(randn(static_cast<size_t>(Co * Ci), seed + 1, 0.1f));
  const Vec xf = from_bits(x), wf = from_bits(w);
  const Vec bias = randn(static_cast<size_t>(Co), seed + 2, 0.5f);
  const Vec dout = randn(static_cast<size_t>(B * Co), seed + 3);
  const Vec dweight0 = randn(static_cast<size_t>(Co * Ci), seed + 4);
  const Vec dbias0 = randn(static_cast<size_t>(Co), seed + 5);
  const bool gelu = c.epilogue == Epilogue::kGelu, relu = c.epilogue == Epilogue::kRelu;

  auto stream = cpu_backend().open_stream(Device{});
  Vec out(static_cast<size_t>(B * Co), NAN), pre(gelu ? static_cast<size_t>(B * Co) : 0, NAN);
  call::LinearForward f;
  f.out = ref(out.data(), dims(Co));
  f.inp = ref(x.data(), dims(Ci));
  f.weight = ref(w.data(), {Co, Ci});
  if (c.bias) f.bias = ref(bias.data(), {Co});
  if (gelu) f.pre = ref(pre.data(), dims(Co));
  f.epilogue = c.epilogue;
  stream->run(f);

  // Forward: the exact sum on the bf16 values, then the bias and the epilogue.
  for (int64_t i = 0; i < B; ++i)
    for (int64_t j = 0; j < Co; ++j) {
      double z = 0, mag = 0;
      for (int64_t kk = 0; kk < Ci; ++kk) {
        const double t = static_cast<double>(xf[i * Ci + kk]) * wf[j * Ci + kk];
        z += t, mag += std::fabs(t);
      }
      const double b = c.bias ? bias[j] : 0.0;
      const double tol = kAccumulation * (mag + std::fabs(b)) + 1e-30;
      const double y = z + b;
      const size_t at = static_cast<size_t>(i * Co + j);
      if (gelu) {
        ASSERT_NEAR(pre[at], y, tol) << "pre " << i << "," << j;
        ASSERT_NEAR(out[at], gelu_ref(y), 1.2 * tol + 1e-6 * std::fabs(y)) << "out " << i << "," << j;
      } else {
        ASSERT_NEAR(out[at], relu ? std::max(y, 0.0) : y, tol) << "out " << i << "," << j;
      }
    }
  if (gelu) {  // the f32 kernel's GELU on the f32 result: what composing the two kernels gives, bit for bit
    Vec composed(out.size());
    k::gelu_forward(composed.data(), pre.data(), static_cast<int64_t>(pre.size()));
    for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], composed[i]) << i;
  }

  // Backward.
  Vec dinp(static_cast<size_t>(B * Ci), NAN), dweight = dweight0, dbias = dbias0;
  if (!c.accumulate) std::fill(dweight.begin(), dweight.end(), NAN), std::fill(dbias.begin(), dbias.end(), NAN);
  Vec dpre(c.epilogue == Epilogue::kNone ? 0 : static_cast<size_t>(B * Co), NAN);
  Bits dout_low(static_cast<size_t>(B * Co), 0xffff);
  call::LinearBackward bw;
  bw.dinp = ref(dinp.data(), dims(Ci));
  bw.dweight = ref(dweight.data(), {Co, Ci});
  if (c.bias) bw.dbias = ref(dbias.data(), {Co});
  if (!dpre.empty()) bw.dpre = ref(dpre.data(), dims(Co));
  bw.dout = ref(dout.data(), dims(Co));
  bw.inp = f.inp;
  bw.weight = f.weight;
  bw.out = f.out;
  if (gelu) bw.pre = f.pre;
  bw.epilogue = c.epilogue;
  bw.accumulate = c.accumulate;
  bw.dout_low = ref(dout_low.data(), dims(Co));
  stream->run(bw);

  // The gradient before the GEMMs: dout, its ReLU mask (exact), or GELU's backward; dout_low its bf16 rounding.
  const Vec& g = c.epilogue == Epilogue::kNone ? dout : dpre;
  for (size_t i = 0; i < dout.size(); ++i) {
    if (relu) ASSERT_EQ(dpre[i], out[i] <= 0.0f ? 0.0f : dout[i]) << i;
    if (gelu) ASSERT_NEAR(dpre[i], dout[i] * gelu_grad_ref(pre[i]), 1e-6 * std::fabs(dout[i]) + 1e-30) << i;
    ASSERT_EQ(dout_low[i], to_bf16(g[i])) << "dout_low " << i;
  }
  const Vec gl = from_bits(dout_low);
  for (int64_t i = 0; i < B; ++i)
    for (int64_t kk = 0; kk < Ci; ++kk) {
      double z = 0, mag = 0;
      for (int64_t j = 0; j < Co; ++j) {
        const double t = static_cast<double>(gl[i * Co + j]) * wf[j * Ci + kk];
        z += t, mag += std::fabs(t);
      }
      ASSERT_NEAR(dinp[i * Ci + kk], z, kAccumulation * mag + 1e-30) << "dinp " << i << "," << kk;
    }
  for (int64_t j = 0; j < Co; ++j) {
    for (int64_t kk = 0; kk < Ci; ++kk) {
      double z = c.accumulate ? dweight0[j * Ci + kk] : 0.0, mag = std::fabs(z);
      for (int64_t i = 0; i < B; ++i) {
        const double t = static_cast<double>(gl[i * Co + j]) * xf[i * Ci + kk];
        z += t, mag += std::fabs(t);
      }
      ASSERT_NEAR(dweight[j * Ci + kk], z, kAccumulation * mag + 1e-30) << "dweight " << j << "," << kk;
    }
    if (!c.bias) continue;
    // dbias: the f32 gradient's column sums (not dout_low's), in double, rounded once, then added.
    double s = 0, mag = 0;
    for (int64_t i = 0; i < B; ++i) s += g[i * Co + j], mag += std::fabs(g[i * Co + j]);
    const double expected = c.accumulate ? dbias0[j] + s : s;
    ASSERT_NEAR(dbias[j], expected, 1e-6 * (mag + std::fabs(dbias0[j])) + 1e-30) << "dbias " << j;
  }
}

TEST(Bf16Linear, MatchesExactProductsOfTheRoundedOperands) {
  SKIP_WITHOUT_BF16();
  uint32_t seed = 10;
  for (Epilogue e : {Epilogue::kNone, Epilogue::kRelu, Epilogue::kGelu})
    for (bool acc : {false, true}) {
      check_linear({{5}, 7, 3, e, acc}, seed++);
      check_linear({{2, 3}, 7, 5, e, acc}, seed++);
      check_linear({{4, 3}, 33, 17, e, acc, false}, seed++);
    }
}

TEST(Bf16Linear, LargeShape) {
  SKIP_WITHOUT_BF16();
  check_linear({{512}, 784, 256, Epilogue::kNone, false}, 100);
  check_linear({{512}, 784, 256, Epilogue::kRelu, true}, 101);
}

TEST(Bf16Linear, EmptyExtents) {
  SKIP_WITHOUT_BF16();
  auto stream = cpu_backend().open_stream(Device{});
  // No input features: out is the bias; no rows: dweight and dbias are zeros.
  const Vec bias = {1.0f, -2.0f};
  Bits x(3 * 1), w(2 * 1);
  Vec out(3 * 2, NAN);
  call::LinearForward f;
  f.out = ref(out.data(), {3, 2});
  f.inp = ref(x.data(), {3, 0});
  f.weight = ref(w.data(), {2, 0});
  f.bias = ref(bias.data(), {2});
  stream->run(f);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(out[i * 2], 1.0f);
    EXPECT_EQ(out[i * 2 + 1], -2.0f);
  }

  Vec dweight(2 * 4, NAN), dbias(2, NAN);
  Bits xi(1), dl(1);
  Vec dout(1), wf(1);
  Bits w4(2 * 4);
  call::LinearBackward b;
  b.dweight = ref(dweight.data(), {2, 4});
  b.dbias = ref(dbias.data(), {2});
  b.dout = ref(dout.data(), {0, 2});
  b.inp = ref(xi.data(), {0, 4});
  b.weight = ref(w4.data(), {2, 4});
  b.dout_low = ref(dl.data(), {0, 2});
  stream->run(b);
  for (float v : dweight) EXPECT_EQ(v, 0.0f);
  for (float v : dbias) EXPECT_EQ(v, 0.0f);
}

// The output kept in bf16 (LinearForward's "out rounded"): the f32 kernel's result, bias and ReLU included, rounded
// once; and backward's ReLU mask read from that rounded output gives the f32 output's gradients bit for bit (a
// rounded value keeps its sign; none of these outputs is below bf16's least subnormal).
TEST(Bf16Linear, RoundedOutputIsTheF32ResultRoundedOnce) {
  SKIP_WITHOUT_BF16();
  auto stream = cpu_backend().open_stream(Device{});
  const int64_t B = 37, C_in = 70, C_out = 45;
  uint32_t seed = 300;
  for (Epilogue e : {Epilogue::kNone, Epilogue::kRelu})
    for (bool bias : {true, false}) {
      SCOPED_TRACE(std::string(epilogue_name(e)) + (bias ? ", bias" : ", no bias"));
      const Bits x = to_bits(randn(static_cast<size_t>(B * C_in), seed++));
      const Bits w = to_bits(randn(static_cast<size_t>(C_out * C_in), seed++, 0.2f));
      const Vec b = randn(static_cast<size_t>(C_out), seed++);
      Vec out(static_cast<size_t>(B * C_out));
      Bits rounded(out.size(), 0xFFFF);
      call::LinearForward f{ref(out.data(), {B, C_out}), ref(x.data(), {B, C_in}), ref(w.data(), {C_out, C_in}),
                            bias ? ref(b.data(), {C_out}) : TensorRef{}, {}, e};
      stream->run(f);
      f.out = ref(rounded.data(), {B, C_out});
      ASSERT_TRUE(stream->can_run(key_of(f))) << key_of(f).str();
      stream->run(f);
      size_t off_by_one = 0;
      for (size_t i = 0; i < out.size(); ++i) {
        // oneDNN's bf16 destination may sum the same products in another order than its f32 one: equal, or the
        // neighbouring bf16 value where the f32 sums straddle a rounding boundary.
        const int diff = std::abs(static_cast<int>(rounded[i]) - static_cast<int>(to_bf16(out[i])));
        ASSERT_LE(diff, 1) << "element " << i << ": " << out[i] << " rounded to " << from_bf16(rounded[i]);
        off_by_one += diff;
      }
      EXPECT_LE(off_by_one, out.size() / 50) << "more than 2% of the elements one bf16 step away";
      if (e != Epilogue::kRelu) continue;
      // Backward from the rounded output's mask against the f32 output's: the same bits.
      const Vec dout = randn(out.size(), seed++);
      Vec dinp_a(static_cast<size_t>(B * C_in)), dinp_b(dinp_a.size()), dw_a(w.size()), dw_b(w.size());
      Vec db_a(b.size()), db_b(b.size()), dpre(out.size());
      Bits dout_low(out.size());
      Vec out_of_rounded = from_bits(rounded);
      call::LinearBackward g{ref(dinp_a.data(), {B, C_in}), ref(dw_a.data(), {C_out, C_in}), ref(db_a.data(), {C_out}),
                             ref(dpre.data(), {B, C_out}), ref(dout.data(), {B, C_out}), ref(x.data(), {B, C_in}),
                             ref(w.data(), {C_out, C_in}), ref(out_of_rounded.data(), {B, C_out}), {}, e, false};
      g.dout_low = ref(dout_low.data(), {B, C_out});
      stream->run(g);
      g.dinp = ref(dinp_b.data(), {B, C_in});
      g.dweight = ref(dw_b.data(), {C_out, C_in});
      g.dbias = ref(db_b.data(), {C_out});
      g.out = ref(rounded.data(), {B, C_out});
      ASSERT_TRUE(stream->can_run(key_of(g))) << key_of(g).str();
      stream->run(g);
      EXPECT_EQ(dinp_a, dinp_b);
      EXPECT_EQ(dw_a, dw_b);
      EXPECT_EQ(db_a, db_b);
    }
  // No f32 kernel writes a rounded output, and no composition stands in.
  EXPECT_FALSE(stream->can_run({Op::kLinearForward, DType::kF32, Epilogue::kNone, DType::kBF16}));
  EXPECT_FALSE(stream->can_run({Op::kLinearForward, DType::kF32, Epilogue::kGelu, DType::kBF16}));
  EXPECT_EQ(KernelKey({Op::kLinearForward, DType::kBF16, Epilogue::kRelu, DType::kBF16}).str(),
            "linear_forward (bf16, relu epilogue, bf16 out)");
}

// A GELU epilogue with the output kept in bf16, as autocast runs a bf16 linear and then GELU: the pre-activation is
// the f32 result with the bias rounded once (kept, rounded, for backward), the output is GELU of that rounded value
// (in f32) rounded once; backward reads the rounded pre-activation and gives what the f32-output kernel gives when
// fed the same values in f32, bit for bit, and GELU's exact derivative within f32's rounding.
TEST(Bf16Linear, RoundedGeluOutputRunsOnTheRoundedPreActivation) {
  SKIP_WITHOUT_BF16();
  auto stream = cpu_backend().open_stream(Device{});
  const int64_t B = 29, C_in = 66, C_out = 53;
  uint32_t seed = 400;
  for (bool bias : {true, false}) {
    SCOPED_TRACE(bias ? "bias" : "no bias");
    const Bits x = to_bits(randn(static_cast<size_t>(B * C_in), seed++));
    const Bits w = to_bits(randn(static_cast<size_t>(C_out * C_in), seed++, 0.2f));
    const Vec b = randn(static_cast<size_t>(C_out), seed++);
    const size_t n = static_cast<size_t>(B * C_out);
    Vec out_f32(n), pre_f32(n);
    Bits out(n, 0xFFFF), pre(n, 0xFFFF);
    call::LinearForward f{ref(out_f32.data(), {B, C_out}), ref(x.data(), {B, C_in}), ref(w.data(), {C_out, C_in}),
                          bias ? ref(b.data(), {C_out}) : TensorRef{}, ref(pre_f32.data(), {B, C_out}),
                          Epilogue::kGelu};
    stream->run(f);
    f.out = ref(out.data(), {B, C_out});
    f.pre = ref(pre.data(), {B, C_out});
    ASSERT_TRUE(stream->can_run(key_of(f))) << key_of(f).str();
    stream->run(f);
    Vec pre_widened = from_bits(pre), gelu_of_rounded(n);
    k::gelu_forward(gelu_of_rounded.data(), pre_widened.data(), static_cast<int64_t>(n));
    size_t off_by_one = 0;
    for (size_t i = 0; i < n; ++i) {
      const int diff = std::abs(static_cast<int>(pre[i]) - static_cast<int>(to_bf16(pre_f32[i])));
      ASSERT_LE(diff, 1) << "pre-activation " << i << ": " << pre_f32[i] << " rounded to " << from_bf16(pre[i]);
      off_by_one += diff;
      ASSERT_EQ(out[i], to_bf16(gelu_of_rounded[i])) << "element " << i;
      ASSERT_NEAR(from_bf16(out[i]), gelu_ref(pre_widened[i]), 1e-2 * std::fabs(gelu_ref(pre_widened[i])) + 1e-6)
          << "element " << i;
    }
    EXPECT_LE(off_by_one, n / 50) << "more than 2% of the pre-activations one bf16 step away";

    // Backward from the rounded pre-activation against the f32 kernel's from its widened values.
    const Vec dout = randn(n, seed++);
    Vec dinp_a(static_cast<size_t>(B * C_in)), dinp_b(dinp_a.size()), dw_a(w.size()), dw_b(w.size());
    Vec db_a(b.size()), db_b(b.size()), dpre_a(n), dpre_b(n);
    Bits dout_low(n);
    call::LinearBackward g{ref(dinp_a.data(), {B, C_in}), ref(dw_a.data(), {C_out, C_in}), ref(db_a.data(), {C_out}),
                           ref(dpre_a.data(), {B, C_out}), ref(dout.data(), {B, C_out}), ref(x.data(), {B, C_in}),
                           ref(w.data(), {C_out, C_in}), ref(out_f32.data(), {B, C_out}),
                           ref(pre_widened.data(), {B, C_out}), Epilogue::kGelu, false};
    g.dout_low = ref(dout_low.data(), {B, C_out});
    stream->run(g);
    g.dinp = ref(dinp_b.data(), {B, C_in});
    g.dweight = ref(dw_b.data(), {C_out, C_in});
    g.dbias = ref(db_b.data(), {C_out});
    g.dpre = ref(dpre_b.data(), {B, C_out});
    g.out = ref(out.data(), {B, C_out});
    g.pre = ref(pre.data(), {B, C_out});
    ASSERT_TRUE(stream->can_run(key_of(g))) << key_of(g).str();
    stream->run(g);
    EXPECT_EQ(dpre_a, dpre_b);
    EXPECT_EQ(dinp_a, dinp_b);
    EXPECT_EQ(dw_a, dw_b);
    EXPECT_EQ(db_a, db_b);
    for (size_t i = 0; i < n; ++i)
      ASSERT_NEAR(dpre_b[i], dout[i] * gelu_grad_ref(pre_widened[i]), 1e-5 * (std::fabs(dout[i]) + 1.0))
          << "element " << i;
  }
}

// A LayerNorm whose output only bf16 linear layers read writes it rounded: the f32 output rounded once, bit for bit,
// and the same saved mean and rstd (its backward reads those and the input, not the output).
TEST(Bf16LayerNorm, RoundedOutputIsTheF32OutputRoundedOnce) {
  auto stream = cpu_backend().open_stream(Device{});
  const int64_t N = 23, D = 96;
  for (bool affine : {true, false}) {
    SCOPED_TRACE(affine ? "affine" : "no affine");
    const Vec x = randn(static_cast<size_t>(N * D), 500, 3.0f);
    const Vec w = randn(static_cast<size_t>(D), 501), b = randn(static_cast<size_t>(D), 502);
    Vec out(x.size());
    Bits rounded(x.size(), 0xFFFF);
    std::vector<double> saved(static_cast<size_t>(2 * N)), saved_rounded(saved.size(), -1.0);
    auto f64 = [](double* p, int64_t n) { return TensorRef::contiguous(p, DType::kF64, &n, 1); };
    call::LayerNormForward f{ref(out.data(), {N, D}), f64(saved.data(), 2 * N), ref(x.data(), {N, D}),
                             affine ? ref(w.data(), {D}) : TensorRef{}, affine ? ref(b.data(), {D}) : TensorRef{}};
    stream->run(f);
    f.out = ref(rounded.data(), {N, D});
    f.mean_rstd = f64(saved_rounded.data(), 2 * N);
    ASSERT_TRUE(stream->can_run(key_of(f))) << key_of(f).str();
    EXPECT_EQ(key_of(f).str(), "layernorm_forward (f32, bf16 out)");
    stream->run(f);
    EXPECT_EQ(saved, saved_rounded);
    for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(rounded[i], to_bf16(out[i])) << "element " << i;
  }
  // Only f32 in, bf16 out: no bf16 LayerNorm, and no f16 output here.
  EXPECT_FALSE(stream->can_run({Op::kLayerNormForward, DType::kBF16, Epilogue::kNone}));
  EXPECT_FALSE(stream->can_run({Op::kLayerNormForward, DType::kF32, Epilogue::kNone, DType::kF16}));
  EXPECT_FALSE(stream->can_run({Op::kLayerNormBackward, DType::kF32, Epilogue::kNone, DType::kBF16}));
}

// The primitives are kept per shape: a second call of a shape creates none, and they are oneDNN's native bf16
// kernels (brgemm on AVX512-BF16 or AMX), not its reference code.
TEST(Bf16Linear, GemmKeepsOnePrimitivePerShapeAndRunsNativeKernels) {
  SKIP_WITHOUT_BF16();
  k::Bf16Gemm gemm;
  const Bits a = to_bits(randn(64 * 32, 1)), b = to_bits(randn(32 * 48, 2));
  Vec c(64 * 48);
  gemm.run(false, false, 64, 48, 32, a.data(), 32, b.data(), 48, false, c.data(), 48);
  gemm.run(false, false, 64, 48, 32, a.data(), 32, b.data(), 48, false, c.data(), 48);
  EXPECT_EQ(gemm.cached(), 1u);
  gemm.run(false, false, 64, 48, 32, a.data(), 32, b.data(), 48, true, c.data(), 48);
  EXPECT_EQ(gemm.cached(), 2u);
  const std::string impl = gemm.last_impl();
  EXPECT_EQ(impl.find("ref"), std::string::npos) << impl;
  EXPECT_NE(impl.find("avx512_core"), std::string::npos) << impl;
  std::printf("bf16 GEMM implementation: %s\n", impl.c_str());
}

// supports() has bf16 linear layers exactly where bf16_support says oneDNN runs bf16 natively; a stream without
// them refuses with the reason (the refusal itself needs a CPU without bf16, not this one).
TEST(Bf16Linear, SupportsAgreesWithBf16Support) {
  const char* why = "";
  const bool native = k::bf16_support(&why);
  EXPECT_EQ(native, std::string(why).empty()) << why;
  if (!native) EXPECT_NE(std::string(why).find("AVX512-BF16 or AMX"), std::string::npos) << why;
  auto stream = cpu_backend().open_stream(Device{});
  for (Op op : {Op::kLinearForward, Op::kLinearBackward})
    for (Epilogue e : {Epilogue::kNone, Epilogue::kRelu, Epilogue::kGelu}) {
      EXPECT_EQ(stream->supports({op, DType::kBF16, e}), native);
      EXPECT_EQ(stream->lacks_why({op, DType::kBF16, e}), native ? "" : why);
    }
  EXPECT_TRUE(stream->supports({Op::kConvert, DType::kBF16, Epilogue::kNone}));
  EXPECT_FALSE(stream->supports({Op::kLayerNormForward, DType::kBF16, Epilogue::kNone}));
  // f32 is as it was: ReLU fused, GELU composed.
  EXPECT_TRUE(stream->supports({Op::kLinearForward, DType::kF32, Epilogue::kRelu}));
  EXPECT_FALSE(stream->supports({Op::kLinearForward, DType::kF32, Epilogue::kGelu}));
  if (!native) {
    Conv2dSpec s;
    s.dtype = DType::kBF16;
    try {
      stream->make_conv2d(s);
      ADD_FAILURE() << "a bf16 convolution without bf16 instructions";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::kNotSupported);
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  }
}

// ---- Convolution -----------------------------------------------------------------------------------------------

struct ConvCase {
  Conv2dSpec spec;
  int64_t N, H, W;
};

void expect_close(const Vec& got, const Vec& want, const Vec& mag, double factor, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], factor * kAccumulation * mag[i] + 1e-30) << what << " " << i;
}

void check_conv(ConvCase c, uint32_t seed) {
  Conv2dSpec s = c.spec;
  SCOPED_TRACE(s.str() + (s.bias ? " with bias" : " without bias") + " relu " +
               (s.epilogue == Epilogue::kRelu ? "yes" : "no"));
  const int64_t N = c.N, H = c.H, W = c.W, OH = s.out_h(H), OW = s.out_w(W);
  const size_t in_n = static_cast<size_t>(N * s.in_channels * H * W);
  const size_t out_n = static_cast<size_t>(N * s.out_channels * OH * OW);
  const size_t w_n = static_cast<size_t>(s.out_channels * (s.in_channels / s.groups) * s.kernel_h * s.kernel_w);
  const Bits x = to_bits(randn(in_n, seed)), w = to_bits(randn(w_n, seed + 1, 0.2f));
  const Vec xf = from_bits(x), wf = from_bits(w);
  const Vec bias = randn(static_cast<size_t>(s.out_channels), seed + 2);
  const Vec dout = randn(out_n, seed + 3);
  const Vec doutf = from_bits(to_bits(dout));  // what the bf16 op multiplies
  const Vec dw0 = randn(w_n, seed + 4), db0 = randn(static_cast<size_t>(s.out_channels), seed + 5);

  auto stream = cpu_backend().open_stream(Device{});
  Conv2dSpec s32 = s;
  s32.dtype = DType::kF32;
  Conv2dSpec mag_spec = s32;  // the sum of the terms' magnitudes: the f32 convolution of |x| and |w|
  mag_spec.epilogue = Epilogue::kNone;
  auto op = stream->make_conv2d(s);
  auto op32 = stream->make_conv2d(s32);
  auto op_mag = stream->make_conv2d(mag_spec);

  const TensorRef xr = ref(x.data(), {N, s.in_channels, H, W});
  const TensorRef wr = ref(w.data(), {s.out_channels, s.in_channels / s.groups, s.kernel_h, s.kernel_w});
  const TensorRef br = s.bias ? ref(bias.data(), {s.out_channels}) : TensorRef{};

  // Forward.
  Vec out(out_n, NAN), want(out_n), mag(out_n);
  op->forward(ref(out.data(), {N, s.out_channels, OH, OW}), xr, wr, br);
  test::conv_forward(*op32, s32, want.data(), xf.data(), wf.data(), bias.data(), N, H, W);
  const Vec xa = abs_of(xf), wa = abs_of(wf), ba = abs_of(bias), da = abs_of(doutf);
  test::conv_forward(*op_mag, mag_spec, mag.data(), xa.data(), wa.data(), ba.data(), N, H, W);
  expect_close(out, want, mag, 2.0, "out");

  // Backward data, from the f32 gradient (the op rounds it).
  Vec dinp(in_n, NAN), dinp_want(in_n), dinp_mag(in_n);
  op->backward_data(ref(dinp.data(), {N, s.in_channels, H, W}), ref(dout.data(), {N, s.out_channels, OH, OW}), wr);
  test::conv_backward_data(*op32, s32, dinp_want.data(), doutf.data(), wf.data(), N, H, W);
  test::conv_backward_data(*op_mag, mag_spec, dinp_mag.data(), da.data(), wa.data(), N, H, W);
  expect_close(dinp, dinp_want, dinp_mag, 2.0, "dinp");

  // Backward weights, overwritten then accumulated.
  for (bool acc : {false, true}) {
    Vec dw = acc ? dw0 : Vec(w_n, NAN), db = acc ? db0 : Vec(bias.size(), NAN);
    Vec dw_want = acc ? dw0 : Vec(w_n), db_want = acc ? db0 : Vec(bias.size());
    Vec dw_mag(w_n), db_mag(bias.size());
    op->backward_weights(ref(dw.data(), {s.out_channels, s.in_channels / s.groups, s.kernel_h, s.kernel_w}),
                         s.bias ? ref(db.data(), {s.out_channels}) : TensorRef{},
                         ref(dout.data(), {N, s.out_channels, OH, OW}), xr, acc);
    test::conv_backward_weights(*op32, s32, dw_want.data(), db_want.data(), doutf.data(), xf.data(), N, H, W, acc);
    test::conv_backward_weights(*op_mag, mag_spec, dw_mag.data(), db_mag.data(), da.data(), xa.data(), N, H, W,
                                false);
    if (acc) {
      for (size_t i = 0; i < w_n; ++i) dw_mag[i] += std::fabs(dw0[i]);
      for (size_t i = 0; i < db0.size(); ++i) db_mag[i] += std::fabs(db0[i]);
    }
    expect_close(dw, dw_want, dw_mag, 2.0, acc ? "dweight accumulated" : "dweight");
    if (s.bias) expect_close(db, db_want, db_mag, 2.0, acc ? "dbias accumulated" : "dbias");
  }
}

Conv2dSpec conv_spec(int64_t cin, int64_t cout, int64_t kernel, int64_t stride, int64_t pad, int64_t groups, bool bias,
                     Epilogue epilogue = Epilogue::kNone) {
  Conv2dSpec s;
  s.in_channels = cin, s.out_channels = cout;
  s.kernel_h = s.kernel_w = kernel;
  s.stride_h = s.stride_w = stride;
  s.pad_h = s.pad_w = pad;
  s.groups = groups;
  s.bias = bias;
  s.epilogue = epilogue;
  s.dtype = DType::kBF16;
  return s;
}

TEST(Bf16Conv, MatchesTheF32OpOnTheRoundedOperands) {
  SKIP_WITHOUT_BF16();
  uint32_t seed = 200;
  check_conv({conv_spec(3, 8, 3, 1, 1, 1, true), 2, 9, 7}, seed++);
  check_conv({conv_spec(3, 8, 3, 1, 1, 1, false), 2, 9, 7}, seed++);
  check_conv({conv_spec(4, 6, 3, 2, 1, 2, true), 3, 11, 10}, seed++);
  check_conv({conv_spec(4, 6, 3, 2, 0, 2, false), 3, 11, 10}, seed++);
  check_conv({conv_spec(16, 32, 3, 1, 1, 1, true, Epilogue::kRelu), 4, 14, 14}, seed++);
  check_conv({conv_spec(8, 16, 1, 1, 0, 1, true), 2, 6, 6}, seed++);  // 1x1: dpar's layout, no blocked reorders
  check_conv({conv_spec(32, 64, 3, 1, 1, 1, true), 8, 28, 28}, seed++);
}

TEST(Bf16Conv, RefusesOtherDtypes) {
  auto stream = cpu_backend().open_stream(Device{});
  Conv2dSpec s;
  s.dtype = DType::kF64;
  try {
    stream->make_conv2d(s);
    ADD_FAILURE() << "an f64 convolution";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kNotSupported);
    EXPECT_NE(std::string(e.what()).find("f64"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dpar
