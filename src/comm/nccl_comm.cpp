// See nccl_comm.h.
#include "comm/nccl_comm.h"

#include <atomic>
#include <exception>
#include <mutex>
#include <thread>

#include "comm/nccl_internal.h"
#include "common/error.h"
#include "kernels/cuda/kernels.h"
#include "platform/cuda/cuda_check.h"
#include "platform/cuda/nccl_library.h"

namespace dpar {
namespace {

using namespace nccl_internal;

using enum Collective;

// A call's record (communicator.h), as all participants compare it: gathered as int64 words.
using Record = CallRecord;
constexpr size_t kRecordWords = sizeof(Record) / sizeof(int64_t);

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::kF32: return ncclFloat32;
    case DType::kF64: return ncclFloat64;
    case DType::kI32: return ncclInt32;
    case DType::kI64: return ncclInt64;
    case DType::kBF16: return ncclBfloat16;
    case DType::kF16: break;
  }
  fail(Status::kInvalidArgument, "nccl: unknown dtype ", static_cast<int>(dtype));
}

ncclRedOp_t nccl_op(DType dtype, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kMean:
      if (dtype != DType::kF32 && dtype != DType::kF64 && dtype != DType::kBF16)
        fail(Status::kNotSupported, "nccl: mean of ", dtype_name(dtype), " (ncclAvg is for floating types)");
      return ncclAvg;
  }
  fail(Status::kInvalidArgument, "nccl: unknown reduce op ", static_cast<int>(op));
}

}  // namespace

// The NCCL communicators of one process that fail together: a group's (one per GPU), or a process's single rank.
// When one participant fails, every one is aborted: a healthy rank's kernels would otherwise wait for the dead one
// forever. Each communicator has its own lock, held while its participant calls NCCL with it, so that an abort
// from another thread never frees it under a call. The locks are per communicator, never one for all: a
// participant's NCCL call may block until the others make theirs (NCCL connects peers inside the first calls), and
// a lock shared between them would then deadlock.
class NcclComms {
 public:
  // comms[i] is a communicator of GPU devices[i].
  NcclComms(std::vector<ncclComm_t> comms, std::vector<int> devices)
      : comms_(std::move(comms)), devices_(std::move(devices)), locks_(comms_.size()) {}
  // ncclCommAbort, not ncclCommDestroy: every participant has waited for its collectives by now (nothing is left to
  // flush), and NCCL's destroy may wait for the other ranks on the host to destroy theirs too, which would make
  // freeing an engine a collective between processes that free in their own order.
  ~NcclComms() {
    for (size_t i = 0; i < comms_.size(); ++i) abort_under_device(comms_[i], devices_[i]);
  }
  NcclComms(const NcclComms&) = delete;
  NcclComms& operator=(const NcclComms&) = delete;

  // Runs use(comm) with communicator `index`; false (use not run) once they have been aborted.
  template <class F>
  bool with(size_t index, F&& use) {
    std::lock_guard<std::mutex> lock(locks_[index]);
    if (aborted_.load()) {
      abort_locked(index);  // an abort that found this one in use left it to its participant
      return false;
    }
    use(comms_[index]);
    return true;
  }
  // Aborts every communicator that no participant is using now (ncclCommAbort ends their kernels and frees them);
  // the ones in use are aborted by their participant as its call returns. The first reason stays.
  void abort(const std::string& reason) {
    {
      std::lock_guard<std::mutex> lock(reason_mutex_);
      if (reason_.empty()) reason_ = reason;
    }
    aborted_.store(true);
    for (size_t i = 0; i < comms_.size(); ++i) {
      std::unique_lock<std::mutex> lock(locks_[i], std::try_to_lock);
      if (lock.owns_lock()) abort_locked(i);
    }
  }
  std::string reason() {
    std::lock_guard<std::mutex> lock(reason_mutex_);
    return reason_;
  }

