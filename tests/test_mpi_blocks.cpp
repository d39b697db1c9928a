// The MPI backend's sharded gradient path (reduce_scatter_sum, all_gather_blocks) against all_reduce_sum and
// slicing, bit for bit, and its mismatch messages against the threads backend's, word for word: run under mpirun
// with 1 to 4 ranks (tests/CMakeLists.txt), each rank checking its own results.
//
// Values are multiples of 1/4 of small integers, so float sums are exact in any order: MPI's reduction order is its
// own, and equal bits then mean the same sums in the same blocks, scaled alike.
#include <mpi.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/mpi_comm.h"
#include "comm/threads_comm.h"

namespace dpar {
namespace {

// memcmp of n bytes, where n may be 0 and the pointers then null (an empty vector's data()): memcmp itself must not
// be given a null pointer even for 0 bytes.
int compare_bytes(const void* a, const void* b, size_t n) { return n == 0 ? 0 : std::memcmp(a, b, n); }

MpiOptions options() {
  MpiOptions o;
  o.timeout_seconds = 60.0;
  return o;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

float value(int r, size_t i) { return static_cast<float>(static_cast<int>((r * 37 + i * 11 + 3) % 23) - 11) * 0.25f; }

const size_t kCounts[] = {0, 1, 2, 3, 15, 16, 17, 33, 100, 1000, 4099, 100003};

// EXPECT, not ASSERT, in the loops: a rank that left early would leave the others waiting in the next collective.
TEST(MpiBlocks, ReduceScatterSumIsAllReduceSumSlicedBitForBit) {
  for (auto transfer : {MpiOptions::Transfer::kBlocking, MpiOptions::Transfer::kNonBlocking}) {
    MpiOptions o = options();
    o.transfer = transfer;
    MpiCommunicator comm(MPI_COMM_WORLD, o);
    const int n = comm.size(), r = comm.rank();
    for (size_t count : kCounts)
      for (int pattern = 0; pattern < 3; ++pattern) {  // everyone; all but the last; nobody contributes
        const bool contributes = pattern == 0 || (pattern == 1 && r != n - 1);
        std::vector<float> reference(count), sharded(count);
        for (size_t i = 0; i < count; ++i) reference[i] = sharded[i] = value(r, i);
        comm.all_reduce_sum(reference.data(), count, contributes, 0.5f);
        comm.reduce_scatter_sum(sharded.data(), count, contributes, 0.5f);
        const auto [begin, end] = Communicator::block_range(count, n, r);
        EXPECT_EQ(compare_bytes(sharded.data() + begin, reference.data() + begin, (end - begin) * sizeof(float)), 0)
            << "count " << count << ", contributors pattern " << pattern << ", rank " << r;
        // Then every owner's block everywhere: the whole of all_reduce_sum's result.
        for (size_t i = 0; i < count; ++i)
          if (i < begin || i >= end) sharded[i] = NAN;
        comm.all_gather_blocks(sharded.data(), count);
        EXPECT_EQ(compare_bytes(sharded.data(), reference.data(), count * sizeof(float)), 0)
            << "all_gather_blocks of " << count << ", rank " << r;
      }
  }
}

// Each mismatch runs twice: through MPI between the processes, and in this process through a threads group of as
// many participants; rank r's MPI message must be participant r's threads message.
TEST(MpiBlocks, MismatchMessagesAreTheThreadsBackendsWordForWord) {
  MpiCommunicator comm(MPI_COMM_WORLD, options());
  const int n = comm.size();
  if (n < 2) GTEST_SKIP() << "needs 2 ranks";
  using Call = std::function<void(Communicator&, int, std::vector<float>&)>;
  const std::vector<Call> mismatches = {
      [](Communicator& c, int r, std::vector<float>& b) {
        c.all_reduce(b.data(), b.data(), r == 1 ? 18 : 17, DType::kF32, ReduceOp::kSum);
      },
      [](Communicator& c, int r, std::vector<float>& b) {
        if (r == 1)
          c.broadcast(b.data(), 17, DType::kF32, 0);
        else
          c.all_reduce(b.data(), b.data(), 17, DType::kF32, ReduceOp::kMax);
      },
      [](Communicator& c, int r, std::vector<float>& b) {
        c.reduce(b.data(), b.data(), 8, r == 0 ? DType::kI32 : DType::kF32, ReduceOp::kSum, r == 0 ? 0 : 1);
      },
      [](Communicator& c, int r, std::vector<float>& b) {
        if (r == 0)
          c.barrier("checkpoint");
        else
          c.all_gather(b.data(), b.data(), 0, DType::kF32);
      },
      [](Communicator& c, int r, std::vector<float>& b) {
        if (r == 1)
          c.all_reduce_sum(b.data(), 100, true, 1.0f);
        else
          c.reduce_scatter_sum(b.data(), 100, true, 1.0f);
      },
      [](Communicator& c, int r, std::vector<float>& b) { c.all_gather_blocks(b.data(), r == 0 ? 64 : 100); },
  };
  for (size_t m = 0; m < mismatches.size(); ++m) {
    std::vector<float> buffer(200, 1.0f);
    const std::string over_mpi = error_of([&] { mismatches[m](comm, comm.rank(), buffer); });

    std::vector<std::string> names;
    for (int r = 0; r < n; ++r) names.push_back("thread " + std::to_string(r));
    ThreadGroup group(names, std::chrono::seconds(60));
    std::vector<std::unique_ptr<Communicator>> comms;
    for (int r = 0; r < n; ++r) comms.push_back(group.communicator(r));
    std::vector<std::string> over_threads(static_cast<size_t>(n));
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        std::vector<float> b(200, 1.0f);
        over_threads[static_cast<size_t>(r)] = error_of([&] { mismatches[m](*comms[static_cast<size_t>(r)], r, b); });
      });
    for (auto& t : threads) t.join();

    EXPECT_NE(over_mpi, "") << "mismatch " << m << " was not detected";
    EXPECT_EQ(over_mpi, over_threads[static_cast<size_t>(comm.rank())]) << "mismatch " << m;
  }
}

// One rank's null buffer in reduce_sum (which MPI runs as a reduce) reaches the others as its refusal, not as a
// mismatch, and the communicator goes on.
TEST(MpiBlocks, ARefusedReduceSumReachesTheOthers) {
  MpiCommunicator comm(MPI_COMM_WORLD, options());
  const int n = comm.size();
  if (n < 2) GTEST_SKIP() << "needs 2 ranks";
  std::vector<float> buffer(8, 1.0f);
  Error got(Status::kOk, "");
  try {
    comm.reduce_sum(comm.rank() == 1 ? nullptr : buffer.data(), 8, true, 1.0f, 0);
  } catch (const Error& e) {
    got = e;
  }
  if (comm.rank() == 1) {
    EXPECT_EQ(got.status(), Status::kInvalidArgument) << got.what();
  } else {
    EXPECT_EQ(got.status(), Status::kRemote) << got.what();
    EXPECT_NE(std::string(got.what()).find("rank 1 refused"), std::string::npos) << got.what();
  }
  buffer.assign(8, 1.0f);
  comm.reduce_sum(buffer.data(), 8, true, 0.5f, n - 1);
  if (comm.rank() == n - 1) {
    EXPECT_EQ(buffer[7], 0.5f * n);
  }
}

TEST(MpiBlocks, CountsBeyondMpisIntsAreRefused) {
  MpiCommunicator comm(MPI_COMM_WORLD, options());
  std::vector<float> one(1);
  try {
    comm.reduce_scatter_sum(one.data(), size_t{1} << 31, true, 1.0f);  // refused before any data moves
    ADD_FAILURE() << "2^31 elements accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kNotSupported) << e.what();
  }
  std::vector<float> buffer(100, 1.0f);  // every rank of up to 4 has a block of it
  comm.reduce_scatter_sum(buffer.data(), 100, true, 1.0f);  // still usable
  const auto [begin, end] = Communicator::block_range(100, comm.size(), comm.rank());
  ASSERT_LT(begin, end);
  EXPECT_EQ(buffer[begin], static_cast<float>(comm.size()));
  EXPECT_EQ(buffer[end - 1], static_cast<float>(comm.size()));
}

// Every rank's failures, prefixed with its rank (only rank 0 prints GoogleTest's report).
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (result.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_, result.file_name() ? result.file_name() : "?",
                   result.line_number(), result.summary());
  }

 private:
  int rank_;
};

}  // namespace
}  // namespace dpar

int main(int argc, char** argv) {
  int expect_ranks = 0;
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--expect-ranks") == 0 && i + 1 < argc) expect_ranks = std::atoi(argv[++i]);
  ::testing::InitGoogleTest(&argc, argv);
  const int rank = dpar::MpiRuntime::instance().world_rank();
  const int size = dpar::MpiRuntime::instance().world_size();
  if (expect_ranks > 0 && size != expect_ranks) {
    std::fprintf(stderr, "rank %d: FAIL the world has %d ranks, but %d were launched\n", rank, size, expect_ranks);
    return 1;
  }
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (rank != 0) delete listeners.Release(listeners.default_result_printer());
  listeners.Append(new dpar::RankFailurePrinter(rank));
  const int rc = RUN_ALL_TESTS();
  // Every rank's verdict counts: a failure on one rank fails the job.
  int worst = rc;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return worst;
}
