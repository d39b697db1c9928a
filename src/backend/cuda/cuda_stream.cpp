#include "backend/cuda/cuda_stream.h"

#include <cuda_runtime_api.h>

#include <cstring>

#include "backend/attention_refs.h"
#include "common/error.h"
#include "common/f16.h"
#ifdef DPAR_HAVE_CUDNN_HEADERS
#include "backend/cuda/cudnn_ops.h"
#endif
#include "kernels/cuda/attention.h"
#include "kernels/cuda/kernels.h"
#include "platform/cuda/cublas_library.h"
#include "platform/cuda/cuda_check.h"

namespace dpar {
namespace {
namespace k = kernels::cuda;

using cuda::cublas;
using cuda::CublasLibrary;
using cuda::DeviceScope;

class CudaAttentionOp;

// ---- A replica's stream -----------------------------------------------------------------------------------------
class CudaStream final : public Stream {
 public:
  // A stream of its own (a replica's).
  explicit CudaStream(Device device) : Stream(device) {
    DeviceScope scope(device.index);
    // Non-blocking: the legacy default stream (used by nothing in dpar) does not serialise it with the others.
    DPAR_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags on ",
               device.str());
    owns_stream_ = true;
    finish_setup();
  }
  // The caller's stream (nullptr: the legacy default stream), used and never destroyed. The caller's thread may
  // have another device current: every operation makes the stream's device current for its span.
  CudaStream(Device device, cudaStream_t borrowed) : Stream(device), stream_(borrowed), borrowed_(true) {
    DeviceScope scope(device.index);
    finish_setup();
  }
  ~CudaStream() override {
    DeviceScope scope(device().index, std::nothrow);
    // A borrowed stream is the caller's, with the caller's work on it: wait only for the copy out of the pinned
    // buffer freed below. Its own stream may hold anything this Stream queued.
    if (borrowed_)
      (void)cudaEventSynchronize(staged_);
    else
      (void)cudaStreamSynchronize(stream_);
    if (pinned_) (void)cudaFreeHost(pinned_);
    if (sum_scratch_) (void)cudaFree(sum_scratch_);
#ifdef DPAR_HAVE_CUDNN_HEADERS
    if (cudnn_) cudnn_->close();  // its handle and workspace, before the stream they are bound to
#endif
    (void)cudaEventDestroy(staged_);
    if (blas_) (void)cublas().destroy(blas_);
    if (owns_stream_) (void)cudaStreamDestroy(stream_);
  }

  cudaStream_t handle() const { return stream_; }

