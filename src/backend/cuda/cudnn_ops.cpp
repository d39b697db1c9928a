#include "backend/cuda/cudnn_ops.h"

#include <climits>
#include <string>
#include <utility>
#include <vector>

#include "common/error.h"
#include "common/f16.h"
#include "kernels/cuda/kernels.h"
#include "platform/cuda/cuda_check.h"
#include "platform/cuda/cudnn_library.h"

namespace dpar {

using cuda::cudnn;
using cuda::CudnnLibrary;
using cuda::DeviceScope;

// ---- The stream's context -----------------------------------------------------------------------------------------

void CudnnContext::check_open() const {
  DPAR_ENFORCE(!closed_, Status::kInvalidState, "a cuDNN op on ", device_.str(),
               " was used after its stream was destroyed");
}

cudnnHandle_t CudnnContext::handle() {
  check_open();
  if (handle_) return handle_;
  const CudnnLibrary& lib = cudnn();  // loads cuDNN the first time
  cudnnHandle_t h = nullptr;
  DPAR_CUDNN_CHECK(lib.create(&h), "cudnnCreate on ", device_.str(), " (", lib.path, ")");
  try {
    DPAR_CUDNN_CHECK(lib.set_stream(h, stream_), "cudnnSetStream on ", device_.str());
  } catch (...) {
    lib.destroy(h);
    throw;
  }
  return handle_ = h;
}

void* CudnnContext::workspace(size_t bytes) {
  check_open();
  if (bytes == 0) return nullptr;
  if (bytes <= workspace_bytes_) return workspace_;
  if (workspace_) {
    DPAR_CUDA_CHECK(cudaStreamSynchronize(stream_), "waiting for ", device_.str(),
                    "'s work before the cuDNN workspace grows");
    DPAR_CUDA_CHECK(cudaFree(workspace_), "cudaFree of the cuDNN workspace");
    workspace_ = nullptr;
    workspace_bytes_ = 0;
  }
  DPAR_CUDA_CHECK(cudaMalloc(&workspace_, bytes), "cudaMalloc of ", bytes, " bytes of cuDNN workspace on ",
                  device_.str());
  workspace_bytes_ = bytes;
  return workspace_;
}

void CudnnContext::close() noexcept {
  if (closed_) return;
  closed_ = true;
  if (!handle_ && !workspace_) return;
  (void)cudaStreamSynchronize(stream_);
  if (workspace_) (void)cudaFree(workspace_);
  if (handle_) (void)cudnn().destroy(handle_);  // a handle exists only where cuDNN was loaded
  workspace_ = nullptr;
  handle_ = nullptr;
}

namespace {

// An op's NCHW memory as cuDNN's f32 descriptors read it.
float* f32(const TensorRef& r) { return r.contiguous_as<float>("a cuDNN convolution or pooling op"); }

// ---- Descriptors --------------------------------------------------------------------------------------------------

// A cuDNN descriptor, destroyed with its owner.
template <class T>
class Desc {
 public:
  using Destroy = cudnnStatus_t (*)(T);
  Desc(cudnnStatus_t (*create)(T*), Destroy destroy, const char* what) : destroy_(destroy) {
    DPAR_CUDNN_CHECK(create(&d_), what);
  }
  ~Desc() {
    if (d_) (void)destroy_(d_);
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  T get() const { return d_; }

 private:
  Destroy destroy_;
  T d_ = nullptr;
};

struct TensorDesc : Desc<cudnnTensorDescriptor_t> {
  TensorDesc() : Desc(cudnn().create_tensor, cudnn().destroy_tensor, "cudnnCreateTensorDescriptor") {}
};

// cuDNN's legacy API takes int extents and strides: every extent, and the element count (N's stride times N),
// must fit. Refused rather than wrapped.
int to_int(int64_t v, const std::string& what) {
  DPAR_ENFORCE(v >= 0 && v <= INT_MAX, Status::kNotSupported, what, " is ", v,
               ": cuDNN's convolution and pooling take 32-bit extents; split the batch");
  return static_cast<int>(v);
}

// A fully packed NCHW f32 tensor (dpar's layout at an op's edges).
void set_nchw(const TensorDesc& d, int64_t N, int64_t C, int64_t H, int64_t W, const std::string& what) {
  to_int(N * C * H * W, what + "'s element count");
  DPAR_CUDNN_CHECK(cudnn().set_tensor_4d(d.get(), CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, to_int(N, what + "'s N"),
                                         to_int(C, what + "'s C"), to_int(H, what + "'s H"), to_int(W, what + "'s W")),
                   "cudnnSetTensor4dDescriptor for ", what, " (", N, ", ", C, ", ", H, ", ", W, ")");
}

const float kOne = 1.0f, kZero = 0.0f;

// How a convolution computes, which decides the math type of its descriptor and the algorithms it may take.
//   kFp32: f32 operands in FP32 FMA arithmetic (CUDNN_FMA_MATH), the CPU reference's precision and dpar's cuBLAS
//          GEMM's. Not CUDNN_DEFAULT_MATH: that lets cuDNN 8+ run FP32 convolutions on TF32 tensor cores on Ampere
//          and later (H100, H200), with a 10-bit mantissa; PyTorch likewise sets CUDNN_FMA_MATH when
//          torch.backends.cudnn.allow_tf32 is false. The default: what a stream without set_allow_tf32 gets.
//   kTf32: f32 operands, TF32 tensor cores allowed (the stream's set_allow_tf32(true)): CUDNN_DEFAULT_MATH, which
//          cuDNN documents as permitting TF32 on A100 and later, as PyTorch sets it when allow_tf32 is true.
//   kLow:  mixed precision (Conv2dSpec::dtype bf16 or f16): bf16- or f16-valued operands widened to f32, the same
//          math type (the tensors cuDNN sees are f32, so TF32 is the tensor-core path for them;
//          CUDNN_TENSOR_OP_MATH is meant for f16/bf16 tensors), and only the algorithms that multiply the operands
//          themselves (implicit or explicit GEMM): a bf16 or f16 value is exact in TF32 (8 or 11 significant bits
//          of TF32's 11, within its exponent range), so their products are exact and are summed in f32, whereas
//          Winograd's and FFT's transformed operands are not such values and would be rounded to TF32.
enum class ConvMath { kFp32, kTf32, kLow };

const char* math_name(ConvMath m) {
  switch (m) {
    case ConvMath::kFp32: return "FP32";
    case ConvMath::kTf32: return "TF32";
    case ConvMath::kLow: return "bf16 or f16 (GEMM-form, f32 accumulation)";
  }
  return "?";
}

bool gemm_form(cudnnConvolutionFwdAlgo_t a) {
  return a == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM || a == CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM ||
         a == CUDNN_CONVOLUTION_FWD_ALGO_GEMM || a == CUDNN_CONVOLUTION_FWD_ALGO_DIRECT;
}
bool gemm_form(cudnnConvolutionBwdDataAlgo_t a) {
  return a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_0 || a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_1;
}
bool gemm_form(cudnnConvolutionBwdFilterAlgo_t a) {
  return a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 || a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1 ||
         a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_3;
}

// The first algorithm of cuDNN's list (its heuristics', fastest first) that ran its check (status SUCCESS), is
// deterministic (two runs give the same bits: replicas must agree, and a rerun must too), computes in the
// precision asked for and whose workspace fits the cap. In FP32 that refuses tensor-op math (TF32: the descriptor's
// CUDNN_FMA_MATH already asks for FP32, this only refuses a result that says otherwise); FP16 down-conversion is
// refused always; in bf16 and f16 only GEMM-form algorithms are taken (ConvMath). The list's algorithm values, for
// the error.
template <class Perf>
const Perf* choose(const std::vector<Perf>& perfs, int returned, ConvMath math) {
  for (int i = 0; i < returned; ++i) {
    const Perf& p = perfs[static_cast<size_t>(i)];
    if (p.status != CUDNN_STATUS_SUCCESS || p.determinism != CUDNN_DETERMINISTIC) continue;
    if (p.mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION) continue;
    if (math == ConvMath::kFp32 && p.mathType == CUDNN_TENSOR_OP_MATH) continue;
    if (math == ConvMath::kLow && !gemm_form(p.algo)) continue;
    if (p.memory > cudnn_detail::kWorkspaceCap) continue;
    return &p;
  }
  return nullptr;
}

template <class Perf>
std::string list_algorithms(const std::vector<Perf>& perfs, int returned) {
  std::string s;
  for (int i = 0; i < returned; ++i) {
    const Perf& p = perfs[static_cast<size_t>(i)];
    s += (s.empty() ? "" : ", ") + std::to_string(static_cast<int>(p.algo)) + " (status " +
         std::to_string(static_cast<int>(p.status)) + (p.determinism == CUDNN_DETERMINISTIC ? ", deterministic" : "") +
         ", math " + std::to_string(static_cast<int>(p.mathType)) + ", " + std::to_string(p.memory) + " bytes)";
  }
  return s.empty() ? "none" : s;
}

// ---- Convolution --------------------------------------------------------------------------------------------------

class CudnnConv2d final : public Conv2dOp {
 public:
  CudnnConv2d(const Conv2dSpec& spec, std::shared_ptr<CudnnContext> ctx)
      : spec_(spec), name_(spec.str()), ctx_(std::move(ctx)), lib_(cudnn()),
        filter_(lib_.create_filter, lib_.destroy_filter, "cudnnCreateFilterDescriptor"),
        conv_(lib_.create_conv, lib_.destroy_conv, "cudnnCreateConvolutionDescriptor") {
    const Conv2dSpec& s = spec_;
    const std::string what = name_ + " on " + ctx_->device().str();
    DPAR_ENFORCE(s.dtype == DType::kF32 || s.dtype == DType::kBF16 || s.dtype == DType::kF16, Status::kNotSupported,
                 what, " in ", dtype_name(s.dtype),
                 ": cuDNN's convolution computes in f32, bf16 or f16 (mixed precision)");
    // PyTorch's weight (C_out, C_in/groups, kh, kw) is cuDNN's KCRS filter of a grouped convolution, as is.
    DPAR_CUDNN_CHECK(lib_.set_filter_4d(filter_.get(), CUDNN_DATA_FLOAT, CUDNN_TENSOR_NCHW,
                                        to_int(s.out_channels, what + ": out_channels"),
                                        to_int(s.in_channels / s.groups, what + ": in_channels / groups"),
                                        to_int(s.kernel_h, what + ": kernel_h"),
                                        to_int(s.kernel_w, what + ": kernel_w")),
                     "cudnnSetFilter4dDescriptor for ", what);
    // Cross-correlation (what PyTorch and oneDNN call convolution), zero padding on both sides, f32 tensors and f32
    // accumulation (bf16 and f16 operands are widened to f32 first: forward() below).
    DPAR_CUDNN_CHECK(lib_.set_conv_2d(conv_.get(), to_int(s.pad_h, what), to_int(s.pad_w, what),
                                      to_int(s.stride_h, what), to_int(s.stride_w, what), to_int(s.dilation_h, what),
                                      to_int(s.dilation_w, what), CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT),
                     "cudnnSetConvolution2dDescriptor for ", what);
    DPAR_CUDNN_CHECK(lib_.set_conv_groups(conv_.get(), to_int(s.groups, what)), "cudnnSetConvolutionGroupCount for ",
                     what);
    // The descriptor's math type (ConvMath): set by use_math(), here and whenever the stream's TF32 switch moved.
    use_math(math_wanted());
    if (s.bias) {
      bias_ = std::make_unique<TensorDesc>();
      set_nchw(*bias_, 1, s.out_channels, 1, 1, what + "'s bias");
    }
  }
  ~CudnnConv2d() override {
    DeviceScope scope(ctx_->device().index, std::nothrow);
    x32_.release();
    w32_.release();
    dy32_.release();
    dy16_.release();
  }

