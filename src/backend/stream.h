// A replica's ordered queue of device work: the kernel table of its backend, plus ordered copies and fills.
//
// A Stream belongs to one replica and is used from that replica's threads (its worker, and its communication
// thread for the reducer's staging copies). Calls are queued in call order: on CPU each runs at once on the
// calling thread; on CUDA each is enqueued on the replica's compute stream and synchronize() waits for them.
// Every pointer is device memory of the stream's device unless the name says host. Each kernel's contract is that
// of the CPU kernel of the same name (kernels/cpu/kernels.h), the reference of every backend's; the Stream itself
// depends on no kernel.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "backend/ops.h"
#include "common/optimizer_hyper.h"
#include "device/device.h"

namespace dpar {

enum class Activation : int32_t { kRelu = 0, kGelu = 1, kTanh = 2, kSigmoid = 3 };

class Stream {
 public:
  explicit Stream(Device device) : device_(device) {}
  virtual ~Stream() = default;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  Device device() const { return device_; }

  // ---- Ordered memory operations ------------------------------------------------------------------------------
  // dst and src are memory of devices of the stream's kind; either may be on another device than the stream's
  // (a replica's rows of an input on another GPU, a gathered output).
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  // `rows` blocks of `width` bytes: row r from src + r * src_pitch to dst + r * dst_pitch (a concatenation's
  // columns). The default is one copy per row; a backend with a strided copy makes it one call.
  virtual void copy_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t rows) {
    for (size_t r = 0; r < rows; ++r)
      copy(static_cast<char*>(dst) + r * dst_pitch, static_cast<const char*>(src) + r * src_pitch, width);
  }
  // The host buffer may be reused as soon as the call returns.
  virtual void copy_from_host(void* dst, const void* host_src, size_t bytes) = 0;
  // Returns once the bytes are in host memory (after everything queued before).
  virtual void copy_to_host(void* host_dst, const void* src, size_t bytes) = 0;
  virtual void fill_zero(void* dst, size_t bytes) = 0;
  // Waits until everything queued so far has finished; throws the device's error, if any.
  virtual void synchronize() = 0;

