// CUDA math kernels: the twins of kernels/cpu/kernels.h, on device buffers, queued on a stream.
//
// Every function here has the contract of its CPU twin (same arguments, same formulas, same op order where the
// CPU kernel documents one), plus the stream it is queued on (and, for GEMMs, the cuBLAS handle, already bound
// to that stream by the caller). Kernels know nothing about tensors, threads, replicas or ranks, allocate
// nothing, never synchronise the host, and never throw for data: argument checks are the O(1) ones of the CPU
// twins (shapes, counts) and throw dpar::Error(INVALID_ARGUMENT); a launch failure throws dpar::Error(DEVICE)
// naming the kernel. The CPU kernel is every kernel's reference (tests/test_cuda_kernels.cpp).
//
// Determinism: each output element is computed by a fixed sequence of operations, independent of the launch
// configuration, and reductions (bias gradients, losses) run in a fixed order, so the same inputs give the same
// bits call after call. GEMMs go through cuBLAS with its deterministic algorithms (no split-K atomics).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/op_specs.h"        // kIgnoreIndex
#include "common/optimizer_hyper.h"  // SgdHyper, AdamHyper: the CPU twins' structs
#include "kernels/pointwise.h"

namespace dpar::kernels::cuda {

// ---------------------------------------------------------------------------------------------------------------
// Linear layer (cuBLAS SGEMM, FP32 arithmetic: the CPU twin's precision, unless the stream allows TF32).

// out = inp @ weight^T + bias.
// inp (B,C_in), weight (C_out,C_in), bias (C_out) or nullptr, out (B,C_out)
void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t B, int64_t C_in,
                    int64_t C_out, cublasHandle_t blas, cudaStream_t stream);

// dinp = dout @ weight (skipped if dinp == nullptr); dweight = dout^T @ inp; dbias = sum over the batch of dout
// (skipped if dbias == nullptr). accumulate=false overwrites dweight/dbias, accumulate=true adds to them.
// dinp (B,C_in), dweight (C_out,C_in), dbias (C_out), dout (B,C_out), inp (B,C_in), weight (C_out,C_in)
void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t B, int64_t C_in, int64_t C_out, bool accumulate,
                     cublasHandle_t blas, cudaStream_t stream);

// out = relu(inp @ weight^T + bias), as the CPU twin: the GEMM's value, then the bias added, then the ReLU (one pass
// over out after the GEMM).
void linear_relu_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t B,
                         int64_t C_in, int64_t C_out, cublasHandle_t blas, cudaStream_t stream);

// The backward of linear_relu_forward from dout = dL/d(its output) and out = its output: dpre (B,C_out) = the
// ReLU's backward, with dbias summed from it in the same pass (as linear_backward sums it: the same bits), then
// linear_backward's GEMMs from dpre. dinp may be dout's memory.
void linear_relu_backward(float* dinp, float* dweight, float* dbias, float* dpre, const float* dout,
                          const float* out, const float* inp, const float* weight, int64_t B, int64_t C_in,
                          int64_t C_out, bool accumulate, cublasHandle_t blas, cudaStream_t stream);

// Mixed precision (call::LinearForward and LinearBackward in bf16 or f16, the dtype `low`): inp and weight are
// `low` (their bits, uint16_t), every other buffer f32. The GEMMs take the 16-bit operands and accumulate in f32
// (cublasGemmEx with CUDA_R_16BF or CUDA_R_16F, CUBLAS_COMPUTE_32F); the bias, the ReLU (relu: the ReLU epilogue)
// and their backward are the f32 kernels' passes above. Backward rounds the f32 gradient before the GEMMs (dout, or
// dpre with the ReLU) to `low` into dout_low (B,C_out), which both GEMMs read. dpre and out are read only with
// relu (else may be null). Error(INVALID_ARGUMENT) for a `low` other than bf16 or f16.
void linear_forward_mixed(DType low, float* out, const uint16_t* inp, const uint16_t* weight, const float* bias,
                          int64_t B, int64_t C_in, int64_t C_out, bool relu, cublasHandle_t blas,
                          cudaStream_t stream);
