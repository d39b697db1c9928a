// fp16 (IEEE half) in dpar: common/f16.h's conversions, exhaustively over every f16 and over millions of floats
// (ties, subnormals, overflow), against an independent reference in double arithmetic and, where the CPU has F16C,
// against the hardware's own conversion; the CPU backend's Convert kernel in f16; and what the CPU backend says of
// f16 arithmetic: oneDNN 2.6 creates no f16 matmul or convolution on CPUs, so the backend lists no f16 GEMM, a
// convolution in f16 is refused, and an engine of CPU devices refuses the f16 policy with that reason, unchanged.
// (The f16 kernels and the f16 training with loss scaling run on CUDA: tests/test_cuda_f16.cpp.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DPAR_TEST_HAVE_F16C_PATH 1
#endif

#include "backend/cpu/cpu_backend.h"
#include "backend/kernel_calls.h"
#include "backend/stream.h"
#include "common/error.h"
#include "common/f16.h"
#include "engine/engine.h"
#include "engine_test_util.h"
#include "kernels/cpu/dnnl_ops.h"
#include "kernels/cpu/kernels.h"

namespace dpar {
namespace {

namespace k = kernels::cpu;

uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}
float float_of(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

// An f16's value from its fields, in double: (-1)^s 2^(e-15) (1 + m/1024), subnormal 2^-14 (m/1024).
double reference_value(uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const double v = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return s ? -v : v;
}

// The nearest f16 to a finite float, ties to even, by search in double over the f16 magnitudes (monotone in their
// bits): written apart from f16.h's bit arithmetic.
uint16_t reference_round(float f) {
  const double a = std::fabs(static_cast<double>(f));
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (a >= 65520.0) return sign | 0x7c00;  // 65504 + half its ulp (16) and up: infinity
  // The largest f16 magnitude <= a, by bisection over the bits 0..0x7bff.
  uint32_t lo = 0, hi = 0x7bff;
  while (lo < hi) {
    const uint32_t mid = (lo + hi + 1) / 2;
    if (reference_value(static_cast<uint16_t>(mid)) <= a) lo = mid;
    else hi = mid - 1;
  }
  const double below = reference_value(static_cast<uint16_t>(lo));
  if (below == a) return sign | static_cast<uint16_t>(lo);
  const double above = lo == 0x7bff ? 65536.0 : reference_value(static_cast<uint16_t>(lo + 1));
  const double d_below = a - below, d_above = above - a;
  uint32_t r = lo;
  if (d_above < d_below || (d_above == d_below && (lo & 1u))) r = lo + 1;
  return sign | static_cast<uint16_t>(r);
}

#ifdef DPAR_TEST_HAVE_F16C_PATH
bool cpu_has_f16c() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("f16c");
}
__attribute__((target("f16c"))) uint16_t hardware_to_f16(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}
__attribute__((target("f16c"))) float hardware_from_f16(uint16_t h) { return _cvtsh_ss(h); }
#endif

// Every f16: widening is exact (the value of its fields; a NaN stays a quiet NaN of its sign and payload) and
// rounding back gives the same bits (a signalling NaN comes back quiet).
TEST(F16Convert, EveryF16WidensExactlyAndRoundsBack) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const auto h = static_cast<uint16_t>(i);
    const float f = from_f16(h);
    const bool nan = (h & 0x7c00) == 0x7c00 && (h & 0x03ff) != 0;
    if (nan) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << h;
      ASSERT_EQ(bits_of(f) >> 31, static_cast<uint32_t>(h >> 15)) << std::hex << h;
      ASSERT_EQ((bits_of(f) >> 13) & 0x1ffu, h & 0x1ffu) << std::hex << h << ": the payload";
      ASSERT_EQ(to_f16(f), h | 0x0200) << std::hex << h;
    } else if ((h & 0x7fff) == 0x7c00) {
      ASSERT_TRUE(std::isinf(f)) << std::hex << h;
      ASSERT_EQ(to_f16(f), h);
    } else {
      ASSERT_EQ(static_cast<double>(f), reference_value(h)) << std::hex << h;
      ASSERT_EQ(std::signbit(f), (h >> 15) != 0) << std::hex << h;
      ASSERT_EQ(to_f16(f), h) << std::hex << h;
    }
#ifdef DPAR_TEST_HAVE_F16C_PATH
    if (cpu_has_f16c()) ASSERT_EQ(bits_of(f), bits_of(hardware_from_f16(h))) << std::hex << h;
#endif
  }
}

