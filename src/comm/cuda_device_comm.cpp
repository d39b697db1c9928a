// See cuda_device_comm.h.
#include "comm/cuda_device_comm.h"

#include <cstring>

#include "common/error.h"
#include "kernels/cuda/kernels.h"
#include "platform/cuda/cuda_check.h"

namespace dpar {
namespace {

// What a participant publishes for one collective (gathered as kI64 over the thread group): the call's record, which
// all compare, and what the others need to do their part.
struct Record {
  CallRecord call;
  int64_t contributes;
  int64_t send, recv;      // device pointers
  int64_t ready, done;     // cudaEvent_t: inputs complete; this participant's slice written
};
constexpr size_t kRecordWords = sizeof(Record) / sizeof(int64_t);
static_assert(sizeof(Record) == 8 * sizeof(int64_t));

using enum Collective;

// Participant r's slice [begin, end) of count elements: the threads backend's cut, 64-byte aligned.
std::pair<size_t, size_t> slice_of(size_t count, size_t esz, int rank, int n) {
  const size_t line = 64 / esz;
  size_t per = (count + static_cast<size_t>(n) - 1) / static_cast<size_t>(n);
  per = (per + line - 1) / line * line;
  const size_t begin = std::min(count, per * static_cast<size_t>(rank));
  return {begin, std::min(count, begin + per)};
}

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
  // Its reductions are f32 and f64 sums: a bf16 gradient reduction is summed in f32 here (ReplicaSet's emulation).
  bool moves(DType dtype) const override { return dtype != DType::kBF16; }

  void abort(const std::string& reason) override { host_.abort(reason); }
  Status async_error(std::string* reason) override { return comm_->async_error(reason); }

 protected:
  void run(const CommCall& c) override {
    switch (c.kind()) {
      case kAllReduceSum:
      case kReduceSum:
      // reduce_sum and reduce_scatter_sum may leave any content in the rest of a buffer: the one pass that writes
      // every slice's sum into every buffer serves them all (block r of reduce_scatter_sum is all_reduce_sum's).
      case kReduceScatterSum: return sum(c, static_cast<float*>(c.recv), c.contributes);
      case kAllReduce: return all_reduce(c);
      case kBroadcast: return broadcast(c);
      case kAllGather: return all_gather(c);
      case kAllGatherBlocks: return all_gather_blocks(c);
      case kBarrier: {
        Record mine = record(c);
        return frame(c, mine, [](const std::vector<Record>&) {});
      }
      case kReduce:
      case kReduceScatter: break;
    }
    // Every participant that makes this call refuses it alike, without waiting: nobody is left behind.
    fail(Status::kNotSupported, c.operation, ": not supported by the CUDA device group (its reductions are f32 "
         "sums: all_reduce, all_reduce_sum, reduce_sum, reduce_scatter_sum)");
  }

  void prepare_thread() noexcept override {
    (void)cuda::bind_thread_to_device(device_);  // if it failed, each call's scope sets it
  }

 private:
  Record record(const CommCall& c) const {
    Record mine{};
    mine.call = c.record;
    mine.contributes = c.contributes;
    mine.send = reinterpret_cast<intptr_t>(c.send);
    mine.recv = reinterpret_cast<intptr_t>(c.recv);
    return mine;
  }

  void all_reduce(const CommCall& c) {
    // f64: SyncBatchNorm's per-channel sums over replicas that share a GPU.
    const bool f64 = c.dtype() == DType::kF64;
    if ((c.dtype() != DType::kF32 && !f64) || c.op() != ReduceOp::kSum)
      fail(Status::kNotSupported, c.operation, ": the CUDA device group reduces f32 and f64 sums only, not ",
           dtype_name(c.dtype()), " ", reduce_op_name(c.op()));
    // Out of place: recv takes send's values first (on this stream, before the inputs-ready event).
    if (c.count() != 0 && c.send != c.recv) {
      cuda::DeviceScope scope(device_);
      DPAR_CUDA_CHECK(cudaMemcpyAsync(c.recv, c.send, c.count() * dtype_size(c.dtype()),
                                      cudaMemcpyDeviceToDevice, stream_),
                      c.operation);
    }
    if (f64) return sum(c, static_cast<double*>(c.recv), true);
    sum(c, static_cast<float*>(c.recv), true);
  }

  void broadcast(const CommCall& c) {
    const size_t count = c.count(), esz = dtype_size(c.dtype());
    const int root = c.root();
    Record mine = record(c);
    frame(c, mine, [&](const std::vector<Record>& all) {
      // This participant copies its slice of root's buffer into every other participant's.
      const auto [begin, end] = slice_of(count, esz, rank_, size());
      if (begin == end) return;
      const char* src = ptr<const char>(all[root].recv) + begin * esz;
      for (int r = 0; r < size(); ++r)
        if (r != root)
          DPAR_CUDA_CHECK(cudaMemcpyAsync(ptr<char>(all[r].recv) + begin * esz, src, (end - begin) * esz,
                                          cudaMemcpyDeviceToDevice, stream_),
                          c.operation, " slice to participant ", r);
    });
  }