 private:
  void abort_locked(size_t index) {
    abort_under_device(comms_[index], devices_[index]);
    comms_[index] = nullptr;
  }

  std::vector<ncclComm_t> comms_;  // comms_[i] under locks_[i]
  std::vector<int> devices_;
  std::vector<std::mutex> locks_;
  std::atomic<bool> aborted_{false};
  std::mutex reason_mutex_;
  std::string reason_;
};

namespace {

class NcclCommunicator final : public Communicator {
 public:
  // comms: the communicators that fail together, this participant's at `index`. host: the in-process group that
  // agrees fingerprints (null across processes). watch: a communicator over the same participants whose failures
  // stop this one too (null: none).
  NcclCommunicator(std::shared_ptr<NcclComms> comms, size_t index, ThreadGroup* host, int rank, int size, int device,
                   cudaStream_t compute, std::string name, std::chrono::duration<double> timeout,
                   std::shared_ptr<Communicator> watch = nullptr)
      : lib_(cuda::nccl()), comms_(std::move(comms)), index_(index), host_(host), watch_(std::move(watch)),
        rank_(rank), size_(size), device_(device), compute_(compute), name_(std::move(name)), timeout_(timeout) {
    if (host_ != nullptr) host_comm_ = host_->communicator(rank);
    cuda::DeviceScope scope(device_);
    DPAR_CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking), name_, ": communication stream");
    DPAR_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), name_, ": event");
    DPAR_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), name_, ": event");
    if (host_ == nullptr) {
      DPAR_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&records_), sizeof(Record) * size_), name_,
                      ": fingerprint buffer");
    }
  }
  ~NcclCommunicator() override {
    stop_async();
    try {
      cuda::DeviceScope scope(device_);
      release();
    } catch (...) {
      release();  // the device could not be made current: release what can be
    }
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend() const override { return "nccl"; }

  void abort(const std::string& reason) override {
    {
      std::lock_guard<std::mutex> lock(abort_mutex_);
      if (abort_reason_.empty()) abort_reason_ = reason;
    }
    aborted_.store(true);
    if (host_ != nullptr) {
      host_->abort(reason);
    } else {
      // Across processes no host group tells the others: the NCCL communicator itself is aborted, which ends this
      // rank's kernels now and shows the others an error instead of a rank that never comes.
      comms_->abort(reason);
    }
  }

  void prepare_thread() noexcept override {
    (void)cuda::bind_thread_to_device(device_);  // if it failed, each call's scope sets it
  }

  void run(const CommCall& c) override {
    const void* send = c.send;
    void* recv = c.recv;
    const size_t count = c.count();
    const DType dtype = c.dtype();
    switch (c.kind()) {
      case kAllReduce: {
        const ncclRedOp_t nop = nccl_op(dtype, c.op());
        return collective(c, [&] {
          nccl("ncclAllReduce", [&](ncclComm_t h) { return lib_.all_reduce(send, recv, count, nccl_type(dtype), nop, h, comm_stream_); });
        });
      }
      case kBroadcast:
        return collective(c, [&] {
          nccl("ncclBroadcast", [&](ncclComm_t h) { return lib_.broadcast(recv, recv, count, nccl_type(dtype), c.root(), h, comm_stream_); });
        });
      case kReduce: {
        const ncclRedOp_t nop = nccl_op(dtype, c.op());
        return collective(c, [&] {
          nccl("ncclReduce", [&](ncclComm_t h) { return lib_.reduce(send, recv, count, nccl_type(dtype), nop, c.root(), h, comm_stream_); });
        });
      }
      case kAllGather:
        return collective(c, [&] {
          nccl("ncclAllGather", [&](ncclComm_t h) { return lib_.all_gather(send, recv, count, nccl_type(dtype), h, comm_stream_); });
        });
      case kReduceScatter: {
        const ncclRedOp_t nop = nccl_op(dtype, c.op());
        return collective(c, [&] {
          nccl("ncclReduceScatter", [&](ncclComm_t h) { return lib_.reduce_scatter(send, recv, count, nccl_type(dtype), nop, h, comm_stream_); });
        });
      }
      case kBarrier: return collective(c, [] {});
      case kAllReduceSum:
      case kReduceSum: return sum(c);
      case kReduceScatterSum: return reduce_scatter_sum(c);
      case kAllGatherBlocks: return all_gather_blocks(c);
    }
    fail(Status::kInternal, c.operation, ": not a collective of the NCCL backend");
  }

  Status async_error(std::string* reason) override {
    if (broken_.load()) {
      *reason = name_ + "'s NCCL communicator was aborted by an earlier failure; create a new one";
      return Status::kInvalidState;
    }
    if (aborted_.load()) {
      std::lock_guard<std::mutex> lock(abort_mutex_);
      *reason = detail::concat(name_, " cannot run collectives: ", abort_reason_);
      return Status::kRemote;
    }
    for (Communicator* peers : {host_comm_.get(), watch_.get()}) {
      if (peers == nullptr) continue;
      const Status status = peers->async_error(reason);
      if (status != Status::kOk) return status;
    }
    // NCCL's own errors between collectives (a collective in flight polls them itself), and another participant's
    // failure, which aborted this one's NCCL communicator too.
    std::unique_lock<std::mutex> idle(call_mutex_, std::try_to_lock);
    if (idle.owns_lock()) {
      ncclResult_t got = ncclSuccess, async = ncclSuccess;
      if (!comms_->with(index_, [&](ncclComm_t c) { got = lib_.comm_get_async_error(c, &async); })) {
        *reason = detail::concat(name_, " cannot run collectives: ", comms_->reason());
        return Status::kRemote;
      }
      const ncclResult_t bad = got != ncclSuccess ? got : async;
      if (bad != ncclSuccess && bad != ncclInProgress) {
        *reason = detail::concat(name_, ": ncclCommGetAsyncError: ", lib_.error_string(bad));
        return Status::kCommunication;
      }
    }
    return Status::kOk;
  }

 private:
  // The communicator's CUDA resources, with its device current. (Its NCCL communicator goes with comms_.)
  void release() noexcept {
    if (!broken_) cudaStreamSynchronize(comm_stream_);
    if (records_ != nullptr) cudaFree(records_);
    if (pad_ != nullptr) cudaFree(pad_);
    cudaEventDestroy(ready_);
    cudaEventDestroy(done_);
    cudaStreamDestroy(comm_stream_);
  }

  void sum(const CommCall& call) {
    const char* operation = call.operation;
    float* buffer = static_cast<float*>(call.recv);
    const size_t count = call.count();
    const bool contributes = call.contributes;
    const float scale = call.scale;
    const int root = call.kind() == kReduceSum ? call.root() : -1;
    collective(call, [&] {
      if (count == 0) return;
      if (!contributes)
        DPAR_CUDA_CHECK(cudaMemsetAsync(buffer, 0, count * sizeof(float), comm_stream_), operation, ": ", name_);
      if (root < 0)
        nccl("ncclAllReduce", [&](ncclComm_t c) {
          return lib_.all_reduce(buffer, buffer, count, ncclFloat32, ncclSum, c, comm_stream_);
        });
      else
        nccl("ncclReduce", [&](ncclComm_t c) {
          return lib_.reduce(buffer, buffer, count, ncclFloat32, ncclSum, root, c, comm_stream_);
        });
      if (scale != 1.0f && (root < 0 || root == rank_))
        kernels::cuda::scale(buffer, scale, static_cast<int64_t>(count), comm_stream_);
    });
  }

  // ncclReduceScatter and ncclAllGather move equal blocks of count / size elements; Communicator::block_range's
  // blocks are ceil(count / size) rounded up to 16, so unless count is size() of them, the buffer is staged through a
  // padded copy (pad_, zeros past count) of size() full blocks. Returns the padded blocks' length, and whether to
  // stage.
  std::pair<size_t, bool> padded_blocks(size_t count) const {
    const size_t block = block_range(count, size_, 0).second;
    return {block, block * static_cast<size_t>(size_) != count};
  }
  float* reserve_pad(const char* operation, size_t elements) {
    if (elements > pad_elements_) {
      if (pad_ != nullptr) cudaFree(pad_);
      pad_ = nullptr;
      pad_elements_ = 0;
      DPAR_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&pad_), elements * sizeof(float)), operation, ": ", name_,
                      ": padded staging buffer");
      pad_elements_ = elements;
    }
    return pad_;
  }

  void reduce_scatter_sum(const CommCall& call) {
    const char* operation = call.operation;
    float* buffer = static_cast<float*>(call.recv);
    const size_t count = call.count();
    const auto [block, staged] = padded_blocks(count);
    const auto [begin, end] = block_range(count, size_, rank_);
    collective(call, [&] {
      if (count == 0) return;
      float* pad = staged ? reserve_pad(operation, block * static_cast<size_t>(size_)) : nullptr;
      float* whole = staged ? pad : buffer;
      if (!call.contributes) {
        DPAR_CUDA_CHECK(cudaMemsetAsync(whole, 0, block * size_ * sizeof(float), comm_stream_), operation, ": ", name_);
      } else if (staged) {
        DPAR_CUDA_CHECK(cudaMemcpyAsync(pad, buffer, count * sizeof(float), cudaMemcpyDeviceToDevice, comm_stream_),
                        operation, ": ", name_);
        DPAR_CUDA_CHECK(cudaMemsetAsync(pad + count, 0, (block * size_ - count) * sizeof(float), comm_stream_),
                        operation, ": ", name_);
      }
      float* mine = whole + block * static_cast<size_t>(rank_);  // in place, as NCCL takes it
      nccl("ncclReduceScatter", [&](ncclComm_t h) {
        return lib_.reduce_scatter(whole, mine, block, ncclFloat32, ncclSum, h, comm_stream_);
      });
      if (end > begin && staged)
        DPAR_CUDA_CHECK(cudaMemcpyAsync(buffer + begin, mine, (end - begin) * sizeof(float), cudaMemcpyDeviceToDevice,
                                        comm_stream_),
                        operation, ": ", name_);
      if (end > begin && call.scale != 1.0f)
        kernels::cuda::scale(buffer + begin, call.scale, static_cast<int64_t>(end - begin), comm_stream_);
    });
  }

  void all_gather_blocks(const CommCall& call) {
    const char* operation = call.operation;
    float* buffer = static_cast<float*>(call.recv);
    const size_t count = call.count();
    const auto [block, staged] = padded_blocks(count);
    const auto [begin, end] = block_range(count, size_, rank_);
    collective(call, [&] {
      if (count == 0) return;
      float* pad = staged ? reserve_pad(operation, block * static_cast<size_t>(size_)) : nullptr;
      float* whole = staged ? pad : buffer;
      float* mine = whole + block * static_cast<size_t>(rank_);
      if (staged && end > begin)
        DPAR_CUDA_CHECK(cudaMemcpyAsync(mine, buffer + begin, (end - begin) * sizeof(float), cudaMemcpyDeviceToDevice,
                                        comm_stream_),
                        operation, ": ", name_);
      nccl("ncclAllGather", [&](ncclComm_t h) {
        return lib_.all_gather(mine, whole, block, ncclFloat32, h, comm_stream_);
      });
      if (staged)
        DPAR_CUDA_CHECK(cudaMemcpyAsync(buffer, pad, count * sizeof(float), cudaMemcpyDeviceToDevice, comm_stream_),
                        operation, ": ", name_);
    });
  }

  template <class Enqueue>
  void collective(const CommCall& call, Enqueue enqueue) {
    const char* operation = call.operation;
    Record mine = call.record;
    std::lock_guard<std::mutex> lock(call_mutex_);
    DPAR_ENFORCE(!broken_, Status::kInvalidState, operation, ": ", name_,
                 "'s NCCL communicator was aborted by an earlier failure; create a new one");
    if (aborted_.load()) remote_failure(operation);
    check_peers(operation, true);
    cuda::DeviceScope scope(device_);
    mine.seq = ++seq_;
    agree(operation, mine);
    // The inputs: the communication stream waits for everything queued on the compute stream so far. The result:
    // this call returns once the host has seen it complete (wait), so whatever reads it is queued after it on any
    // stream. The compute stream is not made to wait on the GPU as well: that would hold back the backward kernels
    // queued meanwhile, which are what the collective overlaps with.
    try {
      DPAR_CUDA_CHECK(cudaEventRecord(ready_, compute_), operation, ": ", name_);
      DPAR_CUDA_CHECK(cudaStreamWaitEvent(comm_stream_, ready_, 0), operation, ": ", name_);
      enqueue();
      DPAR_CUDA_CHECK(cudaEventRecord(done_, comm_stream_), operation, ": ", name_);
      wait(operation);
    } catch (const std::exception& e) {
      // The others may already be waiting in this collective for this participant: they must not wait on.
      if (!broken_) give_up(detail::concat(name_, "'s ", operation, " failed: ", e.what()));
      throw;
    }
  }

  // Fingerprints: every participant gets every record and all decide alike.
  void agree(const char* operation, const Record& mine) {
    std::vector<Record> all(static_cast<size_t>(size_));
    if (host_comm_ != nullptr) {
      host_comm_->all_gather(&mine, all.data(), kRecordWords, DType::kI64);
    } else {
      DPAR_CUDA_CHECK(cudaMemcpyAsync(records_ + rank_, &mine, sizeof(Record), cudaMemcpyHostToDevice, comm_stream_),
                      operation, ": fingerprint");
      nccl("ncclAllGather (fingerprints)", [&](ncclComm_t c) {
        return lib_.all_gather(records_ + rank_, records_, kRecordWords, ncclInt64, c, comm_stream_);
      });
      DPAR_CUDA_CHECK(cudaEventRecord(done_, comm_stream_), operation, ": ", name_);
      wait(operation);
      DPAR_CUDA_CHECK(cudaMemcpy(all.data(), records_, sizeof(Record) * size_, cudaMemcpyDeviceToHost), operation,
                      ": fingerprint");
    }
    for (int r = 1; r < size_; ++r) {
      const Record& theirs = all[static_cast<size_t>(r)];
      if (!same_call(theirs, all[0])) fail_mismatch(operation, r, theirs, all[0]);
    }
  }

  // Until done_ has completed on the GPU.
  void wait(const char* operation) {
    poll(operation, "did not finish", [&](ncclResult_t) {
      const cudaError_t q = cuda::query_event(done_);  // "not ready" is not left for the next launch to find
      if (q == cudaSuccess || q == cudaErrorNotReady) return q == cudaSuccess;
      give_up(detail::concat(name_, "'s device failed: ", cudaGetErrorString(q)));
      cuda::fail_cuda(q, "cudaEventQuery", detail::concat(operation, ": ", name_));
    });
  }

  // Every wait of this participant: until done(state) says what it waits for is done (state: the communicator's
  // ncclCommGetAsyncError, ncclSuccess or ncclInProgress), polling meanwhile NCCL's asynchronous errors, abort()
  // (here, or of the in-process group), the other participants' failures and the deadline. Any failure aborts
  // every communicator of comms_. The communicator's lock is held for each poll only, so that an abort from
  // another thread reaches a call in progress between polls. `not_done` says what a timeout found.
  template <class Done>
  void poll(const char* operation, const char* not_done, Done done) {
    const auto deadline = deadline_after(timeout_);
    for (int spins = 0;; ++spins) {
      ncclResult_t got = ncclSuccess, state = ncclSuccess;
      if (!comms_->with(index_, [&](ncclComm_t c) { got = lib_.comm_get_async_error(c, &state); })) {
        broken_ = true;
        fail(Status::kRemote, operation, ": ", name_, " stopped because ", comms_->reason());
      }
      if (got != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
        const ncclResult_t bad = got != ncclSuccess ? got : state;
        give_up(detail::concat(name_, ": ncclCommGetAsyncError: ", lib_.error_string(bad)));
        cuda::fail_nccl(bad, "ncclCommGetAsyncError", detail::concat(operation, ": ", name_));
      }
      if (done(state)) return;
      if (aborted_.load()) {
        give_up(detail::concat(name_, " was aborted"));
        remote_failure(operation);
      }
      check_peers(operation, spins % 64 == 0);
      if (Clock::now() >= deadline) {
        give_up(detail::concat(name_, "'s ", operation, " ", not_done, " within ", timeout_.count(), " s"));
        fail(Status::kTimeout, operation, ": ", name_, "'s NCCL work ", not_done, " within ", timeout_.count(),
             " s (a participant did not arrive, or the transport stalled); the communicator was aborted");
      }
      if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  // This participant cannot go on: neither can the others, whose kernels may be waiting for it.
  void give_up(const std::string& why) {
    broken_ = true;
    comms_->abort(why);
  }

  // The in-process group's abort (another participant's, or the engine's) stops this participant too, and so does
  // a failure the watched communicator reports (`with_watch`: asking it may take a probe of the network, so a
  // waiting participant asks it on some of its polls only).
  void check_peers(const char* operation, bool with_watch) {
    std::string why;
    if (host_comm_ != nullptr && host_comm_->async_error(&why) != Status::kOk) {
      give_up(why);
      fail(Status::kRemote, operation, ": ", name_, " stopped because ", why);
    }
    if (with_watch && watch_ != nullptr && watch_->async_error(&why) != Status::kOk) {
      give_up(why);
      fail(Status::kRemote, operation, ": ", name_, " stopped because ", why);
    }
  }

  // One NCCL call on this participant's communicator; it fails with Error(REMOTE) once the communicators were
  // aborted. Every communicator is non-blocking, so a call may return ncclInProgress before its work is on the
  // stream (NCCL connects peers inside the first collectives, waiting for them on the host): it is waited for
  // here, so that what follows is ordered after it.
  template <class Call>
  void nccl(const char* what, Call call) {
    ncclResult_t r = ncclSuccess;
    if (!comms_->with(index_, [&](ncclComm_t c) { r = call(c); })) {
      broken_ = true;
      fail(Status::kRemote, what, ": ", name_, " stopped because ", comms_->reason());
    }
    // A call in progress: its host-side part is polled to its end (an error there throws in poll()).
    if (r == ncclInProgress)
      poll(what, "did not get onto the GPU", [](ncclResult_t state) { return state != ncclInProgress; });
    else
      DPAR_NCCL_CHECK(r, what, ": ", name_);
  }

  [[noreturn]] void remote_failure(const char* operation) {
    std::lock_guard<std::mutex> lock(abort_mutex_);
    fail(Status::kRemote, operation, ": ", name_, " stopped because ", abort_reason_);
  }

  const cuda::NcclLibrary& lib_;  // loaded before any communicator was made
  std::shared_ptr<NcclComms> comms_;
  size_t index_;
  ThreadGroup* host_;
  std::unique_ptr<Communicator> host_comm_;
  std::shared_ptr<Communicator> watch_;
  int rank_, size_, device_;
  cudaStream_t compute_;
  std::string name_;
  std::chrono::duration<double> timeout_;
  cudaStream_t comm_stream_ = nullptr;
  cudaEvent_t ready_ = nullptr, done_ = nullptr;
  Record* records_ = nullptr;  // device: the fingerprints across processes
  float* pad_ = nullptr;       // device: reduce_scatter_sum's and all_gather_blocks' padded blocks
  size_t pad_elements_ = 0;
  std::mutex call_mutex_;
  uint32_t seq_ = 0;
  std::atomic<bool> broken_{false};  // read by async_error from any thread
  std::atomic<bool> aborted_{false};
  std::mutex abort_mutex_;
  std::string abort_reason_;
};

}  // namespace

