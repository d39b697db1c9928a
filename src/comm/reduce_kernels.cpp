#include "comm/reduce_kernels.h"

#include <type_traits>

#include "common/bf16.h"

#include "common/error.h"

namespace dpar {
namespace {

// Not under ThreadSanitizer: it instruments the clones' load-time resolver, which then runs before its runtime is
// relocated and crashes every program at start-up.
#if defined(__SANITIZE_THREAD__)
#define DPAR_CLONES
#else
#define DPAR_CLONES __attribute__((target_clones("avx2", "default")))
#endif

// Integer sums wrap (in unsigned arithmetic: no undefined behaviour on overflow).
template <class T>
inline T add(T a, T b) {
  if constexpr (std::is_integral_v<T>)
    return static_cast<T>(static_cast<std::make_unsigned_t<T>>(a) + static_cast<std::make_unsigned_t<T>>(b));
  else
    return a + b;
}
// max/min keep the earlier operand on ties (so -0 vs +0 follows rank order) and propagate NaN, as torch.max does.
// The `|` (not `||`) keeps the loop branch-free, so it vectorises to compare, or, blend.
template <class T>
inline T max_of(T acc, T x) {
  if constexpr (std::is_floating_point_v<T>)
    return ((x > acc) | (x != x)) ? x : acc;
  else
    return x > acc ? x : acc;
}
template <class T>
inline T min_of(T acc, T x) {
  if constexpr (std::is_floating_point_v<T>)
    return ((x < acc) | (x != x)) ? x : acc;
  else
    return x < acc ? x : acc;
}

template <class T, T (*F)(T, T)>
inline __attribute__((always_inline)) void combine_into(T* __restrict dst, const T* __restrict src, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = F(dst[i], src[i]);
}
template <class T, T (*F)(T, T)>
inline __attribute__((always_inline)) void combine_two(T* __restrict dst, const T* __restrict a, const T* __restrict b,
                                                       size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = F(a[i], b[i]);
}
template <class T>
inline __attribute__((always_inline)) void divide(T* x, size_t n, size_t divisor) {
  const T d = static_cast<T>(divisor);
  for (size_t i = 0; i < n; ++i) x[i] = x[i] / d;  // integers: truncates toward zero
}

#define DPAR_COMBINE_KERNELS(NAME, T, F)                                                               \
  DPAR_CLONES void NAME##_into(void* dst, const void* src, size_t n) {                                 \
    combine_into<T, F<T>>(static_cast<T*>(dst), static_cast<const T*>(src), n);                        \
  }                                                                                                    \
  DPAR_CLONES void NAME##_two(void* dst, const void* a, const void* b, size_t n) {                     \
    combine_two<T, F<T>>(static_cast<T*>(dst), static_cast<const T*>(a), static_cast<const T*>(b), n); \
  }
#define DPAR_TYPE_KERNELS(NAME, T)            \
  DPAR_COMBINE_KERNELS(NAME##_sum, T, add)    \
  DPAR_COMBINE_KERNELS(NAME##_max, T, max_of) \
  DPAR_COMBINE_KERNELS(NAME##_min, T, min_of) \
  DPAR_CLONES void NAME##_div(void* x, size_t n, size_t divisor) { divide(static_cast<T*>(x), n, divisor); }

DPAR_TYPE_KERNELS(f32, float)
DPAR_TYPE_KERNELS(f64, double)
DPAR_TYPE_KERNELS(i32, int32_t)
DPAR_TYPE_KERNELS(i64, int64_t)

// bfloat16 sums, in float with each sum rounded back (common/bf16.h), so that a + b == b + a bit for bit.
template <class T>
inline T add_bf16_of(T a, T b) {
  return to_bf16(from_bf16(a) + from_bf16(b));
}
DPAR_COMBINE_KERNELS(bf16_sum, uint16_t, add_bf16_of)

DPAR_CLONES void scale_f32_kernel(float* x, float scale, size_t n) {
  for (size_t i = 0; i < n; ++i) x[i] *= scale;
}

#define DPAR_KERNELS(NAME, OP) \
  ReduceKernels { NAME##_##OP##_into, NAME##_##OP##_two, NAME##_div }
// kMean sums, then divides.
#define DPAR_KERNEL_ROW(NAME) \
  { DPAR_KERNELS(NAME, sum), DPAR_KERNELS(NAME, sum), DPAR_KERNELS(NAME, max), DPAR_KERNELS(NAME, min) }
// [row][op], rows as kernel_row() numbers them, ops in their enum's order.
const ReduceKernels kKernels[4][4] = {DPAR_KERNEL_ROW(f32), DPAR_KERNEL_ROW(f64), DPAR_KERNEL_ROW(i32), DPAR_KERNEL_ROW(i64)};
// The row of kKernels for a dtype; -1 for one with no element-wise kernels.
int kernel_row(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 0;
    case DType::kF64: return 1;
    case DType::kI32: return 2;
    case DType::kI64: return 3;
    default: return -1;
  }
}
// bf16 has a sum only (a mean would have to divide in float and round: no backend offers it).
const ReduceKernels kBf16Sum{bf16_sum_into, bf16_sum_two, nullptr};

}  // namespace

const ReduceKernels& reduce_kernels(DType dtype, ReduceOp op) {
  if (dtype == DType::kBF16 && op == ReduceOp::kSum) return kBf16Sum;
  const int d = kernel_row(dtype), o = static_cast<int>(op);
  DPAR_ENFORCE(d >= 0 && o >= 0 && o < 4, Status::kInternal, "reduce_kernels: dtype ", static_cast<int>(dtype), ", op ", o,
               " has no element-wise kernel");
  return kKernels[d][o];
}

void reduce_into(DType dtype, ReduceOp op, void* dst, const void* src, size_t n) {
  reduce_kernels(dtype, op).into(dst, src, n);
}

void divide_by(DType dtype, void* x, size_t n, size_t divisor) {
  const ReduceKernels& k = reduce_kernels(dtype, ReduceOp::kMean);
  DPAR_ENFORCE(k.div != nullptr, Status::kInternal, "divide_by: ", dtype_name(dtype), " has no mean");
  k.div(x, n, divisor);
}

void scale_f32(float* x, float scale, size_t n) { scale_f32_kernel(x, scale, n); }

}  // namespace dpar
