// Elementwise CUDA kernels: activations, dropout, axpy, scale, bfloat16 conversions. The formulas and operation order are the CPU
// twins' (kernels/cpu/kernels.cpp), element by element; see kernels.h for the contracts.
#include "kernels/cuda/kernels.h"
#include "common/f16.h"

#include "kernels/dropout_rng.h"
#include "kernels/cuda/launch.cuh"

namespace dpar::kernels::cuda {

using detail::blocks_for;
using detail::check_count;
using detail::kThreads;

namespace {

constexpr float kSqrt1_2 = 0.70710678118654752440f;     // 1/sqrt(2)
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;  // 1/sqrt(2*pi)

// Out-of-place and in-place (out == inp) use are both fine: element i is read before it is written, by one thread.

// inp (n), out (n)
__global__ void __launch_bounds__(kThreads) relu_forward_kernel(float* out, const float* inp, int64_t n) {
  DPAR_GRID_STRIDE_LOOP(i, n) {
    const float x = inp[i];
    out[i] = x < 0.0f ? 0.0f : x;  // NaN passes through, as torch.relu
  }
}

// dinp (n), dout (n), out (n)
__global__ void __launch_bounds__(kThreads) relu_backward_kernel(float* dinp, const float* dout, const float* out, int64_t n) {
  DPAR_GRID_STRIDE_LOOP(i, n) {
    const float g = dout[i], y = out[i];
    dinp[i] = y <= 0.0f ? 0.0f : g;
  }
}

// out = x * Phi(x) = 0.5 * x * (1 + erf(x / sqrt 2)).  inp (n), out (n)
__global__ void __launch_bounds__(kThreads) gelu_forward_kernel(float* out, const float* inp, int64_t n) {
  DPAR_GRID_STRIDE_LOOP(i, n) {
    const float x = inp[i];
    out[i] = x * 0.5f * (1.0f + erff(x * kSqrt1_2));
  }
}

// dinp = dout * (Phi(x) + x * phi(x)).  dinp (n), dout (n), inp (n)
__global__ void __launch_bounds__(kThreads) gelu_backward_kernel(float* dinp, const float* dout, const float* inp, int64_t n) {
  DPAR_GRID_STRIDE_LOOP(i, n) {
    const float x = inp[i];
    const float cdf = 0.5f * (1.0f + erff(x * kSqrt1_2));
    const float pdf = kInvSqrt2Pi * expf(x * x * -0.5f);
    dinp[i] = dout[i] * (cdf + x * pdf);
  }
}

// inp (n), out (n)
__global__ void __launch_bounds__(kThreads) tanh_forward_kernel(float* out, const float* inp, int64_t n) {
  DPAR_GRID_STRIDE_LOOP(i, n) { out[i] = tanhf(inp[i]); }
}

// dinp = dout * (1 - y^2).  dinp (n), dout (n), out (n)
__global__ void __launch_bounds__(kThreads) tanh_backward_kernel(float* dinp, const float* dout, const float* out, int64_t n) {
  DPAR_GRID_STRIDE_LOOP(i, n) {
    const float y = out[i];
    dinp[i] = dout[i] * (1.0f - y * y);
  }
}

// inp (n), out (n)
__global__ void __launch_bounds__(kThreads) sigmoid_forward_kernel(float* out, const float* inp, int64_t n) {
  DPAR_GRID_STRIDE_LOOP(i, n) { out[i] = 1.0f / (1.0f + expf(-inp[i])); }
}

// dinp = dout * (1 - y) * y.  dinp (n), dout (n), out (n)
__global__ void __launch_bounds__(kThreads) sigmoid_backward_kernel(float* dinp, const float* dout, const float* out, int64_t n) {
  DPAR_GRID_STRIDE_LOOP(i, n) {
    const float y = out[i];
    dinp[i] = dout[i] * (1.0f - y) * y;
  }
}

// Element i is kept iff uniform24(key, offset + i) >= p; mask = kept ? keep_scale : 0; out = inp * mask.
// out (n), mask (n), inp (n)
__global__ void __launch_bounds__(kThreads) dropout_forward_kernel(float* out, float* mask, const float* inp, int64_t n, float p, float keep_scale,
                                       uint64_t key, uint64_t offset) {
  DPAR_GRID_STRIDE_LOOP(i, n) {
    const float u = rng::uniform24(key, offset + static_cast<uint64_t>(i));
    const float m = u >= p ? keep_scale : 0.0f;
    mask[i] = m;
    out[i] = inp[i] * m;
  }
}

// dinp (n), dout (n), mask (n)
__global__ void __launch_bounds__(kThreads) dropout_backward_kernel(float* dinp, const float* dout, const float* mask, int64_t n) {
  DPAR_GRID_STRIDE_LOOP(i, n) { dinp[i] = dout[i] * mask[i]; }
}

// y += a*x.  y (n), x (n)
__global__ void __launch_bounds__(kThreads) axpy_kernel(float* y, const float* x, float a, int64_t n) {
  DPAR_GRID_STRIDE_LOOP(i, n) { y[i] = y[i] + a * x[i]; }
}

// x *= a.  x (n)
__global__ void __launch_bounds__(kThreads) scale_kernel(float* x, float a, int64_t n) {
  DPAR_GRID_STRIDE_LOOP(i, n) { x[i] = x[i] * a; }
}

// dst = src rounded to bfloat16, as common/bf16.h's to_bf16 does it: a NaN keeps its sign and becomes quiet; any
// other value gets half an ulp of bfloat16 added, plus one if the kept part is odd (ties to even), and the low 16
// bits cut.  dst (n), src (n)
__global__ void __launch_bounds__(kThreads) to_bf16_kernel(uint16_t* dst, const float* src, int64_t n) {
  DPAR_GRID_STRIDE_LOOP(i, n) {
    const uint32_t bits = __float_as_uint(src[i]);
    const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
    dst[i] = static_cast<uint16_t>(nan ? (bits >> 16) | 0x0040u : (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  }
}

// dst = src, exactly: a bfloat16 is a float's upper half.  dst (n), src (n)
template <class F>
__global__ void __launch_bounds__(kThreads) pointwise_forward_kernel(float* out, const float* inp, int64_t n) {
  DPAR_GRID_STRIDE_LOOP(i, n) { out[i] = F::forward(inp[i]); }
}
template <class F>
__global__ void __launch_bounds__(kThreads) pointwise_backward_kernel(float* dinp, const float* dout,
                                                                      const float* inp, const float* out, int64_t n) {
  DPAR_GRID_STRIDE_LOOP(i, n) { dinp[i] = F::backward(dout[i], inp ? inp[i] : 0.0f, out ? out[i] : 0.0f); }
}

__global__ void __launch_bounds__(kThreads) from_bf16_kernel(float* dst, const uint16_t* src, int64_t n) {
  DPAR_GRID_STRIDE_LOOP(i, n) { dst[i] = __uint_as_float(static_cast<uint32_t>(src[i]) << 16); }
}

// dst = src rounded to f16 and back, by the CPU twins' definition (common/f16.h).  dst (n), src (n)
__global__ void __launch_bounds__(kThreads) to_f16_kernel(uint16_t* dst, const float* src, int64_t n) {
  DPAR_GRID_STRIDE_LOOP(i, n) { dst[i] = ::dpar::to_f16(src[i]); }
}
__global__ void __launch_bounds__(kThreads) from_f16_kernel(float* dst, const uint16_t* src, int64_t n) {
  DPAR_GRID_STRIDE_LOOP(i, n) { dst[i] = ::dpar::from_f16(src[i]); }
}

}  // namespace

#define DPAR_LAUNCH_ELEMENTWISE(kernel, n, stream, ...)                     \
  do {                                                                      \
    check_count(#kernel, n);                                                \
    if ((n) == 0) return;                                                   \
    detail::launch(#kernel, kernel##_kernel, blocks_for(n), kThreads, stream, __VA_ARGS__); \
  } while (0)

void relu_forward(float* out, const float* inp, int64_t n, cudaStream_t stream) {
  DPAR_LAUNCH_ELEMENTWISE(relu_forward, n, stream, out, inp, n);
}
void relu_backward(float* dinp, const float* dout, const float* out, int64_t n, cudaStream_t stream) {
  DPAR_LAUNCH_ELEMENTWISE(relu_backward, n, stream, dinp, dout, out, n);
}
void gelu_forward(float* out, const float* inp, int64_t n, cudaStream_t stream) {
  DPAR_LAUNCH_ELEMENTWISE(gelu_forward, n, stream, out, inp, n);
}
void gelu_backward(float* dinp, const float* dout, const float* inp, int64_t n, cudaStream_t stream) {
  DPAR_LAUNCH_ELEMENTWISE(gelu_backward, n, stream, dinp, dout, inp, n);
}
void tanh_forward(float* out, const float* inp, int64_t n, cudaStream_t stream) {
  DPAR_LAUNCH_ELEMENTWISE(tanh_forward, n, stream, out, inp, n);
}
void tanh_backward(float* dinp, const float* dout, const float* out, int64_t n, cudaStream_t stream) {
  DPAR_LAUNCH_ELEMENTWISE(tanh_backward, n, stream, dinp, dout, out, n);
}
void sigmoid_forward(float* out, const float* inp, int64_t n, cudaStream_t stream) {
  DPAR_LAUNCH_ELEMENTWISE(sigmoid_forward, n, stream, out, inp, n);
}
void sigmoid_backward(float* dinp, const float* dout, const float* out, int64_t n, cudaStream_t stream) {
  DPAR_LAUNCH_ELEMENTWISE(sigmoid_backward, n, stream, dinp, dout, out, n);
}

template <class F>
void pointwise_forward(float* out, const float* inp, int64_t n, cudaStream_t stream) {
  check_count("pointwise_forward", n);
  if (n == 0) return;
  detail::launch("pointwise_forward", pointwise_forward_kernel<F>, blocks_for(n), kThreads, stream, out, inp, n);
}
template <class F>
void pointwise_backward(float* dinp, const float* dout, const float* inp, const float* out, int64_t n,
                        cudaStream_t stream) {
  check_count("pointwise_backward", n);
  if (n == 0) return;
  detail::launch("pointwise_backward", pointwise_backward_kernel<F>, blocks_for(n), kThreads, stream, dinp, dout, inp,
                 out, n);
}
#define DPAR_INSTANTIATE_POINTWISE(Enum, Struct, name)                                                              \
  template void pointwise_forward<kernels::Struct>(float*, const float*, int64_t, cudaStream_t);                  \
  template void pointwise_backward<kernels::Struct>(float*, const float*, const float*, const float*, int64_t, \
                                                    cudaStream_t);
DPAR_POINTWISE_ACTIVATIONS(DPAR_INSTANTIATE_POINTWISE)
#undef DPAR_INSTANTIATE_POINTWISE

void dropout_forward(float* out, float* mask, const float* inp, int64_t n, float p, uint64_t seed, uint64_t offset,
                     cudaStream_t stream) {
  DPAR_CHECK_ARG(p >= 0.0f && p < 1.0f, "dropout: p must lie in [0, 1), got ", p);
  // The CPU twin's scale: computed in double, rounded once, multiplied (not divided) as PyTorch does.
  const float keep_scale = static_cast<float>(1.0 / (1.0 - static_cast<double>(p)));
  DPAR_LAUNCH_ELEMENTWISE(dropout_forward, n, stream, out, mask, inp, n, p, keep_scale, rng::stream_key(seed), offset);
}
void dropout_backward(float* dinp, const float* dout, const float* mask, int64_t n, cudaStream_t stream) {
  DPAR_LAUNCH_ELEMENTWISE(dropout_backward, n, stream, dinp, dout, mask, n);
}

void axpy(float* y, const float* x, float a, int64_t n, cudaStream_t stream) {
  DPAR_LAUNCH_ELEMENTWISE(axpy, n, stream, y, x, a, n);
}
void scale(float* x, float a, int64_t n, cudaStream_t stream) { DPAR_LAUNCH_ELEMENTWISE(scale, n, stream, x, a, n); }
void to_bf16(uint16_t* dst, const float* src, int64_t n, cudaStream_t stream) {
  DPAR_LAUNCH_ELEMENTWISE(to_bf16, n, stream, dst, src, n);
}
void from_bf16(float* dst, const uint16_t* src, int64_t n, cudaStream_t stream) {
  DPAR_LAUNCH_ELEMENTWISE(from_bf16, n, stream, dst, src, n);
}
void to_f16(uint16_t* dst, const float* src, int64_t n, cudaStream_t stream) {
  DPAR_LAUNCH_ELEMENTWISE(to_f16, n, stream, dst, src, n);
}
void from_f16(float* dst, const uint16_t* src, int64_t n, cudaStream_t stream) {
  DPAR_LAUNCH_ELEMENTWISE(from_f16, n, stream, dst, src, n);
}
void to_low(DType low, uint16_t* dst, const float* src, int64_t n, cudaStream_t stream) {
  DPAR_CHECK_ARG(low == DType::kBF16 || low == DType::kF16, "to_low: ", dtype_name(low), " is not bf16 or f16");
  (low == DType::kBF16 ? to_bf16 : to_f16)(dst, src, n, stream);
}
void from_low(DType low, float* dst, const uint16_t* src, int64_t n, cudaStream_t stream) {
  DPAR_CHECK_ARG(low == DType::kBF16 || low == DType::kF16, "from_low: ", dtype_name(low), " is not bf16 or f16");
  (low == DType::kBF16 ? from_bf16 : from_f16)(dst, src, n, stream);
}

}  // namespace dpar::kernels::cuda
