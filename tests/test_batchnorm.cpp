// BatchNorm1d, BatchNorm2d and SyncBatchNorm against their references: finite differences for backward, PyTorch's
// numbers (tests/data/batchnorm_reference.json, from tests/reference/make_batchnorm_reference.py), one device on
// the full batch for SyncBatchNorm on N devices, DataParallel's per-chunk statistics for plain BatchNorm; buffers
// through checkpoints and eval mode.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "common/error.h"
#include "engine/engine.h"
#include "io/safetensors.h"
#include "kernels/cpu/kernels.h"
#include "partial_stream.h"
#include "engine_test_util.h"

using namespace dpar;

namespace {

using test::cpu_devices;
using test::host_stream;
using test::host_tensor;
using test::max_relative_error;
using test::randn;

// One BatchNorm layer bound to host memory of its own, outside any model or engine.
struct Rig {
  std::unique_ptr<Layer> layer;
  Tensor w, b, dw, db, running_mean, running_var, tracked;
  uint64_t rng_offset = 0;
  Fault fault = Fault::kNone;
  ReplicaContext ctx;

  Rig(int dims, int64_t c, float eps, float momentum, bool affine) {
    layer = make_batchnorm(dims, c, eps, momentum, affine);
    w = Tensor::zeros(DType::kF32, Shape{c}, Device{});
    b = Tensor::zeros(DType::kF32, Shape{c}, Device{});
    dw = Tensor::zeros(DType::kF32, Shape{c}, Device{});
    db = Tensor::zeros(DType::kF32, Shape{c}, Device{});
    running_mean = Tensor::zeros(DType::kF32, Shape{c}, Device{});
    running_var = Tensor::zeros(DType::kF32, Shape{c}, Device{});
    for (int64_t i = 0; i < c; ++i) running_var.f32()[i] = 1.0f, w.f32()[i] = 1.0f;
    tracked = Tensor::zeros(DType::kI64, Shape{1}, Device{});
    if (affine) layer->bind({w, b}, {dw, db});
    layer->bind_buffers({running_mean, running_var, tracked});
    ctx.stream = &host_stream();
    ctx.rng_offset = &rng_offset;
    ctx.armed_fault = &fault;
  }
  int64_t num_batches_tracked() const { return *tracked.data<int64_t>(); }
  Tensor forward(const Tensor& x) {
    Tensor y = Tensor::empty(DType::kF32, x.shape(), Device{});
    layer->forward(ctx, x, y);
    return y;
  }
  Tensor backward(const Tensor& x, const Tensor& y, const Tensor& dout) {
    Tensor dx = Tensor::empty(DType::kF32, x.shape(), Device{});
    layer->backward(ctx, x, y, dout, dx, false);
    return dx;
  }
};

// sum(out * r) in double
double weighted_sum(const Tensor& out, const std::vector<float>& r) {
  double s = 0;
  for (int64_t i = 0; i < out.numel(); ++i) s += double(out.f32()[i]) * r[static_cast<size_t>(i)];
  return s;
}

struct FdCase {
  int dims;
  Shape shape;
  bool affine;
};

// Training mode: dL/dx, dL/dweight and dL/dbias of L = sum(out * r) against central differences.
TEST(BatchNorm, BackwardMatchesFiniteDifferences) {
  for (const FdCase& fc : {FdCase{1, Shape{5, 3}, true}, FdCase{1, Shape{4, 3, 5}, false}, FdCase{1, Shape{3, 2, 4}, true},
                           FdCase{2, Shape{3, 2, 3, 2}, true}, FdCase{2, Shape{2, 3, 2, 2}, false},
                           FdCase{0, Shape{3, 2, 2, 2}, true}}) {
    const int64_t c = fc.shape[1];
    Rig rig(fc.dims, c, 1e-5f, 0.1f, fc.affine);
    const auto wv = randn(static_cast<size_t>(c), 3, 0.3f, 1.0f), bv = randn(static_cast<size_t>(c), 4);
    std::copy(wv.begin(), wv.end(), rig.w.f32());
    std::copy(bv.begin(), bv.end(), rig.b.f32());
    const size_t n = static_cast<size_t>(fc.shape.numel());
    std::vector<float> xv = randn(n, 5, 1.5f, 0.3f);
    const auto r = randn(n, 6);
    Tensor x = host_tensor(xv, fc.shape);
    const Tensor y = rig.forward(x);
    const Tensor dx = rig.backward(x, y, host_tensor(r, fc.shape));
    const double h = 1e-2;
    auto loss_at = [&](float* p, size_t i, double delta) {
      const float keep = p[i];
      p[i] = static_cast<float>(keep + delta);
      const double l = weighted_sum(rig.forward(x), r);
      p[i] = keep;
      return l;
    };
    auto check = [&](float* p, const float* grad, size_t count, const char* what) {
      for (size_t i = 0; i < count; ++i) {
        const double fd = (loss_at(p, i, h) - loss_at(p, i, -h)) / (2 * h);
        EXPECT_NEAR(grad[i], fd, 2e-3 * std::max(1.0, std::abs(fd))) << what << "[" << i << "] " << fc.shape.str();
      }
    };
    check(x.f32(), dx.f32(), n, "dx");
    if (fc.affine) {
      check(rig.w.f32(), rig.dw.f32(), static_cast<size_t>(c), "dweight");
      check(rig.b.f32(), rig.db.f32(), static_cast<size_t>(c), "dbias");
    }
  }
}

void expect_close(const float* got, const nlohmann::json& want, double tol, const std::string& what) {
  for (size_t i = 0; i < want.size(); ++i) {
    const double w = want[i].get<double>();
    ASSERT_NEAR(got[i], w, tol * std::max(1.0, std::abs(w))) << what << "[" << i << "]";
  }
}

TEST(BatchNorm, MatchesPyTorch) {
  std::ifstream in(std::string(DPAR_TEST_DATA_DIR) + "/batchnorm_reference.json");
  ASSERT_TRUE(in.good());
  const nlohmann::json ref = nlohmann::json::parse(in);
  ASSERT_EQ(ref["cases"].size(), 3u);
  for (const auto& cs : ref["cases"]) {
    const std::string name = cs["name"];
    const auto dims_v = cs["shape"].get<std::vector<int64_t>>();
    Shape shape;
    if (dims_v.size() == 2) shape = Shape{dims_v[0], dims_v[1]};
    if (dims_v.size() == 3) shape = Shape{dims_v[0], dims_v[1], dims_v[2]};
    if (dims_v.size() == 4) shape = Shape{dims_v[0], dims_v[1], dims_v[2], dims_v[3]};
    const bool affine = cs["affine"];
    const int64_t c = shape[1];
    Rig rig(dims_v.size() == 4 ? 2 : 1, c, cs["eps"].get<float>(), cs["momentum"].get<float>(), affine);
    if (affine) {
      const auto wv = cs["weight"].get<std::vector<float>>(), bv = cs["bias"].get<std::vector<float>>();
      std::copy(wv.begin(), wv.end(), rig.w.f32());
      std::copy(bv.begin(), bv.end(), rig.b.f32());
    }
    for (size_t s = 0; s < cs["xs"].size(); ++s) {
      const Tensor x = host_tensor(cs["xs"][s].get<std::vector<float>>(), shape);
      const Tensor y = rig.forward(x);
      expect_close(y.f32(), cs["outputs"][s], 1e-5, name + " output " + std::to_string(s));
      if (s == 0) {
        const Tensor dx = rig.backward(x, y, host_tensor(cs["dout"].get<std::vector<float>>(), shape));
        expect_close(dx.f32(), cs["dx"], 1e-5, name + " dx");
        if (affine) {
          expect_close(rig.dw.f32(), cs["dweight"], 1e-5, name + " dweight");
          expect_close(rig.db.f32(), cs["dbias"], 1e-5, name + " dbias");
        }
      }
    }
    expect_close(rig.running_mean.f32(), cs["running_mean"], 1e-6, name + " running_mean");
    expect_close(rig.running_var.f32(), cs["running_var"], 1e-6, name + " running_var");
    EXPECT_EQ(rig.num_batches_tracked(), cs["num_batches_tracked"].get<int64_t>()) << name;
    rig.ctx.training = false;
    const Tensor y = rig.forward(host_tensor(cs["x_eval"].get<std::vector<float>>(), shape));
    expect_close(y.f32(), cs["eval_output"], 1e-5, name + " eval output");
    EXPECT_EQ(rig.num_batches_tracked(), cs["num_batches_tracked"].get<int64_t>()) << name << ": eval counts nothing";
  }
}

TEST(BatchNorm, ChecksItsArgumentsAndShapes) {
  EXPECT_THROW(make_batchnorm(1, 0, 1e-5f, 0.1f, true), Error);
  EXPECT_THROW(make_batchnorm(1, 4, 0.0f, 0.1f, true), Error);
  EXPECT_THROW(make_batchnorm(1, 4, 1e-5f, 1.5f, true), Error);
  EXPECT_THROW(make_batchnorm(1, 4, 1e-5f, 0.1f, true)->output_shape(Shape{2, 4, 2, 2}), Error);
  EXPECT_THROW(make_batchnorm(2, 4, 1e-5f, 0.1f, true)->output_shape(Shape{2, 4}), Error);
  EXPECT_THROW(make_batchnorm(0, 4, 1e-5f, 0.1f, true)->output_shape(Shape{2, 3}), Error);
  EXPECT_EQ(make_batchnorm(0, 4, 1e-5f, 0.1f, true)->output_shape(Shape{2, 4, 3, 3}), (Shape{2, 4, 3, 3}));
  // One value per channel cannot be normalised in training mode (PyTorch refuses it too).
  Rig rig(1, 3, 1e-5f, 0.1f, true);
  EXPECT_THROW(rig.forward(host_tensor({1, 2, 3}, Shape{1, 3})), Error);
}

TEST(BatchNorm, ModelKeepsBuffersApartFromParameters) {
  Model m(1);
  m.add(make_linear(4, 3, false));
  m.add(make_batchnorm(1, 3, 1e-5f, 0.1f, true));
  m.add(make_batchnorm(1, 3, 1e-5f, 0.1f, false));
  ASSERT_EQ(m.params().size(), 3u);
  EXPECT_EQ(m.params()[1].name, "1.weight");
  EXPECT_EQ(m.num_param_elements(), 12 + 3 + 3);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(m.values()[static_cast<size_t>(12 + i)], 1.0f);  // weight: ones
  for (int i = 0; i < 3; ++i) EXPECT_EQ(m.values()[static_cast<size_t>(15 + i)], 0.0f);  // bias: zeros
  ASSERT_EQ(m.buffers().size(), 6u);
  EXPECT_EQ(m.buffers()[0].name, "1.running_mean");
  EXPECT_EQ(m.buffers()[1].name, "1.running_var");
  EXPECT_EQ(m.buffers()[2].name, "1.num_batches_tracked");
  EXPECT_EQ(m.buffers()[2].dtype, DType::kI64);
  EXPECT_EQ(m.buffers()[2].shape.ndim(), 0u);
  EXPECT_EQ(m.buffers()[5].name, "2.num_batches_tracked");
  EXPECT_EQ(m.buffer_f32(), (std::vector<float>{0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1}));
  EXPECT_EQ(m.buffer_i64(), (std::vector<int64_t>{0, 0}));
  EXPECT_FALSE(m.uses_collectives());
  m.convert_sync_batchnorm();
  EXPECT_TRUE(m.uses_collectives());
  EXPECT_EQ(m.layer(1).describe(), "sync_batchnorm(3)");
  EXPECT_EQ(m.buffers().size(), 6u);
}

// A layer of one parameter of each initialiser, for the model's initialisation.
class Initialised final : public Layer {
 public:
  std::string describe() const override { return "initialised"; }
  std::vector<ParamSpec> param_specs() const override {
    return {{"zeros", Shape{3}, InitKind::kZeros},
            {"ones", Shape{3}, InitKind::kOnes},
            {"normal", Shape{100, 100}, InitKind::kNormal, 0.5f}};
  }
  Shape output_shape(const Shape& in) const override { return in; }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<Initialised>(); }
  void forward(const ReplicaContext&, const Tensor&, const Tensor&) override {}
  void backward(const ReplicaContext&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, bool) override {}
};