  // Mixed precision (bf16 or f16, low_): cuDNN's legacy API has no configuration with 16-bit x and w and an f32 y
  // (its PSEUDO_BFLOAT16_CONFIG and PSEUDO_HALF_CONFIG make y 16-bit too, which would round the output that the
  // contract keeps in f32), so the op widens the operands into f32 buffers it owns (exact: from_low) and runs the f32
  // convolution on them with TF32 tensor cores allowed and GEMM-form algorithms only (ConvMath::kLow): the exact
  // products of the 16-bit values summed in f32, written in f32 where the caller wants it. The gradient of the
  // output is rounded to the dtype (to_low, then widened; in f16 beyond 65504 to infinity, as the linear layer's)
  // for the products of both backward passes; the bias gradient is summed from the f32 gradient, as the linear
  // layer's is.
  void forward(const TensorRef& out, const TensorRef& inp, const TensorRef& weight, const TensorRef& bias) override {
    const int64_t N = inp.size(0), H = inp.size(2), W = inp.size(3);
    if (!low_) return forward(f32(out), f32(inp), f32(weight), f32(bias), N, H, W);
    if (N == 0) return;
    DeviceScope scope(ctx_->device().index);
    const float* x = widen(x32_, inp, "widened input");
    const float* w = widen(w32_, weight, "widened weight");
    forward(f32(out), x, w, f32(bias), N, H, W);
  }
  void backward_data(const TensorRef& dinp, const TensorRef& dout, const TensorRef& weight) override {
    const int64_t N = dinp.size(0), H = dinp.size(2), W = dinp.size(3);
    if (!low_) return backward_data(f32(dinp), f32(dout), f32(weight), N, H, W);
    if (N == 0) return;
    DeviceScope scope(ctx_->device().index);
    const float* dy = rounded(dout);
    const float* w = widen(w32_, weight, "widened weight");
    backward_data(f32(dinp), dy, w, N, H, W);
  }
  void backward_weights(const TensorRef& dweight, const TensorRef& dbias, const TensorRef& dout, const TensorRef& inp,
                        bool accumulate) override {
    const int64_t N = inp.size(0), H = inp.size(2), W = inp.size(3);
    if (!low_ || N == 0) {  // f32; or no rows (zeros), where inp is not read
      const float* x = low_ ? nullptr : f32(inp);
      return backward_weights(f32(dweight), f32(dbias), f32(dout), x, N, H, W, accumulate);
    }
    // bf16 or f16: the weights' and the bias's gradients both from the rounded gradient (Conv2dSpec::dtype), as the
    // CPU's.
    DeviceScope scope(ctx_->device().index);
    const float* dy = rounded(dout);
    const float* x = dweight.defined() ? widen(x32_, inp, "widened input") : nullptr;
    backward_weights(f32(dweight), f32(dbias), dy, x, N, H, W, accumulate);
  }

