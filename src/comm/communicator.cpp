// The parts of Communicator that every backend shares: dtype, op and collective names, and the asynchronous forms.
//
// async_*: each participant (Communicator object) has at most one communication thread, started by its first
// async_* call (detail::CommThread). It runs the blocking collectives queued on it in FIFO order; since every
// participant queues its collectives in its program order, the threads of a group meet in the same order as
// blocking callers would, with the same fingerprints, timeouts and aborts.
//
// Lifetime: the thread calls the derived class's virtual collectives through `this`. The base destructor runs
// after the derived part is destroyed, when those calls would reach freed members (or a pure virtual), so each
// derived destructor calls stop_async() first: the operations still queued run while the whole object is alive,
// then the thread is joined. ~Communicator calls the same machinery only to catch a derived class that did not:
// with a derived part already gone it must not run anything, so it fails the queued operations unrun.
#include "comm/communicator.h"

#include <algorithm>

#include <system_error>

#include "comm/comm_thread.h"
#include "common/error.h"

namespace dpar {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMean: return "mean";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "unknown op";
}

const char* collective_name(Collective kind) {
  switch (kind) {
    case Collective::kBarrier: return "barrier";
    case Collective::kAllReduceSum: return "all_reduce_sum";
    case Collective::kReduceSum: return "reduce_sum";
    case Collective::kAllReduce: return "all_reduce";
    case Collective::kBroadcast: return "broadcast";
    case Collective::kReduce: return "reduce";
    case Collective::kAllGather: return "all_gather";
    case Collective::kReduceScatter: return "reduce_scatter";
    case Collective::kReduceScatterSum: return "reduce_scatter_sum";
    case Collective::kAllGatherBlocks: return "all_gather_blocks";
  }
  return "unknown collective";
}

Communicator::Communicator() = default;

void Communicator::set_timeout(std::chrono::duration<double>) {
  fail(Status::kNotSupported, "the ", backend(), " backend's timeout is fixed when it is created");
}

std::unique_ptr<Communicator> Communicator::duplicate() {
  fail(Status::kNotSupported, "the ", backend(), " backend does not duplicate its communicators");
}

Communicator::~Communicator() {
  // Normally null: the derived destructor's stop_async() has joined the thread.
  if (async_)
    async_->stop(
        "the communicator was destroyed before this asynchronous collective ran (its backend did not "
        "call stop_async())");
}

void Communicator::stop_async() noexcept {
  std::unique_ptr<detail::CommThread> thread;
  {
    std::lock_guard<std::mutex> lock(async_mutex_);
    thread = std::move(async_);
  }
  if (thread) thread->stop(nullptr);
}

std::shared_ptr<Work> Communicator::submit_async(const char* operation, std::function<void()> op) {
  try {
    std::lock_guard<std::mutex> lock(async_mutex_);
    if (!async_) {
      auto on_error = [this](const std::exception_ptr& error) {
        // REMOTE, TIMEOUT and MISMATCH: every participant concerned already knows (the group is aborted, or they
        // all decided alike; aborting after a mismatch would turn a slower participant's MISMATCH into REMOTE).
        // Any other failure is local: this participant will not arrive, so release the others.
        try {
          std::rethrow_exception(error);
        } catch (const Error& e) {
          if (e.status() == Status::kRemote || e.status() == Status::kTimeout || e.status() == Status::kMismatch)
            return;
          abort(std::string("async ") + e.what());
        } catch (const std::exception& e) {
          abort(std::string("async collective failed: ") + e.what());
        } catch (...) {
          abort("async collective failed: unknown exception");
        }
      };
      async_ = std::make_unique<detail::CommThread>(std::move(on_error), [this] { prepare_thread(); });
    }
    return async_->submit(std::move(op));
  } catch (const std::system_error& e) {
    // The operation is not queued: the others would wait for it.
    abort(detail::concat("async_", operation, ": cannot start the communication thread: ", e.what()));
    fail(Status::kCommunication, "async_", operation, ": cannot start the communication thread: ", e.what());
  } catch (const std::bad_alloc&) {
    abort(detail::concat("async_", operation, ": out of memory"));
    throw;
  }
}

std::shared_ptr<Work> Communicator::async_all_reduce(const void* send, void* recv, size_t count, DType dtype,
                                                     ReduceOp op) {
  return submit_async("all_reduce", [=, this] { all_reduce(send, recv, count, dtype, op); });
}

std::shared_ptr<Work> Communicator::async_run(const char* operation, std::function<void()> op) {
  return submit_async(operation, std::move(op));
}

std::shared_ptr<Work> Communicator::async_broadcast(void* buffer, size_t count, DType dtype, int root) {
  return submit_async("broadcast", [=, this] { broadcast(buffer, count, dtype, root); });
}

std::shared_ptr<Work> Communicator::async_reduce(const void* send, void* recv, size_t count, DType dtype,
                                                 ReduceOp op, int root) {
  return submit_async("reduce", [=, this] { reduce(send, recv, count, dtype, op, root); });
}

std::shared_ptr<Work> Communicator::async_all_gather(const void* send, void* recv, size_t count, DType dtype) {
  return submit_async("all_gather", [=, this] { all_gather(send, recv, count, dtype); });
}

std::shared_ptr<Work> Communicator::async_reduce_scatter(const void* send, void* recv, size_t count, DType dtype,
                                                         ReduceOp op) {
  return submit_async("reduce_scatter", [=, this] { reduce_scatter(send, recv, count, dtype, op); });
}

std::shared_ptr<Work> Communicator::async_reduce_scatter_sum(float* buffer, size_t count, bool contributes,
                                                             float scale) {
  return submit_async("reduce_scatter_sum",
                      [=, this] { reduce_scatter_sum(buffer, count, contributes, scale); });
}

std::shared_ptr<Work> Communicator::async_all_gather_blocks(float* buffer, size_t count) {
  return submit_async("all_gather_blocks", [=, this] { all_gather_blocks(buffer, count); });
}

}  // namespace dpar
