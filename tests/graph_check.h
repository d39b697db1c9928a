// Gradients of a model graph against central finite differences, on one CPU replica: the check every graph and
// layer test shares (test_graph, test_transformer).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "engine_test_util.h"
#include "nn/model.h"

namespace dpar::test {

inline std::vector<float> random_vector(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = u(gen);
  return v;
}

inline Tensor host(std::vector<float>& v, const Shape& shape) { return Tensor::wrap(v.data(), DType::kF32, shape, Device{}); }

// sum(rm(x) * r) in double, for the replica's current parameters.
inline double weighted_output(ReplicaModel& rm, const Standalone& s, std::vector<float>& x, const Shape& in_shape,
                      const std::vector<float>& r) {
  const Tensor out = rm.forward(s.ctx, host(x, in_shape));
  double sum = 0;
  for (int64_t i = 0; i < out.numel(); ++i) sum += static_cast<double>(out.f32()[i]) * r[static_cast<size_t>(i)];
  return sum;
}

// Every parameter's gradient of sum(model(x) * r) against central differences. The first node of each model here
// is a linear layer fed by the model input, so its weight gradient checks the gradient that reaches the input of
// the graph behind it (the "input gradient" of the block). Set external to pass dL/dout in the test's own memory.
// `kinks`: the model has ReLUs, and a difference whose step straddles a kink is wrong: an element's gradient must then
// match its difference with step 1e-3 or with step 2.5e-4 (a kink within 1e-3 of a weight is rare, one within both
// rarer still; a wrong gradient matches neither).
inline void check_gradients(Model model, const Shape& in_shape, bool external = false, bool kinks = false) {
  std::vector<float> x = random_vector(static_cast<size_t>(in_shape.numel()), 1);
  const Shape out_shape = model.output_shape(in_shape);
  std::vector<float> r = random_vector(static_cast<size_t>(out_shape.numel()), 2);
  Standalone s;
  ReplicaModel rm(model, s.ctx);
  rm.forward(s.ctx, host(x, in_shape));
  Tensor dout;
  std::vector<float> r_copy = r;
  if (external) {
    dout = host(r_copy, out_shape);
  } else {
    dout = rm.output_grad_buffer(s.ctx);
    ASSERT_EQ(dout.shape(), out_shape);
    std::memcpy(dout.f32(), r.data(), r.size() * sizeof(float));
  }
  // Nonzero garbage in the gradients: accumulate = false must overwrite them.
  for (int64_t i = 0; i < model.num_param_elements(); ++i) rm.grads()[i] = 1e3f;
  rm.backward(s.ctx, dout, false);
  // The differences come from a second replica whose parameters are moved in place, one at a time (forward only:
  // a training-mode BatchNorm's running statistics move, but its output does not depend on them).
  Standalone probe_ctx;
  ReplicaModel probe(model, probe_ctx.ctx);
  auto difference = [&](size_t at, double eps) {
    // Each write through params_for_writing(), which a change of the weights between forwards must use.
    const float value = probe.params()[at];
    auto set = [&](float to) { probe.params_for_writing()[at] = to; };
    set(value + static_cast<float>(eps));
    const double plus = weighted_output(probe, probe_ctx, x, in_shape, r);
    set(value - static_cast<float>(eps));
    const double minus = weighted_output(probe, probe_ctx, x, in_shape, r);
    set(value);
    return (plus - minus) / (2 * eps);
  };
  for (const ParamInfo& p : model.params()) {
    for (int64_t k = 0; k < p.shape.numel(); ++k) {
      const size_t at = static_cast<size_t>(p.offset + k);
      const double grad = rm.grads()[at];
      double fd = difference(at, kinks ? 1e-3 : 1e-2);
      if (kinks && std::fabs(grad - fd) > 2e-3 * (1 + std::fabs(fd))) fd = difference(at, 2.5e-4);
      EXPECT_NEAR(grad, fd, 2e-3 * (1 + std::fabs(fd))) << p.name << "[" << k << "]";
    }
  }
}

}  // namespace dpar::test
