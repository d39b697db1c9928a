// The linear layer on CUDA: GEMMs through cuBLAS, bias through two small kernels.
//
// Row-major through a column-major library. cuBLAS reads a row-major matrix X (r,c) with leading dimension c as
// the column-major matrix X^T (c,r), and writes C = op(A) op(B) column-major. So a row-major product
// Y (M,N) = P (M,K) Q (K,N) is computed as the column-major Y^T (N,M) = Q^T (N,K) P^T (K,M): pass Q first, P second,
// m = N, n = M, and each operand's "transposed" flag flips relative to the row-major formula.
//
// Precision: cublasSgemm in FP32. The handle must be in CUBLAS_DEFAULT_MATH or CUBLAS_PEDANTIC_MATH (a new
// handle's default), never CUBLAS_TF32_TENSOR_OP_MATH: TF32 keeps 10 mantissa bits and the CPU twin keeps 23.
// cuBLAS's default atomics mode (not allowed) keeps its results the same call after call on one GPU.
#include "kernels/cuda/kernels.h"

#include <limits>

#include "platform/cuda/cublas_library.h"
#include "kernels/cuda/launch.cuh"

namespace dpar::kernels::cuda {

using detail::blocks_for;
using detail::kThreads;

namespace {

// cuBLAS's SGEMM, from the library loaded on first use (platform/cuda/cublas_library.h).
template <class... Args>
cublasStatus_t cublas_sgemm(Args... args) {
  return ::dpar::cuda::cublas().sgemm(args...);
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

}  // namespace

// out (B,C_out) = inp (B,C_in) @ weight^T (C_in,C_out) + bias.
// Column-major: out^T (C_out,B) = weight (C_out,C_in) @ inp^T (C_in,B). weight's memory is the column-major
// (C_in,C_out) matrix, hence OP_T; inp's is the column-major (C_in,B) matrix, hence OP_N.
void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t B, int64_t C_in,
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
  DPAR_CUBLAS_CHECK(cublas_sgemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, cout, b, cin, &alpha, weight, cin, inp, cin, &beta,
                                out, cout),
                    "linear_forward: out (", B, ",", C_out, ") = inp (", B, ",", C_in, ") @ weight^T");
}

void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t B, int64_t C_in, int64_t C_out, bool accumulate,
                     cublasHandle_t blas, cudaStream_t stream) {
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
      DPAR_CUBLAS_CHECK(cublas_sgemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, cin, b, cout, &one, weight, cin, dout, cout, &zero,
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
      DPAR_CUBLAS_CHECK(cublas_sgemm(blas, CUBLAS_OP_N, CUBLAS_OP_T, cin, cout, b, &one, inp, cin, dout, cout,
                                    accumulate ? &one : &zero, dweight, cin),
                        "linear_backward: dweight (", C_out, ",", C_in, ") = dout^T @ inp (", B, ",", C_in, ")");
    }
  }

  // dbias (C_out) = column sums of dout (B,C_out).
  if (dbias != nullptr && C_out > 0) {
    const unsigned tiles = static_cast<unsigned>((C_out + kTile - 1) / kTile);
    detail::launch("linear_backward (bias)", bias_backward_kernel, tiles, dim3(kTile, kRows), stream, dbias, dout, B,
                   C_out, accumulate);
  }
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
  linear_backward(dinp, dweight, nullptr, dpre, inp, weight, B, C_in, C_out, accumulate, blas, stream);
}

}  // namespace dpar::kernels::cuda