  void all_gather(const CommCall& c) {
    const size_t bytes = c.count() * dtype_size(c.dtype());
    // The others read this participant's send while it writes its recv: the one overlap that the call check
    // allows and this group does not is send == recv at a rank other than 0.
    if (bytes != 0 && c.send == c.recv && rank_ != 0)
      refuse(c, Error(Status::kNotSupported, detail::concat(c.operation, ": send == recv at rank ", rank_, " is "
                                                             "not supported by the CUDA device group (in place is "
                                                             "send == recv + rank * count)")));
    Record mine = record(c);
    frame(c, mine, [&](const std::vector<Record>& all) {
      // This participant copies every send into its own recv: it writes its own buffer only.
      for (int r = 0; r < size(); ++r) {
        char* dst = static_cast<char*>(c.recv) + bytes * r;
        if (bytes != 0 && dst != ptr<char>(all[r].send))
          DPAR_CUDA_CHECK(cudaMemcpyAsync(dst, ptr<const char>(all[r].send), bytes, cudaMemcpyDeviceToDevice, stream_),
                          c.operation, " block of participant ", r);
      }
    });
  }

  // Block r of participant r's buffer into every other buffer: this participant copies the others' blocks into its
  // own buffer (it writes its own buffer only, and reads blocks that their owners do not write).
  void all_gather_blocks(const CommCall& c) {
    Record mine = record(c);
    frame(c, mine, [&](const std::vector<Record>& all) {
      for (int r = 0; r < size(); ++r) {
        const auto [begin, end] = block_range(c.count(), size(), r);
        if (r == rank_ || begin == end) continue;
        DPAR_CUDA_CHECK(cudaMemcpyAsync(static_cast<float*>(c.recv) + begin, ptr<const float>(all[r].recv) + begin,
                                        (end - begin) * sizeof(float), cudaMemcpyDeviceToDevice, stream_),
                        c.operation, " block of participant ", r);
      }
    });
  }

  template <class T>
  void sum(const CommCall& c, T* buffer, bool contributes) {
    Record mine = record(c);
    mine.contributes = contributes;
    mine.recv = reinterpret_cast<intptr_t>(buffer);
    frame(c, mine, [&](const std::vector<Record>& all) {
      // Every participant's buffer travels in the launch itself (no table in device memory to upload and keep in
      // step with the buffers).
      const int n = size();
      kernels::cuda::SumBuffersOf<T> buffers{};
      buffers.count = n;
      for (int r = 0; r < n; ++r) {
        buffers.buffer[r] = ptr<T>(all[r].recv);
        if (all[r].contributes != 0) buffers.contributes |= uint64_t{1} << r;
      }
      const auto [begin, end] = slice_of(c.count(), sizeof(T), rank_, n);
      kernels::cuda::sum_slice_into_all(buffers, static_cast<int64_t>(begin), static_cast<int64_t>(end), c.scale,
                                        stream_);
    });
  }

  // The collective's frame: publish the record and the ready event, agree, wait for every participant's inputs,
  // queue this participant's part, publish its done event, meet again, wait for every participant's part.
  template <class Part>
  void frame(const CommCall& c, Record& mine, Part part) {
    const char* operation = c.operation;
    cuda::DeviceScope scope(device_);
    DPAR_CUDA_CHECK(cudaEventRecord(ready_, stream_), operation, ": inputs-ready event");
    mine.call.seq = ++seq_;
    mine.ready = reinterpret_cast<intptr_t>(ready_);
    mine.done = reinterpret_cast<intptr_t>(done_);
    std::vector<Record> all(static_cast<size_t>(size()));
    comm_->all_gather(&mine, all.data(), kRecordWords, DType::kI64);
    // Every participant sees the same records, so all throw alike on a difference.
    for (int r = 1; r < size(); ++r)
      if (!same_call(all[r].call, all[0].call)) fail_mismatch(operation, r, all[r].call, all[0].call);
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

  // A refused call does not arrive: the others are released, naming this participant.
  [[noreturn]] void refuse(const CommCall&, const Error& error) override {
    host_.abort(host_.name(rank_) + " failed: " + error.what());
    throw error;
  }

  ThreadGroup& host_;
  int rank_;
  int device_;
  cudaStream_t stream_;
  std::unique_ptr<Communicator> comm_;  // the host side: records, barriers, timeouts, abort
  cudaEvent_t ready_ = nullptr, done_ = nullptr;
  uint32_t seq_ = 0;  // this participant's collectives, for its records
};
}  // namespace

CudaDeviceGroup::CudaDeviceGroup(std::vector<int> devices, std::vector<std::string> names,
                                 std::chrono::duration<double> timeout)
    : host_(std::move(names), timeout), devices_(std::move(devices)) {
  DPAR_CHECK_ARG(static_cast<int>(devices_.size()) == host_.size(), "device group: ", devices_.size(),
                 " devices for ", host_.size(), " names");
  // Each sum names every participant's buffer in its kernel's arguments, which have a fixed size.
  if (host_.size() > kernels::cuda::SumBuffers::kMaxBuffers)
    fail(Status::kNotSupported, "device group: ", host_.size(), " participants; at most ",
         kernels::cuda::SumBuffers::kMaxBuffers, " replicas reduce in one GPU's memory");
}

std::unique_ptr<Communicator> CudaDeviceGroup::communicator(int rank, cudaStream_t stream) {
  DPAR_CHECK_ARG(rank >= 0 && rank < size(), "device group: rank ", rank, " out of range");
  return std::make_unique<CudaDeviceCommunicator>(host_, rank, devices_[static_cast<size_t>(rank)], stream);
}

}  // namespace dpar
