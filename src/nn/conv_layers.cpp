// Convolution and pooling layers (PyTorch's nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d((1, 1))).
// Their math is a stateful op of the replica's backend (backend/ops.h), made on the layer's first forward and kept:
// it prepares its primitives once per input shape. Tensors are NCHW.
#include <cmath>

#include "common/error.h"
#include "nn/layer.h"

namespace dpar {
namespace {

// The largest extent, channel count or step a layer takes: far past any real model, and products of a few of them
// stay inside int64.
constexpr int64_t kMaxExtent = int64_t{1} << 24;

void check_extent(int64_t v, int64_t lo, const char* what) {
  DPAR_CHECK_ARG(v >= lo && v <= kMaxExtent, what, ": ", v, " must be ", lo, " to 2^24");
}

// The input's (N, C, H, W), checked against what a layer takes.
void check_nchw(const Shape& in, int64_t channels, const std::string& layer) {
  DPAR_CHECK_ARG(in.ndim() == 4, layer, " expects a 4-D (batch, channels, height, width) input, got ", in.str());
  DPAR_CHECK_ARG(channels <= 0 || in[1] == channels, layer, " expects ", channels, " input channels, got ", in[1],
                 " (input ", in.str(), ")");
}

class Conv2dLayer final : public Layer {
 public:
  explicit Conv2dLayer(const Conv2dSpec& spec) : spec_(spec) {}
  std::string describe() const override { return spec_.str(); }
  std::vector<ParamSpec> param_specs() const override {
    // PyTorch's nn.Conv2d.reset_parameters: kaiming_uniform_(a=sqrt(5)) gives bound 1/sqrt(fan_in) for the weight
    // and the bias alike, fan_in = in_channels / groups * kh * kw.
    // The weight's shape is checked first (Shape refuses one past 2^60 elements); fan_in is a product of its
    // extents, so it cannot overflow then.
    const Shape weight{spec_.out_channels, spec_.in_channels / spec_.groups, spec_.kernel_h, spec_.kernel_w};
    const int64_t fan_in = weight.row_numel();
    const float bound = 1.0f / std::sqrt(static_cast<float>(fan_in));
    std::vector<ParamSpec> specs{{"weight", weight, InitKind::kUniform, bound}};
    if (spec_.bias) {
      ParamSpec bias{"bias", Shape{spec_.out_channels}, InitKind::kUniform, bound};
      bias.no_decay = true;  // by name, not position: ParamSpec's later fields are not all flags
      specs.push_back(std::move(bias));
    }
    return specs;
  }
  Shape output_shape(const Shape& in) const override {
    check_nchw(in, spec_.in_channels, describe());
    const int64_t oh = spec_.out_h(in[2]), ow = spec_.out_w(in[3]);
    DPAR_CHECK_ARG(oh >= 1 && ow >= 1, describe(), ": input ", in.str(), " is smaller than the kernel's reach (",
                   spec_.dilation_h * (spec_.kernel_h - 1) + 1, "x", spec_.dilation_w * (spec_.kernel_w - 1) + 1,
                   " with padding ", spec_.pad_h, "x", spec_.pad_w, "): the output would be ", oh, "x", ow);
    return Shape{in[0], spec_.out_channels, oh, ow};
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<Conv2dLayer>(spec_); }

  // in (N,C_in,H,W), weight (C_out,C_in/groups,kh,kw), bias (C_out), out (N,C_out,OH,OW)
  void forward(const ReplicaContext& ctx, const Tensor& in, const Tensor& out) override {
    op(ctx).forward(out.ref(), operand(ctx, in), operand_param(0), param(1, spec_.bias));
  }
  void backward(const ReplicaContext& ctx, const Tensor& in, const Tensor&, const Tensor& dout, const Tensor& din,
                bool accumulate) override {
    Conv2dOp& o = op(ctx);
    if (din.defined()) o.backward_data(din.ref(), dout.ref(), operand_param(0));
    o.backward_weights(grad(0), grad(1, spec_.bias), dout.ref(), saved_operand(in), accumulate);
  }

