// Layers: forward and backward of one stage of a sequential model, on one replica.
// A Layer object belongs to one replica (clone() makes the others); its parameters are views into the replica's
// flat parameter and gradient buffers, which the reducer and optimizer treat as single arrays.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/stream.h"
#include "common/op_specs.h"
#include "device/device.h"
#include "tensor/tensor.h"

namespace dpar {

class ReplicaSet;  // collectives/replica_set.h

// Faults a test arms on a replica; the numbers are the C ABI's (src/capi/codes.h checks them).
enum class Fault : int32_t { kNone = 0, kAlloc = 1, kForward = 2, kBackward = 3 };

// What a layer may know about the replica that runs it.
struct ReplicaContext {
  size_t replica = 0;
  Device device;
  Stream* stream = nullptr;        // the replica's kernels and ordered copies
  bool training = true;
  uint64_t rng_seed = 0;       // this replica's stream
  uint64_t* rng_offset = nullptr;  // advanced by every draw; persists across steps
  Fault* armed_fault = nullptr;    // one-shot fault injection (tests)
  // The collectives over every replica of every process, for a layer that needs the other replicas (SyncBatchNorm's
  // statistics): the only way a layer reaches them. Null where the layer runs alone (a single replica outside an
  // engine).
  ReplicaSet* collectives = nullptr;

  // Allocates on this replica's device (honouring an armed allocation fault).
  Tensor alloc(DType dtype, const Shape& shape) const;
  // Room for `shape` in `dtype` that a layer needs within one call only (a gradient rounded for its GEMMs): one
  // buffer per replica, shared by all its layers and grown as needed, so it costs the largest such tensor rather
  // than one per layer. What a call writes there is its own until the next call_room on this replica; the replica's
  // stream runs the calls in order, so the next writer comes after the last reader.
  TensorRef call_room(DType dtype, const Shape& shape) const;
  // call_room's memory (copies of the context share it).
  std::shared_ptr<Tensor> call_scratch = std::make_shared<Tensor>();
  // Throws if `fault` is armed, and disarms it.
  void maybe_fail(Fault fault, const char* where) const;
};

enum class InitKind { kZeros, kUniform, kOnes, kNormal };

struct ParamSpec {
  std::string name;  // "weight"
  Shape shape;
  InitKind init = InitKind::kZeros;
  float bound = 0.0f;  // for kUniform: U(-bound, bound); for kNormal: the standard deviation of N(0, bound^2)
  int64_t zero_row = -1;  // >= 0: this row (index along dim 0) is zeroed after the draw (Embedding's padding_idx)
  // A bias or a norm's scale and shift: exempt from weight decay when the engine is asked to exclude them (the
  // parameter group PyTorch users give weight_decay 0), as decay pulling them to 0 only hurts.
  bool no_decay = false;
};

// A layer's state that is not a parameter (BatchNorm's running statistics): never stepped, reduced or gathered;
// each replica holds its own copy, which the engine makes equal to replica 0's after every training step.
struct BufferSpec {
  std::string name;  // "running_mean"
  DType dtype = DType::kF32;  // kF32 or kI64
  Shape shape;
  InitKind init = InitKind::kZeros;  // kZeros or kOnes
};
// A buffer's element count: a shape of no dimensions is a scalar (PyTorch's num_batches_tracked).
inline int64_t buffer_numel(const Shape& shape) { return shape.ndim() == 0 ? 1 : shape.numel(); }

class Layer {
 public:
  virtual ~Layer() = default;
  virtual std::string describe() const = 0;  // "linear(784 -> 256)"
  virtual std::vector<ParamSpec> param_specs() const { return {}; }
  virtual std::vector<BufferSpec> buffer_specs() const { return {}; }
  // The output shape for an input shape; throws Error(INVALID_ARGUMENT) naming what does not fit.
  virtual Shape output_shape(const Shape& in) const = 0;
  virtual std::unique_ptr<Layer> clone() const = 0;
  // The dtype of the input it reads: f32, or i32 for a layer of indices (Embedding). A model whose input an i32
  // layer reads takes i32 input (Model::input_dtype).
  virtual DType input_dtype() const { return DType::kF32; }
  // Throws Error(INVALID_ARGUMENT) naming the first value of a host copy of an input that the layer cannot read
  // (an Embedding's index out of range, with its position); the engine calls it before a step changes anything.
  virtual void check_input_values(const Tensor& /*host_input*/) const {}
  // Throws Error(INVALID_ARGUMENT) where a training-mode forward could not take its statistics over `in`, the
  // shape of the rows they cover: a replica's chunk, or the whole batch of every replica and process for a layer
  // that uses_collectives() (BatchNorm's more than one value per channel). The engine asks every layer before a
  // training-mode call changes anything, so that one replica's refusal cannot leave another's state moved.
  virtual void check_statistics_input(const Shape& /*in*/) const {}
  // The kernels its forward and backward run through the replica's Stream when it takes `epilogue`, in its compute
  // dtype (set_compute_dtype): the model asks the stream for each (Stream::can_run) when a replica is made and when
  // its compute dtype changes, so a device that lacks one is named before any step. Stateful ops (convolution, pooling) are asked for by the layer's first forward.
  virtual std::vector<KernelKey> kernels(Epilogue /*epilogue*/) const { return {}; }
  // Whether forward or backward call the replica set's collectives (ctx.collectives). Every replica must then run
  // the layer on every call, one given no rows of the batch included (with an empty chunk, contributing zeros), so
  // that no collective waits for a replica that skipped it: the engine does so for a model with such a layer.
  virtual bool uses_collectives() const { return false; }

