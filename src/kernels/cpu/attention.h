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

// How the products on a tile of queries x keys are computed: loops of our own, compiled per vector ISA
// (vector_isa.h), or oneDNN's sgemm per tile. The op uses kLoops (bench/results/attention_cpu_2026-11-29.md: faster
// on the GPT shapes); kSgemm stays for the benchmark's comparison.
enum class AttentionTiles : int { kLoops = 0, kSgemm = 1 };

// out (B,L,C) = softmax(scale q k^T [causal mask]) [dropout] v per head; lse (B,heads,L) contiguous, f32.
// q (B,L,C), k and v (B,S,C).
void attention_forward(const AttentionTensor& out, float* lse, const AttentionTensor& q, const AttentionTensor& k,
                       const AttentionTensor& v, const AttentionShape& shape, const AttentionDropout& dropout,
                       AttentionTiles tiles = AttentionTiles::kSgemm);

// dq (B,L,C), dk and dv (B,S,C), overwritten, from dout (B,L,C) and the forward's q, k, v, out and lse.
void attention_backward(const AttentionTensor& dq, const AttentionTensor& dk, const AttentionTensor& dv,
                        const AttentionTensor& dout, const AttentionTensor& q, const AttentionTensor& k,
                        const AttentionTensor& v, const AttentionTensor& out, const float* lse,
                        const AttentionShape& shape, const AttentionDropout& dropout,
                        AttentionTiles tiles = AttentionTiles::kSgemm);

}  // namespace dpar::kernels::cpu
