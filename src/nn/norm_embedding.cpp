// LayerNorm and Embedding, as PyTorch's. The math is the replica's backend's (Stream::layernorm_*,
// Stream::embedding_*); here are shapes, parameters and saved state.
#include <algorithm>
#include <cmath>

#include "common/error.h"
#include "nn/layer.h"

namespace dpar {
namespace {

class LayerNorm final : public Layer {
 public:
  LayerNorm(int64_t d, float eps, bool affine) : d_(d), eps_(eps), affine_(affine) {}
  std::string describe() const override {
    return "layernorm(" + std::to_string(d_) + (affine_ ? "" : ", no affine") + ")";
  }
  std::vector<ParamSpec> param_specs() const override {
    if (!affine_) return {};
    // PyTorch's LayerNorm.reset_parameters: weight ones, bias zeros; a norm's scale and shift: the no-decay group.
    ParamSpec weight{"weight", Shape{d_}, InitKind::kOnes}, bias{"bias", Shape{d_}, InitKind::kZeros};
    weight.no_decay = bias.no_decay = true;
    return {weight, bias};
  }
  Shape output_shape(const Shape& in) const override {
    DPAR_CHECK_ARG(in.ndim() >= 2 && in[in.ndim() - 1] == d_, describe(), " expects (batch, ..., ", d_, "), got ",
                   in.str());
    return in;
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<LayerNorm>(d_, eps_, affine_); }
  std::vector<KernelKey> kernels(Epilogue) const override {
    return {{Op::kLayerNormForward}, {Op::kLayerNormBackward}};
  }
  // In f32 always (autocast's fp32 list); its output may be kept rounded where only bf16 linear layers read it
  // (a transformer block's ln_1 and ln_2): backward reads the input and the saved mean and rstd, not the output.
  std::vector<KernelKey> rounded_output_kernels(Epilogue epilogue, DType dtype) const override {
    if (epilogue != Epilogue::kNone || dtype == DType::kF32) return {};
    return {{Op::kLayerNormForward, DType::kF32, Epilogue::kNone, dtype}};
  }

  // in (B,...,D) read as (N,D), out likewise
  void forward(const ReplicaContext& ctx, const Tensor& in, const Tensor& out) override {
    const int64_t n = in.numel() / d_;
    // Each row's mean and rstd in doubles, kept for backward (room for 2 doubles per row).
    if (!saved_.defined() || saved_.numel() < 2 * n)
      saved_ = ctx.alloc(DType::kF64, Shape{2 * std::max<int64_t>(n, 1)});
    ctx.stream->run(call::LayerNormForward{out.ref(), mean_rstd(n), in.ref(), param(0, affine_), param(1, affine_),
                                           eps_});
  }
  void backward(const ReplicaContext& ctx, const Tensor& in, const Tensor&, const Tensor& dout, const Tensor& din,
                bool accumulate) override {
    const int64_t n = in.numel() / d_;
    ctx.stream->run(call::LayerNormBackward{din.ref(), grad(0, affine_), grad(1, affine_), dout.ref(), in.ref(),
                                            mean_rstd(n), param(0, affine_), accumulate});
  }

 private:
  // Each of the n rows' mean and rstd of the last forward.
  TensorRef mean_rstd(int64_t n) const { return saved_.rows(0, 2 * n).ref(); }
  int64_t d_;
  float eps_;
  bool affine_;
  Tensor saved_;  // (2,N) f64 of the last forward
};

class Embedding final : public Layer {
 public:
  Embedding(int64_t v, int64_t e, int64_t padding_idx) : v_(v), e_(e), padding_idx_(padding_idx) {}
  std::string describe() const override {
    return "embedding(" + std::to_string(v_) + ", " + std::to_string(e_) +
           (padding_idx_ >= 0 ? ", padding_idx=" + std::to_string(padding_idx_) : std::string()) + ")";
  }
  std::vector<ParamSpec> param_specs() const override {
    // PyTorch's Embedding.reset_parameters: normal_(0, 1), then the padding row zeroed.
    return {{"weight", Shape{v_, e_}, InitKind::kNormal, 1.0f, padding_idx_}};
  }
  DType input_dtype() const override { return DType::kI32; }
  Shape output_shape(const Shape& in) const override {
    DPAR_CHECK_ARG(in.ndim() == 1 || in.ndim() == 2, describe(), " expects indices (batch) or (batch, T), got ",
                   in.str());
    return in.ndim() == 1 ? Shape{in[0], e_} : Shape{in[0], in[1], e_};
  }
  void check_input_values(const Tensor& host) const override {
    const int32_t* idx = host.i32();
    for (int64_t i = 0; i < host.numel(); ++i) {
      if (idx[i] >= 0 && idx[i] < v_) continue;
      const int64_t row_numel = host.shape().row_numel();
      const int64_t row = i / row_numel, col = i % row_numel;
      fail(Status::kInvalidArgument, describe(), ": index ", idx[i], " at position (", row,
           host.shape().ndim() == 2 ? ", " + std::to_string(col) : std::string(), ") is out of range [0, ", v_, ")");
    }
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<Embedding>(v_, e_, padding_idx_); }
  std::vector<KernelKey> kernels(Epilogue) const override {
    return {{Op::kEmbeddingForward}, {Op::kEmbeddingBackward}};
  }

