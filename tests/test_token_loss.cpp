// Cross-entropy over a GPT's tokens: (B, T, V) logits against (B, T) i32 targets, where a target of -100
// (kIgnoreIndex, PyTorch's default ignore_index) is no sample.
//  - the kernel and the loss against PyTorch (tests/data/token_loss_reference.json, from
//    tests/reference/make_token_loss_reference.py): the sum and its gradient, and the mean over the targets counted;
//  - the engine: the loss and the gradient are the mean over the non-ignored targets of the whole batch, so 1, 2, 3
//    and 8 devices (uneven chunks, one chunk all ignored) train as one device; accumulate over micro-batches with
//    different ignored counts equals one step on their union; a batch of ignored targets only gives a NaN loss and a
//    zero gradient; a target out of range is refused by value and position, nothing changed.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine_test_util.h"
#include "kernels/cpu/kernels.h"
#include "nn/loss.h"

namespace dpar {
namespace {

using test::cpu_devices;
using test::max_relative_error;

namespace k = kernels::cpu;

const nlohmann::json& reference() {
  static const nlohmann::json ref = [] {
    std::ifstream in(std::string(DPAR_TEST_DATA_DIR) + "/token_loss_reference.json");
    EXPECT_TRUE(in.good()) << "tests/data/token_loss_reference.json is missing";
    return in.good() ? nlohmann::json::parse(in) : nlohmann::json::object();
  }();
  return ref;
}

std::vector<float> floats(const nlohmann::json& j) {
  std::vector<float> v;
  for (const auto& x : j) v.push_back(x.get<float>());
  return v;
}

void expect_close(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], want[i], 1e-6 + 1e-5 * std::fabs(want[i])) << what << " [" << i << "]";
}

// ---- Kernel and loss against PyTorch ---------------------------------------------------------------------------

TEST(TokenLoss, KernelMatchesTorchSumAndMeanWithIgnoredTargets) {
  ASSERT_TRUE(reference().contains("cases"));
  EXPECT_EQ(reference()["ignore_index"].get<int32_t>(), kIgnoreIndex);
  for (const auto& c : reference()["cases"]) {
    const std::string name = c["name"];
    const int64_t B = c["B"], T = c["T"], V = c["V"], counted = c["counted"];
    const std::vector<float> logits = floats(c["logits"]);
    std::vector<int32_t> targets;
    for (const auto& t : c["targets"]) targets.push_back(t.get<int32_t>());
    // Every (b, t) position is a row of V classes: the GPT's logits.view(-1, V).
    std::vector<float> d(static_cast<size_t>(B * T * V));
    const double sum = k::cross_entropy_forward_backward(d.data(), logits.data(), targets.data(), B * T, V, 1.0f);
    EXPECT_NEAR(sum, c["loss_sum"].get<double>(), 1e-5 * std::fabs(c["loss_sum"].get<double>())) << name;
    expect_close(d, floats(c["dlogits_sum"]), name + ": d(sum)/dlogits");
    // The mean divides by the targets that are not ignored, as the engine does.
    const float scale = static_cast<float>(1.0 / static_cast<double>(counted));
    k::cross_entropy_forward_backward(d.data(), logits.data(), targets.data(), B * T, V, scale);
    EXPECT_NEAR(sum / static_cast<double>(counted), c["loss_mean"].get<double>(),
                1e-5 * std::fabs(c["loss_mean"].get<double>()))
        << name;
    expect_close(d, floats(c["dlogits_mean"]), name + ": d(mean)/dlogits");
    // The loss alone gives the same sum.
    EXPECT_EQ(k::cross_entropy_forward_backward(nullptr, logits.data(), targets.data(), B * T, V, 1.0f), sum);
  }
}

