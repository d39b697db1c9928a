// bench_zero_world [--devices N] [--rounds R] [--steps S]      (under mpirun -np P, or alone)
//
// The engine's three gradient reductions, each with the optimizer's shards where it puts them, and the
// reduce-scatter with the shards kept within each process (EngineConfig::shard_across_processes = false), for the
// MLP 784-1024-1024-10 (Adam, batch 256 per process):
//   all-reduce (the default): the shards within each process (each process holds the whole state), as DDP;
//   reduce-scatter, shards per process: ZeRO-2 within each process, a bucket summed whole across the processes;
//   sharded all-reduce: the all-reduce with the shards over every replica of every process (ZeRO-1 over the world);
//   reduce-scatter: ZeRO-2 over the world.
// For each: the median training step over R interleaved rounds of S steps (the slowest process's, each round), the
// optimizer state each replica holds (measured: Engine::replica_optimizer_state_bytes, the largest), and the bytes
// of gradients and parameters each replica sends (and as many receives) per step across the processes and within
// its process, from the algorithms' layout (ring bus bytes, as nccl-tests counts them, for a gradient of G bytes,
// n replicas a process, P processes):
//   shards per process, either reduction: replica 0 sums each bucket whole across the processes, 2(P-1)/P G; the
//                 others none;
//   sharded all-reduce: the same all-reduce, then every replica all-gathers its local block across the processes,
//                 (P-1)/P G/n;
//   reduce-scatter over the world: every replica reduce-scatters and all-gathers its local block across the
//                 processes, 2(P-1)/P G/n.
// Within a process: all-reduce 2(n-1)/n G (reduce and broadcast through replica 0 with several processes; so too
// the reduce-scatter's with the shards per process and several processes), reduce-scatter and all-gather (n-1)/n G
// each. Rank 0 prints. The step times are the slowest process's.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "comm/processes.h"
#include "engine/engine.h"
#include "nn/layer.h"

namespace {

using namespace dpar;

constexpr int64_t kBatch = 256, kFeatures = 784, kHidden = 1024, kClasses = 10;

Model mlp() {
  Model m(3);
  m.add(make_linear(kFeatures, kHidden, true));
  m.add(make_activation(Activation::kRelu));
  m.add(make_linear(kHidden, kHidden, true));
  m.add(make_activation(Activation::kRelu));
  m.add(make_linear(kHidden, kClasses, true));
  return m;
}

struct Variant {
  const char* name;
  GradientReduction reduction;
  bool across;
};

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

}  // namespace

int main(int argc, char** argv) {
  size_t devices = 1;
  int rounds = 5, steps = 5;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--devices") && i + 1 < argc) devices = static_cast<size_t>(std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--steps") && i + 1 < argc) steps = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: bench_zero_world [--devices N] [--rounds R] [--steps S]\n");
      return 2;
    }
  }
  if (devices < 1 || devices > 64 || rounds < 1 || steps < 1) return 2;
  const Variant variants[4] = {
      {"all-reduce (default, per process)", GradientReduction::kAllReduce, true},
      {"reduce-scatter, shards per process", GradientReduction::kReduceScatter, false},
      {"sharded all-reduce (world ZeRO-1)", GradientReduction::kAllReduceWorldShards, true},
      {"reduce-scatter (world ZeRO-2)", GradientReduction::kReduceScatter, true}};
  std::vector<std::unique_ptr<Engine>> engines;
  OptimizerConfig opt;
  opt.kind = OptimizerKind::kAdam;
  opt.lr = 1e-3f;
  for (const Variant& v : variants) {
    EngineConfig c;
    for (size_t r = 0; r < devices; ++r) c.devices.push_back(Device{DeviceKind::kCpu, static_cast<int32_t>(r)});
    c.reduction = v.reduction;
    c.shard_across_processes = v.across;
    c.processes = connect_processes(ProcessMode::kAuto, 300.0);
    engines.push_back(std::make_unique<Engine>(mlp(), opt, std::move(c)));
  }
  const int rank = engines[0]->process_rank(), processes = engines[0]->num_processes();

  std::mt19937 gen(42);
  std::normal_distribution<float> normal;
  Tensor x = Tensor::empty(DType::kF32, Shape{kBatch, kFeatures}, Device{});
  Tensor y = Tensor::empty(DType::kI32, Shape{kBatch}, Device{});
  for (int64_t i = 0; i < kBatch * kFeatures; ++i) x.f32()[i] = normal(gen);
  for (int64_t i = 0; i < kBatch; ++i) y.i32()[i] = static_cast<int32_t>(gen() % kClasses);

  for (auto& e : engines) e->train_step(x, y), e->train_step(x, y);  // warm up
  std::vector<std::vector<double>> times(4);
  for (int round = 0; round < rounds; ++round) {
    for (size_t v = 0; v < 4; ++v) {
      double t = now();
      for (int s = 0; s < steps; ++s) engines[v]->train_step(x, y);
      t = (now() - t) / steps;
      // The slowest process's: the step is over only when every process has finished it.
      if (processes > 1) MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      times[v].push_back(t);
    }
  }
  if (rank != 0) return 0;
  const double g = 4.0 * static_cast<double>(engines[0]->model().num_param_elements());
  const double n = static_cast<double>(devices), p = static_cast<double>(processes);
  const double mb = 1e-6;
  std::printf("bench_zero_world: %d process(es) x %zu CPU device(s); MLP 784-1024-1024-10, %.2f MB of gradients; "
              "Adam, batch %lld per process; median of %d rounds of %d steps\n",
              processes, devices, g * mb, static_cast<long long>(kBatch), rounds, steps);
  std::printf("%-38s %9s %14s %26s %20s\n", "", "step ms", "opt. state MB", "across processes MB/step",
              "within process MB");
  std::printf("%-38s %9s %14s %26s %20s\n", "", "", "per replica", "(replica 0 / others)", "per replica/step");
  for (size_t v = 0; v < 4; ++v) {
    std::vector<double> t = times[v];
    std::sort(t.begin(), t.end());
    const double median = t[t.size() / 2];
    size_t state = 0;
    for (size_t b : engines[v]->replica_optimizer_state_bytes()) state = std::max(state, b);
    // The shards span the processes (under the default all-reduce they never do).
    const bool world = variants[v].across && variants[v].reduction != GradientReduction::kAllReduce;
    const bool all_reduce = variants[v].reduction != GradientReduction::kReduceScatter;
    double first = 0, others = 0;
    if (processes > 1) {
      const double ring = (p - 1) / p;
      if (!world) {
        first = 2 * ring * g;
      } else if (all_reduce) {
        first = 2 * ring * g + ring * g / n;
        others = ring * g / n;
      } else {
        first = others = 2 * ring * g / n;
      }
    }
    const double local_ring = (n - 1) / n;
    // The all-reduce's reduce and broadcast (or all-reduce) and the all-gather; the reduce-scatter and the
    // all-gather, except where the shards stay within each process and a bucket is summed whole across them.
    const bool whole = all_reduce || (!world && p > 1);
    const double within = (whole ? 3 : 2) * local_ring * g;
    char rest[32] = "-";  // one replica a process: no others
    if (devices > 1) std::snprintf(rest, sizeof rest, "%.2f", others * mb);
    std::printf("%-38s %9.2f %14.2f %15.2f / %-8s %20.2f\n", variants[v].name, median * 1e3,
                static_cast<double>(state) * mb, first * mb, rest, within * mb);
  }
  return 0;
}
