#include "backend/cpu/cpu_backend.h"

#include <cstdlib>
#include <cstring>

#include "comm/threads_comm.h"
#include "common/error.h"
#include "device/worker_pool.h"
#include "kernels/cpu/batchnorm.h"
#include "kernels/cpu/dnnl_ops.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/norm_embedding.h"

namespace dpar {
namespace {
namespace k = kernels::cpu;

// The op seam over the CPU kernels' oneDNN primitives (kernels/cpu/dnnl_ops.h), which know no backend.
class CpuConv2dOp final : public Conv2dOp {
 public:
  explicit CpuConv2dOp(const Conv2dSpec& spec) : conv_(spec) {}
  void forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int64_t H,
               int64_t W) override {
    conv_.forward(out, inp, weight, bias, N, H, W);
  }
  void backward_data(float* dinp, const float* dout, const float* weight, int64_t N, int64_t H, int64_t W) override {
    conv_.backward_data(dinp, dout, weight, N, H, W);
  }
  void backward_weights(float* dweight, float* dbias, const float* dout, const float* inp, int64_t N, int64_t H,
                        int64_t W, bool accumulate) override {
    conv_.backward_weights(dweight, dbias, dout, inp, N, H, W, accumulate);
  }

 private:
  k::Conv2d conv_;
};

class CpuPool2dOp final : public Pool2dOp {
 public:
  explicit CpuPool2dOp(const Pool2dSpec& spec) : pool_(spec) {}
  void forward(float* out, const float* inp, int64_t N, int64_t C, int64_t H, int64_t W) override {
    pool_.forward(out, inp, N, C, H, W);
  }
  void backward(float* dinp, const float* dout, const float*, const float*, int64_t N, int64_t C, int64_t H,
                int64_t W) override {
    pool_.backward(dinp, dout, N, C, H, W);
  }

 private:
  k::Pool2d pool_;
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

