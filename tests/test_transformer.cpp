// What a transformer needs from the graph, on CPU replicas: learned positions, attention as a node of one packed
// input or of q, k and v (the same node among them included), nn.MultiheadAttention and nanoGPT's block builders,
// sequences through Linear, LayerNorm and GELU, all against central finite differences; nodes read by several sums
// and layers (a sum that overwrote a gradient another reader wrote first would fail them); causality; the packed
// projection equal to three separate ones; and the C ABI's refusals, each naming the value.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/error.h"
#include "dpar.h"
#include "engine_test_util.h"
#include "graph_check.h"
#include "kernels/cpu/gemm.h"
#include "nn/model.h"

// The example's GPT builder (C, through the C ABI): the model under test is the one train_char_gpt trains.
#include "char_gpt.h"

namespace dpar {
namespace {

using test::check_gradients;
using test::host;
using test::random_vector;
using test::Standalone;

AttentionSpec heads(int64_t h, bool causal) {
  AttentionSpec spec;
  spec.heads = h;
  spec.causal = causal;
  return spec;
}

// x (B, T, 4) -> linear 4 -> 6 -> + positions -> layernorm -> gelu -> linear 6 -> 3: sequences through the (*, C)
// layers and the positions' gradient.
TEST(Positions, GradientsMatchFiniteDifferences) {
  Model m(3);
  m.add(make_linear(4, 6, true));
  m.add(make_position_embedding(7, 6));
  m.add(make_layernorm(6, 1e-5f, true));
  m.add(make_activation(Activation::kGelu));
  m.add(make_linear(6, 3, true));
  check_gradients(m, Shape{3, 5, 4});
  check_gradients(m, Shape{2, 7, 4});  // every row of the table
}

TEST(Positions, AddRowTOfTheTableAtPositionT) {
  Model m(5);
  m.add(make_position_embedding(4, 3));
  std::vector<float> x = random_vector(2 * 3 * 3, 9);
  Standalone s;
  ReplicaModel rm(m, s.ctx);
  const Tensor out = rm.forward(s.ctx, host(x, Shape{2, 3, 3}));
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t t = 0; t < 3; ++t)
      for (int64_t c = 0; c < 3; ++c) {
        const int64_t i = (b * 3 + t) * 3 + c;
        EXPECT_EQ(out.f32()[i], x[static_cast<size_t>(i)] + m.values()[static_cast<size_t>(t * 3 + c)]);
      }
}

TEST(Positions, ASequenceLongerThanTheTableIsRefusedNamingBoth) {
  Model m(5);
  m.add(make_position_embedding(4, 3));
  try {
    m.output_shape(Shape{2, 5, 3});
    FAIL() << "a sequence of 5 positions passed a table of 4";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("5 positions is longer than the 4"), std::string::npos) << e.what();
  }
}

// x (B, T, C=8) -> c_attn 8 -> 24 -> attention (2 heads, packed) -> c_proj 8 -> 5.
Model packed_attention(bool causal, int64_t h = 2) {
  Model m(11);
  m.add(make_linear(8, 24, true));
  m.add(make_attention(heads(h, causal), 0.0f, 1));
  m.add(make_linear(8, 5, true));
  return m;
}

TEST(Attention, PackedProjectionGradientsMatchFiniteDifferences) {
  check_gradients(packed_attention(true), Shape{2, 5, 8});
  check_gradients(packed_attention(false), Shape{3, 4, 8});
  check_gradients(packed_attention(true, 1), Shape{2, 6, 8});
  check_gradients(packed_attention(true, 4), Shape{1, 7, 8});
}

// q, k and v from three nodes, and the same node as all three (self-attention on x itself): each input's gradient
// is the sum of its uses.
TEST(Attention, ThreeInputsAndOneNodeReadThriceMatchFiniteDifferences) {
  {
    Model m(12);
    const int32_t q = m.add(make_linear(6, 6, true));
    m.branch_from(kModelInput);
    const int32_t k = m.add(make_linear(6, 6, false));
    m.branch_from(kModelInput);
    const int32_t v = m.add(make_activation(Activation::kTanh));
    m.add(make_attention(heads(3, true), 0.0f, 3), {q, k, v});
    m.add(make_linear(6, 2, true));
    check_gradients(m, Shape{2, 4, 6});
  }
  {
    Model m(13);
    const int32_t x = m.add(make_linear(6, 6, true));
    const int32_t a = m.add(make_attention(heads(2, true), 0.0f, 3), {x, x, x});
    m.add_sum({a, x, a});  // x read by attention thrice and by the sum; a twice by the sum
    m.add(make_linear(6, 3, true));
    check_gradients(m, Shape{3, 5, 6});
  }
  {
    // Cross-attention: 6 queries against 3 keys (the input seen as (B, 3, 8)), not causal.
    Model m(14);
    const int32_t q = m.add(make_linear(4, 4, true));
    m.branch_from(kModelInput);
    m.add_reshape({3, 8});
    const int32_t k = m.add(make_linear(8, 4, true));
    const int32_t v = m.add(make_activation(Activation::kTanh));
    m.add(make_attention(heads(2, false), 0.0f, 3), {q, k, v});
    m.add(make_linear(4, 2, true));
    check_gradients(m, Shape{2, 6, 4});
  }
}

