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
// buffers.buffer[b] (>= end floats each), for b < buffers.count
// T: float, or double (scale is then applied in double).
template <class T>
__global__ void __launch_bounds__(kThreads) sum_slice_into_all_kernel(const SumBuffersOf<T> buffers, int64_t begin,
                                                                      int64_t end, float scale) {
  const int64_t n = end - begin;
  DPAR_GRID_STRIDE_LOOP(k, n) {
    const int64_t i = begin + k;
    T s = 0;
    bool any = false;
    for (int b = 0; b < buffers.count; ++b) {
      if (!((buffers.contributes >> b) & 1u)) continue;
      const T x = buffers.buffer[b][i];
      s = any ? s + x : x;
      any = true;
    }
    if (scale != 1.0f) s = s * static_cast<T>(scale);
    for (int b = 0; b < buffers.count; ++b) buffers.buffer[b][i] = s;
  }
}

constexpr int kSumThreads = 256;
static_assert(kSumSquaresBlocks == kSumThreads, "the final pass adds one partial sum per thread");
using detail::block_sum;

// partials[b] = the sum of x[i]^2 over block b's grid-stride elements.  partials (gridDim.x), x (n)
__global__ void __launch_bounds__(kSumThreads) sum_squares_blocks_kernel(double* partials, const float* x, int64_t n) {
  double mine = 0.0;
  DPAR_GRID_STRIDE_LOOP(i, n) {
    const double v = x[i];
    mine += v * v;
  }
  const double total = block_sum<kSumThreads>(mine);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// *total = the sum of the partials.  total (1), partials (kSumThreads)
__global__ void __launch_bounds__(kSumThreads) sum_partials_kernel(double* total, const double* partials) {
  const double sum = block_sum<kSumThreads>(partials[threadIdx.x]);
  if (threadIdx.x == 0) *total = sum;
}

}  // namespace

void sum_squares(double* total, double* partials, const float* x, int64_t n, cudaStream_t stream) {
  DPAR_CHECK_ARG(n >= 0, "sum_squares: element count must be >= 0, got ", n);
  DPAR_CHECK_ARG(total != nullptr && partials != nullptr, "sum_squares: null scratch");
  // A fixed grid whatever n: the order of the additions, and so the bits, depend on n alone.
  detail::launch("sum_squares (blocks)", sum_squares_blocks_kernel, kSumSquaresBlocks, kSumThreads, stream, partials, x,
                 n);
  detail::launch("sum_squares (total)", sum_partials_kernel, 1, kSumThreads, stream, total, partials);
}

namespace {
template <class T>
void sum_slice_into_all_of(const SumBuffersOf<T>& buffers, int64_t begin, int64_t end, float scale,
                           cudaStream_t stream) {
  DPAR_CHECK_ARG(buffers.count >= 0 && buffers.count <= SumBuffers::kMaxBuffers, "sum_slice_into_all: ",
                 buffers.count, " buffers (0 to ", SumBuffers::kMaxBuffers, ")");
  DPAR_CHECK_ARG(begin >= 0 && begin <= end, "sum_slice_into_all: bad slice [", begin, ", ", end, ")");
  if (begin == end || buffers.count == 0) return;
  for (int b = 0; b < buffers.count; ++b)
    DPAR_CHECK_ARG(buffers.buffer[b] != nullptr, "sum_slice_into_all: buffer ", b, " is null");
  detail::launch("sum_slice_into_all", sum_slice_into_all_kernel<T>, blocks_for(end - begin), kThreads, stream,
                 buffers, begin, end, scale);
}
}  // namespace

void sum_slice_into_all(const SumBuffers& buffers, int64_t begin, int64_t end, float scale, cudaStream_t stream) {
  sum_slice_into_all_of(buffers, begin, end, scale, stream);
}
void sum_slice_into_all(const SumBuffersOf<double>& buffers, int64_t begin, int64_t end, float scale,
                        cudaStream_t stream) {
  sum_slice_into_all_of(buffers, begin, end, scale, stream);
}

}  // namespace dpar::kernels::cuda
