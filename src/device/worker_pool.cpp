#include "device/worker_pool.h"

#include <pthread.h>
#include <sched.h>

#include <chrono>
#include <vector>

namespace dpar {
namespace {
// Workers sleep on this deadline between jobs; it only bounds one futex sleep, not how long they idle.
Clock::time_point far_future() { return Clock::now() + std::chrono::hours(24 * 365); }
}  // namespace

void pin_to_cpu(size_t i) { pin_to_cpus(i, 1); }

void pin_to_cpus(size_t first, size_t count) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return;
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  if (cpus.empty()) return;
  cpu_set_t some;
  CPU_ZERO(&some);
  for (size_t j = 0; j < count && j < cpus.size(); ++j) CPU_SET(cpus[(first + j) % cpus.size()], &some);
  pthread_setaffinity_np(pthread_self(), sizeof some, &some);
}

WorkerPool::WorkerPool(size_t size, std::function<void(size_t)> on_start)
    : errors_(size), spin_(spin_policy(size + 1)) {
  threads_.reserve(size);
  try {
    for (size_t w = 0; w < size; ++w) threads_.emplace_back([this, w, on_start] { loop(w, on_start); });
  } catch (...) {
    stop_and_join();  // the threads already started must not outlive a pool that failed to construct
    throw;
  }
}

void WorkerPool::stop_and_join() {
  stopping_ = true;
  generation_.increment_and_wake();
  for (auto& t : threads_) t.join();
  threads_.clear();
}

namespace {
thread_local const WorkerPool* tl_pool = nullptr;  // the pool whose worker this thread is, if any
}  // namespace

bool on_worker_thread() { return tl_pool != nullptr; }

bool WorkerPool::on_own_thread() const { return tl_pool == this; }

WorkerPool::~WorkerPool() { stop_and_join(); }

std::vector<std::exception_ptr> WorkerPool::run_all(const std::function<void(size_t)>& job) {
  job_ = &job;
  for (auto& e : errors_) e = nullptr;
  uint32_t start_done = done_.load();
  // The release in the increment publishes job_ and errors_ to the workers.
  generation_.increment_and_wake();
  const uint32_t target = start_done + static_cast<uint32_t>(threads_.size());
  for (uint32_t seen = done_.load(); seen != target; seen = done_.load()) done_.wait_while_equal(seen, far_future(), spin_);
  job_ = nullptr;
  return errors_;
}

void WorkerPool::loop(size_t worker, const std::function<void(size_t)>& on_start) {
  tl_pool = this;
  // A worker that could not start (its device could not be made current, say) fails every job with the reason,
  // so that the caller hears it: an exception leaving the thread would end the process.
  std::exception_ptr start_error;
  if (on_start) {
    try {
      on_start(worker);
    } catch (...) {
      start_error = std::current_exception();
    }
  }
  // The generation every worker was created under; a job may already have been posted before this thread ran.
  uint32_t seen = 0;
  for (;;) {
    while (generation_.load() == seen) generation_.wait_while_equal(seen, far_future(), spin_);
    seen = generation_.load();
    if (stopping_) return;
    try {
      if (start_error) std::rethrow_exception(start_error);
      (*job_)(worker);
    } catch (...) {
      errors_[worker] = std::current_exception();
    }
    done_.increment_and_wake();
  }
}

}  // namespace dpar
