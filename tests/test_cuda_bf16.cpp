// Mixed precision on cuda: the bf16 linear kernels (cublasGemmEx, f32 accumulation), the bf16 convolution through
// cuDNN, and a stream's TF32 switch (Stream::set_allow_tf32), through the stream's kernel calls and ops.
//
// References. A bf16 GEMM's products are exact in f32 (8-bit mantissas), so its only error is the f32 sum: the
// reference is the sum in double of the products of the bf16-rounded operands, and an element may differ from it by
// 1e-5 of the sum of its terms' magnitudes (f32 summation of at most a few thousand terms, in any order, stays far
// below that; a wrong operand, transposition or rounding gives errors of order 1e-3 and more). TF32 keeps 10
// mantissa bits: an operand's relative error is at most 2^-11 (rounded) or 2^-10 (truncated), a product's under
// 2^-9, so TF32 results lie within 2^-9 of the sum of the terms' magnitudes, and with TF32 off the kernels must give
// the bits they gave before any TF32 was asked for. The bf16 convolution is compared with the f32 cuDNN
// convolution (strict FP32) on the same bf16-rounded operands, at test_cuda_cudnn.cpp's tolerance.
//
// Every test here but the first needs a GPU and skips without one (DPAR_REQUIRE_GPU).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/kernel_calls.h"
#include "backend/stream.h"
#include "common/bf16.h"
#include "common/error.h"
#include "cuda_test_util.h"
#include "op_calls.h"
#include "platform/cuda/cublas_library.h"
#include "platform/cuda/cuda_check.h"

namespace dpar {
namespace {

using test::bitwise_equal;
using test::DeviceBuffer;
using test::on_gpu;
using test::round_bf16;
using test::widen_bf16;
using test::normalised_error;
using test::random_vector;
using Vec = std::vector<float>;
using Bits = std::vector<uint16_t>;

const Device kGpu{DeviceKind::kCuda, 0};

// ---- No GPU needed --------------------------------------------------------------------------------------------------

// cuBLAS loads without a GPU: the mixed-precision GEMM is among the functions resolved.
TEST(CudaBf16Library, CublasGemmExIsResolved) {
  EXPECT_NE(cuda::cublas().gemm_ex, nullptr);
}

// ---- Helpers --------------------------------------------------------------------------------------------------------

template <class T>
TensorRef ref2(const DeviceBuffer<T>& b, int64_t rows, int64_t cols, int64_t lead = 0) {
  // (rows, cols), or (lead, rows / lead, cols) when lead > 0: a (*,C) operand with two leading extents.
  if (lead > 0) return TensorRef::of(b.get(), {lead, rows / lead, cols});
  return TensorRef::of(b.get(), {rows, cols});
}

// |got - want| <= tol * scale[i] for every element, naming the first that is not.
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

double gelu(double x) { return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))); }

// out (B,C_out) = x (B,C_in) @ w^T + b in double, with the sums of the terms' magnitudes.
void gemm_reference(const Vec& x, const Vec& w, const Vec* b, int64_t B, int64_t C_in, int64_t C_out,
                    std::vector<double>& out, std::vector<double>& mag) {
  out.assign(static_cast<size_t>(B * C_out), 0.0), mag.assign(out.size(), 0.0);
  for (int64_t r = 0; r < B; ++r)
    for (int64_t j = 0; j < C_out; ++j) {
      double s = b ? (*b)[static_cast<size_t>(j)] : 0.0, m = b ? std::fabs(s) : 0.0;
      for (int64_t i = 0; i < C_in; ++i) {
        const double t =
            static_cast<double>(x[static_cast<size_t>(r * C_in + i)]) * w[static_cast<size_t>(j * C_in + i)];
        s += t, m += std::fabs(t);
      }
      out[static_cast<size_t>(r * C_out + j)] = s, mag[static_cast<size_t>(r * C_out + j)] = m;
    }
}

