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

// A range [begin, end) of a replica's flat parameters, in elements.
struct ElementRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};

// Steps some ranges of a replica's flat parameters and keeps state for them alone: in the engine each replica steps
// its own shard of the summed gradient (its block of every gradient bucket; world_block), so each holds 1/R of the
// optimizer's state (ZeRO stage 1; R the replicas of every process where the shards span them) rather than a full
// copy that only its shard would keep current.
class Optimizer {
 public:
  // State buffers (zeros) on `device` for the elements of `ranges` (ordered, not overlapping; empty ones allowed).
  Optimizer(const OptimizerConfig& config, std::vector<ElementRange> ranges, Device device);
  // One range.
  Optimizer(const OptimizerConfig& config, int64_t begin, int64_t end, Device device)
      : Optimizer(config, std::vector<ElementRange>{{begin, end}}, device) {}

  // One step of the ranges' elements of `params` (the whole flat buffer) from the same elements of `grads`,
  // queued on `stream`. The element-wise formulas make the steps of ranges equal, bit for bit, to one step over all.
  void step(Stream& stream, float* params, const float* grads);
  void set_lr(float lr) { config_.lr = lr; }
  void set_max_grad_norm(float max_norm) { config_.max_grad_norm = max_norm; }
  // The elements stepped without weight decay from the next step on (ordered, not overlapping; in the same
  // elements as the ranges): a second parameter group with weight_decay 0, as PyTorch users give biases and norms.
  // Empty (the default): every element decays. The state is unchanged: its layout is the ranges', whatever the
  // groups.
  void set_no_decay(std::vector<ElementRange> no_decay);
  const std::vector<ElementRange>& no_decay() const { return no_decay_; }
  const OptimizerConfig& config() const { return config_; }
  int64_t steps() const { return steps_; }
  void set_steps(int64_t steps) { steps_ = steps; }
  const std::vector<ElementRange>& ranges() const { return ranges_; }
  // Elements in all ranges.
  int64_t num_elements() const { return elements_; }

  // Named state buffers ("momentum_buffer"; "exp_avg", "exp_avg_sq"), each num_elements() long: the ranges' states
  // one after the other, in range order. Every kind of state is listed even when there are no elements (its
  // tensors are then undefined).
  std::vector<std::pair<std::string, Tensor>> state() const;
  // The state's names for this configuration, without a replica.
  static std::vector<std::string> state_names(const OptimizerConfig& config);
  // Bytes of state held (for tests: the shards of a replica set add up to one full state).
  size_t state_bytes() const;

 private:
  OptimizerConfig config_;
  std::vector<ElementRange> ranges_;
  std::vector<ElementRange> no_decay_;
  int64_t elements_ = 0;
  int64_t steps_ = 0;
  Tensor buf_a_;  // momentum buffer, or Adam's exp_avg (undefined for SGD without momentum, or no elements)
  Tensor buf_b_;  // Adam's exp_avg_sq
};

}  // namespace dpar
