// The optimizer sharded over every replica of every process (collectives/replica_set.h, world_block), under
// mpirun; one launch covers 1, 2 and 3 CPU replicas per process (tests/CMakeLists.txt runs it with 2 and 3
// processes):
//
//   mpirun -np P test_mpi_zero_world --expect-ranks P
//
// Each test trains tiny engines over every process (each process its rows of the global batch) with small buckets,
// so that every bucket is cut into world blocks of uneven sizes, some empty. The reduction chooses the shards: the
// default all-reduce keeps them within each process (block r of the process), the reduce-scatter (ZeRO-2) and the
// sharded all-reduce (ZeRO-1 over the world) spread them over the world. The checks, on every rank:
//  - the three train to the same bits without clipping, Adam and SGD with momentum, at 2 processes and at 3 (where
//    the buckets are small enough that MPI adds the processes' sums in rank order for every one of them); every
//    replica of every process ends with rank 0's replica 0's bits;
//  - they train as one process of one device on the whole global batch does, within float rounding (the shards
//    cover every parameter once), and to the bits of the reduce-scatter with the shards kept within each process
//    (EngineConfig::shard_across_processes false);
//  - with clipping, the norm is summed from the world's shards: the same bits on every replica of every process,
//    and training within float rounding of the all-reduce's;
//  - under the reduce-scatter and the sharded all-reduce each replica holds the optimizer state of its world block
//    alone: 1/(P*n) of the whole, the shards of the world adding up to it; under the default all-reduce each
//    process holds the whole state, 1/n on each replica;
//  - switching reductions between steps (all-reduce, reduce-scatter, sharded all-reduce, all-reduce) moves the
//    optimizer's state to each one's shards and trains on to the bits of an engine that never switched; a switch
//    that would move the shards is refused while gradients are pending;
//  - checkpoints gather the shards (of the world, or of each process) on rank 0 and load into any number of
//    processes and replicas, under any reduction, bit for bit (saved again, every tensor holds the same bytes);
//  - bf16 on the wire (compression) and the reduce dtype bf16: the reduce-scatter keeps the all-reduce's bits;
//  - loss scaling: an overflow in one process's rows alone makes every replica of every process skip the step.
//
//   mpirun --enable-recovery -np 3 test_mpi_zero_world --rank-exit    (tests/mpi/check_rank_exit.sh)
//
// is not a test suite: rank 1 exits mid-step and the others print what their engine threw.
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "comm/mpi_comm.h"
#include "comm/processes.h"
#include "engine_test_util.h"
#include "io/safetensors.h"
#include "nn/layer.h"

