// The replica set's collectives (src/collectives) and the reducer's bucket strategies over them, and a layer that
// reaches the other replicas through its context:
//  - over one process, every strategy equals one all-reduce among the replicas, bit for bit;
//  - over several processes (here: threads standing in for processes, through a threads group as the processes'
//    link, so that the whole hierarchy runs in one test program), the hierarchical sum equals the sum over every
//    replica, on every replica, with replicas that produced nothing;
//  - a layer whose forward and backward sum statistics over every replica trains N devices exactly as one device on
//    the full batch, with replicas that got no rows, and its calls run on the communication thread after the
//    gradient buckets already in flight.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "collectives/replica_set.h"
#include "comm/threads_comm.h"
#include "common/error.h"
#include "engine/engine.h"
#include "kernels/cpu/kernels.h"
#include "reducer/bucket_strategy.h"
#include "engine_test_util.h"

namespace dpar {
namespace {

using test::cpu_devices;
using test::host_stream;
using test::max_relative_error;

std::vector<std::string> names(int n, const std::string& what = "replica") {
  std::vector<std::string> out;
  for (int r = 0; r < n; ++r) out.push_back(what + " " + std::to_string(r));
  return out;
}

template <class F>
void on_threads(int n, F body) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back([&, r] { body(r); });
  for (auto& t : threads) t.join();
}

// Whole numbers: every order of summation gives the same bits, so a hierarchical sum can be compared exactly.
float value(int process, int replica, size_t i) { return static_cast<float>((process * 7 + replica * 3 + 1) * (i % 5 + 1)); }

// A job of `processes` x `replicas` in this program: one threads group per "process" for its replicas, and a
// threads group of the processes' replica 0 as the link between processes.
struct Job {
  int processes, replicas;
  ThreadGroup across;
  std::vector<std::unique_ptr<ThreadGroup>> locals;
  std::vector<std::shared_ptr<ProcessLinks>> links;
  Job(int p, int n) : processes(p), replicas(n), across(names(p, "process"), std::chrono::seconds(20)) {
    for (int q = 0; q < p; ++q) {
      locals.push_back(std::make_unique<ThreadGroup>(names(n), std::chrono::seconds(20)));
      if (p > 1) {
        links.push_back(std::make_shared<ProcessLinks>());
        links.back()->host = across.communicator(q);
        links.back()->transport = "threads standing in for processes";
      } else {
        links.push_back(nullptr);
      }
    }
  }
  // body(process, replica, set) on one thread per replica of every process.
  template <class F>
  void run(F body) {
    on_threads(processes * replicas, [&](int t) {
      const int p = t / replicas, r = t % replicas;
      auto local = locals[static_cast<size_t>(p)]->communicator(r);
      ReplicaSet set(*local, host_stream(), links[static_cast<size_t>(p)]);
      body(p, r, set);
    });
  }
};

TEST(ReplicaSet, EveryStrategySumsOverEveryReplicaOfEveryProcess) {
  const size_t count = 1001;
  for (const auto& [p, n] : std::vector<std::pair<int, int>>{{1, 1}, {1, 3}, {2, 1}, {2, 2}, {3, 2}}) {
    std::vector<BucketStrategyKind> kinds = {BucketStrategyKind::kHierarchical};
    if (p == 1) kinds.push_back(BucketStrategyKind::kFlat);
    for (BucketStrategyKind kind : kinds) {
      Job job(p, n);
      std::vector<std::vector<float>> got(static_cast<size_t>(p * n));
      job.run([&](int q, int r, ReplicaSet& set) {
        EXPECT_EQ(set.num_processes(), p);
        EXPECT_EQ(set.replica(), static_cast<size_t>(r));
        // The last replica of process 0 produced nothing (when it is not alone in the job).
        const bool contributes = !(q == 0 && r == n - 1 && p * n > 1);
        std::vector<float> data(count);
        for (size_t i = 0; i < count; ++i) data[i] = contributes ? value(q, r, i) : NAN;  // NaN: must not be read
        auto strategy = make_bucket_strategy(kind, set);
        GradBucket bucket;
        bucket.data = data.data();
        bucket.count = count;
        bucket.contributes = contributes;
        bucket.scale = 0.5f;
        strategy->reduce(bucket);
        got[static_cast<size_t>(q * n + r)] = data;
      });
      for (size_t i = 0; i < count; ++i) {
        double expected = 0;
        for (int q = 0; q < p; ++q)
          for (int r = 0; r < n; ++r)
            if (!(q == 0 && r == n - 1 && p * n > 1)) expected += value(q, r, i);
        ASSERT_EQ(got[0][i], static_cast<float>(expected * 0.5)) << bucket_strategy_name(kind) << ", " << p << "x" << n
                                                                  << ", element " << i;
      }
      for (size_t t = 1; t < got.size(); ++t) EXPECT_EQ(got[t], got[0]) << p << "x" << n << ", replica " << t;
    }
  }
}

TEST(ReplicaSet, FlatIsRefusedOverProcessesAndStrategiesAreNamed) {
  Job job(2, 1);
  job.run([&](int, int, ReplicaSet& set) {
    try {
      make_bucket_strategy(BucketStrategyKind::kFlat, set);
      ADD_FAILURE() << "flat over two processes was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("spans 2 processes"), std::string::npos) << e.what();
    }
    EXPECT_STREQ(make_bucket_strategy(BucketStrategyKind::kHierarchical, set)->name(), "hierarchical");
    // The threads standing in for processes move no bf16: the strategy is refused when made, not at every bucket.
    try {
      make_bucket_strategy(BucketStrategyKind::kHierarchicalBf16, set);
      ADD_FAILURE() << "bf16 across threads standing in for processes was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::kNotSupported);
      EXPECT_NE(std::string(e.what()).find("does not move bf16"), std::string::npos) << e.what();
    }
    EXPECT_THROW(make_bucket_strategy(static_cast<BucketStrategyKind>(42), set), Error);
  });
}

// bfloat16 on the wire needs a transport that sums bfloat16 (MPI, NCCL): over the threads backend, which does not,
// the failure reaches every replica of every process as an error, not a hang.
TEST(ReplicaSet, AWireTheProcessesCannotCarryFailsEveryReplica) {
  Job job(2, 2);
  std::vector<Status> statuses(4, Status::kOk);
  job.run([&](int q, int r, ReplicaSet& set) {
    std::vector<float> data(64, 1.0f);
    try {
      set.all_reduce_sum(data.data(), data.size(), true, 1.0f, Wire::kBf16);
    } catch (const Error& e) {
      statuses[static_cast<size_t>(q * 2 + r)] = e.status();
    }
  });
  // The processes' replica 0 see the transport refuse; the others are released by it (REMOTE).
  EXPECT_EQ(statuses[0], Status::kNotSupported);
  EXPECT_EQ(statuses[2], Status::kNotSupported);
  EXPECT_EQ(statuses[1], Status::kRemote);
  EXPECT_EQ(statuses[3], Status::kRemote);
}

TEST(ReplicaSet, LayerSumsOverEveryProcessInF64AndF32) {
  Job job(2, 3);
  std::vector<std::vector<double>> got(6);
  job.run([&](int q, int r, ReplicaSet& set) {
    std::vector<double> stats = {double(q), double(r), 1.0};
    set.sum(stats.data(), stats.size(), DType::kF64);
    got[static_cast<size_t>(q * 3 + r)] = stats;
    std::vector<float> f = {1.5f};
    set.sum(f.data(), 1, DType::kF32);
    EXPECT_EQ(f[0], 9.0f);
    EXPECT_THROW(set.sum(f.data(), 1, DType::kI32), Error);  // refused before anything moves: no hang
  });
  for (const auto& g : got) EXPECT_EQ(g, (std::vector<double>{3.0, 6.0, 6.0}));
}

TEST(ReplicaSet, MeanScaleCountsTheReplicasOfEveryProcess) {
  Job job(3, 2);
  std::vector<float> scale(6);
  job.run([&](int q, int r, ReplicaSet& set) { scale[static_cast<size_t>(q * 2 + r)] = set.mean_scale(); });
  for (float s : scale) EXPECT_EQ(s, 1.0f / 6);
}

// Reduce-scatter leaves each replica its block of the sum, bit for bit the all-reduce's block (one process: a
// reduce-scatter among the replicas; several: the hierarchical sum, each keeping its block). Values whose sum
// depends on the order, so that a different order would show.
TEST(ReplicaSet, ReduceScatterGivesEachReplicaItsBlockOfTheAllReduce) {
  for (const auto& [p, n] : std::vector<std::pair<int, int>>{{1, 1}, {1, 2}, {1, 3}, {1, 4}, {2, 2}, {2, 3}}) {
    for (size_t count : {size_t{1}, size_t{5}, size_t{33}, size_t{1000}}) {
      Job job(p, n);
      std::vector<std::vector<float>> whole(static_cast<size_t>(p * n)), blocks(static_cast<size_t>(p * n));
      job.run([&](int q, int r, ReplicaSet& set) {
        std::vector<float> a(count), b(count);
        for (size_t i = 0; i < count; ++i) a[i] = b[i] = 1.0f / static_cast<float>(3 + q * 5 + r * 7 + i % 11);
        auto all = make_bucket_strategy(BucketStrategyKind::kHierarchical, set);
        auto scatter = make_bucket_strategy(BucketStrategyKind::kReduceScatter, set);
        EXPECT_TRUE(scatter->sharded());
        EXPECT_FALSE(all->sharded());
        GradBucket bucket;
        bucket.count = count;
        bucket.scale = 0.25f;
        bucket.data = a.data();
        all->reduce(bucket);
        bucket.data = b.data();
        scatter->reduce(bucket);
        whole[static_cast<size_t>(q * n + r)] = a;
        blocks[static_cast<size_t>(q * n + r)] = b;
      });
      for (int q = 0; q < p; ++q)
        for (int r = 0; r < n; ++r) {
          const auto [begin, end] = Communicator::block_range(count, n, r);
          const auto& got = blocks[static_cast<size_t>(q * n + r)];
          for (size_t i = begin; i < end; ++i)
            ASSERT_EQ(got[i], whole[0][i]) << p << "x" << n << ", count " << count << ", replica " << r << ", " << i;
        }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// A layer that needs the other replicas: y = x - mean over the batch of x, per feature (BatchNorm's centring).
// Its forward sums each feature and the row count over every replica; its backward sums dout per feature, since
// dL/dx = dout - mean over the batch of dout. Alone (no replica set) it centres over its own rows.

class CentreOverBatch final : public Layer {
 public:
  explicit CentreOverBatch(int64_t features) : features_(features) {}
  std::string describe() const override { return "centre over the batch"; }
  Shape output_shape(const Shape& in) const override { return in; }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<CentreOverBatch>(features_); }
  bool uses_collectives() const override { return true; }

  // in (B, F), out (B, F)
  void forward(const ReplicaContext& ctx, const Tensor& in, const Tensor& out) override {
    const int64_t rows = in.rows(), f = features_;
    std::vector<double> sums(static_cast<size_t>(f) + 1, 0.0);  // per feature, then the rows
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < f; ++j) sums[static_cast<size_t>(j)] += in.f32()[i * f + j];
    sums.back() = static_cast<double>(rows);
    if (ctx.collectives) ctx.collectives->sum(sums.data(), sums.size(), DType::kF64);
    mean_.assign(static_cast<size_t>(f), 0.0f);
    for (int64_t j = 0; j < f; ++j) mean_[static_cast<size_t>(j)] = static_cast<float>(sums[static_cast<size_t>(j)] / sums.back());
    total_rows_ = sums.back();
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < f; ++j) out.f32()[i * f + j] = in.f32()[i * f + j] - mean_[static_cast<size_t>(j)];
  }
  void backward(const ReplicaContext& ctx, const Tensor&, const Tensor&, const Tensor& dout, const Tensor& din,
                bool) override {
    const int64_t rows = dout.rows(), f = features_;
    std::vector<double> sums(static_cast<size_t>(f), 0.0);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < f; ++j) sums[static_cast<size_t>(j)] += dout.f32()[i * f + j];
    if (ctx.collectives) ctx.collectives->sum(sums.data(), sums.size(), DType::kF64);
    if (!din.defined()) return;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < f; ++j)
        din.f32()[i * f + j] =
            dout.f32()[i * f + j] - static_cast<float>(sums[static_cast<size_t>(j)] / total_rows_);
  }

 private:
  int64_t features_;
  std::vector<float> mean_;
  double total_rows_ = 0;
};

