// A sequential model. Model is the host-side template a caller builds; ReplicaModel is one device's copy, with
// all parameters in one flat buffer and all gradients in another, so that communication and the optimizer see
// one array each.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/random.h"
#include "nn/layer.h"

namespace dpar {

struct ParamInfo {
  std::string name;  // "0.weight", as PyTorch's state_dict names it
  Shape shape;
  int64_t offset = 0;  // in the flat buffer, in elements
  size_t layer = 0;
};

struct BufferInfo {
  std::string name;  // "1.running_mean", as PyTorch's state_dict names it
  BufferDType dtype = BufferDType::kF32;
  Shape shape;
  int64_t offset = 0;  // in the model's flat buffer of its dtype, in elements
  size_t layer = 0;
};

class Model {
 public:
  explicit Model(uint64_t seed) : init_rng_(seed) {}
  Model(const Model& other);

  // Appends a layer and draws its initial parameters from the model's seeded stream.
  void add(std::unique_ptr<Layer> layer);

  size_t num_layers() const { return layers_.size(); }
  const Layer& layer(size_t i) const { return *layers_[i]; }
  const std::vector<ParamInfo>& params() const { return params_; }
  int64_t num_param_elements() const { return static_cast<int64_t>(values_.size()); }
  const std::vector<float>& values() const { return values_; }
  std::vector<float>& values() { return values_; }
  // Buffers (Layer::buffer_specs), kept apart from the parameters: f32 ones in one flat array, i64 ones in another.
  const std::vector<BufferInfo>& buffers() const { return buffers_; }
  const std::vector<float>& buffer_f32() const { return buffer_f32_; }
  std::vector<float>& buffer_f32() { return buffer_f32_; }
  const std::vector<int64_t>& buffer_i64() const { return buffer_i64_; }
  std::vector<int64_t>& buffer_i64() { return buffer_i64_; }
  // Replaces every BatchNorm layer with its SyncBatchNorm twin (to_sync_batchnorm), parameters and buffers kept.
  void convert_sync_batchnorm();
  // Shapes through the whole model; throws naming the first layer that rejects its input.
  Shape output_shape(const Shape& input) const;
  // Whether a layer calls the replica set's collectives (Layer::uses_collectives): then every replica runs forward
  // and backward on every call, a replica given no rows of the batch included.
  bool uses_collectives() const;

 private:
  std::vector<std::unique_ptr<Layer>> layers_;
  std::vector<ParamInfo> params_;
  std::vector<float> values_;  // flat, in params_ order
  std::vector<BufferInfo> buffers_;
  std::vector<float> buffer_f32_;      // flat, the f32 buffers in buffers_ order
  std::vector<int64_t> buffer_i64_;    // flat, the i64 buffers in buffers_ order
  Rng init_rng_;
};

class ReplicaModel {
 public:
  // The parameter buffer holds at least `param_capacity` elements (the engine pads it so that every worker's
  // optimizer shard has the same size); the elements past the model's are zero.
  ReplicaModel(const Model& model, const ReplicaContext& ctx, int64_t param_capacity = 0);

  int64_t num_params() const { return params_.numel(); }
  float* params() const { return params_.f32(); }
  float* grads() const { return grads_.f32(); }
  // The buffers' memory on the device: every f32 buffer in one array, every i64 buffer in another (stored as i32
  // pairs); BufferInfo::offset places each. Null where the model has none of that dtype.
  float* buffer_f32() const { return buf_f32_.defined() ? buf_f32_.f32() : nullptr; }
  int64_t* buffer_i64() const { return buf_i64_.defined() ? reinterpret_cast<int64_t*>(buf_i64_.i32()) : nullptr; }
  int64_t num_buffer_f32() const { return n_buf_f32_; }
  int64_t num_buffer_i64() const { return n_buf_i64_; }

  // Runs every layer; keeps each layer's output for backward. Returns a view of the last output.
  Tensor forward(const ReplicaContext& ctx, const Tensor& input);
  // Backward from dL/d(output) of the last forward. Overwrites or adds to the gradients (see Layer::backward).
  // layer_done(i), if given, runs as soon as layer i's gradients are final (layers go last to first): the reducer
  // starts communicating them while the earlier layers compute.
  void backward(const ReplicaContext& ctx, const Tensor& grad_output, bool accumulate,
                const std::function<void(size_t layer)>& layer_done = nullptr);
  bool has_forward_state() const { return has_forward_; }
  void clear_forward_state() { has_forward_ = false; }
  // dL/d(output) buffer of the right size for the last forward, for a loss to write into.
  Tensor output_grad_buffer(const ReplicaContext& ctx);

 private:
  // Makes sure activation buffers hold `rows` rows; grows, never shrinks.
  void reserve(const ReplicaContext& ctx, const Shape& input);

  std::vector<std::unique_ptr<Layer>> layers_;
  std::vector<bool> fused_with_next_;  // layer i computes layer i + 1 with its own (Layer::fuses_with)
  Tensor params_, grads_;
  Tensor buf_f32_, buf_i64_;
  int64_t n_buf_f32_ = 0, n_buf_i64_ = 0;
  std::vector<Shape> row_shapes_;     // per layer output, for one row: shapes with rows = 1
  std::vector<Tensor> outputs_;       // per layer output, capacity rows
  Tensor grad_a_, grad_b_;            // ping-pong buffers for dL/d(activation)
  int64_t capacity_rows_ = 0;
  Tensor input_;                      // the last forward's input (a view; the caller keeps it alive for backward)
  int64_t forward_rows_ = 0;          // rows of the last forward (0 for a replica given no rows)
  bool has_forward_ = false;          // the last forward's state is kept for a backward
};

}  // namespace dpar
