#include "engine/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "common/error.h"
#include "common/random.h"
#include "engine/process_links.h"
#include "io/file.h"

namespace dpar {

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

namespace {
// The backend that every device of the engine belongs to.
Backend& backend_of(const std::vector<Device>& devices) {
  DPAR_CHECK_ARG(!devices.empty(), "device_ids: the device list is empty");
  for (size_t r = 0; r < devices.size(); ++r) {
    DPAR_CHECK_ARG(devices[r].kind == devices[0].kind, "device_ids[", r, "]: ", devices[r].str(),
                   " is not of the same kind as ", devices[0].str(), " (an engine's devices are of one kind)");
    check_device_exists(devices[r], "device_ids");
  }
  return backend_for(devices[0]);
}
}  // namespace

Engine::Engine(const Model& model, const OptimizerConfig& optimizer, EngineConfig config)
    : model_(model), config_(std::move(config)), backend_(backend_of(config_.devices)) {
  DPAR_CHECK_ARG(model_.num_nodes() > 0, "model: has no layers");
  optimizer.check("optimizer");
  DPAR_CHECK_ARG(config_.timeout_seconds > 0, "timeout_seconds: must be positive");
  DPAR_CHECK_ARG(config_.create_timeout_seconds >= 0, "create_timeout_seconds: must be >= 0");
  DPAR_CHECK_ARG(config_.blas_threads >= 1 && config_.blas_threads <= 1024, "blas_threads: ", config_.blas_threads,
                 " must be 1 to 1024");
  const Backend::WorkerOptions workers{config_.pin_workers, config_.blas_threads};
  backend_.prepare_workers(workers);

  const size_t n = config_.devices.size();
  // A job of one process has nothing to sum across: it trains as a single process (and says so: no transport).
  processes_ = config_.processes && config_.processes->size() > 1 ? config_.processes : nullptr;
  // Replicas are numbered across the processes (rank 0's first), so that each has its own RNG stream and P
  // processes of n devices draw what one process of P*n devices would.
  int64_t first_replica = 0;
  bool same_replica_counts = true;  // every process has n replicas: the optimizer's shards can span them all
  if (processes_) {
    // Each process's replica count and device kind.
    std::vector<int64_t> all(2 * static_cast<size_t>(processes_->size()));
    const int64_t local[2] = {static_cast<int64_t>(n), static_cast<int64_t>(backend_.kind())};
    processes_->all_gather(local, all.data(), 2, DType::kI64);
    for (int p = 0; p < processes_->rank(); ++p) first_replica += all[2 * static_cast<size_t>(p)];
    for (int p = 0; p < processes_->size(); ++p) same_replica_counts &= all[2 * static_cast<size_t>(p)] == all[0];
    // Every process must take the same steps from the same summed gradient. What each computes locally on it (the
    // clipping norm) is the same bits only from the same kernels: one device kind for all. Every process sees the
    // same table and refuses alike.
    const auto kind_name = [](int64_t k) { return k == static_cast<int64_t>(DeviceKind::kCpu) ? "cpu" : "cuda"; };
    for (int p = 0; p < processes_->size(); ++p) {
      const int64_t kind = all[2 * static_cast<size_t>(p) + 1];
      DPAR_ENFORCE(kind == all[1], Status::kNotSupported, "processes: process ", p, "'s replicas are on ",
                   kind_name(kind), " devices and process 0's on ", kind_name(all[1]),
                   " devices: every process's engine must use one device kind");
    }
    // Every process starts from rank 0's parameters, whatever each one's model was initialised with (as DDP).
    processes_->broadcast(model_.values().data(), model_.values().size(), DType::kF32, 0);
    // And from rank 0's buffers (DDP's broadcast_buffers).
    if (!model_.buffer_f32().empty())
      processes_->broadcast(model_.buffer_f32().data(), model_.buffer_f32().size(), DType::kF32, 0);
    if (!model_.buffer_i64().empty())
      processes_->broadcast(model_.buffer_i64().data(), model_.buffer_i64().size(), DType::kI64, 0);
    // Every process has arrived: from here on its collectives wait as long as a step's.
    if (config_.create_timeout_seconds > 0)
      processes_->set_timeout(std::chrono::duration<double>(config_.timeout_seconds));
  }
  std::vector<std::string> names;
  std::vector<std::string> tracks{"calls (the calling thread)"};
  for (size_t r = 0; r < n; ++r) {
    const std::string replica = "replica " + std::to_string(r) + " (" + config_.devices[r].str() + ")";
    tracks.push_back(replica + " worker");
    tracks.push_back(replica + " communication");
  }
  trace_ = std::make_unique<Trace>(std::move(tracks));
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

  pool_ = std::make_unique<WorkerPool>(n, [this, workers](size_t w) {
    backend_.start_worker(config_.devices[w], w, workers);
  });
  // Each replica's stream, memory and model are made on its own worker: its memory is first touched (and, for a
  // GPU, allocated) there. This is the only time the model is copied to the devices.
  run("create", [&](Replica& rep, size_t) {
    rep.stream = backend_.open_stream(rep.ctx.device);
    rep.ctx.stream = rep.stream.get();
  });
  std::vector<Stream*> streams;
  for (auto& rep : replicas_) streams.push_back(rep->stream.get());
  group_ = backend_.make_group(config_.devices, streams, names, std::chrono::duration<double>(config_.timeout_seconds));
  for (size_t r = 0; r < n; ++r) replicas_[r]->comm = group_->communicator(static_cast<int>(r));
  if (processes_)
    links_ = connect_replicas(backend_, processes_, config_.devices, streams,
                              std::chrono::duration<double>(config_.timeout_seconds),
                              same_replica_counts && config_.shard_across_processes);
  for (size_t r = 0; r < n; ++r) {
    Replica& rep = *replicas_[r];
    rep.set = std::make_unique<ReplicaSet>(*rep.comm, *rep.stream, links_, trace_.get(), comm_track(r));
    rep.ctx.collectives = rep.set.get();
  }

  every_replica_runs_ = model_.uses_collectives();
  reduction_ = config_.reduction;
  // The reduction chooses where the shards lie (GradientReduction); the links were made whatever it is.
  for (auto& rep : replicas_) rep->set->set_shards_world(world_shards(reduction_));
  node_params_.resize(model_.num_nodes());
  // A parameter is ready once the last backward that writes its gradient ran: a tied one's lowest reader's.
  for (size_t i = 0; i < model_.params().size(); ++i) node_params_[model_.params()[i].last_writer()].push_back(i);

  run("create", [&](Replica& rep, size_t) {
    rep.model = std::make_unique<ReplicaModel>(model_, rep.ctx);
    rep.loss_sum_device = Tensor::zeros(DType::kF32, Shape{2}, rep.ctx.device);  // room for one double
    if (const int64_t words = rep.model->num_buffer_f32() + 2 * rep.model->num_buffer_i64(); words > 0)
      rep.saved_buffers = Tensor::empty(DType::kF32, Shape{words}, rep.ctx.device);
    rep.norm_partial = Tensor::zeros(DType::kF32, Shape{2}, rep.ctx.device);     // likewise
    std::vector<Reducer::Grad> grads;
    for (const ParamInfo& p : model_.params())
      grads.push_back({rep.model->grads() + p.offset, static_cast<size_t>(p.shape.numel())});
    Communicator* comm = rep.comm.get();
    rep.reducer = std::make_unique<Reducer>(
        std::move(grads), config_.buckets, *rep.stream, bucket_strategy_for(rep),
        [this, comm, r = rep.ctx.replica](std::function<void()> op) {
          return comm->async_run("gradient bucket", [this, r, op = std::move(op)] {
            TraceTrack track(comm_track(r));
            op();
          });
        });
    // The optimizer's state for this replica's shard alone: the shard is all it steps (finish_and_step).
    rep.optimizer = std::make_unique<Optimizer>(optimizer, optimizer_shard(rep), rep.ctx.device);
  });
}

Engine::~Engine() = default;

void Engine::check_usable(const char* operation) const {
  DPAR_ENFORCE(!aborted_.load(), Status::kInvalidState, operation, ": the engine was aborted (", aborted_by_.load(),
               ") and must be recreated");
  DPAR_ENFORCE(!broken_, Status::kInvalidState, operation, ": the engine must be recreated: ", broken_reason_);
}

void Engine::abort(const char* by) {
  aborted_by_.store(by);
  aborted_.store(true);
  group_->abort(std::string("the engine was aborted (") + by + ")");
  if (links_) links_->abort("the engine of rank " + std::to_string(processes_->rank()) + " was aborted");
}

void Engine::save_state(Replica& rep) {
  rep.saved_rng_offset = rep.rng_offset;
  if (rep.saved_buffers.defined()) {
    const ReplicaModel& m = *rep.model;
    const auto f32 = static_cast<size_t>(m.num_buffer_f32()), i64 = static_cast<size_t>(m.num_buffer_i64());
    float* saved = rep.saved_buffers.f32();
    if (f32 > 0) rep.stream->copy(saved, m.buffer_f32(), f32 * sizeof(float));
    if (i64 > 0) rep.stream->copy(saved + f32, m.buffer_i64(), i64 * sizeof(int64_t));
  }
  rep.state_saved = true;
}

bool Engine::restore_state() {
  const auto errors = pool_->run_all([&](size_t r) {
    Replica& rep = *replicas_[r];
    if (!rep.state_saved) return;
    rep.rng_offset = rep.saved_rng_offset;
    if (rep.saved_buffers.defined()) {
      const ReplicaModel& m = *rep.model;
      const auto f32 = static_cast<size_t>(m.num_buffer_f32()), i64 = static_cast<size_t>(m.num_buffer_i64());
      const float* saved = rep.saved_buffers.f32();
      if (f32 > 0) rep.stream->copy(m.buffer_f32(), saved, f32 * sizeof(float));
      if (i64 > 0) rep.stream->copy(m.buffer_i64(), saved + f32, i64 * sizeof(int64_t));
      rep.stream->synchronize();
    }
  });
  return std::all_of(errors.begin(), errors.end(), [](const std::exception_ptr& e) { return !e; });
}

void Engine::run(const char* operation, const std::function<void(Replica&, size_t)>& job) {
  for (auto& rep : replicas_) rep->stepped = false, rep->state_saved = false;
  auto errors = pool_->run_all([&](size_t r) {
    Replica& rep = *replicas_[r];
    TraceTrack track(worker_track(r));
    TraceSpan span(*trace_, operation);
    // Whatever fails releases the others from any collective they wait in (the group keeps the first reason,
    // so a replica that only saw another one fail does not overwrite the cause).
    // Its buckets in flight are then waited for: they fail fast in the aborted group, and their buffers must not
    // be in use once the job returns. (The work already queued on its device is waited for below.)
    try {
      job(rep, r);
      // A job ends with its device work done: the caller may then read any replica's memory, and a device
      // failure is this job's.
      if (rep.stream) {
        TraceSpan sync(*trace_, "device sync");
        rep.stream->synchronize();
      }
    } catch (const std::exception& e) {
      if (rep.comm) rep.comm->abort(rep.ctx.device.str() + " failed: " + e.what());
      if (rep.reducer) rep.reducer->drain();
      throw;
    } catch (...) {
      if (rep.comm) rep.comm->abort(rep.ctx.device.str() + " failed: unknown exception");
      if (rep.reducer) rep.reducer->drain();
      throw;
    }
  });
  size_t first = errors.size();
  Status status = Status::kOk;
  std::string message;
  for (size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r]) continue;
    Status s = Status::kInternal;
    std::string what;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const Error& e) {
      s = e.status();
      what = e.what();
    } catch (const std::bad_alloc&) {
      s = Status::kOutOfMemory;
      what = "out of memory";
    } catch (const std::exception& e) {
      what = e.what();
    }
    // Prefer a root cause over a replica that only saw another one fail.
    if (first == errors.size() || (status == Status::kRemote && s != Status::kRemote)) {
      first = r;
      status = s;
      message = what;
    }
  }
  if (first == errors.size()) return;

  // Every replica's queued device work is waited for: a reduction kernel queued before the failure may still
  // write into any replica's buffers, which the next call reuses. A device whose wait still fails failed for good
  // (on a GPU, a sticky error such as an illegal address): its replica cannot take part in another step.
  std::string device_lost;
  for (auto& rep : replicas_) {
    try {
      if (rep->stream) rep->stream->synchronize();
    } catch (const std::exception& e) {
      if (device_lost.empty()) device_lost = e.what();
    }
  }
  if (aborted_.load()) {
    // The group stays aborted, so that a worker still on its way to a collective stops there too.
    // Replicas may have stepped and stopped apart (an abort can land inside the optimizer's all-gather): only a
    // recreated engine is known to be whole again, as every later call says (check_usable).
    if (links_) links_->abort(std::string(operation) + ": the engine was aborted on another process");
    fail(status, operation, ": ", message, "; the engine was aborted (", aborted_by_.load(), ") and must be recreated");
  }
  // Null while the engine is still being created; a group that cannot recover leaves the engine unusable.
  const bool recovered = device_lost.empty() && (!group_ || group_->recover());
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
    links_->abort(prefix + message);
    broken_ = true;
    broken_reason_ = prefix + message;
    fail(status, prefix, message, "; the processes may differ now, so the engine must be recreated on every process");
  }
  if (!device_lost.empty()) {
    broken_ = true;
    broken_reason_ = prefix + message;
    fail(status, prefix, message, "; a device failed for good (", device_lost,
         "), so the engine cannot go on: a GPU in that state needs a new process");
  }
  if (!recovered) {
    broken_ = true;
    broken_reason_ = prefix + message;
    fail(status, prefix, message, "; the replicas' communicator cannot be reused, so the engine must be recreated");
  }
  if (any_stepped) {
    // Some replicas applied the optimizer and others did not: they differ now.
    broken_ = true;
    broken_reason_ = prefix + message;
    fail(status, prefix, message, "; replicas may differ now, so the engine must be recreated");
  }
  // A replica may have moved its buffers or its RNG stream before another failed: each goes back to where the call
  // found it.
  if (!restore_state()) {
    broken_ = true;
    broken_reason_ = prefix + message;
    fail(status, prefix, message, "; the replicas' state could not be put back, so the engine must be recreated");
  }
  fail(status, prefix, message, "; the step's gradients were discarded and the engine remains usable");
}

