// The DataParallel engine: one worker thread per device, each with a persistent replica of the model.
//
// A batch is split as torch.nn.DataParallel splits it (split_batch). The fused training step runs forward, loss
// and backward on every replica and moves only gradients: each replica's gradient is that of the SUM of its rows'
// losses, the all-reduce adds them and scales by 1/N, N the samples of the whole batch (its rows; for
// cross-entropy its targets that are not ignored, counted on the host), so the result is the gradient of the mean
// loss over the whole batch whatever the chunk sizes and wherever the ignored targets lie. Then every replica gets the same optimizer step: each worker computes it
// for its shard of the parameters and writes the shard into every replica, so the replicas stay bit-identical
// for 1/R of the optimizer's work per worker (R replicas; of every process, below).
//
// Gradients move in buckets (src/reducer): backward marks each layer's gradients ready as it finishes the layer,
// and a bucket is all-reduced on the replica's communication thread while backward computes the earlier layers.
//
// Several processes (mpirun -np P): each runs this engine over its own devices, and `processes` connects them,
// one participant per process. A bucket is reduced hierarchically: summed among the process's replicas (threads,
// shared memory; on GPUs NCCL or dpar's device reduction), then replica 0 sums it across the processes (MPI; NCCL
// between the processes' GPUs where each process has a GPU of its own), then the result is shared back to the
// other replicas. Each process feeds its own part of the global batch; the gradient is that of the mean loss over the
// global batch, so P processes of n devices train exactly as one process of P*n devices. Only rank 0 writes
// checkpoints, and a checkpoint that rank 0 reads is broadcast to the others.
//
// Under the reduce-scatter (ZeRO-2) and the all-reduce with world shards (GradientReduction), the optimizer is
// sharded over every replica of every process (ZeRO over the world) where every process has the same number of
// replicas: replica r of process p steps, and holds the optimizer's state for, sub-block p of block r of every
// bucket (world_block, collectives/replica_set.h), 1/(P*n) of the whole; the all-gather that puts the shards
// together crosses the processes on each replica index's own link. Under the default all-reduce, for processes of
// different replica counts, and for MPI initialised by a program below MPI_THREAD_MULTIPLE with several replicas a
// process (the links of two indices would be used at once), the shards stay within each process (each process
// holds the whole optimizer state, in n shards). The per-index links are made at creation wherever the processes
// allow them, whatever the reduction, so that set_gradient_reduction() can move the shards later.
#pragma once

#include <atomic>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "collectives/replica_set.h"
#include "device/worker_pool.h"
#include "engine/loss_scaler.h"
#include "common/trace.h"
#include "nn/loss.h"
#include "nn/model.h"
#include "optim/optimizer.h"
#include "reducer/reducer.h"

