// The reproducible mode (Engine::set_reproducible): the same seed and the same global batches give the same bits
// on any number of devices and processes.
//
// What differs between device counts in the default mode, and what this mode does about each:
//  - The rows each forward sees: a replica's chunk is batch / devices rows, so the kernels see other shapes (and a
//    GEMM may split its work otherwise). Here every process's batch is cut into micro-chunks of a fixed number of
//    rows, whatever the device count; a replica holds whole micro-chunks and runs forward and backward once per
//    micro-chunk, so micro-chunk c meets the same kernels on the same shapes wherever it runs. The GEMM's thread
//    count is the engine's blas_threads per worker, which does not follow the device count either.
//  - The order in which the replicas' gradients are added. Here they are not added as floats at all: each
//    micro-chunk's f32 gradient is kept; the replicas agree on a max exponent E per parameter (one max all-reduce
//    of an int64 per parameter tensor); each micro-chunk's gradient is put on the grid 2^(E - 51 + ceil(log2 K)),
//    K the global micro-chunk count, as int64 (the kernel calls MaxExponent, ToGrid and FromGrid of
//    backend/kernel_calls.h, run by the replica's Stream on its device: rounded to nearest even, a function of the
//    value alone), so that every value and any sum of K of them stays below 2^51; the int64s are summed over the
//    micro-chunks, the replicas and the processes (exact, so in any order and grouping), and the sum is turned back
//    to f32: converted to double (exact: below 2^53), multiplied by the grid step / samples (that factor
//    rounded once, in double), rounded to f32. Relative to the largest micro-chunk gradient of the parameter tensor,
//    the grid keeps 51 - ceil(log2 K) bits, against f32's 24: an element up to 2^20 times smaller than the largest
//    (with up to 128 micro-chunks) still gets f32's precision, and smaller ones an absolute error of at most K/2
//    grid steps (2^-38 of 2^E with 128 micro-chunks). 51 bits rather than 62: rounding to the grid is then one double
//    addition, which vectorises (no x86 before AVX-512DQ converts doubles to int64 in vectors), and the sum converts
//    back exactly. A non-finite value (loss scaling's overflow) makes the parameter's whole gradient NaN, so that
//    loss scaling sees it and skips the step.
//  - Where an element lies in a replica's optimizer shard (vector body or scalar tail): the elementwise kernels are
//    built without FMA contraction (-ffp-contract=off), so an element's bits do not depend on its position. The
//    clipping norm is computed over the whole reduced gradient, which every replica holds here: the mode requires
//    the all-reduce gradient reduction.
//  - The loss: each micro-chunk's loss sum (a double) is kept, told to every process at its global index (a sum in
//    which every index has one non-zero term, so exact), and the sums added in micro-chunk order.
//  - Dropout: micro-chunk c of the step whose optimizer step count is s draws from the stream
//    derive_seed(derive_seed(seed ^ tag, s), c) from offset 0, whatever replica runs it.
//  - Batch statistics: BatchNorm normalises over the rows of one forward, here a micro-chunk's (ghost batch
//    normalisation: the same rows on any device count); its running statistics, which a forward moves, are moved
//    instead by every micro-chunk's statistics in micro-chunk order on every replica (fold_running_statistics), as
//    micro-batches run one after another on one device would move them. SyncBatchNorm (statistics summed over the
//    replicas in an order that follows them) is refused.
//
// Processes: micro-chunks are numbered across the processes in rank order; each process cuts its own rows, so a
// job of processes whose parts (but the last's) are whole numbers of micro-chunks gives the bits of one process
// that holds the whole batch.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "backend/stream.h"
#include "common/error.h"
#include "common/fixed_point.h"
#include "common/random.h"
#include "engine/engine.h"