void Engine::check_reachable(const Tensor& t, const char* what, const char* operation) const {
  const Device d = t.device();
  DPAR_CHECK_ARG(d.is_host() || d.kind == backend_.kind(), operation, ": ", what, " is on ", d.str(),
                 ", but this engine's replicas are on ", backend_.name(), " devices: pass host memory or memory of ",
                 backend_.name(), " devices");
}

Shape Engine::check_batch(const Tensor& input, const Tensor* target, const char* operation,
                          std::vector<int64_t>* row_samples) const {
  check_input_dtype(input, operation);
  check_reachable(input, "input", operation);
  if (target) check_reachable(*target, "target", operation);
  DPAR_CHECK_ARG(input.shape().ndim() >= 1 && input.rows() >= 1, operation, ": input batch is empty");
  Shape out;
  try {
    out = model_.output_shape(input.shape());
  } catch (const Error& e) {
    fail(e.status(), operation, ": input ", input.shape().str(), " does not fit the model: ", e.what());
  }
  check_input_values(input, operation);
  if (target) {
    std::vector<int64_t> samples = check_loss_target(config_.loss, out, *target, operation);
    if (row_samples) *row_samples = std::move(samples);
  }
  return out;
}

void Engine::check_statistics(const Tensor& input) const {
  if (!training_) return;
  model_.check_training_batch(input.shape(), split_batch(input.rows(), replicas_.size()),
                              processes_ ? 0 : input.rows());
}