constexpr double kF32Sum = 1e-5;          // f32 accumulation, relative to the sum of the terms' magnitudes
constexpr double kTf32 = 1.0 / 512.0;     // TF32 operands (2^-9), likewise
constexpr double kConvTolerance = 5e-5;   // test_cuda_cudnn.cpp's

struct LinearCase {
  int64_t B, C_in, C_out;
  int64_t lead;  // > 0: the operands are (lead, B / lead, C)
};
const LinearCase kCases[] = {{1, 1, 1, 0},     {3, 5, 7, 0},      {17, 33, 9, 0},  {64, 784, 256, 0},
                             {257, 129, 65, 0}, {24, 40, 48, 4},   {0, 4, 3, 0},    {4, 0, 3, 0}};

class CudaBf16 : public ::testing::Test {
 protected:
  void SetUp() override {
    DPAR_REQUIRE_GPU();
    gpu_ = cuda_backend().open_stream(kGpu);
    cpu_ = cpu_backend().open_stream(Device{});
  }
  std::unique_ptr<Stream> gpu_, cpu_;
};

// ---- Linear ---------------------------------------------------------------------------------------------------------

TEST_F(CudaBf16, TheStreamListsTheBf16LinearKernels) {
  for (Op op : {Op::kLinearForward, Op::kLinearBackward}) {
    EXPECT_TRUE(gpu_->supports({op, DType::kBF16, Epilogue::kNone}));
    EXPECT_TRUE(gpu_->supports({op, DType::kBF16, Epilogue::kRelu}));
    EXPECT_FALSE(gpu_->supports({op, DType::kBF16, Epilogue::kGelu}));  // composed, as f32's
  }
  EXPECT_TRUE(gpu_->supports({Op::kConvert, DType::kBF16, Epilogue::kNone}));
  EXPECT_FALSE(gpu_->supports({Op::kActivationForward, DType::kBF16, Epilogue::kNone}));
}

TEST_F(CudaBf16, LinearForwardAccumulatesExactProductsInF32) {
  uint64_t seed = 1;
  for (const auto& c : kCases) {
    for (Epilogue e : {Epilogue::kNone, Epilogue::kRelu, Epilogue::kGelu}) {
      for (bool with_bias : {true, false}) {
        SCOPED_TRACE(::testing::Message() << "B " << c.B << " C_in " << c.C_in << " C_out " << c.C_out << " lead "
                                          << c.lead << " " << epilogue_name(e) << " bias " << with_bias);
        const Bits x = round_bf16(random_vector(static_cast<size_t>(c.B * c.C_in), seed++)),
                   w = round_bf16(random_vector(static_cast<size_t>(c.C_out * c.C_in), seed++));
        const Vec b = random_vector(static_cast<size_t>(c.C_out), seed++);
        std::vector<double> want, mag;
        const Vec xw = widen_bf16(x), ww = widen_bf16(w);
        gemm_reference(xw, ww, with_bias ? &b : nullptr, c.B, c.C_in, c.C_out, want, mag);
        std::vector<double> pre_want = want;
        for (auto& v : want) v = e == Epilogue::kRelu ? (v < 0 ? 0.0 : v) : e == Epilogue::kGelu ? gelu(v) : v;
        // The epilogue may move an error by its slope (at most ~1.13 for GELU).
        for (auto& m : mag) m = 1.2 * m + 1e-6;

        auto dx = on_gpu(x), dw = on_gpu(w);
        auto db = on_gpu(b);
        auto dout = on_gpu(Vec(static_cast<size_t>(c.B * c.C_out), NAN));
        auto dpre = on_gpu(Vec(static_cast<size_t>(c.B * c.C_out), NAN));
        call::LinearForward f;
        f.out = ref2(*dout, c.B, c.C_out, c.lead), f.inp = ref2(*dx, c.B, c.C_in, c.lead);
        f.weight = TensorRef::of(dw->get(), {c.C_out, c.C_in});
        if (with_bias) f.bias = TensorRef::of(db->get(), {c.C_out});
        if (e == Epilogue::kGelu) f.pre = ref2(*dpre, c.B, c.C_out, c.lead);
        f.epilogue = e;
        ASSERT_EQ(f.dtype(), DType::kBF16);
        gpu_->run(f);
        EXPECT_TRUE(within(dout->download(), want, mag, kF32Sum)) << "out";
        if (e == Epilogue::kGelu) {
          EXPECT_TRUE(within(dpre->download(), pre_want, mag, kF32Sum)) << "pre";
        }
      }
    }
  }
}

