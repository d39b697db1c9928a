// Tied weights (PyTorch's lm_head.weight = wte.weight): one parameter read by two nodes. Its gradient against
// central differences and against an untied twin's two gradients summed; a later reader with an untied bias of its
// own (overwritten, not added to); 1, 2 and 3 CPU devices after Adam steps; two accumulated micro-batches against one
// batch; checkpoints holding the parameter under both keys (read from the safetensors header), a differing alias
// refused and a missing one accepted; renaming the alias's node; and the C ABI's refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "dpar.h"
#include "engine_test_util.h"
#include "io/safetensors.h"
#include "nn/model.h"

namespace dpar {
namespace {

using test::cpu_devices;
using test::max_relative_error;
using test::Standalone;

constexpr int64_t kVocab = 7, kDim = 5, kSeq = 3;

// The GPT pattern over (B, T) tokens: Embedding(V, E) -> Linear(E, E) -> Tanh -> Linear(E, V, no bias) whose weight
// is the embedding's (tie_to_source: node 3 reads node 0's, as GPT-2's lm_head.weight = wte.weight; otherwise the
// other way round, node 0 reads node 3's, as nanoGPT's wte.weight = lm_head.weight). Untied: the twin with two
// weights of equal initial values.
enum class Tie { kNone, kHeadReadsEmbedding, kEmbeddingReadsHead };

Model gpt_model(Tie tie, uint64_t seed = 3) {
  Model m(seed);
  m.add(make_embedding(kVocab, kDim));   // 0: (B, T) -> (B, T, E)
  m.add(make_linear(kDim, kDim, true));  // 1
  m.add(make_activation(Activation::kTanh));
  m.add(make_linear(kDim, kVocab, false));  // 3: (B, T, E) -> (B, T, V)
  // Both weights start equal (the embedding's draw), so the twins compute the same function.
  std::copy_n(m.values().begin() + m.params()[0].offset, kVocab * kDim, m.values().begin() + m.params()[3].offset);
  if (tie == Tie::kHeadReadsEmbedding) m.tie_param(3, "weight", 0, "weight");
  if (tie == Tie::kEmbeddingReadsHead) m.tie_param(0, "weight", 3, "weight");
  return m;
}

Tensor tokens(int64_t rows, uint32_t seed) {
  std::mt19937 gen(seed);
  Tensor t = Tensor::empty(DType::kI32, Shape{rows, kSeq}, Device{});
  for (int64_t i = 0; i < t.numel(); ++i) t.i32()[i] = static_cast<int32_t>(gen() % kVocab);
  return t;
}

// sum(model(x) * r) in double, for the replica's current parameters.
double weighted_output(ReplicaModel& rm, const Standalone& s, const Tensor& x, const std::vector<float>& r) {
  const Tensor out = rm.forward(s.ctx, x);
  double sum = 0;
  for (int64_t i = 0; i < out.numel(); ++i) sum += static_cast<double>(out.f32()[i]) * r[static_cast<size_t>(i)];
  return sum;
}

// The gradient of sum(model(x) * r) over the flat parameter array, from nonzero garbage (accumulate false must
// overwrite it), or added to `start` when accumulating.
std::vector<float> gradient(const Model& model, const Tensor& x, const std::vector<float>& r, bool accumulate = false,
                            const std::vector<float>& start = {}) {
  Standalone s;
  ReplicaModel rm(model, s.ctx);
  rm.forward(s.ctx, x);
  Tensor dout = rm.output_grad_buffer(s.ctx);
  EXPECT_EQ(dout.numel(), static_cast<int64_t>(r.size()));
  std::memcpy(dout.f32(), r.data(), r.size() * sizeof(float));
  const auto n = static_cast<size_t>(model.num_param_elements());
  for (size_t i = 0; i < n; ++i) rm.grads()[i] = start.empty() ? 1e3f : start[i];
  rm.backward(s.ctx, dout, accumulate);
  return std::vector<float>(rm.grads(), rm.grads() + n);
}

void expect_gradient_matches_differences(const Model& model, const Tensor& x) {
  const Shape out_shape = model.output_shape(x.shape());
  const std::vector<float> r = test::randn(static_cast<size_t>(out_shape.numel()), 2);
  const std::vector<float> grad = gradient(model, x, r);
  Standalone s;
  ReplicaModel probe(model, s.ctx);
  for (const ParamInfo& p : model.params())
    for (int64_t k = 0; k < p.shape.numel(); ++k) {
      const auto at = static_cast<size_t>(p.offset + k);
      // Each write through params_for_writing(), which a change of the weights between forwards must use.
      const float value = probe.params()[at];
      auto set = [&](float to) { probe.params_for_writing()[at] = to; };
      constexpr double kEps = 1e-2;
      set(value + static_cast<float>(kEps));
      const double plus = weighted_output(probe, s, x, r);
      set(value - static_cast<float>(kEps));
      const double minus = weighted_output(probe, s, x, r);
      set(value);
      const double fd = (plus - minus) / (2 * kEps);
      EXPECT_NEAR(grad[at], fd, 2e-3 * (1 + std::fabs(fd))) << p.name << "[" << k << "]";
    }
}

TEST(TiedWeights, TheModelHoldsTheParameterOnceUnderTheSourcesName) {
  const Model untied = gpt_model(Tie::kNone);
  const Model tied = gpt_model(Tie::kHeadReadsEmbedding);
  ASSERT_EQ(untied.params().size(), 4u);
  ASSERT_EQ(tied.params().size(), 3u);
  EXPECT_EQ(tied.num_param_elements(), untied.num_param_elements() - kVocab * kDim);
  EXPECT_EQ(tied.params()[0].name, "0.weight");
  ASSERT_EQ(tied.params()[0].aliases.size(), 1u);
  EXPECT_EQ(tied.params()[0].aliases[0].name, "3.weight");
  EXPECT_EQ(tied.params()[0].last_writer(), 0u);
  // The other way round: node 3's weight stays (its offset moved down by the embedding's elements), node 0 reads it.
  const Model other = gpt_model(Tie::kEmbeddingReadsHead);
  ASSERT_EQ(other.params().size(), 3u);
  EXPECT_EQ(other.params()[0].name, "1.weight");
  EXPECT_EQ(other.params()[0].offset, 0);
  EXPECT_EQ(other.params()[2].name, "3.weight");
  EXPECT_EQ(other.params()[2].offset, kDim * kDim + kDim);
  ASSERT_EQ(other.params()[2].aliases.size(), 1u);
  EXPECT_EQ(other.params()[2].aliases[0].name, "0.weight");
  EXPECT_EQ(other.params()[2].last_writer(), 0u);
  // Renaming a node renames the key it reads the tied parameter under.
  Model named = tied;
  named.set_node_name(0, "transformer.wte");
  named.set_node_name(3, "lm_head");
  EXPECT_EQ(named.params()[0].name, "transformer.wte.weight");
  EXPECT_EQ(named.params()[0].aliases[0].name, "lm_head.weight");
}

TEST(TiedWeights, GradientMatchesFiniteDifferencesEitherWayRound) {
  const Tensor x = tokens(4, 11);
  expect_gradient_matches_differences(gpt_model(Tie::kHeadReadsEmbedding), x);
  expect_gradient_matches_differences(gpt_model(Tie::kEmbeddingReadsHead), x);
}

TEST(TiedWeights, GradientIsTheUntiedTwinsTwoGradientsSummed) {
  const Tensor x = tokens(5, 12);
  const Model untied = gpt_model(Tie::kNone);
  const Model tied = gpt_model(Tie::kHeadReadsEmbedding);
  const std::vector<float> r = test::randn(static_cast<size_t>(untied.output_shape(x.shape()).numel()), 3);
  const std::vector<float> a = gradient(untied, x, r), b = gradient(tied, x, r);
  const auto& up = untied.params();
  const auto n = static_cast<size_t>(kVocab * kDim);
  std::vector<float> want(n), got(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(n));
  for (size_t i = 0; i < n; ++i)
    want[i] = a[static_cast<size_t>(up[0].offset) + i] + a[static_cast<size_t>(up[3].offset) + i];
  EXPECT_LT(max_relative_error(got, want, 1e-3), 1e-5);
  // The untied parameters (node 1's weight and bias) are the twin's.
  const std::vector<float> rest_a(a.begin() + up[1].offset, a.begin() + up[3].offset);
  const std::vector<float> rest_b(b.begin() + static_cast<std::ptrdiff_t>(n), b.end());
  EXPECT_EQ(rest_a, rest_b);
  // Accumulating adds the whole sum once more.
  const std::vector<float> twice = gradient(tied, x, r, true, b);
  for (size_t i = 0; i < b.size(); ++i) EXPECT_NEAR(twice[i], 2 * b[i], 1e-5 * (1 + std::fabs(b[i]))) << i;
}

// The engine hands a parameter to the reducer when the node ParamInfo::last_writer() names finishes its backward:
// its gradient must be final then. Node 0 reads node 3's weight here, so the owner's backward (node 3) is too early
// (the reducer's all-reduce would race the embedding's addition, which a timing-bound test would rarely catch).
TEST(TiedWeights, AGradientIsFinalWhenItsLastWriterIsDone) {
  const Model model = gpt_model(Tie::kEmbeddingReadsHead);
  const Tensor x = tokens(4, 13);
  const std::vector<float> r = test::randn(static_cast<size_t>(model.output_shape(x.shape()).numel()), 4);
  Standalone s;
  ReplicaModel rm(model, s.ctx);
  rm.forward(s.ctx, x);
  Tensor dout = rm.output_grad_buffer(s.ctx);
  std::memcpy(dout.f32(), r.data(), r.size() * sizeof(float));
  const auto& params = model.params();
  std::vector<std::vector<float>> at_ready(params.size()), at_owner(params.size());
  auto snapshot = [&](const ParamInfo& p) {
    return std::vector<float>(rm.grads() + p.offset, rm.grads() + p.offset + p.shape.numel());
  };
  rm.backward(s.ctx, dout, false, [&](size_t node) {
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].last_writer() == node) at_ready[i] = snapshot(params[i]);
      if (params[i].node == node) at_owner[i] = snapshot(params[i]);
    }
  });
  for (size_t i = 0; i < params.size(); ++i) EXPECT_EQ(at_ready[i], snapshot(params[i])) << params[i].name;
  ASSERT_EQ(params[2].name, "3.weight");
  EXPECT_NE(at_owner[2], snapshot(params[2])) << "the embedding's part came after the owner's backward";
}

