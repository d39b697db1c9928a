// Optimizers over a replica's flat parameter buffer, with PyTorch's update formulas (the backend's kernels). The
// state lives on the replica's device.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/stream.h"
#include "tensor/tensor.h"

namespace dpar {

enum class OptimizerKind : int32_t {
  kSgd,   // torch.optim.SGD
  kAdam,  // torch.optim.Adam (L2 weight decay added to the gradient)
  kAdamW  // torch.optim.AdamW (decoupled weight decay)
};

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kSgd;
  float lr = 0.01f, momentum = 0.0f, dampening = 0.0f;
  bool nesterov = false;
  float weight_decay = 0.0f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
  // Before each step, the gradient's global L2 norm is clipped to this, as torch.nn.utils.clip_grad_norm_ does
  // between backward and the step; 0: no clipping.
  float max_grad_norm = 0.0f;

  // Checks every value, naming the field that is wrong (`what`: the options' name, as "optimizer").
  void check(const char* what) const;
  const char* name() const;  // "sgd", "adam", "adamw"
};

class Optimizer {
 public:
  // State buffers (zeros) on `device`.
  Optimizer(const OptimizerConfig& config, int64_t num_params, Device device);

  // One step over all parameters, queued on `stream`.
  void step(Stream& stream, float* params, const float* grads) { step_range(stream, params, grads, 0, num_params_); }
  // One step that updates (and keeps state for) only elements [begin, end) (clipped to the parameters): the step
  // counter still advances once. The element-wise formulas make a step over ranges equal, bit for bit, to a step
  // over all of them.
  void step_range(Stream& stream, float* params, const float* grads, int64_t begin, int64_t end);
  void set_lr(float lr) { config_.lr = lr; }
  void set_max_grad_norm(float max_norm) { config_.max_grad_norm = max_norm; }
  const OptimizerConfig& config() const { return config_; }
  int64_t steps() const { return steps_; }
  void set_steps(int64_t steps) { steps_ = steps; }

  // Named state buffers, each num_params long ("momentum_buffer"; "exp_avg", "exp_avg_sq"), for checkpoints.
  std::vector<std::pair<std::string, Tensor>> state() const;

 private:
  OptimizerConfig config_;
  int64_t num_params_;
  int64_t steps_ = 0;
  Tensor buf_a_;  // momentum buffer, or Adam's exp_avg (undefined for SGD without momentum)
  Tensor buf_b_;  // Adam's exp_avg_sq
};

}  // namespace dpar