void Engine::check_global_statistics(const Tensor& input, int64_t global_batch) const {
  if (training_ && processes_) model_.check_training_batch(input.shape(), {}, global_batch);
}

Tensor Engine::on_replica(Replica& rep, const Tensor& whole, int64_t begin, int64_t rows, Tensor& stage) {
  Tensor part = whole.rows(begin, rows);
  // On the replica's own memory already (host memory for a CPU replica): a view.
  if (rep.ctx.device.is_host() || whole.device() == rep.ctx.device) return part;
  const Shape shape = whole.shape().with_rows(rows);
  if (!stage.defined() || stage.dtype() != whole.dtype() || stage.numel() < shape.numel())
    stage = rep.ctx.alloc(whole.dtype(), Shape{shape.numel()});
  Tensor dst = stage.rows(0, shape.numel()).reshaped(shape);
  if (whole.device().is_host())
    rep.stream->copy_from_host(dst.raw(), part.raw(), part.bytes());
  else
    rep.stream->copy(dst.raw(), part.raw(), part.bytes());  // from another device of the replica's kind
  return dst;
}

void Engine::local_loss_backward(Replica& rep, const Tensor& input, const Tensor& target, int64_t begin,
                                 int64_t samples, bool reduce) {
  const ReplicaContext& ctx = rep.ctx;
  Tensor x, t, out;
  {
    TraceSpan span(*trace_, "batch to device", "rows", rep.rows);
    x = on_replica(rep, input, begin, rep.rows, rep.input_stage);
    t = on_replica(rep, target, begin, rep.rows, rep.target_stage);
  }
  {
    TraceSpan span(*trace_, "forward", "rows", rep.rows);
    out = rep.model->forward(ctx, x);
    if (hook_) hook_(ctx.replica, x.shape(), out.shape());
  }
  Tensor dout = rep.model->output_grad_buffer(ctx);
  {
    // The gradient of the SUM of this chunk's losses, times the loss scale (1 without loss scaling: the step
    // divides it out); the all-reduce divides by the whole batch's samples. The loss itself is not scaled.
    TraceSpan span(*trace_, "loss");
    auto* loss_sum = static_cast<double*>(rep.loss_sum_device.raw());
    loss_forward_backward(config_.loss, ctx, loss_sum, dout, out, t, scaler_.scale());
  }
  rep.loss_rows = rep.rows;
  rep.loss_samples = samples;
  TraceSpan span(*trace_, "backward");
  if (reduce) {
    rep.model->backward(ctx, dout, rep.has_grad, [&](size_t node) {
      for (size_t p : node_params_[node]) rep.reducer->mark_ready(p);
    });
  } else {
    rep.model->backward(ctx, dout, rep.has_grad);
  }
  rep.has_grad = true;
}