 private:
  // An op-owned device buffer, grown to the largest call so far. Growing waits for the stream's queued work (which
  // may read the old one) before it frees it.
  template <class T>
  class Scratch {
   public:
    T* get(int64_t n, cudaStream_t stream, const std::string& op, const char* what) {
      if (n <= capacity_) return p_;
      if (p_) {
        DPAR_CUDA_CHECK(cudaStreamSynchronize(stream), "waiting for the stream before ", op, "'s ", what, " grows");
        DPAR_CUDA_CHECK(cudaFree(p_), "cudaFree of ", op, "'s ", what);
        p_ = nullptr, capacity_ = 0;
      }
      DPAR_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p_), static_cast<size_t>(n) * sizeof(T)), "cudaMalloc of ",
                      op, "'s ", what, " (", n, " elements)");
      capacity_ = n;
      return p_;
    }
    void release() noexcept {
      if (p_) (void)cudaFree(p_);  // waits for the device's work, which may still read it
      p_ = nullptr, capacity_ = 0;
    }

   private:
    T* p_ = nullptr;
    int64_t capacity_ = 0;
  };

  // A bf16 or f16 operand widened into `buf` (exact), on the stream. The caller has made the device current.
  const float* widen(Scratch<float>& buf, const TensorRef& r, const char* which) {
    const char* what = "a mixed-precision cuDNN convolution's operand";
    const uint16_t* src = spec_.dtype == DType::kF16 ? reinterpret_cast<const uint16_t*>(r.contiguous_as<Half>(what))
                                                     : r.contiguous_as<uint16_t>(what);
    const int64_t n = r.numel();
    float* dst = buf.get(n, ctx_->stream(), name_, which);
    kernels::cuda::from_low(spec_.dtype, dst, src, n, ctx_->stream());
    return dst;
  }
  // The f32 gradient of the output rounded to the dtype and widened back: the operand of both backward products.
  const float* rounded(const TensorRef& dout) {
    const float* src = f32(dout);
    const int64_t n = dout.numel();
    uint16_t* low = dy16_.get(n, ctx_->stream(), name_, "16-bit output gradient");
    float* dst = dy32_.get(n, ctx_->stream(), name_, "rounded output gradient");
    kernels::cuda::to_low(spec_.dtype, low, src, n, ctx_->stream());
    kernels::cuda::from_low(spec_.dtype, dst, low, n, ctx_->stream());
    return dst;
  }

