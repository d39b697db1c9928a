#include "collectives/replica_set.h"

#include "common/error.h"
#include "common/trace.h"

namespace dpar {

std::pair<size_t, size_t> world_block(size_t count, size_t replicas, size_t replica, int processes, int process) {
  const auto [begin, end] = Communicator::block_range(count, static_cast<int>(replicas), static_cast<int>(replica));
  if (processes <= 1) return {begin, end};
  const auto [from, to] = Communicator::block_range(end - begin, processes, process);
  return {begin + from, begin + to};
}

void ProcessLinks::abort(const std::string& reason) {
  if (host) host->abort(reason);
  if (device) device->abort(reason);
  for (ReplicaLink& link : by_replica) {
    if (link.host) link.host->abort(reason);
    if (link.device) link.device->abort(reason);
  }
}

ReplicaSet::ReplicaSet(Communicator& local, Stream& stream, std::shared_ptr<ProcessLinks> processes, Trace* trace,
                       size_t comm_track)
    : local_(local), stream_(stream), processes_(std::move(processes)), trace_(trace), comm_track_(comm_track) {
  DPAR_ENFORCE(!processes_ || processes_->host, Status::kInternal, "replica set: process links without a host link");
  // A job of one process has nothing to sum across.
  if (processes_ && processes_->host->size() <= 1) processes_.reset();
  if (processes_ && processes_->shards_world()) {
    DPAR_ENFORCE(processes_->by_replica.size() == local_size(), Status::kInternal, "replica set: ",
                 processes_->by_replica.size(), " per-replica process links for ", local_size(), " replicas");
    DPAR_ENFORCE(replica() == 0 || processes_->by_replica[replica()].host, Status::kInternal,
                 "replica set: replica ", replica(), " has no link across the processes");
    world_ = true;
  }
}

void ReplicaSet::set_shards_world(bool world) {
  DPAR_ENFORCE(!world || can_shard_world(), Status::kInternal, "replica set: the shards cannot span the processes ",
               "(no per-replica process links)");
  world_ = world;
}

Communicator& ReplicaSet::host_link() {
  return replica() == 0 ? *processes_->host : *processes_->by_replica[replica()].host;
}

Communicator* ReplicaSet::device_link() {
  return replica() == 0 ? processes_->device.get() : processes_->by_replica[replica()].device.get();
}

bool ReplicaSet::processes_move(DType dtype) const {
  if (!processes_) return true;
  // What sum_across_processes moves them with (and, sharding the world, this replica's own link).
  const Communicator& across = processes_->device ? *processes_->device : *processes_->host;
  if (!across.moves(dtype)) return false;
  if (!world_ || replica() == 0) return true;
  const ProcessLinks::ReplicaLink& mine = processes_->by_replica[replica()];
  return (mine.device ? *mine.device : *mine.host).moves(dtype);
}

const std::string& ReplicaSet::process_transport() const {
  static const std::string kNone;
  return processes_ ? processes_->transport : kNone;
}

template <class F>
void ReplicaSet::across_or_abort(F&& across) {
  try {
    across();
  } catch (const std::exception& e) {
    // The process's other replicas wait for this one in the broadcast that follows.
    local_.abort(std::string("the reduction across processes failed: ") + e.what());
    throw;
  }
}

void ReplicaSet::all_reduce_sum(float* data, size_t count, bool contributes, float scale, Wire wire) {
  const auto elements = static_cast<int64_t>(count);
  if (!processes_) {
    TraceSpan span(trace_, "bucket all-reduce", "elements", elements);
    local_.all_reduce_sum(data, count, contributes, scale);
    return;
  }
  // The process's sum lands in replica 0 only: the broadcast below is what the others receive.
  {
    TraceSpan span(trace_, "bucket reduce (replicas)", "elements", elements);
    local_.reduce_sum(data, count, contributes, scale, 0);
  }
  if (replica() == 0) {
    // [nccl][bf16]: span names are literals (common/trace.h).
    static constexpr const char* kNames[2][2] = {
        {"bucket all-reduce (processes)", "bucket all-reduce (processes, bf16)"},
        {"bucket all-reduce (processes, nccl)", "bucket all-reduce (processes, nccl, bf16)"}};
    TraceSpan span(trace_, kNames[processes_->device ? 1 : 0][wire == Wire::kBf16 ? 1 : 0], "elements", elements);
    across_or_abort([&] { sum_across_processes(data, count, wire); });
  }
  TraceSpan span(trace_, "bucket broadcast (replicas)", "elements", elements);
  local_.broadcast(data, count, DType::kF32, 0);
}

void ReplicaSet::reduce_scatter_sum(float* data, size_t count, bool contributes, float scale, Wire wire) {
  if (processes_ && !world_) return all_reduce_sum(data, count, contributes, scale, wire);
  {
    TraceSpan span(trace_, world_ ? "bucket reduce-scatter (replicas)" : "bucket reduce-scatter", "elements",
                   static_cast<int64_t>(count));
    local_.reduce_scatter_sum(data, count, contributes, scale);
  }
  if (!world_) return;
  const auto [begin, end] = Communicator::block_range(count, static_cast<int>(local_size()), static_cast<int>(replica()));
  reduce_scatter_across(data + begin, end - begin, wire);
}

void ReplicaSet::reduce_scatter_across(float* block, size_t count, Wire wire) {
  // Every process's replica r has the same local block (every process has n replicas): all skip an empty one.
  if (count == 0) return;
  // [nccl][bf16]: span names are literals (common/trace.h).
  static constexpr const char* kNames[2][2] = {
      {"bucket reduce-scatter (processes)", "bucket reduce-scatter (processes, bf16)"},
      {"bucket reduce-scatter (processes, nccl)", "bucket reduce-scatter (processes, nccl, bf16)"}};
  TraceSpan span(trace_, kNames[device_link() ? 1 : 0][wire == Wire::kBf16 ? 1 : 0], "elements",
                 static_cast<int64_t>(count));
  // A failure here leaves the process's other replicas waiting for this one in their next collective.
  across_or_abort([&] {
    if (wire == Wire::kF32) {
      across_processes(block, count, DType::kF32, [&](Communicator& c, void* p) {
        c.reduce_scatter_sum(static_cast<float*>(p), count, true, 1.0f);
      });
      return;
    }
    // bf16 moves through the equal blocks of reduce_scatter (NCCL's, MPI's): the block rounded to bf16 and padded
    // with zeros to P blocks of sub-block 0's length; this process's sub-block lands after them, and is widened
    // into its place (its length is block_range's, the rest of the padded block's zeros).
    const auto processes = num_processes();
    const size_t per = Communicator::block_range(count, processes, 0).second;
    const size_t padded = per * static_cast<size_t>(processes);
    reserve_bf16_stage(padded + per);
    auto* packed = static_cast<unsigned char*>(bf16_stage_.raw());
    const size_t esz = dtype_size(DType::kBF16);
    const auto n = static_cast<int64_t>(count);
    stream_.run(call::Convert{bf16_stage_.rows(0, n).ref(), TensorRef::of(block, {n})});
    if (padded > count) stream_.fill_zero(packed + count * esz, (padded - count) * esz);
    across_processes(packed, padded + per, DType::kBF16, [&](Communicator& c, void* p) {
      auto* bytes = static_cast<unsigned char*>(p);
      c.reduce_scatter(bytes, bytes + padded * esz, per, DType::kBF16, ReduceOp::kSum);
    });
    const auto [from, to] = Communicator::block_range(count, processes, shard_process());
    widen_scaled(block + from, to - from, padded, 1.0f);
  });
}

void ReplicaSet::reserve_bf16_stage(size_t count) {
  // Tensor::empty, not a replica's allocator: this runs on the communication thread, and the test faults armed for
  // a worker's allocations are the worker's.
  const auto n = static_cast<int64_t>(count);
  if (!bf16_stage_.defined() || bf16_stage_.numel() < n)
    bf16_stage_ = Tensor::empty(DType::kBF16, Shape{std::max<int64_t>(n, 1)}, stream_.device());
}

void ReplicaSet::round_to_bf16(float* data, size_t count) {
  if (count == 0) return;
  reserve_bf16_stage(count);
  const auto n = static_cast<int64_t>(count);
  const TensorRef packed = bf16_stage_.rows(0, n).ref(), floats = TensorRef::of(data, {n});
  stream_.run(call::Convert{packed, floats});
  stream_.run(call::Convert{floats, packed});
}

void ReplicaSet::widen_scaled(float* data, size_t count, size_t from, float scale) {
  if (count == 0) return;
  const auto n = static_cast<int64_t>(count);
  const TensorRef floats = TensorRef::of(data, {n});
  stream_.run(call::Convert{floats, bf16_stage_.rows(static_cast<int64_t>(from), n).ref()});
  if (scale != 1.0f) stream_.run(call::Scale{floats, scale});
}

void ReplicaSet::all_reduce_sum_bf16(float* data, size_t count, bool contributes, float scale) {
  if (local_.moves(DType::kBF16)) return all_reduce_sum_bf16_native(data, count, contributes, scale);
  const auto elements = static_cast<int64_t>(count);
  // The replicas' communicator sums f32 only: each contribution is rounded to bf16 values (held in f32, exactly),
  // summed in f32 in replica order (the threads backend's rank order; unscaled, so that the scale applies once, to
  // the widened result), and the sum rounded to bf16 once.
  if (contributes) round_to_bf16(data, count);
  if (!processes_) {
    {
      TraceSpan span(trace_, "bucket all-reduce (bf16 values)", "elements", elements);
      local_.all_reduce_sum(data, count, contributes, 1.0f);
    }
    // Every replica rounds and scales the same bits the same way.
    round_to_bf16(data, count);
    if (scale != 1.0f && count > 0) stream_.run(call::Scale{TensorRef::of(data, {elements}), scale});
    return;
  }
  {
    TraceSpan span(trace_, "bucket reduce (replicas, bf16 values)", "elements", elements);
    local_.reduce_sum(data, count, contributes, 1.0f, 0);
  }
  if (replica() == 0) {
    static constexpr const char* kNames[2] = {"bucket all-reduce (processes, bf16)",
                                              "bucket all-reduce (processes, nccl, bf16)"};
    TraceSpan span(trace_, kNames[processes_->device ? 1 : 0], "elements", elements);
    across_or_abort([&] {
      // Rounds the process's f32 sum to bf16 (once), sums across the processes in bf16 and widens it.
      sum_across_processes(data, count, Wire::kBf16);
      if (scale != 1.0f && count > 0) stream_.run(call::Scale{TensorRef::of(data, {elements}), scale});
    });
  }
  TraceSpan span(trace_, "bucket broadcast (replicas)", "elements", elements);
  local_.broadcast(data, count, DType::kF32, 0);
}

void ReplicaSet::all_reduce_sum_bf16_native(float* data, size_t count, bool contributes, float scale) {
  const auto elements = static_cast<int64_t>(count);
  reserve_bf16_stage(count);
  void* packed = bf16_stage_.raw();
  if (contributes && count > 0)
    stream_.run(call::Convert{bf16_stage_.rows(0, elements).ref(), TensorRef::of(data, {elements})});
  else
    stream_.fill_zero(packed, count * dtype_size(DType::kBF16));
  if (!processes_) {
    TraceSpan span(trace_, "bucket all-reduce (bf16)", "elements", elements);
    local_.all_reduce(packed, packed, count, DType::kBF16, ReduceOp::kSum);
  } else {
    {
      TraceSpan span(trace_, "bucket reduce (replicas, bf16)", "elements", elements);
      local_.reduce(packed, packed, count, DType::kBF16, ReduceOp::kSum, 0);
    }
    if (replica() == 0) {
      static constexpr const char* kNames[2] = {"bucket all-reduce (processes, bf16)",
                                                "bucket all-reduce (processes, nccl, bf16)"};
      TraceSpan span(trace_, kNames[processes_->device ? 1 : 0], "elements", elements);
      across_or_abort([&] { sum_across_processes(packed, count, DType::kBF16); });
    }
    TraceSpan span(trace_, "bucket broadcast (replicas, bf16)", "elements", elements);
    local_.broadcast(packed, count, DType::kBF16, 0);
  }
  widen_scaled(data, count, 0, scale);
}

void ReplicaSet::reduce_scatter_sum_bf16(float* data, size_t count, bool contributes, float scale) {
  // Shards within each process: across processes a bucket is summed whole, as reduce_scatter_sum does.
  if (processes_ && !world_) return all_reduce_sum_bf16(data, count, contributes, scale);
  const auto [begin, end] = Communicator::block_range(count, static_cast<int>(local_size()), static_cast<int>(replica()));
  const auto elements = static_cast<int64_t>(count);
  // Over the world the scale waits for the sum across the processes, and applies to this replica's sub-block.
  const float local_scale = world_ ? 1.0f : scale;
  const auto finish_world = [&, begin = begin, end = end] {
    reduce_scatter_across(data + begin, end - begin, Wire::kBf16);
    const auto [from, to] = shard_of(count);
    const auto mine = static_cast<int64_t>(to - from);
    if (scale != 1.0f && mine > 0) stream_.run(call::Scale{TensorRef::of(data + from, {mine}), scale});
  };
  if (!local_.moves(DType::kBF16)) {
    // As all_reduce_sum_bf16's emulation, for this replica's block only: block r holds its bits.
    if (contributes) round_to_bf16(data, count);
    {
      TraceSpan span(trace_, "bucket reduce-scatter (bf16 values)", "elements", elements);
      local_.reduce_scatter_sum(data, count, contributes, 1.0f);
    }
    const auto mine = static_cast<int64_t>(end - begin);
    round_to_bf16(data + begin, end - begin);
    if (world_) return finish_world();
    if (scale != 1.0f && mine > 0) stream_.run(call::Scale{TensorRef::of(data + begin, {mine}), scale});
    return;
  }
  // A bf16 reduce-scatter (NCCL's) takes equal blocks: the bucket is padded with zeros to size() blocks of block 0's
  // length, and this replica's block lands after them in the stage.
  const size_t n = local_size();
  const size_t per = Communicator::block_range(count, static_cast<int>(n), 0).second;
  const size_t padded = per * n;
  reserve_bf16_stage(padded + per);
  auto* packed = static_cast<unsigned char*>(bf16_stage_.raw());
  const size_t esz = dtype_size(DType::kBF16);
  if (contributes && count > 0) {
    stream_.run(call::Convert{bf16_stage_.rows(0, elements).ref(), TensorRef::of(data, {elements})});
    if (padded > count) stream_.fill_zero(packed + count * esz, (padded - count) * esz);
  } else {
    stream_.fill_zero(packed, padded * esz);
  }
  {
    TraceSpan span(trace_, "bucket reduce-scatter (bf16)", "elements", elements);
    local_.reduce_scatter(packed, packed + padded * esz, per, DType::kBF16, ReduceOp::kSum);
  }
  // Over the world: the process's sum of block r widened unscaled (bf16 values, exactly), for the processes' sum.
  widen_scaled(data + begin, end - begin, padded, local_scale);
  if (world_) finish_world();
}

void ReplicaSet::all_gather_blocks(float* data, size_t count) {
  if (world_) {
    const auto [begin, end] = Communicator::block_range(count, static_cast<int>(local_size()), static_cast<int>(replica()));
    if (end > begin) {
      static constexpr const char* kNames[2] = {"all-gather (processes)", "all-gather (processes, nccl)"};
      TraceSpan span(trace_, kNames[device_link() ? 1 : 0], "elements", static_cast<int64_t>(end - begin));
      // Named apart from the structured binding: a lambda may not capture one before C++20 (clang 14).
      float* const block = data + begin;
      const size_t n = end - begin;
      across_or_abort([&] {
        across_processes(block, n, DType::kF32,
                         [&](Communicator& c, void* p) { c.all_gather_blocks(static_cast<float*>(p), n); });
      });
    }
  }
  TraceSpan span(trace_, world_ ? "all-gather (replicas)" : "all-gather", "elements", static_cast<int64_t>(count));
  local_.all_gather_blocks(data, count);
}

void ReplicaSet::sum_over_shards(void* data, size_t count, DType dtype) {
  if (world_) return sum(data, count, dtype);
  if (local_size() > 1) sum_within_process(data, count, dtype);
}

void ReplicaSet::sum_within_process(void* data, size_t count, DType dtype) {
  DPAR_CHECK_ARG(dtype == DType::kF32 || dtype == DType::kF64, "replica set sum: ", dtype_name(dtype),
                 " is not summed here (f32 or f64)");
  local_.all_reduce(data, data, count, dtype, ReduceOp::kSum);
}

void ReplicaSet::sum(void* data, size_t count, DType dtype) {
  DPAR_CHECK_ARG(dtype == DType::kF32 || dtype == DType::kF64, "replica set sum: ", dtype_name(dtype),
                 " is not summed here (f32 or f64)");
  DPAR_CHECK_ARG(data != nullptr || count == 0, "replica set sum: null buffer for ", count, " elements");
  on_comm_thread("layer sum", count, [&] {
    local_.all_reduce(data, data, count, dtype, ReduceOp::kSum);
    if (!processes_) return;
    if (replica() == 0) across_or_abort([&] { sum_across_processes(data, count, dtype); });
    local_.broadcast(data, count, dtype, 0);
  });
}

void ReplicaSet::broadcast_from_first(void* data, size_t count, DType dtype) {
  DPAR_CHECK_ARG(data != nullptr || count == 0, "replica set broadcast: null buffer for ", count, " elements");
  on_comm_thread("layer broadcast", count, [&] {
    if (processes_ && replica() == 0) across_or_abort([&] {
      across_processes(data, count, dtype, [&](Communicator& c, void* p) { c.broadcast(p, count, dtype, 0); });
    });
    local_.broadcast(data, count, dtype, 0);
  });
}

template <class F>
void ReplicaSet::on_comm_thread(const char* what, size_t count, F&& body) {
  // Behind the buckets already queued there: every replica queues the same buckets before the same layer's call,
  // so the collectives meet in the same order everywhere.
  local_
      .async_run(what,
                 [&] {
                   TraceTrack track(comm_track_);
                   TraceSpan span(trace_, what, "elements", static_cast<int64_t>(count));
                   body();
                 })
      ->wait();
}

float ReplicaSet::mean_scale() {
  if (mean_scale_ > 0.0f) return mean_scale_;
  float scale = static_cast<float>(1.0 / static_cast<double>(local_size()));
  if (processes_) {
    // Replica 0 counts the replicas of every process and tells its own, in the memory of the replicas' devices.
    if (replica() == 0) {
      const int64_t mine = static_cast<int64_t>(local_size());
      int64_t total = 0;
      processes_->host->all_reduce(&mine, &total, 1, DType::kI64, ReduceOp::kSum);
      scale = static_cast<float>(1.0 / static_cast<double>(total));
    }
    Tensor shared = Tensor::empty(DType::kF32, Shape{1}, stream_.device());
    stream_.copy_from_host(shared.raw(), &scale, sizeof(float));
    local_.broadcast(shared.raw(), 1, DType::kF32, 0);
    stream_.copy_to_host(&scale, shared.raw(), sizeof(float));
    stream_.synchronize();
  }
  mean_scale_ = scale;
  return mean_scale_;
}

void ReplicaSet::abort(const std::string& reason) {
  local_.abort(reason);
  if (processes_) processes_->abort(reason);
}

void ReplicaSet::sum_across_processes(float* data, size_t count, Wire wire) {
  if (wire == Wire::kF32) return sum_across_processes(data, count, DType::kF32);
  const auto n = static_cast<int64_t>(count);
  reserve_bf16_stage(count);
  const TensorRef packed = bf16_stage_.rows(0, n).ref(), floats = TensorRef::of(data, {n});
  stream_.run(call::Convert{packed, floats});
  sum_across_processes(packed.data, count, DType::kBF16);
  stream_.run(call::Convert{floats, packed});
}

void ReplicaSet::sum_across_processes(void* data, size_t count, DType dtype) {
  across_processes(data, count, dtype,
                   [&](Communicator& c, void* p) { c.all_reduce(p, p, count, dtype, ReduceOp::kSum); });
}

template <class F>
void ReplicaSet::across_processes(void* data, size_t count, DType dtype, F&& collective) {
  if (Communicator* device = device_link()) return collective(*device, data);
  if (stream_.device().is_host()) return collective(host_link(), data);
  // MPI moves host memory: through the host and back.
  const size_t bytes = count * dtype_size(dtype);
  if (host_stage_.size() < bytes) host_stage_.resize(bytes);
  stream_.copy_to_host(host_stage_.data(), data, bytes);
  collective(host_link(), host_stage_.data());
  stream_.copy_from_host(data, host_stage_.data(), bytes);
}

}  // namespace dpar