void Engine::read_loss(Replica& rep) {
  if (rep.loss_rows == 0) return;
  TraceSpan span(*trace_, "loss to host");
  rep.stream->copy_to_host(&rep.loss_sum, rep.loss_sum_device.raw(), sizeof(double));
}

template <class T>
T Engine::sum_over_processes(T value, const char* operation) {
  if (!processes_) return value;
  T sum = 0;
  try {
    processes_->all_reduce(&value, &sum, 1, std::is_same_v<T, double> ? DType::kF64 : DType::kI64,
                           ReduceOp::kSum);
  } catch (const Error& e) {
    // Some processes may have gone on: the engine cannot tell where the others are.
    broken_ = true;
    broken_reason_ = std::string(operation) + ": " + e.what();
    fail(e.status(), operation, ": across processes: ", e.what());
  }
  return sum;
}

Engine::BatchCount Engine::global_batch_of(const char* operation, const std::function<BatchCount()>& check) {
  if (!processes_) return check();
  // Every process tells its batch (rows, samples), or -1 rows if it refused its call: then all refuse the step
  // together, and none waits for the one that returned (the engines stay usable). An all-gather, so that each can
  // name who refused.
  int64_t mine[2] = {-1, 0};
  std::exception_ptr refused;
  try {
    const BatchCount batch = check();
    mine[0] = batch.rows;
    mine[1] = batch.samples;
  } catch (const Error&) {
    refused = std::current_exception();
  }
  std::vector<int64_t> batches(2 * static_cast<size_t>(processes_->size()));
  try {
    processes_->all_gather(mine, batches.data(), 2, DType::kI64);
  } catch (const Error& e) {
    broken_ = true;
    broken_reason_ = std::string(operation) + ": " + e.what();
    fail(e.status(), operation, ": across processes: ", e.what());
  }
  if (refused) std::rethrow_exception(refused);
  BatchCount total;
  for (size_t p = 0; 2 * p < batches.size(); ++p) {
    DPAR_ENFORCE(batches[2 * p] >= 0, Status::kRemote, operation, ": rank ", p,
                 " refused its part of the step (its own error says why); no process took the step");
    total.rows += batches[2 * p];
    total.samples += batches[2 * p + 1];
  }
  return total;
}

