// BatchNorm's CPU kernels, the reference of every backend's: per channel c of x (N,C,L) (L = 1 for (N,C), H*W for
// (N,C,H,W)), in double accumulation. Split into reductions and elementwise passes so that SyncBatchNorm can sum
// the reductions over every replica between them.
#pragma once

#include <cstdint>

namespace dpar::kernels::cpu {

// sums (2,C) = per channel Σx, then Σx², over N*L elements each (overwritten; zeros for N = 0).
// x (N,C,L)
void batchnorm_stats(double* sums, const float* x, int64_t N, int64_t C, int64_t L);

// mean_invstd (2,C): training (sums of `count` elements each, count >= 2): mean = Σx/count, biased variance
// Σx²/count - mean², invstd = 1/sqrt(var + eps); running_mean/var (C) move toward mean and the unbiased variance
// var*count/(count-1) by `momentum`, and *num_batches_tracked grows by one (PyTorch's BatchNorm). Eval (sums
// null): mean and invstd from running_mean and running_var, which stay as they are.
void batchnorm_moments(double* mean_invstd, float* running_mean, float* running_var, int64_t* num_batches_tracked,
                       const double* sums, double count, int64_t C, float eps, float momentum);

// out (N,C,L) = (x - mean) * invstd * weight + bias, then max(., 0) with relu (NaN passes through, as relu_forward);
// weight, bias (C) or null (no affine).
void batchnorm_apply(float* out, const float* x, const double* mean_invstd, const float* weight, const float* bias,
                     int64_t N, int64_t C, int64_t L, bool relu = false);

// sums (2,C) = per channel Σdy, then Σdy·x̂ with x̂ = (x - mean) * invstd (overwritten).
// dout (N,C,L), x (N,C,L)
void batchnorm_backward_reduce(double* sums, const float* dout, const float* x, const double* mean_invstd, int64_t N,
                               int64_t C, int64_t L);

// dweight, dbias (C) (or null) = this chunk's Σdy·x̂ and Σdy from `local` (overwritten, or added to when
// accumulate); dinp (N,C,L) (or null) = weight*invstd*(dy - Σdy/count - x̂·Σdy·x̂/count) with the sums of the whole
// batch of `count` elements per channel (`global`), or weight*invstd*dy in eval mode (global null: the running
// statistics are constants).
void batchnorm_backward_apply(float* dinp, float* dweight, float* dbias, const double* local, const double* global,
                              double count, const float* dout, const float* x, const double* mean_invstd,
                              const float* weight, int64_t N, int64_t C, int64_t L, bool accumulate);

}  // namespace dpar::kernels::cpu
