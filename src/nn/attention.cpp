// What a GPT adds to the layers: learned positions and scaled dot-product attention. The math is the replica's
// backend's (a kernel call for the positions, the stateful AttentionOp for attention); here are shapes, parameters
// and the state a backward needs.
#include <algorithm>
#include <cmath>
#include <sstream>

#include "common/error.h"
#include "nn/layer.h"

namespace dpar {
namespace {

class PositionEmbedding final : public Layer {
 public:
  PositionEmbedding(int64_t positions, int64_t dim) : positions_(positions), dim_(dim) {}
  std::string describe() const override {
    return "position_embedding(" + std::to_string(positions_) + ", " + std::to_string(dim_) + ")";
  }
  std::vector<ParamSpec> param_specs() const override {
    // nanoGPT's wpe is an nn.Embedding: normal_(0, 1) by PyTorch's default.
    return {{"weight", Shape{positions_, dim_}, InitKind::kNormal, 1.0f}};
  }
  Shape output_shape(const Shape& in) const override {
    DPAR_CHECK_ARG(in.ndim() == 3 && in[2] == dim_, describe(), " expects (batch, T, ", dim_, "), got ", in.str());
    DPAR_CHECK_ARG(in[1] <= positions_, describe(), ": a sequence of ", in[1], " positions is longer than the ",
                   positions_, " the table holds");
    return in;
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<PositionEmbedding>(positions_, dim_); }
  std::vector<KernelKey> kernels(Epilogue) const override {
    return {{Op::kPositionEmbeddingForward}, {Op::kPositionEmbeddingBackward}};
  }
  void forward(const ReplicaContext& ctx, const Tensor& in, const Tensor& out) override {
    ctx.stream->run(call::PositionEmbeddingForward{out.ref(), in.ref(), param(0)});
  }
  void backward(const ReplicaContext& ctx, const Tensor&, const Tensor&, const Tensor& dout, const Tensor& din,
                bool accumulate) override {
    ctx.stream->run(call::PositionEmbeddingBackward{grad(0), dout.ref(), accumulate});
    // An addition passes its gradient through unchanged.
    if (din.defined()) ctx.stream->copy(din.raw(), dout.raw(), dout.bytes());
  }

 private:
  int64_t positions_, dim_;
};

class Attention final : public Layer {
 public:
  Attention(const AttentionSpec& spec, float dropout_p, size_t num_inputs)
      : spec_(spec), dropout_p_(dropout_p), num_inputs_(num_inputs) {}
  std::string describe() const override {
    std::ostringstream s;
    s << "scaled_dot_product_attention(" << spec_.heads << (spec_.heads == 1 ? " head" : " heads")
      << (spec_.causal ? ", causal" : "");
    if (spec_.scale != 0.0f) s << ", scale " << spec_.scale;
    if (dropout_p_ > 0.0f) s << ", dropout " << dropout_p_;
    s << (num_inputs_ == 1 ? ", packed q|k|v)" : ")");
    return s.str();
  }
  size_t num_inputs() const override { return num_inputs_; }
  std::unique_ptr<Layer> clone() const override {
    return std::make_unique<Attention>(spec_, dropout_p_, num_inputs_);
  }

  // The packed form: (B, T, 3C) -> (B, T, C).
  Shape output_shape(const Shape& in) const override {
    DPAR_CHECK_ARG(in.ndim() == 3 && in[2] % 3 == 0, describe(),
                   " expects one packed (batch, T, 3 x channels) projection, got ", in.str());
    check_heads(in[2] / 3);
    return in.with_dim(2, in[2] / 3);
  }
  Shape output_shape_of(const std::vector<Shape>& in) const override {
    if (num_inputs_ == 1) return output_shape(in[0]);
    const Shape &q = in[0], &k = in[1], &v = in[2];
    DPAR_CHECK_ARG(q.ndim() == 3 && k.ndim() == 3 && v.ndim() == 3, describe(),
                   " expects q, k and v of (batch, length, channels), got q ", q.str(), ", k ", k.str(), ", v ",
                   v.str());
    DPAR_CHECK_ARG(k == v, describe(), ": k ", k.str(), " and v ", v.str(), " must have one shape");
    DPAR_CHECK_ARG(q[0] == k[0] && q[2] == k[2], describe(), ": q ", q.str(), " and k ", k.str(),
                   " must agree in batch and channels");
    DPAR_CHECK_ARG(!spec_.causal || q[1] == k[1], describe(), ": causal attention reads as many keys as queries, got ",
                   q[1], " queries and ", k[1], " keys");
    check_heads(q[2]);
    return q;
  }

