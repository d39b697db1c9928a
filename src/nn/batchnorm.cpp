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
    return {{"running_mean", DType::kF32, Shape{c_}, InitKind::kZeros},
            {"running_var", DType::kF32, Shape{c_}, InitKind::kOnes},
            {"num_batches_tracked", DType::kI64, Shape{}, InitKind::kZeros}};
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
  // The batch's sums (Σx, Σx² per channel) and its element count per channel.
  size_t running_statistics_size() const override { return static_cast<size_t>(2 * c_ + 1); }
  void defer_running_statistics(bool defer) override { deferred_ = defer; }
  void take_running_statistics(const ReplicaContext& ctx, double* host) override {
    DPAR_ENFORCE(scratch_.defined() && training_, Status::kInternal, describe(),
                 ": no training forward's statistics to take");
    ctx.stream->copy_to_host(host, stats().data, 2 * static_cast<size_t>(c_) * sizeof(double));
    host[2 * c_] = count_;
  }
  void apply_running_statistics(const ReplicaContext& ctx, const double* host) override {
    reserve(ctx);
    // The forward's own update from those sums (mean_invstd is scratch here: backward has read it).
    ctx.stream->copy_from_host(stats().data, host, 2 * static_cast<size_t>(c_) * sizeof(double));
    ctx.stream->run(call::BatchNormMoments{mean_invstd(), buffers_[0].ref(), buffers_[1].ref(), buffers_[2].ref(),
                                           stats(), host[2 * c_], eps_, momentum_});
  }
  void check_statistics_input(const Shape& in) const override {
    // A replica given no rows of a plain BatchNorm takes no statistics (forward leaves its buffers alone).
    if (in[0] == 0) return;
    DPAR_CHECK_ARG(in.numel() / c_ > 1, describe(),
                   ": expected more than 1 value per channel when training, got input ", in.str());
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
    const TensorRef running_mean = buffers_[0].ref(), running_var = buffers_[1].ref();
    if (!training_) {
      ctx.stream->run(call::BatchNormMoments{mean_invstd(), running_mean, running_var, {}, {}, 0.0, eps_, 0.0f});
      apply(ctx, in, out, n, l);
      return;
    }
    // This replica's sums, then (SyncBatchNorm) the whole batch's: Σx, Σx² per channel and the element count.
    ctx.stream->run(call::BatchNormStats{stats(), planes(in, n, l)});
    count_ = static_cast<double>(n * (n > 0 ? l : 0));
    if (sync) {
      double* sums = scratch_.data<double>();
      ctx.stream->copy_from_host(sums + 2 * c_, &count_, sizeof(double));
      ctx.collectives->sum(sums, static_cast<size_t>(2 * c_ + 1), DType::kF64);
      ctx.stream->copy_to_host(&count_, sums + 2 * c_, sizeof(double));
    }
    // A replica given no rows of a plain BatchNorm has no statistics: it leaves its running statistics alone (the
    // engine makes them replica 0's after the step).
    if (!sync && n == 0) return;
    DPAR_CHECK_ARG(count_ > 1.0, describe(), ": expected more than 1 value per channel when training, got input ",
                   in.shape().str());
    if (deferred_) {
      // The batch's mean and invstd as always, the running statistics moved in copies that are then dropped.
      ctx.stream->copy(shadow_.raw(), buffers_[0].raw(), buffers_[0].bytes());
      ctx.stream->copy(shadow_.f32() + c_, buffers_[1].raw(), buffers_[1].bytes());
      ctx.stream->run(call::BatchNormMoments{mean_invstd(), shadow_.rows(0, c_).ref(), shadow_.rows(c_, c_).ref(), {},
                                             stats(), count_, eps_, momentum_});
    } else {
      ctx.stream->run(call::BatchNormMoments{mean_invstd(), running_mean, running_var, buffers_[2].ref(), stats(),
                                             count_, eps_, momentum_});
    }
    apply(ctx, in, out, n, l);
  }

  // A ReLU after BatchNorm runs as its epilogue: in the normalisation's pass (no tensor of its own for the normalised
  // values), and backward masks the gradient with that output first.
  bool takes_epilogue(Epilogue epilogue) const override { return epilogue == Epilogue::kRelu; }
  std::vector<KernelKey> kernels(Epilogue epilogue) const override {
    std::vector<KernelKey> keys{{Op::kBatchNormStats},
                                {Op::kBatchNormMoments},
                                {Op::kBatchNormApply, DType::kF32, epilogue},
                                {Op::kBatchNormBackwardReduce},
                                {Op::kBatchNormBackwardApply}};
    if (epilogue != Epilogue::kNone) keys.push_back({Op::kActivationBackward});
    return keys;
  }
  void forward_with_epilogue(const ReplicaContext& ctx, Epilogue, const Tensor& in, const Tensor& out) override {
    relu_ = true;
    forward(ctx, in, out);
  }
  void backward_with_epilogue(const ReplicaContext& ctx, Epilogue, const Tensor& in, const Tensor& out,
                              const Tensor& dout, const Tensor& mid, const Tensor& din, bool accumulate) override {
    ctx.stream->run(call::ActivationBackward{Activation::kRelu, mid.ref(), dout.ref(), {}, out.ref()});
    backward(ctx, in, out, mid, din, accumulate);
  }

  void backward(const ReplicaContext& ctx, const Tensor& in, const Tensor&, const Tensor& dout, const Tensor& din,
                bool accumulate) override {
    const int64_t n = in.rows(), l = n > 0 ? in.numel() / (n * c_) : 0;
    const bool sync = training_ && dims_ == 0 && ctx.collectives != nullptr;
    if (n == 0 && !sync) {
      // No rows and no sums to take part in: this replica's parameter gradients are zero.
      if (affine_ && !accumulate)
        for (const Tensor& g : bound_grads_) ctx.stream->fill_zero(g.raw(), g.bytes());
      return;
    }
    // Σdy and Σdy·x̂ of this replica's rows give the parameter gradients (the reducer sums them over replicas); those
    // of the whole batch give the input's.
    ctx.stream->run(call::BatchNormBackwardReduce{local(), planes(dout, n, l), planes(in, n, l), mean_invstd()});
    TensorRef global;
    if (training_) {
      global = local();
      if (sync) {
        ctx.stream->copy(global_sums().data, local().data, 2 * static_cast<size_t>(c_) * sizeof(double));
        ctx.collectives->sum(global_sums().data, static_cast<size_t>(2 * c_), DType::kF64);
        global = global_sums();
      }
    }
    ctx.stream->run(call::BatchNormBackwardApply{din.defined() ? planes(din, n, l) : TensorRef{}, grad(0, affine_),
                                                 grad(1, affine_), local(), global, planes(dout, n, l),
                                                 planes(in, n, l), mean_invstd(), param(0, affine_), count_,
                                                 accumulate});
  }

 private:
  // out = the normalised in, then the ReLU when it runs as this layer's epilogue.
  void apply(const ReplicaContext& ctx, const Tensor& in, const Tensor& out, int64_t n, int64_t l) {
    ctx.stream->run(call::BatchNormApply{planes(out, n, l), planes(in, n, l), mean_invstd(), param(0, affine_),
                                         param(1, affine_), relu_ ? Epilogue::kRelu : Epilogue::kNone});
  }
  // t (B,C,L...) as the kernels read it: (N,C,L).
  TensorRef planes(const Tensor& t, int64_t n, int64_t l) const { return t.ref().view({n, c_, l}); }
  // Scratch of doubles in device memory: stats (2C + 1), mean_invstd (2C), local (2C), global (2C).
  void reserve(const ReplicaContext& ctx) {
    if (!scratch_.defined()) scratch_ = ctx.alloc(DType::kF64, Shape{8 * c_ + 1});
    if (deferred_ && !shadow_.defined()) shadow_ = ctx.alloc(DType::kF32, Shape{2 * c_});
  }
  TensorRef scratch(int64_t begin, int64_t count) const { return scratch_.rows(begin, count).ref(); }
  TensorRef stats() const { return scratch(0, 2 * c_ + 1); }
  TensorRef mean_invstd() const { return scratch(2 * c_ + 1, 2 * c_); }
  TensorRef local() const { return scratch(4 * c_ + 1, 2 * c_); }
  TensorRef global_sums() const { return scratch(6 * c_ + 1, 2 * c_); }

  int dims_;
  int64_t c_;
  float eps_, momentum_;
  bool affine_;
  Tensor scratch_;
  Tensor shadow_;          // deferred: the running mean and variance's copies a training forward moves
  bool deferred_ = false;  // defer_running_statistics
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
