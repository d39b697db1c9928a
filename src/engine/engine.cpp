#include "engine/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "common/error.h"
#include "common/random.h"
#include "kernels/cpu/blas_threads.h"
#include "kernels/cpu/kernels.h"

namespace dpar {
namespace k = kernels::cpu;

std::vector<int64_t> split_batch(int64_t batch, size_t devices) {
  std::vector<int64_t> rows(devices, 0);
  if (batch <= 0 || devices == 0) return rows;
  const int64_t chunk = (batch + static_cast<int64_t>(devices) - 1) / static_cast<int64_t>(devices);
  int64_t left = batch;
  for (size_t r = 0; r < devices && left > 0; ++r) {
    rows[r] = std::min(chunk, left);
    left -= rows[r];
  }
  return rows;
}

Engine::Engine(const Model& model, const OptimizerConfig& optimizer, EngineConfig config)
    : model_(model), config_(std::move(config)) {
  DPAR_CHECK_ARG(model_.num_layers() > 0, "model: has no layers");
  DPAR_CHECK_ARG(!config_.devices.empty(), "device_ids: the device list is empty");
  DPAR_CHECK_ARG(config_.timeout_seconds > 0, "timeout_seconds: must be positive");
  DPAR_CHECK_ARG(config_.blas_threads >= 1 && config_.blas_threads <= 1024, "blas_threads: ", config_.blas_threads,
                 " must be 1 to 1024");
  // OpenBLAS's thread count is process-wide: one BLAS thread inside each worker keeps the workers from
  // oversubscribing the cores.
  k::set_blas_threads(config_.blas_threads);

  const size_t n = config_.devices.size();
  processes_ = config_.processes;
  // Replicas are numbered across the processes (rank 0's first), so that each has its own RNG stream and P
  // processes of n devices draw what one process of P*n devices would.
  int64_t first_replica = 0;
  if (processes_) {
    std::vector<int64_t> counts(static_cast<size_t>(processes_->size()));
    const int64_t local = static_cast<int64_t>(n);
    processes_->all_gather(&local, counts.data(), 1, CommDType::kI64);
    for (int p = 0; p < processes_->rank(); ++p) first_replica += counts[static_cast<size_t>(p)];
  }
  std::vector<std::string> names;
  for (size_t r = 0; r < n; ++r) {
    auto rep = std::make_unique<Replica>();
    rep->ctx.replica = r;
    rep->ctx.device = config_.devices[r];
    rep->ctx.rng_seed = derive_seed(config_.seed, static_cast<uint64_t>(first_replica) + r);
    rep->ctx.rng_offset = &rep->rng_offset;
    rep->ctx.armed_fault = &rep->fault;
    names.push_back("replica " + std::to_string(r) + " (" + config_.devices[r].str() + ")");
    replicas_.push_back(std::move(rep));
  }
  group_ = std::make_unique<ThreadGroup>(names, std::chrono::duration<double>(config_.timeout_seconds));
  for (size_t r = 0; r < n; ++r) replicas_[r]->comm = group_->communicator(static_cast<int>(r));
  pool_ = std::make_unique<WorkerPool>(n, config_.pin_workers ? pin_to_cpu : nullptr);

  layer_params_.resize(model_.num_layers());
  for (size_t i = 0; i < model_.params().size(); ++i) layer_params_[model_.params()[i].layer].push_back(i);

  // Each replica is built on its own worker: its memory is first touched (and, for a GPU, allocated) there.
  // This is the only time the model is copied to the devices.
  run("create", [&](Replica& rep, size_t) {
    rep.model = std::make_unique<ReplicaModel>(model_, rep.ctx);
    rep.optimizer = std::make_unique<Optimizer>(optimizer, rep.model->num_params());
    std::vector<Reducer::Grad> grads;
    for (const ParamInfo& p : model_.params())
      grads.push_back({rep.model->grads() + p.offset, static_cast<size_t>(p.shape.numel())});
    Communicator* comm = rep.comm.get();
    rep.reducer = std::make_unique<Reducer>(
        std::move(grads), config_.buckets,
        [this, &rep](float* data, size_t count, bool contributes) { reduce_bucket(rep, data, count, contributes); },
        [comm](std::function<void()> op) { return comm->async_run("gradient bucket", std::move(op)); });
  });
  if (processes_) {
    // Every process starts from rank 0's parameters, whatever each one's model was initialised with (as DDP).
    const auto count = static_cast<size_t>(model_.num_param_elements());
    processes_->broadcast(replicas_[0]->model->params(), count, CommDType::kF32, 0);
    for (size_t r = 1; r < n; ++r)
      std::memcpy(replicas_[r]->model->params(), replicas_[0]->model->params(), count * sizeof(float));
  }
}

Engine::~Engine() = default;

void Engine::check_usable(const char* operation) const {
  DPAR_ENFORCE(!aborted_.load(), DPAR_ERR_INVALID_STATE, operation,
               ": the engine was aborted (dpar_engine_abort) and must be recreated");
  DPAR_ENFORCE(!broken_, DPAR_ERR_INVALID_STATE, operation, ": the engine must be recreated: ", broken_reason_);
}

void Engine::abort() {
  aborted_.store(true);
  group_->abort("the engine was aborted (dpar_engine_abort)");
  if (processes_) processes_->abort("the engine of rank " + std::to_string(processes_->rank()) + " was aborted");
}

void Engine::run(const char* operation, const std::function<void(Replica&, size_t)>& job) {
  for (auto& rep : replicas_) rep->stepped = false;
  auto errors = pool_->run_all([&](size_t r) {
    Replica& rep = *replicas_[r];
    // Whatever fails releases the others from any collective they wait in (the group keeps the first reason,
    // so a replica that only saw another one fail does not overwrite the cause).
    // Its buckets in flight are then waited for: they fail fast in the aborted group, and their buffers must not
    // be in use once the job returns.
    try {
      job(rep, r);
    } catch (const std::exception& e) {
      rep.comm->abort(rep.ctx.device.str() + " failed: " + e.what());
      if (rep.reducer) rep.reducer->drain();
      throw;
    } catch (...) {
      rep.comm->abort(rep.ctx.device.str() + " failed: unknown exception");
      if (rep.reducer) rep.reducer->drain();
      throw;
    }
  });
  size_t first = errors.size();
  dpar_status status = DPAR_OK;
  std::string message;
  for (size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r]) continue;
    dpar_status s = DPAR_ERR_INTERNAL;
    std::string what;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const Error& e) {
      s = e.status();
      what = e.what();
    } catch (const std::bad_alloc&) {
      s = DPAR_ERR_OUT_OF_MEMORY;
      what = "out of memory";
    } catch (const std::exception& e) {
      what = e.what();
    }
    // Prefer a root cause over a replica that only saw another one fail.
    if (first == errors.size() || (status == DPAR_ERR_REMOTE && s != DPAR_ERR_REMOTE)) {
      first = r;
      status = s;
      message = what;
    }
  }
  if (first == errors.size()) return;

  if (aborted_.load()) {
    // The group stays aborted, so that a worker still on its way to a collective stops there too.
    if (processes_) processes_->abort(std::string(operation) + ": the engine was aborted on another process");
    fail(status, operation, ": ", message);
  }
  group_->reset();
  bool any_stepped = false;
  for (auto& rep : replicas_) {
    any_stepped = any_stepped || rep->stepped;
    rep->has_grad = false;
    if (rep->model) rep->model->clear_forward_state();  // null while the engine is still being created
  }
  pending_ = Pending::kNone;
  pending_samples_ = 0;
  forward_split_.clear();
  std::string prefix = std::string(operation) + ": replica " + std::to_string(first) + " (" +
                       replicas_[first]->ctx.device.str() + ") failed: ";
  if (processes_) {
    // The other processes cannot all be told to discard the step at the same point: tell them the engine failed
    // (they stop waiting for this process) and give up on it everywhere.
    processes_->abort(prefix + message);
    broken_ = true;
    broken_reason_ = prefix + message;
    fail(status, prefix, message, "; the processes may differ now, so the engine must be recreated on every process");
  }
  if (any_stepped) {
    // Some replicas applied the optimizer and others did not: they differ now.
    broken_ = true;
    broken_reason_ = prefix + message;
    fail(status, prefix, message, "; replicas may differ now, so the engine must be recreated");
  }
  fail(status, prefix, message, "; the step's gradients were discarded and the engine remains usable");
}