  void copy_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t rows) override {
    const auto scope = enter();
    if (width && rows)
      DPAR_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, cudaMemcpyDefault, stream_),
                      "strided copy on ", device().str());
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    const auto scope = enter();
    if (bytes && dst != src)
      // cudaMemcpyDefault: the pointers say where each side is (unified addressing), so that a copy between two
      // GPUs goes peer to peer where it can and through the host where it cannot.
      DPAR_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_), "copy on ", device().str());
  }
  void copy_from_host(void* dst, const void* host_src, size_t bytes) override {
    const auto scope = enter();
    if (!bytes) return;
    // Through a pinned buffer, so that the copy is asynchronous and the caller may reuse its memory at once. The
    // buffer is reused once the previous copy out of it has finished.
    DPAR_CUDA_CHECK(cudaEventSynchronize(staged_), "waiting for the previous host-to-device copy on ", device().str());
    if (pinned_bytes_ < bytes) {
      if (pinned_) DPAR_CUDA_CHECK(cudaFreeHost(pinned_), "cudaFreeHost");
      pinned_ = nullptr;
      pinned_bytes_ = 0;
      DPAR_CUDA_CHECK(cudaMallocHost(&pinned_, bytes), "cudaMallocHost of ", bytes, " bytes");
      pinned_bytes_ = bytes;
    }
    std::memcpy(pinned_, host_src, bytes);
    DPAR_CUDA_CHECK(cudaMemcpyAsync(dst, pinned_, bytes, cudaMemcpyHostToDevice, stream_), "host-to-device copy on ",
               device().str());
    DPAR_CUDA_CHECK(cudaEventRecord(staged_, stream_), "cudaEventRecord");
  }
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override {
    const auto scope = enter();
    if (!bytes) return;
    DPAR_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "device-to-host copy on ",
               device().str());
    synchronize();
  }
  void fill_zero(void* dst, size_t bytes) override {
    const auto scope = enter();
    if (bytes) DPAR_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, stream_), "fill on ", device().str());
  }
  void synchronize() override {
    const auto scope = enter();
    DPAR_CUDA_CHECK(cudaStreamSynchronize(stream_), device().str(), ": the device failed while running queued work");
  }

  // The kernels this backend has: f32 for all; bf16 and f16 for conversions and the linear layer (mixed precision:
  // 16-bit operands, f32 everything else); ReLU fused into a linear layer's and a BatchNorm's pass (the GELU epilogue
  // composes: Stream::run).
  // A linear layer's output kept rounded (KernelKey::out) is not built here: the model keeps it in f32.
  bool supports(const KernelKey& key) const override {
    if (key.out != DType::kF32) return false;
    if (key.dtype == DType::kBF16 || key.dtype == DType::kF16) {
      switch (key.op) {
        case Op::kConvert: return true;
        case Op::kLinearForward:
        case Op::kLinearBackward: return key.epilogue == Epilogue::kNone || key.epilogue == Epilogue::kRelu;
        default: return false;
      }
    }
    if (key.dtype != DType::kF32) return false;
    switch (key.op) {
      case Op::kLinearForward:
      case Op::kLinearBackward:
      case Op::kBatchNormApply: return key.epilogue == Epilogue::kNone || key.epilogue == Epilogue::kRelu;
      case Op::kFill:
      case Op::kMaxExponent:
      case Op::kToGrid:
      case Op::kFromGrid: return false;  // lacks_why
      default: return key.epilogue == Epilogue::kNone;
    }
  }
  std::string lacks_why(const KernelKey& key) const override {
    if (key.op == Op::kFill) return "the reproducible mode's fill of a non-finite gradient has no CUDA kernel yet";
    return fixed_point_op(key.op) ? "the reproducible mode's fixed point has no CUDA kernel yet" : "";
  }
  // TF32 for f32 GEMMs through the handle's math mode (CUBLAS_TF32_TENSOR_OP_MATH) rather than a compute type per
  // call: the f32 GEMMs are cublasSgemm and cublasSgemmStridedBatched (attention's), which take no compute type, so
  // the one switch covers every f32 product of the stream, as torch.backends.cuda.matmul.allow_tf32 does, and with
  // it off those calls are today's, bit for bit. cuDNN's convolutions read the context's flag (cudnn_ops.cpp). The
  // bf16 GEMMs are unaffected: bf16 operands are exact in TF32. Takes effect from the stream's next call.
  bool set_allow_tf32(bool allow) override {
    const auto scope = enter();
    if (blas_) DPAR_CUBLAS_CHECK(cublas().set_math_mode(blas_, math_mode(allow)), "cublasSetMathMode");
    allow_tf32_ = allow;
#ifdef DPAR_HAVE_CUDNN_HEADERS
    if (cudnn_) cudnn_->set_allow_tf32(allow);
#endif
    return true;
  }
  // Through cuDNN, loaded on first use (backend/cuda/cudnn_ops.h); NOT_SUPPORTED naming what is missing without it.
  std::unique_ptr<Conv2dOp> make_conv2d(const Conv2dSpec& spec) override {
#ifdef DPAR_HAVE_CUDNN_HEADERS
    return make_cudnn_conv2d(spec, cudnn_context());
#else
    fail(Status::kNotSupported, spec.str(), " on ", device().str(), ": ", kNoCudnnHeaders);
#endif
  }
  std::unique_ptr<Pool2dOp> make_pool2d(const Pool2dSpec& spec) override {
#ifdef DPAR_HAVE_CUDNN_HEADERS
    return make_cudnn_pool2d(spec, cudnn_context());
#else
    fail(Status::kNotSupported, spec.str(), " on ", device().str(), ": ", kNoCudnnHeaders);
#endif
  }
  // cuBLAS GEMMs around attention's softmax kernels (kernels/cuda/attention.h).
  std::unique_ptr<AttentionOp> make_attention(const AttentionSpec& spec) override;
  bool has_attention(DType dtype) const override { return dtype == DType::kF32 || dtype == DType::kBF16; }
  double sum_squares(const TensorRef& ref) override {
    const float* x = ref.contiguous_as<float>("sum_squares");
    const int64_t n = ref.numel();
    const auto scope = enter();
    if (!sum_scratch_)  // once per stream: the kernels' partial sums and their total
      DPAR_CUDA_CHECK(cudaMalloc(&sum_scratch_, (k::kSumSquaresBlocks + 1) * sizeof(double)),
                      "cudaMalloc of the sum of squares' scratch on ", device().str());
    k::sum_squares(sum_scratch_ + k::kSumSquaresBlocks, sum_scratch_, x, n, stream_);
    double total = 0.0;
    copy_to_host(&total, sum_scratch_ + k::kSumSquaresBlocks, sizeof(double));
    return total;
  }


 protected:
  void execute(const KernelCall& call) override {
    const auto scope = enter();
    std::visit([this](const auto& c) { run_call(c); }, call);
  }

 private:
  friend class CudaAttentionOp;
  // A call's argument as the typed kernels read it (contiguous elements of the kernel's dtype); an error names the
  // call. Nothing is kept between calls: a stream runs calls from its worker and its communication thread.
  template <class C>
  static float* f32(const C&, const TensorRef& r) { return r.contiguous_as<float>(C::kName); }
  template <class C>
  static double* f64(const C&, const TensorRef& r) { return r.contiguous_as<double>(C::kName); }
  template <class C>
  static int32_t* i32(const C&, const TensorRef& r) { return r.contiguous_as<int32_t>(C::kName); }
  template <class C>
  static int64_t* i64(const C&, const TensorRef& r) { return r.contiguous_as<int64_t>(C::kName); }

  // A mixed-precision operand: its bits, checked to be of the call's dtype (bf16 or f16).
  template <class C>
  static uint16_t* low(const C& c, const TensorRef& r) {
    if (c.dtype() == DType::kF16) return reinterpret_cast<uint16_t*>(r.contiguous_as<Half>(C::kName));
    return r.contiguous_as<uint16_t>(C::kName);
  }
  static bool mixed(DType dtype) { return dtype == DType::kBF16 || dtype == DType::kF16; }

  void run_call(const call::LinearForward& c) {
    if (mixed(c.dtype()))
      return k::linear_forward_mixed(c.dtype(), f32(c, c.out), low(c, c.inp), low(c, c.weight), f32(c, c.bias),
                                     c.inp.leading(), c.inp.size(-1), c.out.size(-1), c.epilogue == Epilogue::kRelu,
                                     blas(), stream_);
    (c.epilogue == Epilogue::kRelu ? k::linear_relu_forward : k::linear_forward)(
        f32(c, c.out), f32(c, c.inp), f32(c, c.weight), f32(c, c.bias), c.inp.leading(), c.inp.size(-1), c.out.size(-1),
        blas(), stream_);
  }
  void run_call(const call::LinearBackward& c) {
    const int64_t B = c.inp.leading(), C_in = c.inp.size(-1), C_out = c.dout.size(-1);
    if (mixed(c.dtype())) {
      const bool relu = c.epilogue == Epilogue::kRelu;
      return k::linear_backward_mixed(c.dtype(), f32(c, c.dinp), f32(c, c.dweight), f32(c, c.dbias),
                                      relu ? f32(c, c.dpre) : nullptr, low(c, c.dout_low), f32(c, c.dout),
                                      relu ? f32(c, c.out) : nullptr, low(c, c.inp), low(c, c.weight), B, C_in, C_out,
                                      relu, c.accumulate, blas(), stream_);
    }
    if (c.epilogue == Epilogue::kRelu)
      k::linear_relu_backward(f32(c, c.dinp), f32(c, c.dweight), f32(c, c.dbias), f32(c, c.dpre), f32(c, c.dout),
                              f32(c, c.out), f32(c, c.inp), f32(c, c.weight), B, C_in, C_out, c.accumulate, blas(),
                              stream_);
    else
      k::linear_backward(f32(c, c.dinp), f32(c, c.dweight), f32(c, c.dbias), f32(c, c.dout), f32(c, c.inp),
                         f32(c, c.weight), B, C_in, C_out, c.accumulate, blas(), stream_);
  }
  void run_call(const call::ActivationForward& c) {
    float *out = f32(c, c.out), *inp = f32(c, c.inp);
    const int64_t n = c.inp.numel();
    switch (c.kind) {
      case Activation::kRelu: return k::relu_forward(out, inp, n, stream_);
      case Activation::kGelu: return k::gelu_forward(out, inp, n, stream_);
      case Activation::kTanh: return k::tanh_forward(out, inp, n, stream_);
      case Activation::kSigmoid: return k::sigmoid_forward(out, inp, n, stream_);
#define DPAR_POINTWISE_FORWARD(Enum, Struct, name) \
  case Activation::Enum: return k::pointwise_forward<kernels::Struct>(out, inp, n, stream_);
        DPAR_POINTWISE_ACTIVATIONS(DPAR_POINTWISE_FORWARD)
#undef DPAR_POINTWISE_FORWARD
    }
  }
  void run_call(const call::ActivationBackward& c) {
    float *dinp = f32(c, c.dinp), *dout = f32(c, c.dout);
    const int64_t n = c.dout.numel();
    switch (c.kind) {
      case Activation::kRelu: return k::relu_backward(dinp, dout, f32(c, c.out), n, stream_);
      case Activation::kGelu: return k::gelu_backward(dinp, dout, f32(c, c.inp), n, stream_);
      case Activation::kTanh: return k::tanh_backward(dinp, dout, f32(c, c.out), n, stream_);
      case Activation::kSigmoid: return k::sigmoid_backward(dinp, dout, f32(c, c.out), n, stream_);
#define DPAR_POINTWISE_BACKWARD(Enum, Struct, name) \
  case Activation::Enum:                            \
    return k::pointwise_backward<kernels::Struct>(dinp, dout, f32(c, c.inp), f32(c, c.out), n, stream_);
        DPAR_POINTWISE_ACTIVATIONS(DPAR_POINTWISE_BACKWARD)
#undef DPAR_POINTWISE_BACKWARD
    }
  }
  void run_call(const call::DropoutForward& c) {
    k::dropout_forward(f32(c, c.out), f32(c, c.mask), f32(c, c.inp), c.inp.numel(), c.p, c.seed, c.offset, stream_);
  }
  void run_call(const call::DropoutBackward& c) {
    k::dropout_backward(f32(c, c.dinp), f32(c, c.dout), f32(c, c.mask), c.dout.numel(), stream_);
  }
  void run_call(const call::CrossEntropy& c) {
    k::cross_entropy_forward_backward(f64(c, c.loss_sum), f32(c, c.dlogits), f32(c, c.logits), i32(c, c.labels),
                                      c.logits.leading(), c.logits.size(-1), c.grad_scale, stream_);
  }
  void run_call(const call::MeanSquaredError& c) {
    k::mse_forward_backward(f64(c, c.loss_sum), f32(c, c.dpred), f32(c, c.pred), f32(c, c.target), c.pred.leading(),
                            c.pred.size(-1), c.grad_scale, stream_);
  }
  void run_call(const call::SgdStep& c) {
    k::sgd_step(f32(c, c.param), f32(c, c.momentum), f32(c, c.grad), c.param.numel(), c.hyper, c.first_step, stream_);
  }
  void run_call(const call::AdamStep& c) {
    k::adam_step(f32(c, c.param), f32(c, c.exp_avg), f32(c, c.exp_avg_sq), f32(c, c.grad), c.param.numel(), c.hyper,
                 c.step, stream_);
  }
  void run_call(const call::Axpy& c) { k::axpy(f32(c, c.y), f32(c, c.x), c.a, c.y.numel(), stream_); }
  void run_call(const call::Scale& c) { k::scale(f32(c, c.x), c.a, c.x.numel(), stream_); }
  // The reproducible mode's kernels (its exact sums, and the NaN it writes over a gradient that held a NaN or an
  // infinity): not built for CUDA yet. supports() says so, so Stream::run refuses them before they reach here.
  static bool fixed_point_op(Op op) {
    return op == Op::kFill || op == Op::kMaxExponent || op == Op::kToGrid || op == Op::kFromGrid;
  }
  template <class C>
  [[noreturn]] void not_built_here(const C&) const {
    fail(Status::kInternal, C::kName, " on ", device().str(), ": this backend has no such kernel (supports() says so)");
  }
  void run_call(const call::Fill& c) { not_built_here(c); }
  void run_call(const call::MaxExponent& c) { not_built_here(c); }
  void run_call(const call::ToGrid& c) { not_built_here(c); }
  void run_call(const call::FromGrid& c) { not_built_here(c); }
  void run_call(const call::Convert& c) {
    if (c.dst.dtype == c.dtype())
      k::to_low(c.dtype(), low(c, c.dst), f32(c, c.src), c.src.numel(), stream_);
    else
      k::from_low(c.dtype(), f32(c, c.dst), low(c, c.src), c.src.numel(), stream_);
  }
  void run_call(const call::BatchNormStats& c) {
    k::batchnorm_stats(f64(c, c.sums), f32(c, c.x), c.x.size(0), c.x.size(1), c.x.size(2), stream_);
  }
  void run_call(const call::BatchNormMoments& c) {
    k::batchnorm_moments(f64(c, c.mean_invstd), f32(c, c.running_mean), f32(c, c.running_var),
                         i64(c, c.num_batches_tracked), f64(c, c.sums), c.count, c.mean_invstd.numel() / 2, c.eps,
                         c.momentum, stream_);
  }
  void run_call(const call::BatchNormApply& c) {
    k::batchnorm_apply(f32(c, c.out), f32(c, c.x), f64(c, c.mean_invstd), f32(c, c.weight), f32(c, c.bias), c.x.size(0),
                       c.x.size(1), c.x.size(2), c.epilogue == Epilogue::kRelu, stream_);
  }
  void run_call(const call::BatchNormBackwardReduce& c) {
    k::batchnorm_backward_reduce(f64(c, c.sums), f32(c, c.dout), f32(c, c.x), f64(c, c.mean_invstd), c.x.size(0),
                                 c.x.size(1), c.x.size(2), stream_);
  }
  void run_call(const call::BatchNormBackwardApply& c) {
    k::batchnorm_backward_apply(f32(c, c.dinp), f32(c, c.dweight), f32(c, c.dbias), f64(c, c.local), f64(c, c.global),
                                c.count, f32(c, c.dout), f32(c, c.x), f64(c, c.mean_invstd), f32(c, c.weight),
                                c.x.size(0), c.x.size(1), c.x.size(2), c.accumulate, stream_);
  }
  void run_call(const call::LayerNormForward& c) {
    k::layernorm_forward(f32(c, c.out), f64(c, c.mean_rstd), f32(c, c.x), f32(c, c.weight), f32(c, c.bias),
                         c.x.leading(), c.x.size(-1), c.eps, stream_);
  }
  void run_call(const call::LayerNormBackward& c) {
    k::layernorm_backward(f32(c, c.dinp), f32(c, c.dweight), f32(c, c.dbias), f32(c, c.dout), f32(c, c.x),
                          f64(c, c.mean_rstd), f32(c, c.weight), c.x.leading(), c.x.size(-1), c.accumulate, stream_);
  }
  // The indices are device memory here: they were checked on the host before the step (the engine's
  // check_input_values); the kernels never read outside the weight for one that was not (kernels.h).
  void run_call(const call::EmbeddingForward& c) {
    k::embedding_forward(f32(c, c.out), i32(c, c.idx), f32(c, c.weight), c.idx.numel(), c.weight.size(0),
                         c.weight.size(1), stream_);
  }
  void run_call(const call::EmbeddingBackward& c) {
    k::embedding_backward(f32(c, c.dweight), f32(c, c.dout), i32(c, c.idx), c.idx.numel(), c.dweight.size(0),
                          c.dweight.size(1), c.padding_idx, c.accumulate, stream_);
  }
  void run_call(const call::PositionEmbeddingForward& c) {
    k::position_embedding_forward(f32(c, c.out), f32(c, c.inp), f32(c, c.weight), c.inp.size(0), c.inp.size(1),
                                  c.inp.size(2), stream_);
  }
  void run_call(const call::PositionEmbeddingBackward& c) {
    k::position_embedding_backward(f32(c, c.dweight), f32(c, c.dout), c.dout.size(0), c.dout.size(1),
                                   c.dout.size(2), c.dweight.size(0), c.accumulate, stream_);
  }

  void finish_setup() {
    try {
      // No cuBLAS handle here: it is made by the stream's first GEMM (blas()). Many streams never run one (a data
      // loader's copies batches to the device; a borrowed stream carries a framework's gradients), and the first
      // handle of a process loads cuBLAS, about 215 MB.
      DPAR_CUDA_CHECK(cudaEventCreateWithFlags(&staged_, cudaEventDisableTiming), "cudaEventCreate");
    } catch (...) {
      if (staged_) cudaEventDestroy(staged_);
      if (owns_stream_) cudaStreamDestroy(stream_);
      throw;
    }
  }
  // The stream's cuBLAS handle, made (and cuBLAS loaded, once per process) by the first GEMM.
  cublasHandle_t blas() {
    if (blas_) return blas_;
    const CublasLibrary& lib = cublas();  // loads cuBLAS the first time
    cublasHandle_t h = nullptr;
    DPAR_CUBLAS_CHECK(lib.create(&h), "cublasCreate on ", device().str());
    try {
      DPAR_CUBLAS_CHECK(lib.set_stream(h, stream_), "cublasSetStream");
      // FP32 arithmetic, as the CPU reference computes (no TF32 unless asked for: set_allow_tf32).
      DPAR_CUBLAS_CHECK(lib.set_math_mode(h, math_mode(allow_tf32_)), "cublasSetMathMode");
    } catch (...) {
      lib.destroy(h);
      throw;
    }
    return blas_ = h;
  }
  // CUBLAS_DEFAULT_MATH: cublasSgemm in FP32. CUBLAS_TF32_TENSOR_OP_MATH lets it round its operands to TF32
  // (NVIDIA_TF32_OVERRIDE=0 in the environment still turns that off, for every library of the process).
  static cublasMath_t math_mode(bool allow_tf32) {
    return allow_tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH;
  }
  // Every operation runs with the stream's device current: a replica's worker has made it current already (the
  // scope then costs one cudaGetDevice), but its communication thread and a borrowed stream's callers have not.
  DeviceScope enter() const { return DeviceScope(device().index); }
