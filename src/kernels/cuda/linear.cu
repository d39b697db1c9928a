// The linear layer on CUDA: GEMMs through cuBLAS, bias through two small kernels.
//
// Row-major through a column-major library. cuBLAS reads a row-major matrix X (r,c) with leading dimension c as
// the column-major matrix X^T (c,r), and writes C = op(A) op(B) column-major. So a row-major product
// Y (M,N) = P (M,K) Q (K,N) is computed as the column-major Y^T (N,M) = Q^T (N,K) P^T (K,M): pass Q first, P second,
// m = N, n = M, and each operand's "transposed" flag flips relative to the row-major formula.
//
// Precision: cublasSgemm in FP32. The handle must be in CUBLAS_DEFAULT_MATH or CUBLAS_PEDANTIC_MATH (a new
// handle's default) for the CPU twin's precision: CUBLAS_TF32_TENSOR_OP_MATH (TF32 keeps 10 mantissa bits, the CPU
// twin 23) only where the stream was asked for TF32 (Stream::set_allow_tf32). Mixed precision (the *_mixed
// functions, bf16 or f16 operands): cublasGemmEx with bf16 (CUDA_R_16BF) or f16 (CUDA_R_16F) A and B, an f32 C and
// CUBLAS_COMPUTE_32F (products of bf16 or f16 values are exact in f32 and are summed in f32; tensor cores, whatever
// the math mode); the bias, the epilogue and the bias gradient are the f32 kernels' passes, on f32 values. cuBLAS's
// default atomics mode (not allowed) keeps its results the same call after call on one GPU.
#include "kernels/cuda/kernels.h"

#include <limits>
#include <type_traits>

#include "platform/cuda/cublas_library.h"
#include "kernels/cuda/launch.cuh"

