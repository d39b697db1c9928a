// The C ABI's gradient reducer over processes (dpar_reducer_options.processes), run under mpirun: each process has
// a group of --members threads (dpar_comm_group_create), each registering the same gradient buffers, and every
// reducer is given the processes' communicator (dpar_comm_create_mpi). Checked against definitions computed here:
//  - DPAR_SUM and DPAR_MEAN: every member of every process receives the sum (or mean) over every member of every
//    process, members that marked nothing included (they count as zeros), in several buckets;
//  - DPAR_COMPRESSION_BF16: the result is each process's f32 sum rounded once to bfloat16 (to nearest even), summed
//    across the processes in bfloat16 and widened; with values that bfloat16 cannot hold, so the compression shows;
//  - bad options are refused with a message naming the field.
// Every rank prints its failures as "[rank r] FAIL ..." and exits nonzero if it saw one; rank 0 prints a summary.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "dpar.h"
#include "mpi_checks.h"

namespace {

using mpi_checks::g_failures;
using mpi_checks::g_rank;
using mpi_checks::g_size;

void fail(const std::string& what) {
  std::fprintf(stderr, "[rank %d] FAIL %s\n", g_rank, what.c_str());
  ++g_failures;
}

// bfloat16 by rounding to nearest, ties to even (no NaN here), and back.
float to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  float y;
  std::memcpy(&y, &u, 4);
  return y;
}

const std::vector<size_t> kCounts = {300, 7, 1000, 64};  // with 256-byte buckets: 3 buckets

// Member m of process p: gradient g, element i. `fraction` adds a part that bfloat16 cannot hold.
float grad_value(int p, int m, size_t g, size_t i, bool fraction) {
  const float whole = static_cast<float>((p * 5 + m * 3 + 1) * static_cast<int>(g + 1 + i % 3));
  return fraction ? whole + 1.0f / 1024.0f : whole;
}

// The last member of process 0 marks no gradient (when the job has more than one member): it counts as zeros.
bool marks(int p, int m, int members) { return !(p == 0 && m == members - 1 && g_size * members > 1); }

struct Case {
  int32_t op, compression;
  bool fraction;
  const char* name;
};

void check_case(dpar_comm_group* group, dpar_comm* world, int members, const Case& c) {
  std::vector<std::vector<std::vector<float>>> results(static_cast<size_t>(members));
  std::vector<std::thread> threads;
  for (int m = 0; m < members; ++m) {
    threads.emplace_back([&, m] {
      dpar_comm* comm = nullptr;
      CHECK_OK(dpar_comm_group_member(&comm, group, static_cast<size_t>(m)));
      std::vector<std::vector<float>> grads(kCounts.size());
      std::vector<float*> pointers;
      for (size_t g = 0; g < kCounts.size(); ++g) {
        grads[g].resize(kCounts[g]);
        pointers.push_back(grads[g].data());
      }
      dpar_reducer_options o = DPAR_REDUCER_OPTIONS_INIT;
      o.first_bucket_bytes = 256;
      o.bucket_cap_bytes = 256;
      o.op = c.op;
      o.processes = world;
      o.compression = c.compression;
      dpar_reducer* reducer = nullptr;
      CHECK_OK(dpar_reducer_create(&reducer, comm, pointers.data(), kCounts.data(), kCounts.size(), &o));
      size_t buckets = 0;
      CHECK_OK(dpar_reducer_num_buckets(&buckets, reducer));
      if (buckets < 3) fail(std::string(c.name) + ": " + std::to_string(buckets) + " buckets, expected several");
      for (int step = 0; step < 2; ++step) {
        for (size_t g = 0; g < kCounts.size(); ++g)
          for (size_t i = 0; i < kCounts[g]; ++i) grads[g][i] = grad_value(g_rank, m, g, i, c.fraction) * (step + 1);
        if (marks(g_rank, m, members))
          for (size_t g = kCounts.size(); g-- > 0;) CHECK_OK(dpar_reducer_grad_ready(reducer, g));
        CHECK_OK(dpar_reducer_wait(reducer));
      }
      results[static_cast<size_t>(m)] = grads;
      dpar_reducer_free(reducer);
      dpar_comm_free(comm);
    });
  }
  for (auto& t : threads) t.join();

  const int total = g_size * members;
  for (size_t g = 0; g < kCounts.size(); ++g) {
    for (size_t i = 0; i < kCounts[g]; ++i) {
      float expected;
      if (c.compression == DPAR_COMPRESSION_BF16 && g_size > 1) {  // one process: nothing crosses, nothing rounds
        // Each process's f32 sum (in member order, as the threads group adds them), then rounded, then summed in
        // bfloat16 across the processes, in rank order.
        float across = 0.0f;
        for (int p = 0; p < g_size; ++p) {
          float process_sum = 0.0f;
          for (int m = 0; m < members; ++m)
            if (marks(p, m, members)) process_sum += grad_value(p, m, g, i, c.fraction) * 2;
          across = p == 0 ? to_bf16(process_sum) : to_bf16(across + to_bf16(process_sum));
        }
        expected = across;
      } else {
        double sum = 0;
        for (int p = 0; p < g_size; ++p)
          for (int m = 0; m < members; ++m)
            if (marks(p, m, members)) sum += grad_value(p, m, g, i, c.fraction) * 2;
        expected = static_cast<float>(c.op == DPAR_MEAN ? sum / total : sum);
      }
      for (int m = 0; m < members; ++m) {
        const float got = results[static_cast<size_t>(m)][g][i];
        // Whole numbers add exactly in any order; the mean is one rounding of them.
        const bool ok = c.op == DPAR_MEAN ? std::fabs(got - expected) <= 1e-6f * std::fabs(expected) : got == expected;
        if (!ok) {
          fail(std::string(c.name) + ": member " + std::to_string(m) + ", gradient " + std::to_string(g) +
               ", element " + std::to_string(i) + ": " + std::to_string(got) + ", expected " +
               std::to_string(expected));
          return;
        }
      }
    }
  }
  if (c.compression == DPAR_COMPRESSION_BF16 && c.fraction && g_size > 1) {
    // The compression shows: the f32 sum differs from what arrived.
    double sum = 0;
    for (int p = 0; p < g_size; ++p)
      for (int m = 0; m < members; ++m)
        if (marks(p, m, members)) sum += grad_value(p, m, 0, 0, true) * 2;
    if (static_cast<float>(sum) == results[0][0][0]) fail(std::string(c.name) + ": bf16 left the sum as f32's");
  }
}

