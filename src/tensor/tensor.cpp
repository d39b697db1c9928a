#include "tensor/tensor.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <sstream>

#include "backend/backend.h"
#include "common/error.h"

namespace dpar {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 4;
    case DType::kI32: return 4;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kI32: return "i32";
  }
  return "?";
}

Shape::Shape(std::initializer_list<int64_t> dims) {
  DPAR_ENFORCE(dims.size() <= kMaxDims, Status::kInternal, "shape: too many dimensions");
  for (int64_t d : dims) dims_[ndim_++] = d;
}

Shape Shape::checked(const int64_t* dims, size_t ndim, const char* argument) {
  DPAR_CHECK_ARG(dims != nullptr, argument, ": shape is NULL");
  DPAR_CHECK_ARG(ndim >= 1 && ndim <= kMaxDims, argument, ": ndim is ", ndim, ", must be 1 to ", kMaxDims);
  Shape s;
  int64_t total = 1;
  for (size_t i = 0; i < ndim; ++i) {
    DPAR_CHECK_ARG(dims[i] >= 1, argument, ": extent ", i, " is ", dims[i], ", must be at least 1");
    DPAR_CHECK_ARG(dims[i] <= (int64_t{1} << 40) / total, argument, ": shape is too large");
    total *= dims[i];
    s.dims_[i] = dims[i];
  }
  s.ndim_ = ndim;
  return s;
}

int64_t Shape::numel() const {
  if (ndim_ == 0) return 0;
  int64_t n = 1;
  for (size_t i = 0; i < ndim_; ++i) n *= dims_[i];
  return n;
}

int64_t Shape::row_numel() const {
  int64_t n = 1;
  for (size_t i = 1; i < ndim_; ++i) n *= dims_[i];
  return n;
}

Shape Shape::with_rows(int64_t rows) const {
  Shape s = *this;
  s.dims_[0] = rows;
  return s;
}

std::string Shape::str() const {
  std::ostringstream os;
  os << '(';
  for (size_t i = 0; i < ndim_; ++i) os << (i ? ", " : "") << dims_[i];
  os << ')';
  return os.str();
}

bool Shape::operator==(const Shape& o) const {
  if (ndim_ != o.ndim_) return false;
  for (size_t i = 0; i < ndim_; ++i)
    if (dims_[i] != o.dims_[i]) return false;
  return true;
}

std::shared_ptr<Storage> Storage::allocate(size_t bytes, Device device) {
  Backend& backend = backend_for(device);
  void* p = backend.allocate(device, bytes);
  try {
    return std::shared_ptr<Storage>(new Storage(p, bytes, device, true));
  } catch (...) {
    backend.deallocate(device, p);
    throw;
  }
}

std::shared_ptr<Storage> Storage::borrow(void* data, size_t bytes, Device device) {
  return std::shared_ptr<Storage>(new Storage(data, bytes, device, false));
}

Storage::~Storage() {
  if (owned_) backend_for(device_).deallocate(device_, data_);
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