  // ---- Running statistics, deferred (the engine's reproducible mode) --------------------------------------------
  // A layer whose training forward moves its buffers by the batch's statistics (BatchNorm's running mean and
  // variance, and its counter) can defer that: while deferred, a training forward normalises as always but leaves
  // its buffers alone, keeping the batch's statistics (running_statistics_size() doubles) for
  // take_running_statistics(); apply_running_statistics() later moves the buffers by one such batch, as that
  // forward would have. The reproducible mode so folds every micro-chunk's statistics into every replica's buffers
  // in micro-chunk order: the running statistics of micro-batches run one after another, on any device count.
  virtual size_t running_statistics_size() const { return 0; }
  virtual void defer_running_statistics(bool /*defer*/) {}
  // The last deferred training forward's statistics, into `host` (running_statistics_size() doubles).
  virtual void take_running_statistics(const ReplicaContext& /*ctx*/, double* /*host*/) {}
  virtual void apply_running_statistics(const ReplicaContext& /*ctx*/, const double* /*host*/) {}

  // Points the layer at its parameters and gradients: one view per param_specs() entry, of its shape, sharing the
  // replica's storage (so that a layer that hands one out, as a custom layer's callback may through DLPack, keeps
  // the memory alive), and the same as references for the kernel calls.
  void bind(std::vector<Tensor> params, std::vector<Tensor> grads) {
    bound_params_ = std::move(params);
    bound_grads_ = std::move(grads);
    params_.clear();
    grads_.clear();
    for (const Tensor& p : bound_params_) params_.push_back(p.ref());
    for (const Tensor& g : bound_grads_) grads_.push_back(g.ref());
  }

  // Points the layer at its buffers: one view per buffer_specs() entry, in the replica's memory, of its dtype.
  void bind_buffers(std::vector<Tensor> buffers) { buffers_ = std::move(buffers); }
  // Its parameters' memory, one reference per param_specs() slot (bind()'s).
  const std::vector<TensorRef>& param_refs() const { return params_; }

  // ---- Mixed precision ----------------------------------------------------------------------------------------
  // Whether the layer is on autocast's lower-precision list (torch.autocast's ops that run in the autocast dtype:
  // linear, convolutions, scaled_dot_product_attention): under a bf16 (f16) policy its products run on bf16 (f16)
  // operands with f32 accumulation. Every other layer computes in f32 under every policy (autocast's f32 list: norms,
  // softmax, losses; and the ops autocast leaves alone, which here read f32 activations).
  virtual bool autocasts() const { return false; }
  // The dtype its products compute in from the next forward on (f32, bf16 or f16): set by the model on layers that
  // autocast, with bind_low_precision. A layer that made ops for the previous dtype makes new ones.
  virtual void set_compute_dtype(DType dtype) { compute_dtype_ = dtype; }
  DType compute_dtype() const { return compute_dtype_; }
  // Points the layer at the step's copies of its parameters in the compute dtype (one per param_specs() slot, of
  // its shape): views of the replica's low-precision mirror of the flat parameters, rewritten at the first forward
  // after the parameters change (ReplicaModel::params_for_writing).
  void bind_low_precision(std::vector<TensorRef> params) { low_params_ = std::move(params); }
  // Activations kept in the compute dtype, as autocast keeps a bf16 linear's output for the next linear's backward.
  // The model stores a node's output in the compute dtype (half the bytes, and no f32 copy beside it) where the
  // producer can write it so and every consumer reads it only rounded: then the consumer's input arrives already
  // rounded, the same bits it would have rounded itself.
  //  - Whether the layer's products read its one input only in the compute dtype (forward and backward both), on
  //    `stream` (attention computes in bf16 only where the backend has a bf16 attention).
  virtual bool reads_rounded_input(const Stream& /*stream*/) const { return false; }
  //  - The kernels with which the layer, with `epilogue`, writes its output in `dtype` (the model's compute dtype:
  //    the f32 result, epilogue included, rounded once) and runs its backward on that rounded output; empty where
  //    it cannot. A layer that computes in f32 itself (LayerNorm) may still write its output rounded.
  virtual std::vector<KernelKey> rounded_output_kernels(Epilogue /*epilogue*/, DType /*dtype*/) const { return {}; }