#ifdef DPAR_HAVE_CUDNN_HEADERS
  // Shared with the stream's cuDNN ops, which may outlive it (closed by the destructor).
  std::shared_ptr<CudnnContext> cudnn_context() {
    if (!cudnn_) {
      cudnn_ = std::make_shared<CudnnContext>(device(), stream_);
      cudnn_->set_allow_tf32(allow_tf32_);
    }
    return cudnn_;
  }
  std::shared_ptr<CudnnContext> cudnn_;
#else
  static constexpr const char* kNoCudnnHeaders =
      "dpar was built without cuDNN's headers (cudnn.h was not found at configure time: reconfigure with "
      "-DCUDNN_ROOT=<cuDNN's folder>), so its CUDA backend has no convolution or pooling";
#endif

  cudaStream_t stream_ = nullptr;
  bool owns_stream_ = false, borrowed_ = false;
  cublasHandle_t blas_ = nullptr;
  bool allow_tf32_ = false;  // set_allow_tf32: the handle's math mode, and the cuDNN context's
  cudaEvent_t staged_ = nullptr;  // the last copy out of pinned_ finished
  void* pinned_ = nullptr;
  size_t pinned_bytes_ = 0;
  double* sum_scratch_ = nullptr;  // sum_squares's partial sums (kSumSquaresBlocks) and total (1), device memory
};

