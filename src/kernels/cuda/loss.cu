// Losses fused with their gradient, on CUDA. See kernels.h for the contracts and the CPU twins for the formulas.
//
// The loss sum must come out the same on every call, without atomics and without scratch memory (kernels allocate
// nothing). So the kernel that produces it is one block: each thread accumulates its rows' losses in row order,
// in double, and the block adds the per-thread totals in a fixed tree. The gradient, where it is elementwise
// (MSE), runs on a full grid beside it.
#include "kernels/cuda/kernels.h"

#include <math_constants.h>

#include <cmath>

#include "kernels/cuda/launch.cuh"

namespace dpar::kernels::cuda {

using detail::blocks_for;
using detail::kThreads;

namespace {

constexpr int kLossThreads = 1024;  // the one block of a loss kernel

// *out = the block's per-thread values added in a fixed tree (thread 0 stores it).
__device__ void block_sum_to(double* out, double mine) {
  const double total = detail::block_sum<kLossThreads>(mine);
  if (threadIdx.x == 0) *out = total;
}

// One thread per row (rows t, t + 1024, ...), each row exactly as the CPU twin computes it: row max, exp(x - max)
// summed in double in column order, softmax, then the loss logsumexp(x) - x[label] in double; an ignored row
// (kIgnoreIndex) adds nothing and its gradient is zero.
// loss_sum (1), dlogits (B,C) or nullptr, logits (B,C), labels (B)
__global__ void __launch_bounds__(kLossThreads) cross_entropy_kernel(double* loss_sum, float* dlogits, const float* logits, const int32_t* labels,
                                     int64_t B, int64_t C, float grad_scale) {
  double total = 0.0;
  for (int64_t b = threadIdx.x; b < B; b += blockDim.x) {
    const float* x = logits + b * C;
    const int32_t label = labels[b];
    if (label == kIgnoreIndex) {  // PyTorch's ignore_index: no loss, a zero gradient row
      if (dlogits != nullptr)
        for (int64_t j = 0; j < C; ++j) dlogits[b * C + j] = 0.0f;
      continue;
    }
    if (label < 0 || label >= C) {  // the caller checks labels; a bad one poisons the loss, never reads outside
      total += CUDART_NAN;
      if (dlogits != nullptr)
        for (int64_t j = 0; j < C; ++j) dlogits[b * C + j] = CUDART_NAN_F;
      continue;
    }
    float mx = x[0];
    for (int64_t j = 1; j < C; ++j) mx = x[j] > mx ? x[j] : mx;
    double sum = 0.0;
    if (dlogits != nullptr) {
      float* d = dlogits + b * C;
      for (int64_t j = 0; j < C; ++j) {
        const float e = expf(x[j] - mx);
        d[j] = e;  // kept for the softmax below
        sum += static_cast<double>(e);
      }
      const float inv_sum = static_cast<float>(1.0 / sum);
      const float p_label = d[label] * inv_sum;
      for (int64_t j = 0; j < C; ++j) d[j] = d[j] * inv_sum * grad_scale;
      d[label] = (p_label - 1.0f) * grad_scale;
    } else {
      for (int64_t j = 0; j < C; ++j) sum += static_cast<double>(expf(x[j] - mx));
    }
    total += (static_cast<double>(mx) - static_cast<double>(x[label])) + log(sum);
  }
  block_sum_to(loss_sum, total);
}

// Per-sample loss mean over D of (pred - target)^2, one thread per row as the CPU twin (column order, double).
// loss_sum (1), pred (B,D), target (B,D)
__global__ void __launch_bounds__(kLossThreads) mse_loss_kernel(double* loss_sum, const float* pred, const float* target, int64_t B, int64_t D) {
  double total = 0.0;
  for (int64_t b = threadIdx.x; b < B; b += blockDim.x) {
    const float* p = pred + b * D;
    const float* t = target + b * D;
    double s = 0.0;
    for (int64_t j = 0; j < D; ++j) {
      const double diff = static_cast<double>(p[j]) - static_cast<double>(t[j]);
      s += diff * diff;
    }
    total += s / static_cast<double>(D);
  }
  block_sum_to(loss_sum, total);
}

// dpred = (pred - target) * coef, coef = 2 * grad_scale / D.  dpred (B*D), pred (B*D), target (B*D)
__global__ void __launch_bounds__(kThreads) mse_grad_kernel(float* dpred, const float* pred, const float* target, int64_t n, float coef) {
  DPAR_GRID_STRIDE_LOOP(i, n) { dpred[i] = (pred[i] - target[i]) * coef; }
}

}  // namespace

void cross_entropy_forward_backward(double* loss_sum, float* dlogits, const float* logits, const int32_t* labels,
                                    int64_t B, int64_t C, float grad_scale, cudaStream_t stream) {
  DPAR_CHECK_ARG(B >= 0, "cross_entropy: B must be >= 0, got ", B);
  DPAR_CHECK_ARG(C > 0, "cross_entropy: C must be > 0, got ", C);
  DPAR_CHECK_ARG(loss_sum != nullptr, "cross_entropy: loss_sum is null");
  detail::launch("cross_entropy_forward_backward", cross_entropy_kernel, 1, kLossThreads, stream, loss_sum, dlogits,
                 logits, labels, B, C, grad_scale);
}

void mse_forward_backward(double* loss_sum, float* dpred, const float* pred, const float* target, int64_t B,
                          int64_t D, float grad_scale, cudaStream_t stream) {
  DPAR_CHECK_ARG(B >= 0, "mse: B must be >= 0, got ", B);
  DPAR_CHECK_ARG(D > 0, "mse: D must be > 0, got ", D);
  DPAR_CHECK_ARG(loss_sum != nullptr, "mse: loss_sum is null");
  detail::launch("mse_forward_backward (loss)", mse_loss_kernel, 1, kLossThreads, stream, loss_sum, pred, target, B, D);
  const int64_t n = B * D;
  if (dpred != nullptr && n > 0) {
    // The CPU twin's factor, folded into one float the same way.
    const float coef = static_cast<float>(2.0 * static_cast<double>(grad_scale) / static_cast<double>(D));
    detail::launch("mse_forward_backward (gradient)", mse_grad_kernel, blocks_for(n), kThreads, stream, dpred, pred,
                   target, n, coef);
  }
}

}  // namespace dpar::kernels::cuda
