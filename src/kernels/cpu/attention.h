// Scaled dot-product attention on the CPU, fused (flash-attention style): forward keeps only each query's
// log-sum-exp, backward recomputes the weights from it. The semantics are PyTorch's
// F.scaled_dot_product_attention(q, k, v, dropout_p, is_causal, scale) on q, k, v viewed as (B, heads, L, D).
#pragma once

#include <cstdint>

#include "kernels/attention_args.h"

namespace dpar::kernels::cpu {

using kernels::AttentionDropout;
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

}  // namespace dpar::kernels::cpu