Model centred_mlp(uint64_t seed) {
  Model m(seed);
  // No bias before the centring (as a convolution before BatchNorm): its gradient would be zero but for rounding,
  // which Adam's normalised step would turn into a full step of noise.
  m.add(make_linear(12, 16, false));
  m.add(std::make_unique<CentreOverBatch>(16));
  m.add(make_activation(Activation::kTanh));
  m.add(make_linear(16, 16, true));
  m.add(make_activation(Activation::kRelu));
  m.add(make_linear(16, 5, true));
  return m;
}

struct Batch {
  Tensor x, y;
};

Batch make_batch(int64_t rows, uint64_t seed) {
  std::mt19937 gen(static_cast<uint32_t>(seed));
  std::normal_distribution<float> normal;
  Batch b{Tensor::empty(DType::kF32, Shape{rows, 12}, Device{}), Tensor::empty(DType::kI32, Shape{rows}, Device{})};
  for (int64_t i = 0; i < rows * 12; ++i) b.x.f32()[i] = normal(gen);
  for (int64_t i = 0; i < rows; ++i) b.y.i32()[i] = static_cast<int32_t>(gen() % 5);
  return b;
}

OptimizerConfig adam() {
  OptimizerConfig c;
  c.kind = OptimizerKind::kAdam;
  c.lr = 1e-2f;
  return c;
}

