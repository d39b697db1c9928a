// bench_mpi_backend: dpar's MPI backend (MpiCommunicator::all_reduce) beside a plain MPI_Allreduce, in the same
// processes, interleaved. The aim: dpar's backend within 5% of plain MPI_Allreduce.
//
//   bench_mpi_backend [--np N] [--rounds R] [--tcp]   starts itself under mpirun (-np 2 by default, bound to cores;
//                                                     shared memory, or TCP over loopback as between machines)
//
// f32 sum, in place, 4 KiB to 16 MiB per rank. Every measurement: a barrier, then `iters` back-to-back all-reduces;
// the time per operation is the longest over the ranks. Rounds alternate the variants (rotating their order) and
// the printed figures are the median and the minimum over rounds; dpar/pl is the ratio of the medians, (rounds) the
// median of the per-round ratios (each round at one placement: the steadier figure), (mins) that of the minimums.
// Variants:
//   plain        MPI_Allreduce(MPI_IN_PLACE) on a duplicate of MPI_COMM_WORLD
//   dpar         MpiCommunicator::all_reduce, default options: fingerprint exchange (MPI_Iallgather of 7 int64,
//                polled under the timeout) + blocking MPI_Allreduce
//   dpar-nb      the same with MpiOptions::Transfer::kNonBlocking: MPI_Iallreduce polled with MPI_Test
//   plain-nb     MPI_Iallreduce + MPI_Test loop (what dpar-nb costs without dpar)
//   pl+bar       MPI_Barrier + MPI_Allreduce: plain with a synchronisation before every operation, as dpar's
//                fingerprint exchange is (back-to-back plain all-reduces overlap one call's end with the next's start)
// then, for the engine's gradient compression, the same gradient elements summed as f32 and as bf16 (rounded to
// bfloat16 before and widened after, as the engine does: the conversions are in the bf16 time), and, once, the
// pieces of dpar's overhead: its barrier (the fingerprint exchange alone) beside the other ways
// to exchange a fingerprint (MPI_Allgather, which cannot time out; MPI_Iallgather and an MPI_Iallreduce of
// [x, -x] with MPI_MIN, polled) and a plain MPI_Barrier.
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "bench_util.h"
#include "comm/mpi_comm.h"
#include "kernels/cpu/kernels.h"

namespace {

struct Variant {
  const char* name;
  std::function<void()> op;
};

// Seconds per operation: the longest over the ranks.
double measure(MPI_Comm sync, const std::function<void()>& op, int iters) {
  MPI_Barrier(sync);
  const double t0 = bench_now();
  for (int i = 0; i < iters; ++i) op();
  double t = (bench_now() - t0) / iters, longest = 0;
  MPI_Allreduce(&t, &longest, 1, MPI_DOUBLE, MPI_MAX, sync);
  return longest;
}

void relaunch_under_mpirun(int argc, char** argv, int np, bool tcp) {
#ifdef BENCH_MPIEXEC
  if (geteuid() == 0) {
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
  }
  std::vector<std::string> args = {BENCH_MPIEXEC, "-np", std::to_string(np), "--oversubscribe", "--bind-to", "core",
                                   "--mca", "pml", "ob1", "--mca", "btl", tcp ? "self,tcp" : "self,vader"};
  if (tcp) args.insert(args.end(), {"--mca", "btl_tcp_if_include", "lo"});
  args.push_back(argv[0]);
  for (int i = 1; i < argc; ++i) args.push_back(argv[i]);
  std::vector<char*> cargs;
  for (auto& a : args) cargs.push_back(a.data());
  cargs.push_back(nullptr);
  execv(BENCH_MPIEXEC, cargs.data());
  std::perror("bench_mpi_backend: cannot start mpirun");
  std::exit(2);
#else
  (void)argc, (void)argv, (void)np, (void)tcp;
  std::fprintf(stderr, "bench_mpi_backend: run it under mpirun\n");
  std::exit(2);
#endif
}

}  // namespace