namespace dpar::kernels::cuda {

using detail::blocks_for;
using detail::kThreads;

namespace {

// C (m,n) f32 = alpha op(A) op(B) + beta C, column-major, from the library loaded on first use
// (platform/cuda/cublas_library.h). Operands of type T: float through SGEMM (the f32 kernels' call, unchanged), or
// 16-bit ones (their bits, uint16_t) of the dtype `low` (bf16 or f16) through GemmEx accumulating in f32 into the
// f32 C.
template <class T>
cublasStatus_t gemm(DType low, cublasHandle_t blas, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                    const float* alpha, const T* A, int lda, const T* B, int ldb, const float* beta, float* C,
                    int ldc) {
  if constexpr (std::is_same_v<T, float>) {
    (void)low;
    return ::dpar::cuda::cublas().sgemm(blas, ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc);
  } else {
    static_assert(std::is_same_v<T, uint16_t>, "a GEMM's operands are f32, bf16 or f16");
    const cudaDataType ab = low == DType::kF16 ? CUDA_R_16F : CUDA_R_16BF;
    return ::dpar::cuda::cublas().gemm_ex(blas, ta, tb, m, n, k, alpha, A, ab, lda, B, ab, ldb, beta, C, CUDA_R_32F,
                                          ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  }
}

// A mixed-precision call's dtype: bf16 or f16.
void check_low(DType low, const char* what) {
  DPAR_CHECK_ARG(low == DType::kBF16 || low == DType::kF16, what, ": ", dtype_name(low),
                 " is not a mixed-precision dtype (bf16, f16)");
}

// cuBLAS takes 32-bit extents.
int blas_dim(int64_t v, const char* name) {
  DPAR_CHECK_ARG(v >= 0 && v <= static_cast<int64_t>(std::numeric_limits<int>::max()), "linear: ", name, " = ", v,
                 " is out of the BLAS range");
  return static_cast<int>(v);
}

// out[b, j] = bias[j].  out (B,C_out), bias (C_out)
__global__ void __launch_bounds__(kThreads) bias_broadcast_kernel(float* out, const float* bias, int64_t B, int64_t C_out) {
  DPAR_GRID_STRIDE_LOOP(i, B * C_out) { out[i] = bias[i % C_out]; }
}

// dbias[j] (=|+=) sum over b of dout[b, j], accumulated in double and rounded once, as the CPU twin does.
// One block per tile of kTile columns: thread (x, y) sums rows y, y + kRows, ... of column x in row order, then
// the kRows partial sums of a column are added in a fixed tree. No atomics: the same bits on every call.
// dbias (C_out), dout (B,C_out)
constexpr int kTile = 32, kRows = 32;
__global__ void __launch_bounds__(kTile * kRows) bias_backward_kernel(float* dbias, const float* dout, int64_t B, int64_t C_out, bool accumulate) {
  __shared__ double partial[kRows][kTile + 1];  // +1: no bank conflicts on the column reads below
  const int x = threadIdx.x, y = threadIdx.y;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kTile + x;
  double acc = 0.0;
  if (j < C_out) {
    for (int64_t b = y; b < B; b += kRows) acc += static_cast<double>(dout[b * C_out + j]);
  }
  partial[y][x] = acc;
  __syncthreads();
  for (int stride = kRows / 2; stride > 0; stride /= 2) {
    if (y < stride) partial[y][x] += partial[y + stride][x];
    __syncthreads();
  }
  if (y == 0 && j < C_out) {
    const float sum = static_cast<float>(partial[0][x]);
    dbias[j] = accumulate ? dbias[j] + sum : sum;
  }
}

// out[b, j] = relu(out[b, j] + bias[j]) (bias null: relu alone), in place after a GEMM with beta 0: the CPU twin's
// order (the GEMM's value, then the bias added, then the ReLU), one pass over out where a bias broadcast before the
// GEMM, the GEMM's read of it (beta 1) and a ReLU after it were three. out (B,C_out), bias (C_out) or null
__global__ void __launch_bounds__(kThreads) bias_relu_kernel(float* out, const float* bias, int64_t B, int64_t C_out) {
  DPAR_GRID_STRIDE_LOOP(i, B * C_out) {
    const float x = bias != nullptr ? out[i] + bias[i % C_out] : out[i];
    out[i] = x < 0.0f ? 0.0f : x;  // NaN passes through, as torch.relu
  }
}

// The ReLU's backward and the bias gradient in one pass: dpre[b, j] = out[b, j] <= 0 ? 0 : dout[b, j], and
// dbias[j] (=|+=) the column sums of dpre, laid out and summed as bias_backward_kernel sums (the same bits).
// dbias may be null (no bias). dpre (B,C_out), dout (B,C_out), out (B,C_out), dbias (C_out)
__global__ void __launch_bounds__(kTile * kRows) relu_backward_bias_kernel(float* dpre, float* dbias, const float* dout,
                                                                           const float* out, int64_t B, int64_t C_out,
                                                                           bool accumulate) {
  __shared__ double partial[kRows][kTile + 1];
  const int x = threadIdx.x, y = threadIdx.y;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kTile + x;
  double acc = 0.0;
  if (j < C_out) {
    for (int64_t b = y; b < B; b += kRows) {
      const int64_t i = b * C_out + j;
      const float g = out[i] <= 0.0f ? 0.0f : dout[i];
      dpre[i] = g;
      acc += static_cast<double>(g);
    }
  }
  if (dbias == nullptr) return;  // uniform across the block: no thread waits at the barrier below alone
  partial[y][x] = acc;
  __syncthreads();
  for (int stride = kRows / 2; stride > 0; stride /= 2) {
    if (y < stride) partial[y][x] += partial[y + stride][x];
    __syncthreads();
  }
  if (y == 0 && j < C_out) {
    const float sum = static_cast<float>(partial[0][x]);
    dbias[j] = accumulate ? dbias[j] + sum : sum;
  }
}

void bias_broadcast(float* out, const float* bias, int64_t B, int64_t C_out, cudaStream_t stream) {
  detail::launch("linear_forward (bias)", bias_broadcast_kernel, blocks_for(B * C_out), kThreads, stream, out, bias, B,
                 C_out);
}

void fill_zero(float* x, int64_t n, cudaStream_t stream, const char* what) {
  if (n > 0) DPAR_CUDA_CHECK(cudaMemsetAsync(x, 0, static_cast<size_t>(n) * sizeof(float), stream), what);
}

// out (B,C_out) = inp (B,C_in) @ weight^T (C_in,C_out) + bias, operands of type T (f32, or uint16_t of the dtype
// `low`), out f32.
// Column-major: out^T (C_out,B) = weight (C_out,C_in) @ inp^T (C_in,B). weight's memory is the column-major
// (C_in,C_out) matrix, hence OP_T; inp's is the column-major (C_in,B) matrix, hence OP_N.
template <class T>
void forward_gemm(DType low, float* out, const T* inp, const T* weight, const float* bias, int64_t B, int64_t C_in,
                  int64_t C_out, cublasHandle_t blas, cudaStream_t stream) {
  const int b = blas_dim(B, "B"), cin = blas_dim(C_in, "C_in"), cout = blas_dim(C_out, "C_out");
  if (B == 0 || C_out == 0) return;
  DPAR_CHECK_ARG(out != nullptr, "linear_forward: out is null");
  DPAR_CHECK_ARG(C_in == 0 || (inp != nullptr && weight != nullptr), "linear_forward: inp or weight is null");
  // out starts as the broadcast bias and the GEMM adds to it (beta 1), as the CPU twin and PyTorch's addmm do;
  // without a bias, beta 0 makes cuBLAS ignore out's old content (even NaN).
  if (bias != nullptr) bias_broadcast(out, bias, B, C_out, stream);
  if (C_in == 0) {  // an empty sum: the answer is the bias (or zeros)
    if (bias == nullptr) fill_zero(out, B * C_out, stream, "linear_forward: zeros for C_in = 0");
    return;
  }
  const float alpha = 1.0f, beta = bias != nullptr ? 1.0f : 0.0f;
  DPAR_CUBLAS_CHECK(gemm(low, blas, CUBLAS_OP_T, CUBLAS_OP_N, cout, b, cin, &alpha, weight, cin, inp, cin, &beta, out,
                         cout),
                    "linear_forward: out (", B, ",", C_out, ") = inp (", B, ",", C_in, ") @ weight^T");
}

// linear_backward's two GEMMs, operands of type T (f32, or uint16_t of the dtype `low`): dinp (skipped if null) and
// dweight, f32.
template <class T>
void backward_gemms(DType low, float* dinp, float* dweight, const T* dout, const T* inp, const T* weight, int64_t B,
                    int64_t C_in, int64_t C_out, bool accumulate, cublasHandle_t blas, cudaStream_t stream) {
  const int b = blas_dim(B, "B"), cin = blas_dim(C_in, "C_in"), cout = blas_dim(C_out, "C_out");
  DPAR_CHECK_ARG(dweight != nullptr || C_out * C_in == 0, "linear_backward: dweight is null");
  const bool nonempty = B > 0 && C_out > 0;
  DPAR_CHECK_ARG(!nonempty || dout != nullptr, "linear_backward: dout is null");
  const float one = 1.0f, zero = 0.0f;

  // dinp (B,C_in) = dout (B,C_out) @ weight (C_out,C_in).
  // Column-major: dinp^T (C_in,B) = weight^T (C_in,C_out) @ dout^T (C_out,B); both are their memory as is (OP_N).
  if (dinp != nullptr && B > 0 && C_in > 0) {
    if (C_out == 0) {
      fill_zero(dinp, B * C_in, stream, "linear_backward: zeros for C_out = 0");
    } else {
      DPAR_CHECK_ARG(weight != nullptr, "linear_backward: weight is null");
      DPAR_CUBLAS_CHECK(gemm(low, blas, CUBLAS_OP_N, CUBLAS_OP_N, cin, b, cout, &one, weight, cin, dout, cout, &zero,
                             dinp, cin),
                        "linear_backward: dinp (", B, ",", C_in, ") = dout @ weight (", C_out, ",", C_in, ")");
    }
  }

  // dweight (C_out,C_in) = dout^T (C_out,B) @ inp (B,C_in); beta 1 adds to the gradient already there.
  // Column-major: dweight^T (C_in,C_out) = inp^T (C_in,B) @ dout (B,C_out). inp's memory is inp^T (OP_N); dout's
  // is the column-major (C_out,B) matrix, so dout itself is OP_T of it.
  if (C_out > 0 && C_in > 0) {
    if (B == 0) {
      if (!accumulate) fill_zero(dweight, C_out * C_in, stream, "linear_backward: zeros for B = 0");
    } else {
      DPAR_CHECK_ARG(inp != nullptr, "linear_backward: inp is null");
      DPAR_CUBLAS_CHECK(gemm(low, blas, CUBLAS_OP_N, CUBLAS_OP_T, cin, cout, b, &one, inp, cin, dout, cout,
                             accumulate ? &one : &zero, dweight, cin),
                        "linear_backward: dweight (", C_out, ",", C_in, ") = dout^T @ inp (", B, ",", C_in, ")");
    }
  }
}

// dbias (C_out) (=|+=) column sums of dout (B,C_out), f32.
void bias_backward(float* dbias, const float* dout, int64_t B, int64_t C_out, bool accumulate, cudaStream_t stream) {
  if (dbias != nullptr && C_out > 0) {
    const unsigned tiles = static_cast<unsigned>((C_out + kTile - 1) / kTile);
    detail::launch("linear_backward (bias)", bias_backward_kernel, tiles, dim3(kTile, kRows), stream, dbias, dout, B,
                   C_out, accumulate);
  }
}

// The ReLU's backward into dpre with the bias gradient summed in the same pass (f32). Checks as linear_backward.
void relu_backward_bias(float* dpre, float* dbias, const float* dout, const float* out, int64_t B, int64_t C_out,
                        bool accumulate, cudaStream_t stream) {
  blas_dim(B, "B");
  blas_dim(C_out, "C_out");
  if (C_out > 0) {
    DPAR_CHECK_ARG(B == 0 || (dpre != nullptr && dout != nullptr && out != nullptr),
                   "linear_relu_backward: dpre, dout or out is null");
    if (B > 0 || dbias != nullptr) {
      const unsigned tiles = static_cast<unsigned>((C_out + kTile - 1) / kTile);
      detail::launch("linear_relu_backward (ReLU and bias)", relu_backward_bias_kernel, tiles, dim3(kTile, kRows),
                     stream, dpre, dbias, dout, out, B, C_out, accumulate);
    }
  }
}

}  // namespace

void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t B, int64_t C_in,
                    int64_t C_out, cublasHandle_t blas, cudaStream_t stream) {
  forward_gemm(DType::kF32, out, inp, weight, bias, B, C_in, C_out, blas, stream);
}

void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t B, int64_t C_in, int64_t C_out, bool accumulate,
                     cublasHandle_t blas, cudaStream_t stream) {
  backward_gemms(DType::kF32, dinp, dweight, dout, inp, weight, B, C_in, C_out, accumulate, blas, stream);
  bias_backward(dbias, dout, B, C_out, accumulate, stream);
}

