// The model as a graph: residual and concatenation models against hand computations and finite differences,
// views that alias memory, the gradient buffer plan, node names, refused graphs, and the engine on 1, 2 and 3 CPU
// devices through the C ABI (equal to one device on the full batch; replicas bit-identical; checkpoints by name);
// the fusion pass (a ReLU as the epilogue of the layer before it, never where another node reads that layer) and
// sums that add to a gradient another reader wrote first, against the unfused graph and finite differences.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "common/error.h"
#include "dpar.h"
#include "nn/model.h"
#include "engine_test_util.h"
#include "graph_check.h"

namespace dpar {
namespace {

using test::Standalone;
using test::check_gradients;
using test::host;
using test::random_vector;
using test::weighted_output;

// x -> linear -> tanh -> linear, summed with x; a linear layer in front so that the block's input gradient shows.
Model residual_model(Activation act = Activation::kTanh) {
  Model m(7);
  m.add(make_linear(4, 4, true));   // 0
  m.add(make_linear(4, 6, true));   // 1
  m.add(make_activation(act));      // 2
  m.add(make_linear(6, 4, true));   // 3
  m.add_sum({3, 0});                // 4
  return m;
}

// The same block with a projection shortcut: linear(4 -> 5) without bias on the skip path.
Model projection_model() {
  Model m(8);
  m.add(make_linear(4, 4, true));   // 0
  m.add(make_linear(4, 6, true));   // 1
  m.add(make_activation(Activation::kTanh));
  m.add(make_linear(6, 5, true));   // 3
  m.branch_from(0);
  m.add(make_linear(4, 5, false));  // 4
  m.add_sum({3, 4});                // 5
  return m;
}

// Node 0 feeds three nodes: two branches and the concatenation itself.
Model concat_model() {
  Model m(9);
  m.add(make_linear(4, 4, true));   // 0
  m.add(make_linear(4, 3, true));   // 1
  m.branch_from(0);
  m.add(make_linear(4, 2, true));   // 2
  m.add_concat({1, 2, 0});          // 3: (B, 9)
  m.add(make_activation(Activation::kTanh));
  m.add(make_linear(9, 2, true));   // 5
  return m;
}

TEST(Graph, ResidualForwardIsTheHandComputation) {
  for (Activation act : {Activation::kRelu, Activation::kTanh}) {
    Model m = residual_model(act);
    const int64_t B = 3;
    std::vector<float> x = random_vector(B * 4, 3);
    Standalone s;
    ReplicaModel rm(m, s.ctx);
    const Tensor out = rm.forward(s.ctx, host(x, Shape{B, 4}));
    ASSERT_EQ(out.shape(), (Shape{B, 4}));
    const float* v = m.values().data();
    auto linear = [&](const std::vector<float>& in, int64_t cin, int64_t cout, const ParamInfo& w, const ParamInfo* b) {
      std::vector<float> y(static_cast<size_t>(B * cout));
      for (int64_t i = 0; i < B; ++i)
        for (int64_t o = 0; o < cout; ++o) {
          double acc = b ? v[b->offset + o] : 0.0;
          for (int64_t c = 0; c < cin; ++c) acc += double(in[i * cin + c]) * v[w.offset + o * cin + c];
          y[static_cast<size_t>(i * cout + o)] = static_cast<float>(acc);
        }
      return y;
    };
    const auto& p = m.params();
    const std::vector<float> h0 = linear(x, 4, 4, p[0], &p[1]);
    std::vector<float> h1 = linear(h0, 4, 6, p[2], &p[3]);
    for (float& e : h1) e = act == Activation::kRelu ? std::max(e, 0.0f) : std::tanh(e);
    const std::vector<float> h3 = linear(h1, 6, 4, p[4], &p[5]);
    for (size_t i = 0; i < h3.size(); ++i) EXPECT_NEAR(out.f32()[i], h3[i] + h0[i], 1e-5) << i;
  }
}

TEST(Graph, ResidualGradientsMatchFiniteDifferences) {
  check_gradients(residual_model(), Shape{3, 4});
  check_gradients(residual_model(), Shape{3, 4}, /*external=*/true);
}

TEST(Graph, ProjectionShortcutGradientsMatchFiniteDifferences) { check_gradients(projection_model(), Shape{3, 4}); }

TEST(Graph, ConcatForwardAndGradients) {
  Model m = concat_model();
  const int64_t B = 2;
  std::vector<float> x = random_vector(B * 4, 4);
  Standalone s;
  ReplicaModel rm(m, s.ctx);
  rm.forward(s.ctx, host(x, Shape{B, 4}));
  const Tensor cat = rm.node_output(3);
  ASSERT_EQ(cat.shape(), (Shape{B, 9}));
  const Tensor a = rm.node_output(1), b = rm.node_output(2), c = rm.node_output(0);
  for (int64_t i = 0; i < B; ++i) {
    for (int64_t j = 0; j < 3; ++j) EXPECT_EQ(cat.f32()[i * 9 + j], a.f32()[i * 3 + j]);
    for (int64_t j = 0; j < 2; ++j) EXPECT_EQ(cat.f32()[i * 9 + 3 + j], b.f32()[i * 2 + j]);
    for (int64_t j = 0; j < 4; ++j) EXPECT_EQ(cat.f32()[i * 9 + 5 + j], c.f32()[i * 4 + j]);
  }
  check_gradients(m, Shape{B, 4});
  check_gradients(m, Shape{B, 4}, /*external=*/true);
}

TEST(Graph, NodeWithThreeConsumersSumsTheirGradients) {
  Model m(10);
  m.add(make_linear(4, 4, true));             // 0: read by 1, 2 and 3
  m.add(make_activation(Activation::kTanh));  // 1
  m.branch_from(0);
  m.add(make_linear(4, 4, true));             // 2
  m.add_sum({0, 1, 2});                       // 3
  m.add(make_linear(4, 3, true));             // 4
  check_gradients(m, Shape{3, 4});
}

// (B, 4) -> linear -> (B, 8) -> reshape (2, 2, 2) -> concat with its tanh along the channels -> flatten -> linear.
Model view_model() {
  Model m(11);
  m.add(make_linear(4, 8, true));              // 0
  m.add_reshape({2, 2, 2});                    // 1: a view of 0
  m.add(make_activation(Activation::kTanh));   // 2
  m.add_concat({1, 2});                        // 3: (B, 4, 2, 2)
  m.add_flatten();                             // 4: a view of 3
  m.add(make_linear(16, 3, true));             // 5
  return m;
}

TEST(Graph, FlattenAndReshapeAliasTheirInput) {
  Model m = view_model();
  EXPECT_EQ(m.output_shape(Shape{2, 4}), (Shape{2, 3}));
  std::vector<float> x = random_vector(8, 5);
  Standalone s;
  ReplicaModel rm(m, s.ctx);
  rm.forward(s.ctx, host(x, Shape{2, 4}));
  EXPECT_EQ(rm.node_output(1).raw(), rm.node_output(0).raw());
  EXPECT_EQ(rm.node_output(1).shape(), (Shape{2, 2, 2, 2}));
  EXPECT_EQ(rm.node_output(4).raw(), rm.node_output(3).raw());
  EXPECT_EQ(rm.node_output(4).shape(), (Shape{2, 16}));
  // Channels first: sample i's row is node 1's 8 values, then node 2's.
  const Tensor cat = rm.node_output(3), a = rm.node_output(1), b = rm.node_output(2);
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t j = 0; j < 8; ++j) {
      EXPECT_EQ(cat.f32()[i * 16 + j], a.f32()[i * 8 + j]);
      EXPECT_EQ(cat.f32()[i * 16 + 8 + j], b.f32()[i * 8 + j]);
    }
  check_gradients(m, Shape{2, 4});
  // A model ending in a view: its output and its output gradient are the viewed node's memory.
  Model tail(12);
  tail.add(make_linear(4, 6, true));
  tail.add_reshape({2, 3});
  Standalone s2;
  ReplicaModel rt(tail, s2.ctx);
  const Tensor out = rt.forward(s2.ctx, host(x, Shape{2, 4}));
  EXPECT_EQ(out.raw(), rt.node_output(0).raw());
  EXPECT_EQ(rt.output_grad_buffer(s2.ctx).shape(), (Shape{2, 2, 3}));
  check_gradients(tail, Shape{2, 4});
  check_gradients(tail, Shape{2, 4}, /*external=*/true);
  // A model of views alone: its output is the input's memory, and backward has nothing to compute.
  Model only(13);
  only.add_reshape({2, 2});
  only.add_flatten();
  Standalone s3;
  ReplicaModel ro(only, s3.ctx);
  const Tensor same = ro.forward(s3.ctx, host(x, Shape{2, 4}));
  EXPECT_EQ(same.raw(), static_cast<void*>(x.data()));
  EXPECT_EQ(same.shape(), (Shape{2, 4}));
  const Tensor g = ro.output_grad_buffer(s3.ctx);
  EXPECT_EQ(g.shape(), (Shape{2, 4}));
  ro.backward(s3.ctx, g, false);
  EXPECT_FALSE(ro.has_forward_state());
}

TEST(Graph, GradientBuffersArePlannedByLiveness) {
  Model mlp(13);
  for (int i = 0; i < 4; ++i) {
    mlp.add(make_linear(8, 8, true));
    mlp.add(make_activation(i % 2 ? Activation::kRelu : Activation::kTanh));
  }
  mlp.add(make_linear(8, 2, true));
  std::vector<float> x = random_vector(3 * 8, 6);
  Standalone s;
  ReplicaModel rm(mlp, s.ctx);
  rm.forward(s.ctx, host(x, Shape{3, 8}));
  EXPECT_EQ(rm.num_grad_buffers(), 2u);  // the ping-pong pair a chain needs, for 9 nodes
  Model res = residual_model();
  ReplicaModel rr(res, s.ctx);
  rr.forward(s.ctx, host(x, Shape{6, 4}));
  EXPECT_EQ(rr.num_grad_buffers(), 3u);  // the skip keeps node 0's gradient alive across the block
}

TEST(Graph, NamesFollowTheStateDict) {
  Model m = projection_model();
  EXPECT_EQ(m.params()[0].name, "0.weight");
  EXPECT_EQ(m.params()[4].name, "3.weight");
  EXPECT_EQ(m.params()[6].name, "4.weight");
  m.set_node_name(3, "layer1.0.conv2");
  m.set_node_name(4, "layer1.0.downsample.0");
  EXPECT_EQ(m.params()[4].name, "layer1.0.conv2.weight");
  EXPECT_EQ(m.params()[5].name, "layer1.0.conv2.bias");
  EXPECT_EQ(m.params()[6].name, "layer1.0.downsample.0.weight");
  m.set_node_name(3, "fc_2");  // renaming again
  EXPECT_EQ(m.params()[4].name, "fc_2.weight");
  EXPECT_EQ(m.params()[5].name, "fc_2.bias");
  m.set_node_name(1, "1");     // a node's own index is its default
  auto refused = [&](int32_t node, const std::string& name, const std::string& says) {
    try {
      m.set_node_name(node, name);
      ADD_FAILURE() << "\"" << name << "\" was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refused(0, "", "\"\"");
  refused(0, "a..b", "a..b");
  refused(0, ".a", ".a");
  refused(0, "a.", "a.");
  refused(0, "a-b", "a-b");
  refused(0, "a b", "a b");
  refused(0, "fc_2", "already node 3");
  refused(0, "4", "digits");
  refused(9, "x", "9");
  refused(-1, "x", "-1");
  EXPECT_EQ(m.params()[0].name, "0.weight");
}

// PyTorch's module (tests/reference/make_graph_reference.py) built as a dpar graph with its module paths as node
// names: the same state_dict keys in the same order, its values loaded by name, the same output and gradients.
TEST(Graph, EqualsPyTorchsModuleByStateDictName) {
  std::ifstream f(std::string(DPAR_TEST_DATA_DIR) + "/graph_reference.json");
  ASSERT_TRUE(f) << "tests/data/graph_reference.json";
  const nlohmann::json ref = nlohmann::json::parse(f);
  Model m(0);
  m.set_node_name(m.add(make_linear(4, 6, true)), "stem");                             // 0
  m.set_node_name(m.add(make_linear(6, 8, true)), "layer1.0.fc1");                     // 1
  m.set_node_name(m.add(make_activation(Activation::kRelu)), "layer1.0.relu");         // 2
  m.set_node_name(m.add(make_linear(8, 6, true)), "layer1.0.fc2");                     // 3
  const int32_t block = m.add_sum({3, 0});                                              // 4
  m.set_node_name(m.add(make_linear(6, 8, true)), "main");                             // 5
  m.branch_from(block);
  m.set_node_name(m.add(make_linear(6, 8, false)), "down");                            // 6
  m.add_sum({5, 6});                                                                    // 7
  m.set_node_name(m.add_reshape({2, 2, 2}), "unflatten");                              // 8
  m.set_node_name(m.add(make_activation(Activation::kTanh)), "act");                   // 9
  m.add_concat({8, 9});                                                                 // 10
  m.set_node_name(m.add_flatten(), "flatten");                                         // 11
  m.set_node_name(m.add(make_linear(16, 3, true)), "head");                            // 12
  std::vector<std::string> names;
  for (const ParamInfo& p : m.params()) names.push_back(p.name);
  EXPECT_EQ(names, ref["names"].get<std::vector<std::string>>());
  for (const ParamInfo& p : m.params()) {
    const auto value = ref["params"][p.name]["value"].get<std::vector<float>>();
    ASSERT_EQ(value.size(), static_cast<size_t>(p.shape.numel())) << p.name;
    std::copy(value.begin(), value.end(), m.values().begin() + p.offset);
  }
  std::vector<float> x = ref["x"].get<std::vector<float>>();
  std::vector<float> r = ref["r"].get<std::vector<float>>();
  const std::vector<float> want = ref["out"].get<std::vector<float>>();
  Standalone s;
  ReplicaModel rm(m, s.ctx);
  const Tensor out = rm.forward(s.ctx, host(x, Shape{3, 4}));
  ASSERT_EQ(out.shape(), (Shape{3, 3}));
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(out.f32()[i], want[i], 1e-5 * (1 + std::fabs(want[i]))) << i;
  rm.backward(s.ctx, host(r, Shape{3, 3}), false);
  for (const ParamInfo& p : m.params()) {
    const auto grad = ref["params"][p.name]["grad"].get<std::vector<float>>();
    for (int64_t k = 0; k < p.shape.numel(); ++k)
      EXPECT_NEAR(rm.grads()[p.offset + k], grad[static_cast<size_t>(k)], 1e-5 * (1 + std::fabs(grad[k])))
          << p.name << "[" << k << "]";
  }
}

template <typename F>
void expect_refused(F&& f, const std::vector<std::string>& says) {
  try {
    f();
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument);
    for (const std::string& w : says) EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what();
  }
}

TEST(Graph, BadGraphsAreRefusedNamingTheNodes) {
  Model m(14);
  m.add(make_linear(4, 4, true));
  m.add(make_linear(4, 3, true));
  expect_refused([&] { m.add_sum({0, 5}); }, {"node 5", "not been added"});
  expect_refused([&] { m.add_concat({0, 2}); }, {"node 2", "not been added"});
  expect_refused([&] { m.add_sum({0, -2}); }, {"node -2"});
  expect_refused([&] { m.add_sum({0}); }, {"2 or more"});
  expect_refused([&] { m.branch_from(7); }, {"node 7"});
  expect_refused([&] { m.add_reshape({}); }, {"reshape"});
  EXPECT_EQ(m.num_nodes(), 2u);  // nothing refused was added
  Model sum = m;
  sum.add_sum({0, 1});
  expect_refused([&] { sum.output_shape(Shape{2, 4}); }, {"node 2", "sum", "(2, 3)", "(2, 4)", "node 1", "node 0"});
  Model cat(15);
  cat.add(make_linear(4, 8, true));
  cat.add_reshape({2, 4});  // (B, 2, 4)
  cat.branch_from(0);
  cat.add_reshape({2, 2, 2});
  cat.add_concat({1, 2});
  expect_refused([&] { cat.output_shape(Shape{2, 4}); }, {"node 3", "concat", "(2, 2, 4)", "(2, 2, 2, 2)"});
  Model cat2(16);
  cat2.add(make_linear(4, 8, true));
  cat2.add_reshape({2, 4});  // (B, 2, 4)
  cat2.branch_from(0);
  cat2.add_reshape({4, 2});  // (B, 4, 2): dim 2 differs
  cat2.add_concat({1, 2});
  expect_refused([&] { cat2.output_shape(Shape{2, 4}); }, {"node 3", "(2, 2, 4)", "(2, 4, 2)", "other than 1"});
  Model reshape(17);
  reshape.add(make_linear(4, 6, true));
  reshape.add_reshape({4, 2});
  expect_refused([&] { reshape.output_shape(Shape{2, 4}); }, {"node 1", "6 elements", "8"});
  Model dead(18);
  dead.add(make_linear(4, 4, true));
  dead.add(make_linear(4, 2, true));  // node 1: nothing reads it
  dead.branch_from(0);
  dead.add(make_linear(4, 2, true));
  expect_refused([&] { dead.output_shape(Shape{2, 4}); }, {"node 1", "leads nowhere"});
}

// ---------------------------------------------------------------------------------------------------------------
// Through the C ABI

#define ASSERT_DPAR_OK(call) ASSERT_EQ((call), DPAR_OK) << dpar_last_error()

struct ModelDeleter { void operator()(dpar_model* m) const { dpar_model_free(m); } };
struct EngineDeleter { void operator()(dpar_engine* e) const { dpar_engine_free(e); } };
struct TensorDeleter { void operator()(dpar_tensor* t) const { dpar_tensor_free(t); } };
using ModelPtr = std::unique_ptr<dpar_model, ModelDeleter>;
using EnginePtr = std::unique_ptr<dpar_engine, EngineDeleter>;
using TensorPtr = std::unique_ptr<dpar_tensor, TensorDeleter>;

// A residual block, as README's model section builds it: x -> fc1 -> relu -> fc2, + x, -> head.
ModelPtr c_residual_model() {
  dpar_model_options o = DPAR_MODEL_OPTIONS_INIT;
  o.seed = 21;
  dpar_model* raw = nullptr;
  EXPECT_EQ(dpar_model_create(&raw, &o), DPAR_OK);
  ModelPtr m(raw);
  int32_t block_in = 0;
  EXPECT_EQ(dpar_model_last_node(&block_in, raw), DPAR_OK);
  EXPECT_EQ(block_in, DPAR_MODEL_INPUT);
  EXPECT_EQ(dpar_model_add_linear(raw, 6, 8, 1), DPAR_OK);
  EXPECT_EQ(dpar_model_set_node_name(raw, 0, "block.fc1"), DPAR_OK);
  EXPECT_EQ(dpar_model_add_activation(raw, DPAR_RELU), DPAR_OK);
  EXPECT_EQ(dpar_model_add_linear(raw, 8, 6, 1), DPAR_OK);
  EXPECT_EQ(dpar_model_set_node_name(raw, 2, "block.fc2"), DPAR_OK);
  int32_t fc2 = 0;
  EXPECT_EQ(dpar_model_last_node(&fc2, raw), DPAR_OK);
  EXPECT_EQ(fc2, 2);
  const int32_t inputs[2] = {fc2, block_in};
  EXPECT_EQ(dpar_model_add_sum(raw, inputs, 2), DPAR_OK);
  EXPECT_EQ(dpar_model_add_linear(raw, 6, 3, 1), DPAR_OK);
  EXPECT_EQ(dpar_model_set_node_name(raw, 4, "head"), DPAR_OK);
  return m;
}

EnginePtr c_engine(const dpar_model* m, size_t devices, size_t bucket_bytes = 0) {
  dpar_optimizer_options opt = DPAR_OPTIMIZER_OPTIONS_INIT;
  opt.lr = 0.1f;
  opt.momentum = 0.9f;
  dpar_engine_options o = DPAR_ENGINE_OPTIONS_INIT;
  o.num_cpu_devices = devices;
  o.timeout_seconds = 60;
  o.first_bucket_bytes = bucket_bytes;
  o.bucket_cap_bytes = bucket_bytes;
  dpar_engine* e = nullptr;
  EXPECT_EQ(dpar_engine_create(&e, m, &opt, &o), DPAR_OK) << dpar_last_error();
  return EnginePtr(e);
}

std::vector<float> c_params(dpar_engine* e, size_t replica, size_t n) {
  std::vector<float> p(n);
  EXPECT_EQ(dpar_engine_get_params(p.data(), e, replica, n), DPAR_OK) << dpar_last_error();
  return p;
}

void c_train(dpar_engine* e, int steps) {
  const int64_t B = 7;  // uneven over 2 and 3 devices
  for (int s = 0; s < steps; ++s) {
    std::vector<float> x = random_vector(B * 6, 100 + s);
    std::vector<int32_t> y(B);
    for (int64_t i = 0; i < B; ++i) y[i] = static_cast<int32_t>((i * 5 + s) % 3);
    const int64_t xs[2] = {B, 6}, ys[1] = {B};
    dpar_tensor *xt = nullptr, *yt = nullptr;
    ASSERT_DPAR_OK(dpar_tensor_wrap_host(&xt, DPAR_F32, xs, 2, x.data()));
    TensorPtr xp(xt);
    ASSERT_DPAR_OK(dpar_tensor_wrap_host(&yt, DPAR_I32, ys, 1, y.data()));
    TensorPtr yp(yt);
    float loss = 0;
    ASSERT_DPAR_OK(dpar_engine_train_step(&loss, e, xt, yt));
    EXPECT_TRUE(std::isfinite(loss));
  }
}

TEST(GraphCapi, EngineOnOneTwoThreeDevicesTrainsAsOneDevice) {
  ModelPtr m = c_residual_model();
  size_t n = 0;
  ASSERT_DPAR_OK(dpar_model_num_param_elements(&n, m.get()));
  EnginePtr one = c_engine(m.get(), 1);
  c_train(one.get(), 3);
  const std::vector<float> want = c_params(one.get(), 0, n);
  for (size_t devices : {2u, 3u}) {
    // One bucket, and a bucket per few parameters (reduced while backward still runs the nodes before them).
    for (size_t bucket_bytes : {size_t{0}, size_t{64}}) {
      EnginePtr e = c_engine(m.get(), devices, bucket_bytes);
      size_t buckets = 0;
      ASSERT_DPAR_OK(dpar_engine_num_buckets(&buckets, e.get()));
      EXPECT_EQ(buckets > 1, bucket_bytes != 0);
      c_train(e.get(), 3);
      const std::vector<float> got = c_params(e.get(), 0, n);
      for (size_t i = 0; i < n; ++i)
        EXPECT_NEAR(got[i], want[i], 1e-5) << devices << " devices, buckets of " << bucket_bytes << ", element " << i;
      for (size_t r = 1; r < devices; ++r) EXPECT_EQ(c_params(e.get(), r, n), got) << "replica " << r;
    }
  }
}

TEST(GraphCapi, EnginesRefuseBadGraphsNamingTheNodes) {
  dpar_model_options o = DPAR_MODEL_OPTIONS_INIT;
  dpar_model* raw = nullptr;
  ASSERT_DPAR_OK(dpar_model_create(&raw, &o));
  ModelPtr m(raw);
  ASSERT_DPAR_OK(dpar_model_add_linear(raw, 6, 4, 1));  // 0: (B, 4)
  const int32_t unequal[2] = {0, DPAR_MODEL_INPUT};     // (B, 4) + (B, 6)
  ASSERT_DPAR_OK(dpar_model_add_sum(raw, unequal, 2));
  ASSERT_DPAR_OK(dpar_model_add_linear(raw, 4, 3, 1));
  EnginePtr e = c_engine(raw, 2);
  std::vector<float> x(7 * 6, 0.5f);
  std::vector<int32_t> y(7, 1);
  const int64_t xs[2] = {7, 6}, ys[1] = {7};
  dpar_tensor *xt = nullptr, *yt = nullptr;
  ASSERT_DPAR_OK(dpar_tensor_wrap_host(&xt, DPAR_F32, xs, 2, x.data()));
  TensorPtr xp(xt);
  ASSERT_DPAR_OK(dpar_tensor_wrap_host(&yt, DPAR_I32, ys, 1, y.data()));
  TensorPtr yp(yt);
  EXPECT_EQ(dpar_engine_train_step(nullptr, e.get(), xt, yt), DPAR_ERR_INVALID_ARGUMENT);
  const std::string msg = dpar_last_error();
  for (const char* w : {"node 1", "sum", "(7, 6)", "(7, 4)"}) EXPECT_NE(msg.find(w), std::string::npos) << msg;
  // A branch that leads nowhere is refused when the engine is made.
  ASSERT_DPAR_OK(dpar_model_branch_from(raw, 0));
  ASSERT_DPAR_OK(dpar_model_add_linear(raw, 4, 3, 1));  // node 3; node 2 is now read by nothing
  dpar_optimizer_options opt = DPAR_OPTIMIZER_OPTIONS_INIT;
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = 1;
  dpar_engine* dead = nullptr;
  EXPECT_EQ(dpar_engine_create(&dead, raw, &opt, &eo), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dpar_last_error()).find("node 2"), std::string::npos) << dpar_last_error();
  EXPECT_EQ(dead, nullptr);
}

