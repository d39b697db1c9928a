// The CPU's convolutions and poolings: oneDNN primitives, prepared once per input shape and kept (a small cache
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

#include "common/op_specs.h"

namespace dpar::kernels::cpu {

// inp (N,C_in,H,W), weight (C_out,C_in/groups,kh,kw), bias (C_out), out (N,C_out,OH,OW): PyTorch's nn.Conv2d.
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
