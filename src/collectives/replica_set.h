// A replica set: every replica of every process of a job (an engine's replicas, or the members of a C API group
// with the processes' communicator), and the collectives over all of them. This is the one place where the
// hierarchy lives: among a process's replicas (its worker threads; on GPUs NCCL or dpar's device reduction), then
// across the processes by the process's replica 0 (MPI, or NCCL between the processes' GPUs; f32 or bfloat16 on
// the wire), then back to the process's other replicas.
//
// Sharding over the world (ZeRO-1/2 over every replica of every process): where every process has the same number
// n of replicas and the links give each replica index a link of its own across the processes
// (ProcessLinks::by_replica), replica r of process p owns, in every bucket, sub-block p (of P processes) of local
// block r (of n): world_block(). A reduce-scatter is then hierarchical: among the process's replicas (replica r
// gets local block r), then across the processes between the replicas of index r, each over its own link (process
// p gets sub-block p), so each replica's block crosses the network once, on its own link and thread; the
// all-gather runs the other way round. With one process this is block r of the process; with one replica per
// process, the plain reduce-scatter over the processes. Without per-index links (the C API's reducer, processes of
// different replica counts), or where the engine's reduction keeps them there (its all-reduce: set_shards_world),
// the shards stay within each process: block r of the process, every process holding every block (a bucket is
// then summed whole across the processes by replica 0).
//
// Three users: the reducer's bucket strategies (reducer/bucket_strategy.h), the C API's reducer (a framework's own
// gradients), and layers that need other replicas (SyncBatchNorm's statistics), which reach it through their
// ReplicaContext and never a communicator.
//
// Each replica holds its own ReplicaSet, as each holds its own communicator: a ReplicaSet is one replica's view of
// the set. Every replica of every process calls the same collectives in the same order, from its own thread; a
// collective is ordered after the device work queued on the replica's stream before it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/stream.h"
#include "comm/communicator.h"
#include "tensor/tensor.h"

namespace dpar {

class Trace;

// The completion of work queued on a replica's communication thread (Communicator::async_run): what the reducer
// holds for each bucket in flight, so that it needs no communicator of its own.
using AsyncWork = Work;

// How a sum crosses the processes (within a process it is always f32).
enum class Wire : int32_t {
  kF32 = 0,
  // The process's sum rounded to bfloat16 (nearest-even), summed across the processes in bfloat16 and widened
  // back: half the bytes between processes, f32's range, about 3 significant digits (DDP's bf16_compress_hook).
  kBf16 = 1,
};

// Where replica `replica` (of `replicas` in its process) of process `process` (of `processes`) shards a bucket of
// `count` elements: sub-block `process` (Communicator::block_range over the processes) of local block `replica`
// (block_range over the process's replicas), as offsets in the bucket. The one layout of the world's shards: the
// reduce-scatter, the all-gather, the optimizer's shard, clipping, loss scaling and checkpoints all use it.
// processes == 1: block `replica` of the process.
std::pair<size_t, size_t> world_block(size_t count, size_t replicas, size_t replica, int processes, int process);

// What connects one process's replicas to the other processes: one per process, shared by its replicas. Replica 0
// moves data through `host` and `device`; replica r >= 1 through by_replica[r] (where the shards span the processes).
struct ProcessLinks {
  // One participant per process, on host memory (MPI).
  std::shared_ptr<Communicator> host;
  // Replica 0's link to the other processes' replica 0 for its device's memory (NCCL between the processes' GPUs),
  // or null: `host` carries the data, through host memory where replica 0 is not on the host.
  std::unique_ptr<Communicator> device;
  // "mpi", "nccl", or what carried the data and why: for messages and traces.
  std::string transport;
  // Replica r's own links to replica r of every other process, as `host` and `device` are replica 0's (entry 0
  // stays empty: replica 0 uses those). Used only by replica r's threads. Empty: the shards stay within each
  // process (ReplicaSet, at the top); else one entry per replica, every process having as many, and the shards
  // span the processes where the engine's reduction puts them there (ReplicaSet::set_shards_world).
  struct ReplicaLink {
    std::unique_ptr<Communicator> host;    // MPI, a duplicate of `host`
    std::unique_ptr<Communicator> device;  // NCCL between the processes' GPUs of index r, or null
  };
  std::vector<ReplicaLink> by_replica;
  bool shards_world() const { return !by_replica.empty(); }

