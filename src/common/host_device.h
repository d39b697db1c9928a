// DPAR_HOST_DEVICE marks a function that CUDA kernels call as well as host code (__host__ __device__ under nvcc,
// nothing for the host compiler), so that the CPU kernels and their CUDA twins share one definition rather than
// two that must be kept alike. Such a function is header-only, `inline`, and uses nothing the device lacks.
#pragma once

#ifdef __CUDACC__
#define DPAR_HOST_DEVICE __host__ __device__
#else
#define DPAR_HOST_DEVICE
#endif
