// The DataParallel engine against its references: torch.nn.DataParallel's split table, single-device full-batch
// training (a plain loop over one ReplicaModel, no engine, no communication), and itself (bit-identical replicas,
// checkpoint resume, gradient accumulation).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/error.h"
#include "backend/cpu/cpu_backend.h"
#include "comm/threads_comm.h"
#include "device/worker_pool.h"
#include "engine/engine.h"
#include "io/safetensors.h"
#include "kernels/cpu/kernels.h"
#include "engine_test_util.h"

namespace dpar {
namespace {

using test::cpu_devices;
using test::max_relative_error;
using test::Standalone;

// ---------------------------------------------------------------------------------------------------------------
// Helpers

Model make_mlp(uint64_t seed, int64_t in = 12, int64_t hidden = 16, int64_t out = 5,
               Activation act = Activation::kTanh) {
  Model m(seed);
  m.add(make_linear(in, hidden, true));
  m.add(make_activation(act));
  m.add(make_linear(hidden, hidden, true));
  m.add(make_activation(Activation::kRelu));
  m.add(make_linear(hidden, out, true));
  return m;
}

struct Batch {
  Tensor x, y;
};

Batch make_batch(int64_t rows, int64_t in, int64_t classes, uint64_t seed) {
  std::mt19937 gen(static_cast<uint32_t>(seed));
  std::normal_distribution<float> normal;
  Batch b{Tensor::empty(DType::kF32, Shape{rows, in}, Device{}), Tensor::empty(DType::kI32, Shape{rows}, Device{})};
  for (int64_t i = 0; i < rows * in; ++i) b.x.f32()[i] = normal(gen);
  for (int64_t i = 0; i < rows; ++i) b.y.i32()[i] = static_cast<int32_t>(gen() % classes);
  return b;
}

OptimizerConfig sgd_momentum() {
  OptimizerConfig c;
  c.kind = OptimizerKind::kSgd;
  c.lr = 0.05f;
  c.momentum = 0.9f;
  c.weight_decay = 1e-4f;
  return c;
}

OptimizerConfig adam() {
  OptimizerConfig c;
  c.kind = OptimizerKind::kAdam;
  c.lr = 1e-3f;
  return c;
}

// torch.nn.utils.clip_grad_norm_(params, max_norm), restated: total_norm = the L2 norm of every gradient
// element (summed here in long double, in index order: not the kernel's order), clip_coef = max_norm /
// (total_norm + 1e-6) in float, clamped to 1, gradients multiplied by it. Returns whether it scaled them.
bool reference_clip(float* grads, int64_t n, float max_norm) {
  long double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<long double>(grads[i]) * grads[i];
  const float total_norm = static_cast<float>(std::sqrt(sum));
  const float coef = max_norm / (total_norm + 1e-6f);
  if (coef >= 1.0f) return false;
  for (int64_t i = 0; i < n; ++i) grads[i] *= coef;
  return true;
}

// Single-device full-batch training, written without the engine: forward the whole batch, cross-entropy mean,
// backward, gradient clipping where the optimizer asks for it, optimizer step. `clipped` counts the steps whose
// gradient the clipping scaled.
std::vector<float> reference_training(const Model& model, const OptimizerConfig& opt, const std::vector<Batch>& data,
                                      int steps, int* clipped = nullptr) {
  Standalone single;
  const ReplicaContext& ctx = single.ctx;
  ReplicaModel replica(model, ctx);
  Optimizer optimizer(opt, 0, model.num_param_elements(), Device{});
  for (int s = 0; s < steps; ++s) {
    const Batch& b = data[static_cast<size_t>(s) % data.size()];
    Tensor out = replica.forward(ctx, b.x);
    Tensor dout = replica.output_grad_buffer(ctx);
    const int64_t rows = b.x.rows();
    kernels::cpu::cross_entropy_forward_backward(dout.f32(), out.f32(), b.y.i32(), rows, out.shape()[1],
                                                 1.0f / static_cast<float>(rows));
    replica.backward(ctx, dout, false);
    if (opt.max_grad_norm > 0.0f && reference_clip(replica.grads(), model.num_param_elements(), opt.max_grad_norm) &&
        clipped)
      ++*clipped;
    optimizer.step(*single.stream, replica.params_for_writing(), replica.grads());
  }
  return std::vector<float>(replica.params(), replica.params() + model.num_param_elements());
}

uint64_t fnv1a(const std::vector<float>& v) {
  uint64_t h = 1469598103934665603ull;
  const auto* p = reinterpret_cast<const unsigned char*>(v.data());
  for (size_t i = 0; i < v.size() * sizeof(float); ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// ---------------------------------------------------------------------------------------------------------------
// Scatter

TEST(Split, MatchesTorchDataParallel) {
  // torch.nn.DataParallel scatters with chunk = ceil(B / n); trailing devices may get nothing.
  struct Case {
    int64_t batch;
    size_t devices;
    std::vector<int64_t> rows;
  };
  const std::vector<Case> table = {
      {30, 3, {10, 10, 10}},
      {30, 8, {4, 4, 4, 4, 4, 4, 4, 2}},
      {10, 8, {2, 2, 2, 2, 2, 0, 0, 0}},
      {10, 3, {4, 4, 2}},
      {30, 1, {30}},
      {30, 2, {15, 15}},
      {1, 4, {1, 0, 0, 0}},
      {7, 7, {1, 1, 1, 1, 1, 1, 1}},
      {9, 4, {3, 3, 3, 0}},  // ceil(9/4) = 3: three devices suffice
      {100, 8, {13, 13, 13, 13, 13, 13, 13, 9}},
  };
  for (const Case& c : table) EXPECT_EQ(split_batch(c.batch, c.devices), c.rows) << c.batch << " over " << c.devices;
}

// ---------------------------------------------------------------------------------------------------------------
// Equivalence with single-device full-batch training

struct EquivalenceCase {
  size_t devices;
  int64_t batch;
  bool adam;
};

void PrintTo(const EquivalenceCase& c, std::ostream* os) {
  *os << (c.adam ? "adam" : "sgd") << ", " << c.devices << " devices, batch " << c.batch;
}

class Equivalence : public ::testing::TestWithParam<EquivalenceCase> {};

TEST_P(Equivalence, TwentyStepsMatchSingleDeviceFullBatch) {
  const auto p = GetParam();
  const Model model = make_mlp(7);
  const OptimizerConfig opt = p.adam ? adam() : sgd_momentum();
  std::vector<Batch> data;
  for (int i = 0; i < 4; ++i) data.push_back(make_batch(p.batch, 12, 5, 100 + i));
  const int steps = 20;
  const auto expected = reference_training(model, opt, data, steps);

  Engine engine(model, opt, cpu_devices(p.devices));
  for (int s = 0; s < steps; ++s) {
    const Batch& b = data[s % data.size()];
    engine.train_step(b.x, b.y);
  }
  const auto got = engine.params(0);
  EXPECT_LT(max_relative_error(got, expected), 1e-5) << p.devices << " devices, batch " << p.batch;
  // And training moved the parameters well beyond that tolerance, so the comparison means something.
  EXPECT_GT(max_relative_error(got, model.values()), 1e-2);
  for (size_t r = 1; r < engine.num_replicas(); ++r) EXPECT_EQ(engine.params(r), got) << "replica " << r;
}

INSTANTIATE_TEST_SUITE_P(
    DevicesAndBatches, Equivalence,
    ::testing::Values(EquivalenceCase{1, 30, false}, EquivalenceCase{2, 30, false}, EquivalenceCase{3, 30, false},
                      EquivalenceCase{4, 30, false}, EquivalenceCase{8, 30, false}, EquivalenceCase{8, 10, false},
                      EquivalenceCase{3, 10, false}, EquivalenceCase{4, 9, false}, EquivalenceCase{1, 30, true},
                      EquivalenceCase{2, 30, true}, EquivalenceCase{3, 30, true}, EquivalenceCase{4, 30, true},
                      EquivalenceCase{8, 30, true}, EquivalenceCase{8, 10, true}, EquivalenceCase{3, 10, true},
                      EquivalenceCase{4, 9, true},
                      // 565 parameters in shards of 16: the last 4 of 40 replicas hold no shard and step nothing.
                      EquivalenceCase{40, 60, false}, EquivalenceCase{40, 60, true}),
    [](const auto& info) {
      return std::string(info.param.adam ? "adam_" : "sgd_") + std::to_string(info.param.devices) + "dev_batch" +
             std::to_string(info.param.batch);
    });

// Gradient clipping acts on the summed gradient, as clip_grad_norm_ after DDP's backward: N devices still train as
// one device on the full batch, whether the norm is clipped on every step, on some, or on none.
TEST(Engine, GradientClippingOverDevicesMatchesSingleDeviceFullBatch) {
  const Model model = make_mlp(13);
  std::vector<Batch> data;
  for (int i = 0; i < 4; ++i) data.push_back(make_batch(30, 12, 5, 700 + i));
  const int steps = 20;
  for (OptimizerConfig opt : {sgd_momentum(), adam()}) {
    const auto unclipped = reference_training(model, opt, data, steps);
    // The norms of these gradients lie between 0.24 and 0.39: 0.05 clips every step, 0.3 some, 1e3 none.
    for (float max_norm : {0.05f, 0.3f, 1e3f}) {
      opt.max_grad_norm = max_norm;
      int clipped = 0;
      const auto expected = reference_training(model, opt, data, steps, &clipped);
      SCOPED_TRACE(std::string(opt.name()) + ", max_grad_norm " + std::to_string(max_norm) + ", clipped " +
                   std::to_string(clipped) + " of " + std::to_string(steps) + " steps");
      if (max_norm == 0.05f) EXPECT_EQ(clipped, steps);
      if (max_norm == 0.3f) {
        EXPECT_GT(clipped, 0);
        EXPECT_LT(clipped, steps);
      }
      if (max_norm == 1e3f) EXPECT_EQ(clipped, 0);
      // Clipping changed the training wherever it scaled a gradient.
      if (clipped > 0) EXPECT_GT(max_relative_error(expected, unclipped), 1e-4);
      for (size_t devices : {1, 2, 3, 8}) {
        Engine engine(model, opt, cpu_devices(devices));
        for (int s = 0; s < steps; ++s) engine.train_step(data[s % 4].x, data[s % 4].y);
        const auto got = engine.params(0);
        EXPECT_LT(max_relative_error(got, expected), 1e-5) << devices << " devices";
        for (size_t r = 1; r < engine.num_replicas(); ++r) EXPECT_EQ(engine.params(r), got) << "replica " << r;
        // Each replica scales its own shard by the coefficient of its own norm: the norms must be the same bits
        // (the all-gather above would hide a difference of an ulp).
        const auto norms = engine.replica_grad_norms();
        for (size_t r = 0; r < norms.size(); ++r) {
          EXPECT_TRUE(std::isfinite(norms[r]) && norms[r] > 0.0f) << "replica " << r << ": " << norms[r];
          EXPECT_EQ(std::memcmp(&norms[r], &norms[0], sizeof(float)), 0) << "replica " << r << "'s norm";
        }
        EXPECT_EQ(engine.grad_norm(), norms[0]);
      }
    }
  }
  OptimizerConfig bad = adam();
  for (float v : {-1.0f, std::nanf(""), INFINITY}) {
    bad.max_grad_norm = v;
    try {
      Engine engine(model, bad, cpu_devices(2));
      ADD_FAILURE() << "max_grad_norm " << v << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("optimizer.max_grad_norm"), std::string::npos) << e.what();
    }
  }
}

// Buckets change when gradients move, not what they sum to: every element is still reduced in rank order, so
// any bucket layout gives the very same bits as one all-reduce after backward, on every device count.
TEST(Buckets, AnyBucketLayoutTrainsBitIdenticallyToOneAllReduce) {
  const Model model = make_mlp(11, 12, 40, 5);
  std::vector<Batch> data;
  for (int i = 0; i < 3; ++i) data.push_back(make_batch(30, 12, 5, 300 + i));
  for (size_t devices : {1, 2, 3, 8}) {
    auto train = [&](size_t first, size_t cap, size_t expected_buckets) {
      EngineConfig config = cpu_devices(devices);
      config.buckets.first_bucket_bytes = first;
      config.buckets.bucket_cap_bytes = cap;
      Engine engine(model, adam(), config);
      EXPECT_EQ(engine.num_buckets(), expected_buckets);
      for (int s = 0; s < 12; ++s) engine.train_step(data[s % 3].x, data[s % 3].y);
      for (size_t r = 1; r < engine.num_replicas(); ++r) EXPECT_EQ(engine.params(r), engine.params(0));
      return engine.params(0);
    };
    const auto one = train(SIZE_MAX, SIZE_MAX, 1);
    EXPECT_EQ(train(1, 1, 6), one) << devices << " devices, a bucket per parameter";
    EXPECT_EQ(train((5 + 40 * 5) * 4, SIZE_MAX, 2), one) << devices << " devices, the last layer, then the rest";
    EXPECT_EQ(train(1 << 20, 25 << 20, 1), one) << devices << " devices, the defaults";
  }
}

// A replica given no rows (10 over 8 leaves three idle) produces no gradient for any bucket: it is left out of
// every bucket's sum, with as many buckets as parameters.
TEST(Buckets, IdleReplicasContributeNothingToAnyBucket) {
  const Model model = make_mlp(5);
  std::vector<Batch> data;
  for (int i = 0; i < 4; ++i) data.push_back(make_batch(10, 12, 5, 500 + i));
  const auto expected = reference_training(model, sgd_momentum(), data, 20);
  EngineConfig config = cpu_devices(8);
  config.buckets.first_bucket_bytes = config.buckets.bucket_cap_bytes = 1;
  Engine engine(model, sgd_momentum(), config);
  for (int s = 0; s < 20; ++s) engine.train_step(data[s % 4].x, data[s % 4].y);
  EXPECT_LT(max_relative_error(engine.params(0), expected), 1e-5);
}

TEST(Engine, MseLossMatchesReference) {
  // An MSE regression over 3 devices with an uneven split equals full-batch training with PyTorch's mean MSE.
  Model model(3);
  model.add(make_linear(6, 8, true));
  model.add(make_activation(Activation::kGelu));
  model.add(make_linear(8, 3, true));
  const int64_t rows = 11;
  std::mt19937 gen(5);
  std::normal_distribution<float> normal;
  Tensor x = Tensor::empty(DType::kF32, Shape{rows, 6}, Device{});
  Tensor y = Tensor::empty(DType::kF32, Shape{rows, 3}, Device{});
  for (int64_t i = 0; i < x.numel(); ++i) x.f32()[i] = normal(gen);
  for (int64_t i = 0; i < y.numel(); ++i) y.f32()[i] = normal(gen);

  Standalone single;
  const ReplicaContext& ctx = single.ctx;
  ReplicaModel ref(model, ctx);
  Optimizer ref_opt(sgd_momentum(), 0, model.num_param_elements(), Device{});
  EngineConfig config = cpu_devices(3);
  config.loss = LossKind::kMse;
  Engine engine(model, sgd_momentum(), config);
  for (int s = 0; s < 15; ++s) {
    Tensor out = ref.forward(ctx, x);
    Tensor dout = ref.output_grad_buffer(ctx);
    const double ref_loss =
        kernels::cpu::mse_forward_backward(dout.f32(), out.f32(), y.f32(), rows, 3, 1.0f / rows) / rows;
    ref.backward(ctx, dout, false);
    ref_opt.step(*single.stream, ref.params_for_writing(), ref.grads());
    const double loss = engine.train_step(x, y);
    EXPECT_NEAR(loss, ref_loss, 1e-5 * std::abs(ref_loss)) << "step " << s;
  }
  EXPECT_LT(max_relative_error(engine.params(0), std::vector<float>(ref.params(), ref.params() + model.num_param_elements())),
            1e-5);
}

// ---------------------------------------------------------------------------------------------------------------
// Replicas stay identical; state in a replica persists

TEST(Engine, ReplicasBitIdenticalAfterManySteps) {
  Model model = make_mlp(11, 12, 32, 5, Activation::kGelu);
  Engine engine(model, adam(), cpu_devices(8));
  for (int s = 0; s < 100; ++s) {
    Batch b = make_batch(30 + s % 7, 12, 5, s);  // even and uneven splits
    engine.train_step(b.x, b.y);
  }
  const uint64_t h0 = fnv1a(engine.params(0));
  for (size_t r = 1; r < 8; ++r) EXPECT_EQ(fnv1a(engine.params(r)), h0) << "replica " << r;
  EXPECT_EQ(engine.step_count(), 100);
}

// A linear layer and the ReLU after it run fused (one pass for the bias and the ReLU, one for the mask and the bias
// gradient). A dropout of p = 0 between them is an exact identity that prevents the fusion: the two models must
// train to the same bits, through train_step (the loss's gradient in the model's own buffer, ReLUs fused twice in a
// row) and through forward/backward/step (the caller's gradient in memory of its own).
TEST(Engine, ALinearFusedWithItsReluTrainsAsTheTwoApart) {
  auto build = [](bool apart) {
    Model m(21);
    m.add(make_linear(12, 32, true));
    if (apart) m.add(make_dropout(0.0f));
    m.add(make_activation(Activation::kRelu));
    m.add(make_linear(32, 24, false));
    if (apart) m.add(make_dropout(0.0f));
    m.add(make_activation(Activation::kRelu));
    m.add(make_linear(24, 5, true));
    m.add(make_activation(Activation::kRelu));  // a model may end with a fused pair
    return m;
  };
  Engine fused(build(false), adam(), cpu_devices(3)), apart(build(true), adam(), cpu_devices(3));
  for (int s = 0; s < 12; ++s) {
    const Batch b = make_batch(20 + s % 5, 12, 5, 300 + s);
    EXPECT_EQ(fused.train_step(b.x, b.y), apart.train_step(b.x, b.y)) << "loss at step " << s;
  }
  const Batch b = make_batch(17, 12, 5, 400);
  Tensor grad = Tensor::empty(DType::kF32, Shape{17, 5}, Device{});
  for (int64_t i = 0; i < grad.numel(); ++i) grad.f32()[i] = static_cast<float>(i % 7) - 3.0f;
  for (Engine* e : {&fused, &apart}) {
    e->forward(b.x);
    e->backward(grad);
    e->step();
  }
  for (size_t r = 0; r < 3; ++r) EXPECT_EQ(fnv1a(fused.params(r)), fnv1a(apart.params(r))) << "replica " << r;
}

TEST(Engine, DropoutStreamsPersistAcrossStepsAndDifferPerReplica) {
  Model model(1);
  model.add(make_linear(4, 64, true));
  model.add(make_dropout(0.5f));
  EngineConfig config = cpu_devices(2);
  config.seed = 42;
  Engine engine(model, sgd_momentum(), config);
  Tensor x = Tensor::empty(DType::kF32, Shape{2, 4}, Device{});
  for (int i = 0; i < 8; ++i) x.f32()[i] = 1.0f;  // both rows identical: only the masks tell them apart
  Tensor a = engine.forward(x);
  engine.zero_grad();
  Tensor b = engine.forward(x);
  engine.zero_grad();
  auto row = [](const Tensor& t, int r) { return std::vector<float>(t.f32() + r * 64, t.f32() + (r + 1) * 64); };
  // Replica 0 and replica 1 (rows 0 and 1) use different streams; each stream moves on between forwards.
  EXPECT_NE(row(a, 0), row(a, 1));
  EXPECT_NE(row(a, 0), row(b, 0));
  EXPECT_NE(row(a, 1), row(b, 1));
  // Eval mode turns dropout off: rows equal again.
  engine.set_training(false);
  Tensor c = engine.forward(x);
  EXPECT_EQ(row(c, 0), row(c, 1));
}

// ---------------------------------------------------------------------------------------------------------------
// DataParallel's forward / backward, per-device losses, gradient accumulation

TEST(Engine, ForwardGathersInBatchOrder) {
  Model model = make_mlp(2);
  Engine one(model, sgd_momentum(), cpu_devices(1));
  Engine many(model, sgd_momentum(), cpu_devices(3));
  Batch b = make_batch(10, 12, 5, 3);
  Tensor y1 = one.forward(b.x);
  Tensor y3 = many.forward(b.x);
  ASSERT_EQ(y3.shape(), (Shape{10, 5}));
  for (int64_t i = 0; i < y1.numel(); ++i) EXPECT_NEAR(y3.f32()[i], y1.f32()[i], 1e-6f) << i;
}

TEST(Engine, ForwardBackwardStepEqualsFusedTrainStep) {
  // DataParallel's own semantics: output gathered, loss gradient computed by the caller, backward scattered.
  Model model = make_mlp(4);
  Engine fused(model, sgd_momentum(), cpu_devices(3));
  Engine split(model, sgd_momentum(), cpu_devices(3));
  for (int s = 0; s < 5; ++s) {
    Batch b = make_batch(10, 12, 5, 50 + s);
    fused.train_step(b.x, b.y);
    Tensor out = split.forward(b.x);
    Tensor dout = Tensor::empty(DType::kF32, out.shape(), Device{});
    kernels::cpu::cross_entropy_forward_backward(dout.f32(), out.f32(), b.y.i32(), 10, 5, 1.0f / 10);
    split.backward(dout);
    split.step();
  }
  EXPECT_LT(max_relative_error(split.params(0), fused.params(0)), 1e-5);
}

TEST(Engine, ReplicaLossesAreChunkMeans) {
  Model model = make_mlp(5);
  Engine engine(model, sgd_momentum(), cpu_devices(8));
  Batch b = make_batch(10, 12, 5, 9);
  Tensor out = engine.forward(b.x);  // parameters before the step
  engine.zero_grad();
  const double loss = engine.train_step(b.x, b.y);
  const auto losses = engine.replica_losses();
  ASSERT_EQ(losses.size(), 8u);
  double weighted = 0;
  for (int r = 0; r < 5; ++r) {
    const double chunk = kernels::cpu::cross_entropy_forward_backward(nullptr, out.f32() + r * 2 * 5,
                                                                      b.y.i32() + r * 2, 2, 5, 1.0f) / 2;
    EXPECT_NEAR(losses[r], chunk, 1e-5) << "replica " << r;
    weighted += chunk * 2;
  }
  for (int r = 5; r < 8; ++r) EXPECT_TRUE(std::isnan(losses[r])) << "replica " << r << " got no rows";
  EXPECT_NEAR(loss, weighted / 10, 1e-5);
}

TEST(Engine, AccumulationEqualsOneLargeBatch) {
  // Micro-batches of 7, 13 and 10 rows with one synchronisation equal one step on all 30 rows.
  Model model = make_mlp(6);
  Batch big = make_batch(30, 12, 5, 77);
  Engine reference(model, adam(), cpu_devices(4));
  Engine accumulated(model, adam(), cpu_devices(4));
  for (int s = 0; s < 3; ++s) {
    reference.train_step(big.x, big.y);
    int64_t begin = 0;
    for (int64_t rows : {7, 13, 10}) {
      accumulated.accumulate(big.x.rows(begin, rows), big.y.rows(begin, rows));
      begin += rows;
    }
    accumulated.step();
  }
  EXPECT_LT(max_relative_error(accumulated.params(0), reference.params(0)), 1e-5);
  EXPECT_EQ(accumulated.step_count(), 3);
}

// accumulate() over micro-batches and one step() apply the gradient of the mean loss over all their rows: the
// same update as train_step() on those rows at once, and as one device on them without any engine. Plain SGD,
// whose update is proportional to the gradient (Adam's would hide a gradient of the wrong scale), with clipping
// off and on (clipping every step). The micro-batches change from step to step so that replicas get rows in one
// step and none in the next, none in some micro-batches of a step, or none in a whole step (micro-batches with
// fewer rows than devices): whatever they held from earlier must not reach the step.
TEST(Engine, AccumulateAndStepEqualTrainStepOnTheWholeBatch) {
  const Model model = make_mlp(17);
  OptimizerConfig sgd;
  sgd.kind = OptimizerKind::kSgd;
  sgd.lr = 0.1f;
  // Each step's micro-batches; every step has 12 rows.
  const std::vector<std::vector<int64_t>> micro = {{12}, {1, 2, 9}, {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1},
                                                   {5, 1, 6}, {12}, {2, 2, 2, 2, 2, 2}};
  std::vector<Batch> data;
  for (size_t s = 0; s < micro.size(); ++s) data.push_back(make_batch(12, 12, 5, 900 + s));
  const int steps = static_cast<int>(micro.size());
  const auto unclipped = reference_training(model, sgd, data, steps);
  // The norms of these gradients are above 0.2: 0.05 clips every step.
  for (float max_norm : {0.0f, 0.05f}) {
    OptimizerConfig opt = sgd;
    opt.max_grad_norm = max_norm;
    int clipped = 0;
    const auto expected = reference_training(model, opt, data, steps, &clipped);
    if (max_norm > 0.0f) {
      EXPECT_EQ(clipped, steps);
      EXPECT_GT(max_relative_error(expected, unclipped), 1e-3) << "clipping must change the training";
    }
    for (size_t devices : {1, 3, 4}) {
      SCOPED_TRACE(std::to_string(devices) + " devices, max_grad_norm " + std::to_string(max_norm));
      Engine fused(model, opt, cpu_devices(devices));
      Engine accumulated(model, opt, cpu_devices(devices));
      for (int s = 0; s < steps; ++s) {
        const Batch& b = data[static_cast<size_t>(s)];
        fused.train_step(b.x, b.y);
        int64_t begin = 0;
        for (int64_t rows : micro[static_cast<size_t>(s)]) {
          accumulated.accumulate(b.x.rows(begin, rows), b.y.rows(begin, rows));
          begin += rows;
        }
        accumulated.step();
      }
      const auto got = accumulated.params(0);
      EXPECT_LT(max_relative_error(got, fused.params(0)), 1e-5) << "against train_step";
      EXPECT_LT(max_relative_error(got, expected), 1e-5) << "against one device without the engine";
      EXPECT_GT(max_relative_error(got, model.values()), 1e-2) << "training barely moved the parameters";
      for (size_t r = 1; r < accumulated.num_replicas(); ++r) EXPECT_EQ(accumulated.params(r), got) << r;
      if (max_norm > 0.0f) EXPECT_GT(accumulated.grad_norm(), max_norm) << "the last step's norm was not clipped";
    }
  }
}

// Gradient compression acts between processes only (within one they share memory and sum in f32): an engine of
// one process trains to the same bits with it as without it, on any device count.
TEST(Engine, CompressionChangesNothingInOneProcess) {
  const Model model = make_mlp(19);
  OptimizerConfig opt;
  opt.kind = OptimizerKind::kSgd;
  opt.lr = 0.1f;
  std::vector<Batch> data;
  for (int i = 0; i < 3; ++i) data.push_back(make_batch(10, 12, 5, 40 + i));
  for (size_t devices : {1, 2, 3}) {
    Engine plain(model, opt, cpu_devices(devices));
    Engine compressed(model, opt, cpu_devices(devices));
    compressed.set_gradient_compression(GradientCompression::kBf16);
    for (int s = 0; s < 6; ++s) {
      const Batch& b = data[static_cast<size_t>(s) % data.size()];
      plain.train_step(b.x, b.y);
      compressed.train_step(b.x, b.y);
    }
    // The accumulate path too.
    for (Engine* e : {&plain, &compressed}) {
      e->accumulate(data[0].x.rows(0, 3), data[0].y.rows(0, 3));
      e->accumulate(data[1].x, data[1].y);
      e->step();
    }
    EXPECT_EQ(compressed.params(0), plain.params(0)) << devices << " devices";
  }
}

// The optimizer's shards must cover every parameter whatever its count. Shards are rounded to 16 elements, which
// hides a shard size rounded down for most counts: counts just above a multiple of devices x 16 are where it
// shows (a last element that no shard steps). Each such model trains as one device on the full batch, and
// together the replicas hold one full optimizer state.
TEST(Engine, OptimizerShardsCoverParameterCountsJustAboveAMultiple) {
  struct Case {
    size_t devices;
    int64_t in, out;  // a linear layer of out x (in + 1) parameters
  };
  // 33 = 2x16 + 1, 49 = 3x16 + 1, 65 = 4x16 + 1, 81 = 5x16 + 1, 130 = 4x32 + 2.
  for (const Case c : {Case{2, 10, 3}, Case{3, 6, 7}, Case{4, 12, 5}, Case{5, 8, 9}, Case{4, 12, 10}}) {
    Model model(3);
    model.add(make_linear(c.in, c.out, true));
    const auto elements = static_cast<size_t>(model.num_param_elements());
    ASSERT_TRUE(elements % (c.devices * 16) == 1 || elements % (c.devices * 16) == 2) << elements;
    std::vector<Batch> data;
    for (int i = 0; i < 3; ++i) data.push_back(make_batch(12, c.in, c.out, 60 + i));
    for (const OptimizerConfig& opt : {sgd_momentum(), adam()}) {
      SCOPED_TRACE(std::to_string(c.devices) + " devices, " + std::to_string(elements) + " parameters, " +
                   opt.name());
      const auto expected = reference_training(model, opt, data, 6);
      Engine engine(model, opt, cpu_devices(c.devices));
      for (int s = 0; s < 6; ++s) engine.train_step(data[s % 3].x, data[s % 3].y);
      const auto got = engine.params(0);
      EXPECT_LT(max_relative_error(got, expected), 1e-5);
      // Every parameter moved, the last ones included.
      for (size_t i = 0; i < elements; ++i) EXPECT_NE(got[i], model.values()[i]) << "parameter " << i;
      size_t total = 0;
      for (size_t b : engine.replica_optimizer_state_bytes()) total += b;
      EXPECT_EQ(total, (opt.kind == OptimizerKind::kAdam ? 2 : 1) * sizeof(float) * elements);
    }
  }
}

TEST(Engine, LearningRateChangesBetweenSteps) {
  Model model = make_mlp(8);
  Batch b = make_batch(12, 12, 5, 1);
  Engine frozen(model, sgd_momentum(), cpu_devices(2));
  frozen.set_lr(0.0f);
  frozen.train_step(b.x, b.y);
  EXPECT_EQ(frozen.params(0), model.values());  // lr 0: nothing moves (weight decay goes through lr too)
  frozen.set_lr(0.05f);
  frozen.train_step(b.x, b.y);
  EXPECT_NE(frozen.params(0), model.values());
}

// ---------------------------------------------------------------------------------------------------------------
// Checkpoints

std::string temp_path(const std::string& name) {
  return (::testing::TempDir().empty() ? std::string("/tmp/") : ::testing::TempDir()) + name;
}

TEST(Checkpoint, ResumeIsBitIdenticalToTrainingStraight) {
  for (const OptimizerConfig& opt : {sgd_momentum(), adam()}) {
    Model model(21);
    model.add(make_linear(12, 16, true));
    model.add(make_dropout(0.2f));  // the RNG streams must resume too
    model.add(make_activation(Activation::kRelu));
    model.add(make_linear(16, 5, true));
    std::vector<Batch> data;
    for (int i = 0; i < 20; ++i) data.push_back(make_batch(30, 12, 5, 300 + i));
    EngineConfig config = cpu_devices(3);
    config.seed = 9;

    Engine straight(model, opt, config);
    for (int s = 0; s < 20; ++s) straight.train_step(data[s].x, data[s].y);

    const std::string path = temp_path("dpar_resume.safetensors");
    {
      Engine first(model, opt, config);
      for (int s = 0; s < 10; ++s) first.train_step(data[s].x, data[s].y);
      first.save(path);
    }
    Engine resumed(model, opt, config);
    resumed.load(path);
    EXPECT_EQ(resumed.step_count(), 10);
    for (int s = 10; s < 20; ++s) resumed.train_step(data[s].x, data[s].y);
    EXPECT_EQ(fnv1a(resumed.params(0)), fnv1a(straight.params(0))) << opt.name();
    EXPECT_EQ(resumed.params(2), straight.params(2)) << opt.name();
    std::remove(path.c_str());
  }
}

// Each replica holds the optimizer's state for its own shard only: together, one full state.
TEST(Engine, EachReplicaHoldsOnlyItsShardOfTheOptimizerState) {
  const Model model = make_mlp(5);
  const size_t elements = static_cast<size_t>(model.num_param_elements());
  for (size_t devices : {1, 3, 8}) {
    Engine engine(model, adam(), cpu_devices(devices));
    const auto bytes = engine.replica_optimizer_state_bytes();
    ASSERT_EQ(bytes.size(), devices);
    size_t total = 0;
    for (size_t b : bytes) {
      total += b;
      // exp_avg and exp_avg_sq for at most one shard: the parameters split n ways, rounded up to 16 elements.
      EXPECT_LE(b, 2 * sizeof(float) * (((elements + devices - 1) / devices + 15) / 16 * 16)) << devices;
    }
    EXPECT_EQ(total, 2 * sizeof(float) * elements) << devices << " devices";
  }
  // SGD without momentum keeps no state at all.
  Engine plain(model, OptimizerConfig{}, cpu_devices(2));
  for (size_t b : plain.replica_optimizer_state_bytes()) EXPECT_EQ(b, 0u);
}

// A checkpoint written by one sharding of the optimizer state and loaded into another (replicas whose shards are
// empty included) carries the same state: written again, every tensor has the same bytes; and training on from it
// is training on from the source, up to the rounding of another replica count.
TEST(Checkpoint, OptimizerStateMovesBetweenShardings) {
  const Model model = make_mlp(41);
  const std::string first = temp_path("dpar_shards_3.safetensors"), second = temp_path("dpar_shards_n.safetensors");
  std::vector<Batch> data;
  for (int s = 0; s < 6; ++s) data.push_back(make_batch(48, 12, 5, 70 + s));
  for (const OptimizerConfig& opt : {sgd_momentum(), adam()}) {
    Engine source(model, opt, cpu_devices(3));
    for (int s = 0; s < 3; ++s) source.train_step(data[s].x, data[s].y);
    source.save(first);
    const std::vector<float> saved_params = source.params(0);
    for (int s = 3; s < 6; ++s) source.train_step(data[s].x, data[s].y);
    const io::SafetensorsFile saved = io::SafetensorsFile::parse(first, io::SafetensorsFile::read_bytes(first));
    for (size_t devices : {1, 2, 8, 40}) {
      Engine target(model, opt, cpu_devices(devices));
      target.load(first);
      target.save(second);
      const io::SafetensorsFile again = io::SafetensorsFile::parse(second, io::SafetensorsFile::read_bytes(second));
      ASSERT_EQ(again.names(), saved.names());
      for (const std::string& name : saved.names()) {
        if (name.rfind("optimizer.", 0) != 0) continue;
        ASSERT_EQ(again.entry(name).bytes, saved.entry(name).bytes) << name;
        EXPECT_EQ(std::memcmp(again.data(name), saved.data(name), saved.entry(name).bytes), 0)
            << opt.name() << ", " << devices << " devices: " << name;
      }
      for (int s = 3; s < 6; ++s) target.train_step(data[s].x, data[s].y);
      EXPECT_LT(max_relative_error(target.params(0), source.params(0)), 1e-5) << opt.name() << ", " << devices;
      EXPECT_GT(max_relative_error(target.params(0), saved_params), 1e-3) << "the steps after loading moved nothing";
    }
  }
  std::remove(first.c_str());
  std::remove(second.c_str());
}

TEST(Checkpoint, CorruptOrTruncatedFileIsRefusedAndChangesNothing) {
  Model model = make_mlp(31);
  Engine engine(model, adam(), cpu_devices(2));
  Batch b = make_batch(8, 12, 5, 2);
  engine.train_step(b.x, b.y);
  const std::string path = temp_path("dpar_corrupt.safetensors");
  engine.save(path);
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(bytes.size(), 100u);

  Engine target(model, adam(), cpu_devices(2));
  const auto before = target.params(0);
  auto expect_refused = [&](const std::string& content, const std::string& what) {
    const std::string bad = temp_path("dpar_bad.safetensors");
    std::ofstream(bad, std::ios::binary | std::ios::trunc).write(content.data(), std::streamsize(content.size()));
    try {
      target.load(bad);
      ADD_FAILURE() << what << ": was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::kCorrupt) << what << ": " << e.what();
    }
    EXPECT_EQ(target.params(0), before) << what << ": parameters changed";
    std::remove(bad.c_str());
  };
  for (size_t len : {size_t(0), size_t(4), size_t(8), size_t(20), bytes.size() / 2, bytes.size() - 1})
    expect_refused(bytes.substr(0, len), "truncated to " + std::to_string(len));
  for (size_t at : {size_t(3), size_t(12), bytes.size() - 5}) {
    std::string flipped = bytes;
    flipped[at] = static_cast<char>(flipped[at] ^ 0x5a);
    expect_refused(flipped, "byte " + std::to_string(at) + " flipped");
  }
  // A checkpoint of another model is a mismatch, not corruption.
  Engine other(make_mlp(31, 12, 8, 5), adam(), cpu_devices(2));
  try {
    other.load(path);
    ADD_FAILURE() << "another model's checkpoint was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kMismatch) << e.what();
  }
  // The engine still works after the refusals.
  target.load(path);
  EXPECT_EQ(target.params(0), engine.params(0));
  std::remove(path.c_str());
}

// ---------------------------------------------------------------------------------------------------------------
// The trace

// A trace file's spans, by track.
struct TraceSpans {
  std::map<int, std::vector<nlohmann::json>> by_track;
  std::map<int, std::string> track_names;
  int64_t dropped = -1;

  explicit TraceSpans(const std::string& path) : TraceSpans(std::ifstream(path)) {}
  // The spans of a trace's text (Trace::chrome_json).
  explicit TraceSpans(std::istream&& in) {
    const nlohmann::json file = nlohmann::json::parse(in);
    dropped = file.at("otherData").at("dropped_events").get<int64_t>();
    for (const auto& e : file.at("traceEvents")) {
      const int tid = e.at("tid").get<int>();
      if (e.at("ph") == "M" && e.at("name") == "thread_name") track_names[tid] = e.at("args").at("name");
      if (e.at("ph") == "X") by_track[tid].push_back(e);
    }
  }
  size_t count(int track, const std::string& name) const {
    if (!by_track.count(track)) return 0;
    size_t n = 0;
    for (const auto& e : by_track.at(track)) n += e.at("name") == name;
    return n;
  }
};

TEST(Trace, EachReplicasWorkIsOnItsOwnTracksNestedInTheCalls) {
  const Model model = make_mlp(3);
  EngineConfig config = cpu_devices(2);
  config.buckets.first_bucket_bytes = 256;  // several buckets: all but the last go to the communication threads
  config.buckets.bucket_cap_bytes = 256;
  Engine engine(model, adam(), config);
  const size_t buckets = engine.num_buckets();
  ASSERT_GE(buckets, 3u);
  const Batch b = make_batch(16, 12, 5, 4);
  engine.train_step(b.x, b.y);  // before the trace: not in it
  engine.trace_start();
  for (int s = 0; s < 3; ++s) engine.train_step(b.x, b.y);
  engine.trace_stop("");        // stops without writing
  engine.train_step(b.x, b.y);  // after the stop: not in it either
  const std::string path = temp_path("dpar_trace.json");
  engine.trace_stop(path);      // what was recorded stays until the next start

  const TraceSpans trace(path);
  EXPECT_EQ(trace.dropped, 0);
  EXPECT_EQ(trace.track_names.at(0), "calls (the calling thread)");
  EXPECT_EQ(trace.track_names.at(1), "replica 0 (cpu:0) worker");
  EXPECT_EQ(trace.track_names.at(4), "replica 1 (cpu:1) communication");
  EXPECT_EQ(trace.count(0, "train_step"), 3u);
  EXPECT_EQ(trace.by_track.at(0).front().at("args").at("rows"), 16);
  for (int r = 0; r < 2; ++r) {
    const int worker = 1 + 2 * r, comm = 2 + 2 * r;
    for (const char* name : {"train_step", "batch to device", "forward", "loss", "backward", "gradient buckets finish",
                             "optimizer", "parameters all-gather", "loss to host", "device sync"})
      EXPECT_EQ(trace.count(worker, name), 3u) << "replica " << r << ": " << name;
    // The last bucket is reduced by the worker when backward ends, the others by the communication thread.
    EXPECT_EQ(trace.count(worker, "bucket all-reduce"), 3u) << r;
    EXPECT_EQ(trace.count(comm, "bucket all-reduce"), 3 * (buckets - 1)) << r;
  }
  // Every track's spans nest: each starts after the one before it and ends inside every span still open.
  const auto ends = [](const nlohmann::json& e) { return e.at("ts").get<double>() + e.at("dur").get<double>(); };
  for (const auto& [track, spans] : trace.by_track) {
    std::vector<double> open;
    double last_start = -1;
    for (const auto& e : spans) {
      const double start = e.at("ts").get<double>();
      EXPECT_GE(start, last_start) << "track " << track;
      last_start = start;
      while (!open.empty() && open.back() <= start) open.pop_back();
      if (!open.empty()) EXPECT_LE(ends(e), open.back() + 1e-3) << "track " << track << ": " << e.dump();
      open.push_back(ends(e));
    }
  }
  // Each worker's job lies inside the call that handed it over.
  for (size_t step = 0; step < 3; ++step) {
    const auto& call = trace.by_track.at(0)[step];
    for (int worker : {1, 3}) {
      const auto& job = trace.by_track.at(worker)[step * (trace.by_track.at(worker).size() / 3)];
      EXPECT_EQ(job.at("name"), "train_step");
      EXPECT_GE(job.at("ts").get<double>(), call.at("ts").get<double>());
      EXPECT_LE(ends(job), ends(call) + 1e-3);
    }
  }
  std::remove(path.c_str());
}

// The cap: spans past it, and spans for a track that does not exist, are dropped and counted in the file.
TEST(Trace, SpansPastTheCapAreCountedAsDropped) {
  Trace trace({"one", "two"}, 10);
  trace.start();
  for (int i = 0; i < 15; ++i) {
    const TraceTrack track(static_cast<size_t>(i % 2));
    const TraceSpan span(trace, "work", "i", i);
  }
  const auto now = Trace::Clock::now();
  trace.add(7, "nowhere", now, now, nullptr, 0, false);
  trace.stop();
  const TraceSpans spans(std::istringstream(trace.chrome_json(3)));
  EXPECT_EQ(spans.dropped, 6);
  EXPECT_EQ(spans.count(0, "work") + spans.count(1, "work"), 10u);
  EXPECT_EQ(spans.count(0, "work"), 5u);  // the first ten, alternating
  EXPECT_EQ(spans.by_track.at(1).front().at("pid"), 3);
  // A new start forgets all of it.
  trace.start();
  trace.stop();
  const TraceSpans restarted(std::istringstream(trace.chrome_json(0)));
  EXPECT_EQ(restarted.dropped, 0);
  EXPECT_TRUE(restarted.by_track.empty());
}

TEST(Trace, AFailedStepShowsWhereItFailedAndStopIsCheckedAndRetried) {
  Engine engine(make_mlp(5), adam(), cpu_devices(2));
  const Batch b = make_batch(8, 12, 5, 6);
  try {
    engine.trace_stop(temp_path("dpar_trace_never.json"));
    ADD_FAILURE() << "a trace that never started was written";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidState) << e.what();
  }
  engine.trace_start();
  engine.inject_fault(1, Fault::kBackward);
  EXPECT_THROW(engine.train_step(b.x, b.y), Error);
  engine.train_step(b.x, b.y);
  // A directory that does not exist: the write fails, and the timeline stays for another path.
  try {
    engine.trace_stop("/nonexistent-dpar-dir/trace.json");
    ADD_FAILURE() << "written into a directory that does not exist";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kIo) << e.what();
  }
  const std::string path = temp_path("dpar_trace_failed.json");
  engine.trace_stop(path);
  const TraceSpans trace(path);
  EXPECT_EQ(trace.count(0, "train_step"), 2u);
  size_t failed = 0;
  for (const auto& e : trace.by_track.at(3))  // replica 1's worker
    if (e.contains("args") && e.at("args").value("failed", false)) {
      ++failed;
      EXPECT_TRUE(e.at("name") == "backward" || e.at("name") == "train_step") << e.dump();
    }
  EXPECT_EQ(failed, 2u) << "the job and its backward";
  std::remove(path.c_str());
}

// ---------------------------------------------------------------------------------------------------------------
// Failures on one worker reach the caller; the others do not deadlock

// A worker whose start failed (on a GPU: its device could not be made current) must not end the process: each of
// its jobs fails with the start's exception, and the other workers work.
TEST(Faults, AWorkerThatCouldNotStartFailsItsJobsWithTheReason) {
  WorkerPool pool(3, [](size_t w) {
    if (w == 1) fail(Status::kDevice, "worker 1 could not make its device current");
  });
  std::atomic<int> ran{0};
  for (int call = 0; call < 2; ++call) {
    const auto errors = pool.run_all([&](size_t) { ++ran; });
    ASSERT_EQ(errors.size(), 3u);
    EXPECT_EQ(errors[0], nullptr);
    EXPECT_EQ(errors[2], nullptr);
    ASSERT_NE(errors[1], nullptr);
    try {
      std::rethrow_exception(errors[1]);
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::kDevice);
      EXPECT_NE(std::string(e.what()).find("worker 1 could not make its device current"), std::string::npos);
    }
  }
  EXPECT_EQ(ran.load(), 4) << "the two workers that started ran every job";
}

