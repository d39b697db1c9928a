#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <mutex>
#include <set>

#include "capi/api.h"
#include "comm/processes.h"

using namespace dpar;
using namespace dpar::capi;

namespace {

// The fields of the options' kind (another kind's fields are ignored, whatever they hold), checked.
OptimizerConfig optimizer_config(const dpar_optimizer_options& o) {
  DPAR_CHECK_ARG(o.kind == DPAR_SGD || o.kind == DPAR_ADAM || o.kind == DPAR_ADAMW, "optimizer.kind: unknown kind ",
                 o.kind);
  OptimizerConfig c;
  c.kind = o.kind == DPAR_SGD ? OptimizerKind::kSgd : o.kind == DPAR_ADAM ? OptimizerKind::kAdam : OptimizerKind::kAdamW;
  c.lr = o.lr;
  c.weight_decay = o.weight_decay;
  if (c.kind == OptimizerKind::kSgd) {
    c.momentum = o.momentum;
    c.dampening = o.dampening;
    c.nesterov = o.nesterov != 0;
  } else {
    c.beta1 = o.beta1;
    c.beta2 = o.beta2;
    c.eps = o.eps;
  }
  c.check("optimizer");
  return c;
}

EngineConfig engine_config(const dpar_engine_options& o) {
  EngineConfig c;
  const DeviceKind kind = checked_device_kind(o.device_kind, "opts.device_kind");
  const char* name = kind == DeviceKind::kCpu ? "cpu" : "cuda";
  size_t available = 0;
  if (kind == DeviceKind::kCpu) {
    available = o.num_cpu_devices ? o.num_cpu_devices : default_cpu_device_count();
    DPAR_CHECK_ARG(available <= 256, "opts.num_cpu_devices: ", available, " is more than 256");
  } else {
    Backend& backend = backend_for(kind);
    available = backend.device_count();
    DPAR_ENFORCE(available > 0, Status::kDevice, "opts.device_kind: no ", name, " device (",
                 backend.unavailable_reason(), ")");
  }
  std::vector<int32_t> ids;
  if (o.device_ids) {
    DPAR_CHECK_ARG(o.num_device_ids > 0, "opts.num_device_ids: the device list is empty");
    DPAR_CHECK_ARG(o.num_device_ids <= 256, "opts.num_device_ids: ", o.num_device_ids, " is more than 256");
    ids.assign(o.device_ids, o.device_ids + o.num_device_ids);
  } else {
    DPAR_CHECK_ARG(o.num_device_ids == 0, "opts.device_ids: is NULL but num_device_ids is ", o.num_device_ids);
    for (size_t i = 0; i < available; ++i) ids.push_back(static_cast<int32_t>(i));
  }
  std::set<int32_t> seen;
  for (size_t i = 0; i < ids.size(); ++i) {
    DPAR_CHECK_ARG(ids[i] >= 0 && static_cast<size_t>(ids[i]) < available, "opts.device_ids[", i, "]: ", name, ":",
                   ids[i], " is out of range (", available, " ", name, " devices: ", name, ":0 to ", name, ":",
                   available - 1, ")");
    // A GPU named twice holds two replicas (they reduce through device memory); a CPU device is one thread.
    DPAR_CHECK_ARG(seen.insert(ids[i]).second || kind != DeviceKind::kCpu, "opts.device_ids[", i, "]: cpu:", ids[i],
                   " is repeated");
    c.devices.push_back(Device{kind, ids[i]});
  }
  if (o.output_device >= 0) {
    auto it = std::find(ids.begin(), ids.end(), o.output_device);
    DPAR_CHECK_ARG(it != ids.end(), "opts.output_device: ", name, ":", o.output_device,
                   " is not one of the engine's devices");
    c.output_replica = static_cast<size_t>(it - ids.begin());
  } else {
    DPAR_CHECK_ARG(o.output_device == -1, "opts.output_device: ", o.output_device, " (use -1 for the first device)");
  }
  DPAR_CHECK_ARG(o.loss == DPAR_LOSS_CROSS_ENTROPY || o.loss == DPAR_LOSS_MSE, "opts.loss: unknown loss ", o.loss);
  DPAR_CHECK_ARG(o.timeout_seconds > 0, "opts.timeout_seconds: ", o.timeout_seconds,
                 " must be positive (INFINITY for none)");
  DPAR_CHECK_ARG(o.blas_threads >= 1 && o.blas_threads <= 1024, "opts.blas_threads: ", o.blas_threads,
                 " must be 1 to 1024");
  c.loss = o.loss == DPAR_LOSS_MSE ? LossKind::kMse : LossKind::kCrossEntropy;
  static_assert(kIgnoreIndex == DPAR_IGNORE_INDEX, "the core skips the target the header names");
  c.seed = o.seed;
  DPAR_CHECK_ARG(o.create_timeout_seconds >= 0, "opts.create_timeout_seconds: ", o.create_timeout_seconds,
                 " must be >= 0 (0: timeout_seconds; INFINITY for none)");
  c.timeout_seconds = o.timeout_seconds;
  c.create_timeout_seconds = o.create_timeout_seconds;
  c.blas_threads = static_cast<int32_t>(o.blas_threads);
  c.pin_workers = o.pin_workers != 0;
  c.buckets = bucket_options(o.first_bucket_bytes, o.bucket_cap_bytes);
  return c;
}

// The engine's connection to the other processes, or null for a single process.
std::shared_ptr<Communicator> processes_comm(const dpar_engine_options& o) {
  DPAR_CHECK_ARG(o.processes == DPAR_PROCESSES_AUTO || o.processes == DPAR_PROCESSES_SINGLE ||
                     o.processes == DPAR_PROCESSES_MPI,
                 "opts.processes: unknown value ", o.processes);
  static_assert(static_cast<int>(ProcessMode::kAuto) == DPAR_PROCESSES_AUTO &&
                static_cast<int>(ProcessMode::kSingle) == DPAR_PROCESSES_SINGLE &&
                static_cast<int>(ProcessMode::kMpi) == DPAR_PROCESSES_MPI);
  return connect_processes(static_cast<ProcessMode>(o.processes), o.timeout_seconds, o.create_timeout_seconds);
}

// A strong reference to a live engine, refused from inside the engine's own callbacks: the calling thread holds
// the engine's lock while its workers run them, so a call back into the engine would wait forever.
// `once_live` runs as soon as the handle is known to be a live engine, before any other refusal.
template <class F = void (*)()>
std::shared_ptr<Engine> acquire(const dpar_engine* engine, F&& once_live = [] {}) {
  DPAR_CHECK_ARG(engine != nullptr, "engine: handle is NULL");
  LiveHandleGuard registry;
  DPAR_CHECK_ARG(registry.live(engine, HandleKind::kEngine), "engine",
                 ": not a live handle of this type (freed already, or never created by dpar)");
  once_live();
  // Another engine (one created inside this callback, say) may be called from here: it has its own lock and workers.
  DPAR_ENFORCE(!engine->engine->on_own_worker(), Status::kInvalidState,
               "engine: called from a callback on one of its own worker threads (a custom layer or the forward "
               "hook); an engine's functions may only be called from outside its callbacks");
  return engine->engine;
}

// Runs body on a checked engine with its lock held.
template <class F>
dpar_status with_engine(dpar_engine* engine, F&& body) {
  return guard([&] {
    std::shared_ptr<Engine> e = acquire(engine);
    std::lock_guard<std::mutex> lock(e->mutex());
    body(*e);
  });
}

template <class F>
dpar_status with_engine(const dpar_engine* engine, F&& body) {
  return with_engine(const_cast<dpar_engine*>(engine), std::forward<F>(body));
}

const Tensor& tensor_arg(const dpar_tensor* t, const char* argument) { return checked(t, argument).tensor; }

size_t replica_arg(const Engine& e, size_t replica) {
  DPAR_CHECK_ARG(replica < e.num_replicas(), "replica: ", replica, " is out of range (the engine has ",
                 e.num_replicas(), " replicas)");
  return replica;
}

}  // namespace