// Position t's output does not move when the inputs after t do (the causal mask), and does when they are not masked.
TEST(Attention, CausalOutputsIgnoreLaterPositions) {
  for (bool causal : {true, false}) {
    Model m = packed_attention(causal);
    Standalone s;
    ReplicaModel rm(m, s.ctx);
    std::vector<float> x = random_vector(1 * 6 * 8, 4);
    const std::vector<float> before = [&] {
      const Tensor out = rm.forward(s.ctx, host(x, Shape{1, 6, 8}));
      return std::vector<float>(out.f32(), out.f32() + out.numel());
    }();
    for (size_t i = 4 * 8; i < x.size(); ++i) x[i] += 1.0f;  // positions 4 and 5
    const Tensor out = rm.forward(s.ctx, host(x, Shape{1, 6, 8}));
    bool prefix_same = true;
    for (int64_t i = 0; i < 4 * 5; ++i) prefix_same = prefix_same && out.f32()[i] == before[static_cast<size_t>(i)];
    EXPECT_EQ(prefix_same, causal) << (causal ? "causal" : "full") << " attention";
  }
}

// One packed projection and three projections holding its thirds give the same output and gradients (to the
// rounding of GEMMs of other shapes).
TEST(Attention, PackedProjectionEqualsThreeProjections) {
  Model packed(21);
  packed.add(make_linear(8, 24, true));
  packed.add(make_attention(heads(2, true), 0.0f, 1));
  Model split(22);
  std::vector<int32_t> qkv;
  for (int i = 0; i < 3; ++i) {
    split.branch_from(kModelInput);
    qkv.push_back(split.add(make_linear(8, 8, true)));
  }
  split.add(make_attention(heads(2, true), 0.0f, 3), qkv);
  // The thirds: rows [8i, 8i + 8) of the packed weight and bias.
  const std::vector<float>& w = packed.values();
  std::vector<float>& sv = split.values();
  for (int i = 0; i < 3; ++i) {
    const int64_t base = i * (64 + 8);
    std::copy(w.begin() + i * 64, w.begin() + (i + 1) * 64, sv.begin() + base);
    std::copy(w.begin() + 192 + i * 8, w.begin() + 192 + (i + 1) * 8, sv.begin() + base + 64);
  }
  std::vector<float> x = random_vector(2 * 5 * 8, 6);
  Standalone s1, s2;
  ReplicaModel a(packed, s1.ctx), b(split, s2.ctx);
  const Tensor ya = a.forward(s1.ctx, host(x, Shape{2, 5, 8}));
  const Tensor yb = b.forward(s2.ctx, host(x, Shape{2, 5, 8}));
  ASSERT_EQ(ya.numel(), yb.numel());
  for (int64_t i = 0; i < ya.numel(); ++i) EXPECT_NEAR(ya.f32()[i], yb.f32()[i], 1e-5f) << i;
  std::vector<float> r = random_vector(static_cast<size_t>(ya.numel()), 7);
  std::vector<float> r2 = r;
  a.backward(s1.ctx, host(r, ya.shape()), false);
  b.backward(s2.ctx, host(r2, yb.shape()), false);
  for (int i = 0; i < 3; ++i)
    for (int64_t j = 0; j < 64; ++j)
      EXPECT_NEAR(a.grads()[i * 64 + j], b.grads()[i * 72 + j], 1e-4f) << "weight third " << i << "[" << j << "]";
}

// nn.MultiheadAttention's layer: its four parameters, their names, and its gradients.
TEST(Attention, MultiheadAttentionLayerMatchesFiniteDifferences) {
  Model m(31);
  m.add(make_linear(4, 8, true));
  const int32_t mha = m.add(make_multihead_attention(8, heads(2, true), 0.0f, true));
  m.set_node_name(mha, "attn");
  m.add(make_linear(8, 3, true));
  std::vector<std::string> names;
  for (const ParamInfo& p : m.params()) names.push_back(p.name);
  EXPECT_EQ(names, (std::vector<std::string>{"0.weight", "0.bias", "attn.in_proj_weight", "attn.in_proj_bias",
                                             "attn.out_proj.weight", "attn.out_proj.bias", "2.weight", "2.bias"}));
  check_gradients(m, Shape{2, 5, 4});
  Model no_bias(32);
  no_bias.add(make_multihead_attention(8, heads(4, false), 0.0f, false));
  EXPECT_EQ(no_bias.params().size(), 2u);
  check_gradients(no_bias, Shape{2, 3, 8});
}

