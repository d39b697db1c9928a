// What every CUDA kernel file shares: launch shapes, the grid-stride loop, argument checks.
//
// Kernels are compiled with --fmad=false (CMakeLists.txt): a*b+c is a multiply then an add, each rounded, as in
// the CPU twins (whose x86-64 build has no FMA). With that, every kernel made of +, -, *, / and sqrt gives the CPU
// twin's bits exactly; only the transcendental ones (exp, erf, tanh, log) differ, by CUDA's documented ulp bounds.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "common/error.h"
#include "platform/cuda/cuda_check.h"

namespace dpar::kernels::cuda::detail {

constexpr int kThreads = 256;
// A grid-stride loop covers any n, so the grid only needs to fill the GPU (132 SMs x 8 blocks of 256 on an H100,
// with room): more blocks than this only add scheduling.
constexpr int64_t kMaxBlocks = 4096;

// Blocks for n elements, one element per thread up to kMaxBlocks blocks. n > 0.
inline unsigned blocks_for(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks));
}

inline void check_count(const char* kernel, int64_t n) {
  DPAR_CHECK_ARG(n >= 0, kernel, ": element count must be >= 0, got ", n);
}

#ifdef __CUDACC__
// kernel<<<grid, block, 0, stream>>>(args...), throwing Error(DEVICE) naming the kernel if the launch itself failed.
// The status is this launch's own (cudaLaunchKernelEx returns it), never an error an earlier call left in the
// thread's last-error slot: a "not ready" from an event query there, or another library's failure, cannot make a
// good launch throw (reading cudaGetLastError() after <<<...>>> would take it for this launch's).
template <class... Params, class... Args>
void launch(const char* kernel_name, void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream,
            Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (err != cudaSuccess) ::dpar::cuda::fail_cuda(err, "kernel launch", kernel_name);
}

// The sum of the block's per-thread values, added in a fixed tree: the same bits on every launch, whatever the
// threads' timing. Every thread gets it. Blocks of kBlockThreads threads, a power of two; every thread calls it.
template <int kBlockThreads>
__device__ double block_sum(double mine) {
  static_assert((kBlockThreads & (kBlockThreads - 1)) == 0, "the tree halves the block");
  __shared__ double partial[kBlockThreads];
  const int t = threadIdx.x;
  partial[t] = mine;
  __syncthreads();
  for (int stride = kBlockThreads / 2; stride > 0; stride /= 2) {
    if (t < stride) partial[t] += partial[t + stride];
    __syncthreads();
  }
  const double total = partial[0];
  __syncthreads();  // every thread has read it before a later call may write partial[] again
  return total;
}
#endif

}  // namespace dpar::kernels::cuda::detail

// for (int64_t i = first; i < n; i += stride): element i of a grid-stride loop. Whatever the launch shape, element
// i gets the same arithmetic, so results never depend on the grid.
#define DPAR_GRID_STRIDE_LOOP(i, n)                                                                        \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n);                   \
       i += static_cast<int64_t>(blockDim.x) * gridDim.x)
