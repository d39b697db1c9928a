// Stateful ops: kernels that a backend prepares once per input shape and then runs many times (oneDNN primitives,
// cuDNN descriptors). A layer asks its replica's Stream for one (Stream::make_conv2d, make_pool2d) on its first
// forward, keeps it, and calls it from that replica's threads only; the op caches what it prepares, keyed by the
// input shape, as PyTorch's oneDNN and cuDNN paths do.
//
// Tensors at an op's edges are references to plain, contiguous NCHW f32 memory of the stream's device; a library's blocked
// layouts stay inside an op. In mixed precision (the spec's dtype bf16) the operands an op multiplies (the input and
// the weight; q, k, v) are bf16 and everything else stays f32: outputs, gradients, biases, statistics. A backend without an op answers NOT_SUPPORTED (Error with Status::kNotSupported),
// naming the device and what it lacks.
#pragma once

#include <cstdint>

#include "common/op_specs.h"
#include "common/tensor_ref.h"

namespace dpar {

// Shapes, for every method below: inp (N,C_in,H,W), weight (C_out,C_in/groups,kernel_h,kernel_w), bias (C_out),
// out (N,C_out,OH,OW) with OH = spec.out_h(H), OW = spec.out_w(W); the extents are the references'.
class Conv2dOp {
 public:
  virtual ~Conv2dOp() = default;
  // out = epilogue(conv(inp, weight) + bias); bias is ignored (may be absent) when the spec has none.
  virtual void forward(const TensorRef& out, const TensorRef& inp, const TensorRef& weight, const TensorRef& bias) = 0;
  // dinp = dL/d(inp) from dout, overwritten. dout is the gradient of the convolution's result before the
  // epilogue: with a ReLU epilogue the caller masks the gradient of out first (call::ActivationBackward with out),
  // as a linear layer's composed backward does.
  virtual void backward_data(const TensorRef& dinp, const TensorRef& dout, const TensorRef& weight) = 0;
  // dweight and dbias (absent: not wanted; ignored without a bias) from dout (as backward_data's) and inp:
  // overwritten when accumulate is false, added to when true.
  virtual void backward_weights(const TensorRef& dweight, const TensorRef& dbias, const TensorRef& dout,
                                const TensorRef& inp, bool accumulate) = 0;
};

// inp (N,C,H,W), out (N,C,OH,OW) with OH = spec.out_h(H), OW = spec.out_w(W).
class Pool2dOp {
 public:
  virtual ~Pool2dOp() = default;
  // A max pool remembers where each maximum was (for the next backward on this shape).
  virtual void forward(const TensorRef& out, const TensorRef& inp) = 0;
  // dinp (overwritten) from dout, for the last forward of this shape; inp and out are that forward's (a backend
  // may need them: cuDNN's max pooling reads both, oneDNN's reads neither).
  virtual void backward(const TensorRef& dinp, const TensorRef& dout, const TensorRef& inp, const TensorRef& out) = 0;
};

// Scaled dot-product attention (AttentionSpec), for every head at once. Shapes: q (B,L,C), k and v (B,S,C), out
// (B,L,C) with C = heads x D, head h in channels [hD, (h+1)D) of each (heads merged as PyTorch's
// transpose(1, 2).reshape(B, L, C) merges them); lse (f32, (B,heads,L)). q, k, v and their gradients may be strided
// in their first two dimensions (views of one packed (B,T,3C) projection: row stride 3C), each row's C channels
// contiguous; out, dout and lse are contiguous.
//
// Dropout on the attention weights (after the softmax, before the product with v, as PyTorch's SDPA) keeps weight
// (b,h,i,j) iff kernels::rng::uniform24(stream_key(seed), offset + ((b*heads + h)*L + i)*S + j) >= dropout_p, and
// scales kept ones by 1/(1 - dropout_p): the mask is a function of the position, so backward draws it again
// instead of storing it, and every backend draws the same one. A causal op takes L == S (self-attention).
class AttentionOp {
 public:
  virtual ~AttentionOp() = default;
  // out, and lse = each query's log-sum-exp of its (masked, scaled) scores: what backward needs besides q, k, v
  // and out. Nothing of size L x S outlives the call.
  virtual void forward(const TensorRef& out, const TensorRef& lse, const TensorRef& q, const TensorRef& k,
                       const TensorRef& v, float dropout_p, uint64_t seed, uint64_t offset) = 0;
  // dq, dk, dv (overwritten) from dout and the forward's arguments and results (the same dropout_p, seed, offset).
  virtual void backward(const TensorRef& dq, const TensorRef& dk, const TensorRef& dv, const TensorRef& dout,
                        const TensorRef& q, const TensorRef& k, const TensorRef& v, const TensorRef& out,
                        const TensorRef& lse, float dropout_p, uint64_t seed, uint64_t offset) = 0;
};

}  // namespace dpar