TEST(TokenLoss, LossOverBTVTensorsCountsTheTargetsNotIgnored) {
  const auto& c = reference()["cases"][0];
  const int64_t B = c["B"], T = c["T"], V = c["V"];
  const Tensor logits = test::host_tensor(floats(c["logits"]), Shape{B, T, V});
  Tensor target = Tensor::empty(DType::kI32, Shape{B, T}, Device{});
  for (int64_t i = 0; i < B * T; ++i) target.i32()[i] = c["targets"][static_cast<size_t>(i)].get<int32_t>();
  const std::vector<int64_t> samples = check_loss_target(LossKind::kCrossEntropy, logits.shape(), target, "test");
  ASSERT_EQ(samples.size(), static_cast<size_t>(B));
  EXPECT_EQ(samples, (std::vector<int64_t>{3, 0, 4}));  // row 1 is all ignored
  EXPECT_EQ(samples[0] + samples[1] + samples[2], c["counted"].get<int64_t>());

  test::Standalone s;
  Tensor dout = Tensor::zeros(DType::kF32, logits.shape(), Device{});
  double sum = 0.0;
  loss_forward_backward(LossKind::kCrossEntropy, s.ctx, &sum, dout, logits, target, 1.0f);
  EXPECT_NEAR(sum, c["loss_sum"].get<double>(), 1e-5 * std::fabs(c["loss_sum"].get<double>()));
  expect_close(std::vector<float>(dout.f32(), dout.f32() + dout.numel()), floats(c["dlogits_sum"]), "dlogits");
  // The ignored positions' gradient rows are exactly zero.
  for (int64_t t = 0; t < T; ++t)
    for (int64_t v = 0; v < V; ++v) EXPECT_EQ(dout.f32()[(1 * T + t) * V + v], 0.0f);
}

TEST(TokenLoss, TargetsOutOfRangeOrMisshapenAreRefusedByValueAndPosition) {
  const Shape out{2, 3, 5};
  Tensor target = Tensor::zeros(DType::kI32, Shape{2, 3}, Device{});
  target.i32()[0] = kIgnoreIndex;
  EXPECT_EQ(check_loss_target(LossKind::kCrossEntropy, out, target, "t"), (std::vector<int64_t>{2, 3}));
  for (int32_t bad : {5, -1, -99, -101}) {
    target.i32()[1 * 3 + 2] = bad;
    try {
      check_loss_target(LossKind::kCrossEntropy, out, target, "train_step");
      FAIL() << bad << ": no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::kInvalidArgument);
      const std::string want = "train_step: target[1, 2] = " + std::to_string(bad) + " is out of range [0, 5)";
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  }
  // One label per position, not per sequence.
  try {
    check_loss_target(LossKind::kCrossEntropy, out, Tensor::zeros(DType::kI32, Shape{2}, Device{}), "train_step");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("target (2) must be (2, 3) labels"), std::string::npos) << e.what();
  }
  // The kernel refuses a bad label too (its own check), but skips the ignored one.
  const std::vector<float> logits(2 * 5, 0.5f);
  std::vector<float> d(2 * 5, 7.0f);
  const int32_t labels[2] = {kIgnoreIndex, kIgnoreIndex};
  EXPECT_EQ(k::cross_entropy_forward_backward(d.data(), logits.data(), labels, 2, 5, 1.0f), 0.0);
  for (float g : d) EXPECT_EQ(g, 0.0f);
  const int32_t worse[2] = {1, -100 - 1};
  EXPECT_THROW(k::cross_entropy_forward_backward(d.data(), logits.data(), worse, 2, 5, 1.0f), Error);
}

// ---- The engine ------------------------------------------------------------------------------------------------

constexpr int64_t kVocab = 13, kEmbed = 6, kSeq = 4, kRows = 7;

// A GPT's head in miniature: Embedding over (B, T) tokens, then Linear(E, V) over (B, T, E): (B, T, V) logits.
Model token_model(uint64_t seed) {
  Model m(seed);
  m.add(make_embedding(kVocab, kEmbed));
  m.add(make_linear(kEmbed, kVocab, true));
  return m;
}

OptimizerConfig sgd(float momentum = 0.0f) {
  OptimizerConfig c;
  c.lr = 0.5f;
  c.momentum = momentum;
  return c;
}

struct Batch {
  Tensor x, y;
};

// kRows sequences of next-token targets, ignored unevenly: row 0 keeps one target, row 2 loses one, and the last
// row (the last replica's whole chunk on 3 devices, 3,3,1) is all ignored.
Batch token_batch(uint32_t seed, int64_t rows = kRows) {
  std::mt19937 gen(seed);
  Batch b{Tensor::empty(DType::kI32, Shape{rows, kSeq}, Device{}),
          Tensor::empty(DType::kI32, Shape{rows, kSeq}, Device{})};
  for (int64_t i = 0; i < rows * kSeq; ++i) {
    b.x.i32()[i] = static_cast<int32_t>(gen() % kVocab);
    b.y.i32()[i] = static_cast<int32_t>(gen() % kVocab);
  }
  auto ignore = [&](int64_t row, int64_t t) {
    if (row < rows) b.y.i32()[row * kSeq + t] = kIgnoreIndex;
  };
  for (int64_t t = 1; t < kSeq; ++t) ignore(0, t);
  ignore(2, 3);
  for (int64_t t = 0; t < kSeq; ++t) ignore(rows - 1, t);
  return b;
}