  void forward(const ReplicaContext& ctx, const Tensor& in, const Tensor& out) override {
    forward_inputs(ctx, {in}, out);
  }
  void backward(const ReplicaContext& ctx, const Tensor& in, const Tensor& out, const Tensor& dout, const Tensor& din,
                bool accumulate) override {
    backward_inputs(ctx, {in}, out, dout, {din}, accumulate);
  }

  // Under a bf16 policy attention computes in bf16 as torch.autocast runs scaled_dot_product_attention: q, k and v
  // rounded (kept so for backward: half the f32 bytes), the products on bf16 operands with f32 accumulation, the
  // softmax, out and the gradients f32 (AttentionSpec::dtype). Where the projection before it writes its output in
  // bf16 (a packed q|k|v that only this layer reads), the input arrives rounded and nothing is copied. A backend
  // without a bf16 attention (Stream::has_attention) keeps attention f32; the linear layers around it still run in
  // bf16.
  bool autocasts() const override { return true; }
  bool reads_rounded_input(const Stream& stream) const override {
    return num_inputs_ == 1 && computes_in(stream) != DType::kF32;
  }
  std::vector<KernelKey> kernels(Epilogue) const override {
    if (compute_dtype_ == DType::kF32) return {};
    return {{Op::kConvert, compute_dtype_}};  // where the input arrives f32
  }

  void forward_inputs(const ReplicaContext& ctx, const std::vector<Tensor>& in, const Tensor& out) override {
    const DType dtype = computes_in(*ctx.stream);
    std::vector<Tensor> operands = in;
    for (size_t i = 0; i < operands.size(); ++i) operands[i] = low_[i].round(ctx, dtype, in[i]);
    TensorRef q, k, v;
    split(operands, q, k, v);
    const int64_t B = q.size(0), L = q.size(1), S = k.size(1);
    const int64_t n = B * spec_.heads * L;
    if (!lse_.defined() || lse_.numel() < n) lse_ = ctx.alloc(DType::kF32, Shape{std::max<int64_t>(n, 1)});
    if (!op_ || op_dtype_ != dtype) {
      AttentionSpec spec = spec_;
      spec.dtype = dtype;
      op_ = ctx.stream->make_attention(spec);
      op_dtype_ = dtype;
    }
    // Dropout's mask is a function of the position in this replica's stream: backward draws it again from the same
    // offset, so nothing of size L x S is kept.
    active_p_ = ctx.training ? dropout_p_ : 0.0f;
    offset_ = active_p_ > 0.0f ? *ctx.rng_offset : 0;
    seed_ = ctx.rng_seed;
    op_->forward(out.ref(), lse(B, L), q, k, v, active_p_, ctx.rng_seed, offset_);
    if (active_p_ > 0.0f) *ctx.rng_offset += static_cast<uint64_t>(n * S);
  }
  void backward_inputs(const ReplicaContext&, const std::vector<Tensor>& in, const Tensor& out, const Tensor& dout,
                       const std::vector<Tensor>& din, bool) override {
    std::vector<Tensor> operands = in;
    for (size_t i = 0; i < operands.size(); ++i) operands[i] = low_[i].rounded(op_dtype_, in[i], describe());
    TensorRef q, k, v, dq, dk, dv;
    split(operands, q, k, v);
    split(din, dq, dk, dv);
    op_->backward(dq, dk, dv, dout.ref(), q, k, v, out.ref(), lse(q.size(0), q.size(1)), active_p_, seed_, offset_);
  }

 private:
  // The dtype the products compute in on `stream`: the policy's where the backend has that attention, else f32.
  DType computes_in(const Stream& stream) const {
    return compute_dtype_ != DType::kF32 && stream.has_attention(compute_dtype_) ? compute_dtype_ : DType::kF32;
  }
  void check_heads(int64_t channels) const {
    DPAR_CHECK_ARG(channels % spec_.heads == 0, describe(), ": ", spec_.heads, " heads do not divide the ", channels,
                   " channels");
  }
  // q, k and v: the inputs, or the three thirds of the packed one's last dimension.
  void split(const std::vector<Tensor>& t, TensorRef& q, TensorRef& k, TensorRef& v) const {
    if (num_inputs_ == 3) {
      q = t[0].ref(), k = t[1].ref(), v = t[2].ref();
      return;
    }
    const TensorRef packed = t[0].ref();
    const int64_t C = packed.size(-1) / 3;
    q = packed.narrow_last(0, C), k = packed.narrow_last(C, C), v = packed.narrow_last(2 * C, C);
  }
  // (B, heads, L) of the last forward.
  TensorRef lse(int64_t B, int64_t L) const { return lse_.rows(0, B * spec_.heads * L).ref().view({B, spec_.heads, L}); }