  // Under a bf16 policy the op reads the input rounded to bf16 (kept from forward for the weights' gradient) and
  // the step's bf16 weight; bias, output and gradients stay f32 (Conv2dSpec::dtype).
  bool autocasts() const override { return true; }
  void set_compute_dtype(DType dtype) override {
    if (dtype != compute_dtype_) op_.reset();  // its primitives were made for the other dtype
    Layer::set_compute_dtype(dtype);
  }

  // A ReLU after the convolution is the op's epilogue (oneDNN's post-op, or cuDNN's convolution and then the ReLU
  // on its output); backward masks the gradient with the output, then runs the convolution's backward from it.
  bool takes_epilogue(Epilogue epilogue) const override { return epilogue == Epilogue::kRelu; }
  std::vector<KernelKey> kernels(Epilogue epilogue) const override {
    std::vector<KernelKey> keys;
    if (epilogue != Epilogue::kNone) keys.push_back({Op::kActivationBackward});  // masks the gradient first
    if (compute_dtype_ != DType::kF32) keys.push_back({Op::kConvert, compute_dtype_});
    return keys;
  }
  void forward_with_epilogue(const ReplicaContext& ctx, Epilogue epilogue, const Tensor& in,
                             const Tensor& out) override {
    op(ctx, epilogue).forward(out.ref(), operand(ctx, in), operand_param(0), param(1, spec_.bias));
  }
  void backward_with_epilogue(const ReplicaContext& ctx, Epilogue epilogue, const Tensor& in, const Tensor& out,
                              const Tensor& dout, const Tensor& mid, const Tensor& din, bool accumulate) override {
    ctx.stream->run(call::ActivationBackward{Activation::kRelu, mid.ref(), dout.ref(), {}, out.ref()});
    Conv2dOp& o = op(ctx, epilogue);
    if (din.defined()) o.backward_data(din.ref(), mid.ref(), operand_param(0));
    o.backward_weights(grad(0), grad(1, spec_.bias), mid.ref(), saved_operand(in), accumulate);
  }

 private:
  // The input as the op reads it: in itself, or its copy in the compute dtype (made here, kept for backward).
  TensorRef operand(const ReplicaContext& ctx, const Tensor& in) { return in_low_.round(ctx, compute_dtype_, in).ref(); }
  TensorRef saved_operand(const Tensor& in) const { return in_low_.rounded(compute_dtype_, in, describe()).ref(); }
  // The op, made by the replica's backend on first use for the epilogue the model runs this layer with (the fusion
  // pass fixes it for the model's life), and kept: not copied by clone().
  Conv2dOp& op(const ReplicaContext& ctx, Epilogue epilogue = Epilogue::kNone) {
    if (!op_) {
      Conv2dSpec spec = spec_;
      spec.epilogue = epilogue;
      spec.dtype = compute_dtype_;
      op_ = ctx.stream->make_conv2d(spec);
      op_epilogue_ = epilogue;
    }
    DPAR_ENFORCE(op_epilogue_ == epilogue, Status::kInternal, describe(), ": its op was made for another epilogue");
    return *op_;
  }
  Conv2dSpec spec_;
  std::unique_ptr<Conv2dOp> op_;
  Epilogue op_epilogue_ = Epilogue::kNone;
  LowPrecisionBuffer in_low_;
};

class Pool2dLayer final : public Layer {
 public:
  explicit Pool2dLayer(const Pool2dSpec& spec) : spec_(spec) {}
  std::string describe() const override { return spec_.str(); }
  Shape output_shape(const Shape& in) const override {
    check_nchw(in, 0, describe());
    const int64_t oh = spec_.out_h(in[2]), ow = spec_.out_w(in[3]);
    DPAR_CHECK_ARG(oh >= 1 && ow >= 1, describe(), ": input ", in.str(), " is smaller than the window: the output ",
                   "would be ", oh, "x", ow);
    return Shape{in[0], in[1], oh, ow};
  }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<Pool2dLayer>(spec_); }

  // in (N,C,H,W), out (N,C,OH,OW)
  void forward(const ReplicaContext& ctx, const Tensor& in, const Tensor& out) override {
    op(ctx).forward(out.ref(), in.ref());
  }
  void backward(const ReplicaContext& ctx, const Tensor& in, const Tensor& out, const Tensor& dout,
                const Tensor& din, bool) override {
    if (!din.defined()) return;
    op(ctx).backward(din.ref(), dout.ref(), in.ref(), out.ref());
  }

