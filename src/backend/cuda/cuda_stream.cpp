#include "backend/cuda/cuda_stream.h"

#include <cuda_runtime_api.h>

#include <cstring>

#include "common/error.h"
#ifdef DPAR_HAVE_CUDNN_HEADERS
#include "backend/cuda/cudnn_ops.h"
#endif
#include "kernels/cuda/kernels.h"
#include "platform/cuda/cublas_library.h"
#include "platform/cuda/cuda_check.h"

namespace dpar {
namespace {
namespace k = kernels::cuda;

using cuda::cublas;
using cuda::CublasLibrary;
using cuda::DeviceScope;

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

  void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t B, int64_t C_in,
                      int64_t C_out) override {
    const auto scope = enter();
    k::linear_forward(out, inp, weight, bias, B, C_in, C_out, blas(), stream_);
  }
  void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                       const float* weight, int64_t B, int64_t C_in, int64_t C_out, bool accumulate) override {
    const auto scope = enter();
    k::linear_backward(dinp, dweight, dbias, dout, inp, weight, B, C_in, C_out, accumulate, blas(), stream_);
  }
  void linear_relu_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t B,
                           int64_t C_in, int64_t C_out) override {
    const auto scope = enter();
    k::linear_relu_forward(out, inp, weight, bias, B, C_in, C_out, blas(), stream_);
  }
  void linear_relu_backward(float* dinp, float* dweight, float* dbias, float* dpre, const float* dout,
                            const float* out, const float* inp, const float* weight, int64_t B, int64_t C_in,
                            int64_t C_out, bool accumulate) override {
    const auto scope = enter();
    k::linear_relu_backward(dinp, dweight, dbias, dpre, dout, out, inp, weight, B, C_in, C_out, accumulate, blas(),
                            stream_);
  }
  void activation_forward(Activation kind, float* out, const float* inp, int64_t n) override {
    const auto scope = enter();
    switch (kind) {
      case Activation::kRelu: return k::relu_forward(out, inp, n, stream_);
      case Activation::kGelu: return k::gelu_forward(out, inp, n, stream_);
      case Activation::kTanh: return k::tanh_forward(out, inp, n, stream_);
      case Activation::kSigmoid: return k::sigmoid_forward(out, inp, n, stream_);
    }
  }
  void activation_backward(Activation kind, float* dinp, const float* dout, const float* inp, const float* out,
                           int64_t n) override {
    const auto scope = enter();
    switch (kind) {
      case Activation::kRelu: return k::relu_backward(dinp, dout, out, n, stream_);
      case Activation::kGelu: return k::gelu_backward(dinp, dout, inp, n, stream_);
      case Activation::kTanh: return k::tanh_backward(dinp, dout, out, n, stream_);
      case Activation::kSigmoid: return k::sigmoid_backward(dinp, dout, out, n, stream_);
    }
  }
  void dropout_forward(float* out, float* mask, const float* inp, int64_t n, float p, uint64_t seed,
                       uint64_t offset) override {
    const auto scope = enter();
    k::dropout_forward(out, mask, inp, n, p, seed, offset, stream_);
  }
  void dropout_backward(float* dinp, const float* dout, const float* mask, int64_t n) override {
    const auto scope = enter();
    k::dropout_backward(dinp, dout, mask, n, stream_);
  }
  void cross_entropy_forward_backward(double* loss_sum, float* dlogits, const float* logits, const int32_t* labels,
                                      int64_t B, int64_t C, float grad_scale) override {
    const auto scope = enter();
    k::cross_entropy_forward_backward(loss_sum, dlogits, logits, labels, B, C, grad_scale, stream_);
  }
  void mse_forward_backward(double* loss_sum, float* dpred, const float* pred, const float* target, int64_t B,
                            int64_t D, float grad_scale) override {
    const auto scope = enter();
    k::mse_forward_backward(loss_sum, dpred, pred, target, B, D, grad_scale, stream_);
  }
  void sgd_step(float* param, float* momentum_buf, const float* grad, int64_t n, const SgdHyper& h,
                bool first_step) override {
    const auto scope = enter();
    k::sgd_step(param, momentum_buf, grad, n, h, first_step, stream_);
  }
  void adam_step(float* param, float* exp_avg, float* exp_avg_sq, const float* grad, int64_t n,
                 const AdamHyper& h, int64_t step) override {
    const auto scope = enter();
    k::adam_step(param, exp_avg, exp_avg_sq, grad, n, h, step, stream_);
  }
  void axpy(float* y, const float* x, float a, int64_t n) override {
    const auto scope = enter();
    k::axpy(y, x, a, n, stream_);
  }
  void scale(float* x, float a, int64_t n) override {
    const auto scope = enter();
    k::scale(x, a, n, stream_);
  }
  void to_bf16(uint16_t* dst, const float* src, int64_t n) override {
    const auto scope = enter();
    k::to_bf16(dst, src, n, stream_);
  }
  void from_bf16(float* dst, const uint16_t* src, int64_t n) override {
    const auto scope = enter();
    k::from_bf16(dst, src, n, stream_);
  }
  void batchnorm_stats(double* sums, const float* x, int64_t N, int64_t C, int64_t L) override {
    const auto scope = enter();
    k::batchnorm_stats(sums, x, N, C, L, stream_);
  }
  void batchnorm_moments(double* mean_invstd, float* running_mean, float* running_var, int64_t* num_batches_tracked,
                         const double* sums, double count, int64_t C, float eps, float momentum) override {
    const auto scope = enter();
    k::batchnorm_moments(mean_invstd, running_mean, running_var, num_batches_tracked, sums, count, C, eps, momentum,
                         stream_);
  }
  void batchnorm_apply(float* out, const float* x, const double* mean_invstd, const float* weight, const float* bias,
                       int64_t N, int64_t C, int64_t L) override {
    const auto scope = enter();
    k::batchnorm_apply(out, x, mean_invstd, weight, bias, N, C, L, stream_);
  }
  void batchnorm_backward_reduce(double* sums, const float* dout, const float* x, const double* mean_invstd,
                                 int64_t N, int64_t C, int64_t L) override {
    const auto scope = enter();
    k::batchnorm_backward_reduce(sums, dout, x, mean_invstd, N, C, L, stream_);
  }
  void batchnorm_backward_apply(float* dinp, float* dweight, float* dbias, const double* local, const double* global,
                                double count, const float* dout, const float* x, const double* mean_invstd,
                                const float* weight, int64_t N, int64_t C, int64_t L, bool accumulate) override {
    const auto scope = enter();
    k::batchnorm_backward_apply(dinp, dweight, dbias, local, global, count, dout, x, mean_invstd, weight, N, C, L,
                                accumulate, stream_);
  }
  void layernorm_forward(float* out, double* mean_rstd, const float* x, const float* weight, const float* bias,
                         int64_t N, int64_t D, float eps) override {
    const auto scope = enter();
    k::layernorm_forward(out, mean_rstd, x, weight, bias, N, D, eps, stream_);
  }
  void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* x,
                          const double* mean_rstd, const float* weight, int64_t N, int64_t D,
                          bool accumulate) override {
    const auto scope = enter();
    k::layernorm_backward(dinp, dweight, dbias, dout, x, mean_rstd, weight, N, D, accumulate, stream_);
  }
  // The indices are device memory here: they were checked on the host before the step (the engine's
  // check_input_values); the kernels never read outside the weight for one that was not (kernels.h).
  void embedding_forward(float* out, const int32_t* idx, const float* weight, int64_t N, int64_t V,
                         int64_t E) override {
    const auto scope = enter();
    k::embedding_forward(out, idx, weight, N, V, E, stream_);
  }
  void embedding_backward(float* dweight, const float* dout, const int32_t* idx, int64_t N, int64_t V, int64_t E,
                          int64_t padding_idx, bool accumulate) override {
    const auto scope = enter();
    k::embedding_backward(dweight, dout, idx, N, V, E, padding_idx, accumulate, stream_);
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
  double sum_squares(const float* x, int64_t n) override {
    const auto scope = enter();
    if (!sum_scratch_)  // once per stream: the kernels' partial sums and their total
      DPAR_CUDA_CHECK(cudaMalloc(&sum_scratch_, (k::kSumSquaresBlocks + 1) * sizeof(double)),
                      "cudaMalloc of the sum of squares' scratch on ", device().str());
    k::sum_squares(sum_scratch_ + k::kSumSquaresBlocks, sum_scratch_, x, n, stream_);
    double total = 0.0;
    copy_to_host(&total, sum_scratch_ + k::kSumSquaresBlocks, sizeof(double));
    return total;
  }

 private:
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
      // FP32 arithmetic, as the CPU reference computes (no TF32 unless asked for).
      DPAR_CUBLAS_CHECK(lib.set_math_mode(h, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
    } catch (...) {
      lib.destroy(h);
      throw;
    }
    return blas_ = h;
  }
  // Every operation runs with the stream's device current: a replica's worker has made it current already (the
  // scope then costs one cudaGetDevice), but its communication thread and a borrowed stream's callers have not.
  DeviceScope enter() const { return DeviceScope(device().index); }
#ifdef DPAR_HAVE_CUDNN_HEADERS
  // Shared with the stream's cuDNN ops, which may outlive it (closed by the destructor).
  std::shared_ptr<CudnnContext> cudnn_context() {
    if (!cudnn_) cudnn_ = std::make_shared<CudnnContext>(device(), stream_);
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
  cudaEvent_t staged_ = nullptr;  // the last copy out of pinned_ finished
  void* pinned_ = nullptr;
  size_t pinned_bytes_ = 0;
  double* sum_scratch_ = nullptr;  // sum_squares's partial sums (kSumSquaresBlocks) and total (1), device memory
};

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