// nanoGPT's block on a residual stream that every block reads: x + attn(ln_1(x)), then x + mlp(ln_2(x)), twice.
TEST(Attention, NanoGptBlocksMatchFiniteDifferences) {
  Model m(41);
  int32_t x = m.add(make_linear(5, 8, true));
  for (int layer = 0; layer < 2; ++layer) {
    m.branch_from(x);
    m.add(make_layernorm(8, 1e-5f, true));
    const int32_t a = add_causal_self_attention(m, 8, 2, 0.0f, true, "h." + std::to_string(layer) + ".attn");
    x = m.add_sum({x, a});
    m.add(make_layernorm(8, 1e-5f, true));
    m.add(make_linear(8, 32, true));
    m.add(make_activation(Activation::kGelu));
    const int32_t f = m.add(make_linear(32, 8, true));
    x = m.add_sum({x, f});
  }
  m.add(make_linear(8, 4, false));
  bool named = false;
  for (const ParamInfo& p : m.params()) named = named || p.name == "h.1.attn.c_proj.bias";
  EXPECT_TRUE(named);
  check_gradients(m, Shape{2, 6, 5});
}

// Dropout on the attention weights is the identity in eval mode, and draws a mask in training mode.
TEST(Attention, DropoutActsInTrainingModeOnly) {
  Model with(51), without(51);
  with.add(make_linear(8, 24, true));
  with.add(make_attention(heads(2, true), 0.5f, 1));
  without.add(make_linear(8, 24, true));
  without.add(make_attention(heads(2, true), 0.0f, 1));
  std::vector<float> x = random_vector(2 * 5 * 8, 8);
  Standalone s1, s2;
  ReplicaModel a(with, s1.ctx), b(without, s2.ctx);
  s1.ctx.training = s2.ctx.training = false;
  const Tensor ya = a.forward(s1.ctx, host(x, Shape{2, 5, 8}));
  const std::vector<float> eval(ya.f32(), ya.f32() + ya.numel());
  const Tensor yb = b.forward(s2.ctx, host(x, Shape{2, 5, 8}));
  EXPECT_EQ(0, std::memcmp(eval.data(), yb.f32(), eval.size() * sizeof(float)));
  s1.ctx.training = true;
  const Tensor yt = a.forward(s1.ctx, host(x, Shape{2, 5, 8}));
  EXPECT_NE(0, std::memcmp(eval.data(), yt.f32(), eval.size() * sizeof(float)));
  EXPECT_GT(s1.rng_offset, 0u);
}

// ---- The C ABI ------------------------------------------------------------------------------------------------

struct ModelDeleter {
  void operator()(dpar_model* m) const { dpar_model_free(m); }
};
using ModelPtr = std::unique_ptr<dpar_model, ModelDeleter>;

ModelPtr c_model() {
  dpar_model* raw = nullptr;
  EXPECT_EQ(dpar_model_create(&raw, nullptr), DPAR_OK);
  return ModelPtr(raw);
}

void expect_refused(dpar_status st, dpar_status want, const std::string& says) {
  EXPECT_EQ(st, want) << dpar_last_error();
  EXPECT_NE(std::string(dpar_last_error()).find(says), std::string::npos) << dpar_last_error();
}

