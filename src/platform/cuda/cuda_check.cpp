// See cuda_check.h.
#include "platform/cuda/cuda_check.h"

#include "platform/cuda/cublas_library.h"
#include "platform/cuda/nccl_library.h"
#ifdef DPAR_HAVE_CUDNN_HEADERS
#include "platform/cuda/cudnn_library.h"
#endif

#include <mutex>
#include <type_traits>

namespace dpar::cuda {

namespace {

// "cudaMalloc(&p, bytes) [allocating 1 GiB on cuda:0]: out of memory (cudaErrorMemoryAllocation)"
std::string describe(const char* call, const std::string& context, const char* text, const char* name) {
  std::string out = call;
  if (!context.empty()) out += " [" + context + "]";
  out += ": ";
  out += text != nullptr ? text : "unknown error";
  if (name != nullptr) {
    out += " (";
    out += name;
    out += ")";
  }
  return out;
}

}  // namespace

Status cuda_error_status(cudaError_t err) {
  return err == cudaErrorMemoryAllocation ? Status::kOutOfMemory : Status::kDevice;
}

Status cublas_error_status(cublasStatus_t status) {
  return status == CUBLAS_STATUS_ALLOC_FAILED ? Status::kOutOfMemory : Status::kDevice;
}

Status nccl_error_status(ncclResult_t result) {
  switch (result) {
    case ncclRemoteError:
      return Status::kRemote;
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return Status::kInvalidArgument;
    case ncclUnhandledCudaError:
      return Status::kDevice;
    default:
      return Status::kCommunication;
  }
}

const char* cublas_status_name(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}

void fail_cuda(cudaError_t err, const char* call, const std::string& context) {
  // The error is reported here: it must not be reported again by the next launch check on this thread, which
  // reads the same last error. (A sticky error stays: every later call returns it anyway.)
  (void)cudaGetLastError();
  fail(cuda_error_status(err), describe(call, context, cudaGetErrorString(err), cudaGetErrorName(err)));
}

void fail_cublas(cublasStatus_t status, const char* call, const std::string& context) {
  fail(cublas_error_status(status), describe(call, context, cublas().status_string(status), cublas_status_name(status)));
}

#ifdef DPAR_HAVE_CUDNN_HEADERS
Status cudnn_error_status(cudnnStatus_t status) {
  switch (status) {
    case CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED:
    case CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED:
      return Status::kOutOfMemory;
    case CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED:
    case CUDNN_STATUS_NOT_SUPPORTED_SUBLIBRARY_UNAVAILABLE:
      return Status::kNotSupported;
    default:
      return Status::kDevice;
  }
}

void fail_cudnn(cudnnStatus_t status, const char* call, const std::string& context) {
  // A cuDNN status can only come from a loaded cuDNN, so its own text is at hand.
  fail(cudnn_error_status(status), describe(call, context, cudnn().error_string(status), nullptr) + " (cuDNN status " +
                                       std::to_string(static_cast<int>(status)) + ")");
}
#endif

void fail_nccl(ncclResult_t result, const char* call, const std::string& context) {
  // NCCL's own text, from the loaded NCCL (a result comes from one; if none loads, its number says it), and
  // ncclGetLastError's detail that NCCL logged for this thread's last failure (may be empty).
  std::string text = "NCCL result " + std::to_string(static_cast<int>(result));
  try {
    const NcclLibrary& nccl = cuda::nccl();
    text = nccl.error_string(result);
    const char* detail = nccl.last_error(nullptr);
    if (detail != nullptr && detail[0] != '\0') text += std::string(": ") + detail;
  } catch (const Error&) {
  }
  fail(nccl_error_status(result), describe(call, context, text.c_str(), nullptr));
}

int cuda_device_count(std::string* why_none) {
  static std::once_flag once;
  static int count = 0;
  static std::string why;
  std::call_once(once, [] {
    int n = 0;
    const cudaError_t err = cudaGetDeviceCount(&n);
    if (err == cudaSuccess && n > 0) {
      count = n;
      return;
    }
    // The runtime keeps no sticky state from this failure; clear its last-error slot for this thread anyway.
    (void)cudaGetLastError();
    if (err == cudaSuccess) {
      why = "no CUDA device (the driver reports 0 devices)";
    } else if (err == cudaErrorInsufficientDriver) {
      why = std::string("no CUDA driver (cudaGetDeviceCount: ") + cudaGetErrorString(err) + ")";
    } else if (err == cudaErrorNoDevice) {
      why = std::string("no CUDA device (cudaGetDeviceCount: ") + cudaGetErrorString(err) + ")";
    } else {
      why = std::string("CUDA is unavailable (cudaGetDeviceCount: ") + cudaGetErrorString(err) + ", " +
            cudaGetErrorName(err) + ")";
    }
  });
  if (count == 0 && why_none != nullptr) *why_none = why;
  return count;
}

cudaError_t query_event(cudaEvent_t event) noexcept {
  const cudaError_t state = cudaEventQuery(event);
  if (state == cudaErrorNotReady) (void)cudaGetLastError();
  return state;
}

namespace {

// The driver's functions a scope needs, from the runtime's table of driver entry points (null where the driver has
// none to give, e.g. no driver at all).
struct DriverCalls {
  CUresult (*get_current)(CUcontext*) = nullptr;
  CUresult (*set_current)(CUcontext) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*primary_state)(CUdevice, unsigned*, int*) = nullptr;
  CUresult (*primary_retain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*primary_release)(CUdevice) = nullptr;
  bool complete() const {
    return get_current && set_current && device_get && primary_state && primary_retain && primary_release;
  }
};

const DriverCalls& driver_calls() {
  static const DriverCalls calls = [] {
    DriverCalls c;
    auto find = [](const char* symbol, auto& fn) {
      void* found_fn = nullptr;
      cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
      if (cudaGetDriverEntryPointByVersion(symbol, &found_fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
          found != cudaDriverEntryPointSuccess) {
        (void)cudaGetLastError();
        found_fn = nullptr;
      }
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(found_fn);
    };
    find("cuCtxGetCurrent", c.get_current);
    find("cuCtxSetCurrent", c.set_current);
    find("cuDeviceGet", c.device_get);
    find("cuDevicePrimaryCtxGetState", c.primary_state);
    find("cuDevicePrimaryCtxRetain", c.primary_retain);
    find("cuDevicePrimaryCtxRelease", c.primary_release);  // version 12000: cuDevicePrimaryCtxRelease_v2
    return c;
  }();
  return calls;
}

CUcontext active_primary_context(int device) {
  const DriverCalls& d = driver_calls();
  CUdevice dev = 0;
  unsigned flags = 0;
  int active = 0;
  if (d.device_get(&dev, device) != CUDA_SUCCESS || d.primary_state(dev, &flags, &active) != CUDA_SUCCESS ||
      !active)
    return nullptr;
  // The runtime holds the active primary context; this retain and release only read its handle.
  CUcontext ctx = nullptr;
  if (d.primary_retain(&ctx, dev) != CUDA_SUCCESS) return nullptr;
  (void)d.primary_release(dev);
  return ctx;
}

thread_local int t_bound_device = -1;  // the device bind_thread_to_device made current on this thread

}  // namespace

const ContextCalls& runtime_context_calls() {
  static const ContextCalls calls = [] {
    ContextCalls c;
    c.get_device = [](int* device) { return cudaGetDevice(device); };
    c.set_device = [](int device) { return cudaSetDevice(device); };
    c.init_device = [](int device) { return cudaInitDevice(device, 0, 0); };  // the device flags already set
    const DriverCalls& d = driver_calls();
    if (d.complete()) {
      c.get_current = d.get_current;
      c.set_current = d.set_current;
      c.active_primary = active_primary_context;
    }
    return c;
  }();
  return calls;
}

bool thread_has_context() noexcept {
  const auto& calls = driver_calls();
  CUcontext current = nullptr;
  if (calls.get_current == nullptr || calls.get_current(&current) != CUDA_SUCCESS) return true;
  return current != nullptr;
}

cudaError_t bind_thread_to_device(int device) noexcept {
  const cudaError_t err = cudaSetDevice(device);
  if (err == cudaSuccess)
    t_bound_device = device;
  else
    (void)cudaGetLastError();
  return err;
}

cudaError_t DeviceScope::enter(int device, const char** failed_call) noexcept {
  const ContextCalls& c = *calls_;
  *failed_call = "cudaGetDevice";
  if (const cudaError_t err = c.get_device(&previous_device_); err != cudaSuccess) return err;
  // A thread dpar bound to this device (every kernel launch of a replica's worker comes here): nothing to undo.
  if (previous_device_ == device && t_bound_device == device) return cudaSuccess;
  CUcontext current = nullptr;
  const bool driver = c.get_current != nullptr && c.get_current(&current) == CUDA_SUCCESS;
  if (!driver) {
    // Without the driver's context calls the runtime's device is all there is to restore.
    if (previous_device_ == device) return cudaSuccess;
    *failed_call = "cudaSetDevice";
    const cudaError_t err = c.set_device(device);
    if (err == cudaSuccess) restore_ = Restore::kDevice;
    return err;
  }
  // dpar's memory, streams and handles live in the primary context: a framework's own context on the same device
  // is switched away from too (and back after).
  if (current != nullptr && current == c.active_primary(device)) return cudaSuccess;
  *failed_call = "cudaInitDevice";
  if (const cudaError_t err = c.init_device(device); err != cudaSuccess) return err;
  const CUcontext primary = c.active_primary(device);
  *failed_call = "cuCtxSetCurrent (the primary context, after cudaInitDevice)";
  if (primary == nullptr || c.set_current(primary) != CUDA_SUCCESS) return cudaErrorDeviceUninitialized;
  previous_context_ = current;
  restore_ = Restore::kContext;
  return cudaSuccess;
}

DeviceScope::DeviceScope(int device, const ContextCalls& calls) : calls_(&calls) {
  const char* failed_call = "";
  const cudaError_t err = enter(device, &failed_call);
  if (err != cudaSuccess) fail_cuda(err, failed_call, detail::concat("making cuda:", device, " current"));
}

DeviceScope::DeviceScope(int device, std::nothrow_t, const ContextCalls& calls) noexcept : calls_(&calls) {
  const char* failed_call = "";
  if (enter(device, &failed_call) != cudaSuccess) (void)cudaGetLastError();
}

DeviceScope::~DeviceScope() {
  const ContextCalls& c = *calls_;
  switch (restore_) {
    case Restore::kNothing:
      return;
    case Restore::kDevice:
      if (c.set_device(previous_device_) != cudaSuccess) (void)cudaGetLastError();
      return;
    case Restore::kContext:
      break;
  }
  (void)c.set_current(previous_context_);
  if (previous_context_ != nullptr) return;  // the runtime's device is that context's
  // No context now: cudaGetDevice says the runtime's own device. A call in the scope that changed it is undone
  // where that creates nothing (cudaSetDevice initialises the primary context); else it stays, as the lesser harm.
  int now = previous_device_;
  if (c.get_device(&now) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  if (now == previous_device_ || c.active_primary(previous_device_) == nullptr) return;
  if (c.set_device(previous_device_) != cudaSuccess) (void)cudaGetLastError();
  (void)c.set_current(nullptr);
}

}  // namespace dpar::cuda