Shape Engine::check_batch(const Tensor& input, const Tensor* target, const char* operation) const {
  DPAR_CHECK_ARG(input.dtype() == DType::kF32, operation, ": input must be f32, got ", dtype_name(input.dtype()));
  DPAR_CHECK_ARG(input.device().is_host(), operation, ": input must be in host memory, got ", input.device().str());
  DPAR_CHECK_ARG(input.shape().ndim() >= 1 && input.rows() >= 1, operation, ": input batch is empty");
  Shape out;
  try {
    out = model_.output_shape(input.shape());
  } catch (const Error& e) {
    fail(e.status(), operation, ": input ", input.shape().str(), " does not fit the model: ", e.what());
  }
  if (!target) return out;
  if (config_.loss == DPAR_LOSS_CROSS_ENTROPY) {
    DPAR_CHECK_ARG(out.ndim() == 2, operation, ": cross-entropy needs a (batch, classes) output, the model gives ",
                   out.str());
    DPAR_CHECK_ARG(target->dtype() == DType::kI32, operation, ": target must be i32 class labels, got ",
                   dtype_name(target->dtype()));
    DPAR_CHECK_ARG(target->shape().ndim() == 1 && target->rows() == input.rows(), operation, ": target ",
                   target->shape().str(), " must be (", input.rows(), ") labels, one per input row");
    const int32_t* labels = target->i32();
    for (int64_t i = 0; i < target->rows(); ++i)
      DPAR_CHECK_ARG(labels[i] >= 0 && labels[i] < out[1], operation, ": target[", i, "] = ", labels[i],
                     " is out of range [0, ", out[1], ")");
  } else {
    DPAR_CHECK_ARG(target->dtype() == DType::kF32, operation, ": MSE target must be f32, got ",
                   dtype_name(target->dtype()));
    DPAR_CHECK_ARG(target->shape() == out, operation, ": MSE target ", target->shape().str(),
                   " must be shaped as the output ", out.str());
  }
  DPAR_CHECK_ARG(target->device().is_host(), operation, ": target must be in host memory");
  return out;
}

