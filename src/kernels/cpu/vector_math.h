// exp and erf for the CPU kernels' vector loops: branch-free float arithmetic without library calls, so that a
// loop over them vectorizes in every copy run_vector makes (vector_isa.h), and, being made of +, -, * and selects
// alone (no FMA: the kernels are built with -ffp-contract=off), gives the same bits in each copy. libm's expf and
// erff are scalar calls: GELU through erff took a fifth of a GPT's training step on one core.
#pragma once

#include <bit>
#include <cstdint>

#include "kernels/cpu/vector_isa.h"

namespace dpar::kernels::cpu {

// exp(x) for x <= 0 within 2 ulp (Cephes' expf: x = n ln2 + r, |r| <= ln2/2, a degree-6 polynomial in r, times
// 2^n); 0 below -87 (and for -inf), where exp is below FLT_MIN; NaN for NaN. n is rounded to nearest by adding and
// subtracting 1.5 * 2^23 (exact for |n| < 2^22; no contraction or reassociation is allowed in the kernels' build, so
// the two adds stay).
DPAR_VECTOR_LOOP float exp_nonpositive(float x) {
  const float xc = x < -87.0f ? -87.0f : x;
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const float two_n = std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  return x < -87.0f ? 0.0f : p * two_n;
}

// erf(x) within 1.1 ulp over all floats (measured against mpmath at 40,001 points of [-6, 6]; libm's erff is within
// 0.5, CUDA's erff within 2). |x| <= 0.921875: x + x P(x^2), P a degree-7 least-squares fit of erf(x)/x - 1 (adding x
// last keeps the rounding of the leading term out of the polynomial); above: 1 - exp(Q(|x|)) with Q a degree-9 fit
// of log(erfc(|x|)) on [0.921875, 3.95], and 1 past 3.95, where erf rounds to 1; the sign copied from x. The
// coefficients are float32 roundings of the double fits (tests/reference/fit_erf.py).
DPAR_VECTOR_LOOP float erf_approx(float x) {
  const float a = x < 0.0f ? -x : x;
  const float s = x * x;
  float p = -1.0380706953583285e-05f;
  p = p * s + 1.147587172454223e-04f;
  p = p * s + -8.508178289048374e-04f;
  p = p * s + 5.22239226847887e-03f;
  p = p * s + -2.6865821331739426e-02f;
  p = p * s + 1.1283788084983826e-01f;
  p = p * s + -3.7612637877464294e-01f;
  p = p * s + 1.2837916612625122e-01f;
  const float small = x + x * p;
  float q = -3.009905213957609e-08f;
  q = q * a + 2.288354153279215e-06f;
  q = q * a + -5.2135088481009007e-05f;
  q = q * a + 6.288174772635102e-04f;
  q = q * a + -4.86415671184659e-03f;
  q = q * a + 2.6639975607395172e-02f;
  q = q * a + -1.1037243902683258e-01f;
  q = q * a + -6.315866708755493e-01f;
  q = q * a + -1.1303420066833496e+00f;
  q = q * a + 3.4077922464348376e-04f;
  const float tail = a > 3.95f ? 1.0f : 1.0f - exp_nonpositive(q > 0.0f ? 0.0f : q);  // NaN stays NaN
  const float big = x < 0.0f ? -tail : tail;
  return a <= 0.921875f ? small : big;
}

}  // namespace dpar::kernels::cpu
