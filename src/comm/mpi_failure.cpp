// How an MPI collective fails instead of hanging (mpi_comm.h): notices (abort, timeout, void), the wait that
// polls for them under the deadline, and the abandoned exchanges that a rank which gave up keeps advancing.
#include <mpi.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/mpi_internal.h"
#include "comm/reduce_kernels.h"

namespace dpar {

using namespace mpi_internal;
using enum Collective;

namespace mpi_internal {

// How long a rank that gave up listens for the others' notices (and advances what it left): a quarter of the
// timeout, 50 ms to 1 s (1 s when the timeout is infinite).
SteadyClock::duration grace_period(double timeout_seconds) {
  const double timeout = timeout_seconds > 3.0e9 ? 4.0 : timeout_seconds;
  return std::chrono::duration_cast<SteadyClock::duration>(
      std::chrono::duration<double>(std::clamp(timeout / 4, 0.05, 1.0)));
}

// The communicators that left a collective in its fingerprint exchange (see "Abandoned exchanges" in the header):
// a collective of any communicator of this process advances them while it waits, so that a late rank in one is
// released even while this process waits in another (such as a test's or a program's own agreement after a
// failure). Entries whose exchange is done are dropped lazily; a communicator removes itself as it is destroyed.
std::mutex g_abandoned_mutex;
std::vector<MpiCommunicator*> g_abandoned;
std::atomic<int> g_abandoned_count{0};

}  // namespace mpi_internal

void MpiCommunicator::mark(State state, const std::string& reason) {
  g_group_failed.store(true);
  std::lock_guard<std::mutex> lock(reason_mutex_);
  if (state_.load() != kUsable) return;  // the first failure is the one to report
  broken_reason_ = reason;
  state_.store(state, std::memory_order_release);
}

void MpiCommunicator::throw_unusable(const std::string& where) {
  std::string reason;
  {
    std::lock_guard<std::mutex> lock(reason_mutex_);
    reason = broken_reason_;
  }
  if (state_.load() == kAborted) fail(Status::kRemote, where, ": stopped because ", reason);
  fail(Status::kInvalidState, where, ": this communicator is unusable since ", reason,
       "; create a new one to go on");
}

void MpiCommunicator::mpi_failed(const char* function, int code, const std::string& where) {
  requests_left_pending_ = true;
  exchange_.abandoned = false;  // MPI itself failed: nothing more is attempted on this communicator
  const std::string message = detail::concat(where, ": ", function, " failed: ", mpi_error_string(code));
  mark(kFailed, message);
  throw Error(Status::kCommunication, message);
}

void MpiCommunicator::abort(const std::string& reason) {
  mark(kAborted, detail::concat("rank ", rank_, " aborted the group: ", reason));
  {
    std::lock_guard<std::mutex> lock(reason_mutex_);
    if (abort_reason_.empty()) abort_reason_ = reason;
  }
  abort_requested_.store(true, std::memory_order_seq_cst);
  // Tell the other ranks now if no collective of ours is running; otherwise the thread inside it does, at once
  // if it is waiting, or when its transfer ends. Under less than MPI_THREAD_MULTIPLE another thread may be in MPI
  // (another communicator), so the next collective on this one sends them instead.
  if (thread_level_ == MPI_THREAD_MULTIPLE && mutex_.try_lock()) {
    std::lock_guard<std::mutex> lock(mutex_, std::adopt_lock);
    send_abort_notices_locked();
  }
}

Status MpiCommunicator::async_error(std::string* reason) {
  // Progress when no collective runs: send this rank's pending abort notices and read the others' (a collective in
  // flight does both itself). Under less than MPI_THREAD_MULTIPLE another thread may be in MPI: only the state.
  if (thread_level_ == MPI_THREAD_MULTIPLE && mutex_.try_lock()) {
    std::lock_guard<std::mutex> lock(mutex_, std::adopt_lock);
    if (abort_requested_.load()) send_abort_notices_locked();
    if (state_.load() == kUsable)
      drain_notices(seq_.load(), 2);
    else
      release_abandoned();
  }
  const int state = state_.load(std::memory_order_acquire);
  if (state == kUsable) return Status::kOk;
  std::lock_guard<std::mutex> lock(reason_mutex_);
  *reason = broken_reason_;
  return state == kAborted ? Status::kRemote : Status::kInvalidState;
}

void MpiCommunicator::send_abort_notices_locked() {
  if (abort_notices_sent_ || !abort_requested_.load()) return;
  abort_notices_sent_ = true;
  std::string reason;
  {
    std::lock_guard<std::mutex> lock(reason_mutex_);
    reason = abort_reason_;
  }
  send_notice(kAbortNotice, seq_.load(), 0, reason);
}

void MpiCommunicator::send_notice(int64_t kind, uint64_t seq, int64_t coll, const std::string& text) {
  test_pending_sends();
  auto data = std::make_shared<std::vector<char>>(kNoticeHeader + text.size());
  const int64_t header[3] = {kind, static_cast<int64_t>(seq), coll};
  std::memcpy(data->data(), header, kNoticeHeader);
  std::memcpy(data->data() + kNoticeHeader, text.data(), text.size());
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    MPI_Request request;
    // Best effort: a rank that is gone cannot be told.
    if (MPI_Isend(data->data(), static_cast<int>(data->size()), MPI_BYTE, r, kNoticeTag, control_, &request) ==
        MPI_SUCCESS)
      pending_sends_.push_back({request, data});
  }
  test_pending_sends();
}

