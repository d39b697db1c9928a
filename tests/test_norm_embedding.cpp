// LayerNorm and Embedding against their references: finite differences for backward, PyTorch's numbers
// (tests/data/layernorm_embedding_reference.json, from tests/reference/make_layernorm_embedding_reference.py), one
// device on the full batch for engines on N devices (with int32 inputs), refused indices, and a transformer
// block's residual structure.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "common/error.h"
#include "engine/engine.h"
#include "partial_stream.h"
#include "engine_test_util.h"

using namespace dpar;

namespace {

using test::cpu_devices;
using test::host_stream;
using test::host_tensor;
using test::max_relative_error;
using test::randn;

Tensor host_indices(const std::vector<int32_t>& v, const Shape& shape) {
  Tensor t = Tensor::empty(DType::kI32, shape, Device{});
  std::copy(v.begin(), v.end(), t.i32());
  return t;
}

Shape shape_of(const std::vector<int64_t>& d) {
  if (d.size() == 1) return Shape{d[0]};
  if (d.size() == 2) return Shape{d[0], d[1]};
  return Shape{d[0], d[1], d[2]};
}

// One layer bound to host parameters of its own, outside any model or engine.
struct Rig {
  std::unique_ptr<Layer> layer;
  std::vector<Tensor> params, grads;
  uint64_t rng_offset = 0;
  Fault fault = Fault::kNone;
  ReplicaContext ctx;

