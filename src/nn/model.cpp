#include "nn/model.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"

namespace dpar {

Model::Model(const Model& other)
    : params_(other.params_),
      values_(other.values_),
      buffers_(other.buffers_),
      buffer_f32_(other.buffer_f32_),
      buffer_i64_(other.buffer_i64_),
      init_rng_(other.init_rng_) {
  for (const auto& l : other.layers_) layers_.push_back(l->clone());
}

void Model::add(std::unique_ptr<Layer> layer) {
  const size_t index = layers_.size();
  for (const ParamSpec& spec : layer->param_specs()) {
    ParamInfo info{std::to_string(index) + "." + spec.name, spec.shape, static_cast<int64_t>(values_.size()), index};
    const int64_t n = spec.shape.numel();
    values_.reserve(values_.size() + static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      float v = 0.0f;
      if (spec.init == InitKind::kUniform) v = init_rng_.uniform(-spec.bound, spec.bound);
      if (spec.init == InitKind::kOnes) v = 1.0f;
      if (spec.init == InitKind::kNormal) {
        // Box-Muller from two draws of the model's stream; 1 - u keeps the logarithm's argument in (0, 1].
        const double u1 = 1.0 - init_rng_.uniform(), u2 = init_rng_.uniform();
        v = static_cast<float>(spec.bound * std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
      }
      values_.push_back(v);
    }
    params_.push_back(std::move(info));
  }
  for (const BufferSpec& spec : layer->buffer_specs()) {
    const bool f32 = spec.dtype == BufferDType::kF32;
    const int64_t offset = static_cast<int64_t>(f32 ? buffer_f32_.size() : buffer_i64_.size());
    buffers_.push_back({std::to_string(index) + "." + spec.name, spec.dtype, spec.shape, offset, index});
    const int64_t v = spec.init == InitKind::kOnes ? 1 : 0;
    for (int64_t i = 0; i < buffer_numel(spec.shape); ++i) {
      if (f32)
        buffer_f32_.push_back(static_cast<float>(v));
      else
        buffer_i64_.push_back(v);
    }
  }
  layers_.push_back(std::move(layer));
}

void Model::convert_sync_batchnorm() {
  for (auto& layer : layers_)
    if (auto sync = to_sync_batchnorm(*layer)) layer = std::move(sync);
}

Shape Model::output_shape(const Shape& input) const {
  Shape s = input;
  for (size_t i = 0; i < layers_.size(); ++i) {
    try {
      s = layers_[i]->output_shape(s);
    } catch (const Error& e) {
      fail(e.status(), "layer ", i, " (", layers_[i]->describe(), "): ", e.what());
    }
  }
  return s;
}

bool Model::uses_collectives() const {
  for (const auto& layer : layers_)
    if (layer->uses_collectives()) return true;
  return false;
}

ReplicaModel::ReplicaModel(const Model& model, const ReplicaContext& ctx, int64_t param_capacity) {
  const int64_t n = std::max<int64_t>({model.num_param_elements(), param_capacity, 1});
  params_ = ctx.alloc(DType::kF32, Shape{n});
  grads_ = ctx.alloc(DType::kF32, Shape{n});
  ctx.stream->fill_zero(params_.raw(), params_.bytes());
  ctx.stream->fill_zero(grads_.raw(), grads_.bytes());
  ctx.stream->copy_from_host(params_.f32(), model.values().data(), model.values().size() * sizeof(float));
  for (size_t i = 0; i < model.num_layers(); ++i) layers_.push_back(model.layer(i).clone());
  for (size_t i = 0; i < layers_.size(); ++i) {
    std::vector<Tensor> p, g;
    for (const ParamInfo& info : model.params())
      if (info.layer == i) {
        p.push_back(params_.rows(info.offset, info.shape.numel()).reshaped(info.shape));
        g.push_back(grads_.rows(info.offset, info.shape.numel()).reshaped(info.shape));
      }
    layers_[i]->bind(std::move(p), std::move(g));
  }
  // Buffers: this replica's own copy, from the model's values.
  n_buf_f32_ = static_cast<int64_t>(model.buffer_f32().size());
  n_buf_i64_ = static_cast<int64_t>(model.buffer_i64().size());
  if (n_buf_f32_ > 0) {
    buf_f32_ = ctx.alloc(DType::kF32, Shape{n_buf_f32_});
    ctx.stream->copy_from_host(buf_f32_.raw(), model.buffer_f32().data(), buf_f32_.bytes());
  }
  if (n_buf_i64_ > 0) {
    buf_i64_ = ctx.alloc(DType::kI32, Shape{2 * n_buf_i64_});
    ctx.stream->copy_from_host(buf_i64_.raw(), model.buffer_i64().data(), buf_i64_.bytes());
  }
  for (size_t i = 0; i < layers_.size(); ++i) {
    std::vector<Tensor> b;
    for (const BufferInfo& info : model.buffers())
      if (info.layer == i) {
        if (info.dtype == BufferDType::kF32)
          b.push_back(buf_f32_.rows(info.offset, buffer_numel(info.shape)));
        else
          b.push_back(buf_i64_.rows(2 * info.offset, 2 * buffer_numel(info.shape)));
      }
    layers_[i]->bind_buffers(std::move(b));
  }
  for (size_t i = 0; i + 1 < layers_.size(); ++i) {
    // A layer fused with the one before it is not fused with the one after it: pairs do not chain.
    fused_with_next_.push_back((i == 0 || !fused_with_next_[i - 1]) && layers_[i]->fuses_with(*layers_[i + 1]));
  }
  fused_with_next_.push_back(false);
}

void ReplicaModel::reserve(const ReplicaContext& ctx, const Shape& input) {
  const int64_t rows = input[0];
  // Per-row shapes of every output; recomputed per call because a later input may have another row shape.
  std::vector<Shape> shapes;
  Shape s = input.with_rows(1);
  for (auto& layer : layers_) {
    s = layer->output_shape(s);
    shapes.push_back(s);
  }
  if (rows <= capacity_rows_ && shapes == row_shapes_) return;
  const int64_t cap = std::max(rows, capacity_rows_);
  outputs_.clear();
  int64_t widest = input.row_numel();
  for (const Shape& row : shapes) {
    outputs_.push_back(ctx.alloc(DType::kF32, row.with_rows(cap)));
    widest = std::max(widest, row.row_numel());
  }
  grad_a_ = ctx.alloc(DType::kF32, Shape{cap * widest});
  grad_b_ = ctx.alloc(DType::kF32, Shape{cap * widest});
  row_shapes_ = std::move(shapes);
  capacity_rows_ = cap;
}

Tensor ReplicaModel::forward(const ReplicaContext& ctx, const Tensor& input) {
  has_forward_ = false;
  reserve(ctx, input.shape());
  ctx.maybe_fail(Fault::kForward, "forward");
  const int64_t rows = input.rows();
  input_ = input;
  Tensor x = input;
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (fused_with_next_[i]) {  // layer i and i + 1 at once; layer i's own output is not written
      Tensor y = outputs_[i + 1].rows(0, rows);
      layers_[i]->forward_with_next(ctx, x, y);
      x = y;
      ++i;
      continue;
    }
    Tensor y = outputs_[i].rows(0, rows);
    layers_[i]->forward(ctx, x, y);
    x = y;
  }
  forward_rows_ = rows;
  has_forward_ = true;
  return x;
}

Tensor ReplicaModel::output_grad_buffer(const ReplicaContext&) {
  const Shape out = row_shapes_.back().with_rows(forward_rows_);
  return grad_a_.rows(0, out.numel()).reshaped(out);
}

void ReplicaModel::backward(const ReplicaContext& ctx, const Tensor& grad_output, bool accumulate,
                            const std::function<void(size_t layer)>& layer_done) {
  DPAR_ENFORCE(has_forward_, Status::kInvalidState, "backward: no forward state on ", ctx.device.str());
  ctx.maybe_fail(Fault::kBackward, "backward");
  const int64_t rows = forward_rows_;
  Tensor dout = grad_output;
  for (size_t i = layers_.size(); i-- > 0;) {
    const bool pair = i > 0 && fused_with_next_[i - 1];  // layers i - 1 and i run as one
    const size_t first = pair ? i - 1 : i;
    Tensor in = first == 0 ? input_ : outputs_[first - 1].rows(0, rows);
    // The ping-pong buffer that dout is not in, and the other one: dout's own (dout starts its buffer, being the
    // loss's gradient in grad_a_ or an earlier din) or, for a caller's gradient in memory of its own, a free one.
    const bool dout_in_a = dout.raw() == grad_a_.raw();
    Tensor& free_buf = dout_in_a ? grad_b_ : grad_a_;
    Tensor& other_buf = dout_in_a ? grad_a_ : grad_b_;
    Tensor din;
    if (pair) {
      // The gradient between the two layers goes into the free buffer, and din into the other, which may hold
      // dout: the pair reads dout in full before it writes din.
      const Tensor first_out = outputs_[first].rows(0, rows);
      const Tensor mid = free_buf.rows(0, first_out.numel()).reshaped(first_out.shape());
      if (first > 0) din = other_buf.rows(0, in.numel()).reshaped(in.shape());
      layers_[first]->backward_with_next(ctx, in, outputs_[i].rows(0, rows), dout, mid, din, accumulate);
      if (layer_done) layer_done(i), layer_done(first);
    } else {
      if (i > 0) din = free_buf.rows(0, in.numel()).reshaped(in.shape());
      layers_[i]->backward(ctx, in, outputs_[i].rows(0, rows), dout, din, accumulate);
      if (layer_done) layer_done(i);
    }
    dout = din;
    i = first;
  }
  has_forward_ = false;
  input_ = Tensor();
}

}  // namespace dpar