void Engine::local_loss_backward(Replica& rep, const Tensor& input, const Tensor& target, int64_t begin,
                                 bool reduce) {
  const ReplicaContext& ctx = rep.ctx;
  Tensor x = input.rows(begin, rep.rows);
  Tensor out = rep.model->forward(ctx, x);
  if (hook_) hook_(ctx.replica, x.shape(), out.shape());
  Tensor dout = rep.model->output_grad_buffer(ctx);
  // The gradient of the SUM of this chunk's losses; the all-reduce divides by the whole batch.
  if (config_.loss == DPAR_LOSS_CROSS_ENTROPY) {
    rep.loss_sum = k::cross_entropy_forward_backward(dout.f32(), out.f32(), target.i32() + begin, rep.rows,
                                                     out.shape()[1], 1.0f);
  } else {
    Tensor t = target.rows(begin, rep.rows);
    rep.loss_sum = k::mse_forward_backward(dout.f32(), out.f32(), t.f32(), rep.rows, out.shape().row_numel(), 1.0f);
  }
  rep.loss_rows = rep.rows;
  if (reduce) {
    rep.model->backward(ctx, dout, rep.has_grad, [&](size_t layer) {
      for (size_t p : layer_params_[layer]) rep.reducer->mark_ready(p);
    });
  } else {
    rep.model->backward(ctx, dout, rep.has_grad);
  }
  rep.has_grad = true;
}