  explicit Rig(std::unique_ptr<Layer> l) : layer(std::move(l)) {
    uint32_t seed = 11;
    for (const ParamSpec& p : layer->param_specs()) {
      params.push_back(host_tensor(randn(static_cast<size_t>(p.shape.numel()), seed++, 0.5f, 1.0f), p.shape));
      grads.push_back(Tensor::zeros(DType::kF32, p.shape, Device{}));
    }
    layer->bind(params, grads);
    ctx.stream = &host_stream();
    ctx.rng_offset = &rng_offset;
    ctx.armed_fault = &fault;
  }
  Tensor forward(const Tensor& x) {
    Tensor y = Tensor::empty(DType::kF32, layer->output_shape(x.shape()), Device{});
    layer->forward(ctx, x, y);
    return y;
  }
  // din undefined for an input of indices
  Tensor backward(const Tensor& x, const Tensor& y, const Tensor& dout, bool accumulate = false) {
    Tensor dx = x.dtype() == DType::kF32 ? Tensor::empty(DType::kF32, x.shape(), Device{}) : Tensor();
    layer->backward(ctx, x, y, dout, dx, accumulate);
    return dx;
  }
};

double weighted_sum(const Tensor& out, const std::vector<float>& r) {
  double s = 0;
  for (int64_t i = 0; i < out.numel(); ++i) s += double(out.f32()[i]) * r[static_cast<size_t>(i)];
  return s;
}

// Central differences of L = sum(forward(x) * r) with respect to p[0..count), against grad.
void check_fd(Rig& rig, const Tensor& x, const std::vector<float>& r, float* p, const float* grad, size_t count,
              const std::string& what) {
  const double h = 1e-2;
  auto loss_at = [&](size_t i, double delta) {
    const float keep = p[i];
    p[i] = static_cast<float>(keep + delta);
    const double l = weighted_sum(rig.forward(x), r);
    p[i] = keep;
    return l;
  };
  for (size_t i = 0; i < count; ++i) {
    const double fd = (loss_at(i, h) - loss_at(i, -h)) / (2 * h);
    EXPECT_NEAR(grad[i], fd, 2e-3 * std::max(1.0, std::abs(fd))) << what << "[" << i << "]";
  }
}

TEST(LayerNorm, BackwardMatchesFiniteDifferences) {
  for (const auto& [shape, affine] : std::vector<std::pair<Shape, bool>>{
           {Shape{5, 6}, true}, {Shape{3, 2, 4}, true}, {Shape{4, 5}, false}, {Shape{2, 3, 3}, false}}) {
    Rig rig(make_layernorm(shape[shape.ndim() - 1], 1e-5f, affine));
    const size_t n = static_cast<size_t>(shape.numel());
    Tensor x = host_tensor(randn(n, 5, 1.5f, 0.3f), shape);
    const auto r = randn(n, 6);
    const Tensor y = rig.forward(x);
    const Tensor dx = rig.backward(x, y, host_tensor(r, shape));
    const std::string where = shape.str() + (affine ? " affine" : "");
    check_fd(rig, x, r, x.f32(), dx.f32(), n, "dx " + where);
    for (size_t k = 0; k < rig.params.size(); ++k)
      check_fd(rig, x, r, rig.params[k].f32(), rig.grads[k].f32(), static_cast<size_t>(rig.params[k].numel()),
               (k == 0 ? "dweight " : "dbias ") + where);
    // accumulate adds the same gradients again
    if (affine) {
      const std::vector<float> dw(rig.grads[0].f32(), rig.grads[0].f32() + rig.grads[0].numel());
      rig.backward(x, y, host_tensor(r, shape), true);
      for (size_t i = 0; i < dw.size(); ++i) EXPECT_NEAR(rig.grads[0].f32()[i], 2 * dw[i], 1e-5) << where;
    }
  }
}

TEST(Embedding, WeightGradientMatchesFiniteDifferencesAndRepeatsAccumulate) {
  for (const Shape& shape : {Shape{4, 3}, Shape{6}}) {
    Rig rig(make_embedding(5, 3));
    std::vector<int32_t> idx(static_cast<size_t>(shape.numel()));
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<int32_t>((i * 3) % 4);  // row 4 unused, repeats
    const Tensor x = host_indices(idx, shape);
    const Tensor y = rig.forward(x);
    ASSERT_EQ(y.shape(), shape.ndim() == 1 ? (Shape{6, 3}) : (Shape{4, 3, 3}));
    for (size_t i = 0; i < idx.size(); ++i)
      for (int64_t e = 0; e < 3; ++e)
        ASSERT_EQ(y.f32()[i * 3 + static_cast<size_t>(e)], rig.params[0].f32()[idx[i] * 3 + e]);
    const auto r = randn(static_cast<size_t>(y.numel()), 7);
    rig.backward(x, y, host_tensor(r, y.shape()));
    check_fd(rig, x, r, rig.params[0].f32(), rig.grads[0].f32(), 15, "dweight " + shape.str());
    // Row 0 is named more than once: its gradient is the sum of those rows of dout.
    for (int64_t e = 0; e < 3; ++e) {
      double want = 0;
      int uses = 0;
      for (size_t i = 0; i < idx.size(); ++i)
        if (idx[i] == 0) want += r[i * 3 + static_cast<size_t>(e)], ++uses;
      ASSERT_GE(uses, 2);
      EXPECT_NEAR(rig.grads[0].f32()[e], want, 1e-6);
      EXPECT_EQ(rig.grads[0].f32()[4 * 3 + e], 0.0f) << "an unused row gets no gradient";
    }
  }
}

// padding_idx, as PyTorch's: the row starts at zero, is read as any row, and never gets a gradient.
TEST(Embedding, PaddingRowStartsAtZeroAndGetsNoGradient) {
  Model m(2);
  m.add(make_embedding(5, 3, 2));
  for (int64_t i = 0; i < 15; ++i)
    if (i / 3 == 2)
      EXPECT_EQ(m.values()[static_cast<size_t>(i)], 0.0f);
    else
      EXPECT_NE(m.values()[static_cast<size_t>(i)], 0.0f);
  EXPECT_THROW(make_embedding(5, 3, 5), Error);
  EXPECT_THROW(make_embedding(5, 3, -2), Error);
  Rig rig(make_embedding(5, 3, 2));
  const Tensor x = host_indices({2, 0, 2, 1, 0}, Shape{5});
  const Tensor y = rig.forward(x);
  EXPECT_EQ(y.f32()[0], rig.params[0].f32()[6]);  // read as any row
  const auto r = randn(15, 8);
  rig.backward(x, y, host_tensor(r, y.shape()));
  for (int64_t e = 0; e < 3; ++e) {
    EXPECT_EQ(rig.grads[0].f32()[2 * 3 + e], 0.0f);
    EXPECT_NEAR(rig.grads[0].f32()[e], r[static_cast<size_t>(3 + e)] + r[static_cast<size_t>(12 + e)], 1e-6);
    EXPECT_NEAR(rig.grads[0].f32()[3 + e], r[static_cast<size_t>(9 + e)], 1e-6);
  }
}

TEST(Embedding, KernelRefusesAnIndexOutOfRangeBeforeReadingIt) {
  Rig rig(make_embedding(5, 2));
  for (int32_t bad : {5, -1}) {
    const Tensor x = host_indices({0, 1, bad}, Shape{3});
    try {
      rig.forward(x);
      FAIL() << "no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("index " + std::to_string(bad) + " at position 2"), std::string::npos)
          << e.what();
    }
  }
}

TEST(LayerNormEmbedding, ChecksArgumentsAndShapes) {
  EXPECT_THROW(make_layernorm(0, 1e-5f, true), Error);
  EXPECT_THROW(make_layernorm(4, 0.0f, true), Error);
  EXPECT_THROW(make_layernorm(4, NAN, true), Error);
  EXPECT_THROW(make_layernorm(4, 1e-5f, true)->output_shape(Shape{2, 5}), Error);
  EXPECT_THROW(make_layernorm(4, 1e-5f, true)->output_shape(Shape{4}), Error);
  EXPECT_EQ(make_layernorm(4, 1e-5f, true)->output_shape(Shape{2, 3, 4}), (Shape{2, 3, 4}));
  EXPECT_THROW(make_embedding(0, 3), Error);
  EXPECT_THROW(make_embedding(3, 0), Error);
  EXPECT_THROW(make_embedding(3, 2)->output_shape(Shape{2, 3, 4}), Error);
  EXPECT_EQ(make_embedding(3, 2)->output_shape(Shape{2, 3}), (Shape{2, 3, 2}));
  // PyTorch's names and initialisers.
  const auto ln = make_layernorm(4, 1e-5f, true)->param_specs();
  ASSERT_EQ(ln.size(), 2u);
  EXPECT_EQ(ln[0].name, "weight");
  EXPECT_EQ(ln[0].init, InitKind::kOnes);
  EXPECT_EQ(ln[1].name, "bias");
  EXPECT_EQ(ln[1].init, InitKind::kZeros);
  EXPECT_TRUE(make_layernorm(4, 1e-5f, false)->param_specs().empty());
  const auto emb = make_embedding(3, 2)->param_specs();
  ASSERT_EQ(emb.size(), 1u);
  EXPECT_EQ(emb[0].name, "weight");
  EXPECT_EQ(emb[0].init, InitKind::kNormal);
  EXPECT_EQ(emb[0].bound, 1.0f);
  // A model's input dtype follows the layers that read it; read as both, it is refused.
  Model m(1);
  m.add(make_embedding(3, 2));
  EXPECT_EQ(m.input_dtype(), DType::kI32);
  Model plain(1);
  plain.add(make_layernorm(2, 1e-5f, true));
  EXPECT_EQ(plain.input_dtype(), DType::kF32);
  Model both(1);
  both.add(make_embedding(3, 2));
  both.branch_from(kModelInput);
  both.add(make_layernorm(2, 1e-5f, true));
  EXPECT_THROW(both.input_dtype(), Error);
  // Every node's output is f32: an Embedding after another node is refused when it is added.
  Model late(1);
  late.add(make_layernorm(2, 1e-5f, true));
  try {
    late.add(make_embedding(3, 2));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("must read the model's input, not node 0"), std::string::npos) << e.what();
  }
  EXPECT_EQ(late.num_nodes(), 1u);
}

