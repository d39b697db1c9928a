// What the engine and layer tests share: CPU engine configurations, the measure that compares parameters across
// engines, and a replica context on the test's own thread.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "engine/engine.h"
#include "nn/layer.h"

namespace dpar::test {

// cpu:0 .. cpu:n-1, with a timeout that ends a deadlocked test instead of hanging it.
inline EngineConfig cpu_devices(size_t n, LossKind loss = LossKind::kCrossEntropy) {
  EngineConfig c;
  for (size_t i = 0; i < n; ++i) c.devices.push_back(Device{DeviceKind::kCpu, static_cast<int32_t>(i)});
  c.timeout_seconds = 30;
  c.loss = loss;
  return c;
}

// The largest |a - b| / max(|b|, floor). Sizes must match; a NaN or an infinity on either side that the other does
// not match makes it infinite (std::max would drop a NaN's comparison, so that parameters gone NaN would look
// exact).
inline double max_relative_error(const std::vector<float>& a, const std::vector<float>& b, double floor = 1e-2) {
  EXPECT_EQ(a.size(), b.size());
  if (a.size() != b.size()) return INFINITY;
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) {
      if ((std::isnan(a[i]) && std::isnan(b[i])) || a[i] == b[i]) continue;
      return INFINITY;
    }
    worst = std::max(worst, std::abs(double(a[i]) - double(b[i])) / std::max(std::abs(double(b[i])), floor));
  }
  return worst;
}

// A CPU stream for kernels called outside any engine.
inline Stream& host_stream() {
  static const std::unique_ptr<Stream> stream = cpu_backend().open_stream(Device{});
  return *stream;
}

// n normal values * scale + shift, from `seed`.
inline std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.0f, float shift = 0.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  std::vector<float> v(n);
  for (float& x : v) x = normal(gen) * scale + shift;
  return v;
}

// A host f32 tensor holding v.
inline Tensor host_tensor(const std::vector<float>& v, const Shape& shape) {
  Tensor t = Tensor::empty(DType::kF32, shape, Device{});
  std::copy(v.begin(), v.end(), t.f32());
  return t;
}

// The context of a CPU replica that runs on the test's own thread, outside any engine.
struct Standalone {
  uint64_t rng_offset = 0;
  Fault fault = Fault::kNone;
  std::unique_ptr<Stream> stream = cpu_backend().open_stream(Device{});
  ReplicaContext ctx;
  Standalone() {
    ctx.rng_offset = &rng_offset;
    ctx.armed_fault = &fault;
    ctx.stream = stream.get();
  }
};

}  // namespace dpar::test
