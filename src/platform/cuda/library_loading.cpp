#include "platform/cuda/library_loading.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

namespace dpar::cuda {

void* resolve_symbol(void* handle, const char* name, std::vector<std::string>& missing) {
  void* fn = dlsym(handle, name);
  if (fn == nullptr) missing.push_back(name);
  return fn;
}

std::string cudart_directory() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<const void*>(&cudaRuntimeGetVersion), &info) == 0 || info.dli_fname == nullptr)
    return {};
  const std::string file = info.dli_fname;
  const size_t slash = file.rfind('/');
  return slash == std::string::npos ? std::string() : file.substr(0, slash + 1);
}

}  // namespace dpar::cuda
