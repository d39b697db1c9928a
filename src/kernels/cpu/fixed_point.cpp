#include "kernels/cpu/fixed_point.h"

#include <cmath>
#include <cstring>

#include "kernels/cpu/vector_isa.h"

namespace dpar::kernels::cpu {

namespace {

// The largest magnitude's bits: |x| as an integer orders as |x| does, and every NaN or infinity is at least
// 0x7f800000. An integer max, so that every copy vectorises.
DPAR_VECTOR_LOOP uint32_t max_magnitude_bits(const float* x, int64_t n) {
  uint32_t largest = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, sizeof u);
    u &= 0x7fffffffu;
    largest = u > largest ? u : largest;
  }
  return largest;
}

// 1.5 * 2^52: v + kMagic for |v| <= 2^51 lies in [2^52, 2^53), where doubles are the integers, so the addition
// rounds v to an integer (to nearest, ties to even) and the integer is the difference of the bit patterns.
constexpr double kMagic = 6755399441055744.0;

DPAR_VECTOR_LOOP void to_grid_loop(int64_t* sum, const float* x, int64_t n, double grid, bool accumulate) {
  int64_t magic_bits;
  std::memcpy(&magic_bits, &kMagic, sizeof magic_bits);
  const int64_t keep = accumulate ? -1 : 0;  // a mask, so that one loop body serves both
  for (int64_t i = 0; i < n; ++i) {
    const double t = static_cast<double>(x[i]) * grid + kMagic;  // the product is exact: grid is a power of two
    int64_t bits;
    std::memcpy(&bits, &t, sizeof bits);
    sum[i] = (sum[i] & keep) + (bits - magic_bits);
  }
}

// The inverse of the magic addition: for |s| <= 2^51 the bits of kMagic plus s are those of the double kMagic + s,
// so subtracting kMagic gives s exactly. Unlike an int64-to-double conversion, that vectorises without AVX-512DQ.
DPAR_VECTOR_LOOP void from_grid_loop(float* out, const int64_t* sum, int64_t n, double factor) {
  int64_t magic_bits;
  std::memcpy(&magic_bits, &kMagic, sizeof magic_bits);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t bits = magic_bits + sum[i];
    double t;
    std::memcpy(&t, &bits, sizeof t);
    out[i] = static_cast<float>((t - kMagic) * factor);
  }
}

}  // namespace

int max_exponent(const float* x, int64_t n) {
  const uint32_t largest = n > 0 ? run_vector<max_magnitude_bits>(x, n) : 0u;
  if (largest >= 0x7f800000u) return kFixedPointNotFinite;
  if (largest == 0) return kFixedPointAllZero;
  // A normal value of biased exponent b is 1.f * 2^(b - 127) < 2^(b - 126); a subnormal is below 2^-126.
  const int biased = static_cast<int>(largest >> 23);
  return (biased > 0 ? biased : 1) - 126;
}

void to_grid(int64_t* sum, const float* x, int64_t n, int scale_exponent, bool accumulate) {
  if (n > 0) run_vector<to_grid_loop>(sum, x, n, std::ldexp(1.0, scale_exponent), accumulate);
}

void from_grid(float* out, const int64_t* sum, int64_t n, double factor) {
  if (n > 0) run_vector<from_grid_loop>(out, sum, n, factor);
}

}  // namespace dpar::kernels::cpu
