#include "backend/cpu/cpu_backend.h"

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "backend/attention_refs.h"
#include "comm/threads_comm.h"
#include "common/error.h"
#include "common/f16.h"
#include "device/worker_pool.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/batchnorm.h"
#include "kernels/cpu/dnnl_ops.h"
#include "kernels/cpu/fixed_point.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/norm_embedding.h"

namespace dpar {
namespace {
namespace k = kernels::cpu;

// An op's NCHW memory as oneDNN's f32 primitives read it.
float* op_f32(const TensorRef& r) { return r.contiguous_as<float>("a convolution or pooling op"); }

// The bf16 operands of a mixed-precision op (its input and weight).
uint16_t* op_bf16(const TensorRef& r) { return r.contiguous_as<uint16_t>("a bf16 convolution"); }

// The op seam over the CPU kernels' oneDNN primitives (kernels/cpu/dnnl_ops.h), which know no backend. In bf16
// (spec.dtype) inp and weight are bf16 and the rest f32.
class CpuConv2dOp final : public Conv2dOp {
 public:
  explicit CpuConv2dOp(const Conv2dSpec& spec) : conv_(spec), bf16_(spec.dtype == DType::kBF16) {}
  void forward(const TensorRef& out, const TensorRef& inp, const TensorRef& weight, const TensorRef& bias) override {
    if (bf16_)
      conv_.forward(op_f32(out), op_bf16(inp), op_bf16(weight), op_f32(bias), inp.size(0), inp.size(2), inp.size(3));
    else
      conv_.forward(op_f32(out), op_f32(inp), op_f32(weight), op_f32(bias), inp.size(0), inp.size(2), inp.size(3));
  }
  void backward_data(const TensorRef& dinp, const TensorRef& dout, const TensorRef& weight) override {
    if (bf16_)
      conv_.backward_data(op_f32(dinp), op_f32(dout), op_bf16(weight), dinp.size(0), dinp.size(2), dinp.size(3));
    else
      conv_.backward_data(op_f32(dinp), op_f32(dout), op_f32(weight), dinp.size(0), dinp.size(2), dinp.size(3));
  }
  void backward_weights(const TensorRef& dweight, const TensorRef& dbias, const TensorRef& dout, const TensorRef& inp,
                        bool accumulate) override {
    if (bf16_)
      conv_.backward_weights(op_f32(dweight), op_f32(dbias), op_f32(dout), op_bf16(inp), inp.size(0), inp.size(2),
                             inp.size(3), accumulate);
    else
      conv_.backward_weights(op_f32(dweight), op_f32(dbias), op_f32(dout), op_f32(inp), inp.size(0), inp.size(2),
                             inp.size(3), accumulate);
  }

 private:
  k::Conv2d conv_;
  bool bf16_;
};

class CpuPool2dOp final : public Pool2dOp {
 public:
  explicit CpuPool2dOp(const Pool2dSpec& spec) : pool_(spec) {}
  void forward(const TensorRef& out, const TensorRef& inp) override {
    pool_.forward(op_f32(out), op_f32(inp), inp.size(0), inp.size(1), inp.size(2), inp.size(3));
  }
  void backward(const TensorRef& dinp, const TensorRef& dout, const TensorRef&, const TensorRef&) override {
    pool_.backward(op_f32(dinp), op_f32(dout), dinp.size(0), dinp.size(1), dinp.size(2), dinp.size(3));
  }

