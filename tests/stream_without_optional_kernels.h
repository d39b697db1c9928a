// A Stream with none of the optional kernels and ops of a backend, for the tests of Stream's defaults (the
// NOT_SUPPORTED answers a backend without them gives): every kernel a backend must have throws std::logic_error,
// since only the defaults are under test.
#pragma once

#include <stdexcept>

#include "backend/stream.h"

namespace dpar::test {

class StreamWithoutOptionalKernels final : public Stream {
 public:
  StreamWithoutOptionalKernels() : Stream(Device{DeviceKind::kCuda, 0}) {}
  void copy(void*, const void*, size_t) override { no(); }
  void copy_from_host(void*, const void*, size_t) override { no(); }
  void copy_to_host(void*, const void*, size_t) override { no(); }
  void fill_zero(void*, size_t) override { no(); }
  void synchronize() override {}
  void linear_forward(float*, const float*, const float*, const float*, int64_t, int64_t, int64_t) override { no(); }
  void linear_backward(float*, float*, float*, const float*, const float*, const float*, int64_t, int64_t, int64_t,
                       bool) override {
    no();
  }
  void activation_forward(Activation, float*, const float*, int64_t) override { no(); }
  void activation_backward(Activation, float*, const float*, const float*, const float*, int64_t) override { no(); }
  void dropout_forward(float*, float*, const float*, int64_t, float, uint64_t, uint64_t) override { no(); }
  void dropout_backward(float*, const float*, const float*, int64_t) override { no(); }
  void cross_entropy_forward_backward(double*, float*, const float*, const int32_t*, int64_t, int64_t,
                                      float) override {
    no();
  }
  void mse_forward_backward(double*, float*, const float*, const float*, int64_t, int64_t, float) override { no(); }
  void sgd_step(float*, float*, const float*, int64_t, const SgdHyper&, bool) override { no(); }
  void adam_step(float*, float*, float*, const float*, int64_t, const AdamHyper&, int64_t) override { no(); }
  void axpy(float*, const float*, float, int64_t) override { no(); }
  void scale(float*, float, int64_t) override { no(); }
  double sum_squares(const float*, int64_t) override { no(); }
  void to_bf16(uint16_t*, const float*, int64_t) override { no(); }
  void from_bf16(float*, const uint16_t*, int64_t) override { no(); }

 private:
  [[noreturn]] static void no() { throw std::logic_error("not under test"); }
};

}  // namespace dpar::test