TEST_F(CudaBf16, LinearBackwardRoundsTheGradientOnceAndAccumulatesInF32) {
  uint64_t seed = 1000;
  for (const auto& c : kCases) {
    for (Epilogue e : {Epilogue::kNone, Epilogue::kRelu, Epilogue::kGelu}) {
      for (bool accumulate : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "B " << c.B << " C_in " << c.C_in << " C_out " << c.C_out << " lead "
                                          << c.lead << " " << epilogue_name(e) << " accumulate " << accumulate);
        const size_t nx = static_cast<size_t>(c.B * c.C_in), nw = static_cast<size_t>(c.C_out * c.C_in),
                     ny = static_cast<size_t>(c.B * c.C_out), nb = static_cast<size_t>(c.C_out);
        const Bits x = round_bf16(random_vector(nx, seed++)), w = round_bf16(random_vector(nw, seed++));
        const Vec dy = random_vector(ny, seed++), pre = random_vector(ny, seed++), gw0 = random_vector(nw, seed++),
                  gb0 = random_vector(nb, seed++);
        // The forward's output as the epilogue's backward reads it: ReLU reads out, GELU reads pre.
        Vec out(ny);
        for (size_t i = 0; i < ny; ++i) out[i] = pre[i] < 0.0f ? 0.0f : pre[i];

        auto dx = on_gpu(x), dw = on_gpu(w);
        auto d_dy = on_gpu(dy), d_pre = on_gpu(pre), d_out = on_gpu(out);
        auto d_dinp = on_gpu(Vec(nx, NAN)), d_dpre = on_gpu(Vec(ny, NAN));
        auto d_dw = on_gpu(accumulate ? gw0 : Vec(nw, NAN)), d_db = on_gpu(accumulate ? gb0 : Vec(nb, NAN));
        auto d_low = on_gpu(Bits(ny, 0xffff));
        call::LinearBackward g;
        g.dinp = ref2(*d_dinp, c.B, c.C_in, c.lead), g.dweight = TensorRef::of(d_dw->get(), {c.C_out, c.C_in});
        g.dbias = TensorRef::of(d_db->get(), {c.C_out}), g.dout = ref2(*d_dy, c.B, c.C_out, c.lead);
        g.inp = ref2(*dx, c.B, c.C_in, c.lead), g.weight = TensorRef::of(dw->get(), {c.C_out, c.C_in});
        g.dout_low = ref2(*d_low, c.B, c.C_out, c.lead);
        if (e != Epilogue::kNone) {
          g.dpre = ref2(*d_dpre, c.B, c.C_out, c.lead);
          g.out = ref2(*d_out, c.B, c.C_out, c.lead);
          g.pre = ref2(*d_pre, c.B, c.C_out, c.lead);
        }
        g.epilogue = e, g.accumulate = accumulate;
        ASSERT_EQ(g.dtype(), DType::kBF16);
        gpu_->run(g);

        // The f32 gradient before the GEMMs: dout; ReLU's backward (exact); GELU's from the CPU kernel, which the
        // CUDA one matches (test_cuda_kernels.cpp) to within its own rounding, so its bits are taken from the GPU's
        // dpre after that check.
        Vec grad = dy;
        if (e == Epilogue::kRelu) {
          for (size_t i = 0; i < ny; ++i) grad[i] = out[i] <= 0.0f ? 0.0f : dy[i];
          EXPECT_TRUE(bitwise_equal(d_dpre->download(), grad)) << "dpre (ReLU's backward)";
        } else if (e == Epilogue::kGelu) {
          Vec cpu_grad(ny);
          test::activation_backward(*cpu_, Activation::kGelu, cpu_grad.data(), dy.data(), pre.data(), out.data(),
                                    static_cast<int64_t>(ny));
          grad = d_dpre->download();
          EXPECT_LT(normalised_error(grad, cpu_grad), 1e-6) << "dpre (GELU's backward)";
        }
        const Bits low = d_low->download();
        EXPECT_EQ(low, round_bf16(grad)) << "dout_low: the gradient before the GEMMs rounded to bf16";
        const Vec lw = widen_bf16(round_bf16(grad)), xw = widen_bf16(x), ww = widen_bf16(w);

        // dinp (B,C_in) = low (B,C_out) @ w (C_out,C_in).
        std::vector<double> want(nx, 0.0), mag(nx, 0.0);
        for (int64_t r = 0; r < c.B; ++r)
          for (int64_t i = 0; i < c.C_in; ++i)
            for (int64_t j = 0; j < c.C_out; ++j) {
              const double t = static_cast<double>(lw[static_cast<size_t>(r * c.C_out + j)]) *
                               ww[static_cast<size_t>(j * c.C_in + i)];
              want[static_cast<size_t>(r * c.C_in + i)] += t, mag[static_cast<size_t>(r * c.C_in + i)] += std::fabs(t);
            }
        EXPECT_TRUE(within(d_dinp->download(), want, mag, kF32Sum)) << "dinp";
        // dweight (C_out,C_in) (+)= low^T @ x; dbias (+)= column sums of the f32 gradient (not rounded).
        want.assign(nw, 0.0), mag.assign(nw, 0.0);
        for (int64_t j = 0; j < c.C_out; ++j)
          for (int64_t i = 0; i < c.C_in; ++i) {
            const size_t k = static_cast<size_t>(j * c.C_in + i);
            if (accumulate) want[k] = gw0[k], mag[k] = std::fabs(gw0[k]);
            for (int64_t r = 0; r < c.B; ++r) {
              const double t = static_cast<double>(lw[static_cast<size_t>(r * c.C_out + j)]) *
                               xw[static_cast<size_t>(r * c.C_in + i)];
              want[k] += t, mag[k] += std::fabs(t);
            }
          }
        EXPECT_TRUE(within(d_dw->download(), want, mag, kF32Sum)) << "dweight";
        want.assign(nb, 0.0), mag.assign(nb, 0.0);
        for (int64_t j = 0; j < c.C_out; ++j) {
          const size_t k = static_cast<size_t>(j);
          if (accumulate) want[k] = gb0[k], mag[k] = std::fabs(gb0[k]);
          for (int64_t r = 0; r < c.B; ++r) {
            const double t = grad[static_cast<size_t>(r * c.C_out + j)];
            want[k] += t, mag[k] += std::fabs(t);
          }
        }
        EXPECT_TRUE(within(d_db->download(), want, mag, kF32Sum)) << "dbias";
      }
    }
  }
}

