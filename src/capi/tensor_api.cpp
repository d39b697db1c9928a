#include "capi/api.h"

using namespace dpar;
using namespace dpar::capi;

namespace dpar::capi {

DeviceKind checked_device_kind(int32_t kind, const char* argument) {
  DeviceKind k;
  switch (kind) {
    case DPAR_DEVICE_CPU: k = DeviceKind::kCpu; break;
    case DPAR_DEVICE_CUDA: k = DeviceKind::kCuda; break;
    default: fail(DPAR_ERR_INVALID_ARGUMENT, argument, ": unknown device kind ", kind);
  }
  DPAR_ENFORCE(backend_built(k), DPAR_ERR_NOT_SUPPORTED, argument, ": device kind ", kind == DPAR_DEVICE_CUDA ? "cuda" : "?",
               ": this dpar was built without CUDA");
  return k;
}

Device checked_device(dpar_device d, const char* argument) {
  Device dev{checked_device_kind(d.kind, argument), d.index};
  check_device_exists(dev, argument);
  return dev;
}

}  // namespace dpar::capi

extern "C" {

DPAR_API dpar_status dpar_device_count(size_t* out, int32_t kind) {
  return guard([&] {
    checked_out(out);
    *out = backend_for(checked_device_kind(kind, "kind")).device_count();
  });
}

DPAR_API dpar_status dpar_device_parse(dpar_device* out, const char* text) {
  return guard([&] {
    checked_out(out);
    DPAR_CHECK_ARG(text != nullptr, "text: is NULL");
    Device d = parse_device(text);
    *out = dpar_device{static_cast<int32_t>(d.kind), d.index};
  });
}

DPAR_API dpar_status dpar_tensor_create(dpar_tensor** out, int32_t dtype, const int64_t* shape, size_t ndim,
                                        dpar_device device) {
  return guard([&] {
    checked_out(out);
    *out = nullptr;
    DType dt = checked_dtype(dtype, "dtype");
    Shape s = Shape::checked(shape, ndim, "shape");
    Device dev = checked_device(device, "device");
    auto* h = new_handle<dpar_tensor>();
    h->tensor = Tensor::zeros(dt, s, dev);
    *out = h;
  });
}

DPAR_API dpar_status dpar_tensor_wrap_host(dpar_tensor** out, int32_t dtype, const int64_t* shape, size_t ndim,
                                           void* data) {
  return guard([&] {
    checked_out(out);
    *out = nullptr;
    DType dt = checked_dtype(dtype, "dtype");
    Shape s = Shape::checked(shape, ndim, "shape");
    DPAR_CHECK_ARG(data != nullptr, "data: is NULL");
    auto* h = new_handle<dpar_tensor>();
    h->tensor = Tensor::wrap(data, dt, s, Device{});
    *out = h;
  });
}

DPAR_API void dpar_tensor_free(dpar_tensor* tensor) {
  if (tensor && is_live(tensor, HandleKind::kTensor) && !tensor->owned_by_parent) free_handle(tensor);
}

DPAR_API dpar_status dpar_tensor_copy_from_host(dpar_tensor* tensor, const void* src, size_t bytes) {
  return guard([&] {
    auto& t = checked(tensor, "tensor").tensor;
    DPAR_CHECK_ARG(src != nullptr, "src: is NULL");
    DPAR_CHECK_ARG(bytes == t.bytes(), "bytes: ", bytes, " differs from the tensor's ", t.bytes(), " bytes ",
                   t.shape().str());
    t.copy_from_host(src);
  });
}

DPAR_API dpar_status dpar_tensor_copy_to_host(void* dst, const dpar_tensor* tensor, size_t bytes) {
  return guard([&] {
    const auto& t = checked(tensor, "tensor").tensor;
    DPAR_CHECK_ARG(dst != nullptr, "dst: is NULL");
    DPAR_CHECK_ARG(bytes == t.bytes(), "bytes: ", bytes, " differs from the tensor's ", t.bytes(), " bytes ",
                   t.shape().str());
    t.copy_to_host(dst);
  });
}

DPAR_API dpar_status dpar_tensor_shape(int64_t* out_shape, size_t* out_ndim, const dpar_tensor* tensor,
                                       size_t capacity) {
  return guard([&] {
    const auto& t = checked(tensor, "tensor").tensor;
    checked_out(out_ndim, "out_ndim");
    *out_ndim = t.shape().ndim();
    if (!out_shape) return;
    DPAR_CHECK_ARG(capacity >= t.shape().ndim(), "capacity: ", capacity, " is less than the tensor's ",
                   t.shape().ndim(), " dimensions");
    for (size_t i = 0; i < t.shape().ndim(); ++i) out_shape[i] = t.shape()[i];
  });
}

DPAR_API dpar_status dpar_tensor_info(int32_t* out_dtype, int64_t* out_numel, dpar_device* out_device,
                                      const dpar_tensor* tensor) {
  return guard([&] {
    const auto& t = checked(tensor, "tensor").tensor;
    if (out_dtype) *out_dtype = static_cast<int32_t>(t.dtype());
    if (out_numel) *out_numel = t.numel();
    if (out_device) *out_device = dpar_device{static_cast<int32_t>(t.device().kind), t.device().index};
  });
}

DPAR_API dpar_status dpar_tensor_data(void** out, dpar_tensor* tensor) {
  return guard([&] {
    checked_out(out);
    *out = nullptr;
    auto& t = checked(tensor, "tensor").tensor;
    DPAR_CHECK_ARG(t.device().is_host(), "tensor: lives on ", t.device().str(), ", not in host memory");
    *out = t.raw();
  });
}

}  // extern "C"
