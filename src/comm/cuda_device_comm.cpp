// See cuda_device_comm.h.
#include "comm/cuda_device_comm.h"

#include <cstring>

#include "common/error.h"
#include "kernels/cuda/kernels.h"
#include "platform/cuda/cuda_check.h"

namespace dpar {
namespace {

// What a participant publishes for one collective (gathered as kI64 over the thread group).
struct Record {
  Collective kind;
  int64_t count, dtype, op, root, contributes;
  int64_t send, recv;      // device pointers
  int64_t ready, done;     // cudaEvent_t: inputs complete; this participant's slice written
};
constexpr size_t kRecordWords = sizeof(Record) / sizeof(int64_t);
static_assert(sizeof(Record) == 10 * sizeof(int64_t));

using enum Collective;

// Participant r's slice [begin, end) of count elements: the threads backend's cut, 64-byte aligned.
std::pair<size_t, size_t> slice_of(size_t count, size_t esz, int rank, int n) {
  const size_t line = 64 / esz;
  size_t per = (count + static_cast<size_t>(n) - 1) / static_cast<size_t>(n);
  per = (per + line - 1) / line * line;
  const size_t begin = std::min(count, per * static_cast<size_t>(rank));
  return {begin, std::min(count, begin + per)};
}

// An argument check that fails before this participant arrives: release the others (they would wait for it until the
// timeout), then throw, as the threads backend's local_failure.
#define DPAR_LOCAL_CHECK(cond, ...)                                                   \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      const std::string dpar_msg_ = ::dpar::detail::concat(__VA_ARGS__);              \
      host_.abort(host_.name(rank_) + " failed: " + dpar_msg_);                       \
      ::dpar::fail(DPAR_ERR_INVALID_ARGUMENT, dpar_msg_);                             \
    }                                                                                 \
  } while (0)

template <class T>
T* ptr(int64_t v) {
  return reinterpret_cast<T*>(static_cast<intptr_t>(v));
}