TEST(GraphCapi, CheckpointRoundTripUsesTheNames) {
  ModelPtr m = c_residual_model();
  size_t count = 0, n = 0;
  ASSERT_DPAR_OK(dpar_model_num_params(&count, m.get()));
  ASSERT_DPAR_OK(dpar_model_num_param_elements(&n, m.get()));
  const char* want[] = {"block.fc1.weight", "block.fc1.bias", "block.fc2.weight", "block.fc2.bias", "head.weight",
                        "head.bias"};
  ASSERT_EQ(count, 6u);
  for (size_t i = 0; i < count; ++i) EXPECT_STREQ(dpar_model_param_name(m.get(), i), want[i]);
  EnginePtr e = c_engine(m.get(), 2);
  c_train(e.get(), 2);
  const std::string path = ::testing::TempDir() + "/graph_checkpoint.safetensors";
  ASSERT_DPAR_OK(dpar_engine_save(e.get(), path.c_str()));
  // The safetensors header names every tensor by its state_dict key.
  std::ifstream f(path, std::ios::binary);
  uint64_t header_len = 0;
  f.read(reinterpret_cast<char*>(&header_len), 8);
  std::string header(header_len, '\0');
  f.read(header.data(), static_cast<std::streamsize>(header_len));
  for (const char* name : want) EXPECT_NE(header.find(std::string("\"") + name + "\""), std::string::npos) << name;
  EnginePtr fresh = c_engine(m.get(), 2);
  ASSERT_DPAR_OK(dpar_engine_load(fresh.get(), path.c_str()));
  EXPECT_EQ(c_params(fresh.get(), 0, n), c_params(e.get(), 0, n));
  EXPECT_EQ(c_params(fresh.get(), 1, n), c_params(e.get(), 0, n));
  // A model whose node has another name does not take the checkpoint, and says which tensor it misses.
  ASSERT_DPAR_OK(dpar_model_set_node_name(m.get(), 4, "classifier"));
  EnginePtr renamed = c_engine(m.get(), 1);
  EXPECT_EQ(dpar_engine_load(renamed.get(), path.c_str()), DPAR_ERR_MISMATCH);
  EXPECT_NE(std::string(dpar_last_error()).find("classifier.weight"), std::string::npos) << dpar_last_error();
  std::remove(path.c_str());
}

