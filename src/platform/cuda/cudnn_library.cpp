#include "platform/cuda/cudnn_library.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

#include "common/error.h"
#include "platform/cuda/library_loading.h"

namespace dpar::cuda {
namespace {

// Every function of CudnnLibrary from `handle`; the names of those missing.
std::vector<std::string> resolve_all(void* handle, CudnnLibrary& lib) {
  std::vector<std::string> missing;
  resolve(handle, "cudnnGetVersion", lib.get_version, missing);
  resolve(handle, "cudnnGetErrorString", lib.error_string, missing);
  resolve(handle, "cudnnCreate", lib.create, missing);
  resolve(handle, "cudnnDestroy", lib.destroy, missing);
  resolve(handle, "cudnnSetStream", lib.set_stream, missing);
  resolve(handle, "cudnnCreateTensorDescriptor", lib.create_tensor, missing);
  resolve(handle, "cudnnDestroyTensorDescriptor", lib.destroy_tensor, missing);
  resolve(handle, "cudnnSetTensor4dDescriptor", lib.set_tensor_4d, missing);
  resolve(handle, "cudnnCreateFilterDescriptor", lib.create_filter, missing);
  resolve(handle, "cudnnDestroyFilterDescriptor", lib.destroy_filter, missing);
  resolve(handle, "cudnnSetFilter4dDescriptor", lib.set_filter_4d, missing);
  resolve(handle, "cudnnCreateConvolutionDescriptor", lib.create_conv, missing);
  resolve(handle, "cudnnDestroyConvolutionDescriptor", lib.destroy_conv, missing);
  resolve(handle, "cudnnSetConvolution2dDescriptor", lib.set_conv_2d, missing);
  resolve(handle, "cudnnSetConvolutionGroupCount", lib.set_conv_groups, missing);
  resolve(handle, "cudnnSetConvolutionMathType", lib.set_conv_math, missing);
  resolve(handle, "cudnnGetConvolution2dForwardOutputDim", lib.conv_output_dim, missing);
  resolve(handle, "cudnnGetConvolutionForwardAlgorithm_v7", lib.fwd_algorithms, missing);
  resolve(handle, "cudnnGetConvolutionBackwardDataAlgorithm_v7", lib.bwd_data_algorithms, missing);
  resolve(handle, "cudnnGetConvolutionBackwardFilterAlgorithm_v7", lib.bwd_filter_algorithms, missing);
  resolve(handle, "cudnnGetConvolutionForwardWorkspaceSize", lib.fwd_workspace, missing);
  resolve(handle, "cudnnGetConvolutionBackwardDataWorkspaceSize", lib.bwd_data_workspace, missing);
  resolve(handle, "cudnnGetConvolutionBackwardFilterWorkspaceSize", lib.bwd_filter_workspace, missing);
  resolve(handle, "cudnnConvolutionForward", lib.conv_forward, missing);
  resolve(handle, "cudnnConvolutionBackwardData", lib.conv_backward_data, missing);
  resolve(handle, "cudnnConvolutionBackwardFilter", lib.conv_backward_filter, missing);
  resolve(handle, "cudnnConvolutionBackwardBias", lib.conv_backward_bias, missing);
  resolve(handle, "cudnnAddTensor", lib.add_tensor, missing);
  resolve(handle, "cudnnCreatePoolingDescriptor", lib.create_pooling, missing);
  resolve(handle, "cudnnDestroyPoolingDescriptor", lib.destroy_pooling, missing);
  resolve(handle, "cudnnSetPooling2dDescriptor", lib.set_pooling_2d, missing);
  resolve(handle, "cudnnPoolingForward", lib.pooling_forward, missing);
  resolve(handle, "cudnnPoolingBackward", lib.pooling_backward, missing);
  return missing;
}

}  // namespace

namespace loader {

std::vector<std::string> cudnn_candidates() {
  const std::string soname = "libcudnn.so." + std::to_string(CUDNN_MAJOR);
  std::vector<std::string> candidates{soname};
  if (const char* root = std::getenv("CUDNN_ROOT"); root != nullptr && root[0] != '\0')
    candidates.push_back(std::string(root) + "/lib/" + soname);
  const std::string dir = toolkit_library_directory();
  if (!dir.empty()) candidates.push_back(dir + soname);
  return candidates;
}

CudnnLibrary load_cudnn(const std::vector<std::string>& candidates) {
  std::string tried;
  auto note = [&](const std::string& file, const std::string& why) {
    tried += (tried.empty() ? "" : "; ") + file + ": " + why;
  };
  for (const std::string& file : candidates) {
    void* handle = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* why = dlerror();
      note(file, why ? why : "not loadable");
      continue;
    }
    CudnnLibrary lib;
    const std::vector<std::string> missing = resolve_all(handle, lib);
    if (!missing.empty()) {
      dlclose(handle);
      note(file, "lacks " + join_names(missing));
      continue;
    }
    // The structures and enumerations dpar was compiled against are those of the headers' major version.
    lib.version = lib.get_version();
    if (lib.version / 10000 != CUDNN_VERSION / 10000) {
      dlclose(handle);
      note(file, "is cuDNN " + std::to_string(lib.version) + ", not of major version " + std::to_string(CUDNN_MAJOR));
      continue;
    }
    lib.path = file_of(reinterpret_cast<const void*>(lib.create), file);
    return lib;  // the handle stays open for the life of the process
  }
  fail(Status::kNotSupported, "cuDNN ", CUDNN_MAJOR,
       ".x, which convolution and pooling on cuda need, could not be loaded (",
       tried.empty() ? std::string("no file to try") : tried,
       "): install cuDNN ", CUDNN_MAJOR, " (NVIDIA's libcudnn", CUDNN_MAJOR,
       " package, or pip's nvidia-cudnn-cu* with CUDNN_ROOT set to its folder), or add its directory to "
       "LD_LIBRARY_PATH. Without cuDNN, these layers on cuda return NOT_SUPPORTED naming the missing library");
}

}  // namespace loader

const CudnnLibrary& cudnn() {
  // call_once runs the load again on a later call when it threw; once it returned, a call is one atomic load.
  static std::once_flag once;
  static CudnnLibrary loaded;
  std::call_once(once, [] { loaded = loader::load_cudnn(loader::cudnn_candidates()); });
  return loaded;
}

}  // namespace dpar::cuda