// dinp may be dout's memory (kernel_calls.h): dout is consumed (into dbias and dout_low) before dinp is written.
TEST_F(CudaBf16, LinearBackwardMayWriteDinpOverDout) {
  const int64_t B = 33, C = 48;
  const size_t n = static_cast<size_t>(B * C);
  const Bits x = round_bf16(random_vector(n, 7)), w = round_bf16(random_vector(n, 8));
  const Vec dy = random_vector(n, 9);
  auto dx = on_gpu(x), dw = on_gpu(w), low1 = on_gpu(Bits(n)), low2 = on_gpu(Bits(n));
  auto shared = on_gpu(dy), separate = on_gpu(Vec(n, NAN)), d_dy = on_gpu(dy);
  auto gw1 = on_gpu(Vec(n, NAN)), gw2 = on_gpu(Vec(n, NAN)), gb1 = on_gpu(Vec(C, NAN)), gb2 = on_gpu(Vec(C, NAN));
  auto run = [&](DeviceBuffer<float>& dinp, DeviceBuffer<float>& dout, DeviceBuffer<float>& gw,
                 DeviceBuffer<float>& gb, DeviceBuffer<uint16_t>& low) {
    call::LinearBackward g;
    g.dinp = ref2(dinp, B, C), g.dweight = ref2(gw, C, C), g.dbias = TensorRef::of(gb.get(), {C});
    g.dout = ref2(dout, B, C), g.inp = ref2(*dx, B, C), g.weight = ref2(*dw, C, C), g.dout_low = ref2(low, B, C);
    gpu_->run(g);
  };
  run(*separate, *d_dy, *gw1, *gb1, *low1);
  run(*shared, *shared, *gw2, *gb2, *low2);
  EXPECT_TRUE(bitwise_equal(shared->download(), separate->download())) << "dinp";
  EXPECT_TRUE(bitwise_equal(gw2->download(), gw1->download())) << "dweight";
  EXPECT_TRUE(bitwise_equal(gb2->download(), gb1->download())) << "dbias";
}