TEST(GraphCapi, CallsCheckTheirArguments) {
  ModelPtr m = c_residual_model();
  auto says = [](dpar_status st, const char* what) {
    EXPECT_EQ(st, DPAR_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(dpar_last_error()).find(what), std::string::npos) << dpar_last_error();
  };
  const int32_t later[2] = {0, 9};
  says(dpar_model_add_sum(m.get(), later, 2), "node 9");
  says(dpar_model_add_concat(m.get(), later, 2), "node 9");
  says(dpar_model_add_sum(m.get(), nullptr, 2), "inputs");
  says(dpar_model_add_sum(m.get(), later, 1), "2 or more");
  says(dpar_model_add_sum(nullptr, later, 2), "model");
  says(dpar_model_branch_from(m.get(), 5), "node 5");
  says(dpar_model_set_node_name(m.get(), 1, nullptr), "name");
  says(dpar_model_set_node_name(m.get(), 1, "head"), "already node 4");
  says(dpar_model_set_node_name(m.get(), 1, "a/b"), "a/b");
  says(dpar_model_last_node(nullptr, m.get()), "out");
  says(dpar_model_add_reshape(m.get(), nullptr, 2), "row_shape");
  const int64_t row[4] = {1, 2, 3, 4};
  says(dpar_model_add_reshape(m.get(), row, 4), "ndim");
  says(dpar_model_add_flatten(nullptr), "model");
  size_t nodes = 0;
  ASSERT_DPAR_OK(dpar_model_num_layers(&nodes, m.get()));
  EXPECT_EQ(nodes, 5u);  // nothing refused was added
  // Views and concat through the C ABI: (B, 6) -> (B, 2, 3) -> concat with itself (B, 4, 3) -> flatten (B, 12).
  ASSERT_DPAR_OK(dpar_model_branch_from(m.get(), DPAR_MODEL_INPUT));
  const int64_t r2[2] = {2, 3};
  ASSERT_DPAR_OK(dpar_model_add_reshape(m.get(), r2, 2));
  const int32_t twice[2] = {5, 5};
  ASSERT_DPAR_OK(dpar_model_add_concat(m.get(), twice, 2));
  ASSERT_DPAR_OK(dpar_model_add_flatten(m.get()));
  int32_t last = 0;
  ASSERT_DPAR_OK(dpar_model_last_node(&last, m.get()));
  EXPECT_EQ(last, 7);
}

