// One worker thread per device. The engine hands every worker the same job at once (run_all) and waits for all of
// them; each worker runs all of its device's work, so a replica's state is only ever touched by its own thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/sync.h"

namespace dpar {

// Binds the calling thread to the i-th CPU (mod their number) of the process's affinity mask. Best effort: a
// failure leaves the thread where it is.
void pin_to_cpu(size_t i);
// Binds the calling thread to `count` CPUs of that mask from the first-th on (mod their number; all of them when
// count >= their number). Threads it starts later inherit the set: a worker's own GEMM threads run beside it, not
// on its one core.
void pin_to_cpus(size_t first, size_t count);

// True on a thread that a WorkerPool runs: callbacks from the engine run there, and must not call the engine.
bool on_worker_thread();

class WorkerPool {
 public:
  // Starts `size` threads. `on_start(worker)` runs first on each thread (e.g. to set per-thread BLAS state); if it
  // throws, every job of that worker fails with its exception.
  WorkerPool(size_t size, std::function<void(size_t)> on_start);
  ~WorkerPool();  // finishes the job in flight, then joins
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  size_t size() const { return threads_.size(); }
  // True on one of this pool's own threads (joining the pool from there would wait forever).
  bool on_own_thread() const;

  // Runs job(worker) on every worker and waits for all. Returns each worker's exception (null where it succeeded):
  // one worker's failure never stops the others from finishing, so the caller always gets control back.
  std::vector<std::exception_ptr> run_all(const std::function<void(size_t)>& job);

 private:
  void loop(size_t worker, const std::function<void(size_t)>& on_start);
  void stop_and_join();

  std::vector<std::thread> threads_;
  const std::function<void(size_t)>* job_ = nullptr;  // valid while a run_all is in flight
  std::vector<std::exception_ptr> errors_;
  WaitWord generation_;  // bumped to start a job; workers wait on it
  WaitWord done_;        // counts workers that finished the current job
  Spin spin_;            // whether the workers and the caller (size + 1 threads) fit on the cores
  std::atomic<bool> stopping_{false};
};

}  // namespace dpar