namespace {

// The factor of the summed gradient: 1 / samples, and 0 for none (every target ignored), so that the optimizer
// steps with a zero gradient where PyTorch's 0/0 would write NaN into every weight.
float mean_scale(int64_t samples) { return samples > 0 ? static_cast<float>(1.0 / static_cast<double>(samples)) : 0.0f; }

// The replicas' rows [begin, begin + rows) of the batch hold these samples.
int64_t samples_in(const std::vector<int64_t>& row_samples, int64_t begin, int64_t rows) {
  int64_t n = 0;
  for (int64_t i = begin; i < begin + rows; ++i) n += row_samples[static_cast<size_t>(i)];
  return n;
}

}  // namespace

double Engine::finish_loss(const char* operation, int64_t global_samples) {
  double total = 0.0;  // the replicas' loss_sum, copied from their devices at the end of the job
  for (auto& rep : replicas_) total += rep->loss_rows > 0 ? rep->loss_sum : 0.0;
  total = sum_over_processes(total, operation);
  // No sample: NaN, PyTorch's mean over no target (its 0/0).
  return global_samples > 0 ? total / static_cast<double>(global_samples)
                            : std::numeric_limits<double>::quiet_NaN();
}

double Engine::accumulate(const Tensor& input, const Tensor& target) {
  check_usable("accumulate");
  if (micro_chunk_rows_ > 0) return reproducible_accumulate(input, target);
  const TraceSpan span(*trace_, kCallTrack, "accumulate", "rows", input.rows());
  std::vector<int64_t> row_samples;
  const BatchCount global = global_batch_of("accumulate", [&] {
    check_batch(input, &target, "accumulate", &row_samples);
    DPAR_ENFORCE(pending_ != Pending::kExplicit, Status::kInvalidState,
                 "accumulate: gradients from backward() are pending; call step() or zero_grad() first");
    check_statistics(input);
    return BatchCount{input.rows(), samples_in(row_samples, 0, input.rows())};
  });
  check_global_statistics(input, global.rows);
  const int64_t batch = input.rows();
  const auto split = split_batch(batch, replicas_.size());
  run("accumulate", [&](Replica& rep, size_t r) {
    int64_t begin = 0;
    for (size_t i = 0; i < r; ++i) begin += split[i];
    rep.rows = split[r];
    rep.loss_rows = 0;
    rep.loss_samples = 0;
    if (training_) save_state(rep);
    if (rep.rows > 0 || every_replica_runs_)
      local_loss_backward(rep, input, target, begin, samples_in(row_samples, begin, rep.rows), false);
    if (training_) sync_buffers(rep);
    read_loss(rep);
  });
  pending_ = Pending::kLoss;
  pending_samples_ += global.samples;
  forward_split_.clear();  // the replicas' forward state now belongs to this micro-batch
  return finish_loss("accumulate", global.samples);
}

