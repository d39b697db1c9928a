// The CPU's convolutions, poolings and bf16 GEMMs: oneDNN primitives, prepared once per input shape and kept (a small cache
// keyed by the shape), each object with its own oneDNN engine, stream and scratchpads, so that objects used from
// different threads share nothing mutable. Every call runs on the calling thread's GEMM thread count
// (gemm.h's GemmThreadsScope), as the GEMM does.
//
// Tensors are plain NCHW f32 at the edges. Inside, convolutions with kernels larger than 1x1 run on oneDNN's
// blocked layouts with reorders at the edges (measured faster, depthwise several times; a 1x1 was slower blocked,
// and stays on dpar's memory: dnnl_ops.cpp, Conv2d::Impl::asked); poolings read and write dpar's memory directly.
// Errors are dpar::Error naming the op and oneDNN's status.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "common/op_specs.h"

namespace dpar::kernels::cpu {

// Why the CPU backend has no f16 (IEEE half) kernels: oneDNN is asked, once per process, for an f16 matmul (f16
// source and weights, f32 destination, as Bf16Gemm's in bf16) and an f16 convolution. oneDNN 2.6 implements neither
// on CPUs (its CPU ISA list ends at AMX, without AVX512-FP16), so the answer names its refusal, oneDNN's version and
// this CPU's ISA (gemm.h's gemm_backend): "oneDNN creates no f16 matmul (f16 x f16 -> f32) here (oneDNN 2.6.3
// (OpenMP), ... (CPU ISA avx512_core_amx)): unimplemented; ...". Were a oneDNN to create them, the answer says that
// the backend's f16 kernels are still to be written (Bf16Gemm generalised by dtype). Static storage; never "".
const char* f16_unsupported_why();

// GEMMs of bf16 operands with f32 results (mixed precision's linear layers): oneDNN's matmul primitive, bf16 source
// and weights, f32 destination, the products (exact in f32) accumulated in f32 by the hardware's bf16 instructions
// (AVX512-BF16 or AMX: gemm.h's bf16_support; elsewhere oneDNN would emulate them, and the backend has no bf16).
// One object per user of it (a stream): it keeps a primitive per shape (the transposes, extents, leading
// dimensions, accumulation and the calling thread's GEMM thread count), the least recently used one going past a
// bound, and one scratchpad (scratchpad_mode::user) grown to the largest primitive's. Not for concurrent use: its
// owner runs one call at a time.
class Bf16Gemm {
 public:
  Bf16Gemm();
  ~Bf16Gemm();
  Bf16Gemm(const Bf16Gemm&) = delete;
  Bf16Gemm& operator=(const Bf16Gemm&) = delete;

  // C (M,N) = op(A) op(B), or C += op(A) op(B) when accumulate (oneDNN's sum post-op); without it whatever C held
  // (even NaN) is ignored. A and B are bf16 bits (common/bf16.h), row-major with leading dimensions lda and ldb;
  // op(X) is X^T when its flag is set (the memory's strides say it: nothing is copied). C is f32 with leading
  // dimension ldc. M, N, K >= 1. Throws dpar::Error on a failure that oneDNN reports.
  void run(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda,
           const uint16_t* B, int64_t ldb, bool accumulate, float* C, int64_t ldc);

  // C (M,N) bf16 = round(relu?(A B^T + bias)): A (M,K) and B (N,K) bf16 row-major (a linear layer's input and
  // weight), bias (N) f32 or null, the sum, bias and ReLU in f32 and rounded once to nearest even (oneDNN's bf16
  // destination with a bias and an eltwise post-op). M, N, K >= 1.
  void run_rounded(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                   const float* bias, bool relu, uint16_t* C, int64_t ldc);

  // oneDNN's name for the implementation of the last run's primitive ("brg:avx512_core_amx"); "" before any.
  std::string last_impl() const;
  // How many primitives are kept now.
  size_t cached() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// inp (N,C_in,H,W), weight (C_out,C_in/groups,kh,kw), bias (C_out), out (N,C_out,OH,OW): PyTorch's nn.Conv2d.
// With spec.dtype bf16 (gemm.h's bf16_support must hold) inp and weight are bf16 bits and everything else f32:
// the bf16 overloads below; backward reads the f32 gradient and rounds it to bf16 (to nearest even) itself, in a
// buffer of the op's (oneDNN's reorder), and dbias is oneDNN's sum of that rounded gradient.
class Conv2d {
 public:
  explicit Conv2d(const Conv2dSpec& spec);
  ~Conv2d();
  Conv2d(const Conv2d&) = delete;
  Conv2d& operator=(const Conv2d&) = delete;

  // out = epilogue(conv(inp, weight) + bias); bias may be nullptr without one.
  void forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int64_t H,
               int64_t W);
  // dinp (overwritten) from dout, the gradient before the epilogue.
  void backward_data(float* dinp, const float* dout, const float* weight, int64_t N, int64_t H, int64_t W);
  // dweight, dbias (nullptr: not wanted) from dout and inp; overwritten, or added to when accumulate.
  void backward_weights(float* dweight, float* dbias, const float* dout, const float* inp, int64_t N, int64_t H,
                        int64_t W, bool accumulate);

  // The same in bf16 (spec.dtype bf16): inp and weight bf16, the rest f32.
  void forward(float* out, const uint16_t* inp, const uint16_t* weight, const float* bias, int64_t N, int64_t H,
               int64_t W);
  void backward_data(float* dinp, const float* dout, const uint16_t* weight, int64_t N, int64_t H, int64_t W);
  void backward_weights(float* dweight, float* dbias, const float* dout, const uint16_t* inp, int64_t N, int64_t H,
                        int64_t W, bool accumulate);

  // oneDNN's names for the implementations of the most recent shape's primitives: "forward jit:..., backward_data
  // ..., backward_weights ..." (those prepared so far).
  std::string impl_info() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// inp (N,C,H,W), out (N,C,OH,OW): PyTorch's nn.MaxPool2d, nn.AvgPool2d (count_include_pad) and, global,
// nn.AdaptiveAvgPool2d((1, 1)).
class Pool2d {
 public:
  explicit Pool2d(const Pool2dSpec& spec);
  ~Pool2d();
  Pool2d(const Pool2d&) = delete;
  Pool2d& operator=(const Pool2d&) = delete;

  // A max pool keeps where each maximum was (oneDNN's workspace) for the next backward of this shape.
  void forward(float* out, const float* inp, int64_t N, int64_t C, int64_t H, int64_t W);
  // dinp (overwritten) from dout; a max pool's needs a forward of this shape first.
  void backward(float* dinp, const float* dout, int64_t N, int64_t C, int64_t H, int64_t W);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dpar::kernels::cpu