  // ---- Layers of several inputs (attention reads q, k and v) --------------------------------------------------
  // The node's inputs, in order, are the layer's; a layer of one input needs none of these. The graph calls them
  // for every layer; their defaults are the one-input methods.
  virtual size_t num_inputs() const { return 1; }
  virtual Shape output_shape_of(const std::vector<Shape>& in) const { return output_shape(in[0]); }
  virtual void forward_inputs(const ReplicaContext& ctx, const std::vector<Tensor>& in, const Tensor& out) {
    forward(ctx, in[0], out);
  }
  // din: one per input, each defined (the graph gives scratch where it needs no gradient), overwritten.
  virtual void backward_inputs(const ReplicaContext& ctx, const std::vector<Tensor>& in, const Tensor& out,
                               const Tensor& dout, const std::vector<Tensor>& din, bool accumulate) {
    backward(ctx, in[0], out, dout, din[0], accumulate);
  }

  // in (B, ...) -> out (B, ...), with out preallocated to output_shape(in).
  virtual void forward(const ReplicaContext& ctx, const Tensor& in, const Tensor& out) = 0;
  // Given dout, writes din (when din is defined) and the parameter gradients: overwriting them when
  // accumulate is false, adding to them when true. in/out are the tensors of the matching forward.
  virtual void backward(const ReplicaContext& ctx, const Tensor& in, const Tensor& out, const Tensor& dout,
                        const Tensor& din, bool accumulate) = 0;

  // ---- Fusion: an activation as the epilogue of the layer before it --------------------------------------------
  // The model's one fusion pass (ReplicaModel) runs an activation node inside the layer before it when that
  // layer's output feeds nothing else and the layer takes the activation as an epilogue: the layer then writes the
  // activation's output itself (its own output is never written) and its backward starts from the activation's
  // gradient. GEMM + bias + ReLU (one pass after the GEMM), a convolution and its ReLU (the op's epilogue) and
  // BatchNorm + ReLU all go through it.
  //
  // The epilogue this layer is when it follows another (a ReLU: Epilogue::kRelu), or Epilogue::kNone.
  virtual Epilogue as_epilogue() const { return Epilogue::kNone; }
  // Whether this layer can apply `epilogue` to its own output (forward_with_epilogue).
  virtual bool takes_epilogue(Epilogue /*epilogue*/) const { return false; }
  // in (B, ...) -> out (B, ...) = epilogue(this(in)).
  virtual void forward_with_epilogue(const ReplicaContext& ctx, Epilogue epilogue, const Tensor& in,
                                     const Tensor& out);
  // Given dout = dL/d(out) and out of forward_with_epilogue, writes din (when defined) and this layer's parameter
  // gradients as the epilogue's backward and then this layer's would; mid is scratch of this layer's output shape
  // (for the gradient before the epilogue). din may be dout's memory (dout is consumed first).
  virtual void backward_with_epilogue(const ReplicaContext& ctx, Epilogue epilogue, const Tensor& in,
                                      const Tensor& out, const Tensor& dout, const Tensor& mid, const Tensor& din,
                                      bool accumulate);

