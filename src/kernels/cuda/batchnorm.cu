// BatchNorm on CUDA: the twins of kernels/cpu/batchnorm.h (see there and kernels.h for the contracts).
//
// A channel's reductions (Σx, Σx²; Σdy, Σdy·x̂) are one block's: its threads take the channel's N*L elements in a
// fixed interleave, each accumulating in double, and the block adds the per-thread sums in a fixed tree
// (detail::block_sum). So the sums need no atomics and no scratch, and have the same bits on every call; they
// differ from the CPU's sequential sums only by double rounding. One block per channel leaves SMs idle when C is
// small and N*L large (C = 16 on an H100 uses 16 of 132 SMs); a two-pass split of each channel would need scratch
// from the caller, which the Stream interface does not give these kernels.
//
// The elementwise passes and batchnorm_moments compute each element with the CPU twin's expression, in the same
// order, in double; with --fmad=false (launch.cuh) and IEEE division and sqrt they give the CPU twin's bits.
#include "kernels/cuda/kernels.h"

#include "kernels/cuda/launch.cuh"

namespace dpar::kernels::cuda {

using detail::blocks_for;
using detail::kThreads;

namespace {

constexpr int kChannelThreads = 256;  // the block of one channel's reduction
// Channels are taken by blocks in a block-stride loop; more blocks than this only add scheduling.
constexpr int64_t kMaxChannelBlocks = 4096;

unsigned channel_blocks(int64_t C) { return static_cast<unsigned>(C < kMaxChannelBlocks ? C : kMaxChannelBlocks); }

// Thread t of a channel's block visits elements i = t, t + kChannelThreads, ... of the channel's N*L, element
// i = n*L + l being x[(n*C + c)*L + l]. (n, l) advance by a precomputed step, without a division per element.
// L >= 1.
struct PlaneWalk {
  int64_t n, l, dn, dl;
  __device__ PlaneWalk(int64_t L) : n(threadIdx.x / L), l(threadIdx.x % L), dn(kChannelThreads / L),
                                    dl(kChannelThreads % L) {}
  __device__ void next(int64_t L) {
    n += dn;
    l += dl;
    if (l >= L) {
      l -= L;
      ++n;
    }
  }
};

// sums (2,C), x (N,C,L). N = 0 writes zeros. L >= 1.
__global__ void __launch_bounds__(kChannelThreads) batchnorm_stats_kernel(double* sums, const float* x, int64_t N,
                                                                          int64_t C, int64_t L) {
  for (int64_t c = blockIdx.x; c < C; c += gridDim.x) {  // uniform across the block: block_sum's barriers hold
    double s = 0.0, sq = 0.0;
    for (PlaneWalk w(L); w.n < N; w.next(L)) {
      const double v = x[(w.n * C + c) * L + w.l];
      s += v;
      sq += v * v;
    }
    s = detail::block_sum<kChannelThreads>(s);
    sq = detail::block_sum<kChannelThreads>(sq);
    if (threadIdx.x == 0) {
      sums[c] = s;
      sums[C + c] = sq;
    }
  }
}

// mean_invstd (2,C), running_mean/var (C), *num_batches_tracked, sums (2,C) or null (eval). One thread a channel.
__global__ void __launch_bounds__(kThreads) batchnorm_moments_kernel(double* mean_invstd, float* running_mean,
                                                                     float* running_var,
                                                                     int64_t* num_batches_tracked,
                                                                     const double* sums, double count, int64_t C,
                                                                     float eps, float momentum) {
  DPAR_GRID_STRIDE_LOOP(c, C) {
    double mean, var;
    if (sums) {
      mean = sums[c] / count;
      var = fmax(sums[C + c] / count - mean * mean, 0.0);  // rounding may take a zero variance below 0
      const double unbiased = var * count / (count - 1.0);
      running_mean[c] = static_cast<float>((1.0 - momentum) * running_mean[c] + momentum * mean);
      running_var[c] = static_cast<float>((1.0 - momentum) * running_var[c] + momentum * unbiased);
    } else {
      mean = running_mean[c];
      var = running_var[c];
    }
    mean_invstd[c] = mean;
    mean_invstd[C + c] = 1.0 / sqrt(var + static_cast<double>(eps));
  }
  // In int64 as PyTorch adds, wrapping at 2^63 as its two's complement does (through uint64_t: no overflow).
  if (sums && num_batches_tracked && blockIdx.x == 0 && threadIdx.x == 0)
    *num_batches_tracked = static_cast<int64_t>(static_cast<uint64_t>(*num_batches_tracked) + 1);
}

// out (N,C,L) = x * a + b per channel; the grid covers N*C*L.
__global__ void __launch_bounds__(kThreads) batchnorm_apply_kernel(float* out, const float* x,
                                                                   const double* mean_invstd, const float* weight,
                                                                   const float* bias, int64_t C, int64_t L,
                                                                   int64_t total, bool relu) {
  DPAR_GRID_STRIDE_LOOP(i, total) {
    const int64_t c = (i / L) % C;
    const double w = weight ? weight[c] : 1.0, bb = bias ? bias[c] : 0.0;
    const double a = mean_invstd[C + c] * w, b = bb - mean_invstd[c] * a;
    const float v = static_cast<float>(x[i] * a + b);
    out[i] = relu && v < 0.0f ? 0.0f : v;  // relu_forward's select: NaN passes through
  }
}

// sums (2,C) = Σdy, Σdy·x̂ per channel; dout, x (N,C,L). L >= 1.
__global__ void __launch_bounds__(kChannelThreads) batchnorm_backward_reduce_kernel(double* sums, const float* dout,
                                                                                    const float* x,
                                                                                    const double* mean_invstd,
                                                                                    int64_t N, int64_t C, int64_t L) {
  for (int64_t c = blockIdx.x; c < C; c += gridDim.x) {
    const double mean = mean_invstd[c], invstd = mean_invstd[C + c];
    double sdy = 0.0, sdyx = 0.0;
    for (PlaneWalk w(L); w.n < N; w.next(L)) {
      const int64_t i = (w.n * C + c) * L + w.l;
      const float dy = dout[i];
      sdy += dy;
      sdyx += dy * ((x[i] - mean) * invstd);
    }
    sdy = detail::block_sum<kChannelThreads>(sdy);
    sdyx = detail::block_sum<kChannelThreads>(sdyx);
    if (threadIdx.x == 0) {
      sums[c] = sdy;
      sums[C + c] = sdyx;
    }
  }
}

// dweight, dbias (C) (either may be null) from local (2,C). One thread a channel.
__global__ void __launch_bounds__(kThreads) batchnorm_param_grads_kernel(float* dweight, float* dbias,
                                                                         const double* local, int64_t C,
                                                                         bool accumulate) {
  DPAR_GRID_STRIDE_LOOP(c, C) {
    if (dweight) dweight[c] = static_cast<float>((accumulate ? dweight[c] : 0.0) + local[C + c]);
    if (dbias) dbias[c] = static_cast<float>((accumulate ? dbias[c] : 0.0) + local[c]);
  }
}

// dinp (N,C,L); global (2,C) or null (eval); the grid covers N*C*L.
__global__ void __launch_bounds__(kThreads) batchnorm_input_grad_kernel(float* dinp, const double* global,
                                                                        double count, const float* dout,
                                                                        const float* x, const double* mean_invstd,
                                                                        const float* weight, int64_t C, int64_t L,
                                                                        int64_t total) {
  DPAR_GRID_STRIDE_LOOP(i, total) {
    const int64_t c = (i / L) % C;
    const double mean = mean_invstd[c], invstd = mean_invstd[C + c];
    const double k = (weight ? weight[c] : 1.0) * invstd;
    const double mdy = global ? global[c] / count : 0.0, mdyx = global ? global[C + c] / count : 0.0;
    dinp[i] = static_cast<float>(k * (dout[i] - mdy - (x[i] - mean) * invstd * mdyx));
  }
}

void check_shape(const char* kernel, int64_t N, int64_t C, int64_t L) {
  DPAR_CHECK_ARG(N >= 0 && C >= 0 && L >= 0, kernel, ": shape (", N, ", ", C, ", ", L, ") must be >= 0");
}

}  // namespace

void batchnorm_stats(double* sums, const float* x, int64_t N, int64_t C, int64_t L, cudaStream_t stream) {
  check_shape("batchnorm_stats", N, C, L);
  if (C == 0) return;
  // No elements (N or L zero): the loop runs no iteration and the sums are zeros; L = 1 keeps the walk's division
  // defined.
  if (N == 0 || L == 0) N = 0, L = 1;
  detail::launch("batchnorm_stats", batchnorm_stats_kernel, channel_blocks(C), kChannelThreads, stream, sums, x, N,
                 C, L);
}

void batchnorm_moments(double* mean_invstd, float* running_mean, float* running_var, int64_t* num_batches_tracked,
                       const double* sums, double count, int64_t C, float eps, float momentum, cudaStream_t stream) {
  DPAR_CHECK_ARG(C >= 0, "batchnorm_moments: channels must be >= 0, got ", C);
  // Launched even for C = 0: num_batches_tracked still grows, as the CPU twin's.
  detail::launch("batchnorm_moments", batchnorm_moments_kernel, C > 0 ? blocks_for(C) : 1u, kThreads, stream,
                 mean_invstd, running_mean, running_var, num_batches_tracked, sums, count, C, eps, momentum);
}

void batchnorm_apply(float* out, const float* x, const double* mean_invstd, const float* weight, const float* bias,
                     int64_t N, int64_t C, int64_t L, bool relu, cudaStream_t stream) {
  check_shape("batchnorm_apply", N, C, L);
  const int64_t total = N * C * L;
  if (total == 0) return;
  detail::launch("batchnorm_apply", batchnorm_apply_kernel, blocks_for(total), kThreads, stream, out, x, mean_invstd,
                 weight, bias, C, L, total, relu);
}

void batchnorm_backward_reduce(double* sums, const float* dout, const float* x, const double* mean_invstd, int64_t N,
                               int64_t C, int64_t L, cudaStream_t stream) {
  check_shape("batchnorm_backward_reduce", N, C, L);
  if (C == 0) return;
  if (N == 0 || L == 0) N = 0, L = 1;  // zeros, as batchnorm_stats
  detail::launch("batchnorm_backward_reduce", batchnorm_backward_reduce_kernel, channel_blocks(C), kChannelThreads,
                 stream, sums, dout, x, mean_invstd, N, C, L);
}

void batchnorm_backward_apply(float* dinp, float* dweight, float* dbias, const double* local, const double* global,
                              double count, const float* dout, const float* x, const double* mean_invstd,
                              const float* weight, int64_t N, int64_t C, int64_t L, bool accumulate,
                              cudaStream_t stream) {
  check_shape("batchnorm_backward_apply", N, C, L);
  if (C == 0) return;
  if (dweight || dbias)
    detail::launch("batchnorm_backward_apply (parameters)", batchnorm_param_grads_kernel, blocks_for(C), kThreads,
                   stream, dweight, dbias, local, C, accumulate);
  const int64_t total = N * C * L;
  if (dinp && total > 0)
    detail::launch("batchnorm_backward_apply (input)", batchnorm_input_grad_kernel, blocks_for(total), kThreads,
                   stream, dinp, global, count, dout, x, mean_invstd, weight, C, L, total);
}

}  // namespace dpar::kernels::cuda
