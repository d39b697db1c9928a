// What a replica holds between forward and backward, measured by the device's byte count (tensor.h's memory_stats):
// a layer that runs as another's epilogue input keeps no output buffer, and under a bf16 policy the activations
// that only linear layers read are kept in bf16 (autocast keeps a bf16 linear's output so), with the gradient
// rounded for the GEMMs in one buffer per replica instead of one per layer.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "engine_test_util.h"
#include "kernels/cpu/gemm.h"
#include "nn/model.h"

namespace dpar {
namespace {

using test::Standalone;

constexpr int64_t kIn = 784, kHidden = 512, kOut = 10, kRows = 64;

// The demo MLP: linear, ReLU, linear, ReLU, linear. Each ReLU runs as its linear layer's epilogue.
Model mlp() {
  Model m(3);
  m.add(make_linear(kIn, kHidden, true));
  m.add(make_activation(Activation::kRelu));
  m.add(make_linear(kHidden, kHidden, true));
  m.add(make_activation(Activation::kRelu));
  m.add(make_linear(kHidden, kOut, true));
  return m;
}

struct Held {
  int64_t step;    // bytes allocated by the first forward and backward and still held after them (the plan)
  int64_t peak;    // the most held at once during them, above what was held before
};

// A transformer's MLP as nanoGPT's: linear, GELU (the linear layer's epilogue), linear.
Model gelu_mlp() {
  Model m(4);
  m.add(make_linear(kIn, kHidden, true));
  m.add(make_activation(Activation::kGelu));
  m.add(make_linear(kHidden, kOut, true));
  return m;
}

// A transformer block's MLP half as nanoGPT's, without the residual: LayerNorm, then the GELU MLP.
Model normed_gelu_mlp() {
  Model m(5);
  m.add(make_layernorm(kIn, 1e-5f, true));
  m.add(make_linear(kIn, kHidden, true));
  m.add(make_activation(Activation::kGelu));
  m.add(make_linear(kHidden, kOut, true));
  return m;
}

// Self-attention as nanoGPT's, without the residual: the packed q|k|v projection, causal attention over its heads,
// the output projection; on (kSeqs, kT, kC).
constexpr int64_t kSeqs = 4, kT = 16, kC = 32;
Model attention_block() {
  Model m(6);
  m.add(make_linear(kC, 3 * kC, true));
  AttentionSpec spec;
  spec.heads = 4;
  spec.causal = true;
  m.add(make_attention(spec, 0.0f, 1));
  m.add(make_linear(kC, kC, true));
  return m;
}

// One forward and backward of a fresh replica of `model` in `dtype`: what they allocate and keep.
Held forward_backward(DType dtype, size_t* rounded, const Model& model = mlp(), const Shape& in = Shape{kRows, kIn}) {
  Standalone s;
  ReplicaModel rm(model, s.ctx);
  rm.set_compute_dtype(s.ctx, dtype);
  *rounded = rm.num_rounded_outputs();
  std::vector<float> x(static_cast<size_t>(in.numel()), 0.25f);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 0.25f + 0.01f * static_cast<float>(i % 7);
  const Tensor input = Tensor::wrap(x.data(), DType::kF32, in, s.ctx.device);
  const MemoryStats before = memory_stats(s.ctx.device);
  reset_peak_memory(s.ctx.device);
  rm.forward(s.ctx, input);
  const Tensor dout = rm.output_grad_buffer(s.ctx);
  std::vector<float> ones(static_cast<size_t>(dout.numel()), 1.0f);
  dout.copy_from_host(ones.data());
  rm.backward(s.ctx, dout, false);
  const MemoryStats after = memory_stats(s.ctx.device);
  return {after.allocated - before.allocated, after.peak - before.allocated};
}

TEST(ActivationMemory, Bf16KeepsLinearOnlyActivationsInBf16) {
  const char* why = "";
  if (!kernels::cpu::bf16_support(&why)) GTEST_SKIP() << "no bf16 here: " << why;
  size_t rounded_f32 = 0, rounded_bf16 = 0;
  const Held f32 = forward_backward(DType::kF32, &rounded_f32);
  const Held bf16 = forward_backward(DType::kBF16, &rounded_bf16);
  // The two hidden activations (each ReLU's output, read by a linear layer alone); the logits stay f32 for the loss.
  EXPECT_EQ(rounded_f32, 0u);
  EXPECT_EQ(rounded_bf16, 2u);
  // What bf16 adds and saves against f32, everything else (the gradient plan, the output) alike: the input rounded
  // and kept for the first layer's weight gradient, the rounded gradient's one buffer (the widest layer's), and
  // half of each hidden activation's bytes.
  const int64_t input_copy = kRows * kIn * 2, gradient_room = kRows * kHidden * 2;
  const int64_t hidden_saved = 2 * kRows * kHidden * 2;
  EXPECT_EQ(bf16.step - f32.step, input_copy + gradient_room - hidden_saved)
      << "f32 " << f32.step << " B, bf16 " << bf16.step << " B";
  // Without this plan bf16 kept every output in f32 (the fused layers' unwritten ones too), a bf16 copy of each
  // linear layer's input and a rounded-gradient buffer per layer: that much more than f32 held then.
  const int64_t unfused_outputs = 2 * kRows * kHidden * 4;
  const int64_t before = f32.step + unfused_outputs + input_copy + 2 * kRows * kHidden * 2 +
                         (2 * kRows * kHidden + kRows * kOut) * 2;
  std::printf("activation memory per replica, MLP %lld-%lld-%lld-%lld at %lld rows: f32 %lld B (was %lld B), bf16 %lld B "
              "(was %lld B); peak above the parameters: f32 %lld B, bf16 %lld B\n",
              static_cast<long long>(kIn), static_cast<long long>(kHidden), static_cast<long long>(kHidden),
              static_cast<long long>(kOut), static_cast<long long>(kRows), static_cast<long long>(f32.step),
              static_cast<long long>(f32.step + unfused_outputs), static_cast<long long>(bf16.step),
              static_cast<long long>(before), static_cast<long long>(f32.peak), static_cast<long long>(bf16.peak));
  EXPECT_LT(bf16.step, before);
}

// Under bf16 a GELU after a linear layer keeps its input (the linear's output, the pre-activation its backward
// reads) and its output in bf16, as autocast keeps them: half the bytes of each, and the next linear layer reads the
// output without a copy of its own.
TEST(ActivationMemory, Bf16KeepsTheGeluMlpsHiddenActivationsInBf16) {
  const char* why = "";
  if (!kernels::cpu::bf16_support(&why)) GTEST_SKIP() << "no bf16 here: " << why;
  size_t rounded_f32 = 0, rounded_bf16 = 0;
  const Held f32 = forward_backward(DType::kF32, &rounded_f32, gelu_mlp());
  const Held bf16 = forward_backward(DType::kBF16, &rounded_bf16, gelu_mlp());
  EXPECT_EQ(rounded_f32, 0u);
  EXPECT_EQ(rounded_bf16, 1u);
  const int64_t input_copy = kRows * kIn * 2, gradient_room = kRows * kHidden * 2;
  const int64_t output_saved = kRows * kHidden * 2, pre_activation_saved = kRows * kHidden * 2;
  EXPECT_EQ(bf16.step - f32.step, input_copy + gradient_room - output_saved - pre_activation_saved)
      << "f32 " << f32.step << " B, bf16 " << bf16.step << " B";
  // Before, bf16 kept both in f32 and a bf16 copy of the GELU's output for the second layer.
  const int64_t before = f32.step + input_copy + gradient_room + kRows * kHidden * 2;
  std::printf("activation memory per replica, GELU MLP %lld-%lld-%lld at %lld rows: f32 %lld B, bf16 %lld B "
              "(was %lld B)\n",
              static_cast<long long>(kIn), static_cast<long long>(kHidden), static_cast<long long>(kOut),
              static_cast<long long>(kRows), static_cast<long long>(f32.step), static_cast<long long>(bf16.step),
              static_cast<long long>(before));
}

// A LayerNorm read only by a linear layer writes its output in bf16 (computed in f32, rounded once, as the linear
// layer would round it): the f32 output and the linear layer's bf16 copy of it give way to one bf16 buffer.
TEST(ActivationMemory, Bf16KeepsALayerNormsOutputInBf16WhereOnlyALinearLayerReadsIt) {
  const char* why = "";
  if (!kernels::cpu::bf16_support(&why)) GTEST_SKIP() << "no bf16 here: " << why;
  size_t rounded_f32 = 0, rounded_bf16 = 0;
  const Held f32 = forward_backward(DType::kF32, &rounded_f32, normed_gelu_mlp());
  const Held bf16 = forward_backward(DType::kBF16, &rounded_bf16, normed_gelu_mlp());
  EXPECT_EQ(rounded_f32, 0u);
  EXPECT_EQ(rounded_bf16, 2u);  // the LayerNorm's output and the GELU's
  // Against f32: the rounded gradient's buffer added; half of the LayerNorm's output, of the pre-activation and of
  // the GELU's output saved; no input copy for the first linear layer (its input arrives rounded).
  const int64_t gradient_room = kRows * kHidden * 2;
  const int64_t saved = kRows * kIn * 2 + 2 * kRows * kHidden * 2;
  EXPECT_EQ(bf16.step - f32.step, gradient_room - saved) << "f32 " << f32.step << " B, bf16 " << bf16.step << " B";
  EXPECT_LT(bf16.step, f32.step);
  std::printf("activation memory per replica, LayerNorm + GELU MLP %lld-%lld-%lld at %lld rows: f32 %lld B, bf16 "
              "%lld B\n",
              static_cast<long long>(kIn), static_cast<long long>(kHidden), static_cast<long long>(kOut),
              static_cast<long long>(kRows), static_cast<long long>(f32.step), static_cast<long long>(bf16.step));
}

// Under bf16 attention reads q, k and v rounded and keeps them so for backward; the projection that writes the
// packed q|k|v, which attention alone reads, writes it in bf16: one bf16 buffer where f32 kept the f32 projection
// (and a bf16 copy beside it, had attention rounded its input itself).
TEST(ActivationMemory, Bf16KeepsThePackedProjectionThatAttentionReadsInBf16) {
  const char* why = "";
  if (!kernels::cpu::bf16_support(&why)) GTEST_SKIP() << "no bf16 here: " << why;
  size_t rounded_f32 = 0, rounded_bf16 = 0;
  const Shape in{kSeqs, kT, kC};
  const Held f32 = forward_backward(DType::kF32, &rounded_f32, attention_block(), in);
  const Held bf16 = forward_backward(DType::kBF16, &rounded_bf16, attention_block(), in);
  EXPECT_EQ(rounded_f32, 0u);
  EXPECT_EQ(rounded_bf16, 1u);  // the packed projection
  // Against f32: half of the projection's bytes saved; the two linear layers' inputs rounded and kept (the model's
  // input and attention's f32 output); the rounded gradient's one buffer (the widest, the projection's).
  const int64_t tokens = kSeqs * kT;
  const int64_t projection_saved = tokens * 3 * kC * 2, input_copies = 2 * tokens * kC * 2;
  const int64_t gradient_room = tokens * 3 * kC * 2;
  EXPECT_EQ(bf16.step - f32.step, input_copies + gradient_room - projection_saved)
      << "f32 " << f32.step << " B, bf16 " << bf16.step << " B";
}

TEST(ActivationMemory, FusedLayersKeepNoOutputOfTheirOwn) {
  // In f32: the two linear layers whose ReLU is their epilogue write only the ReLU's output; the plan holds the
  // three written outputs and the gradient buffers, no more.
  Standalone s;
  const Model model = mlp();
  ReplicaModel rm(model, s.ctx);
  EXPECT_EQ(rm.num_fused(), 2u);
  std::vector<float> x(static_cast<size_t>(kRows * kIn), 0.5f);
  const Tensor input = Tensor::wrap(x.data(), DType::kF32, Shape{kRows, kIn}, s.ctx.device);
  const MemoryStats before = memory_stats(s.ctx.device);
  rm.forward(s.ctx, input);
  const int64_t outputs = (2 * kRows * kHidden + kRows * kOut) * 4;
  int64_t grads = 0;
  // The gradient buffers: whatever the liveness plan chose, each at most the widest row.
  grads = memory_stats(s.ctx.device).allocated - before.allocated - outputs;
  EXPECT_GE(grads, 0);
  EXPECT_LE(grads, static_cast<int64_t>(rm.num_grad_buffers()) * kRows * kHidden * 4);
}

TEST(ActivationMemory, CountsEveryDeviceApartAndReturnsToZero) {
  const Device a{DeviceKind::kCpu, 5}, b{DeviceKind::kCpu, 6};
  const int64_t a0 = memory_stats(a).allocated, b0 = memory_stats(b).allocated;
  {
    const Tensor t = Tensor::empty(DType::kF32, Shape{1000}, a);
    EXPECT_EQ(memory_stats(a).allocated - a0, 4000);
    EXPECT_EQ(memory_stats(b).allocated - b0, 0);
    EXPECT_GE(memory_stats(a).peak, memory_stats(a).allocated);
    float host[4] = {};
    const Tensor borrowed = Tensor::wrap(host, DType::kF32, Shape{4}, a);  // the caller's memory: not counted
    EXPECT_EQ(memory_stats(a).allocated - a0, 4000);
  }
  EXPECT_EQ(memory_stats(a).allocated, a0);
  reset_peak_memory(a);
  EXPECT_EQ(memory_stats(a).peak, a0);
}

}  // namespace
}  // namespace dpar
