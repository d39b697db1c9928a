// The kernels a Stream runs, each one struct of its arguments: the one place a kernel's signature lives. A layer
// fills a struct of tensor references (common/tensor_ref.h) and hands it to Stream::run; the backend chooses the
// implementation by the call's kind and dtype (its `dtype()`), or refuses with NOT_SUPPORTED naming both.
//
// Each struct's contract (what it computes, in which order, with which rounding) is the CPU kernel of the same name
// in kernels/cpu/, the reference of every backend's. Shapes are in each struct's comment; extents are read from the
// references, never passed beside them. Absent optional arguments are default (null) references.
//
// Adding a kernel: a struct here (with its name) and its line in KernelCall and Op, its implementation in each backend
// that has it (the backend's run table and supports() list), and the layer that calls it. Adding a dtype to a kernel:
// the backend's implementation and its supports() entry; no struct or method changes.
#pragma once

#include <cstdint>
#include <variant>

#include "common/op_specs.h"
#include "common/optimizer_hyper.h"
#include "common/tensor_ref.h"
#include "kernels/pointwise.h"

namespace dpar {

// The activations: four written out per backend, then the pointwise ones defined once (kernels/pointwise.h).
enum class Activation : int32_t {
  kRelu = 0,
  kGelu = 1,
  kTanh = 2,
  kSigmoid = 3,
#define DPAR_ACTIVATION_ENUM(Enum, Struct, name) Enum,
  DPAR_POINTWISE_ACTIVATIONS(DPAR_ACTIVATION_ENUM)
#undef DPAR_ACTIVATION_ENUM
};
const char* activation_name(Activation kind);  // "relu", "silu"
// The activation an epilogue applies (kNone has none: not to be asked).
Activation epilogue_activation(Epilogue epilogue);

namespace call {

// out (*,C_out) = epilogue(inp (*,C_in) @ weight^T + bias); weight (C_out,C_in), bias (C_out) or absent. With a GELU
// epilogue, pre (*,C_out) receives the result before it (GELU's backward reads it); otherwise pre is absent.
//
// In bf16 (mixed precision: the call's dtype is inp's): inp and weight are bf16 (the layer's input rounded to bf16
// and the step's bf16 copy of the weight); bias, out and pre stay f32. The products of bf16 values are exact in f32
// and are accumulated in f32 (autocast's linear, without rounding its result to bf16); the bias and the epilogue are
// applied in f32, as in the f32 kernel. In f16 the same with f16 in place of bf16 (common/f16.h): f16 products are
// exact in f32 too.
//
// Out rounded (out of inp's dtype, bf16 or f16): the activation kept in the compute dtype, as autocast keeps a
// linear's output: the f32 result above (bias and ReLU included) rounded once to nearest even. With a GELU, as
// autocast runs a bf16 linear and then GELU on its bf16 output: pre (inp's dtype too) = the f32 result with the bias
// rounded once, and out = GELU of pre (computed in f32) rounded once.
struct LinearForward {
  static constexpr const char* kName = "linear_forward";
  TensorRef out, inp, weight, bias, pre;
  Epilogue epilogue = Epilogue::kNone;
  DType dtype() const { return inp.dtype; }
  DType out_dtype() const { return out.defined() ? out.dtype : DType::kF32; }
};
// From dout = dL/d(out of LinearForward): dinp (*,C_in) or absent, dweight (C_out,C_in), dbias (C_out) or absent;
// overwritten, or added to when accumulate. With an epilogue, dpre (*,C_out) is scratch for the gradient before it,
// and the epilogue's backward reads out (ReLU) or pre (GELU); dinp may be dout's memory (dout is consumed first).
//
// In bf16 (inp and weight bf16, as in LinearForward; dout, out, pre, dpre, dinp, dweight and dbias f32): dbias and
// the epilogue's backward are computed in f32 as in the f32 kernel; the gradient before the GEMMs (dout, or dpre
// with an epilogue) is rounded to bf16 into dout_low (*,C_out) bf16, which both GEMMs read: dinp = dout_low @ weight
// and dweight (+)= dout_low^T @ inp, exact products accumulated in f32 (autocast's backward of a bf16 linear).
// In f16 likewise, dout_low f16: a gradient beyond 65504 rounds to infinity there and the GEMMs carry it into
// dinp and dweight, where loss scaling (engine/loss_scaler.h) finds it. dout_low is absent in f32.
// With a ReLU epilogue, out may be the forward's rounded output (in inp's dtype): its sign is the f32 output's
// (a positive f32 below bf16's least subnormal excepted, which rounds to zero: autocast's ReLU sees the same).
// With a GELU epilogue and out rounded, pre is the forward's rounded pre-activation, which GELU's backward reads
// widened.
struct LinearBackward {
  static constexpr const char* kName = "linear_backward";
  TensorRef dinp, dweight, dbias, dpre, dout, inp, weight, out, pre;
  Epilogue epilogue = Epilogue::kNone;
  bool accumulate = false;
  TensorRef dout_low;
  DType dtype() const { return inp.dtype; }
  DType out_dtype() const { return out.defined() ? out.dtype : DType::kF32; }
};
// out = kind(inp), both (n) of any shape.
struct ActivationForward {
  static constexpr const char* kName = "activation_forward";
  Activation kind = Activation::kRelu;
  TensorRef out, inp;
  DType dtype() const { return inp.dtype; }
};
// dinp = dL/d(inp) from dout; reads inp (GELU) or out (the others). All (n).
struct ActivationBackward {
  static constexpr const char* kName = "activation_backward";
  Activation kind = Activation::kRelu;
  TensorRef dinp, dout, inp, out;
  DType dtype() const { return dout.dtype; }
};
// out = inp * mask, mask (n) = 0 or 1/(1-p), drawn from the stream (seed, offset + i) for element i.
struct DropoutForward {
  static constexpr const char* kName = "dropout_forward";
  TensorRef out, mask, inp;
  float p = 0.0f;
  uint64_t seed = 0, offset = 0;
  DType dtype() const { return inp.dtype; }
};
struct DropoutBackward {
  static constexpr const char* kName = "dropout_backward";
  TensorRef dinp, dout, mask;
  DType dtype() const { return dout.dtype; }
};
// loss_sum (f64, one element of device memory) = the sum of the per-sample losses; dlogits (N,C) = grad_scale x
// dL/dlogits; logits (N,C), labels (N) i32 in [0, C) (checked by the caller) or kIgnoreIndex (no loss, a zero
// gradient row). N is every leading extent: (B,T,C) logits with (B,T) labels are B*T samples.
struct CrossEntropy {
  static constexpr const char* kName = "cross_entropy";
  TensorRef loss_sum, dlogits, logits, labels;
  float grad_scale = 1.0f;
  DType dtype() const { return logits.dtype; }
};
// pred, target, dpred (B,D): loss_sum = the sum of the squared errors.
struct MeanSquaredError {
  static constexpr const char* kName = "mse";
  TensorRef loss_sum, dpred, pred, target;
  float grad_scale = 1.0f;
  DType dtype() const { return pred.dtype; }
};
// torch.optim.SGD's step over (n) elements; momentum (n) or absent without momentum.
struct SgdStep {
  static constexpr const char* kName = "sgd_step";
  TensorRef param, momentum, grad;
  SgdHyper hyper{};
  bool first_step = false;
  DType dtype() const { return param.dtype; }
};
// torch.optim.Adam/AdamW's step over (n) elements, `step` counting from 1.
struct AdamStep {
  static constexpr const char* kName = "adam_step";
  TensorRef param, exp_avg, exp_avg_sq, grad;
  AdamHyper hyper{};
  int64_t step = 1;
  DType dtype() const { return param.dtype; }
};
// y += a*x, both (n).
struct Axpy {
  static constexpr const char* kName = "axpy";
  TensorRef y, x;
  float a = 1.0f;
  DType dtype() const { return y.dtype; }
};
// x *= a, (n).
struct Scale {
  static constexpr const char* kName = "scale";
  TensorRef x;
  float a = 1.0f;
  DType dtype() const { return x.dtype; }
};
// dst = src in dst's dtype, both (n): f32 -> bf16 and f32 -> f16 round to nearest even (common/bf16.h,
// common/f16.h; f16 overflows to infinity above 65504), bf16 -> f32 and f16 -> f32 are exact. Its dtype is the
// narrow side's.
struct Convert {
  static constexpr const char* kName = "convert";
  TensorRef dst, src;
  DType dtype() const { return dst.dtype == DType::kF32 ? src.dtype : dst.dtype; }
};
// BatchNorm over x (N,C,L) (kernels/cpu/batchnorm.h): sums (f64, 2C+1) = per-channel Σx, Σx² and the count.
struct BatchNormStats {
  static constexpr const char* kName = "batchnorm_stats";
  TensorRef sums, x;
  DType dtype() const { return x.dtype; }
};
// mean_invstd (f64, 2C) from sums over `count` rows; updates running_mean, running_var (C) and num_batches_tracked
// (i64, 1) with `momentum`.
struct BatchNormMoments {
  static constexpr const char* kName = "batchnorm_moments";
  TensorRef mean_invstd, running_mean, running_var, num_batches_tracked, sums;
  double count = 0.0;
  float eps = 1e-5f, momentum = 0.1f;
  DType dtype() const { return running_mean.dtype; }
};
// out (N,C,L) = epilogue((x - mean) * invstd * weight + bias); weight, bias (C) or absent. ReLU is the epilogue
// a BatchNorm takes, in the same pass.
struct BatchNormApply {
  static constexpr const char* kName = "batchnorm_apply";
  TensorRef out, x, mean_invstd, weight, bias;
  Epilogue epilogue = Epilogue::kNone;
  DType dtype() const { return x.dtype; }
};
// sums (f64, 2C) = per-channel Σdout, Σdout·x̂ over dout, x (N,C,L).
struct BatchNormBackwardReduce {
  static constexpr const char* kName = "batchnorm_backward_reduce";
  TensorRef sums, dout, x, mean_invstd;
  DType dtype() const { return x.dtype; }
};
// dinp (N,C,L) from the local and the global sums (f64, 2C) over `count` rows; dweight, dbias (C) or absent.
struct BatchNormBackwardApply {
  static constexpr const char* kName = "batchnorm_backward_apply";
  TensorRef dinp, dweight, dbias, local, global, dout, x, mean_invstd, weight;
  double count = 0.0;
  bool accumulate = false;
  DType dtype() const { return x.dtype; }
};
// LayerNorm over the last dimension of x (*,D): out (*,D), mean_rstd (f64, 2 x rows), weight, bias (D) or absent.
// Out rounded (out bf16, x f32): the f32 output rounded once, for a LayerNorm whose output only bf16 linear layers
// read (autocast runs layer_norm in f32 and the linear layers round its output: the same bits, without an f32 copy).
struct LayerNormForward {
  static constexpr const char* kName = "layernorm_forward";
  TensorRef out, mean_rstd, x, weight, bias;
  float eps = 1e-5f;
  DType dtype() const { return x.dtype; }
  DType out_dtype() const { return out.defined() ? out.dtype : DType::kF32; }
};
struct LayerNormBackward {
  static constexpr const char* kName = "layernorm_backward";
  TensorRef dinp, dweight, dbias, dout, x, mean_rstd, weight;
  bool accumulate = false;
  DType dtype() const { return x.dtype; }
};
// out (*,E) = weight (V,E)[idx (*)], idx i32.
struct EmbeddingForward {
  static constexpr const char* kName = "embedding_forward";
  TensorRef out, idx, weight;
  DType dtype() const { return weight.dtype; }
};
// dweight (V,E) from dout (*,E) at idx (*); the row padding_idx (>= 0) gets no gradient.
struct EmbeddingBackward {
  static constexpr const char* kName = "embedding_backward";
  TensorRef dweight, dout, idx;
  int64_t padding_idx = -1;
  bool accumulate = false;
  DType dtype() const { return dout.dtype; }
};

// GPT-2's learned positions: out (B,T,C) = inp (B,T,C) + weight (P,C)[t] at position t, T <= P.
struct PositionEmbeddingForward {
  static constexpr const char* kName = "position_embedding_forward";
  TensorRef out, inp, weight;
  DType dtype() const { return inp.dtype; }
};
// dweight (P,C): row t < T = the sum over the batch of dout (B,T,C) at t; rows t >= T zero (overwritten), or all
// rows added to when accumulate.
struct PositionEmbeddingBackward {
  static constexpr const char* kName = "position_embedding_backward";
  TensorRef dweight, dout;
  bool accumulate = false;
  DType dtype() const { return dout.dtype; }
};

// x (n) = value in every element (a gradient made NaN where the reproducible mode found a NaN or an infinity).
struct Fill {
  static constexpr const char* kName = "fill";
  TensorRef x;
  float value = 0.0f;
  DType dtype() const { return x.dtype; }
};

// The reproducible mode's exact sums in int64 fixed point (common/fixed_point.h, engine/reproducible.cpp; on CPU
// kernels/cpu/fixed_point.h): a max exponent per parameter tensor, each micro-chunk's gradient put on the grid it
// gives and summed as integers, the sum turned back to f32 once.
//
// out (i64, 1 element) = an e with |x[i]| < 2^e for every i of x (f32, n): frexp's exponent of the largest magnitude
// (-125 where it is subnormal); kFixedPointAllZero when every value is zero (or n == 0), kFixedPointNotFinite when
// any is a NaN or an infinity.
struct MaxExponent {
  static constexpr const char* kName = "max_exponent";
  TensorRef out, x;
  DType dtype() const { return x.dtype; }
};
// sum (i64, n) (+)= x (f32, n) * 2^scale_exponent rounded to the nearest integer, ties to even: added to sum with
// `accumulate`, written over it without. Each |x[i] * 2^scale_exponent| must be at most 2^kFixedPointBits (the
// caller's grid ensures it), so that the rounding is exact arithmetic on doubles and a function of the value alone.
struct ToGrid {
  static constexpr const char* kName = "to_grid";
  TensorRef sum, x;
  int scale_exponent = 0;
  bool accumulate = false;
  DType dtype() const { return x.dtype; }
};
// out (f32, n) = f32(double(sum[i]) * factor) for sum (i64, n) with |sum[i]| <= 2^kFixedPointBits (which converts to
// double exactly): the product is the one rounding in double and the conversion to f32 the other.
struct FromGrid {
  static constexpr const char* kName = "from_grid";
  TensorRef out, sum;
  double factor = 0.0;
  DType dtype() const { return out.dtype; }
};

}  // namespace call

// One kernel call. The index of an alternative is its Op.
using KernelCall = std::variant<call::LinearForward, call::LinearBackward, call::ActivationForward,
                                call::ActivationBackward, call::DropoutForward, call::DropoutBackward,
                                call::CrossEntropy, call::MeanSquaredError, call::SgdStep, call::AdamStep, call::Axpy,
                                call::Scale, call::Convert, call::BatchNormStats, call::BatchNormMoments,
                                call::BatchNormApply, call::BatchNormBackwardReduce, call::BatchNormBackwardApply,
                                call::LayerNormForward, call::LayerNormBackward, call::EmbeddingForward,
                                call::EmbeddingBackward, call::PositionEmbeddingForward,
                                call::PositionEmbeddingBackward, call::Fill, call::MaxExponent, call::ToGrid,
                                call::FromGrid>;

// A kind of kernel: KernelCall's alternatives, in order.
enum class Op : int32_t {
  kLinearForward,
  kLinearBackward,
  kActivationForward,
  kActivationBackward,
  kDropoutForward,
  kDropoutBackward,
  kCrossEntropy,
  kMeanSquaredError,
  kSgdStep,
  kAdamStep,
  kAxpy,
  kScale,
  kConvert,
  kBatchNormStats,
  kBatchNormMoments,
  kBatchNormApply,
  kBatchNormBackwardReduce,
  kBatchNormBackwardApply,
  kLayerNormForward,
  kLayerNormBackward,
  kEmbeddingForward,
  kEmbeddingBackward,
  kPositionEmbeddingForward,
  kPositionEmbeddingBackward,
  kFill,
  kMaxExponent,
  kToGrid,
  kFromGrid,
};
static_assert(static_cast<size_t>(Op::kFromGrid) + 1 == std::variant_size_v<KernelCall>,
              "one Op per KernelCall alternative, in order");

// "linear_forward", ...: the kName of the call's struct.
const char* op_name(Op op);

// What a backend is asked whether it has: a kernel, the dtype it computes in, and the epilogue it fuses (kNone for
// kernels that take none).
struct KernelKey {
  Op op;
  DType dtype = DType::kF32;
  Epilogue epilogue = Epilogue::kNone;
  // A linear layer's output activation kept in its compute dtype (LinearForward's "out rounded"): `dtype` here,
  // else f32. A backend runs such a call only as one kernel: no composition stands in for it.
  DType out = DType::kF32;
  std::string str() const;  // "linear_forward (f32, gelu epilogue)", "linear_forward (bf16, relu epilogue, bf16 out)"
};
KernelKey key_of(const KernelCall& call);

}  // namespace dpar