class CudaDeviceCommunicator final : public Communicator {
 public:
  CudaDeviceCommunicator(ThreadGroup& host, int rank, int device, cudaStream_t stream)
      : host_(host), rank_(rank), device_(device), stream_(stream), comm_(host.communicator(rank)) {
    cuda::DeviceScope scope(device_);
    DPAR_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "device group: event");
    DPAR_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "device group: event");
  }
  ~CudaDeviceCommunicator() override {
    stop_async();
    cuda::DeviceScope scope(device_, std::nothrow);
    // Queued work may still wait for the events: let this participant's stream finish first.
    cudaStreamSynchronize(stream_);
    cudaEventDestroy(ready_);
    cudaEventDestroy(done_);
  }

  int rank() const override { return rank_; }
  int size() const override { return host_.size(); }
  const char* backend() const override { return "cuda-device"; }

  void all_reduce_sum(float* buffer, size_t count, bool contributes, float scale) override {
    sum("all_reduce_sum", kAllReduceSum, buffer, count, contributes, scale, 0);
  }
  void reduce_sum(float* buffer, size_t count, bool contributes, float scale, int root) override {
    check_root("reduce_sum", root);
    sum("reduce_sum", kReduceSum, buffer, count, contributes, scale, root);
  }

  void all_reduce(const void* send, void* recv, size_t count, CommDType dtype, ReduceOp op) override {
    static constexpr const char* kOp = "all_reduce";
    if (dtype != CommDType::kF32 || op != ReduceOp::kSum)
      fail(DPAR_ERR_NOT_SUPPORTED, kOp, ": the CUDA device group reduces f32 sums only, not ", comm_dtype_name(dtype),
           " ", reduce_op_name(op));
    DPAR_LOCAL_CHECK(count == 0 || (send != nullptr && recv != nullptr), kOp, ": null buffer");
    // Out of place: recv takes send's values first (on this stream, before the inputs-ready event).
    if (count != 0 && send != recv) {
      cuda::DeviceScope scope(device_);
      DPAR_CUDA_CHECK(cudaMemcpyAsync(recv, send, count * sizeof(float), cudaMemcpyDeviceToDevice, stream_), kOp);
    }
    sum(kOp, kAllReduce, static_cast<float*>(recv), count, true, 1.0f, 0);
  }

  void broadcast(void* buffer, size_t count, CommDType dtype, int root) override {
    static constexpr const char* kOp = "broadcast";
    check_root(kOp, root);
    const size_t esz = comm_dtype_size(dtype);
    DPAR_LOCAL_CHECK(count == 0 || buffer != nullptr, kOp, ": buffer is null");
    Record mine{kBroadcast, static_cast<int64_t>(count), static_cast<int64_t>(dtype), 0, root, 0, 0, 0, 0, 0};
    mine.recv = reinterpret_cast<intptr_t>(buffer);
    run(kOp, mine, [&](const std::vector<Record>& all) {
      // This participant copies its slice of root's buffer into every other participant's.
      const auto [begin, end] = slice_of(count, esz, rank_, size());
      if (begin == end) return;
      const char* src = ptr<const char>(all[root].recv) + begin * esz;
      for (int r = 0; r < size(); ++r)
        if (r != root)
          DPAR_CUDA_CHECK(cudaMemcpyAsync(ptr<char>(all[r].recv) + begin * esz, src, (end - begin) * esz,
                                          cudaMemcpyDeviceToDevice, stream_),
                          kOp, " slice to participant ", r);
    });
  }

  void all_gather(const void* send, void* recv, size_t count, CommDType dtype) override {
    static constexpr const char* kOp = "all_gather";
    const size_t esz = comm_dtype_size(dtype);
    DPAR_LOCAL_CHECK(count == 0 || (send != nullptr && recv != nullptr), kOp, ": null buffer");
    const size_t bytes = count * esz;
    DPAR_LOCAL_CHECK(send == static_cast<char*>(recv) + bytes * rank_ ||
                       static_cast<const char*>(send) + bytes <= static_cast<char*>(recv) ||
                       static_cast<char*>(recv) + bytes * size() <= static_cast<const char*>(send),
                   kOp, ": send overlaps recv without being its block (in place)");
    Record mine{kAllGather, static_cast<int64_t>(count), static_cast<int64_t>(dtype), 0, 0, 0, 0, 0, 0, 0};
    mine.send = reinterpret_cast<intptr_t>(send);
    mine.recv = reinterpret_cast<intptr_t>(recv);
    run(kOp, mine, [&](const std::vector<Record>& all) {
      // This participant copies every send into its own recv: it writes its own buffer only.
      for (int r = 0; r < size(); ++r) {
        char* dst = static_cast<char*>(recv) + bytes * r;
        if (bytes != 0 && dst != ptr<char>(all[r].send))
          DPAR_CUDA_CHECK(cudaMemcpyAsync(dst, ptr<const char>(all[r].send), bytes, cudaMemcpyDeviceToDevice, stream_),
                          kOp, " block of participant ", r);
      }
    });
  }

  void reduce(const void*, void*, size_t, CommDType, ReduceOp, int) override {
    fail(DPAR_ERR_NOT_SUPPORTED, "reduce: not supported by the CUDA device group (use reduce_sum)");
  }
  void reduce_scatter(const void*, void*, size_t, CommDType, ReduceOp) override {
    fail(DPAR_ERR_NOT_SUPPORTED, "reduce_scatter: not supported by the CUDA device group");
  }

  void barrier(const char* operation) override {
    Record mine{kBarrier, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    run(operation, mine, [](const std::vector<Record>&) {});
  }

  void abort(const std::string& reason) override { host_.abort(reason); }
  dpar_status async_error(std::string* reason) override { return comm_->async_error(reason); }

 protected:
  void prepare_thread() noexcept override {
    (void)cuda::bind_thread_to_device(device_);  // if it failed, each call's scope sets it
  }

 private:
  void check_root(const char* operation, int root) {
    DPAR_LOCAL_CHECK(root >= 0 && root < size(), operation, ": root ", root, " is not a participant (size ", size(),
                   ")");
  }

  void sum(const char* operation, Collective kind, float* buffer, size_t count, bool contributes, float scale,
           int root) {
    DPAR_LOCAL_CHECK(count == 0 || buffer != nullptr, operation, ": buffer is null");
    Record mine{kind, static_cast<int64_t>(count), static_cast<int64_t>(CommDType::kF32), 0, root, contributes, 0, 0,
                0, 0};
    mine.recv = reinterpret_cast<intptr_t>(buffer);
    run(operation, mine, [&](const std::vector<Record>& all) {
      // Every participant's buffer travels in the launch itself (no table in device memory to upload and keep in
      // step with the buffers).
      const int n = size();
      kernels::cuda::SumBuffers buffers{};
      buffers.count = n;
      for (int r = 0; r < n; ++r) {
        buffers.buffer[r] = ptr<float>(all[r].recv);
        if (all[r].contributes != 0) buffers.contributes |= uint64_t{1} << r;
      }
      const auto [begin, end] = slice_of(count, sizeof(float), rank_, n);
      kernels::cuda::sum_slice_into_all(buffers, static_cast<int64_t>(begin), static_cast<int64_t>(end), scale,
                                        stream_);
    });
  }

  // The collective's frame: publish the record and the ready event, agree, wait for every participant's inputs,
  // queue this participant's part, publish its done event, meet again, wait for every participant's part.
  template <class Part>
  void run(const char* operation, Record& mine, Part part) {
    cuda::DeviceScope scope(device_);
    DPAR_CUDA_CHECK(cudaEventRecord(ready_, stream_), operation, ": inputs-ready event");
    mine.ready = reinterpret_cast<intptr_t>(ready_);
    mine.done = reinterpret_cast<intptr_t>(done_);
    std::vector<Record> all(static_cast<size_t>(size()));
    comm_->all_gather(&mine, all.data(), kRecordWords, CommDType::kI64);
    check_records(operation, all);
    try {
      for (const auto& r : all)
        DPAR_CUDA_CHECK(cudaStreamWaitEvent(stream_, ptr<CUevent_st>(r.ready), 0), operation, ": wait for inputs");
      part(all);
      DPAR_CUDA_CHECK(cudaEventRecord(done_, stream_), operation, ": done event");
    } catch (const Error& e) {
      host_.abort(host_.name(rank_) + " failed in " + operation + ": " + e.what());
      throw;
    }
    comm_->barrier(operation);
    for (const auto& r : all)
      DPAR_CUDA_CHECK(cudaStreamWaitEvent(stream_, ptr<CUevent_st>(r.done), 0), operation, ": wait for the others");
  }

  // Every participant sees the same records, so all throw alike on a difference.
  void check_records(const char* operation, const std::vector<Record>& all) const {
    const Record& a = all[0];
    for (int r = 1; r < size(); ++r) {
      const Record& b = all[r];
      if (a.kind == b.kind && a.count == b.count && a.dtype == b.dtype && a.op == b.op && a.root == b.root) continue;
      auto describe = [](const Record& x) {
        return detail::concat(collective_name(x.kind), " of ", x.count, " ",
                              comm_dtype_name(static_cast<CommDType>(x.dtype)),
                              x.kind == kBroadcast || x.kind == kReduceSum ? " root " : "",
                              x.kind == kBroadcast || x.kind == kReduceSum ? std::to_string(x.root) : "");
      };
      fail(DPAR_ERR_MISMATCH, operation, ": participant ", r, " (", host_.name(r), ") called ", describe(b),
           " but participant 0 (", host_.name(0), ") called ", describe(a), " (seen by ", host_.name(rank_), ")");
    }
  }

  ThreadGroup& host_;
  int rank_;
  int device_;
  cudaStream_t stream_;
  std::unique_ptr<Communicator> comm_;  // the host side: records, barriers, timeouts, abort
  cudaEvent_t ready_ = nullptr, done_ = nullptr;
};

}  // namespace

CudaDeviceGroup::CudaDeviceGroup(std::vector<int> devices, std::vector<std::string> names,
                                 std::chrono::duration<double> timeout)
    : host_(std::move(names), timeout), devices_(std::move(devices)) {
  DPAR_CHECK_ARG(static_cast<int>(devices_.size()) == host_.size(), "device group: ", devices_.size(),
                 " devices for ", host_.size(), " names");
  // Each sum names every participant's buffer in its kernel's arguments, which have a fixed size.
  if (host_.size() > kernels::cuda::SumBuffers::kMaxBuffers)
    fail(DPAR_ERR_NOT_SUPPORTED, "device group: ", host_.size(), " participants; at most ",
         kernels::cuda::SumBuffers::kMaxBuffers, " replicas reduce in one GPU's memory");
}

std::unique_ptr<Communicator> CudaDeviceGroup::communicator(int rank, cudaStream_t stream) {
  DPAR_CHECK_ARG(rank >= 0 && rank < size(), "device group: rank ", rank, " out of range");
  return std::make_unique<CudaDeviceCommunicator>(host_, rank, devices_[static_cast<size_t>(rank)], stream);
}

}  // namespace dpar
