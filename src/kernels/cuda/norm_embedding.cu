// LayerNorm and Embedding on CUDA: the twins of kernels/cpu/norm_embedding.h (see there and kernels.h for the
// contracts).
//
// LayerNorm: a row's reductions (its mean, its centred squares; Σg and Σg·x̂ backward) are one block's, in double,
// threads interleaved over the row and their sums added in a fixed tree (detail::block_sum): the same bits on every
// call, the CPU's sums up to double rounding. The parameter gradients are sums over rows that the CPU twin adds in
// float, row after row; one thread per column does exactly that, so they are the CPU's bits. That is N serial steps
// per column (fine for the few thousand rows of a replica's batch; a long sequence's N*T rows would want a
// two-pass scheme with scratch, which the Stream interface does not give these kernels).
//
// Embedding: indices are checked on the host before a step (Engine::check_input_values, Embedding's
// check_input_values); a kernel cannot throw, so an index outside [0, V) that reaches it anyway reads and writes
// nothing out of bounds: forward writes zeros for it, backward skips it. The backward must sum a repeated index's
// rows in a fixed order without atomics: thread (e, p) owns column e of the weight rows r with r % P == p
// (P = kEmbeddingBuckets buckets, or V when smaller) and scans all N indices in order, adding the rows whose index
// it owns. So every element of dweight gets the CPU twin's float sum in the CPU's order (the same bits), no two
// threads write one element, and the work is N index reads per thread (broadcast across a warp, which reads one
// index for 32 columns) plus one read of each dout element: O(N * P * E / 32) cached index loads. A sort-based
// scheme (CUB radix sort by index) would be O(N log N) but needs scratch the Stream interface does not give.
#include "kernels/cuda/kernels.h"

#include "kernels/cuda/launch.cuh"