namespace dpar {
namespace {

using test::cpu_devices;
using test::max_relative_error;

int g_rank = 0, g_size = 1;

constexpr int64_t kIn = 12, kClasses = 5, kGlobalBatch = 19;

Model mlp() {
  Model m(21);
  m.add(make_linear(kIn, 24, true));
  m.add(make_activation(Activation::kTanh));
  m.add(make_linear(24, 16, true));
  m.add(make_activation(Activation::kTanh));
  m.add(make_linear(16, kClasses, true));
  return m;
}

struct Batch {
  Tensor x, y;
};

// Global batch b, the same on every rank.
Batch global_batch(uint64_t b) {
  std::mt19937 gen(static_cast<uint32_t>(500 + b));
  std::normal_distribution<float> normal;
  Batch out{Tensor::empty(DType::kF32, Shape{kGlobalBatch, kIn}, Device{}),
            Tensor::empty(DType::kI32, Shape{kGlobalBatch}, Device{})};
  for (int64_t i = 0; i < kGlobalBatch * kIn; ++i) out.x.f32()[i] = normal(gen);
  for (int64_t i = 0; i < kGlobalBatch; ++i) out.y.i32()[i] = static_cast<int32_t>(gen() % kClasses);
  return out;
}

// This process's rows of a global batch: balanced, sizes differing by one at most.
std::pair<int64_t, int64_t> my_rows(int rank = g_rank, int size = g_size) {
  const int64_t base = kGlobalBatch / size, extra = kGlobalBatch % size;
  return {rank * base + std::min<int64_t>(rank, extra), base + (rank < extra ? 1 : 0)};
}

OptimizerConfig adam(float max_norm = 0.0f) {
  OptimizerConfig c;
  c.kind = OptimizerKind::kAdam;
  c.lr = 1e-2f;
  c.max_grad_norm = max_norm;
  return c;
}

OptimizerConfig sgd() {
  OptimizerConfig c;
  c.kind = OptimizerKind::kSgd;
  c.lr = 0.1f;
  c.momentum = 0.9f;
  return c;
}

// An engine of n CPU replicas over every process (or this one alone), with buckets of 16 to 96 gradients.
// across == false: the shards stay within each process (EngineConfig::shard_across_processes).
std::unique_ptr<Engine> engine(size_t n, const OptimizerConfig& opt, GradientReduction reduction, bool world = true,
                               bool across = true) {
  EngineConfig c = cpu_devices(n);
  c.shard_across_processes = across;
  c.buckets.first_bucket_bytes = 64;
  c.buckets.bucket_cap_bytes = 384;
  c.reduction = reduction;
  if (world) c.processes = world_communicator(30.0);
  return std::make_unique<Engine>(mlp(), opt, std::move(c));
}

double step(Engine& e, uint64_t b) {
  const Batch g = global_batch(b);
  if (e.num_processes() == 1) return e.train_step(g.x, g.y);
  const auto [begin, rows] = my_rows();
  return e.train_step(g.x.rows(begin, rows), g.y.rows(begin, rows));
}

// Rank 0's values on every rank.
std::vector<float> rank0s(std::vector<float> v) {
  MPI_Bcast(v.data(), static_cast<int>(v.size()), MPI_FLOAT, 0, MPI_COMM_WORLD);
  return v;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Every replica holds replica 0's bits, and replica 0 holds rank 0's.
void expect_world_agrees(const Engine& e, const std::string& label) {
  const std::vector<float> first = e.params(0);
  for (size_t r = 1; r < e.num_replicas(); ++r)
    EXPECT_TRUE(same_bits(e.params(r), first)) << label << ": replica " << r << " differs from replica 0";
  EXPECT_TRUE(same_bits(rank0s(first), first)) << label << ": replica 0 differs from rank 0's";
}

size_t world_sum(size_t mine) {
  unsigned long long in = mine, out = 0;
  MPI_Allreduce(&in, &out, 1, MPI_UNSIGNED_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  return static_cast<size_t>(out);
}

// Adam's state over the whole model, and what one replica may hold of it at most as 1/parts (blocks are rounded to
// 16 elements, so a replica holds at most 16 elements a bucket more).
size_t adam_state_bytes(const Engine& e) {
  return 2 * sizeof(float) * static_cast<size_t>(e.model().num_param_elements());
}
size_t adam_share_bound(const Engine& e, size_t parts) {
  return adam_state_bytes(e) / parts + 2 * sizeof(float) * 16 * e.num_buckets();
}

// Each replica's optimizer state: 1/(P*n) of the whole where the shards span the world (the world's adding up to
// it), 1/n where they stay within each process (the process's adding up to it).
void expect_state_shares(const Engine& e, bool world, const std::string& label) {
  const size_t whole = adam_state_bytes(e), n = e.num_replicas();
  size_t mine = 0;
  for (size_t b : e.replica_optimizer_state_bytes()) {
    mine += b;
    EXPECT_LE(b, adam_share_bound(e, world ? n * static_cast<size_t>(g_size) : n)) << label;
  }
  if (world) {
    EXPECT_EQ(world_sum(mine), whole) << label;
    if (g_size > 1) {
      EXPECT_LT(mine, whole) << label << ": this process holds the whole state";
    }
  } else {
    EXPECT_EQ(mine, whole) << label;
  }
}

TEST(WorldZero, TheThreeReductionsTrainToTheSameBitsAndAsOneDevice) {
  constexpr int kSteps = 4;
  for (size_t n : {size_t{1}, size_t{2}, size_t{3}}) {
    for (const OptimizerConfig& opt : {adam(), sgd()}) {
      const std::string label = std::to_string(g_size) + " x " + std::to_string(n) + ", " + std::string(opt.name());
      auto all = engine(n, opt, GradientReduction::kAllReduce);
      auto scatter = engine(n, opt, GradientReduction::kReduceScatter);
      auto sharded = engine(n, opt, GradientReduction::kAllReduceWorldShards);
      ASSERT_EQ(scatter->num_processes(), g_size);
      ASSERT_GE(scatter->num_buckets(), 3u) << label;
      auto alone = engine(1, opt, GradientReduction::kAllReduce, false);
      // The reduce-scatter with the shards within each process: each bucket summed whole across the processes.
      auto per_process = engine(n, opt, GradientReduction::kReduceScatter, true, false);
      for (int s = 0; s < kSteps; ++s) {
        const double a = step(*all, static_cast<uint64_t>(s)), r = step(*scatter, static_cast<uint64_t>(s));
        const double h = step(*sharded, static_cast<uint64_t>(s));
        step(*alone, static_cast<uint64_t>(s));
        step(*per_process, static_cast<uint64_t>(s));
        EXPECT_EQ(std::memcmp(&a, &r, sizeof a), 0) << label << ", step " << s << ": losses " << a << " and " << r;
        EXPECT_EQ(std::memcmp(&a, &h, sizeof a), 0) << label << ", step " << s << ": losses " << a << " and " << h;
      }
      EXPECT_TRUE(same_bits(scatter->params(0), all->params(0))) << label << ": the reduce-scatter's parameters";
      EXPECT_TRUE(same_bits(sharded->params(0), all->params(0))) << label << ": the sharded all-reduce's parameters";
      EXPECT_TRUE(same_bits(scatter->params(0), per_process->params(0))) << label << ": against the shards per process";
      EXPECT_LE(max_relative_error(all->params(0), alone->params(0)), 1e-5) << label << ": against one device";
      expect_world_agrees(*all, label + ", all-reduce");
      expect_world_agrees(*scatter, label + ", reduce-scatter");
      expect_world_agrees(*sharded, label + ", sharded all-reduce");
      if (opt.kind == OptimizerKind::kAdam) {
        expect_state_shares(*all, false, label + ", all-reduce");
        expect_state_shares(*per_process, false, label + ", reduce-scatter within each process");
        expect_state_shares(*scatter, true, label + ", reduce-scatter");
        expect_state_shares(*sharded, true, label + ", sharded all-reduce");
        EXPECT_EQ(scatter->replica_optimizer_state_bytes(), sharded->replica_optimizer_state_bytes()) << label;
      }
    }
  }
}

// Switching between steps moves the optimizer's state where the shards move (the default all-reduce's per process,
// the others' over the world): Adam's moments must land on their new owners for the bits to hold.
TEST(WorldZero, SwitchingReductionsMovesTheStateAndKeepsTheBits) {
  constexpr GradientReduction kOrder[] = {GradientReduction::kReduceScatter, GradientReduction::kAllReduceWorldShards,
                                          GradientReduction::kAllReduce};
  for (size_t n : {size_t{1}, size_t{3}}) {
    const std::string label = std::to_string(g_size) + " x " + std::to_string(n);
    auto straight = engine(n, adam(), GradientReduction::kAllReduce);
    auto switching = engine(n, adam(), GradientReduction::kAllReduce);
    for (int s = 0; s < 7; ++s) {
      if (s == 1 || s == 3 || s == 5) {
        const GradientReduction to = kOrder[s / 2];
        switching->set_gradient_reduction(to);
        expect_state_shares(*switching, to != GradientReduction::kAllReduce,
                            label + ", switched to " + std::to_string(static_cast<int>(to)));
      }
      step(*straight, static_cast<uint64_t>(s));
      step(*switching, static_cast<uint64_t>(s));
    }
    EXPECT_TRUE(same_bits(switching->params(0), straight->params(0))) << label;
    expect_world_agrees(*switching, label + ", switched");
    // Gradients pending: a switch that moves the shards is refused, and one that keeps them is not.
    const Batch g = global_batch(9);
    const auto [begin, rows] = my_rows();
    switching->accumulate(g.x.rows(begin, rows), g.y.rows(begin, rows));
    try {
      switching->set_gradient_reduction(GradientReduction::kReduceScatter);
      if (g_size > 1) {
        ADD_FAILURE() << label << ": the shards moved with gradients pending";
      }
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::kInvalidState) << label << ": " << e.what();
      EXPECT_GT(g_size, 1) << label << ": one process has nothing to move";
    }
    switching->zero_grad();
  }
}

TEST(WorldZero, ClippingNormIsTheWorldsAndTheSameOnEveryReplica) {
  constexpr float kMaxNorm = 0.05f;  // below every step's norm here: each step is clipped
  for (size_t n : {size_t{1}, size_t{2}, size_t{3}}) {
    const std::string label = std::to_string(g_size) + " x " + std::to_string(n);
    auto all = engine(n, adam(kMaxNorm), GradientReduction::kAllReduce);
    auto scatter = engine(n, adam(kMaxNorm), GradientReduction::kReduceScatter);
    auto alone = engine(1, adam(kMaxNorm), GradientReduction::kAllReduce, false);
    for (int s = 0; s < 3; ++s) {
      step(*all, static_cast<uint64_t>(s));
      step(*scatter, static_cast<uint64_t>(s));
      step(*alone, static_cast<uint64_t>(s));
      EXPECT_GT(scatter->grad_norm(), kMaxNorm) << label << ", step " << s;
      EXPECT_NEAR(scatter->grad_norm(), alone->grad_norm(), 1e-5 * alone->grad_norm()) << label << ", step " << s;
      for (float norm : scatter->replica_grad_norms())
        EXPECT_EQ(norm, rank0s({scatter->grad_norm()})[0]) << label << ", step " << s;
    }
    EXPECT_LE(max_relative_error(scatter->params(0), all->params(0)), 1e-5) << label;
    EXPECT_LE(max_relative_error(scatter->params(0), alone->params(0)), 1e-4) << label;
    expect_world_agrees(*scatter, label + ", reduce-scatter, clipped");
    expect_world_agrees(*all, label + ", all-reduce, clipped");
  }
}

// bf16 across the processes (compression), and the whole reduction in bf16 (reduce dtype): the reduce-scatter's
// blocks cross the processes in bf16 as the all-reduce's buckets do, to the same bits.
TEST(WorldZero, Bf16OnTheWireKeepsTheAllReducesBits) {
  for (size_t n : {size_t{1}, size_t{3}}) {
    for (bool reduce_dtype : {false, true}) {
      const std::string label = std::to_string(g_size) + " x " + std::to_string(n) +
                                (reduce_dtype ? ", reduce dtype bf16" : ", bf16 compression");
      auto all = engine(n, sgd(), GradientReduction::kAllReduce);
      auto scatter = engine(n, sgd(), GradientReduction::kReduceScatter);
      auto plain = engine(n, sgd(), GradientReduction::kReduceScatter);
      for (Engine* e : {all.get(), scatter.get()}) {
        if (reduce_dtype)
          e->set_reduce_dtype(DType::kBF16);
        else
          e->set_gradient_compression(GradientCompression::kBf16);
      }
      for (int s = 0; s < 3; ++s)
        for (Engine* e : {all.get(), scatter.get(), plain.get()}) step(*e, static_cast<uint64_t>(s));
      EXPECT_TRUE(same_bits(scatter->params(0), all->params(0))) << label;
      EXPECT_FALSE(same_bits(scatter->params(0), plain->params(0))) << label << ": nothing was rounded to bf16";
      EXPECT_LE(max_relative_error(scatter->params(0), plain->params(0)), 2e-2) << label;
      expect_world_agrees(*scatter, label);
    }
  }
}

// Every tensor of two checkpoints, byte for byte (their metadata names their replica counts, which may differ).
void expect_same_tensors(const std::string& a, const std::string& b, const std::string& label) {
  const io::SafetensorsFile fa = io::SafetensorsFile::read(a), fb = io::SafetensorsFile::read(b);
  ASSERT_EQ(fa.names(), fb.names()) << label;
  for (const std::string& name : fa.names()) {
    ASSERT_EQ(fa.entry(name).bytes, fb.entry(name).bytes) << label << ": " << name;
    EXPECT_EQ(std::memcmp(fa.data(name), fb.data(name), fa.entry(name).bytes), 0) << label << ": " << name;
  }
  EXPECT_EQ(fa.metadata().at("dpar.step"), fb.metadata().at("dpar.step")) << label;
}

TEST(WorldZero, CheckpointsMoveBetweenWorldSizesAndReductions) {
  // A directory of rank 0's, named to every rank (one machine: rank 0 alone writes and reads files).
  char dir[64] = "/tmp/dpar_zero_world_XXXXXX";
  if (g_rank == 0) {
    ASSERT_NE(mkdtemp(dir), nullptr);
  }
  MPI_Bcast(dir, sizeof dir, MPI_CHAR, 0, MPI_COMM_WORLD);
  const std::string saved = std::string(dir) + "/world.safetensors";
  auto source = engine(2, adam(), GradientReduction::kReduceScatter);
  for (int s = 0; s < 2; ++s) step(*source, static_cast<uint64_t>(s));
  source->save(saved);
  // Into every process again, 3 and 1 replicas each, either reduction, and out again: the same tensors.
  int round = 0;
  for (size_t n : {size_t{3}, size_t{1}}) {
    for (GradientReduction reduction : {GradientReduction::kAllReduce, GradientReduction::kReduceScatter,
                                        GradientReduction::kAllReduceWorldShards}) {
      const std::string label = std::to_string(g_size) + " x 2 into " + std::to_string(g_size) + " x " +
                                std::to_string(n) + ", reduction " + std::to_string(static_cast<int>(reduction));
      auto target = engine(n, adam(), reduction);
      target->load(saved);
      const std::string again = std::string(dir) + "/again" + std::to_string(round++) + ".safetensors";
      target->save(again);
      if (g_rank == 0) expect_same_tensors(saved, again, label);
      // And it trains on as the source does (other replica counts: within float rounding).
      step(*source, 7);
      step(*target, 7);
      EXPECT_LE(max_relative_error(target->params(0), source->params(0)), 1e-5) << label;
      source->load(saved);
      if (g_rank == 0) std::remove(again.c_str());
    }
  }
  // Into one process alone (rank 0), 3 replicas, and from it back into every process.
  const std::string alone_path = std::string(dir) + "/alone.safetensors";
  if (g_rank == 0) {
    auto alone = engine(3, adam(), GradientReduction::kAllReduce, false);
    alone->load(saved);
    alone->save(alone_path);
    expect_same_tensors(saved, alone_path, "into one process of 3 replicas");
  }
  MPI_Barrier(MPI_COMM_WORLD);
  auto back = engine(2, adam(), GradientReduction::kReduceScatter);
  back->load(alone_path);
  const std::string back_path = std::string(dir) + "/back.safetensors";
  back->save(back_path);
  if (g_rank == 0) {
    expect_same_tensors(saved, back_path, "back into every process");
    for (const std::string& p : {saved, alone_path, back_path}) std::remove(p.c_str());
    rmdir(dir);
  }
}

TEST(WorldZero, AnOverflowInOneProcessSkipsTheStepEverywhere) {
  for (GradientReduction reduction : {GradientReduction::kAllReduce, GradientReduction::kReduceScatter,
                                      GradientReduction::kAllReduceWorldShards}) {
    auto e = engine(2, adam(), reduction);
    LossScaling ls;
    ls.init_scale = 1024.0f;
    e->set_loss_scaling(ls);
    step(*e, 0);
    const std::vector<float> before = e->params(0);
    const int64_t steps = e->step_count();
    // An infinite input in the last rank's rows alone.
    Batch g = global_batch(1);
    const auto [begin, rows] = my_rows();
    if (g_rank == g_size - 1) g.x.f32()[begin * kIn] = INFINITY;
    e->train_step(g.x.rows(begin, rows), g.y.rows(begin, rows));
    EXPECT_EQ(e->step_count(), steps);
    EXPECT_TRUE(same_bits(e->params(0), before));
    EXPECT_EQ(e->loss_scaler().scale(), 512.0f);
    step(*e, 2);
    EXPECT_EQ(e->step_count(), steps + 1);
    expect_world_agrees(*e, "after a skipped step");
  }
}

// Not a test suite (tests/mpi/check_rank_exit.sh reads what it prints): an engine of 2 replicas a process under the
// reduce-scatter, where rank 1 exits in the forward of its third step; the others, waiting in the buckets'
// reduce-scatters across the processes (each replica on its own link), must fail within the timeout naming it.
int rank_exit() {
  auto e = [] {
    EngineConfig c = cpu_devices(2);
    c.buckets.first_bucket_bytes = 64;
    c.buckets.bucket_cap_bytes = 384;
    c.reduction = GradientReduction::kReduceScatter;
    c.timeout_seconds = 2.0;
    c.processes = world_communicator(2.0, 30.0);
    return std::make_unique<Engine>(mlp(), adam(), std::move(c));
  }();
  int s = 0;
  e->set_forward_hook([&](size_t replica, const Shape&, const Shape&) {
    if (g_rank == 1 && s == 2 && replica == 1) {
      std::fflush(stdout);
      _exit(3);
    }
  });
  for (; s < 5; ++s) {
    try {
      step(*e, static_cast<uint64_t>(s));
    } catch (const Error& err) {
      const bool ok = (err.status() == Status::kTimeout || err.status() == Status::kCommunication ||
                       err.status() == Status::kRemote) && s == 2;
      std::printf("rank %d: step %d threw %s: %s\n", g_rank, s, status_name(err.status()), err.what());
      if (ok) std::printf("rank %d: SURVIVOR OK\n", g_rank);
      std::fflush(stdout);
      _exit(ok ? 0 : 1);
    }
  }
  std::printf("rank %d: no error although rank 1 exited\n", g_rank);
  std::fflush(stdout);
  _exit(1);
}

// Prints every rank's failures (gtest's own printer runs on rank 0 only), and starts each test together.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestStart(const ::testing::TestInfo&) override { MPI_Barrier(MPI_COMM_WORLD); }
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
  bool rank_exit = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--expect-ranks") == 0 && i + 1 < argc) expect_ranks = std::atoi(argv[++i]);
    if (std::strcmp(argv[i], "--rank-exit") == 0) rank_exit = true;
  }
  ::testing::InitGoogleTest(&argc, argv);
  dpar::g_rank = dpar::MpiRuntime::instance().world_rank();
  dpar::g_size = dpar::MpiRuntime::instance().world_size();
  if (rank_exit) return dpar::rank_exit();
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (dpar::g_rank != 0) delete listeners.Release(listeners.default_result_printer());
  listeners.Append(new dpar::RankFailurePrinter(dpar::g_rank));
  // Every launched rank must have joined: a job that fell apart into singletons would train each alone.
  if (expect_ranks > 0 && dpar::g_size != expect_ranks) {
    std::fprintf(stderr, "rank %d: FAIL the world has %d ranks, but %d were launched\n", dpar::g_rank, dpar::g_size,
                 expect_ranks);
    return 1;
  }
  return RUN_ALL_TESTS();
}
