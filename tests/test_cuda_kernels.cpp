// The CUDA kernels against their CPU twins (the reference), and every backward against finite differences on the
// GPU. Without a GPU the device tests report SKIPPED with the reason; the host-side checks (the dropout stream's
// device code compiled for the host, error mapping, "no device" reporting) run everywhere.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda_test_util.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cuda/kernels.h"
#include "kernels/dropout_rng.h"
#include "platform/cuda/cublas_library.h"
#include "platform/cuda/cuda_check.h"

namespace dpar {
namespace {

namespace cpu = kernels::cpu;
namespace gpu = kernels::cuda;
using test::bitwise_equal;
using test::DeviceBuffer;
using test::normalised_error;
using test::random_vector;
using test::within_ulps;

// ---- Host-side checks: no GPU needed -----------------------------------------------------------------------------

// The measures every kernel test compares with must be able to fail: an infinity in the reference (activation
// inputs include +-inf) once made the normalised error's scale infinite, and so every error 0.
TEST(CudaTestMeasures, InfinitiesAndNaNsMustMatch) {
  const std::vector<float> ref = {1.0f, INFINITY, -2.0f, NAN, -INFINITY};
  EXPECT_EQ(normalised_error(ref, ref), 0.0);
  EXPECT_TRUE(within_ulps(ref, ref, 0));
  auto off = [&](size_t i, float v) {
    auto a = ref;
    a[i] = v;
    return a;
  };
  EXPECT_GT(normalised_error(off(0, 1.5f), ref), 0.1) << "a finite error beside an infinity in the reference";
  EXPECT_FALSE(within_ulps(off(0, 1.5f), ref, 4));
  for (float wrong : {0.0f, 3.0e38f, -INFINITY, NAN}) {
    EXPECT_EQ(normalised_error(off(1, wrong), ref), INFINITY) << "got " << wrong << " for +inf";
    EXPECT_FALSE(within_ulps(off(1, wrong), ref, 4)) << "got " << wrong << " for +inf";
  }
  EXPECT_EQ(normalised_error(off(3, 0.0f), ref), INFINITY) << "a number for NaN";
  EXPECT_EQ(normalised_error(off(2, INFINITY), ref), INFINITY) << "an infinity for a number";
  EXPECT_FALSE(within_ulps(off(2, INFINITY), ref, 4)) << "an infinity for a number";
}

TEST(CudaRuntime, DeviceCountReportsWhyNone) {
  std::string why;
  const int n = cuda::cuda_device_count(&why);
  ASSERT_GE(n, 0);
  if (n == 0) {
    EXPECT_FALSE(why.empty());
    EXPECT_NE(why.find("CUDA"), std::string::npos) << why;
    std::string again;
    EXPECT_EQ(cuda::cuda_device_count(&again), 0);  // asked once, the same answer after
    EXPECT_EQ(again, why);
  }
}

TEST(CudaRuntime, ErrorsNameTheCallAndMapStatuses) {
  try {
    DPAR_CUDA_CHECK(cudaErrorMemoryAllocation, "allocating ", 42, " bytes");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kOutOfMemory);
    const std::string what = e.what();
    EXPECT_NE(what.find("cudaErrorMemoryAllocation"), std::string::npos) << what;
    EXPECT_NE(what.find("allocating 42 bytes"), std::string::npos) << what;
  }
  try {
    DPAR_CUDA_CHECK(cudaErrorInvalidValue, "copy");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kDevice);
    EXPECT_NE(std::string(e.what()).find(cudaGetErrorString(cudaErrorInvalidValue)), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(DPAR_CUDA_CHECK(cudaSuccess, "nothing"));
  try {
    DPAR_CUBLAS_CHECK(CUBLAS_STATUS_NOT_SUPPORTED, "gemm");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kDevice);
    EXPECT_NE(std::string(e.what()).find("CUBLAS_STATUS_NOT_SUPPORTED"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cuda::cublas_error_status(CUBLAS_STATUS_ALLOC_FAILED), Status::kOutOfMemory);
  EXPECT_EQ(cuda::nccl_error_status(ncclRemoteError), Status::kRemote);
  EXPECT_EQ(cuda::nccl_error_status(ncclInvalidUsage), Status::kInvalidArgument);
  EXPECT_EQ(cuda::nccl_error_status(ncclSystemError), Status::kCommunication);
  try {
    DPAR_NCCL_CHECK(ncclInvalidUsage, "all_reduce");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("all_reduce"), std::string::npos) << e.what();
  }
}

// cuBLAS is not linked (libdpar loads without it) but loaded on first use, which needs no GPU: the library of the
// major version dpar was built with, and every function dpar calls.
TEST(CudaCublasLibrary, LoadsOnFirstUseWithEveryFunction) {
  const cuda::CublasLibrary& lib = cuda::cublas();
  EXPECT_NE(lib.create, nullptr);
  EXPECT_NE(lib.destroy, nullptr);
  EXPECT_NE(lib.set_stream, nullptr);
  EXPECT_NE(lib.set_math_mode, nullptr);
  EXPECT_NE(lib.sgemm, nullptr);
  EXPECT_NE(lib.sgemm_strided_batched, nullptr);
  ASSERT_NE(lib.status_string, nullptr);
  EXPECT_NE(lib.path.find("libcublas.so." + std::to_string(CUBLAS_VER_MAJOR)), std::string::npos) << lib.path;
  EXPECT_GT(std::strlen(lib.status_string(CUBLAS_STATUS_NOT_SUPPORTED)), 0u);
  EXPECT_EQ(&cuda::cublas(), &lib);  // loaded once
}

// The device dropout stream is the CPU's, bit for bit: what the CUDA kernels call (kernels/dropout_rng.h),
// compiled for the host here, draws what the CPU kernels draw.
TEST(CudaDropoutStream, HostCompiledDeviceCodeMatchesCpuStream) {
  const uint64_t seeds[] = {0, 1, 2, 42, 0x243F6A8885A308D3ULL, ~0ULL};
  const uint64_t starts[] = {0, 1000, (1ULL << 32) - 5, ~0ULL - 100};
  for (uint64_t seed : seeds) {
    const uint64_t key = kernels::rng::stream_key(seed);
    for (uint64_t start : starts)
      for (uint64_t c = start; c < start + 100; ++c)
        ASSERT_EQ(kernels::rng::uniform24(key, c), cpu::dropout_uniform(seed, c))
            << "seed " << seed << " counter " << c;
  }
}

// ---- Device tests --------------------------------------------------------------------------------------------------

class CudaKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    DPAR_REQUIRE_GPU();
    DPAR_CUDA_CHECK(cudaSetDevice(0), "test device");
    // A blocking stream: the tests' uploads and downloads (cudaMemcpy, on the legacy stream) are ordered with
    // the kernels on it both ways, as a non-blocking stream's would not be.
    DPAR_CUDA_CHECK(cudaStreamCreate(&stream_), "test stream");
    DPAR_CUBLAS_CHECK(cuda::cublas().create(&blas_), "test handle");
    DPAR_CUBLAS_CHECK(cuda::cublas().set_stream(blas_, stream_), "test handle");
  }
  void TearDown() override {
    if (blas_ != nullptr) cuda::cublas().destroy(blas_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  void sync() { DPAR_CUDA_CHECK(cudaStreamSynchronize(stream_), "test sync"); }

  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
};

struct LinearShape {
  int64_t B, C_in, C_out;
};
// Odd sizes, sizes below and above cuBLAS's tiles, and the degenerate ones.
const LinearShape kLinearShapes[] = {{1, 1, 1},    {3, 5, 7},    {17, 33, 9},  {64, 784, 256}, {257, 129, 65},
                                     {128, 256, 10}, {5, 1, 300}, {300, 2, 1}, {0, 4, 3},       {4, 0, 3},
                                     {4, 3, 0}};

TEST_F(CudaKernels, LinearForwardMatchesCpu) {
  uint64_t seed = 1;
  for (const auto& s : kLinearShapes) {
    for (bool with_bias : {true, false}) {
      SCOPED_TRACE(::testing::Message() << "B " << s.B << " C_in " << s.C_in << " C_out " << s.C_out << " bias "
                                        << with_bias);
      const auto inp = random_vector(s.B * s.C_in, seed++), w = random_vector(s.C_out * s.C_in, seed++),
                 bias = random_vector(s.C_out, seed++);
      std::vector<float> ref(s.B * s.C_out, 7.0f);
      cpu::linear_forward(ref.data(), inp.data(), w.data(), with_bias ? bias.data() : nullptr, s.B, s.C_in, s.C_out);
      DeviceBuffer<float> d_inp(inp), d_w(w), d_bias(bias);
      // out starts as NaN: without a bias the GEMM must ignore what out held.
      DeviceBuffer<float> d_out(std::vector<float>(s.B * s.C_out, NAN));
      gpu::linear_forward(d_out.get(), d_inp.get(), d_w.get(), with_bias ? d_bias.get() : nullptr, s.B, s.C_in,
                          s.C_out, blas_, stream_);
      const auto out = d_out.download();
      // A transposed operand or a wrong leading dimension gives an error of order 1; two FP32 summation orders
      // over K <= 784 terms differ by far less than 1e-5 of the output's scale.
      EXPECT_LT(normalised_error(out, ref), 1e-5) << "normalised error";
    }
  }
}

TEST_F(CudaKernels, LinearBackwardMatchesCpu) {
  uint64_t seed = 100;
  for (const auto& s : kLinearShapes) {
    for (bool accumulate : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "B " << s.B << " C_in " << s.C_in << " C_out " << s.C_out << " accumulate "
                                        << accumulate);
      const auto inp = random_vector(s.B * s.C_in, seed++), w = random_vector(s.C_out * s.C_in, seed++),
                 dout = random_vector(s.B * s.C_out, seed++);
      const auto dw0 = random_vector(s.C_out * s.C_in, seed++), db0 = random_vector(s.C_out, seed++);
      std::vector<float> dinp(s.B * s.C_in), dw = dw0, db = db0;
      cpu::linear_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(), s.B, s.C_in, s.C_out,
                           accumulate);
      DeviceBuffer<float> d_inp(inp), d_w(w), d_dout(dout), d_dinp(std::vector<float>(s.B * s.C_in, NAN)),
          d_dw(dw0), d_db(db0);
      gpu::linear_backward(d_dinp.get(), d_dw.get(), d_db.get(), d_dout.get(), d_inp.get(), d_w.get(), s.B, s.C_in,
                           s.C_out, accumulate, blas_, stream_);
      EXPECT_LT(normalised_error(d_dinp.download(), dinp), 1e-5) << "dinp";
      EXPECT_LT(normalised_error(d_dw.download(), dw), 1e-5) << "dweight";
      // The bias gradient sums in double and rounds once, like the CPU: only the order of the double sum differs,
      // which moves the float result by an ulp at most (before the accumulation's add).
      EXPECT_LT(normalised_error(d_db.download(), db), 1e-6) << "dbias";
    }
  }
}

