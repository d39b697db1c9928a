// Element types: one list for tensors, a model's buffers, collectives and the kernels' tensor references. The
// numbers are the C ABI's (src/capi/codes.h checks them pair by pair), so that a code crosses as a cast; 4 is the
// ABI's reserved u8, which the core does not hold.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dpar {

struct Half;  // common/f16.h

enum class DType : int32_t {
  kF32 = 0,
  kI32 = 1,   // class labels, token indices
  kBF16 = 2,  // bfloat16 (common/bf16.h): compressed gradient buckets today
  kF16 = 3,   // IEEE half (common/f16.h): mixed precision's second compute dtype
  kF64 = 5,  // statistics kept in double (BatchNorm's sums, LayerNorm's mean and rstd, sums of squares)
  kI64 = 6,  // counters (num_batches_tracked)
};

// Bytes per element. Throws Error(INVALID_ARGUMENT) for a value that is no DType (one read from a peer's record).
size_t dtype_size(DType dtype);
// "f32", "bf16", ...; "unknown dtype" for a value that is none.
const char* dtype_name(DType dtype);

// The DType of a C++ element type, for typed access to memory whose dtype is checked (TensorRef::data_as).
template <class T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::kF32; };
template <> struct dtype_of<double> { static constexpr DType value = DType::kF64; };
template <> struct dtype_of<int32_t> { static constexpr DType value = DType::kI32; };
template <> struct dtype_of<int64_t> { static constexpr DType value = DType::kI64; };
// bfloat16 is held as its bits (common/bf16.h).
template <> struct dtype_of<uint16_t> { static constexpr DType value = DType::kBF16; };
// f16 is held as its bits too, typed apart (common/f16.h's Half) so that the check tells the two apart.
template <> struct dtype_of<Half> { static constexpr DType value = DType::kF16; };

}  // namespace dpar