// ---- TF32 -----------------------------------------------------------------------------------------------------------

struct F32Linear {
  int64_t B, C_in, C_out;
  Vec x, w, b, dy;
  std::vector<double> want, mag;  // forward's reference and its terms' magnitudes
};

F32Linear f32_linear(int64_t B, int64_t C_in, int64_t C_out, uint64_t seed) {
  F32Linear l{B,
              C_in,
              C_out,
              random_vector(static_cast<size_t>(B * C_in), seed),
              random_vector(static_cast<size_t>(C_out * C_in), seed + 1),
              random_vector(static_cast<size_t>(C_out), seed + 2),
              random_vector(static_cast<size_t>(B * C_out), seed + 3),
              {},
              {}};
  gemm_reference(l.x, l.w, &l.b, B, C_in, C_out, l.want, l.mag);
  return l;
}

// The f32 forward and backward on `s`: out, dinp, dweight, dbias, concatenated.
Vec run_f32_linear(Stream& s, const F32Linear& l) {
  auto dx = on_gpu(l.x), dw = on_gpu(l.w), db = on_gpu(l.b), ddy = on_gpu(l.dy);
  const size_t ny = static_cast<size_t>(l.B * l.C_out), nx = l.x.size(), nw = l.w.size(), nb = l.b.size();
  auto out = on_gpu(Vec(ny, NAN)), dinp = on_gpu(Vec(nx, NAN)), gw = on_gpu(Vec(nw, NAN)), gb = on_gpu(Vec(nb, NAN));
  s.run(call::LinearForward{ref2(*out, l.B, l.C_out), ref2(*dx, l.B, l.C_in), ref2(*dw, l.C_out, l.C_in),
                            TensorRef::of(db->get(), {l.C_out})});
  call::LinearBackward g;
  g.dinp = ref2(*dinp, l.B, l.C_in), g.dweight = ref2(*gw, l.C_out, l.C_in);
  g.dbias = TensorRef::of(gb->get(), {l.C_out});
  g.dout = ref2(*ddy, l.B, l.C_out), g.inp = ref2(*dx, l.B, l.C_in), g.weight = ref2(*dw, l.C_out, l.C_in);
  s.run(g);
  Vec all = out->download();
  for (const auto* part : {dinp.get(), gw.get(), gb.get()}) {
    const Vec v = part->download();
    all.insert(all.end(), v.begin(), v.end());
  }
  return all;
}

int compute_capability_major() {
  int major = 0;
  DPAR_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), "compute capability");
  return major;
}

