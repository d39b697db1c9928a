#include "common/optimizer_hyper.h"

#include <cmath>

namespace dpar {

// Built into dpar_core without contraction of a*b+c (CMakeLists.txt), as the kernels are: one definition, so that
// the CPU kernel and the CUDA twin's host code cannot derive the scalars differently.
AdamScalars adam_scalars(const AdamHyper& h, int64_t step) {
  const double lr = h.lr, beta1 = h.beta1, beta2 = h.beta2, wd = h.weight_decay;
  // PyTorch keeps `step` in a float32 tensor and reads it back as a Python float.
  const double step_d = static_cast<double>(static_cast<float>(step));
  const double bias_correction1 = 1.0 - std::pow(beta1, step_d);
  const double bias_correction2 = 1.0 - std::pow(beta2, step_d);
  const double step_size = lr / bias_correction1;
  const double bias_correction2_sqrt = std::sqrt(bias_correction2);  // Python's bc2 ** 0.5, correctly rounded

  AdamScalars s;
  s.decay = h.decoupled && wd != 0.0;
  s.param_scale = s.decay ? static_cast<float>(1.0 - lr * wd) : 1.0f;  // param.mul_(1 - lr*wd)
  s.l2 = !h.decoupled && wd != 0.0;
  s.weight_decay = h.weight_decay;
  s.w1 = static_cast<float>(1.0 - beta1);
  // ATen's lerp picks its formula by the weight as the kernel sees it (float), with 1 - w computed in float.
  s.small_weight = std::fabs(s.w1) < 0.5f;
  s.one_minus_w1 = 1.0f - s.w1;
  s.beta2 = h.beta2;
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.bias_correction2_sqrt = static_cast<float>(bias_correction2_sqrt);
  s.eps = h.eps;
  s.neg_step_size = static_cast<float>(-step_size);
  return s;
}

}  // namespace dpar
