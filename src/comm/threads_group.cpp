// The threads backend's group: barrier rounds, the records participants publish, abort and reset (threads_comm.h).
// The collectives themselves are in threads_comm.cpp.
#include <algorithm>
#include <cstring>
#include <sstream>

#include "comm/threads_comm.h"
#include "common/error.h"

namespace dpar {

ThreadGroup::ThreadGroup(std::vector<std::string> names, std::chrono::duration<double> timeout)
    : names_(std::move(names)),
      timeout_(timeout),
      spin_(spin_policy(names_.size())),
      stage_limit_(spin_ == Spin::kYes ? size_t{1} << 10 : kStageBytes),
      slots_(names_.size()),
      stages_(names_.size()) {
  DPAR_ENFORCE(!names_.empty() && names_.size() <= ThreadGroup::kMaxParticipants, Status::kInvalidArgument,
               "thread group: size must be 1 to ", ThreadGroup::kMaxParticipants, ", got ", names_.size());
}

void ThreadGroup::reset() {
  arrived_.store(0, std::memory_order_relaxed);
  uint64_t most = 0;
  for (auto& s : slots_) most = std::max(most, s.arrivals.load());
  for (auto& s : slots_) {
    s.arrivals.store(most);
    s.seq = 0;
  }
  {
    std::lock_guard<std::mutex> lock(abort_mutex_);
    abort_reason_.clear();
  }
  aborted_.store(false, std::memory_order_release);
}

std::string ThreadGroup::abort_reason() {
  std::lock_guard<std::mutex> lock(abort_mutex_);
  return abort_reason_;
}

void ThreadGroup::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(abort_mutex_);
    if (abort_reason_.empty()) abort_reason_ = reason;
  }
  aborted_.store(true, std::memory_order_seq_cst);
  generation_.increment_and_wake();
}

void ThreadGroup::check_records(uint64_t round, const char* operation) const {
  // On the critical path of every collective: three 64-bit words per participant and one branch for all of them.
  const size_t p = round & 1;
  uint64_t first[3], diff = 0;
  std::memcpy(first, &slots_[0].pub[p].record, sizeof first);
  for (int r = 1; r < size(); ++r) {
    uint64_t f[3];
    std::memcpy(f, &slots_[r].pub[p].record, sizeof f);
    diff |= (f[0] ^ first[0]) | (f[1] ^ first[1]) | (f[2] ^ first[2]);
  }
  if (diff == 0) [[likely]]
    return;
  for (int r = 1; r < size(); ++r)
    if (!same_call(slots_[r].pub[p].record, slots_[0].pub[p].record))
      fail_mismatch(operation, r, slots_[r].pub[p].record, slots_[0].pub[p].record);
}

unsigned char* ThreadGroup::stage(int rank, size_t parity) {
  auto& stage = stages_[static_cast<size_t>(rank)];
  if (!stage) stage = std::make_unique<Stage>();
  return stage->bytes[parity];
}

void ThreadGroup::remote_failure(int rank, const char* operation) {
  std::lock_guard<std::mutex> lock(abort_mutex_);
  fail(Status::kRemote, operation, ": ", names_[rank], " stopped waiting because ", abort_reason_);
}

void ThreadGroup::arrive_and_wait(int rank, const char* operation) {
  if (size() == 1) {  // nobody to wait for or to release
    if (aborted()) remote_failure(rank, operation);
    slots_[rank].arrivals.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  // The generation is read before the abort flag: abort() sets the flag and then bumps the generation, so an
  // abort that lands after this read either shows in the flag or ends the wait below.
  const uint32_t gen = generation_.load();
  if (aborted()) remote_failure(rank, operation);
  const uint64_t my_arrival = slots_[rank].arrivals.fetch_add(1, std::memory_order_relaxed) + 1;
  if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<uint32_t>(size())) {
    arrived_.store(0, std::memory_order_relaxed);
    generation_.increment_and_wake();  // releases everyone; the release publishes this round's slots
    if (aborted()) remote_failure(rank, operation);
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
      fail(Status::kTimeout, operation, ": ", missing.str(), " did not arrive within ", timeout_.count(), " s (",
           names_[rank], " waited)");
    }
  }
  if (aborted()) remote_failure(rank, operation);
}

}  // namespace dpar