// Floats that probe every rounding case: for every f16 magnitude, the float itself, its midpoint with the next
// (a tie: to even), and the floats one ulp either side of the midpoint; the same for both signs. Ties between
// subnormals, between the largest subnormal and the smallest normal, at 65504 / infinity (65520 rounds up), and
// below the smallest subnormal (2^-25 is a tie that rounds to zero) are among them.
std::vector<float> rounding_cases() {
  std::vector<float> out;
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    const double v = reference_value(static_cast<uint16_t>(h));
    const double next = h == 0x7bff ? 65536.0 : reference_value(static_cast<uint16_t>(h + 1));
    const auto mid = static_cast<float>((v + next) / 2);  // exact: a float has the bits for it
    for (float f : {static_cast<float>(v), mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f)}) {
      out.push_back(f);
      out.push_back(-f);
    }
  }
  for (float f : {std::ldexp(1.0f, -25), std::ldexp(1.0f, -26), std::numeric_limits<float>::denorm_min(),
                  std::numeric_limits<float>::min(), std::numeric_limits<float>::max(), 65519.996f, 65520.0f, 1e10f,
                  std::numeric_limits<float>::infinity()}) {
    out.push_back(f);
    out.push_back(-f);
  }
  return out;
}

TEST(F16Convert, RoundsToNearestEvenAtEveryTieAndOverflowsToInfinity) {
  const std::vector<float> cases = rounding_cases();
  ASSERT_GT(cases.size(), 240000u);
  for (float f : cases) {
    ASSERT_EQ(to_f16(f), reference_round(f)) << f << " (bits " << std::hex << bits_of(f) << ")";
#ifdef DPAR_TEST_HAVE_F16C_PATH
    if (cpu_has_f16c()) ASSERT_EQ(to_f16(f), hardware_to_f16(f)) << f;
#endif
  }
  EXPECT_EQ(to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(to_f16(65519.996f), 0x7bff);
  EXPECT_EQ(to_f16(65520.0f), 0x7c00) << "the tie between 65504 and 65536 goes to the even one, infinity";
  EXPECT_EQ(to_f16(-1e6f), 0xfc00);
  EXPECT_EQ(to_f16(std::ldexp(1.0f, -24)), 0x0001) << "the smallest subnormal";
  EXPECT_EQ(to_f16(std::ldexp(1.0f, -25)), 0x0000) << "half of it is a tie: to zero (even)";
  EXPECT_EQ(to_f16(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(to_f16(-0.0f), 0x8000);
  EXPECT_EQ(to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00) << "1 + half an ulp: to 1 (even)";
  EXPECT_EQ(to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02) << "1 + 1.5 ulp: to 1 + 2 ulp (even)";
}

// A few million floats: every exponent, random mantissas, both signs, and the NaNs (quiet, of their sign, with the
// top of their payload) against the reference (the hardware's where the CPU has F16C).
TEST(F16Convert, MillionsOfRandomFloatsMatchTheReference) {
  std::mt19937 gen(2026);
  std::uniform_int_distribution<uint32_t> any;
  const bool f16c =
#ifdef DPAR_TEST_HAVE_F16C_PATH
      cpu_has_f16c();
#else
      false;
#endif
  for (int i = 0; i < 4000000; ++i) {
    // Half the draws with exponents around f16's range (2^-26 .. 2^17), half anywhere.
    uint32_t b = any(gen);
    if (i & 1) b = (b & 0x807fffffu) | ((101u + (b >> 23) % 44u) << 23);
    const float f = float_of(b);
    const uint16_t got = to_f16(f);
    if (std::isnan(f)) {
      ASSERT_EQ(got, static_cast<uint16_t>(((b >> 16) & 0x8000u) | 0x7e00u | ((b >> 13) & 0x3ffu))) << std::hex << b;
    } else if (f16c) {
#ifdef DPAR_TEST_HAVE_F16C_PATH
      ASSERT_EQ(got, hardware_to_f16(f)) << std::hex << b;
#endif
    } else if (i % 16 == 0) {  // the bisection is slow: a sixteenth of them
      ASSERT_EQ(got, reference_round(f)) << std::hex << b;
    }
  }
}

// Where the CPU has F16C: every one of the 2^32 floats rounds to the bits VCVTPS2PH gives (round to nearest even),
// NaNs included. A few seconds.
TEST(F16Convert, EveryFloatRoundsAsF16cDoes) {
#ifdef DPAR_TEST_HAVE_F16C_PATH
  if (!cpu_has_f16c()) GTEST_SKIP() << "this CPU has no F16C: the other tests compare with the double reference";
  uint64_t wrong = 0;
  uint32_t first = 0;
  for (uint64_t u = 0; u < (uint64_t{1} << 32); ++u) {
    const float f = float_of(static_cast<uint32_t>(u));
    if (to_f16(f) != hardware_to_f16(f) && wrong++ == 0) first = static_cast<uint32_t>(u);
  }
  EXPECT_EQ(wrong, 0u) << "first at float bits " << std::hex << first;
#else
  GTEST_SKIP() << "not an x86 build: no F16C to compare with";
#endif
}

// The Convert kernel call in f16 on the CPU stream: the same bits as f16.h's functions, both ways.
TEST(F16Convert, TheCpuStreamConvertsInF16) {
  std::unique_ptr<Stream> s = cpu_backend().open_stream(Device{});
  EXPECT_TRUE(s->supports({Op::kConvert, DType::kF16}));
  const std::vector<float> x = {0.0f, -0.0f, 1.0f, 65504.0f, 65520.0f, 1e-8f, 3.14159f, -2.5e-5f, NAN};
  std::vector<uint16_t> h(x.size(), 0xffff);
  std::vector<float> back(x.size(), 7.0f);
  const int64_t n = static_cast<int64_t>(x.size());
  const TensorRef src = TensorRef::of(x.data(), {n});
  const TensorRef low = TensorRef::contiguous(h.data(), DType::kF16, &n, 1);
  const TensorRef wide = TensorRef::of(back.data(), {n});
  call::Convert down{low, src};
  ASSERT_EQ(down.dtype(), DType::kF16);
  s->run(down);
  s->run(call::Convert{wide, low});
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(h[i], to_f16(x[i])) << i;
    EXPECT_EQ(bits_of(back[i]), bits_of(from_f16(h[i]))) << i;
  }
  EXPECT_TRUE(std::isinf(back[4])) << "65520 overflows";
  // A bf16 buffer is not an f16 one: the dtypes are checked.
  const TensorRef as_bf16 = TensorRef::contiguous(h.data(), DType::kBF16, &n, 1);
  EXPECT_NO_THROW(s->run(call::Convert{as_bf16, src}));  // bf16 is its own conversion
  EXPECT_THROW(k::to_f16(nullptr, nullptr, -1), Error);
  EXPECT_THROW(k::from_f16(nullptr, nullptr, -1), Error);
}

// oneDNN 2.6.3 (this build's) creates no f16 matmul or convolution on CPUs: the backend lists no f16 GEMM, says why
// (naming oneDNN and its refusal), refuses an f16 convolution with that reason, and an engine of CPU devices refuses
// the f16 policy whole, naming the node, the kernel and the reason, and trains on in f32.
TEST(F16OnCpu, OneDnnHasNoF16GemmSoTheBackendRefusesF16WithTheReason) {
  const std::string why = k::f16_unsupported_why();
  EXPECT_NE(why.find("oneDNN"), std::string::npos) << why;
  EXPECT_NE(why.find("f16 matmul"), std::string::npos) << why;
  std::unique_ptr<Stream> s = cpu_backend().open_stream(Device{});
  for (Op op : {Op::kLinearForward, Op::kLinearBackward})
    for (Epilogue e : {Epilogue::kNone, Epilogue::kRelu, Epilogue::kGelu}) {
      EXPECT_FALSE(s->supports({op, DType::kF16, e}));
      EXPECT_FALSE(s->can_run({op, DType::kF16, e}));
      EXPECT_EQ(s->lacks_why({op, DType::kF16, e}), why);
    }
  Conv2dSpec spec;
  spec.dtype = DType::kF16;
  try {
    s->make_conv2d(spec);
    ADD_FAILURE() << "an f16 convolution on a CPU";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kNotSupported);
    EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
  }

  Model m(3);
  m.add(make_linear(4, 6, true));
  m.add(make_activation(Activation::kRelu));
  m.add(make_linear(6, 2, true));
  OptimizerConfig o;
  o.kind = OptimizerKind::kSgd;
  o.lr = 0.1f;
  Engine engine(std::move(m), o, test::cpu_devices(2));
  try {
    engine.set_compute_dtype(DType::kF16);
    ADD_FAILURE() << "f16 on CPU devices";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kNotSupported);
    const std::string msg = e.what();
    EXPECT_NE(msg.find("linear_forward (f16"), std::string::npos) << msg;
    EXPECT_NE(msg.find(why), std::string::npos) << msg;
  }
  EXPECT_EQ(engine.compute_dtype(), DType::kF32);
  const Tensor x = test::host_tensor(test::randn(8 * 4, 1, 1.0f), Shape{8, 4});
  Tensor y = Tensor::empty(DType::kI32, Shape{8}, Device{});
  for (int64_t i = 0; i < 8; ++i) y.i32()[i] = static_cast<int32_t>(i % 2);
  EXPECT_TRUE(std::isfinite(engine.train_step(x, y))) << "the engine trains on in f32";
  EXPECT_THROW(engine.set_compute_dtype(DType::kI32), Error);
}

}  // namespace
}  // namespace dpar