  ConvMath math_wanted() const {
    if (low_) return ConvMath::kLow;
    return ctx_->allow_tf32() ? ConvMath::kTf32 : ConvMath::kFp32;
  }
  // Sets the descriptor's math type for `m`. A change (the stream's TF32 switch moved) forgets the algorithms chosen
  // under the other one.
  void use_math(ConvMath m) {
    if (math_set_ && m == math_) return;
    const cudnnMathType_t type = m == ConvMath::kFp32 ? CUDNN_FMA_MATH : CUDNN_DEFAULT_MATH;
    DPAR_CUDNN_CHECK(lib_.set_conv_math(conv_.get(), type), "cudnnSetConvolutionMathType for ", name_);
    if (math_set_) cache_.clear();
    math_ = m;
    math_set_ = true;
  }

  void forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int64_t H,
               int64_t W) {
    if (N == 0) return;
    DeviceScope scope(ctx_->device().index);
    use_math(math_wanted());
    Shape& p = shape(N, H, W);
    cudnnHandle_t h = ctx_->handle();
    void* ws = ctx_->workspace(p.fwd_bytes);
    DPAR_CUDNN_CHECK(lib_.conv_forward(h, &kOne, p.x.get(), inp, filter_.get(), weight, conv_.get(), p.fwd, ws,
                                       p.fwd_bytes, &kZero, p.y.get(), out),
                     "cudnnConvolutionForward for ", name_);
    if (spec_.bias)  // out += bias, broadcast over N, OH, OW
      DPAR_CUDNN_CHECK(lib_.add_tensor(h, &kOne, bias_->get(), bias, &kOne, p.y.get(), out), "cudnnAddTensor for ",
                       name_, "'s bias");
    if (spec_.epilogue == Epilogue::kRelu)
      kernels::cuda::relu_forward(out, out, N * spec_.out_channels * p.OH * p.OW, ctx_->stream());
  }

  void backward_data(float* dinp, const float* dout, const float* weight, int64_t N, int64_t H, int64_t W) {
    if (N == 0) return;
    DeviceScope scope(ctx_->device().index);
    use_math(math_wanted());
    Shape& p = shape(N, H, W);
    cudnnHandle_t h = ctx_->handle();
    if (!p.has_bwd_data) choose_bwd_data(h, p);
    void* ws = ctx_->workspace(p.bwd_data_bytes);
    DPAR_CUDNN_CHECK(lib_.conv_backward_data(h, &kOne, filter_.get(), weight, p.y.get(), dout, conv_.get(),
                                             p.bwd_data, ws, p.bwd_data_bytes, &kZero, p.x.get(), dinp),
                     "cudnnConvolutionBackwardData for ", name_);
  }

  // dweight from dout and inp, dbias from dout.
  void backward_weights(float* dweight, float* dbias, const float* dout, const float* inp, int64_t N, int64_t H,
                        int64_t W, bool accumulate) {
    const Conv2dSpec& s = spec_;
    if (!s.bias) dbias = nullptr;
    if (!dweight && !dbias) return;
    DeviceScope scope(ctx_->device().index);
    if (N == 0) {  // no rows: a zero gradient
      if (accumulate) return;
      const size_t wn = static_cast<size_t>(s.out_channels * (s.in_channels / s.groups) * s.kernel_h * s.kernel_w);
      if (dweight)
        DPAR_CUDA_CHECK(cudaMemsetAsync(dweight, 0, wn * sizeof(float), ctx_->stream()), name_, ": zero dweight");
      if (dbias)
        DPAR_CUDA_CHECK(cudaMemsetAsync(dbias, 0, static_cast<size_t>(s.out_channels) * sizeof(float),
                                        ctx_->stream()),
                        name_, ": zero dbias");
      return;
    }
    use_math(math_wanted());
    Shape& p = shape(N, H, W);
    cudnnHandle_t h = ctx_->handle();
    // beta = 1 adds to what is there (accumulate), beta = 0 overwrites (and reads nothing, NaN included).
    const float* beta = accumulate ? &kOne : &kZero;
    if (dweight) {
      if (!p.has_bwd_filter) choose_bwd_filter(h, p);
      void* ws = ctx_->workspace(p.bwd_filter_bytes);
      DPAR_CUDNN_CHECK(lib_.conv_backward_filter(h, &kOne, p.x.get(), inp, p.y.get(), dout, conv_.get(),
                                                 p.bwd_filter, ws, p.bwd_filter_bytes, beta, filter_.get(), dweight),
                       "cudnnConvolutionBackwardFilter for ", name_);
    }
    if (dbias)
      DPAR_CUDNN_CHECK(lib_.conv_backward_bias(h, &kOne, p.y.get(), dout, beta, bias_->get(), dbias),
                       "cudnnConvolutionBackwardBias for ", name_);
  }

  // What one input shape needs: its tensors and the algorithm chosen for each direction, with its workspace.
  struct Shape {
    int64_t N = 0, H = 0, W = 0, OH = 0, OW = 0;
    TensorDesc x, y;
    cudnnConvolutionFwdAlgo_t fwd{};
    size_t fwd_bytes = 0;
    bool has_bwd_data = false, has_bwd_filter = false;  // chosen by the first backward: not every op has one
    cudnnConvolutionBwdDataAlgo_t bwd_data{};
    size_t bwd_data_bytes = 0;
    cudnnConvolutionBwdFilterAlgo_t bwd_filter{};
    size_t bwd_filter_bytes = 0;
  };
  // Enough for a training batch, its last (smaller) batch and an evaluation batch or two, as the CPU op keeps.
  static constexpr size_t kMaxShapes = 8;

  Shape& shape(int64_t N, int64_t H, int64_t W) {
    for (auto& p : cache_)
      if (p->N == N && p->H == H && p->W == W) return *p;
    const Conv2dSpec& s = spec_;
    const int64_t OH = s.out_h(H), OW = s.out_w(W);
    DPAR_CHECK_ARG(OH >= 1 && OW >= 1, name_, ": input ", H, "x", W, " is smaller than the kernel's reach");
    auto p = std::make_unique<Shape>();
    p->N = N, p->H = H, p->W = W, p->OH = OH, p->OW = OW;
    set_nchw(p->x, N, s.in_channels, H, W, name_ + "'s input");
    set_nchw(p->y, N, s.out_channels, OH, OW, name_ + "'s output");
    int n = 0, c = 0, oh = 0, ow = 0;
    DPAR_CUDNN_CHECK(lib_.conv_output_dim(conv_.get(), p->x.get(), filter_.get(), &n, &c, &oh, &ow),
                     "cudnnGetConvolution2dForwardOutputDim for ", name_);
    DPAR_ENFORCE(n == N && c == s.out_channels && oh == OH && ow == OW, Status::kInternal, name_,
                 ": cuDNN's output extent ", oh, "x", ow, " is not PyTorch's ", OH, "x", OW);
    cudnnHandle_t h = ctx_->handle();
    std::vector<cudnnConvolutionFwdAlgoPerf_t> perfs(CUDNN_CONVOLUTION_FWD_ALGO_COUNT);
    int returned = 0;
    DPAR_CUDNN_CHECK(lib_.fwd_algorithms(h, p->x.get(), filter_.get(), conv_.get(), p->y.get(),
                                         static_cast<int>(perfs.size()), &returned, perfs.data()),
                     "cudnnGetConvolutionForwardAlgorithm_v7 for ", name_);
    const auto* best = choose(perfs, returned, math_);
    DPAR_ENFORCE(best != nullptr, Status::kNotSupported, name_, " on ", ctx_->device().str(), " for input (", N,
                 ", ", s.in_channels, ", ", H, ", ", W, "): cuDNN offers no deterministic ", math_name(math_),
                 " forward algorithm within ", cudnn_detail::kWorkspaceCap, " bytes of workspace; it offered ",
                 list_algorithms(perfs, returned));
    p->fwd = best->algo;
    // The workspace of the algorithm as configured, asked again: the heuristics' figure is an estimate.
    DPAR_CUDNN_CHECK(lib_.fwd_workspace(h, p->x.get(), filter_.get(), conv_.get(), p->y.get(), p->fwd, &p->fwd_bytes),
                     "cudnnGetConvolutionForwardWorkspaceSize for ", name_);
    if (cache_.size() == kMaxShapes) cache_.erase(cache_.begin());
    cache_.push_back(std::move(p));
    return *cache_.back();
  }

  void choose_bwd_data(cudnnHandle_t h, Shape& p) {
    std::vector<cudnnConvolutionBwdDataAlgoPerf_t> perfs(CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT);
    int returned = 0;
    DPAR_CUDNN_CHECK(lib_.bwd_data_algorithms(h, filter_.get(), p.y.get(), conv_.get(), p.x.get(),
                                              static_cast<int>(perfs.size()), &returned, perfs.data()),
                     "cudnnGetConvolutionBackwardDataAlgorithm_v7 for ", name_);
    const auto* best = choose(perfs, returned, math_);
    DPAR_ENFORCE(best != nullptr, Status::kNotSupported, name_, " on ", ctx_->device().str(), " for input (", p.N,
                 ", ", spec_.in_channels, ", ", p.H, ", ", p.W, "): cuDNN offers no deterministic ", math_name(math_),
                 " backward-data algorithm within ", cudnn_detail::kWorkspaceCap, " bytes of workspace; it offered ",
                 list_algorithms(perfs, returned));
    p.bwd_data = best->algo;
    DPAR_CUDNN_CHECK(lib_.bwd_data_workspace(h, filter_.get(), p.y.get(), conv_.get(), p.x.get(), p.bwd_data,
                                             &p.bwd_data_bytes),
                     "cudnnGetConvolutionBackwardDataWorkspaceSize for ", name_);
    p.has_bwd_data = true;
  }

  void choose_bwd_filter(cudnnHandle_t h, Shape& p) {
    std::vector<cudnnConvolutionBwdFilterAlgoPerf_t> perfs(CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT);
    int returned = 0;
    DPAR_CUDNN_CHECK(lib_.bwd_filter_algorithms(h, p.x.get(), p.y.get(), conv_.get(), filter_.get(),
                                                static_cast<int>(perfs.size()), &returned, perfs.data()),
                     "cudnnGetConvolutionBackwardFilterAlgorithm_v7 for ", name_);
    const auto* best = choose(perfs, returned, math_);
    DPAR_ENFORCE(best != nullptr, Status::kNotSupported, name_, " on ", ctx_->device().str(), " for input (", p.N,
                 ", ", spec_.in_channels, ", ", p.H, ", ", p.W, "): cuDNN offers no deterministic ", math_name(math_),
                 " backward-filter algorithm within ", cudnn_detail::kWorkspaceCap, " bytes of workspace; it offered ",
                 list_algorithms(perfs, returned));
    p.bwd_filter = best->algo;
    DPAR_CUDNN_CHECK(lib_.bwd_filter_workspace(h, p.x.get(), p.y.get(), conv_.get(), filter_.get(), p.bwd_filter,
                                               &p.bwd_filter_bytes),
                     "cudnnGetConvolutionBackwardFilterWorkspaceSize for ", name_);
    p.has_bwd_filter = true;
  }

  Conv2dSpec spec_;
  std::string name_;
  std::shared_ptr<CudnnContext> ctx_;
  const CudnnLibrary& lib_;
  bool low_ = spec_.dtype == DType::kBF16 || spec_.dtype == DType::kF16;
  ConvMath math_ = ConvMath::kFp32;  // the descriptor's, once math_set_
  bool math_set_ = false;
  Scratch<float> x32_, w32_, dy32_;  // bf16, f16: the widened input and weight, the rounded output gradient
  Scratch<uint16_t> dy16_;           // bf16, f16: the output gradient rounded
  Desc<cudnnFilterDescriptor_t> filter_;
  Desc<cudnnConvolutionDescriptor_t> conv_;
  std::unique_ptr<TensorDesc> bias_;  // (1, C_out, 1, 1), broadcast over the output
  std::vector<std::unique_ptr<Shape>> cache_;  // most recently prepared last
};