// The fused linear + ReLU against the CPU's: the CPU twin's order (GEMM, then bias, then ReLU), so only the GEMM's
// summation order differs; the backward's dbias is summed in double in the ReLU's pass, as linear_backward sums it.
TEST_F(CudaKernels, LinearReluForwardAndBackwardMatchCpu) {
  uint64_t seed = 300;
  for (const auto& s : kLinearShapes) {
    for (bool with_bias : {true, false}) {
      for (bool accumulate : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "B " << s.B << " C_in " << s.C_in << " C_out " << s.C_out << " bias "
                                          << with_bias << " accumulate " << accumulate);
        const auto inp = random_vector(s.B * s.C_in, seed++), w = random_vector(s.C_out * s.C_in, seed++),
                   bias = random_vector(s.C_out, seed++), dout = random_vector(s.B * s.C_out, seed++);
        const auto dw0 = random_vector(s.C_out * s.C_in, seed++), db0 = random_vector(s.C_out, seed++);
        std::vector<float> out(s.B * s.C_out), dpre(s.B * s.C_out), dinp(s.B * s.C_in), dw = dw0, db = db0;
        const float* b = with_bias ? bias.data() : nullptr;
        cpu::linear_relu_forward(out.data(), inp.data(), w.data(), b, s.B, s.C_in, s.C_out);
        cpu::linear_relu_backward(dinp.data(), dw.data(), with_bias ? db.data() : nullptr, dpre.data(), dout.data(),
                                  out.data(), inp.data(), w.data(), s.B, s.C_in, s.C_out, accumulate);
        DeviceBuffer<float> d_inp(inp), d_w(w), d_bias(bias), d_dout(dout), d_dw(dw0), d_db(db0),
            d_out(std::vector<float>(s.B * s.C_out, NAN)), d_dpre(s.B * s.C_out),
            d_dinp(std::vector<float>(s.B * s.C_in, NAN));
        gpu::linear_relu_forward(d_out.get(), d_inp.get(), d_w.get(), with_bias ? d_bias.get() : nullptr, s.B,
                                 s.C_in, s.C_out, blas_, stream_);
        const auto got = d_out.download();
        EXPECT_LT(normalised_error(got, out), 1e-5) << "out";
        // The backward reads the CPU's out, so that both mask the same elements (an output within rounding of 0
        // could be masked on one side only).
        d_out.upload(out);
        gpu::linear_relu_backward(d_dinp.get(), d_dw.get(), with_bias ? d_db.get() : nullptr, d_dpre.get(),
                                  d_dout.get(), d_out.get(), d_inp.get(), d_w.get(), s.B, s.C_in, s.C_out,
                                  accumulate, blas_, stream_);
        EXPECT_TRUE(bitwise_equal(d_dpre.download(), dpre)) << "dpre: the mask is exact";
        EXPECT_LT(normalised_error(d_dinp.download(), dinp), 1e-5) << "dinp";
        // dweight sums B products whose signs the ReLU's mask leaves mixed: at B = 300 and C_in = 2 the two sums
        // are much smaller than their terms, and two FP32 orders differed by 1.4e-5 of them on an H200.
        EXPECT_LT(normalised_error(d_dw.download(), dw), 1e-4) << "dweight";
        EXPECT_LT(normalised_error(d_db.download(), db), 1e-6) << "dbias (untouched without a bias)";
      }
    }
  }
}

