#include "common/sync.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <ctime>

namespace dpar {
namespace {

// Spinning is bounded by time, not by a count of pauses: a PAUSE takes from 5 to over 40 ns depending on the CPU.
// 20 us catches a peer that is a little behind (small load imbalance) without sleeping; shorter spins made a
// 2-thread all-reduce of 4 MiB sleep on ordinary imbalance and cost a third more.
constexpr auto kSpinTime = std::chrono::microseconds(20);
constexpr int kPausesPerClockRead = 8;
constexpr int kYieldIterations = 4;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

long futex(const std::atomic<uint32_t>* addr, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<const uint32_t*>(addr), op, value, timeout, nullptr, 0);
}

}  // namespace

void WaitWord::wake() {
  // The sleeper increments sleepers_ before its last check of word_, and the futex checks word_ again in the
  // kernel, so a store that happens before this load cannot be missed (both sides are seq_cst).
  if (sleepers_.load(std::memory_order_seq_cst) > 0) futex(&word_, FUTEX_WAKE_PRIVATE, INT_MAX, nullptr);
}

void WaitWord::store_and_wake(uint32_t value) {
  word_.store(value, std::memory_order_seq_cst);
  wake();
}

uint32_t WaitWord::increment_and_wake() {
  uint32_t now = word_.fetch_add(1, std::memory_order_seq_cst) + 1;
  wake();
  return now;
}

size_t available_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  const int n = CPU_COUNT(&set);
  return n > 0 ? static_cast<size_t>(n) : 1;
}

Spin spin_policy(size_t threads) { return threads <= available_cpus() ? Spin::kYes : Spin::kNo; }

bool WaitWord::wait_while_equal(uint32_t seen, Clock::time_point deadline, Spin spin) const {
  if (spin == Spin::kYes) {
    const auto spin_until = Clock::now() + kSpinTime;
    do {
      for (int i = 0; i < kPausesPerClockRead; ++i) {
        if (word_.load(std::memory_order_acquire) != seen) return true;
        cpu_relax();
      }
    } while (Clock::now() < spin_until);
  }
  for (int i = 0; i < kYieldIterations; ++i) {
    if (word_.load(std::memory_order_acquire) != seen) return true;
    sched_yield();
  }
  for (;;) {
    auto now = Clock::now();
    if (now >= deadline) return word_.load(std::memory_order_acquire) != seen;
    auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - now).count();
    // Sleep at most 100 ms at a time so that a deadline is noticed promptly even if a wake is lost.
    if (left > 100'000'000) left = 100'000'000;
    timespec ts{static_cast<time_t>(left / 1'000'000'000), static_cast<long>(left % 1'000'000'000)};
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    if (word_.load(std::memory_order_seq_cst) != seen) {
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      return true;
    }
    futex(&word_, FUTEX_WAIT_PRIVATE, seen, &ts);
    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    if (word_.load(std::memory_order_acquire) != seen) return true;
  }
}

}  // namespace dpar