// One device, the full batch, no engine: the layer sees every row and no replica set.
std::vector<float> single_device(const Model& model, const std::vector<Batch>& data, int steps) {
  uint64_t rng_offset = 0;
  Fault fault = Fault::kNone;
  ReplicaContext ctx;
  ctx.rng_offset = &rng_offset;
  ctx.armed_fault = &fault;
  ctx.stream = &host_stream();
  ReplicaModel replica(model, ctx);
  Optimizer optimizer(adam(), 0, model.num_param_elements(), Device{});
  for (int s = 0; s < steps; ++s) {
    const Batch& b = data[static_cast<size_t>(s) % data.size()];
    Tensor out = replica.forward(ctx, b.x);
    Tensor dout = replica.output_grad_buffer(ctx);
    const int64_t rows = b.x.rows();
    kernels::cpu::cross_entropy_forward_backward(dout.f32(), out.f32(), b.y.i32(), rows, 5,
                                                 1.0f / static_cast<float>(rows));
    replica.backward(ctx, dout, false);
    optimizer.step(host_stream(), replica.params_for_writing(), replica.grads());
  }
  return std::vector<float>(replica.params(), replica.params() + model.num_param_elements());
}

// 10 rows over 8 devices are 2,2,2,2,2,0,0,0: three replicas have no rows and still take part in the layer's sums.
TEST(LayerCollectives, BatchStatisticsOverReplicasTrainAsOneDeviceOnTheFullBatch) {
  const Model model = centred_mlp(5);
  for (const auto& [devices, rows] : std::vector<std::pair<size_t, int64_t>>{{8, 10}, {3, 10}, {2, 31}}) {
    std::vector<Batch> data;
    for (int i = 0; i < 3; ++i) data.push_back(make_batch(rows, 40 + static_cast<uint64_t>(i)));
    const auto expected = single_device(model, data, 12);
    Engine engine(model, adam(), cpu_devices(devices));
    for (int s = 0; s < 12; ++s) engine.train_step(data[s % 3].x, data[s % 3].y);
    const auto got = engine.params(0);
    EXPECT_LT(max_relative_error(got, expected), 1e-4) << devices << " devices, " << rows << " rows";
    EXPECT_GT(max_relative_error(got, model.values()), 1e-2);  // training moved them: the comparison means something
    for (size_t r = 1; r < devices; ++r) EXPECT_EQ(engine.params(r), got) << "replica " << r;
    // Without the sums over replicas, each replica would centre over its own chunk: a different model.
  }
}

