#include "reducer/bucket_strategy.h"

#include "common/error.h"

namespace dpar {

const char* bucket_strategy_name(BucketStrategyKind kind) {
  switch (kind) {
    case BucketStrategyKind::kFlat: return "flat";
    case BucketStrategyKind::kHierarchical: return "hierarchical";
    case BucketStrategyKind::kHierarchicalBf16: return "hierarchical bf16";
    case BucketStrategyKind::kReduceScatter: return "reduce-scatter";
  }
  return "unknown bucket strategy";
}

namespace {

class FlatAllReduce final : public BucketStrategy {
 public:
  explicit FlatAllReduce(ReplicaSet& set) : set_(set) {}
  const char* name() const override { return "flat"; }
  // The set spans one process (checked when made): its sum is one all-reduce among the replicas.
  void reduce(const GradBucket& b) override {
    set_.all_reduce_sum(b.data, b.count, b.contributes, b.scale, Wire::kF32);
  }

 private:
  ReplicaSet& set_;
};

class HierarchicalAllReduce final : public BucketStrategy {
 public:
  HierarchicalAllReduce(ReplicaSet& set, Wire wire) : set_(set), wire_(wire) {}
  const char* name() const override { return wire_ == Wire::kBf16 ? "hierarchical bf16" : "hierarchical"; }
  void reduce(const GradBucket& b) override { set_.all_reduce_sum(b.data, b.count, b.contributes, b.scale, wire_); }

 private:
  ReplicaSet& set_;
  Wire wire_;
};

class ReduceScatter final : public BucketStrategy {
 public:
  ReduceScatter(ReplicaSet& set, Wire wire) : set_(set), wire_(wire) {}
  const char* name() const override { return "reduce-scatter"; }
  void reduce(const GradBucket& b) override {
    set_.reduce_scatter_sum(b.data, b.count, b.contributes, b.scale, wire_);
  }
  bool sharded() const override { return true; }

 private:
  ReplicaSet& set_;
  Wire wire_;
};

// The reduce dtype bf16: every replica's bucket rounded to bf16, summed in bf16 within and across the processes.
class Bf16Reduction final : public BucketStrategy {
 public:
  Bf16Reduction(ReplicaSet& set, bool sharded) : set_(set), sharded_(sharded) {}
  const char* name() const override {
    return sharded_ ? "reduce-scatter (reduce dtype bf16)" : "all-reduce (reduce dtype bf16)";
  }
  void reduce(const GradBucket& b) override {
    if (sharded_)
      set_.reduce_scatter_sum_bf16(b.data, b.count, b.contributes, b.scale);
    else
      set_.all_reduce_sum_bf16(b.data, b.count, b.contributes, b.scale);
  }
  bool sharded() const override { return sharded_; }

 private:
  ReplicaSet& set_;
  bool sharded_;
};

}  // namespace

std::unique_ptr<BucketStrategy> make_bucket_strategy(BucketStrategyKind kind, ReplicaSet& set, Wire wire,
                                                     DType reduce_dtype) {
  DPAR_CHECK_ARG(reduce_dtype == DType::kF32 || reduce_dtype == DType::kBF16, "bucket strategy: reduce dtype ",
                 dtype_name(reduce_dtype), " is not a reduce dtype (f32, bf16)");
  // bf16 between processes: refused here, when the setting is made, where the processes' link cannot carry it (a
  // threads communicator), rather than by every later reduction. Within a process any communicator serves: one
  // that does not sum bf16 sums the rounded values in f32.
  const bool bf16 = kind == BucketStrategyKind::kHierarchicalBf16 ||
                    (kind == BucketStrategyKind::kReduceScatter && wire == Wire::kBf16) ||
                    reduce_dtype == DType::kBF16;
  DPAR_ENFORCE(!bf16 || set.processes_move(DType::kBF16), Status::kNotSupported,
               "bucket strategy: bf16 compression across the processes, but their link (", set.process_transport(),
               ") does not move bf16");
  if (reduce_dtype == DType::kBF16) {
    DPAR_CHECK_ARG(kind != BucketStrategyKind::kFlat || !set.spans_processes(), "bucket strategy: flat reduces ",
                   "among one process's replicas, and this set spans ", set.num_processes(), " processes");
    if (kind == BucketStrategyKind::kFlat || kind == BucketStrategyKind::kHierarchical ||
        kind == BucketStrategyKind::kHierarchicalBf16)
      return std::make_unique<Bf16Reduction>(set, false);
    if (kind == BucketStrategyKind::kReduceScatter) return std::make_unique<Bf16Reduction>(set, true);
  }
  switch (kind) {
    case BucketStrategyKind::kFlat:
      DPAR_CHECK_ARG(!set.spans_processes(), "bucket strategy: flat reduces among one process's replicas, and this ",
                     "set spans ", set.num_processes(), " processes: use hierarchical");
      return std::make_unique<FlatAllReduce>(set);
    case BucketStrategyKind::kHierarchical: return std::make_unique<HierarchicalAllReduce>(set, Wire::kF32);
    case BucketStrategyKind::kHierarchicalBf16: return std::make_unique<HierarchicalAllReduce>(set, Wire::kBf16);
    case BucketStrategyKind::kReduceScatter: return std::make_unique<ReduceScatter>(set, wire);
  }
  fail(Status::kInvalidArgument, "bucket strategy: ", static_cast<int32_t>(kind), " is not a strategy (0: flat, ",
       "1: hierarchical, 2: hierarchical bf16, 3: reduce-scatter)");
}

}  // namespace dpar
