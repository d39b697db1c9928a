#include "backend/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "comm/cuda_device_comm.h"
#include "comm/nccl_comm.h"
#include "common/error.h"
#include "device/worker_pool.h"
#include "kernels/cuda/kernels.h"
#include "platform/cuda/cublas_library.h"
#include "platform/cuda/cuda_check.h"

namespace dpar {
namespace {
namespace k = kernels::cuda;

// ---- The caching allocator -------------------------------------------------------------------------------------
// One per GPU. Sizes are rounded (512 B granules up to 1 MiB, 2 MiB granules above), and a freed block waits in
// its size class for the next allocation of that class: a training loop allocates the same sizes every step, so
// after the first step no allocation reaches the driver. When cudaMalloc fails, the cache is emptied and the
// allocation tried once more before OUT_OF_MEMORY is reported.
//
// A block freed by one stream may be handed to another replica's stream on the same GPU, so a free first waits
// for the device's work in flight (frees are rare: an engine's buffers live as long as it does, and its staging
// buffers only grow).
class CachingAllocator {
 public:
  explicit CachingAllocator(int device) : device_(device) {}

  void* allocate(size_t bytes) {
    const size_t size = round_size(bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = cache_.find(size);
    if (it != cache_.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      in_use_[p] = size;
      ++stats_.cached_reuses;
      return p;
    }
    void* p = nullptr;
    cudaError_t rc = cudaMalloc(&p, size);
    if (rc == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // clear the sticky-free error state of the failed call
      release_cache_locked();
      rc = cudaMalloc(&p, size);
    }
    if (rc == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      fail(Status::kOutOfMemory, "cuda:", device_, ": out of device memory allocating ", bytes, " bytes (",
           stats_.bytes_reserved, " bytes held by dpar)");
    }
    DPAR_CUDA_CHECK(rc, "cudaMalloc of ", bytes, " bytes on cuda:", device_);
    ++stats_.device_mallocs;
    stats_.bytes_reserved += size;
    in_use_[p] = size;
    return p;
  }

  void deallocate(void* p) noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = in_use_.find(p);
    if (it == in_use_.end()) return;
    // Work queued on any stream of this GPU may still read or write the block (see the class comment).
    cuda::DeviceScope scope(device_, std::nothrow);
    (void)cudaDeviceSynchronize();
    cache_[it->second].push_back(p);
    in_use_.erase(it);
  }

  CudaAllocatorStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }

 private:
  static size_t round_size(size_t bytes) {
    constexpr size_t kSmall = 512, kLarge = size_t{2} << 20, kLargeFrom = size_t{1} << 20;
    if (bytes == 0) bytes = 1;
    return bytes < kLargeFrom ? (bytes + kSmall - 1) / kSmall * kSmall : (bytes + kLarge - 1) / kLarge * kLarge;
  }
  void release_cache_locked() noexcept {
    cuda::DeviceScope scope(device_, std::nothrow);
    (void)cudaDeviceSynchronize();
    for (auto& [size, blocks] : cache_) {
      for (void* p : blocks) {
        (void)cudaFree(p);
        ++stats_.device_frees;
        stats_.bytes_reserved -= size;
      }
      blocks.clear();
    }
  }

