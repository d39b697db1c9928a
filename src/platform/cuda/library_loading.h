// What dpar's loaders of NVIDIA libraries share (cuBLAS, cuDNN, NCCL: loaded on first use, never linked): resolving a
// library's functions by name, the file a resolved function comes from, and where the CUDA toolkit that dpar was
// built against keeps its libraries.
#pragma once

#include <string>
#include <vector>

namespace dpar::cuda {

// Resolves `name` in the dlopen handle into `fn`; a name it lacks is added to `missing` (the failures are collected
// so that one message names them all).
void* resolve_symbol(void* handle, const char* name, std::vector<std::string>& missing);
template <class Fn>
void resolve(void* handle, const char* name, Fn& fn, std::vector<std::string>& missing) {
  fn = reinterpret_cast<Fn>(resolve_symbol(handle, name, missing));
}

// "a, b, c": the names resolve() found missing, for a message.
std::string join_names(const std::vector<std::string>& names);

// The file that the loaded function `fn` lives in (dladdr), or `fallback` when it cannot be told.
std::string file_of(const void* fn, const std::string& fallback);

// The directory of the CUDA toolkit's libraries that dpar was built against, with a trailing slash; empty where the
// build did not record one. (The CUDA runtime is linked into libdpar statically, so the directory a loaded runtime
// came from no longer says where the toolkit is.)
std::string toolkit_library_directory();

}  // namespace dpar::cuda
