// A Stream whose backend has only the kernels a test names, and that records the kernels it is asked to run
// instead of running them: for the tests of Stream::run's answers to a backend that lacks a kernel (a composition
// of kernels it has, or NOT_SUPPORTED naming what is missing). Its memory is host memory, copied as the CPU's is,
// so that a model can be placed on it; it names itself cuda:0 in messages.
#pragma once

#include <cstring>
#include <functional>
#include <stdexcept>
#include <vector>

#include "backend/stream.h"

namespace dpar::test {

class PartialStream final : public Stream {
 public:
  explicit PartialStream(std::function<bool(const KernelKey&)> has)
      : Stream(Device{DeviceKind::kCuda, 0}), has_(std::move(has)) {}
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memmove(dst, src, bytes);
  }
  void copy_from_host(void* dst, const void* src, size_t bytes) override { copy(dst, src, bytes); }
  void copy_to_host(void* dst, const void* src, size_t bytes) override { copy(dst, src, bytes); }
  void fill_zero(void* dst, size_t bytes) override {
    if (bytes) std::memset(dst, 0, bytes);
  }
  void synchronize() override {}
  bool supports(const KernelKey& key) const override { return has_(key); }
  double sum_squares(const TensorRef&) override { no(); }

  std::vector<KernelCall> ran;  // what execute() was given, in order

 protected:
  void execute(const KernelCall& call) override { ran.push_back(call); }

 private:
  [[noreturn]] static void no() { throw std::logic_error("not under test"); }
  std::function<bool(const KernelKey&)> has_;
};

}  // namespace dpar::test
