// The built-in layers. Their math is the replica's backend's (through its Stream); here are shapes, parameters
// and saved state.
#include <algorithm>
#include <cmath>

#include "common/error.h"
#include "nn/layer.h"

namespace dpar {

Tensor ReplicaContext::alloc(DType dtype, const Shape& shape) const {
  maybe_fail(Fault::kAlloc, "allocation");
  return Tensor::empty(dtype, shape, device);
}

void Layer::forward_with_epilogue(const ReplicaContext&, Epilogue, const Tensor&, const Tensor&) {
  fail(Status::kInternal, describe(), " takes no epilogue");
}

void Layer::backward_with_epilogue(const ReplicaContext&, Epilogue, const Tensor&, const Tensor&, const Tensor&,
                                   const Tensor&, const Tensor&, bool) {
  fail(Status::kInternal, describe(), " takes no epilogue");
}

void ReplicaContext::maybe_fail(Fault fault, const char* where) const {
  if (armed_fault && *armed_fault == fault) {
    *armed_fault = Fault::kNone;
    fail(fault == Fault::kAlloc ? Status::kOutOfMemory : Status::kDevice, device.str(), ": injected fault in ",
         where);
  }
}

namespace {

class Linear final : public Layer {
 public:
  Linear(int64_t in, int64_t out, bool bias) : in_(in), out_(out), bias_(bias) {}
  std::string describe() const override {
    return "linear(" + std::to_string(in_) + " -> " + std::to_string(out_) + (bias_ ? "" : ", no bias") + ")";
  }
  std::vector<ParamSpec> param_specs() const override {
    // PyTorch's nn.Linear.reset_parameters: kaiming_uniform_(a=sqrt(5)) gives bound 1/sqrt(fan_in) for the
    // weight, and the bias uses the same bound.
    const float bound = 1.0f / std::sqrt(static_cast<float>(in_));
    std::vector<ParamSpec> specs{{"weight", Shape{out_, in_}, InitKind::kUniform, bound}};
    if (bias_) {
      ParamSpec bias{"bias", Shape{out_}, InitKind::kUniform, bound};
      bias.no_decay = true;  // by name, not position: ParamSpec's later fields are not all flags
      specs.push_back(std::move(bias));
    }
    return specs;
  }
  // (*, C_in) -> (*, C_out), as nn.Linear: the leading extents are rows (a sequence's positions among them).
  Shape output_shape(const Shape& in) const override {
    DPAR_CHECK_ARG(in.ndim() >= 2 && in[in.ndim() - 1] == in_, describe(), " expects (batch, ..., ", in_, "), got ",
                   in.str());
    return in.with_dim(in.ndim() - 1, out_);
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<Linear>(in_, out_, bias_); }

  // in (*,C_in), weight (C_out,C_in), bias (C_out), out (*,C_out)
  void forward(const ReplicaContext& ctx, const Tensor& in, const Tensor& out) override {
    ctx.stream->run(call::LinearForward{out.ref(), operand(ctx, in), operand_param(0), param(1, bias_)});
  }
  void backward(const ReplicaContext& ctx, const Tensor& in, const Tensor&, const Tensor& dout, const Tensor& din,
                bool accumulate) override {
    call::LinearBackward c{din.ref(), grad(0), grad(1, bias_)};
    c.dout = dout.ref();
    c.inp = saved_operand(in);
    c.weight = operand_param(0);
    c.accumulate = accumulate;
    c.dout_low = rounded_gradient_room(ctx, dout.shape());
    ctx.stream->run(c);
  }

  // Under a bf16 policy the GEMMs read the input rounded to bf16 (kept from forward for backward's weight
  // gradient: half the f32 input's bytes) and the step's bf16 copy of the weight; bias, epilogue and results f32,
  // or, where the model keeps the output in bf16, the result rounded after the bias and a ReLU, or a GELU run on the
  // rounded pre-activation (kept for backward in bf16 too), as autocast's linear followed by GELU.
  bool autocasts() const override { return true; }
  bool reads_rounded_input(const Stream&) const override { return compute_dtype_ != DType::kF32; }
  std::vector<KernelKey> rounded_output_kernels(Epilogue epilogue, DType dtype) const override {
    if (compute_dtype_ == DType::kF32 || dtype != compute_dtype_) return {};
    // Backward reads the output for the ReLU's mask, and a GELU's pre-activation, kept rounded with the output.
    return {{Op::kLinearForward, compute_dtype_, epilogue, compute_dtype_},
            {Op::kLinearBackward, compute_dtype_, epilogue,
             epilogue == Epilogue::kNone ? DType::kF32 : compute_dtype_}};
  }