namespace dpar {

namespace {

// The kernels the mode runs besides the model's: the exact sum's, and the fill of a non-finite gradient with NaN.
constexpr Op kModeOps[] = {Op::kMaxExponent, Op::kToGrid, Op::kFromGrid, Op::kFill};

// Mixed into the seed of the micro-chunks' dropout streams, apart from the replicas' own streams.
constexpr uint64_t kChunkStreamTag = 0x6d6963726f636875ull;

// ceil(log2(k)) for k >= 1.
int ceil_log2(int64_t k) {
  int bits = 0;
  while ((int64_t{1} << bits) < k) ++bits;
  return bits;
}

// Restores a replica's RNG stream (seed and offset) when the micro-chunks are done, or fail.
struct RngStreamGuard {
  ReplicaContext& ctx;
  uint64_t seed, offset;
  explicit RngStreamGuard(ReplicaContext& c) : ctx(c), seed(c.rng_seed), offset(*c.rng_offset) {}
  ~RngStreamGuard() {
    ctx.rng_seed = seed;
    *ctx.rng_offset = offset;
  }
};

}  // namespace

void Engine::set_reproducible(int64_t micro_chunk_rows) {
  DPAR_CHECK_ARG(micro_chunk_rows >= 0, "micro_chunk_rows: ", micro_chunk_rows,
                 " must be >= 0 (0 turns the reproducible mode off)");
  DPAR_ENFORCE(pending_ == Pending::kNone, Status::kInvalidState, "set_reproducible: gradients from ",
               pending_ == Pending::kLoss ? "accumulate()" : "backward()",
               " are pending; call step() or zero_grad() first");
  if (micro_chunk_rows > 0) {
    // Asked of the backend rather than of the device kind: the mode runs wherever these kernels exist.
    const Stream& stream = *replicas_.front()->stream;
    for (Op op : kModeOps) {
      const KernelKey key{op, DType::kF32};
      const std::string why = stream.can_run(key) ? std::string() : stream.lacks_why(key);
      DPAR_ENFORCE(stream.can_run(key), Status::kNotSupported, "set_reproducible: the reproducible mode needs the "
                   "kernel ", key.str(), ", which ", stream.device().str(), "'s backend does not have",
                   why.empty() ? std::string() : " (" + why + ")");
    }
    for (const Node& node : model_.nodes()) {
      if (!node.layer) continue;
      // SyncBatchNorm's statistics are summed over the replicas in an order that follows them.
      DPAR_ENFORCE(!node.layer->uses_collectives(), Status::kNotSupported, "set_reproducible: node ", node.name,
                   " (", node.describe(), ") sums its statistics over the replicas, in an order that follows the "
                   "device count; in the reproducible mode use BatchNorm, which normalises over each micro-chunk "
                   "(ghost batch normalisation) and folds the micro-chunks' running statistics in order");
      // Buffers that a forward moves in a way the mode cannot defer.
      DPAR_ENFORCE(node.layer->buffer_specs().empty() || node.layer->running_statistics_size() > 0,
                   Status::kNotSupported, "set_reproducible: node ", node.name, " (", node.describe(),
                   ") keeps buffers that its forward moves, which the reproducible mode cannot order");
    }
  }
  micro_chunk_rows_ = micro_chunk_rows;
  for (auto& rep : replicas_)
    for (size_t i = 0; i < model_.nodes().size(); ++i)
      if (Layer* layer = rep->model->layer(i)) layer->defer_running_statistics(micro_chunk_rows > 0);
  if (micro_chunk_rows == 0) {
    chunk_grads_ = {};
    chunk_kept_ = {};
    chunk_exponents_device_ = {};
    chunk_sums_ = {};
    chunk_exponents_ = {};
    chunk_statistics_ = {};
  }
}

void Engine::reduce_over_all(Replica& rep, void* data, size_t count, DType dtype, ReduceOp op) {
  if (replicas_.size() > 1) rep.comm->all_reduce(data, data, count, dtype, op);
  if (!processes_) return;
  if (rep.ctx.replica == 0) {
    try {
      processes_->all_reduce(data, data, count, dtype, op);
    } catch (const std::exception& e) {
      // The process's other replicas wait for replica 0 in the broadcast below.
      rep.comm->abort(std::string("across processes: ") + e.what());
      throw;
    }
  }
  if (replicas_.size() > 1) rep.comm->broadcast(data, count, dtype, 0);
}

// What a train_step or accumulate call of the mode is about: this process's micro-chunks of its batch.
struct Engine::ChunkCall {
  const Tensor* input = nullptr;
  const Tensor* target = nullptr;
  std::vector<int64_t> row_samples;  // the loss's samples in each row
  BatchCount global;                 // the call's rows and samples over every process
  int64_t chunks = 0;                // this process's micro-chunks
  int64_t first_chunk = 0;           // the global index of the first (micro-chunks of the step's earlier calls first)
  int64_t global_chunks = 0;         // every process's micro-chunks of this call
  std::vector<int64_t> per_replica;  // micro-chunks per replica (split_batch over the micro-chunk count)
  bool keep_last_in_place = false;   // the last micro-chunk's gradient stays in the gradients (the step follows)
};

Engine::ChunkCall Engine::reproducible_call(const char* operation, const Tensor& input, const Tensor& target,
                                            bool accumulating) {
  ChunkCall call;
  call.input = &input;
  call.target = &target;
  call.global = global_batch_of(operation, [&] {
    check_batch(input, &target, operation, &call.row_samples);
    if (accumulating) {
      DPAR_ENFORCE(pending_ != Pending::kExplicit, Status::kInvalidState,
                   operation, ": gradients from backward() are pending; call step() or zero_grad() first");
    } else {
      DPAR_ENFORCE(pending_ == Pending::kNone, Status::kInvalidState, operation, ": gradients from ",
                   pending_ == Pending::kLoss ? "accumulate()" : "backward()",
                   " are pending; call step() or zero_grad() first");
    }
    DPAR_ENFORCE(reduction_ == GradientReduction::kAllReduce, Status::kNotSupported, operation,
                 ": the reproducible mode needs the all-reduce gradient reduction (its clipping norm is computed "
                 "over the whole gradient); set the all-reduce gradient reduction or turn the mode off");
    // BatchNorm sees a micro-chunk's rows: a whole one, and the last, shorter one.
    if (training_) {
      const int64_t rows = input.rows(), R = micro_chunk_rows_;
      std::vector<int64_t> sizes{std::min(R, rows)};
      if (rows > R && rows % R != 0) sizes.push_back(rows % R);
      model_.check_training_batch(input.shape(), sizes, processes_ ? 0 : rows, R);
    }
    int64_t samples = 0;
    for (int64_t s : call.row_samples) samples += s;
    return BatchCount{input.rows(), samples};
  });
  const int64_t R = micro_chunk_rows_;
  call.chunks = input.rows() / R + (input.rows() % R != 0 ? 1 : 0);  // no overflow for any R
  // The global numbering: this process's first micro-chunk, and the count over every process.
  call.global_chunks = call.chunks;
  if (processes_) {
    std::vector<int64_t> all(static_cast<size_t>(processes_->size()));
    try {
      processes_->all_gather(&call.chunks, all.data(), 1, DType::kI64);
    } catch (const Error& e) {
      broken_ = true;
      broken_reason_ = std::string(operation) + ": " + e.what();
      fail(e.status(), operation, ": across processes: ", e.what());
    }
    call.global_chunks = 0;
    for (size_t p = 0; p < all.size(); ++p) {
      if (static_cast<int>(p) < processes_->rank()) call.first_chunk += all[p];
      call.global_chunks += all[p];
    }
  }
  // A step's first call forgets what an abandoned step (zero_grad, a failure) kept.
  if (pending_ == Pending::kNone) {
    step_chunks_ = 0;
    // The device memory stays from step to step (a step of the same batch needs the same room).
    chunk_grads_.resize(replicas_.size());
    chunk_kept_.assign(replicas_.size(), 0);
    chunk_exponents_device_.resize(replicas_.size());
    chunk_exponents_.assign(replicas_.size(), std::vector<int64_t>(model_.params().size(), kFixedPointAllZero));
    chunk_sums_.resize(replicas_.size());
    chunk_statistics_.resize(replicas_.size());
  }
  call.first_chunk += step_chunks_;
  call.per_replica = split_batch(call.chunks, replicas_.size());
  call.keep_last_in_place = !accumulating;
  chunk_losses_.assign(static_cast<size_t>(call.chunks), 0.0);
  return call;
}

void Engine::reproducible_backward(Replica& rep, size_t r, const ChunkCall& call) {
  int64_t chunk_begin = 0;
  for (size_t i = 0; i < r; ++i) chunk_begin += call.per_replica[i];
  const int64_t mine = call.per_replica[r];
  const auto& params = model_.params();
  const size_t numel = static_cast<size_t>(model_.num_param_elements());
  const int64_t R = micro_chunk_rows_, rows = call.input->rows();
  const uint64_t step_seed = derive_seed(config_.seed ^ kChunkStreamTag, static_cast<uint64_t>(step_count()));
  const auto kept = static_cast<size_t>(chunk_kept_[r]);  // micro-chunks of the step's earlier calls
  const int64_t copied = call.keep_last_in_place ? std::max<int64_t>(mine - 1, 0) : mine;
  Tensor& room = chunk_grads_[r];
  const size_t held = kept + static_cast<size_t>(copied);
  const size_t room_chunks = room.defined() ? static_cast<size_t>(room.numel()) / numel : 0;
  if (held > room_chunks) {
    // At least twice the room, so that a step's accumulate() calls do not copy the kept gradients at every call.
    const size_t chunks = std::max(held, 2 * room_chunks);
    Tensor grown = rep.ctx.alloc(DType::kF32, Shape{static_cast<int64_t>(chunks), static_cast<int64_t>(numel)});
    if (kept > 0) rep.stream->copy(grown.raw(), room.raw(), kept * numel * sizeof(float));
    room = std::move(grown);
  }
  chunk_kept_[r] = static_cast<int64_t>(held);
  std::vector<int64_t>& exponent = chunk_exponents_[r];
  // A micro-chunk's largest exponent per parameter tensor, on the device, then read once per micro-chunk.
  Tensor& found_device = chunk_exponents_device_[r];
  if (!found_device.defined() || found_device.numel() != static_cast<int64_t>(params.size()))
    found_device = rep.ctx.alloc(DType::kI64, Shape{static_cast<int64_t>(params.size())});
  std::vector<int64_t> found(params.size());
  rep.loss_rows = 0;
  rep.loss_samples = 0;
  double loss_sum = 0.0;
  int64_t loss_rows = 0, loss_samples = 0;
  // The running statistics of the call's micro-chunks, at their index among the call's micro-chunks of every process.
  const std::vector<StatisticsNode> stats_nodes = training_ ? statistics_nodes() : std::vector<StatisticsNode>{};
  const size_t record = stats_nodes.empty() ? 0 : stats_nodes.back().offset + stats_nodes.back().size;
  chunk_statistics_[r].assign(static_cast<size_t>(call.global_chunks) * record, 0.0);
  {
    RngStreamGuard guard(rep.ctx);
    for (int64_t c = 0; c < mine; ++c) {
      const int64_t chunk = chunk_begin + c;
      const int64_t begin = chunk * R;
      rep.rows = std::min(R, rows - begin);
      rep.ctx.rng_seed = derive_seed(step_seed, static_cast<uint64_t>(call.first_chunk + chunk));
      rep.rng_offset = 0;
      rep.has_grad = false;  // backward overwrites the gradients: this micro-chunk's alone
      const int64_t chunk_samples = std::accumulate(call.row_samples.begin() + begin,
                                                    call.row_samples.begin() + begin + rep.rows, int64_t{0});
      local_loss_backward(rep, *call.input, *call.target, begin, chunk_samples, false);
      read_loss(rep);  // waits for the device: the loss sum is on the host
      chunk_losses_[static_cast<size_t>(chunk)] = rep.loss_sum;
      const auto index = static_cast<size_t>(call.first_chunk - step_chunks_ + chunk);
      for (const StatisticsNode& n : stats_nodes)
        rep.model->layer(n.node)->take_running_statistics(rep.ctx,
                                                          chunk_statistics_[r].data() + index * record + n.offset);
      loss_sum += rep.loss_sum;
      loss_rows += rep.rows;
      loss_samples += chunk_samples;
      // Kept for the sum, but for a step's last micro-chunk, which stays in the gradients.
      TraceSpan keep(*trace_, "micro-chunk gradient kept");
      float* const grads = rep.model->grads();
      float* dst = c < copied ? room.data<float>() + (kept + static_cast<size_t>(c)) * numel : grads;
      if (c < copied) rep.stream->copy(dst, grads, numel * sizeof(float));
      int64_t* const out = found_device.data<int64_t>();
      for (size_t p = 0; p < params.size(); ++p)
        rep.stream->run(call::MaxExponent{TensorRef::of(out + p, {1}),
                                          TensorRef::of(dst + params[p].offset, {params[p].shape.numel()})});
      rep.stream->copy_to_host(found.data(), out, found.size() * sizeof(int64_t));
      for (size_t p = 0; p < params.size(); ++p) exponent[p] = std::max(exponent[p], found[p]);
    }
  }
  rep.loss_sum = loss_sum;
  rep.loss_rows = loss_rows;
  rep.loss_samples = loss_samples;
  // The gradients hold a micro-chunk's alone: the step's sum is in the kept micro-chunks.
  rep.has_grad = false;
}

void Engine::reproducible_reduce(Replica& rep, size_t r, int64_t global_chunks, int64_t samples, bool last_in_place) {
  const auto& params = model_.params();
  const size_t numel = static_cast<size_t>(model_.num_param_elements());
  const int64_t kept = chunk_kept_[r];
  const int64_t held = kept + (last_in_place ? 1 : 0);
  const float* const partials = kept > 0 ? chunk_grads_[r].data<float>() : nullptr;
  std::vector<int64_t>& exponent = chunk_exponents_[r];
  Tensor& sum_tensor = chunk_sums_[r];
  if (!sum_tensor.defined() || sum_tensor.numel() != static_cast<int64_t>(numel))
    sum_tensor = rep.ctx.alloc(DType::kI64, Shape{static_cast<int64_t>(numel)});
  int64_t* const sum = sum_tensor.data<int64_t>();
  const int grid_bits = kFixedPointBits - ceil_log2(std::max<int64_t>(global_chunks, 1));
  {
    TraceSpan agree(*trace_, "gradient exponents max");
    reduce_over_all(rep, exponent.data(), exponent.size(), DType::kI64, ReduceOp::kMax);
  }
  // Each micro-chunk's gradient on its parameter's grid, summed exactly.
  {
    TraceSpan fixed(*trace_, "gradients to fixed point");
    for (size_t p = 0; p < params.size(); ++p) {
      const auto begin = static_cast<size_t>(params[p].offset);
      const int64_t count = params[p].shape.numel();
      if (held == 0 || exponent[p] == kFixedPointAllZero || exponent[p] == kFixedPointNotFinite) {
        rep.stream->fill_zero(sum + begin, static_cast<size_t>(count) * sizeof(int64_t));
        continue;
      }
      // value * 2^(grid_bits - E) is below 2^grid_bits in magnitude: K of them stay below 2^51.
      const int down = grid_bits - static_cast<int>(exponent[p]);
      // In blocks whose sums stay in the cache while every micro-chunk is added to them.
      constexpr int64_t kBlock = 4096;
      for (int64_t from = 0; from < count; from += kBlock) {
        const int64_t n = std::min(kBlock, count - from);
        for (int64_t c = 0; c < held; ++c) {
          const float* g = c < kept ? partials + static_cast<size_t>(c) * numel : rep.model->grads();
          rep.stream->run(call::ToGrid{TensorRef::of(sum + begin + from, {n}), TensorRef::of(g + begin + from, {n}),
                                       down, c > 0});
        }
      }
    }
  }
  {
    TraceSpan exact(*trace_, "gradients exact sum", "elements", static_cast<int64_t>(numel));
    // Device memory, as the gradients the replicas' communicator sums in the default mode.
    reduce_over_all(rep, sum, numel, DType::kI64, ReduceOp::kSum);
  }
  // Back to f32, into the gradients: the exact sum (exact in double: below 2^53) times the grid
  // step / samples (that factor rounded once, in double), rounded to f32, on every replica of every job alike.
  TraceSpan back(*trace_, "gradients from fixed point");
  float* grad = rep.model->grads();
  for (size_t p = 0; p < params.size(); ++p) {
    const auto begin = static_cast<size_t>(params[p].offset);
    const int64_t count = params[p].shape.numel();
    const TensorRef out = TensorRef::of(grad + begin, {count});
    if (exponent[p] == kFixedPointNotFinite) {
      rep.stream->run(call::Fill{out, std::numeric_limits<float>::quiet_NaN()});
      continue;
    }
    const double factor =
        samples > 0 ? std::ldexp(1.0, static_cast<int>(exponent[p]) - grid_bits) / static_cast<double>(samples) : 0.0;
    rep.stream->run(call::FromGrid{out, TensorRef::of(sum + begin, {count}), factor});
  }
  rep.has_grad = true;
}

std::vector<Engine::StatisticsNode> Engine::statistics_nodes() const {
  std::vector<StatisticsNode> out;
  size_t offset = 0;
  for (size_t i = 0; i < model_.nodes().size(); ++i)
    if (const Layer* layer = model_.nodes()[i].layer.get(); layer && layer->running_statistics_size() > 0) {
      out.push_back({i, offset, layer->running_statistics_size()});
      offset += layer->running_statistics_size();
    }
  return out;
}

void Engine::fold_running_statistics(Replica& rep, size_t r, const ChunkCall& call) {
  const std::vector<StatisticsNode> nodes = statistics_nodes();
  if (nodes.empty() || !training_) return;
  const size_t record = nodes.back().offset + nodes.back().size;
  std::vector<double>& table = chunk_statistics_[r];
  // Each micro-chunk's record is written by the one replica that ran it and is zero elsewhere, so the sum over the
  // replicas and processes is that record exactly, whatever the order; + 0.0 makes a -0 +0 as the sum would on more
  // than one device.
  for (double& v : table) v += 0.0;
  {
    TraceSpan told(*trace_, "running statistics told");
    reduce_over_all(rep, table.data(), table.size(), DType::kF64, ReduceOp::kSum);
  }
  TraceSpan folded(*trace_, "running statistics folded");
  for (int64_t c = 0; c < call.global_chunks; ++c)
    for (const StatisticsNode& n : nodes)
      rep.model->layer(n.node)->apply_running_statistics(rep.ctx, table.data() + static_cast<size_t>(c) * record + n.offset);
}

double Engine::reproducible_loss(const char* operation, const ChunkCall& call) {
  // Every micro-chunk's loss sum at its global index, added in that order.
  std::vector<double> losses(static_cast<size_t>(call.global_chunks), 0.0);
  std::copy(chunk_losses_.begin(), chunk_losses_.end(), losses.begin() + (call.first_chunk - step_chunks_));
  if (processes_) {
    try {
      processes_->all_reduce(losses.data(), losses.data(), losses.size(), DType::kF64, ReduceOp::kSum);
    } catch (const Error& e) {
      broken_ = true;
      broken_reason_ = std::string(operation) + ": " + e.what();
      fail(e.status(), operation, ": across processes: ", e.what());
    }
  }
  double total = 0.0;
  for (double l : losses) total += l;
  return call.global.samples > 0 ? total / static_cast<double>(call.global.samples)
                                 : std::numeric_limits<double>::quiet_NaN();
}

double Engine::reproducible_train_step(const Tensor& input, const Tensor& target) {
  const TraceSpan span(*trace_, kCallTrack, "train_step", "rows", input.rows());
  const ChunkCall call = reproducible_call("train_step", input, target, false);
  run("train_step", [&](Replica& rep, size_t r) {
    if (training_) save_state(rep);
    reproducible_backward(rep, r, call);
    fold_running_statistics(rep, r, call);
    reproducible_reduce(rep, r, call.global_chunks, call.global.samples, call.per_replica[r] > 0);
    finish_and_step(rep, true);
    if (training_) sync_buffers(rep);
  });
  publish_grad_norm();
  update_loss_scale();
  forward_split_.clear();
  return reproducible_loss("train_step", call);
}

double Engine::reproducible_accumulate(const Tensor& input, const Tensor& target) {
  const TraceSpan span(*trace_, kCallTrack, "accumulate", "rows", input.rows());
  const ChunkCall call = reproducible_call("accumulate", input, target, true);
  run("accumulate", [&](Replica& rep, size_t r) {
    if (training_) save_state(rep);
    reproducible_backward(rep, r, call);
    fold_running_statistics(rep, r, call);
    if (training_) sync_buffers(rep);
  });
  const double loss = reproducible_loss("accumulate", call);
  pending_ = Pending::kLoss;
  pending_samples_ += call.global.samples;
  step_chunks_ += call.global_chunks;
  forward_split_.clear();
  return loss;
}

void Engine::reproducible_step() {
  const TraceSpan span(*trace_, kCallTrack, "step");
  DPAR_ENFORCE(pending_ == Pending::kLoss, Status::kInvalidState,
               "step: no gradient is pending (call accumulate() first)");
  const int64_t samples = pending_samples_, chunks = step_chunks_;
  run("step", [&](Replica& rep, size_t r) {
    reproducible_reduce(rep, r, chunks, samples, false);
    finish_and_step(rep, true);
    rep.model->clear_forward_state();
  });
  publish_grad_norm();
  update_loss_scale();
  pending_ = Pending::kNone;
  pending_samples_ = 0;
  step_chunks_ = 0;
  forward_split_.clear();
}

}  // namespace dpar
