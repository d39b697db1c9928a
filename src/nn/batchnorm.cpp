// BatchNorm1d, BatchNorm2d and SyncBatchNorm, as PyTorch's: training mode normalises with the batch's statistics
// (biased variance) and moves the running statistics toward them (unbiased variance) by `momentum`; eval mode
// normalises with the running statistics. The math is the replica's backend's (Stream::batchnorm_*); here are
// shapes, parameters, buffers and, for SyncBatchNorm, the sums over every replica.
#include <cmath>

#include "collectives/replica_set.h"
#include "common/error.h"
#include "nn/layer.h"

namespace dpar {
namespace {

class BatchNorm final : public Layer {
 public:
  // dims: 1 (BatchNorm1d), 2 (BatchNorm2d) or 0 (SyncBatchNorm: any of their inputs).
  BatchNorm(int dims, int64_t c, float eps, float momentum, bool affine)
      : dims_(dims), c_(c), eps_(eps), momentum_(momentum), affine_(affine) {}
  std::string describe() const override {
    const char* kind = dims_ == 1 ? "batchnorm1d" : dims_ == 2 ? "batchnorm2d" : "sync_batchnorm";
    return std::string(kind) + "(" + std::to_string(c_) + (affine_ ? "" : ", no affine") + ")";
  }
  std::vector<ParamSpec> param_specs() const override {
    if (!affine_) return {};
    // PyTorch's _NormBase.reset_parameters: weight ones, bias zeros.
    ParamSpec weight{"weight", Shape{c_}, InitKind::kOnes}, bias{"bias", Shape{c_}, InitKind::kZeros};
    weight.no_decay = bias.no_decay = true;  // a norm's scale and shift: the no-decay group
    return {weight, bias};
  }
  std::vector<BufferSpec> buffer_specs() const override {
    return {{"running_mean", BufferDType::kF32, Shape{c_}, InitKind::kZeros},
            {"running_var", BufferDType::kF32, Shape{c_}, InitKind::kOnes},
            {"num_batches_tracked", BufferDType::kI64, Shape{}, InitKind::kZeros}};
  }
  Shape output_shape(const Shape& in) const override {
    const size_t lo = dims_ == 2 ? 4 : 2, hi = dims_ == 1 ? 3 : 4;
    DPAR_CHECK_ARG(in.ndim() >= lo && in.ndim() <= hi && in[1] == c_, describe(), " expects ",
                   dims_ == 1   ? "(batch, C) or (batch, C, L)"
                   : dims_ == 2 ? "(batch, C, H, W)"
                                : "(batch, C), (batch, C, L) or (batch, C, H, W)",
                   " with C = ", c_, ", got ", in.str());
    return in;
  }
  std::unique_ptr<Layer> clone() const override {
    return std::make_unique<BatchNorm>(dims_, c_, eps_, momentum_, affine_);
  }
  bool uses_collectives() const override { return dims_ == 0; }
  void check_statistics_input(const Shape& in) const override {
    // A replica given no rows of a plain BatchNorm takes no statistics (forward leaves its buffers alone).
    if (in[0] == 0) return;
    DPAR_CHECK_ARG(in.numel() / c_ > 1, describe(), ": expected more than 1 value per channel when training, got input ",
                   in.str());
  }
  std::unique_ptr<Layer> as_sync() const {
    return dims_ == 0 ? nullptr : std::make_unique<BatchNorm>(0, c_, eps_, momentum_, affine_);
  }

  // in (B,C,L...), out (B,C,L...)
  void forward(const ReplicaContext& ctx, const Tensor& in, const Tensor& out) override {
    const int64_t n = in.rows(), l = n > 0 ? in.numel() / (n * c_) : 0;
    reserve(ctx);
    training_ = ctx.training;
    const bool sync = dims_ == 0 && ctx.collectives != nullptr;
    float* running_mean = buffers_[0].f32();
    float* running_var = buffers_[1].f32();
    auto* tracked = reinterpret_cast<int64_t*>(buffers_[2].i32());
    if (!training_) {
      ctx.stream->batchnorm_moments(mean_invstd(), running_mean, running_var, nullptr, nullptr, 0.0, c_, eps_, 0.0f);
      apply(ctx, in, out, n, l);
      return;
    }
    // This replica's sums, then (SyncBatchNorm) the whole batch's: Σx, Σx² per channel and the element count.
    ctx.stream->batchnorm_stats(stats(), in.f32(), n, c_, l);
    count_ = static_cast<double>(n * (n > 0 ? l : 0));
    if (sync) {
      ctx.stream->copy_from_host(stats() + 2 * c_, &count_, sizeof(double));
      ctx.collectives->sum(stats(), static_cast<size_t>(2 * c_ + 1), CommDType::kF64);
      ctx.stream->copy_to_host(&count_, stats() + 2 * c_, sizeof(double));
    }
    // A replica given no rows of a plain BatchNorm has no statistics: it leaves its running statistics alone (the
    // engine makes them replica 0's after the step).
    if (!sync && n == 0) return;
    DPAR_CHECK_ARG(count_ > 1.0, describe(), ": expected more than 1 value per channel when training, got input ",
                   in.shape().str());
    ctx.stream->batchnorm_moments(mean_invstd(), running_mean, running_var, tracked, stats(), count_, c_, eps_,
                                  momentum_);
    apply(ctx, in, out, n, l);
  }