void expect_close(const float* got, const nlohmann::json& want, double tol, const std::string& what) {
  for (size_t i = 0; i < want.size(); ++i) {
    const double w = want[i].get<double>();
    ASSERT_NEAR(got[i], w, tol * std::max(1.0, std::abs(w))) << what << "[" << i << "]";
  }
}

TEST(LayerNormEmbedding, MatchPyTorch) {
  std::ifstream in(std::string(DPAR_TEST_DATA_DIR) + "/layernorm_embedding_reference.json");
  ASSERT_TRUE(in.good());
  const nlohmann::json ref = nlohmann::json::parse(in);
  ASSERT_EQ(ref["layernorm"].size(), 3u);
  for (const auto& cs : ref["layernorm"]) {
    const std::string name = cs["name"];
    const Shape shape = shape_of(cs["shape"].get<std::vector<int64_t>>());
    const bool affine = cs["affine"];
    Rig rig(make_layernorm(shape[shape.ndim() - 1], cs["eps"].get<float>(), affine));
    if (affine) {
      const auto wv = cs["weight"].get<std::vector<float>>(), bv = cs["bias"].get<std::vector<float>>();
      std::copy(wv.begin(), wv.end(), rig.params[0].f32());
      std::copy(bv.begin(), bv.end(), rig.params[1].f32());
    }
    const Tensor x = host_tensor(cs["x"].get<std::vector<float>>(), shape);
    const Tensor y = rig.forward(x);
    expect_close(y.f32(), cs["output"], 1e-5, name + " output");
    const Tensor dx = rig.backward(x, y, host_tensor(cs["dout"].get<std::vector<float>>(), shape));
    expect_close(dx.f32(), cs["dx"], 1e-5, name + " dx");
    if (affine) {
      expect_close(rig.grads[0].f32(), cs["dweight"], 1e-5, name + " dweight");
      expect_close(rig.grads[1].f32(), cs["dbias"], 1e-5, name + " dbias");
    }
  }
  ASSERT_EQ(ref["embedding"].size(), 3u);
  for (const auto& cs : ref["embedding"]) {
    const std::string name = cs["name"];
    Rig rig(make_embedding(cs["num_embeddings"].get<int64_t>(), cs["embedding_dim"].get<int64_t>(),
                           cs["padding_idx"].get<int64_t>()));
    const auto wv = cs["weight"].get<std::vector<float>>();
    std::copy(wv.begin(), wv.end(), rig.params[0].f32());
    const Tensor x = host_indices(cs["indices"].get<std::vector<int32_t>>(),
                                  shape_of(cs["index_shape"].get<std::vector<int64_t>>()));
    const Tensor y = rig.forward(x);
    expect_close(y.f32(), cs["output"], 0.0, name + " output");
    rig.backward(x, y, host_tensor(cs["dout"].get<std::vector<float>>(), y.shape()));
    expect_close(rig.grads[0].f32(), cs["dweight"], 1e-6, name + " dweight");
  }
}

