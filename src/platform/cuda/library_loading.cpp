#include "platform/cuda/library_loading.h"

#include <dlfcn.h>

namespace dpar::cuda {

void* resolve_symbol(void* handle, const char* name, std::vector<std::string>& missing) {
  void* fn = dlsym(handle, name);
  if (fn == nullptr) missing.push_back(name);
  return fn;
}

std::string join_names(const std::vector<std::string>& names) {
  std::string joined;
  for (const std::string& name : names) joined += (joined.empty() ? "" : ", ") + name;
  return joined;
}

std::string file_of(const void* fn, const std::string& fallback) {
  Dl_info info{};
  return dladdr(fn, &info) != 0 && info.dli_fname != nullptr && info.dli_fname[0] != '\0' ? info.dli_fname : fallback;
}

std::string toolkit_library_directory() {
#ifdef DPAR_CUDA_LIBRARY_DIR
  const std::string dir = DPAR_CUDA_LIBRARY_DIR;  // CMake's CUDAToolkit_LIBRARY_DIR
  return dir.empty() || dir.back() == '/' ? dir : dir + "/";
#else
  return {};
#endif
}

}  // namespace dpar::cuda
