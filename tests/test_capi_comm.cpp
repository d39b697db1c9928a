// The collectives of the C ABI (dpar_comm_*), through dpar.h alone: results, asynchronous work, argument checks,
// and the mismatch and timeout reports that reach a C caller.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "dpar.h"
#include "dpar_api.h"

namespace {

#define ASSERT_OK(call) ASSERT_EQ((call), DPAR_OK) << #call << ": " << dpar_last_error()

// How a test's group is made: dpar_comm_group_create, or dpar_comm_group_create_on_devices over CPU devices (the
// same host group, reached through the device path that GPU groups take).
enum class Made { kPlain, kOnCpuDevices };

// Runs body(rank, comm) on one thread per member of a new in-process group; returns each rank's status.
template <class F>
std::vector<dpar_status> run_group(int size, double timeout, F body, Made made = Made::kPlain) {
  dpar_comm_options opts = DPAR_COMM_OPTIONS_INIT;
  opts.timeout_seconds = timeout;
  dpar_comm_group* group = nullptr;
  if (made == Made::kPlain) {
    EXPECT_EQ(dpar_comm_group_create(&group, static_cast<size_t>(size), &opts), DPAR_OK) << dpar_last_error();
  } else {
    std::vector<dpar_device> devices;
    for (int r = 0; r < size; ++r) devices.push_back({DPAR_DEVICE_CPU, r});
    EXPECT_EQ(dpar_comm_group_create_on_devices(&group, devices.data(), nullptr, devices.size(), &opts), DPAR_OK)
        << dpar_last_error();
  }
  std::vector<dpar_comm*> comms(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r)
    EXPECT_EQ(dpar_comm_group_member(&comms[r], group, static_cast<size_t>(r)), DPAR_OK);
  dpar_comm_group_free(group);  // the members keep it alive
  std::vector<dpar_status> status(static_cast<size_t>(size), DPAR_OK);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) threads.emplace_back([&, r] { status[r] = body(r, comms[r]); });
  for (auto& t : threads) t.join();
  for (dpar_comm* c : comms) dpar_comm_free(c);
  return status;
}

class CommApiMade : public ::testing::TestWithParam<Made> {};
INSTANTIATE_TEST_SUITE_P(CommApi, CommApiMade, ::testing::Values(Made::kPlain, Made::kOnCpuDevices),
                         [](const auto& info) { return info.param == Made::kPlain ? "Plain" : "OnCpuDevices"; });

