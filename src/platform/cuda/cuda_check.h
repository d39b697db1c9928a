// Checks for CUDA runtime, cuBLAS and NCCL calls: a failure becomes a dpar::Error naming the call, the context and
// the library's own message, so that "cudaMalloc(256 MiB on cuda:0): out of memory" reaches the user instead of a
// status code.
//
//   DPAR_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, stream), "copy of ", bytes, " bytes to ", name);
//   DPAR_CUBLAS_CHECK(cublasSgemm(...), "linear_forward");
//   DPAR_NCCL_CHECK(ncclAllReduce(...), "all_reduce on ", comm_name);
//
// Kernels are launched through kernels::cuda::detail::launch (launch.cuh), which checks the launch's own status.
// Nothing in dpar reads cudaGetLastError() to learn whether a call failed: that slot also holds what earlier calls
// left there (a "not ready" from a query among them), so it would blame a good call for an old answer.
//
// Statuses: cudaErrorMemoryAllocation becomes Status::kOutOfMemory (and cuBLAS's ALLOC_FAILED too); every other
// CUDA or cuBLAS failure Status::kDevice; an NCCL failure Status::kCommunication, except ncclRemoteError
// (Status::kRemote: a peer failed), ncclInvalidArgument and ncclInvalidUsage (Status::kInvalidArgument) and a
// CUDA error inside NCCL (Status::kDevice).
#pragma once

#include <cublas_v2.h>
#include <cuda.h>  // the driver's types only (CUcontext): its functions are reached through the runtime
#include <cuda_runtime_api.h>
#include <nccl.h>
#ifdef DPAR_HAVE_CUDNN_HEADERS
#include <cudnn.h>
#endif

#include <new>
#include <string>

#include "common/error.h"

namespace dpar::cuda {

// Throw the Error for a failed call. `call` is the expression's text; `context` may be empty.
[[noreturn]] void fail_cuda(cudaError_t err, const char* call, const std::string& context);
[[noreturn]] void fail_cublas(cublasStatus_t status, const char* call, const std::string& context);
[[noreturn]] void fail_nccl(ncclResult_t result, const char* call, const std::string& context);

// The status a failure maps to (see above); exposed for tests and for callers that report without throwing.
Status cuda_error_status(cudaError_t err);
Status cublas_error_status(cublasStatus_t status);
Status nccl_error_status(ncclResult_t result);

#ifdef DPAR_HAVE_CUDNN_HEADERS
// cuDNN: an allocation that failed (on the host or the device) is Status::kOutOfMemory; a sub-library that cuDNN
// could not load (libcudnn_cnn, libcudnn_ops beside libcudnn.so) Status::kNotSupported, as a missing libcudnn is;
// any other failure Status::kDevice. The text is cudnnGetErrorString's, through the loaded library.
[[noreturn]] void fail_cudnn(cudnnStatus_t status, const char* call, const std::string& context);
Status cudnn_error_status(cudnnStatus_t status);
#endif

// "CUBLAS_STATUS_NOT_SUPPORTED" and the like (cuBLAS's own cublasGetStatusString gives the text).
const char* cublas_status_name(cublasStatus_t status);

// How many CUDA devices this process can use. Never throws: where there are none, returns 0 and, if why_none is
// not null, sets it to the reason ("no CUDA driver (...)", "no CUDA device (...)", or the runtime's error for any
// other failure to initialise), so a CPU-only run can say why it did not use a GPU. (A machine without a driver
// makes cudaGetDeviceCount return cudaErrorInsufficientDriver, not a count of 0.) The runtime is asked once per
// process; later calls return the same answer.
int cuda_device_count(std::string* why_none = nullptr);

// cudaEventQuery without its side effect: "not ready" is a state, not a failure, yet the runtime records it in the
// thread's last-error slot, where a later reader of cudaGetLastError() on this thread that shares dpar's runtime (a
// program linking dpar's core, checking its own launches that way) would take it for an error of its own. (A
// framework calling through the C API is not such a reader since libdpar carries its runtime statically: its own
// runtime, PyTorch's libcudart for one, has its own slot, as cuBLAS's copy has.) Returns cudaSuccess,
// cudaErrorNotReady, or the failure (left in the slot for fail_cuda, which clears it).
cudaError_t query_event(cudaEvent_t event) noexcept;

// The calls a DeviceScope makes: the runtime's, and the driver's context calls, reached through the runtime's
// table of driver entry points (dpar never links libcuda). Tests give a scope a table of their own.
struct ContextCalls {
  cudaError_t (*get_device)(int*) = nullptr;     // cudaGetDevice
  cudaError_t (*set_device)(int) = nullptr;      // cudaSetDevice
  cudaError_t (*init_device)(int) = nullptr;     // cudaInitDevice: the primary context initialised, not made current
  CUresult (*get_current)(CUcontext*) = nullptr;  // cuCtxGetCurrent
  CUresult (*set_current)(CUcontext) = nullptr;   // cuCtxSetCurrent
  // The primary context of `device` if it is active, else null; never creates one (cuDevicePrimaryCtxGetState, then
  // cuDevicePrimaryCtxRetain and Release, which leave its reference count as it was).
  CUcontext (*active_primary)(int device) = nullptr;
};

// The runtime's and the driver's. Where the driver has no entry points to give (no driver at all), the four
// context calls are null, and a scope falls back on the runtime's current device alone.
const ContextCalls& runtime_context_calls();

// Makes `device`'s primary context current on the calling thread for the scope, and gives the thread back exactly
// what it had after it. The current context is per thread and belongs to whoever owns the thread (a framework
// calling through the C API keeps its own): dpar changes it only for the span of its own calls.
//
// "Exactly" means the context itself, not its device: a framework's own (non-primary) context comes back as that
// context, and a thread that had none (one that never used CUDA) gets none back, rather than device 0's primary
// context, which restoring cudaGetDevice()'s 0 would create (cudaSetDevice creates it since CUDA 12): every process
// of a job of one GPU per process would then hold a context on GPU 0, and on a GPU in exclusive compute mode the
// restore would fail. The scope switches contexts with cuCtxSetCurrent, after cudaInitDevice (the runtime owns the
// primary context, as after cudaSetDevice), so that the runtime's own per-thread device, which it falls back on
// when no context is current, is not changed either. A call inside the scope that sets it (NCCL's teardown calls
// cudaSetDevice) is undone where that creates nothing: where the old device's primary context is active.
//
// A restore that fails leaves nothing in the thread's last-error slot. Threads that dpar owns (workers,
// communication threads) bind their device once when they start (bind_thread_to_device), so a scope on them for
// that device does nothing beyond one cudaGetDevice.
class DeviceScope {
 public:
  explicit DeviceScope(int device, const ContextCalls& calls = runtime_context_calls());
  // For destructors and other noexcept paths: makes `device` current if it can, and never throws. When it cannot
  // (a sticky error), the calls that follow fail on their own and the thread's context stays as it was.
  DeviceScope(int device, std::nothrow_t, const ContextCalls& calls = runtime_context_calls()) noexcept;
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  // Makes `device` current; the status of the call that failed (its name in *failed_call), else cudaSuccess.
  cudaError_t enter(int device, const char** failed_call) noexcept;