void linear_backward_mixed(DType low, float* dinp, float* dweight, float* dbias, float* dpre, uint16_t* dout_low,
                           const float* dout, const float* out, const uint16_t* inp, const uint16_t* weight,
                           int64_t B, int64_t C_in, int64_t C_out, bool relu, bool accumulate, cublasHandle_t blas,
                           cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------------
// Elementwise activations on n elements (all buffers (n)); out may alias inp exactly.

void relu_forward(float* out, const float* inp, int64_t n, cudaStream_t stream);
void relu_backward(float* dinp, const float* dout, const float* out, int64_t n, cudaStream_t stream);
void gelu_forward(float* out, const float* inp, int64_t n, cudaStream_t stream);
void gelu_backward(float* dinp, const float* dout, const float* inp, int64_t n, cudaStream_t stream);
void tanh_forward(float* out, const float* inp, int64_t n, cudaStream_t stream);
void tanh_backward(float* dinp, const float* dout, const float* out, int64_t n, cudaStream_t stream);
void sigmoid_forward(float* out, const float* inp, int64_t n, cudaStream_t stream);
void sigmoid_backward(float* dinp, const float* dout, const float* out, int64_t n, cudaStream_t stream);
// A pointwise activation of kernels/pointwise.h (instantiated in elementwise.cu for each of its list).
template <class F>
void pointwise_forward(float* out, const float* inp, int64_t n, cudaStream_t stream);
template <class F>
void pointwise_backward(float* dinp, const float* dout, const float* inp, const float* out, int64_t n,
                        cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------------
// Dropout with dpar's counter-based stream: element i is kept iff cpu::dropout_uniform(seed, offset + i) >= p,
// bit for bit the CPU twin's draw, so a GPU replica draws exactly the mask its CPU twin draws.
// out (n), mask (n), inp (n)
void dropout_forward(float* out, float* mask, const float* inp, int64_t n, float p, uint64_t seed, uint64_t offset,
                     cudaStream_t stream);
// dinp (n), dout (n), mask (n)
void dropout_backward(float* dinp, const float* dout, const float* mask, int64_t n, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------------
// Losses fused with their gradient. The SUM over the batch of per-sample losses (accumulated in double, in a
// fixed order) is written to *loss_sum, a device double; the gradient is that of (the sum * grad_scale).
// dlogits/dpred may be nullptr for the loss alone. A row labelled kIgnoreIndex adds no loss and gets a zero
// gradient row (as the CPU twin); any other label must lie in [0, C): the caller checks them (a kernel cannot
// throw); an out-of-range label gives a NaN loss, never an out-of-bounds read.

// dlogits (B,C), logits (B,C), labels (B)
void cross_entropy_forward_backward(double* loss_sum, float* dlogits, const float* logits, const int32_t* labels,
                                    int64_t B, int64_t C, float grad_scale, cudaStream_t stream);
// dpred (B,D), pred (B,D), target (B,D)
void mse_forward_backward(double* loss_sum, float* dpred, const float* pred, const float* target, int64_t B,
                          int64_t D, float grad_scale, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------------
// Optimizers on flat buffers (one launch for every parameter of a replica), PyTorch's formulas, as the CPU twins.

// param (n), momentum_buf (n) or nullptr when momentum == 0, grad (n)
void sgd_step(float* param, float* momentum_buf, const float* grad, int64_t n, const SgdHyper& h, bool first_step,
              cudaStream_t stream);
// step is 1-based. param (n), exp_avg (n), exp_avg_sq (n), grad (n)
void adam_step(float* param, float* exp_avg, float* exp_avg_sq, const float* grad, int64_t n, const AdamHyper& h,
               int64_t step, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------------
// BatchNorm (kernels/cpu/batchnorm.h has each contract; every double is device memory too, and so is
// num_batches_tracked). x, dout, out, dinp (N,C,L); sums, local, global, mean_invstd (2,C); weight, bias (C) or
// nullptr. A channel's sums are one block's fixed tree in double (batchnorm.cu); the elementwise passes and
// batchnorm_moments give the CPU twins' bits.

void batchnorm_stats(double* sums, const float* x, int64_t N, int64_t C, int64_t L, cudaStream_t stream);
void batchnorm_moments(double* mean_invstd, float* running_mean, float* running_var, int64_t* num_batches_tracked,
                       const double* sums, double count, int64_t C, float eps, float momentum, cudaStream_t stream);
void batchnorm_apply(float* out, const float* x, const double* mean_invstd, const float* weight, const float* bias,
                     int64_t N, int64_t C, int64_t L, bool relu, cudaStream_t stream);
void batchnorm_backward_reduce(double* sums, const float* dout, const float* x, const double* mean_invstd, int64_t N,
                               int64_t C, int64_t L, cudaStream_t stream);
void batchnorm_backward_apply(float* dinp, float* dweight, float* dbias, const double* local, const double* global,
                              double count, const float* dout, const float* x, const double* mean_invstd,
                              const float* weight, int64_t N, int64_t C, int64_t L, bool accumulate,
                              cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------------
// LayerNorm and Embedding (kernels/cpu/norm_embedding.h has each contract). x, out, dout, dinp (N,D); mean_rstd
// (2,N) doubles; weight, bias (D) both or neither. Embedding: idx (N), weight and dweight (V,E), out and dout (N,E).
// The indices must lie in [0, V): the caller checks them on the host (a kernel cannot throw). One outside that
// reaches a kernel anyway is never read through: forward writes a row of zeros for it, backward skips it.

void layernorm_forward(float* out, double* mean_rstd, const float* x, const float* weight, const float* bias,
                       int64_t N, int64_t D, float eps, cudaStream_t stream);
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* x,
                        const double* mean_rstd, const float* weight, int64_t N, int64_t D, bool accumulate,
                        cudaStream_t stream);
void embedding_forward(float* out, const int32_t* idx, const float* weight, int64_t N, int64_t V, int64_t E,
                       cudaStream_t stream);
void embedding_backward(float* dweight, const float* dout, const int32_t* idx, int64_t N, int64_t V, int64_t E,
                        int64_t padding_idx, bool accumulate, cudaStream_t stream);
// GPT-2's learned positions (kernels/cpu/norm_embedding.h): out, inp, dout (B,T,C); weight, dweight (P,C). The
// backward sums the batch in batch order, as the CPU kernel (the same bits).
void position_embedding_forward(float* out, const float* inp, const float* weight, int64_t B, int64_t T, int64_t C,
                                cudaStream_t stream);
void position_embedding_backward(float* dweight, const float* dout, int64_t B, int64_t T, int64_t C, int64_t P,
                                 bool accumulate, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------------------------
// Small helpers.

// y += a*x.  y (n), x (n)
void axpy(float* y, const float* x, float a, int64_t n, cudaStream_t stream);
// x *= a.  x (n)
void scale(float* x, float a, int64_t n, cudaStream_t stream);
// The CPU twins' bfloat16 conversions, bit for bit (to nearest, ties to even; a NaN stays a quiet NaN of its sign).
// dst (n), src (n)
void to_bf16(uint16_t* dst, const float* src, int64_t n, cudaStream_t stream);
void from_bf16(float* dst, const uint16_t* src, int64_t n, cudaStream_t stream);
// The CPU twins' f16 conversions (common/f16.h's, one definition for both), bit for bit: to nearest, ties to even,
// overflow to infinity; a NaN stays a quiet NaN of its sign with its payload's top bits (where CUDA's
// __float2half_rn would make every NaN the canonical 0x7fff). dst (n), src (n)
void to_f16(uint16_t* dst, const float* src, int64_t n, cudaStream_t stream);
void from_f16(float* dst, const uint16_t* src, int64_t n, cudaStream_t stream);
// The conversion for a mixed-precision dtype `low` (bf16 or f16; Error(INVALID_ARGUMENT) for another): to_bf16 or
// to_f16, from_bf16 or from_f16.
void to_low(DType low, uint16_t* dst, const float* src, int64_t n, cudaStream_t stream);
void from_low(DType low, float* dst, const uint16_t* src, int64_t n, cudaStream_t stream);
// *total = the sum of x[i]^2 in double: block b of a fixed grid of kSumSquaresBlocks adds its grid-stride elements
// and writes partials[b], then one block adds the partials, each in a fixed tree, so every call gives the same bits.
// The CPU twin (8 lanes) adds in another order: equal within double rounding.
// total (1), partials (kSumSquaresBlocks), both device memory; x (n)
constexpr int kSumSquaresBlocks = 256;
void sum_squares(double* total, double* partials, const float* x, int64_t n, cudaStream_t stream);

// The buffers of one reduction of replicas that share a device: passed to the kernel by value, as its argument, so
// that no table lives in device memory. A table there would have to be uploaded when the buffers change (from the
// host, ordered with the kernels that read the previous one) and could go stale after a failed upload; an argument
// is part of the launch itself. kMaxBuffers bounds its size (kernel arguments are limited to 4 KiB).
template <class T>
struct SumBuffersOf {
  static constexpr int kMaxBuffers = 64;
  T* buffer[kMaxBuffers];
  uint64_t contributes;  // bit b: whether buffer[b] contributes
  int count;             // buffers in use, <= kMaxBuffers
};
using SumBuffers = SumBuffersOf<float>;

// The reduction of replicas that share a device (or reach each other's memory by peer access): elements
// [begin, end) of every buffer get (sum over b, in index order, of buffer[b][i] where contributes has bit b) *
// scale. Each participant reduces its own slice of every buffer on its own stream (the one-pass algorithm of the
// threads backend, in device memory). Order of the sum is buffer order, so every slice gets the same bits
// whichever participant computes it.
void sum_slice_into_all(const SumBuffers& buffers, int64_t begin, int64_t end, float scale, cudaStream_t stream);
// The same in double (SyncBatchNorm's per-channel sums over replicas that share a GPU): the sum in buffer order,
// in double, then * scale.
void sum_slice_into_all(const SumBuffersOf<double>& buffers, int64_t begin, int64_t end, float scale,
                        cudaStream_t stream);

}  // namespace dpar::kernels::cuda