TEST_P(CommApiMade, AllCollectivesGiveTheReferenceResults) {
  const int n = 3;
  const size_t count = 1000;
  auto status = run_group(n, 30, [&](int r, dpar_comm* c) -> dpar_status {
    size_t rank = 99, size = 99;
    if (dpar_comm_info(&rank, &size, c) != DPAR_OK || rank != size_t(r) || size != size_t(n)) return DPAR_ERR_INTERNAL;
    // Host memory: cpu:r for a group made on CPU devices, cpu:0 otherwise.
    dpar_device where{-1, -1};
    if (dpar_comm_device(&where, c) != DPAR_OK || where.kind != DPAR_DEVICE_CPU ||
        where.index != (GetParam() == Made::kPlain ? 0 : r))
      return DPAR_ERR_DEVICE;
    std::vector<double> x(count), sum(count);
    for (size_t i = 0; i < count; ++i) x[i] = double(i) + 1000.0 * r;
    if (dpar_comm_all_reduce(c, x.data(), sum.data(), count, DPAR_F64, DPAR_SUM)) return DPAR_ERR_INTERNAL;
    for (size_t i = 0; i < count; ++i)
      if (sum[i] != 3.0 * double(i) + 3000.0) return DPAR_ERR_MISMATCH;
    std::vector<int64_t> v(count, r), mx(count);
    if (dpar_comm_all_reduce(c, v.data(), mx.data(), count, DPAR_I64, DPAR_MAX)) return DPAR_ERR_INTERNAL;
    for (int64_t m : mx)
      if (m != n - 1) return DPAR_ERR_MISMATCH;
    std::vector<float> b(count, float(r));
    if (dpar_comm_broadcast(c, b.data(), count, DPAR_F32, 2)) return DPAR_ERR_INTERNAL;
    for (float f : b)
      if (f != 2.0f) return DPAR_ERR_MISMATCH;
    std::vector<int32_t> mine(4, r), all(4 * n);
    if (dpar_comm_all_gather(c, mine.data(), all.data(), 4, DPAR_I32)) return DPAR_ERR_INTERNAL;
    for (size_t i = 0; i < all.size(); ++i)
      if (all[i] != int32_t(i / 4)) return DPAR_ERR_MISMATCH;
    // Every element distinct across ranks, blocks and positions, so that a wrong op (sum), block or rank shows:
    // rank r sends 10 r + 3 b + e at element e of block b; block r's mean is 10 (n - 1) / 2 + 3 r + e, exactly.
    std::vector<float> blocks(2 * n), block(2, -1.0f);
    for (int b = 0; b < n; ++b)
      for (int e = 0; e < 2; ++e) blocks[size_t(2 * b + e)] = float(10 * r + 3 * b + e);
    if (dpar_comm_reduce_scatter(c, blocks.data(), block.data(), 2, DPAR_F32, DPAR_MEAN)) return DPAR_ERR_INTERNAL;
    for (int e = 0; e < 2; ++e)
      if (block[size_t(e)] != float(10 * (n - 1) / 2 + 3 * r + e)) return DPAR_ERR_MISMATCH;
    float one = 1.0f, total = 0.0f;
    if (dpar_comm_reduce(c, &one, r == 0 ? &total : nullptr, 1, DPAR_F32, DPAR_SUM, 0)) return DPAR_ERR_INTERNAL;
    if (r == 0 && total != float(n)) return DPAR_ERR_MISMATCH;
    return dpar_comm_barrier(c);
  }, GetParam());
  for (int r = 0; r < n; ++r) EXPECT_EQ(status[r], DPAR_OK) << "rank " << r;
}

TEST(CommApi, AGroupOnDevicesChecksItsArguments) {
  dpar_comm_group* group = nullptr;
  const dpar_device cpus[2] = {{DPAR_DEVICE_CPU, 0}, {DPAR_DEVICE_CPU, 1}};
  EXPECT_EQ(dpar_comm_group_create_on_devices(nullptr, cpus, nullptr, 2, nullptr), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(dpar_comm_group_create_on_devices(&group, nullptr, nullptr, 2, nullptr), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dpar_last_error()).find("devices"), std::string::npos) << dpar_last_error();
  EXPECT_EQ(dpar_comm_group_create_on_devices(&group, cpus, nullptr, 0, nullptr), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dpar_last_error()).find("size"), std::string::npos) << dpar_last_error();
  const dpar_device negative[2] = {{DPAR_DEVICE_CPU, 0}, {DPAR_DEVICE_CPU, -1}};
  EXPECT_EQ(dpar_comm_group_create_on_devices(&group, negative, nullptr, 2, nullptr), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dpar_last_error()).find("devices[1]"), std::string::npos) << dpar_last_error();
  const dpar_device unknown[1] = {{7, 0}};
  EXPECT_EQ(dpar_comm_group_create_on_devices(&group, unknown, nullptr, 1, nullptr), DPAR_ERR_INVALID_ARGUMENT);
  // A CPU buffer has no stream to be ordered on.
  int not_a_stream = 0;
  void* streams[2] = {nullptr, &not_a_stream};
  EXPECT_EQ(dpar_comm_group_create_on_devices(&group, cpus, streams, 2, nullptr), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dpar_last_error()).find("streams[1]"), std::string::npos) << dpar_last_error();
  dpar_comm_options bad = DPAR_COMM_OPTIONS_INIT;
  bad.timeout_seconds = 0;
  EXPECT_EQ(dpar_comm_group_create_on_devices(&group, cpus, nullptr, 2, &bad), DPAR_ERR_INVALID_ARGUMENT);
  // A GPU: refused cleanly where there is none or CUDA is not built; next to a CPU device, refused for the kinds.
  size_t gpus = 0;
  const bool cuda_built = dpar_device_count(&gpus, DPAR_DEVICE_CUDA) == DPAR_OK;
  const dpar_device mixed[2] = {{DPAR_DEVICE_CUDA, 0}, {DPAR_DEVICE_CPU, 0}};
  const dpar_status got = dpar_comm_group_create_on_devices(&group, mixed, nullptr, 2, nullptr);
  const std::string why = dpar_last_error();
  if (!cuda_built) {
    EXPECT_EQ(got, DPAR_ERR_NOT_SUPPORTED) << why;
  } else if (gpus == 0) {
    EXPECT_EQ(got, DPAR_ERR_DEVICE) << why;
    EXPECT_NE(why.find("devices[0]: cuda:0: no cuda device"), std::string::npos) << why;
  } else {
    EXPECT_EQ(got, DPAR_ERR_INVALID_ARGUMENT) << why;
    EXPECT_NE(why.find("one kind"), std::string::npos) << why;
  }
  EXPECT_EQ(group, nullptr);
  // A group of one on a CPU device is the identity, and its member says where its buffers are.
  ASSERT_OK(dpar_comm_group_create_on_devices(&group, cpus + 1, nullptr, 1, nullptr));
  dpar_comm* c = nullptr;
  EXPECT_EQ(dpar_comm_group_member(&c, group, 1), DPAR_ERR_INVALID_ARGUMENT);
  ASSERT_OK(dpar_comm_group_member(&c, group, 0));
  dpar_device where{-1, -1};
  EXPECT_EQ(dpar_comm_device(nullptr, c), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(dpar_comm_device(&where, nullptr), DPAR_ERR_INVALID_ARGUMENT);
  ASSERT_OK(dpar_comm_device(&where, c));
  EXPECT_EQ(where.kind, DPAR_DEVICE_CPU);
  EXPECT_EQ(where.index, 1);
  float x[3] = {1, 2, 3};
  ASSERT_OK(dpar_comm_all_reduce(c, x, x, 3, DPAR_F32, DPAR_MEAN));
  EXPECT_EQ(x[2], 3.0f);
  dpar_comm_group_free(group);
  dpar_comm_free(c);
}

