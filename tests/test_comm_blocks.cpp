// The sharded gradient path of the threads backend (reduce_scatter_sum, all_gather_blocks: Communicator in
// comm/communicator.h) against all_reduce_sum and slicing, bit for bit, over groups of 1 to 4 participants; the one
// call check and its one mismatch message; and the reduction module's kernels (comm/reduce_kernels.h).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/reduce_kernels.h"
#include "comm/threads_comm.h"
#include "common/bf16.h"
#include "common/error.h"

namespace dpar {
namespace {

// memcmp of n bytes, where n may be 0 and the pointers then null (an empty vector's data()): memcmp itself must not
// be given a null pointer even for 0 bytes.
int compare_bytes(const void* a, const void* b, size_t n) { return n == 0 ? 0 : std::memcmp(a, b, n); }

struct Group {
  explicit Group(int n) : group(names(n), std::chrono::seconds(60)) {
    for (int r = 0; r < n; ++r) comms.push_back(group.communicator(r));
  }
  static std::vector<std::string> names(int n) {
    std::vector<std::string> v;
    for (int r = 0; r < n; ++r) v.push_back("replica " + std::to_string(r));
    return v;
  }
  Communicator& operator[](int r) { return *comms[static_cast<size_t>(r)]; }
  ThreadGroup group;
  std::vector<std::unique_ptr<Communicator>> comms;
};

struct Outcome {
  Status status = Status::kOk;
  std::string message;
};

// Runs f(rank) on one thread per rank and returns how each ended.
template <class F>
std::vector<Outcome> on_ranks(int n, F&& f) {
  std::vector<Outcome> out(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        f(r);
      } catch (const Error& e) {
        out[static_cast<size_t>(r)] = {e.status(), e.what()};
      }
    });
  for (auto& t : threads) t.join();
  return out;
}

void expect_all_ok(const std::vector<Outcome>& out) {
  for (size_t r = 0; r < out.size(); ++r) ASSERT_EQ(out[r].status, Status::kOk) << "rank " << r << ": " << out[r].message;
}

// Floats with full mantissas and varied exponents: the order of a sum changes its bits, so equal bits mean the same
// kernel in the same order.
float noisy(int r, size_t i) {
  uint64_t x = (static_cast<uint64_t>(r) << 40) ^ (i * 0x9E3779B97F4A7C15ULL);
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 32;
  const float mant = static_cast<float>(static_cast<int64_t>(x & 0xFFFFFF) - 0x800000) / 0x800000;
  return std::ldexp(mant, static_cast<int>((x >> 24) % 24) - 12);
}

const size_t kCounts[] = {0, 1, 2, 3, 15, 16, 17, 33, 63, 100, 1000, 4099, 100003};

class Blocks : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(GroupSizes, Blocks, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return std::to_string(info.param) + "_ranks"; });

TEST(BlockRange, TilesTheBufferInBlocksOf16) {
  for (int n = 1; n <= 5; ++n)
    for (size_t count : kCounts) {
      const size_t per = ((count + n - 1) / n + 15) / 16 * 16;
      size_t next = 0;
      for (int r = 0; r < n; ++r) {
        const auto [begin, end] = Communicator::block_range(count, n, r);
        EXPECT_EQ(begin, std::min(count, per * r)) << count << " over " << n;
        EXPECT_EQ(begin, next) << count << " over " << n << ", block " << r;
        EXPECT_LE(end - begin, per);
        next = end;
      }
      EXPECT_EQ(next, count) << count << " over " << n;
    }
  EXPECT_EQ(Communicator::block_range(100, 4, 1), std::make_pair(size_t{32}, size_t{64}));
  EXPECT_EQ(Communicator::block_range(3, 4, 0), std::make_pair(size_t{0}, size_t{3}));  // fewer elements than ranks
  EXPECT_EQ(Communicator::block_range(3, 4, 3), std::make_pair(size_t{3}, size_t{3}));
}

// Block r of reduce_scatter_sum is block r of all_reduce_sum, bit for bit, with every pattern of contributors.
TEST_P(Blocks, ReduceScatterSumIsAllReduceSumSlicedBitForBit) {
  const int n = GetParam();
  Group g(n);
  for (size_t count : kCounts)
    for (int pattern = 0; pattern < 3; ++pattern)  // everyone; all but the last; nobody contributes
      for (float scale : {1.0f, 0.37f}) {
        auto contributes = [&](int r) { return pattern == 0 || (pattern == 1 && r != n - 1); };
        std::vector<std::vector<float>> reference(n, std::vector<float>(count)), sharded = reference;
        for (int r = 0; r < n; ++r)
          for (size_t i = 0; i < count; ++i) reference[r][i] = sharded[r][i] = noisy(r, i);
        expect_all_ok(on_ranks(n, [&](int r) {
          g[r].all_reduce_sum(reference[r].data(), count, contributes(r), scale);
          g[r].reduce_scatter_sum(sharded[r].data(), count, contributes(r), scale);
        }));
        for (int r = 0; r < n; ++r) {
          const auto [begin, end] = Communicator::block_range(count, n, r);
          ASSERT_EQ(compare_bytes(sharded[r].data() + begin, reference[r].data() + begin, (end - begin) * sizeof(float)),
                    0)
              << "count " << count << ", contributors pattern " << pattern << ", scale " << scale << ", rank " << r;
        }
      }
}

