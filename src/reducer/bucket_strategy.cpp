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

}  // namespace

std::unique_ptr<BucketStrategy> make_bucket_strategy(BucketStrategyKind kind, ReplicaSet& set, Wire wire) {
  // bf16 crosses the processes only: refused here, when the setting is made, where the processes' link cannot
  // carry it (a threads communicator), rather than by every later reduction.
  const bool bf16 = kind == BucketStrategyKind::kHierarchicalBf16 ||
                    (kind == BucketStrategyKind::kReduceScatter && wire == Wire::kBf16);
  DPAR_ENFORCE(!bf16 || set.processes_move(DType::kBF16), Status::kNotSupported,
               "bucket strategy: bf16 compression across the processes, but their link (", set.process_transport(),
               ") does not move bf16");
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
