// Convolution and pooling on cuda through cuDNN (loaded on first use: platform/cuda/cudnn_library.h), the ops of
// backend/ops.h that CudaStream::make_conv2d and make_pool2d return. They live beside the stream rather than under
// kernels/cuda because they are the op seam itself, drawing on the stream's own state (its cuDNN handle, its
// workspace); the math is all cuDNN's, and the dpar kernels they call (the ReLU epilogue, the bf16 conversions) are
// kernels/cuda's.
//
// Built only where cuDNN's headers were found (DPAR_HAVE_CUDNN_HEADERS).
#pragma once

#include <cuda_runtime_api.h>
#include <cudnn.h>

#include <cstddef>
#include <memory>

#include "backend/ops.h"
#include "device/device.h"

namespace dpar {

// What a CudaStream lends its cuDNN ops: its cuDNN handle, made by the first op that runs (cudnnCreate, bound to
// the stream with cudnnSetStream), and one grow-only workspace, shared by its ops because they run in the stream's
// order. The stream owns it and close()s it when it is destroyed; an op that outlives its stream holds the
// (closed) context and fails with Status::kInvalidState instead of touching freed state.
class CudnnContext {
 public:
  CudnnContext(Device device, cudaStream_t stream) : device_(device), stream_(stream) {}
  ~CudnnContext() { close(); }
  CudnnContext(const CudnnContext&) = delete;
  CudnnContext& operator=(const CudnnContext&) = delete;

  Device device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  // The caller has made the device current. The first call loads cuDNN (once per process) and makes the handle.
  cudnnHandle_t handle();
  // At least `bytes` of device memory for the next call queued on the stream (null for 0 bytes). Growing waits for
  // the stream's queued work, which may still use the old buffer, before it frees it.
  void* workspace(size_t bytes);
  // Waits for the stream's work, destroys the handle and frees the workspace; never throws. The caller has made
  // the device current.
  void close() noexcept;
  // The stream's TF32 switch (Stream::set_allow_tf32): whether f32 convolutions may round their operands to TF32.
  // Off (the default), they are strict FP32. An op reads it when it runs.
  void set_allow_tf32(bool allow) { allow_tf32_ = allow; }
  bool allow_tf32() const { return allow_tf32_; }

 private:
  void check_open() const;

  Device device_;
  cudaStream_t stream_;
  bool closed_ = false;
  bool allow_tf32_ = false;
  cudnnHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
};

// Load cuDNN (Error with Status::kNotSupported naming the files tried where it cannot) and prepare the
// descriptors that do not depend on the input's shape; per-shape ones are made on first use of each shape.
std::unique_ptr<Conv2dOp> make_cudnn_conv2d(const Conv2dSpec& spec, std::shared_ptr<CudnnContext> context);
std::unique_ptr<Pool2dOp> make_cudnn_pool2d(const Pool2dSpec& spec, std::shared_ptr<CudnnContext> context);

namespace cudnn_detail {
// The most workspace an algorithm may ask for: an algorithm that needs more is passed over for the next
// deterministic one (cuDNN always has one that needs little or none).
constexpr size_t kWorkspaceCap = size_t{512} << 20;
}  // namespace cudnn_detail

}  // namespace dpar
