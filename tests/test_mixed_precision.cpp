// The bf16 precision policy (dpar_engine_set_precision) through the C ABI: against PyTorch's autocast and against
// dpar's own contract emulated in PyTorch (tests/reference/make_mixed_precision_reference.py), across device
// counts, the weights' bf16 copies made again at every step, f32 checkpoints, and the refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "dpar.h"

namespace {

struct ModelDeleter {
  void operator()(dpar_model* m) const { dpar_model_free(m); }
};
struct EngineDeleter {
  void operator()(dpar_engine* e) const { dpar_engine_free(e); }
};
struct TensorDeleter {
  void operator()(dpar_tensor* t) const { dpar_tensor_free(t); }
};
using ModelPtr = std::unique_ptr<dpar_model, ModelDeleter>;
using EnginePtr = std::unique_ptr<dpar_engine, EngineDeleter>;
using TensorPtr = std::unique_ptr<dpar_tensor, TensorDeleter>;

nlohmann::json reference() {
  std::ifstream f(std::string(DPAR_TEST_DATA_DIR) + "/mixed_precision_reference.json");
  EXPECT_TRUE(f.good()) << "tests/data/mixed_precision_reference.json";
  return nlohmann::json::parse(f);
}

// The reference's model, its parameters set by name.
ModelPtr reference_model(const std::string& which, const nlohmann::json& r) {
  dpar_model* raw = nullptr;
  EXPECT_EQ(dpar_model_create(&raw, nullptr), DPAR_OK);
  ModelPtr m(raw);
  if (which == "mlp" || which == "gelu_mlp") {
    EXPECT_EQ(dpar_model_add_linear(m.get(), 12, 32, 1), DPAR_OK);
    EXPECT_EQ(dpar_model_add_activation(m.get(), which == "mlp" ? DPAR_RELU : DPAR_GELU), DPAR_OK);
    EXPECT_EQ(dpar_model_add_linear(m.get(), 32, 5, 1), DPAR_OK);
  } else if (which == "attention") {
    EXPECT_EQ(dpar_model_add_causal_self_attention(m.get(), 8, 2, 0.0f, 1, "attn"), DPAR_OK) << dpar_last_error();
    EXPECT_EQ(dpar_model_add_linear(m.get(), 8, 5, 1), DPAR_OK);
    int32_t head = 0;
    EXPECT_EQ(dpar_model_last_node(&head, m.get()), DPAR_OK);
    EXPECT_EQ(dpar_model_set_node_name(m.get(), head, "head"), DPAR_OK) << dpar_last_error();
  } else {
    const int64_t kernel[2] = {3, 3}, padding[2] = {1, 1};
    EXPECT_EQ(dpar_model_add_conv2d(m.get(), 2, 6, kernel, nullptr, padding, nullptr, 1, 1), DPAR_OK);
    EXPECT_EQ(dpar_model_add_activation(m.get(), DPAR_RELU), DPAR_OK);
    EXPECT_EQ(dpar_model_add_flatten(m.get()), DPAR_OK);
    EXPECT_EQ(dpar_model_add_linear(m.get(), 6 * 5 * 5, 4, 1), DPAR_OK);
  }
  size_t n = 0;
  EXPECT_EQ(dpar_model_num_params(&n, m.get()), DPAR_OK);
  for (size_t i = 0; i < n; ++i) {
    const std::string name = dpar_model_param_name(m.get(), i);
    const std::vector<float> v = r["params"][name].get<std::vector<float>>();
    EXPECT_EQ(dpar_model_set_param(m.get(), i, v.data(), v.size()), DPAR_OK) << name << ": " << dpar_last_error();
  }
  return m;
}

EnginePtr make_engine(const dpar_model* m, size_t devices, int32_t optimizer, float lr) {
  dpar_optimizer_options oo = DPAR_OPTIMIZER_OPTIONS_INIT;
  oo.kind = optimizer;
  oo.lr = lr;
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = devices;
  eo.bucket_cap_bytes = eo.first_bucket_bytes = 256;  // several buckets even for these small models
  dpar_engine* e = nullptr;
  EXPECT_EQ(dpar_engine_create(&e, m, &oo, &eo), DPAR_OK) << dpar_last_error();
  return EnginePtr(e);
}

// Whether the CPU has bf16 arithmetic (AVX512-BF16 or AMX-BF16), by its flags in /proc/cpuinfo.
bool cpu_has_bf16() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("flags", 0) == 0)
      return line.find(" avx512_bf16") != std::string::npos || line.find(" amx_bf16") != std::string::npos;
  return false;
}

