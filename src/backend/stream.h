// A replica's ordered queue of device work: the kernel table of its backend, plus ordered copies and fills.
//
// A Stream belongs to one replica and is used from that replica's threads (its worker, and its communication
// thread for the reducer's staging copies). Calls are queued in call order: on CPU each runs at once on the
// calling thread; on CUDA each is enqueued on the replica's compute stream and synchronize() waits for them.
// Every pointer and tensor reference is device memory of the stream's device unless the name says host. Kernels are
// calls (backend/kernel_calls.h: one struct per kernel, the contract of the CPU kernel of the same name), chosen
// inside the backend by kind and dtype; the Stream itself depends on no kernel.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "backend/kernel_calls.h"
#include "backend/ops.h"
#include "device/device.h"

namespace dpar {

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

  // ---- Kernels (backend/kernel_calls.h) -----------------------------------------------------------------------
  // Runs one kernel, queued after everything before. When the backend lacks the call's kernel (supports()), a
  // composition of kernels it has runs instead where one exists (an epilogue as a separate pass after the kernel,
  // bit for bit what the fused kernel computes); without one, throws Error(NOT_SUPPORTED) naming the kernel, its
  // dtype and epilogue, and the device.
  void run(const KernelCall& call);
  // Whether this backend has the kernel itself (not composed). A model asks before its first step.
  virtual bool supports(const KernelKey& key) const = 0;
  // Whether run() can run the call, itself or composed.
  bool can_run(const KernelKey& key) const;
  // Why this backend lacks a kernel that it has on other machines (a CPU without bf16 instructions), for run()'s
  // refusal and a caller's skip; "" when there is nothing to add to "this backend has no such kernel".
  virtual std::string lacks_why(const KernelKey& /*key*/) const { return {}; }
  // The sum of x[i]^2 in double over (n) elements, once everything queued before has run: on CPU
  // kernels::cpu::sum_squares, on another device a twin equal to it within rounding. The same bits on every call
  // on one device.
  virtual double sum_squares(const TensorRef& x) = 0;

  // ---- Math modes ---------------------------------------------------------------------------------------------
  // Lets this stream's f32 GEMMs and convolutions round their operands to TF32 (10-bit mantissa, f32 accumulation)
  // on hardware that has it, as PyTorch's torch.backends.cuda.matmul.allow_tf32 and cudnn.allow_tf32 do; off until
  // asked. Returns whether the backend has TF32: one without it (the CPU) keeps computing in f32 and returns false.
  virtual bool set_allow_tf32(bool /*allow*/) { return false; }

  // ---- Stateful ops (backend/ops.h) ---------------------------------------------------------------------------
  // An op for this stream's device, used from this stream's threads only and destroyed before the stream. The
  // defaults throw Error(NOT_SUPPORTED) naming the device and the op (not_built): a backend that has one overrides
  // them.
  virtual std::unique_ptr<Conv2dOp> make_conv2d(const Conv2dSpec& spec);
  virtual std::unique_ptr<Pool2dOp> make_pool2d(const Pool2dSpec& spec);
  virtual std::unique_ptr<AttentionOp> make_attention(const AttentionSpec& spec);
  // Whether make_attention makes an op whose products compute in `dtype` (AttentionSpec::dtype) here: a layer
  // under a bf16 policy asks before it rounds its inputs, and computes in f32 where the answer is no.
  virtual bool has_attention(DType /*dtype*/) const { return false; }

 protected:
  // Runs a call whose kernel supports() says the backend has.
  virtual void execute(const KernelCall& call) = 0;
  // Throws Error(Status::kNotSupported): "<call> on <device>: this backend has no <what>". Every default above that
  // a backend may leave out answers through it.
  [[noreturn]] void not_built(const std::string& call, const char* what) const;

 private:
  Device device_;
};

}  // namespace dpar