 private:
  k::Pool2d pool_;
};

// The fused attention kernel of kernels/cpu/attention.h; it keeps the kernel's scratch tiles, nothing per shape.
class CpuAttentionOp final : public AttentionOp {
 public:
  explicit CpuAttentionOp(const AttentionSpec& spec) : spec_(spec) {}
  void forward(const TensorRef& out, const TensorRef& lse, const TensorRef& q, const TensorRef& k, const TensorRef& v,
               float dropout_p, uint64_t seed, uint64_t offset) override {
    namespace a = attention_refs;
    const auto sh = a::shape(spec_, q, k);
    const int64_t C = sh.heads * sh.D;
    if (spec_.dtype == DType::kBF16) {
      return k::attention_forward_bf16(gemm(), a::contiguous(out, "out", sh.B, sh.L, C), a::lse(lse, sh),
                                       a::tensor_bf16(q, "q", sh.B, sh.L, C), a::tensor_bf16(k, "k", sh.B, sh.S, C),
                                       a::tensor_bf16(v, "v", sh.B, sh.S, C), sh, a::dropout(dropout_p, seed, offset),
                                       bytes(k::attention_bf16_scratch_bytes(sh, false)));
    }
    k::attention_forward(a::contiguous(out, "out", sh.B, sh.L, C), a::lse(lse, sh), a::tensor(q, "q", sh.B, sh.L, C),
                         a::tensor(k, "k", sh.B, sh.S, C), a::tensor(v, "v", sh.B, sh.S, C), sh,
                         a::dropout(dropout_p, seed, offset), k::AttentionTiles::kSgemm, scratch(sh.D));
  }
  void backward(const TensorRef& dq, const TensorRef& dk, const TensorRef& dv, const TensorRef& dout,
                const TensorRef& q, const TensorRef& k, const TensorRef& v, const TensorRef& out, const TensorRef& lse,
                float dropout_p, uint64_t seed, uint64_t offset) override {
    namespace a = attention_refs;
    const auto sh = a::shape(spec_, q, k);
    const int64_t C = sh.heads * sh.D;
    if (spec_.dtype == DType::kBF16) {
      return k::attention_backward_bf16(
          gemm(), a::tensor(dq, "dq", sh.B, sh.L, C), a::tensor(dk, "dk", sh.B, sh.S, C),
          a::tensor(dv, "dv", sh.B, sh.S, C), a::contiguous(dout, "dout", sh.B, sh.L, C),
          a::tensor_bf16(q, "q", sh.B, sh.L, C), a::tensor_bf16(k, "k", sh.B, sh.S, C),
          a::tensor_bf16(v, "v", sh.B, sh.S, C), a::contiguous(out, "out", sh.B, sh.L, C), a::lse(lse, sh), sh,
          a::dropout(dropout_p, seed, offset), bytes(k::attention_bf16_scratch_bytes(sh, true)));
    }
    k::attention_backward(a::tensor(dq, "dq", sh.B, sh.L, C), a::tensor(dk, "dk", sh.B, sh.S, C),
                          a::tensor(dv, "dv", sh.B, sh.S, C), a::contiguous(dout, "dout", sh.B, sh.L, C),
                          a::tensor(q, "q", sh.B, sh.L, C), a::tensor(k, "k", sh.B, sh.S, C),
                          a::tensor(v, "v", sh.B, sh.S, C), a::contiguous(out, "out", sh.B, sh.L, C),
                          a::lse(lse, sh), sh, a::dropout(dropout_p, seed, offset), k::AttentionTiles::kSgemm,
                          scratch(sh.D));
  }

 private:
  // The kernel's tiles, kept between calls: fresh pages on every call cost page faults.
  float* scratch(int64_t D) {
    const auto n = static_cast<size_t>(k::attention_scratch_floats(D));
    if (scratch_.size() < n) scratch_.resize(n);
    return scratch_.data();
  }

  // The bf16 routines' rows (and backward's bf16 dout), as floats so that they are aligned for every element type.
  void* bytes(int64_t n) {
    const auto floats = static_cast<size_t>((n + 3) / 4);
    if (scratch_.size() < floats) scratch_.resize(floats);
    return scratch_.data();
  }
  // The bf16 products' primitives, per shape: the op's own (a layer's op runs on its replica's threads, one call at
  // a time), made on the first bf16 call.
  k::Bf16Gemm& gemm() {
    if (!gemm_) gemm_ = std::make_unique<k::Bf16Gemm>();
    return *gemm_;
  }

  AttentionSpec spec_;
  std::vector<float> scratch_;
  std::unique_ptr<k::Bf16Gemm> gemm_;
};

class CpuStream final : public Stream {
 public:
  explicit CpuStream(Device device) : Stream(device) {}

  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes && dst != src) std::memcpy(dst, src, bytes);
  }
  void copy_from_host(void* dst, const void* host_src, size_t bytes) override { copy(dst, host_src, bytes); }
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override { copy(host_dst, src, bytes); }
  void fill_zero(void* dst, size_t bytes) override {
    if (bytes) std::memset(dst, 0, bytes);
  }
  void synchronize() override {}