TEST(TransformerCapi, BadArgumentsAreRefusedNamingTheValue) {
  ModelPtr m = c_model();
  expect_refused(dpar_model_add_position_embedding(m.get(), 0, 8), DPAR_ERR_INVALID_ARGUMENT, "max_positions: 0");
  expect_refused(dpar_model_add_position_embedding(nullptr, 4, 8), DPAR_ERR_INVALID_ARGUMENT, "model");
  expect_refused(dpar_model_add_attention(m.get(), nullptr, 0, 0, 1, 0.0f, 0.0f), DPAR_ERR_INVALID_ARGUMENT,
                 "num_heads: 0");
  expect_refused(dpar_model_add_attention(m.get(), nullptr, 0, 2, 1, 1.0f, 0.0f), DPAR_ERR_INVALID_ARGUMENT,
                 "dropout_p: 1");
  expect_refused(dpar_model_add_attention(m.get(), nullptr, 0, 2, 1, 0.0f, -1.0f), DPAR_ERR_INVALID_ARGUMENT,
                 "scale: -1");
  const int32_t two[2] = {DPAR_MODEL_INPUT, DPAR_MODEL_INPUT};
  expect_refused(dpar_model_add_attention(m.get(), two, 2, 2, 1, 0.0f, 0.0f), DPAR_ERR_INVALID_ARGUMENT, "n: 2");
  expect_refused(dpar_model_add_attention(m.get(), nullptr, 3, 2, 1, 0.0f, 0.0f), DPAR_ERR_INVALID_ARGUMENT,
                 "inputs: is NULL");
  const int32_t missing[3] = {DPAR_MODEL_INPUT, 5, DPAR_MODEL_INPUT};
  expect_refused(dpar_model_add_attention(m.get(), missing, 3, 2, 1, 0.0f, 0.0f), DPAR_ERR_INVALID_ARGUMENT,
                 "node 5 has not been added");
  expect_refused(dpar_model_add_multihead_attention(m.get(), 10, 4, 0.0f, 1, 1), DPAR_ERR_INVALID_ARGUMENT,
                 "num_heads: 4 does not divide embed_dim 10");
  expect_refused(dpar_model_add_causal_self_attention(m.get(), 12, 5, 0.0f, 1, "attn"), DPAR_ERR_INVALID_ARGUMENT,
                 "n_head: 5");
  size_t nodes = 99;
  ASSERT_EQ(dpar_model_num_layers(&nodes, m.get()), DPAR_OK);
  EXPECT_EQ(nodes, 0u) << "a refused call added a node";
  // A name taken half-way through the block: nothing of the block stays.
  ASSERT_EQ(dpar_model_add_linear(m.get(), 4, 4, 1), DPAR_OK);
  ASSERT_EQ(dpar_model_set_node_name(m.get(), 0, "attn.c_proj"), DPAR_OK);
  expect_refused(dpar_model_add_causal_self_attention(m.get(), 4, 2, 0.0f, 1, "attn"), DPAR_ERR_INVALID_ARGUMENT,
                 "attn.c_proj");
  ASSERT_EQ(dpar_model_num_layers(&nodes, m.get()), DPAR_OK);
  EXPECT_EQ(nodes, 1u);
  size_t params = 0;
  ASSERT_EQ(dpar_model_num_params(&params, m.get()), DPAR_OK);
  EXPECT_EQ(params, 2u);
}

// Shapes that do not fit are refused when an engine first meets them, naming the values, and nothing moves.
TEST(TransformerCapi, ShapesThatDisagreeAreRefusedAtTheFirstStep) {
  auto forward_error = [](dpar_model* m, std::vector<int64_t> shape) {
    dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
    eo.num_cpu_devices = 1;
    eo.loss = DPAR_LOSS_MSE;
    dpar_optimizer_options oo = DPAR_OPTIMIZER_OPTIONS_INIT;
    dpar_engine* e = nullptr;
    EXPECT_EQ(dpar_engine_create(&e, m, &oo, &eo), DPAR_OK) << dpar_last_error();
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float> x(static_cast<size_t>(n), 0.5f);
    dpar_tensor* in = nullptr;
    EXPECT_EQ(dpar_tensor_wrap_host(&in, DPAR_F32, shape.data(), shape.size(), x.data()), DPAR_OK);
    dpar_tensor* out = nullptr;
    const dpar_status st = dpar_engine_forward(&out, e, in);
    const std::string message = dpar_last_error();
    dpar_tensor_free(out);
    dpar_tensor_free(in);
    dpar_engine_free(e);
    EXPECT_EQ(st, DPAR_ERR_INVALID_ARGUMENT);
    return message;
  };
  {
    ModelPtr m = c_model();
    ASSERT_EQ(dpar_model_add_attention(m.get(), nullptr, 0, 4, 1, 0.0f, 0.0f), DPAR_OK);
    EXPECT_NE(forward_error(m.get(), {2, 3, 30}).find("4 heads do not divide the 10 channels"), std::string::npos);
    EXPECT_NE(forward_error(m.get(), {2, 3, 31}).find("3 x channels"), std::string::npos);
  }
  {
    ModelPtr m = c_model();
    ASSERT_EQ(dpar_model_add_linear(m.get(), 4, 4, 1), DPAR_OK);
    ASSERT_EQ(dpar_model_branch_from(m.get(), DPAR_MODEL_INPUT), DPAR_OK);
    const int64_t row[2] = {2, 8};
    ASSERT_EQ(dpar_model_add_reshape(m.get(), row, 2), DPAR_OK);
    const int32_t qkv[3] = {0, 1, 1};
    ASSERT_EQ(dpar_model_add_attention(m.get(), qkv, 3, 2, 1, 0.0f, 0.0f), DPAR_OK);
    const std::string why = forward_error(m.get(), {2, 4, 4});
    EXPECT_NE(why.find("q (2, 4, 4) and k (2, 2, 8) must agree"), std::string::npos) << why;
  }
  {
    ModelPtr m = c_model();
    ASSERT_EQ(dpar_model_add_position_embedding(m.get(), 3, 4), DPAR_OK);
    const std::string why = forward_error(m.get(), {2, 5, 4});
    EXPECT_NE(why.find("5 positions is longer than the 3"), std::string::npos) << why;
  }
}


