// Waiting between threads on one machine: spin briefly, then yield, then sleep in the kernel (futex).
// Worker threads hand work to each other every few microseconds, so a condition variable's sleep/wake on every
// hand-off would dominate small steps; pure spinning would starve the threads that do the work when there are
// more workers than cores. This does both in order, and every sleep has a deadline.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace dpar {

using Clock = std::chrono::steady_clock;

// A 32-bit word that threads wait on until it differs from a value they saw.
class WaitWord {
 public:
  explicit WaitWord(uint32_t initial = 0) : word_(initial) {}

  uint32_t load() const { return word_.load(std::memory_order_acquire); }
  // Stores a new value and wakes every sleeper.
  void store_and_wake(uint32_t value);
  // Adds one (returning the new value) and wakes every sleeper.
  uint32_t increment_and_wake();
  // Waits until the word differs from `seen` or until `deadline`; returns false on timeout.
  bool wait_while_equal(uint32_t seen, Clock::time_point deadline) const;

 private:
  void wake();
  std::atomic<uint32_t> word_;
  mutable std::atomic<int32_t> sleepers_{0};
};

}  // namespace dpar