std::pair<int64_t, int64_t> Engine::optimizer_shard(size_t replica) const {
  // Cache-line-aligned slices, so that no two workers write the same line of a replica's parameters.
  const int64_t n = model_.num_param_elements(), parts = static_cast<int64_t>(replicas_.size());
  const int64_t per = ((n + parts - 1) / parts + 15) / 16 * 16;
  const int64_t begin = std::min(n, per * static_cast<int64_t>(replica));
  return {begin, std::min(n, begin + per)};
}

void Engine::reduce_bucket(Replica& rep, float* data, size_t count, bool contributes) {
  if (!processes_) {
    rep.comm->all_reduce_sum(data, count, contributes, rep.grad_scale);
    return;
  }
  // The process's sum lands in replica 0 only: the broadcast below is what the others receive.
  rep.comm->reduce_sum(data, count, contributes, rep.grad_scale, 0);
  if (rep.ctx.replica == 0) {
    try {
      processes_->all_reduce(data, data, count, CommDType::kF32, ReduceOp::kSum);
    } catch (const std::exception& e) {
      // The other replicas wait for this one in the broadcast below.
      rep.comm->abort(std::string("the reduction across processes failed: ") + e.what());
      throw;
    }
  }
  rep.comm->broadcast(data, count, CommDType::kF32, 0);
}

void Engine::finish_and_step(Replica& rep) {
  rep.reducer->finish();
  rep.stepped = true;
  // Every replica now holds the same summed gradient, so the optimizer's result is the same on all of them. Each
  // worker computes it for its own shard only and writes that shard into every replica: the replicas end
  // identical, bit for bit, as if each had stepped everything, for 1/n of the optimizer's work. (Its state for a
  // shard is current in the shard's owner only; save() gathers it.) No replica reads parameters until the next
  // job, and run() returns only when every worker is done, so the writes need no barrier of their own.
  const auto [begin, end] = optimizer_shard(rep.ctx.replica);
  rep.optimizer->step_range(rep.model->params(), rep.model->grads(), begin, end);
  for (auto& other : replicas_)
    if (other.get() != &rep)
      std::memcpy(other->model->params() + begin, rep.model->params() + begin,
                  static_cast<size_t>(end - begin) * sizeof(float));
  rep.has_grad = false;
}

template <class T>
T Engine::sum_over_processes(T value, const char* operation) {
  if (!processes_) return value;
  T sum = 0;
  try {
    processes_->all_reduce(&value, &sum, 1, std::is_same_v<T, double> ? CommDType::kF64 : CommDType::kI64,
                           ReduceOp::kSum);
  } catch (const Error& e) {
    // Some processes may have gone on: the engine cannot tell where the others are.
    broken_ = true;
    broken_reason_ = std::string(operation) + ": " + e.what();
    fail(e.status(), operation, ": across processes: ", e.what());
  }
  return sum;
}

int64_t Engine::global_batch_of(const char* operation, const std::function<int64_t()>& check) {
  if (!processes_) return check();
  // Every process tells its batch, or -1 if it refused its call: then all refuse the step together, and none waits
  // for the one that returned (the engines stay usable). An all-gather, so that each can name who refused.
  int64_t mine = -1;
  std::exception_ptr refused;
  try {
    mine = check();
  } catch (const Error&) {
    refused = std::current_exception();
  }
  std::vector<int64_t> batches(static_cast<size_t>(processes_->size()));
  try {
    processes_->all_gather(&mine, batches.data(), 1, CommDType::kI64);
  } catch (const Error& e) {
    broken_ = true;
    broken_reason_ = std::string(operation) + ": " + e.what();
    fail(e.status(), operation, ": across processes: ", e.what());
  }
  if (refused) std::rethrow_exception(refused);
  int64_t total = 0;
  for (size_t p = 0; p < batches.size(); ++p) {
    DPAR_ENFORCE(batches[p] >= 0, DPAR_ERR_REMOTE, operation, ": rank ", p,
                 " refused its part of the step (its own error says why); no process took the step");
    total += batches[p];
  }
  return total;
}