extern "C" {

// What programs built against dpar.h 0.4 or older call (dpar.h now makes the name a macro that passes the
// caller's size to dpar_engine_options_init_sized): it writes dpar.h 0.4's layout, whatever this library's is.
DPAR_API dpar_status (dpar_engine_options_init)(dpar_engine_options* opts) {
  return guard([&] { init_unsized_options(opts, "opts"); });
}

DPAR_API dpar_status dpar_engine_options_init_sized(dpar_engine_options* opts, size_t size) {
  return guard([&] { init_options(opts, size, "opts"); });
}

DPAR_API dpar_status dpar_engine_create(dpar_engine** out, const dpar_model* model,
                                        const dpar_optimizer_options* optimizer, const dpar_engine_options* opts) {
  return guard([&] {
    checked_out(out);
    *out = nullptr;
    const Model& m = checked(model, "model").model;
    const auto o = read_options(opts, "opts");
    const auto oo = read_options(optimizer, "optimizer");
    EngineConfig config = engine_config(o);
    const OptimizerConfig opt = optimizer_config(oo);
    config.processes = processes_comm(o);
    auto engine = std::make_unique<Engine>(m, opt, std::move(config));
    auto* h = new_handle<dpar_engine>();
    h->engine = std::move(engine);
    *out = h;
  });
}

DPAR_API void dpar_engine_free(dpar_engine* engine) {
  // From one of the engine's own worker threads this would join the thread it runs on: refused there (the engine
  // stays), checked under the registry's lock so that the handle cannot be freed meanwhile. Any other thread,
  // another engine's worker included, frees it.
  if (engine && take_handle(engine, HandleKind::kEngine, [engine] { return !engine->engine->on_own_worker(); })) {
    delete engine;
  }
}

DPAR_API dpar_status dpar_engine_abort(dpar_engine* engine) {
  return guard([&] { acquire(engine)->abort("dpar_engine_abort"); });  // no lock: the call in flight holds it
}

DPAR_API dpar_status dpar_engine_num_replicas(size_t* out, const dpar_engine* engine) {
  return with_engine(engine, [&](Engine& e) { *checked_out(out) = e.num_replicas(); });
}

DPAR_API dpar_status dpar_engine_processes(size_t* out_rank, size_t* out_size, const dpar_engine* engine) {
  return with_engine(engine, [&](Engine& e) {
    if (out_rank) *out_rank = static_cast<size_t>(e.process_rank());
    if (out_size) *out_size = static_cast<size_t>(e.num_processes());
  });
}

DPAR_API const char* dpar_engine_process_transport(const dpar_engine* engine) {
  const char* transport = nullptr;
  with_engine(engine, [&](Engine& e) { transport = e.process_transport().c_str(); });
  return transport;
}

DPAR_API dpar_status dpar_engine_num_buckets(size_t* out, const dpar_engine* engine) {
  return with_engine(engine, [&](Engine& e) { *checked_out(out) = e.num_buckets(); });
}

DPAR_API dpar_status dpar_engine_replica_device(dpar_device* out, const dpar_engine* engine, size_t replica) {
  return with_engine(engine, [&](Engine& e) {
    checked_out(out);
    Device d = e.replica_device(replica_arg(e, replica));
    *out = to_c(d);
  });
}

DPAR_API dpar_status dpar_engine_split(size_t* out, const dpar_engine* engine, size_t batch, size_t capacity) {
  return with_engine(engine, [&](Engine& e) {
    checked_out(out);
    DPAR_CHECK_ARG(capacity >= e.num_replicas(), "capacity: ", capacity, " is less than the ", e.num_replicas(),
                   " replicas");
    DPAR_CHECK_ARG(batch >= 1, "batch: must be at least 1");
    DPAR_CHECK_ARG(batch <= static_cast<size_t>(INT64_MAX), "batch: ", batch, " is too large");
    auto rows = split_batch(static_cast<int64_t>(batch), e.num_replicas());
    for (size_t r = 0; r < rows.size(); ++r) out[r] = static_cast<size_t>(rows[r]);
  });
}

DPAR_API dpar_status dpar_engine_train_step(float* out_loss, dpar_engine* engine, const dpar_tensor* input,
                                            const dpar_tensor* target) {
  return with_engine(engine, [&](Engine& e) {
    double loss = e.train_step(tensor_arg(input, "input"), tensor_arg(target, "target"));
    if (out_loss) *out_loss = static_cast<float>(loss);
  });
}

DPAR_API dpar_status dpar_engine_accumulate(float* out_loss, dpar_engine* engine, const dpar_tensor* input,
                                            const dpar_tensor* target) {
  return with_engine(engine, [&](Engine& e) {
    double loss = e.accumulate(tensor_arg(input, "input"), tensor_arg(target, "target"));
    if (out_loss) *out_loss = static_cast<float>(loss);
  });
}

DPAR_API dpar_status dpar_engine_step(dpar_engine* engine) {
  return with_engine(engine, [&](Engine& e) { e.step(); });
}

DPAR_API dpar_status dpar_engine_zero_grad(dpar_engine* engine) {
  return with_engine(engine, [&](Engine& e) { e.zero_grad(); });
}

DPAR_API dpar_status dpar_engine_forward(dpar_tensor** out, dpar_engine* engine, const dpar_tensor* input) {
  if (out) *out = nullptr;
  return with_engine(engine, [&](Engine& e) {
    checked_out(out);
    Tensor y = e.forward(tensor_arg(input, "input"));
    auto* h = new_handle<dpar_tensor>();
    h->tensor = std::move(y);
    *out = h;
  });
}

DPAR_API dpar_status dpar_engine_backward(dpar_engine* engine, const dpar_tensor* grad_output) {
  return with_engine(engine, [&](Engine& e) { e.backward(tensor_arg(grad_output, "grad_output")); });
}

DPAR_API dpar_status dpar_engine_set_training(dpar_engine* engine, int32_t training) {
  return with_engine(engine, [&](Engine& e) { e.set_training(training != 0); });
}

DPAR_API dpar_status dpar_engine_set_lr(dpar_engine* engine, float lr) {
  return with_engine(engine, [&](Engine& e) { e.set_lr(lr); });
}

DPAR_API dpar_status dpar_engine_set_max_grad_norm(dpar_engine* engine, float max_norm) {
  return with_engine(engine, [&](Engine& e) { e.set_max_grad_norm(max_norm); });
}

DPAR_API dpar_status dpar_engine_set_gradient_compression(dpar_engine* engine, int32_t compression) {
  return with_engine(engine,
                     [&](Engine& e) { e.set_gradient_compression(static_cast<GradientCompression>(compression)); });
}

DPAR_API dpar_status dpar_engine_set_gradient_reduction(dpar_engine* engine, int32_t reduction) {
  return with_engine(engine,
                     [&](Engine& e) { e.set_gradient_reduction(static_cast<GradientReduction>(reduction)); });
}

DPAR_API dpar_status dpar_engine_set_weight_decay_exclusion(dpar_engine* engine, int32_t exclude_biases_and_norms) {
  return with_engine(engine, [&](Engine& e) {
    DPAR_CHECK_ARG(exclude_biases_and_norms == 0 || exclude_biases_and_norms == 1, "exclude_biases_and_norms: ",
                   exclude_biases_and_norms, " is neither 0 (every parameter decays) nor 1 (biases and norms do not)");
    e.set_weight_decay_exclusion(exclude_biases_and_norms == 1);
  });
}

DPAR_API dpar_status dpar_engine_grad_norm(float* out, const dpar_engine* engine) {
  return with_engine(engine, [&](Engine& e) { *checked_out(out) = e.grad_norm(); });
}

DPAR_API dpar_status dpar_engine_step_count(size_t* out, const dpar_engine* engine) {
  return with_engine(engine, [&](Engine& e) { *checked_out(out) = static_cast<size_t>(e.step_count()); });
}

DPAR_API dpar_status dpar_engine_set_loss_scaling(dpar_engine* engine, float init_scale, float growth_factor,
                                                  float backoff_factor, int64_t growth_interval) {
  return with_engine(engine, [&](Engine& e) {
    e.set_loss_scaling(LossScaling{init_scale, growth_factor, backoff_factor, growth_interval});
  });
}

DPAR_API dpar_status dpar_engine_loss_scale(float* out, const dpar_engine* engine) {
  return with_engine(engine, [&](Engine& e) { *checked_out(out) = e.loss_scaler().scale(); });
}

DPAR_API dpar_status dpar_engine_last_step_skipped(int32_t* out, const dpar_engine* engine) {
  return with_engine(engine, [&](Engine& e) { *checked_out(out) = e.loss_scaler().last_step_skipped() ? 1 : 0; });
}

DPAR_API dpar_status dpar_engine_replica_losses(float* out, const dpar_engine* engine, size_t capacity) {
  return with_engine(engine, [&](Engine& e) {
    checked_out(out);
    DPAR_CHECK_ARG(capacity >= e.num_replicas(), "capacity: ", capacity, " is less than the ", e.num_replicas(),
                   " replicas");
    auto losses = e.replica_losses();
    std::copy(losses.begin(), losses.end(), out);
  });
}

DPAR_API dpar_status dpar_engine_get_params(float* dst, dpar_engine* engine, size_t replica, size_t count) {
  return with_engine(engine, [&](Engine& e) {
    DPAR_CHECK_ARG(dst != nullptr, "dst: is NULL");
    replica_arg(e, replica);
    DPAR_CHECK_ARG(count == static_cast<size_t>(e.model().num_param_elements()), "count: ", count,
                   " differs from the model's ", e.model().num_param_elements(), " parameter elements");
    auto p = e.params(replica);
    std::copy(p.begin(), p.end(), dst);
  });
}

DPAR_API dpar_status dpar_engine_memory_stats(int64_t* allocated_bytes, int64_t* peak_bytes,
                                              const dpar_engine* engine, size_t replica) {
  return with_engine(engine, [&](Engine& e) {
    DPAR_CHECK_ARG(allocated_bytes != nullptr || peak_bytes != nullptr,
                   "allocated_bytes and peak_bytes: output pointers are both NULL");
    const MemoryStats stats = e.memory_stats(replica_arg(e, replica));
    if (allocated_bytes) *allocated_bytes = stats.allocated;
    if (peak_bytes) *peak_bytes = stats.peak;
  });
}

DPAR_API dpar_status dpar_engine_reset_peak_memory(dpar_engine* engine, size_t replica) {
  return with_engine(engine, [&](Engine& e) { e.reset_peak_memory(replica_arg(e, replica)); });
}

DPAR_API dpar_status dpar_engine_get_buffer(void* dst, dpar_engine* engine, size_t replica, size_t index,
                                            size_t count) {
  return with_engine(engine, [&](Engine& e) {
    DPAR_CHECK_ARG(dst != nullptr, "dst: is NULL");
    replica_arg(e, replica);
    const auto& buffers = e.model().buffers();
    DPAR_CHECK_ARG(index < buffers.size(), "index: ", index, " is out of range (the model has ", buffers.size(),
                   " buffers)");
    DPAR_CHECK_ARG(count == static_cast<size_t>(buffer_numel(buffers[index].shape)), "count: ", count,
                   " differs from buffer \"", buffers[index].name, "\"'s ", buffer_numel(buffers[index].shape),
                   " elements");
    e.read_buffer(dst, replica, index);
  });
}

DPAR_API dpar_status dpar_engine_set_forward_hook(dpar_engine* engine, dpar_forward_hook hook, void* payload,
                                                  dpar_destroy_fn destroy) {
  // The payload is dpar's once the engine is known to be live: released when the hook that holds it goes
  // (replaced, removed, or the engine destroyed), or here when the call fails for any other reason (a call from
  // inside the engine's own callbacks, which acquire refuses, included).
  std::shared_ptr<void> held;
  const dpar_status rc = guard([&] {
    std::shared_ptr<Engine> engine_ref = acquire(engine, [&] {
      held = std::shared_ptr<void>(payload, [destroy](void* p) {
        if (destroy) destroy(p);
      });
    });
    std::lock_guard<std::mutex> lock(engine_ref->mutex());
    Engine& e = *engine_ref;
    if (!hook) {
      held.reset();  // nothing will call it
      e.set_forward_hook(nullptr);
      return;
    }
    e.set_forward_hook([hook, held](size_t replica, const Shape& in, const Shape& out) {
      dpar_clear_error();
      const dpar_status s = hook(held.get(), replica, in.data(), in.ndim(), out.data(), out.ndim());
      if (s != DPAR_OK) {
        const std::string detail = dpar_last_error();
        fail(from_c_error(s), "forward hook on replica ", replica,
             " returned ", dpar_status_str(s), detail.empty() ? "" : ": ", detail);
      }
    });
  });
  return rc;
}

DPAR_API dpar_status dpar_engine_save(dpar_engine* engine, const char* path) {
  return with_engine(engine, [&](Engine& e) {
    DPAR_CHECK_ARG(path != nullptr, "path: is NULL");
    e.save(path);
  });
}

DPAR_API dpar_status dpar_engine_load(dpar_engine* engine, const char* path) {
  return with_engine(engine, [&](Engine& e) {
    DPAR_CHECK_ARG(path != nullptr, "path: is NULL");
    e.load(path);
  });
}

DPAR_API dpar_status dpar_engine_trace_start(dpar_engine* engine) {
  return with_engine(engine, [&](Engine& e) { e.trace_start(); });
}

DPAR_API dpar_status dpar_engine_trace_stop(dpar_engine* engine, const char* path) {
  return with_engine(engine, [&](Engine& e) {
    DPAR_CHECK_ARG(path == nullptr || path[0] != '\0', "path: empty (NULL only stops)");
    e.trace_stop(path ? path : "");
  });
}

DPAR_API dpar_status dpar_engine_inject_fault(dpar_engine* engine, size_t replica, int32_t fault) {
  return with_engine(engine, [&](Engine& e) {
    replica_arg(e, replica);
    e.inject_fault(replica, checked_fault(fault, "fault"));
  });
}

}  // extern "C"

