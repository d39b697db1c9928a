// Dynamic loss scaling (Engine::set_loss_scaling), torch.amp.GradScaler's semantics: a power-of-two scale that does
// not overflow trains bit for bit as no scaling; an overflow skips the step on every replica (parameters, optimizer
// state and step count untouched) and backs the scale off; clean steps grow it; the state survives a checkpoint.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "common/error.h"
#include "engine/engine.h"
#include "engine_test_util.h"

using namespace dpar;

namespace {

using test::cpu_devices;
using test::host_tensor;
using test::randn;

constexpr int64_t kIn = 5, kHidden = 7, kClasses = 3, kRows = 10;

Model small_model() {
  Model m(11);
  m.add(make_linear(kIn, kHidden, true));
  m.add(make_activation(Activation::kTanh));
  m.add(make_linear(kHidden, kClasses, true));
  return m;
}

OptimizerConfig sgd() {
  OptimizerConfig o;
  o.kind = OptimizerKind::kSgd;
  o.lr = 0.1f;
  o.momentum = 0.9f;
  o.weight_decay = 0.01f;
  return o;
}

OptimizerConfig adam() {
  OptimizerConfig o;
  o.kind = OptimizerKind::kAdam;
  o.lr = 0.01f;
  return o;
}

struct Batch {
  Tensor x, y;
};

// A batch of normal inputs; `poisoned` puts a NaN in its first row, so that its gradient cannot be finite.
Batch batch(uint32_t seed, bool poisoned = false, float input_scale = 1.0f) {
  std::vector<float> x = randn(static_cast<size_t>(kRows * kIn), seed, input_scale);
  if (poisoned) x[0] = std::numeric_limits<float>::quiet_NaN();
  Batch b{host_tensor(x, Shape{kRows, kIn}), Tensor::empty(DType::kI32, Shape{kRows}, Device{})};
  for (int64_t i = 0; i < kRows; ++i) b.y.i32()[i] = static_cast<int32_t>((seed + 7 * i) % kClasses);
  return b;
}

LossScaling scaling(float init, int64_t interval = 2000) {
  LossScaling s;
  s.init_scale = init;
  s.growth_interval = interval;
  return s;
}

// Every replica's parameters.
std::vector<std::vector<float>> all_params(const Engine& e) {
  std::vector<std::vector<float>> out;
  for (size_t r = 0; r < e.num_replicas(); ++r) out.push_back(e.params(r));
  return out;
}

// GradScaler.update()'s formulas, written out on their own: the scale after each step of `overflows`.
std::vector<float> grad_scaler_sequence(float scale, float growth, float backoff, int64_t interval,
                                        const std::vector<bool>& overflows) {
  std::vector<float> out;
  int64_t tracker = 0;
  for (bool inf : overflows) {
    if (inf) {
      scale *= backoff;
      tracker = 0;
    } else if (++tracker == interval) {
      if (std::isfinite(scale * growth)) scale *= growth;
      tracker = 0;
    }
    out.push_back(scale);
  }
  return out;
}

TEST(LossScaling, OffByDefault) {
  Engine e(small_model(), sgd(), cpu_devices(1));
  EXPECT_FALSE(e.loss_scaler().enabled());
  EXPECT_EQ(e.loss_scaler().scale(), 1.0f);
  EXPECT_FALSE(e.loss_scaler().last_step_skipped());
}

// Scaling by 2^k and unscaling is exact: the same bits as no scaling, for train_step, accumulate + step and
// forward + backward + step, with clipping (which sees the unscaled gradient) and both reductions, on 1 and 3 devices.
TEST(LossScaling, PowerOfTwoScaleTrainsBitForBitAsNone) {
  for (const OptimizerConfig& base : {sgd(), adam()}) {
    for (size_t devices : {size_t{1}, size_t{3}}) {
      for (GradientReduction reduction : {GradientReduction::kAllReduce, GradientReduction::kReduceScatter}) {
        for (float clip : {0.0f, 0.5f}) {
          OptimizerConfig opt = base;
          opt.max_grad_norm = clip;
          Engine plain(small_model(), opt, cpu_devices(devices));
          Engine scaled(small_model(), opt, cpu_devices(devices));
          for (Engine* e : {&plain, &scaled}) e->set_gradient_reduction(reduction);
          // Growth every 2 steps: the scale goes 1024, 2048, 4096, ... and stays exact.
          scaled.set_loss_scaling(scaling(1024.0f, 2));
          const std::string what = std::string(opt.kind == OptimizerKind::kSgd ? "sgd" : "adam") + " on " +
                                   std::to_string(devices) + " devices, reduction " +
                                   std::to_string(static_cast<int>(reduction)) + ", clip " + std::to_string(clip);
          for (uint32_t s = 0; s < 5; ++s) {
            const Batch b = batch(s);
            const double lp = plain.train_step(b.x, b.y), ls = scaled.train_step(b.x, b.y);
            EXPECT_EQ(lp, ls) << what << ": the loss is reported unscaled";
            EXPECT_FALSE(scaled.loss_scaler().last_step_skipped()) << what;
          }
          EXPECT_EQ(scaled.loss_scaler().scale(), 4096.0f) << what;
          // Gradient accumulation: the check and the unscaling happen at the step.
          for (uint32_t s = 10; s < 12; ++s) {
            const Batch b = batch(s);
            EXPECT_EQ(plain.accumulate(b.x, b.y), scaled.accumulate(b.x, b.y)) << what;
          }
          plain.step();
          scaled.step();
          // backward(grad_output): the engine scales the caller's gradient (in its own buffer, not the caller's).
          const Batch b = batch(20);
          const std::vector<float> g = randn(static_cast<size_t>(kRows * kClasses), 21, 0.1f);
          const Tensor grad = host_tensor(g, Shape{kRows, kClasses});
          for (Engine* e : {&plain, &scaled}) {
            e->forward(b.x);
            e->backward(grad);
            e->step();
          }
          EXPECT_EQ(std::vector<float>(grad.f32(), grad.f32() + g.size()), g) << what;
          EXPECT_EQ(scaled.step_count(), 7) << what;
          EXPECT_EQ(all_params(scaled), all_params(plain)) << what;
          if (clip > 0.0f) EXPECT_EQ(scaled.grad_norm(), plain.grad_norm()) << what;
        }
      }
    }
  }
}

// A scale so large that the gradient overflows (2^127: the largest power of two of f32): every step is skipped on
// every replica, each halving the scale, until the scale is small enough; then training proceeds, and from there it
// is bit for bit that of an engine without scaling that never saw the skipped batches (the scale is a power of two
// throughout): the skips left parameters, Adam's moments and its step count as they were.
TEST(LossScaling, OverflowSkipsTheStepOnEveryReplicaAndBacksOff) {
  for (size_t devices : {size_t{1}, size_t{3}}) {
    for (GradientReduction reduction : {GradientReduction::kAllReduce, GradientReduction::kReduceScatter}) {
      Engine plain(small_model(), adam(), cpu_devices(devices));
      Engine scaled(small_model(), adam(), cpu_devices(devices));
      for (Engine* e : {&plain, &scaled}) e->set_gradient_reduction(reduction);
      const std::string what = std::to_string(devices) + " devices, reduction " +
                               std::to_string(static_cast<int>(reduction));
      // A step first, so that Adam has state to keep.
      const Batch first = batch(100);
      plain.train_step(first.x, first.y);
      scaled.train_step(first.x, first.y);
      const float huge = std::ldexp(1.0f, 127);
      scaled.set_loss_scaling(scaling(huge));
      std::vector<bool> skipped;
      uint32_t s = 0;
      for (; s < 200; ++s) {
        const auto before = all_params(scaled);
        const int64_t steps = scaled.step_count();
        const float scale = scaled.loss_scaler().scale();
        const Batch b = batch(200 + s, false, 10.0f);
        const double loss = scaled.train_step(b.x, b.y);
        EXPECT_TRUE(std::isfinite(loss)) << what << ": the loss is reported unscaled";
        skipped.push_back(scaled.loss_scaler().last_step_skipped());
        if (!skipped.back()) {
          EXPECT_EQ(scaled.step_count(), steps + 1) << what;
          EXPECT_NE(scaled.params(0), before[0]) << what;
          break;
        }
        EXPECT_EQ(all_params(scaled), before) << what << ", step " << s;
        EXPECT_EQ(scaled.step_count(), steps) << what;
        EXPECT_EQ(scaled.loss_scaler().scale(), scale * 0.5f) << what;
        EXPECT_EQ(scaled.loss_scaler().growth_tracker(), 0) << what;
      }
      ASSERT_GE(skipped.size(), 2u) << what << ": the planted overflow did not overflow";
      ASSERT_FALSE(skipped.back()) << what << ": training never proceeded";
      EXPECT_EQ(scaled.loss_scaler().scale(), grad_scaler_sequence(huge, 2.0f, 0.5f, 2000, skipped).back());
      // The engine without scaling takes the step the scaled one took (the last batch) and no other.
      const Batch taken = batch(200 + s, false, 10.0f);
      plain.train_step(taken.x, taken.y);
      EXPECT_EQ(all_params(scaled), all_params(plain)) << what;
      for (uint32_t t = 0; t < 3; ++t) {
        const Batch b = batch(500 + t);
        plain.train_step(b.x, b.y);
        scaled.train_step(b.x, b.y);
      }
      EXPECT_EQ(all_params(scaled), all_params(plain)) << what;
      EXPECT_EQ(scaled.step_count(), plain.step_count()) << what;
    }
  }
}

// Planted overflows (a NaN in a batch) at chosen steps, with growth_interval 3: the scale follows GradScaler's
// formulas step by step; a skipped accumulate + step backs off too.
TEST(LossScaling, ScaleSequenceIsGradScalers) {
  const std::vector<bool> overflows{false, false, false, true,  false, true,  false, false,
                                    false, false, false, false, true,  true,  false, false};
  for (size_t devices : {size_t{1}, size_t{3}}) {
    Engine e(small_model(), sgd(), cpu_devices(devices));
    LossScaling s = scaling(1024.0f, 3);
    s.growth_factor = 3.0f;
    s.backoff_factor = 0.25f;
    e.set_loss_scaling(s);
    const std::vector<float> want = grad_scaler_sequence(1024.0f, 3.0f, 0.25f, 3, overflows);
    int64_t steps = 0;
    for (size_t i = 0; i < overflows.size(); ++i) {
      const Batch b = batch(static_cast<uint32_t>(i), overflows[i]);
      if (i % 2 == 0) {
        e.train_step(b.x, b.y);
      } else {
        e.accumulate(b.x, b.y);
        const Batch clean = batch(static_cast<uint32_t>(100 + i));
        e.accumulate(clean.x, clean.y);
        e.step();
      }
      steps += overflows[i] ? 0 : 1;
      EXPECT_EQ(e.loss_scaler().last_step_skipped(), overflows[i]) << devices << " devices, step " << i;
      EXPECT_EQ(e.loss_scaler().scale(), want[i]) << devices << " devices, step " << i;
      EXPECT_EQ(e.step_count(), steps) << devices << " devices, step " << i;
    }
    for (float p : e.params(0)) ASSERT_TRUE(std::isfinite(p)) << "a NaN step was taken";
  }
}

TEST(LossScaling, RefusesBadSettingsChangingNothing) {
  Engine e(small_model(), sgd(), cpu_devices(2));
  e.set_loss_scaling(scaling(256.0f, 5));
  const Batch b = batch(1);
  e.train_step(b.x, b.y);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  auto bad = [&](LossScaling s, const std::string& word) {
    try {
      e.set_loss_scaling(s);
      ADD_FAILURE() << word << " was accepted";
    } catch (const Error& err) {
      EXPECT_EQ(err.status(), Status::kInvalidArgument);
      EXPECT_NE(std::string(err.what()).find(word), std::string::npos) << err.what();
    }
    EXPECT_EQ(e.loss_scaler().scale(), 256.0f);
    EXPECT_EQ(e.loss_scaler().growth_tracker(), 1);
    EXPECT_EQ(e.loss_scaler().settings().growth_interval, 5);
  };
  for (float v : {-1.0f, nan, inf}) bad(scaling(v), "init_scale");
  for (float v : {1.0f, 0.5f, nan, inf}) {
    LossScaling s = scaling(8.0f);
    s.growth_factor = v;
    bad(s, "growth_factor");
  }
  for (float v : {0.0f, 1.0f, -0.5f, nan}) {
    LossScaling s = scaling(8.0f);
    s.backoff_factor = v;
    bad(s, "backoff_factor");
  }
  for (int64_t v : {int64_t{0}, int64_t{-3}}) bad(scaling(8.0f, v), "growth_interval");
  // Not while accumulated gradients wait for their step: they were scaled by the old scale.
  e.accumulate(b.x, b.y);
  EXPECT_THROW(e.set_loss_scaling(scaling(8.0f)), Error);
  e.step();
  // 0 turns it off: the scale reads 1 and steps are never skipped.
  e.set_loss_scaling(scaling(0.0f));
  EXPECT_FALSE(e.loss_scaler().enabled());
  EXPECT_EQ(e.loss_scaler().scale(), 1.0f);
}

// The scaler's state (scale, growth tracker, settings) travels in the checkpoint: an engine that loads it continues
// as the one that saved it, scale and steps alike. A checkpoint saved without scaling keeps the loader's scaler.
TEST(LossScaling, CheckpointRoundTripKeepsTheScaler) {
  const std::string path = ::testing::TempDir() + "/dpar_loss_scaling.safetensors";
  Engine engine(small_model(), adam(), cpu_devices(2));
  LossScaling s = scaling(4096.0f, 4);
  s.growth_factor = 4.0f;
  s.backoff_factor = 0.125f;
  engine.set_loss_scaling(s);
  for (uint32_t i = 0; i < 4; ++i) {
    const Batch b = batch(i, i == 1);  // one overflow: scale 512, then 2 clean steps
    engine.train_step(b.x, b.y);
  }
  ASSERT_EQ(engine.loss_scaler().scale(), 512.0f);
  ASSERT_EQ(engine.loss_scaler().growth_tracker(), 2);
  engine.save(path);

  Engine restored(small_model(), adam(), cpu_devices(2));  // scaling off until it loads
  restored.load(path);
  ASSERT_TRUE(restored.loss_scaler().enabled());
  EXPECT_EQ(restored.loss_scaler().scale(), 512.0f);
  EXPECT_EQ(restored.loss_scaler().growth_tracker(), 2);
  EXPECT_EQ(restored.loss_scaler().settings().init_scale, 4096.0f);
  EXPECT_EQ(restored.loss_scaler().settings().growth_factor, 4.0f);
  EXPECT_EQ(restored.loss_scaler().settings().backoff_factor, 0.125f);
  EXPECT_EQ(restored.loss_scaler().settings().growth_interval, 4);
  for (uint32_t i = 10; i < 14; ++i) {
    const Batch b = batch(i, i == 13);
    engine.train_step(b.x, b.y);
    restored.train_step(b.x, b.y);
    EXPECT_EQ(restored.loss_scaler().scale(), engine.loss_scaler().scale()) << i;
    EXPECT_EQ(restored.loss_scaler().last_step_skipped(), engine.loss_scaler().last_step_skipped()) << i;
  }
  EXPECT_EQ(engine.loss_scaler().scale(), 2048.0f * 0.125f);  // grew at the 2nd step, backed off at the 4th
  EXPECT_EQ(restored.params(0), engine.params(0));
  EXPECT_EQ(restored.step_count(), engine.step_count());

  // Without scaling the checkpoint holds no scaler: loading it keeps the loader's as it is.
  Engine unscaled(small_model(), adam(), cpu_devices(1));
  unscaled.save(path);
  Engine keeps(small_model(), adam(), cpu_devices(1));
  keeps.set_loss_scaling(scaling(64.0f));
  const Batch b = batch(3, true);
  keeps.train_step(b.x, b.y);
  keeps.load(path);
  EXPECT_TRUE(keeps.loss_scaler().enabled());
  EXPECT_EQ(keeps.loss_scaler().scale(), 32.0f);
  std::remove(path.c_str());
}

}  // namespace
