#include "reducer/reducer.h"

#include <algorithm>
#include <exception>

#include "common/error.h"

namespace dpar {

std::vector<std::vector<size_t>> assign_buckets(const std::vector<size_t>& counts, size_t element_bytes,
                                                const BucketOptions& options) {
  DPAR_CHECK_ARG(element_bytes > 0, "assign_buckets: element size is 0");
  std::vector<std::vector<size_t>> buckets;
  std::vector<size_t> current;
  size_t bytes = 0;
  for (size_t i = counts.size(); i-- > 0;) {
    current.push_back(i);
    bytes += counts[i] * element_bytes;
    // A bucket closes once it holds its limit (a gradient larger than the limit gets a bucket of its own).
    const size_t limit = buckets.empty() ? options.first_bucket_bytes : options.bucket_cap_bytes;
    if (bytes >= limit) {
      buckets.push_back(std::move(current));
      current.clear();
      bytes = 0;
    }
  }
  if (!current.empty()) buckets.push_back(std::move(current));
  return buckets;
}

Reducer::Reducer(std::vector<Grad> grads, const BucketOptions& options, Stream& stream,
                 std::unique_ptr<BucketStrategy> strategy, Launch launch)
    : grads_(std::move(grads)), stream_(stream), strategy_(std::move(strategy)), launch_(std::move(launch)) {
  DPAR_ENFORCE(strategy_ != nullptr, Status::kInternal, "reducer: no bucket strategy");
  DPAR_CHECK_ARG(options.first_bucket_bytes > 0 && options.bucket_cap_bytes > 0,
                 "bucket sizes: the first bucket's limit and the cap must be positive");
  std::vector<size_t> counts;
  for (size_t i = 0; i < grads_.size(); ++i) {
    DPAR_CHECK_ARG(grads_[i].data || grads_[i].count == 0, "gradient ", i, ": null buffer for ", grads_[i].count,
                   " elements");
    counts.push_back(grads_[i].count);
  }
  ready_.assign(grads_.size(), 0);
  bucket_of_.assign(grads_.size(), 0);
  for (auto& members : assign_buckets(counts, sizeof(float), options)) {
    Bucket b;
    b.grads = std::move(members);
    for (size_t g : b.grads) {
      bucket_of_[g] = buckets_.size();
      b.count += grads_[g].count;
    }
    // In place when the gradients tile one range of memory, in any order.
    std::vector<size_t> by_address = b.grads;
    std::sort(by_address.begin(), by_address.end(),
              [&](size_t x, size_t y) { return std::less<const float*>()(grads_[x].data, grads_[y].data); });
    bool contiguous = true;
    for (size_t i = 1; i < by_address.size(); ++i) {
      const Grad& prev = grads_[by_address[i - 1]];
      contiguous = contiguous && prev.data + prev.count == grads_[by_address[i]].data;
    }
    if (contiguous && !by_address.empty()) {
      b.data = grads_[by_address.front()].data;
    } else {
      b.staging = Tensor::empty(DType::kF32, Shape{static_cast<int64_t>(b.count)}, stream_.device());
      b.data = b.staging.f32();
    }
    buckets_.push_back(std::move(b));
  }
  next_launch_ = buckets_.size();  // nothing to launch until prepare()
}

Reducer::~Reducer() { drain(); }

void Reducer::set_strategy(std::unique_ptr<BucketStrategy> strategy) {
  DPAR_ENFORCE(strategy != nullptr, Status::kInternal, "reducer: no bucket strategy");
  DPAR_ENFORCE(!in_step_, Status::kInvalidState, "reducer: the bucket strategy changes between steps only");
  strategy_ = std::move(strategy);
}

void Reducer::prepare(float scale) {
  for (const Bucket& b : buckets_)
    DPAR_ENFORCE(!b.work, Status::kInvalidState, "reducer: the previous step's buckets are still in flight");
  scale_ = scale;
  std::fill(ready_.begin(), ready_.end(), 0);
  for (Bucket& b : buckets_) {
    b.pending = b.grads.size();
    b.produced = 0;
  }
  next_launch_ = 0;
  in_step_ = true;
}

void Reducer::mark_ready(size_t index) {
  DPAR_ENFORCE(in_step_, Status::kInvalidState, "reducer: gradient ", index, " marked ready outside a step");
  DPAR_CHECK_ARG(index < grads_.size(), "gradient index ", index, " is out of range (", grads_.size(),
                 " gradients registered)");
  DPAR_ENFORCE(!ready_[index], Status::kInvalidState, "gradient ", index, " was marked ready twice in one step");
  ready_[index] = 1;
  Bucket& b = buckets_[bucket_of_[index]];
  --b.pending;
  ++b.produced;
  launch_ready();
}

void Reducer::mark_all_ready() {
  DPAR_ENFORCE(in_step_, Status::kInvalidState, "reducer: gradients marked ready outside a step");
  for (size_t i = 0; i < grads_.size(); ++i) {
    if (ready_[i]) continue;
    ready_[i] = 1;
    Bucket& b = buckets_[bucket_of_[i]];
    --b.pending;
    ++b.produced;
  }
}

void Reducer::launch_ready() {
  // The last bucket is left to finish() (see the header).
  while (next_launch_ + 1 < buckets_.size() && buckets_[next_launch_].pending == 0) {
    Bucket& b = buckets_[next_launch_];
    b.work = launch_([this, &b] { reduce_bucket(b); });
    ++next_launch_;
  }
}

void Reducer::reduce_bucket(Bucket& b) {
  // A bucket runs here either complete (launched) or from finish(), after the last mark_ready: ready_ is stable.
  const bool contributes = b.produced > 0;
  if (!b.staging.defined()) {
    if (contributes && b.produced < b.grads.size())
      for (size_t g : b.grads)
        if (!ready_[g]) stream_.fill_zero(grads_[g].data, grads_[g].count * sizeof(float));
  } else if (contributes) {
    float* at = b.data;
    for (size_t g : b.grads) {
      if (ready_[g])
        stream_.copy(at, grads_[g].data, grads_[g].count * sizeof(float));
      else
        stream_.fill_zero(at, grads_[g].count * sizeof(float));
      at += grads_[g].count;
    }
  }
  GradBucket bucket;
  bucket.index = static_cast<size_t>(&b - buckets_.data());
  bucket.data = b.data;
  bucket.count = b.count;
  bucket.contributes = contributes;
  bucket.scale = scale_;
  strategy_->reduce(bucket);
  if (b.staging.defined()) {
    const float* at = b.data;
    for (size_t g : b.grads) {
      stream_.copy(grads_[g].data, at, grads_[g].count * sizeof(float));
      at += grads_[g].count;
    }
  }
}

void Reducer::finish() {
  DPAR_ENFORCE(in_step_, Status::kInvalidState, "reducer: finish() without a step in progress");
  std::exception_ptr first;
  for (size_t i = 0; i < next_launch_; ++i) {
    Bucket& b = buckets_[i];
    try {
      b.work->wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
    b.work.reset();
  }
  in_step_ = false;
  if (first) std::rethrow_exception(first);
  for (; next_launch_ < buckets_.size(); ++next_launch_) reduce_bucket(buckets_[next_launch_]);
}

void Reducer::drain() noexcept {
  for (Bucket& b : buckets_) {
    if (!b.work) continue;
    try {
      b.work->wait();
    } catch (...) {
    }
    b.work.reset();
  }
  in_step_ = false;
}

}  // namespace dpar