double Engine::train_step(const Tensor& input, const Tensor& target) {
  check_usable("train_step");
  if (micro_chunk_rows_ > 0) return reproducible_train_step(input, target);
  const TraceSpan span(*trace_, kCallTrack, "train_step", "rows", input.rows());
  std::vector<int64_t> row_samples;
  const BatchCount global = global_batch_of("train_step", [&] {
    check_batch(input, &target, "train_step", &row_samples);
    DPAR_ENFORCE(pending_ == Pending::kNone, Status::kInvalidState,
                 "train_step: gradients from ", pending_ == Pending::kLoss ? "accumulate()" : "backward()",
                 " are pending; call step() or zero_grad() first");
    check_statistics(input);
    return BatchCount{input.rows(), samples_in(row_samples, 0, input.rows())};
  });
  check_global_statistics(input, global.rows);
  const int64_t batch = input.rows();
  const auto split = split_batch(batch, replicas_.size());
  const float scale = mean_scale(global.samples);
  // One hand-off to the workers for the whole step: forward, loss, backward with the buckets' all-reduces
  // overlapped, optimizer.
  run("train_step", [&](Replica& rep, size_t r) {
    int64_t begin = 0;
    for (size_t i = 0; i < r; ++i) begin += split[i];
    rep.rows = split[r];
    rep.loss_rows = 0;
    rep.loss_samples = 0;
    rep.reducer->prepare(scale);
    if (training_) save_state(rep);
    if (rep.rows > 0 || every_replica_runs_)
      local_loss_backward(rep, input, target, begin, samples_in(row_samples, begin, rep.rows), true);
    finish_and_step(rep);
    if (training_) sync_buffers(rep);
    read_loss(rep);
  });
  publish_grad_norm();
  update_loss_scale();
  forward_split_.clear();
  return finish_loss("train_step", global.samples);
}

