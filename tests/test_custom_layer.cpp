// A layer brought by the caller through C callbacks, checked against the built-in equivalent, through the C ABI
// alone (as a Rust, Go or Julia program would use it).
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <dlpack/dlpack.h>

#include "dpar.h"

namespace {

#define ASSERT_OK(call) ASSERT_EQ((call), DPAR_OK) << #call << ": " << dpar_last_error()

constexpr size_t kMaxReplicas = 8;

// A linear layer y = x W^T + b written by a "foreign" caller, with a per-replica call counter (state that lives in
// the replica, as torch.nn.DataParallel cannot keep) and a switch that makes one replica fail.
struct CustomLinear {
  int64_t in = 0, out = 0;
  std::atomic<int> forwards[kMaxReplicas] = {};
  std::atomic<int> fail_replica{-1};
  dpar_status fail_status = DPAR_ERR_DEVICE;
  const char* fail_message = nullptr;  // given through dpar_set_error when set
};

float* data_of(const dpar_tensor* t) {
  void* p = nullptr;
  EXPECT_EQ(dpar_tensor_data(&p, const_cast<dpar_tensor*>(t)), DPAR_OK) << dpar_last_error();
  return static_cast<float*>(p);
}

int64_t rows_of(const dpar_tensor* t) {
  int64_t shape[DPAR_MAX_DIMS];
  size_t ndim = 0;
  EXPECT_EQ(dpar_tensor_shape(shape, &ndim, t, DPAR_MAX_DIMS), DPAR_OK);
  return shape[0];
}

dpar_status linear_shape(void* payload, int64_t* out_shape, size_t* out_ndim, const int64_t* in_shape,
                         size_t in_ndim) {
  auto* L = static_cast<CustomLinear*>(payload);
  if (in_ndim != 2 || in_shape[1] != L->in)
    return dpar_set_error(DPAR_ERR_MISMATCH, ("my_linear takes " + std::to_string(L->in) + " features").c_str());
  out_shape[0] = in_shape[0];
  out_shape[1] = L->out;
  *out_ndim = 2;
  return DPAR_OK;
}

dpar_status linear_forward(void* payload, const dpar_custom_call* call) {
  auto* L = static_cast<CustomLinear*>(payload);
  L->forwards[call->replica]++;
  if (L->fail_replica.load() == static_cast<int>(call->replica))
    return L->fail_message ? dpar_set_error(L->fail_status, L->fail_message) : L->fail_status;
  const float* x = data_of(call->input);
  float* y = data_of(call->output);
  const float* W = data_of(call->params[0]);
  const float* b = data_of(call->params[1]);
  const int64_t B = rows_of(call->input);
  for (int64_t i = 0; i < B; ++i)
    for (int64_t o = 0; o < L->out; ++o) {
      float acc = b[o];
      for (int64_t k = 0; k < L->in; ++k) acc += x[i * L->in + k] * W[o * L->in + k];
      y[i * L->out + o] = acc;
    }
  return DPAR_OK;
}

dpar_status linear_backward(void* payload, const dpar_custom_call* call) {
  auto* L = static_cast<CustomLinear*>(payload);
  const float* x = data_of(call->input);
  const float* dy = data_of(call->grad_output);
  const float* W = data_of(call->params[0]);
  float* dW = data_of(call->grads[0]);
  float* db = data_of(call->grads[1]);
  const int64_t B = rows_of(call->input);
  // Gradients are written, not added: dpar handles accumulation.
  std::memset(dW, 0, sizeof(float) * L->in * L->out);
  std::memset(db, 0, sizeof(float) * L->out);
  for (int64_t i = 0; i < B; ++i)
    for (int64_t o = 0; o < L->out; ++o) {
      db[o] += dy[i * L->out + o];
      for (int64_t k = 0; k < L->in; ++k) dW[o * L->in + k] += dy[i * L->out + o] * x[i * L->in + k];
    }
  if (call->grad_input) {
    float* dx = data_of(call->grad_input);
    for (int64_t i = 0; i < B; ++i)
      for (int64_t k = 0; k < L->in; ++k) {
        float acc = 0;
        for (int64_t o = 0; o < L->out; ++o) acc += dy[i * L->out + o] * W[o * L->in + k];
        dx[i * L->in + k] = acc;
      }
  }
  return DPAR_OK;
}

dpar_custom_layer describe(CustomLinear* L) {
  static dpar_param_spec specs[2];
  specs[0] = dpar_param_spec{"weight", 2, {L->out, L->in, 0, 0}, DPAR_INIT_UNIFORM, 0.5f};
  specs[1] = dpar_param_spec{"bias", 1, {L->out, 0, 0, 0}, DPAR_INIT_ZEROS, 0.0f};
  dpar_custom_layer layer = DPAR_CUSTOM_LAYER_INIT;
  layer.name = "my_linear";
  layer.params = specs;
  layer.num_params = 2;
  layer.output_shape = linear_shape;
  layer.forward = linear_forward;
  layer.backward = linear_backward;
  layer.payload = L;
  return layer;
}

struct Data {
  std::vector<float> x;
  std::vector<int32_t> y;
  dpar_tensor *tx = nullptr, *ty = nullptr;
  Data(int64_t rows, int64_t in, int classes, unsigned seed) : x(rows * in), y(rows) {
    for (auto& v : x) v = float((seed = seed * 1103515245u + 12345u) >> 8) / float(1 << 24) - 0.5f;
    for (auto& v : y) v = int32_t((seed = seed * 1103515245u + 12345u) >> 16) % classes;
    int64_t xs[2] = {rows, in}, ys[1] = {rows};
    EXPECT_EQ(dpar_tensor_wrap_host(&tx, DPAR_F32, xs, 2, x.data()), DPAR_OK);
    EXPECT_EQ(dpar_tensor_wrap_host(&ty, DPAR_I32, ys, 1, y.data()), DPAR_OK);
  }
  ~Data() {
    dpar_tensor_free(tx);
    dpar_tensor_free(ty);
  }
};

std::vector<float> params_of(dpar_engine* e, size_t replica, size_t n) {
  std::vector<float> p(n);
  EXPECT_EQ(dpar_engine_get_params(p.data(), e, replica, p.size()), DPAR_OK) << dpar_last_error();
  return p;
}

TEST(CustomLayer, TrainsLikeTheBuiltInLinearOverThreeDevices) {
  CustomLinear L;
  L.in = 8;
  L.out = 4;
  dpar_model *custom = nullptr, *builtin = nullptr;
  ASSERT_OK(dpar_model_create(&custom, nullptr));
  ASSERT_OK(dpar_model_create(&builtin, nullptr));
  for (dpar_model* m : {custom, builtin}) {
    ASSERT_OK(dpar_model_add_linear(m, 6, 8, 1));
    ASSERT_OK(dpar_model_add_activation(m, DPAR_TANH));
  }
  dpar_custom_layer layer = describe(&L);
  ASSERT_OK(dpar_model_add_custom(custom, &layer));
  ASSERT_OK(dpar_model_add_linear(builtin, 8, 4, 1));
  // Same starting point: copy every parameter of the custom model into the built-in one.
  size_t nparams = 0;
  ASSERT_OK(dpar_model_num_params(&nparams, custom));
  ASSERT_EQ(nparams, 4u);
  for (size_t i = 0; i < nparams; ++i) {
    int64_t shape[DPAR_MAX_DIMS];
    size_t ndim = 0;
    ASSERT_OK(dpar_model_param_info(shape, &ndim, custom, i));
    int64_t n = 1;
    for (size_t d = 0; d < ndim; ++d) n *= shape[d];
    std::vector<float> v(static_cast<size_t>(n));
    ASSERT_OK(dpar_model_get_param(v.data(), custom, i, v.size()));
    ASSERT_OK(dpar_model_set_param(builtin, i, v.data(), v.size()));
  }
  const char* name = dpar_model_param_name(custom, 2);
  ASSERT_NE(name, nullptr) << dpar_last_error();
  EXPECT_STREQ(name, "2.weight");

  dpar_optimizer_options opt = DPAR_OPTIMIZER_OPTIONS_INIT;
  opt.lr = 0.1f;
  opt.momentum = 0.9f;
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = 3;
  dpar_engine *ec = nullptr, *eb = nullptr;
  ASSERT_OK(dpar_engine_create(&ec, custom, &opt, &eo));
  ASSERT_OK(dpar_engine_create(&eb, builtin, &opt, &eo));
  size_t n = 0;
  ASSERT_OK(dpar_model_num_param_elements(&n, custom));
  const auto initial = params_of(ec, 0, n);

  Data d(10, 6, 4, 3);  // 10 over 3 devices: 4, 4, 2
  for (int s = 0; s < 10; ++s) {
    float lc = 0, lb = 0;
    ASSERT_OK(dpar_engine_train_step(&lc, ec, d.tx, d.ty));
    ASSERT_OK(dpar_engine_train_step(&lb, eb, d.tx, d.ty));
    EXPECT_NEAR(lc, lb, 1e-5f * std::abs(lb)) << "step " << s;
  }
  const auto pc = params_of(ec, 0, n), pb = params_of(eb, 0, n);
  double worst = 0, moved = 0;
  for (size_t i = 0; i < pc.size(); ++i) {
    worst = std::max(worst, std::abs(double(pc[i]) - pb[i]) / std::max(std::abs(double(pb[i])), 1e-2));
    moved = std::max(moved, std::abs(double(pc[i]) - initial[i]));
  }
  EXPECT_LT(worst, 1e-5);
  EXPECT_GT(moved, 1e-2);
  for (size_t r = 1; r < 3; ++r) EXPECT_EQ(params_of(ec, r, n), pc);

  // The replica's own state persisted: each replica was called once per step, on its own worker.
  for (size_t r = 0; r < 3; ++r) EXPECT_EQ(L.forwards[r].load(), 10) << "replica " << r;

  // Gradient accumulation through the scratch path equals one batch.
  dpar_engine *acc = nullptr, *one = nullptr;
  ASSERT_OK(dpar_engine_create(&acc, custom, &opt, &eo));
  ASSERT_OK(dpar_engine_create(&one, custom, &opt, &eo));
  Data half1(5, 6, 4, 11), half2(5, 6, 4, 12), both(10, 6, 4, 0);
  std::memcpy(both.x.data(), half1.x.data(), 30 * sizeof(float));
  std::memcpy(both.x.data() + 30, half2.x.data(), 30 * sizeof(float));
  std::memcpy(both.y.data(), half1.y.data(), 5 * sizeof(int32_t));
  std::memcpy(both.y.data() + 5, half2.y.data(), 5 * sizeof(int32_t));
  ASSERT_OK(dpar_engine_accumulate(nullptr, acc, half1.tx, half1.ty));
  ASSERT_OK(dpar_engine_accumulate(nullptr, acc, half2.tx, half2.ty));
  ASSERT_OK(dpar_engine_step(acc));
  ASSERT_OK(dpar_engine_train_step(nullptr, one, both.tx, both.ty));
  const auto pa = params_of(acc, 0, n), po = params_of(one, 0, n);
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_NEAR(pa[i], po[i], 1e-5f * std::max(1.0f, std::abs(po[i])));

  dpar_engine_free(acc);
  dpar_engine_free(one);
  dpar_engine_free(ec);
  dpar_engine_free(eb);
  dpar_model_free(custom);
  dpar_model_free(builtin);
}

TEST(CustomLayer, CallbackFailureOnOneReplicaIsReportedWithoutDeadlock) {
  CustomLinear L;
  L.in = 5;
  L.out = 3;
  dpar_model* m = nullptr;
  ASSERT_OK(dpar_model_create(&m, nullptr));
  dpar_custom_layer layer = describe(&L);
  ASSERT_OK(dpar_model_add_custom(m, &layer));
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = 4;
  dpar_engine* e = nullptr;
  ASSERT_OK(dpar_engine_create(&e, m, nullptr, &eo));
  Data d(8, 5, 3, 1);
  size_t n = 0;
  ASSERT_OK(dpar_model_num_param_elements(&n, m));
  const auto before = params_of(e, 0, n);

  L.fail_replica = 2;
  dpar_clear_error();
  EXPECT_EQ(dpar_engine_train_step(nullptr, e, d.tx, d.ty), DPAR_ERR_DEVICE);
  const std::string msg = dpar_last_error();
  EXPECT_NE(msg.find("my_linear"), std::string::npos) << msg;
  EXPECT_NE(msg.find("cpu:2"), std::string::npos) << msg;
  EXPECT_EQ(params_of(e, 0, n), before);

  // Even a callback that reports a remote failure itself releases the other replicas at once: they report the
  // callback's failure, not a timeout waiting for replica 1.
  L.fail_replica = 1;
  L.fail_status = DPAR_ERR_REMOTE;
  EXPECT_EQ(dpar_engine_train_step(nullptr, e, d.tx, d.ty), DPAR_ERR_REMOTE);
  const std::string remote = dpar_last_error();
  EXPECT_NE(remote.find("my_linear"), std::string::npos) << remote;
  EXPECT_EQ(remote.find("did not arrive"), std::string::npos) << remote;
  EXPECT_EQ(params_of(e, 0, n), before);

  L.fail_replica = -1;
  ASSERT_OK(dpar_engine_train_step(nullptr, e, d.tx, d.ty));
  EXPECT_NE(params_of(e, 0, n), before);
  dpar_engine_free(e);
  dpar_model_free(m);
}

TEST(CustomLayer, DescriptionIsChecked) {
  CustomLinear L;
  L.in = 2;
  L.out = 2;
  dpar_model* m = nullptr;
  ASSERT_OK(dpar_model_create(&m, nullptr));
  dpar_custom_layer layer = describe(&L);
  layer.forward = nullptr;
  EXPECT_EQ(dpar_model_add_custom(m, &layer), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dpar_last_error()).find("forward"), std::string::npos);
  layer = describe(&L);
  layer.name = nullptr;
  EXPECT_EQ(dpar_model_add_custom(m, &layer), DPAR_ERR_INVALID_ARGUMENT);
  layer = describe(&L);
  layer.version = 99;
  EXPECT_EQ(dpar_model_add_custom(m, &layer), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dpar_last_error()).find("version"), std::string::npos);
  size_t layers = 1;
  ASSERT_OK(dpar_model_num_layers(&layers, m));
  EXPECT_EQ(layers, 0u);  // nothing was added by the refused calls
  dpar_model_free(m);
}