// The mean over the batch's counted targets, computed here from the 1-device engine's output.
double mean_loss(Engine& e, const Batch& b) {
  e.set_training(false);
  const Tensor out = e.forward(b.x);
  e.set_training(true);
  int64_t counted = 0;
  for (int64_t i = 0; i < b.y.numel(); ++i) counted += b.y.i32()[i] != kIgnoreIndex;
  const double sum = k::cross_entropy_forward_backward(nullptr, out.f32(), b.y.i32(), b.y.numel(), kVocab, 1.0f);
  return sum / static_cast<double>(counted);
}

TEST(TokenLossEngine, OneTwoThreeAndEightDevicesTrainAsOneWithIgnoredTargetsSpreadUnevenly) {
  const Model model = token_model(5);
  std::vector<Batch> data;
  for (uint32_t i = 0; i < 3; ++i) data.push_back(token_batch(40 + i));
  constexpr int kSteps = 6;
  std::vector<float> want;
  std::vector<double> want_losses;
  for (size_t devices : {1, 2, 3, 8}) {
    Engine engine(model, sgd(0.9f), cpu_devices(devices));
    std::vector<double> losses;
    for (int s = 0; s < kSteps; ++s) {
      const Batch& b = data[s % 3];
      if (devices == 1) {
        // The returned loss is the mean over the counted targets (of the parameters before the step).
        Engine probe(model, sgd(), cpu_devices(1));
        if (s == 0) EXPECT_NEAR(probe.train_step(b.x, b.y), mean_loss(probe, b), 1e-6);
      }
      losses.push_back(engine.train_step(b.x, b.y));
    }
    const auto got = engine.params(0);
    for (size_t r = 1; r < devices; ++r) EXPECT_EQ(engine.params(r), got) << devices << " devices, replica " << r;
    // Each replica's loss is the mean over its own counted targets: the last step's batch is data[2].
    const auto per_replica = engine.replica_losses();
    const auto split = split_batch(kRows, devices);
    int64_t begin = 0;
    for (size_t r = 0; r < devices; ++r) {
      int64_t counted = 0;
      for (int64_t i = begin * kSeq; i < (begin + split[r]) * kSeq; ++i) counted += data[2].y.i32()[i] != kIgnoreIndex;
      if (counted == 0)
        EXPECT_TRUE(std::isnan(per_replica[r])) << devices << " devices, replica " << r << " has no counted target";
      else
        EXPECT_TRUE(std::isfinite(per_replica[r])) << devices << " devices, replica " << r;
      begin += split[r];
    }
    if (devices == 1) {
      want = got;
      want_losses = losses;
      EXPECT_GT(max_relative_error(got, model.values()), 1e-2);  // training moved them
      continue;
    }
    EXPECT_LT(max_relative_error(got, want), 1e-5) << devices << " devices";
    for (int s = 0; s < kSteps; ++s) EXPECT_NEAR(losses[s], want_losses[s], 1e-5) << devices << " devices, step " << s;
  }
}

TEST(TokenLossEngine, GlobalMeanIsNotTheMeanOfReplicaMeans) {
  // Replica 0 (rows 0..3) counts 12 targets, replica 1 (rows 4..6) counts 8: the mean over the 20 targets is their
  // means weighted 12 : 8, not the plain mean of the two (DDP's result when the counts differ).
  const Model model = token_model(6);
  Engine engine(model, sgd(), cpu_devices(2));
  const Batch b = token_batch(77);
  // Trained a little, the model fits the rows apart, so that the two means differ clearly.
  for (int s = 0; s < 10; ++s) engine.train_step(b.x, b.y);
  const double want = mean_loss(engine, b);
  const double loss = engine.train_step(b.x, b.y);
  EXPECT_NEAR(loss, want, 1e-5);
  const auto per = engine.replica_losses();
  EXPECT_NEAR((per[0] * 12.0 + per[1] * 8.0) / 20.0, loss, 1e-5);
  EXPECT_GT(std::fabs((per[0] + per[1]) / 2.0 - loss), 1e-3) << "the data do not tell the two means apart";
}