namespace dpar {

// Rows per device for a batch of `batch` rows over `devices` devices: chunks of ceil(batch/devices), the last
// smaller, and devices past the last row get 0 (10 over 8 is 2,2,2,2,2,0,0,0), as torch.nn.DataParallel does.
std::vector<int64_t> split_batch(int64_t batch, size_t devices);

// How gradient buckets cross the processes (DDP's bf16_compress_hook, Horovod's compression): within a process
// they are always summed in f32.
enum class GradientCompression : int32_t {
  kNone = 0,
  // The process's sum, rounded to bfloat16, summed across the processes in bfloat16 and widened back: half the
  // bytes between processes, f32's range, about 3 significant digits.
  kBf16 = 1,
};

// How each bucket of summed gradients reaches the replicas, whose optimizers each step their shard of the
// parameters before an all-gather puts the shards together; it also chooses where the shards lie across the
// processes (above). With one process the three have the same shards (block r of every bucket).
enum class GradientReduction : int32_t {
  // Every replica receives the whole sum (all-reduce, as DDP); the shards stay within each process (block r of
  // every bucket among its n replicas: each process holds the whole optimizer state, in n shards), so that only
  // the all-reduce crosses the processes: DDP's bytes. Clipping's norm is computed whole on every replica.
  kAllReduce = 0,
  // Each replica receives only its shard of each bucket (reduce-scatter: ZeRO-2), the shards spanning the
  // processes where the links allow (its world block: 1/R of the optimizer state), the reduce-scatter and the
  // all-gather hierarchical over the processes (ReplicaSet::reduce_scatter_sum); clipping's norm is the sum of the
  // shards' (one scalar summed over every replica holding a shard). Where the shards stay within each process
  // (processes of different replica counts) a bucket is summed whole across the processes.
  kReduceScatter = 1,
  // The all-reduce, with the shards spanning the processes where the links allow (ZeRO-1 over the world): each
  // replica steps its world block, and the parameters' all-gather crosses the processes. It holds 1/R of the
  // optimizer state as kReduceScatter does, but moves about 1.5x the bytes between processes (the all-reduce's
  // 2(P-1)/P of the gradient and the all-gather's (P-1)/P of the parameters), where kReduceScatter moves the
  // all-reduce's. Where the shards cannot span the processes, kAllReduce.
  kAllReduceWorldShards = 2,
};

struct EngineConfig {
  std::vector<Device> devices;  // replica r runs on devices[r]; all of one kind
  size_t output_replica = 0;    // forward() gathers on this replica's device
  LossKind loss = LossKind::kCrossEntropy;
  uint64_t seed = 0;
  double timeout_seconds = 300.0;
  // How long creation waits for the other processes (their engines' creation collectives: replica counts,
  // parameters, buffers), which start at different times; 0: timeout_seconds. With it, `processes` was created with
  // this timeout, and the engine sets it to timeout_seconds once it is created.
  double create_timeout_seconds = 0.0;
  int32_t blas_threads = 1;
  bool pin_workers = true;
  BucketOptions buckets;
  GradientReduction reduction = GradientReduction::kAllReduce;
  // Whether the optimizer's shards may span every process where every process has as many replicas (ZeRO over
  // the world, above; under kReduceScatter and kAllReduceWorldShards); false keeps them within each process
  // whatever the reduction (each holds the whole state among its replicas, and a bucket is summed whole across the
  // processes): for comparisons (bench_zero_world, tests).
  bool shard_across_processes = true;
  // One participant per process (rank = this process), or null for a single process. Every process creates its
  // engine, and then calls the same operations in the same order.
  std::shared_ptr<Communicator> processes;
};

class Engine {
 public:
  using ForwardHook = std::function<void(size_t replica, const Shape& input, const Shape& output)>;

  Engine(const Model& model, const OptimizerConfig& optimizer, EngineConfig config);
  ~Engine();

  size_t num_replicas() const { return replicas_.size(); }
  // This process's rank and the number of processes (0 and 1 without `processes`).
  int process_rank() const { return processes_ ? processes_->rank() : 0; }
  int num_processes() const { return processes_ ? processes_->size() : 1; }
  size_t num_buckets() const { return replicas_[0]->reducer->num_buckets(); }
  // How buckets cross the processes: "" with one process, else "mpi", "nccl", or "mpi through host memory (why
  // not NCCL)".
  const std::string& process_transport() const { return replicas_[0]->set->process_transport(); }
  // The bucket strategy the replicas' reducers use now ("flat", "hierarchical", "hierarchical bf16", ...).
  const char* bucket_strategy() const { return replicas_[0]->reducer->strategy().name(); }
  Device replica_device(size_t r) const { return replicas_[r]->ctx.device; }
  // The bytes of dpar's tensors replica r's device holds now and its peak (tensor.h's memory_stats): the device's
  // count, shared with every other replica or engine on that device. The peak runs from the process's start or the
  // device's last reset, as torch.cuda's: creating an engine resets nothing, so that it leaves other engines'
  // measurements alone.
  MemoryStats memory_stats(size_t r) const { return dpar::memory_stats(replica_device(r)); }
  // Starts replica r's device's peak again from what it holds now (for every engine on that device).
  void reset_peak_memory(size_t r) const { dpar::reset_peak_memory(replica_device(r)); }
  const Model& model() const { return model_; }