TEST_F(CudaKernels, LinearBackwardSkipsNullOutputsAndIsDeterministic) {
  const int64_t B = 333, C_in = 47, C_out = 29;
  const auto inp = random_vector(B * C_in, 7), w = random_vector(C_out * C_in, 8), dout = random_vector(B * C_out, 9);
  DeviceBuffer<float> d_inp(inp), d_w(w), d_dout(dout), d_dw(C_out * C_in), d_db(C_out);
  gpu::linear_backward(nullptr, d_dw.get(), d_db.get(), d_dout.get(), d_inp.get(), d_w.get(), B, C_in, C_out, false,
                       blas_, stream_);
  const auto dw1 = d_dw.download(), db1 = d_db.download();
  gpu::linear_backward(nullptr, d_dw.get(), nullptr, d_dout.get(), d_inp.get(), d_w.get(), B, C_in, C_out, false,
                       blas_, stream_);
  EXPECT_TRUE(bitwise_equal(d_dw.download(), dw1));
  EXPECT_TRUE(bitwise_equal(d_db.download(), db1)) << "dbias was written although it was null";
}

// Finite differences of L = sum(out * R), computed with the GPU forward, against the GPU backward. L is linear in
// each of inp, weight and bias, so a central difference is exact up to float rounding.
TEST_F(CudaKernels, LinearBackwardMatchesFiniteDifferences) {
  const int64_t B = 7, C_in = 13, C_out = 5;
  auto inp = random_vector(B * C_in, 21), w = random_vector(C_out * C_in, 22), bias = random_vector(C_out, 23);
  const auto R = random_vector(B * C_out, 24);
  DeviceBuffer<float> d_inp(inp), d_w(w), d_bias(bias), d_R(R), d_out(B * C_out), d_dinp(B * C_in),
      d_dw(C_out * C_in), d_db(C_out);
  gpu::linear_backward(d_dinp.get(), d_dw.get(), d_db.get(), d_R.get(), d_inp.get(), d_w.get(), B, C_in, C_out, false,
                       blas_, stream_);
  const auto dinp = d_dinp.download(), dw = d_dw.download(), db = d_db.download();
  auto loss = [&] {
    gpu::linear_forward(d_out.get(), d_inp.get(), d_w.get(), d_bias.get(), B, C_in, C_out, blas_, stream_);
    const auto out = d_out.download();
    double L = 0.0;
    for (size_t i = 0; i < out.size(); ++i) L += static_cast<double>(out[i]) * R[i];
    return L;
  };
  auto check = [&](std::vector<float>& x, DeviceBuffer<float>& d_x, const std::vector<float>& grad, const char* name) {
    const float h = 1e-2f;
    for (size_t i = 0; i < x.size(); i += 3) {
      const float x0 = x[i];
      x[i] = x0 + h;
      d_x.upload(x);
      const double up = loss();
      x[i] = x0 - h;
      d_x.upload(x);
      const double down = loss();
      x[i] = x0;
      d_x.upload(x);
      const double fd = (up - down) / (2.0 * h);
      EXPECT_NEAR(grad[i], fd, 2e-3 * (1.0 + std::fabs(fd))) << name << "[" << i << "]";
    }
  };
  check(inp, d_inp, dinp, "dinp");
  check(w, d_w, dw, "dweight");
  check(bias, d_bias, db, "dbias");
}