TEST(TokenLossEngine, AccumulateWithDifferentIgnoredCountsEqualsOneStepOnTheUnion) {
  const Model model = token_model(7);
  const Batch whole = token_batch(11);
  for (size_t devices : {1, 2, 3}) {
    Engine once(model, sgd(), cpu_devices(devices));
    const double want_loss = once.train_step(whole.x, whole.y);
    Engine twice(model, sgd(), cpu_devices(devices));
    // Rows 0..2 count 1 + 4 + 3 = 8 targets, rows 3..6 count 4 + 4 + 4 + 0 = 12.
    const double a = twice.accumulate(whole.x.rows(0, 3), whole.y.rows(0, 3));
    const double b = twice.accumulate(whole.x.rows(3, 4), whole.y.rows(3, 4));
    twice.step();
    EXPECT_NEAR((a * 8.0 + b * 12.0) / 20.0, want_loss, 1e-6) << devices << " devices";
    EXPECT_LT(max_relative_error(twice.params(0), once.params(0)), 1e-5) << devices << " devices";
  }
}

TEST(TokenLossEngine, AllIgnoredBatchGivesNanLossAndZeroGradient) {
  const Model model = token_model(8);
  Batch none = token_batch(3);
  for (int64_t i = 0; i < none.y.numel(); ++i) none.y.i32()[i] = kIgnoreIndex;
  const Batch some = token_batch(4);
  for (size_t devices : {1, 3}) {
    Engine engine(model, sgd(), cpu_devices(devices));
    const auto before = engine.params(0);
    const double loss = engine.train_step(none.x, none.y);
    EXPECT_TRUE(std::isnan(loss)) << loss;  // PyTorch's 0/0
    for (float l : engine.replica_losses()) EXPECT_TRUE(std::isnan(l));
    // The optimizer stepped with a zero gradient: plain SGD leaves every weight where it was, none NaN.
    EXPECT_EQ(engine.step_count(), 1);
    EXPECT_EQ(engine.params(0), before);
    // An all-ignored micro-batch adds nothing to an accumulation, to its gradient nor to its divisor.
    Engine reference(model, sgd(), cpu_devices(devices));
    reference.train_step(some.x, some.y);
    EXPECT_TRUE(std::isnan(engine.accumulate(none.x, none.y)));
    engine.accumulate(some.x, some.y);
    engine.step();
    EXPECT_LT(max_relative_error(engine.params(0), reference.params(0)), 1e-6) << devices << " devices";
    // Only ignored micro-batches: step() steps with a zero gradient too.
    engine.accumulate(none.x, none.y);
    const auto held = engine.params(0);
    engine.step();
    EXPECT_EQ(engine.params(0), held);
  }
}

TEST(TokenLossEngine, TargetOutOfRangeIsRefusedByValueAndPositionAndNothingChanges) {
  const Model model = token_model(9);
  Engine engine(model, sgd(0.9f), cpu_devices(3));
  const Batch good = token_batch(21);
  engine.train_step(good.x, good.y);
  const auto before = engine.params(0);
  const int64_t steps = engine.step_count();
  for (int32_t bad : {static_cast<int32_t>(kVocab), -1}) {
    Batch b = token_batch(22);
    b.y.i32()[5 * kSeq + 1] = bad;
    for (int call = 0; call < 2; ++call) {
      try {
        if (call == 0)
          engine.train_step(b.x, b.y);
        else
          engine.accumulate(b.x, b.y);
        FAIL() << "no error";
      } catch (const Error& e) {
        EXPECT_EQ(e.status(), Status::kInvalidArgument);
        const std::string want = "target[5, 1] = " + std::to_string(bad) + " is out of range [0, 13)";
        EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
      }
    }
  }
  // (B) labels for a (B, T, V) output: refused, naming both shapes.
  try {
    engine.train_step(good.x, Tensor::zeros(DType::kI32, Shape{kRows}, Device{}));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("must be (7, 4) labels"), std::string::npos) << e.what();
  }
  EXPECT_EQ(engine.step_count(), steps);
  for (size_t r = 0; r < 3; ++r) EXPECT_EQ(engine.params(r), before);
  // It trains on as an engine that never saw the bad batches: step() has nothing pending.
  EXPECT_THROW(engine.step(), Error);
  Engine fresh(model, sgd(0.9f), cpu_devices(3));
  fresh.train_step(good.x, good.y);
  engine.train_step(good.x, good.y);
  fresh.train_step(good.x, good.y);
  EXPECT_EQ(engine.params(0), fresh.params(0));
}

}  // namespace
}  // namespace dpar
