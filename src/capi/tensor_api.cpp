#include <dlpack/dlpack.h>

#include <cstdint>
#include <cstring>

#include "capi/api.h"

using namespace dpar;
using namespace dpar::capi;

namespace dpar::capi {

Device checked_device(dpar_device d, const char* argument) {
  Device dev{checked_device_kind(d.kind, argument), d.index};
  check_device_exists(dev, argument);
  return dev;
}

}  // namespace dpar::capi

namespace {

// A tensor handed out through DLPack: the DLManagedTensor and what keeps the storage alive, freed together.
struct DlpackExport {
  DLManagedTensor managed{};
  Tensor tensor;
  std::shared_ptr<void> external;  // the imported DLPack tensor the memory belongs to, if it is one
  int64_t shape[DPAR_MAX_DIMS] = {0, 0, 0, 0};
};

void release_dlpack_export(DLManagedTensor* managed) {
  delete static_cast<DlpackExport*>(managed->manager_ctx);
}

}  // namespace

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
    *out = to_c(d);
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

DPAR_API dpar_status dpar_tensor_info(int32_t* out_dtype, size_t* out_numel, dpar_device* out_device,
                                      const dpar_tensor* tensor) {
  return guard([&] {
    const auto& t = checked(tensor, "tensor").tensor;
    if (out_dtype) *out_dtype = to_c(t.dtype());
    if (out_numel) *out_numel = static_cast<size_t>(t.numel());
    if (out_device) *out_device = to_c(t.device());
  });
}

DPAR_API dpar_status dpar_tensor_from_dlpack(dpar_tensor** out, DLManagedTensor* managed) {
  return guard([&] {
    checked_out(out);
    *out = nullptr;
    DPAR_CHECK_ARG(managed != nullptr, "managed: is NULL");
    const DLTensor& d = managed->dl_tensor;
    // The device type as the integer it is: a producer may send a value outside DLDeviceType as dpar knows it
    // (a newer DLPack's), and loading that through the enum type is undefined behaviour.
    static_assert(sizeof(DLDeviceType) == sizeof(int32_t), "DLPack's device type is a 32-bit integer");
    int32_t device_type = 0;
    std::memcpy(&device_type, &d.device.device_type, sizeof device_type);
    Device dev;
    switch (device_type) {
      case kDLCPU:
        break;
      case kDLCUDA:
        dev = checked_device(dpar_device{DPAR_DEVICE_CUDA, d.device.device_id}, "managed->dl_tensor.device (kDLCUDA)");
        break;
      default:
        fail(Status::kNotSupported, "managed->dl_tensor.device: DLPack device type ", device_type,
             " is not one dpar has (kDLCPU, kDLCUDA)");
    }
    DType dt = DType::kF32;
    if (d.dtype.code == kDLFloat && d.dtype.bits == 32 && d.dtype.lanes == 1) {
      dt = DType::kF32;
    } else if (d.dtype.code == kDLInt && d.dtype.bits == 32 && d.dtype.lanes == 1) {
      dt = DType::kI32;
    } else {
      fail(Status::kInvalidArgument, "managed->dl_tensor.dtype: code ", static_cast<int>(d.dtype.code), ", ",
           static_cast<int>(d.dtype.bits), " bits, ", d.dtype.lanes, " lanes: dpar takes float32 and int32");
    }
    DPAR_CHECK_ARG(d.ndim >= 1 && d.ndim <= DPAR_MAX_DIMS, "managed->dl_tensor.ndim: ", d.ndim, " must be 1 to ",
                   DPAR_MAX_DIMS);
    DPAR_CHECK_ARG(d.shape != nullptr, "managed->dl_tensor.shape: is NULL");
    const Shape s = Shape::checked(d.shape, static_cast<size_t>(d.ndim), "managed->dl_tensor.shape");
    if (d.strides) {
      // Compact row-major only; an extent of 1 may carry any stride (frameworks disagree on it).
      int64_t expected = 1;
      for (int i = d.ndim - 1; i >= 0; --i) {
        DPAR_CHECK_ARG(d.shape[i] == 1 || d.strides[i] == expected, "managed->dl_tensor.strides[", i, "]: ",
                       d.strides[i], " (expected ", expected, "): dpar takes compact row-major tensors only");
        expected *= d.shape[i];
      }
    }
    DPAR_CHECK_ARG(d.data != nullptr, "managed->dl_tensor.data: is NULL");
    // The first element's address, data + byte_offset, and the last byte's must not wrap around the address
    // space (an offset of 2^64 - 4 would read before the buffer), no object spans more than PTRDIFF_MAX bytes
    // (an offset of 2^63 is no real one), and elements must be aligned (int32 labels at an odd address are
    // misaligned reads). Computed on integers: the pointer sum itself would be undefined.
    const auto base = reinterpret_cast<uintptr_t>(d.data);
    const uint64_t bytes = static_cast<uint64_t>(s.numel()) * dtype_size(dt);  // at most 2^42 (Shape::checked)
    constexpr auto kMaxSpan = static_cast<uint64_t>(PTRDIFF_MAX);
    DPAR_CHECK_ARG(d.byte_offset <= kMaxSpan - bytes && d.byte_offset <= UINTPTR_MAX - base &&
                       bytes <= UINTPTR_MAX - base - d.byte_offset,
                   "managed->dl_tensor.byte_offset: ", d.byte_offset, " with ", bytes,
                   " bytes of data runs past the end of the address space");
    const uintptr_t first = base + static_cast<uintptr_t>(d.byte_offset);
    DPAR_CHECK_ARG(first % dtype_size(dt) == 0, "managed->dl_tensor: data + byte_offset (", d.byte_offset,
                   ") is not aligned to the ", dtype_size(dt), "-byte elements");
    void* data = reinterpret_cast<void*>(first);
    // The producer's writes are ordered on the device's legacy default stream (what the Python binding asks
    // __dlpack__(stream=1) for, and what dpar.h asks of a C caller); dpar's streams do not wait for it: wait now.
    if (!dev.is_host()) backend_for(dev).wait_for_legacy_stream(dev);
    auto* h = new_handle<dpar_tensor>();
    h->tensor = Tensor::wrap(data, dt, s, dev);
    h->external = std::shared_ptr<void>(managed, [](void* p) {
      auto* m = static_cast<DLManagedTensor*>(p);
      if (m->deleter) m->deleter(m);
    });
    *out = h;
  });
}