// A later reader (in backward order) with an untied parameter of its own: linear(4 -> 4, bias) -> tanh ->
// linear(4 -> 4, bias) reading the first one's weight. The first node's bias must be overwritten by a
// non-accumulating backward, not added to the garbage before it.
TEST(TiedWeights, ALaterReadersOwnParametersAreOverwrittenNotAddedTo) {
  Model m(5);
  m.add(make_linear(4, 4, true));
  m.add(make_activation(Activation::kTanh));
  m.add(make_linear(4, 4, true));
  m.tie_param(2, "weight", 0, "weight");
  ASSERT_EQ(m.params().size(), 3u);
  Tensor x = test::host_tensor(test::randn(12, 4), Shape{3, 4});
  expect_gradient_matches_differences(m, x);
}

// A layer of two inputs with parameters (none of dpar's has both yet): out = weight * a + b + bias over (B, C),
// weight and bias (C), in plain loops on host memory.
class ScaledSum final : public Layer {
 public:
  explicit ScaledSum(int64_t c) : c_(c) {}
  std::string describe() const override { return "scaled_sum(" + std::to_string(c_) + ")"; }
  std::vector<ParamSpec> param_specs() const override {
    return {{"weight", Shape{c_}, InitKind::kUniform, 1.0f}, {"bias", Shape{c_}, InitKind::kUniform, 1.0f}};
  }
  size_t num_inputs() const override { return 2; }
  Shape output_shape(const Shape& in) const override { return in; }
  Shape output_shape_of(const std::vector<Shape>& in) const override { return in[0]; }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<ScaledSum>(c_); }
  void forward(const ReplicaContext&, const Tensor&, const Tensor&) override { fail(Status::kInternal, "2 inputs"); }
  void backward(const ReplicaContext&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool) override {
    fail(Status::kInternal, "2 inputs");
  }
  void forward_inputs(const ReplicaContext&, const std::vector<Tensor>& in, const Tensor& out) override {
    const float *w = bound_params_[0].f32(), *bias = bound_params_[1].f32();
    for (int64_t i = 0; i < out.numel(); ++i)
      out.f32()[i] = w[i % c_] * in[0].f32()[i] + in[1].f32()[i] + bias[i % c_];
  }
  void backward_inputs(const ReplicaContext&, const std::vector<Tensor>& in, const Tensor&, const Tensor& dout,
                       const std::vector<Tensor>& din, bool accumulate) override {
    const float* w = bound_params_[0].f32();
    float *dw = bound_grads_[0].f32(), *db = bound_grads_[1].f32();
    if (!accumulate) std::fill_n(dw, c_, 0.0f), std::fill_n(db, c_, 0.0f);
    for (int64_t i = 0; i < dout.numel(); ++i) {
      const float g = dout.f32()[i];
      dw[i % c_] += g * in[0].f32()[i];
      db[i % c_] += g;
      din[0].f32()[i] = g * w[i % c_];
      din[1].f32()[i] = g;
    }
  }

 private:
  int64_t c_;
};

