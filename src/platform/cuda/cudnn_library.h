// cuDNN, loaded on first use as cuBLAS is (cublas_library.h): a process that never runs a convolution on a GPU
// does not map it (cuDNN 9's libraries are over 1 GB on disk), and libdpar loads where cuDNN is not installed.
// Only its headers are needed to build (DPAR_HAVE_CUDNN_HEADERS); without cuDNN at run time, convolution and
// pooling on cuda answer NOT_SUPPORTED naming the library that is missing.
#pragma once

#include <cudnn.h>

#include <string>
#include <vector>

namespace dpar::cuda {

// The cuDNN functions dpar calls, with the types of cudnn.h's declarations (the legacy API, which cuDNN 9 keeps:
// libcudnn.so.9 exports it and dispatches to its sub-libraries libcudnn_ops and libcudnn_cnn).
struct CudnnLibrary {
  decltype(&cudnnGetVersion) get_version = nullptr;
  decltype(&cudnnGetErrorString) error_string = nullptr;
  decltype(&cudnnCreate) create = nullptr;
  decltype(&cudnnDestroy) destroy = nullptr;
  decltype(&cudnnSetStream) set_stream = nullptr;
  decltype(&cudnnCreateTensorDescriptor) create_tensor = nullptr;
  decltype(&cudnnDestroyTensorDescriptor) destroy_tensor = nullptr;
  decltype(&cudnnSetTensor4dDescriptor) set_tensor_4d = nullptr;
  decltype(&cudnnCreateFilterDescriptor) create_filter = nullptr;
  decltype(&cudnnDestroyFilterDescriptor) destroy_filter = nullptr;
  decltype(&cudnnSetFilter4dDescriptor) set_filter_4d = nullptr;
  decltype(&cudnnCreateConvolutionDescriptor) create_conv = nullptr;
  decltype(&cudnnDestroyConvolutionDescriptor) destroy_conv = nullptr;
  decltype(&cudnnSetConvolution2dDescriptor) set_conv_2d = nullptr;
  decltype(&cudnnSetConvolutionGroupCount) set_conv_groups = nullptr;
  decltype(&cudnnSetConvolutionMathType) set_conv_math = nullptr;
  decltype(&cudnnGetConvolution2dForwardOutputDim) conv_output_dim = nullptr;
  decltype(&cudnnGetConvolutionForwardAlgorithm_v7) fwd_algorithms = nullptr;
  decltype(&cudnnGetConvolutionBackwardDataAlgorithm_v7) bwd_data_algorithms = nullptr;
  decltype(&cudnnGetConvolutionBackwardFilterAlgorithm_v7) bwd_filter_algorithms = nullptr;
  decltype(&cudnnGetConvolutionForwardWorkspaceSize) fwd_workspace = nullptr;
  decltype(&cudnnGetConvolutionBackwardDataWorkspaceSize) bwd_data_workspace = nullptr;
  decltype(&cudnnGetConvolutionBackwardFilterWorkspaceSize) bwd_filter_workspace = nullptr;
  decltype(&cudnnConvolutionForward) conv_forward = nullptr;
  decltype(&cudnnConvolutionBackwardData) conv_backward_data = nullptr;
  decltype(&cudnnConvolutionBackwardFilter) conv_backward_filter = nullptr;
  decltype(&cudnnConvolutionBackwardBias) conv_backward_bias = nullptr;
  decltype(&cudnnAddTensor) add_tensor = nullptr;
  decltype(&cudnnCreatePoolingDescriptor) create_pooling = nullptr;
  decltype(&cudnnDestroyPoolingDescriptor) destroy_pooling = nullptr;
  decltype(&cudnnSetPooling2dDescriptor) set_pooling_2d = nullptr;
  decltype(&cudnnPoolingForward) pooling_forward = nullptr;
  decltype(&cudnnPoolingBackward) pooling_backward = nullptr;
  std::string path;  // the file that was loaded
  size_t version = 0;  // cudnnGetVersion(): major * 10000 + minor * 100 + patch
};

// cuDNN of the major version dpar was built with (libcudnn.so.<CUDNN_MAJOR>), loaded once per process and never
// unloaded: by name (the dynamic loader's search, LD_LIBRARY_PATH and libdpar's run path), else from
// $CUDNN_ROOT/lib (where a Python environment's nvidia-cudnn keeps it), else from the library directory of the CUDA
// toolkit dpar was built against. Throws Error(Status::kNotSupported) naming every file tried and why it failed (not
// found, a function missing, another major version); a later call tries again.
const CudnnLibrary& cudnn();

namespace loader {
// The files cudnn() tries, in order.
std::vector<std::string> cudnn_candidates();
// Loads the first of `candidates` that opens, has every function and the major version of the headers; throws as
// cudnn() does. cudnn() is this over cudnn_candidates(); tests give it other lists.
CudnnLibrary load_cudnn(const std::vector<std::string>& candidates);
}  // namespace loader

}  // namespace dpar::cuda