  // in (N) i32 indices, weight (V,E), out (N,E)
  void forward(const ReplicaContext& ctx, const Tensor& in, const Tensor& out) override {
    ctx.stream->run(call::EmbeddingForward{out.ref(), in.ref(), param(0)});
  }
  // The weight's gradient is dense: (V,E), zero in the rows no index named (see the README on why it is reduced
  // as any parameter).
  void backward(const ReplicaContext& ctx, const Tensor& in, const Tensor&, const Tensor& dout, const Tensor&,
                bool accumulate) override {
    ctx.stream->run(call::EmbeddingBackward{grad(0), dout.ref(), in.ref(), padding_idx_, accumulate});
  }

 private:
  int64_t v_, e_;
  int64_t padding_idx_;  // -1: none
};

}  // namespace

std::unique_ptr<Layer> make_layernorm(int64_t normalized_size, float eps, bool elementwise_affine) {
  DPAR_CHECK_ARG(normalized_size >= 1 && normalized_size <= (1 << 24), "normalized_size: ", normalized_size,
                 " must be 1 to 2^24");
  DPAR_CHECK_ARG(std::isfinite(eps) && eps > 0.0f, "eps: ", eps, " must be positive");
  return std::make_unique<LayerNorm>(normalized_size, eps, elementwise_affine);
}

namespace {
// The table's extents, checked before anything computed from them (a padding index's range) is.
void check_embedding_extents(int64_t num_embeddings, int64_t embedding_dim) {
  DPAR_CHECK_ARG(num_embeddings >= 1 && num_embeddings <= (1 << 24), "num_embeddings: ", num_embeddings,
                 " must be 1 to 2^24");
  DPAR_CHECK_ARG(embedding_dim >= 1 && embedding_dim <= (1 << 24), "embedding_dim: ", embedding_dim,
                 " must be 1 to 2^24");
  DPAR_CHECK_ARG(num_embeddings * embedding_dim <= (int64_t{1} << 31), "embedding: ", num_embeddings, " x ",
                 embedding_dim, " weights are more than 2^31");
}
}  // namespace

std::unique_ptr<Layer> make_embedding(int64_t num_embeddings, int64_t embedding_dim, int64_t padding_idx) {
  check_embedding_extents(num_embeddings, embedding_dim);
  DPAR_CHECK_ARG(padding_idx >= -1 && padding_idx < num_embeddings, "padding_idx: ", padding_idx,
                 " must be -1 (none) or in [0, ", num_embeddings, ")");
  return std::make_unique<Embedding>(num_embeddings, embedding_dim, padding_idx);
}

std::unique_ptr<Layer> make_embedding_padded(int64_t num_embeddings, int64_t embedding_dim, int64_t padding_idx) {
  check_embedding_extents(num_embeddings, embedding_dim);
  DPAR_CHECK_ARG(padding_idx >= -num_embeddings && padding_idx < num_embeddings, "padding_idx: ", padding_idx,
                 " must be in [-num_embeddings, num_embeddings) = [", -num_embeddings, ", ", num_embeddings, ")");
  return make_embedding(num_embeddings, embedding_dim, padding_idx < 0 ? padding_idx + num_embeddings : padding_idx);
}

}  // namespace dpar