TEST(Faults, FailureOnOneWorkerIsReportedAndEngineStaysUsable) {
  for (Fault fault : {Fault::kAlloc, Fault::kForward, Fault::kBackward}) {
    Model model = make_mlp(41);
    Engine engine(model, sgd_momentum(), cpu_devices(4));
    Engine clean(model, sgd_momentum(), cpu_devices(4));
    // Grow past the buffers' first capacity so that the allocation fault has an allocation to hit.
    Batch big = make_batch(40, 12, 5, 5);
    Batch b = make_batch(30, 12, 5, 6);
    engine.train_step(b.x, b.y);
    clean.train_step(b.x, b.y);
    engine.inject_fault(2, fault);
    try {
      engine.train_step(big.x, big.y);
      ADD_FAILURE() << "the injected fault was not reported";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), fault == Fault::kAlloc ? Status::kOutOfMemory : Status::kDevice) << e.what();
      EXPECT_NE(std::string(e.what()).find("replica 2 (cpu:2)"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("remains usable"), std::string::npos) << e.what();
    }
    // Nothing was applied, and the next steps match an engine that never failed.
    EXPECT_EQ(engine.params(0), clean.params(0));
    engine.train_step(big.x, big.y);
    clean.train_step(big.x, big.y);
    for (size_t r = 0; r < 4; ++r) EXPECT_EQ(engine.params(r), clean.params(r));
  }
}

