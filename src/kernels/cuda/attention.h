// Scaled dot-product attention on CUDA, f32, the twin of kernels/cpu/attention.h: cuBLAS strided-batched GEMMs for
// the products (S = q k^T, out = P v; backward's dP = dout v^T, dv = P^T dout, dq = dS k, dk = dS^T q) around two
// kernels of our own: the softmax (scale, causal mask, lse, dropout drawn from the position) and its backward.
//
// The weights of every head live in a workspace of (B, heads, L, S) floats (two of them in backward) for the span
// of a call; backward recomputes them from q, k and lse. Queued on `stream`; `blas` bound to it by the caller.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/attention_args.h"

namespace dpar::kernels::cuda {

// The workspace floats a call needs: B*heads*L*S for forward, twice that for backward.
int64_t attention_workspace_floats(const AttentionShape& shape, bool backward);

// out (B,L,C), lse (B,heads,L) contiguous; q (B,L,C), k and v (B,S,C), rows strided.
void attention_forward(const AttentionTensor& out, float* lse, const AttentionTensor& q, const AttentionTensor& k,
                       const AttentionTensor& v, const AttentionShape& shape, const AttentionDropout& dropout,
                       float* workspace, cublasHandle_t blas, cudaStream_t stream);

// dq (B,L,C), dk and dv (B,S,C) overwritten, from dout (B,L,C) and the forward's q, k, v, out and lse.
void attention_backward(const AttentionTensor& dq, const AttentionTensor& dk, const AttentionTensor& dv,
                        const AttentionTensor& dout, const AttentionTensor& q, const AttentionTensor& k,
                        const AttentionTensor& v, const AttentionTensor& out, const float* lse,
                        const AttentionShape& shape, const AttentionDropout& dropout, float* workspace,
                        cublasHandle_t blas, cudaStream_t stream);

// ---- Mixed precision (AttentionSpec::dtype bf16), the twin of kernels/cpu/attention.h's ---------------------------
// q, k, v bf16; out, lse, dout, dq, dk, dv f32; the products cublasGemmStridedBatchedEx's on bf16 operands with f32
// accumulation, the rest f32, rounded as op_specs.h's AttentionSpec::dtype defines (the weights normalised before
// they are rounded, so that forward and backward round the same w). The CPU op is its reference: equal but for f32's
// summation order (and the rare weight that the order moves across a bf16 rounding boundary).

// The workspace bytes a call needs: the scores (f32) and weights (bf16) of every head; backward twice that and a
// bf16 copy of dout.
int64_t attention_bf16_workspace_bytes(const AttentionShape& shape, bool backward);

void attention_forward_bf16(const AttentionTensor& out, float* lse, const AttentionTensorBf16& q,
                            const AttentionTensorBf16& k, const AttentionTensorBf16& v, const AttentionShape& shape,
                            const AttentionDropout& dropout, void* workspace, cublasHandle_t blas,
                            cudaStream_t stream);

void attention_backward_bf16(const AttentionTensor& dq, const AttentionTensor& dk, const AttentionTensor& dv,
                             const AttentionTensor& dout, const AttentionTensorBf16& q, const AttentionTensorBf16& k,
                             const AttentionTensorBf16& v, const AttentionTensor& out, const float* lse,
                             const AttentionShape& shape, const AttentionDropout& dropout, void* workspace,
                             cublasHandle_t blas, cudaStream_t stream);

}  // namespace dpar::kernels::cuda