DPAR_API dpar_status dpar_tensor_to_dlpack(DLManagedTensor** out, dpar_tensor* tensor) {
  return guard([&] {
    checked_out(out);
    *out = nullptr;
    const dpar_tensor& h = checked(tensor, "tensor");
    const Tensor& t = h.tensor;
    // The export must keep what it points into alive after the handle is freed. dpar's own storage and an
    // imported DLPack tensor (held through `external`) can be; a caller's buffer (dpar_tensor_wrap_host) cannot.
    DPAR_CHECK_ARG(t.owns_memory() || h.external, "tensor: its memory belongs to the caller (dpar_tensor_wrap_host, "
                   "or a view of such a tensor), which dpar cannot keep alive; export a copy (dpar_tensor_create "
                   "and dpar_tensor_copy_from_host)");
    auto ex = std::make_unique<DlpackExport>();
    ex->tensor = t;  // shares the storage: the tensor handle may be freed first
    ex->external = h.external;
    for (size_t i = 0; i < t.shape().ndim(); ++i) ex->shape[i] = t.shape()[i];
    DLTensor& d = ex->managed.dl_tensor;
    d.data = t.raw();
    const Device dev = t.device();
    d.device = dev.is_host() ? DLDevice{kDLCPU, 0} : DLDevice{kDLCUDA, dev.index};
    d.ndim = static_cast<int32_t>(t.shape().ndim());
    d.dtype = t.dtype() == DType::kI32 ? DLDataType{kDLInt, 32, 1} : DLDataType{kDLFloat, 32, 1};
    DPAR_CHECK_ARG(t.dtype() == DType::kI32 || t.dtype() == DType::kF32, "tensor: only f32 and i32 tensors");
    d.shape = ex->shape;
    d.strides = nullptr;  // compact row-major
    d.byte_offset = 0;
    ex->managed.manager_ctx = ex.get();
    ex->managed.deleter = release_dlpack_export;
    *out = &ex.release()->managed;
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
