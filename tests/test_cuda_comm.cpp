// GPU collectives against the threads backend: the same inputs must give the same results (bit for bit for the
// device group, whose sum order is the threads backend's). Skipped with the reason where no GPU is present.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/cuda_device_comm.h"
#include "comm/nccl_comm.h"
#include "comm/threads_comm.h"
#include "common/error.h"
#include "kernels/cuda/kernels.h"
#include "platform/cuda/cuda_check.h"
#include "cuda_test_util.h"

namespace dpar {
namespace {

using test::bitwise_equal;
using test::DeviceBuffer;
using test::random_vector;

std::vector<std::string> names(int n, const char* device) {
  std::vector<std::string> v;
  for (int r = 0; r < n; ++r) v.push_back("replica " + std::to_string(r) + " (" + device + ")");
  return v;
}

// Runs body(rank) on n threads; rethrows nothing, returns each thread's error status (Status::kOk if none).
std::vector<Status> run_threads(int n, const std::function<void(int)>& body) {
  std::vector<Status> status(n, Status::kOk);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (const Error& e) {
        status[r] = e.status();
      }
    });
  for (auto& t : threads) t.join();
  return status;
}

// A blocking stream on `device`, which it makes current on the calling thread (blocking: ordered with
// DeviceBuffer's uploads on the legacy default stream); destroyed with it, after whatever was declared later.
struct ThreadStream {
  cudaStream_t stream = nullptr;
  explicit ThreadStream(int device) {
    DPAR_CUDA_CHECK(cudaSetDevice(device), "thread device");
    DPAR_CUDA_CHECK(cudaStreamCreate(&stream), "stream");
  }
  ~ThreadStream() { cudaStreamDestroy(stream); }
  ThreadStream(const ThreadStream&) = delete;
  ThreadStream& operator=(const ThreadStream&) = delete;
};

class CudaDeviceGroupTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    DPAR_REQUIRE_GPU();
    DPAR_CUDA_CHECK(cudaSetDevice(0), "test device");
  }
};