TEST_F(CudaBf16, Tf32OnStaysWithinTf32RoundingAndOffGivesTodaysBits) {
  const F32Linear l = f32_linear(256, 1024, 512, 42);
  // Today's kernel: a stream that was never asked for TF32.
  const Vec strict = run_f32_linear(*gpu_, l);
  const Vec strict_out(strict.begin(), strict.begin() + static_cast<std::ptrdiff_t>(l.want.size()));
  EXPECT_TRUE(within(strict_out, l.want, l.mag, kF32Sum)) << "strict f32";

  auto s = cuda_backend().open_stream(kGpu);
  EXPECT_TRUE(s->set_allow_tf32(true));
  const Vec tf32 = run_f32_linear(*s, l);
  const Vec tf32_out(tf32.begin(), tf32.begin() + static_cast<std::ptrdiff_t>(l.want.size()));
  EXPECT_TRUE(within(tf32_out, l.want, l.mag, kTf32)) << "TF32";
  // On Ampere and later TF32 tensor cores exist: a 256x1024x512 GEMM allowed them uses them, and its result
  // differs from the strict one (else the switch did nothing).
  if (compute_capability_major() >= 8) {
    EXPECT_FALSE(bitwise_equal(tf32, strict)) << "TF32 on changed nothing";
  }

  EXPECT_TRUE(s->set_allow_tf32(false));
  EXPECT_TRUE(bitwise_equal(run_f32_linear(*s, l), strict)) << "TF32 off again";
  // Asked before the stream's first GEMM (its cuBLAS handle is made then): off from the start.
  auto fresh = cuda_backend().open_stream(kGpu);
  EXPECT_TRUE(fresh->set_allow_tf32(false));
  EXPECT_TRUE(bitwise_equal(run_f32_linear(*fresh, l), strict)) << "TF32 off before the first GEMM";
}

// ---- Convolution ----------------------------------------------------------------------------------------------------

Conv2dSpec conv(int64_t cin, int64_t cout, int64_t k, int64_t stride, int64_t pad, int64_t groups, bool bias,
                Epilogue epilogue, DType dtype) {
  Conv2dSpec s;
  s.in_channels = cin, s.out_channels = cout, s.kernel_h = s.kernel_w = k, s.stride_h = s.stride_w = stride;
  s.pad_h = s.pad_w = pad, s.groups = groups, s.bias = bias, s.epilogue = epilogue, s.dtype = dtype;
  return s;
}

struct ConvCase {
  const char* name;
  int64_t cin, cout, k, stride, pad, groups;
  bool bias;
  Epilogue epilogue;
  int64_t N, H, W;
};
const ConvCase kConvCases[] = {
    {"3x3 same", 16, 32, 3, 1, 1, 1, true, Epilogue::kNone, 4, 14, 14},
    {"3x3 stride 2, ReLU", 8, 16, 3, 2, 1, 1, true, Epilogue::kRelu, 3, 15, 13},
    {"1x1 no bias", 32, 8, 1, 1, 0, 1, false, Epilogue::kNone, 2, 9, 9},
    {"grouped 5x5", 12, 24, 5, 1, 2, 3, true, Epilogue::kNone, 2, 11, 12},
    {"one input channel", 1, 6, 5, 1, 0, 1, true, Epilogue::kNone, 5, 28, 28},
};

struct ConvResults {
  Vec y, dx, dw, db, dw_acc, db_acc;
};

