// CPU math kernels: the arithmetic of layers, losses and optimizers on raw, contiguous, row-major float buffers.
//
// Kernels know nothing about tensors, threads or devices: callers own every buffer and pass shapes last.
// They allocate nothing, so they can run on a worker thread in a hot loop.
//
// Determinism: each output element is computed by the same sequence of float operations wherever it sits in the
// buffer (loops are written so that the compiler's vector body and scalar tail do identical arithmetic, and no
// reduction is reassociated), so the same inputs give bit-identical outputs, call after call. GEMMs go through
// oneDNN (kernels/cpu/gemm.h), whose results depend on the oneDNN build, the CPU's ISA and the calling thread's
// GEMM thread count, but not on the call.
//
// Elementwise kernels (activations, dropout, axpy, scale) allow their output to alias their input exactly
// (in-place use); no other partial overlap is allowed anywhere.
//
// Errors: arguments are checked cheaply (O(1), plus label ranges) and reported by throwing dpar::Error with
// Status::kInvalidArgument.
#pragma once

#include <cstdint>

#include "common/op_specs.h"        // kIgnoreIndex
#include "common/optimizer_hyper.h"  // SgdHyper, AdamHyper
#include "kernels/pointwise.h"

namespace dpar::kernels::cpu {

// ---------------------------------------------------------------------------------------------------------------
// Linear layer (GEMM through oneDNN's dnnl_sgemm; extents must fit in 32 bits, as for cuBLAS).

// out = inp @ weight^T + bias: the GEMM's value, then the bias added (each element rounded once).
// inp (B,C_in), weight (C_out,C_in), bias (C_out) or nullptr, out (B,C_out)
void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t B, int64_t C_in,
                    int64_t C_out);
// out = relu(inp @ weight^T + bias): linear_forward then relu_forward, the same bits, with the bias and the ReLU in
// one pass over out.
void linear_relu_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t B,
                         int64_t C_in, int64_t C_out);

// dinp = dout @ weight (skipped if dinp == nullptr; always overwritten otherwise);
// dweight = dout^T @ inp; dbias = sum over the batch of dout (skipped if dbias == nullptr).
// accumulate=false overwrites dweight/dbias, accumulate=true adds to them (gradient accumulation).
// dinp (B,C_in), dweight (C_out,C_in), dbias (C_out), dout (B,C_out), inp (B,C_in), weight (C_out,C_in)
void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t B, int64_t C_in, int64_t C_out, bool accumulate);
// The backward of linear_relu_forward, given dout = dL/d(its output) and out = its output: relu_backward into
// dpre (B,C_out), then linear_backward from dpre, the same bits; the mask and dbias's sums are one pass. dinp may
// be dout's memory: dout is read in full before dinp is written.
void linear_relu_backward(float* dinp, float* dweight, float* dbias, float* dpre, const float* dout,
                          const float* out, const float* inp, const float* weight, int64_t B, int64_t C_in,
                          int64_t C_out, bool accumulate);

// In mixed precision (backend/kernel_calls.h's LinearForward and LinearBackward in bf16): inp and weight are bf16
// bits (common/bf16.h), everything else f32. The GEMMs run on `gemm` (dnnl_ops.h: bf16 products, exact in f32,
// accumulated in f32; gemm.h's bf16_support must hold); the bias, the epilogue and their backward are the f32
// kernels' own passes above, the same arithmetic on the GEMM's f32 result.
class Bf16Gemm;

// out (B,C_out) = epilogue(inp @ weight^T + bias). ReLU: linear_relu_forward's pass. GELU: the GEMM and the bias
// into pre (B,C_out), then gelu_forward from pre into out (what composing linear_forward and gelu_forward gives);
// pre is unused otherwise (may be nullptr).
void linear_forward_bf16(Bf16Gemm& gemm, float* out, float* pre, const uint16_t* inp, const uint16_t* weight,
                         const float* bias, int64_t B, int64_t C_in, int64_t C_out, Epilogue epilogue);
// The same with the output kept in bf16: out (B,C_out) bf16 = the f32 result, bias and ReLU included, rounded once
// to nearest even (Bf16Gemm::run_rounded: one pass, no f32 copy). With a GELU, as autocast runs a bf16 linear and
// then GELU: the GEMM and the bias rounded once into pre (B,C_out) bf16 (kept for backward), then out =
// gelu_forward_rounded(pre); pre is unused otherwise (may be nullptr).
void linear_forward_bf16_rounded(Bf16Gemm& gemm, uint16_t* out, uint16_t* pre, const uint16_t* inp,
                                 const uint16_t* weight, const float* bias, int64_t B, int64_t C_in, int64_t C_out,
                                 Epilogue epilogue);
