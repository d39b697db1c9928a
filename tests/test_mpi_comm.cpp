// The MPI backend (src/comm/mpi_comm.*), run under mpirun with 1 to 4 ranks and alone (singleton MPI).
//
// Every rank knows every rank's data by construction (value(rank, i)), so each checks its result against a
// reference computed locally. Values are small multiples of 1/4, so float sums are exact in any order.
//
//   test_mpi_comm                     GoogleTest; dpar initialises MPI (MpiRuntime) and finalises it at exit
//   test_mpi_comm --init-mpi-first    the program initialises and finalises MPI itself; dpar must respect it
//   test_mpi_comm --rank-exit         not a test suite: rank 1 exits mid-run and the others print what they got
//                                     (tests/mpi/check_rank_exit.sh reads it)
//
// Output: rank 0 prints GoogleTest's usual report; every rank prints its own failures, prefixed "[rank r]".
#include <mpi.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "comm/mpi_comm.h"
#include "common/bf16.h"

namespace dpar {
namespace {

bool g_init_mpi_first = false;

using Seconds = std::chrono::duration<double>;
double since(std::chrono::steady_clock::time_point t0) {
  return Seconds(std::chrono::steady_clock::now() - t0).count();
}
void sleep_s(double s) { std::this_thread::sleep_for(Seconds(s)); }

MpiOptions options(double timeout = 60.0,
                   MpiOptions::Transfer transfer = MpiOptions::Transfer::kBlocking) {
  MpiOptions o;
  o.timeout_seconds = timeout;
  o.transfer = transfer;
  return o;
}

// The status and message of what f throws (Status::kOk, "" if nothing).
struct Outcome {
  Status status = Status::kOk;
  std::string message;
};
template <class F>
Outcome outcome(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    if (std::getenv("DPAR_TEST_PRINT_ERRORS"))
      std::fprintf(stderr, "error %d: %s\n", static_cast<int>(e.status()), e.what());
    return {e.status(), e.what()};
  }
  return {};
}
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::kF32; }
template <> constexpr DType dtype_of<double>() { return DType::kF64; }
template <> constexpr DType dtype_of<int32_t>() { return DType::kI32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::kI64; }

// Element i of rank r's contribution (`salt` varies it between blocks). Mixed signs, so that integer means
// truncate negative sums too; i64 values use the high bits.
template <class T>
T value(int r, size_t i, int salt = 0) {
  const int64_t base = static_cast<int64_t>((r * 37 + i * 11 + salt * 5 + 3) % 23) - 11 + 3 * r;
  if constexpr (std::is_floating_point_v<T>) return static_cast<T>(base) + static_cast<T>(0.25 * (r % 4));
  if constexpr (std::is_same_v<T, int64_t>) return base + (static_cast<int64_t>(i % 5) - 2) * (int64_t{1} << 34);
  return static_cast<T>(base);
}

template <class T>
T sentinel() {
  if constexpr (std::is_floating_point_v<T>) return std::numeric_limits<T>::quiet_NaN();
  return std::numeric_limits<T>::min() + 12345;
}

// The reduction of element i of every rank's contribution, as the backend must compute it.
template <class T>
T reference(ReduceOp op, int n, size_t i, int salt = 0) {
  T acc = value<T>(0, i, salt);
  for (int r = 1; r < n; ++r) {
    const T v = value<T>(r, i, salt);
    if (op == ReduceOp::kMax) acc = std::max(acc, v);
    else if (op == ReduceOp::kMin) acc = std::min(acc, v);
    else acc += v;
  }
  if (op == ReduceOp::kMean) acc /= static_cast<T>(n);
  return acc;
}

template <class T>
bool same(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) return a == b || (std::isnan(a) && std::isnan(b));
  return a == b;
}

// The first index where `got` differs from `want(i)`, or -1.
template <class T, class W>
long first_difference(const T* got, size_t count, W&& want) {
  for (size_t i = 0; i < count; ++i)
    if (!same(got[i], want(i))) return static_cast<long>(i);
  return -1;
}

// 1000 and 5000 straddle the size of a fused all-reduce (16 KiB / ranks) for most dtypes and rank counts.
const size_t kCounts[] = {0, 1, 17, 1000, 5000, 100003};
const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMax, ReduceOp::kMin};

std::string label(const char* what, DType dtype, ReduceOp op, size_t count, bool in_place, int root = -1) {
  return detail::concat(what, " ", dtype_name(dtype), " ", reduce_op_name(op), " count ", count,
                        in_place ? " in place" : " out of place", root >= 0 ? " root " : "",
                        root >= 0 ? std::to_string(root) : "");
}