DPAR_API dpar_status dpar_engine_set_precision(dpar_engine* engine, int32_t compute_dtype) {
  return with_engine(engine, [&](Engine& e) {
    DPAR_CHECK_ARG(compute_dtype == DPAR_F32 || compute_dtype == DPAR_BF16 || compute_dtype == DPAR_F16,
                   "compute_dtype: ", compute_dtype,
                   " is not a compute dtype (DPAR_F32 = 0, DPAR_BF16 = 2, DPAR_F16 = 3)");
    e.set_compute_dtype(static_cast<DType>(compute_dtype));
  });
}

DPAR_API dpar_status dpar_engine_precision(int32_t* out, const dpar_engine* engine) {
  return with_engine(engine, [&](Engine& e) { *checked_out(out) = static_cast<int32_t>(e.compute_dtype()); });
}

DPAR_API dpar_status dpar_engine_set_reduce_dtype(dpar_engine* engine, int32_t dtype) {
  return with_engine(engine, [&](Engine& e) {
    DPAR_CHECK_ARG(dtype == DPAR_F32 || dtype == DPAR_BF16, "reduce_dtype: ", dtype,
                   " is not a reduce dtype (DPAR_F32 = 0, DPAR_BF16 = 2)");
    e.set_reduce_dtype(static_cast<DType>(dtype));
  });
}

DPAR_API dpar_status dpar_engine_reduce_dtype(int32_t* out, const dpar_engine* engine) {
  return with_engine(engine, [&](Engine& e) { *checked_out(out) = static_cast<int32_t>(e.reduce_dtype()); });
}

DPAR_API dpar_status dpar_engine_set_reproducible(dpar_engine* engine, int64_t micro_chunk_rows) {
  return with_engine(engine, [&](Engine& e) { e.set_reproducible(micro_chunk_rows); });
}

DPAR_API dpar_status dpar_engine_reproducible(int64_t* out, const dpar_engine* engine) {
  return with_engine(engine, [&](Engine& e) { *checked_out(out) = e.reproducible(); });
}

DPAR_API dpar_status dpar_engine_set_allow_tf32(dpar_engine* engine, int32_t allow, int32_t* has_tf32) {
  return with_engine(engine, [&](Engine& e) {
    DPAR_CHECK_ARG(allow == 0 || allow == 1, "allow: ", allow, " is neither 0 (strict f32) nor 1 (TF32 allowed)");
    const bool has = e.set_allow_tf32(allow == 1);
    if (has_tf32) *has_tf32 = has ? 1 : 0;
  });
}
