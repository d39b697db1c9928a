// What a stateful op computes (backend/ops.h): plain descriptions, shared by the op seam and the kernels that
// implement it (which know nothing of backends).
#pragma once

#include <cstdint>
#include <string>

#include "common/dtype.h"

namespace dpar {

// The class target that cross-entropy skips (no loss, no gradient, not counted in the mean): PyTorch's default
// ignore_index, which a GPT gives its padding and its prompt tokens.
constexpr int32_t kIgnoreIndex = -100;

// What an op applies to its result before writing it: fusion is an argument, not another op. The bias is the
// op's own argument (present or not), so the epilogue is the activation after it.
enum class Epilogue : int32_t { kNone = 0, kRelu = 1, kGelu = 2 };
const char* epilogue_name(Epilogue epilogue);  // "none", "relu", "gelu"

// A sliding window's output extent, as PyTorch computes it: floor(reach / stride) + 1, where `reach` (the input
// with its padding, less the window's span) may be negative, so the quotient rounds down, not toward zero: a window
// wider than the padded input gives 0 (or less), which the layer refuses.
constexpr int64_t window_out_extent(int64_t reach, int64_t stride) {
  return (reach >= 0 ? reach / stride : -((-reach + stride - 1) / stride)) + 1;
}

// A 2-D convolution, as PyTorch's nn.Conv2d (cross-correlation, zero padding).
struct Conv2dSpec {
  int64_t in_channels = 1, out_channels = 1;
  int64_t kernel_h = 1, kernel_w = 1;
  int64_t stride_h = 1, stride_w = 1;
  int64_t pad_h = 0, pad_w = 0;
  int64_t dilation_h = 1, dilation_w = 1;
  int64_t groups = 1;
  bool bias = true;
  Epilogue epilogue = Epilogue::kNone;
  // The dtype the convolution computes in: f32, or bf16 or f16 (mixed precision: the op reads a bf16 (f16) input
  // and the step's bf16 (f16) weight, accumulates in f32 and writes f32 output and f32 gradients; its backward reads
  // the f32 gradient of its output and rounds it to the dtype itself, and the bias gradient is the f32 sum of that
  // rounded gradient, as the libraries' low-precision backward-weights computes it with the weights').
  DType dtype = DType::kF32;

  // PyTorch's output extent: floor((in + 2 pad - dilation (kernel - 1) - 1) / stride) + 1 (may be < 1: the
  // layer refuses it).
  int64_t out_h(int64_t h) const {
    return window_out_extent(h + 2 * pad_h - dilation_h * (kernel_h - 1) - 1, stride_h);
  }
  int64_t out_w(int64_t w) const {
    return window_out_extent(w + 2 * pad_w - dilation_w * (kernel_w - 1) - 1, stride_w);
  }
  std::string str() const;  // "conv2d(3 -> 8, kernel 3x3, stride 1x1, padding 1x1, dilation 1x1, groups 1)"
};

// Scaled dot-product attention over heads, as PyTorch's F.scaled_dot_product_attention(q, k, v, dropout_p,
// is_causal, scale) on q, k, v split into `heads` heads of D = C / heads channels each.
struct AttentionSpec {
  int64_t heads = 1;
  bool causal = false;  // query i attends to keys j <= i (PyTorch's is_causal: the top-left aligned lower triangle)
  float scale = 0.0f;   // the scores' factor; 0: PyTorch's default 1/sqrt(D)
  // The dtype the products compute in: f32, or bf16 (mixed precision: q, k and v bf16; the scores, the softmax, the
  // log-sum-exp and out f32; the weights rounded to bf16 before their product with v; every product accumulated in
  // f32; backward reads f32 dout and writes f32 dq, dk, dv, its products in bf16 likewise). Exactly, per head, with
  // bf16(x) f32 rounded to nearest even, f_ij the dropout factor (0 or 1/(1-p); 1 without dropout), sums in f32:
  //   s_ij = scale (q_i . k_j)                        masked ones -inf
  //   lse_i = m_i + log sum_j exp(s_ij - m_i)          m_i = max_j s_ij
  //   p_ij = exp(s_ij - lse_i)                         the exact softmax: normalised before it is rounded
  //   w_ij = bf16(p_ij f_ij);   out_i = sum_j w_ij v_j
  // and backward, from g = bf16(dout) and the same p and w:
  //   dv_j = sum_i w_ij g_i;    dp_ij = g_i . v_j;     D_i = dout_i . out_i (f32 operands)
  //   ds_ij = bf16(p_ij (dp_ij f_ij - D_i))
  //   dq_i = scale sum_j ds_ij k_j;   dk_j = scale sum_i ds_ij q_i    (the scale applied to the f32 sums)
  // flash-attention's roundings (P and dS rounded before their products), except that the weights are rounded
  // after the normalisation rather than relative to a running maximum, so that the result does not depend on a
  // kernel's tiling and forward and backward round the same w. tests/reference/make_mixed_precision_reference.py
  // emulates it in PyTorch.
  DType dtype = DType::kF32;
  // The factor for head size `head_dim`.
  float scale_for(int64_t head_dim) const;
  std::string str() const;  // "attention(4 heads, causal)"
};

enum class PoolKind : int32_t {
  kMax = 0,  // gradients to the first maximum of each window in row-major order, as PyTorch's
  kAvg = 1,  // padding counts in the divisor (PyTorch's count_include_pad=True): kernel_h * kernel_w
};

// A 2-D pooling, as PyTorch's nn.MaxPool2d / nn.AvgPool2d with ceil_mode=False and dilation 1; `global` makes the
// window the whole input (stride and padding unused): nn.AdaptiveAvgPool2d((1, 1)).
struct Pool2dSpec {
  PoolKind kind = PoolKind::kMax;
  bool global = false;
  int64_t kernel_h = 1, kernel_w = 1;
  int64_t stride_h = 1, stride_w = 1;
  int64_t pad_h = 0, pad_w = 0;

  int64_t out_h(int64_t h) const { return global ? 1 : window_out_extent(h + 2 * pad_h - kernel_h, stride_h); }
  int64_t out_w(int64_t w) const { return global ? 1 : window_out_extent(w + 2 * pad_w - kernel_w, stride_w); }
  std::string str() const;  // "max_pool2d(kernel 2x2, stride 2x2, padding 0x0)"
};

}  // namespace dpar
