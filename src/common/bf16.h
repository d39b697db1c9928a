// bfloat16: the upper 16 bits of an IEEE float (sign, 8 exponent bits, 7 mantissa bits), as torch.bfloat16 and
// NCCL's ncclBfloat16 store it. Gradients cross the processes in it when compressed: half the bytes, f32's range.
#pragma once

#include <cstdint>
#include <cstring>

namespace dpar {

// f rounded to the nearest bfloat16, ties to even (torch's float -> bfloat16); a NaN stays a (quiet) NaN of its
// sign. The exponent range is f32's: only floats within half a bfloat16 ulp of FLT_MAX (above about 3.396e38)
// round up to infinity.
// Branch-free, so that a loop of it vectorises (a select, not a jump, picks the NaN case).
inline uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x0040u;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// Exact: every bfloat16 is a float.
inline float from_bf16(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace dpar