// Attention on the stream it was made by, which must outlive its calls (a layer's op is its replica's). It owns the
// workspace that holds every head's weights during a call, grown to the largest call so far; nothing in it
// outlives a call (backward recomputes the weights), so one workspace serves forward and backward of any shape.
class CudaAttentionOp final : public AttentionOp {
 public:
  CudaAttentionOp(const AttentionSpec& spec, CudaStream* stream) : spec_(spec), stream_(stream) {}
  ~CudaAttentionOp() override {
    if (workspace_) {
      DeviceScope scope(stream_device_, std::nothrow);
      (void)cudaFree(workspace_);  // waits for the device's work, which may still read it
    }
  }

  void forward(const TensorRef& out, const TensorRef& lse, const TensorRef& q, const TensorRef& k, const TensorRef& v,
               float dropout_p, uint64_t seed, uint64_t offset) override {
    namespace a = attention_refs;
    const auto sh = a::shape(spec_, q, k);
    const int64_t C = sh.heads * sh.D;
    const auto o = a::contiguous(out, "out", sh.B, sh.L, C);
    float* l = a::lse(lse, sh);
    const auto drop = a::dropout(dropout_p, seed, offset);
    if (spec_.dtype == DType::kBF16) {
      const auto qq = a::tensor_bf16(q, "q", sh.B, sh.L, C), kk = a::tensor_bf16(k, "k", sh.B, sh.S, C),
                 vv = a::tensor_bf16(v, "v", sh.B, sh.S, C);
      const auto scope = stream_->enter();
      float* ws = workspace((k::attention_bf16_workspace_bytes(sh, false) + 3) / 4);
      return k::attention_forward_bf16(o, l, qq, kk, vv, sh, drop, ws, stream_->blas(), stream_->stream_);
    }
    const auto qq = a::tensor(q, "q", sh.B, sh.L, C), kk = a::tensor(k, "k", sh.B, sh.S, C),
               vv = a::tensor(v, "v", sh.B, sh.S, C);
    const auto scope = stream_->enter();
    float* ws = workspace(k::attention_workspace_floats(sh, false));
    k::attention_forward(o, l, qq, kk, vv, sh, drop, ws, stream_->blas(), stream_->stream_);
  }
  void backward(const TensorRef& dq, const TensorRef& dk, const TensorRef& dv, const TensorRef& dout,
                const TensorRef& q, const TensorRef& k, const TensorRef& v, const TensorRef& out, const TensorRef& lse,
                float dropout_p, uint64_t seed, uint64_t offset) override {
    namespace a = attention_refs;
    const auto sh = a::shape(spec_, q, k);
    const int64_t C = sh.heads * sh.D;
    const auto gq = a::tensor(dq, "dq", sh.B, sh.L, C), gk = a::tensor(dk, "dk", sh.B, sh.S, C),
               gv = a::tensor(dv, "dv", sh.B, sh.S, C), go = a::contiguous(dout, "dout", sh.B, sh.L, C),
               o = a::contiguous(out, "out", sh.B, sh.L, C);
    const float* l = a::lse(lse, sh);
    const auto drop = a::dropout(dropout_p, seed, offset);
    if (spec_.dtype == DType::kBF16) {
      const auto qq = a::tensor_bf16(q, "q", sh.B, sh.L, C), kk = a::tensor_bf16(k, "k", sh.B, sh.S, C),
                 vv = a::tensor_bf16(v, "v", sh.B, sh.S, C);
      const auto scope = stream_->enter();
      float* ws = workspace((k::attention_bf16_workspace_bytes(sh, true) + 3) / 4);
      return k::attention_backward_bf16(gq, gk, gv, go, qq, kk, vv, o, l, sh, drop, ws, stream_->blas(),
                                        stream_->stream_);
    }
    const auto qq = a::tensor(q, "q", sh.B, sh.L, C), kk = a::tensor(k, "k", sh.B, sh.S, C),
               vv = a::tensor(v, "v", sh.B, sh.S, C);
    const auto scope = stream_->enter();
    float* ws = workspace(k::attention_workspace_floats(sh, true));
    k::attention_backward(gq, gk, gv, go, qq, kk, vv, o, l, sh, drop, ws, stream_->blas(), stream_->stream_);
  }