double Engine::finish_loss(const char* operation, int64_t global_batch) {
  double total = 0.0;
  for (auto& rep : replicas_) total += rep->loss_rows > 0 ? rep->loss_sum : 0.0;
  return sum_over_processes(total, operation) / static_cast<double>(global_batch);
}

double Engine::accumulate(const Tensor& input, const Tensor& target) {
  check_usable("accumulate");
  const int64_t global_batch = global_batch_of("accumulate", [&] {
    check_batch(input, &target, "accumulate");
    DPAR_ENFORCE(pending_ != Pending::kExplicit, DPAR_ERR_INVALID_STATE,
                 "accumulate: gradients from backward() are pending; call step() or zero_grad() first");
    return input.rows();
  });
  const int64_t batch = input.rows();
  const auto split = split_batch(batch, replicas_.size());
  run("accumulate", [&](Replica& rep, size_t r) {
    int64_t begin = 0;
    for (size_t i = 0; i < r; ++i) begin += split[i];
    rep.rows = split[r];
    rep.loss_rows = 0;
    if (rep.rows > 0) local_loss_backward(rep, input, target, begin, false);
  });
  pending_ = Pending::kLoss;
  pending_samples_ += global_batch;
  forward_split_.clear();  // the replicas' forward state now belongs to this micro-batch
  return finish_loss("accumulate", global_batch);
}

double Engine::train_step(const Tensor& input, const Tensor& target) {
  check_usable("train_step");
  const int64_t global_batch = global_batch_of("train_step", [&] {
    check_batch(input, &target, "train_step");
    DPAR_ENFORCE(pending_ == Pending::kNone, DPAR_ERR_INVALID_STATE,
                 "train_step: gradients from ", pending_ == Pending::kLoss ? "accumulate()" : "backward()",
                 " are pending; call step() or zero_grad() first");
    return input.rows();
  });
  const int64_t batch = input.rows();
  const auto split = split_batch(batch, replicas_.size());
  const float scale = static_cast<float>(1.0 / static_cast<double>(global_batch));
  // One hand-off to the workers for the whole step: forward, loss, backward with the buckets' all-reduces
  // overlapped, optimizer.
  run("train_step", [&](Replica& rep, size_t r) {
    int64_t begin = 0;
    for (size_t i = 0; i < r; ++i) begin += split[i];
    rep.rows = split[r];
    rep.loss_rows = 0;
    rep.grad_scale = scale;
    rep.reducer->prepare();
    if (rep.rows > 0) local_loss_backward(rep, input, target, begin, true);
    finish_and_step(rep);
  });
  forward_split_.clear();
  return finish_loss("train_step", global_batch);
}

void Engine::step() {
  check_usable("step");
  DPAR_ENFORCE(pending_ != Pending::kNone, DPAR_ERR_INVALID_STATE,
               "step: no gradient is pending (call accumulate() or forward() and backward() first)");
  const float scale =
      pending_ == Pending::kLoss ? static_cast<float>(1.0 / static_cast<double>(pending_samples_)) : 1.0f;
  // Activations kept by a forward() before this step belong to the old parameters: a backward through them after
  // the step would mix the two, so they are dropped.
  run("step", [&](Replica& rep, size_t) {
    rep.grad_scale = scale;
    rep.reducer->prepare();
    if (rep.has_grad) rep.reducer->mark_all_ready();
    finish_and_step(rep);
    rep.model->clear_forward_state();
  });
  pending_ = Pending::kNone;
  pending_samples_ = 0;
  forward_split_.clear();
}