int main(int argc, char** argv) {
  int np = 2, rounds = 15;
  bool nonblocking = true, tcp = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--np") && i + 1 < argc) np = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--tcp")) tcp = true;
    else if (!std::strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = std::max(1, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--no-nb")) nonblocking = false;
    else {
      std::fprintf(stderr, "usage: %s [--np N] [--rounds R] [--no-nb] [--tcp]\n", argv[0]);
      return 2;
    }
  }
  if (!std::getenv("OMPI_COMM_WORLD_SIZE")) relaunch_under_mpirun(argc, argv, np, tcp);

  dpar::MpiCommunicator dpar_comm;  // initialises MPI
  dpar::MpiOptions nb;
  nb.transfer = dpar::MpiOptions::Transfer::kNonBlocking;
  dpar::MpiCommunicator dpar_nb(MPI_COMM_WORLD, nb);
  MPI_Comm plain, sync;
  MPI_Comm_dup(MPI_COMM_WORLD, &plain);
  MPI_Comm_dup(MPI_COMM_WORLD, &sync);
  const int rank = dpar_comm.rank(), size = dpar_comm.size();
  if (rank == 0) {
    bench_print_machine(stdout);
    std::printf("ranks: %d (mpirun --bind-to core, btl %s); %d rounds, median over rounds\n\n", size,
                tcp ? "self,tcp over loopback" : "self,vader", rounds);
  }

  const size_t sizes[] = {4 << 10, 64 << 10, 1 << 20, 16 << 20};
  std::vector<float> buffer((16 << 20) / sizeof(float), 0.0f);  // zeros: the sums stay zero
  if (rank == 0)
    std::printf("%-8s %9s %9s %9s %9s %10s %9s %9s  %8s %8s %8s %10s %11s\n", "bytes", "plain us", "(min)",
                "dpar us", "(min)", "dpar-nb us", "plain-nb", "pl+bar", "dpar/pl", "(rounds)", "(mins)",
                "dpar-pl us", "plain busbw");
  for (size_t bytes : sizes) {
    const size_t count = bytes / sizeof(float);
    const int iters = bytes <= (4 << 10) ? 4000 : bytes <= (64 << 10) ? 1000 : bytes <= (1 << 20) ? 100 : 8;
    float* buf = buffer.data();
    std::vector<Variant> variants = {
        {"plain", [&] { MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, plain); }},
        {"dpar", [&] { dpar_comm.all_reduce(buf, buf, count, dpar::DType::kF32, dpar::ReduceOp::kSum); }},
        {"dpar-nb", [&] { dpar_nb.all_reduce(buf, buf, count, dpar::DType::kF32, dpar::ReduceOp::kSum); }},
        {"plain-nb",
         [&] {
           MPI_Request r;
           MPI_Iallreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, plain, &r);
           int done = 0;
           while (!done) MPI_Test(&r, &done, MPI_STATUS_IGNORE);
         }},
        {"plain+barrier",
         [&] {
           MPI_Barrier(plain);
           MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, plain);
         }},
    };
    if (!nonblocking) variants.erase(variants.begin() + 2, variants.begin() + 4);
    std::vector<std::vector<double>> times(variants.size());
    std::vector<double> ratios;  // dpar / plain within each round (same placement)
    for (auto& v : variants) measure(sync, v.op, std::max(1, iters / 4));  // warm-up
    for (int round = 0; round < rounds; ++round) {
      std::vector<double> t(variants.size());
      for (size_t k = 0; k < variants.size(); ++k) {
        const size_t v = (k + round) % variants.size();
        t[v] = measure(sync, variants[v].op, iters);
      }
      for (size_t v = 0; v < variants.size(); ++v) times[v].push_back(t[v]);
      ratios.push_back(t[1] / t[0]);
    }
    std::vector<double> med, low;
    for (auto& t : times) {
      med.push_back(bench_median(t.data(), t.size()));  // sorts t
      low.push_back(t.front());
    }
    if (!nonblocking) {
      med.insert(med.begin() + 2, 2, 0.0);
      low.insert(low.begin() + 2, 2, 0.0);
    }
    const double ratio = bench_median(ratios.data(), ratios.size());
    const double busbw = bytes / med[0] * 2.0 * (size - 1) / size / 1e9;
    if (rank == 0)
      std::printf("%-8zu %9.2f %9.2f %9.2f %9.2f %10.2f %9.2f %9.2f  %7.3fx %7.3fx %7.3fx %10.2f %6.2f GB/s\n",
                  bytes, med[0] * 1e6, low[0] * 1e6, med[1] * 1e6, low[1] * 1e6, med[2] * 1e6, med[3] * 1e6,
                  med[4] * 1e6, med[1] / med[0], ratio, low[1] / low[0], (med[1] - med[0]) * 1e6, busbw);
  }

  // Gradient compression: elements of a bucket as f32, and as bf16 with its conversions (the engine's
  // reduce_across_processes, with the CPU kernels it runs). Random values, so that the bf16 sums round as real
  // gradients do.
  using dpar::kernels::cpu::from_bf16;
  using dpar::kernels::cpu::to_bf16;
  {
    std::vector<float> grads((16 << 20) / sizeof(float));
    uint64_t rng = 0x243F6A8885A308D3ull + static_cast<uint64_t>(rank);
    for (auto& g : grads) g = bench_uniform(&rng) * 1e-3f;
    std::vector<uint16_t> packed(grads.size());
    if (rank == 0)
      std::printf("\ngradient compression (dpar's backend): a bucket of floats summed as f32, and as bf16 with its "
                  "conversions\n%-10s %10s %10s %10s %9s\n", "elements", "f32 us", "bf16 us", "(convert)", "f32/bf16");
    for (size_t count : {size_t{1} << 18, size_t{1} << 20, size_t{1} << 22}) {
      const int iters = count <= (size_t{1} << 18) ? 100 : count <= (size_t{1} << 20) ? 30 : 8;
      const auto n = static_cast<int64_t>(count);
      std::vector<Variant> variants = {
          {"f32", [&] { dpar_comm.all_reduce(grads.data(), grads.data(), count, dpar::DType::kF32,
                                             dpar::ReduceOp::kSum); }},
          {"bf16",
           [&] {
             to_bf16(packed.data(), grads.data(), n);
             dpar_comm.all_reduce(packed.data(), packed.data(), count, dpar::DType::kBF16, dpar::ReduceOp::kSum);
             from_bf16(grads.data(), packed.data(), n);
           }},
          {"convert",
           [&] {
             to_bf16(packed.data(), grads.data(), n);
             from_bf16(grads.data(), packed.data(), n);
           }},
      };
      std::vector<std::vector<double>> times(variants.size());
      std::vector<double> ratios;
      for (auto& v : variants) measure(sync, v.op, std::max(1, iters / 4));
      for (int round = 0; round < rounds; ++round) {
        std::vector<double> t(variants.size());
        for (size_t k = 0; k < variants.size(); ++k) {
          const size_t v = (k + static_cast<size_t>(round)) % variants.size();
          t[v] = measure(sync, variants[v].op, iters);
        }
        for (size_t v = 0; v < variants.size(); ++v) times[v].push_back(t[v]);
        ratios.push_back(t[0] / t[1]);
      }
      std::vector<double> med;
      for (auto& t : times) med.push_back(bench_median(t.data(), t.size()));
      if (rank == 0)
        std::printf("%-10zu %10.1f %10.1f %10.1f %8.2fx\n", count, med[0] * 1e6, med[1] * 1e6, med[2] * 1e6,
                    bench_median(ratios.data(), ratios.size()));
      // Keep the values in range: the sums double them every call.
      for (auto& g : grads) g = bench_uniform(&rng) * 1e-3f;
    }
  }

  // The pieces of the fixed overhead.
  int64_t fp[14] = {}, table[14 * 64];
  std::vector<Variant> pieces = {
      {"dpar barrier (the fingerprint exchange alone)", [&] { dpar_comm.barrier("bench"); }},
      {"plain MPI_Allgather of 7 int64", [&] { MPI_Allgather(fp, 7, MPI_INT64_T, table, 7, MPI_INT64_T, plain); }},
      {"plain MPI_Iallgather of 7 int64 + MPI_Test loop",
       [&] {
         MPI_Request r;
         MPI_Iallgather(fp, 7, MPI_INT64_T, table, 7, MPI_INT64_T, plain, &r);
         int done = 0;
         while (!done) MPI_Test(&r, &done, MPI_STATUS_IGNORE);
       }},
      {"plain MPI_Iallreduce of 14 int64 (min) + MPI_Test",
       [&] {
         MPI_Request r;
         MPI_Iallreduce(fp, table, 14, MPI_INT64_T, MPI_MIN, plain, &r);
         int done = 0;
         while (!done) MPI_Test(&r, &done, MPI_STATUS_IGNORE);
       }},
      {"plain MPI_Barrier", [&] { MPI_Barrier(plain); }},
  };
  if (size <= 64) {
    std::vector<std::vector<double>> times(pieces.size());
    for (int round = 0; round < rounds; ++round)
      for (size_t k = 0; k < pieces.size(); ++k) {
        const size_t v = (k + round) % pieces.size();
        times[v].push_back(measure(sync, pieces[v].op, 4000));
      }
    if (rank == 0) std::printf("\n");
    for (size_t v = 0; v < pieces.size(); ++v) {
      const double m = bench_median(times[v].data(), times[v].size());
      if (rank == 0) std::printf("%-48s %8.2f us\n", pieces[v].name, m * 1e6);
    }
  }
  MPI_Comm_free(&plain);
  MPI_Comm_free(&sync);
  return 0;
}