TEST(CustomLayer, CallbackMessagesReachTheCaller) {
  CustomLinear L;
  L.in = 5;
  L.out = 3;
  dpar_model* m = nullptr;
  ASSERT_OK(dpar_model_create(&m, nullptr));
  dpar_custom_layer layer = describe(&L);
  ASSERT_OK(dpar_model_add_custom(m, &layer));
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = 2;
  dpar_engine* e = nullptr;
  ASSERT_OK(dpar_engine_create(&e, m, nullptr, &eo));
  Data d(6, 5, 3, 7);

  // forward's own message, with its own status.
  L.fail_replica = 1;
  L.fail_status = DPAR_ERR_IO;
  L.fail_message = "the weights file vanished";
  EXPECT_EQ(dpar_engine_train_step(nullptr, e, d.tx, d.ty), DPAR_ERR_IO);
  std::string msg = dpar_last_error();
  EXPECT_NE(msg.find("my_linear"), std::string::npos) << msg;
  EXPECT_NE(msg.find("the weights file vanished"), std::string::npos) << msg;

  // A status dpar does not know becomes DPAR_ERR_INTERNAL; the message still arrives.
  L.fail_status = -1000;
  L.fail_message = "a code from the future";
  EXPECT_EQ(dpar_engine_train_step(nullptr, e, d.tx, d.ty), DPAR_ERR_INTERNAL);
  msg = dpar_last_error();
  EXPECT_NE(msg.find("a code from the future"), std::string::npos) << msg;

  // output_shape rejects an input with its own status and message.
  L.fail_replica = -1;
  Data wrong(6, 4, 3, 7);
  EXPECT_EQ(dpar_engine_train_step(nullptr, e, wrong.tx, wrong.ty), DPAR_ERR_MISMATCH);
  msg = dpar_last_error();
  EXPECT_NE(msg.find("my_linear takes 5 features"), std::string::npos) << msg;
  ASSERT_OK(dpar_engine_train_step(nullptr, e, d.tx, d.ty));
  dpar_engine_free(e);
  dpar_model_free(m);
}

