#include "platform/cuda/cublas_library.h"

#include <dlfcn.h>

#include <mutex>
#include <vector>

#include "common/error.h"
#include "platform/cuda/library_loading.h"

namespace dpar::cuda {
namespace {

CublasLibrary load() {
  const std::string soname = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
  std::vector<std::string> candidates{soname};
  const std::string dir = toolkit_library_directory();
  if (!dir.empty()) candidates.push_back(dir + soname);
  std::string tried;
  for (const std::string& file : candidates) {
    void* handle = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* why = dlerror();
      tried += (tried.empty() ? "" : "; ") + file + ": " + (why ? why : "not loadable");
      continue;
    }
    CublasLibrary lib;
    std::vector<std::string> missing;
    resolve(handle, "cublasCreate_v2", lib.create, missing);
    resolve(handle, "cublasDestroy_v2", lib.destroy, missing);
    resolve(handle, "cublasSetStream_v2", lib.set_stream, missing);
    resolve(handle, "cublasSetMathMode", lib.set_math_mode, missing);
    resolve(handle, "cublasSgemm_v2", lib.sgemm, missing);
    resolve(handle, "cublasSgemmStridedBatched", lib.sgemm_strided_batched, missing);
    resolve(handle, "cublasGemmEx", lib.gemm_ex, missing);
    resolve(handle, "cublasGemmStridedBatchedEx", lib.gemm_strided_batched_ex, missing);
    resolve(handle, "cublasGetStatusString", lib.status_string, missing);
    if (!missing.empty()) {
      dlclose(handle);
      tried += (tried.empty() ? "" : "; ") + file + ": lacks " + join_names(missing);
      continue;
    }
    lib.path = file_of(reinterpret_cast<const void*>(lib.create), file);
    return lib;  // the handle stays open for the life of the process
  }
  fail(Status::kDevice, "cuBLAS ", CUBLAS_VER_MAJOR, ".x, which dpar's CUDA backend needs, could not be loaded (", tried,
       "): install the CUDA toolkit's cuBLAS, or add its directory to LD_LIBRARY_PATH");
}

}  // namespace

const CublasLibrary& cublas() {
  // call_once runs load() again on a later call when it threw; once it returned, a call is one atomic load.
  static std::once_flag once;
  static CublasLibrary loaded;
  std::call_once(once, [] { loaded = load(); });
  return loaded;
}

}  // namespace dpar::cuda
