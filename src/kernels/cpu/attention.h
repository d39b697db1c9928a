// Scaled dot-product attention on the CPU, fused (flash-attention style): forward keeps only each query's
// log-sum-exp, backward recomputes the weights from it. The semantics are PyTorch's
// F.scaled_dot_product_attention(q, k, v, dropout_p, is_causal, scale) on q, k, v viewed as (B, heads, L, D).
#pragma once

#include <cstdint>

#include "kernels/attention_args.h"

namespace dpar::kernels::cpu {

class Bf16Gemm;  // dnnl_ops.h

using kernels::AttentionDropout;
using kernels::AttentionTensorBf16;
using kernels::AttentionShape;
using kernels::AttentionTensor;

// How the products on a tile of queries x keys are computed: oneDNN's sgemm per tile (FMA kernels; the op's
// choice), or loops of our own compiled per vector ISA (vector_isa.h), without FMA as -ffp-contract=off keeps every
// CPU kernel. Measured on the GPT shapes (bench/results/attention_cpu_2026-11-29.md) the sgemm tiles are 2-4x faster;
// the loops stay for that comparison and as a second computation in the tests.
enum class AttentionTiles : int { kLoops = 0, kSgemm = 1 };

// The floats of scratch memory a call with head size D uses (a few tiles of one query block, about 150 KB at D = 64).
int64_t attention_scratch_floats(int64_t D);

// out (B,L,C) = softmax(scale q k^T [causal mask]) [dropout] v per head; lse (B,heads,L) contiguous, f32.
// q (B,L,C), k and v (B,S,C).
void attention_forward(const AttentionTensor& out, float* lse, const AttentionTensor& q, const AttentionTensor& k,
                       const AttentionTensor& v, const AttentionShape& shape, const AttentionDropout& dropout,
                       AttentionTiles tiles = AttentionTiles::kSgemm, float* scratch = nullptr);

// scratch: attention_scratch_floats(D) floats that the caller keeps between calls (an op), or null: the call
// allocates its own (above malloc's mmap threshold, so fresh pages, zero-filled by the kernel, on every call).
//
// dq (B,L,C), dk and dv (B,S,C), overwritten, from dout (B,L,C) and the forward's q, k, v, out and lse.
void attention_backward(const AttentionTensor& dq, const AttentionTensor& dk, const AttentionTensor& dv,
                        const AttentionTensor& dout, const AttentionTensor& q, const AttentionTensor& k,
                        const AttentionTensor& v, const AttentionTensor& out, const float* lse,
                        const AttentionShape& shape, const AttentionDropout& dropout,
                        AttentionTiles tiles = AttentionTiles::kSgemm, float* scratch = nullptr);

// ---- Mixed precision (AttentionSpec::dtype bf16) ------------------------------------------------------------------
// q, k, v bf16; out, lse, dout, dq, dk, dv f32; the products are `gemm`'s (bf16 operands, f32 accumulation; the
// caller's, not for concurrent use), the rest f32, rounded as op_specs.h's AttentionSpec::dtype defines:
//   s = scale (q k^T), lse, p = exp(s - lse) and w = bf16(p f) (f the dropout factor); out = w v;
//   g = bf16(dout); dv = w^T g; dp = g v^T; D_i = dout_i . out_i; ds = bf16(p (dp f - D)); dq = scale (ds k),
//   dk = scale (ds^T q).
// Per head, a block of 128 queries against all its keys at once: the block's score rows are kept (128 x S floats), so
// the softmax is exact before the weights are rounded (the same w in forward and backward), and the products run
// on key chunks of a fixed width, so that `gemm` keeps a bounded number of shapes (a few per product) for any S.
// gemm.h's bf16_support must hold (oneDNN would emulate bf16 products elsewhere).
//
// The bytes of scratch memory a call uses: a few rows of kBq x S, and backward's bf16 copy of dout (B L C).
int64_t attention_bf16_scratch_bytes(const AttentionShape& shape, bool backward);

void attention_forward_bf16(Bf16Gemm& gemm, const AttentionTensor& out, float* lse, const AttentionTensorBf16& q,
                            const AttentionTensorBf16& k, const AttentionTensorBf16& v, const AttentionShape& shape,
                            const AttentionDropout& dropout, void* scratch);

// dout and out contiguous (as the op's contract has them).
void attention_backward_bf16(Bf16Gemm& gemm, const AttentionTensor& dq, const AttentionTensor& dk,
                             const AttentionTensor& dv, const AttentionTensor& dout, const AttentionTensorBf16& q,
                             const AttentionTensorBf16& k, const AttentionTensorBf16& v, const AttentionTensor& out,
                             const float* lse, const AttentionShape& shape, const AttentionDropout& dropout,
                             void* scratch);

}  // namespace dpar::kernels::cpu