// The ZeRO-2 step: reduce-scatter, update one's own block, all-gather; every buffer ends equal to all_reduce_sum's.
TEST_P(Blocks, AllGatherBlocksSpreadsEveryOwnersBlock) {
  const int n = GetParam();
  Group g(n);
  for (size_t count : kCounts) {
    std::vector<std::vector<float>> reference(n, std::vector<float>(count)), sharded = reference;
    for (int r = 0; r < n; ++r)
      for (size_t i = 0; i < count; ++i) reference[r][i] = sharded[r][i] = noisy(r, i);
    expect_all_ok(on_ranks(n, [&](int r) {
      g[r].all_reduce_sum(reference[r].data(), count, true, 0.5f);
      g[r].reduce_scatter_sum(sharded[r].data(), count, true, 0.5f);
      // The rest of the buffer is unspecified: make it visibly wrong, so only the owners' blocks can fill it.
      const auto [begin, end] = Communicator::block_range(count, n, r);
      for (size_t i = 0; i < count; ++i)
        if (i < begin || i >= end) sharded[r][i] = NAN;
      g[r].all_gather_blocks(sharded[r].data(), count);
    }));
    for (int r = 0; r < n; ++r)
      ASSERT_EQ(compare_bytes(sharded[r].data(), reference[r].data(), count * sizeof(float)), 0)
          << "count " << count << ", rank " << r;
  }
  // The asynchronous forms run the same operations.
  std::vector<std::vector<float>> buf(n, std::vector<float>(1000, 1.0f));
  expect_all_ok(on_ranks(n, [&](int r) {
    g[r].async_reduce_scatter_sum(buf[r].data(), 1000, true, 2.0f)->wait();
    g[r].async_all_gather_blocks(buf[r].data(), 1000)->wait();
  }));
  for (int r = 0; r < n; ++r) EXPECT_EQ(buf[r], std::vector<float>(1000, 2.0f * n)) << "rank " << r;
}

TEST_P(Blocks, ARefusedCallReleasesTheOthers) {
  const int n = GetParam();
  Group g(n);
  std::vector<float> x(64, 1.0f);
  const auto out = on_ranks(n, [&](int r) {
    std::vector<float> mine = x;
    g[r].reduce_scatter_sum(r == n - 1 ? nullptr : mine.data(), 64, true, 1.0f);
  });
  for (int r = 0; r < n; ++r) {
    if (r == n - 1) {
      EXPECT_EQ(out[r].status, Status::kInvalidArgument) << out[r].message;
      EXPECT_EQ(out[r].message, "reduce_scatter_sum: buffer is null (count 64)");
    } else {
      EXPECT_EQ(out[r].status, Status::kRemote) << out[r].message;
      EXPECT_NE(out[r].message.find("replica " + std::to_string(n - 1) + " failed: reduce_scatter_sum: buffer is null"),
                std::string::npos)
          << out[r].message;
    }
  }
}

// Every backend gives this message for this mismatch (test_mpi_blocks compares the MPI backend's with it).
TEST_P(Blocks, MismatchIsTheOneMessage) {
  const int n = GetParam();
  if (n < 2) GTEST_SKIP() << "needs two participants";
  Group g(n);
  std::vector<std::vector<float>> buf(n, std::vector<float>(100, 1.0f));
  const auto out = on_ranks(n, [&](int r) {
    if (r == 1)
      g[r].all_reduce_sum(buf[r].data(), 100, true, 1.0f);
    else
      g[r].reduce_scatter_sum(buf[r].data(), 100, true, 1.0f);
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(out[r].status, Status::kMismatch);
    EXPECT_EQ(out[r].message, std::string(r == 1 ? "all_reduce_sum" : "reduce_scatter_sum") +
                                  ": participant 1 called all_reduce_sum of 100 f32 but participant 0 called "
                                  "reduce_scatter_sum of 100 f32; nothing was moved");
    EXPECT_EQ(buf[r], std::vector<float>(100, 1.0f)) << "no data moved";
  }
}

// The reduction module holds every backend's element-wise arithmetic.
TEST(ReduceKernels, Bf16SumsRoundInFloatAndMeansAndScalesAreTheModules) {
  const std::vector<float> a = {1.0f, 3.140625f, -2.5f, 1e-3f, 65504.0f, -0.0f};
  const std::vector<float> b = {0.00390625f, 2.71875f, 2.5f, 7e-4f, 1.5f, 0.0f};
  std::vector<uint16_t> x(a.size()), y(a.size());
  for (size_t i = 0; i < a.size(); ++i) x[i] = to_bf16(a[i]), y[i] = to_bf16(b[i]);
  std::vector<uint16_t> sum = x;
  reduce_into(DType::kBF16, ReduceOp::kSum, sum.data(), y.data(), sum.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(sum[i], to_bf16(from_bf16(x[i]) + from_bf16(y[i]))) << i;
  EXPECT_EQ(from_bf16(sum[0]), 1.0f);  // 1 + 2^-8 rounds back to 1 in bfloat16 (ties to even)

  std::vector<int32_t> ints = {7, -7, 8, -9};
  divide_by(DType::kI32, ints.data(), ints.size(), 2);
  EXPECT_EQ(ints, (std::vector<int32_t>{3, -3, 4, -4}));  // truncates toward zero
  std::vector<float> f = {1.0f, -3.0f, 0.1f};
  scale_f32(f.data(), 0.5f, f.size());
  EXPECT_EQ(f, (std::vector<float>{0.5f, -1.5f, 0.05f}));
  EXPECT_THROW(reduce_kernels(DType::kBF16, ReduceOp::kMax), Error);
}

}  // namespace
}  // namespace dpar