  // Returns the mean loss over the batch's samples (over the global batch: every process's rows, with several
  // processes). A batch whose cross-entropy targets are all ignored has no samples: its loss is NaN (0/0, as
  // PyTorch's), and its gradient zero (not PyTorch's NaN), so the optimizer still steps but no weight is poisoned.
  double train_step(const Tensor& input, const Tensor& target);
  double accumulate(const Tensor& input, const Tensor& target);
  void step();
  void zero_grad();
  Tensor forward(const Tensor& input);
  void backward(const Tensor& grad_output);

  void set_training(bool training);
  // From the next step on. Every process must set the same: the processes' collectives compare their element
  // types, so a process that differs makes the step fail with MISMATCH on all of them. No effect on one process.
  void set_gradient_compression(GradientCompression compression);
  // From the next step on. Every process sets the same, at the same point: where the new reduction's shards lie
  // otherwise across the processes (GradientReduction), the optimizer's state is gathered and cut along the new
  // shards (a collective; INVALID_STATE while gradients are pending). Anything else throws INVALID_ARGUMENT.
  void set_gradient_reduction(GradientReduction reduction);
  // The dtype gradient buckets are reduced in, from the next step on (FSDP's MixedPrecisionPolicy.reduce_dtype):
  // f32 (the default: summed in f32 within a process, across processes as set_gradient_compression says) or bf16
  // (every replica's bucket rounded to bf16 and the whole reduction carried in bf16, within the process and across
  // the processes whatever the compression says; ReplicaSet::all_reduce_sum_bf16), the result widened to f32 for
  // clipping and the optimizer. Any gradient reduction. The compression setting is kept and applies again once
  // the reduce dtype is f32. Anything else throws INVALID_ARGUMENT; bf16 over processes whose link does not move it
  // throws NOT_SUPPORTED; both change nothing. Every process sets the same.
  void set_reduce_dtype(DType dtype);
  DType reduce_dtype() const { return reduce_dtype_; }
  // The reproducible mode (engine/reproducible.cpp): with micro_chunk_rows > 0, train_step (and accumulate, whose
  // micro-chunks step() sums) cuts each process's batch into micro-chunks of that many rows (its last one shorter),
  // gives every replica whole micro-chunks (split_batch over the micro-chunk count), runs forward and backward once
  // per micro-chunk and sums the micro-chunks' gradients exactly (int64 fixed point), so that the same seed and the
  // same global batches give the same bits on any number of devices and processes. 0 turns it off (the default).
  // Throws INVALID_ARGUMENT for a negative count, INVALID_STATE while gradients are pending, NOT_SUPPORTED on GPUs
  // and for a model whose layers keep batch statistics (BatchNorm, SyncBatchNorm), changing nothing; backward()
  // throws NOT_SUPPORTED while it is on.
  void set_reproducible(int64_t micro_chunk_rows);
  int64_t reproducible() const { return micro_chunk_rows_; }
  void set_lr(float lr);
  // Mixed precision, as torch.autocast's policy: from the next call on, linear layers and convolutions compute on
  // `dtype` operands (bf16: the input rounded to bf16 and each step's bf16 copy of the weights, f32 accumulation)
  // and write f32; master parameters, their gradients, the optimizer, checkpoints and every other layer stay f32.
  // f32 (the default) or bf16; throws Error(NOT_SUPPORTED) naming the first node whose kernel the devices lack,
  // changing nothing. Every process sets the same. (engine/precision.cpp)
  void set_compute_dtype(DType dtype);
  DType compute_dtype() const { return compute_dtype_; }
  // Lets the replicas' f32 GEMMs and convolutions use TF32 where their devices have it (off by default, as in
  // PyTorch); returns whether they have it (CPU: false, nothing changes).
  bool set_allow_tf32(bool allow);
  // Clips the gradient of the following steps to this global L2 norm (OptimizerConfig::max_grad_norm); 0: off.
  void set_max_grad_norm(float max_norm);
  // From the next step on: true steps the parameters that do not decay (ParamInfo::decays: biases, norms' scales
  // and shifts) with weight_decay 0, as two PyTorch parameter groups; false (the default): all decay alike.
  void set_weight_decay_exclusion(bool exclude_biases_and_norms);
  bool weight_decay_exclusion() const { return exclude_no_decay_; }
  // Dynamic loss scaling from the next step on (torch.amp.GradScaler; LossScaling::init_scale 0: off, the default):
  // the loss's gradient (train_step, accumulate) and backward()'s grad_output are multiplied by the scale, the
  // summed gradient is checked for inf and NaN once reduced, and a step whose gradient holds one is skipped (no
  // optimizer step: parameters, optimizer state and step_count() unchanged) and backs the scale off; otherwise
  // the gradient is unscaled before clipping and the step. Starts over from init_scale. Every process sets the same.
  void set_loss_scaling(const LossScaling& settings);
  const LossScaler& loss_scaler() const { return scaler_; }
  // The gradient's norm before clipping at the last step taken with clipping on; NaN before any.
  float grad_norm() const { return grad_norm_; }
  // Each replica's own computation of that norm (the same bits on every replica, or the shards would be scaled
  // apart): for tests.
  std::vector<float> replica_grad_norms() const;
  // Bytes of optimizer state each replica holds, for tests (its shard's: 1/R of the whole, R the replicas of every
  // process where the shards span them).
  std::vector<size_t> replica_optimizer_state_bytes() const;
  int64_t step_count() const;
  std::vector<float> replica_losses() const;
  std::vector<float> params(size_t replica) const;
  // Buffer `index` of model().buffers() on a replica, into dst (buffer_numel elements of its dtype: float or
  // int64_t). Every replica holds replica 0's after every training-mode call (sync_buffers).
  void read_buffer(void* dst, size_t replica, size_t index) const;
  void set_forward_hook(ForwardHook hook);
  void inject_fault(size_t replica, Fault fault);

