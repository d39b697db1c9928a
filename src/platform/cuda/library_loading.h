// What dpar's loaders of NVIDIA libraries share (cuBLAS, cuDNN: loaded on first use, never linked): resolving a
// library's functions by name, and where the loaded CUDA runtime lives (where the toolkit keeps its libraries).
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

// The directory of the CUDA runtime that libdpar loaded, with a trailing slash; empty when it cannot be told.
std::string cudart_directory();

}  // namespace dpar::cuda