void MpiCommunicator::test_pending_sends() {
  for (auto it = pending_sends_.begin(); it != pending_sends_.end();) {
    int done = 0;
    if (MPI_Test(&it->request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || done)
      it = pending_sends_.erase(it);
    else
      ++it;
  }
}

bool MpiCommunicator::drain_notices(uint64_t current_seq, int looks) {
  // A look costs ~0.07 us. OpenMPI's probe looks at its queue before it makes progress, so a notice still in
  // shared memory may show only at a later look.
  bool any = false;
  for (int empty = 0;;) {
    int flag = 0;
    MPI_Message message;
    MPI_Status status;
    if (MPI_Improbe(MPI_ANY_SOURCE, kNoticeTag, control_, &flag, &message, &status) != MPI_SUCCESS) return any;
    if (!flag) {
      if (++empty >= looks) return any;
      continue;
    }
    int count = 0;
    MPI_Get_count(&status, MPI_BYTE, &count);
    std::vector<char> data(static_cast<size_t>(std::max(count, 0)));
    if (MPI_Mrecv(data.data(), count, MPI_BYTE, &message, MPI_STATUS_IGNORE) != MPI_SUCCESS) return any;
    any = true;
    if (data.size() < kNoticeHeader) continue;
    int64_t header[3];
    std::memcpy(header, data.data(), kNoticeHeader);
    const std::string text(data.data() + kNoticeHeader, data.size() - kNoticeHeader);
    const int from = status.MPI_SOURCE;
    if (header[0] == kAbortNotice) {
      mark(kAborted, detail::concat("rank ", from, " aborted the group: ", text));
    } else if (header[0] == kTimeoutNotice && from >= 0 && from < size_) {
      const auto seq = static_cast<uint64_t>(header[1]);
      timeout_notice_seq_[static_cast<size_t>(from)] = header[1];
      // For the current collective the callers decide (a late rank, or a waiter that joins the timeout); any
      // other one means that the group cannot go on.
      if (seq != current_seq)
        mark(kFailed, detail::concat("rank ", from, " gave up waiting in ",
                                     collective_name(static_cast<Collective>(header[2])), " #", seq,
                                     " after its timeout"));
    } else if (header[0] == kVoidNotice && from >= 0 && from < size_) {
      const auto seq = static_cast<uint64_t>(header[1]);
      void_notice_seq_[static_cast<size_t>(from)] = header[1];
      if (seq != current_seq)
        mark(kFailed, detail::concat("rank ", from, " had left ", collective_name(static_cast<Collective>(header[2])), " #", seq, " (", text,
                                     ") and joined its transfer only to release the others: its result was void"));
    }
  }
}

void MpiCommunicator::wait(MPI_Request* requests, int count, MPI_Status* statuses, const CommCall& call, uint64_t seq,
                           bool transferring, SteadyClock::time_point start) {
  const double timeout = timeout_seconds();
  const bool forever = timeout > 3.0e9;
  const auto deadline = forever ? SteadyClock::time_point::max()
                                : start + std::chrono::duration_cast<SteadyClock::duration>(
                                              std::chrono::duration<double>(timeout));
  bool sleeping = false;  // past the spinning phase: every round sleeps, and checks everything
  for (unsigned i = 0;; ++i) {
    int done = 0;
    const int rc = MPI_Testall(count, requests, &done, statuses);
    if (rc != MPI_SUCCESS) mpi_failed("MPI_Testall", rc, where(call, seq));
    if (done) return;
    // Leaving the exchange: keep it, to release a late rank that completes its own (see the header).
    if (abort_requested_.load(std::memory_order_relaxed)) {
      requests_left_pending_ = true;
      send_abort_notices_locked();
      if (!transferring) abandon_exchange(true);
      throw_unusable(where(call, seq));
    }
    if (!sleeping && (i & 15) != 15) continue;
    if (drain_notices(seq, 1)) {
      if (state_.load() != kUsable) {
        requests_left_pending_ = true;
        if (!transferring) abandon_exchange(true);
        std::lock_guard<std::mutex> lock(reason_mutex_);
        fail(Status::kRemote, where(call, seq), ": stopped because ", broken_reason_);
      }
      for (int r = 0; r < size_; ++r)
        if (timeout_notice_seq_[static_cast<size_t>(r)] == static_cast<int64_t>(seq))
          give_up(call, seq, transferring, r);
    }
    if (sleeping && g_abandoned_count.load(std::memory_order_relaxed) > 0) release_others();
    const auto now = SteadyClock::now();
    if (now >= deadline) give_up(call, seq, transferring, -1);
    // Spin for a short while (the others are usually close), then sleep in slices of 1/16 of the time waited so
    // far (at most 200 us): a waiter that polled on would take the core from the computation it overlaps (a
    // bucket's all-reduce beside backward), while the slices add at most ~6% to a long wait.
    const auto waited = now - start;
    if (waited > std::chrono::microseconds(50)) {
      sleeping = true;
      const auto slice = std::clamp<SteadyClock::duration>(waited / 16, std::chrono::microseconds(5),
                                                           std::chrono::microseconds(200));
      std::this_thread::sleep_for(slice);
    }
  }
}

void MpiCommunicator::give_up(const CommCall& call, uint64_t seq, bool transferring, int first_notifier) {
  requests_left_pending_ = true;
  send_notice(kTimeoutNotice, seq, static_cast<int64_t>(call.kind()), "");
  // Listen: every rank waiting in this collective answers with its own notice. Meanwhile the exchange this rank
  // leaves goes on, for a late rank that completes its own without seeing the notice (see the header).
  if (!transferring) abandon_exchange(false);
  const auto end = SteadyClock::now() + grace_period(timeout_seconds());
  std::vector<int> waiting{rank_}, silent;
  bool released = false;  // the exchange completed after all: the late ranks arrived in the grace period
  while (true) {
    drain_notices(seq, 1);
    if (exchange_.abandoned && release_abandoned()) released = true;
    waiting.assign(1, rank_);
    silent.clear();
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      if (timeout_notice_seq_[static_cast<size_t>(r)] == static_cast<int64_t>(seq))
        waiting.push_back(r);
      else
        silent.push_back(r);
    }
    if ((silent.empty() && !exchange_.abandoned) || released || SteadyClock::now() >= end) break;
    test_pending_sends();
    sched_yield();
  }
  std::sort(waiting.begin(), waiting.end());
  std::ostringstream os;
  os << where(call, seq) << ": ";
  const std::string limit = timeout_seconds() > 3.0e9 && first_notifier >= 0
                                ? detail::concat("rank ", first_notifier, "'s timeout")
                                : detail::concat(timeout_seconds(), " s");
  if (!transferring) {
    if (!silent.empty())
      os << rank_list(silent) << " did not arrive within " << limit << " ("
         << rank_list(waiting) << " waited"
         << (released ? "; they arrived in the grace period after it, and their transfer was released with a void "
                        "result"
                      : "")
         << ")";
    else
      os << "every rank arrived but the fingerprint exchange did not complete within " << limit;
  } else {
    os << "the transfer did not complete within " << limit << " although every rank had arrived (still waiting: "
       << rank_list(waiting) << "; not answering, stopped or dead: " << rank_list(silent) << ")";
  }
  if (first_notifier >= 0) os << "; rank " << first_notifier << "'s timeout passed first";
  const std::string message = os.str();
  mark(kFailed, message);
  throw Error(Status::kTimeout, message);
}