TEST(CustomLayer, SetErrorReturnsItsStatusAndSetsTheMessage) {
  EXPECT_EQ(dpar_set_error(DPAR_ERR_TIMEOUT, "late"), DPAR_ERR_TIMEOUT);
  EXPECT_STREQ(dpar_last_error(), "late");
  EXPECT_EQ(dpar_set_error(DPAR_OK, nullptr), DPAR_OK);
  EXPECT_STREQ(dpar_last_error(), "");
  const std::string long_text(5000, 'x');
  dpar_set_error(DPAR_ERR_IO, long_text.c_str());
  EXPECT_EQ(std::strlen(dpar_last_error()), 2047u);  // truncated, never overflowing
  dpar_clear_error();
}

std::atomic<int> g_destroyed{0};
void count_destroy(void* payload) {
  EXPECT_NE(payload, nullptr);
  g_destroyed++;
}

TEST(CustomLayer, PayloadIsDestroyedOnceWhenTheLastHolderGoes) {
  CustomLinear L;
  L.in = 3;
  L.out = 2;
  g_destroyed = 0;
  dpar_model* m = nullptr;
  ASSERT_OK(dpar_model_create(&m, nullptr));
  dpar_custom_layer layer = describe(&L);
  layer.destroy = count_destroy;
  ASSERT_OK(dpar_model_add_custom(m, &layer));
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = 2;
  dpar_engine *e1 = nullptr, *e2 = nullptr;
  ASSERT_OK(dpar_engine_create(&e1, m, nullptr, &eo));
  ASSERT_OK(dpar_engine_create(&e2, m, nullptr, &eo));
  dpar_model_free(m);
  EXPECT_EQ(g_destroyed.load(), 0);  // the engines still call it
  Data d(4, 3, 2, 1);
  ASSERT_OK(dpar_engine_train_step(nullptr, e1, d.tx, d.ty));
  dpar_engine_free(e1);
  EXPECT_EQ(g_destroyed.load(), 0);
  ASSERT_OK(dpar_engine_train_step(nullptr, e2, d.tx, d.ty));
  dpar_engine_free(e2);
  EXPECT_EQ(g_destroyed.load(), 1);

  // A refused layer is released before the call returns; one of an unknown version is not touched.
  ASSERT_OK(dpar_model_create(&m, nullptr));
  layer.forward = nullptr;
  EXPECT_EQ(dpar_model_add_custom(m, &layer), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(g_destroyed.load(), 2);
  layer = describe(&L);
  layer.destroy = count_destroy;
  layer.version = 99;
  EXPECT_EQ(dpar_model_add_custom(m, &layer), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(g_destroyed.load(), 2);
  dpar_model_free(m);
  EXPECT_EQ(g_destroyed.load(), 2);
}

}  // namespace

namespace {

// A layer that blocks in forward until released, so that a test can abort an engine mid-step.
struct Gate {
  std::atomic<int> entered{0};
  std::atomic<bool> open{false};
};

dpar_status identity_shape(void*, int64_t* out, size_t* out_ndim, const int64_t* in, size_t in_ndim) {
  for (size_t i = 0; i < in_ndim; ++i) out[i] = in[i];
  *out_ndim = in_ndim;
  return 0;
}

dpar_status gated_forward(void* payload, const dpar_custom_call* call) {
  auto* g = static_cast<Gate*>(payload);
  g->entered++;
  if (call->replica == 0)
    while (!g->open.load()) std::this_thread::yield();
  std::memcpy(data_of(call->output), data_of(call->input), sizeof(float) * rows_of(call->input) * 4);
  return DPAR_OK;
}

dpar_status gated_backward(void*, const dpar_custom_call* call) {
  if (call->grad_input)
    std::memcpy(data_of(call->grad_input), data_of(call->grad_output), sizeof(float) * rows_of(call->input) * 4);
  return DPAR_OK;
}

}  // namespace

TEST(Abort, AbortFromAnotherThreadEndsTheCallInFlight) {
  Gate gate;
  dpar_model* m = nullptr;
  ASSERT_OK(dpar_model_create(&m, nullptr));
  ASSERT_OK(dpar_model_add_linear(m, 4, 4, 1));
  dpar_custom_layer layer = DPAR_CUSTOM_LAYER_INIT;
  layer.name = "gate";
  layer.output_shape = identity_shape;
  layer.forward = gated_forward;
  layer.backward = gated_backward;
  layer.payload = &gate;
  ASSERT_OK(dpar_model_add_custom(m, &layer));
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = 3;
  eo.loss = DPAR_LOSS_MSE;
  dpar_engine* e = nullptr;
  ASSERT_OK(dpar_engine_create(&e, m, nullptr, &eo));
  Data d(6, 4, 4, 2);
  std::vector<float> target(6 * 4, 0.5f);
  dpar_tensor* t = nullptr;
  int64_t ts[2] = {6, 4};
  ASSERT_OK(dpar_tensor_wrap_host(&t, DPAR_F32, ts, 2, target.data()));

  dpar_status status = DPAR_OK;
  std::string message;
  std::thread trainer([&] {
    status = dpar_engine_train_step(nullptr, e, d.tx, t);
    message = dpar_last_error();
  });
  while (gate.entered.load() < 3) std::this_thread::yield();  // replicas 1 and 2 go on to the all-reduce and wait
  ASSERT_OK(dpar_engine_abort(e));
  gate.open = true;  // replica 0 leaves its callback and finds the group aborted
  trainer.join();
  EXPECT_EQ(status, DPAR_ERR_REMOTE) << message;
  EXPECT_NE(message.find("aborted"), std::string::npos) << message;
  EXPECT_EQ(dpar_engine_train_step(nullptr, e, d.tx, t), DPAR_ERR_INVALID_STATE);
  EXPECT_NE(std::string(dpar_last_error()).find("dpar_engine_abort"), std::string::npos);
  dpar_tensor_free(t);
  dpar_engine_free(e);
  dpar_model_free(m);
}

// ---- The forward hook: its failure message and its payload's destructor ------------------------------------

namespace {

struct HookState {
  std::atomic<int> calls{0};
  int fail_replica = -1;
  std::atomic<int>* destroyed = nullptr;
};

dpar_status counting_hook(void* payload, size_t replica, const int64_t*, size_t, const int64_t*, size_t) {
  auto* h = static_cast<HookState*>(payload);
  h->calls++;
  if (static_cast<int>(replica) == h->fail_replica)
    return dpar_set_error(DPAR_ERR_DEVICE, ("the probe on replica " + std::to_string(replica) + " broke").c_str());
  return DPAR_OK;
}

void count_hook_destroy(void* payload) { (*static_cast<HookState*>(payload)->destroyed)++; }

TEST(ForwardHook, FailureCarriesTheHooksMessageAndPayloadsAreReleasedOnce) {
  dpar_model* m = nullptr;
  ASSERT_OK(dpar_model_create(&m, nullptr));
  ASSERT_OK(dpar_model_add_linear(m, 4, 3, 1));
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = 2;
  dpar_engine* e = nullptr;
  ASSERT_OK(dpar_engine_create(&e, m, nullptr, &eo));
  Data d(6, 4, 3, 5);
  std::atomic<int> destroyed_a{0}, destroyed_b{0};
  HookState a, b;
  a.destroyed = &destroyed_a;
  b.destroyed = &destroyed_b;
  a.fail_replica = 1;
  ASSERT_OK(dpar_engine_set_forward_hook(e, counting_hook, &a, count_hook_destroy));
  EXPECT_EQ(dpar_engine_train_step(nullptr, e, d.tx, d.ty), DPAR_ERR_DEVICE);
  const std::string msg = dpar_last_error();
  EXPECT_NE(msg.find("the probe on replica 1 broke"), std::string::npos) << msg;
  EXPECT_EQ(a.calls.load(), 2);
  EXPECT_EQ(destroyed_a.load(), 0);

  // Replacing the hook releases the old payload, once; removing it releases the new one.
  ASSERT_OK(dpar_engine_set_forward_hook(e, counting_hook, &b, count_hook_destroy));
  EXPECT_EQ(destroyed_a.load(), 1);
  ASSERT_OK(dpar_engine_train_step(nullptr, e, d.tx, d.ty));
  EXPECT_EQ(b.calls.load(), 2);
  ASSERT_OK(dpar_engine_set_forward_hook(e, nullptr, nullptr, nullptr));
  EXPECT_EQ(destroyed_b.load(), 1);

  // The engine's destruction releases the hook it still holds; a NULL hook with a payload releases it at once.
  ASSERT_OK(dpar_engine_set_forward_hook(e, counting_hook, &b, count_hook_destroy));
  dpar_engine_free(e);
  EXPECT_EQ(destroyed_b.load(), 2);
  EXPECT_EQ(destroyed_a.load(), 1);
  // A dead engine: the payload stays the caller's.
  EXPECT_EQ(dpar_engine_set_forward_hook(e, counting_hook, &a, count_hook_destroy), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(destroyed_a.load(), 1);
  dpar_model_free(m);
}

}  // namespace

namespace {

// A custom layer's forward that exports its weight through DLPack (as a callback handing it to PyTorch would)
// and keeps the export.
struct Exporter {
  CustomLinear linear;
  std::atomic<DLManagedTensor*> weight{nullptr};
};

dpar_status exporting_forward(void* payload, const dpar_custom_call* call) {
  auto* x = static_cast<Exporter*>(payload);
  if (call->replica == 0 && !x->weight.load()) {
    DLManagedTensor* m = nullptr;
    const dpar_status rc = dpar_tensor_to_dlpack(&m, call->params[0]);
    if (rc != DPAR_OK) return rc;
    x->weight = m;
  }
  return linear_forward(&x->linear, call);
}

TEST(CustomLayer, ExportedParameterOutlivesTheEngine) {
  Exporter x;
  x.linear.in = 3;
  x.linear.out = 2;
  dpar_model* m = nullptr;
  ASSERT_OK(dpar_model_create(&m, nullptr));
  dpar_custom_layer layer = describe(&x.linear);
  layer.payload = &x;
  layer.forward = exporting_forward;
  ASSERT_OK(dpar_model_add_custom(m, &layer));
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = 2;
  dpar_engine* e = nullptr;
  ASSERT_OK(dpar_engine_create(&e, m, nullptr, &eo));
  Data d(4, 3, 2, 1);
  ASSERT_OK(dpar_engine_train_step(nullptr, e, d.tx, d.ty));
  const std::vector<float> params = params_of(e, 0, 8);  // weight (2, 3) then bias (2)
  dpar_engine_free(e);
  dpar_model_free(m);
  DLManagedTensor* w = x.weight.load();
  ASSERT_NE(w, nullptr);
  // The replica's parameter memory must still be there (a use after free under AddressSanitizer otherwise).
  ASSERT_EQ(w->dl_tensor.ndim, 2);
  const float* f = static_cast<const float*>(w->dl_tensor.data);
  EXPECT_EQ(std::vector<float>(f, f + 6), std::vector<float>(params.begin(), params.begin() + 6));
  w->deleter(w);
}

}  // namespace

namespace {

// A forward hook that tries to install another hook on its own engine, which is refused (the engine's lock is
// held by the call that runs the hook); the refused payload must still be released.
struct ReentrantHook {
  dpar_engine* engine = nullptr;
  std::atomic<int> refused{0};
  std::atomic<int> other_status{DPAR_OK};
  HookState other;  // the payload offered from inside the hook
};

dpar_status reentrant_hook(void* payload, size_t replica, const int64_t*, size_t, const int64_t*, size_t) {
  auto* r = static_cast<ReentrantHook*>(payload);
  if (replica != 0) return DPAR_OK;
  const dpar_status rc = dpar_engine_set_forward_hook(r->engine, counting_hook, &r->other, count_hook_destroy);
  r->other_status = rc;
  if (rc != DPAR_OK) r->refused++;
  return DPAR_OK;
}

TEST(ForwardHook, RefusedFromInsideTheHookStillReleasesThePayload) {
  dpar_model* m = nullptr;
  ASSERT_OK(dpar_model_create(&m, nullptr));
  ASSERT_OK(dpar_model_add_linear(m, 4, 3, 1));
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = 2;
  ReentrantHook r;
  ASSERT_OK(dpar_engine_create(&r.engine, m, nullptr, &eo));
  std::atomic<int> destroyed_other{0};
  r.other.destroyed = &destroyed_other;
  ASSERT_OK(dpar_engine_set_forward_hook(r.engine, reentrant_hook, &r, nullptr));
  Data d(6, 4, 3, 5);
  ASSERT_OK(dpar_engine_train_step(nullptr, r.engine, d.tx, d.ty));
  EXPECT_EQ(r.refused.load(), 1);
  EXPECT_EQ(r.other_status.load(), DPAR_ERR_INVALID_STATE);
  EXPECT_EQ(destroyed_other.load(), 1) << "the refused payload's destroy was not called";
  EXPECT_EQ(r.other.calls.load(), 0);
  dpar_engine_free(r.engine);
  EXPECT_EQ(destroyed_other.load(), 1);
  dpar_model_free(m);
}

}  // namespace