void Engine::step() {
  check_usable("step");
  if (micro_chunk_rows_ > 0) return reproducible_step();
  const TraceSpan span(*trace_, kCallTrack, "step");
  DPAR_ENFORCE(pending_ != Pending::kNone, Status::kInvalidState,
               "step: no gradient is pending (call accumulate() or forward() and backward() first)");
  const float scale = pending_ == Pending::kLoss ? mean_scale(pending_samples_) : 1.0f;
  // Activations kept by a forward() before this step belong to the old parameters: a backward through them after
  // the step would mix the two, so they are dropped.
  run("step", [&](Replica& rep, size_t) {
    rep.reducer->prepare(scale);
    if (rep.has_grad) rep.reducer->mark_all_ready();
    finish_and_step(rep);
    rep.model->clear_forward_state();
  });
  publish_grad_norm();
  update_loss_scale();
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
  const TraceSpan span(*trace_, kCallTrack, "forward", "rows", input.rows());
  Shape out_shape;
  const auto check = [&] {
    out_shape = check_batch(input, nullptr, "forward");
    check_statistics(input);
    return BatchCount{input.rows(), input.rows()};
  };
  // A training-mode forward moves buffers over every process (sync_buffers): all of them refuse it together.
  if (training_ && processes_)
    check_global_statistics(input, global_batch_of("forward", check).rows);
  else
    check();
  const auto split = split_batch(input.rows(), replicas_.size());
  const Device out_device = config_.devices[config_.output_replica];
  Tensor out = Tensor::empty(DType::kF32, out_shape, out_device);
  const int64_t out_row = out_shape.row_numel();
  run("forward", [&](Replica& rep, size_t r) {
    int64_t begin = 0;
    for (size_t i = 0; i < r; ++i) begin += split[i];
    rep.rows = split[r];
    if (training_) save_state(rep);
    if (rep.rows == 0 && !every_replica_runs_) {
      if (training_) sync_buffers(rep);  // every replica takes part in the buffers' broadcast
      return;
    }
    Tensor x = on_replica(rep, input, begin, rep.rows, rep.input_stage);
    Tensor y;
    {
      TraceSpan span(*trace_, "forward", "rows", rep.rows);
      y = rep.model->forward(rep.ctx, x);
      if (hook_) hook_(r, x.shape(), y.shape());
    }
    // Gather: each replica copies its rows into the output, in batch order.
    float* dst = out.f32() + begin * out_row;
    const size_t bytes = static_cast<size_t>(y.numel()) * sizeof(float);
    // The output device is one of the replicas' devices, of their kind: a copy within the kind (between two GPUs
    // where the replica is on another one than the output).
    rep.stream->copy(dst, y.f32(), bytes);
    if (!training_) rep.model->clear_forward_state();
    if (training_) sync_buffers(rep);
  });
  if (training_) {
    forward_split_ = split;
    forward_output_shape_ = out_shape;
  }
  return out;
}