// From dout (B,C_out): the gradient before the GEMMs, g = dout (no epilogue), relu_backward's mask of it by out
// (ReLU) or gelu_backward's by pre (GELU), written to dpre (B,C_out) with an epilogue; dbias (C_out, or nullptr)
// = its column sums as in linear_backward; dout_low (B,C_out) = g rounded to bf16 (to_bf16); then dinp (B,C_in, or
// nullptr) = dout_low @ weight and dweight (C_out,C_in) = dout_low^T @ inp, overwritten or added to when
// accumulate (dbias too). dinp may be dout's memory: dout is read in full before dinp is written.
// With a ReLU epilogue the mask reads out (f32) or, where the forward kept its output in bf16, out_rounded (the
// other null); with a GELU, gelu_backward reads pre (f32) or pre_rounded (bf16, linear_forward_bf16_rounded's).
void linear_backward_bf16(Bf16Gemm& gemm, float* dinp, float* dweight, float* dbias, float* dpre, uint16_t* dout_low,
                          const float* dout, const float* out, const uint16_t* out_rounded, const float* pre,
                          const uint16_t* pre_rounded, const uint16_t* inp, const uint16_t* weight, int64_t B,
                          int64_t C_in, int64_t C_out, Epilogue epilogue, bool accumulate);

// ---------------------------------------------------------------------------------------------------------------
// Elementwise activations on n elements. Backward takes what it needs: relu/tanh/sigmoid the forward output,
// gelu the forward input. All buffers (n).

// out = max(inp, 0); NaN propagates, as in PyTorch.
void relu_forward(float* out, const float* inp, int64_t n);
// dinp = out > 0 ? dout : 0 (PyTorch's threshold_backward: out <= 0 gives 0).
void relu_backward(float* dinp, const float* dout, const float* out, int64_t n);

// out = inp * Phi(inp) = 0.5 * inp * (1 + erf(inp / sqrt 2)): the exact form (PyTorch approximate='none').
void gelu_forward(float* out, const float* inp, int64_t n);
// dinp = dout * (Phi(inp) + inp * phi(inp)).
void gelu_backward(float* dinp, const float* dout, const float* inp, int64_t n);
// The same on a bf16 input (a linear layer's pre-activation kept in bf16), read widened: gelu_forward's value
// rounded once to bf16 (out bf16), and gelu_backward's gradient in f32.
void gelu_forward_rounded(uint16_t* out, const uint16_t* inp, int64_t n);
void gelu_backward_rounded(float* dinp, const float* dout, const uint16_t* inp, int64_t n);

// out = tanh(inp).
void tanh_forward(float* out, const float* inp, int64_t n);
// dinp = dout * (1 - out^2).
void tanh_backward(float* dinp, const float* dout, const float* out, int64_t n);

// out = 1 / (1 + exp(-inp)).
void sigmoid_forward(float* out, const float* inp, int64_t n);
// dinp = dout * (1 - out) * out.
void sigmoid_backward(float* dinp, const float* dout, const float* out, int64_t n);

// A pointwise activation of kernels/pointwise.h, element by element: out = F::forward(inp), and
// dinp = F::backward(dout, inp, out). All buffers (n); out == inp and dinp == dout are allowed.
template <class F>
void pointwise_forward(float* out, const float* inp, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = F::forward(inp[i]);
}
template <class F>
void pointwise_backward(float* dinp, const float* dout, const float* inp, const float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dinp[i] = F::backward(dout[i], inp ? inp[i] : 0.0f, out ? out[i] : 0.0f);
}

// ---------------------------------------------------------------------------------------------------------------
// Dropout with a counter-based RNG: element i's draw is a pure function of (seed, offset + i), so a stream is
// just (seed, counter) and a caller continues it by advancing offset by n. p in [0, 1).

// The uniform draw in [0, 1), a multiple of 2^-24, that dropout uses for counter value `counter` of stream `seed`.
// Exposed so that tests and other kernels can reproduce a mask.
float dropout_uniform(uint64_t seed, uint64_t counter);

