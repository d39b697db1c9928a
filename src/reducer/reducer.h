// The reducer: gradients grouped into buckets and each bucket reduced as soon as backward has produced all of its
// gradients, on the communication thread, while backward goes on with the earlier layers (what PyTorch's
// DistributedDataParallel and Horovod's tensor fusion do). How a bucket is reduced is its strategy's business
// (reducer/bucket_strategy.h: flat, hierarchical, bf16 across processes, reduce-scatter).
//
// Buckets are formed once, from the gradients in the model's order, walking them in reverse (the order backward
// produces them): a bucket takes gradients until it holds at least its limit, the first bucket's limit being small
// so that communication starts early and the others' the cap (DDP's rule, with the same 1 MiB / 25 MiB defaults).
// Buckets are launched strictly in bucket order, whatever order the gradients arrive in, so that every participant
// runs the same collectives in the same order: a participant's fingerprints would disagree otherwise.
//
// Gradients a step did not produce (a layer that got no input, a replica given no rows, a framework's unused
// parameter) need no flag: whatever was not marked ready by finish() counts as zero. A bucket with some
// gradients missing gets zeros written in their place; a bucket with none of its gradients is reduced with
// contributes == false, which the collective treats as zeros without reading the buffer.
//
// A bucket whose gradients lie next to each other in memory (the engine's flat gradient buffer) is reduced in
// place; otherwise it has a staging buffer on the gradients' device, into which the communication thread copies
// the gradients before the collective and out of which it copies the result after. Zero-fills and staging copies
// go through the participant's Stream, so they are ordered with its device's work.
//
// The last bucket is not handed to the communication thread: it is ready only when backward is over, when the
// caller has nothing left to do but wait, so finish() runs it on the calling thread once the earlier buckets are
// done, saving a hand-off per step (and all of the thread traffic for a model that fits one bucket).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "backend/stream.h"
#include "collectives/replica_set.h"
#include "reducer/bucket_strategy.h"
#include "tensor/tensor.h"

namespace dpar {

struct BucketOptions {
  size_t first_bucket_bytes = size_t{1} << 20;  // the limit of the bucket backward fills first
  size_t bucket_cap_bytes = size_t{25} << 20;   // the limit of every other bucket
};

// Gradient indices per bucket, in launch order: bucket 0 holds the last gradients. `counts` are element counts in
// the model's order; every gradient lands in exactly one bucket (an empty model gives no bucket).
std::vector<std::vector<size_t>> assign_buckets(const std::vector<size_t>& counts, size_t element_bytes,
                                                const BucketOptions& options);

class Reducer {
 public:
  struct Grad {
    float* data;
    size_t count;
  };
  // Runs `op` on the communication thread after what it was given before; returns the op's completion.
  using Launch = std::function<std::shared_ptr<AsyncWork>(std::function<void()> op)>;

  // `grads` are device memory of `stream`'s device; the stream must outlive the reducer. `strategy` reduces each
  // bucket (on every participant, the same buckets in the same order).
  Reducer(std::vector<Grad> grads, const BucketOptions& options, Stream& stream,
          std::unique_ptr<BucketStrategy> strategy, Launch launch);
  // Waits for buckets still in flight (their errors are dropped).
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  size_t num_grads() const { return grads_.size(); }
  size_t num_buckets() const { return buckets_.size(); }
  // Gradient indices of bucket b, and whether it is reduced in place (no staging copy).
  const std::vector<size_t>& bucket(size_t b) const { return buckets_[b].grads; }
  bool in_place(size_t b) const { return !buckets_[b].staging.defined(); }
  // The range bucket b reduces: the gradients themselves when in place, else its staging buffer.
  float* bucket_data(size_t b) const { return buckets_[b].data; }
  size_t bucket_count(size_t b) const { return buckets_[b].count; }

  const BucketStrategy& strategy() const { return *strategy_; }
  // From the next step on. Throws INVALID_STATE inside a step.
  void set_strategy(std::unique_ptr<BucketStrategy> strategy);

  // Starts a step: no gradient is ready; each bucket's sum will be multiplied by `scale`. Throws INVALID_STATE if
  // buckets of the previous step are in flight.
  void prepare(float scale = 1.0f);
  // Gradient `index` holds this step's value and will not be written again before finish(). Launches every
  // bucket this completes, in bucket order. Throws INVALID_ARGUMENT for an index out of range and INVALID_STATE
  // for a gradient marked twice in a step.
  void mark_ready(size_t index);
  // Marks every gradient ready without launching anything (all are ready at once: nothing to overlap).
  void mark_all_ready();
  // Ends the step: gradients not marked count as zero; the buckets not launched yet run on the calling thread,
  // after the launched ones completed. Every gradient then holds the reduced value. Rethrows the first failure.
  void finish();
  // After a failure elsewhere (the group must already be aborted, or the wait lasts until the timeout): waits for
  // the launched buckets and forgets their errors.
  void drain() noexcept;

 private:
  struct Bucket {
    std::vector<size_t> grads;
    float* data = nullptr;            // the range reduced: the gradients themselves, or the staging buffer
    size_t count = 0;
    Tensor staging;                   // undefined when the gradients are contiguous
    size_t pending = 0;               // gradients not yet ready this step
    size_t produced = 0;              // gradients marked ready this step
    std::shared_ptr<AsyncWork> work;  // the launched reduction, until finish()
  };
  void launch_ready();
  // The reduction of bucket b, as it runs on whichever thread: zero-fill, stage in, reduce, stage out.
  void reduce_bucket(Bucket& b);

  std::vector<Grad> grads_;
  Stream& stream_;
  std::vector<size_t> bucket_of_;  // gradient -> bucket
  std::vector<uint8_t> ready_;  // bytes, not bits: the communication thread reads entries while others are set
  std::vector<Bucket> buckets_;
  size_t next_launch_ = 0;  // buckets before it are launched this step
  bool in_step_ = false;
  float scale_ = 1.0f;
  std::unique_ptr<BucketStrategy> strategy_;
  Launch launch_;
};

}  // namespace dpar