  AttentionSpec spec_;
  float dropout_p_;
  size_t num_inputs_;
  std::unique_ptr<AttentionOp> op_;  // made by the replica's stream on the first forward of its dtype
  DType op_dtype_ = DType::kF32;     // the dtype op_ computes in
  LowPrecisionBuffer low_[3];        // the inputs rounded to op_dtype_, kept for backward (the inputs where f32)
  Tensor lse_;                       // (B, heads, L) of the last forward
  float active_p_ = 0.0f;            // the last forward's dropout (0 in eval mode)
  uint64_t seed_ = 0, offset_ = 0;   // the last forward's stream and where its mask began in it
};

// nn.MultiheadAttention(embed_dim, num_heads, dropout, bias, batch_first=True) as self-attention, module(x, x, x,
// need_weights=False, is_causal=...)[0]: one layer of one input, with that module's parameters and names.
class MultiheadAttention final : public Layer {
 public:
  MultiheadAttention(int64_t embed_dim, const AttentionSpec& spec, float dropout_p, bool bias)
      : e_(embed_dim), bias_(bias), spec_(spec), dropout_p_(dropout_p), attention_(spec, dropout_p, 1) {}
  std::string describe() const override {
    return "multihead_attention(" + std::to_string(e_) + ", " + attention_.describe() + (bias_ ? "" : ", no bias") +
           ")";
  }
  std::vector<ParamSpec> param_specs() const override {
    // MultiheadAttention._reset_parameters: xavier_uniform_ on in_proj_weight (fan_in E, fan_out 3E), zero biases;
    // out_proj keeps nn.Linear's kaiming_uniform_(a=sqrt(5)), U(+-1/sqrt(E)).
    std::vector<ParamSpec> specs{
        {"in_proj_weight", Shape{3 * e_, e_}, InitKind::kUniform, static_cast<float>(std::sqrt(6.0 / (4.0 * e_)))}};
    if (bias_) specs.push_back({"in_proj_bias", Shape{3 * e_}, InitKind::kZeros, 0.0f, -1, true});
    specs.push_back({"out_proj.weight", Shape{e_, e_}, InitKind::kUniform, static_cast<float>(1.0 / std::sqrt(e_))});
    if (bias_) specs.push_back({"out_proj.bias", Shape{e_}, InitKind::kZeros, 0.0f, -1, true});
    return specs;
  }
  Shape output_shape(const Shape& in) const override {
    DPAR_CHECK_ARG(in.ndim() == 3 && in[2] == e_, describe(), " expects (batch, T, ", e_, "), got ", in.str());
    return in;
  }
  std::unique_ptr<Layer> clone() const override {
    return std::make_unique<MultiheadAttention>(e_, spec_, dropout_p_, bias_);
  }
  // Under a bf16 policy the projections are linear layers' bf16 GEMMs (their inputs rounded and kept, the step's
  // bf16 weights) and the heads are Attention's (bf16 where the backend has it, q|k|v rounded from the f32
  // projection); biases and the projection stay f32.
  bool autocasts() const override { return true; }
  void set_compute_dtype(DType dtype) override {
    Layer::set_compute_dtype(dtype);
    attention_.set_compute_dtype(dtype);
  }
  std::vector<KernelKey> kernels(Epilogue) const override {
    std::vector<KernelKey> keys{{Op::kLinearForward, compute_dtype_}, {Op::kLinearBackward, compute_dtype_}};
    if (compute_dtype_ != DType::kF32) keys.push_back({Op::kConvert, compute_dtype_});
    return keys;
  }

  void forward(const ReplicaContext& ctx, const Tensor& in, const Tensor& out) override {
    const int64_t B = in.shape()[0], T = in.shape()[1];
    reserve(ctx, B * T);
    const Tensor qkv = rows(qkv_, {B, T, 3 * e_}), attn = rows(attn_, {B, T, e_});
    ctx.stream->run(call::LinearForward{qkv.ref(), in_low_.round(ctx, compute_dtype_, in).ref(), operand_param(0),
                                        param(1, bias_)});
    attention_.forward(ctx, qkv, attn);
    ctx.stream->run(call::LinearForward{out.ref(), attn_low_.round(ctx, compute_dtype_, attn).ref(),
                                        operand_param(bias_ ? 2 : 1), param(3, bias_)});
  }
  void backward(const ReplicaContext& ctx, const Tensor& in, const Tensor& out, const Tensor& dout, const Tensor& din,
                bool accumulate) override {
    const int64_t B = in.shape()[0], T = in.shape()[1];
    const Tensor qkv = rows(qkv_, {B, T, 3 * e_}), attn = rows(attn_, {B, T, e_});
    const Tensor dqkv = rows(dqkv_, {B, T, 3 * e_}), dattn = rows(dattn_, {B, T, e_});
    const size_t w = bias_ ? 2 : 1;
    call::LinearBackward out_proj{dattn.ref(), grad(w), grad(3, bias_), {}, dout.ref(),
                                  attn_low_.rounded(compute_dtype_, attn, describe()).ref(), operand_param(w),
                                  out.ref(), {}, Epilogue::kNone, accumulate};
    if (compute_dtype_ != DType::kF32) out_proj.dout_low = ctx.call_room(compute_dtype_, dout.shape());
    ctx.stream->run(out_proj);
    attention_.backward(ctx, qkv, attn, dattn, dqkv, accumulate);
    call::LinearBackward in_proj{din.ref(), grad(0), grad(1, bias_), {}, dqkv.ref(),
                                 in_low_.rounded(compute_dtype_, in, describe()).ref(), operand_param(0), qkv.ref(),
                                 {}, Epilogue::kNone, accumulate};
    if (compute_dtype_ != DType::kF32) in_proj.dout_low = ctx.call_room(compute_dtype_, dqkv.shape());
    ctx.stream->run(in_proj);
  }