  void save(const std::string& path) const;
  void load(const std::string& path);

  // A timeline of the engine's calls from now on (common/trace.h): forgets one recorded before.
  void trace_start();
  // Stops recording and writes the timeline to `path` (Chrome's trace event format), atomically; an empty path
  // only stops. What was recorded stays until the next trace_start(), so a failed write may be tried again.
  void trace_stop(const std::string& path);

  // Aborts the call in flight, if any, and every later call. Thread-safe without the engine's lock. `by` names
  // the call that aborted it (static storage), so that every later message tells the caller what to look for.
  void abort(const char* by);

  // Held by the C ABI around every call: an engine serialises its callers.
  std::mutex& mutex() { return mutex_; }
  // True on one of this engine's worker threads, inside one of its callbacks: the caller of the call in flight
  // holds the lock and waits for this thread, so a call into the engine from here would wait forever.
  bool on_own_worker() const { return pool_ && pool_->on_own_thread(); }

 private:
  struct Replica {
    ReplicaContext ctx;
    std::unique_ptr<Stream> stream;  // the replica's kernels and ordered copies (ctx.stream)
    std::unique_ptr<ReplicaModel> model;
    std::unique_ptr<Optimizer> optimizer;
    std::unique_ptr<Communicator> comm;  // among this process's replicas
    std::unique_ptr<ReplicaSet> set;     // over every replica of every process (through `comm` and the processes)
    std::unique_ptr<Reducer> reducer;    // the gradient buckets, reduced through `set`
    uint64_t rng_offset = 0;
    Fault fault = Fault::kNone;
    bool has_grad = false;  // local gradients hold something since the last step
    bool stepped = false;   // this call applied the optimizer (tells whether a failure left replicas apart)
    bool skipped = false;   // this call's step was skipped: its scaled gradient held inf or NaN (loss scaling)
    double loss_sum = 0.0;
    Tensor loss_sum_device;  // where the loss kernel writes the sum (a double) on the replica's device
    Tensor norm_partial;     // a double on the replica's device: its shard's part of the gradient's squared norm
    // The replica's rows of a host batch (input, target, backward()'s grad_output) on a device that is not the host.
    Tensor input_stage, target_stage, grad_stage;
    int64_t rows = 0;       // rows of the current call
    int64_t loss_rows = 0;  // rows behind loss_sum (the last training step or accumulate)
    int64_t loss_samples = 0;  // samples of those rows (targets not ignored): replica_losses divides by them
    float grad_norm = std::numeric_limits<float>::quiet_NaN();  // the gradient's norm at this call's clipping
    // What a training-mode call changes besides gradients (the RNG stream's position, the buffers), saved at its
    // start (save_state) and put back when it fails and the engine stays usable: a failed call changes nothing.
    uint64_t saved_rng_offset = 0;
    Tensor saved_buffers;     // the f32 buffers, then the i64 ones (as pairs of f32 words); made with the replica
    bool state_saved = false;  // this call saved its state
  };
  enum class Pending { kNone, kLoss, kExplicit };