// The layer of two inputs as the lower reader (it adds to the LayerNorm's gradient, and its own bias is
// overwritten, not added to): linear -> scaled_sum(linear, input) -> layernorm whose weight is the scaled sum's ->
// linear.
TEST(TiedWeights, ALayerOfSeveralInputsAddsToATiedGradient) {
  Model m(6);
  m.add(make_linear(4, 4, true));                               // 0
  m.add(std::make_unique<ScaledSum>(4), {0, kModelInput});      // 1
  m.add(make_layernorm(4, 1e-5f, true));                        // 2
  m.add(make_linear(4, 3, true));                               // 3
  m.tie_param(2, "weight", 1, "weight");
  ASSERT_EQ(m.params().size(), 7u);  // 2 + 2 + 1 (the bias; the weight is the scaled sum's) + 2
  Tensor x = test::host_tensor(test::randn(12, 8), Shape{3, 4});
  expect_gradient_matches_differences(m, x);
}

// Engines: Adam over (B, T) tokens, the output flattened to (B, T * V) for the engine's cross-entropy.
Model gpt_classifier(Tie tie) {
  Model m = gpt_model(tie);
  m.add_flatten();
  return m;
}

Tensor labels(int64_t rows, uint32_t seed) {
  std::mt19937 gen(seed);
  Tensor t = Tensor::empty(DType::kI32, Shape{rows}, Device{});
  for (int64_t i = 0; i < rows; ++i) t.i32()[i] = static_cast<int32_t>(gen() % (kSeq * kVocab));
  return t;
}

