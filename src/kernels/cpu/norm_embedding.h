// LayerNorm's and Embedding's CPU kernels, the reference of every backend's.
#pragma once

#include <cstdint>

namespace dpar::kernels::cpu {

// LayerNorm over the last dim of x (N,D), as torch.nn.LayerNorm((D,)): per row, mean and biased variance in double,
// rstd = 1/sqrt(var + eps); out (N,D) = (x - mean) * rstd * weight + bias; weight, bias (D) or null (no affine).
// mean_rstd (2,N): per row its mean, then its rstd, kept for backward.
void layernorm_forward(float* out, double* mean_rstd, const float* x, const float* weight, const float* bias,
                       int64_t N, int64_t D, float eps);
// The same with out (N,D) bf16: each f32 result above rounded once to bf16 (what a bf16 linear layer reading the
// f32 output would round it to), for a LayerNorm whose output only such layers read.
void layernorm_forward_rounded(uint16_t* out, double* mean_rstd, const float* x, const float* weight,
                               const float* bias, int64_t N, int64_t D, float eps);

// dinp (N,D) (or null) = rstd * (g - mean(g) - x̂ * mean(g * x̂)) per row with g = dout * weight and
// x̂ = (x - mean) * rstd; dweight = Σ_rows dout * x̂, dbias = Σ_rows dout, both (D) or null (overwritten, or added
// to when accumulate). dout (N,D), x (N,D), mean_rstd (2,N) from the forward.
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* x,
                        const double* mean_rstd, const float* weight, int64_t N, int64_t D, bool accumulate);

// out (N,E) = weight[idx[n]] per n; idx (N), weight (V,E). Throws Error(INVALID_ARGUMENT) naming the first index
// outside [0, V) and its position, before writing anything.
void embedding_forward(float* out, const int32_t* idx, const float* weight, int64_t N, int64_t V, int64_t E);

// dweight (V,E) += dout[n] at row idx[n] for each n (after zeroing it, unless accumulate): rows no index names get
// zero; a repeated index sums its rows; row padding_idx (or none for -1) gets nothing, as PyTorch's. Throws as
// embedding_forward for an index outside [0, V).
void embedding_backward(float* dweight, const float* dout, const int32_t* idx, int64_t N, int64_t V, int64_t E,
                        int64_t padding_idx, bool accumulate);

// GPT-2's learned positions: out (B,T,C) = inp (B,T,C) + weight[t] (a row of weight (P,C), T <= P) at position t.
void position_embedding_forward(float* out, const float* inp, const float* weight, int64_t B, int64_t T, int64_t C);
// dweight (P,C): rows t < T = Σ_b dout[b,t] (B,T,C), summed in batch order; rows t >= T zero. Overwritten, or every
// row added to when accumulate.
void position_embedding_backward(float* dweight, const float* dout, int64_t B, int64_t T, int64_t C, int64_t P,
                                 bool accumulate);

}  // namespace dpar::kernels::cpu