// Inputs for activations: random values over a wide range, plus the special ones.
std::vector<float> activation_inputs(size_t n, uint64_t seed) {
  auto x = random_vector(n, seed, -8.0f, 8.0f);
  const float special[] = {0.0f, -0.0f, 1e-30f, -1e-30f, 20.0f, -20.0f, 100.0f, -100.0f, INFINITY, -INFINITY, NAN};
  for (size_t i = 0; i < sizeof(special) / sizeof(special[0]) && i < n; ++i) x[i * 7 % n] = special[i];
  return x;
}

struct Activation {
  const char* name;
  void (*cpu_fwd)(float*, const float*, int64_t);
  void (*cpu_bwd)(float*, const float*, const float*, int64_t);
  void (*gpu_fwd)(float*, const float*, int64_t, cudaStream_t);
  void (*gpu_bwd)(float*, const float*, const float*, int64_t, cudaStream_t);
  bool backward_takes_input;  // gelu: the forward input; the others: the forward output
  int ulps;                   // allowed distance from the CPU twin, element by element (0: bit for bit)
  double normalised;          // or, where ulps < 0, the allowed normalised error
};

::testing::AssertionResult close_to_cpu(const Activation& a, const std::vector<float>& got,
                                        const std::vector<float>& ref) {
  if (a.ulps == 0) return bitwise_equal(got, ref);
  if (a.ulps > 0) return within_ulps(got, ref, a.ulps);
  const double err = normalised_error(got, ref);
  if (err <= a.normalised) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "normalised error " << err << " > " << a.normalised;
}
// SiLU, defined once for both (kernels/pointwise.h), through the generic pointwise kernels.
void cpu_silu_fwd(float* out, const float* inp, int64_t n) { cpu::pointwise_forward<kernels::Silu>(out, inp, n); }
void cpu_silu_bwd(float* dinp, const float* dout, const float* inp, int64_t n) {
  cpu::pointwise_backward<kernels::Silu>(dinp, dout, inp, nullptr, n);
}
void gpu_silu_fwd(float* out, const float* inp, int64_t n, cudaStream_t s) {
  gpu::pointwise_forward<kernels::Silu>(out, inp, n, s);
}
void gpu_silu_bwd(float* dinp, const float* dout, const float* inp, int64_t n, cudaStream_t s) {
  gpu::pointwise_backward<kernels::Silu>(dinp, dout, inp, nullptr, n, s);
}

const Activation kActivations[] = {
    {"relu", cpu::relu_forward, cpu::relu_backward, gpu::relu_forward, gpu::relu_backward, false, 0, 0.0},
    // erff, expf and tanhf are within 2 ulp of the true value in CUDA and in glibc, so within 4 of each other.
    // GELU's 1 + erf(x/sqrt 2) cancels for negative x (an ulp of erf near -1 is a large part of the sum), so it
    // is compared by its normalised error rather than element by element.
    {"gelu", cpu::gelu_forward, cpu::gelu_backward, gpu::gelu_forward, gpu::gelu_backward, true, -1, 1e-6},
    {"tanh", cpu::tanh_forward, cpu::tanh_backward, gpu::tanh_forward, gpu::tanh_backward, false, 4, 0.0},
    {"sigmoid", cpu::sigmoid_forward, cpu::sigmoid_backward, gpu::sigmoid_forward, gpu::sigmoid_backward, false, 4,
     0.0},
    // expf within 2 ulp on each side; the quotient and products add a few more: compared as GELU is.
    {"silu", cpu_silu_fwd, cpu_silu_bwd, gpu_silu_fwd, gpu_silu_bwd, true, -1, 1e-6},
};

TEST_F(CudaKernels, ActivationsMatchCpu) {
  for (const auto& a : kActivations) {
    for (int64_t n : {1, 31, 1000, 100003}) {
      SCOPED_TRACE(::testing::Message() << a.name << " n " << n);
      const auto x = activation_inputs(n, 1000 + n), dout = random_vector(n, 2000 + n);
      std::vector<float> y(n), dx(n);
      a.cpu_fwd(y.data(), x.data(), n);
      a.cpu_bwd(dx.data(), dout.data(), a.backward_takes_input ? x.data() : y.data(), n);
      DeviceBuffer<float> d_x(x), d_y(n), d_dout(dout), d_dx(n);
      a.gpu_fwd(d_y.get(), d_x.get(), n, stream_);
      const auto y_gpu = d_y.download();
      EXPECT_TRUE(close_to_cpu(a, y_gpu, y)) << "forward";
      // The backward from the CPU's forward values, so that only the backward is compared.
      DeviceBuffer<float> d_saved(a.backward_takes_input ? x : y);
      a.gpu_bwd(d_dx.get(), d_dout.get(), d_saved.get(), n, stream_);
      EXPECT_TRUE(close_to_cpu(a, d_dx.download(), dx)) << "backward";
      // In place (out == inp) gives the same as out of place.
      a.gpu_fwd(d_x.get(), d_x.get(), n, stream_);
      EXPECT_TRUE(bitwise_equal(d_x.download(), y_gpu)) << "in place";
    }
  }
}

TEST_F(CudaKernels, ActivationBackwardMatchesFiniteDifferences) {
  const int64_t n = 200;
  // Away from relu's kink at 0, where the difference quotient is not the derivative.
  auto x = random_vector(n, 77, -3.0f, 3.0f);
  for (auto& v : x)
    if (std::fabs(v) < 0.05f) v = 0.5f;
  const std::vector<float> ones(n, 1.0f);
  for (const auto& a : kActivations) {
    SCOPED_TRACE(a.name);
    const float h = 1e-2f;
    std::vector<float> up(n), down(n);
    for (int64_t i = 0; i < n; ++i) {
      up[i] = x[i] + h;
      down[i] = x[i] - h;
    }
    DeviceBuffer<float> d_x(x), d_up(up), d_down(down), d_y(n), d_yu(n), d_yd(n), d_ones(ones), d_dx(n);
    a.gpu_fwd(d_y.get(), d_x.get(), n, stream_);
    a.gpu_fwd(d_yu.get(), d_up.get(), n, stream_);
    a.gpu_fwd(d_yd.get(), d_down.get(), n, stream_);
    a.gpu_bwd(d_dx.get(), d_ones.get(), a.backward_takes_input ? d_x.get() : d_y.get(), n, stream_);
    const auto yu = d_yu.download(), yd = d_yd.download(), dx = d_dx.download();
    for (int64_t i = 0; i < n; ++i) {
      // Up and down are rounded to float: divide by the step actually taken.
      const double fd = (static_cast<double>(yu[i]) - yd[i]) / (static_cast<double>(up[i]) - down[i]);
      EXPECT_NEAR(dx[i], fd, 2e-3 + 2e-3 * std::fabs(fd)) << "x = " << x[i];
    }
  }
}

