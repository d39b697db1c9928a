// Tensors: contiguous, row-major, up to 4 dimensions, on one device. Storage is shared between a tensor and its
// views (rows() slices the first dimension without a copy: that is how a batch is scattered to CPU replicas).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "common/dtype.h"
#include "common/tensor_ref.h"
#include "device/device.h"

namespace dpar {


// A tensor's extents. Every shape dpar makes holds at most kMaxElements elements: the constructors refuse a larger
// one with Error(INVALID_ARGUMENT) naming its extents, so a product of extents (an element count, a byte count, a
// row's elements) never overflows, wherever a shape comes from (a layer's parameters or output, a reshape, a batch).
class Shape {
 public:
  static constexpr size_t kMaxDims = 4;
  // 2^60: the byte count in the widest dtype (8 bytes) still fits int64. Far past any memory, so a larger shape is
  // a mistake in an argument, never a real tensor.
  static constexpr int64_t kMaxElements = int64_t{1} << 60;

  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  // Internal extents (1..4 dims, each >= 0), checked as the constructor checks them.
  static Shape of(const int64_t* dims, size_t ndim);
  // Checks extents from a caller (1..4 dims, each >= 1, at most 2^40 elements in all).
  static Shape checked(const int64_t* dims, size_t ndim, const char* argument);
  // The product of n extents, the one place one is computed: throws Error(INVALID_ARGUMENT) naming the extents
  // when one is negative or the product passes kMaxElements.
  static int64_t checked_product(const int64_t* dims, size_t n);

  size_t ndim() const { return ndim_; }
  int64_t operator[](size_t i) const { return dims_[i]; }
  const int64_t* data() const { return dims_.data(); }
  int64_t numel() const;
  // Elements per row of the first dimension.
  int64_t row_numel() const;
  // The same shape with another extent of dim 0, or of dim i; checked as a new shape is.
  Shape with_rows(int64_t rows) const;
  Shape with_dim(size_t i, int64_t extent) const;
  std::string str() const;  // "(30, 5)"
  bool operator==(const Shape& o) const;
  bool operator!=(const Shape& o) const { return !(*this == o); }

 private:
  std::array<int64_t, kMaxDims> dims_{};
  size_t ndim_ = 0;
};

// a * b for extents or element counts (each >= 0), checked as a shape's product is.
inline int64_t checked_mul(int64_t a, int64_t b) {
  const int64_t dims[2] = {a, b};
  return Shape::checked_product(dims, 2);
}

// The bytes of dpar's own storage (Storage::allocate; borrowed memory is the caller's) on one device: what is held
// now, and the most held at once since the process started or the last reset_peak_memory (torch.cuda's
// memory_allocated and max_memory_allocated, for every device kind; cpu:K is a replica's virtual device). Devices
// of index 0 to 255 are counted.
struct MemoryStats {
  int64_t allocated = 0;
  int64_t peak = 0;
};
MemoryStats memory_stats(Device device);
// Starts the device's peak again from what it holds now.
void reset_peak_memory(Device device);

// A block of memory on a device, allocated and freed by the device's backend (host memory is 64-byte aligned);
// borrowed memory belongs to the caller.
class Storage {
 public:
  static std::shared_ptr<Storage> allocate(size_t bytes, Device device);
  static std::shared_ptr<Storage> borrow(void* data, size_t bytes, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  // False for borrowed memory: dpar cannot keep it alive, so nothing may hand it out beyond the borrower's scope.
  bool owned() const { return owned_; }

 private:
  Storage(void* data, size_t bytes, Device device, bool owned) : data_(data), bytes_(bytes), device_(device), owned_(owned) {}
  void* data_;
  size_t bytes_;
  Device device_;
  bool owned_;
};

class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(DType dtype, const Shape& shape, Device device);
  static Tensor zeros(DType dtype, const Shape& shape, Device device);
  static Tensor wrap(void* data, DType dtype, const Shape& shape, Device device);

  bool defined() const { return storage_ != nullptr; }
  // Whether dpar owns the memory (allocated it), so that sharing the storage keeps it alive; false for wrap().
  bool owns_memory() const { return storage_ && storage_->owned(); }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  Device device() const { return storage_ ? storage_->device() : Device{}; }
  int64_t numel() const { return shape_.numel(); }
  size_t bytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  int64_t rows() const { return shape_[0]; }

  void* raw() const { return static_cast<char*>(storage_->data()) + offset_; }
  float* f32() const;
  int32_t* i32() const;
  // The memory as T* after checking that the dtype is T's (common/dtype.h's dtype_of).
  template <class T>
  T* data() const {
    check_dtype(dtype_of<T>::value);
    return static_cast<T*>(raw());
  }
  // A reference for a kernel call (common/tensor_ref.h): contiguous, this shape; absent for an undefined tensor.
  TensorRef ref() const {
    return defined() ? TensorRef::contiguous(raw(), dtype_, shape_.data(), static_cast<int>(shape_.ndim()))
                     : TensorRef{};
  }

  // Synchronous copies of all bytes() bytes between the tensor and host memory, through its device's backend
  // (the caller has synchronised the streams that write the tensor).
  void copy_from_host(const void* src) const;
  void copy_to_host(void* dst) const;

  // Rows [begin, begin + count) of the first dimension, sharing storage.
  Tensor rows(int64_t begin, int64_t count) const;
  // The same storage seen with another shape of equal element count.
  Tensor reshaped(const Shape& shape) const;

 private:
  void check_dtype(DType expected) const;
  std::shared_ptr<Storage> storage_;
  size_t offset_ = 0;
  Shape shape_;
  DType dtype_ = DType::kF32;
};

}  // namespace dpar
