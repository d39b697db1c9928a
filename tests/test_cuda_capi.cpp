// The collectives and the reducer of the C ABI on GPU buffers, ordered on streams the caller owns (a framework that
// keeps its tensors on the GPU and uses dpar to synchronise them), through dpar.h alone. The expected values are
// small integers, exact in f32 whatever the order of the sum. Skipped with the reason where no GPU is present.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dpar.h"
#include "require_gpu.h"

namespace {

#define ASSERT_OK(call) ASSERT_EQ((call), DPAR_OK) << #call << ": " << dpar_last_error()

#define REQUIRE_GPU()                                                                                       \
  do {                                                                                                      \
    size_t dpar_gpus_ = 0;                                                                                  \
    if (dpar_device_count(&dpar_gpus_, DPAR_DEVICE_CUDA) != DPAR_OK || dpar_gpus_ == 0) {                   \
      if (dpar::test::gpu_required())                                                                       \
        FAIL() << "DPAR_TEST_REQUIRE_GPU is set, but dpar_device_count(cuda) finds no device";              \
      GTEST_SKIP() << "built with CUDA, no device: skipped (dpar_device_count(cuda) is 0)";                 \
    }                                                                                                       \
  } while (0)

// A CUDA call in a participant's thread: its failure becomes that participant's status.
#define CUDA_OR_FAIL(expr)                                                                                  \
  do {                                                                                                      \
    if ((expr) != cudaSuccess) return DPAR_ERR_DEVICE;                                                      \
  } while (0)

// One participant's stream, created and destroyed by the test as a framework would.
struct OwnStream {
  cudaStream_t stream = nullptr;
  OwnStream() { EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess); }
  ~OwnStream() { cudaStreamDestroy(stream); }
};

// A host function queued on a stream: it holds the stream back, so that work queued after it runs late, and a
// collective that did not wait for the stream would read stale inputs. (The copies queued after it come from pinned
// memory: from pageable memory cudaMemcpyAsync may wait for the stream itself, and the test would prove nothing.)
void CUDART_CB hold_back(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(20)); }

// Pinned host memory for n values of T, freed on destruction.
template <class T>
struct Pinned {
  T* p = nullptr;
  explicit Pinned(size_t n) { EXPECT_EQ(cudaMallocHost(reinterpret_cast<void**>(&p), n * sizeof(T)), cudaSuccess); }
  ~Pinned() { cudaFreeHost(p); }
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
};

// Runs body(rank, comm, stream) on one thread per participant of a group on cuda:0, named `n` times, each
// participant with a stream of its own; returns each participant's status.
std::vector<dpar_status> run_on_gpu(int n, const std::function<dpar_status(int, dpar_comm*, cudaStream_t)>& body) {
  std::vector<OwnStream> streams(static_cast<size_t>(n));
  std::vector<void*> handles;
  std::vector<dpar_device> devices;
  for (int r = 0; r < n; ++r) {
    handles.push_back(streams[static_cast<size_t>(r)].stream);
    devices.push_back({DPAR_DEVICE_CUDA, 0});
  }
  dpar_comm_options opts = DPAR_COMM_OPTIONS_INIT;
  opts.timeout_seconds = 60;
  dpar_comm_group* group = nullptr;
  EXPECT_EQ(dpar_comm_group_create_on_devices(&group, devices.data(), handles.data(), devices.size(), &opts),
            DPAR_OK)
      << dpar_last_error();
  std::vector<dpar_status> status(static_cast<size_t>(n), DPAR_ERR_INTERNAL);
  if (group == nullptr) return status;
  std::vector<dpar_comm*> comms(static_cast<size_t>(n), nullptr);
  for (int r = 0; r < n; ++r) EXPECT_EQ(dpar_comm_group_member(&comms[r], group, static_cast<size_t>(r)), DPAR_OK);
  dpar_comm_group_free(group);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] { status[r] = body(r, comms[r], streams[static_cast<size_t>(r)].stream); });
  for (auto& t : threads) t.join();
  for (dpar_comm* c : comms) dpar_comm_free(c);
  return status;
}