// out = relu(inp @ weight^T + bias): the GEMM with beta 0 (as linear_forward without a bias), then the bias and the
// ReLU in one pass over out.
void linear_relu_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t B,
                         int64_t C_in, int64_t C_out, cublasHandle_t blas, cudaStream_t stream) {
  linear_forward(out, inp, weight, nullptr, B, C_in, C_out, blas, stream);
  if (B == 0 || C_out == 0) return;
  detail::launch("linear_relu_forward (bias and ReLU)", bias_relu_kernel, blocks_for(B * C_out), kThreads, stream,
                 out, bias, B, C_out);
}

// The ReLU's backward into dpre with the bias gradient summed in the same pass, then linear_backward's GEMMs from
// dpre (its bias pass skipped: done). dinp may be dout's memory: dout is read in full (into dpre) first.
void linear_relu_backward(float* dinp, float* dweight, float* dbias, float* dpre, const float* dout,
                          const float* out, const float* inp, const float* weight, int64_t B, int64_t C_in,
                          int64_t C_out, bool accumulate, cublasHandle_t blas, cudaStream_t stream) {
  relu_backward_bias(dpre, dbias, dout, out, B, C_out, accumulate, stream);
  linear_backward(dinp, dweight, nullptr, dpre, inp, weight, B, C_in, C_out, accumulate, blas, stream);
}