// Sets bf16 on the engine, or says why this machine cannot: only a CPU without bf16 arithmetic may refuse.
bool set_bf16(dpar_engine* e, std::string* why) {
  const dpar_status st = dpar_engine_set_precision(e, DPAR_BF16);
  if (st == DPAR_OK) return true;
  EXPECT_EQ(st, DPAR_ERR_NOT_SUPPORTED) << dpar_last_error();
  EXPECT_FALSE(cpu_has_bf16()) << "this CPU has AVX512-BF16 or AMX, yet bf16 was refused: " << dpar_last_error();
  *why = dpar_last_error();
  return false;
}
#define SET_BF16_OR_SKIP(e)                                          \
  do {                                                               \
    std::string why_;                                                \
    if (!set_bf16((e), &why_)) GTEST_SKIP() << "no bf16 here: " << why_; \
  } while (0)

std::vector<float> params_of(dpar_engine* e, const dpar_model* m, size_t replica = 0) {
  size_t n = 0;
  EXPECT_EQ(dpar_model_num_param_elements(&n, m), DPAR_OK);
  std::vector<float> v(n);
  EXPECT_EQ(dpar_engine_get_params(v.data(), e, replica, n), DPAR_OK) << dpar_last_error();
  return v;
}

struct Batch {
  TensorPtr x, y;
  std::vector<float> xs;
  std::vector<int32_t> ys;
};
Batch batch_of(const nlohmann::json& r) {
  Batch b;
  b.xs = r["x"].get<std::vector<float>>();
  b.ys = r["labels"].get<std::vector<int32_t>>();
  const std::vector<int64_t> shape = r["x_shape"].get<std::vector<int64_t>>();
  const std::vector<int64_t> label_shape = r["labels_shape"].get<std::vector<int64_t>>();
  dpar_tensor *x = nullptr, *y = nullptr;
  EXPECT_EQ(dpar_tensor_wrap_host(&x, DPAR_F32, shape.data(), shape.size(), b.xs.data()), DPAR_OK);
  EXPECT_EQ(dpar_tensor_wrap_host(&y, DPAR_I32, label_shape.data(), label_shape.size(), b.ys.data()), DPAR_OK);
  b.x.reset(x);
  b.y.reset(y);
  return b;
}

// One SGD step of lr 1 from the reference's parameters: the loss, and each parameter's gradient (what it moved).
struct Step {
  float loss = 0.0f;
  std::vector<std::vector<float>> grads;  // per parameter, in the model's order
};
Step one_step(const std::string& which, const nlohmann::json& r, bool bf16, size_t devices, std::string* skip) {
  ModelPtr m = reference_model(which, r);
  EnginePtr e = make_engine(m.get(), devices, DPAR_SGD, 1.0f);
  Step s;
  if (bf16 && !set_bf16(e.get(), skip)) return s;
  Batch b = batch_of(r);
  const std::vector<float> before = params_of(e.get(), m.get());
  EXPECT_EQ(dpar_engine_train_step(&s.loss, e.get(), b.x.get(), b.y.get()), DPAR_OK) << dpar_last_error();
  const std::vector<float> after = params_of(e.get(), m.get());
  size_t n = 0, offset = 0;
  EXPECT_EQ(dpar_model_num_params(&n, m.get()), DPAR_OK);
  for (size_t i = 0; i < n; ++i) {
    const size_t count = r["params"][dpar_model_param_name(m.get(), i)].size();
    std::vector<float> g(count);
    for (size_t k = 0; k < count; ++k) g[k] = before[offset + k] - after[offset + k];
    s.grads.push_back(std::move(g));
    offset += count;
  }
  return s;
}

// The largest difference between a and b over the largest magnitude of b.
double relative_gap(const std::vector<float>& a, const std::vector<float>& b) {
  double gap = 0.0, scale = 1e-30;
  for (size_t k = 0; k < b.size(); ++k) {
    gap = std::max(gap, std::fabs(static_cast<double>(a[k]) - b[k]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[k])));
  }
  return gap / scale;
}

void check_against_reference(const std::string& which) {
  const nlohmann::json all = reference();
  const nlohmann::json& r = all[which];
  std::string skip;
  const Step bf16 = one_step(which, r, true, 1, &skip);
  if (!skip.empty()) GTEST_SKIP() << "no bf16 here: " << skip;
  const Step f32 = one_step(which, r, false, 1, &skip);
  ModelPtr m = reference_model(which, r);
  size_t n = 0;
  ASSERT_EQ(dpar_model_num_params(&n, m.get()), DPAR_OK);
  ASSERT_EQ(bf16.grads.size(), n);
  EXPECT_NEAR(bf16.loss, r["emulated"]["loss"].get<double>(), 2e-6);
  EXPECT_NEAR(bf16.loss, r["autocast"]["loss"].get<double>(), 1e-3);
  bool f32_differs = std::fabs(f32.loss - r["emulated"]["loss"].get<double>()) > 2e-6;
  for (size_t i = 0; i < n; ++i) {
    const std::string name = dpar_model_param_name(m.get(), i);
    const std::vector<float> emulated = r["emulated"]["grads"][name].get<std::vector<float>>();
    const std::vector<float> autocast = r["autocast"]["grads"][name].get<std::vector<float>>();
    // dpar's contract, emulated in PyTorch: equal but for f32's summation order (and, rarely, an element whose
    // f32 activation rounds to the neighbouring bf16 value because the order moved it across the midpoint).
    EXPECT_LT(relative_gap(bf16.grads[i], emulated), 5e-4) << which << " " << name;
    // PyTorch's autocast, which also rounds each layer's output to bf16: within bf16's rounding.
    EXPECT_LT(relative_gap(bf16.grads[i], autocast), 2e-2) << which << " " << name;
    f32_differs = f32_differs || relative_gap(f32.grads[i], emulated) > 5e-4;
  }
  EXPECT_TRUE(f32_differs) << "the f32 policy's gradients meet the bf16 reference too: the check would not see bf16";
}