TEST(CommApi, AsyncWorkCompletesInOrder) {
  const int n = 2;
  auto status = run_group(n, 30, [&](int r, dpar_comm* c) -> dpar_status {
    std::vector<float> a(4096, float(r + 1)), b(4096, float(10 * (r + 1)));
    dpar_work *wa = nullptr, *wb = nullptr;
    if (dpar_comm_all_reduce_async(&wa, c, a.data(), a.data(), a.size(), DPAR_F32, DPAR_SUM)) return DPAR_ERR_INTERNAL;
    if (dpar_comm_all_reduce_async(&wb, c, b.data(), b.data(), b.size(), DPAR_F32, DPAR_SUM)) return DPAR_ERR_INTERNAL;
    int32_t done = -1;
    if (dpar_work_test(&done, wa) != DPAR_OK || (done != 0 && done != 1)) return DPAR_ERR_INTERNAL;
    if (dpar_work_wait(wb) != DPAR_OK || dpar_work_wait(wa) != DPAR_OK) return DPAR_ERR_INTERNAL;
    if (dpar_work_test(&done, wa) != DPAR_OK || done != 1) return DPAR_ERR_INTERNAL;
    dpar_work_free(wa);
    dpar_work_free(wb);
    return a[17] == 3.0f && b[4095] == 30.0f ? DPAR_OK : DPAR_ERR_MISMATCH;
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(status[r], DPAR_OK) << "rank " << r;
}

// A blocking collective called while the participant's asynchronous ones are queued runs after them, never beside
// them: the participants' collectives stay in one order (a blocking one running beside a queued one would pair
// with the wrong call of the others, or touch the participant's state from two threads at once).
TEST(CommApi, ABlockingCollectiveAfterAsyncOnesRunsAfterThem) {
  const int n = 3;
  auto status = run_group(n, 30, [&](int r, dpar_comm* c) -> dpar_status {
    std::vector<float> a(1 << 16, float(r + 1)), b(64, float(10 * (r + 1)));
    std::vector<int64_t> g(n, -1);
    const int64_t mine = r;
    dpar_work *wa = nullptr, *wb = nullptr;
    if (dpar_comm_all_reduce_async(&wa, c, a.data(), a.data(), a.size(), DPAR_F32, DPAR_SUM)) return DPAR_ERR_INTERNAL;
    // Blocking, while the asynchronous one may still be queued: an all-gather of a different size and type.
    const dpar_status gathered = dpar_comm_all_gather(c, &mine, g.data(), 1, DPAR_I64);
    if (dpar_comm_broadcast_async(&wb, c, b.data(), b.size(), DPAR_F32, 2)) return DPAR_ERR_INTERNAL;
    const dpar_status barrier = dpar_comm_barrier(c);
    const dpar_status wait_a = dpar_work_wait(wa), wait_b = dpar_work_wait(wb);
    dpar_work_free(wa);
    dpar_work_free(wb);
    if (gathered != DPAR_OK) return gathered;
    if (barrier != DPAR_OK) return barrier;
    if (wait_a != DPAR_OK) return wait_a;
    if (wait_b != DPAR_OK) return wait_b;
    for (int p = 0; p < n; ++p)
      if (g[p] != p) return DPAR_ERR_MISMATCH;
    return a[12345] == 6.0f && b[63] == 30.0f ? DPAR_OK : DPAR_ERR_MISMATCH;
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(status[r], DPAR_OK) << "rank " << r << ": " << dpar_status_str(status[r]);
}

TEST(CommApi, DifferentCountsAreAMismatchForEveryParticipant) {
  std::vector<std::string> messages(2);
  auto status = run_group(2, 30, [&](int r, dpar_comm* c) -> dpar_status {
    std::vector<float> x(r == 0 ? 100 : 200, 1.0f);
    dpar_status s = dpar_comm_all_reduce(c, x.data(), x.data(), x.size(), DPAR_F32, DPAR_SUM);
    messages[r] = dpar_last_error();
    return s;
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(status[r], DPAR_ERR_MISMATCH) << messages[r];
    EXPECT_NE(messages[r].find("all_reduce"), std::string::npos) << messages[r];
    EXPECT_NE(messages[r].find("participant 1"), std::string::npos) << messages[r];
  }
}

TEST(CommApi, AParticipantThatNeverArrivesIsNamed) {
  std::vector<std::string> messages(3);
  auto status = run_group(3, 0.2, [&](int r, dpar_comm* c) -> dpar_status {
    if (r == 2) return DPAR_OK;  // skips the barrier
    dpar_status s = dpar_comm_barrier(c);
    messages[r] = dpar_last_error();
    return s;
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(status[r] == DPAR_ERR_TIMEOUT || status[r] == DPAR_ERR_REMOTE) << messages[r];
    EXPECT_NE(messages[r].find("participant 2"), std::string::npos) << messages[r];
  }
}

TEST(CommApi, ArgumentsAreChecked) {
  dpar_comm_group* group = nullptr;
  EXPECT_EQ(dpar_comm_group_create(nullptr, 2, nullptr), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(dpar_comm_group_create(&group, 0, nullptr), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dpar_last_error()).find("size"), std::string::npos);
  dpar_comm_options bad = DPAR_COMM_OPTIONS_INIT;
  bad.version = 42;
  EXPECT_EQ(dpar_comm_group_create(&group, 2, &bad), DPAR_ERR_INVALID_ARGUMENT);
  bad = dpar_comm_options DPAR_COMM_OPTIONS_INIT;
  bad.timeout_seconds = -1;
  EXPECT_EQ(dpar_comm_group_create(&group, 2, &bad), DPAR_ERR_INVALID_ARGUMENT);
  ASSERT_OK(dpar_comm_group_create(&group, 1, nullptr));
  dpar_comm* c = nullptr;
  EXPECT_EQ(dpar_comm_group_member(&c, group, 1), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dpar_last_error()).find("rank"), std::string::npos);
  ASSERT_OK(dpar_comm_group_member(&c, group, 0));
  float x[4] = {1, 2, 3, 4};
  EXPECT_EQ(dpar_comm_all_reduce(nullptr, x, x, 4, DPAR_F32, DPAR_SUM), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(dpar_comm_all_reduce(c, nullptr, x, 4, DPAR_F32, DPAR_SUM), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dpar_last_error()).find("send"), std::string::npos);
  EXPECT_EQ(dpar_comm_all_reduce(c, x, x, 4, DPAR_BF16, DPAR_SUM), DPAR_ERR_NOT_SUPPORTED);
  EXPECT_EQ(dpar_comm_all_reduce(c, x, x, 4, 77, DPAR_SUM), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(dpar_comm_all_reduce(c, x, x, 4, DPAR_F32, 9), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dpar_last_error()).find("op"), std::string::npos);
  EXPECT_EQ(dpar_comm_broadcast(c, x, 4, DPAR_F32, 1), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dpar_last_error()).find("root"), std::string::npos);
  dpar_work* w = nullptr;
  EXPECT_EQ(dpar_comm_all_reduce_async(nullptr, c, x, x, 4, DPAR_F32, DPAR_SUM), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(dpar_work_wait(nullptr), DPAR_ERR_INVALID_ARGUMENT);
  int32_t done = 0;
  EXPECT_EQ(dpar_work_test(&done, reinterpret_cast<dpar_work*>(c)), DPAR_ERR_INVALID_ARGUMENT);
  // The communicator still works after the refusals, and a group of one is the identity.
  ASSERT_OK(dpar_comm_all_reduce_async(&w, c, x, x, 4, DPAR_F32, DPAR_SUM));
  ASSERT_OK(dpar_work_wait(w));
  dpar_work_free(w);
  EXPECT_EQ(x[3], 4.0f);
  dpar_comm_free(c);
  EXPECT_EQ(dpar_comm_barrier(c), DPAR_ERR_INVALID_ARGUMENT);  // freed
  dpar_comm_group_free(group);
  dpar_comm_free(nullptr);
  dpar_comm_group_free(nullptr);
  dpar_work_free(nullptr);
}

TEST(CommApi, AbortReleasesEveryWaiterAndShowsAsAnAsyncError) {
  const int n = 3;
  std::atomic<int> waiting{0};
  std::vector<std::string> messages(n);
  std::vector<dpar_status> async_before(n, -99), async_after(n, -99);
  std::vector<std::string> async_reason(n);
  auto status = run_group(n, 60, [&](int r, dpar_comm* c) -> dpar_status {
    dpar_status s = -99;
    if (dpar_comm_get_async_error(&s, c) != DPAR_OK) return DPAR_ERR_INTERNAL;
    async_before[r] = s;
    if (dpar_comm_barrier(c) != DPAR_OK) return DPAR_ERR_INTERNAL;  // everyone checked before the abort
    dpar_status result = DPAR_OK;
    if (r == 2) {
      // Participant 2 never joins: it aborts once the others wait for it (60 s timeout: only the abort ends it).
      while (waiting.load() < n - 1) std::this_thread::yield();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      if (dpar_comm_abort(c, "the input pipeline died") != DPAR_OK) return DPAR_ERR_INTERNAL;
      float x = 1.0f;
      result = dpar_comm_all_reduce(c, &x, &x, 1, DPAR_F32, DPAR_SUM);  // refused too
    } else {
      float x = 1.0f;
      waiting++;
      result = dpar_comm_all_reduce(c, &x, &x, 1, DPAR_F32, DPAR_SUM);
    }
    messages[r] = dpar_last_error();
    if (dpar_comm_get_async_error(&s, c) != DPAR_OK) return DPAR_ERR_INTERNAL;
    async_after[r] = s;
    async_reason[r] = dpar_last_error();
    return result;
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(status[r], DPAR_ERR_REMOTE) << r << ": " << messages[r];
    EXPECT_NE(messages[r].find("the input pipeline died"), std::string::npos) << messages[r];
    EXPECT_EQ(async_before[r], DPAR_OK);
    EXPECT_EQ(async_after[r], DPAR_ERR_REMOTE);
    EXPECT_NE(async_reason[r].find("participant 2 called dpar_comm_abort"), std::string::npos) << async_reason[r];
  }
  dpar_status s = DPAR_OK;
  EXPECT_EQ(dpar_comm_abort(nullptr, nullptr), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(dpar_comm_get_async_error(&s, nullptr), DPAR_ERR_INVALID_ARGUMENT);
}

TEST(CommApi, FailedAsyncWorkShowsAsAnAsyncError) {
  // Participant 1 starts an all-reduce that participant 0 never joins: after the timeout its work fails, and the
  // communicator reports it without another collective being called.
  auto status = run_group(2, 0.2, [&](int r, dpar_comm* c) -> dpar_status {
    if (r == 0) return DPAR_OK;
    float x = 1.0f;
    dpar_work* w = nullptr;
    if (dpar_comm_all_reduce_async(&w, c, &x, &x, 1, DPAR_F32, DPAR_SUM) != DPAR_OK) return DPAR_ERR_INTERNAL;
    const dpar_status waited = dpar_work_wait(w);
    dpar_work_free(w);
    dpar_status s = DPAR_OK;
    if (dpar_comm_get_async_error(&s, c) != DPAR_OK) return DPAR_ERR_INTERNAL;
    return waited == DPAR_ERR_TIMEOUT && s != DPAR_OK ? DPAR_OK : DPAR_ERR_MISMATCH;
  });
  EXPECT_EQ(status[0], DPAR_OK);
  EXPECT_EQ(status[1], DPAR_OK) << dpar_last_error();
}

TEST(CommApi, TheFunctionTableReachesEveryFunction) {
  const auto* api = static_cast<const dpar_api_v1*>(dpar_get_api(DPAR_API_TABLE_VERSION));
  ASSERT_NE(api, nullptr);
  EXPECT_EQ(api->size, sizeof(dpar_api_v1));
  EXPECT_EQ(api->dpar_version, &dpar_version);
  EXPECT_EQ(api->dpar_comm_all_reduce, &dpar_comm_all_reduce);
  EXPECT_EQ(api->dpar_engine_train_step, &dpar_engine_train_step);
  EXPECT_EQ(dpar_get_api(DPAR_API_TABLE_VERSION + 1), nullptr);
  // Every entry is set.
  const auto* slots = reinterpret_cast<void (*const*)(void)>(reinterpret_cast<const char*>(api) +
                                                                offsetof(dpar_api_v1, dpar_version));
  const size_t n = (sizeof(dpar_api_v1) - offsetof(dpar_api_v1, dpar_version)) / sizeof(void (*)(void));
  for (size_t i = 0; i < n; ++i) EXPECT_NE(slots[i], nullptr) << "entry " << i;
}

}  // namespace

// ---- The gradient reducer (dpar_reducer_*) ------------------------------------------------------------------

namespace {

// Gradient buffers of one participant, separate allocations (not adjacent: staged buckets).
struct Grads {
  std::vector<std::vector<float>> buffers;
  std::vector<float*> pointers;
  std::vector<size_t> counts;
  explicit Grads(const std::vector<size_t>& sizes) {
    for (size_t n : sizes) buffers.emplace_back(n);
    for (auto& b : buffers) {
      pointers.push_back(b.data());
      counts.push_back(b.size());
    }
  }
};

dpar_reducer_options small_buckets() {
  dpar_reducer_options o = DPAR_REDUCER_OPTIONS_INIT;
  o.first_bucket_bytes = 256;
  o.bucket_cap_bytes = 2048;
  return o;
}

}  // namespace

class ReducerApiMade : public ::testing::TestWithParam<Made> {};
INSTANTIATE_TEST_SUITE_P(ReducerApi, ReducerApiMade, ::testing::Values(Made::kPlain, Made::kOnCpuDevices),
                         [](const auto& info) { return info.param == Made::kPlain ? "Plain" : "OnCpuDevices"; });

TEST_P(ReducerApiMade, AveragesWhatEachParticipantProducedStepAfterStep) {
  // Four participants with their own backward order; participant 3 leaves gradient 1 out (an unused parameter);
  // participant 2 produces nothing in step 1 (no data). Buffers hold the mean over the participants, missing = 0.
  const int n = 4;
  const std::vector<size_t> sizes = {300, 7, 1200, 64, 513};
  auto status = run_group(n, 30, [&](int r, dpar_comm* c) -> dpar_status {
    Grads g(sizes);
    dpar_reducer_options o = small_buckets();
    dpar_reducer* red = nullptr;
    if (dpar_status s = dpar_reducer_create(&red, c, g.pointers.data(), g.counts.data(), sizes.size(), &o)) return s;
    size_t buckets = 0;
    if (dpar_reducer_num_buckets(&buckets, red) || buckets < 3) return DPAR_ERR_INTERNAL;
    for (int step = 0; step < 3; ++step) {
      const bool idle = r == 2 && step == 1;
      std::vector<size_t> order = {4, 3, 2, 1, 0};
      if (r % 2) std::swap(order[0], order[2]);  // another arrival order, the same launch order
      for (size_t k : order) {
        if (idle || (r == 3 && k == 1)) {
          std::fill(g.buffers[k].begin(), g.buffers[k].end(), NAN);  // ignored
          continue;
        }
        for (size_t i = 0; i < sizes[k]; ++i) g.buffers[k][i] = float(r + 1) * 4.0f + float(k) + float(step);
        if (dpar_status s = dpar_reducer_grad_ready(red, k)) return s;
      }
      if (dpar_status s = dpar_reducer_wait(red)) return s;
      for (size_t k = 0; k < sizes.size(); ++k) {
        float sum = 0;
        for (int p = 0; p < n; ++p)
          if (!(p == 2 && step == 1) && !(p == 3 && k == 1)) sum += float(p + 1) * 4.0f + float(k) + float(step);
        for (float v : g.buffers[k])
          if (v != sum / n) return DPAR_ERR_MISMATCH;
      }
    }
    dpar_reducer_free(red);
    return DPAR_OK;
  }, GetParam());
  for (int r = 0; r < n; ++r) EXPECT_EQ(status[r], DPAR_OK) << "participant " << r;
}

TEST(ReducerApi, RefusesBadArgumentsAndKeepsTheStep) {
  auto status = run_group(1, 30, [&](int, dpar_comm* c) -> dpar_status {
    Grads g({10, 20});
    dpar_reducer* red = nullptr;
    const size_t zero[2] = {10, 0};
    float* same[2] = {g.pointers[0], g.pointers[0] + 5};  // overlapping
    float* null_one[2] = {g.pointers[0], nullptr};
    dpar_reducer_options bad_op = DPAR_REDUCER_OPTIONS_INIT;
    bad_op.op = DPAR_MAX;
    dpar_reducer_options bad_version = DPAR_REDUCER_OPTIONS_INIT;
    bad_version.version = 99;
    // Each refusal is checked as it happens: the status, the field its message names, and *out left NULL.
    auto refused = [&](dpar_status got, const char* needle) {
      return got == DPAR_ERR_INVALID_ARGUMENT && std::string(dpar_last_error()).find(needle) != std::string::npos;
    };
    const bool all_refused =
        refused(dpar_reducer_create(nullptr, c, g.pointers.data(), g.counts.data(), 2, nullptr), "out") &&
        refused(dpar_reducer_create(&red, nullptr, g.pointers.data(), g.counts.data(), 2, nullptr), "comm") &&
        refused(dpar_reducer_create(&red, c, nullptr, g.counts.data(), 2, nullptr), "grads") &&
        refused(dpar_reducer_create(&red, c, g.pointers.data(), nullptr, 2, nullptr), "counts") &&
        refused(dpar_reducer_create(&red, c, g.pointers.data(), g.counts.data(), 0, nullptr), "num_grads") &&
        refused(dpar_reducer_create(&red, c, g.pointers.data(), zero, 2, nullptr), "counts[1]") &&
        refused(dpar_reducer_create(&red, c, same, g.counts.data(), 2, nullptr), "overlap") &&
        refused(dpar_reducer_create(&red, c, null_one, g.counts.data(), 2, nullptr), "grads[1]") &&
        refused(dpar_reducer_create(&red, c, g.pointers.data(), g.counts.data(), 2, &bad_op), "opts.op") &&
        refused(dpar_reducer_create(&red, c, g.pointers.data(), g.counts.data(), 2, &bad_version), "version");
    if (!all_refused) return DPAR_ERR_INTERNAL;
    if (red != nullptr) return DPAR_ERR_INTERNAL;
    if (dpar_reducer_create(&red, c, g.pointers.data(), g.counts.data(), 2, nullptr)) return DPAR_ERR_INTERNAL;
    std::fill(g.buffers[0].begin(), g.buffers[0].end(), 3.0f);
    std::fill(g.buffers[1].begin(), g.buffers[1].end(), 5.0f);
    if (dpar_reducer_grad_ready(red, 1)) return DPAR_ERR_INTERNAL;
    if (dpar_reducer_grad_ready(red, 1) != DPAR_ERR_INVALID_STATE) return DPAR_ERR_INTERNAL;
    if (dpar_reducer_grad_ready(red, 2) != DPAR_ERR_INVALID_ARGUMENT) return DPAR_ERR_INTERNAL;
    if (dpar_reducer_grad_ready(nullptr, 0) != DPAR_ERR_INVALID_ARGUMENT) return DPAR_ERR_INTERNAL;
    if (dpar_reducer_wait(nullptr) != DPAR_ERR_INVALID_ARGUMENT) return DPAR_ERR_INTERNAL;
    // The step went on: gradient 1 counts, gradient 0 (never marked) is zero.
    if (dpar_reducer_wait(red)) return DPAR_ERR_INTERNAL;
    for (float v : g.buffers[0])
      if (v != 0.0f) return DPAR_ERR_MISMATCH;
    for (float v : g.buffers[1])
      if (v != 5.0f) return DPAR_ERR_MISMATCH;
    dpar_reducer_free(red);
    if (dpar_reducer_wait(red) != DPAR_ERR_INVALID_ARGUMENT) return DPAR_ERR_INTERNAL;  // freed
    dpar_reducer_free(nullptr);
    return DPAR_OK;
  });
  EXPECT_EQ(status[0], DPAR_OK) << dpar_last_error();
}

TEST(ReducerApi, OutlivesItsCommunicatorHandle) {
  dpar_comm_group* group = nullptr;
  ASSERT_OK(dpar_comm_group_create(&group, 1, nullptr));
  dpar_comm* c = nullptr;
  ASSERT_OK(dpar_comm_group_member(&c, group, 0));
  dpar_comm_group_free(group);
  std::vector<float> g(100, 2.0f);
  float* p = g.data();
  const size_t n = g.size();
  dpar_reducer_options o = DPAR_REDUCER_OPTIONS_INIT;
  o.op = DPAR_SUM;
  dpar_reducer* red = nullptr;
  ASSERT_OK(dpar_reducer_create(&red, c, &p, &n, 1, &o));
  dpar_comm_free(c);  // the reducer keeps the communicator
  ASSERT_OK(dpar_reducer_grad_ready(red, 0));
  ASSERT_OK(dpar_reducer_wait(red));
  EXPECT_EQ(g, std::vector<float>(100, 2.0f));
  dpar_reducer_free(red);
}

TEST(ReducerApi, AParticipantThatNeverWaitsIsNamed) {
  // Participant 1 marks its gradients but never calls wait (it hangs elsewhere): the others' wait times out naming
  // it instead of hanging.
  auto status = run_group(3, 0.5, [&](int r, dpar_comm* c) -> dpar_status {
    Grads g({1000, 1000});
    dpar_reducer_options o = small_buckets();
    dpar_reducer* red = nullptr;
    if (dpar_status s = dpar_reducer_create(&red, c, g.pointers.data(), g.counts.data(), 2, &o)) return s;
    dpar_status result = DPAR_OK;
    if (r != 1) {
      dpar_reducer_grad_ready(red, 1);
      dpar_reducer_grad_ready(red, 0);
      result = dpar_reducer_wait(red);
      // The first to give up reports TIMEOUT; one that finds the group given up on reports REMOTE. Both name
      // the participant that never came.
      if (std::string(dpar_last_error()).find("participant 1") == std::string::npos) result = DPAR_ERR_INTERNAL;
    }
    dpar_reducer_free(red);
    return result;
  });
  for (int r : {0, 2}) EXPECT_TRUE(status[r] == DPAR_ERR_TIMEOUT || status[r] == DPAR_ERR_REMOTE) << status[r];
  EXPECT_TRUE(status[0] == DPAR_ERR_TIMEOUT || status[2] == DPAR_ERR_TIMEOUT);
}