// Element i is kept iff dropout_uniform(seed, offset + i) >= p (probability 1 - p).
// mask = kept ? 1/(1-p) : 0 (the multiplier backward needs); out = inp * mask, as PyTorch multiplies by the scale.
// out (n), mask (n), inp (n)
void dropout_forward(float* out, float* mask, const float* inp, int64_t n, float p, uint64_t seed, uint64_t offset);
// dinp = dout * mask.
// dinp (n), dout (n), mask (n)
void dropout_backward(float* dinp, const float* dout, const float* mask, int64_t n);

// ---------------------------------------------------------------------------------------------------------------
// Losses fused with their gradient. They return the SUM over the batch of per-sample losses (accumulated in
// double); the gradient written is that of (the sum * grad_scale), e.g. grad_scale = 1/total_batch for a mean.
// The gradient pointer may be nullptr to compute the loss only.

// Per-sample loss = -log softmax(logits)[label] (log-sum-exp with max subtraction, stable for huge logits).
// dlogits = (softmax(logits) - onehot(label)) * grad_scale. A row labelled kIgnoreIndex (-100, PyTorch's
// ignore_index) adds no loss and gets a zero gradient row; any other label must lie in [0, C) (checked; throws).
// dlogits (B,C), logits (B,C), labels (B)
double cross_entropy_forward_backward(float* dlogits, const float* logits, const int32_t* labels, int64_t B,
                                      int64_t C, float grad_scale);

// Per-sample loss = mean over D of (pred - target)^2, so the mean over samples is PyTorch's MSELoss('mean').
// dpred = 2 * (pred - target) / D * grad_scale.
// dpred (B,D), pred (B,D), target (B,D)
double mse_forward_backward(float* dpred, const float* pred, const float* target, int64_t B, int64_t D,
                            float grad_scale);

// ---------------------------------------------------------------------------------------------------------------
// Optimizers on flat buffers, with PyTorch's single-tensor (for-loop) formulas and op order, in float32.
// Scalars that PyTorch derives in Python double precision (1 - dampening, bias corrections, ...) are derived
// here in double from the float hyper-parameters and rounded to float where PyTorch rounds them.

// d = g + wd*p; if momentum != 0: buf = first_step ? d : momentum*buf + (1-dampening)*d;
// d = nesterov ? d + momentum*buf : buf; p -= lr*d.
// param (n), momentum_buf (n) or nullptr when momentum == 0, grad (n)
void sgd_step(float* param, float* momentum_buf, const float* grad, int64_t n, const SgdHyper& h, bool first_step);

// step is 1-based: the step being taken (1 on the first call). exp_avg/exp_avg_sq start at zero.
// Adam: g += wd*p. AdamW: p *= 1 - lr*wd. m = lerp(m, g, 1-b1); v = b2*v + (1-b2)*g*g;
// step_size = lr/(1-b1^step); denom = sqrt(v)/sqrt(1-b2^step) + eps; p -= step_size * m/denom.
// param (n), exp_avg (n), exp_avg_sq (n), grad (n)
void adam_step(float* param, float* exp_avg, float* exp_avg_sq, const float* grad, int64_t n, const AdamHyper& h,
               int64_t step);

// ---------------------------------------------------------------------------------------------------------------
// Small helpers.

// y += a*x.  y (n), x (n)
void axpy(float* y, const float* x, float a, int64_t n);
// x *= a.  x (n)
void scale(float* x, float a, int64_t n);
// x[i] = value.  x (n)
void fill(float* x, float value, int64_t n);
// The sum of x[i]^2, in double (each square is exact there): lane l (l < kSumSquaresLanes) adds the elements
// i = l mod kSumSquaresLanes in index order, then the lanes are added in a fixed pairwise tree. The order does not
// depend on the machine, so every call gives the same bits.  x (n)
constexpr int kSumSquaresLanes = 8;
double sum_squares(const float* x, int64_t n);

// dst[i] = src[i] rounded to bfloat16 (common/bf16.h: to nearest, ties to even).  dst (n), src (n)
void to_bf16(uint16_t* dst, const float* src, int64_t n);
// dst[i] = src[i], exactly.  dst (n), src (n)
void from_bf16(float* dst, const uint16_t* src, int64_t n);
// dst[i] = src[i] rounded to f16 (common/f16.h: to nearest, ties to even, overflow to infinity); dst holds the
// bits.  dst (n), src (n)
void to_f16(uint16_t* dst, const float* src, int64_t n);
// dst[i] = src[i], exactly.  dst (n), src (n)
void from_f16(float* dst, const uint16_t* src, int64_t n);

}  // namespace dpar::kernels::cpu