EngineConfig small_buckets(size_t devices) {
  EngineConfig c = cpu_devices(devices);
  // A bucket per parameter or so: the tied weight's bucket must wait for the embedding's backward, the last.
  c.buckets.first_bucket_bytes = 64;
  c.buckets.bucket_cap_bytes = 64;
  return c;
}

TEST(TiedWeights, OneTwoAndThreeDevicesTrainAlikeWithAdam) {
  const Model model = gpt_classifier(Tie::kHeadReadsEmbedding);
  OptimizerConfig adam;
  adam.kind = OptimizerKind::kAdam;
  adam.lr = 1e-2f;
  const Tensor x = tokens(7, 21), y = labels(7, 22);
  std::vector<float> want;
  for (size_t devices : {1, 2, 3}) {
    Engine engine(model, adam, small_buckets(devices));
    for (int s = 0; s < 4; ++s) engine.train_step(x, y);
    const std::vector<float> got = engine.params(0);
    ASSERT_EQ(got.size(), static_cast<size_t>(model.num_param_elements()));
    for (size_t r = 1; r < devices; ++r) EXPECT_EQ(engine.params(r), got) << "replica " << r;
    if (devices == 1) {
      want = got;
      EXPECT_GT(max_relative_error(got, model.values()), 1e-3);  // training moved them
    } else {
      EXPECT_LT(max_relative_error(got, want), 1e-5) << devices << " devices";
    }
  }
}

