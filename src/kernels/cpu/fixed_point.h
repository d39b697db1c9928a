// Exact sums of f32 values in int64 fixed point (the engine's reproducible mode): values are put on a grid of
// 2^-g (g chosen from the largest exponent, so that every value and every sum of up to K values is an integer below
// 2^51 in magnitude), summed as integers (exact, so in any order and any grouping), and turned back to f32 once.
#pragma once

#include <cstdint>

#include "common/fixed_point.h"

namespace dpar::kernels::cpu {

// The sentinels of max_exponent and the grid's width (common/fixed_point.h, shared with the engine and the other
// backends).
using ::dpar::kFixedPointAllZero;
using ::dpar::kFixedPointBits;
using ::dpar::kFixedPointNotFinite;

// An e with |x[i]| < 2^e for every i: frexp's exponent of the largest magnitude (-125 where it is subnormal);
// kFixedPointAllZero for all zeros (or n == 0), kFixedPointNotFinite if any value is a NaN or an infinity.  x (n)
int max_exponent(const float* x, int64_t n);

// sum[i] (+)= x[i] * 2^scale_exponent rounded to the nearest integer, ties to even: added with `accumulate`,
// written without. Each |x[i] * 2^scale_exponent| must be at most 2^kFixedPointBits (the caller's grid ensures it).
// sum (n), x (n)
void to_grid(int64_t* sum, const float* x, int64_t n, int scale_exponent, bool accumulate);

// out[i] = f32(double(sum[i]) * factor), for |sum[i]| <= 2^kFixedPointBits (which converts to double exactly): the
// product is the one rounding in double and the conversion to f32 the other.  out (n), sum (n)
void from_grid(float* out, const int64_t* sum, int64_t n, double factor);

}  // namespace dpar::kernels::cpu