namespace dpar::kernels::cuda {

using detail::blocks_for;
using detail::kThreads;

namespace {

constexpr int kRowThreads = 256;  // the block of one LayerNorm row
constexpr int64_t kMaxRowBlocks = 4096;
constexpr int kEmbeddingBuckets = 64;

unsigned row_blocks(int64_t N) { return static_cast<unsigned>(N < kMaxRowBlocks ? N : kMaxRowBlocks); }

// out (N,D), mean_rstd (2,N), x (N,D), weight and bias (D) or null. One block a row.
__global__ void __launch_bounds__(kRowThreads) layernorm_forward_kernel(float* out, double* mean_rstd, const float* x,
                                                                        const float* weight, const float* bias,
                                                                        int64_t N, int64_t D, float eps) {
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {  // uniform across the block: block_sum's barriers hold
    const float* xr = x + n * D;
    float* yr = out + n * D;
    // Two passes in double, as the CPU twin: the mean, then the centred squares.
    double sum = 0.0;
    for (int64_t d = threadIdx.x; d < D; d += kRowThreads) sum += xr[d];
    const double mean = detail::block_sum<kRowThreads>(sum) / static_cast<double>(D);
    double sq = 0.0;
    for (int64_t d = threadIdx.x; d < D; d += kRowThreads) {
      const double c = xr[d] - mean;
      sq += c * c;
    }
    sq = detail::block_sum<kRowThreads>(sq);
    const double rstd = 1.0 / sqrt(sq / static_cast<double>(D) + static_cast<double>(eps));
    if (threadIdx.x == 0) {
      mean_rstd[n] = mean;
      mean_rstd[N + n] = rstd;
    }
    for (int64_t d = threadIdx.x; d < D; d += kRowThreads) {
      double y = (xr[d] - mean) * rstd;
      if (weight) y = y * weight[d] + bias[d];
      yr[d] = static_cast<float>(y);
    }
  }
}

// dinp (N,D) = rstd * (g - mean(g) - x̂ * mean(g * x̂)) per row. One block a row.
__global__ void __launch_bounds__(kRowThreads) layernorm_input_grad_kernel(float* dinp, const float* dout,
                                                                           const float* x, const double* mean_rstd,
                                                                           const float* weight, int64_t N,
                                                                           int64_t D) {
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    const float* xr = x + n * D;
    const float* gr = dout + n * D;
    const double mean = mean_rstd[n], rstd = mean_rstd[N + n];
    double sum_g = 0.0, sum_gx = 0.0;
    for (int64_t d = threadIdx.x; d < D; d += kRowThreads) {
      const double g = weight ? static_cast<double>(gr[d]) * weight[d] : gr[d];
      sum_g += g;
      sum_gx += g * ((xr[d] - mean) * rstd);
    }
    const double mg = detail::block_sum<kRowThreads>(sum_g) / static_cast<double>(D);
    const double mgx = detail::block_sum<kRowThreads>(sum_gx) / static_cast<double>(D);
    float* dr = dinp + n * D;
    for (int64_t d = threadIdx.x; d < D; d += kRowThreads) {
      const double g = weight ? static_cast<double>(gr[d]) * weight[d] : gr[d];
      dr[d] = static_cast<float>(rstd * (g - mg - (xr[d] - mean) * rstd * mgx));
    }
  }
}

// dweight, dbias (D) (either may be null) += over rows in row order, in float, as the CPU twin. One thread a column.
__global__ void __launch_bounds__(kThreads) layernorm_param_grads_kernel(float* dweight, float* dbias,
                                                                         const float* dout, const float* x,
                                                                         const double* mean_rstd, int64_t N,
                                                                         int64_t D, bool accumulate) {
  DPAR_GRID_STRIDE_LOOP(d, D) {
    float w = accumulate && dweight ? dweight[d] : 0.0f;
    float b = accumulate && dbias ? dbias[d] : 0.0f;
    for (int64_t n = 0; n < N; ++n) {
      const float g = dout[n * D + d];
      if (dweight) w += static_cast<float>(g * ((x[n * D + d] - mean_rstd[n]) * mean_rstd[N + n]));
      if (dbias) b += g;
    }
    if (dweight) dweight[d] = w;
    if (dbias) dbias[d] = b;
  }
}

// out (N,E) = weight[idx[n]], zeros for an index outside [0, V). The grid covers N*E.
__global__ void __launch_bounds__(kThreads) embedding_forward_kernel(float* out, const int32_t* idx,
                                                                     const float* weight, int64_t V, int64_t E,
                                                                     int64_t total) {
  DPAR_GRID_STRIDE_LOOP(i, total) {
    const int64_t n = i / E, e = i - n * E;
    const int64_t r = idx[n];
    out[i] = r >= 0 && r < V ? weight[r * E + e] : 0.0f;
  }
}

// dweight (V,E) += dout[n] at row idx[n], in n order; thread (e, blockIdx.y) owns the rows r % gridDim.y ==
// blockIdx.y of column e. Indices outside [0, V) and padding_idx are skipped.
__global__ void __launch_bounds__(kThreads) embedding_backward_kernel(float* dweight, const float* dout,
                                                                      const int32_t* idx, int64_t N, int64_t V,
                                                                      int64_t E, int64_t padding_idx) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= E) return;  // no barrier below
  const int64_t p = blockIdx.y, buckets = gridDim.y;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t r = idx[n];
    if (r < 0 || r >= V || r == padding_idx || r % buckets != p) continue;
    float* cell = dweight + r * E + e;
    *cell = *cell + dout[n * E + e];
  }
}

// out (B,T,C) = inp + weight[t]: element i of a sequence (row = T*C elements) adds the table's element i.
__global__ void __launch_bounds__(kThreads) position_embedding_forward_kernel(float* out, const float* inp,
                                                                              const float* weight, int64_t row,
                                                                              int64_t total) {
  DPAR_GRID_STRIDE_LOOP(i, total) { out[i] = inp[i] + weight[i % row]; }
}

// dweight's first T*C elements (+)= Σ_b dout[b] element by element, in batch order as the CPU twin adds; the rows
// past T are zeroed (unless accumulate) by the caller.
__global__ void __launch_bounds__(kThreads) position_embedding_backward_kernel(float* dweight, const float* dout,
                                                                               int64_t B, int64_t row,
                                                                               bool accumulate) {
  DPAR_GRID_STRIDE_LOOP(i, row) {
    float s = accumulate ? dweight[i] : 0.0f;
    for (int64_t b = 0; b < B; ++b) s = s + dout[b * row + i];
    dweight[i] = s;
  }
}

}  // namespace

void position_embedding_forward(float* out, const float* inp, const float* weight, int64_t B, int64_t T, int64_t C,
                                cudaStream_t stream) {
  DPAR_CHECK_ARG(B >= 0 && T >= 1 && C >= 1, "position_embedding_forward: (", B, ", ", T, ", ", C, ")");
  const int64_t total = B * T * C;
  if (total == 0) return;
  detail::launch("position_embedding_forward", position_embedding_forward_kernel, blocks_for(total), kThreads, stream,
                 out, inp, weight, T * C, total);
}