class Collectives : public ::testing::TestWithParam<MpiOptions::Transfer> {
 protected:
  void SetUp() override { comm_ = std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, options(60.0, GetParam())); }
  std::unique_ptr<MpiCommunicator> comm_;

  template <class T>
  void all_reduce() {
    const int n = comm_->size(), r = comm_->rank();
    for (size_t count : kCounts)
      for (ReduceOp op : kOps)
        for (bool in_place : {false, true}) {
          SCOPED_TRACE(label("all_reduce", dtype_of<T>(), op, count, in_place));
          std::vector<T> send(count), recv(count, sentinel<T>());
          for (size_t i = 0; i < count; ++i) send[i] = value<T>(r, i);
          T* out = in_place ? send.data() : recv.data();
          comm_->all_reduce(send.data(), out, count, dtype_of<T>(), op);
          EXPECT_EQ(first_difference(out, count, [&](size_t i) { return reference<T>(op, n, i); }), -1);
          if (!in_place) {
            EXPECT_EQ(first_difference(send.data(), count, [&](size_t i) { return value<T>(r, i); }), -1)
                << "send changed";
          }
        }
  }

  template <class T>
  void broadcast() {
    const int n = comm_->size(), r = comm_->rank();
    for (size_t count : kCounts)
      for (int root = 0; root < n; ++root) {
        SCOPED_TRACE(label("broadcast", dtype_of<T>(), ReduceOp::kSum, count, true, root));
        std::vector<T> buffer(count, sentinel<T>());
        if (r == root)
          for (size_t i = 0; i < count; ++i) buffer[i] = value<T>(r, i);
        comm_->broadcast(buffer.data(), count, dtype_of<T>(), root);
        EXPECT_EQ(first_difference(buffer.data(), count, [&](size_t i) { return value<T>(root, i); }), -1);
      }
  }

  template <class T>
  void reduce() {
    const int n = comm_->size(), r = comm_->rank();
    for (size_t count : kCounts)
      for (ReduceOp op : kOps)
        for (bool in_place : {false, true})
          for (int root = 0; root < n; ++root) {
            SCOPED_TRACE(label("reduce", dtype_of<T>(), op, count, in_place, root));
            std::vector<T> send(count), recv(count, sentinel<T>());
            for (size_t i = 0; i < count; ++i) send[i] = value<T>(r, i);
            // recv may be null away from the root.
            T* out = in_place ? send.data() : (r == root ? recv.data() : nullptr);
            comm_->reduce(send.data(), out, count, dtype_of<T>(), op, root);
            if (r == root) {
              EXPECT_EQ(first_difference(out, count, [&](size_t i) { return reference<T>(op, n, i); }), -1);
            } else if (in_place) {
              EXPECT_EQ(first_difference(send.data(), count, [&](size_t i) { return value<T>(r, i); }), -1)
                  << "a non-root's buffer changed";
            }
          }
  }

  // mode 0: out of place; 1: send == recv + rank * count (MPI_IN_PLACE, NCCL); 2: send == recv.
  template <class T>
  void all_gather() {
    const int n = comm_->size(), r = comm_->rank();
    for (size_t count : kCounts)
      for (int mode = 0; mode < 3; ++mode) {
        SCOPED_TRACE(detail::concat("all_gather ", dtype_name(dtype_of<T>()), " count ", count, " mode ", mode));
        std::vector<T> send(count), recv(count * n, sentinel<T>());
        T* contribution = mode == 0 ? send.data() : mode == 1 ? recv.data() + r * count : recv.data();
        for (size_t i = 0; i < count; ++i) contribution[i] = value<T>(r, i);
        comm_->all_gather(contribution, recv.data(), count, dtype_of<T>());
        EXPECT_EQ(first_difference(recv.data(), count * n,
                                   [&](size_t i) { return value<T>(static_cast<int>(i / count), i % count); }),
                  -1);
      }
  }

  // mode 0: out of place; 1: recv == send (result at the start); 2: recv == send + rank * count (NCCL).
  template <class T>
  void reduce_scatter() {
    const int n = comm_->size(), r = comm_->rank();
    for (size_t count : kCounts)
      for (ReduceOp op : kOps)
        for (int mode = 0; mode < 3; ++mode) {
          SCOPED_TRACE(detail::concat("reduce_scatter ", dtype_name(dtype_of<T>()), " ", reduce_op_name(op),
                                      " count ", count, " mode ", mode));
          // Block b of every rank's send holds value(rank, i, salt = b).
          std::vector<T> send(count * n), recv(count, sentinel<T>());
          for (int b = 0; b < n; ++b)
            for (size_t i = 0; i < count; ++i) send[b * count + i] = value<T>(r, i, b);
          T* out = mode == 0 ? recv.data() : mode == 1 ? send.data() : send.data() + r * count;
          comm_->reduce_scatter(send.data(), out, count, dtype_of<T>(), op);
          EXPECT_EQ(first_difference(out, count, [&](size_t i) { return reference<T>(op, n, i, r); }), -1);
        }
  }
};

TEST_P(Collectives, AllReduce) {
  all_reduce<float>();
  all_reduce<double>();
  all_reduce<int32_t>();
  all_reduce<int64_t>();
}

TEST_P(Collectives, Broadcast) {
  broadcast<float>();
  broadcast<double>();
  broadcast<int32_t>();
  broadcast<int64_t>();
}

TEST_P(Collectives, Reduce) {
  reduce<float>();
  reduce<double>();
  reduce<int32_t>();
  reduce<int64_t>();
}

TEST_P(Collectives, AllGather) {
  all_gather<float>();
  all_gather<double>();
  all_gather<int32_t>();
  all_gather<int64_t>();
}

TEST_P(Collectives, ReduceScatter) {
  reduce_scatter<float>();
  reduce_scatter<double>();
  reduce_scatter<int32_t>();
  reduce_scatter<int64_t>();
}