// ---- The whole GPT: examples/c/char_gpt.h's model against PyTorch's nanoGPT, and over several devices -------------

struct EngineDeleter {
  void operator()(dpar_engine* e) const { dpar_engine_free(e); }
};
using EnginePtr = std::unique_ptr<dpar_engine, EngineDeleter>;

nlohmann::json gpt_reference() {
  std::ifstream f(std::string(DPAR_TEST_DATA_DIR) + "/gpt_reference.json");
  EXPECT_TRUE(f.good()) << "tests/data/gpt_reference.json";
  return nlohmann::json::parse(f);
}

gpt_config reference_config(const nlohmann::json& r) {
  return gpt_config{r["vocab"].get<int64_t>(), r["block"].get<int64_t>(), r["layers"].get<int64_t>(),
                    r["heads"].get<int64_t>(), r["embd"].get<int64_t>(), 0.0f};
}

// The model with PyTorch's parameters, found by name.
ModelPtr reference_gpt(const nlohmann::json& r) {
  const gpt_config c = reference_config(r);
  ModelPtr m(gpt_build(&c, 0));
  size_t n = 0;
  EXPECT_EQ(dpar_model_num_params(&n, m.get()), DPAR_OK);
  EXPECT_EQ(n, r["params"].size()) << "the tied weight is one parameter, as named_parameters() lists it";
  for (size_t i = 0; i < n; ++i) {
    const std::string name = dpar_model_param_name(m.get(), i);
    EXPECT_TRUE(r["params"].contains(name)) << name;
    if (!r["params"].contains(name)) continue;
    const std::vector<float> v = r["params"][name].get<std::vector<float>>();
    EXPECT_EQ(dpar_model_set_param(m.get(), i, v.data(), v.size()), DPAR_OK) << name << ": " << dpar_last_error();
  }
  return m;
}

EnginePtr gpt_engine(const dpar_model* m, size_t devices, int32_t optimizer, float lr, size_t bucket_bytes = 0) {
  dpar_optimizer_options oo = DPAR_OPTIMIZER_OPTIONS_INIT;
  oo.kind = optimizer;
  oo.lr = lr;
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = devices;
  if (bucket_bytes) eo.bucket_cap_bytes = bucket_bytes, eo.first_bucket_bytes = bucket_bytes;
  dpar_engine* e = nullptr;
  EXPECT_EQ(dpar_engine_create(&e, m, &oo, &eo), DPAR_OK) << dpar_last_error();
  return EnginePtr(e);
}

std::vector<float> engine_params(dpar_engine* e, size_t replica, const dpar_model* m) {
  size_t n = 0;
  EXPECT_EQ(dpar_model_num_param_elements(&n, m), DPAR_OK);
  std::vector<float> v(n);
  EXPECT_EQ(dpar_engine_get_params(v.data(), e, replica, n), DPAR_OK) << dpar_last_error();
  return v;
}

// One SGD step of lr 1 of the reference GPT on the reference batch, on `devices` CPU devices in `precision`: the
// loss, and how far each parameter moved (its gradient; lr 1), per parameter in the model's order and flat.
struct GptStep {
  dpar_status precision_status = DPAR_OK;  // dpar_engine_set_precision's; no step is taken unless it is DPAR_OK
  float loss = 0.0f;
  std::vector<std::string> names;
  std::vector<std::vector<double>> moved;
  std::vector<double> flat;
};
GptStep gpt_step(const nlohmann::json& r, size_t devices, int32_t precision) {
  GptStep s;
  ModelPtr m = reference_gpt(r);
  EnginePtr e = gpt_engine(m.get(), devices, DPAR_SGD, 1.0f);
  if (precision != DPAR_F32) {
    s.precision_status = dpar_engine_set_precision(e.get(), precision);
    if (s.precision_status != DPAR_OK) return s;
  }
  std::vector<int32_t> tokens = r["tokens"].get<std::vector<int32_t>>();
  std::vector<int32_t> targets = r["targets"].get<std::vector<int32_t>>();
  const std::vector<int64_t> shape = r["shape"].get<std::vector<int64_t>>();
  dpar_tensor *x = nullptr, *y = nullptr;
  EXPECT_EQ(dpar_tensor_wrap_host(&x, DPAR_I32, shape.data(), 2, tokens.data()), DPAR_OK);
  EXPECT_EQ(dpar_tensor_wrap_host(&y, DPAR_I32, shape.data(), 2, targets.data()), DPAR_OK);
  const std::vector<float> before = engine_params(e.get(), 0, m.get());
  EXPECT_EQ(dpar_engine_train_step(&s.loss, e.get(), x, y), DPAR_OK) << dpar_last_error();
  dpar_tensor_free(x);
  dpar_tensor_free(y);
  const std::vector<float> after = engine_params(e.get(), 0, m.get());
  for (size_t k = 0; k < before.size(); ++k) s.flat.push_back(static_cast<double>(before[k]) - after[k]);
  size_t n = 0, offset = 0;
  EXPECT_EQ(dpar_model_num_params(&n, m.get()), DPAR_OK);
  for (size_t i = 0; i < n; ++i) {
    s.names.push_back(dpar_model_param_name(m.get(), i));
    const size_t count = r["grads"][s.names.back()].size();
    s.moved.emplace_back(s.flat.begin() + static_cast<ptrdiff_t>(offset),
                         s.flat.begin() + static_cast<ptrdiff_t>(offset + count));
    offset += count;
  }
  return s;
}