TEST(Faults, CollectiveTimeoutNamesTheMissingParticipant) {
  ThreadGroup group({"replica 0 (cpu:0)", "replica 1 (cpu:1)", "replica 2 (cpu:2)"},
                    std::chrono::milliseconds(200));
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < 3; ++r) comms.push_back(group.communicator(r));
  std::vector<float> bufs[3] = {std::vector<float>(64, 1.0f), std::vector<float>(64, 2.0f), std::vector<float>(64, 3.0f)};
  std::vector<Status> status(3, Status::kOk);
  std::vector<std::string> message(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)  // replica 2 never arrives
    threads.emplace_back([&, r] {
      try {
        comms[r]->all_reduce_sum(bufs[r].data(), 64, true, 1.0f);
      } catch (const Error& e) {
        status[r] = e.status();
        message[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(status[r] == Status::kTimeout || status[r] == Status::kRemote) << message[r];
    EXPECT_NE(message[r].find("replica 2 (cpu:2)"), std::string::npos) << message[r];
  }
  EXPECT_TRUE(status[0] == Status::kTimeout || status[1] == Status::kTimeout);
  // After a reset the group works again.
  group.reset();
  threads.clear();
  for (int r = 0; r < 3; ++r)
    threads.emplace_back([&, r] { comms[r]->all_reduce_sum(bufs[r].data(), 64, true, 0.5f); });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) EXPECT_EQ(bufs[r][7], 3.0f);  // (1 + 2 + 3) * 0.5
}

TEST(AllReduce, SumsEveryElementAcrossParticipantsForManySizes) {
  for (int n : {1, 2, 3, 5, 8}) {
    std::vector<std::string> names;
    for (int r = 0; r < n; ++r) names.push_back("rank " + std::to_string(r));
    ThreadGroup group(names, std::chrono::seconds(30));
    std::vector<std::unique_ptr<Communicator>> comms;
    for (int r = 0; r < n; ++r) comms.push_back(group.communicator(r));
    for (size_t count : {size_t(1), size_t(15), size_t(17), size_t(4099), size_t(100003)}) {
      std::vector<std::vector<float>> bufs(n, std::vector<float>(count));
      for (int r = 0; r < n; ++r)
        for (size_t i = 0; i < count; ++i) bufs[r][i] = float((i * 7 + r * 3) % 64);
      std::vector<std::thread> threads;
      for (int r = 0; r < n; ++r)  // rank 1 contributes nothing (it produced no gradient)
        threads.emplace_back([&, r] { comms[r]->all_reduce_sum(bufs[r].data(), count, r != 1, 0.25f); });
      for (auto& t : threads) t.join();
      for (int r = 0; r < n; ++r)
        for (size_t i = 0; i < count; ++i) {
          float want = 0;
          for (int q = 0; q < n; ++q)
            if (q != 1) want += float((i * 7 + q * 3) % 64);
          ASSERT_EQ(bufs[r][i], want * 0.25f) << n << " ranks, " << count << " elements, rank " << r << ", i " << i;
        }
    }
  }
}

}  // namespace
}  // namespace dpar
