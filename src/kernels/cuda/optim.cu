// Optimizer steps on CUDA: one launch updates a whole flat buffer. The formulas, the operation order and the
// scalars derived on the host are the CPU twins' (kernels/cpu/kernels.cpp, PyTorch's single-tensor SGD and Adam),
// and with --fmad=false and IEEE division and square root every element gets the CPU twin's bits.
#include "kernels/cuda/kernels.h"

#include <cmath>

#include "kernels/cuda/launch.cuh"

namespace dpar::kernels::cuda {

using detail::blocks_for;
using detail::check_count;
using detail::kThreads;

namespace {

// kMomentum: 0 none, 1 first step (buf = d), 2 later steps.
// param (n), momentum_buf (n) or nullptr, grad (n)
template <bool kWd, int kMomentum, bool kNesterov>
__global__ void __launch_bounds__(kThreads) sgd_kernel(float* param, float* momentum_buf, const float* grad, int64_t n, float wd, float mom,
                           float one_minus_damp, float neg_lr) {
  DPAR_GRID_STRIDE_LOOP(i, n) {
    const float p = param[i];
    float d = grad[i];
    if (kWd) d = d + wd * p;  // grad.add(param, alpha=weight_decay)
    if (kMomentum != 0) {
      float buf;
      if (kMomentum == 1) {
        buf = d;  // torch.clone(grad)
      } else {
        buf = momentum_buf[i] * mom;     // buf.mul_(momentum)
        buf = buf + one_minus_damp * d;  //    .add_(grad, alpha=1 - dampening)
      }
      momentum_buf[i] = buf;
      d = kNesterov ? d + mom * buf : buf;
    }
    param[i] = p + neg_lr * d;  // param.add_(grad, alpha=-lr)
  }
}

template <bool kWd>
void sgd_dispatch(float* param, float* momentum_buf, const float* grad, int64_t n, const SgdHyper& h, bool first_step,
                  cudaStream_t stream) {
  const float wd = h.weight_decay, mom = h.momentum, neg_lr = -h.lr;
  const float omd = static_cast<float>(1.0 - static_cast<double>(h.dampening));
  auto kernel = sgd_kernel<kWd, 0, false>;
  if (mom != 0.0f) {
    if (first_step)
      kernel = h.nesterov ? sgd_kernel<kWd, 1, true> : sgd_kernel<kWd, 1, false>;
    else
      kernel = h.nesterov ? sgd_kernel<kWd, 2, true> : sgd_kernel<kWd, 2, false>;
  }
  detail::launch("sgd_step", kernel, blocks_for(n), kThreads, stream, param, momentum_buf, grad, n, wd, mom, omd,
                 neg_lr);
}

// AdamW's decay (p *= decay, decay = 1 - lr*wd, or 1 for none), then Adam (with the L2 term if kL2):
// m = lerp(m, g, w1); v = b2*v + ((1-b2)*g)*g; denom = sqrt(v)/sqrt(bc2) + eps; p += (-step_size*m)/denom.
// param (n), m_buf (n), v_buf (n), grad (n)
template <bool kL2, bool kSmallLerpWeight>
__global__ void __launch_bounds__(kThreads) adam_kernel(float* param, float* m_buf, float* v_buf, const float* grad, int64_t n, float decay,
                            float wd, float w1, float one_minus_w1, float beta2, float one_minus_beta2, float bc2_sqrt,
                            float eps, float neg_step) {
  DPAR_GRID_STRIDE_LOOP(i, n) {
    float p = param[i];
    if (decay != 1.0f) p = p * decay;  // param.mul_(1 - lr*wd), AdamW
    float g = grad[i];
    if (kL2) g = g + wd * p;  // grad.add(param, alpha=weight_decay), Adam
    const float mi = m_buf[i];
    // exp_avg.lerp_(grad, 1-beta1): ATen's two-sided formula, chosen by the weight
    const float m = kSmallLerpWeight ? mi + w1 * (g - mi) : g - (g - mi) * one_minus_w1;
    const float vi = v_buf[i] * beta2;          // exp_avg_sq.mul_(beta2)
    const float v = vi + (one_minus_beta2 * g) * g;  //   .addcmul_(grad, grad, value=1-beta2)
    m_buf[i] = m;
    v_buf[i] = v;
    const float denom = sqrtf(v) / bc2_sqrt + eps;  // (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param[i] = p + (neg_step * m) / denom;          // param.addcdiv_(exp_avg, denom, value=-step_size)
  }
}

}  // namespace

void sgd_step(float* param, float* momentum_buf, const float* grad, int64_t n, const SgdHyper& h, bool first_step,
              cudaStream_t stream) {
  check_count("sgd_step", n);
  DPAR_CHECK_ARG(h.momentum == 0.0f || momentum_buf != nullptr || n == 0, "sgd: momentum needs a momentum buffer");
  DPAR_CHECK_ARG(!h.nesterov || (h.momentum > 0.0f && h.dampening == 0.0f),
                 "sgd: Nesterov momentum requires a momentum and zero dampening");
  if (n == 0) return;
  if (h.weight_decay != 0.0f)  // PyTorch skips the decay term when weight_decay == 0 (inf/NaN parameters)
    sgd_dispatch<true>(param, momentum_buf, grad, n, h, first_step, stream);
  else
    sgd_dispatch<false>(param, momentum_buf, grad, n, h, first_step, stream);
}

void adam_step(float* param, float* exp_avg, float* exp_avg_sq, const float* grad, int64_t n, const AdamHyper& h,
               int64_t step, cudaStream_t stream) {
  check_count("adam_step", n);
  DPAR_CHECK_ARG(step >= 1, "adam: step is 1-based, got ", step);
  if (n == 0) return;
  // The scalars the CPU twin uses (common/optimizer_hyper.h). It scales by param_scale in a separate pass
  // (scale()): the same single multiply per element as the kernel's, which param_scale == 1 skips.
  const AdamScalars s = adam_scalars(h, step);
  auto kernel = s.l2 ? (s.small_weight ? adam_kernel<true, true> : adam_kernel<true, false>)
                     : (s.small_weight ? adam_kernel<false, true> : adam_kernel<false, false>);
  detail::launch("adam_step", kernel, blocks_for(n), kThreads, stream, param, exp_avg, exp_avg_sq, grad, n,
                 s.param_scale, s.weight_decay, s.w1, s.one_minus_w1, s.beta2, s.one_minus_beta2,
                 s.bias_correction2_sqrt, s.eps, s.neg_step_size);
}

}  // namespace dpar::kernels::cuda