  int device_;
  std::mutex mutex_;
  std::map<size_t, std::vector<void*>> cache_;  // size class -> free blocks
  std::unordered_map<void*, size_t> in_use_;
  CudaAllocatorStats stats_;
};

using cuda::cublas;
using cuda::CublasLibrary;
using cuda::DeviceScope;

// ---- A replica's stream -----------------------------------------------------------------------------------------
class CudaStream final : public Stream {
 public:
  // A stream of its own (a replica's).
  explicit CudaStream(Device device) : Stream(device) {
    DeviceScope scope(device.index);
    // Non-blocking: the legacy default stream (used by nothing in dpar) does not serialise it with the others.
    DPAR_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags on ",
               device.str());
    owns_stream_ = true;
    finish_setup();
  }
  // The caller's stream (nullptr: the legacy default stream), used and never destroyed. The caller's thread may
  // have another device current: every operation makes the stream's device current for its span.
  CudaStream(Device device, cudaStream_t borrowed) : Stream(device), stream_(borrowed), borrowed_(true) {
    DeviceScope scope(device.index);
    finish_setup();
  }
  ~CudaStream() override {
    DeviceScope scope(device().index, std::nothrow);
    // A borrowed stream is the caller's, with the caller's work on it: wait only for the copy out of the pinned
    // buffer freed below. Its own stream may hold anything this Stream queued.
    if (borrowed_)
      (void)cudaEventSynchronize(staged_);
    else
      (void)cudaStreamSynchronize(stream_);
    if (pinned_) (void)cudaFreeHost(pinned_);
    if (sum_scratch_) (void)cudaFree(sum_scratch_);
    (void)cudaEventDestroy(staged_);
    if (blas_) (void)cublas().destroy(blas_);
    if (owns_stream_) (void)cudaStreamDestroy(stream_);
  }

  cudaStream_t handle() const { return stream_; }