 private:
  // At least `floats` of device memory. A larger one replaces the old after the stream's queued work (which may
  // read the old) is done: cudaFree waits for the device.
  float* workspace(int64_t floats) {
    if (floats <= capacity_) return workspace_;
    if (workspace_) {
      DPAR_CUDA_CHECK(cudaFree(workspace_), "cudaFree of attention's workspace on ", stream_->device().str());
      workspace_ = nullptr, capacity_ = 0;
    }
    DPAR_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&workspace_), static_cast<size_t>(floats) * sizeof(float)),
                    "cudaMalloc of attention's workspace (", floats, " floats) on ", stream_->device().str());
    capacity_ = floats;
    stream_device_ = stream_->device().index;
    return workspace_;
  }

  AttentionSpec spec_;
  CudaStream* stream_;
  float* workspace_ = nullptr;
  int64_t capacity_ = 0;
  int stream_device_ = 0;
};

std::unique_ptr<AttentionOp> CudaStream::make_attention(const AttentionSpec& spec) {
  DPAR_CHECK_ARG(spec.heads >= 1, spec.str(), ": heads must be >= 1, got ", spec.heads);
  // f32 or bf16 (AttentionSpec::dtype); an f16 attention is refused here, before a step, rather than read as f32.
  if (spec.dtype != DType::kF32 && spec.dtype != DType::kBF16)
    fail(Status::kNotSupported, spec.str(), " in ", dtype_name(spec.dtype), " on ", device().str(),
         ": this backend's attention computes in f32 or bf16");
  return std::make_unique<CudaAttentionOp>(spec, this);
}

}  // namespace

std::unique_ptr<Stream> make_cuda_stream(Device device) { return std::make_unique<CudaStream>(device); }

std::unique_ptr<Stream> wrap_cuda_stream(Device device, cudaStream_t borrowed) {
  return std::make_unique<CudaStream>(device, borrowed);
}

cudaStream_t cuda_stream_handle(Stream& stream) {
  auto* s = dynamic_cast<CudaStream*>(&stream);
  DPAR_CHECK_ARG(s != nullptr, stream.device().str(), ": not a stream of dpar's CUDA backend");
  return s->handle();
}

}  // namespace dpar