// forward(), backward() and step() run the layer on every replica as train_step() does.
TEST(LayerCollectives, ForwardBackwardStepRunEveryReplica) {
  const Model model = centred_mlp(6);
  const Batch b = make_batch(5, 77);  // 2,2,1,0 over 4 devices
  Engine fused(model, adam(), cpu_devices(4)), apart(model, adam(), cpu_devices(4));
  for (int s = 0; s < 3; ++s) {
    fused.train_step(b.x, b.y);
    const Tensor out = apart.forward(b.x);
    Tensor grad = Tensor::empty(DType::kF32, out.shape(), Device{});
    kernels::cpu::cross_entropy_forward_backward(grad.f32(), out.f32(), b.y.i32(), 5, 5, 1.0f / 5);
    apart.backward(grad);
    apart.step();
  }
  EXPECT_LT(max_relative_error(apart.params(0), fused.params(0)), 1e-5);
  for (size_t r = 1; r < 4; ++r) EXPECT_EQ(apart.params(r), apart.params(0));
}

// With buckets small enough that the last layers' gradients are reduced while backward is still in the earlier
// layers, the layer's backward sum is queued behind them on the communication thread: on every replica's
// communication track it starts after that step's first bucket has ended.
TEST(LayerCollectives, ALayerSumRunsAfterTheBucketsAlreadyInFlight) {
  EngineConfig config = cpu_devices(3);
  config.buckets.first_bucket_bytes = 64;
  config.buckets.bucket_cap_bytes = 64;
  Engine engine(centred_mlp(8), adam(), config);
  ASSERT_GE(engine.num_buckets(), 3u);
  const Batch b = make_batch(7, 9);
  engine.train_step(b.x, b.y);
  engine.trace_start();
  engine.train_step(b.x, b.y);
  const std::string path = ::testing::TempDir() + "dpar_layer_sum_trace.json";
  engine.trace_stop(path);
  std::ifstream in(path);
  const nlohmann::json trace = nlohmann::json::parse(in);
  std::remove(path.c_str());
  for (size_t r = 0; r < 3; ++r) {
    const int64_t comm_track = static_cast<int64_t>(2 + 2 * r);
    std::vector<std::pair<double, double>> buckets, sums;  // [start, end)
    for (const auto& e : trace.at("traceEvents")) {
      if (e.value("ph", "") != "X" || e.at("tid").get<int64_t>() != comm_track) continue;
      const double start = e.at("ts").get<double>(), end = start + e.at("dur").get<double>();
      if (e.at("name") == "bucket all-reduce") buckets.emplace_back(start, end);
      if (e.at("name") == "layer sum") sums.emplace_back(start, end);
    }
    ASSERT_EQ(sums.size(), 2u) << "replica " << r << ": one sum in forward, one in backward";
    ASSERT_FALSE(buckets.empty()) << "replica " << r;
    std::sort(buckets.begin(), buckets.end());
    std::sort(sums.begin(), sums.end());
    EXPECT_LT(sums[0].second, buckets.front().first) << "replica " << r << ": the forward sum precedes every bucket";
    EXPECT_GE(sums[1].first, buckets.front().second) << "replica " << r << ": backward's sum ran beside a bucket";
  }
}

}  // namespace
}  // namespace dpar