  // The kernels this backend has: f32 for all (the reproducible mode's fixed point among them: MaxExponent, ToGrid
  // and FromGrid, whose dtype is their f32 side's), and bf16 for conversions; ReLU fused into a linear layer's and a
  // BatchNorm's pass (the GELU epilogue composes: Stream::run). Mixed precision's bf16 linear layers (ReLU and GELU
  // fused; the output kept in bf16 with any epilogue) where oneDNN runs bf16 natively
  // (kernels::cpu::bf16_support): elsewhere it would emulate bf16 products in f32 code, slower than f32 itself. f16
  // only for conversions: oneDNN 2.6 has no f16 GEMM or convolution on CPUs (kernels::cpu::f16_unsupported_why).
  bool supports(const KernelKey& key) const override {
    if (key.out != DType::kF32) {  // an output kept in bf16: a bf16 linear layer's (oneDNN's bf16 destination)
      const bool linear = key.op == Op::kLinearForward || key.op == Op::kLinearBackward;
      if (key.op == Op::kLayerNormForward) return key.dtype == DType::kF32 && key.out == DType::kBF16;  // or LN's
      return linear && key.dtype == DType::kBF16 && key.out == DType::kBF16 && k::bf16_support(nullptr);
    }
    if (key.dtype == DType::kF16) return key.op == Op::kConvert;
    if (key.dtype == DType::kBF16) {
      if (key.op == Op::kConvert) return true;
      const bool linear = key.op == Op::kLinearForward || key.op == Op::kLinearBackward;
      return linear && k::bf16_support(nullptr);
    }
    if (key.dtype != DType::kF32) return false;
    switch (key.op) {
      case Op::kLinearForward:
      case Op::kLinearBackward:
      case Op::kBatchNormApply: return key.epilogue == Epilogue::kNone || key.epilogue == Epilogue::kRelu;
      default: return key.epilogue == Epilogue::kNone;
    }
  }
  std::string lacks_why(const KernelKey& key) const override {
    const char* why = "";
    const bool linear = key.op == Op::kLinearForward || key.op == Op::kLinearBackward;
    if (key.dtype == DType::kF16 && linear) return k::f16_unsupported_why();
    return key.dtype == DType::kBF16 && linear && !k::bf16_support(&why) ? why : "";
  }
  double sum_squares(const TensorRef& x) override {
    return k::sum_squares(x.contiguous_as<float>("sum_squares"), x.numel());
  }

  std::unique_ptr<Conv2dOp> make_conv2d(const Conv2dSpec& spec) override {
    if (spec.dtype != DType::kF32) {
      const char* why = "";
      if (spec.dtype == DType::kF16)
        fail(Status::kNotSupported, spec.str(), " in f16 on ", device().str(), ": ", k::f16_unsupported_why());
      if (spec.dtype != DType::kBF16)
        fail(Status::kNotSupported, spec.str(), " in ", dtype_name(spec.dtype), " on ", device().str(),
             ": this backend's convolutions compute in f32 or bf16");
      if (!k::bf16_support(&why)) fail(Status::kNotSupported, spec.str(), " in bf16 on ", device().str(), ": ", why);
    }
    return std::make_unique<CpuConv2dOp>(spec);
  }
  std::unique_ptr<Pool2dOp> make_pool2d(const Pool2dSpec& spec) override {
    return std::make_unique<CpuPool2dOp>(spec);
  }
  std::unique_ptr<AttentionOp> make_attention(const AttentionSpec& spec) override {
    DPAR_CHECK_ARG(spec.heads >= 1, spec.str(), ": heads must be >= 1, got ", spec.heads);
    if (spec.dtype != DType::kF32) {
      const char* why = "";
      if (spec.dtype != DType::kBF16)
        fail(Status::kNotSupported, spec.str(), " in ", dtype_name(spec.dtype), " on ", device().str(),
             ": this backend's attention computes in f32 or bf16");
      if (!k::bf16_support(&why)) fail(Status::kNotSupported, spec.str(), " in bf16 on ", device().str(), ": ", why);
    }
    return std::make_unique<CpuAttentionOp>(spec);
  }
  bool has_attention(DType dtype) const override {
    const char* why = "";
    return dtype == DType::kF32 || (dtype == DType::kBF16 && k::bf16_support(&why));
  }