  // Rows [begin, begin + rows) of a batch tensor on the replica's device: a view where the tensor is the replica's
  // memory already, a copy into the replica's staging buffer `stage` elsewhere (from the host, or from another
  // device of the replica's kind).
  Tensor on_replica(Replica& rep, const Tensor& whole, int64_t begin, int64_t rows, Tensor& stage);
  // A batch tensor (`what`: input, target, grad_output) must be host memory or memory of the replicas' kind.
  void check_reachable(const Tensor& t, const char* what, const char* operation) const;
  // The input's dtype must be the model's (Model::input_dtype: i32 for a model read by an Embedding).
  void check_input_dtype(const Tensor& input, const char* operation) const;
  // An i32 input's values, checked on the host by the nodes that read it (an index out of range) before a step.
  void check_input_values(const Tensor& input, const char* operation) const;
  // Checks input (and target) against the model; returns the output shape for the whole batch. With a target,
  // *row_samples receives the loss's samples in each row of the batch (check_loss_target).
  Shape check_batch(const Tensor& input, const Tensor* target, const char* operation,
                    std::vector<int64_t>* row_samples = nullptr) const;
  // Runs job on every replica's worker; on failure restores a usable state (or marks the engine broken) and
  // throws the first failure that is not merely "another replica failed".
  void run(const char* operation, const std::function<void(Replica&, size_t)>& job);
  void check_usable(const char* operation) const;
  // Saves what the call may change besides gradients (Replica::saved_*), on the replica's worker.
  void save_state(Replica& rep);
  // Puts back every replica's saved state after a failed call; false if a replica could not.
  bool restore_state();
  // The checks of a training-mode call with a batch of `input` (its rows split over the replicas) that every
  // replica must pass before any changes state: each layer's statistics (Model::check_training_batch). With
  // several processes the layers whose statistics span every process are checked once the global batch is known
  // (check_global_statistics), alike on every process.
  void check_statistics(const Tensor& input) const;
  void check_global_statistics(const Tensor& input, int64_t global_batch) const;
  // Forward on rows [begin, begin+rows) of input, loss and backward: the worker's half of accumulate. `samples`:
  // the loss's samples in those rows. With `reduce`, each layer's gradients go to the reducer as soon as backward
  // has computed them.
  void local_loss_backward(Replica& rep, const Tensor& input, const Tensor& target, int64_t begin, int64_t samples,
                           bool reduce);
  // The bucket strategy for the engine's settings (hierarchical, in bf16 across processes when compressed).
  std::unique_ptr<BucketStrategy> bucket_strategy_for(Replica& rep) const;
  // Makes these the settings and gives every reducer its strategy for them; all or nothing.
  void set_strategies(GradientCompression compression, GradientReduction reduction, DType reduce_dtype);
  // Copies the replica's loss sum of its last rows from its device into rep.loss_sum.
  void read_loss(Replica& rep);
  // Scales the replica's shard of the summed gradient so that the gradient's global L2 norm is at most the
  // optimizer's max_grad_norm.
  void clip_gradient(Replica& rep);
  // After a step that succeeded: the norm its clipping saw becomes grad_norm().
  void publish_grad_norm();
  // Loss scaling (loss_scaling.cpp). Whether the replica's reduced gradient is finite, from its shard's sum of
  // squares summed over every replica holding a shard (ReplicaSet::sum_over_shards), so that every replica of every
  // process takes the same decision; if it is, multiplies what the replica holds of it by 1/scale
  // (GradScaler.unscale_).
  bool unscale_finite_gradient(Replica& rep);
  // backward()'s grad_output rows on the replica multiplied by the loss scale, in the replica's staging buffer
  // (never in the caller's memory).
  Tensor scaled_grad_output(Replica& rep, const Tensor& dout);
  // After a step that succeeded: tells the scaler whether it was skipped.
  void update_loss_scale();
  // Finishes the reduction of the step's gradients (scaled as the reducer was prepared) and applies the optimizer;
  // with `reduced`, the gradients hold the reduced sum already (the reproducible mode) and the reducer is not used.
  void finish_and_step(Replica& rep, bool reduced = false);
  // The reproducible mode (engine/reproducible.cpp): train_step, accumulate and step; a call's micro-chunks
  // (reproducible_call: its checks and the micro-chunks' numbering), their forward and backward on a replica, keeping
  // their gradients, and the exact sum of the step's kept gradients into the replica's gradients, times 1 / samples
  // (last_in_place: the replica's last micro-chunk's gradient is still in its gradients).
  struct ChunkCall;
  double reproducible_train_step(const Tensor& input, const Tensor& target);
  double reproducible_accumulate(const Tensor& input, const Tensor& target);
  void reproducible_step();
  ChunkCall reproducible_call(const char* operation, const Tensor& input, const Tensor& target, bool accumulating);
  void reproducible_backward(Replica& rep, size_t r, const ChunkCall& call);
  void reproducible_reduce(Replica& rep, size_t r, int64_t global_chunks, int64_t samples, bool last_in_place);
  double reproducible_loss(const char* operation, const ChunkCall& call);
  // The layers' running statistics (BatchNorm's, deferred in the mode): every micro-chunk's of the call, told to
  // every replica of every process at its global index and folded into each replica's buffers in that order.
  void fold_running_statistics(Replica& rep, size_t r, const ChunkCall& call);
  // The nodes whose layers keep running statistics, and where each one's lie in a micro-chunk's record.
  struct StatisticsNode {
    size_t node, offset, size;
  };
  std::vector<StatisticsNode> statistics_nodes() const;
  // `count` elements of `dtype` at `data` (host memory) reduced with `op` over every replica of every process, into
  // every replica's buffer: among the process's replicas, across the processes by replica 0, then broadcast back.
  void reduce_over_all(Replica& rep, void* data, size_t count, DType dtype, ReduceOp op);
  // A batch's rows, and the samples its loss's mean divides by (rows, or cross-entropy's targets not ignored).
  struct BatchCount {
    int64_t rows = 0, samples = 0;
  };
  // Runs `check` (the call's argument and state checks, returning this process's batch) and returns the global
  // batch: the sums over the processes. If any process's check throws, every process throws (the one that refused
  // its own error, the others REMOTE naming it), so that none is left waiting.
  BatchCount global_batch_of(const char* operation, const std::function<BatchCount()>& check);
  // The sum of `value` (int64_t or double) over the processes (itself with one process).
  template <class T>
  T sum_over_processes(T value, const char* operation);
  // Rank 0's outcome of an operation it alone performed, told to every process: rethrown on rank 0, reported as
  // rank 0's failure elsewhere.
  void share_outcome(const char* operation, std::exception_ptr error) const;
  // Every state of the optimizer (Optimizer::state_names' order) over every parameter element, put together from
  // every replica's shard (of every process: collective over the processes, every process getting them all).
  std::vector<std::vector<float>> gather_optimizer_state() const;
  // The replica's optimizer state for its shard, from every state's values over every parameter: values(s, p) is
  // state s (state_names' order) of parameter p, f32, maybe unaligned. Checkpoint loading and a change of shards.
  void load_optimizer_shard(Replica& rep, const std::function<const uint8_t*(size_t, const ParamInfo&)>& values);
  // Whether the optimizer's shards span the processes under `reduction` (where the replica sets' links allow).
  bool world_shards(GradientReduction reduction) const;
  void write_checkpoint(const std::string& path, const std::vector<std::vector<float>>& optimizer_state) const;
  // The elements of the flat parameters whose optimizer step the replica computes and whose optimizer state it
  // holds: its shard of every gradient bucket (ReplicaSet::shard_of; made once its reducer exists). The last
  // replicas' shards of a small bucket may be empty.
  std::vector<ElementRange> optimizer_shard(const Replica& rep) const;
  bool exclude_no_decay_ = false;
  LossScaler scaler_;
  // Makes every replica's buffers (BatchNorm's running statistics) replica 0's of process 0, as DataParallel keeps
  // replica 0's and DistributedDataParallel broadcasts rank 0's: a broadcast over the replica set, each dtype as
  // itself. Every replica calls it at the end of every training-mode call that ran forward; nothing
  // for a model without buffers.
  void sync_buffers(Replica& rep);
  // The mean loss of the last step or micro-batch over the global batch's `global_samples` (NaN for none).
  double finish_loss(const char* operation, int64_t global_samples);