  // A ReLU after BatchNorm runs as its epilogue: in place on its output after the normalisation (no tensor of its
  // own for the normalised values), and backward masks the gradient with that output first. Each is still a pass of
  // its own over the activations: a kernel that normalises and clamps in one pass is a backend's to add.
  bool takes_epilogue(Epilogue epilogue) const override { return epilogue == Epilogue::kRelu; }
  void forward_with_epilogue(const ReplicaContext& ctx, Epilogue, const Tensor& in, const Tensor& out) override {
    relu_ = true;
    forward(ctx, in, out);
  }
  void backward_with_epilogue(const ReplicaContext& ctx, Epilogue, const Tensor& in, const Tensor& out,
                              const Tensor& dout, const Tensor& mid, const Tensor& din, bool accumulate) override {
    ctx.stream->activation_backward(Activation::kRelu, mid.f32(), dout.f32(), nullptr, out.f32(), out.numel());
    backward(ctx, in, out, mid, din, accumulate);
  }

  void backward(const ReplicaContext& ctx, const Tensor& in, const Tensor&, const Tensor& dout, const Tensor& din,
                bool accumulate) override {
    const int64_t n = in.rows(), l = n > 0 ? in.numel() / (n * c_) : 0;
    const bool sync = training_ && dims_ == 0 && ctx.collectives != nullptr;
    if (n == 0 && !sync) {
      // No rows and no sums to take part in: this replica's parameter gradients are zero.
      if (affine_ && !accumulate)
        for (float* g : grads_) ctx.stream->fill_zero(g, static_cast<size_t>(c_) * sizeof(float));
      return;
    }
    // Σdy and Σdy·x̂ of this replica's rows give the parameter gradients (the reducer sums them over replicas); those
    // of the whole batch give the input's.
    ctx.stream->batchnorm_backward_reduce(local(), dout.f32(), in.f32(), mean_invstd(), n, c_, l);
    const double* global = nullptr;
    if (training_) {
      global = local();
      if (sync) {
        ctx.stream->copy(global_sums(), local(), 2 * static_cast<size_t>(c_) * sizeof(double));
        ctx.collectives->sum(global_sums(), static_cast<size_t>(2 * c_), CommDType::kF64);
        global = global_sums();
      }
    }
    ctx.stream->batchnorm_backward_apply(din.defined() ? din.f32() : nullptr, affine_ ? grads_[0] : nullptr,
                                         affine_ ? grads_[1] : nullptr, local(), global, count_, dout.f32(),
                                         in.f32(), mean_invstd(), weight(), n, c_, l, accumulate);
  }

 private:
  // out = the normalised in, then the ReLU when it runs as this layer's epilogue.
  void apply(const ReplicaContext& ctx, const Tensor& in, const Tensor& out, int64_t n, int64_t l) {
    ctx.stream->batchnorm_apply(out.f32(), in.f32(), mean_invstd(), weight(), bias(), n, c_, l);
    if (relu_) ctx.stream->activation_forward(Activation::kRelu, out.f32(), out.f32(), out.numel());
  }
  const float* weight() const { return affine_ ? params_[0] : nullptr; }
  const float* bias() const { return affine_ ? params_[1] : nullptr; }
  // Scratch of doubles in device memory: stats (2C + 1), mean_invstd (2C), local (2C), global (2C).
  void reserve(const ReplicaContext& ctx) {
    if (!scratch_.defined()) scratch_ = ctx.alloc(DType::kF32, Shape{2 * (8 * c_ + 1)});
  }
  double* base() const { return reinterpret_cast<double*>(scratch_.f32()); }
  double* stats() const { return base(); }
  double* mean_invstd() const { return base() + 2 * c_ + 1; }
  double* local() const { return base() + 4 * c_ + 1; }
  double* global_sums() const { return base() + 6 * c_ + 1; }

  int dims_;
  int64_t c_;
  float eps_, momentum_;
  bool affine_;
  Tensor scratch_;
  bool training_ = true;  // the mode of the last forward
  bool relu_ = false;     // a ReLU runs as its epilogue (the fusion pass fixes it for the model's life)
  double count_ = 0.0;    // elements per channel of the last training forward's batch (all replicas' for sync)
};

}  // namespace

std::unique_ptr<Layer> make_batchnorm(int dims, int64_t num_features, float eps, float momentum, bool affine) {
  DPAR_CHECK_ARG(dims >= 0 && dims <= 2, "dims: ", dims, " must be 0 (sync), 1 or 2");
  DPAR_CHECK_ARG(num_features >= 1 && num_features <= (1 << 24), "num_features: ", num_features,
                 " must be 1 to 2^24");
  DPAR_CHECK_ARG(std::isfinite(eps) && eps > 0.0f, "eps: ", eps, " must be positive");
  DPAR_CHECK_ARG(momentum >= 0.0f && momentum <= 1.0f, "momentum: ", momentum,
                 " must be in [0, 1] (PyTorch's momentum=None, a cumulative average, is not supported)");
  return std::make_unique<BatchNorm>(dims, num_features, eps, momentum, affine);
}

std::unique_ptr<Layer> to_sync_batchnorm(const Layer& layer) {
  const auto* bn = dynamic_cast<const BatchNorm*>(&layer);
  return bn ? bn->as_sync() : nullptr;
}

}  // namespace dpar
