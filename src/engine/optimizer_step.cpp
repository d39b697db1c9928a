// The engine's step after backward: how the gradient buckets are reduced (the bucket strategy), which block of them
// each replica's optimizer steps, gradient clipping, the optimizer, and the all-gather that puts the blocks
// together again.
#include <algorithm>
#include <cmath>

#include "common/error.h"
#include "engine/engine.h"

namespace dpar {

std::vector<ElementRange> Engine::optimizer_shard(const Replica& rep) const {
  // The replica's shard of every bucket (world_block: block r of the process, sub-block p of it where the shards
  // span the processes), as Megatron-LM's distributed optimizer shards: a bucket reduce-scattered as soon as
  // backward produced it leaves each replica the gradient of what it steps. Buckets are ranges of the flat gradient
  // buffer, in launch order (the last parameters first).
  std::vector<ElementRange> ranges;
  const Reducer& reducer = *rep.reducer;
  for (size_t b = 0; b < reducer.num_buckets(); ++b) {
    DPAR_ENFORCE(reducer.in_place(b), Status::kInternal, "engine: gradient bucket ", b, " is not a range of the ",
                 "flat gradient buffer");
    const int64_t offset = reducer.bucket_data(b) - rep.model->grads();
    const auto [begin, end] = rep.set->shard_of(reducer.bucket_count(b));
    ranges.push_back({offset + static_cast<int64_t>(begin), offset + static_cast<int64_t>(end)});
  }
  std::sort(ranges.begin(), ranges.end(), [](const ElementRange& a, const ElementRange& b) { return a.begin < b.begin; });
  return ranges;
}

std::unique_ptr<BucketStrategy> Engine::bucket_strategy_for(Replica& rep) const {
  // reduce_dtype_ bf16 carries the whole reduction in bf16, so across the processes too: the compression setting
  // (bf16 or not) then changes nothing.
  const Wire wire = compression_ == GradientCompression::kBf16 ? Wire::kBf16 : Wire::kF32;
  if (reduction_ == GradientReduction::kReduceScatter)
    return make_bucket_strategy(BucketStrategyKind::kReduceScatter, *rep.set, wire, reduce_dtype_);
  if (!links_) return make_bucket_strategy(BucketStrategyKind::kFlat, *rep.set, Wire::kF32, reduce_dtype_);
  return make_bucket_strategy(
      wire == Wire::kBf16 ? BucketStrategyKind::kHierarchicalBf16 : BucketStrategyKind::kHierarchical, *rep.set,
      Wire::kF32, reduce_dtype_);
}

void Engine::clip_gradient(Replica& rep) {
  const std::vector<ElementRange>& shard = rep.optimizer->ranges();
  float* grads = rep.model->grads();
  double sum = 0.0;
  if (!rep.reducer->strategy().sharded()) {
    // Every replica holds the whole summed gradient, the same bits on all of them: each computes the same norm
    // with the same kernel.
    sum = rep.stream->sum_squares(TensorRef::of(grads, {model_.num_param_elements()}));
  } else {
    // Each replica holds its shard of the summed gradient: the norm is the sum of the shards' (one scalar summed
    // over every replica that holds a shard: the process's, or every process's where the shards span them), the
    // same bits on every replica.
    for (const ElementRange& r : shard)
      sum += r.size() > 0 ? rep.stream->sum_squares(TensorRef::of(grads + r.begin, {r.size()})) : 0.0;
    if (replicas_.size() > 1 || rep.set->shard_processes() > 1) {
      rep.stream->copy_from_host(rep.norm_partial.raw(), &sum, sizeof(double));
      rep.set->sum_over_shards(rep.norm_partial.raw(), 1, DType::kF64);
      rep.stream->copy_to_host(&sum, rep.norm_partial.raw(), sizeof(double));
    }
  }
  const float norm = static_cast<float>(std::sqrt(sum));
  // torch.nn.utils.clip_grad_norm_, in its float arithmetic: clip_coef = max_norm / (total_norm + 1e-6), clamped
  // to 1. A NaN coefficient (a NaN gradient) is applied, as torch.clamp passes NaN on.
  const float coef = rep.optimizer->config().max_grad_norm / (norm + 1e-6f);
  rep.grad_norm = norm;
  if (coef >= 1.0f) return;
  for (const ElementRange& r : shard)
    if (r.size() > 0) rep.stream->run(call::Scale{TensorRef::of(grads + r.begin, {r.size()}), coef});
}

void Engine::publish_grad_norm() {
  // A step that failed threw before this: the norm told is always that of a step taken. A skipped step's
  // clipping did not run.
  if (!replicas_[0]->skipped && replicas_[0]->optimizer->config().max_grad_norm > 0.0f) grad_norm_ = replicas_[0]->grad_norm;
}

std::vector<float> Engine::replica_grad_norms() const {
  std::vector<float> out;
  for (const auto& rep : replicas_) out.push_back(rep->grad_norm);
  return out;
}

std::vector<size_t> Engine::replica_optimizer_state_bytes() const {
  std::vector<size_t> out;
  for (const auto& rep : replicas_) out.push_back(rep->optimizer->state_bytes());
  return out;
}

void Engine::finish_and_step(Replica& rep, bool reduced) {
  if (!reduced) {
    // The buckets still in flight, and the last one, which backward's end leaves to this thread.
    TraceSpan span(*trace_, "gradient buckets finish");
    rep.reducer->finish();
  }
  // GradScaler's step: an overflow in the scaled gradient skips the optimizer altogether (the decision is every
  // replica's alike, so all skip or none does); otherwise the gradient is unscaled before clipping sees it.
  rep.skipped = scaler_.enabled() && !unscale_finite_gradient(rep);
  if (rep.skipped) {
    rep.has_grad = false;
    return;
  }
  rep.stepped = true;
  // Every replica now holds the same summed gradient, so the optimizer's result is the same on all of them. Each
  // worker computes it for its own shard only, and an all-gather puts the shards together in every replica: the
  // replicas end identical, bit for bit, as if each had stepped everything, for 1/R of the optimizer's work and
  // 1/R of its state (R: the replicas of every process where the shards span them, else the process's; a shard's
  // state lives with its owner only; save() gathers it).
  float* params = rep.model->params_for_writing();
  if (rep.optimizer->config().max_grad_norm > 0.0f) {
    TraceSpan span(*trace_, "gradient clipping");
    clip_gradient(rep);
  }
  {
    TraceSpan span(*trace_, "optimizer", "elements", rep.optimizer->num_elements());
    rep.optimizer->step(*rep.stream, params, rep.model->grads());
  }
  // Each replica's shard of each bucket's parameters, into every replica (of every process where the shards span
  // the processes).
  TraceSpan span(*trace_, "parameters all-gather");
  if (replicas_.size() > 1 || rep.set->shard_processes() > 1)
    for (size_t b = 0; b < rep.reducer->num_buckets(); ++b)
      rep.set->all_gather_blocks(params + (rep.reducer->bucket_data(b) - rep.model->grads()), rep.reducer->bucket_count(b));
  rep.has_grad = false;
}

void Engine::set_gradient_compression(GradientCompression compression) {
  DPAR_CHECK_ARG(compression == GradientCompression::kNone || compression == GradientCompression::kBf16,
                 "compression: ", static_cast<int32_t>(compression), " is not a gradient compression (0: none, ",
                 "1: bf16)");
  set_strategies(compression, reduction_, reduce_dtype_);
}

void Engine::set_reduce_dtype(DType dtype) {
  DPAR_CHECK_ARG(dtype == DType::kF32 || dtype == DType::kBF16, "reduce_dtype: ", dtype_name(dtype),
                 " is not a reduce dtype (f32, bf16)");
  set_strategies(compression_, reduction_, dtype);
}

bool Engine::world_shards(GradientReduction reduction) const {
  return reduction != GradientReduction::kAllReduce && replicas_[0]->set->can_shard_world();
}

void Engine::set_strategies(GradientCompression compression, GradientReduction reduction, DType reduce_dtype) {
  // Where the reduction moves the optimizer's shards across the processes, every process gathers its state under
  // the current shards first (the same call at the same point everywhere), and cuts it along the new ones below.
  const bool world = world_shards(reduction);
  const bool reshard = world != replicas_[0]->set->shards_world();
  if (reshard) check_usable("set_gradient_reduction");  // the gather crosses the processes' links
  DPAR_ENFORCE(!reshard || pending_ == Pending::kNone, Status::kInvalidState, "set_gradient_reduction: gradients from ",
               pending_ == Pending::kLoss ? "accumulate()" : "backward()", " are pending, and the optimizer's shards ",
               "would move to the new reduction's; call step() or zero_grad() first");
  std::vector<std::vector<float>> state;
  if (reshard) state = gather_optimizer_state();
  // Every replica's strategy is made before anything changes, so that a refused setting changes nothing. Between
  // calls the workers are idle: the reducers are the caller's to change.
  const GradientCompression old_compression = compression_;
  const GradientReduction old_reduction = reduction_;
  const DType old_reduce_dtype = reduce_dtype_;
  compression_ = compression;
  reduction_ = reduction;
  reduce_dtype_ = reduce_dtype;
  for (auto& rep : replicas_) rep->set->set_shards_world(world);  // what the strategies check (processes_move)
  std::vector<std::unique_ptr<BucketStrategy>> strategies;
  try {
    for (auto& rep : replicas_) strategies.push_back(bucket_strategy_for(*rep));
  } catch (...) {
    compression_ = old_compression;
    reduction_ = old_reduction;
    reduce_dtype_ = old_reduce_dtype;
    for (auto& rep : replicas_) rep->set->set_shards_world(reshard ? !world : world);
    throw;
  }
  for (size_t r = 0; r < replicas_.size(); ++r) replicas_[r]->reducer->set_strategy(std::move(strategies[r]));
  if (!reshard) return;
  // Each replica's optimizer for its new shard, its state cut from the gathered state as a checkpoint's is.
  run("set_gradient_reduction", [&](Replica& rep, size_t) {
    const Optimizer& old = *rep.optimizer;
    auto optimizer = std::make_unique<Optimizer>(old.config(), optimizer_shard(rep), rep.ctx.device);
    optimizer->set_steps(old.steps());
    optimizer->set_no_decay(old.no_decay());
    rep.optimizer = std::move(optimizer);
    load_optimizer_shard(rep, [&](size_t s, const ParamInfo& p) {
      return reinterpret_cast<const uint8_t*>(state[s].data() + p.offset);
    });
  });
}

void Engine::set_gradient_reduction(GradientReduction reduction) {
  DPAR_CHECK_ARG(reduction == GradientReduction::kAllReduce || reduction == GradientReduction::kReduceScatter ||
                     reduction == GradientReduction::kAllReduceWorldShards,
                 "reduction: ", static_cast<int32_t>(reduction), " is not a gradient reduction (0: all-reduce, ",
                 "1: reduce-scatter, 2: all-reduce with the shards over every process)");
  set_strategies(compression_, reduction, reduce_dtype_);
}

void Engine::set_lr(float lr) {
  DPAR_CHECK_ARG(std::isfinite(lr) && lr >= 0.0f, "lr: ", lr, " must be finite and >= 0");
  for (auto& rep : replicas_) rep->optimizer->set_lr(lr);
}

void Engine::set_max_grad_norm(float max_norm) {
  OptimizerConfig config = replicas_[0]->optimizer->config();
  config.max_grad_norm = max_norm;
  config.check("optimizer");
  for (auto& rep : replicas_) rep->optimizer->set_max_grad_norm(max_norm);
}

void Engine::set_weight_decay_exclusion(bool exclude_biases_and_norms) {
  // The parameters are contiguous in the flat buffer, in model order: their element ranges are ordered already.
  std::vector<ElementRange> no_decay;
  if (exclude_biases_and_norms)
    for (const ParamInfo& p : model_.params())
      if (!p.decays) no_decay.push_back({p.offset, p.offset + p.shape.numel()});
  for (auto& rep : replicas_) rep->optimizer->set_no_decay(no_decay);
  exclude_no_decay_ = exclude_biases_and_norms;
}

int64_t Engine::step_count() const { return replicas_[0]->optimizer->steps(); }

}  // namespace dpar