TEST_F(CudaKernels, DropoutMasksAreTheCpuMasksBitForBit) {
  for (float p : {0.0f, 0.1f, 0.5f, 0.9f}) {
    for (int64_t n : {1, 33, 4097, 100001}) {
      for (uint64_t offset : {uint64_t{0}, uint64_t{12345}, (uint64_t{1} << 33) + 7}) {
        SCOPED_TRACE(::testing::Message() << "p " << p << " n " << n << " offset " << offset);
        const uint64_t seed = 99 + static_cast<uint64_t>(n);
        const auto x = random_vector(n, seed), dout = random_vector(n, seed + 1);
        std::vector<float> out(n), mask(n), dx(n);
        cpu::dropout_forward(out.data(), mask.data(), x.data(), n, p, seed, offset);
        cpu::dropout_backward(dx.data(), dout.data(), mask.data(), n);
        DeviceBuffer<float> d_x(x), d_out(n), d_mask(n), d_dout(dout), d_dx(n);
        gpu::dropout_forward(d_out.get(), d_mask.get(), d_x.get(), n, p, seed, offset, stream_);
        gpu::dropout_backward(d_dx.get(), d_dout.get(), d_mask.get(), n, stream_);
        ASSERT_TRUE(bitwise_equal(d_mask.download(), mask)) << "mask";
        EXPECT_TRUE(bitwise_equal(d_out.download(), out)) << "out";
        EXPECT_TRUE(bitwise_equal(d_dx.download(), dx)) << "dinp";
      }
    }
  }
  // A stream continued in two calls is the stream drawn in one.
  const int64_t n = 1000, k = 377;
  const auto x = random_vector(n, 5);
  DeviceBuffer<float> d_x(x), d_out(n), d_mask(n), d_out2(n), d_mask2(n);
  gpu::dropout_forward(d_out.get(), d_mask.get(), d_x.get(), n, 0.3f, 8, 100, stream_);
  gpu::dropout_forward(d_out2.get(), d_mask2.get(), d_x.get(), k, 0.3f, 8, 100, stream_);
  gpu::dropout_forward(d_out2.get() + k, d_mask2.get() + k, d_x.get() + k, n - k, 0.3f, 8, 100 + k, stream_);
  EXPECT_TRUE(bitwise_equal(d_mask2.download(), d_mask.download()));
}

// Reads a device double.
double download_double(const DeviceBuffer<double>& d) { return d.download().at(0); }

TEST_F(CudaKernels, CrossEntropyMatchesCpu) {
  struct Shape {
    int64_t B, C;
  };
  uint64_t seed = 500;
  for (const Shape s : {Shape{1, 1}, Shape{1, 10}, Shape{7, 3}, Shape{128, 10}, Shape{1025, 17}, Shape{3000, 1000},
                        Shape{0, 5}}) {
    SCOPED_TRACE(::testing::Message() << "B " << s.B << " C " << s.C);
    auto logits = random_vector(s.B * s.C, seed++, -10.0f, 10.0f);
    if (s.B > 1) logits[s.C] = 1e4f;  // a huge logit: stable only with the max subtracted
    std::vector<int32_t> labels(s.B);
    Rng rng(seed++);
    for (auto& l : labels) l = static_cast<int32_t>(rng.below(static_cast<uint64_t>(s.C)));
    // Every fifth row from the third on is ignored (PyTorch's ignore_index): no loss, a zero gradient row.
    for (int64_t b = 2; b < s.B; b += 5) labels[static_cast<size_t>(b)] = kIgnoreIndex;
    const float grad_scale = s.B > 0 ? 1.0f / static_cast<float>(s.B) : 1.0f;
    std::vector<float> dlogits(s.B * s.C);
    const double loss = cpu::cross_entropy_forward_backward(dlogits.data(), logits.data(), labels.data(), s.B, s.C,
                                                            grad_scale);
    DeviceBuffer<float> d_logits(logits), d_dlogits(s.B * s.C);
    DeviceBuffer<int32_t> d_labels(labels);
    DeviceBuffer<double> d_loss(1), d_loss2(1);
    gpu::cross_entropy_forward_backward(d_loss.get(), d_dlogits.get(), d_logits.get(), d_labels.get(), s.B, s.C,
                                        grad_scale, stream_);
    gpu::cross_entropy_forward_backward(d_loss2.get(), nullptr, d_logits.get(), d_labels.get(), s.B, s.C, grad_scale,
                                        stream_);
    const double loss_gpu = download_double(d_loss);
    EXPECT_NEAR(loss_gpu, loss, 1e-6 * (1.0 + std::fabs(loss)));
    EXPECT_EQ(download_double(d_loss2), loss_gpu) << "the loss alone differs from the loss with its gradient";
    // expf differs by an ulp or two between CUDA and glibc; the softmax divides by a sum of such terms.
    EXPECT_LT(normalised_error(d_dlogits.download(), dlogits), 1e-6);
    const std::vector<float> got = d_dlogits.download();
    for (int64_t b = 2; b < s.B; b += 5)
      for (int64_t j = 0; j < s.C; ++j) ASSERT_EQ(got[static_cast<size_t>(b * s.C + j)], 0.0f) << "ignored row " << b;
    gpu::cross_entropy_forward_backward(d_loss2.get(), d_dlogits.get(), d_logits.get(), d_labels.get(), s.B, s.C,
                                        grad_scale, stream_);
    EXPECT_EQ(download_double(d_loss2), loss_gpu) << "not deterministic";
  }
}