namespace dpar {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// The sharded optimizer on reduce-scatter (ZeRO-2): each replica receives only its block of every bucket, steps it,
// and the all-gather puts the blocks together.

Model mlp(uint64_t seed) {
  Model m(seed);
  m.add(make_linear(12, 40, true));
  m.add(make_activation(Activation::kRelu));
  m.add(make_linear(40, 24, true));
  m.add(make_activation(Activation::kTanh));
  m.add(make_linear(24, 5, true));
  return m;
}

EngineConfig small_buckets(size_t devices, GradientReduction reduction) {
  EngineConfig c = cpu_devices(devices);
  c.buckets.first_bucket_bytes = 512;  // several buckets, of sizes that do not divide evenly
  c.buckets.bucket_cap_bytes = 1500;
  c.reduction = reduction;
  return c;
}

OptimizerConfig sgd() {
  OptimizerConfig c;
  c.kind = OptimizerKind::kSgd;
  c.lr = 0.05f;
  c.momentum = 0.9f;
  return c;
}

// Without clipping nothing is computed from the gradient but the optimizer's element-wise step: the two reductions
// give the same bits, and so the same training.
TEST(ReduceScatterEngine, TrainsBitIdenticallyToTheAllReduce) {
  const Model model = mlp(11);
  std::vector<Batch> data;
  for (int i = 0; i < 3; ++i) data.push_back(make_batch(23, 300 + static_cast<uint64_t>(i)));
  for (size_t devices : {size_t{2}, size_t{3}, size_t{4}, size_t{8}}) {
    for (const OptimizerConfig& opt : {adam(), sgd()}) {
      Engine all(model, opt, small_buckets(devices, GradientReduction::kAllReduce));
      Engine scatter(model, opt, small_buckets(devices, GradientReduction::kReduceScatter));
      ASSERT_GE(scatter.num_buckets(), 3u);
      EXPECT_STREQ(scatter.bucket_strategy(), "reduce-scatter");
      for (int s = 0; s < 8; ++s) {
        const Batch& b = data[static_cast<size_t>(s) % 3];
        EXPECT_EQ(all.train_step(b.x, b.y), scatter.train_step(b.x, b.y)) << devices << " devices, step " << s;
      }
      const auto expected = all.params(0);
      for (size_t r = 0; r < devices; ++r) EXPECT_EQ(scatter.params(r), expected) << devices << " devices, replica " << r;
      EXPECT_EQ(scatter.replica_optimizer_state_bytes(), all.replica_optimizer_state_bytes());
    }
  }
}

// With clipping the norm comes from the shards: every replica computes the same bits, and training equals the
// all-reduce's up to the order of that one sum.
TEST(ReduceScatterEngine, ClippingNormFromTheShardsKeepsReplicasIdentical) {
  const Model model = mlp(12);
  std::vector<Batch> data;
  for (int i = 0; i < 3; ++i) data.push_back(make_batch(30, 400 + static_cast<uint64_t>(i)));
  OptimizerConfig opt = adam();
  opt.max_grad_norm = 0.2f;  // clips most steps
  for (size_t devices : {size_t{3}, size_t{4}}) {
    Engine all(model, opt, small_buckets(devices, GradientReduction::kAllReduce));
    Engine scatter(model, opt, small_buckets(devices, GradientReduction::kReduceScatter));
    for (int s = 0; s < 10; ++s) {
      const Batch& b = data[static_cast<size_t>(s) % 3];
      all.train_step(b.x, b.y);
      scatter.train_step(b.x, b.y);
      const auto norms = scatter.replica_grad_norms();
      for (float n : norms) EXPECT_EQ(n, norms[0]) << "step " << s;
      EXPECT_NEAR(scatter.grad_norm(), all.grad_norm(), 1e-6 * all.grad_norm()) << "step " << s;
    }
    EXPECT_GT(all.grad_norm(), 0.2f);  // clipping was on
    EXPECT_LT(max_relative_error(scatter.params(0), all.params(0)), 1e-4);
    for (size_t r = 1; r < devices; ++r) EXPECT_EQ(scatter.params(r), scatter.params(0)) << "replica " << r;
  }
}

// With one process the three reductions keep the same optimizer shards: switching between steps changes nothing,
// and a checkpoint of one loads into another.
TEST(ReduceScatterEngine, SwitchingBetweenStepsAndCheckpointsChangeNothing) {
  const Model model = mlp(13);
  std::vector<Batch> data;
  for (int i = 0; i < 3; ++i) data.push_back(make_batch(17, 500 + static_cast<uint64_t>(i)));
  Engine straight(model, adam(), small_buckets(3, GradientReduction::kAllReduce));
  Engine switching(model, adam(), small_buckets(3, GradientReduction::kAllReduce));
  const std::string path = ::testing::TempDir() + "dpar_reduce_scatter.safetensors";
  for (int s = 0; s < 9; ++s) {
    if (s == 3) switching.set_gradient_reduction(GradientReduction::kReduceScatter);
    if (s == 5) {
      switching.set_gradient_reduction(GradientReduction::kAllReduceWorldShards);
      EXPECT_EQ(switching.replica_optimizer_state_bytes(), straight.replica_optimizer_state_bytes());
    }
    if (s == 6) {
      switching.save(path);
      Engine loaded(model, adam(), small_buckets(3, GradientReduction::kReduceScatter));
      loaded.load(path);
      EXPECT_EQ(loaded.params(0), switching.params(0));
      switching.set_gradient_reduction(GradientReduction::kAllReduce);
    }
    const Batch& b = data[static_cast<size_t>(s) % 3];
    straight.train_step(b.x, b.y);
    switching.train_step(b.x, b.y);
  }
  std::remove(path.c_str());
  EXPECT_EQ(switching.params(0), straight.params(0));
  for (int32_t unknown : {3, 7, -1}) {
    try {
      switching.set_gradient_reduction(static_cast<GradientReduction>(unknown));
      ADD_FAILURE() << unknown << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::kInvalidArgument) << unknown;
      EXPECT_NE(std::string(e.what()).find(std::to_string(unknown)), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(switching.params(0), straight.params(0));
}

}  // namespace
}  // namespace dpar