NcclGroup::NcclGroup(std::vector<int> devices, std::vector<std::string> names, std::chrono::duration<double> timeout)
    : host_(std::move(names), timeout), timeout_(timeout), devices_(std::move(devices)) {
  DPAR_CHECK_ARG(static_cast<int>(devices_.size()) == host_.size(), "nccl group: ", devices_.size(), " devices for ",
                 host_.size(), " names");
  for (size_t i = 0; i < devices_.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      DPAR_CHECK_ARG(devices_[i] != devices_[j], "nccl group: device ", devices_[i],
                     " is named twice (NCCL refuses two ranks on one GPU: use the CUDA device group)");
  comms_ = std::make_shared<NcclComms>(init_group(devices_, timeout_), devices_);
}

NcclGroup::~NcclGroup() = default;

std::unique_ptr<Communicator> NcclGroup::communicator(int rank, cudaStream_t compute_stream) {
  DPAR_CHECK_ARG(rank >= 0 && rank < size(), "nccl group: rank ", rank, " out of range");
  return std::make_unique<NcclCommunicator>(comms_, static_cast<size_t>(rank), &host_, rank, size(), devices_[rank],
                                            compute_stream, host_.name(rank), timeout_);
}

ncclUniqueId nccl_unique_id() {
  ncclUniqueId id{};
  DPAR_NCCL_CHECK(cuda::nccl().get_unique_id(&id), "an id for an NCCL communicator across processes");
  return id;
}

std::unique_ptr<Communicator> nccl_rank_communicator(const ncclUniqueId& id, int nranks, int rank, int device,
                                                     cudaStream_t compute_stream, std::string name,
                                                     std::chrono::duration<double> timeout,
                                                     std::chrono::duration<double> join_within,
                                                     std::shared_ptr<Communicator> watch) {
  DPAR_CHECK_ARG(nranks >= 1 && rank >= 0 && rank < nranks, "nccl: rank ", rank, " of ", nranks);
  cuda::DeviceScope scope(device);
  // Non-blocking: a blocking ncclCommInitRank waits for every rank without a limit, so a rank that failed before
  // joining would hold the others there for good. Here the creation is polled under the timeout and the watch, and
  // aborted when either ends it.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t r = cuda::nccl().comm_init_rank_config(&comm, nranks, id, rank, &config);
  const auto deadline = deadline_after(join_within);
  Status gave_up = Status::kOk;  // TIMEOUT, or the watch's failure
  std::string why;
  while (r == ncclInProgress && gave_up == Status::kOk) {
    r = settle(comm, deadline_after(std::chrono::milliseconds(1)));
    if (r != ncclInProgress) break;
    if (watch != nullptr && watch->async_error(&why) != Status::kOk) {
      gave_up = Status::kRemote;
    } else if (Clock::now() >= deadline) {
      gave_up = Status::kTimeout;
      why = detail::concat("not every rank joined within ", join_within.count(), " s");
    }
  }
  if (r != ncclSuccess) {
    abort_under_device(comm, device);
    if (gave_up != Status::kOk) fail(gave_up, name, ": ncclCommInitRankConfig, rank ", rank, " of ", nranks, ": ", why);
    DPAR_NCCL_CHECK(r, name, ": rank ", rank, " of ", nranks);
  }
  auto comms = std::make_shared<NcclComms>(std::vector<ncclComm_t>{comm}, std::vector<int>{device});  // aborts it
  return std::make_unique<NcclCommunicator>(std::move(comms), 0, nullptr, rank, nranks, device, compute_stream,
                                            std::move(name), timeout, std::move(watch));
}

}  // namespace dpar