// bfloat16 sums, the engine's compressed buckets: exact where every partial sum is a bfloat16 (whichever order MPI
// adds in), the same bits on every rank where they round, both in fused messages and through MPI_Allreduce's own
// op; other reductions are refused.
TEST_P(Collectives, Bf16AllReduceSumsInFloatAndEveryRankGetsTheSameBits) {
  const int n = comm_->size(), r = comm_->rank();
  for (size_t count : kCounts) {
    SCOPED_TRACE(detail::concat("bf16 count ", count));
    // Quarters of small integers: every partial sum has at most 8 significant bits, so none rounds.
    auto exact = [](int rank, size_t i) { return static_cast<float>(static_cast<int>((rank + 3 * i) % 9) - 4) * 0.25f; };
    std::vector<uint16_t> mine(count);
    for (size_t i = 0; i < count; ++i) mine[i] = to_bf16(exact(r, i));
    comm_->all_reduce(mine.data(), mine.data(), count, DType::kBF16, ReduceOp::kSum);
    long wrong = -1;
    for (size_t i = 0; i < count && wrong < 0; ++i) {
      float want = 0;
      for (int q = 0; q < n; ++q) want += exact(q, i);
      if (from_bf16(mine[i]) != want) wrong = static_cast<long>(i);
    }
    EXPECT_EQ(wrong, -1) << "first wrong element";
    // Values that round: every rank must still end with rank 0's bits.
    std::mt19937 gen(static_cast<uint32_t>(7 * r + 1));
    std::uniform_real_distribution<float> uniform(-3.0f, 3.0f);
    for (auto& h : mine) h = to_bf16(uniform(gen));
    comm_->all_reduce(mine.data(), mine.data(), count, DType::kBF16, ReduceOp::kSum);
    std::vector<uint16_t> root = mine;
    comm_->broadcast(root.data(), count, DType::kBF16, 0);
    EXPECT_EQ(root, mine) << "rank " << r << "'s sum differs from rank 0's";
  }
  uint16_t x = 0;
  for (ReduceOp op : {ReduceOp::kMean, ReduceOp::kMax}) {
    const auto o = outcome([&] { comm_->all_reduce(&x, &x, 1, DType::kBF16, op); });
    EXPECT_EQ(o.status, Status::kNotSupported) << o.message;
  }
}

TEST_P(Collectives, AllReduceSumWithNonContributorsAndScale) {
  const int n = comm_->size(), r = comm_->rank();
  auto contributes = [](int rank, int pattern) { return pattern == 0 ? true : pattern == 1 ? rank % 2 == 0 : false; };
  for (size_t count : kCounts)
    for (int pattern = 0; pattern < 3; ++pattern)
      for (float scale : {1.0f, 0.5f}) {
        SCOPED_TRACE(detail::concat("all_reduce_sum count ", count, " pattern ", pattern, " scale ", scale));
        std::vector<float> buffer(count);
        for (size_t i = 0; i < count; ++i)
          buffer[i] = contributes(r, pattern) ? value<float>(r, i) : std::numeric_limits<float>::quiet_NaN();
        comm_->all_reduce_sum(buffer.data(), count, contributes(r, pattern), scale);
        EXPECT_EQ(first_difference(buffer.data(), count,
                                   [&](size_t i) {
                                     float sum = 0;
                                     for (int q = 0; q < n; ++q)
                                       if (contributes(q, pattern)) sum += value<float>(q, i);
                                     return sum * scale;
                                   }),
                  -1);
      }
}

TEST_P(Collectives, ReduceSumLandsAtTheRoot) {
  // The Communicator's default reduce_sum: reduce() to the root, then the scale there.
  const int n = comm_->size(), r = comm_->rank();
  for (size_t count : kCounts)
    for (bool contributing : {true, false}) {
      SCOPED_TRACE(detail::concat("reduce_sum count ", count, contributing ? "" : ", rank 0 does not contribute"));
      const int root = n - 1;
      const bool mine = contributing || r != 0;
      std::vector<float> buffer(count);
      for (size_t i = 0; i < count; ++i) buffer[i] = mine ? value<float>(r, i) : std::numeric_limits<float>::quiet_NaN();
      comm_->reduce_sum(buffer.data(), count, mine, 0.5f, root);
      if (r != root) continue;
      EXPECT_EQ(first_difference(buffer.data(), count,
                                 [&](size_t i) {
                                   float sum = 0;
                                   for (int q = 0; q < n; ++q)
                                     if (contributing || q != 0) sum += value<float>(q, i);
                                   return sum * 0.5f;
                                 }),
                -1);
    }
}