TEST_F(CudaKernels, CrossEntropyBadLabelGivesNanNotACrash) {
  const std::vector<float> logits = random_vector(2 * 4, 3);
  const std::vector<int32_t> labels = {1, 4};  // 4 is outside [0, 4)
  DeviceBuffer<float> d_logits(logits), d_dlogits(8);
  DeviceBuffer<int32_t> d_labels(labels);
  DeviceBuffer<double> d_loss(1);
  gpu::cross_entropy_forward_backward(d_loss.get(), d_dlogits.get(), d_logits.get(), d_labels.get(), 2, 4, 1.0f,
                                      stream_);
  EXPECT_TRUE(std::isnan(download_double(d_loss)));
  EXPECT_THROW(gpu::cross_entropy_forward_backward(d_loss.get(), nullptr, d_logits.get(), d_labels.get(), 2, 0, 1.0f,
                                                   stream_),
               Error);
}

TEST_F(CudaKernels, MseMatchesCpu) {
  struct Shape {
    int64_t B, D;
  };
  uint64_t seed = 700;
  for (const Shape s : {Shape{1, 1}, Shape{3, 7}, Shape{128, 10}, Shape{2049, 33}, Shape{0, 3}}) {
    SCOPED_TRACE(::testing::Message() << "B " << s.B << " D " << s.D);
    const auto pred = random_vector(s.B * s.D, seed++), target = random_vector(s.B * s.D, seed++);
    const float grad_scale = 0.37f;
    std::vector<float> dpred(s.B * s.D);
    const double loss = cpu::mse_forward_backward(dpred.data(), pred.data(), target.data(), s.B, s.D, grad_scale);
    DeviceBuffer<float> d_pred(pred), d_target(target), d_dpred(s.B * s.D);
    DeviceBuffer<double> d_loss(1);
    gpu::mse_forward_backward(d_loss.get(), d_dpred.get(), d_pred.get(), d_target.get(), s.B, s.D, grad_scale,
                              stream_);
    // Each row's loss is the CPU's to the bit; only the order of the sum over rows differs.
    EXPECT_NEAR(download_double(d_loss), loss, 1e-12 * (1.0 + loss));
    EXPECT_TRUE(bitwise_equal(d_dpred.download(), dpred)) << "dpred";
  }
}

// dlogits and dpred against central differences of the GPU's own loss (grad_scale 1, so the gradient is d sum).
TEST_F(CudaKernels, LossGradientsMatchFiniteDifferences) {
  const int64_t B = 5, C = 7;
  auto logits = random_vector(B * C, 31, -2.0f, 2.0f);
  const std::vector<int32_t> labels = {0, 6, 3, 3, 1};
  auto target = random_vector(B * C, 32);
  DeviceBuffer<float> d_logits(logits), d_grad(B * C), d_target(target);
  DeviceBuffer<int32_t> d_labels(labels);
  DeviceBuffer<double> d_loss(1);
  for (int which = 0; which < 2; ++which) {
    const bool ce = which == 0;
    SCOPED_TRACE(ce ? "cross entropy" : "mse");
    auto run = [&](bool with_grad) {
      float* g = with_grad ? d_grad.get() : nullptr;
      if (ce)
        gpu::cross_entropy_forward_backward(d_loss.get(), g, d_logits.get(), d_labels.get(), B, C, 1.0f, stream_);
      else
        gpu::mse_forward_backward(d_loss.get(), g, d_logits.get(), d_target.get(), B, C, 1.0f, stream_);
      return download_double(d_loss);
    };
    run(true);
    const auto grad = d_grad.download();
    for (int64_t i = 0; i < B * C; ++i) {
      const float x0 = logits[i], h = 1e-2f;
      logits[i] = x0 + h;
      d_logits.upload(logits);
      const double up = run(false);
      const float xu = logits[i];
      logits[i] = x0 - h;
      d_logits.upload(logits);
      const double down = run(false);
      const float xd = logits[i];
      logits[i] = x0;
      d_logits.upload(logits);
      const double fd = (up - down) / (static_cast<double>(xu) - xd);
      EXPECT_NEAR(grad[i], fd, 1e-3 + 1e-3 * std::fabs(fd)) << "element " << i;
    }
  }
}

TEST_F(CudaKernels, SgdMatchesCpuBitForBit) {
  const dpar::SgdHyper variants[] = {
      {0.1f, 0.0f, 0.0f, 0.0f, false},   {0.05f, 0.9f, 0.0f, 0.0f, false}, {0.05f, 0.9f, 0.1f, 1e-2f, false},
      {0.01f, 0.9f, 0.0f, 1e-3f, true}, {0.2f, 0.0f, 0.0f, 5e-4f, false},
  };
  for (const auto& h : variants) {
    for (int64_t n : {1, 1001, 65537}) {
      SCOPED_TRACE(::testing::Message() << "lr " << h.lr << " momentum " << h.momentum << " dampening " << h.dampening
                                        << " wd " << h.weight_decay << " nesterov " << h.nesterov << " n " << n);
      auto p = random_vector(n, 1), buf = std::vector<float>(n, 0.0f);
      DeviceBuffer<float> d_p(p), d_buf(buf), d_g(n);
      for (int step = 0; step < 3; ++step) {
        const auto g = random_vector(n, 10 + step);
        cpu::sgd_step(p.data(), h.momentum != 0.0f ? buf.data() : nullptr, g.data(), n, h, step == 0);
        d_g.upload(g);
        gpu::sgd_step(d_p.get(), h.momentum != 0.0f ? d_buf.get() : nullptr, d_g.get(), n, h, step == 0, stream_);
      }
      EXPECT_TRUE(bitwise_equal(d_p.download(), p)) << "param";
      if (h.momentum != 0.0f) {
        EXPECT_TRUE(bitwise_equal(d_buf.download(), buf)) << "momentum";
      }
    }
  }
}

