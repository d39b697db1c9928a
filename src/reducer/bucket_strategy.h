// How a gradient bucket is reduced: communication hooks, as PyTorch DDP's (a GradBucket handed to an all-reduce
// hook, a bf16 compression hook, or a user's own). The reducer owns one and hands it each bucket once backward has
// produced the bucket's gradients; the engine and the C API only choose which. A strategy moves data only through
// its replica's ReplicaSet (collectives/replica_set.h), where the hierarchy over threads and processes lives.
//
//  - flat: one all-reduce among the process's replicas (a job of one process);
//  - hierarchical: among the process's replicas, then across the processes in f32, then back;
//  - hierarchical in bf16: the same, bfloat16 on the wire between processes;
//  - reduce-scatter: each replica receives only its shard of every bucket (the shard its optimizer steps: ZeRO-2;
//    ReplicaSet::shard_of, over every process where the shards span them), f32 or bf16 between processes;
//  - either of them in bf16 throughout (reduce dtype bf16): every replica's bucket rounded to bf16, within and
//    across the processes (ReplicaSet::all_reduce_sum_bf16, reduce_scatter_sum_bf16).
#pragma once

#include <cstddef>
#include <memory>

#include "collectives/replica_set.h"

namespace dpar {

// One bucket of one step, as the reducer hands it over: `count` contiguous floats at `data` (the gradients
// themselves, or the bucket's staging buffer) in the memory of the replica's device.
struct GradBucket {
  size_t index = 0;  // launch order: bucket 0 holds the last gradients of the model
  float* data = nullptr;
  size_t count = 0;
  // false: this replica produced none of the bucket's gradients this step, and `data` must be read as zeros.
  bool contributes = true;
  // The factor on the sum (the engine's 1 / global batch; a C API reducer's 1 or 1 / replicas).
  float scale = 1.0f;
};

class BucketStrategy {
 public:
  virtual ~BucketStrategy() = default;
  // "flat", "hierarchical", "hierarchical bf16", "reduce-scatter", "all-reduce (reduce dtype bf16)",
  // "reduce-scatter (reduce dtype bf16)": for messages and benchmarks.
  virtual const char* name() const = 0;
  // Reduces the bucket on this replica. Every replica of every process calls it for the same buckets in the same
  // order, each from its own thread.
  virtual void reduce(const GradBucket& bucket) = 0;
  // Whether the result is this replica's block of the bucket only (ReplicaSet::reduce_scatter_sum's layout);
  // otherwise every element of the bucket holds it.
  virtual bool sharded() const { return false; }
};

enum class BucketStrategyKind : int32_t { kFlat = 0, kHierarchical = 1, kHierarchicalBf16 = 2, kReduceScatter = 3 };
const char* bucket_strategy_name(BucketStrategyKind kind);

// The strategy of `kind` over `set` (which must outlive it). kFlat over a set that spans processes is refused
// (INVALID_ARGUMENT): the processes' replicas would never meet. `wire`: how kReduceScatter crosses processes.
// `reduce_dtype` kBF16: the reduction is carried in bf16 within the process too (and so across it, whatever `kind`
// and `wire` say): kFlat and kHierarchical* become an all-reduce in bf16, kReduceScatter a reduce-scatter in bf16.
// kF32 (the default): as `kind` and `wire` say.
std::unique_ptr<BucketStrategy> make_bucket_strategy(BucketStrategyKind kind, ReplicaSet& set, Wire wire = Wire::kF32,
                                                     DType reduce_dtype = DType::kF32);

}  // namespace dpar