  // An activation after a linear layer runs as its epilogue: the bias and a ReLU are one pass after the GEMM, and
  // backward masks the gradient and sums the bias gradient in one pass before the GEMMs; a GELU is its own pass
  // where the backend does not fuse it (Stream::run), over the pre-activation the layer keeps for its backward.
  bool takes_epilogue(Epilogue epilogue) const override { return epilogue != Epilogue::kNone; }
  std::vector<KernelKey> kernels(Epilogue epilogue) const override {
    std::vector<KernelKey> keys{{Op::kLinearForward, compute_dtype_, epilogue},
                                {Op::kLinearBackward, compute_dtype_, epilogue}};
    if (compute_dtype_ != DType::kF32) keys.push_back({Op::kConvert, compute_dtype_});
    return keys;
  }
  void forward_with_epilogue(const ReplicaContext& ctx, Epilogue epilogue, const Tensor& in,
                             const Tensor& out) override {
    // The pre-activation a GELU's backward reads, in the output's dtype: kept rounded where the output is.
    if (epilogue == Epilogue::kGelu &&
        (!pre_.defined() || pre_.dtype() != out.dtype() || pre_.numel() < out.numel()))
      pre_ = ctx.alloc(out.dtype(), Shape{std::max<int64_t>(out.numel(), 1)});
    ctx.stream->run(call::LinearForward{out.ref(), operand(ctx, in), operand_param(0), param(1, bias_),
                                        pre(epilogue, out), epilogue});
  }
  void backward_with_epilogue(const ReplicaContext& ctx, Epilogue epilogue, const Tensor& in, const Tensor& out,
                              const Tensor& dout, const Tensor& mid, const Tensor& din, bool accumulate) override {
    call::LinearBackward c{din.ref(), grad(0), grad(1, bias_), mid.ref(), dout.ref(), saved_operand(in),
                           operand_param(0), out.ref(), pre(epilogue, out), epilogue, accumulate};
    c.dout_low = rounded_gradient_room(ctx, out.shape());
    ctx.stream->run(c);
  }

 private:
  // The gradient rounded for the backward GEMMs: the replica's call room (absent in f32).
  TensorRef rounded_gradient_room(const ReplicaContext& ctx, const Shape& shape) const {
    return compute_dtype_ == DType::kF32 ? TensorRef{} : ctx.call_room(compute_dtype_, shape);
  }
  // The input as the GEMMs read it: in itself, or its copy in the compute dtype (made here, kept for backward).
  TensorRef operand(const ReplicaContext& ctx, const Tensor& in) { return in_low_.round(ctx, compute_dtype_, in).ref(); }
  TensorRef saved_operand(const Tensor& in) const { return in_low_.rounded(compute_dtype_, in, describe()).ref(); }
  // The pre-activation of the last forward with a GELU epilogue, of out's shape; absent for the other epilogues.
  TensorRef pre(Epilogue epilogue, const Tensor& out) const {
    return epilogue == Epilogue::kGelu ? pre_.rows(0, out.numel()).reshaped(out.shape()).ref() : TensorRef{};
  }
  Tensor pre_;
  LowPrecisionBuffer in_low_;

  int64_t in_, out_;
  bool bias_;
};

class ActivationLayer final : public Layer {
 public:
  explicit ActivationLayer(Activation kind) : kind_(kind) {}
  std::string describe() const override { return activation_name(kind_); }
  Shape output_shape(const Shape& in) const override { return in; }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<ActivationLayer>(kind_); }
  Activation kind() const { return kind_; }
  Epilogue as_epilogue() const override {
    switch (kind_) {
      case Activation::kRelu: return Epilogue::kRelu;
      case Activation::kGelu: return Epilogue::kGelu;
      default: return Epilogue::kNone;
    }
  }

  std::vector<KernelKey> kernels(Epilogue) const override {
    return {{Op::kActivationForward}, {Op::kActivationBackward}};
  }
  void forward(const ReplicaContext& ctx, const Tensor& in, const Tensor& out) override {
    ctx.stream->run(call::ActivationForward{kind_, out.ref(), in.ref()});
  }
  void backward(const ReplicaContext& ctx, const Tensor& in, const Tensor& out, const Tensor& dout,
                const Tensor& din, bool) override {
    if (din.defined()) ctx.stream->run(call::ActivationBackward{kind_, din.ref(), dout.ref(), in.ref(), out.ref()});
  }