TEST_P(Collectives, BarrierWaitsForEveryRank) {
  if (comm_->size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const auto t0 = std::chrono::steady_clock::now();
  if (comm_->rank() == 0) sleep_s(0.3);
  comm_->barrier("test barrier");
  if (comm_->rank() != 0) {
    EXPECT_GE(since(t0), 0.25);
  }
  EXPECT_EQ(comm_->sequence(), 1u);
}

TEST_P(Collectives, CountsBeyondOneMpiCallAreSplit) {
  detail::set_mpi_max_chunk_for_tests(1000);
  const int n = comm_->size(), r = comm_->rank();
  const size_t count = 100003;
  std::vector<double> send(count), recv(count);
  for (size_t i = 0; i < count; ++i) send[i] = value<double>(r, i);
  comm_->all_reduce(send.data(), recv.data(), count, DType::kF64, ReduceOp::kMean);
  EXPECT_EQ(first_difference(recv.data(), count, [&](size_t i) { return reference<double>(ReduceOp::kMean, n, i); }),
            -1);
  comm_->reduce(send.data(), recv.data(), count, DType::kF64, ReduceOp::kMax, n - 1);
  if (r == n - 1) {
    EXPECT_EQ(first_difference(recv.data(), count, [&](size_t i) { return reference<double>(ReduceOp::kMax, n, i); }),
              -1);
  }
  if (r == 0) recv = send;
  comm_->broadcast(recv.data(), count, DType::kF64, 0);
  EXPECT_EQ(first_difference(recv.data(), count, [&](size_t i) { return value<double>(0, i); }), -1);
  detail::set_mpi_max_chunk_for_tests(0);
}

// The reduction rules every backend shares (comm/reduce_kernels.h), both in a fused all-reduce (40 elements) and
// through MPI's own all-reduce (100003): a NaN from any rank, the last one included, propagates in max and min, as
// in the threads backend and PyTorch; integer sums wrap (two's complement) instead of overflowing.
TEST_P(Collectives, MaxMinPropagateNaNFromEveryRankAndIntegerSumsWrap) {
  const int n = comm_->size(), r = comm_->rank();
  const float fnan = std::numeric_limits<float>::quiet_NaN();
  const double dnan = std::numeric_limits<double>::quiet_NaN();
  for (size_t count : {size_t{40}, size_t{100003}}) {
    for (ReduceOp op : {ReduceOp::kMax, ReduceOp::kMin}) {
      SCOPED_TRACE(detail::concat(reduce_op_name(op), " count ", count));
      std::vector<float> f(count, 1.0f);
      std::vector<double> d(count, 1.0);
      if (r == n - 1) f[3] = fnan, d[3] = dnan;  // only the last rank's
      if (r == 0) f[5] = fnan, d[5] = dnan, f[7] = 2.0f, d[7] = 2.0;
      comm_->all_reduce(f.data(), f.data(), count, DType::kF32, op);
      comm_->all_reduce(d.data(), d.data(), count, DType::kF64, op);
      EXPECT_TRUE(std::isnan(f[3]) && std::isnan(d[3])) << "a NaN of the last rank was dropped";
      EXPECT_TRUE(std::isnan(f[5]) && std::isnan(d[5])) << "a NaN of rank 0 was dropped";
      const double want7 = op == ReduceOp::kMax || n == 1 ? 2.0 : 1.0;
      EXPECT_EQ(f[7], want7);
      EXPECT_EQ(d[7], want7);
      EXPECT_EQ(f[8], 1.0f);
      EXPECT_EQ(d[count - 1], 1.0);
    }
    SCOPED_TRACE(detail::concat("sum count ", count));
    std::vector<int32_t> a(count, std::numeric_limits<int32_t>::max());
    std::vector<int64_t> b(count, std::numeric_limits<int64_t>::max());
    comm_->all_reduce(a.data(), a.data(), count, DType::kI32, ReduceOp::kSum);
    comm_->all_reduce(b.data(), b.data(), count, DType::kI64, ReduceOp::kSum);
    const auto want32 = static_cast<int32_t>(static_cast<uint32_t>(INT32_MAX) * static_cast<uint32_t>(n));
    const auto want64 = static_cast<int64_t>(static_cast<uint64_t>(INT64_MAX) * static_cast<uint64_t>(n));
    EXPECT_EQ(first_difference(a.data(), count, [&](size_t) { return want32; }), -1);
    EXPECT_EQ(first_difference(b.data(), count, [&](size_t) { return want64; }), -1);
  }
}

INSTANTIATE_TEST_SUITE_P(Transfer, Collectives,
                         ::testing::Values(MpiOptions::Transfer::kBlocking, MpiOptions::Transfer::kNonBlocking),
                         [](const auto& info) {
                           return info.param == MpiOptions::Transfer::kBlocking ? "Blocking" : "NonBlocking";
                         });

TEST(MpiRuntime, RespectsWhoInitialisedMpi) {
  auto& runtime = MpiRuntime::instance();
  EXPECT_EQ(runtime.initialized_by_dpar(), !g_init_mpi_first);
  EXPECT_EQ(runtime.thread_level(), MPI_THREAD_MULTIPLE);
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  EXPECT_EQ(runtime.world_size(), size);
  MpiCommunicator comm;
  EXPECT_EQ(comm.size(), size);
  EXPECT_STREQ(comm.backend(), "mpi");
}

TEST(MpiComm, SubCommunicator) {
  int world_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm half;
  MPI_Comm_split(MPI_COMM_WORLD, world_rank % 2, world_rank, &half);
  {
    MpiCommunicator comm(half, options());
    int32_t x = world_rank, sum = 0;
    comm.all_reduce(&x, &sum, 1, DType::kI32, ReduceOp::kSum);
    int32_t want = 0;
    int world_size = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    for (int q = world_rank % 2; q < world_size; q += 2) want += q;
    EXPECT_EQ(sum, want);
  }
  MPI_Comm_free(&half);
}

TEST(MpiComm, AsyncCollectivesRunOnTheCommunicationThread) {
  MpiCommunicator comm(MPI_COMM_WORLD, options());
  const int n = comm.size(), r = comm.rank();
  const size_t count = 1000;
  std::vector<float> a(count), b(count);
  std::vector<int64_t> gathered(count * n), mine(count);
  for (size_t i = 0; i < count; ++i) a[i] = value<float>(r, i), mine[i] = value<int64_t>(r, i);
  auto w1 = comm.async_all_reduce(a.data(), b.data(), count, DType::kF32, ReduceOp::kSum);
  auto w2 = comm.async_all_gather(mine.data(), gathered.data(), count, DType::kI64);
  w1->wait();
  w2->wait();
  EXPECT_TRUE(w1->test());
  EXPECT_EQ(first_difference(b.data(), count, [&](size_t i) { return reference<float>(ReduceOp::kSum, n, i); }), -1);
  EXPECT_EQ(first_difference(gathered.data(), count * n,
                             [&](size_t i) { return value<int64_t>(static_cast<int>(i / count), i % count); }),
            -1);
}

TEST(MpiComm, InvalidArgumentsOnEveryRank) {
  MpiCommunicator comm(MPI_COMM_WORLD, options());
  float x = 0;
  auto o = outcome([&] { comm.broadcast(&x, 1, DType::kF32, comm.size()); });
  EXPECT_EQ(o.status, Status::kInvalidArgument) << o.message;
  EXPECT_TRUE(contains(o.message, "root")) << o.message;
  // Beyond MPI's int counts (the buffers are never touched: the call is refused before any data moves).
  std::vector<float> one(1);
  o = outcome([&] { comm.reduce_scatter(one.data(), one.data(), size_t{1} << 31, DType::kF32, ReduceOp::kSum); });
  EXPECT_EQ(o.status, Status::kNotSupported) << o.message;
  std::vector<float> buffer(64);
  o = outcome([&] { comm.all_reduce(buffer.data(), buffer.data() + 1, 32, DType::kF32, ReduceOp::kSum); });
  EXPECT_EQ(o.status, Status::kInvalidArgument) << o.message;
  o = outcome([&] { comm.all_reduce(buffer.data(), buffer.data(), 4, static_cast<DType>(9), ReduceOp::kSum); });
  EXPECT_EQ(o.status, Status::kInvalidArgument) << o.message;
  // Still usable: argument errors are agreed on before any data moves.
  buffer.assign(64, 1.0f);
  comm.all_reduce(buffer.data(), buffer.data(), 64, DType::kF32, ReduceOp::kSum);
  EXPECT_EQ(buffer[63], static_cast<float>(comm.size()));
  EXPECT_FALSE(comm.broken());
}

TEST(MpiComm, InvalidArgumentsOnOneRankReachTheOthers) {
  MpiCommunicator comm(MPI_COMM_WORLD, options());
  if (comm.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  std::vector<float> buffer(5, 1.0f);
  const auto o = outcome([&] {
    comm.all_reduce(comm.rank() == 1 ? nullptr : buffer.data(), buffer.data(), 5, DType::kF32, ReduceOp::kSum);
  });
  if (comm.rank() == 1) {
    EXPECT_EQ(o.status, Status::kInvalidArgument) << o.message;
  } else {
    EXPECT_EQ(o.status, Status::kRemote) << o.message;
    EXPECT_TRUE(contains(o.message, "rank 1 refused")) << o.message;
  }
  comm.all_reduce(buffer.data(), buffer.data(), 5, DType::kF32, ReduceOp::kSum);
  EXPECT_EQ(buffer[4], static_cast<float>(comm.size()));
}

TEST(MpiComm, MismatchesMakeEveryRankThrowAndMoveNothing) {
  MpiCommunicator comm(MPI_COMM_WORLD, options(20.0));
  if (comm.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const int r = comm.rank();
  std::vector<float> buffer(32, 1.0f);
  // count
  auto o = outcome([&] {
    comm.all_reduce(buffer.data(), buffer.data(), r == 1 ? 18 : 17, DType::kF32, ReduceOp::kSum);
  });
  EXPECT_EQ(o.status, Status::kMismatch) << o.message;
  EXPECT_TRUE(contains(o.message, "all_reduce: participant 1 called all_reduce of 18 f32 (sum) but participant 0 "
                                  "called all_reduce of 17 f32 (sum); nothing was moved"))
      << o.message;
  EXPECT_EQ(buffer[0], 1.0f) << "data moved despite the mismatch";
  // count, where one side's data would ride with the fingerprints and the other's not
  std::vector<float> big(100003, 1.0f);
  o = outcome([&] { comm.all_reduce(big.data(), big.data(), r == 1 ? 100003 : 17, DType::kF32, ReduceOp::kSum); });
  EXPECT_EQ(o.status, Status::kMismatch) << o.message;
  EXPECT_TRUE(contains(o.message, "participant 1 called all_reduce of 100003 f32 (sum)")) << o.message;
  EXPECT_EQ(big[0], 1.0f) << "data moved despite the mismatch";
  // operation
  o = outcome([&] {
    if (r == 1)
      comm.broadcast(buffer.data(), 17, DType::kF32, 0);
    else
      comm.all_reduce(buffer.data(), buffer.data(), 17, DType::kF32, ReduceOp::kSum);
  });
  EXPECT_EQ(o.status, Status::kMismatch) << o.message;
  EXPECT_TRUE(contains(o.message, "participant 1 called broadcast of 17 f32 from root 0 but participant 0 called "
                                  "all_reduce of 17 f32 (sum)"))
      << o.message;
  // dtype, op, root
  o = outcome([&] {
    comm.all_reduce(buffer.data(), buffer.data(), 8, r == 0 ? DType::kI32 : DType::kF32, ReduceOp::kSum);
  });
  EXPECT_EQ(o.status, Status::kMismatch) << o.message;
  EXPECT_TRUE(contains(o.message, "participant 1 called all_reduce of 8 f32 (sum) but participant 0 called "
                                  "all_reduce of 8 i32 (sum)"))
      << o.message;
  o = outcome([&] {
    comm.all_reduce(buffer.data(), buffer.data(), 8, DType::kF32, r == 0 ? ReduceOp::kMax : ReduceOp::kSum);
  });
  EXPECT_EQ(o.status, Status::kMismatch) << o.message;
  EXPECT_TRUE(contains(o.message, "participant 1 called all_reduce of 8 f32 (sum) but participant 0 called "
                                  "all_reduce of 8 f32 (max)"))
      << o.message;
  o = outcome([&] { comm.broadcast(buffer.data(), 8, DType::kF32, r == 0 ? 0 : 1); });
  EXPECT_EQ(o.status, Status::kMismatch) << o.message;
  EXPECT_TRUE(contains(o.message, "participant 1 called broadcast of 8 f32 from root 1 but participant 0 called "
                                  "broadcast of 8 f32 from root 0"))
      << o.message;
  // barrier against a collective
  o = outcome([&] {
    if (r == 0)
      comm.barrier("checkpoint");
    else
      comm.all_reduce(buffer.data(), buffer.data(), 8, DType::kF32, ReduceOp::kSum);
  });
  EXPECT_EQ(o.status, Status::kMismatch) << o.message;
  EXPECT_TRUE(contains(o.message, std::string(r == 0 ? "checkpoint" : "all_reduce") +
                                      ": participant 1 called all_reduce of 8 f32 (sum) but participant 0 called "
                                      "barrier; nothing was moved"))
      << o.message;
  // The communicator stays usable.
  comm.all_reduce(buffer.data(), buffer.data(), 32, DType::kF32, ReduceOp::kSum);
  EXPECT_EQ(buffer[31], static_cast<float>(comm.size()));
  EXPECT_FALSE(comm.broken());
}

TEST(MpiComm, AbortReachesRanksAlreadyWaiting) {
  MpiCommunicator comm(MPI_COMM_WORLD, options(30.0));
  if (comm.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const int r = comm.rank();
  std::vector<float> buffer(100, 1.0f);
  const auto t0 = std::chrono::steady_clock::now();
  if (r == 1) {
    sleep_s(0.3);  // the others are waiting by now
    comm.abort("injected failure");
  }
  auto o = outcome([&] { comm.all_reduce(buffer.data(), buffer.data(), 100, DType::kF32, ReduceOp::kSum); });
  EXPECT_EQ(o.status, Status::kRemote) << o.message;
  EXPECT_TRUE(contains(o.message, "rank 1 aborted the group: injected failure")) << o.message;
  EXPECT_LT(since(t0), 10.0) << "the abort was not noticed before the timeout";
  EXPECT_TRUE(comm.broken());
  // ... and later calls too.
  o = outcome([&] { comm.barrier("after the abort"); });
  EXPECT_EQ(o.status, Status::kRemote) << o.message;
  EXPECT_TRUE(contains(o.message, "injected failure")) << o.message;
}

TEST(MpiComm, AbortFromAnotherThreadStopsThisRanksWait) {
  MpiCommunicator comm(MPI_COMM_WORLD, options(30.0));
  if (comm.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const int r = comm.rank();
  std::vector<float> buffer(100, 1.0f);
  const auto t0 = std::chrono::steady_clock::now();
  std::thread aborter;
  if (r == 0) aborter = std::thread([&] {
      sleep_s(0.3);
      comm.abort("a worker thread failed");
    });
  else
    sleep_s(1.0);  // rank 0 is alone in the collective when it aborts
  auto o = outcome([&] { comm.all_reduce(buffer.data(), buffer.data(), 100, DType::kF32, ReduceOp::kSum); });
  if (aborter.joinable()) aborter.join();
  EXPECT_EQ(o.status, Status::kRemote) << o.message;
  EXPECT_TRUE(contains(o.message, "rank 0 aborted the group: a worker thread failed")) << o.message;
  EXPECT_LT(since(t0), 10.0);
}

TEST(MpiComm, AsyncErrorShowsAnAbortWithoutACollective) {
  MpiCommunicator comm(MPI_COMM_WORLD, options(30.0));
  if (comm.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  std::string reason;
  EXPECT_EQ(comm.async_error(&reason), Status::kOk) << reason;
  comm.barrier("before the abort");
  // Ranks leave a barrier at different times: a prompt abort would reach some while still inside it (which then
  // reports it, correctly, but is not what this test is about). Half a second lets every rank leave first.
  if (comm.rank() == 1) {
    sleep_s(0.5);
    comm.abort("the loader died");
  }
  // Every rank learns it by asking alone (NCCL's ncclCommGetAsyncError loop), long before any timeout.
  const auto t0 = std::chrono::steady_clock::now();
  Status s = Status::kOk;
  while ((s = comm.async_error(&reason)) == Status::kOk && since(t0) < 10.0) sleep_s(0.01);
  EXPECT_EQ(s, Status::kRemote) << reason;
  EXPECT_TRUE(contains(reason, "rank 1 aborted the group: the loader died")) << reason;
  EXPECT_LT(since(t0), 10.0);
  auto o = outcome([&] { comm.barrier("after the abort"); });
  EXPECT_EQ(o.status, Status::kRemote) << o.message;
}

TEST(MpiComm, TimeoutNamesTheRankThatDidNotArrive) {
  constexpr double kTimeout = 1.0, kLate = 3.0;
  auto comm = std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, options(kTimeout));
  if (comm->size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const int r = comm->rank();
  std::vector<double> buffer(1000, 1.0);
  comm->barrier("start");
  if (r == 1) sleep_s(kLate);
  const auto t0 = std::chrono::steady_clock::now();
  auto o = outcome([&] { comm->all_reduce(buffer.data(), buffer.data(), 1000, DType::kF64, ReduceOp::kSum); });
  const double waited = since(t0);
  if (r == 1) {
    // It arrived late: the others had given up, and it finds their notices instead of hanging.
    EXPECT_EQ(o.status, Status::kRemote) << o.message;
    EXPECT_TRUE(contains(o.message, "gave up waiting in all_reduce #1")) << o.message;
    EXPECT_LT(waited, 1.0);
  } else {
    EXPECT_EQ(o.status, Status::kTimeout) << o.message;
    EXPECT_TRUE(contains(o.message, "rank 1 did not arrive within 1 s")) << o.message;
    EXPECT_TRUE(contains(o.message, "all_reduce #1")) << o.message;
    EXPECT_GE(waited, kTimeout * 0.9);
    EXPECT_LT(waited, kTimeout + 2.0);
  }
  EXPECT_EQ(buffer[0], 1.0);
  // Unusable now ...
  o = outcome([&] { comm->barrier("after the timeout"); });
  EXPECT_EQ(o.status, Status::kInvalidState) << o.message;
  // ... but a new communicator works (its creation waits for rank 1).
  MpiCommunicator fresh(MPI_COMM_WORLD, options(30.0));
  fresh.all_reduce(buffer.data(), buffer.data(), 1000, DType::kF64, ReduceOp::kSum);
  EXPECT_EQ(buffer[999], static_cast<double>(fresh.size()));
  comm.reset();  // leaves its pending request to MPI_Finalize
}

// The last rank arrives after the others' timeout and misses their TIMEOUT notices (as a rank descheduled between
// its look for notices and its first send would): it completes its exchange with the messages they sent before
// giving up, and enters a blocking MPI_Allreduce. The ranks that gave up must finish the exchange they left and
// join that transfer with zeros, so that it gets an error (the result is void) instead of waiting for ever. They
// do it in their grace period, at their next touch of the communicator, or as they destroy it.
enum class Release { kInGrace, kByALaterCall, kByDestruction };

void late_rank_is_released(Release how) {
  // grace = timeout / 4; the late rank arrives inside the grace period, or after it (then the others call
  // async_error for a while, or are destroyed, which waits a grace period).
  const double timeout = how == Release::kByDestruction ? 4.0 : 2.0, grace = timeout / 4;
  const double late = how == Release::kInGrace ? timeout + grace / 2 : timeout + grace + 0.3;
  auto comm = std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, options(timeout));
  if (comm->size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const int r = comm->rank(), last = comm->size() - 1;
  std::vector<double> buffer(1000, 1.0);  // 8000 bytes: not fused, so a transfer follows the exchange
  comm->barrier("start");
  if (r == last) {
    sleep_s(late);
    detail::set_mpi_skip_arrival_check_for_tests(true);
  }
  auto o = outcome([&] { comm->all_reduce(buffer.data(), buffer.data(), 1000, DType::kF64, ReduceOp::kSum); });
  detail::set_mpi_skip_arrival_check_for_tests(false);
  if (r == last) {
    // Released. With 2 ranks it always completes its exchange and is released from the transfer; with more it
    // may also see the notices while its exchange waits for a rank that has not yet advanced, and give up too.
    if (comm->size() == 2) {
      EXPECT_EQ(o.status, Status::kRemote) << o.message;
      EXPECT_TRUE(contains(o.message, "rank 0 had given up on all_reduce #1 and joined its transfer only to "
                                      "release this rank: the result is void")) << o.message;
    } else {
      EXPECT_TRUE(o.status == Status::kRemote || o.status == Status::kTimeout) << o.message;
    }
  } else {
    EXPECT_EQ(o.status, Status::kTimeout) << o.message;
    if (how == Release::kByALaterCall) {
      const auto t0 = std::chrono::steady_clock::now();
      std::string reason;
      while (since(t0) < 2.5) {
        EXPECT_EQ(comm->async_error(&reason), Status::kInvalidState);
        sleep_s(0.01);
      }
    }
  }
  o = outcome([&] { comm->barrier("after the timeout"); });
  EXPECT_NE(o.status, Status::kOk) << "the communicator must stay unusable";
  comm.reset();
  // Every rank is out, and the next communicator pairs as it should.
  MpiCommunicator fresh(MPI_COMM_WORLD, options(30.0));
  std::fill(buffer.begin(), buffer.end(), 1.0);
  fresh.all_reduce(buffer.data(), buffer.data(), 1000, DType::kF64, ReduceOp::kSum);
  EXPECT_EQ(buffer[999], static_cast<double>(fresh.size()));
}

TEST(MpiComm, ALateRankThatMissedTheNoticesIsReleasedInTheGracePeriod) { late_rank_is_released(Release::kInGrace); }
TEST(MpiComm, ALateRankThatMissedTheNoticesIsReleasedByALaterCall) { late_rank_is_released(Release::kByALaterCall); }
TEST(MpiComm, ALateRankThatMissedTheNoticesIsReleasedByDestruction) {
  late_rank_is_released(Release::kByDestruction);
}

// A creation that timed out leaves its duplication of the base pending, so that the ranks' creations over that
// base no longer pair by order: a later creation over it is refused at once, on every rank, instead of pairing
// with the wrong duplications (or timing out for no visible reason).
TEST(MpiComm, ACreationThatTimedOutMakesItsBaseRefused) {
  int size = 0, r = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  if (size < 2) GTEST_SKIP() << "needs 2 ranks";
  MPI_Comm base;  // the test's own: it stays unusable for communicators, and is never freed
  MPI_Comm_dup(MPI_COMM_WORLD, &base);
  const int last = size - 1;
  if (r == last) sleep_s(1.5);
  auto o = outcome([&] { MpiCommunicator comm(base, options(r == last ? 1.0 : 0.5)); });
  EXPECT_EQ(o.status, Status::kTimeout) << o.message;
  EXPECT_TRUE(contains(o.message, "the creation is collective")) << o.message;
  o = outcome([&] { MpiCommunicator comm(base, options(30.0)); });
  EXPECT_EQ(o.status, Status::kInvalidState) << o.message;
  EXPECT_TRUE(contains(o.message, "a creation over this base communicator timed out earlier")) << o.message;
  // Another base works.
  MpiCommunicator fresh(MPI_COMM_WORLD, options(30.0));
  std::vector<double> buffer(1000, 1.0);
  fresh.all_reduce(buffer.data(), buffer.data(), 1000, DType::kF64, ReduceOp::kSum);
  EXPECT_EQ(buffer[0], static_cast<double>(size));
}

TEST(MpiComm, SingletonWorksAlone) {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size != 1) GTEST_SKIP() << "only alone";
  MpiCommunicator comm(MPI_COMM_SELF, options());
  EXPECT_EQ(comm.rank(), 0);
  EXPECT_EQ(comm.size(), 1);
  int64_t x[3] = {1, -7, 3}, y[3] = {};
  comm.all_reduce(x, y, 3, DType::kI64, ReduceOp::kMean);
  EXPECT_EQ(y[1], -7);
  comm.barrier("alone");
}

// ---------------------------------------------------------------------------------------------------------------

// Prints this rank's failures, and lines the ranks up before every test (a plain blocking barrier on a
// communicator of its own), so that a test that leaves one rank behind, such as the abort and timeout tests, does
// not spill into the next.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) { MPI_Comm_dup(MPI_COMM_WORLD, &sync_); }
  void OnTestStart(const ::testing::TestInfo&) override { MPI_Barrier(sync_); }
  void OnTestProgramEnd(const ::testing::UnitTest&) override { MPI_Comm_free(&sync_); }
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (result.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, result.file_name() ? result.file_name() : "?",
                   result.line_number(), result.summary());
  }
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (info.result()->Failed())
      std::fprintf(stderr, "[rank %d] FAILED %s.%s\n", rank_, info.test_suite_name(), info.name());
  }

 private:
  int rank_;
  MPI_Comm sync_ = MPI_COMM_NULL;
};

// Rank 1 exits without a word in the middle of the run; the others must get an error within the timeout.
int rank_exit_main() {
  MpiCommunicator comm(MPI_COMM_WORLD, options(1.0));
  const int r = comm.rank();
  std::vector<float> buffer(1000, 1.0f);
  comm.all_reduce(buffer.data(), buffer.data(), 1000, DType::kF32, ReduceOp::kSum);
  std::printf("rank %d: first all_reduce ok\n", r);
  std::fflush(stdout);
  if (r == 1) _exit(0);
  const auto t0 = std::chrono::steady_clock::now();
  const auto o = outcome([&] { comm.all_reduce(buffer.data(), buffer.data(), 1000, DType::kF32, ReduceOp::kSum); });
  const double waited = since(t0);
  const bool ok = (o.status == Status::kTimeout || o.status == Status::kCommunication) && waited < 10.0;
  std::printf("rank %d: %s after %.2f s: status %d: %s\n", r, ok ? "SURVIVOR OK" : "SURVIVOR FAILED", waited,
              static_cast<int>(o.status), o.message.c_str());
  std::fflush(stdout);
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace dpar

int main(int argc, char** argv) {
  bool rank_exit = false;
  int expect_ranks = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--init-mpi-first") == 0) dpar::g_init_mpi_first = true;
    if (std::strcmp(argv[i], "--rank-exit") == 0) rank_exit = true;
    if (std::strcmp(argv[i], "--expect-ranks") == 0 && i + 1 < argc) expect_ranks = std::atoi(argv[++i]);
  }
  if (dpar::g_init_mpi_first) {
    int provided = 0;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  }
  int rc = 0;
  if (rank_exit) {
    rc = dpar::rank_exit_main();
  } else {
    ::testing::InitGoogleTest(&argc, argv);
    const int rank = dpar::MpiRuntime::instance().world_rank();
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    if (rank != 0) delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new dpar::RankFailurePrinter(rank));
    // Every launched rank must have joined: tests that need several ranks skip on one, and CTest cannot see a
    // skip, so a job that fell apart into singletons would otherwise pass.
    const int size = dpar::MpiRuntime::instance().world_size();
    if (expect_ranks > 0 && size != expect_ranks) {
      std::fprintf(stderr, "rank %d: FAIL the world has %d ranks, but %d were launched\n", rank, size, expect_ranks);
      rc = 1;
    } else {
      rc = RUN_ALL_TESTS();
    }
  }
  if (dpar::g_init_mpi_first) MPI_Finalize();  // the program's to do; dpar must not have done it
  return rc;
}
