// The engine's side of dynamic loss scaling (loss_scaler.h holds the state machine): the scale enters the loss's
// gradient (local_loss_backward) or backward()'s grad_output, and finish_and_step asks unscale_finite_gradient()
// once the gradient is reduced, before it clips and steps.
#include <cmath>

#include "common/error.h"
#include "engine/engine.h"

namespace dpar {

void Engine::set_loss_scaling(const LossScaling& settings) {
  settings.check("set_loss_scaling");
  // Gradients accumulated under one scale would be divided by another.
  DPAR_ENFORCE(pending_ == Pending::kNone, Status::kInvalidState, "set_loss_scaling: gradients from ",
               pending_ == Pending::kLoss ? "accumulate()" : "backward()",
               " are pending; call step() or zero_grad() first");
  scaler_.configure(settings);
}

bool Engine::unscale_finite_gradient(Replica& rep) {
  // Any inf or NaN element makes its sum of squares (in double, which no finite f32 square overflows) inf or NaN,
  // whatever the order of the sum: the decision is the same on every replica even where the sums' bits are not.
  // Every replica holds the whole reduced gradient or its shard of it, so the shards' sums over every replica
  // that holds a shard (the process's, alike on every process, or every process's where the shards span them)
  // cover every element of the global gradient.
  const float* grads = rep.model->grads();  // summed over every replica, divided by the samples
  double sum = 0.0;
  for (const ElementRange& r : rep.optimizer->ranges())
    if (r.size() > 0) sum += rep.stream->sum_squares(TensorRef::of(grads + r.begin, {r.size()}));
  if (replicas_.size() > 1 || rep.set->shard_processes() > 1) {
    rep.stream->copy_from_host(rep.norm_partial.raw(), &sum, sizeof(double));
    rep.set->sum_over_shards(rep.norm_partial.raw(), 1, DType::kF64);
    rep.stream->copy_to_host(&sum, rep.norm_partial.raw(), sizeof(double));
  }
  if (!std::isfinite(sum)) return false;
  // GradScaler's inv_scale, the reciprocal in double rounded to float: exact for a power of two (2^-127 included,
  // a subnormal), so that the unscaled gradient is the unscaled run's bit for bit. A separate multiplication rather
  // than one folded into the mean's 1/N, whose product with it would leave f32's normal range at large scales.
  // Every element the replica reads from here on: its shard, or the whole gradient where clipping's norm is
  // computed over the whole of it on every replica.
  const float inv_scale = static_cast<float>(1.0 / static_cast<double>(scaler_.scale()));
  float* g = rep.model->grads();
  if (!rep.reducer->strategy().sharded()) {
    rep.stream->run(call::Scale{TensorRef::of(g, {model_.num_param_elements()}), inv_scale});
  } else {
    for (const ElementRange& r : rep.optimizer->ranges())
      if (r.size() > 0) rep.stream->run(call::Scale{TensorRef::of(g + r.begin, {r.size()}), inv_scale});
  }
  return true;
}

Tensor Engine::scaled_grad_output(Replica& rep, const Tensor& dout) {
  if (dout.numel() == 0) return dout;
  Tensor scaled = dout;
  // on_replica() left a view of the caller's memory where the replica can read it in place: copy it first.
  if (!rep.grad_stage.defined() || dout.raw() != rep.grad_stage.raw()) {
    if (!rep.grad_stage.defined() || rep.grad_stage.dtype() != dout.dtype() || rep.grad_stage.numel() < dout.numel())
      rep.grad_stage = rep.ctx.alloc(dout.dtype(), Shape{dout.numel()});
    scaled = rep.grad_stage.rows(0, dout.numel()).reshaped(dout.shape());
    rep.stream->copy(scaled.raw(), dout.raw(), dout.bytes());
  }
  rep.stream->run(call::Scale{scaled.ref(), scaler_.scale()});
  return scaled;
}

void Engine::update_loss_scale() {
  if (scaler_.enabled()) scaler_.update(replicas_[0]->skipped);
}

}  // namespace dpar
