// The int64 fixed point of the reproducible mode's exact gradient sums (engine/reproducible.cpp): the sentinels
// and the grid's width that the engine and every backend's fixed-point kernels (backend/kernel_calls.h:
// call::MaxExponent, call::ToGrid, call::FromGrid; on CPU kernels/cpu/fixed_point.h) agree on.
#pragma once

namespace dpar {

// What max_exponent returns for values that are all zero, and for values holding a NaN or an infinity: far outside
// any f32 exponent, so that a max over replicas keeps "not finite" above every exponent and "all zero" below.
constexpr int kFixedPointAllZero = -100000;
constexpr int kFixedPointNotFinite = 100000;
// The magnitude that a value on the grid and any sum of values on it stay below: 2^51, so that rounding to the grid
// is one exact double addition (ties to even) and a sum converts to double exactly.
constexpr int kFixedPointBits = 51;

}  // namespace dpar
