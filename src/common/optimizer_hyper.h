// The hyper-parameters of one optimizer step, as every layer that takes part in one sees them: the optimizer
// fills them, a replica's Stream carries them, and each device's kernels read them. They sit below the backends
// and the kernels alike, so that neither layer borrows the other's types.
#pragma once

namespace dpar {

struct SgdHyper {
  float lr, momentum, dampening, weight_decay;
  bool nesterov;  // needs momentum > 0 and dampening == 0, as PyTorch requires
};

struct AdamHyper {
  float lr, beta1, beta2, eps, weight_decay;
  bool decoupled;  // true: AdamW (decoupled weight decay); false: Adam (L2 penalty added to the gradient)
};

}  // namespace dpar