// ---- The fusion pass: an activation as the epilogue of the layer before it ------------------------------------

// The layers the fusion pass runs a ReLU after as their epilogue ("heads"), each behind a linear layer (8 -> 8)
// from the model input, so that the head's input gradient is checked through that layer's weight gradient.
// Appends the linear layer and the head to m; returns the shape of one row of the head's output.
constexpr int kNumHeads = 4;
const char* const kHeads[kNumHeads] = {"linear", "conv2d", "conv2d + batchnorm2d", "batchnorm1d"};

std::vector<int64_t> add_head(Model& m, int head) {
  m.add(make_linear(8, 8, true));
  Conv2dSpec conv;
  conv.in_channels = 2;
  conv.out_channels = 3;
  conv.kernel_h = conv.kernel_w = 3;
  conv.pad_h = conv.pad_w = 1;
  switch (head) {
    case 0:
      m.add(make_linear(8, 6, true));
      return {6};
    case 1:
      m.add_reshape({2, 2, 2});
      m.add(make_conv2d(conv));
      return {3, 2, 2};
    case 2:  // BatchNorm2d after a convolution
      m.add_reshape({2, 2, 2});
      conv.bias = false;
      m.add(make_conv2d(conv));
      m.add(make_batchnorm(2, 3, 1e-5f, 0.1f, true));
      return {3, 2, 2};
    default:
      m.add(make_batchnorm(1, 8, 1e-5f, 0.1f, true));
      return {8};
  }
}