 private:
  static Tensor rows(const Tensor& t, std::initializer_list<int64_t> dims) {
    const Shape shape = Shape::of(dims.begin(), dims.size());
    return t.rows(0, shape.numel()).reshaped(shape);
  }
  void reserve(const ReplicaContext& ctx, int64_t n) {
    if (qkv_.defined() && qkv_.numel() >= 3 * e_ * n) return;
    const int64_t m = std::max<int64_t>(n, 1);
    qkv_ = ctx.alloc(DType::kF32, Shape{3 * e_ * m});
    dqkv_ = ctx.alloc(DType::kF32, Shape{3 * e_ * m});
    attn_ = ctx.alloc(DType::kF32, Shape{e_ * m});
    dattn_ = ctx.alloc(DType::kF32, Shape{e_ * m});
  }
  int64_t e_;
  bool bias_;
  AttentionSpec spec_;
  float dropout_p_;
  Attention attention_;  // the heads, on the packed projection
  Tensor qkv_, attn_, dqkv_, dattn_;  // the projection and the heads' output of the last forward; their gradients
  // The bf16 copies of the projections' inputs (kept for backward) and of their output gradients.
  LowPrecisionBuffer in_low_, attn_low_;
};

}  // namespace

std::unique_ptr<Layer> make_position_embedding(int64_t max_positions, int64_t embedding_dim) {
  DPAR_CHECK_ARG(max_positions >= 1 && max_positions <= (1 << 24), "max_positions: ", max_positions,
                 " must be 1 to 2^24");
  DPAR_CHECK_ARG(embedding_dim >= 1 && embedding_dim <= (1 << 24), "embedding_dim: ", embedding_dim,
                 " must be 1 to 2^24");
  DPAR_CHECK_ARG(max_positions * embedding_dim <= (int64_t{1} << 31), "position_embedding: ", max_positions, " x ",
                 embedding_dim, " weights are more than 2^31");
  return std::make_unique<PositionEmbedding>(max_positions, embedding_dim);
}

std::unique_ptr<Layer> make_attention(const AttentionSpec& spec, float dropout_p, size_t num_inputs) {
  DPAR_CHECK_ARG(spec.heads >= 1 && spec.heads <= (1 << 16), "num_heads: ", spec.heads, " must be 1 to 65536");
  DPAR_CHECK_ARG(std::isfinite(dropout_p) && dropout_p >= 0.0f && dropout_p < 1.0f, "dropout_p: ", dropout_p,
                 " must be in [0, 1)");
  DPAR_CHECK_ARG(std::isfinite(spec.scale) && spec.scale >= 0.0f, "scale: ", spec.scale,
                 " must be positive, or 0 for 1/sqrt(head size)");
  DPAR_CHECK_ARG(num_inputs == 1 || num_inputs == 3, "attention reads q, k and v (3 inputs) or one packed q|k|v "
                 "projection (1 input), not ", num_inputs);
  return std::make_unique<Attention>(spec, dropout_p, num_inputs);
}

std::unique_ptr<Layer> make_multihead_attention(int64_t embed_dim, const AttentionSpec& spec, float dropout_p,
                                                bool bias) {
  DPAR_CHECK_ARG(embed_dim >= 1 && embed_dim <= (1 << 16), "embed_dim: ", embed_dim, " must be 1 to 65536");
  make_attention(spec, dropout_p, 1);  // its own checks
  DPAR_CHECK_ARG(embed_dim % spec.heads == 0, "num_heads: ", spec.heads, " does not divide embed_dim ", embed_dim);
  return std::make_unique<MultiheadAttention>(embed_dim, spec, dropout_p, bias);
}

}  // namespace dpar