  // Every process waiting in a collective on these links throws REMOTE with `reason`.
  void abort(const std::string& reason);
};

class ReplicaSet {
 public:
  // `local`: this replica's participant among its process's replicas (rank = the replica's index in the process);
  // `stream`: its device's ordered work, on which staging copies and conversions are queued. `processes` is null
  // for a single process, else shared by the process's replicas. `trace`, if not null, gets a span per step of a
  // reduction (it must outlive the set), spans on the communication thread going on track `comm_track`. All must
  // outlive the ReplicaSet.
  ReplicaSet(Communicator& local, Stream& stream, std::shared_ptr<ProcessLinks> processes, Trace* trace = nullptr,
             size_t comm_track = 0);
  ReplicaSet(const ReplicaSet&) = delete;
  ReplicaSet& operator=(const ReplicaSet&) = delete;

  size_t replica() const { return static_cast<size_t>(local_.rank()); }  // within the process
  size_t local_size() const { return static_cast<size_t>(local_.size()); }
  int num_processes() const { return processes_ ? processes_->host->size() : 1; }
  bool spans_processes() const { return num_processes() > 1; }
  const std::string& process_transport() const;
  // Whether sums across the processes can travel as `dtype` (bf16 on Wire::kBf16); true with one process.
  bool processes_move(DType dtype) const;
  // Whether the links let the shards span the processes (several processes, per-index links), and whether they
  // do: they start to where the links allow, and the engine chooses by its gradient reduction
  // (set_shards_world(), between steps, on every replica of every process alike).
  bool can_shard_world() const { return processes_ && processes_->shards_world(); }
  bool shards_world() const { return world_; }
  void set_shards_world(bool world);
  // The processes the shards are spread over: num_processes() where they span the world, else 1 (every process
  // holds every shard). And this process's index among them (0 when 1).
  int shard_processes() const { return world_ ? num_processes() : 1; }
  int shard_process() const { return world_ ? processes_->host->rank() : 0; }
  // This replica's shard of a bucket of `count` elements (world_block()), as offsets in the bucket.
  std::pair<size_t, size_t> shard_of(size_t count) const {
    return world_block(count, local_size(), replica(), shard_processes(), shard_process());
  }
  // Sums `count` elements of `dtype` (f32, f64; the replica's device memory) over every replica that holds a shard
  // of its own: the process's replicas, or every replica of every process where the shards span the world (the
  // norm of a sharded gradient, clipping's and the loss scaler's). Every such replica gets the same bits.
  void sum_over_shards(void* data, size_t count, DType dtype);
  Communicator& local() { return local_; }
  Stream& stream() { return stream_; }

  // ---- Gradient sums (f32, in place; called on the replica's communication thread or its worker) -------------
  // (sum over every replica of every process of `count` floats at `data`) * scale, into every replica's buffer.
  // contributes == false: this replica produced none of them; its buffer is read as zeros (and not read).
  // One process: one all-reduce among the replicas. Several: summed (and scaled) into replica 0, summed across the
  // processes by replica 0 on `wire`, then broadcast to the process's other replicas.
  void all_reduce_sum(float* data, size_t count, bool contributes, float scale, Wire wire);
  // The same sum, but each replica needs only its shard of the buffer (shard_of(count)); the rest of its buffer is
  // unspecified afterwards. One process: a reduce-scatter among the replicas, whose block r is bit for bit
  // all_reduce_sum's. Shards over the world: a reduce-scatter among the process's replicas (scaled), then one
  // across the processes on this replica's own link of its local block (on `wire`), each process keeping its
  // sub-block: (P-1)/P of the local block leaves and enters each replica, where all_reduce_sum moves twice that
  // through replica 0 alone. Across the processes MPI adds the processes' partial sums in rank order (mpi_comm.h),
  // NCCL in an order of its own; the shard holds all_reduce_sum's bits wherever the all-reduce adds them in the
  // same order: always for two processes (a sum of two does not depend on it), and over MPI for more where the
  // all-reduce is fused (small buckets; a large one is MPI_Allreduce's, whose algorithm chooses the order). Shards
  // within each process: summed into replica 0, across the processes, then broadcast (each replica keeps its
  // block), all_reduce_sum's traffic.
  void reduce_scatter_sum(float* data, size_t count, bool contributes, float scale, Wire wire);
  // The same two sums carried in bfloat16 throughout (the engine's reduce dtype bf16, as FSDP's
  // MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)): this replica's `count` floats rounded to bf16 (nearest even),
  // summed over the process's replicas, rounded to bf16, summed across the processes in bf16 (as Wire::kBf16), then
  // widened to f32 and multiplied by `scale` in f32. Within the process: where the replicas' communicator sums bf16
  // (NCCL), its bf16 all-reduce (reduce-scatter, reduce and broadcast) carries it, half the bytes of f32; elsewhere
  // (threads, dpar's CUDA device group) the rounded values are summed in f32 in replica order and the sum rounded to
  // bf16 once, which a bf16 ring approximates (each of its partial sums rounded), with the same bytes as f32 through
  // shared memory. Every replica ends with the same bits, independent of thread timing.
  void all_reduce_sum_bf16(float* data, size_t count, bool contributes, float scale);
  // The shard of the same, as reduce_scatter_sum is of all_reduce_sum (across the processes the local block is
  // reduce-scattered in bf16, as Wire::kBf16).
  void reduce_scatter_sum_bf16(float* data, size_t count, bool contributes, float scale);
  // Every replica's shard (the same layout) into every replica of every process. Shards over the world: across the
  // processes on this replica's link first (local block r put together from the processes' sub-blocks), then among
  // the process's replicas. Shards within the process: among its replicas only (every process holds every block).
  void all_gather_blocks(float* data, size_t count);