TEST_F(CudaKernels, AdamAndAdamWMatchCpuBitForBit) {
  const dpar::AdamHyper variants[] = {
      {1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, false},  {1e-3f, 0.9f, 0.999f, 1e-8f, 1e-2f, false},
      {1e-3f, 0.9f, 0.999f, 1e-8f, 1e-2f, true},  {3e-2f, 0.3f, 0.99f, 1e-6f, 0.0f, true},  // lerp's other branch
  };
  for (const auto& h : variants) {
    for (int64_t n : {1, 777, 100003}) {
      SCOPED_TRACE(::testing::Message() << "lr " << h.lr << " beta1 " << h.beta1 << " wd " << h.weight_decay
                                        << " decoupled " << h.decoupled << " n " << n);
      auto p = random_vector(n, 2);
      std::vector<float> m(n, 0.0f), v(n, 0.0f);
      DeviceBuffer<float> d_p(p), d_m(m), d_v(v), d_g(n);
      for (int64_t step = 1; step <= 5; ++step) {
        auto g = random_vector(n, 20 + step);
        if (step == 3) g[0] = 0.0f;  // v small, denom near eps
        cpu::adam_step(p.data(), m.data(), v.data(), g.data(), n, h, step);
        d_g.upload(g);
        gpu::adam_step(d_p.get(), d_m.get(), d_v.get(), d_g.get(), n, h, step, stream_);
      }
      EXPECT_TRUE(bitwise_equal(d_m.download(), m)) << "exp_avg";
      EXPECT_TRUE(bitwise_equal(d_v.download(), v)) << "exp_avg_sq";
      EXPECT_TRUE(bitwise_equal(d_p.download(), p)) << "param";
    }
  }
}

TEST_F(CudaKernels, AxpyAndScaleMatchCpuBitForBit) {
  for (int64_t n : {1, 257, 100001}) {
    auto y = random_vector(n, 3), x = random_vector(n, 4);
    DeviceBuffer<float> d_y(y), d_x(x);
    cpu::axpy(y.data(), x.data(), -0.3f, n);
    cpu::scale(y.data(), 1.7f, n);
    gpu::axpy(d_y.get(), d_x.get(), -0.3f, n, stream_);
    gpu::scale(d_y.get(), 1.7f, n, stream_);
    EXPECT_TRUE(bitwise_equal(d_y.download(), y)) << "n " << n;
  }
  EXPECT_THROW(gpu::scale(nullptr, 1.0f, -1, stream_), Error);
}

TEST_F(CudaKernels, Bf16ConversionsMatchCpuBitForBit) {
  // Random bits over every exponent (NaNs and infinities among them), ties, and every bfloat16 back.
  for (int64_t n : {1, 257, 65536, 100003}) {
    std::vector<float> x(static_cast<size_t>(n));
    std::mt19937 gen(static_cast<uint32_t>(n));
    for (auto& v : x) {
      const uint32_t b = static_cast<uint32_t>(gen()) & (gen() % 4 == 0 ? 0xffff8000u : 0xffffffffu);  // ties too
      std::memcpy(&v, &b, sizeof v);
    }
    std::vector<uint16_t> want(x.size());
    cpu::to_bf16(want.data(), x.data(), n);
    DeviceBuffer<float> d_x(x), d_wide(n);
    DeviceBuffer<uint16_t> d_h(n);
    gpu::to_bf16(d_h.get(), d_x.get(), n, stream_);
    EXPECT_EQ(d_h.download(), want) << "to_bf16, n " << n;
    std::vector<float> wide(x.size());
    cpu::from_bf16(wide.data(), want.data(), n);
    gpu::from_bf16(d_wide.get(), d_h.get(), n, stream_);
    EXPECT_TRUE(bitwise_equal(d_wide.download(), wide)) << "from_bf16, n " << n;
  }
  EXPECT_THROW(gpu::to_bf16(nullptr, nullptr, -1, stream_), Error);
}

TEST_F(CudaKernels, SumSquaresMatchesCpuWithinDoubleRoundingAndRepeatsItsBits) {
  DeviceBuffer<double> scratch(gpu::kSumSquaresBlocks + 1);
  double* partials = scratch.get();
  double* total = scratch.get() + gpu::kSumSquaresBlocks;
  for (int64_t n : {0, 1, 255, 256, 257, 65537, 1000003}) {
    const auto x = random_vector(n, 11);
    DeviceBuffer<float> d_x(x);
    const double expected = cpu::sum_squares(x.data(), n);
    gpu::sum_squares(total, partials, d_x.get(), n, stream_);
    const double first = scratch.download()[gpu::kSumSquaresBlocks];
    gpu::sum_squares(total, partials, d_x.get(), n, stream_);
    const double again = scratch.download()[gpu::kSumSquaresBlocks];
    // Terms are exact and positive: two orders of adding them differ by at most n roundings of the total.
    EXPECT_LE(std::abs(first - expected), 1e-15 * static_cast<double>(n + 1) * expected) << "n " << n;
    EXPECT_EQ(first, again) << "n " << n << ": the same bits on every call";
  }
  EXPECT_THROW(gpu::sum_squares(total, partials, nullptr, -1, stream_), Error);
}

// The threads backend's pass, on the host: contributors added in buffer order from the first one, then scaled.
std::vector<float> host_sum(const std::vector<std::vector<float>>& bufs, const std::vector<uint8_t>& contributes,
                            float scale) {
  std::vector<float> out(bufs[0].size(), 0.0f);
  for (size_t i = 0; i < out.size(); ++i) {
    bool any = false;
    float s = 0.0f;
    for (size_t b = 0; b < bufs.size(); ++b) {
      if (!contributes[b]) continue;
      s = any ? s + bufs[b][i] : bufs[b][i];
      any = true;
    }
    out[i] = scale != 1.0f ? s * scale : s;
  }
  return out;
}