// dpar's GPT and PyTorch's nanoGPT agree on one batch's loss (over the targets not ignored) and on every gradient:
// one SGD step of lr 1 moves each parameter by its gradient.
TEST(Gpt, LossAndGradientsEqualPyTorchsNanoGpt) {
  const nlohmann::json r = gpt_reference();
  const GptStep s = gpt_step(r, 1, DPAR_F32);
  EXPECT_NEAR(s.loss, r["loss"].get<double>(), 2e-6);
  for (size_t i = 0; i < s.names.size(); ++i) {
    const std::vector<float> g = r["grads"][s.names[i]].get<std::vector<float>>();
    ASSERT_EQ(s.moved[i].size(), g.size()) << s.names[i];
    for (size_t k = 0; k < g.size(); ++k)
      EXPECT_NEAR(s.moved[i][k], g[k], 1e-5 + 1e-4 * std::fabs(g[k])) << s.names[i] << "[" << k << "]";
  }
}

// The largest difference between a and b over the largest magnitude of b.
double relative_gap(const std::vector<double>& a, const std::vector<float>& b) {
  double gap = 0.0, scale = 1e-30;
  for (size_t k = 0; k < b.size(); ++k) {
    gap = std::max(gap, std::fabs(a[k] - b[k]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[k])));
  }
  return gap / scale;
}

// Under the bf16 policy the GPT's step stays within bf16's rounding of nanoGPT's under torch.autocast (CPU, bf16):
// the loss, and every gradient (attention in bf16 in both, LayerNorm and the loss in f32), and on the whole closer
// to autocast's than the f32 step is.
TEST(Gpt, Bf16StepStaysWithinBf16RoundingOfNanoGptUnderAutocast) {
  const nlohmann::json r = gpt_reference();
  const nlohmann::json& autocast = r["autocast"];
  const GptStep f32 = gpt_step(r, 1, DPAR_F32), bf16 = gpt_step(r, 1, DPAR_BF16);
  if (bf16.precision_status == DPAR_ERR_NOT_SUPPORTED) GTEST_SKIP() << "no bf16 here: " << dpar_last_error();
  ASSERT_EQ(bf16.precision_status, DPAR_OK) << dpar_last_error();
  EXPECT_NEAR(bf16.loss, autocast["loss"].get<double>(), 2e-3);
  double gap_sum[2] = {0.0, 0.0};
  for (size_t i = 0; i < bf16.names.size(); ++i) {
    const std::vector<float> want = autocast["grads"][bf16.names[i]].get<std::vector<float>>();
    const double gap = relative_gap(bf16.moved[i], want);
    EXPECT_LT(gap, 3e-2) << bf16.names[i];
    gap_sum[1] += gap;
    gap_sum[0] += relative_gap(f32.moved[i], want);
  }
  std::printf("mean relative gap to autocast's gradients over the GPT's parameters: f32 %.5f, bf16 %.5f\n",
              gap_sum[0] / static_cast<double>(r["grads"].size()), gap_sum[1] / static_cast<double>(r["grads"].size()));
  EXPECT_LT(gap_sum[1], gap_sum[0]);
}

// The GPT's checkpoint is nanoGPT's state_dict: every key PyTorch's module has (the tied weight under both).
TEST(Gpt, CheckpointHoldsEveryStateDictKey) {
  const nlohmann::json r = gpt_reference();
  ModelPtr m = reference_gpt(r);
  EnginePtr e = gpt_engine(m.get(), 1, DPAR_ADAM, 1e-3f);
  const std::string path = ::testing::TempDir() + "gpt_keys.safetensors";
  ASSERT_EQ(dpar_engine_save(e.get(), path.c_str()), DPAR_OK) << dpar_last_error();
  std::ifstream f(path, std::ios::binary);
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  std::string header(static_cast<size_t>(n), '\0');
  f.read(header.data(), static_cast<std::streamsize>(n));
  const nlohmann::json h = nlohmann::json::parse(header);
  for (const auto& key : r["state_dict_keys"]) EXPECT_TRUE(h.contains(key.get<std::string>())) << key;
  std::remove(path.c_str());
}