int64_t row_width(const std::vector<int64_t>& row) {
  int64_t width = 1;
  for (int64_t d : row) width *= d;
  return width;
}

// A head followed by a ReLU, and a classifier; with `apart`, a view between the head and the ReLU keeps the ReLU a
// node of its own (the pass fuses only a ReLU that reads the layer directly and alone).
Model head_then_relu(int head, bool apart, Activation activation = Activation::kRelu) {
  Model m(11);
  const std::vector<int64_t> row = add_head(m, head);
  if (apart) m.add_reshape(row);
  m.add(make_activation(activation));
  m.add_flatten();
  m.add(make_linear(row_width(row), 4, true));
  return m;
}

// One forward and backward of a model on a replica outside any engine, with the input and dL/d(output) drawn from
// fixed seeds: what the fused and the unfused graph must agree on.
struct Step {
  size_t fused = 0;  // ReplicaModel::num_fused()
  std::vector<float> out, grads, buffers;
};

Step run_step(const Model& m, const Shape& in_shape) {
  Step step;
  Standalone s;
  ReplicaModel rm(m, s.ctx);
  std::vector<float> x = random_vector(static_cast<size_t>(in_shape.numel()), 3);
  const Tensor y = rm.forward(s.ctx, host(x, in_shape));
  step.fused = rm.num_fused();
  step.out.assign(y.f32(), y.f32() + y.numel());
  std::vector<float> r = random_vector(static_cast<size_t>(y.numel()), 4);
  rm.backward(s.ctx, host(r, y.shape()), false);
  step.grads.assign(rm.grads(), rm.grads() + m.num_param_elements());
  if (rm.num_buffer_f32() > 0) step.buffers.assign(rm.buffer_f32(), rm.buffer_f32() + rm.num_buffer_f32());
  return step;
}

