// See cuda_check.h.
#include "platform/cuda/cuda_check.h"

#include "platform/cuda/cublas_library.h"

#include <cuda.h>  // the driver's types only: its functions are reached through the runtime's entry points

#include <mutex>

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

dpar_status cuda_error_status(cudaError_t err) {
  return err == cudaErrorMemoryAllocation ? DPAR_ERR_OUT_OF_MEMORY : DPAR_ERR_DEVICE;
}

dpar_status cublas_error_status(cublasStatus_t status) {
  return status == CUBLAS_STATUS_ALLOC_FAILED ? DPAR_ERR_OUT_OF_MEMORY : DPAR_ERR_DEVICE;
}

dpar_status nccl_error_status(ncclResult_t result) {
  switch (result) {
    case ncclRemoteError:
      return DPAR_ERR_REMOTE;
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return DPAR_ERR_INVALID_ARGUMENT;
    case ncclUnhandledCudaError:
      return DPAR_ERR_DEVICE;
    default:
      return DPAR_ERR_COMMUNICATION;
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

void fail_nccl(ncclResult_t result, const char* call, const std::string& context) {
  // ncclGetLastError gives the detail NCCL logged for this thread's last failure (may be empty).
  std::string text = ncclGetErrorString(result);
  const char* detail = ncclGetLastError(nullptr);
  if (detail != nullptr && detail[0] != '\0') text += std::string(": ") + detail;
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

// cuCtxGetCurrent and cuCtxSetCurrent, from the runtime's table of driver entry points (null where the driver has
// none to give, e.g. no driver at all).
struct DriverContextCalls {
  CUresult (*get_current)(CUcontext*) = nullptr;
  CUresult (*set_current)(CUcontext) = nullptr;
};

const DriverContextCalls& driver_context_calls() {
  static const DriverContextCalls calls = [] {
    DriverContextCalls c;
    auto find = [](const char* symbol) -> void* {
      void* fn = nullptr;
      cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
      if (cudaGetDriverEntryPointByVersion(symbol, &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
          found != cudaDriverEntryPointSuccess) {
        (void)cudaGetLastError();
        return nullptr;
      }
      return fn;
    };
    c.get_current = reinterpret_cast<CUresult (*)(CUcontext*)>(find("cuCtxGetCurrent"));
    c.set_current = reinterpret_cast<CUresult (*)(CUcontext)>(find("cuCtxSetCurrent"));
    return c;
  }();
  return calls;
}

}  // namespace

bool thread_has_context() noexcept {
  const auto& calls = driver_context_calls();
  CUcontext current = nullptr;
  if (calls.get_current == nullptr || calls.get_current(&current) != CUDA_SUCCESS) return true;
  return current != nullptr;
}

namespace {
thread_local int t_bound_device = -1;  // the device bind_thread_to_device made current on this thread
}  // namespace

cudaError_t bind_thread_to_device(int device) noexcept {
  const cudaError_t err = cudaSetDevice(device);
  if (err == cudaSuccess)
    t_bound_device = device;
  else
    (void)cudaGetLastError();
  return err;
}

void DeviceScope::remember_previous() noexcept {
  // Without a way to clear the context again, restoring the old device is the closest to "as before".
  had_context_ = thread_has_context() || driver_context_calls().set_current == nullptr;
}

DeviceScope::DeviceScope(int device) {
  DPAR_CUDA_CHECK(cudaGetDevice(&previous_), "cudaGetDevice");
  device_ = device;
  // A thread dpar bound to this device (every kernel launch of a replica's worker comes here): nothing to undo.
  if (previous_ == device && t_bound_device == device) return;
  remember_previous();
  if (previous_ != device) {
    DPAR_CUDA_CHECK(cudaSetDevice(device), "cudaSetDevice(", device, ")");
    changed_ = true;
  }
}

DeviceScope::DeviceScope(int device, std::nothrow_t) noexcept {
  int current = 0;
  if (cudaGetDevice(&current) != cudaSuccess) {
    (void)cudaGetLastError();
    return;  // nothing changed, nothing to restore
  }
  previous_ = device_ = current;
  if (current == device && t_bound_device == device) return;
  remember_previous();
  if (current == device) return;
  if (cudaSetDevice(device) == cudaSuccess) {
    device_ = device;
    changed_ = true;
  } else {
    (void)cudaGetLastError();
  }
}

DeviceScope::~DeviceScope() {
  if (!had_context_) {
    // The thread had no context: it gets none back (not device 0's, which restoring cudaGetDevice()'s 0 would
    // create). The scope's calls made one current, whether or not it changed the device.
    (void)driver_context_calls().set_current(nullptr);
    return;
  }
  if (changed_ && cudaSetDevice(previous_) != cudaSuccess) (void)cudaGetLastError();
}

}  // namespace dpar::cuda