// ---- Pooling ------------------------------------------------------------------------------------------------------

class CudnnPool2d final : public Pool2dOp {
 public:
  CudnnPool2d(const Pool2dSpec& spec, std::shared_ptr<CudnnContext> ctx)
      : spec_(spec), name_(spec.str()), ctx_(std::move(ctx)), lib_(cudnn()) {}

  void forward(const TensorRef& out, const TensorRef& inp) override {
    forward(f32(out), f32(inp), inp.size(0), inp.size(1), inp.size(2), inp.size(3));
  }
  void backward(const TensorRef& dinp, const TensorRef& dout, const TensorRef& inp, const TensorRef& out) override {
    backward(f32(dinp), f32(dout), f32(inp), f32(out), dinp.size(0), dinp.size(1), dinp.size(2), dinp.size(3));
  }

 private:
  void forward(float* out, const float* inp, int64_t N, int64_t C, int64_t H, int64_t W) {
    if (N == 0) return;
    DeviceScope scope(ctx_->device().index);
    Shape& p = shape(N, C, H, W);
    DPAR_CUDNN_CHECK(lib_.pooling_forward(ctx_->handle(), p.pool.get(), &kOne, p.x.get(), inp, &kZero, p.y.get(), out),
                     "cudnnPoolingForward for ", name_);
  }