TEST(LayerNormEmbedding, AStreamWithoutTheirKernelsRefusesWithNotSupported) {
  test::PartialStream stream([](const KernelKey& key) { return key.op < Op::kLayerNormForward; });
  float x[4] = {}, w[4] = {};
  double stats[2] = {};
  int32_t idx[1] = {};
  const std::vector<std::pair<KernelCall, std::string>> calls{
      {call::LayerNormForward{TensorRef::of(x, {1, 4}), TensorRef::of(stats, {2}), TensorRef::of(x, {1, 4})},
       "layernorm_forward (f32)"},
      {call::LayerNormBackward{TensorRef::of(x, {1, 4}), {}, {}, TensorRef::of(x, {1, 4}), TensorRef::of(x, {1, 4}),
                               TensorRef::of(stats, {2})},
       "layernorm_backward (f32)"},
      {call::EmbeddingForward{TensorRef::of(x, {1, 4}), TensorRef::of(idx, {1}), TensorRef::of(w, {1, 4})},
       "embedding_forward (f32)"},
      {call::EmbeddingBackward{TensorRef::of(w, {1, 4}), TensorRef::of(x, {1, 4}), TensorRef::of(idx, {1})},
       "embedding_backward (f32)"}};
  for (const auto& [c, what] : calls) {
    try {
      stream.run(c);
      FAIL() << "no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::kNotSupported);
      EXPECT_NE(std::string(e.what()).find(what + " on cuda:0: this backend has no such kernel"), std::string::npos)
          << e.what();
    }
  }
  EXPECT_TRUE(stream.ran.empty());
}

// ---- Engines --------------------------------------------------------------------------------------------------