void check_refusals(dpar_comm_group* group, dpar_comm* world) {
  dpar_comm* comm = nullptr;
  CHECK_OK(dpar_comm_group_member(&comm, group, 0));
  float buffer[4] = {};
  float* pointers[1] = {buffer};
  const size_t counts[1] = {4};
  dpar_reducer* reducer = nullptr;
  dpar_reducer_options o = DPAR_REDUCER_OPTIONS_INIT;
  o.processes = world;
  o.compression = 7;
  if (dpar_reducer_create(&reducer, comm, pointers, counts, 1, &o) != DPAR_ERR_INVALID_ARGUMENT ||
      !std::strstr(dpar_last_error(), "opts.compression"))
    fail(std::string("an unknown compression was not refused by name: ") + dpar_last_error());
  o.compression = DPAR_COMPRESSION_NONE;
  o.processes = comm;
  if (dpar_reducer_create(&reducer, comm, pointers, counts, 1, &o) != DPAR_ERR_INVALID_ARGUMENT ||
      !std::strstr(dpar_last_error(), "opts.processes"))
    fail(std::string("the reducer's own communicator as the processes' was not refused: ") + dpar_last_error());
  o.processes = reinterpret_cast<dpar_comm*>(buffer);
  if (dpar_reducer_create(&reducer, comm, pointers, counts, 1, &o) != DPAR_ERR_INVALID_ARGUMENT ||
      !std::strstr(dpar_last_error(), "opts.processes"))
    fail(std::string("a pointer that is no communicator was not refused: ") + dpar_last_error());
  dpar_comm_free(comm);
}

}  // namespace

int main(int argc, char** argv) {
  int members = 2, expect_processes = 0;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--members") && i + 1 < argc) members = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--expect-processes") && i + 1 < argc) expect_processes = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: test_mpi_reducer [--members N] [--expect-processes P]\n");
      return 2;
    }
  }
  dpar_comm* world = nullptr;
  CHECK_OK(dpar_comm_create_mpi(&world, nullptr));
  size_t rank = 0, size = 1;
  CHECK_OK(dpar_comm_info(&rank, &size, world));
  g_rank = static_cast<int>(rank);
  g_size = static_cast<int>(size);
  if (expect_processes > 0 && g_size != expect_processes) {
    std::fprintf(stderr, "[rank %d] FAIL %d processes, but %d were launched\n", g_rank, g_size, expect_processes);
    return 1;
  }
  dpar_comm_group* group = nullptr;
  CHECK_OK(dpar_comm_group_create(&group, static_cast<size_t>(members), nullptr));
  const Case cases[] = {
      {DPAR_SUM, DPAR_COMPRESSION_NONE, false, "sum"},
      {DPAR_MEAN, DPAR_COMPRESSION_NONE, true, "mean"},
      {DPAR_SUM, DPAR_COMPRESSION_BF16, true, "sum in bf16 across processes"},
      {DPAR_SUM, DPAR_COMPRESSION_BF16, false, "sum of whole numbers in bf16 across processes"},
  };
  for (const Case& c : cases) check_case(group, world, members, c);
  check_refusals(group, world);
  dpar_comm_group_free(group);
  dpar_comm_free(world);
  if (g_rank == 0) std::printf("%s\n", g_failures ? "FAILED" : "ALL PASSED");
  return g_failures ? 1 : 0;
}
