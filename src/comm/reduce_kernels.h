// The element-wise reductions of the host-memory backends' collectives (threads, MPI: fused or through
// MPI_Allreduce with dpar's own MPI operations), defined once (GPU groups use NCCL's operations):
//   - sums of integers wrap (two's complement, computed unsigned: no undefined behaviour on overflow);
//   - sums of floats are IEEE sums in the backend's order (rank order here);
//   - max and min propagate NaN from any operand, as torch.max and torch.min do, and keep the earlier operand on
//     ties (so -0 against +0 follows the order of combination);
//   - kMean is the sum divided by the number of participants (integers truncate toward zero);
//   - bf16 (sums only: the MPI backend's compressed gradients) adds in float and rounds each sum back to bfloat16
//     (common/bf16.h), so a sum is commutative and every rank gets the same bits;
//   - the engine's scaled sums (all_reduce_sum and its kin) multiply the finished sum once by the scale.
// Compiled for AVX2 and for baseline x86-64, chosen at load time. Each element is combined with one operation in a
// fixed order, so every vector width gives the same bits; no FMA is involved (no multiply-add).
#pragma once

#include <cstddef>

#include "comm/communicator.h"

namespace dpar {

// dst op= src; dst = a op b (dst distinct from a and b); x /= divisor.
using IntoFn = void (*)(void*, const void*, size_t);
using TwoFn = void (*)(void*, const void*, const void*, size_t);
using DivFn = void (*)(void*, size_t, size_t);

struct ReduceKernels {
  IntoFn into;  // dst = dst op src, element by element (dst the earlier operand)
  TwoFn two;    // dst = a op b (a the earlier operand)
  DivFn div;    // for kMean (the sum kernels do the rest)
};

// The kernels of (dtype, op) for f32, f64, i32 and i64 (kMean: the sum's), and of bf16's sum. Throws INTERNAL for
// the other bf16 reductions, which no backend offers.
const ReduceKernels& reduce_kernels(DType dtype, ReduceOp op);

// dst[i] = dst[i] op src[i] for i < n, with the rules above (kMean: the sum; the caller divides).
void reduce_into(DType dtype, ReduceOp op, void* dst, const void* src, size_t n);

// x[i] /= divisor for i < n: a kMean's division of the sum (integers truncate toward zero).
void divide_by(DType dtype, void* x, size_t n, size_t divisor);

// x[i] *= scale for i < n: the scale of all_reduce_sum and its kin.
void scale_f32(float* x, float scale, size_t n);

}  // namespace dpar