void Engine::backward(const Tensor& grad_output) {
  check_usable("backward");
  DPAR_ENFORCE(micro_chunk_rows_ == 0, Status::kNotSupported, "backward: the reproducible mode (micro-chunks of ",
               micro_chunk_rows_, " rows) trains with train_step and accumulate; turn it off (0) to call backward()");
  const TraceSpan span(*trace_, kCallTrack, "backward");
  DPAR_ENFORCE(!forward_split_.empty(), Status::kInvalidState,
               "backward: no training-mode forward() to go back through");
  DPAR_ENFORCE(pending_ != Pending::kLoss, Status::kInvalidState,
               "backward: gradients from accumulate() are pending; call step() or zero_grad() first");
  DPAR_CHECK_ARG(grad_output.dtype() == DType::kF32, "backward: grad_output must be f32, got ",
                 dtype_name(grad_output.dtype()));
  check_reachable(grad_output, "grad_output", "backward");
  DPAR_CHECK_ARG(grad_output.shape() == forward_output_shape_, "backward: grad_output ", grad_output.shape().str(),
                 " must be shaped as forward's output ", forward_output_shape_.str());
  const auto split = forward_split_;
  run("backward", [&](Replica& rep, size_t r) {
    if (split[r] == 0 && !every_replica_runs_) return;
    int64_t begin = 0;
    for (size_t i = 0; i < r; ++i) begin += split[i];
    Tensor dout = on_replica(rep, grad_output, begin, split[r], rep.grad_stage);
    if (scaler_.enabled()) dout = scaled_grad_output(rep, dout);
    TraceSpan span(*trace_, "backward");
    rep.model->backward(rep.ctx, dout, rep.has_grad);
    rep.has_grad = true;
  });
  forward_split_.clear();
  pending_ = Pending::kExplicit;
}

void Engine::set_training(bool training) { training_ = training; for (auto& rep : replicas_) rep->ctx.training = training; }

std::vector<float> Engine::replica_losses() const {
  std::vector<float> out;
  for (auto& rep : replicas_)
    out.push_back(rep->loss_rows > 0 && rep->loss_samples > 0
                      ? static_cast<float>(rep->loss_sum / static_cast<double>(rep->loss_samples))
                      : std::numeric_limits<float>::quiet_NaN());
  return out;
}

std::vector<float> Engine::params(size_t replica) const {
  const Replica& rep = *replicas_[replica];
  std::vector<float> values(static_cast<size_t>(model_.num_param_elements()));
  backend_.copy_to_host(values.data(), rep.model->params(), values.size() * sizeof(float), rep.ctx.device);
  return values;
}

void Engine::set_forward_hook(ForwardHook hook) { hook_ = std::move(hook); }

void Engine::trace_start() { trace_->start(); }

void Engine::trace_stop(const std::string& path) {
  DPAR_ENFORCE(trace_->started(), Status::kInvalidState, "trace_stop: no trace was started (trace_start)");
  trace_->stop();
  if (path.empty()) return;
  const std::string text = trace_->chrome_json(process_rank());
  io::write_file_atomically(path, {{text.data(), text.size()}});  // throws Status::kIo naming the path
}

void Engine::inject_fault(size_t replica, Fault fault) { replicas_[replica]->fault = fault; }

}  // namespace dpar