  void copy_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t rows) override {
    const auto scope = enter();
    if (width && rows)
      DPAR_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, cudaMemcpyDefault, stream_),
                      "strided copy on ", device().str());
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    const auto scope = enter();
    if (bytes && dst != src)
      // cudaMemcpyDefault: the pointers say where each side is (unified addressing), so that a copy between two
      // GPUs goes peer to peer where it can and through the host where it cannot.
      DPAR_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_), "copy on ", device().str());
  }
  void copy_from_host(void* dst, const void* host_src, size_t bytes) override {
    const auto scope = enter();
    if (!bytes) return;
    // Through a pinned buffer, so that the copy is asynchronous and the caller may reuse its memory at once. The
    // buffer is reused once the previous copy out of it has finished.
    DPAR_CUDA_CHECK(cudaEventSynchronize(staged_), "waiting for the previous host-to-device copy on ", device().str());
    if (pinned_bytes_ < bytes) {
      if (pinned_) DPAR_CUDA_CHECK(cudaFreeHost(pinned_), "cudaFreeHost");
      pinned_ = nullptr;
      pinned_bytes_ = 0;
      DPAR_CUDA_CHECK(cudaMallocHost(&pinned_, bytes), "cudaMallocHost of ", bytes, " bytes");
      pinned_bytes_ = bytes;
    }
    std::memcpy(pinned_, host_src, bytes);
    DPAR_CUDA_CHECK(cudaMemcpyAsync(dst, pinned_, bytes, cudaMemcpyHostToDevice, stream_), "host-to-device copy on ",
               device().str());
    DPAR_CUDA_CHECK(cudaEventRecord(staged_, stream_), "cudaEventRecord");
  }
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override {
    const auto scope = enter();
    if (!bytes) return;
    DPAR_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "device-to-host copy on ",
               device().str());
    synchronize();
  }
  void fill_zero(void* dst, size_t bytes) override {
    const auto scope = enter();
    if (bytes) DPAR_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, stream_), "fill on ", device().str());
  }
  void synchronize() override {
    const auto scope = enter();
    DPAR_CUDA_CHECK(cudaStreamSynchronize(stream_), device().str(), ": the device failed while running queued work");
  }

  void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t B, int64_t C_in,
                      int64_t C_out) override {
    const auto scope = enter();
    k::linear_forward(out, inp, weight, bias, B, C_in, C_out, blas(), stream_);
  }
  void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                       const float* weight, int64_t B, int64_t C_in, int64_t C_out, bool accumulate) override {
    const auto scope = enter();
    k::linear_backward(dinp, dweight, dbias, dout, inp, weight, B, C_in, C_out, accumulate, blas(), stream_);
  }
  void activation_forward(Activation kind, float* out, const float* inp, int64_t n) override {
    const auto scope = enter();
    switch (kind) {
      case Activation::kRelu: return k::relu_forward(out, inp, n, stream_);
      case Activation::kGelu: return k::gelu_forward(out, inp, n, stream_);
      case Activation::kTanh: return k::tanh_forward(out, inp, n, stream_);
      case Activation::kSigmoid: return k::sigmoid_forward(out, inp, n, stream_);
    }
  }
  void activation_backward(Activation kind, float* dinp, const float* dout, const float* inp, const float* out,
                           int64_t n) override {
    const auto scope = enter();
    switch (kind) {
      case Activation::kRelu: return k::relu_backward(dinp, dout, out, n, stream_);
      case Activation::kGelu: return k::gelu_backward(dinp, dout, inp, n, stream_);
      case Activation::kTanh: return k::tanh_backward(dinp, dout, out, n, stream_);
      case Activation::kSigmoid: return k::sigmoid_backward(dinp, dout, out, n, stream_);
    }
  }
  void dropout_forward(float* out, float* mask, const float* inp, int64_t n, float p, uint64_t seed,
                       uint64_t offset) override {
    const auto scope = enter();
    k::dropout_forward(out, mask, inp, n, p, seed, offset, stream_);
  }
  void dropout_backward(float* dinp, const float* dout, const float* mask, int64_t n) override {
    const auto scope = enter();
    k::dropout_backward(dinp, dout, mask, n, stream_);
  }
  void cross_entropy_forward_backward(double* loss_sum, float* dlogits, const float* logits, const int32_t* labels,
                                      int64_t B, int64_t C, float grad_scale) override {
    const auto scope = enter();
    k::cross_entropy_forward_backward(loss_sum, dlogits, logits, labels, B, C, grad_scale, stream_);
  }
  void mse_forward_backward(double* loss_sum, float* dpred, const float* pred, const float* target, int64_t B,
                            int64_t D, float grad_scale) override {
    const auto scope = enter();
    k::mse_forward_backward(loss_sum, dpred, pred, target, B, D, grad_scale, stream_);
  }
  void sgd_step(float* param, float* momentum_buf, const float* grad, int64_t n, const SgdHyper& h,
                bool first_step) override {
    const auto scope = enter();
    k::sgd_step(param, momentum_buf, grad, n, h, first_step, stream_);
  }
  void adam_step(float* param, float* exp_avg, float* exp_avg_sq, const float* grad, int64_t n,
                 const AdamHyper& h, int64_t step) override {
    const auto scope = enter();
    k::adam_step(param, exp_avg, exp_avg_sq, grad, n, h, step, stream_);
  }
  void axpy(float* y, const float* x, float a, int64_t n) override {
    const auto scope = enter();
    k::axpy(y, x, a, n, stream_);
  }
  void scale(float* x, float a, int64_t n) override {
    const auto scope = enter();
    k::scale(x, a, n, stream_);
  }
  void to_bf16(uint16_t* dst, const float* src, int64_t n) override {
    const auto scope = enter();
    k::to_bf16(dst, src, n, stream_);
  }
  void from_bf16(float* dst, const uint16_t* src, int64_t n) override {
    const auto scope = enter();
    k::from_bf16(dst, src, n, stream_);
  }
  // cuDNN is what these need (loaded on first use, as cuBLAS is); until then they say so, rather than the default's
  // generic line.
  std::unique_ptr<Conv2dOp> make_conv2d(const Conv2dSpec& spec) override {
    fail(Status::kNotSupported, spec.str(), " on ", device().str(),
         ": dpar's CUDA backend has no convolution yet (it needs cuDNN)");
  }
  std::unique_ptr<Pool2dOp> make_pool2d(const Pool2dSpec& spec) override {
    fail(Status::kNotSupported, spec.str(), " on ", device().str(),
         ": dpar's CUDA backend has no pooling yet (it needs cuDNN)");
  }
  double sum_squares(const float* x, int64_t n) override {
    const auto scope = enter();
    if (!sum_scratch_)  // once per stream: the kernels' partial sums and their total
      DPAR_CUDA_CHECK(cudaMalloc(&sum_scratch_, (k::kSumSquaresBlocks + 1) * sizeof(double)),
                      "cudaMalloc of the sum of squares' scratch on ", device().str());
    k::sum_squares(sum_scratch_ + k::kSumSquaresBlocks, sum_scratch_, x, n, stream_);
    double total = 0.0;
    copy_to_host(&total, sum_scratch_ + k::kSumSquaresBlocks, sizeof(double));
    return total;
  }

 private:
  void finish_setup() {
    try {
      // No cuBLAS handle here: it is made by the stream's first GEMM (blas()). Many streams never run one (a data
      // loader's copies batches to the device; a borrowed stream carries a framework's gradients), and the first
      // handle of a process loads cuBLAS, about 215 MB.
      DPAR_CUDA_CHECK(cudaEventCreateWithFlags(&staged_, cudaEventDisableTiming), "cudaEventCreate");
    } catch (...) {
      if (staged_) cudaEventDestroy(staged_);
      if (owns_stream_) cudaStreamDestroy(stream_);
      throw;
    }
  }
  // The stream's cuBLAS handle, made (and cuBLAS loaded, once per process) by the first GEMM.
  cublasHandle_t blas() {
    if (blas_) return blas_;
    const CublasLibrary& lib = cublas();  // loads cuBLAS the first time
    cublasHandle_t h = nullptr;
    DPAR_CUBLAS_CHECK(lib.create(&h), "cublasCreate on ", device().str());
    try {
      DPAR_CUBLAS_CHECK(lib.set_stream(h, stream_), "cublasSetStream");
      // FP32 arithmetic, as the CPU reference computes (no TF32 unless asked for).
      DPAR_CUBLAS_CHECK(lib.set_math_mode(h, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
    } catch (...) {
      lib.destroy(h);
      throw;
    }
    return blas_ = h;
  }
  // Every operation runs with the stream's device current: a replica's worker has made it current already (the
  // scope then costs one cudaGetDevice), but its communication thread and a borrowed stream's callers have not.
  DeviceScope enter() const { return DeviceScope(device().index); }

  cudaStream_t stream_ = nullptr;
  bool owns_stream_ = false, borrowed_ = false;
  cublasHandle_t blas_ = nullptr;
  cudaEvent_t staged_ = nullptr;  // the last copy out of pinned_ finished
  void* pinned_ = nullptr;
  size_t pinned_bytes_ = 0;
  double* sum_scratch_ = nullptr;  // sum_squares's partial sums (kSumSquaresBlocks) and total (1), device memory
};

// ---- The in-process groups -------------------------------------------------------------------------------------
// A CUDA group whose participants each order their collectives against their replica's compute stream.
template <class G>
class StreamGroup final : public Group {
 public:
  StreamGroup(std::unique_ptr<G> group, std::vector<cudaStream_t> streams, bool reusable)
      : group_(std::move(group)), streams_(std::move(streams)), reusable_(reusable) {}
  int size() const override { return group_->size(); }
  std::unique_ptr<Communicator> communicator(int rank) override {
    return group_->communicator(rank, streams_[static_cast<size_t>(rank)]);
  }
  void abort(const std::string& reason) override { group_->abort(reason); }
  bool recover() override {
    if constexpr (requires(G& g) { g.reset(); }) {
      if (reusable_) {
        group_->reset();
        return true;
      }
    }
    return false;
  }

 private:
  std::unique_ptr<G> group_;
  std::vector<cudaStream_t> streams_;
  bool reusable_;
};

// ---- The backend ------------------------------------------------------------------------------------------------
class CudaBackend final : public Backend {
 public:
  CudaBackend() {
    count_ = static_cast<size_t>(cuda::cuda_device_count(&why_none_));
    for (size_t d = 0; d < count_; ++d) allocators_.push_back(std::make_unique<CachingAllocator>(static_cast<int>(d)));
  }
  DeviceKind kind() const override { return DeviceKind::kCuda; }
  const char* name() const override { return "cuda"; }
  size_t device_count() const override { return count_; }
  std::string unavailable_reason() const override { return why_none_; }

  void* allocate(Device device, size_t bytes) override {
    DeviceScope scope(device.index);
    return allocator(device).allocate(bytes);
  }
  void deallocate(Device device, void* ptr) noexcept override {
    try {
      DeviceScope scope(device.index);
      allocator(device).deallocate(ptr);
    } catch (...) {
      // Freeing never fails the caller; a block that cannot be returned stays with the driver.
    }
  }
  void copy_to_host(void* dst, const void* src, size_t bytes, Device device) override {
    if (!bytes) return;
    DeviceScope scope(device.index);
    DPAR_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "copy from ", device.str(), " to the host");
  }
  void copy_from_host(void* dst, const void* src, size_t bytes, Device device) override {
    if (!bytes) return;
    DeviceScope scope(device.index);
    DPAR_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "copy from the host to ", device.str());
    // From pageable memory cudaMemcpy may return once the bytes are staged, before they reach the device; the
    // replicas' streams do not wait for the legacy stream the copy ran on. The contract is "arrived": wait.
    DPAR_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy), "copy from the host to ", device.str());
  }
  void fill_zero(void* dst, size_t bytes, Device device) override {
    if (!bytes) return;
    DeviceScope scope(device.index);
    DPAR_CUDA_CHECK(cudaMemset(dst, 0, bytes), "fill on ", device.str());
    DPAR_CUDA_CHECK(cudaDeviceSynchronize(), "fill on ", device.str());
  }

  void wait_for_legacy_stream(Device device) override {
    DeviceScope scope(device.index);  // the caller's current device (PyTorch's, say) is restored
    DPAR_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy), device.str(),
                    ": waiting for the work that produced a DLPack tensor (the legacy default stream)");
  }
  void check_memory(const void* ptr, size_t bytes, Device device, const char* argument) override {
    // Both ends: a count past the end of a device allocation may land in host memory or another GPU's.
    check_byte(ptr, device, argument, "");
    if (bytes > 1) check_byte(static_cast<const char*>(ptr) + bytes - 1, device, argument, "the last byte of ");
  }
  static void check_byte(const void* p, Device device, const char* argument, const char* which) {
    cudaPointerAttributes a{};
    const cudaError_t rc = cudaPointerGetAttributes(&a, p);
    if (rc != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky: clear the thread's last error
      fail(Status::kInvalidArgument, argument, ": ", which, p, " is not memory CUDA knows (", cudaGetErrorString(rc),
           "); it must be memory of ", device.str());
    }
    // Managed memory is reachable from every GPU; device memory only from its own (peer access aside, which a
    // collective's kernels do not rely on).
    const bool ok = a.type == cudaMemoryTypeManaged || (a.type == cudaMemoryTypeDevice && a.device == device.index);
    DPAR_CHECK_ARG(ok, argument, ": ", which, p, " is ",
                   a.type == cudaMemoryTypeDevice
                       ? "memory of cuda:" + std::to_string(a.device)
                       : std::string(a.type == cudaMemoryTypeHost ? "pinned host memory" : "host memory"),
                   ", but it must be memory of ", device.str());
  }

  void start_worker(Device device, size_t worker, const WorkerOptions& options) override {
    if (options.pin) pin_to_cpu(worker);
    DPAR_CUDA_CHECK(cuda::bind_thread_to_device(device.index), "cudaSetDevice(", device.index, ") on the worker of ",
                    device.str());
  }
  std::unique_ptr<Stream> open_stream(Device device) override { return std::make_unique<CudaStream>(device); }
  std::unique_ptr<Stream> wrap_stream(Device device, void* native) override {
    check_device_exists(device, "device");
    // cudaStreamPerThread names the calling thread's own stream: dpar's threads would each get theirs, not the
    // caller's. (nullptr and cudaStreamLegacy name one stream, whichever thread uses them.)
    DPAR_CHECK_ARG(static_cast<cudaStream_t>(native) != cudaStreamPerThread, device.str(),
                   ": cudaStreamPerThread names each thread's own stream; pass the stream itself, or NULL for the "
                   "legacy default stream");
    return std::make_unique<CudaStream>(device, static_cast<cudaStream_t>(native));
  }

  std::unique_ptr<Group> make_group(const std::vector<Device>& devices, const std::vector<Stream*>& streams,
                                    std::vector<std::string> names, std::chrono::duration<double> timeout) override {
    std::vector<cudaStream_t> handles;
    for (Stream* s : streams) handles.push_back(static_cast<CudaStream*>(s)->handle());
    std::vector<int> ordinals;
    for (const Device& d : devices) ordinals.push_back(d.index);
    // NCCL between distinct GPUs; dpar's device reduction when a GPU holds several replicas (NCCL refuses that).
    const std::set<int> gpus(ordinals.begin(), ordinals.end());
    if (gpus.size() == ordinals.size() && ordinals.size() > 1)
      return std::make_unique<StreamGroup<NcclGroup>>(std::make_unique<NcclGroup>(ordinals, std::move(names), timeout),
                                                      handles, false);
    // The device reduction's kernels read and write every participant's buffer: across GPUs that takes peer access
    // both ways (without it the first access is an illegal address, which ends the process's CUDA context).
    for (int a : gpus)
      for (int b : gpus)
        if (a != b) enable_peer_access(a, b);
    return std::make_unique<StreamGroup<CudaDeviceGroup>>(
        std::make_unique<CudaDeviceGroup>(ordinals, std::move(names), timeout), handles, true);
  }

  // NCCL between the processes' GPUs, where each process drives a GPU of its own; MPI through host memory where two
  // share one (NCCL takes one rank per GPU, and may hang on two), or where NCCL cannot connect them. Every step is
  // agreed over `processes`, so that all of them take the same transport, or all throw.
  ProcessLink link_processes(Device device, Stream& stream, const std::shared_ptr<Communicator>& processes,
                             std::chrono::duration<double> timeout) override {
    const int rank = processes->rank(), size = processes->size();
    const std::string staged = "mpi through host memory";
    const std::array<int64_t, 2> mine = gpu_identity(device);
    std::vector<int64_t> all(2 * static_cast<size_t>(size));
    processes->all_gather(mine.data(), all.data(), 2, CommDType::kI64);
    for (int p = 0; p < size; ++p)
      for (int q = p + 1; q < size; ++q)
        if (all[2 * p] == all[2 * q] && all[2 * p + 1] == all[2 * q + 1])
          return {nullptr, detail::concat(staged, " (processes ", p, " and ", q, " drive the same GPU, and NCCL ",
                                          "takes one process per GPU)")};

    // Rank 0's id, after a word that says whether it could make one.
    constexpr size_t kIdWords = (sizeof(ncclUniqueId) + sizeof(int64_t) - 1) / sizeof(int64_t);
    std::array<int64_t, 1 + kIdWords> id_words{};
    if (rank == 0) {
      ncclUniqueId id{};
      if (ncclGetUniqueId(&id) == ncclSuccess) {
        id_words[0] = 1;
        std::memcpy(&id_words[1], &id, sizeof id);
      }
    }
    processes->broadcast(id_words.data(), id_words.size(), CommDType::kI64, 0);
    if (id_words[0] == 0) return {nullptr, staged + " (rank 0 could not make an NCCL id: ncclGetUniqueId failed)"};
    ncclUniqueId id{};
    std::memcpy(&id, &id_words[1], sizeof id);

    // Every process joins; NCCL is kept only if every one could.
    std::unique_ptr<Communicator> comm;
    std::string why;
    try {
      // Half the timeout to join: a rank that failed before joining waits in the agreement below, and must still be
      // waiting there when this one gives up.
      comm = nccl_rank_communicator(id, size, rank, device.index, static_cast<CudaStream&>(stream).handle(),
                                    detail::concat("rank ", rank, " (", device.str(), ")"), timeout, timeout / 2,
                                    processes);
    } catch (const std::exception& e) {
      why = e.what();
    }
    const int64_t joined = comm ? 1 : 0;
    int64_t all_joined = 0;
    processes->all_reduce(&joined, &all_joined, 1, CommDType::kI64, ReduceOp::kMin);
    if (all_joined == 0)
      return {nullptr, detail::concat(staged, " (NCCL could not connect the processes", why.empty() ? "" : ": ", why,
                                      ")")};
    return {std::move(comm), "nccl"};
  }

  // Which GPU `device` is, comparable across the processes of a job: its host (name and boot) and PCI address.
  static std::array<int64_t, 2> gpu_identity(Device device) {
    cudaDeviceProp prop{};
    DPAR_CUDA_CHECK(cudaGetDeviceProperties(&prop, device.index), "cudaGetDeviceProperties(", device.index, ")");
    std::string host(256, '\0');
    if (gethostname(host.data(), host.size() - 1) != 0) host.clear();
    host.resize(std::strlen(host.c_str()));
    std::ifstream boot("/proc/sys/kernel/random/boot_id");
    std::string boot_id;
    std::getline(boot, boot_id);
    uint64_t hash = 14695981039346656037ull;  // FNV-1a: the same on every process, whatever its standard library
    for (const char c : host + "/" + boot_id) hash = (hash ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    const int64_t pci = (static_cast<int64_t>(prop.pciDomainID) << 32) | (static_cast<int64_t>(prop.pciBusID) << 8) |
                        static_cast<int64_t>(prop.pciDeviceID);
    return {static_cast<int64_t>(hash), pci};
  }

  // Lets kernels on GPU `from` reach GPU `to`'s memory; refuses a pair that cannot.
  static void enable_peer_access(int from, int to) {
    int can = 0;
    DPAR_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, from, to), "cudaDeviceCanAccessPeer(", from, ", ", to, ")");
    DPAR_ENFORCE(can, Status::kNotSupported, "cuda:", from, " cannot reach cuda:", to,
                 "'s memory (no peer access): a group that names a GPU more than once must not span GPUs without "
                 "it; name each GPU once (NCCL), or use one GPU");
    DeviceScope scope(from);
    const cudaError_t rc = cudaDeviceEnablePeerAccess(to, 0);
    if (rc == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
      return;
    }
    DPAR_CUDA_CHECK(rc, "cudaDeviceEnablePeerAccess from cuda:", from, " to cuda:", to);
  }

  CudaAllocatorStats stats(int device) {
    DPAR_CHECK_ARG(device >= 0 && static_cast<size_t>(device) < count_, "cuda:", device, " does not exist");
    return allocators_[static_cast<size_t>(device)]->stats();
  }

 private:
  CachingAllocator& allocator(Device device) {
    DPAR_CHECK_ARG(device.index >= 0 && static_cast<size_t>(device.index) < count_, device.str(),
                   " does not exist (", count_, " CUDA devices", why_none_.empty() ? "" : ": ", why_none_, ")");
    return *allocators_[static_cast<size_t>(device.index)];
  }

  size_t count_ = 0;
  std::string why_none_;
  std::vector<std::unique_ptr<CachingAllocator>> allocators_;
};

CudaBackend& the_backend() {
  static CudaBackend backend;
  return backend;
}

}  // namespace

Backend& cuda_backend() { return the_backend(); }

CudaAllocatorStats cuda_allocator_stats(int device) { return the_backend().stats(device); }

}  // namespace dpar
