// The arguments of the attention kernels, one definition for the CPU kernel (kernels/cpu/attention.h) and the CUDA
// kernel (kernels/cuda/attention.h). The semantics are PyTorch's F.scaled_dot_product_attention(q, k, v, dropout_p,
// is_causal, scale) on q, k, v viewed as (B, heads, positions, D).
#pragma once

#include <cstdint>

namespace dpar::kernels {

// One (B, positions, heads*D) tensor of the memory the kernel runs on: element (b, t, c) at
// data[b*batch_stride + t*row_stride + c]. q, k and v may be views of one packed (B, T, 3C) projection (row_stride 3C).
struct AttentionTensor {
  float* data = nullptr;
  int64_t batch_stride = 0;
  int64_t row_stride = 0;
};

// The same for a bf16 operand of mixed precision (q, k, v: AttentionSpec::dtype bf16), read only; bf16 bits
// (common/bf16.h).
struct AttentionTensorBf16 {
  const uint16_t* data = nullptr;
  int64_t batch_stride = 0;
  int64_t row_stride = 0;
};

struct AttentionShape {
  int64_t B = 0, L = 0, S = 0;  // batch, queries, keys (L == S when causal)
  int64_t heads = 1, D = 0;     // C = heads * D
  float scale = 1.0f;           // the scores' factor
  bool causal = false;          // query i sees keys j <= i
};

// Dropout on the weights, as AttentionOp documents (backend/ops.h): weight (b,h,i,j) kept iff
// rng::uniform24(rng::stream_key(seed), offset + ((b*heads + h)*L + i)*S + j) >= p, kept ones scaled by 1/(1-p).
struct AttentionDropout {
  float p = 0.0f;
  uint64_t seed = 0, offset = 0;
};

}  // namespace dpar::kernels