  // ---- Kernels ------------------------------------------------------------------------------------------------
  // inp (B,C_in), weight (C_out,C_in), bias (C_out) or nullptr, out (B,C_out)
  virtual void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t B,
                              int64_t C_in, int64_t C_out) = 0;
  // dinp (B,C_in) or nullptr, dweight (C_out,C_in), dbias (C_out) or nullptr, dout (B,C_out)
  virtual void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                               const float* weight, int64_t B, int64_t C_in, int64_t C_out, bool accumulate) = 0;
  // out (B,C_out) = relu(inp @ weight^T + bias): linear_forward, then a ReLU on its output. A backend may fuse the
  // two (the CPU's adds the bias and applies the ReLU in one pass after its GEMM); the default makes both calls.
  virtual void linear_relu_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t B,
                                   int64_t C_in, int64_t C_out) {
    linear_forward(out, inp, weight, bias, B, C_in, C_out);
    activation_forward(Activation::kRelu, out, out, B * C_out);
  }
  // The backward of linear_relu_forward from dout = dL/d(its output) and out = its output: dpre (B,C_out) = the
  // ReLU's backward, then linear_backward from dpre. dinp may be dout's memory (dout is consumed first).
  virtual void linear_relu_backward(float* dinp, float* dweight, float* dbias, float* dpre, const float* dout,
                                    const float* out, const float* inp, const float* weight, int64_t B,
                                    int64_t C_in, int64_t C_out, bool accumulate) {
    activation_backward(Activation::kRelu, dpre, dout, nullptr, out, B * C_out);
    linear_backward(dinp, dweight, dbias, dpre, inp, weight, B, C_in, C_out, accumulate);
  }
  // out (n), inp (n)
  virtual void activation_forward(Activation kind, float* out, const float* inp, int64_t n) = 0;
  // dinp (n), dout (n), and what the kind's backward reads: inp (GELU) or out (the others), both (n)
  virtual void activation_backward(Activation kind, float* dinp, const float* dout, const float* inp,
                                   const float* out, int64_t n) = 0;
  // out (n), mask (n), inp (n)
  virtual void dropout_forward(float* out, float* mask, const float* inp, int64_t n, float p, uint64_t seed,
                               uint64_t offset) = 0;
  virtual void dropout_backward(float* dinp, const float* dout, const float* mask, int64_t n) = 0;
  // *loss_sum (a double in device memory) = the sum of the per-sample losses. dlogits (B,C), logits (B,C),
  // labels (B) in [0, C), checked by the caller.
  virtual void cross_entropy_forward_backward(double* loss_sum, float* dlogits, const float* logits,
                                              const int32_t* labels, int64_t B, int64_t C, float grad_scale) = 0;
  // dpred (B,D), pred (B,D), target (B,D)
  virtual void mse_forward_backward(double* loss_sum, float* dpred, const float* pred, const float* target,
                                    int64_t B, int64_t D, float grad_scale) = 0;
  virtual void sgd_step(float* param, float* momentum_buf, const float* grad, int64_t n,
                        const SgdHyper& h, bool first_step) = 0;
  virtual void adam_step(float* param, float* exp_avg, float* exp_avg_sq, const float* grad, int64_t n,
                         const AdamHyper& h, int64_t step) = 0;
  // y += a*x
  virtual void axpy(float* y, const float* x, float a, int64_t n) = 0;
  // x *= a
  virtual void scale(float* x, float a, int64_t n) = 0;
  // The sum of x[i]^2 in double, once everything queued before has run: on CPU kernels::cpu::sum_squares, on
  // another device a twin equal to it within rounding. The same bits on every call on one device.
  virtual double sum_squares(const float* x, int64_t n) = 0;
  // bfloat16 copies of floats and back (kernels::cpu::to_bf16 / from_bf16: the same bits on every backend).
  virtual void to_bf16(uint16_t* dst, const float* src, int64_t n) = 0;
  virtual void from_bf16(float* dst, const uint16_t* src, int64_t n) = 0;

  // ---- Stateful ops (backend/ops.h) ---------------------------------------------------------------------------
  // An op for this stream's device, used from this stream's threads only and destroyed before the stream. The
  // defaults throw Error(NOT_SUPPORTED) naming the device and the op (not_built): a backend that has one overrides
  // them.
  virtual std::unique_ptr<Conv2dOp> make_conv2d(const Conv2dSpec& spec);
  virtual std::unique_ptr<Pool2dOp> make_pool2d(const Pool2dSpec& spec);
  // ---- BatchNorm (kernels/cpu/batchnorm.h has each contract; doubles are device memory too) -------------------
  // A backend without them refuses with NOT_SUPPORTED naming the device (not_built); CPU and CUDA have them.
  virtual void batchnorm_stats(double* sums, const float* x, int64_t N, int64_t C, int64_t L);
  virtual void batchnorm_moments(double* mean_invstd, float* running_mean, float* running_var,
                                 int64_t* num_batches_tracked, const double* sums, double count, int64_t C, float eps,
                                 float momentum);
  virtual void batchnorm_apply(float* out, const float* x, const double* mean_invstd, const float* weight,
                               const float* bias, int64_t N, int64_t C, int64_t L);
  virtual void batchnorm_backward_reduce(double* sums, const float* dout, const float* x, const double* mean_invstd,
                                         int64_t N, int64_t C, int64_t L);
  virtual void batchnorm_backward_apply(float* dinp, float* dweight, float* dbias, const double* local,
                                        const double* global, double count, const float* dout, const float* x,
                                        const double* mean_invstd, const float* weight, int64_t N, int64_t C,
                                        int64_t L, bool accumulate);
  // ---- LayerNorm and Embedding (kernels/cpu/norm_embedding.h has each contract) -------------------------------
  // A backend without them refuses with NOT_SUPPORTED naming the device (not_built); CPU and CUDA have them. The
  // CPU's embedding kernels throw for an index outside [0, V); a device's cannot (its indices are device memory,
  // read by the kernel), so callers check indices on the host first (the engine does, before every step) and a
  // device kernel only guarantees not to read or write out of bounds for one (kernels/cuda/kernels.h).
  virtual void layernorm_forward(float* out, double* mean_rstd, const float* x, const float* weight,
                                 const float* bias, int64_t N, int64_t D, float eps);
  virtual void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* x,
                                  const double* mean_rstd, const float* weight, int64_t N, int64_t D,
                                  bool accumulate);
  virtual void embedding_forward(float* out, const int32_t* idx, const float* weight, int64_t N, int64_t V,
                                 int64_t E);
  virtual void embedding_backward(float* dweight, const float* dout, const int32_t* idx, int64_t N, int64_t V,
                                  int64_t E, int64_t padding_idx, bool accumulate);

 protected:
  // Throws Error(Status::kNotSupported): "<call> on <device>: this backend has no <what>". Every default above that
  // a backend may leave out answers through it.
  [[noreturn]] void not_built(const std::string& call, const char* what) const;

 private:
  Device device_;
};

}  // namespace dpar