// One SGD step: the tied weight moves by both readers' gradients, as the untied twin's two weights move by one each.
TEST(TiedWeights, AStepMovesTheWeightByTheTwinsTwoUpdates) {
  OptimizerConfig sgd;
  sgd.lr = 0.5f;
  const Tensor x = tokens(7, 31), y = labels(7, 32);
  const Model untied = gpt_classifier(Tie::kNone);
  const Model tied = gpt_classifier(Tie::kEmbeddingReadsHead);
  Engine twin(untied, sgd, small_buckets(2));
  twin.train_step(x, y);
  const std::vector<float> a = twin.params(0);
  for (size_t devices : {1, 3}) {
    Engine engine(tied, sgd, small_buckets(devices));
    engine.train_step(x, y);
    const std::vector<float> b = engine.params(0);
    const ParamInfo& head = tied.params()[2];
    const auto& up = untied.params();
    std::vector<float> want, got;
    for (int64_t i = 0; i < kVocab * kDim; ++i) {
      const float w0 = untied.values()[static_cast<size_t>(up[0].offset + i)];
      want.push_back(a[static_cast<size_t>(up[0].offset + i)] + a[static_cast<size_t>(up[3].offset + i)] - w0);
      got.push_back(b[static_cast<size_t>(head.offset + i)]);
    }
    EXPECT_LT(max_relative_error(got, want), 1e-5) << devices << " devices";
  }
}

TEST(TiedWeights, TwoAccumulatedMicroBatchesEqualOneBatch) {
  const Model model = gpt_classifier(Tie::kHeadReadsEmbedding);
  OptimizerConfig sgd;
  sgd.lr = 0.5f;
  const Tensor x = tokens(7, 41), y = labels(7, 42);
  Engine whole(model, sgd, small_buckets(1));
  whole.train_step(x, y);
  Engine parts(model, sgd, small_buckets(2));
  parts.accumulate(x.rows(0, 3), y.rows(0, 3));
  parts.accumulate(x.rows(3, 4), y.rows(3, 4));
  parts.step();
  EXPECT_LT(max_relative_error(parts.params(0), whole.params(0)), 1e-5);
  EXPECT_GT(max_relative_error(parts.params(0), model.values()), 1e-3);
}

std::string temp_path(const char* name) { return ::testing::TempDir() + name; }

// The file's tensors, to write again with one changed or left out.
void rewrite(const std::string& from, const std::string& to, const std::string& drop, const std::string& bump) {
  const io::SafetensorsFile file = io::SafetensorsFile::parse(from, io::SafetensorsFile::read_bytes(from));
  std::vector<std::vector<uint8_t>> data;
  std::vector<io::TensorView> views;
  for (const std::string& name : file.names()) {
    if (name == drop) continue;
    const auto& e = file.entry(name);
    data.emplace_back(file.data(name), file.data(name) + e.bytes);
    if (name == bump) data.back()[1] ^= 0x40;
  }
  size_t k = 0;
  for (const std::string& name : file.names()) {
    if (name == drop) continue;
    const auto& e = file.entry(name);
    views.push_back({name, e.dtype, e.shape, data[k].data(), data[k].size()});
    ++k;
  }
  std::map<std::string, std::string> meta = file.metadata();  // less the checksums, which the writer adds
  meta.erase(io::kSafetensorsCrcKey);
  meta.erase(io::kSafetensorsHeaderCrcKey);
  io::write_safetensors(to, views, meta);
}

