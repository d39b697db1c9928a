// AttentionOp's tensor references (backend/ops.h) as the attention kernels read them (kernels/attention_args.h),
// with the checks every backend makes: f32, three dimensions, each row's channels contiguous, and the extents that
// the op's contract ties together. One definition for the CPU and the CUDA op.
#pragma once

#include <cstdint>

#include "common/error.h"
#include "common/op_specs.h"
#include "common/tensor_ref.h"
#include "kernels/attention_args.h"

namespace dpar::attention_refs {

// `x` (named `what` in a message) as a kernel tensor of shape (B, positions, C). Its first two dimensions may be
// strided (a view of a packed projection); its last must be contiguous.
inline kernels::AttentionTensor tensor(const TensorRef& x, const char* what, int64_t B, int64_t positions, int64_t C) {
  DPAR_CHECK_ARG(x.defined(), "attention: ", what, " is absent");
  DPAR_CHECK_ARG(x.dtype == DType::kF32, "attention: ", what, ": expected f32, got ", dtype_name(x.dtype));
  DPAR_CHECK_ARG(x.ndim == 3 && x.shape[0] == B && x.shape[1] == positions && x.shape[2] == C, "attention: ", what,
                 ": expected (", B, ", ", positions, ", ", C, "), got ", x.str());
  DPAR_CHECK_ARG(x.strides[2] == 1 || C == 1, "attention: ", what,
                 ": each position's channels must be contiguous, got the view ", x.str());
  return {static_cast<float*>(x.data), x.strides[0], x.strides[1]};
}

// A bf16 operand (q, k, v of an op whose spec's dtype is bf16), with the same checks.
inline kernels::AttentionTensorBf16 tensor_bf16(const TensorRef& x, const char* what, int64_t B, int64_t positions,
                                                int64_t C) {
  DPAR_CHECK_ARG(x.defined(), "attention: ", what, " is absent");
  DPAR_CHECK_ARG(x.dtype == DType::kBF16, "attention (bf16): ", what, ": expected bf16, got ", dtype_name(x.dtype));
  DPAR_CHECK_ARG(x.ndim == 3 && x.shape[0] == B && x.shape[1] == positions && x.shape[2] == C, "attention: ", what,
                 ": expected (", B, ", ", positions, ", ", C, "), got ", x.str());
  DPAR_CHECK_ARG(x.strides[2] == 1 || C == 1, "attention: ", what,
                 ": each position's channels must be contiguous, got the view ", x.str());
  return {static_cast<const uint16_t*>(x.data), x.strides[0], x.strides[1]};
}

// A tensor the contract says is contiguous (out, dout): refused otherwise.
inline kernels::AttentionTensor contiguous(const TensorRef& x, const char* what, int64_t B, int64_t positions,
                                           int64_t C) {
  const kernels::AttentionTensor t = tensor(x, what, B, positions, C);
  DPAR_CHECK_ARG(x.is_contiguous(), "attention: ", what, ": this op reads contiguous memory, got the strided view ",
                 x.str());
  return t;
}

// The shape of a call from q (B,L,C) and k (B,S,C); checks what the spec ties to them.
inline kernels::AttentionShape shape(const AttentionSpec& spec, const TensorRef& q, const TensorRef& k) {
  DPAR_CHECK_ARG(q.ndim == 3 && k.ndim == 3, "attention: q and k must be (B, L, C) and (B, S, C), got ", q.str(),
                 " and ", k.str());
  kernels::AttentionShape s;
  s.B = q.shape[0], s.L = q.shape[1], s.S = k.shape[1];
  s.heads = spec.heads;
  const int64_t C = q.shape[2];
  DPAR_CHECK_ARG(spec.heads >= 1 && C % spec.heads == 0, "attention: ", spec.heads, " heads do not divide C = ", C);
  s.D = C / spec.heads;
  s.scale = spec.scale_for(s.D);
  s.causal = spec.causal;
  DPAR_CHECK_ARG(!s.causal || s.L == s.S, "attention: causal attention takes as many keys as queries, got L = ", s.L,
                 " and S = ", s.S);
  return s;
}

// lse (B, heads, L), contiguous f32.
inline float* lse(const TensorRef& x, const kernels::AttentionShape& s) {
  float* p = x.contiguous_as<float>("attention: lse");
  DPAR_CHECK_ARG(p && x.ndim == 3 && x.shape[0] == s.B && x.shape[1] == s.heads && x.shape[2] == s.L,
                 "attention: lse: expected (", s.B, ", ", s.heads, ", ", s.L, "), got ", x.str());
  return p;
}

inline kernels::AttentionDropout dropout(float p, uint64_t seed, uint64_t offset) {
  DPAR_CHECK_ARG(p >= 0.0f && p < 1.0f, "attention: dropout_p must be in [0, 1), got ", p);
  return {p, seed, offset};
}

}  // namespace dpar::attention_refs