TEST_F(CudaKernels, SumSliceIntoAllMatchesTheThreadsPass) {
  for (int nb : {1, 2, 3, 8, 64}) {  // 64: every bit of the contributes mask
    for (int pattern = 0; pattern < 3; ++pattern) {
      SCOPED_TRACE(::testing::Message() << nb << " buffers, pattern " << pattern);
      const int64_t n = 10007;
      std::vector<std::vector<float>> host;
      std::vector<std::unique_ptr<DeviceBuffer<float>>> dev;
      std::vector<float*> ptrs;
      std::vector<uint8_t> contributes;
      for (int b = 0; b < nb; ++b) {
        host.push_back(random_vector(n, 40 + b));
        host.back()[5] = -0.0f;  // -0 alone stays -0
        dev.push_back(std::make_unique<DeviceBuffer<float>>(host.back()));
        ptrs.push_back(dev.back()->get());
        contributes.push_back(pattern == 0 ? 1 : pattern == 1 ? static_cast<uint8_t>(b % 2 == 1) : 0);
      }
      const float scale = pattern == 0 ? 1.0f : 0.25f;
      const auto expected = host_sum(host, contributes, scale);
      gpu::SumBuffers buffers{};
      buffers.count = nb;
      for (int b = 0; b < nb; ++b) {
        buffers.buffer[b] = ptrs[b];
        if (contributes[b]) buffers.contributes |= uint64_t{1} << b;
      }
      // Three participants' slices, as the device group cuts them, each launched separately.
      const int64_t cuts[] = {0, 3333, 6672, n};
      for (int r = 0; r < 3; ++r) gpu::sum_slice_into_all(buffers, cuts[r], cuts[r + 1], scale, stream_);
      for (int b = 0; b < nb; ++b) EXPECT_TRUE(bitwise_equal(dev[b]->download(), expected)) << "buffer " << b;
    }
  }
}

// A "not ready" left in the thread's last-error slot by an event query must not fail the next launch (launches
// check their own status), and dpar's own polls leave nothing there (cuda::query_event), since cuBLAS reads the
// slot after its launches. The engine's communication thread polls events between its kernels.
TEST_F(CudaKernels, LaunchAfterANotReadyQuerySucceeds) {
  // Allocated and filled before the stream is held: a device allocation may synchronize the whole device (CUDA's
  // implicit synchronization), and would then wait forever for the held stream (it hung there on an H200).
  DeviceBuffer<float> x(std::vector<float>(1000, 2.0f));
  // The kernel launched below is launched once first, for the same reason: CUDA loads a module's kernels at their
  // first launch (lazy loading, the default since CUDA 12), and loading may wait for the whole device too (it hung
  // there on an H200 after the allocation was moved).
  gpu::scale(x.get(), 1.0f, 1000, stream_);
  sync();
  cudaStream_t held = nullptr;
  DPAR_CUDA_CHECK(cudaStreamCreateWithFlags(&held, cudaStreamNonBlocking), "held stream");
  std::atomic<bool> release{false};
  // Holds `held` until the test releases it: its event stays not ready for as long as the test needs.
  DPAR_CUDA_CHECK(cudaLaunchHostFunc(
                      held,
                      [](void* flag) {
                        while (!static_cast<std::atomic<bool>*>(flag)->load())
                          std::this_thread::sleep_for(std::chrono::milliseconds(1));
                      },
                      &release),
                  "hold the stream");
  cudaEvent_t event = nullptr;
  DPAR_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "event");
  DPAR_CUDA_CHECK(cudaEventRecord(event, held), "record");
  struct Release {
    std::atomic<bool>& flag;
    cudaStream_t stream;
    cudaEvent_t event;
    ~Release() {
      flag.store(true);
      cudaStreamSynchronize(stream);
      cudaEventDestroy(event);
      cudaStreamDestroy(stream);
    }
  } guard{release, held, event};

  ASSERT_EQ(cudaEventQuery(event), cudaErrorNotReady);  // the raw query: its answer stays in the slot
  EXPECT_NO_THROW(gpu::scale(x.get(), 0.5f, 1000, stream_)) << "a launch failed on an earlier query's answer";
  (void)cudaGetLastError();
  EXPECT_EQ(cuda::query_event(event), cudaErrorNotReady);
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess) << "query_event left its \"not ready\" in the last-error slot";
  EXPECT_NO_THROW(gpu::scale(x.get(), 0.5f, 1000, stream_));
  sync();
  release.store(true);
  DPAR_CUDA_CHECK(cudaStreamSynchronize(held), "release");
  EXPECT_EQ(cuda::query_event(event), cudaSuccess);
  EXPECT_TRUE(bitwise_equal(x.download(), std::vector<float>(1000, 0.5f)));
}

// A thread that never used CUDA gets no context back from a DeviceScope: restoring cudaGetDevice()'s answer (0 on
// such a thread) would create a context on GPU 0 in every process of a job of one GPU per process. A thread that
// chose a device gets it back.
TEST(CudaRuntime, DeviceScopeRestoresOnlyAContextThatExisted) {
  DPAR_REQUIRE_GPU();
  const int last = cuda::cuda_device_count() - 1;
  std::thread([&] {
    EXPECT_FALSE(cuda::thread_has_context()) << "a new thread has no context";
    {
      cuda::DeviceScope scope(last);
      DPAR_CUDA_CHECK(cudaFree(nullptr), "a call in the scope");  // binds the device's context to the thread
      int current = -1;
      DPAR_CUDA_CHECK(cudaGetDevice(&current), "current device");
      EXPECT_EQ(current, last);
      EXPECT_TRUE(cuda::thread_has_context());
    }
    EXPECT_FALSE(cuda::thread_has_context()) << "the scope left its context current on a thread that had none";
    EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
  }).join();
  std::thread([&] {
    DPAR_CUDA_CHECK(cudaSetDevice(0), "the thread's own device");
    {
      cuda::DeviceScope scope(last);
      DPAR_CUDA_CHECK(cudaFree(nullptr), "a call in the scope");
    }
    int current = -1;
    DPAR_CUDA_CHECK(cudaGetDevice(&current), "current device");
    EXPECT_EQ(current, 0);
    EXPECT_TRUE(cuda::thread_has_context());
  }).join();
}

}  // namespace
}  // namespace dpar
