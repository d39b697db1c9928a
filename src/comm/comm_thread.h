// A participant's communication thread: the machinery behind Communicator::async_*.
//
// One thread per participant (per Communicator object), started by its first async_* call. It runs the queued
// operations one at a time, in the order they were queued, and completes each operation's Work with the
// operation's error, if any. The thread knows nothing of collectives: an operation is a std::function that calls
// the participant's blocking collective.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "comm/communicator.h"

namespace dpar::detail {

// The Work of one queued operation. test() is a single atomic load; wait() sleeps on the same atomic (C++20
// atomic wait: a short spin, then a futex), then rethrows the operation's exception.
class AsyncWork final : public Work {
 public:
  bool test() override { return done_.load(std::memory_order_acquire); }
  void wait() override;
  // Called once, by the communication thread. The error is written before `done_` is released.
  void finish(std::exception_ptr error) noexcept;

 private:
  std::atomic<bool> done_{false};
  std::exception_ptr error_;
};

class CommThread {
 public:
  // Starts the thread (throws std::system_error if it cannot). `on_error` runs on the communication thread after
  // an operation failed and before its Work completes (the Communicator uses it to abort the group); it must not
  // throw.
  // `on_start`, if given, runs first on the thread; it must not throw.
  explicit CommThread(std::function<void(const std::exception_ptr&)> on_error, std::function<void()> on_start = {});
  // Stops the thread as stop(nullptr) does, if stop() was not called.
  ~CommThread();
  CommThread(const CommThread&) = delete;
  CommThread& operator=(const CommThread&) = delete;

  // Queues `op`; its Work completes when it has run. Throws std::bad_alloc, or Error(INTERNAL) after stop().
  std::shared_ptr<Work> submit(std::function<void()> op);

  // Stops accepting operations and joins the thread. With `discard_reason` == nullptr the operations already
  // queued run first; otherwise those not yet started complete with Error(INTERNAL, discard_reason) without
  // running (for a Communicator whose derived part is already destroyed). An operation that is running is always
  // waited for.
  void stop(const char* discard_reason) noexcept;

 private:
  struct Task {
    std::function<void()> op;
    std::shared_ptr<AsyncWork> work;
  };
  void loop();

  std::function<void(const std::exception_ptr&)> on_error_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace dpar::detail