// Run as the epilogue, the ReLU gives the same bits as run as a node of its own: the output, every parameter's
// gradient (the first linear layer's carries the head's input gradient) and BatchNorm's running statistics.
TEST(Fusion, AReluRunsAsTheEpilogueOfTheLayerBeforeItWithTheSameBits) {
  for (int head = 0; head < kNumHeads; ++head) {
    SCOPED_TRACE(kHeads[head]);
    const Step fused = run_step(head_then_relu(head, false), Shape{5, 8});
    const Step apart = run_step(head_then_relu(head, true), Shape{5, 8});
    // The first linear layer and its ReLU-less successor never fuse; the head and its ReLU do, unless apart.
    EXPECT_EQ(fused.fused, 1u);
    EXPECT_EQ(apart.fused, 0u);
    EXPECT_EQ(fused.out, apart.out);
    EXPECT_EQ(fused.grads, apart.grads);
    EXPECT_EQ(fused.buffers, apart.buffers);
    EXPECT_GT(*std::max_element(fused.grads.begin(), fused.grads.end()), 0.0f) << "no gradient reached the parameters";
  }
}

// A GELU after a linear layer is its epilogue too: where a backend does not fuse it, Stream::run composes it from
// the GEMM (into the pre-activation the layer keeps) and the activation, the same bits as the two nodes apart.
// Tanh and sigmoid are no epilogue: they stay nodes.
TEST(Fusion, AGeluRunsAsTheEpilogueOfALinearLayerWithTheSameBits) {
  const Step fused = run_step(head_then_relu(0, false, Activation::kGelu), Shape{5, 8});
  const Step apart = run_step(head_then_relu(0, true, Activation::kGelu), Shape{5, 8});
  EXPECT_EQ(fused.fused, 1u);
  EXPECT_EQ(apart.fused, 0u);
  EXPECT_EQ(fused.out, apart.out);
  EXPECT_EQ(fused.grads, apart.grads);
  EXPECT_GT(*std::max_element(fused.grads.begin(), fused.grads.end()), 0.0f) << "no gradient reached the parameters";
  EXPECT_EQ(run_step(head_then_relu(0, false, Activation::kTanh), Shape{5, 8}).fused, 0u);
  // A convolution and a BatchNorm take a ReLU only: a GELU after them stays a node.
  EXPECT_EQ(run_step(head_then_relu(1, false, Activation::kGelu), Shape{5, 8}).fused, 0u);
  EXPECT_EQ(run_step(head_then_relu(3, false, Activation::kGelu), Shape{5, 8}).fused, 0u);
}