 private:
  Activation kind_;
};

class Dropout final : public Layer {
 public:
  explicit Dropout(float p) : p_(p) {}
  std::string describe() const override { return "dropout(p=" + std::to_string(p_) + ")"; }
  Shape output_shape(const Shape& in) const override { return in; }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<Dropout>(p_); }
  std::vector<KernelKey> kernels(Epilogue) const override { return {{Op::kDropoutForward}, {Op::kDropoutBackward}}; }

  void forward(const ReplicaContext& ctx, const Tensor& in, const Tensor& out) override {
    const int64_t n = in.numel();
    active_ = ctx.training && p_ > 0.0f;
    if (!active_) {
      ctx.stream->copy(out.f32(), in.f32(), static_cast<size_t>(n) * sizeof(float));
      return;
    }
    if (!mask_.defined() || mask_.numel() < n) mask_ = ctx.alloc(DType::kF32, Shape{n});
    // Each replica draws from its own stream, and the stream's position persists across steps.
    ctx.stream->run(call::DropoutForward{out.ref(), mask_.rows(0, n).ref(), in.ref(), p_, ctx.rng_seed,
                                         *ctx.rng_offset});
    *ctx.rng_offset += static_cast<uint64_t>(n);
  }
  void backward(const ReplicaContext& ctx, const Tensor& in, const Tensor&, const Tensor& dout, const Tensor& din,
                bool) override {
    if (!din.defined()) return;
    const int64_t n = in.numel();
    if (active_)
      ctx.stream->run(call::DropoutBackward{din.ref(), dout.ref(), mask_.rows(0, n).ref()});
    else
      ctx.stream->copy(din.f32(), dout.f32(), static_cast<size_t>(n) * sizeof(float));
  }

 private:
  float p_;
  bool active_ = false;
  Tensor mask_;  // the multipliers of the last forward, kept for backward
};

}  // namespace

TensorRef ReplicaContext::call_room(DType dtype, const Shape& shape) const {
  // Held as f32 elements (the widest dtype a call asks for): as many as cover the bytes.
  const int64_t floats = (checked_mul(shape.numel(), static_cast<int64_t>(dtype_size(dtype))) + 3) / 4;
  Tensor& memory = *call_scratch;
  if (!memory.defined() || memory.numel() < floats) memory = alloc(DType::kF32, Shape{std::max<int64_t>(floats, 1)});
  return TensorRef::contiguous(memory.raw(), dtype, shape.data(), static_cast<int>(shape.ndim()));
}

Tensor LowPrecisionBuffer::round(const ReplicaContext& ctx, DType dtype, const Tensor& x) {
  if (dtype == DType::kF32) return x;
  if (x.dtype() == dtype) {
    memory_ = Tensor();  // the input comes rounded: this buffer's room is not needed
    last_ = x;
    return x;
  }
  const int64_t n = std::max<int64_t>(x.numel(), 1);
  if (!memory_.defined() || memory_.dtype() != dtype || memory_.numel() < n) memory_ = ctx.alloc(dtype, Shape{n});
  Tensor low = memory_.rows(0, x.numel()).reshaped(x.shape());
  if (x.numel() > 0) ctx.stream->run(call::Convert{low.ref(), x.ref()});
  last_ = low;
  return low;
}

Tensor LowPrecisionBuffer::rounded(DType dtype, const Tensor& x, const std::string& who) const {
  if (dtype == DType::kF32) return x;
  DPAR_ENFORCE(last_.defined() && last_.dtype() == dtype && last_.shape() == x.shape(), Status::kInternal, who,
               ": backward without its forward's ", dtype_name(dtype), " input");
  return last_;
}

std::unique_ptr<Layer> make_linear(int64_t in_features, int64_t out_features, bool bias) {
  DPAR_CHECK_ARG(in_features >= 1 && in_features <= (1 << 24), "in_features: ", in_features, " must be 1 to 2^24");
  DPAR_CHECK_ARG(out_features >= 1 && out_features <= (1 << 24), "out_features: ", out_features,
                 " must be 1 to 2^24");
  return std::make_unique<Linear>(in_features, out_features, bias);
}

std::unique_ptr<Layer> make_activation(Activation activation) {
  return std::make_unique<ActivationLayer>(activation);
}

std::unique_ptr<Layer> make_dropout(float p) {
  DPAR_CHECK_ARG(p >= 0.0f && p < 1.0f, "p: dropout probability ", p, " must be in [0, 1)");
  return std::make_unique<Dropout>(p);
}

}  // namespace dpar