OptimizerConfig sgd() {
  OptimizerConfig c;
  c.lr = 0.1f;
  return c;
}

constexpr int64_t kVocab = 11, kDim = 6, kSeq = 4, kClasses = 5;

// Embedding -> LayerNorm -> Flatten -> Linear, over (B, T) int32 tokens.
Model token_model(uint64_t seed) {
  Model m(seed);
  m.add(make_embedding(kVocab, kDim));
  m.add(make_layernorm(kDim, 1e-5f, true));
  m.add_flatten();
  m.add(make_linear(kSeq * kDim, kClasses, true));
  return m;
}

struct Batch {
  Tensor x, y;
};

Batch token_batch(int64_t rows, uint32_t seed) {
  std::mt19937 gen(seed);
  Batch b{Tensor::empty(DType::kI32, Shape{rows, kSeq}, Device{}), Tensor::empty(DType::kI32, Shape{rows}, Device{})};
  // Tokens of the lower half of the vocabulary: the upper rows must keep a zero gradient (and stay put under SGD).
  for (int64_t i = 0; i < rows * kSeq; ++i) b.x.i32()[i] = static_cast<int32_t>(gen() % (kVocab / 2));
  for (int64_t i = 0; i < rows; ++i) b.y.i32()[i] = static_cast<int32_t>(gen() % kClasses);
  return b;
}

TEST(LayerNormEmbedding, NDevicesTrainAsOneDeviceOnTheFullBatchWithInt32Inputs) {
  const Model model = token_model(3);
  ASSERT_EQ(model.params()[0].name, "0.weight");
  ASSERT_EQ(model.params()[1].name, "1.weight");
  constexpr int kSteps = 6;
  std::vector<Batch> data;
  for (uint32_t i = 0; i < 3; ++i) data.push_back(token_batch(7, 50 + i));
  std::vector<float> want, want_out;
  std::vector<double> want_losses;
  for (size_t devices : {1, 2, 3}) {
    Engine engine(model, sgd(), cpu_devices(devices));
    std::vector<double> losses;
    for (int s = 0; s < kSteps; ++s) losses.push_back(engine.train_step(data[s % 3].x, data[s % 3].y));
    // accumulate() and step() split the i32 batch as train_step() does
    engine.accumulate(data[0].x.rows(0, 3), data[0].y.rows(0, 3));
    engine.accumulate(data[0].x.rows(3, 4), data[0].y.rows(3, 4));
    engine.step();
    const auto got = engine.params(0);
    engine.set_training(false);
    const Tensor out = engine.forward(data[1].x);
    const std::vector<float> got_out(out.f32(), out.f32() + out.numel());
    for (size_t r = 1; r < devices; ++r) EXPECT_EQ(engine.params(r), got) << "replica " << r;
    if (devices == 1) {
      want = got;
      want_out = got_out;
      want_losses = losses;
      EXPECT_GT(max_relative_error(got, model.values()), 1e-2);  // training moved them
      // The embedding rows no token named kept their initial values: their gradient is zero.
      for (int64_t i = (kVocab / 2) * kDim; i < kVocab * kDim; ++i)
        EXPECT_EQ(got[static_cast<size_t>(i)], model.values()[static_cast<size_t>(i)]);
      continue;
    }
    EXPECT_LT(max_relative_error(got, want), 1e-5) << devices << " devices";
    EXPECT_LT(max_relative_error(got_out, want_out), 1e-5) << devices << " devices: forward";
    for (int s = 0; s < kSteps; ++s) EXPECT_NEAR(losses[s], want_losses[s], 1e-5) << devices << " devices";
  }
}