TEST(MixedPrecision, Bf16MlpMatchesAutocastAndItsContract) { check_against_reference("mlp"); }
TEST(MixedPrecision, Bf16CnnMatchesAutocastAndItsContract) { check_against_reference("cnn"); }
// The GELU runs on the linear layer's output rounded to bf16 and writes its own rounded, as autocast's.
TEST(MixedPrecision, Bf16GeluMlpMatchesAutocastAndItsContract) { check_against_reference("gelu_mlp"); }
// Causal self-attention as nanoGPT's: the projections in bf16, attention on the packed q|k|v that its projection
// writes in bf16, the softmax's weights rounded before their product with v (AttentionSpec::dtype bf16).
TEST(MixedPrecision, Bf16AttentionMatchesAutocastAndItsContract) { check_against_reference("attention"); }

// N devices equal one device under bf16: every product is exact, so only f32's summation order differs (the batch
// split into chunks, the chunks' gradients summed).
TEST(MixedPrecision, Bf16OnSeveralDevicesEqualsOneDevice) {
  const nlohmann::json all = reference();
  for (const std::string which : {"mlp", "gelu_mlp", "cnn", "attention"}) {
    const nlohmann::json& r = all[which];
    std::string skip;
    const Step one = one_step(which, r, true, 1, &skip);
    if (!skip.empty()) GTEST_SKIP() << "no bf16 here: " << skip;
    for (size_t devices : {2, 3}) {
      const Step many = one_step(which, r, true, devices, &skip);
      EXPECT_NEAR(many.loss, one.loss, 1e-6) << which << " on " << devices;
      for (size_t i = 0; i < one.grads.size(); ++i)
        EXPECT_LT(relative_gap(many.grads[i], one.grads[i]), 5e-4) << which << " on " << devices << ", param " << i;
    }
  }
}

// The bf16 copy of the weights is made again at the first forward after the weights change: after steps in bf16, an
// engine that loads the checkpoint (f32) and computes in bf16 gives the same outputs bit for bit, whether it was set
// to bf16 before the load (and ran a forward on its first weights) or after; one left in f32 does not.
TEST(MixedPrecision, WeightCopiesFollowEveryStepAndCheckpointsStayF32) {
  const nlohmann::json all = reference();
  const nlohmann::json& r = all["mlp"];
  ModelPtr m = reference_model("mlp", r);
  EnginePtr a = make_engine(m.get(), 2, DPAR_ADAM, 1e-2f);
  SET_BF16_OR_SKIP(a.get());
  Batch b = batch_of(r);
  float loss = 0.0f;
  for (int s = 0; s < 3; ++s) ASSERT_EQ(dpar_engine_train_step(&loss, a.get(), b.x.get(), b.y.get()), DPAR_OK);
  const std::string path = ::testing::TempDir() + "mixed_precision.safetensors";
  ASSERT_EQ(dpar_engine_save(a.get(), path.c_str()), DPAR_OK) << dpar_last_error();
  {
    std::ifstream f(path, std::ios::binary);
    uint64_t len = 0;
    f.read(reinterpret_cast<char*>(&len), 8);
    std::string header(static_cast<size_t>(len), '\0');
    f.read(header.data(), static_cast<std::streamsize>(len));
    const nlohmann::json tensors = nlohmann::json::parse(header);
    for (const auto& [key, value] : tensors.items())
      if (key != "__metadata__" && key.rfind("optimizer.", 0) != 0)
        EXPECT_EQ(value["dtype"], "F32") << key;
  }
  auto forward = [&](dpar_engine* e) -> std::vector<float> {
    EXPECT_EQ(dpar_engine_set_training(e, 0), DPAR_OK);
    dpar_tensor* out = nullptr;
    EXPECT_EQ(dpar_engine_forward(&out, e, b.x.get()), DPAR_OK) << dpar_last_error();
    std::vector<float> v(16 * 5);
    EXPECT_EQ(dpar_tensor_copy_to_host(v.data(), out, v.size() * sizeof(float)), DPAR_OK);
    dpar_tensor_free(out);
    return v;
  };
  EnginePtr bf16 = make_engine(m.get(), 1, DPAR_ADAM, 1e-2f);
  EnginePtr bf16_first = make_engine(m.get(), 1, DPAR_ADAM, 1e-2f);
  EnginePtr f32 = make_engine(m.get(), 1, DPAR_ADAM, 1e-2f);
  ASSERT_EQ(dpar_engine_set_precision(bf16_first.get(), DPAR_BF16), DPAR_OK);
  const std::vector<float> y_initial = forward(bf16_first.get());
  ASSERT_EQ(dpar_engine_load(bf16.get(), path.c_str()), DPAR_OK) << dpar_last_error();
  ASSERT_EQ(dpar_engine_load(bf16_first.get(), path.c_str()), DPAR_OK) << dpar_last_error();
  ASSERT_EQ(dpar_engine_load(f32.get(), path.c_str()), DPAR_OK) << dpar_last_error();
  ASSERT_EQ(dpar_engine_set_precision(bf16.get(), DPAR_BF16), DPAR_OK);
  std::vector<float> ya, yb, yc, yf;
  ya = forward(a.get());
  yb = forward(bf16.get());
  yc = forward(bf16_first.get());
  yf = forward(f32.get());
  EXPECT_EQ(ya, yb);
  EXPECT_EQ(ya, yc);
  EXPECT_NE(yc, y_initial);
  EXPECT_NE(ya, yf);
  std::remove(path.c_str());
}

