// The hyper-parameters of one optimizer step, as every layer that takes part in one sees them: the optimizer
// fills them, a replica's Stream carries them, and each device's kernels read them. They sit below the backends
// and the kernels alike, so that neither layer borrows the other's types.
#pragma once

#include <cstdint>

namespace dpar {

struct SgdHyper {
  float lr, momentum, dampening, weight_decay;
  bool nesterov;  // needs momentum > 0 and dampening == 0, as PyTorch requires
};

struct AdamHyper {
  float lr, beta1, beta2, eps, weight_decay;
  bool decoupled;  // true: AdamW (decoupled weight decay); false: Adam (L2 penalty added to the gradient)
};

// The scalars of one Adam step as every device's kernel takes them: derived on the host as PyTorch's Adam derives
// them (in double from the float hyper-parameters, rounded to float where PyTorch hands them to a float tensor
// op), once for the CPU kernel and its CUDA twin alike, so that both see the same bits.
struct AdamScalars {
  bool decay;                   // AdamW with weight_decay != 0: param *= param_scale before the update
  float param_scale;            // 1 - lr * weight_decay; 1 without decay
  bool l2;                      // Adam with weight_decay != 0: grad + weight_decay * param
  float weight_decay;           // the L2 term's factor, as given
  float w1;                     // 1 - beta1: exp_avg.lerp_(grad, w1)
  bool small_weight;            // |w1| < 0.5: which of ATen's two lerp formulas applies
  float one_minus_w1;           // 1 - w1, in float (ATen's lerp)
  float beta2;                  // exp_avg_sq.mul_(beta2)
  float one_minus_beta2;        //   .addcmul_(grad, grad, value=1-beta2)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  float eps;
  float neg_step_size;          // -lr / (1 - beta1^step)
};

// The scalars of step `step` (1-based; the caller checks it).
AdamScalars adam_scalars(const AdamHyper& h, int64_t step);

}  // namespace dpar