TEST(TiedWeights, CheckpointsHoldBothKeysAndRefuseAnAliasThatDiffers) {
  Model model = gpt_classifier(Tie::kHeadReadsEmbedding);
  model.set_node_name(0, "transformer.wte");
  model.set_node_name(3, "lm_head");
  OptimizerConfig adam;
  adam.kind = OptimizerKind::kAdam;
  adam.lr = 1e-2f;
  const Tensor x = tokens(6, 51), y = labels(6, 52);
  Engine engine(model, adam, cpu_devices(2));
  engine.train_step(x, y);
  const std::string path = temp_path("tied.safetensors");
  engine.save(path);
  const io::SafetensorsFile file = io::SafetensorsFile::parse(path, io::SafetensorsFile::read_bytes(path));
  ASSERT_TRUE(file.has("transformer.wte.weight"));
  ASSERT_TRUE(file.has("lm_head.weight"));
  EXPECT_EQ(file.entry("lm_head.weight").shape, (std::vector<int64_t>{kVocab, kDim}));
  EXPECT_EQ(std::memcmp(file.data("lm_head.weight"), file.data("transformer.wte.weight"),
                        file.entry("lm_head.weight").bytes),
            0);
  // The optimizer's state under the parameter's own name alone.
  EXPECT_TRUE(file.has("optimizer.exp_avg.transformer.wte.weight"));
  EXPECT_FALSE(file.has("optimizer.exp_avg.lm_head.weight"));
  // 3 parameters + 1 alias + 2 Adam states of 3 parameters.
  EXPECT_EQ(file.names().size(), 10u);

  Engine fresh(model, adam, cpu_devices(3));
  fresh.load(path);
  EXPECT_EQ(fresh.params(0), engine.params(0));
  const std::vector<float> before = fresh.params(0);

  const std::string bad = temp_path("tied_bad.safetensors");
  rewrite(path, bad, "", "lm_head.weight");
  try {
    fresh.load(bad);
    ADD_FAILURE() << "a differing alias was loaded";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kMismatch);
    EXPECT_NE(std::string(e.what()).find("\"lm_head.weight\" differs from \"transformer.wte.weight\""),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(fresh.params(0), before);

  // A file without the alias (as safetensors' save_model writes tensors that share memory) loads.
  const std::string lean = temp_path("tied_lean.safetensors");
  rewrite(path, lean, "lm_head.weight", "");
  Engine third(model, adam, cpu_devices(1));
  third.load(lean);
  EXPECT_EQ(third.params(0), engine.params(0));
  // One without the parameter's own key does not.
  const std::string headless = temp_path("tied_headless.safetensors");
  rewrite(path, headless, "transformer.wte.weight", "");
  EXPECT_THROW(third.load(headless), Error);
  for (const std::string& p : {path, bad, lean, headless}) std::remove(p.c_str());
}

// The C ABI: the GPT pattern through dpar.h, its counts and names, and each refusal naming the value.
struct CModel {
  dpar_model* m = nullptr;
  CModel() {
    dpar_model_options o;
    dpar_model_options_init(&o);
    o.seed = 5;
    EXPECT_EQ(dpar_model_create(&m, &o), DPAR_OK);
  }
  ~CModel() { dpar_model_free(m); }
  size_t num_params() const {
    size_t n = 0;
    EXPECT_EQ(dpar_model_num_params(&n, m), DPAR_OK);
    return n;
  }
  size_t num_elements() const {
    size_t n = 0;
    EXPECT_EQ(dpar_model_num_param_elements(&n, m), DPAR_OK);
    return n;
  }
};

void expect_refused(dpar_status status, const char* needle) {
  EXPECT_EQ(status, DPAR_ERR_INVALID_ARGUMENT);
  const std::string what = dpar_last_error();
  EXPECT_NE(what.find(needle), std::string::npos) << "\"" << what << "\" lacks \"" << needle << "\"";
  dpar_clear_error();
}

TEST(TiedWeights, TheCApiTiesCountsOnceAndRefusesNamingTheValue) {
  CModel c;
  ASSERT_EQ(dpar_model_add_embedding(c.m, kVocab, kDim), DPAR_OK);          // 0: weight (7, 5)
  ASSERT_EQ(dpar_model_add_linear(c.m, kDim, kDim, 1), DPAR_OK);           // 1: weight (5, 5), bias
  ASSERT_EQ(dpar_model_add_activation(c.m, DPAR_TANH), DPAR_OK);          // 2
  ASSERT_EQ(dpar_model_add_linear(c.m, kDim, kVocab, 0), DPAR_OK);         // 3: weight (7, 5)
  ASSERT_EQ(dpar_model_add_linear(c.m, kVocab, kVocab, 0), DPAR_OK);       // 4: weight (7, 7)
  ASSERT_EQ(c.num_params(), 5u);
  const size_t elements = c.num_elements();

  expect_refused(dpar_model_tie_param(nullptr, 3, "weight", 0, "weight"), "model");
  expect_refused(dpar_model_tie_param(c.m, 3, nullptr, 0, "weight"), "param: is NULL");
  expect_refused(dpar_model_tie_param(c.m, 3, "weight", 0, nullptr), "source_param: is NULL");
  expect_refused(dpar_model_tie_param(c.m, 9, "weight", 0, "weight"), "node 9 is not a node");
  expect_refused(dpar_model_tie_param(c.m, 3, "weight", -1, "weight"), "node -1 is not a node");
  expect_refused(dpar_model_tie_param(c.m, 3, "bias", 0, "weight"), "has no parameter \"bias\" (it has \"weight\")");
  expect_refused(dpar_model_tie_param(c.m, 2, "weight", 0, "weight"), "it has no parameters");
  expect_refused(dpar_model_tie_param(c.m, 3, "weight", 0, "wieght"), "has no parameter \"wieght\"");
  expect_refused(dpar_model_tie_param(c.m, 3, "weight", 3, "weight"), "node 3 cannot be tied to itself");
  expect_refused(dpar_model_tie_param(c.m, 3, "weight", 1, "weight"), "\"3.weight\" is (7, 5) but \"1.weight\" is (5, 5)");
  expect_refused(dpar_model_tie_param(c.m, 4, "weight", 0, "weight"), "(7, 7)");
  EXPECT_EQ(c.num_params(), 5u);
  EXPECT_EQ(c.num_elements(), elements);

  ASSERT_EQ(dpar_model_tie_param(c.m, 3, "weight", 0, "weight"), DPAR_OK);
  EXPECT_EQ(c.num_params(), 4u);  // as len(list(model.parameters())): the tied weight once
  EXPECT_EQ(c.num_elements(), elements - static_cast<size_t>(kVocab * kDim));
  EXPECT_STREQ(dpar_model_param_name(c.m, 0), "0.weight");
  EXPECT_STREQ(dpar_model_param_name(c.m, 3), "4.weight");
  // Tied already, either side; a source the node reads already.
  expect_refused(dpar_model_tie_param(c.m, 3, "weight", 0, "weight"), "\"3.weight\" is tied already (it reads \"0.weight\")");
  expect_refused(dpar_model_tie_param(c.m, 0, "weight", 3, "weight"), "\"0.weight\" is tied already (node 3 reads it");
  EXPECT_EQ(c.num_params(), 4u);
  // Renaming the reader renames its key; a name that would collide with it is refused.
  ASSERT_EQ(dpar_model_set_node_name(c.m, 3, "lm_head"), DPAR_OK);
  ASSERT_EQ(dpar_model_set_node_name(c.m, 0, "wte"), DPAR_OK);
  EXPECT_STREQ(dpar_model_param_name(c.m, 0), "wte.weight");
}

}  // namespace
}  // namespace dpar
