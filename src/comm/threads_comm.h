// The threads backend: participants are threads of one process and buffers are in shared memory.
//
// all_reduce_sum is one pass: after a barrier (every buffer is ready), participant r sums its own slice of every
// participant's buffer and writes the result into that slice of all of them; a second barrier makes the result
// visible to all. Every byte is read once and written once per participant: the lower bound for this operation,
// and no participant does more than 1/size of the work (not "thread 0 sums everything").
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "common/sync.h"

namespace dpar {

class ThreadGroup {
 public:
  // names[r] names participant r in messages ("replica 2 (cpu:2)").
  ThreadGroup(std::vector<std::string> names, std::chrono::duration<double> timeout);

  int size() const { return static_cast<int>(names_.size()); }
  // Makes an aborted group usable again. Only while no participant is inside a collective.
  void reset();
  bool aborted() const { return aborted_.load(std::memory_order_acquire); }
  // Every participant waiting now or later throws Error(REMOTE) with `reason` (the first reason is kept).
  void abort(const std::string& reason);

  // Participant `rank`'s view. The group must outlive it.
  std::unique_ptr<Communicator> communicator(int rank);

 private:
  friend class ThreadCommunicator;
  struct alignas(64) Slot {
    float* buffer = nullptr;
    bool contributes = false;
    std::atomic<uint64_t> arrivals{0};  // barriers this participant has entered: names who is missing
  };

  void arrive_and_wait(int rank, const char* operation);

  std::vector<std::string> names_;
  std::chrono::duration<double> timeout_;
  Spin spin_;  // whether all participants fit on the cores
  std::vector<Slot> slots_;
  alignas(64) std::atomic<uint32_t> arrived_{0};
  alignas(64) WaitWord generation_;
  std::atomic<bool> aborted_{false};
  std::mutex abort_mutex_;
  std::string abort_reason_;
};

}  // namespace dpar
