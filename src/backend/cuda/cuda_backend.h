// The CUDA backend: cuda:K is a GPU driven by its replicas' worker threads. Memory comes from a caching allocator
// (the steady-state step never calls cudaMalloc or cudaFree), each replica's work is queued on its own compute
// stream with its own cuBLAS handle, and the kernels are kernels/cuda. Replicas on different GPUs reduce with
// NCCL; replicas that share a GPU (NCCL refuses two ranks on one GPU) reduce through device memory.
#pragma once

#include <cstddef>
#include <cstdint>

#include "backend/backend.h"

namespace dpar {

Backend& cuda_backend();

// Allocator statistics of one GPU, for tests and benchmarks: how often the driver was asked for memory.
struct CudaAllocatorStats {
  uint64_t device_mallocs = 0;   // cudaMalloc calls
  uint64_t device_frees = 0;     // cudaFree calls (only when the cache is emptied)
  uint64_t cached_reuses = 0;    // allocations served from the cache
  size_t bytes_reserved = 0;     // held from the driver, in use or cached
};
CudaAllocatorStats cuda_allocator_stats(int device);

}  // namespace dpar