 private:
  Pool2dOp& op(const ReplicaContext& ctx) {
    if (!op_) op_ = ctx.stream->make_pool2d(spec_);
    return *op_;
  }
  Pool2dSpec spec_;
  std::unique_ptr<Pool2dOp> op_;
};

// A sliding window's kernel (>= 1), stride (>= 1) and padding (>= 0), each named as the C ABI's arrays name it.
void check_window(int64_t kernel_h, int64_t kernel_w, int64_t stride_h, int64_t stride_w, int64_t pad_h,
                  int64_t pad_w) {
  check_extent(kernel_h, 1, "kernel_size[0]");
  check_extent(kernel_w, 1, "kernel_size[1]");
  check_extent(stride_h, 1, "stride[0]");
  check_extent(stride_w, 1, "stride[1]");
  check_extent(pad_h, 0, "padding[0]");
  check_extent(pad_w, 0, "padding[1]");
}

}  // namespace

std::unique_ptr<Layer> make_conv2d(const Conv2dSpec& spec) {
  check_extent(spec.in_channels, 1, "in_channels");
  check_extent(spec.out_channels, 1, "out_channels");
  check_window(spec.kernel_h, spec.kernel_w, spec.stride_h, spec.stride_w, spec.pad_h, spec.pad_w);
  check_extent(spec.dilation_h, 1, "dilation[0]");
  check_extent(spec.dilation_w, 1, "dilation[1]");
  check_extent(spec.groups, 1, "groups");
  DPAR_CHECK_ARG(spec.in_channels % spec.groups == 0, "in_channels: ", spec.in_channels,
                 " is not divisible by groups (", spec.groups, ")");
  DPAR_CHECK_ARG(spec.out_channels % spec.groups == 0, "out_channels: ", spec.out_channels,
                 " is not divisible by groups (", spec.groups, ")");
  DPAR_CHECK_ARG(spec.epilogue == Epilogue::kNone || spec.epilogue == Epilogue::kRelu, "epilogue: unknown kind ",
                 static_cast<int>(spec.epilogue));
  DPAR_CHECK_ARG(spec.epilogue == Epilogue::kNone, "epilogue: a conv2d layer computes no activation of its own ",
                 "(its backward takes the convolution's gradient); add the activation after it");
  return std::make_unique<Conv2dLayer>(spec);
}

std::unique_ptr<Layer> make_pool2d(const Pool2dSpec& spec) {
  DPAR_CHECK_ARG(spec.kind == PoolKind::kMax || spec.kind == PoolKind::kAvg, "pool: unknown kind ",
                 static_cast<int>(spec.kind));
  DPAR_CHECK_ARG(!spec.global, "pool: a global pool is make_adaptive_avg_pool2d's");
  check_window(spec.kernel_h, spec.kernel_w, spec.stride_h, spec.stride_w, spec.pad_h, spec.pad_w);
  // PyTorch's rule: a window must hold at least one input element beside its padding.
  DPAR_CHECK_ARG(2 * spec.pad_h <= spec.kernel_h && 2 * spec.pad_w <= spec.kernel_w, "padding: ", spec.pad_h, "x",
                 spec.pad_w, " must be at most half the kernel size ", spec.kernel_h, "x", spec.kernel_w);
  return std::make_unique<Pool2dLayer>(spec);
}

std::unique_ptr<Layer> make_adaptive_avg_pool2d(int64_t output_h, int64_t output_w) {
  check_extent(output_h, 1, "output_h");
  check_extent(output_w, 1, "output_w");
  DPAR_ENFORCE(output_h == 1 && output_w == 1, Status::kNotSupported, "adaptive_avg_pool2d: output size ", output_h,
               "x", output_w, " is not supported (only 1x1, global average pooling)");
  Pool2dSpec spec;
  spec.kind = PoolKind::kAvg;
  spec.global = true;
  return std::make_unique<Pool2dLayer>(spec);
}

}  // namespace dpar
