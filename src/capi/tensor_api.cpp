#include "capi/api.h"

using namespace dpar;
using namespace dpar::capi;

namespace {
Device checked_device(dpar_device d, const char* argument) {
  Device dev{checked_device_kind(d.kind, argument), d.index};
  DPAR_CHECK_ARG(d.index >= 0, argument, ": device index ", d.index, " is negative");
  return dev;
}
}  // namespace

extern "C" {

DPAR_API dpar_status dpar_device_count(size_t* out, int32_t kind) {
  return guard([&] {
    checked_out(out);
    checked_device_kind(kind, "kind");
    *out = default_cpu_device_count();
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
    // The storage first: a failed allocation must not leave a registered, unreachable handle behind.
    Tensor t = Tensor::zeros(dt, s, dev);
    auto* h = new_handle<dpar_tensor>();
    h->tensor = std::move(t);
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
  // One step: two threads freeing the same tensor must not both delete it. A tensor its parent owns stays.
  if (tensor && take_handle(tensor, HandleKind::kTensor, [tensor] { return !tensor->owned_by_parent; })) delete tensor;
}

DPAR_API dpar_status dpar_tensor_copy_from_host(dpar_tensor* tensor, const void* src, size_t bytes) {
  return guard([&] {
    auto& t = checked(tensor, "tensor").tensor;
    DPAR_CHECK_ARG(src != nullptr, "src: is NULL");
    DPAR_CHECK_ARG(bytes == t.bytes(), "bytes: ", bytes, " differs from the tensor's ", t.bytes(), " bytes ",
                   t.shape().str());
    std::memcpy(t.raw(), src, bytes);
  });
}

DPAR_API dpar_status dpar_tensor_copy_to_host(void* dst, const dpar_tensor* tensor, size_t bytes) {
  return guard([&] {
    const auto& t = checked(tensor, "tensor").tensor;
    DPAR_CHECK_ARG(dst != nullptr, "dst: is NULL");
    DPAR_CHECK_ARG(bytes == t.bytes(), "bytes: ", bytes, " differs from the tensor's ", t.bytes(), " bytes ",
                   t.shape().str());
    std::memcpy(dst, t.raw(), bytes);
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
