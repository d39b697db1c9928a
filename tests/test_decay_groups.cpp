// Weight decay in two parameter groups (Engine::set_weight_decay_exclusion): Linear weights decay, biases and
// BatchNorm's weight and bias do not, as PyTorch users group them. Checked against PyTorch's two-group SGD and
// AdamW (tests/data/decay_groups_reference.json, from tests/reference/make_decay_groups_reference.py), on 1, 2 and
// 3 devices, with both gradient reductions, and across a checkpoint.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "common/error.h"
#include "engine/engine.h"
#include "engine_test_util.h"

using namespace dpar;

namespace {

using test::cpu_devices;

const nlohmann::json& reference() {
  static const nlohmann::json ref = [] {
    std::ifstream in(std::string(DPAR_TEST_DATA_DIR) + "/decay_groups_reference.json");
    if (!in) throw std::runtime_error("decay_groups_reference.json is missing");
    return nlohmann::json::parse(in);
  }();
  return ref;
}

// Linear(4, 6, no bias), BatchNorm1d(6), Linear(6, 3) with PyTorch's initial parameters; SyncBatchNorm when `sync`, so
// that N devices normalise over the whole batch as one device does.
Model reference_model(bool sync) {
  Model m(1);
  m.add(make_linear(4, 6, false));
  m.add(make_batchnorm(1, 6, 1e-5f, 0.1f, true));
  m.add(make_linear(6, 3, true));
  if (sync) m.convert_sync_batchnorm();
  const nlohmann::json& init = reference()["init"];
  for (size_t i = 0; i < m.params().size(); ++i) {
    const ParamInfo& p = m.params()[i];
    EXPECT_EQ(p.name, reference()["names"][i].get<std::string>());
    const std::vector<float> v = init[i].get<std::vector<float>>();
    EXPECT_EQ(static_cast<int64_t>(v.size()), p.shape.numel());
    std::copy(v.begin(), v.end(), m.values().begin() + p.offset);
  }
  return m;
}

OptimizerConfig config_of(const nlohmann::json& c) {
  OptimizerConfig o;
  const nlohmann::json& h = c["hyper"];
  o.lr = h["lr"].get<float>();
  o.weight_decay = h["weight_decay"].get<float>();
  if (c["optimizer"] == "sgd") {
    o.kind = OptimizerKind::kSgd;
    o.momentum = h["momentum"].get<float>();
  } else {
    o.kind = OptimizerKind::kAdamW;
    o.beta1 = h["beta1"].get<float>();
    o.beta2 = h["beta2"].get<float>();
    o.eps = h["eps"].get<float>();
  }
  return o;
}

struct Batch {
  Tensor x, y;
};

std::vector<Batch> reference_batches() {
  std::vector<Batch> out;
  const nlohmann::json& ref = reference();
  for (size_t s = 0; s < ref["xs"].size(); ++s) {
    const std::vector<float> x = ref["xs"][s].get<std::vector<float>>();
    const std::vector<int32_t> y = ref["ys"][s].get<std::vector<int32_t>>();
    const int64_t rows = static_cast<int64_t>(y.size());
    Batch b{Tensor::empty(DType::kF32, Shape{rows, 4}, Device{}), Tensor::empty(DType::kI32, Shape{rows}, Device{})};
    std::copy(x.begin(), x.end(), b.x.f32());
    std::copy(y.begin(), y.end(), b.y.i32());
    out.push_back(std::move(b));
  }
  return out;
}

std::vector<float> train(Engine& engine, const std::vector<Batch>& data) {
  for (const Batch& b : data) engine.train_step(b.x, b.y);
  return engine.params(0);
}

// The reference's parameters, flattened in the model's order.
std::vector<float> expected(const nlohmann::json& c) {
  std::vector<float> out;
  for (const auto& name : reference()["names"]) {
    const std::vector<float> v = c["params"][name.get<std::string>()].get<std::vector<float>>();
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) worst = std::max(worst, std::abs(double(a[i]) - b[i]));
  return worst;
}

TEST(DecayGroups, LayersMarkBiasesAndNormsAsNotDecaying) {
  const Model m = reference_model(false);
  std::vector<bool> decays;
  for (const ParamInfo& p : m.params()) decays.push_back(p.decays);
  EXPECT_EQ(decays, (std::vector<bool>{true, false, false, true, false}));
  Model conv(1);
  conv.add(make_conv2d(Conv2dSpec{2, 3, 3, 3}));
  EXPECT_TRUE(conv.params()[0].decays);
  EXPECT_FALSE(conv.params()[1].decays);
}

TEST(DecayGroups, MatchPyTorchTwoParamGroupsOnOneTwoAndThreeDevices) {
  const std::vector<Batch> data = reference_batches();
  for (const nlohmann::json& c : reference()["cases"]) {
    const OptimizerConfig opt = config_of(c);
    const std::vector<float> want = expected(c);
    std::vector<float> one_device;
    for (size_t devices : {1, 2, 3}) {
      std::vector<float> first;
      for (GradientReduction reduction : {GradientReduction::kAllReduce, GradientReduction::kReduceScatter}) {
        Engine engine(reference_model(devices > 1), opt, cpu_devices(devices));
        engine.set_gradient_reduction(reduction);
        engine.set_weight_decay_exclusion(true);
        EXPECT_TRUE(engine.weight_decay_exclusion());
        const std::vector<float> got = train(engine, data);
        const std::string what = c["optimizer"].get<std::string>() + " on " + std::to_string(devices) +
                                 " devices, reduction " + std::to_string(static_cast<int>(reduction));
        EXPECT_LT(max_abs_diff(got, want), 1e-6) << what;
        for (size_t r = 1; r < devices; ++r) EXPECT_EQ(engine.params(r), got) << what << ", replica " << r;
        // Both reductions step the same shards from the same summed gradient: the same bits.
        if (first.empty()) first = got;
        else EXPECT_EQ(got, first) << what;
      }
      if (devices == 1) one_device = first;
      else EXPECT_LT(max_abs_diff(first, one_device), 1e-6) << c["optimizer"] << " on " << devices << " devices";
    }
    // The grouping matters here: one group (the default) decays the biases and norms as well and ends elsewhere.
    Engine plain(reference_model(false), opt, cpu_devices(1));
    EXPECT_FALSE(plain.weight_decay_exclusion());
    EXPECT_GT(max_abs_diff(train(plain, data), want), 1e-5) << c["optimizer"];
  }
}

// Off is the default's behaviour bit for bit; on with weight_decay 0 too (nothing left to exclude).
TEST(DecayGroups, OffOrWithoutDecayStepsAsOneGroup) {
  const std::vector<Batch> data = reference_batches();
  const OptimizerConfig opt = config_of(reference()["cases"][1]);
  Engine plain(reference_model(true), opt, cpu_devices(3));
  Engine toggled(reference_model(true), opt, cpu_devices(3));
  toggled.set_weight_decay_exclusion(true);
  toggled.set_weight_decay_exclusion(false);
  EXPECT_EQ(train(toggled, data), train(plain, data));

  OptimizerConfig no_decay = opt;
  no_decay.weight_decay = 0.0f;
  Engine a(reference_model(true), no_decay, cpu_devices(2)), b(reference_model(true), no_decay, cpu_devices(2));
  b.set_weight_decay_exclusion(true);
  EXPECT_EQ(train(a, data), train(b, data));
}

// A checkpoint holds the same state with or without groups; an engine that loads it and excludes the same
// parameters continues as the one that saved it.
TEST(DecayGroups, CheckpointRoundTripKeepsTheSteps) {
  const std::vector<Batch> data = reference_batches();
  for (const nlohmann::json& c : reference()["cases"]) {
    const OptimizerConfig opt = config_of(c);
    Engine engine(reference_model(true), opt, cpu_devices(2));
    engine.set_weight_decay_exclusion(true);
    engine.train_step(data[0].x, data[0].y);
    engine.train_step(data[1].x, data[1].y);
    const std::string path = ::testing::TempDir() + "/dpar_decay_groups.safetensors";
    engine.save(path);
    Engine restored(reference_model(true), opt, cpu_devices(3));
    restored.set_weight_decay_exclusion(true);
    restored.load(path);
    EXPECT_TRUE(restored.weight_decay_exclusion());  // loading keeps the engine's setting
    for (size_t s = 2; s < data.size(); ++s) {
      engine.train_step(data[s].x, data[s].y);
      restored.train_step(data[s].x, data[s].y);
    }
    EXPECT_LT(max_abs_diff(restored.params(0), engine.params(0)), 1e-6) << c["optimizer"];
    EXPECT_LT(max_abs_diff(restored.params(0), expected(c)), 1e-6) << c["optimizer"];
    std::remove(path.c_str());
  }
}

// The optimizer alone: a range that crosses group boundaries anywhere steps as the same elements stepped one at a
// time, each with its group's decay.
TEST(DecayGroups, OptimizerSplitsRangesAtGroupBoundaries) {
  const std::unique_ptr<Stream> stream = cpu_backend().open_stream(Device{});
  std::vector<float> grads(40);
  for (size_t i = 0; i < grads.size(); ++i) grads[i] = std::sin(static_cast<float>(i)) * 0.3f;
  const std::vector<ElementRange> no_decay{{3, 9}, {9, 12}, {20, 21}, {30, 40}};
  auto decays = [&](int64_t i) {
    for (const ElementRange& r : no_decay)
      if (i >= r.begin && i < r.end) return false;
    return true;
  };
  for (OptimizerKind kind : {OptimizerKind::kSgd, OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
    OptimizerConfig config;
    config.kind = kind;
    config.momentum = 0.9f;
    config.weight_decay = 0.3f;
    OptimizerConfig undecayed = config;
    undecayed.weight_decay = 0.0f;
    std::vector<float> got(40, 1.0f), want(40, 1.0f);
    Optimizer grouped(config, {{0, 5}, {5, 25}, {25, 40}}, Device{});
    grouped.set_no_decay(no_decay);
    std::vector<std::unique_ptr<Optimizer>> single;
    for (int64_t i = 0; i < 40; ++i)
      single.push_back(std::make_unique<Optimizer>(decays(i) ? config : undecayed, i, i + 1, Device{}));
    for (int s = 0; s < 3; ++s) {
      grouped.step(*stream, got.data(), grads.data());
      for (auto& o : single) o->step(*stream, want.data(), grads.data());
    }
    stream->synchronize();
    EXPECT_EQ(got, want) << config.name();
    EXPECT_NE(got[3], got[2]) << config.name();  // the groups differ: decay moved the decayed elements further
  }
}

}  // namespace