TEST(CudaCommApi, CollectivesOnDeviceBuffersAreOrderedOnTheCallersStreams) {
  REQUIRE_GPU();
  const int n = 3;
  const size_t count = 100003;  // not a multiple of the slices
  auto status = run_on_gpu(n, [&](int r, dpar_comm* c, cudaStream_t s) -> dpar_status {
    dpar_device where{-1, -1};
    if (dpar_comm_device(&where, c) != DPAR_OK || where.kind != DPAR_DEVICE_CUDA || where.index != 0)
      return DPAR_ERR_INTERNAL;
    Pinned<float> x(count);
    if (x.p == nullptr) return DPAR_ERR_OUT_OF_MEMORY;
    std::vector<float> got(count);
    for (size_t i = 0; i < count; ++i) x.p[i] = float(i % 1000) + 1000.0f * float(r);
    float* d = nullptr;
    float* gathered = nullptr;
    CUDA_OR_FAIL(cudaMalloc(reinterpret_cast<void**>(&d), count * sizeof(float)));
    CUDA_OR_FAIL(cudaMalloc(reinterpret_cast<void**>(&gathered), n * 8 * sizeof(float)));
    // The inputs arrive late on the stream: the collective must wait for them.
    CUDA_OR_FAIL(cudaLaunchHostFunc(s, hold_back, nullptr));
    CUDA_OR_FAIL(cudaMemcpyAsync(d, x.p, count * sizeof(float), cudaMemcpyHostToDevice, s));
    if (dpar_status st = dpar_comm_all_reduce(c, d, d, count, DPAR_F32, DPAR_SUM)) return st;
    // Its result, read on the stream after the call.
    CUDA_OR_FAIL(cudaMemcpyAsync(got.data(), d, count * sizeof(float), cudaMemcpyDeviceToHost, s));
    CUDA_OR_FAIL(cudaStreamSynchronize(s));
    for (size_t i = 0; i < count; ++i)
      if (got[i] != 3.0f * float(i % 1000) + 3000.0f) return DPAR_ERR_MISMATCH;
    // Broadcast from participant 1, then every participant's first 8 elements gathered.
    if (dpar_status st = dpar_comm_broadcast(c, d, count, DPAR_F32, 1)) return st;
    if (dpar_status st = dpar_comm_all_gather(c, d, gathered, 8, DPAR_F32)) return st;
    std::vector<float> all(n * 8);
    CUDA_OR_FAIL(cudaMemcpyAsync(all.data(), gathered, all.size() * sizeof(float), cudaMemcpyDeviceToHost, s));
    CUDA_OR_FAIL(cudaStreamSynchronize(s));
    for (size_t i = 0; i < all.size(); ++i)
      if (all[i] != 3.0f * float(i % 8) + 3000.0f) return DPAR_ERR_MISMATCH;
    // Host memory handed to a GPU collective is refused before anything moves (on the GPU it would fault).
    if (dpar_comm_all_reduce(c, got.data(), d, count, DPAR_F32, DPAR_SUM) != DPAR_ERR_INVALID_ARGUMENT)
      return DPAR_ERR_INTERNAL;
    if (std::string(dpar_last_error()).find("send") == std::string::npos) return DPAR_ERR_INTERNAL;
    // So is pinned host memory, and a count that runs past the end of the device buffer.
    if (dpar_comm_all_reduce(c, x.p, d, count, DPAR_F32, DPAR_SUM) != DPAR_ERR_INVALID_ARGUMENT)
      return DPAR_ERR_INTERNAL;
    if (dpar_comm_all_reduce(c, d, d, size_t{1} << 28, DPAR_F32, DPAR_SUM) != DPAR_ERR_INVALID_ARGUMENT)
      return DPAR_ERR_INTERNAL;  // 1 GiB past a 400 KB buffer
    if (std::string(dpar_last_error()).find("the last byte of") == std::string::npos) return DPAR_ERR_INTERNAL;
    if (std::string(dpar_last_error()).find("send") == std::string::npos) return DPAR_ERR_INTERNAL;
    // What one GPU named several times does not do is refused alike on every participant, without waiting.
    if (dpar_comm_reduce_scatter(c, d, d, 1, DPAR_F32, DPAR_SUM) != DPAR_ERR_NOT_SUPPORTED) return DPAR_ERR_INTERNAL;
    if (dpar_status st = dpar_comm_barrier(c)) return st;
    cudaFree(d);
    cudaFree(gathered);
    return DPAR_OK;
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(status[r], DPAR_OK) << "participant " << r;
}

TEST(CudaCommApi, TheReducerAveragesDeviceGradientsOnTheCallersStreams) {
  REQUIRE_GPU();
  const int n = 2;
  // Gradients 0 and 1 are one allocation cut in two (their bucket can be reduced in place); the others are
  // allocations of their own (staged buckets).
  const std::vector<size_t> sizes = {300, 7, 1200, 64, 513};
  auto status = run_on_gpu(n, [&](int r, dpar_comm* c, cudaStream_t s) -> dpar_status {
    std::vector<float*> grads;
    std::vector<float*> allocations;
    for (size_t k = 0; k < sizes.size(); ++k) {
      if (k == 1) {
        grads.push_back(grads[0] + sizes[0]);
        continue;
      }
      float* p = nullptr;
      CUDA_OR_FAIL(cudaMalloc(reinterpret_cast<void**>(&p), (k == 0 ? sizes[0] + sizes[1] : sizes[k]) * sizeof(float)));
      grads.push_back(p);
      allocations.push_back(p);
    }
    std::vector<std::unique_ptr<Pinned<float>>> staged;  // each gradient's values, copied late on the stream
    for (size_t k = 0; k < sizes.size(); ++k) staged.push_back(std::make_unique<Pinned<float>>(sizes[k]));
    dpar_reducer_options o = DPAR_REDUCER_OPTIONS_INIT;
    o.first_bucket_bytes = 256;
    o.bucket_cap_bytes = 2048;
    dpar_reducer* red = nullptr;
    if (dpar_status st = dpar_reducer_create(&red, c, grads.data(), sizes.data(), sizes.size(), &o)) return st;
    for (int step = 0; step < 3; ++step) {
      for (size_t k = sizes.size(); k-- > 0;) {
        // Participant 1 produces no gradient 1 (an unused parameter): it counts as zero.
        if (r == 1 && k == 1) continue;
        // The stream has passed the previous step's copies: the end of that step synchronised it.
        std::fill(staged[k]->p, staged[k]->p + sizes[k], float(4 * (r + 1) + int(k) + step));
        CUDA_OR_FAIL(cudaLaunchHostFunc(s, hold_back, nullptr));
        CUDA_OR_FAIL(cudaMemcpyAsync(grads[k], staged[k]->p, sizes[k] * sizeof(float), cudaMemcpyHostToDevice, s));
        if (dpar_status st = dpar_reducer_grad_ready(red, k)) return st;
      }
      if (dpar_status st = dpar_reducer_wait(red)) return st;
      for (size_t k = 0; k < sizes.size(); ++k) {
        std::vector<float> got(sizes[k]);
        CUDA_OR_FAIL(cudaMemcpyAsync(got.data(), grads[k], got.size() * sizeof(float), cudaMemcpyDeviceToHost, s));
        CUDA_OR_FAIL(cudaStreamSynchronize(s));
        float sum = 0;
        for (int p = 0; p < n; ++p)
          if (!(p == 1 && k == 1)) sum += float(4 * (p + 1) + int(k) + step);
        for (float v : got)
          if (v != sum / n) return DPAR_ERR_MISMATCH;
      }
    }
    dpar_reducer_free(red);
    for (float* p : allocations) cudaFree(p);
    return DPAR_OK;
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(status[r], DPAR_OK) << "participant " << r;
}

TEST(CudaCommApi, DevicesOfTwoKindsOrAMissingGpuAreRefused) {
  REQUIRE_GPU();
  // A GPU next to a CPU device: refused for the kinds, naming the participant.
  const dpar_device mixed[2] = {{DPAR_DEVICE_CUDA, 0}, {DPAR_DEVICE_CPU, 0}};
  dpar_comm_group* group = nullptr;
  EXPECT_EQ(dpar_comm_group_create_on_devices(&group, mixed, nullptr, 2, nullptr), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dpar_last_error()).find("devices[1]"), std::string::npos) << dpar_last_error();
  // A GPU that does not exist.
  const dpar_device missing[1] = {{DPAR_DEVICE_CUDA, 4096}};
  EXPECT_EQ(dpar_comm_group_create_on_devices(&group, missing, nullptr, 1, nullptr), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dpar_last_error()).find("out of range"), std::string::npos) << dpar_last_error();
  EXPECT_EQ(group, nullptr);
}

}  // namespace