// ---- Mixed precision ------------------------------------------------------------------------------------------------

void linear_forward_mixed(DType low, float* out, const uint16_t* inp, const uint16_t* weight, const float* bias,
                          int64_t B, int64_t C_in, int64_t C_out, bool relu, cublasHandle_t blas,
                          cudaStream_t stream) {
  check_low(low, "linear_forward");
  if (!relu) return forward_gemm(low, out, inp, weight, bias, B, C_in, C_out, blas, stream);
  // As linear_relu_forward: the GEMM with beta 0, then the bias and the ReLU in one f32 pass over out.
  forward_gemm(low, out, inp, weight, static_cast<const float*>(nullptr), B, C_in, C_out, blas, stream);
  if (B == 0 || C_out == 0) return;
  detail::launch("linear_relu_forward (bias and ReLU)", bias_relu_kernel, blocks_for(B * C_out), kThreads, stream,
                 out, bias, B, C_out);
}

// The f32 passes first (the ReLU's backward into dpre and dbias, or dbias from dout), then the gradient before the
// GEMMs rounded to `low` into dout_low (in f16 a gradient beyond 65504 becomes infinite there, and the GEMMs carry
// the infinity into dinp and dweight, where loss scaling finds it), then both GEMMs from dout_low: dout is read in
// full before dinp (which may be its memory) is written.
void linear_backward_mixed(DType low, float* dinp, float* dweight, float* dbias, float* dpre, uint16_t* dout_low,
                           const float* dout, const float* out, const uint16_t* inp, const uint16_t* weight,
                           int64_t B, int64_t C_in, int64_t C_out, bool relu, bool accumulate, cublasHandle_t blas,
                           cudaStream_t stream) {
  check_low(low, "linear_backward");
  blas_dim(B, "B");
  blas_dim(C_in, "C_in");
  blas_dim(C_out, "C_out");
  // The GEMMs' argument checks before any pass is queued: a refused call changes nothing.
  DPAR_CHECK_ARG(dweight != nullptr || C_out * C_in == 0, "linear_backward: dweight is null");
  DPAR_CHECK_ARG(B == 0 || C_out == 0 || dout_low != nullptr, "linear_backward (", dtype_name(low),
                 "): dout_low is null");
  DPAR_CHECK_ARG(B == 0 || C_out == 0 || C_in == 0 || (inp != nullptr && weight != nullptr),
                 "linear_backward: inp or weight is null");
  const float* grad = dout;  // the f32 gradient before the GEMMs
  if (relu) {
    relu_backward_bias(dpre, dbias, dout, out, B, C_out, accumulate, stream);
    grad = dpre;
  } else {
    DPAR_CHECK_ARG(B == 0 || C_out == 0 || dout != nullptr, "linear_backward: dout is null");
    bias_backward(dbias, dout, B, C_out, accumulate, stream);
  }
  if (B > 0 && C_out > 0) to_low(low, dout_low, grad, B * C_out, stream);
  backward_gemms(low, dinp, dweight, static_cast<const uint16_t*>(dout_low), inp, weight, B, C_in, C_out, accumulate,
                 blas, stream);
}

}  // namespace dpar::kernels::cuda
