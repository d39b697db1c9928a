#include "comm/comm_thread.h"

#include "common/error.h"

namespace dpar::detail {

void AsyncWork::wait() {
  done_.wait(false, std::memory_order_acquire);
  if (error_) std::rethrow_exception(error_);
}

void AsyncWork::finish(std::exception_ptr error) noexcept {
  error_ = std::move(error);
  done_.store(true, std::memory_order_release);
  // The communication thread holds a reference to this Work until after the notification, so a waiter that
  // wakes and drops its own reference cannot free the atomic under it.
  done_.notify_all();
}

CommThread::CommThread(std::function<void(const std::exception_ptr&)> on_error, std::function<void()> on_start)
    : on_error_(std::move(on_error)) {
  thread_ = std::thread([this, start = std::move(on_start)] {
    if (start) start();
    loop();
  });
}

CommThread::~CommThread() { stop(nullptr); }

std::shared_ptr<Work> CommThread::submit(std::function<void()> op) {
  auto work = std::make_shared<AsyncWork>();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    DPAR_ENFORCE(!stopping_, Status::kInternal, "communication thread: an operation was queued after stop");
    queue_.push_back(Task{std::move(op), work});
  }
  cv_.notify_one();
  return work;
}

void CommThread::stop(const char* discard_reason) noexcept {
  std::deque<Task> discarded;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    if (discard_reason) discarded.swap(queue_);
  }
  cv_.notify_one();
  for (auto& task : discarded) task.work->finish(std::make_exception_ptr(Error(Status::kInternal, discard_reason)));
  if (thread_.joinable()) thread_.join();
}

void CommThread::loop() {
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything queued has run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    std::exception_ptr error;
    try {
      task.op();
    } catch (...) {
      error = std::current_exception();
    }
    if (error) on_error_(error);
    task.work->finish(std::move(error));
  }
}

}  // namespace dpar::detail