// (B) indices: Embedding -> LayerNorm -> Linear, with Adam, on 3 devices and on one.
TEST(LayerNormEmbedding, OneDimensionalIndicesTrainOnThreeDevicesAsOne) {
  Model model(6);
  model.add(make_embedding(kVocab, kDim, 0));
  model.add(make_layernorm(kDim, 1e-5f, true));
  model.add(make_linear(kDim, kClasses, true));
  Tensor x = Tensor::empty(DType::kI32, Shape{8}, Device{}), y = Tensor::empty(DType::kI32, Shape{8}, Device{});
  for (int32_t i = 0; i < 8; ++i) x.i32()[i] = (i * 7) % static_cast<int32_t>(kVocab), y.i32()[i] = i % 5;
  OptimizerConfig adam;
  adam.kind = OptimizerKind::kAdam;
  adam.lr = 1e-2f;
  std::vector<float> want;
  for (size_t devices : {1, 3}) {
    Engine engine(model, adam, cpu_devices(devices));
    for (int s = 0; s < 5; ++s) engine.train_step(x, y);
    const auto got = engine.params(0);
    // The padding row (0, named by x[0]) starts at zero and stays there.
    for (int64_t e = 0; e < kDim; ++e) EXPECT_EQ(got[static_cast<size_t>(e)], 0.0f);
    for (size_t r = 1; r < devices; ++r) EXPECT_EQ(engine.params(r), got);
    if (devices == 1)
      want = got;
    else
      EXPECT_LT(max_relative_error(got, want), 1e-5);
  }
}

TEST(LayerNormEmbedding, EngineRefusesAnIndexOutOfRangeAndChangesNothing) {
  const Model model = token_model(4);
  Engine engine(model, sgd(), cpu_devices(2));
  Batch good = token_batch(5, 9);
  engine.train_step(good.x, good.y);
  const auto before = engine.params(0);
  Batch bad = token_batch(5, 10);
  bad.x.i32()[3 * kSeq + 2] = static_cast<int32_t>(kVocab);
  try {
    engine.train_step(bad.x, bad.y);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("index 11 at position (3, 2) is out of range [0, 11)"), std::string::npos)
        << e.what();
  }
  bad.x.i32()[3 * kSeq + 2] = -4;
  EXPECT_THROW(engine.forward(bad.x), Error);
  EXPECT_EQ(engine.params(0), before);
  EXPECT_EQ(engine.params(1), before);
  // f32 input to a model of indices: refused, naming both dtypes.
  try {
    engine.forward(Tensor::zeros(DType::kF32, Shape{2, kSeq}, Device{}));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("input must be i32"), std::string::npos) << e.what();
  }
  // It trains on afterwards, as an engine that never saw the bad batch.
  Engine fresh(model, sgd(), cpu_devices(2));
  fresh.train_step(good.x, good.y);
  engine.train_step(good.x, good.y);
  fresh.train_step(good.x, good.y);
  EXPECT_EQ(engine.params(0), fresh.params(0));
  EXPECT_NE(engine.params(0), before);
}

// A transformer block's feed-forward half with its residual: x + Linear(GELU(Linear(LayerNorm(x)))), x (B, D).
Model residual_block(uint64_t seed) {
  Model m(seed);
  m.add(make_layernorm(8, 1e-5f, true));
  m.add(make_linear(8, 16, true));
  m.add(make_activation(Activation::kGelu));
  const int32_t mlp = m.add(make_linear(16, 8, true));
  m.add_sum({mlp, kModelInput});
  return m;
}

TEST(LayerNormEmbedding, ResidualBlockTrainsOnTwoDevicesAsOne) {
  const Model model = residual_block(8);
  const int64_t rows = 9;
  const Tensor x = host_tensor(randn(static_cast<size_t>(rows * 8), 21, 2.0f, 0.5f), Shape{rows, 8});
  const Tensor y = host_tensor(randn(static_cast<size_t>(rows * 8), 22), Shape{rows, 8});
  std::vector<float> want;
  for (size_t devices : {1, 2}) {
    Engine engine(model, sgd(), cpu_devices(devices, LossKind::kMse));
    double first = 0, last = 0;
    for (int s = 0; s < 8; ++s) {
      last = engine.train_step(x, y);
      if (s == 0) first = last;
    }
    EXPECT_LT(last, first) << "training lowers the loss";
    const auto got = engine.params(0);
    if (devices == 1) {
      want = got;
      EXPECT_GT(max_relative_error(got, model.values()), 1e-3);
      continue;
    }
    EXPECT_EQ(engine.params(1), got);
    EXPECT_LT(max_relative_error(got, want), 1e-5);
  }
}

}  // namespace
