// The in-device reduction of replicas that share a GPU (comm/cuda_device_comm.*): each participant sums its slice
// of every replica's buffer and writes the sum into all of them, as the threads backend does on the host.
#include "kernels/cuda/kernels.h"

#include "kernels/cuda/launch.cuh"

namespace dpar::kernels::cuda {

using detail::blocks_for;
using detail::kThreads;

namespace {

// For i in [begin, end): s = the contributors' buffers[b][i] added in buffer order, starting from the first one
// (not from 0, so -0 stays -0, as the threads backend's pass), then s * scale; s is written to every buffer.
// With no contributor every buffer gets 0. Buffers may be any device memory this GPU can address.
// buffers (num_buffers) of (>= end) floats each, contributes (num_buffers)
__global__ void sum_slice_into_all_kernel(float* const* buffers, const uint8_t* contributes, int num_buffers,
                                          int64_t begin, int64_t end, float scale) {
  const int64_t n = end - begin;
  DPAR_GRID_STRIDE_LOOP(k, n) {
    const int64_t i = begin + k;
    float s = 0.0f;
    bool any = false;
    for (int b = 0; b < num_buffers; ++b) {
      if (!contributes[b]) continue;
      const float x = buffers[b][i];
      s = any ? s + x : x;
      any = true;
    }
    if (scale != 1.0f) s = s * scale;
    for (int b = 0; b < num_buffers; ++b) buffers[b][i] = s;
  }
}

constexpr int kSumThreads = 256;
static_assert(kSumSquaresBlocks == kSumThreads, "the final pass adds one partial sum per thread");
using detail::block_sum;

// partials[b] = the sum of x[i]^2 over block b's grid-stride elements.  partials (gridDim.x), x (n)
__global__ void sum_squares_blocks_kernel(double* partials, const float* x, int64_t n) {
  double mine = 0.0;
  DPAR_GRID_STRIDE_LOOP(i, n) {
    const double v = x[i];
    mine += v * v;
  }
  const double total = block_sum<kSumThreads>(mine);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// *total = the sum of the partials.  total (1), partials (kSumThreads)
__global__ void sum_partials_kernel(double* total, const double* partials) {
  const double sum = block_sum<kSumThreads>(partials[threadIdx.x]);
  if (threadIdx.x == 0) *total = sum;
}

}  // namespace

void sum_squares(double* total, double* partials, const float* x, int64_t n, cudaStream_t stream) {
  DPAR_CHECK_ARG(n >= 0, "sum_squares: element count must be >= 0, got ", n);
  DPAR_CHECK_ARG(total != nullptr && partials != nullptr, "sum_squares: null scratch");
  // A fixed grid whatever n: the order of the additions, and so the bits, depend on n alone.
  sum_squares_blocks_kernel<<<kSumSquaresBlocks, kSumThreads, 0, stream>>>(partials, x, n);
  DPAR_CUDA_CHECK_LAUNCH("sum_squares (blocks)");
  sum_partials_kernel<<<1, kSumThreads, 0, stream>>>(total, partials);
  DPAR_CUDA_CHECK_LAUNCH("sum_squares (total)");
}

void sum_slice_into_all(float* const* buffers, const uint8_t* contributes, int num_buffers, int64_t begin,
                        int64_t end, float scale, cudaStream_t stream) {
  DPAR_CHECK_ARG(num_buffers >= 0, "sum_slice_into_all: num_buffers must be >= 0, got ", num_buffers);
  DPAR_CHECK_ARG(begin >= 0 && begin <= end, "sum_slice_into_all: bad slice [", begin, ", ", end, ")");
  if (begin == end || num_buffers == 0) return;
  DPAR_CHECK_ARG(buffers != nullptr && contributes != nullptr, "sum_slice_into_all: null buffer table");
  sum_slice_into_all_kernel<<<blocks_for(end - begin), kThreads, 0, stream>>>(buffers, contributes, num_buffers,
                                                                              begin, end, scale);
  DPAR_CUDA_CHECK_LAUNCH("sum_slice_into_all");
}

}  // namespace dpar::kernels::cuda
