// A tensor reference: what crosses the seam between the layers and a backend's kernels and ops. Memory of one
// device (the stream's), an element type, up to 4 extents and a stride per extent (in elements), so that a view may
// be a slice, transposed or strided without a copy. It owns nothing: the layer that passes one keeps the memory
// alive for the call.
//
// A kernel reads the dtype and chooses its implementation by it (as ggml's backends and oneDNN's primitives do);
// one that needs contiguous memory says so with contiguous_as<T>(), which refuses anything else with a message
// naming the kernel and the argument.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>

#include "common/dtype.h"
#include "common/error.h"

namespace dpar {

struct TensorRef {
  static constexpr int kMaxDims = 4;

  void* data = nullptr;  // null: the argument is absent (an optional bias, an input gradient not wanted)
  DType dtype = DType::kF32;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};  // in elements

  // Row-major contiguous memory of the given extents (each >= 0, at most kMaxDims of them).
  static TensorRef contiguous(void* data, DType dtype, const int64_t* dims, int ndim) {
    DPAR_ENFORCE(ndim >= 0 && ndim <= kMaxDims, Status::kInternal, "tensor reference: ", ndim, " dimensions");
    TensorRef r;
    r.data = data;
    r.dtype = dtype;
    r.ndim = ndim;
    int64_t stride = 1;
    for (int i = ndim - 1; i >= 0; --i) {
      r.shape[static_cast<size_t>(i)] = dims[i];
      r.strides[static_cast<size_t>(i)] = stride;
      stride *= dims[i];
    }
    return r;
  }
  static TensorRef contiguous(void* data, DType dtype, std::initializer_list<int64_t> dims) {
    return contiguous(data, dtype, dims.begin(), static_cast<int>(dims.size()));
  }
  template <class T>
  static TensorRef of(T* data, std::initializer_list<int64_t> dims) {
    return contiguous(const_cast<std::remove_const_t<T>*>(data), dtype_of<std::remove_const_t<T>>::value, dims);
  }

  bool defined() const { return data != nullptr; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[static_cast<size_t>(i)];
    return n;
  }
  // Extent i; a negative i counts from the last (-1: the last dimension, as PyTorch's (*, C) layers read it).
  int64_t size(int i) const { return shape[static_cast<size_t>(i < 0 ? ndim + i : i)]; }
  // The product of the extents before the last: the rows a (*, C) kernel sees.
  int64_t leading() const {
    int64_t n = 1;
    for (int i = 0; i + 1 < ndim; ++i) n *= shape[static_cast<size_t>(i)];
    return n;
  }
  bool is_contiguous() const {
    int64_t expected = 1;
    for (int i = ndim - 1; i >= 0; --i) {
      const auto u = static_cast<size_t>(i);
      if (shape[u] != 1 && strides[u] != expected) return false;
      expected *= shape[u];
    }
    return true;
  }

  // The same memory seen with other extents of equal element count; contiguous references only.
  TensorRef view(std::initializer_list<int64_t> dims) const {
    TensorRef r = contiguous(data, dtype, dims.begin(), static_cast<int>(dims.size()));
    DPAR_ENFORCE(is_contiguous() && r.numel() == numel(), Status::kInternal, "tensor reference: cannot view ",
                 str(), " as ", r.str());
    return r;
  }
  // Extents [start, start + length) of the last dimension, the other strides kept: a slice without a copy (the
  // q, k and v of one packed projection).
  TensorRef narrow_last(int64_t start, int64_t length) const {
    const auto last = static_cast<size_t>(ndim - 1);
    DPAR_ENFORCE(ndim >= 1 && start >= 0 && length >= 0 && start + length <= shape[last], Status::kInternal,
                 "tensor reference: cannot take [", start, ", ", start + length, ") of the last extent of ", str());
    TensorRef r = *this;
    if (data) r.data = static_cast<char*>(data) + start * strides[last] * static_cast<int64_t>(dtype_size(dtype));
    r.shape[last] = length;
    return r;
  }
  // Dimensions a and b swapped, without a copy (a transposed view).
  TensorRef transposed(int a, int b) const {
    TensorRef r = *this;
    std::swap(r.shape[static_cast<size_t>(a)], r.shape[static_cast<size_t>(b)]);
    std::swap(r.strides[static_cast<size_t>(a)], r.strides[static_cast<size_t>(b)]);
    return r;
  }

  // The memory as T*, for a kernel that reads this reference as contiguous elements of T: throws
  // Error(INVALID_ARGUMENT) naming `what` when the dtype is another or the view is strided. Null when absent.
  template <class T>
  T* contiguous_as(const char* what) const {
    if (!defined()) return nullptr;
    DPAR_CHECK_ARG(dtype == dtype_of<T>::value, what, ": expected ", dtype_name(dtype_of<T>::value), ", got ",
                   dtype_name(dtype));
    DPAR_CHECK_ARG(is_contiguous(), what, ": this kernel reads contiguous memory, got the strided view ", str());
    return static_cast<T*>(data);
  }

  // "f32 (4, 3)" or, strided, "f32 (4, 3) strides (1, 4)".
  std::string str() const {
    std::string s = std::string(dtype_name(dtype)) + " (";
    for (int i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(shape[static_cast<size_t>(i)]);
    s += ")";
    if (!is_contiguous()) {
      s += " strides (";
      for (int i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(strides[static_cast<size_t>(i)]);
      s += ")";
    }
    return s;
  }
};

}  // namespace dpar
