#include "tensor/tensor.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <sstream>

#include "backend/backend.h"
#include "common/error.h"

namespace dpar {

namespace {
std::string extents_str(const int64_t* dims, size_t n) {
  std::ostringstream os;
  os << '(';
  for (size_t i = 0; i < n; ++i) os << (i ? ", " : "") << dims[i];
  os << ')';
  return os.str();
}
}  // namespace

int64_t Shape::checked_product(const int64_t* dims, size_t n) {
  // The bound holds for the extents other than 0 too, so that a row of an empty shape (a replica given no rows)
  // is as checked as the shape itself.
  int64_t total = 1;
  bool empty = false;
  for (size_t i = 0; i < n; ++i) {
    DPAR_CHECK_ARG(dims[i] >= 0, "shape ", extents_str(dims, n), ": extent ", i, " is negative");
    if (dims[i] == 0) {
      empty = true;
      continue;
    }
    // total <= kMaxElements here, so neither the division nor the product can overflow.
    DPAR_CHECK_ARG(dims[i] <= kMaxElements / total, "shape ", extents_str(dims, n),
                   " holds more than 2^60 elements (a product of its extents overflows)");
    total *= dims[i];
  }
  return empty ? 0 : total;
}

Shape::Shape(std::initializer_list<int64_t> dims) {
  DPAR_ENFORCE(dims.size() <= kMaxDims, Status::kInternal, "shape: too many dimensions");
  for (int64_t d : dims) dims_[ndim_++] = d;
  checked_product(dims_.data(), ndim_);
}

Shape Shape::of(const int64_t* dims, size_t ndim) {
  DPAR_ENFORCE(ndim <= kMaxDims, Status::kInternal, "shape: ", ndim, " dimensions, at most ", kMaxDims);
  Shape s;
  for (size_t i = 0; i < ndim; ++i) s.dims_[i] = dims[i];
  s.ndim_ = ndim;
  checked_product(s.dims_.data(), ndim);
  return s;
}

Shape Shape::checked(const int64_t* dims, size_t ndim, const char* argument) {
  DPAR_CHECK_ARG(dims != nullptr, argument, ": shape is NULL");
  DPAR_CHECK_ARG(ndim >= 1 && ndim <= kMaxDims, argument, ": ndim is ", ndim, ", must be 1 to ", kMaxDims);
  Shape s;
  int64_t total = 1;
  for (size_t i = 0; i < ndim; ++i) {
    DPAR_CHECK_ARG(dims[i] >= 1, argument, ": extent ", i, " is ", dims[i], ", must be at least 1");
    DPAR_CHECK_ARG(dims[i] <= (int64_t{1} << 40) / total, argument, ": shape ", extents_str(dims, ndim),
                   " is too large (more than 2^40 elements)");
    total *= dims[i];
    s.dims_[i] = dims[i];
  }
  s.ndim_ = ndim;
  return s;
}

int64_t Shape::numel() const { return ndim_ == 0 ? 0 : checked_product(dims_.data(), ndim_); }

int64_t Shape::row_numel() const { return ndim_ == 0 ? 1 : checked_product(dims_.data() + 1, ndim_ - 1); }

Shape Shape::with_rows(int64_t rows) const { return with_dim(0, rows); }

Shape Shape::with_dim(size_t i, int64_t extent) const {
  DPAR_ENFORCE(i < ndim_, Status::kInternal, "shape ", str(), " has no dim ", i);
  Shape s = *this;
  s.dims_[i] = extent;
  checked_product(s.dims_.data(), s.ndim_);
  return s;
}

std::string Shape::str() const { return extents_str(dims_.data(), ndim_); }

bool Shape::operator==(const Shape& o) const {
  if (ndim_ != o.ndim_) return false;
  for (size_t i = 0; i < ndim_; ++i)
    if (dims_[i] != o.dims_[i]) return false;
  return true;
}

namespace {

// Per device kind and index: the bytes held and the peak. Relaxed atomics: each replica allocates from its own
// thread, and a figure read while others allocate is a moment's, as torch.cuda's is.
constexpr int32_t kCountedDevices = 256;
struct DeviceBytes {
  std::atomic<int64_t> held{0}, peak{0};
};
DeviceBytes* counted(Device device) {
  static DeviceBytes table[2][kCountedDevices];
  const auto kind = static_cast<size_t>(device.kind);
  if (kind >= 2 || device.index < 0 || device.index >= kCountedDevices) return nullptr;
  return &table[kind][device.index];
}
void count_allocation(Device device, int64_t bytes) {
  DeviceBytes* d = counted(device);
  if (d == nullptr) return;
  const int64_t now = d->held.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  int64_t peak = d->peak.load(std::memory_order_relaxed);
  while (now > peak && !d->peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

}  // namespace

MemoryStats memory_stats(Device device) {
  const DeviceBytes* d = counted(device);
  if (d == nullptr) return {};
  return {d->held.load(std::memory_order_relaxed), d->peak.load(std::memory_order_relaxed)};
}

void reset_peak_memory(Device device) {
  DeviceBytes* d = counted(device);
  if (d != nullptr) d->peak.store(d->held.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

std::shared_ptr<Storage> Storage::allocate(size_t bytes, Device device) {
  Backend& backend = backend_for(device);
  void* p = backend.allocate(device, bytes);
  try {
    auto storage = std::shared_ptr<Storage>(new Storage(p, bytes, device, true));
    count_allocation(device, static_cast<int64_t>(bytes));
    return storage;
  } catch (...) {
    backend.deallocate(device, p);
    throw;
  }
}

std::shared_ptr<Storage> Storage::borrow(void* data, size_t bytes, Device device) {
  return std::shared_ptr<Storage>(new Storage(data, bytes, device, false));
}

Storage::~Storage() {
  if (!owned_) return;
  backend_for(device_).deallocate(device_, data_);
  count_allocation(device_, -static_cast<int64_t>(bytes_));
}

Tensor Tensor::empty(DType dtype, const Shape& shape, Device device) {
  Tensor t;
  t.storage_ = Storage::allocate(static_cast<size_t>(shape.numel()) * dtype_size(dtype), device);
  t.shape_ = shape;
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::zeros(DType dtype, const Shape& shape, Device device) {
  Tensor t = empty(dtype, shape, device);
  backend_for(device).fill_zero(t.raw(), t.bytes(), device);
  return t;
}

Tensor Tensor::wrap(void* data, DType dtype, const Shape& shape, Device device) {
  Tensor t;
  t.storage_ = Storage::borrow(data, static_cast<size_t>(shape.numel()) * dtype_size(dtype), device);
  t.shape_ = shape;
  t.dtype_ = dtype;
  return t;
}

void Tensor::check_dtype(DType expected) const {
  DPAR_ENFORCE(dtype_ == expected, Status::kInvalidArgument, "tensor: expected ", dtype_name(expected), ", got ",
               dtype_name(dtype_));
}

float* Tensor::f32() const {
  DPAR_ENFORCE(dtype_ == DType::kF32, Status::kInvalidArgument, "tensor: expected f32, got ", dtype_name(dtype_));
  return static_cast<float*>(raw());
}

int32_t* Tensor::i32() const {
  DPAR_ENFORCE(dtype_ == DType::kI32, Status::kInvalidArgument, "tensor: expected i32, got ", dtype_name(dtype_));
  return static_cast<int32_t*>(raw());
}

void Tensor::copy_from_host(const void* src) const {
  backend_for(device()).copy_from_host(raw(), src, bytes(), device());
}

void Tensor::copy_to_host(void* dst) const { backend_for(device()).copy_to_host(dst, raw(), bytes(), device()); }

Tensor Tensor::rows(int64_t begin, int64_t count) const {
  DPAR_ENFORCE(begin >= 0 && count >= 0 && begin + count <= shape_[0], Status::kInternal, "tensor: rows [", begin,
               ", ", begin + count, ") out of ", shape_.str());
  Tensor t = *this;
  t.offset_ = offset_ + static_cast<size_t>(begin * shape_.row_numel()) * dtype_size(dtype_);
  t.shape_ = shape_.with_rows(count);
  return t;
}

Tensor Tensor::reshaped(const Shape& shape) const {
  DPAR_ENFORCE(shape.numel() == numel(), Status::kInternal, "tensor: cannot view ", shape_.str(), " as ", shape.str());
  Tensor t = *this;
  t.shape_ = shape;
  return t;
}

}  // namespace dpar