// forward, backward_data, backward_weights overwriting and accumulating onto gw0, gb0; x and w f32 (the f32 op) or
// bf16 bits widened (the bf16 op reads the bits).
ConvResults run_conv(Conv2dOp& op, const Conv2dSpec& s, const ConvCase& c, const Vec& x, const Vec& w, const Vec& b,
                     const Vec& dy, const Vec& gw0, const Vec& gb0) {
  const bool low = s.dtype == DType::kBF16;
  const int64_t OH = s.out_h(c.H), OW = s.out_w(c.W);
  const TensorRef wshape = TensorRef::of(static_cast<float*>(nullptr), {s.out_channels, s.in_channels / s.groups,
                                                                        s.kernel_h, s.kernel_w});
  auto as = [](const TensorRef& shape, void* p, DType dt) {
    TensorRef r = shape;
    r.data = p, r.dtype = dt;
    return r;
  };
  const TensorRef xs = TensorRef::of(static_cast<float*>(nullptr), {c.N, s.in_channels, c.H, c.W});
  const TensorRef ys = TensorRef::of(static_cast<float*>(nullptr), {c.N, s.out_channels, OH, OW});
  auto x32 = on_gpu(x), w32 = on_gpu(w);
  auto x16 = on_gpu(round_bf16(x)), w16 = on_gpu(round_bf16(w));
  auto b_ = on_gpu(b), dy_ = on_gpu(dy), y_ = on_gpu(Vec(static_cast<size_t>(ys.numel()), NAN));
  auto dx_ = on_gpu(Vec(x.size(), NAN)), dw_ = on_gpu(Vec(w.size(), NAN)), db_ = on_gpu(Vec(b.size(), NAN));
  auto dwa = on_gpu(gw0), dba = on_gpu(gb0);
  const TensorRef xin = low ? as(xs, x16->get(), DType::kBF16) : as(xs, x32->get(), DType::kF32);
  const TensorRef win = low ? as(wshape, w16->get(), DType::kBF16) : as(wshape, w32->get(), DType::kF32);
  const TensorRef bias = s.bias ? TensorRef::of(b_->get(), {s.out_channels}) : TensorRef{};
  auto bias_of = [&](DeviceBuffer<float>& g) {
    return s.bias ? TensorRef::of(g.get(), {s.out_channels}) : TensorRef{};
  };
  op.forward(as(ys, y_->get(), DType::kF32), xin, win, bias);
  op.backward_data(as(xs, dx_->get(), DType::kF32), as(ys, dy_->get(), DType::kF32), win);
  op.backward_weights(as(wshape, dw_->get(), DType::kF32), bias_of(*db_), as(ys, dy_->get(), DType::kF32), xin, false);
  op.backward_weights(as(wshape, dwa->get(), DType::kF32), bias_of(*dba), as(ys, dy_->get(), DType::kF32), xin, true);
  ConvResults r;
  r.y = y_->download(), r.dx = dx_->download(), r.dw = dw_->download(), r.db = db_->download();
  r.dw_acc = dwa->download(), r.db_acc = dba->download();
  return r;
}

size_t conv_out(const ConvCase& c) {
  const Conv2dSpec s = conv(c.cin, c.cout, c.k, c.stride, c.pad, c.groups, c.bias, c.epilogue, DType::kF32);
  return static_cast<size_t>(c.N * c.cout * s.out_h(c.H) * s.out_w(c.W));
}