void Engine::zero_grad() {
  check_usable("zero_grad");
  // Gradients are overwritten by the next backward when has_grad is false, so nothing needs clearing in memory.
  for (auto& rep : replicas_) {
    rep->has_grad = false;
    rep->model->clear_forward_state();
  }
  pending_ = Pending::kNone;
  pending_samples_ = 0;
  forward_split_.clear();
}

Tensor Engine::forward(const Tensor& input) {
  check_usable("forward");
  const Shape out_shape = check_batch(input, nullptr, "forward");
  const auto split = split_batch(input.rows(), replicas_.size());
  Tensor out = Tensor::empty(DType::kF32, out_shape, config_.devices[config_.output_replica]);
  const int64_t out_row = out_shape.row_numel();
  run("forward", [&](Replica& rep, size_t r) {
    int64_t begin = 0;
    for (size_t i = 0; i < r; ++i) begin += split[i];
    rep.rows = split[r];
    if (rep.rows == 0) return;
    Tensor x = input.rows(begin, rep.rows);
    Tensor y = rep.model->forward(rep.ctx, x);
    if (hook_) hook_(r, x.shape(), y.shape());
    // Gather: each replica copies its rows into the output, in batch order.
    std::memcpy(out.f32() + begin * out_row, y.f32(), static_cast<size_t>(y.numel()) * sizeof(float));
    if (!training_) rep.model->clear_forward_state();
  });
  if (training_) {
    forward_split_ = split;
    forward_output_shape_ = out_shape;
  }
  return out;
}

void Engine::backward(const Tensor& grad_output) {
  check_usable("backward");
  DPAR_ENFORCE(!forward_split_.empty(), DPAR_ERR_INVALID_STATE,
               "backward: no training-mode forward() to go back through");
  DPAR_ENFORCE(pending_ != Pending::kLoss, DPAR_ERR_INVALID_STATE,
               "backward: gradients from accumulate() are pending; call step() or zero_grad() first");
  DPAR_CHECK_ARG(grad_output.dtype() == DType::kF32 && grad_output.device().is_host(),
                 "backward: grad_output must be an f32 host tensor");
  DPAR_CHECK_ARG(grad_output.shape() == forward_output_shape_, "backward: grad_output ", grad_output.shape().str(),
                 " must be shaped as forward's output ", forward_output_shape_.str());
  const auto split = forward_split_;
  run("backward", [&](Replica& rep, size_t r) {
    if (split[r] == 0) return;
    int64_t begin = 0;
    for (size_t i = 0; i < r; ++i) begin += split[i];
    rep.model->backward(rep.ctx, grad_output.rows(begin, split[r]), rep.has_grad);
    rep.has_grad = true;
  });
  forward_split_.clear();
  pending_ = Pending::kExplicit;
}

void Engine::set_training(bool training) { training_ = training; for (auto& rep : replicas_) rep->ctx.training = training; }

void Engine::set_lr(float lr) {
  DPAR_CHECK_ARG(std::isfinite(lr) && lr >= 0.0f, "lr: ", lr, " must be finite and >= 0");
  for (auto& rep : replicas_) rep->optimizer->set_lr(lr);
}

int64_t Engine::step_count() const { return replicas_[0]->optimizer->steps(); }

std::vector<float> Engine::replica_losses() const {
  std::vector<float> out;
  for (auto& rep : replicas_)
    out.push_back(rep->loss_rows > 0 ? static_cast<float>(rep->loss_sum / static_cast<double>(rep->loss_rows))
                                : std::numeric_limits<float>::quiet_NaN());
  return out;
}

std::vector<float> Engine::params(size_t replica) const {
  const auto& m = *replicas_[replica]->model;
  return std::vector<float>(m.params(), m.params() + model_.num_param_elements());
}

void Engine::set_forward_hook(ForwardHook hook) { hook_ = std::move(hook); }

void Engine::inject_fault(size_t replica, Fault fault) { replicas_[replica]->fault = fault; }

}  // namespace dpar
