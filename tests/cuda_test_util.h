// What the CUDA tests share: the skip when there is no GPU, device buffers, random data, error measures.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "common/f16.h"
#include "common/random.h"
#include "platform/cuda/cuda_check.h"
#include "require_gpu.h"

namespace dpar::test {

// Skips the current test, with the reason, unless a CUDA device is present; fails instead where a GPU is known to
// be there (DPAR_TEST_REQUIRE_GPU, require_gpu.h). (A macro: GTEST_SKIP and FAIL return from the function it is
// written in.)
#define DPAR_REQUIRE_GPU()                                                                             \
  do {                                                                                                 \
    std::string dpar_why_;                                                                             \
    if (::dpar::cuda::cuda_device_count(&dpar_why_) == 0) {                                            \
      if (::dpar::test::gpu_required())                                                                \
        FAIL() << "DPAR_TEST_REQUIRE_GPU is set, but dpar finds no CUDA device (" << dpar_why_ << ")"; \
      GTEST_SKIP() << "built with CUDA, no device: skipped (" << dpar_why_ << ")";                     \
    }                                                                                                  \
  } while (0)

// A device array of n elements of T, freed on destruction.
template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    if (n_ > 0) DPAR_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p_), n_ * sizeof(T)), "test buffer");
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() {
    if (p_ != nullptr) cudaFree(p_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return p_; }
  size_t size() const { return n_; }
  void upload(const std::vector<T>& host) {
    EXPECT_EQ(host.size(), n_);
    if (n_ > 0) DPAR_CUDA_CHECK(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), "upload");
  }
  // Waits for all device work first (cudaMemcpy on the legacy stream synchronises with blocking streams).
  std::vector<T> download() const {
    std::vector<T> host(n_);
    DPAR_CUDA_CHECK(cudaDeviceSynchronize(), "download");
    if (n_ > 0) DPAR_CUDA_CHECK(cudaMemcpy(host.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return host;
  }

 private:
  size_t n_;
  T* p_ = nullptr;
};

// A device copy of `host`, its upload finished: the streams under test are non-blocking, and do not wait for the
// legacy stream's copies.
template <class T>
std::unique_ptr<DeviceBuffer<T>> on_gpu(const std::vector<T>& host) {
  auto b = std::make_unique<DeviceBuffer<T>>(host);
  DPAR_CUDA_CHECK(cudaDeviceSynchronize(), "upload");
  return b;
}

// Host values rounded to bf16 or f16 bits (to nearest even), and such bits widened back to f32.
inline std::vector<uint16_t> round_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> h(x.size());
  for (size_t i = 0; i < x.size(); ++i) h[i] = ::dpar::to_bf16(x[i]);
  return h;
}
inline std::vector<uint16_t> round_f16(const std::vector<float>& x) {
  std::vector<uint16_t> h(x.size());
  for (size_t i = 0; i < x.size(); ++i) h[i] = ::dpar::to_f16(x[i]);
  return h;
}
inline std::vector<float> widen_bf16(const std::vector<uint16_t>& h) {
  std::vector<float> x(h.size());
  for (size_t i = 0; i < h.size(); ++i) x[i] = ::dpar::from_bf16(h[i]);
  return x;
}
inline std::vector<float> widen_f16(const std::vector<uint16_t>& h) {
  std::vector<float> x(h.size());
  for (size_t i = 0; i < h.size(); ++i) x[i] = ::dpar::from_f16(h[i]);
  return x;
}

inline std::vector<float> random_vector(size_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = rng.uniform(lo, hi);
  return v;
}

// max |a - b| / max(max |b|, floor) over the finite elements: the error of a against the reference b, relative to
// the reference's scale. A NaN must meet a NaN and an infinity the same infinity (else the error is infinite):
// an infinity in the scale would make every error look like 0, so that the comparison could not fail.
inline double normalised_error(const std::vector<float>& a, const std::vector<float>& b, double floor = 1e-30) {
  if (a.size() != b.size()) {
    ADD_FAILURE() << "sizes " << a.size() << " vs " << b.size();
    return INFINITY;
  }
  double err = 0.0, scale = floor;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) != std::isnan(b[i])) return INFINITY;
    if (std::isnan(b[i])) continue;
    if (std::isinf(a[i]) || std::isinf(b[i])) {
      if (a[i] != b[i]) return INFINITY;
      continue;
    }
    err = std::max(err, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return err / scale;
}

// Every element within `ulps` units in the last place of the reference (NaN matches NaN, an infinity only the same
// infinity: its ulp is infinite, so without that any finite value would pass).
inline ::testing::AssertionResult within_ulps(const std::vector<float>& a, const std::vector<float>& b, int ulps) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes " << a.size() << " vs " << b.size();
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) && std::isnan(b[i])) continue;
    if (std::isinf(a[i]) || std::isinf(b[i])) {
      if (a[i] == b[i]) continue;
      return ::testing::AssertionFailure() << "element " << i << ": " << a[i] << " vs reference " << b[i];
    }
    const double tol = ulps * std::max(std::ldexp(1.0, -149), std::fabs(static_cast<double>(b[i])) * 0x1p-23);
    if (!(std::fabs(static_cast<double>(a[i]) - b[i]) <= tol))
      return ::testing::AssertionFailure() << "element " << i << ": " << a[i] << " vs reference " << b[i] << " (more than "
                                           << ulps << " ulp apart)";
  }
  return ::testing::AssertionSuccess();
}

// Bit-for-bit equality (NaN payloads included), naming the first difference.
inline ::testing::AssertionResult bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes " << a.size() << " vs " << b.size();
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0)
      return ::testing::AssertionFailure() << "element " << i << ": " << a[i] << " vs reference " << b[i];
  }
  return ::testing::AssertionSuccess();
}

}  // namespace dpar::test