  void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t B, int64_t C_in,
                      int64_t C_out) override {
    k::linear_forward(out, inp, weight, bias, B, C_in, C_out);
  }
  void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                       const float* weight, int64_t B, int64_t C_in, int64_t C_out, bool accumulate) override {
    k::linear_backward(dinp, dweight, dbias, dout, inp, weight, B, C_in, C_out, accumulate);
  }
  void linear_relu_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t B,
                           int64_t C_in, int64_t C_out) override {
    k::linear_relu_forward(out, inp, weight, bias, B, C_in, C_out);
  }
  void linear_relu_backward(float* dinp, float* dweight, float* dbias, float* dpre, const float* dout,
                            const float* out, const float* inp, const float* weight, int64_t B, int64_t C_in,
                            int64_t C_out, bool accumulate) override {
    k::linear_relu_backward(dinp, dweight, dbias, dpre, dout, out, inp, weight, B, C_in, C_out, accumulate);
  }
  void activation_forward(Activation kind, float* out, const float* inp, int64_t n) override {
    switch (kind) {
      case Activation::kRelu: return k::relu_forward(out, inp, n);
      case Activation::kGelu: return k::gelu_forward(out, inp, n);
      case Activation::kTanh: return k::tanh_forward(out, inp, n);
      case Activation::kSigmoid: return k::sigmoid_forward(out, inp, n);
    }
  }
  void activation_backward(Activation kind, float* dinp, const float* dout, const float* inp, const float* out,
                           int64_t n) override {
    switch (kind) {
      case Activation::kRelu: return k::relu_backward(dinp, dout, out, n);
      case Activation::kGelu: return k::gelu_backward(dinp, dout, inp, n);
      case Activation::kTanh: return k::tanh_backward(dinp, dout, out, n);
      case Activation::kSigmoid: return k::sigmoid_backward(dinp, dout, out, n);
    }
  }
  void dropout_forward(float* out, float* mask, const float* inp, int64_t n, float p, uint64_t seed,
                       uint64_t offset) override {
    k::dropout_forward(out, mask, inp, n, p, seed, offset);
  }
  void dropout_backward(float* dinp, const float* dout, const float* mask, int64_t n) override {
    k::dropout_backward(dinp, dout, mask, n);
  }
  void cross_entropy_forward_backward(double* loss_sum, float* dlogits, const float* logits, const int32_t* labels,
                                      int64_t B, int64_t C, float grad_scale) override {
    *loss_sum = k::cross_entropy_forward_backward(dlogits, logits, labels, B, C, grad_scale);
  }
  void mse_forward_backward(double* loss_sum, float* dpred, const float* pred, const float* target, int64_t B,
                            int64_t D, float grad_scale) override {
    *loss_sum = k::mse_forward_backward(dpred, pred, target, B, D, grad_scale);
  }
  void sgd_step(float* param, float* momentum_buf, const float* grad, int64_t n, const SgdHyper& h,
                bool first_step) override {
    k::sgd_step(param, momentum_buf, grad, n, h, first_step);
  }
  void adam_step(float* param, float* exp_avg, float* exp_avg_sq, const float* grad, int64_t n,
                 const AdamHyper& h, int64_t step) override {
    k::adam_step(param, exp_avg, exp_avg_sq, grad, n, h, step);
  }
  void axpy(float* y, const float* x, float a, int64_t n) override { k::axpy(y, x, a, n); }
  void scale(float* x, float a, int64_t n) override { k::scale(x, a, n); }
  double sum_squares(const float* x, int64_t n) override { return k::sum_squares(x, n); }
  void to_bf16(uint16_t* dst, const float* src, int64_t n) override { k::to_bf16(dst, src, n); }
  void from_bf16(float* dst, const uint16_t* src, int64_t n) override { k::from_bf16(dst, src, n); }

  std::unique_ptr<Conv2dOp> make_conv2d(const Conv2dSpec& spec) override {
    return std::make_unique<CpuConv2dOp>(spec);
  }
  std::unique_ptr<Pool2dOp> make_pool2d(const Pool2dSpec& spec) override {
    return std::make_unique<CpuPool2dOp>(spec);
  }
  void batchnorm_stats(double* sums, const float* x, int64_t N, int64_t C, int64_t L) override {
    k::batchnorm_stats(sums, x, N, C, L);
  }
  void batchnorm_moments(double* mean_invstd, float* running_mean, float* running_var, int64_t* num_batches_tracked,
                         const double* sums, double count, int64_t C, float eps, float momentum) override {
    k::batchnorm_moments(mean_invstd, running_mean, running_var, num_batches_tracked, sums, count, C, eps, momentum);
  }
  void batchnorm_apply(float* out, const float* x, const double* mean_invstd, const float* weight, const float* bias,
                       int64_t N, int64_t C, int64_t L) override {
    k::batchnorm_apply(out, x, mean_invstd, weight, bias, N, C, L);
  }
  void batchnorm_backward_reduce(double* sums, const float* dout, const float* x, const double* mean_invstd,
                                 int64_t N, int64_t C, int64_t L) override {
    k::batchnorm_backward_reduce(sums, dout, x, mean_invstd, N, C, L);
  }
  void batchnorm_backward_apply(float* dinp, float* dweight, float* dbias, const double* local, const double* global,
                                double count, const float* dout, const float* x, const double* mean_invstd,
                                const float* weight, int64_t N, int64_t C, int64_t L, bool accumulate) override {
    k::batchnorm_backward_apply(dinp, dweight, dbias, local, global, count, dout, x, mean_invstd, weight, N, C, L,
                                accumulate);
  }
  void layernorm_forward(float* out, double* mean_rstd, const float* x, const float* weight, const float* bias,
                         int64_t N, int64_t D, float eps) override {
    k::layernorm_forward(out, mean_rstd, x, weight, bias, N, D, eps);
  }
  void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* x,
                          const double* mean_rstd, const float* weight, int64_t N, int64_t D,
                          bool accumulate) override {
    k::layernorm_backward(dinp, dweight, dbias, dout, x, mean_rstd, weight, N, D, accumulate);
  }
  void embedding_forward(float* out, const int32_t* idx, const float* weight, int64_t N, int64_t V,
                         int64_t E) override {
    k::embedding_forward(out, idx, weight, N, V, E);
  }
  void embedding_backward(float* dweight, const float* dout, const int32_t* idx, int64_t N, int64_t V, int64_t E,
                          int64_t padding_idx, bool accumulate) override {
    k::embedding_backward(dweight, dout, idx, N, V, E, padding_idx, accumulate);
  }
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