TEST(MixedPrecision, SettingsAndRefusals) {
  const nlohmann::json all = reference();
  ModelPtr m = reference_model("mlp", all["mlp"]);
  EnginePtr e = make_engine(m.get(), 2, DPAR_SGD, 0.1f);
  int32_t p = -1;
  ASSERT_EQ(dpar_engine_precision(&p, e.get()), DPAR_OK);
  EXPECT_EQ(p, DPAR_F32);
  // f16 on CPU devices: refused whole, naming the node, the kernel in f16 and oneDNN's reason (2.6 has no f16 matmul
  // for CPUs), the engine unchanged.
  EXPECT_EQ(dpar_engine_set_precision(e.get(), DPAR_F16), DPAR_ERR_NOT_SUPPORTED);
  for (const char* part : {"linear_forward (f16", "oneDNN", "f16 matmul"})
    EXPECT_NE(std::string(dpar_last_error()).find(part), std::string::npos) << part << ": " << dpar_last_error();
  ASSERT_EQ(dpar_engine_precision(&p, e.get()), DPAR_OK);
  EXPECT_EQ(p, DPAR_F32);
  for (int32_t bad : {-1, static_cast<int>(DPAR_I32), 7}) {
    EXPECT_EQ(dpar_engine_set_precision(e.get(), bad), DPAR_ERR_INVALID_ARGUMENT) << bad;
    EXPECT_NE(std::string(dpar_last_error()).find("compute_dtype"), std::string::npos) << dpar_last_error();
  }
  EXPECT_EQ(dpar_engine_set_precision(nullptr, DPAR_BF16), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(dpar_engine_precision(nullptr, e.get()), DPAR_ERR_INVALID_ARGUMENT);
  ASSERT_EQ(dpar_engine_precision(&p, e.get()), DPAR_OK);
  EXPECT_EQ(p, DPAR_F32) << "a refused setting changes nothing";
  int32_t has = -1;
  EXPECT_EQ(dpar_engine_set_allow_tf32(e.get(), 2, &has), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(has, -1);
  ASSERT_EQ(dpar_engine_set_allow_tf32(e.get(), 1, &has), DPAR_OK);
  EXPECT_EQ(has, 0) << "CPU devices have no TF32";
  ASSERT_EQ(dpar_engine_set_allow_tf32(e.get(), 0, nullptr), DPAR_OK);
  std::string why;
  if (set_bf16(e.get(), &why)) {
    ASSERT_EQ(dpar_engine_precision(&p, e.get()), DPAR_OK);
    EXPECT_EQ(p, DPAR_BF16);
    ASSERT_EQ(dpar_engine_set_precision(e.get(), DPAR_F32), DPAR_OK);
    ASSERT_EQ(dpar_engine_precision(&p, e.get()), DPAR_OK);
    EXPECT_EQ(p, DPAR_F32);
  } else {
    // Refused whole: the message names the node and the kernel, and the engine still trains in f32.
    EXPECT_NE(why.find("linear"), std::string::npos) << why;
    ASSERT_EQ(dpar_engine_precision(&p, e.get()), DPAR_OK);
    EXPECT_EQ(p, DPAR_F32);
  }
}

}  // namespace
