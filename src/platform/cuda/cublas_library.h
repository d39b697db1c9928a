// cuBLAS, loaded on first use rather than linked. Linking it made every process that loads libdpar, CPU-only ones
// included, map and relocate cuBLAS and cuBLASLt when it started: ~100 ms and ~215 MB resident (measured on a
// program that links nothing else). Now cuBLAS is loaded the first time a GPU stream needs a handle (and libdpar
// names no CUDA library at all as a load-time dependency: the runtime is linked statically, NCCL loaded on first use).
#pragma once

#include <cublas_v2.h>

#include <string>

namespace dpar::cuda {

// cublasGemmEx as cublas_api.h declares it (with cublasComputeType_t). C++ also sees an inline overload taking a
// cudaDataType compute type, so decltype(&cublasGemmEx) would be ambiguous: the type is spelled out.
using CublasGemmEx = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                                        const void*, const void*, cudaDataType, int, const void*, cudaDataType, int,
                                        const void*, void*, cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);

// cublasGemmStridedBatchedEx, spelled out for the same reason.
using CublasGemmStridedBatchedEx = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int,
                                                      int, const void*, const void*, cudaDataType, int, long long int,
                                                      const void*, cudaDataType, int, long long int, const void*,
                                                      void*, cudaDataType, int, long long int, int,
                                                      cublasComputeType_t, cublasGemmAlgo_t);

// The cuBLAS functions dpar calls, with the types of cublas_v2.h's declarations.
struct CublasLibrary {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetMathMode) set_math_mode = nullptr;
  decltype(&cublasSgemm_v2) sgemm = nullptr;
  decltype(&cublasSgemmStridedBatched) sgemm_strided_batched = nullptr;  // attention's per-head products
  CublasGemmEx gemm_ex = nullptr;  // mixed precision: bf16 operands, f32 accumulation and result
  CublasGemmStridedBatchedEx gemm_strided_batched_ex = nullptr;  // attention's per-head products in bf16
  decltype(&cublasGetStatusString) status_string = nullptr;
  std::string path;  // the file that was loaded
};

// cuBLAS of the major version dpar was built with (libcublas.so.<CUBLAS_VER_MAJOR>), loaded once per process and
// never unloaded: by name (the dynamic loader's search, with libdpar's run path; a framework's cuBLAS already in the
// process is found so), else from the library directory of the CUDA toolkit dpar was built against. Throws
// Error(Status::kDevice) naming every file tried and why it failed; a later call tries again.
const CublasLibrary& cublas();

}  // namespace dpar::cuda