TEST(Initialisers, OnesAndNormalDrawAsTheySay) {
  Model m(5);
  m.add(std::make_unique<Initialised>());
  const auto& v = m.values();
  EXPECT_EQ(std::vector<float>(v.begin(), v.begin() + 6), (std::vector<float>{0, 0, 0, 1, 1, 1}));
  double sum = 0, sq = 0;
  for (size_t i = 6; i < v.size(); ++i) sum += v[i], sq += double(v[i]) * v[i];
  const double n = static_cast<double>(v.size() - 6), mean = sum / n, sd = std::sqrt(sq / n - mean * mean);
  EXPECT_NEAR(mean, 0.0, 0.02);  // 4 standard errors of 10^4 draws of N(0, 0.5^2)
  EXPECT_NEAR(sd, 0.5, 0.015);
  Model again(5);
  again.add(std::make_unique<Initialised>());
  EXPECT_EQ(again.values(), v);  // from the model's seed
}

// A backend's stream that has no batch norm kernels refuses each of them with NOT_SUPPORTED naming the kernel and
// the device, before running anything.
TEST(BatchNorm, AStreamWithoutItsKernelsRefusesWithNotSupported) {
  test::PartialStream stream([](const KernelKey& key) {
    return key.op < Op::kBatchNormStats || key.op > Op::kBatchNormBackwardApply;
  });
  float x[4] = {};
  double sums[3] = {};
  const TensorRef xs = TensorRef::of(x, {1, 1, 4});
  const std::vector<std::pair<KernelCall, std::string>> calls{
      {call::BatchNormStats{TensorRef::of(sums, {3}), xs}, "batchnorm_stats (f32)"},
      {call::BatchNormApply{xs, xs, TensorRef::of(sums, {2}), {}, {}, Epilogue::kRelu},
       "batchnorm_apply (f32, relu epilogue)"},
      {call::BatchNormBackwardReduce{TensorRef::of(sums, {2}), xs, xs, TensorRef::of(sums, {2})},
       "batchnorm_backward_reduce (f32)"}};
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

struct Batch {
  Tensor x, y;
};

Batch make_batch(int64_t rows, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  Batch b{Tensor::empty(DType::kF32, Shape{rows, 12}, Device{}), Tensor::empty(DType::kI32, Shape{rows}, Device{})};
  for (int64_t i = 0; i < rows * 12; ++i) b.x.f32()[i] = normal(gen) * 2.0f + 1.0f;
  for (int64_t i = 0; i < rows; ++i) b.y.i32()[i] = static_cast<int32_t>(gen() % 5);
  return b;
}

// linear (no bias, as before a BatchNorm), BatchNorm1d, tanh, linear, BatchNorm1d without affine, linear.
Model bn_mlp(uint64_t seed, bool sync) {
  Model m(seed);
  m.add(make_linear(12, 16, false));
  m.add(make_batchnorm(1, 16, 1e-5f, 0.1f, true));
  m.add(make_activation(Activation::kTanh));
  m.add(make_linear(16, 8, false));
  m.add(make_batchnorm(1, 8, 1e-5f, 0.3f, false));
  m.add(make_linear(8, 5, true));
  if (sync) m.convert_sync_batchnorm();
  return m;
}

OptimizerConfig adam() {
  OptimizerConfig c;
  c.kind = OptimizerKind::kAdam;
  c.lr = 1e-2f;
  return c;
}

std::vector<float> engine_buffers_f32(const Engine& e, size_t replica) {
  std::vector<float> out;
  for (size_t i = 0; i < e.model().buffers().size(); ++i) {
    const BufferInfo& b = e.model().buffers()[i];
    if (b.dtype != DType::kF32) continue;
    std::vector<float> v(static_cast<size_t>(buffer_numel(b.shape)));
    e.read_buffer(v.data(), replica, i);
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

std::vector<int64_t> engine_buffers_i64(const Engine& e, size_t replica) {
  std::vector<int64_t> out;
  for (size_t i = 0; i < e.model().buffers().size(); ++i)
    if (e.model().buffers()[i].dtype == DType::kI64) {
      int64_t v = 0;
      e.read_buffer(&v, replica, i);
      out.push_back(v);
    }
  return out;
}

// The DataParallel reference: each chunk of the batch (split_batch) runs on its own replica, which starts the step
// with the parameters and with replica 0's buffers; the gradients of the mean loss over the whole batch are
// summed; one Adam step. With one chunk this is one device on the full batch. Returns parameters, then f32
// buffers, then i64 buffers (replica 0's) through the out-arguments.
std::vector<float> data_parallel(const Model& model, const std::vector<Batch>& data, int steps, size_t devices,
                                 std::vector<float>* buffers, std::vector<int64_t>* counters,
                                 LossKind loss = LossKind::kCrossEntropy) {
  std::vector<uint64_t> offsets(devices, 0);
  std::vector<Fault> faults(devices, Fault::kNone);
  std::vector<ReplicaContext> ctxs(devices);
  std::vector<std::unique_ptr<ReplicaModel>> reps;
  for (size_t r = 0; r < devices; ++r) {
    ctxs[r].rng_offset = &offsets[r];
    ctxs[r].armed_fault = &faults[r];
    ctxs[r].stream = &host_stream();
    reps.push_back(std::make_unique<ReplicaModel>(model, ctxs[r]));
  }
  const int64_t n = model.num_param_elements();
  std::vector<float> params(model.values()), grads(static_cast<size_t>(n));
  Optimizer optimizer(adam(), 0, n, Device{});
  for (int s = 0; s < steps; ++s) {
    const Batch& b = data[static_cast<size_t>(s) % data.size()];
    const int64_t rows = b.x.rows();
    const auto split = split_batch(rows, devices);
    std::fill(grads.begin(), grads.end(), 0.0f);
    int64_t begin = 0;
    for (size_t r = 0; r < devices; ++r) {
      if (split[r] == 0) continue;
      ReplicaModel& rep = *reps[r];
      std::copy(params.begin(), params.end(), rep.params_for_writing());
      std::copy(reps[0]->buffer_f32(), reps[0]->buffer_f32() + reps[0]->num_buffer_f32(), rep.buffer_f32());
      std::copy(reps[0]->buffer_i64(), reps[0]->buffer_i64() + reps[0]->num_buffer_i64(), rep.buffer_i64());
      const Tensor x = b.x.rows(begin, split[r]);
      Tensor out = rep.forward(ctxs[r], x);
      Tensor dout = rep.output_grad_buffer(ctxs[r]);
      if (loss == LossKind::kCrossEntropy)
        kernels::cpu::cross_entropy_forward_backward(dout.f32(), out.f32(), b.y.i32() + begin, split[r], 5,
                                                     1.0f / static_cast<float>(rows));
      else
        kernels::cpu::mse_forward_backward(dout.f32(), out.f32(), b.y.rows(begin, split[r]).f32(), split[r],
                                           out.shape().row_numel(), 1.0f / static_cast<float>(rows));
      rep.backward(ctxs[r], dout, false);
      for (int64_t i = 0; i < n; ++i) grads[static_cast<size_t>(i)] += rep.grads()[i];
      begin += split[r];
    }
    optimizer.step(host_stream(), params.data(), grads.data());
  }
  buffers->assign(reps[0]->buffer_f32(), reps[0]->buffer_f32() + reps[0]->num_buffer_f32());
  counters->assign(reps[0]->buffer_i64(), reps[0]->buffer_i64() + reps[0]->num_buffer_i64());
  return params;
}

// 10 rows over 8 devices are 2,2,2,2,2,0,0,0: three replicas have no rows and still take part in the sums.
TEST(SyncBatchNorm, NDevicesTrainAsOneDeviceOnTheFullBatch) {
  const Model model = bn_mlp(5, true);
  constexpr int kSteps = 8;
  for (const auto& [devices, rows] : std::vector<std::pair<size_t, int64_t>>{{2, 31}, {3, 10}, {8, 10}}) {
    std::vector<Batch> data;
    for (int i = 0; i < 3; ++i) data.push_back(make_batch(rows, 40 + static_cast<uint32_t>(i)));
    std::vector<float> want_buffers;
    std::vector<int64_t> want_counters;
    const auto want = data_parallel(model, data, kSteps, 1, &want_buffers, &want_counters);
    Engine engine(model, adam(), cpu_devices(devices));
    for (int s = 0; s < kSteps; ++s) engine.train_step(data[s % 3].x, data[s % 3].y);
    const auto got = engine.params(0);
    EXPECT_LT(max_relative_error(got, want), 1e-4) << devices << " devices";
    EXPECT_GT(max_relative_error(got, model.values()), 1e-2);  // training moved them
    const auto buffers = engine_buffers_f32(engine, 0);
    EXPECT_LT(max_relative_error(buffers, want_buffers), 1e-4) << devices << " devices: running statistics";
    EXPECT_GT(max_relative_error(buffers, model.buffer_f32()), 1e-2);
    EXPECT_EQ(engine_buffers_i64(engine, 0), (std::vector<int64_t>{kSteps, kSteps}));
    EXPECT_EQ(want_counters, (std::vector<int64_t>{kSteps, kSteps}));
    for (size_t r = 1; r < devices; ++r) {
      EXPECT_EQ(engine.params(r), got) << "replica " << r;
      EXPECT_EQ(engine_buffers_f32(engine, r), buffers) << "replica " << r;
      EXPECT_EQ(engine_buffers_i64(engine, r), engine_buffers_i64(engine, 0)) << "replica " << r;
    }
  }
}

// (B, C, H, W): BatchNorm2d layers converted to SyncBatchNorm, trained with MSE, on 3 and 8 devices.
TEST(SyncBatchNorm, FourDimensionalInputsTrainAsOneDevice) {
  Model model(13);
  model.add(make_batchnorm(2, 3, 1e-5f, 0.1f, true));
  model.add(make_activation(Activation::kTanh));
  model.add(make_batchnorm(2, 3, 1e-3f, 0.2f, true));
  model.convert_sync_batchnorm();
  constexpr int kSteps = 6;
  for (const auto& [devices, rows] : std::vector<std::pair<size_t, int64_t>>{{3, 7}, {8, 10}}) {
    std::vector<Batch> data;
    for (uint32_t i = 0; i < 2; ++i) {
      const size_t n = static_cast<size_t>(rows) * 12;
      data.push_back({host_tensor(randn(n, 100 + i, 2.0f, 0.5f), Shape{rows, 3, 2, 2}),
                      host_tensor(randn(n, 200 + i, 0.5f, 0.3f), Shape{rows, 3, 2, 2})});
    }
    std::vector<float> want_buffers;
    std::vector<int64_t> want_counters;
    const auto want = data_parallel(model, data, kSteps, 1, &want_buffers, &want_counters, LossKind::kMse);
    EngineConfig config = cpu_devices(devices);
    config.loss = LossKind::kMse;
    Engine engine(model, adam(), config);
    for (int s = 0; s < kSteps; ++s) engine.train_step(data[s % 2].x, data[s % 2].y);
    const auto got = engine.params(0);
    EXPECT_LT(max_relative_error(got, want), 1e-4) << devices << " devices";
    EXPECT_GT(max_relative_error(got, model.values()), 1e-2);
    EXPECT_LT(max_relative_error(engine_buffers_f32(engine, 0), want_buffers), 1e-4);
    for (size_t r = 1; r < devices; ++r) {
      EXPECT_EQ(engine.params(r), got) << "replica " << r;
      EXPECT_EQ(engine_buffers_f32(engine, r), engine_buffers_f32(engine, 0)) << "replica " << r;
    }
  }
}

// Plain BatchNorm normalises each chunk by itself, as DataParallel does; every replica ends with replica 0's
// running statistics.
TEST(BatchNorm, NDevicesNormalisePerChunkAsDataParallel) {
  const Model model = bn_mlp(7, false);
  constexpr int kSteps = 6;
  for (const auto& [devices, rows] : std::vector<std::pair<size_t, int64_t>>{{3, 13}, {8, 10}}) {
    std::vector<Batch> data;
    for (int i = 0; i < 3; ++i) data.push_back(make_batch(rows, 60 + static_cast<uint32_t>(i)));
    std::vector<float> want_buffers, full_buffers;
    std::vector<int64_t> want_counters, full_counters;
    const auto want = data_parallel(model, data, kSteps, devices, &want_buffers, &want_counters);
    const auto full = data_parallel(model, data, kSteps, 1, &full_buffers, &full_counters);
    Engine engine(model, adam(), cpu_devices(devices));
    for (int s = 0; s < kSteps; ++s) engine.train_step(data[s % 3].x, data[s % 3].y);
    const auto got = engine.params(0);
    EXPECT_LT(max_relative_error(got, want), 1e-4) << devices << " devices";
    EXPECT_GT(max_relative_error(got, full), 1e-3) << "per-chunk statistics differ from the full batch's";
    const auto buffers = engine_buffers_f32(engine, 0);
    EXPECT_LT(max_relative_error(buffers, want_buffers), 1e-4);
    EXPECT_EQ(engine_buffers_i64(engine, 0), (std::vector<int64_t>{kSteps, kSteps}));
    for (size_t r = 1; r < devices; ++r) {
      EXPECT_EQ(engine.params(r), got) << "replica " << r;
      EXPECT_EQ(engine_buffers_f32(engine, r), buffers) << "replica " << r;
      EXPECT_EQ(engine_buffers_i64(engine, r), engine_buffers_i64(engine, 0)) << "replica " << r;
    }
  }
}

// forward(), backward() and step() keep the buffers equal too, and eval mode normalises with them.
TEST(BatchNorm, ForwardBackwardStepAndEvalMode) {
  for (bool sync : {false, true}) {
    const Model model = bn_mlp(9, sync);
    const Batch b = make_batch(9, 77);  // 3,3,3,0 over 4 devices
    Engine fused(model, adam(), cpu_devices(4)), apart(model, adam(), cpu_devices(4));
    for (int s = 0; s < 3; ++s) {
      fused.train_step(b.x, b.y);
      const Tensor out = apart.forward(b.x);
      Tensor grad = Tensor::empty(DType::kF32, out.shape(), Device{});
      kernels::cpu::cross_entropy_forward_backward(grad.f32(), out.f32(), b.y.i32(), 9, 5, 1.0f / 9);
      apart.backward(grad);
      apart.step();
    }
    EXPECT_LT(max_relative_error(apart.params(0), fused.params(0)), 1e-5);
    EXPECT_LT(max_relative_error(engine_buffers_f32(apart, 0), engine_buffers_f32(fused, 0)), 1e-5);
    for (size_t r = 1; r < 4; ++r) {
      EXPECT_EQ(apart.params(r), apart.params(0));
      EXPECT_EQ(engine_buffers_f32(apart, r), engine_buffers_f32(apart, 0));
    }
    // Eval mode: the running statistics, unchanged by the call; the output of the whole batch does not depend on
    // how it was split.
    fused.set_training(false);
    const auto before = engine_buffers_f32(fused, 0);
    const Tensor y4 = fused.forward(b.x);
    EXPECT_EQ(engine_buffers_f32(fused, 0), before);
    EXPECT_EQ(engine_buffers_i64(fused, 0), (std::vector<int64_t>{3, 3}));
    // The same model evaluated on one device, from the engine's parameters and buffers.
    Model one = model;
    one.values() = fused.params(0);
    one.buffer_f32() = before;
    uint64_t offset = 0;
    Fault fault = Fault::kNone;
    ReplicaContext ctx;
    ctx.rng_offset = &offset;
    ctx.armed_fault = &fault;
    ctx.stream = &host_stream();
    ctx.training = false;
    ReplicaModel rep(one, ctx);
    const Tensor y1 = rep.forward(ctx, b.x);
    for (int64_t i = 0; i < y1.numel(); ++i) EXPECT_NEAR(y4.f32()[i], y1.f32()[i], 1e-5) << i;
  }
}

TEST(BatchNorm, CheckpointsKeepBuffersUnderPyTorchNames) {
  const Model model = bn_mlp(11, true);
  const Batch b = make_batch(9, 5);
  Engine engine(model, adam(), cpu_devices(2));
  for (int s = 0; s < 3; ++s) engine.train_step(b.x, b.y);
  const std::string path = ::testing::TempDir() + "/dpar_batchnorm.safetensors";
  engine.save(path);
  const io::SafetensorsFile file = io::SafetensorsFile::read(path);
  ASSERT_TRUE(file.has("1.running_mean"));
  EXPECT_EQ(file.entry("1.running_mean").dtype, "F32");
  EXPECT_EQ(file.entry("1.running_var").shape, (std::vector<int64_t>{16}));
  ASSERT_TRUE(file.has("4.num_batches_tracked"));
  EXPECT_EQ(file.entry("4.num_batches_tracked").dtype, "I64");
  EXPECT_TRUE(file.entry("4.num_batches_tracked").shape.empty());
  int64_t tracked = 0;
  std::memcpy(&tracked, file.data("4.num_batches_tracked"), sizeof tracked);
  EXPECT_EQ(tracked, 3);
  EXPECT_FALSE(file.has("optimizer.exp_avg.1.running_mean"));

  Engine restored(model, adam(), cpu_devices(3));
  restored.load(path);
  for (size_t r = 0; r < 3; ++r) {
    EXPECT_EQ(engine_buffers_f32(restored, r), engine_buffers_f32(engine, 0));
    EXPECT_EQ(engine_buffers_i64(restored, r), (std::vector<int64_t>{3, 3}));
  }
  engine.train_step(b.x, b.y);
  restored.train_step(b.x, b.y);
  EXPECT_LT(max_relative_error(restored.params(0), engine.params(0)), 1e-5);
  EXPECT_LT(max_relative_error(engine_buffers_f32(restored, 0), engine_buffers_f32(engine, 0)), 1e-5);

  // A model without those buffers refuses the file.
  Model other(11);
  other.add(make_linear(12, 16, false));
  other.add(make_linear(16, 5, true));
  Engine mismatched(other, adam(), cpu_devices(1));
  EXPECT_THROW(mismatched.load(path), Error);
  std::remove(path.c_str());
}

}  // namespace