// ---- Readers of a head's output besides its ReLU, and sums that are not the first to write a gradient ---------

// What reads the head's output h and its ReLU r = relu(h), after them. In the first four, h has a reader besides
// r, so the pair must not fuse (fused, h's output is never written, and that reader would read stale memory). In
// the last two the pair fuses, and a sum must add r's gradient to what another reader wrote before it.
enum class Readers {
  kSum,           // sum(r, h)
  kConcat,        // concat(r, h)
  kLayer,         // sum(r, tanh(h)): a later layer reads h
  kView,          // sum(r, view of h): a view's memory is h's
  kSumTwice,      // sum(r, r): one sum reads r twice
  kSumThenLayer,  // sum(sum(r, tanh(r)), sigmoid(r)): backward reaches sigmoid(r), r's later reader, before the sum
};
const char* const kReaders[] = {"sum(r, h)", "concat(r, h)", "sum(r, tanh(h))", "sum(r, view of h)", "sum(r, r)",
                                "sum(sum(r, tanh(r)), sigmoid(r))"};
constexpr Readers kAllReaders[] = {Readers::kSum,  Readers::kConcat,   Readers::kLayer,
                                   Readers::kView, Readers::kSumTwice, Readers::kSumThenLayer};

// The head, its ReLU and their readers, then a flatten and a classifier; with `apart`, the ReLU reads a view of the
// head (so that no pass fuses them): the same function, computed without fusion.
Model head_with_readers(int head, Readers readers, bool apart) {
  Model m(23);
  const std::vector<int64_t> row = add_head(m, head);
  const int32_t h = m.last_node();
  if (apart) m.add_reshape(row);
  const int32_t r = m.add(make_activation(Activation::kRelu));
  int64_t width = row_width(row);
  switch (readers) {
    case Readers::kSum: m.add_sum({r, h}); break;
    case Readers::kConcat:
      m.add_concat({r, h});
      width *= 2;
      break;
    case Readers::kLayer: {
      m.branch_from(h);
      const int32_t t = m.add(make_activation(Activation::kTanh));
      m.add_sum({r, t});
      break;
    }
    case Readers::kView: {
      m.branch_from(h);
      const int32_t v = m.add_reshape(row);
      m.add_sum({r, v});
      break;
    }
    case Readers::kSumTwice: m.add_sum({r, r}); break;
    case Readers::kSumThenLayer: {
      const int32_t t = m.add(make_activation(Activation::kTanh));
      const int32_t s = m.add_sum({r, t});
      m.branch_from(r);
      const int32_t g = m.add(make_activation(Activation::kSigmoid));
      m.add_sum({s, g});
      break;
    }
  }
  m.add_flatten();
  m.add(make_linear(width, 3, true));
  return m;
}