void position_embedding_backward(float* dweight, const float* dout, int64_t B, int64_t T, int64_t C, int64_t P,
                                 bool accumulate, cudaStream_t stream) {
  DPAR_CHECK_ARG(B >= 0 && T >= 1 && C >= 1 && T <= P, "position_embedding_backward: (", B, ", ", T, ", ", C,
                 ") with ", P, " positions");
  if (!accumulate && P > T)
    DPAR_CUDA_CHECK(cudaMemsetAsync(dweight + T * C, 0, static_cast<size_t>((P - T) * C) * sizeof(float), stream),
                    "position_embedding_backward: zeroing the rows past T");
  detail::launch("position_embedding_backward", position_embedding_backward_kernel, blocks_for(T * C), kThreads,
                 stream, dweight, dout, B, T * C, accumulate);
}

void layernorm_forward(float* out, double* mean_rstd, const float* x, const float* weight, const float* bias,
                       int64_t N, int64_t D, float eps, cudaStream_t stream) {
  DPAR_CHECK_ARG(N >= 0 && D >= 1, "layernorm_forward: shape (", N, ", ", D, ") needs N >= 0 and D >= 1");
  DPAR_CHECK_ARG((weight == nullptr) == (bias == nullptr), "layernorm_forward: weight and bias come together");
  if (N == 0) return;
  detail::launch("layernorm_forward", layernorm_forward_kernel, row_blocks(N), kRowThreads, stream, out, mean_rstd, x,
                 weight, bias, N, D, eps);
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* x,
                        const double* mean_rstd, const float* weight, int64_t N, int64_t D, bool accumulate,
                        cudaStream_t stream) {
  DPAR_CHECK_ARG(N >= 0 && D >= 1, "layernorm_backward: shape (", N, ", ", D, ") needs N >= 0 and D >= 1");
  // With N = 0 the parameter gradients are still zeroed (unless accumulate), as the CPU twin's.
  if (dweight || dbias)
    detail::launch("layernorm_backward (parameters)", layernorm_param_grads_kernel, blocks_for(D), kThreads, stream,
                   dweight, dbias, dout, x, mean_rstd, N, D, accumulate);
  if (dinp && N > 0)
    detail::launch("layernorm_backward (input)", layernorm_input_grad_kernel, row_blocks(N), kRowThreads, stream,
                   dinp, dout, x, mean_rstd, weight, N, D);
}

void embedding_forward(float* out, const int32_t* idx, const float* weight, int64_t N, int64_t V, int64_t E,
                       cudaStream_t stream) {
  DPAR_CHECK_ARG(N >= 0 && V >= 1 && E >= 1, "embedding_forward: N = ", N, ", V = ", V, ", E = ", E,
                 " (need N >= 0, V >= 1, E >= 1)");
  const int64_t total = N * E;
  if (total == 0) return;
  detail::launch("embedding_forward", embedding_forward_kernel, blocks_for(total), kThreads, stream, out, idx, weight,
                 V, E, total);
}

void embedding_backward(float* dweight, const float* dout, const int32_t* idx, int64_t N, int64_t V, int64_t E,
                        int64_t padding_idx, bool accumulate, cudaStream_t stream) {
  DPAR_CHECK_ARG(N >= 0 && V >= 1 && E >= 1, "embedding_backward: N = ", N, ", V = ", V, ", E = ", E,
                 " (need N >= 0, V >= 1, E >= 1)");
  DPAR_CHECK_ARG(E <= (int64_t{1} << 31), "embedding_backward: E = ", E, " is more than a grid's columns (2^31)");
  if (!accumulate)
    DPAR_CUDA_CHECK(cudaMemsetAsync(dweight, 0, static_cast<size_t>(V * E) * sizeof(float), stream),
                    "embedding_backward: zeroing dweight");
  if (N == 0) return;
  const unsigned column_blocks = static_cast<unsigned>((E + kThreads - 1) / kThreads);
  const unsigned buckets = static_cast<unsigned>(V < kEmbeddingBuckets ? V : kEmbeddingBuckets);
  detail::launch("embedding_backward", embedding_backward_kernel, dim3(column_blocks, buckets), kThreads, stream,
                 dweight, dout, idx, N, V, E, padding_idx);
}

}  // namespace dpar::kernels::cuda
