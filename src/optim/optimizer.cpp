#include "optim/optimizer.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"

namespace dpar {

OptimizerConfig OptimizerConfig::from_options(const dpar_optimizer_options& o) {
  DPAR_CHECK_ARG(o.kind >= DPAR_SGD && o.kind <= DPAR_ADAMW, "optimizer.kind: unknown kind ", o.kind);
  DPAR_CHECK_ARG(std::isfinite(o.lr) && o.lr >= 0.0f, "optimizer.lr: ", o.lr, " must be finite and >= 0");
  DPAR_CHECK_ARG(std::isfinite(o.weight_decay) && o.weight_decay >= 0.0f, "optimizer.weight_decay: ", o.weight_decay,
                 " must be finite and >= 0");
  OptimizerConfig c;
  c.kind = o.kind;
  c.lr = o.lr;
  c.weight_decay = o.weight_decay;
  if (o.kind == DPAR_SGD) {
    DPAR_CHECK_ARG(std::isfinite(o.momentum) && o.momentum >= 0.0f, "optimizer.momentum: ", o.momentum,
                   " must be finite and >= 0");
    DPAR_CHECK_ARG(std::isfinite(o.dampening), "optimizer.dampening: must be finite");
    // torch.optim.SGD: "Nesterov momentum requires a momentum and zero dampening".
    DPAR_CHECK_ARG(!o.nesterov || (o.momentum > 0.0f && o.dampening == 0.0f),
                   "optimizer.nesterov: requires momentum > 0 and dampening 0");
    c.momentum = o.momentum;
    c.dampening = o.dampening;
    c.nesterov = o.nesterov != 0;
  } else {
    DPAR_CHECK_ARG(o.beta1 >= 0.0f && o.beta1 < 1.0f, "optimizer.beta1: ", o.beta1, " must be in [0, 1)");
    DPAR_CHECK_ARG(o.beta2 >= 0.0f && o.beta2 < 1.0f, "optimizer.beta2: ", o.beta2, " must be in [0, 1)");
    DPAR_CHECK_ARG(std::isfinite(o.eps) && o.eps >= 0.0f, "optimizer.eps: ", o.eps, " must be finite and >= 0");
    c.beta1 = o.beta1;
    c.beta2 = o.beta2;
    c.eps = o.eps;
  }
  return c;
}

const char* OptimizerConfig::name() const {
  switch (kind) {
    case DPAR_SGD: return "sgd";
    case DPAR_ADAM: return "adam";
    default: return "adamw";
  }
}

Optimizer::Optimizer(const OptimizerConfig& config, int64_t num_params, Device device)
    : config_(config), num_params_(num_params) {
  const Shape shape{std::max<int64_t>(num_params, 1)};
  if (config_.kind == DPAR_SGD) {
    if (config_.momentum != 0.0f) buf_a_ = Tensor::zeros(DType::kF32, shape, device);
  } else {
    buf_a_ = Tensor::zeros(DType::kF32, shape, device);
    buf_b_ = Tensor::zeros(DType::kF32, shape, device);
  }
}

void Optimizer::step_range(Stream& stream, float* params, const float* grads, int64_t begin, int64_t end) {
  ++steps_;
  end = std::min(end, num_params_);
  const int64_t n = end - begin;
  if (n <= 0) return;
  params += begin;
  grads += begin;
  if (config_.kind == DPAR_SGD) {
    kernels::cpu::SgdHyper h{config_.lr, config_.momentum, config_.dampening, config_.weight_decay, config_.nesterov};
    stream.sgd_step(params, buf_a_.defined() ? buf_a_.f32() + begin : nullptr, grads, n, h, steps_ == 1);
  } else {
    kernels::cpu::AdamHyper h{config_.lr, config_.beta1, config_.beta2, config_.eps, config_.weight_decay,
                              config_.kind == DPAR_ADAMW};
    stream.adam_step(params, buf_a_.f32() + begin, buf_b_.f32() + begin, grads, n, h, steps_);
  }
}

std::vector<std::pair<std::string, Tensor>> Optimizer::state() const {
  std::vector<std::pair<std::string, Tensor>> s;
  if (config_.kind == DPAR_SGD) {
    if (buf_a_.defined()) s.emplace_back("momentum_buffer", buf_a_);
  } else {
    s.emplace_back("exp_avg", buf_a_);
    s.emplace_back("exp_avg_sq", buf_b_);
  }
  return s;
}

}  // namespace dpar