  // ---- For layers (from forward and backward, on the replica's worker) -----------------------------------------
  // Sums `count` elements of `dtype` (kF32 or kF64) at `data`, memory of the replica's device, over every replica
  // of every process, into every replica's buffer. It runs on the replica's communication thread, after every
  // bucket reduction queued there before the call (so it orders with gradient buckets in flight the same way on
  // every replica), and returns when the sum is in `data`. A replica with no rows of the batch must call it too,
  // with zeros, as every replica must call every collective.
  void sum(void* data, size_t count, DType dtype);
  // Makes `count` elements of `dtype` at `data` (memory of the replica's device) on every replica of every process
  // those of replica 0 of process 0, bit for bit, whatever the dtype (the engine's buffers: BatchNorm's running
  // statistics and its int64 counters). Ordered as sum() is.
  void broadcast_from_first(void* data, size_t count, DType dtype);
  // The same sum over this process's replicas only, for values that every process holds alike (the norm of a
  // gradient that every process has reduced in full).
  void sum_within_process(void* data, size_t count, DType dtype);

  // The factor that turns a sum over the set into a mean: 1 / (replicas of every process). A collective over every
  // replica of every process the first time (every replica must pass the same scale to a sum: each sums a part of
  // the buffer), then kept.
  float mean_scale();

  // Makes every replica and process waiting in a collective of this set throw REMOTE with `reason`.
  void abort(const std::string& reason);

 private:
  // Rounds `count` floats at `data` (the replica's device memory) to bf16 values, in place (through bf16_stage_).
  void round_to_bf16(float* data, size_t count);
  // Widens `count` bf16 values of bf16_stage_ (from element `from`) into `data` and multiplies them by `scale`.
  void widen_scaled(float* data, size_t count, size_t from, float scale);
  // bf16_stage_ holds at least `count` elements.
  void reserve_bf16_stage(size_t count);
  // all_reduce_sum_bf16 where the replicas' communicator sums bf16 (NCCL).
  void all_reduce_sum_bf16_native(float* data, size_t count, bool contributes, float scale);
  // Replica 0's part of a hierarchical sum: `count` elements of `dtype` at `data` (device memory) summed across the
  // processes.
  void sum_across_processes(void* data, size_t count, DType dtype);
  // This replica's link across the processes (replica 0's, or its own by_replica entry) for `count` elements of
  // `dtype` at `data` (its device's memory): collective(communicator, buffer) on the device link, on the host link
  // for host memory, or on the host link through a host copy (MPI moves host memory).
  template <class F>
  void across_processes(void* data, size_t count, DType dtype, F&& collective);
  Communicator& host_link();
  Communicator* device_link();
  // The world reduce-scatter's second level: `count` floats at `block` (this replica's local block, summed over the
  // process) reduce-scattered over the processes on this replica's link (f32, or bf16 on Wire::kBf16); the
  // process's sub-block (block_range over the processes) receives the sum.
  void reduce_scatter_across(float* block, size_t count, Wire wire);
  // Runs body on the replica's communication thread (a span `what` of `count` elements) and waits for it.
  template <class F>
  void on_comm_thread(const char* what, size_t count, F&& body);
  // The same for f32 data, on `wire`.
  void sum_across_processes(float* data, size_t count, Wire wire);
  // Replica 0 sums across the processes; every replica of the process waits for it in the broadcast that follows,
  // so a failure there aborts the process's group before it is rethrown.
  template <class F>
  void across_or_abort(F&& across);

  Communicator& local_;
  Stream& stream_;
  std::shared_ptr<ProcessLinks> processes_;
  bool world_ = false;  // the shards span the processes (processes_->shards_world())
  Trace* trace_;
  size_t comm_track_;
  float mean_scale_ = 0.0f;  // 0 until computed
  // Replica 0's staging: a buffer on its way through host memory (MPI moves host memory), and a buffer rounded to
  // bfloat16 on the replica's device (i32 storage, two to an element). Used by one thread at a time (the replica's
  // communication thread, or its worker once that thread is idle); both grow to the largest use.
  std::vector<unsigned char> host_stage_;
  Tensor bf16_stage_;
};

}  // namespace dpar
