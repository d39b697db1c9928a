// The stateful ops and kernel calls with the arguments of the kernels they wrap (pointers and extents), for tests
// that compare them with references over plain arrays: each builds the tensor references the seam takes.
#pragma once

#include "backend/ops.h"
#include "backend/stream.h"

namespace dpar::test {

inline TensorRef nchw(const float* p, int64_t N, int64_t C, int64_t H, int64_t W) {
  return TensorRef::of(p, {N, C, H, W});
}
inline TensorRef conv_weight(const Conv2dSpec& s, const float* w) {
  return TensorRef::of(w, {s.out_channels, s.in_channels / s.groups, s.kernel_h, s.kernel_w});
}
inline TensorRef conv_bias(const Conv2dSpec& s, const float* b) {
  return s.bias ? TensorRef::of(b, {s.out_channels}) : TensorRef{};
}

inline void conv_forward(Conv2dOp& op, const Conv2dSpec& s, float* out, const float* inp, const float* w,
                         const float* b, int64_t N, int64_t H, int64_t W) {
  op.forward(nchw(out, N, s.out_channels, s.out_h(H), s.out_w(W)), nchw(inp, N, s.in_channels, H, W),
             conv_weight(s, w), conv_bias(s, b));
}
inline void conv_backward_data(Conv2dOp& op, const Conv2dSpec& s, float* dinp, const float* dout, const float* w,
                               int64_t N, int64_t H, int64_t W) {
  op.backward_data(nchw(dinp, N, s.in_channels, H, W), nchw(dout, N, s.out_channels, s.out_h(H), s.out_w(W)),
                   conv_weight(s, w));
}
inline void conv_backward_weights(Conv2dOp& op, const Conv2dSpec& s, float* dw, float* db, const float* dout,
                                  const float* inp, int64_t N, int64_t H, int64_t W, bool accumulate) {
  op.backward_weights(conv_weight(s, dw), conv_bias(s, db), nchw(dout, N, s.out_channels, s.out_h(H), s.out_w(W)),
                      nchw(inp, N, s.in_channels, H, W), accumulate);
}
inline void pool_forward(Pool2dOp& op, const Pool2dSpec& s, float* out, const float* inp, int64_t N, int64_t C,
                         int64_t H, int64_t W) {
  op.forward(nchw(out, N, C, s.out_h(H), s.out_w(W)), nchw(inp, N, C, H, W));
}
inline void pool_backward(Pool2dOp& op, const Pool2dSpec& s, float* dinp, const float* dout, const float* inp,
                          const float* out, int64_t N, int64_t C, int64_t H, int64_t W) {
  op.backward(nchw(dinp, N, C, H, W), nchw(dout, N, C, s.out_h(H), s.out_w(W)), nchw(inp, N, C, H, W),
              nchw(out, N, C, s.out_h(H), s.out_w(W)));
}

inline void activation_forward(Stream& s, Activation kind, float* out, const float* inp, int64_t n) {
  s.run(call::ActivationForward{kind, TensorRef::of(out, {n}), TensorRef::of(inp, {n})});
}
inline void activation_backward(Stream& s, Activation kind, float* dinp, const float* dout, const float* inp,
                                const float* out, int64_t n) {
  s.run(call::ActivationBackward{kind, TensorRef::of(dinp, {n}), TensorRef::of(dout, {n}), TensorRef::of(inp, {n}),
                                 TensorRef::of(out, {n})});
}

// Kernel calls over plain arrays, with the argument lists of the CPU kernels they are checked against.
inline void linear_forward(Stream& s, float* out, const float* inp, const float* w, const float* b, int64_t B,
                           int64_t C_in, int64_t C_out) {
  s.run(call::LinearForward{TensorRef::of(out, {B, C_out}), TensorRef::of(inp, {B, C_in}),
                            TensorRef::of(w, {C_out, C_in}), TensorRef::of(b, {C_out})});
}
inline void batchnorm_stats(Stream& s, double* sums, const float* x, int64_t N, int64_t C, int64_t L) {
  s.run(call::BatchNormStats{TensorRef::of(sums, {2 * C + 1}), TensorRef::of(x, {N, C, L})});
}
inline void batchnorm_moments(Stream& s, double* mean_invstd, float* running_mean, float* running_var,
                              int64_t* num_batches_tracked, const double* sums, double count, int64_t C, float eps,
                              float momentum) {
  s.run(call::BatchNormMoments{TensorRef::of(mean_invstd, {2 * C}), TensorRef::of(running_mean, {C}),
                               TensorRef::of(running_var, {C}), TensorRef::of(num_batches_tracked, {1}),
                               TensorRef::of(sums, {2 * C + 1}), count, eps, momentum});
}
inline void batchnorm_apply(Stream& s, float* out, const float* x, const double* mean_invstd, const float* w,
                            const float* b, int64_t N, int64_t C, int64_t L) {
  s.run(call::BatchNormApply{TensorRef::of(out, {N, C, L}), TensorRef::of(x, {N, C, L}),
                             TensorRef::of(mean_invstd, {2 * C}), TensorRef::of(w, {C}), TensorRef::of(b, {C})});
}
inline void batchnorm_backward_reduce(Stream& s, double* sums, const float* dout, const float* x,
                                      const double* mean_invstd, int64_t N, int64_t C, int64_t L) {
  s.run(call::BatchNormBackwardReduce{TensorRef::of(sums, {2 * C}), TensorRef::of(dout, {N, C, L}),
                                      TensorRef::of(x, {N, C, L}), TensorRef::of(mean_invstd, {2 * C})});
}
inline void batchnorm_backward_apply(Stream& s, float* dinp, float* dw, float* db, const double* local,
                                     const double* global, double count, const float* dout, const float* x,
                                     const double* mean_invstd, const float* w, int64_t N, int64_t C, int64_t L,
                                     bool accumulate) {
  s.run(call::BatchNormBackwardApply{TensorRef::of(dinp, {N, C, L}), TensorRef::of(dw, {C}), TensorRef::of(db, {C}),
                                     TensorRef::of(local, {2 * C}), TensorRef::of(global, {2 * C}),
                                     TensorRef::of(dout, {N, C, L}), TensorRef::of(x, {N, C, L}),
                                     TensorRef::of(mean_invstd, {2 * C}), TensorRef::of(w, {C}), count, accumulate});
}
inline void layernorm_forward(Stream& s, float* out, double* mean_rstd, const float* x, const float* w,
                              const float* b, int64_t N, int64_t D, float eps) {
  s.run(call::LayerNormForward{TensorRef::of(out, {N, D}), TensorRef::of(mean_rstd, {2 * N}), TensorRef::of(x, {N, D}),
                               TensorRef::of(w, {D}), TensorRef::of(b, {D}), eps});
}
inline void layernorm_backward(Stream& s, float* dinp, float* dw, float* db, const float* dout, const float* x,
                               const double* mean_rstd, const float* w, int64_t N, int64_t D, bool accumulate) {
  s.run(call::LayerNormBackward{TensorRef::of(dinp, {N, D}), TensorRef::of(dw, {D}), TensorRef::of(db, {D}),
                                TensorRef::of(dout, {N, D}), TensorRef::of(x, {N, D}),
                                TensorRef::of(mean_rstd, {2 * N}), TensorRef::of(w, {D}), accumulate});
}
inline void embedding_forward(Stream& s, float* out, const int32_t* idx, const float* w, int64_t N, int64_t V,
                              int64_t E) {
  s.run(call::EmbeddingForward{TensorRef::of(out, {N, E}), TensorRef::of(idx, {N}), TensorRef::of(w, {V, E})});
}
inline void embedding_backward(Stream& s, float* dw, const float* dout, const int32_t* idx, int64_t N, int64_t V,
                               int64_t E, int64_t padding_idx, bool accumulate) {
  s.run(call::EmbeddingBackward{TensorRef::of(dw, {V, E}), TensorRef::of(dout, {N, E}), TensorRef::of(idx, {N}),
                                padding_idx, accumulate});
}

}  // namespace dpar::test