// Each replica thread owns a stream; the reference runs the same calls through a ThreadGroup on host copies.
TEST_P(CudaDeviceGroupTest, MatchesTheThreadsBackend) {
  const int n = GetParam();
  const size_t count = 10007;  // not a multiple of the slice alignment
  CudaDeviceGroup group(std::vector<int>(n, 0), names(n, "cuda:0"), std::chrono::seconds(30));
  ThreadGroup reference(names(n, "cpu"), std::chrono::seconds(30));
  std::vector<std::vector<float>> host(n), expected(n), got(n), gathered(n), gathered_ref(n), bcast(n), bcast_ref(n);
  for (int r = 0; r < n; ++r) host[r] = random_vector(count, 10 + r);

  const auto status = run_threads(n, [&](int r) {
    ThreadStream ts(0);
    auto comm = group.communicator(r, ts.stream);
    auto ref = reference.communicator(r);
    // all_reduce_sum: replica 1 does not contribute; scaled.
    const bool contributes = r != 1;
    DeviceBuffer<float> d(host[r]);
    comm->all_reduce_sum(d.get(), count, contributes, 0.5f);
    std::vector<float> h = host[r];
    ref->all_reduce_sum(h.data(), count, contributes, 0.5f);
    expected[r] = h;
    // all_reduce (sum, out of place) after it, on the same stream.
    DeviceBuffer<float> out(count);
    comm->all_reduce(d.get(), out.get(), count, DType::kF32, ReduceOp::kSum);
    std::vector<float> h_out(count);
    ref->all_reduce(h.data(), h_out.data(), count, DType::kF32, ReduceOp::kSum);
    DPAR_CUDA_CHECK(cudaStreamSynchronize(ts.stream), "sync");
    got[r] = out.download();
    expected[r] = h_out;
    // all_gather (f32 blocks of 333) and broadcast from the last replica.
    const size_t block = 333;
    DeviceBuffer<float> g(block * n);
    comm->all_gather(d.get(), g.get(), block, DType::kF32);
    gathered_ref[r].resize(block * n);
    ref->all_gather(h.data(), gathered_ref[r].data(), block, DType::kF32);
    DeviceBuffer<float> b(host[r]);
    comm->broadcast(b.get(), count, DType::kF32, n - 1);
    DPAR_CUDA_CHECK(cudaStreamSynchronize(ts.stream), "sync");
    gathered[r] = g.download();
    bcast[r] = b.download();
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_EQ(status[r], Status::kOk) << "replica " << r;
    EXPECT_TRUE(bitwise_equal(got[r], expected[r])) << "all_reduce_sum + all_reduce, replica " << r;
    // Both gathered the all_reduce_sum results (d and h), so the blocks agree bit for bit too.
    EXPECT_TRUE(bitwise_equal(gathered[r], gathered_ref[r])) << "all_gather, replica " << r;
    EXPECT_TRUE(bitwise_equal(bcast[r], host[n - 1])) << "broadcast, replica " << r;
  }
}

// f64 sums (SyncBatchNorm's statistics over replicas that share a GPU), in place and out of place: the threads
// backend's bits (both add in participant order, in double).
TEST_P(CudaDeviceGroupTest, DoubleSumsMatchTheThreadsBackend) {
  const int n = GetParam();
  const size_t count = 1001;
  CudaDeviceGroup group(std::vector<int>(n, 0), names(n, "cuda:0"), std::chrono::seconds(30));
  ThreadGroup reference(names(n, "cpu"), std::chrono::seconds(30));
  std::vector<std::vector<double>> host(n), expected(n), got(n), expected_out(n), got_out(n);
  for (int r = 0; r < n; ++r) {
    const auto f = random_vector(count, 40 + r);
    for (float v : f) host[r].push_back(static_cast<double>(v) / 3.0);  // digits past a float's
  }
  const auto status = run_threads(n, [&](int r) {
    ThreadStream ts(0);
    auto comm = group.communicator(r, ts.stream);
    auto ref = reference.communicator(r);
    DeviceBuffer<double> d(host[r]), out(count);
    comm->all_reduce(d.get(), d.get(), count, DType::kF64, ReduceOp::kSum);
    comm->all_reduce(d.get(), out.get(), count, DType::kF64, ReduceOp::kSum);
    std::vector<double> h = host[r], h_out(count);
    ref->all_reduce(h.data(), h.data(), count, DType::kF64, ReduceOp::kSum);
    ref->all_reduce(h.data(), h_out.data(), count, DType::kF64, ReduceOp::kSum);
    DPAR_CUDA_CHECK(cudaStreamSynchronize(ts.stream), "sync");
    got[r] = d.download();
    got_out[r] = out.download();
    expected[r] = h;
    expected_out[r] = h_out;
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_EQ(status[r], Status::kOk) << "replica " << r;
    EXPECT_EQ(std::memcmp(got[r].data(), expected[r].data(), count * sizeof(double)), 0) << "in place, replica " << r;
    EXPECT_EQ(std::memcmp(got_out[r].data(), expected_out[r].data(), count * sizeof(double)), 0)
        << "out of place, replica " << r;
  }
}

TEST_P(CudaDeviceGroupTest, MismatchIsReportedByEveryParticipant) {
  const int n = GetParam();
  CudaDeviceGroup group(std::vector<int>(n, 0), names(n, "cuda:0"), std::chrono::seconds(10));
  const auto status = run_threads(n, [&](int r) {
    ThreadStream ts(0);
    auto comm = group.communicator(r, ts.stream);
    DeviceBuffer<float> d(100);
    comm->all_reduce_sum(d.get(), r == n - 1 ? 99 : 100, true, 1.0f);  // the last one disagrees on the count
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(status[r], Status::kMismatch) << "replica " << r;
}

TEST_P(CudaDeviceGroupTest, MissingParticipantTimesOut) {
  const int n = GetParam();
  CudaDeviceGroup group(std::vector<int>(n, 0), names(n, "cuda:0"), std::chrono::milliseconds(300));
  const auto status = run_threads(n, [&](int r) {
    if (r == 0) return;  // never calls
    DPAR_CUDA_CHECK(cudaSetDevice(0), "thread device");
    auto comm = group.communicator(r, nullptr);
    DeviceBuffer<float> d(64);
    comm->all_reduce_sum(d.get(), 64, true, 1.0f);
  });
  EXPECT_EQ(status[0], Status::kOk);
  for (int r = 1; r < n; ++r) EXPECT_TRUE(status[r] == Status::kTimeout || status[r] == Status::kRemote) << r;
}

// The sharded gradient path on one GPU: block r of reduce_scatter_sum is the threads backend's block r of
// all_reduce_sum, bit for bit, and all_gather_blocks then gives every replica the whole result.
TEST_P(CudaDeviceGroupTest, ReduceScatterSumAndAllGatherBlocksMatchTheThreadsBackend) {
  const int n = GetParam();
  const size_t count = 10007;
  CudaDeviceGroup group(std::vector<int>(n, 0), names(n, "cuda:0"), std::chrono::seconds(30));
  ThreadGroup reference(names(n, "cpu"), std::chrono::seconds(30));
  std::vector<std::vector<float>> host(n), expected(n), scattered(n), gathered(n);
  for (int r = 0; r < n; ++r) host[r] = random_vector(count, 90 + r);
  const auto status = run_threads(n, [&](int r) {
    ThreadStream ts(0);
    auto comm = group.communicator(r, ts.stream);
    auto ref = reference.communicator(r);
    expected[r] = host[r];
    ref->all_reduce_sum(expected[r].data(), count, r != n - 1, 0.25f);
    DeviceBuffer<float> d(host[r]);
    comm->reduce_scatter_sum(d.get(), count, r != n - 1, 0.25f);
    DPAR_CUDA_CHECK(cudaStreamSynchronize(ts.stream), "sync");
    scattered[r] = d.download();
    comm->all_gather_blocks(d.get(), count);
    DPAR_CUDA_CHECK(cudaStreamSynchronize(ts.stream), "sync");
    gathered[r] = d.download();
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_EQ(status[r], Status::kOk) << "replica " << r;
    const auto [begin, end] = Communicator::block_range(count, n, r);
    EXPECT_TRUE(bitwise_equal(std::vector<float>(scattered[r].begin() + begin, scattered[r].begin() + end),
                              std::vector<float>(expected[r].begin() + begin, expected[r].begin() + end)))
        << "reduce_scatter_sum, replica " << r;
    EXPECT_TRUE(bitwise_equal(gathered[r], expected[r])) << "all_gather_blocks, replica " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Replicas, CudaDeviceGroupTest, ::testing::Values(2, 3, 4));

// NCCL over every GPU of this machine (one rank each; the GPU machines have one), against the threads backend:
// NCCL's sum order is its own, so the comparison is within float rounding, not bit for bit.
TEST(NcclGroupTest, AllReduceSumAndBroadcastMatchTheThreadsBackend) {
  DPAR_REQUIRE_GPU();
  const int n = cuda::cuda_device_count();
  std::vector<int> devices;
  for (int d = 0; d < n; ++d) devices.push_back(d);
  NcclGroup group(devices, names(n, "cuda"), std::chrono::seconds(60));
  ThreadGroup reference(names(n, "cpu"), std::chrono::seconds(60));
  const size_t count = 4099;
  std::vector<std::vector<float>> got(n), expected(n), bcast(n), host(n);
  for (int r = 0; r < n; ++r) host[r] = random_vector(count, 70 + r);
  const auto status = run_threads(n, [&](int r) {
    ThreadStream ts(r);
    auto comm = group.communicator(r, ts.stream);
    auto ref = reference.communicator(r);
    DeviceBuffer<float> d(host[r]);
    comm->all_reduce_sum(d.get(), count, true, 0.25f);
    std::vector<float> h = host[r];
    ref->all_reduce_sum(h.data(), count, true, 0.25f);
    expected[r] = h;
    got[r] = d.download();
    DeviceBuffer<float> b(host[r]);
    comm->broadcast(b.get(), count, DType::kF32, 0);
    bcast[r] = b.download();
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_EQ(status[r], Status::kOk) << "rank " << r;
    EXPECT_LT(test::normalised_error(got[r], expected[r]), 1e-6) << "all_reduce_sum, rank " << r;
    EXPECT_TRUE(bitwise_equal(bcast[r], host[0])) << "broadcast, rank " << r;
  }
}

// The engine's buckets over GPUs: all_reduce_sum after all_reduce_sum, each scaled by a kernel on the
// communication stream after its NCCL call, whose completion is polled. A poll's "not ready" must not fail the next
// bucket's scale kernel (it did when launches read the thread's last-error slot). One rank, so that a machine with
// one GPU runs it; blocking calls and calls on the communication thread, as the engine makes them.
TEST(NcclGroupTest, ScaledSumsBackToBackOnOneRank) {
  DPAR_REQUIRE_GPU();
  NcclGroup group({0}, names(1, "cuda"), std::chrono::seconds(60));
  ThreadStream ts(0);
  const size_t count = size_t{1} << 24;  // 64 MiB: the scale kernel is long enough for polls to find it running
  const auto host = random_vector(count, 5);
  std::vector<float> expected = host;
  for (auto& x : expected) x = x * 0.5f * 0.5f * 0.5f * 0.5f;  // powers of two: exact, whatever the order
  std::vector<float> got;
  {
    auto comm = group.communicator(0, ts.stream);
    DeviceBuffer<float> d(host);
    for (int i = 0; i < 2; ++i) comm->all_reduce_sum(d.get(), count, true, 0.5f);
    for (int i = 0; i < 2; ++i)
      comm->async_run("bucket", [&] { comm->all_reduce_sum(d.get(), count, true, 0.5f); })->wait();
    got = d.download();
  }
  EXPECT_TRUE(bitwise_equal(got, expected));
}

// The same-GPU reduction reads every participant's buffer from the launch's arguments: buffers and contributors
// that change from call to call are each reduced as given (a table kept in device memory between calls could go
// stale).
TEST_P(CudaDeviceGroupTest, BuffersThatChangeEveryCallAreReducedAsGiven) {
  const int n = GetParam();
  const size_t count = 4099;
  CudaDeviceGroup group(std::vector<int>(n, 0), names(n, "cuda:0"), std::chrono::seconds(30));
  ThreadGroup reference(names(n, "cpu"), std::chrono::seconds(30));
  std::vector<std::vector<float>> got(n), expected(n);
  const auto status = run_threads(n, [&](int r) {
    ThreadStream ts(0);
    auto comm = group.communicator(r, ts.stream);
    auto ref = reference.communicator(r);
    DeviceBuffer<float> a(random_vector(count, 100 + r)), b(random_vector(count, 200 + r));
    std::vector<float> ha = random_vector(count, 100 + r), hb = random_vector(count, 200 + r);
    for (int call = 0; call < 6; ++call) {
      const bool use_a = call % 2 == 0;
      const bool contributes = (call + r) % 3 != 0;
      comm->all_reduce_sum(use_a ? a.get() : b.get(), count, contributes, call == 5 ? 0.25f : 1.0f);
      ref->all_reduce_sum(use_a ? ha.data() : hb.data(), count, contributes, call == 5 ? 0.25f : 1.0f);
    }
    DPAR_CUDA_CHECK(cudaStreamSynchronize(ts.stream), "sync");
    got[r] = a.download();
    const auto gb = b.download();
    got[r].insert(got[r].end(), gb.begin(), gb.end());
    expected[r] = ha;
    expected[r].insert(expected[r].end(), hb.begin(), hb.end());
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_EQ(status[r], Status::kOk) << "replica " << r;
    EXPECT_TRUE(bitwise_equal(got[r], expected[r])) << "replica " << r;
  }
}

TEST(CudaDeviceGroupLimits, MoreParticipantsThanOneLaunchCanNameAreRefused) {
  std::vector<std::string> many = names(kernels::cuda::SumBuffers::kMaxBuffers + 1, "cuda:0");
  try {
    CudaDeviceGroup group(std::vector<int>(many.size(), 0), many, std::chrono::seconds(1));
    FAIL() << "65 participants accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kNotSupported) << e.what();
  }
}

}  // namespace
}  // namespace dpar
