// Waiting between threads on one machine: spin briefly, then yield, then sleep in the kernel (futex).
// Worker threads hand work to each other every few microseconds, so a sleep and a wake on every hand-off would
// dominate small steps. But a spinning waiter holds a core: when there are more threads than cores it takes the
// core that the thread it waits for needs. So the owner of a WaitWord says whether spinning pays (Spin).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>

namespace dpar {

using Clock = std::chrono::steady_clock;

// How a waiter spends the time before it sleeps.
enum class Spin {
  kYes,  // spin up to ~20 us: the threads that must arrive have cores of their own
  kNo,   // more runnable threads than cores: yield a few times, then sleep
};

// The number of CPUs this process may run on (its affinity mask).
size_t available_cpus();
// kYes when `threads` busy threads fit on the available CPUs.
Spin spin_policy(size_t threads);

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
  bool wait_while_equal(uint32_t seen, Clock::time_point deadline, Spin spin) const;

 private:
  void wake();
  std::atomic<uint32_t> word_;
  mutable std::atomic<int32_t> sleepers_{0};
};

}  // namespace dpar
