#include "backend/backend.h"

#include "backend/cpu/cpu_backend.h"
#include "common/error.h"
#ifdef DPAR_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace dpar {

bool backend_built(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kCpu: return true;
#ifdef DPAR_HAVE_CUDA
    case DeviceKind::kCuda: return true;
#else
    case DeviceKind::kCuda: return false;
#endif
  }
  return false;
}

Backend& backend_for(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kCpu: return cpu_backend();
    case DeviceKind::kCuda:
#ifdef DPAR_HAVE_CUDA
      return cuda_backend();
#else
      fail(Status::kNotSupported, "cuda: this dpar was built without CUDA");
#endif
  }
  fail(Status::kInternal, "backend: unknown device kind ", static_cast<int>(kind));
}

void check_device_exists(Device device, const char* argument) {
  DPAR_CHECK_ARG(device.index >= 0, argument, ": device index ", device.index, " is negative");
  // CPU devices are virtual: an engine may have more of them than there are cores.
  if (device.is_host()) return;
  Backend& b = backend_for(device);
  const size_t count = b.device_count();
  if (count == 0) {
    const std::string why = b.unavailable_reason();
    fail(Status::kDevice, argument, ": ", device.str(), ": no ", b.name(), " device", why.empty() ? "" : " (",
         why, why.empty() ? "" : ")");
  }
  DPAR_CHECK_ARG(device.index >= 0 && static_cast<size_t>(device.index) < count, argument, ": ", device.str(),
                 " is out of range (", count, " ", b.name(), " devices: ", b.name(), ":0 to ", b.name(), ":",
                 count - 1, ")");
}

}  // namespace dpar

// ---- Stream kernels a backend may lack: NOT_SUPPORTED naming what and where -------------------------------------
namespace dpar {

void Stream::not_built(const std::string& call, const char* what) const {
  fail(Status::kNotSupported, call, " on ", device().str(), ": this backend has no ", what);
}

std::unique_ptr<Conv2dOp> Stream::make_conv2d(const Conv2dSpec& spec) { not_built(spec.str(), "convolution"); }
std::unique_ptr<Pool2dOp> Stream::make_pool2d(const Pool2dSpec& spec) { not_built(spec.str(), "pooling"); }
std::unique_ptr<AttentionOp> Stream::make_attention(const AttentionSpec& spec) {
  not_built(spec.str(), "attention");
}

}  // namespace dpar