 protected:
  std::vector<Tensor> bound_params_, bound_grads_;  // the views given to bind()
  std::vector<TensorRef> params_, grads_;           // their memory
  // Parameter i's reference, or an absent one when `present` is false (an optional bias).
  TensorRef param(size_t i, bool present = true) const { return present ? params_[i] : TensorRef{}; }
  TensorRef grad(size_t i, bool present = true) const { return present ? grads_[i] : TensorRef{}; }
  // Parameter i as the layer's products read it: the f32 master in f32, the step's low-precision copy otherwise.
  TensorRef operand_param(size_t i) const { return compute_dtype_ == DType::kF32 ? params_[i] : low_params_[i]; }
  DType compute_dtype_ = DType::kF32;
  std::vector<TensorRef> low_params_;  // bind_low_precision()'s
  std::vector<Tensor> buffers_;                     // the views given to bind_buffers()
};

// A layer's buffer for the low-precision copy of a tensor its products read and its backward reads again (its
// input), grown as needed and reused across steps.
class LowPrecisionBuffer {
 public:
  // `x` rounded to `dtype` (call::Convert: to nearest, ties to even) into this buffer, shaped as x; x itself when
  // dtype is f32 or x is already of `dtype` (an activation kept in the compute dtype: nothing is copied).
  Tensor round(const ReplicaContext& ctx, DType dtype, const Tensor& x);
  // What the last round() returned for x, for backward (x itself when dtype is f32); `who` names the layer in the
  // internal error of a backward that did not follow its forward.
  Tensor rounded(DType dtype, const Tensor& x, const std::string& who) const;
 private:
  Tensor memory_, last_;
};

std::unique_ptr<Layer> make_linear(int64_t in_features, int64_t out_features, bool bias);
std::unique_ptr<Layer> make_activation(Activation activation);
std::unique_ptr<Layer> make_dropout(float p);
// nn.Conv2d: (N, C_in, H, W) -> (N, C_out, OH, OW); parameters "weight" (C_out, C_in/groups, kh, kw) and "bias"
// (C_out). Throws Error(INVALID_ARGUMENT) naming the first value that does not fit. (nn/conv_layers.cpp)
std::unique_ptr<Layer> make_conv2d(const Conv2dSpec& spec);
// nn.MaxPool2d / nn.AvgPool2d (ceil_mode=False, count_include_pad=True): spec.kind, kernel, stride, padding.
std::unique_ptr<Layer> make_pool2d(const Pool2dSpec& spec);
// nn.AdaptiveAvgPool2d((output_h, output_w)): (1, 1) only; any other size throws Error(NOT_SUPPORTED).
std::unique_ptr<Layer> make_adaptive_avg_pool2d(int64_t output_h, int64_t output_w);
// BatchNorm over dim 1 (channels) of (B,C), (B,C,L) (`dims` 1: BatchNorm1d), (B,C,H,W) (`dims` 2: BatchNorm2d),
// or any of them (`dims` 0: SyncBatchNorm, whose statistics are summed over every replica of every process).
std::unique_ptr<Layer> make_batchnorm(int dims, int64_t num_features, float eps, float momentum, bool affine);
// nn.LayerNorm((normalized_size,), eps, elementwise_affine): over the last dim of (B, ..., D). (nn/norm_embedding.cpp)
std::unique_ptr<Layer> make_layernorm(int64_t normalized_size, float eps, bool elementwise_affine);
// nn.Embedding(num_embeddings, embedding_dim, padding_idx): i32 indices (B) or (B, T) -> (B, E) or (B, T, E).
// padding_idx: -1 for none, else a row in [0, num_embeddings) that starts at zero and never gets a gradient.
std::unique_ptr<Layer> make_embedding(int64_t num_embeddings, int64_t embedding_dim, int64_t padding_idx = -1);
// The same with padding_idx as nn.Embedding takes it: in [-num_embeddings, num_embeddings), a negative index
// counting from the end.
std::unique_ptr<Layer> make_embedding_padded(int64_t num_embeddings, int64_t embedding_dim, int64_t padding_idx);
// GPT-2's learned position embedding (nanoGPT's wpe, added to its input): (B, T, C) -> (B, T, C) + weight[t] at
// position t, weight (max_positions, C) drawn from N(0, 1) as nn.Embedding's; T > max_positions is refused.
// (nn/attention.cpp)
std::unique_ptr<Layer> make_position_embedding(int64_t max_positions, int64_t embedding_dim);
// F.scaled_dot_product_attention over `spec.heads` heads, reading (B, L, C) q, k and v (num_inputs 3, k and v of
// length S) or one packed (B, T, 3C) projection read as [q | k | v] along its last dimension (num_inputs 1, nanoGPT's
// c_attn(x).split(C, dim=2)), without copies: heads and the split are strides of the op's views. Output (B, L, C),
// heads merged. Attention dropout with probability dropout_p in training mode. (nn/attention.cpp)
std::unique_ptr<Layer> make_attention(const AttentionSpec& spec, float dropout_p, size_t num_inputs);
// nn.MultiheadAttention(embed_dim, spec.heads, dropout_p, bias, batch_first=True) as self-attention on (B, T, E),
// causal with spec.causal: parameters in_proj_weight (3E, E), in_proj_bias (3E), out_proj.weight (E, E),
// out_proj.bias (E), initialised as that module's. (nn/attention.cpp)
std::unique_ptr<Layer> make_multihead_attention(int64_t embed_dim, const AttentionSpec& spec, float dropout_p,
                                                bool bias);
// The SyncBatchNorm twin of a BatchNorm layer (same parameters and buffers), or null for any other layer.
std::unique_ptr<Layer> to_sync_batchnorm(const Layer& layer);

}  // namespace dpar