// nn.MultiheadAttention's layer against PyTorch's module (causal self-attention, biases): the output and every
// parameter's gradient (the input's gradient is checked by finite differences above, through a layer in front).
TEST(Gpt, MultiheadAttentionEqualsPyTorchsModule) {
  const nlohmann::json r = gpt_reference()["mha"];
  Model m(1);
  m.add(make_multihead_attention(8, heads(2, true), 0.0f, true));
  std::vector<float>& values = m.values();
  for (const ParamInfo& p : m.params()) {
    const std::vector<float> v = r["params"][p.name.substr(2)].get<std::vector<float>>();  // "0.in_proj_weight"
    ASSERT_EQ(static_cast<int64_t>(v.size()), p.shape.numel()) << p.name;
    std::copy(v.begin(), v.end(), values.begin() + p.offset);
  }
  std::vector<float> x = r["x"].get<std::vector<float>>(), dout = r["dout"].get<std::vector<float>>();
  Standalone s;
  ReplicaModel rm(m, s.ctx);
  const Tensor y = rm.forward(s.ctx, host(x, Shape{2, 5, 8}));
  const std::vector<float> want = r["output"].get<std::vector<float>>();
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(y.f32()[i], want[i], 2e-6 + 1e-5 * std::fabs(want[i])) << i;
  rm.backward(s.ctx, host(dout, Shape{2, 5, 8}), false);
  for (const ParamInfo& p : m.params()) {
    const std::vector<float> g = r["grads"][p.name.substr(2)].get<std::vector<float>>();
    for (size_t k = 0; k < g.size(); ++k)
      EXPECT_NEAR(rm.grads()[static_cast<size_t>(p.offset) + k], g[k], 2e-5 + 1e-4 * std::fabs(g[k]))
          << p.name << "[" << k << "]";
  }
}

// Under a bf16 policy nn.MultiheadAttention's projections and its heads compute in bf16 (the heads on q|k|v rounded
// from the f32 projection): its output and gradients within bf16's rounding of PyTorch's f32 module, and not equal
// to them.
TEST(Gpt, MultiheadAttentionInBf16StaysWithinBf16RoundingOfPyTorchsModule) {
  const char* why = "";
  if (!kernels::cpu::bf16_support(&why)) GTEST_SKIP() << "no bf16 here: " << why;
  const nlohmann::json r = gpt_reference()["mha"];
  Model m(1);
  m.add(make_multihead_attention(8, heads(2, true), 0.0f, true));
  std::vector<float>& values = m.values();
  for (const ParamInfo& p : m.params()) {
    const std::vector<float> v = r["params"][p.name.substr(2)].get<std::vector<float>>();
    std::copy(v.begin(), v.end(), values.begin() + p.offset);
  }
  std::vector<float> x = r["x"].get<std::vector<float>>(), dout = r["dout"].get<std::vector<float>>();
  Standalone s;
  ReplicaModel rm(m, s.ctx);
  rm.set_compute_dtype(s.ctx, DType::kBF16);
  const Tensor y = rm.forward(s.ctx, host(x, Shape{2, 5, 8}));
  // The largest difference from `want` over want's largest magnitude.
  auto gap = [](const float* got, const std::vector<float>& want) {
    double g = 0.0, scale = 1e-30;
    for (size_t i = 0; i < want.size(); ++i) {
      g = std::max(g, std::fabs(static_cast<double>(got[i]) - want[i]));
      scale = std::max(scale, std::fabs(static_cast<double>(want[i])));
    }
    return g / scale;
  };
  const double out_gap = gap(y.f32(), r["output"].get<std::vector<float>>());
  EXPECT_LT(out_gap, 2e-2);
  EXPECT_GT(out_gap, 1e-5) << "the bf16 policy computed the module in f32";
  rm.backward(s.ctx, host(dout, Shape{2, 5, 8}), false);
  for (const ParamInfo& p : m.params()) {
    const std::vector<float> g = r["grads"][p.name.substr(2)].get<std::vector<float>>();
    EXPECT_LT(gap(rm.grads() + p.offset, g), 3e-2) << p.name;
  }
}

