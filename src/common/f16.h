// IEEE binary16 (half: sign, 5 exponent bits, 10 mantissa bits), as torch.float16, CUDA's __half and cuBLAS's
// CUDA_R_16F store it. Mixed precision's second compute dtype: the operands of a layer's products rounded to it
// (its 11 significant bits make their products exact in f32), which overflow to infinity above 65504, the reason
// fp16 training scales its loss (engine/loss_scaler.h).
//
// One definition for the CPU kernels and the CUDA ones (DPAR_HOST_DEVICE), so that both backends round every value,
// NaNs included, to the same bits. Integer arithmetic only: the result does not depend on the FPU's rounding mode or
// on flush-to-zero (a subnormal f16 is rounded from the float's bits, not by a float addition).
#pragma once

#include <cstdint>
#include <cstring>

#include "common/host_device.h"

namespace dpar {

// An f16 element held as its bits, so that typed access to f16 memory (TensorRef::contiguous_as<Half>) is checked
// against DType::kF16 as uint16_t's is against kBF16. Same size and layout as the bits.
struct Half {
  uint16_t bits;
};
static_assert(sizeof(Half) == 2, "Half is its 16 bits");

namespace f16_detail {
DPAR_HOST_DEVICE inline uint32_t float_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
#endif
}
DPAR_HOST_DEVICE inline float bits_float(uint32_t b) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(b);
#else
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
#endif
}
}  // namespace f16_detail

// f rounded to the nearest f16, ties to even (torch's float -> half, F16C's VCVTPS2PH with round-to-nearest):
// magnitudes from 65520 (half an ulp above 65504, a tie that rounds to the even infinity) overflow to infinity;
// below 2^-14 the result is subnormal, and at most 2^-25 rounds to zero; a NaN stays a NaN of its sign, made quiet,
// with the top 9 bits of its payload (as VCVTPS2PH does).
DPAR_HOST_DEVICE inline uint16_t to_f16(float f) {
  const uint32_t x = f16_detail::float_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t a = x & 0x7fffffffu;
  uint32_t h;
  if (a > 0x7f800000u) {
    h = 0x7e00u | ((a >> 13) & 0x03ffu);  // NaN
  } else if (a >= 0x477ff000u) {
    h = 0x7c00u;  // infinity, or a finite value that rounds to it
  } else if (a >= 0x38800000u) {
    // Normal: rebias the exponent (127 -> 15) and round the 23-bit mantissa to 10 bits; a carry out of the mantissa
    // moves into the exponent, which is the correct rounding too.
    const uint32_t r = a - 0x38000000u;
    h = (r + 0x0fffu + ((r >> 13) & 1u)) >> 13;
  } else {
    // Subnormal or zero: the value in units of 2^-24 (f16's smallest subnormal) is m * 2^(e - 126) for the float's
    // significand m (implicit bit set) and biased exponent e, rounded to an integer, ties to even.
    const uint32_t e = a >> 23;
    const uint32_t shift = 126u - e;  // >= 14 here
    if (shift > 24u) {
      h = 0;  // below 2^-25 (f32 subnormals included): rounds to zero
    } else {
      const uint32_t m = (a & 0x007fffffu) | 0x00800000u;
      const uint32_t q = m >> shift, rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
      h = q + ((rest > half || (rest == half && (q & 1u))) ? 1u : 0u);
    }
  }
  return static_cast<uint16_t>(sign | h);
}

// Exact: every f16 is a float. A NaN keeps its sign and payload and is made quiet (as F16C's VCVTPH2PS does).
DPAR_HOST_DEVICE inline float from_f16(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x03ffu;
  uint32_t bits;
  if (e == 0x1fu) {
    bits = sign | 0x7f800000u | (m << 13) | (m != 0 ? 0x00400000u : 0u);  // infinity, or a quiet NaN
  } else if (e != 0) {
    bits = sign | ((e + 112u) << 23) | (m << 13);
  } else if (m == 0) {
    bits = sign;
  } else {
    // Subnormal: m * 2^-24, a normal float. Normalise m (its top set bit becomes the implicit one).
    uint32_t shift = 0;
    uint32_t mm = m;
    while ((mm & 0x0400u) == 0) mm <<= 1, ++shift;
    bits = sign | ((113u - shift) << 23) | ((mm & 0x03ffu) << 13);
  }
  return f16_detail::bits_float(bits);
}

}  // namespace dpar