  Model model_;
  EngineConfig config_;
  Backend& backend_;
  // Before the replicas: a replica's communicator belongs to the group, which must outlive it (members are
  // destroyed in reverse order, also when the constructor throws).
  std::unique_ptr<Group> group_;
  std::vector<std::unique_ptr<Replica>> replicas_;
  std::shared_ptr<Communicator> processes_;
  // What the replica sets cross the processes with (processes_, and replica 0's link for its device's memory from
  // Backend::link_processes); null with one process.
  std::shared_ptr<ProcessLinks> links_;
  GradientCompression compression_ = GradientCompression::kNone;
  DType reduce_dtype_ = DType::kF32;
  DType compute_dtype_ = DType::kF32;
  GradientReduction reduction_ = GradientReduction::kAllReduce;
  // The reproducible mode: rows per micro-chunk (0: off); per replica, on its device: room for the step's
  // micro-chunks' gradients (one after the other, but for train_step's last, which stays in its gradients; kept
  // from step to step, grown as needed) and how many it holds, a micro-chunk's largest exponent per parameter
  // (one i64 per parameter tensor) and the int64 sums; on the host, the step's largest exponent per parameter
  // (folded from each micro-chunk's, then agreed over the replicas); per micro-chunk of the call on this process,
  // its loss sum; the step's micro-chunks over every process so far (accumulate).
  int64_t micro_chunk_rows_ = 0;
  std::vector<Tensor> chunk_grads_;
  std::vector<int64_t> chunk_kept_;
  std::vector<Tensor> chunk_exponents_device_;
  std::vector<std::vector<int64_t>> chunk_exponents_;
  std::vector<Tensor> chunk_sums_;
  int64_t step_chunks_ = 0;
  std::vector<double> chunk_losses_;
  std::vector<std::vector<double>> chunk_statistics_;  // per replica: the call's micro-chunks' running statistics
  std::vector<std::vector<size_t>> node_params_;  // per node, the parameters ready after its backward
  // A layer calls the replica set's collectives: a replica given no rows of a batch runs forward and backward too
  // (on an empty chunk), so that it takes part in them.
  bool every_replica_runs_ = false;
  std::unique_ptr<WorkerPool> pool_;
  std::mutex mutex_;
  ForwardHook hook_;
  bool training_ = true;
  float grad_norm_ = std::numeric_limits<float>::quiet_NaN();
  bool broken_ = false;
  std::atomic<bool> aborted_{false};  // set by abort() from any thread
  std::atomic<const char*> aborted_by_{"abort"};  // abort()'s `by`, stored before aborted_
  std::string broken_reason_;
  Pending pending_ = Pending::kNone;
  int64_t pending_samples_ = 0;  // the global samples of the accumulated micro-batches: step() divides by them
  std::vector<int64_t> forward_split_;  // chunk rows of the last training-mode forward
  Shape forward_output_shape_;
  // Track 0: the calling thread; replica r's worker on track 1 + 2r, its communication thread on 2 + 2r.
  std::unique_ptr<Trace> trace_;
  static constexpr size_t kCallTrack = 0;
  static size_t worker_track(size_t replica) { return 1 + 2 * replica; }
  static size_t comm_track(size_t replica) { return 2 + 2 * replica; }
};

}  // namespace dpar
