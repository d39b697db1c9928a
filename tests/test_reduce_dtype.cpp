// The reduce dtype bf16 (Engine::set_reduce_dtype, dpar_engine_set_reduce_dtype): the step's gradient against its
// definition, recomputed on the host from each replica's own f32 gradient (each rounded to bf16, added in f32 in
// replica order, the sum rounded to bf16 once, widened and scaled by 1 / batch), bit for bit, under both gradient
// reductions; replicas bit-identical; the rounding real (f32 trains elsewhere) and training; refusals.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "common/bf16.h"
#include "common/error.h"
#include "engine/engine.h"
#include "engine_test_util.h"
#include "nn/loss.h"
#include "optim/optimizer.h"

namespace dpar {
namespace {

using test::cpu_devices;
using test::Standalone;

Model make_mlp(uint64_t seed) {
  Model m(seed);
  m.add(make_linear(12, 16, true));
  m.add(make_activation(Activation::kTanh));
  m.add(make_linear(16, 16, true));
  m.add(make_activation(Activation::kRelu));
  m.add(make_linear(16, 5, true));
  return m;
}

struct Batch {
  Tensor x, y;
};

Batch make_batch(int64_t rows, uint64_t seed) {
  std::vector<float> x = test::randn(static_cast<size_t>(rows * 12), static_cast<uint32_t>(seed), 2.0f);
  Batch b{test::host_tensor(x, Shape{rows, 12}), Tensor::empty(DType::kI32, Shape{rows}, Device{})};
  for (int64_t i = 0; i < rows; ++i) b.y.i32()[i] = static_cast<int32_t>((i * 7 + static_cast<int64_t>(seed)) % 5);
  return b;
}

OptimizerConfig sgd() {
  OptimizerConfig c;
  c.kind = OptimizerKind::kSgd;
  c.lr = 0.5f;
  return c;
}

std::vector<uint32_t> bits(const std::vector<float>& v) {
  std::vector<uint32_t> out(v.size());
  std::memcpy(out.data(), v.data(), v.size() * sizeof(float));
  return out;
}

// The gradient of the sum of the losses of rows [begin, begin + rows) at the model's initial parameters: what the
// replica given those rows hands its reducer (no loss scaling).
std::vector<float> local_gradient(const Model& model, const Batch& b, int64_t begin, int64_t rows) {
  const auto n = static_cast<size_t>(model.num_param_elements());
  if (rows == 0) return std::vector<float>(n, 0.0f);
  Standalone single;
  ReplicaModel replica(model, single.ctx);
  Tensor x = b.x.rows(begin, rows), y = b.y.rows(begin, rows);
  Tensor out = replica.forward(single.ctx, x);
  Tensor dout = replica.output_grad_buffer(single.ctx);
  double loss_sum = 0.0;
  loss_forward_backward(LossKind::kCrossEntropy, single.ctx, &loss_sum, dout, out, y, 1.0f);
  replica.backward(single.ctx, dout, false);
  return std::vector<float>(replica.grads(), replica.grads() + n);
}

// The documented reduction: every replica's gradient rounded to bf16 (nearest even), the rounded values added in
// f32 in replica order, the sum rounded to bf16 once, widened, times 1 / batch in f32.
std::vector<float> bf16_reduction(const std::vector<std::vector<float>>& locals, int64_t batch) {
  const float scale = static_cast<float>(1.0 / static_cast<double>(batch));
  std::vector<float> out(locals[0].size());
  for (size_t i = 0; i < out.size(); ++i) {
    float sum = from_bf16(to_bf16(locals[0][i]));
    for (size_t r = 1; r < locals.size(); ++r) sum += from_bf16(to_bf16(locals[r][i]));
    out[i] = from_bf16(to_bf16(sum)) * scale;
  }
  return out;
}

// The parameters after one SGD step on `grad` from the model's initial ones, with the optimizer's own kernel.
std::vector<float> stepped(const Model& model, const std::vector<float>& grad) {
  Standalone single;
  ReplicaModel replica(model, single.ctx);
  const int64_t n = model.num_param_elements();
  std::copy(grad.begin(), grad.end(), replica.grads());
  Optimizer optimizer(sgd(), 0, n, Device{});
  optimizer.step(*single.stream, replica.params_for_writing(), replica.grads());
  return std::vector<float>(replica.params(), replica.params() + n);
}

TEST(ReduceDtype, Bf16StepEqualsItsDefinitionBitForBit) {
  const Model model = make_mlp(23);
  const int64_t rows = 11;  // 6 + 5 over 2 devices, 4 + 4 + 3 over 3
  const Batch b = make_batch(rows, 5);
  for (size_t devices : {2, 3}) {
    std::vector<std::vector<float>> locals;
    int64_t begin = 0;
    for (int64_t chunk : split_batch(rows, devices)) {
      locals.push_back(local_gradient(model, b, begin, chunk));
      begin += chunk;
    }
    const std::vector<float> expected = stepped(model, bf16_reduction(locals, rows));
    for (GradientReduction reduction : {GradientReduction::kAllReduce, GradientReduction::kReduceScatter}) {
      EngineConfig config = cpu_devices(devices);
      config.reduction = reduction;
      Engine e(model, sgd(), config);
      e.set_reduce_dtype(DType::kBF16);
      EXPECT_EQ(e.reduce_dtype(), DType::kBF16);
      e.train_step(b.x, b.y);
      const char* what = reduction == GradientReduction::kAllReduce ? "all-reduce" : "reduce-scatter";
      for (size_t r = 0; r < devices; ++r)
        EXPECT_EQ(bits(e.params(r)), bits(expected)) << devices << " devices, " << what << ", replica " << r;
    }
  }
}

// The rounding is real: the f32 reduction of the same local gradients (added in replica order, scaled) is not the
// bf16 one, and the engine in f32 lands on the f32 one's step.
TEST(ReduceDtype, DiffersFromF32) {
  const Model model = make_mlp(23);
  const Batch b = make_batch(10, 6);
  Engine f32(model, sgd(), cpu_devices(2));
  Engine bf16(model, sgd(), cpu_devices(2));
  bf16.set_reduce_dtype(DType::kBF16);
  f32.train_step(b.x, b.y);
  bf16.train_step(b.x, b.y);
  const std::vector<float> a = f32.params(0), c = bf16.params(0);
  size_t differ = 0;
  for (size_t i = 0; i < a.size(); ++i) differ += a[i] != c[i];
  EXPECT_GT(differ, a.size() / 4) << "bf16 rounded hardly any gradient";
  EXPECT_LT(test::max_relative_error(c, a, 1e-1), 1e-2) << "bf16 is far from f32";
}

// Several steps, accumulation and both reductions, with clipping (whose norm reads the widened f32 gradient): the
// replicas stay bit-identical, the loss decreases, and both reductions train to the same bits.
TEST(ReduceDtype, ReplicasIdenticalAndTraining) {
  const Model model = make_mlp(31);
  std::vector<Batch> data;
  for (int i = 0; i < 4; ++i) data.push_back(make_batch(24, 100 + static_cast<uint64_t>(i)));
  for (size_t devices : {2, 3}) {
    std::vector<std::vector<float>> results;
    for (GradientReduction reduction : {GradientReduction::kAllReduce, GradientReduction::kReduceScatter}) {
      EngineConfig config = cpu_devices(devices);
      config.reduction = reduction;
      OptimizerConfig opt = sgd();
      opt.lr = 0.1f;
      opt.momentum = 0.9f;
      opt.max_grad_norm = 1.0f;
      Engine e(model, opt, config);
      e.set_reduce_dtype(DType::kBF16);
      double first = 0.0, last = 0.0;
      for (int s = 0; s < 40; ++s) {
        const Batch& b = data[static_cast<size_t>(s) % data.size()];
        const double loss = e.train_step(b.x, b.y);
        if (s < 4) first += loss;
        if (s >= 36) last += loss;
      }
      e.accumulate(data[0].x.rows(0, 7), data[0].y.rows(0, 7));
      e.accumulate(data[1].x, data[1].y);
      e.step();
      EXPECT_LT(last, 0.7 * first) << devices << " devices: bf16 reduction did not train";
      const std::vector<float> p = e.params(0);
      for (size_t r = 1; r < devices; ++r) EXPECT_EQ(bits(e.params(r)), bits(p)) << devices << " devices, replica " << r;
      results.push_back(p);
    }
    EXPECT_EQ(bits(results[0]), bits(results[1])) << devices << " devices: reduce-scatter differs from all-reduce";
  }
}

// The compression setting is kept under bf16 and applies again at f32: in one process it changes nothing, so f32
// with compression trains as plain f32; and bf16 with compression trains as bf16 without.
TEST(ReduceDtype, CompressionKeptAndBackToF32) {
  const Model model = make_mlp(19);
  const Batch b = make_batch(9, 3);
  Engine plain(model, sgd(), cpu_devices(2));
  Engine both(model, sgd(), cpu_devices(2));
  Engine bf16(model, sgd(), cpu_devices(2));
  both.set_gradient_compression(GradientCompression::kBf16);
  both.set_reduce_dtype(DType::kBF16);
  bf16.set_reduce_dtype(DType::kBF16);
  both.train_step(b.x, b.y);
  bf16.train_step(b.x, b.y);
  plain.train_step(b.x, b.y);
  EXPECT_EQ(bits(both.params(0)), bits(bf16.params(0)));
  both.set_reduce_dtype(DType::kF32);
  bf16.set_reduce_dtype(DType::kF32);
  EXPECT_EQ(both.reduce_dtype(), DType::kF32);
  both.train_step(b.x, b.y);
  bf16.train_step(b.x, b.y);
  EXPECT_EQ(bits(both.params(0)), bits(bf16.params(0)));
}

TEST(ReduceDtype, Refusals) {
  const Model model = make_mlp(19);
  Engine e(model, sgd(), cpu_devices(2));
  const char* before = e.bucket_strategy();
  for (DType bad : {DType::kF16, DType::kF64, DType::kI32}) {
    try {
      e.set_reduce_dtype(bad);
      ADD_FAILURE() << dtype_name(bad) << " accepted";
    } catch (const Error& err) {
      EXPECT_EQ(err.status(), Status::kInvalidArgument);
      EXPECT_NE(std::string(err.what()).find(dtype_name(bad)), std::string::npos) << err.what();
    }
    EXPECT_EQ(e.reduce_dtype(), DType::kF32);
    EXPECT_STREQ(e.bucket_strategy(), before);
  }
  e.set_reduce_dtype(DType::kBF16);
  EXPECT_STREQ(e.bucket_strategy(), "all-reduce (reduce dtype bf16)");
  e.set_gradient_reduction(GradientReduction::kReduceScatter);
  EXPECT_STREQ(e.bucket_strategy(), "reduce-scatter (reduce dtype bf16)");
}

}  // namespace
}  // namespace dpar