void MpiCommunicator::check_late(const CommCall& c, uint64_t seq, int looks) {
  drain_notices(seq, looks);
  if (state_.load() != kUsable) {
    std::lock_guard<std::mutex> lock(reason_mutex_);
    fail(Status::kRemote, where(c, seq), ": stopped because ", broken_reason_);
  }
  for (int r = 0; r < size_; ++r) {
    if (timeout_notice_seq_[static_cast<size_t>(r)] != static_cast<int64_t>(seq)) continue;
    const std::string reason = detail::concat("rank ", r, " gave up waiting in ", collective_name(c.kind()), " #", seq,
                                              " after its timeout, before this rank arrived");
    mark(kFailed, reason);
    fail(Status::kRemote, where(c, seq), ": ", reason, "; nothing was moved");
  }
}

void MpiCommunicator::abandon_exchange(bool linger) {
  if (options_.transfer != MpiOptions::Transfer::kBlocking) return;  // the others' transfers see the notices
  exchange_.abandoned = true;
  {
    std::lock_guard<std::mutex> registry(g_abandoned_mutex);
    if (std::find(g_abandoned.begin(), g_abandoned.end(), this) == g_abandoned.end())
      g_abandoned.push_back(this), g_abandoned_count.fetch_add(1);
  }
  if (!linger) return;
  // A late rank is most likely to slip through just now: give it a grace period before leaving.
  const auto end = SteadyClock::now() + grace_period(timeout_seconds());
  while (!release_abandoned() && SteadyClock::now() < end) {
    test_pending_sends();
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void MpiCommunicator::release_others() {
  // Another thread may be inside MPI for another communicator only under MPI_THREAD_MULTIPLE.
  if (thread_level_ != MPI_THREAD_MULTIPLE) return;
  std::lock_guard<std::mutex> registry(g_abandoned_mutex);
  for (auto it = g_abandoned.begin(); it != g_abandoned.end();) {
    MpiCommunicator* other = *it;
    bool done = false;
    if (other != this && other->mutex_.try_lock()) {
      std::lock_guard<std::mutex> lock(other->mutex_, std::adopt_lock);
      done = other->release_abandoned();
    }
    if (done) {
      it = g_abandoned.erase(it);
      g_abandoned_count.fetch_sub(1);
    } else {
      ++it;
    }
  }
}

bool MpiCommunicator::release_abandoned() {
  if (!exchange_.abandoned) return true;
  CommCall c;
  c.record.kind = static_cast<uint8_t>(exchange_.coll);
  c.operation = collective_name(exchange_.coll);
  const uint64_t seq = exchange_.seq;
  try {
    while (exchange_.distance < size_) {
      int done = 0;
      if (MPI_Testall(2, exchange_.requests, &done, exchange_.statuses) != MPI_SUCCESS) {
        exchange_.abandoned = false;
        return true;
      }
      if (!done) return false;
      finish_round(c, seq);
    }
    exchange_.abandoned = false;
    // Every rank has arrived. Those whose exchange completed take the same decision as agree(), from the same
    // table: a transfer follows only if the fingerprints agree and the data did not ride with them.
    collect_table();
    for (int r = 0; r < size_; ++r)
      if (!same_call(table_[static_cast<size_t>(r)].record, table_[0].record) || table_[static_cast<size_t>(r)].error)
        return true;
    c.record = table_[0].record;
    const size_t bytes = c.count() * dtype_size(c.dtype());
    const bool fused = (c.kind() == kAllReduce || c.kind() == kAllReduceSum) && c.count() > 0 && bytes <= fused_max_bytes_;
    if (fused || c.count() == 0 || c.kind() == kBarrier) return true;
    // Zeros, in place: every form of transfer() accepts send == recv.
    const bool whole = c.kind() == kAllGather || c.kind() == kReduceScatter;  // size() blocks of count
    std::vector<char> scratch(whole ? bytes * static_cast<size_t>(size_) : bytes, 0);
    c.send = c.recv = scratch.data();
    std::string reason;
    {
      std::lock_guard<std::mutex> lock(reason_mutex_);
      reason = broken_reason_;
    }
    send_notice(kVoidNotice, seq, static_cast<int64_t>(c.kind()), reason);
    transfer(c, seq);
  } catch (const std::exception&) {
    exchange_.abandoned = false;  // MPI failed, or no memory for the zeros: nothing more can be done
  }
  return true;
}

void MpiCommunicator::check_void(const CommCall& c, uint64_t seq) {
  // One look: the notice was sent before its sender joined, so it came in before the data that ended the
  // transfer and waits in MPI's queue already (through another rank, it may not: the next call finds it).
  drain_notices(seq, 1);
  for (int r = 0; r < size_; ++r) {
    const auto i = static_cast<size_t>(r);
    if (timeout_notice_seq_[i] != static_cast<int64_t>(seq) && void_notice_seq_[i] != static_cast<int64_t>(seq))
      continue;
    const std::string reason = detail::concat("rank ", r, " had given up on ", collective_name(c.kind()), " #", seq,
                                              " and joined its transfer only to release this rank");
    mark(kFailed, reason);
    fail(Status::kRemote, where(c, seq), ": ", reason, ": the result is void");
  }
}

}  // namespace dpar