 protected:
  void execute(const KernelCall& call) override {
    std::visit([this](const auto& c) { run_call(c); }, call);
  }

 private:
  // A call's argument as the typed kernels read it (contiguous elements of the kernel's dtype); an error names the
  // call. Nothing is kept between calls: a stream runs calls from its worker and its communication thread.
  template <class C>
  static float* f32(const C&, const TensorRef& r) { return r.contiguous_as<float>(C::kName); }
  template <class C>
  static double* f64(const C&, const TensorRef& r) { return r.contiguous_as<double>(C::kName); }
  template <class C>
  static uint16_t* bf16(const C&, const TensorRef& r) { return r.contiguous_as<uint16_t>(C::kName); }
  template <class C>
  static uint16_t* f16(const C&, const TensorRef& r) {
    return reinterpret_cast<uint16_t*>(r.contiguous_as<Half>(C::kName));
  }
  template <class C>
  static int32_t* i32(const C&, const TensorRef& r) { return r.contiguous_as<int32_t>(C::kName); }
  template <class C>
  static int64_t* i64(const C&, const TensorRef& r) { return r.contiguous_as<int64_t>(C::kName); }

  void run_call(const call::LinearForward& c) {
    if (c.dtype() == DType::kBF16) {
      std::lock_guard<std::mutex> one_at_a_time(bf16_mutex_);
      if (c.out_dtype() == DType::kBF16)
        return k::linear_forward_bf16_rounded(bf16_gemm(), bf16(c, c.out), bf16(c, c.pre), bf16(c, c.inp),
                                              bf16(c, c.weight), f32(c, c.bias), c.inp.leading(), c.inp.size(-1),
                                              c.out.size(-1), c.epilogue);
      return k::linear_forward_bf16(bf16_gemm(), f32(c, c.out), f32(c, c.pre), bf16(c, c.inp), bf16(c, c.weight),
                                    f32(c, c.bias), c.inp.leading(), c.inp.size(-1), c.out.size(-1), c.epilogue);
    }
    (c.epilogue == Epilogue::kRelu ? k::linear_relu_forward : k::linear_forward)(
        f32(c, c.out), f32(c, c.inp), f32(c, c.weight), f32(c, c.bias), c.inp.leading(), c.inp.size(-1),
        c.out.size(-1));
  }
  void run_call(const call::LinearBackward& c) {
    const int64_t B = c.inp.leading(), C_in = c.inp.size(-1), C_out = c.dout.size(-1);
    if (c.dtype() == DType::kBF16) {
      std::lock_guard<std::mutex> one_at_a_time(bf16_mutex_);
      // Where the forward kept its output rounded, it kept a GELU's pre-activation rounded too.
      const bool rounded_out = c.out_dtype() == DType::kBF16;
      return k::linear_backward_bf16(bf16_gemm(), f32(c, c.dinp), f32(c, c.dweight), f32(c, c.dbias), f32(c, c.dpre),
                                     bf16(c, c.dout_low), f32(c, c.dout), rounded_out ? nullptr : f32(c, c.out),
                                     rounded_out ? bf16(c, c.out) : nullptr, rounded_out ? nullptr : f32(c, c.pre),
                                     rounded_out ? bf16(c, c.pre) : nullptr, bf16(c, c.inp), bf16(c, c.weight), B,
                                     C_in, C_out, c.epilogue, c.accumulate);
    }
    if (c.epilogue == Epilogue::kRelu)
      k::linear_relu_backward(f32(c, c.dinp), f32(c, c.dweight), f32(c, c.dbias), f32(c, c.dpre), f32(c, c.dout),
                              f32(c, c.out), f32(c, c.inp), f32(c, c.weight), B, C_in, C_out, c.accumulate);
    else
      k::linear_backward(f32(c, c.dinp), f32(c, c.dweight), f32(c, c.dbias), f32(c, c.dout), f32(c, c.inp),
                         f32(c, c.weight), B, C_in, C_out, c.accumulate);
  }
  void run_call(const call::ActivationForward& c) {
    float *out = f32(c, c.out), *inp = f32(c, c.inp);
    const int64_t n = c.inp.numel();
    switch (c.kind) {
      case Activation::kRelu: return k::relu_forward(out, inp, n);
      case Activation::kGelu: return k::gelu_forward(out, inp, n);
      case Activation::kTanh: return k::tanh_forward(out, inp, n);
      case Activation::kSigmoid: return k::sigmoid_forward(out, inp, n);
#define DPAR_POINTWISE_FORWARD(Enum, Struct, name) \
  case Activation::Enum: return k::pointwise_forward<kernels::Struct>(out, inp, n);
        DPAR_POINTWISE_ACTIVATIONS(DPAR_POINTWISE_FORWARD)
#undef DPAR_POINTWISE_FORWARD
    }
  }
  void run_call(const call::ActivationBackward& c) {
    float *dinp = f32(c, c.dinp), *dout = f32(c, c.dout);
    const int64_t n = c.dout.numel();
    switch (c.kind) {
      case Activation::kRelu: return k::relu_backward(dinp, dout, f32(c, c.out), n);
      case Activation::kGelu: return k::gelu_backward(dinp, dout, f32(c, c.inp), n);
      case Activation::kTanh: return k::tanh_backward(dinp, dout, f32(c, c.out), n);
      case Activation::kSigmoid: return k::sigmoid_backward(dinp, dout, f32(c, c.out), n);
#define DPAR_POINTWISE_BACKWARD(Enum, Struct, name) \
  case Activation::Enum: return k::pointwise_backward<kernels::Struct>(dinp, dout, f32(c, c.inp), f32(c, c.out), n);
        DPAR_POINTWISE_ACTIVATIONS(DPAR_POINTWISE_BACKWARD)
#undef DPAR_POINTWISE_BACKWARD
    }
  }
  void run_call(const call::DropoutForward& c) {
    k::dropout_forward(f32(c, c.out), f32(c, c.mask), f32(c, c.inp), c.inp.numel(), c.p, c.seed, c.offset);
  }
  void run_call(const call::DropoutBackward& c) {
    k::dropout_backward(f32(c, c.dinp), f32(c, c.dout), f32(c, c.mask), c.dout.numel());
  }
  void run_call(const call::CrossEntropy& c) {
    *f64(c, c.loss_sum) = k::cross_entropy_forward_backward(f32(c, c.dlogits), f32(c, c.logits), i32(c, c.labels),
                                                         c.logits.leading(), c.logits.size(-1), c.grad_scale);
  }
  void run_call(const call::MeanSquaredError& c) {
    *f64(c, c.loss_sum) = k::mse_forward_backward(f32(c, c.dpred), f32(c, c.pred), f32(c, c.target), c.pred.leading(),
                                               c.pred.size(-1), c.grad_scale);
  }
  void run_call(const call::SgdStep& c) {
    k::sgd_step(f32(c, c.param), f32(c, c.momentum), f32(c, c.grad), c.param.numel(), c.hyper, c.first_step);
  }
  void run_call(const call::AdamStep& c) {
    k::adam_step(f32(c, c.param), f32(c, c.exp_avg), f32(c, c.exp_avg_sq), f32(c, c.grad), c.param.numel(), c.hyper,
                 c.step);
  }
  void run_call(const call::Axpy& c) { k::axpy(f32(c, c.y), f32(c, c.x), c.a, c.y.numel()); }
  void run_call(const call::Scale& c) { k::scale(f32(c, c.x), c.a, c.x.numel()); }
  void run_call(const call::Convert& c) {
    if (c.dtype() == DType::kF16) {
      if (c.dst.dtype == DType::kF16)
        k::to_f16(f16(c, c.dst), f32(c, c.src), c.src.numel());
      else
        k::from_f16(f32(c, c.dst), f16(c, c.src), c.src.numel());
    } else if (c.dst.dtype == DType::kBF16) {
      k::to_bf16(c.dst.template contiguous_as<uint16_t>(c.kName), f32(c, c.src), c.src.numel());
    } else {
      k::from_bf16(f32(c, c.dst), c.src.template contiguous_as<uint16_t>(c.kName), c.src.numel());
    }
  }
  void run_call(const call::BatchNormStats& c) {
    k::batchnorm_stats(f64(c, c.sums), f32(c, c.x), c.x.size(0), c.x.size(1), c.x.size(2));
  }
  void run_call(const call::BatchNormMoments& c) {
    k::batchnorm_moments(f64(c, c.mean_invstd), f32(c, c.running_mean), f32(c, c.running_var),
                         i64(c, c.num_batches_tracked), f64(c, c.sums), c.count, c.mean_invstd.numel() / 2, c.eps,
                         c.momentum);
  }
  void run_call(const call::BatchNormApply& c) {
    k::batchnorm_apply(f32(c, c.out), f32(c, c.x), f64(c, c.mean_invstd), f32(c, c.weight), f32(c, c.bias), c.x.size(0),
                       c.x.size(1), c.x.size(2), c.epilogue == Epilogue::kRelu);
  }
  void run_call(const call::BatchNormBackwardReduce& c) {
    k::batchnorm_backward_reduce(f64(c, c.sums), f32(c, c.dout), f32(c, c.x), f64(c, c.mean_invstd), c.x.size(0),
                                 c.x.size(1), c.x.size(2));
  }
  void run_call(const call::BatchNormBackwardApply& c) {
    k::batchnorm_backward_apply(f32(c, c.dinp), f32(c, c.dweight), f32(c, c.dbias), f64(c, c.local), f64(c, c.global),
                                c.count, f32(c, c.dout), f32(c, c.x), f64(c, c.mean_invstd), f32(c, c.weight),
                                c.x.size(0), c.x.size(1), c.x.size(2), c.accumulate);
  }
  void run_call(const call::LayerNormForward& c) {
    if (c.out_dtype() == DType::kBF16)
      return k::layernorm_forward_rounded(bf16(c, c.out), f64(c, c.mean_rstd), f32(c, c.x), f32(c, c.weight),
                                          f32(c, c.bias), c.x.leading(), c.x.size(-1), c.eps);
    k::layernorm_forward(f32(c, c.out), f64(c, c.mean_rstd), f32(c, c.x), f32(c, c.weight), f32(c, c.bias),
                         c.x.leading(), c.x.size(-1), c.eps);
  }
  void run_call(const call::LayerNormBackward& c) {
    k::layernorm_backward(f32(c, c.dinp), f32(c, c.dweight), f32(c, c.dbias), f32(c, c.dout), f32(c, c.x),
                          f64(c, c.mean_rstd), f32(c, c.weight), c.x.leading(), c.x.size(-1), c.accumulate);
  }
  void run_call(const call::EmbeddingForward& c) {
    k::embedding_forward(f32(c, c.out), i32(c, c.idx), f32(c, c.weight), c.idx.numel(), c.weight.size(0),
                         c.weight.size(1));
  }
  void run_call(const call::EmbeddingBackward& c) {
    k::embedding_backward(f32(c, c.dweight), f32(c, c.dout), i32(c, c.idx), c.idx.numel(), c.dweight.size(0),
                          c.dweight.size(1), c.padding_idx, c.accumulate);
  }
  void run_call(const call::PositionEmbeddingForward& c) {
    k::position_embedding_forward(f32(c, c.out), f32(c, c.inp), f32(c, c.weight), c.inp.size(0), c.inp.size(1),
                                  c.inp.size(2));
  }
  void run_call(const call::PositionEmbeddingBackward& c) {
    k::position_embedding_backward(f32(c, c.dweight), f32(c, c.dout), c.dout.size(0), c.dout.size(1),
                                   c.dout.size(2), c.dweight.size(0), c.accumulate);
  }
  void run_call(const call::Fill& c) { k::fill(f32(c, c.x), c.value, c.x.numel()); }
  void run_call(const call::MaxExponent& c) {
    int64_t* out = i64(c, c.out);
    DPAR_CHECK_ARG(c.out.numel() == 1, c.kName, ": out holds one exponent, got ", c.out.str());
    *out = k::max_exponent(f32(c, c.x), c.x.numel());
  }
  void run_call(const call::ToGrid& c) {
    same_count(c, c.sum, c.x);
    k::to_grid(i64(c, c.sum), f32(c, c.x), c.x.numel(), c.scale_exponent, c.accumulate);
  }
  void run_call(const call::FromGrid& c) {
    same_count(c, c.out, c.sum);
    k::from_grid(f32(c, c.out), i64(c, c.sum), c.sum.numel(), c.factor);
  }
  // The element counts of two (n) arguments of an elementwise call whose kernel reads one count.
  template <class C>
  static void same_count(const C&, const TensorRef& a, const TensorRef& b) {
    DPAR_CHECK_ARG(a.numel() == b.numel(), C::kName, ": its arguments differ in element count: ", a.str(), " and ",
                   b.str());
  }