// 1, 2, 3 and 8 devices train the GPT as one device on the whole batch: 7 sequences (uneven chunks), ignored
// targets spread unevenly (one sequence all ignored), three SGD steps, small buckets; every replica the same. SGD,
// not Adam: Adam divides each gradient by its running magnitude, so an element whose gradient is at the level of
// float rounding (1e-9 where another summation order gives -1e-9) takes a step of lr either way, and a comparison
// across device counts would measure that, not the engine (with Adam at lr 1e-2 the worst element moved 2.5e-3).
TEST(Gpt, DevicesTrainAsOneDeviceWithIgnoredTokensSpreadUnevenly) {
  const nlohmann::json r = gpt_reference();
  ModelPtr m = reference_gpt(r);
  const int64_t B = 7, T = 6, V = r["vocab"].get<int64_t>();
  std::vector<int32_t> tokens(static_cast<size_t>(B * T)), targets(tokens.size());
  uint64_t rng = 5;
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<int32_t>(gpt_next_u64(&rng) % static_cast<uint64_t>(V));
    targets[i] = static_cast<int32_t>(gpt_next_u64(&rng) % static_cast<uint64_t>(V));
    if (i / T == 3 || (i / T == 5 && i % 2 == 0) || i == 1) targets[i] = DPAR_IGNORE_INDEX;
  }
  const int64_t shape[2] = {B, T};
  dpar_tensor *x = nullptr, *y = nullptr;
  ASSERT_EQ(dpar_tensor_wrap_host(&x, DPAR_I32, shape, 2, tokens.data()), DPAR_OK);
  ASSERT_EQ(dpar_tensor_wrap_host(&y, DPAR_I32, shape, 2, targets.data()), DPAR_OK);
  std::vector<float> one;
  std::vector<float> one_losses;
  for (size_t devices : {1, 2, 3, 8}) {
    EnginePtr e = gpt_engine(m.get(), devices, DPAR_SGD, 0.5f, 4096);
    std::vector<float> losses;
    for (int step = 0; step < 3; ++step) {
      float loss = 0.0f;
      ASSERT_EQ(dpar_engine_train_step(&loss, e.get(), x, y), DPAR_OK) << dpar_last_error();
      losses.push_back(loss);
    }
    const std::vector<float> p = engine_params(e.get(), 0, m.get());
    for (size_t rep = 1; rep < devices; ++rep)
      EXPECT_EQ(engine_params(e.get(), rep, m.get()), p) << "replica " << rep << " of " << devices;
    if (devices == 1) {
      one = p, one_losses = losses;
      continue;
    }
    for (size_t s = 0; s < losses.size(); ++s) EXPECT_NEAR(losses[s], one_losses[s], 1e-5) << devices << " devices";
    double worst = 0.0;
    for (size_t i = 0; i < p.size(); ++i) worst = std::max(worst, std::fabs(static_cast<double>(p[i]) - one[i]));
    EXPECT_LT(worst, 2e-6) << devices << " devices differ from one device by " << worst;
  }
  dpar_tensor_free(x);
  dpar_tensor_free(y);
}

// The bf16 policy on the GPT (linear layers, nn.MultiheadAttention's projections and attention in bf16): one
// batch's loss and gradients within bf16's rounding of f32's, visibly not f32's, and 1 device = 3 devices within
// f32 summation order (every bf16 product is exact, and attention is computed per sequence).
TEST(Gpt, Bf16PolicyStaysWithinBf16RoundingAndAcrossDevices) {
  const nlohmann::json r = gpt_reference();
  const GptStep s32 = gpt_step(r, 1, DPAR_F32), s16 = gpt_step(r, 1, DPAR_BF16);
  if (s16.precision_status == DPAR_ERR_NOT_SUPPORTED) GTEST_SKIP() << "no bf16 here: " << dpar_last_error();
  ASSERT_EQ(s16.precision_status, DPAR_OK) << dpar_last_error();
  const GptStep s16x3 = gpt_step(r, 3, DPAR_BF16);
  double scale = 0, gap32 = 0, gap3 = 0;
  for (size_t i = 0; i < s32.flat.size(); ++i) {
    scale = std::max(scale, std::fabs(s32.flat[i]));
    gap32 = std::max(gap32, std::fabs(s16.flat[i] - s32.flat[i]));
    gap3 = std::max(gap3, std::fabs(s16x3.flat[i] - s16.flat[i]));
  }
  EXPECT_NEAR(s16.loss, s32.loss, 1e-2 * std::fabs(s32.loss));
  EXPECT_GT(std::fabs(s16.loss - s32.loss), 0.0f) << "bf16 computed nothing in bf16";
  EXPECT_LT(gap32, 3e-2 * scale);
  EXPECT_GT(gap32, 1e-4 * scale) << "bf16's gradients are f32's";
  EXPECT_NEAR(s16x3.loss, s16.loss, 1e-5);
  EXPECT_LT(gap3, 5e-4 * scale);
}

}  // namespace
}  // namespace dpar