// Each graph against the same graph computed without fusion (bit for bit, as fusion changes no arithmetic) and
// against central differences of the loss sum(output * r): a pass that fuses a layer whose output another node
// reads, or a sum that overwrites a gradient another reader wrote first, fails one or both.
TEST(Fusion, ReadersOfTheHeadBesidesItsReluAndSumsMatchTheUnfusedGraphAndFiniteDifferences) {
  for (int head = 0; head < kNumHeads; ++head) {
    for (Readers readers : kAllReaders) {
      SCOPED_TRACE(std::string(kHeads[head]) + ", then " + kReaders[static_cast<int>(readers)]);
      const Model m = head_with_readers(head, readers, false);
      const Step got = run_step(m, Shape{5, 8});
      const Step want = run_step(head_with_readers(head, readers, true), Shape{5, 8});
      const bool h_read_twice = readers != Readers::kSumTwice && readers != Readers::kSumThenLayer;
      EXPECT_EQ(got.fused, h_read_twice ? 0u : 1u);
      EXPECT_EQ(want.fused, 0u);
      EXPECT_EQ(got.out, want.out);
      EXPECT_EQ(got.grads, want.grads);
      EXPECT_EQ(got.buffers, want.buffers);
      check_gradients(m, Shape{5, 8}, /*external=*/false, /*kinks=*/true);
    }
  }
}

}  // namespace
}  // namespace dpar