  // The bf16 linear layers' oneDNN primitives, per shape: the stream's, so that replicas share nothing; made on
  // the first bf16 call (an f32 model never has one). The calls come from the worker; the lock keeps the cache and
  // its scratchpad whole should another of the stream's threads run one.
  k::Bf16Gemm& bf16_gemm() {
    if (!bf16_gemm_) bf16_gemm_ = std::make_unique<k::Bf16Gemm>();
    return *bf16_gemm_;
  }
  std::mutex bf16_mutex_;
  std::unique_ptr<k::Bf16Gemm> bf16_gemm_;
};

class CpuBackend final : public Backend {
 public:
  DeviceKind kind() const override { return DeviceKind::kCpu; }
  const char* name() const override { return "cpu"; }
  size_t device_count() const override { return default_cpu_device_count(); }
  std::string math_library() const override { return k::gemm_backend(); }

  void* allocate(Device device, size_t bytes) override {
    // Rounded up to whole cache lines so that vector loops over any buffer start aligned and peel identically.
    const size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded ? rounded : 64);
    if (!p) fail(Status::kOutOfMemory, device.str(), ": out of memory allocating ", bytes, " bytes");
    return p;
  }
  void deallocate(Device, void* ptr) noexcept override { std::free(ptr); }
  void copy_to_host(void* dst, const void* src, size_t bytes, Device) override {
    if (bytes && dst != src) std::memcpy(dst, src, bytes);
  }
  void copy_from_host(void* dst, const void* src, size_t bytes, Device) override {
    if (bytes && dst != src) std::memcpy(dst, src, bytes);
  }
  void fill_zero(void* dst, size_t bytes, Device) override {
    if (bytes) std::memset(dst, 0, bytes);
  }
  void check_memory(const void*, size_t, Device, const char*) override {}

  void prepare_workers(const WorkerOptions&) override {
    // A CPU with AVX2 or AVX-512 whose GEMM runs slower code is worth a line on stderr, once per process.
    k::warn_if_gemm_generic();
  }
  void start_worker(Device, size_t worker, const WorkerOptions& options) override {
    // A worker with GEMM threads gets as many cores: OpenMP starts its team from the worker, and the team
    // inherits the worker's affinity (on a single core, the team's threads would take turns and spin-wait for
    // each other: a step 25x slower, measured).
    const size_t threads = static_cast<size_t>(options.blas_threads > 1 ? options.blas_threads : 1);
    if (options.pin) pin_to_cpus(worker * threads, threads);
    // The GEMM's thread count belongs to the calling thread: one thread inside each worker (the default) keeps
    // the workers from oversubscribing the cores.
    k::set_gemm_threads(options.blas_threads);
  }
  std::unique_ptr<Stream> open_stream(Device device) override { return std::make_unique<CpuStream>(device); }
  std::unique_ptr<Stream> wrap_stream(Device device, void* native) override {
    DPAR_CHECK_ARG(native == nullptr, device.str(), ": CPU devices have no streams (pass NULL)");
    return std::make_unique<CpuStream>(device);
  }

  std::unique_ptr<Group> make_group(const std::vector<Device>&, const std::vector<Stream*>&,
                                    std::vector<std::string> names, std::chrono::duration<double> timeout) override {
    return std::make_unique<ThreadGroup>(std::move(names), timeout);
  }
};

}  // namespace

Backend& cpu_backend() {
  static CpuBackend backend;
  return backend;
}

}  // namespace dpar
