#include "comm/threads_comm.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "common/error.h"

namespace dpar {
namespace {

// Adds `src` into `dst`. Compiled for AVX2 and for baseline x86-64, chosen at load time; an addition is exact per
// element at any vector width, so every build gives the same bits.
__attribute__((target_clones("avx2", "default"))) void add_into(float* __restrict dst, const float* __restrict src,
                                                                  size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] += src[i];
}

__attribute__((target_clones("avx2", "default"))) void scale_in_place(float* x, float scale, size_t n) {
  for (size_t i = 0; i < n; ++i) x[i] *= scale;
}

// Work in blocks that stay in L1 while every participant's buffer is visited.
constexpr size_t kBlock = 2048;  // floats: 8 KiB
// Slices start on cache-line boundaries so no two participants write the same line.
constexpr size_t kAlign = 16;  // floats: 64 bytes

}  // namespace

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(ThreadGroup& group, int rank) : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_.size(); }

  void all_reduce_sum(float* buffer, size_t count, bool contributes, float scale) override {
    auto& self = group_.slots_[rank_];
    self.buffer = buffer;
    self.contributes = contributes;
    group_.arrive_and_wait(rank_, "all_reduce");

    const size_t n = static_cast<size_t>(size());
    // This participant's slice [begin, end) of every buffer.
    size_t per = (count + n - 1) / n;
    per = (per + kAlign - 1) / kAlign * kAlign;
    const size_t begin = std::min(count, per * rank_);
    const size_t end = std::min(count, begin + per);

    float* bufs[256];
    float* contrib[256];
    size_t num_bufs = 0, num_contrib = 0;
    for (size_t r = 0; r < n; ++r) {
      bufs[num_bufs++] = group_.slots_[r].buffer;
      if (group_.slots_[r].contributes) contrib[num_contrib++] = group_.slots_[r].buffer;
    }
    for (size_t b = begin; b < end; b += kBlock) {
      const size_t len = std::min(kBlock, end - b);
      // Sum in rank order into the first contributor's block (a fixed order: the same bits on every run).
      float* acc = num_contrib ? contrib[0] + b : nullptr;
      for (size_t c = 1; c < num_contrib; ++c) add_into(acc, contrib[c] + b, len);
      if (acc && scale != 1.0f) scale_in_place(acc, scale, len);
      for (size_t r = 0; r < num_bufs; ++r) {
        float* dst = bufs[r] + b;
        if (dst == acc) continue;
        if (acc)
          std::memcpy(dst, acc, len * sizeof(float));
        else
          std::memset(dst, 0, len * sizeof(float));
      }
    }
    group_.arrive_and_wait(rank_, "all_reduce");
  }

  void barrier(const char* operation) override { group_.arrive_and_wait(rank_, operation); }
  void abort(const std::string& reason) override { group_.abort(reason); }

 private:
  ThreadGroup& group_;
  int rank_;
};

ThreadGroup::ThreadGroup(std::vector<std::string> names, std::chrono::duration<double> timeout)
    : names_(std::move(names)), timeout_(timeout), spin_(spin_policy(names_.size())), slots_(names_.size()) {
  DPAR_ENFORCE(!names_.empty() && names_.size() <= 256, DPAR_ERR_INVALID_ARGUMENT,
               "thread group: size must be 1 to 256, got ", names_.size());
}

std::unique_ptr<Communicator> ThreadGroup::communicator(int rank) {
  DPAR_ENFORCE(rank >= 0 && rank < size(), DPAR_ERR_INVALID_ARGUMENT, "thread group: rank ", rank, " out of range");
  return std::make_unique<ThreadCommunicator>(*this, rank);
}

void ThreadGroup::reset() {
  arrived_.store(0, std::memory_order_relaxed);
  uint64_t most = 0;
  for (auto& s : slots_) most = std::max(most, s.arrivals.load());
  for (auto& s : slots_) s.arrivals.store(most);
  {
    std::lock_guard<std::mutex> lock(abort_mutex_);
    abort_reason_.clear();
  }
  aborted_.store(false, std::memory_order_release);
}

void ThreadGroup::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(abort_mutex_);
    if (abort_reason_.empty()) abort_reason_ = reason;
  }
  aborted_.store(true, std::memory_order_seq_cst);
  generation_.increment_and_wake();
}

void ThreadGroup::arrive_and_wait(int rank, const char* operation) {
  auto remote_failure = [&] {
    std::lock_guard<std::mutex> lock(abort_mutex_);
    fail(DPAR_ERR_REMOTE, operation, ": ", names_[rank], " stopped waiting because ", abort_reason_);
  };
  // The generation is read before the abort flag: abort() sets the flag and then bumps the generation, so an
  // abort that lands after this read either shows in the flag or ends the wait below.
  const uint32_t gen = generation_.load();
  if (aborted()) remote_failure();
  const uint64_t my_arrival = slots_[rank].arrivals.fetch_add(1, std::memory_order_relaxed) + 1;
  if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<uint32_t>(size())) {
    arrived_.store(0, std::memory_order_relaxed);
    generation_.increment_and_wake();  // releases everyone; the release publishes this round's slots
    if (aborted()) remote_failure();
    return;
  }
  // A timeout beyond a century means none (and must not overflow the clock's nanoseconds).
  const auto deadline = timeout_.count() > 3.0e9 ? Clock::time_point::max()
                                                 : Clock::now() + std::chrono::duration_cast<Clock::duration>(timeout_);
  while (generation_.load() == gen) {
    if (!generation_.wait_while_equal(gen, deadline, spin_)) {
      std::ostringstream missing;
      for (int r = 0; r < size(); ++r)
        if (slots_[r].arrivals.load() < my_arrival) missing << (missing.tellp() ? ", " : "") << names_[r];
      // Tell the others too: a timed-out group cannot continue.
      std::ostringstream reason;
      reason << operation << " timed out waiting for " << missing.str();
      abort(reason.str());
      fail(DPAR_ERR_TIMEOUT, operation, ": ", missing.str(), " did not arrive within ", timeout_.count(), " s (",
           names_[rank], " waited)");
    }
  }
  if (aborted()) remote_failure();
}

}  // namespace dpar