TEST_F(CudaBf16, ConvolutionInBf16MatchesTheF32ConvolutionOfTheRoundedOperands) {
  uint64_t seed = 5000;
  for (const auto& c : kConvCases) {
    SCOPED_TRACE(c.name);
    const Conv2dSpec s16 = conv(c.cin, c.cout, c.k, c.stride, c.pad, c.groups, c.bias, c.epilogue, DType::kBF16);
    const Conv2dSpec s32 = conv(c.cin, c.cout, c.k, c.stride, c.pad, c.groups, c.bias, c.epilogue, DType::kF32);
    const size_t nx = static_cast<size_t>(c.N * c.cin * c.H * c.W),
                 nw = static_cast<size_t>(c.cout * (c.cin / c.groups) * c.k * c.k), ny = conv_out(c),
                 nb = static_cast<size_t>(c.cout);
    const Vec x = random_vector(nx, seed++), w = random_vector(nw, seed++), b = random_vector(nb, seed++),
              dy = random_vector(ny, seed++), gw0 = random_vector(nw, seed++), gb0 = random_vector(nb, seed++);
    std::unique_ptr<Conv2dOp> op16, op32;
    try {
      op16 = gpu_->make_conv2d(s16);
      op32 = gpu_->make_conv2d(s32);
    } catch (const Error& e) {
      if (e.status() == Status::kNotSupported && !test::gpu_required()) GTEST_SKIP() << e.what();
      throw;
    }
    const ConvResults got = run_conv(*op16, s16, c, x, w, b, dy, gw0, gb0);
    // The reference: the strict f32 convolution of the operands rounded to bf16; every gradient from the gradient
    // rounded to bf16 (Conv2dSpec::dtype: the bias's too, as the CPU's).
    const Vec xr = widen_bf16(round_bf16(x)), wr = widen_bf16(round_bf16(w)), dyr = widen_bf16(round_bf16(dy));
    const ConvResults ref = run_conv(*op32, s32, c, xr, wr, b, dyr, gw0, gb0);
    const ConvResults& ref_bias = ref;
    EXPECT_LT(normalised_error(got.y, ref.y), kConvTolerance) << "forward";
    EXPECT_LT(normalised_error(got.dx, ref.dx), kConvTolerance) << "backward_data";
    EXPECT_LT(normalised_error(got.dw, ref.dw), kConvTolerance) << "backward_weights";
    EXPECT_LT(normalised_error(got.dw_acc, ref.dw_acc), kConvTolerance) << "backward_weights, accumulating";
    if (c.bias) {
      EXPECT_LT(normalised_error(got.db, ref_bias.db), kConvTolerance) << "dbias";
      EXPECT_LT(normalised_error(got.db_acc, ref_bias.db_acc), kConvTolerance) << "dbias, accumulating";
    }
  }
}

TEST_F(CudaBf16, ConvolutionTf32OnStaysCloseAndOffGivesTodaysBits) {
  const ConvCase c = kConvCases[0];
  const Conv2dSpec s = conv(c.cin, c.cout, c.k, c.stride, c.pad, c.groups, c.bias, c.epilogue, DType::kF32);
  const size_t nx = static_cast<size_t>(c.N * c.cin * c.H * c.W), nw = static_cast<size_t>(c.cout * c.cin * c.k * c.k),
               nb = static_cast<size_t>(c.cout), ny = conv_out(c);
  const Vec x = random_vector(nx, 1), w = random_vector(nw, 2), b = random_vector(nb, 3), dy = random_vector(ny, 4),
            gw0 = random_vector(nw, 5), gb0 = random_vector(nb, 6);
  std::unique_ptr<Conv2dOp> op;
  try {
    op = gpu_->make_conv2d(s);
  } catch (const Error& e) {
    if (e.status() == Status::kNotSupported && !test::gpu_required()) GTEST_SKIP() << e.what();
    throw;
  }
  const ConvResults strict = run_conv(*op, s, c, x, w, b, dy, gw0, gb0);
  ASSERT_TRUE(gpu_->set_allow_tf32(true));
  const ConvResults tf32 = run_conv(*op, s, c, x, w, b, dy, gw0, gb0);
  // 144 products of values in [-1, 1] per output: TF32's operand rounding keeps the result within ~1e-3 of its
  // scale; FP32's is far below.
  EXPECT_LT(normalised_error(tf32.y, strict.y), 4e-3) << "forward";
  EXPECT_LT(normalised_error(tf32.dx, strict.dx), 4e-3) << "backward_data";
  EXPECT_LT(normalised_error(tf32.dw, strict.dw), 4e-3) << "backward_weights";
  ASSERT_TRUE(gpu_->set_allow_tf32(false));
  const ConvResults again = run_conv(*op, s, c, x, w, b, dy, gw0, gb0);
  EXPECT_TRUE(bitwise_equal(again.y, strict.y)) << "forward, TF32 off again";
  EXPECT_TRUE(bitwise_equal(again.dx, strict.dx)) << "backward_data, TF32 off again";
  EXPECT_TRUE(bitwise_equal(again.dw, strict.dw)) << "backward_weights, TF32 off again";
  EXPECT_TRUE(bitwise_equal(again.dw_acc, strict.dw_acc)) << "backward_weights accumulating, TF32 off again";
}

}  // namespace
}  // namespace dpar