  void backward(float* dinp, const float* dout, const float* inp, const float* out, int64_t N, int64_t C, int64_t H,
                int64_t W) {
    if (N == 0) return;
    DeviceScope scope(ctx_->device().index);
    Shape& p = shape(N, C, H, W);
    // A max pool finds each window's maximum again from inp and out (no state from the forward is kept).
    DPAR_CUDNN_CHECK(lib_.pooling_backward(ctx_->handle(), p.pool.get(), &kOne, p.y.get(), out, p.y.get(), dout,
                                           p.x.get(), inp, &kZero, p.x.get(), dinp),
                     "cudnnPoolingBackward for ", name_);
  }

  struct Shape {
    int64_t N = 0, C = 0, H = 0, W = 0;
    TensorDesc x, y;
    Desc<cudnnPoolingDescriptor_t> pool{cudnn().create_pooling, cudnn().destroy_pooling,
                                        "cudnnCreatePoolingDescriptor"};
  };
  static constexpr size_t kMaxShapes = 8;

  Shape& shape(int64_t N, int64_t C, int64_t H, int64_t W) {
    for (auto& p : cache_)
      if (p->N == N && p->C == C && p->H == H && p->W == W) return *p;
    const Pool2dSpec& s = spec_;
    const int64_t OH = s.out_h(H), OW = s.out_w(W);
    DPAR_CHECK_ARG(OH >= 1 && OW >= 1, name_, ": input ", H, "x", W, " is smaller than the window");
    auto p = std::make_unique<Shape>();
    p->N = N, p->C = C, p->H = H, p->W = W;
    set_nchw(p->x, N, C, H, W, name_ + "'s input");
    set_nchw(p->y, N, C, OH, OW, name_ + "'s output");
    // Max: padded cells never win (cuDNN's max pooling takes only the window's cells inside the input, as
    // PyTorch's pads with -inf); the deterministic mode, so that backward gives the same bits every time. Avg:
    // PyTorch's count_include_pad=True, the divisor kernel_h * kernel_w. Global: one window of the whole input.
    // NaN propagates, as in PyTorch's max pooling.
    const cudnnPoolingMode_t mode =
        s.kind == PoolKind::kMax ? CUDNN_POOLING_MAX_DETERMINISTIC : CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING;
    const int64_t kh = s.global ? H : s.kernel_h, kw = s.global ? W : s.kernel_w;
    const int64_t ph = s.global ? 0 : s.pad_h, pw = s.global ? 0 : s.pad_w;
    const int64_t sh = s.global ? 1 : s.stride_h, sw = s.global ? 1 : s.stride_w;
    DPAR_CUDNN_CHECK(lib_.set_pooling_2d(p->pool.get(), mode, CUDNN_PROPAGATE_NAN, to_int(kh, name_), to_int(kw, name_),
                                         to_int(ph, name_), to_int(pw, name_), to_int(sh, name_), to_int(sw, name_)),
                     "cudnnSetPooling2dDescriptor for ", name_);
    if (cache_.size() == kMaxShapes) cache_.erase(cache_.begin());
    cache_.push_back(std::move(p));
    return *cache_.back();
  }

  Pool2dSpec spec_;
  std::string name_;
  std::shared_ptr<CudnnContext> ctx_;
  const CudnnLibrary& lib_;
  std::vector<std::unique_ptr<Shape>> cache_;
};

}  // namespace

std::unique_ptr<Conv2dOp> make_cudnn_conv2d(const Conv2dSpec& spec, std::shared_ptr<CudnnContext> context) {
  return std::make_unique<CudnnConv2d>(spec, std::move(context));
}

std::unique_ptr<Pool2dOp> make_cudnn_pool2d(const Pool2dSpec& spec, std::shared_ptr<CudnnContext> context) {
  return std::make_unique<CudnnPool2d>(spec, std::move(context));
}

}  // namespace dpar
