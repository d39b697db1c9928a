#include "optim/optimizer.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"

namespace dpar {

void OptimizerConfig::check(const char* what) const {
  DPAR_CHECK_ARG(kind == OptimizerKind::kSgd || kind == OptimizerKind::kAdam || kind == OptimizerKind::kAdamW, what,
                 ".kind: unknown kind ", static_cast<int32_t>(kind));
  DPAR_CHECK_ARG(std::isfinite(lr) && lr >= 0.0f, what, ".lr: ", lr, " must be finite and >= 0");
  DPAR_CHECK_ARG(std::isfinite(weight_decay) && weight_decay >= 0.0f, what, ".weight_decay: ", weight_decay,
                 " must be finite and >= 0");
  DPAR_CHECK_ARG(std::isfinite(max_grad_norm) && max_grad_norm >= 0.0f, what, ".max_grad_norm: ", max_grad_norm,
                 " must be finite and >= 0 (0: no clipping)");
  if (kind == OptimizerKind::kSgd) {
    DPAR_CHECK_ARG(std::isfinite(momentum) && momentum >= 0.0f, what, ".momentum: ", momentum,
                   " must be finite and >= 0");
    DPAR_CHECK_ARG(std::isfinite(dampening), what, ".dampening: must be finite");
    // torch.optim.SGD: "Nesterov momentum requires a momentum and zero dampening".
    DPAR_CHECK_ARG(!nesterov || (momentum > 0.0f && dampening == 0.0f), what,
                   ".nesterov: requires momentum > 0 and dampening 0");
  } else {
    DPAR_CHECK_ARG(beta1 >= 0.0f && beta1 < 1.0f, what, ".beta1: ", beta1, " must be in [0, 1)");
    DPAR_CHECK_ARG(beta2 >= 0.0f && beta2 < 1.0f, what, ".beta2: ", beta2, " must be in [0, 1)");
    DPAR_CHECK_ARG(std::isfinite(eps) && eps >= 0.0f, what, ".eps: ", eps, " must be finite and >= 0");
  }
}

const char* OptimizerConfig::name() const {
  switch (kind) {
    case OptimizerKind::kSgd: return "sgd";
    case OptimizerKind::kAdam: return "adam";
    case OptimizerKind::kAdamW: return "adamw";
  }
  return "unknown";
}

Optimizer::Optimizer(const OptimizerConfig& config, std::vector<ElementRange> ranges, Device device)
    : config_(config), ranges_(std::move(ranges)) {
  int64_t previous_end = 0;
  for (const ElementRange& r : ranges_) {
    DPAR_ENFORCE(previous_end <= r.begin && r.begin <= r.end, Status::kInternal, "optimizer: [", r.begin, ", ",
                 r.end, ") is not a range of parameters after the ones before it");
    previous_end = r.end;
    elements_ += r.size();
  }
  if (elements_ == 0) return;
  const Shape shape{elements_};
  if (config_.kind == OptimizerKind::kSgd) {
    if (config_.momentum != 0.0f) buf_a_ = Tensor::zeros(DType::kF32, shape, device);
  } else {
    buf_a_ = Tensor::zeros(DType::kF32, shape, device);
    buf_b_ = Tensor::zeros(DType::kF32, shape, device);
  }
}

void Optimizer::set_no_decay(std::vector<ElementRange> no_decay) {
  int64_t previous_end = 0;
  for (const ElementRange& r : no_decay) {
    DPAR_ENFORCE(previous_end <= r.begin && r.begin <= r.end, Status::kInternal, "optimizer: [", r.begin, ", ",
                 r.end, ") is not a range of undecayed parameters after the ones before it");
    previous_end = r.end;
  }
  no_decay_ = std::move(no_decay);
}

void Optimizer::step(Stream& stream, float* params, const float* grads) {
  ++steps_;  // the step counter advances on every replica, whatever its ranges
  int64_t state = 0;  // where the piece's state starts
  // One kernel call per piece of a range that lies wholly in one group: the formulas are element-wise, so the
  // pieces' steps equal, bit for bit, one step of the range with each element's weight decay.
  auto step_piece = [&](int64_t begin, int64_t end, float weight_decay) {
    const int64_t n = end - begin;
    if (n <= 0) return;
    if (config_.kind == OptimizerKind::kSgd) {
      const SgdHyper h{config_.lr, config_.momentum, config_.dampening, weight_decay, config_.nesterov};
      stream.run(call::SgdStep{TensorRef::of(params + begin, {n}),
                               buf_a_.defined() ? buf_a_.rows(state, n).ref() : TensorRef{},
                               TensorRef::of(grads + begin, {n}), h, steps_ == 1});
    } else {
      const AdamHyper h{config_.lr, config_.beta1, config_.beta2, config_.eps, weight_decay,
                        config_.kind == OptimizerKind::kAdamW};
      stream.run(call::AdamStep{TensorRef::of(params + begin, {n}), buf_a_.rows(state, n).ref(),
                                buf_b_.rows(state, n).ref(), TensorRef::of(grads + begin, {n}), h, steps_});
    }
    state += n;
  };
  size_t k = 0;  // the first undecayed range that may meet the current range (both lists are ordered)
  for (const ElementRange& r : ranges_) {
    int64_t at = r.begin;
    while (k < no_decay_.size() && no_decay_[k].end <= at) ++k;
    for (size_t j = k; j < no_decay_.size() && no_decay_[j].begin < r.end; ++j) {
      const int64_t nd_begin = std::max(no_decay_[j].begin, at), nd_end = std::min(no_decay_[j].end, r.end);
      step_piece(at, nd_begin, config_.weight_decay);
      step_piece(nd_begin, nd_end, 0.0f);
      at = nd_end;
    }
    step_piece(at, r.end, config_.weight_decay);
  }
}

std::vector<std::string> Optimizer::state_names(const OptimizerConfig& config) {
  if (config.kind == OptimizerKind::kSgd) {
    if (config.momentum != 0.0f) return {"momentum_buffer"};
    return {};
  }
  return {"exp_avg", "exp_avg_sq"};
}

std::vector<std::pair<std::string, Tensor>> Optimizer::state() const {
  std::vector<std::pair<std::string, Tensor>> s;
  const std::vector<std::string> names = state_names(config_);
  for (size_t i = 0; i < names.size(); ++i) s.emplace_back(names[i], i == 0 ? buf_a_ : buf_b_);
  return s;
}

size_t Optimizer::state_bytes() const {
  return (buf_a_.defined() ? buf_a_.bytes() : 0) + (buf_b_.defined() ? buf_b_.bytes() : 0);
}

}  // namespace dpar