  const ContextCalls* calls_;
  int previous_device_ = 0;
  CUcontext previous_context_ = nullptr;
  enum class Restore { kNothing, kContext, kDevice } restore_ = Restore::kNothing;
};

// Makes `device` current on the calling thread, a thread dpar owns and drives that device with (a worker, a
// communication thread), for the thread's life. Returns the runtime's status; a failure leaves nothing in the
// thread's last-error slot.
cudaError_t bind_thread_to_device(int device) noexcept;

// Whether the calling thread has a current CUDA context (asked through the driver's cuCtxGetCurrent, reached via
// the runtime's entry-point table: dpar never links libcuda). True when it cannot tell.
bool thread_has_context() noexcept;

}  // namespace dpar::cuda

// DPAR_CUDA_CHECK(expr, context...): evaluates a cudaError_t expression once; throws unless cudaSuccess.
#define DPAR_CUDA_CHECK(expr, ...)                                                                   \
  do {                                                                                               \
    const cudaError_t dpar_cuda_err_ = (expr);                                                       \
    if (dpar_cuda_err_ != cudaSuccess)                                                               \
      ::dpar::cuda::fail_cuda(dpar_cuda_err_, #expr, ::dpar::detail::concat(__VA_ARGS__));           \
  } while (0)

#define DPAR_CUBLAS_CHECK(expr, ...)                                                                 \
  do {                                                                                               \
    const cublasStatus_t dpar_cublas_st_ = (expr);                                                   \
    if (dpar_cublas_st_ != CUBLAS_STATUS_SUCCESS)                                                    \
      ::dpar::cuda::fail_cublas(dpar_cublas_st_, #expr, ::dpar::detail::concat(__VA_ARGS__));        \
  } while (0)

#define DPAR_NCCL_CHECK(expr, ...)                                                                   \
  do {                                                                                               \
    const ncclResult_t dpar_nccl_res_ = (expr);                                                      \
    if (dpar_nccl_res_ != ncclSuccess)                                                               \
      ::dpar::cuda::fail_nccl(dpar_nccl_res_, #expr, ::dpar::detail::concat(__VA_ARGS__));           \
  } while (0)

#ifdef DPAR_HAVE_CUDNN_HEADERS
#define DPAR_CUDNN_CHECK(expr, ...)                                                                  \
  do {                                                                                               \
    const cudnnStatus_t dpar_cudnn_st_ = (expr);                                                     \
    if (dpar_cudnn_st_ != CUDNN_STATUS_SUCCESS)                                                      \
      ::dpar::cuda::fail_cudnn(dpar_cudnn_st_, #expr, ::dpar::detail::concat(__VA_ARGS__));          \
  } while (0)
#endif
