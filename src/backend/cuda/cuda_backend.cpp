#include "backend/cuda/cuda_backend.h"

#include "backend/cuda/cuda_stream.h"

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
#include "platform/cuda/cuda_check.h"

namespace dpar {
namespace {

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

using cuda::DeviceScope;

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
  std::unique_ptr<Stream> open_stream(Device device) override { return make_cuda_stream(device); }
  std::unique_ptr<Stream> wrap_stream(Device device, void* native) override {
    check_device_exists(device, "device");
    // cudaStreamPerThread names the calling thread's own stream: dpar's threads would each get theirs, not the
    // caller's. (nullptr and cudaStreamLegacy name one stream, whichever thread uses them.)
    DPAR_CHECK_ARG(static_cast<cudaStream_t>(native) != cudaStreamPerThread, device.str(),
                   ": cudaStreamPerThread names each thread's own stream; pass the stream itself, or NULL for the "
                   "legacy default stream");
    return wrap_cuda_stream(device, static_cast<cudaStream_t>(native));
  }

  std::unique_ptr<Group> make_group(const std::vector<Device>& devices, const std::vector<Stream*>& streams,
                                    std::vector<std::string> names, std::chrono::duration<double> timeout) override {
    std::vector<cudaStream_t> handles;
    for (Stream* s : streams) handles.push_back(cuda_stream_handle(*s));
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
    processes->all_gather(mine.data(), all.data(), 2, DType::kI64);
    for (int p = 0; p < size; ++p)
      for (int q = p + 1; q < size; ++q)
        if (all[2 * p] == all[2 * q] && all[2 * p + 1] == all[2 * q + 1])
          return {nullptr, detail::concat(staged, " (processes ", p, " and ", q, " drive the same GPU, and NCCL ",
                                          "takes one process per GPU)")};

    // Rank 0's id, after a word that says whether it could make one (it cannot where NCCL is not installed).
    constexpr size_t kIdWords = (sizeof(ncclUniqueId) + sizeof(int64_t) - 1) / sizeof(int64_t);
    std::array<int64_t, 1 + kIdWords> id_words{};
    std::string no_id;
    if (rank == 0) {
      try {
        const ncclUniqueId id = nccl_unique_id();
        id_words[0] = 1;
        std::memcpy(&id_words[1], &id, sizeof id);
      } catch (const std::exception& e) {
        no_id = e.what();
      }
    }
    processes->broadcast(id_words.data(), id_words.size(), DType::kI64, 0);
    if (id_words[0] == 0)
      return {nullptr, detail::concat(staged, " (rank 0 could not make an NCCL id",
                                      no_id.empty() ? std::string() : ": " + no_id, ")")};
    ncclUniqueId id{};
    std::memcpy(&id, &id_words[1], sizeof id);

    // Every process joins; NCCL is kept only if every one could.
    std::unique_ptr<Communicator> comm;
    std::string why;
    try {
      // Half the timeout to join: a rank that failed before joining waits in the agreement below, and must still be
      // waiting there when this one gives up.
      comm = nccl_rank_communicator(id, size, rank, device.index, cuda_stream_handle(stream),
                                    detail::concat("rank ", rank, " (", device.str(), ")"), timeout, timeout / 2,
                                    processes);
    } catch (const std::exception& e) {
      why = e.what();
    }
    const int64_t joined = comm ? 1 : 0;
    int64_t all_joined = 0;
    processes->all_reduce(&joined, &all_joined, 1, DType::kI64, ReduceOp::kMin);
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
