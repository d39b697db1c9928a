// One channel's plane at a time, accumulating in double: the statistics of a channel are sums over N*L elements,
// where float accumulation would lose digits that SyncBatchNorm's comparison with one device needs.
//
// A sum runs in kLanes partial sums (element l of each row's plane in lane l % kLanes, rows in order), added in a
// fixed tree at the end: the same bits on every call, and kLanes independent chains where one running sum made each
// add wait for the one before (the loops then vectorize). Each loop is compiled for every vector ISA with the same
// bits (vector_isa.h).
#include "kernels/cpu/batchnorm.h"

#include <cmath>

#include "kernels/cpu/vector_isa.h"

namespace dpar::kernels::cpu {
namespace {

constexpr int kLanes = 8;

DPAR_VECTOR_LOOP double lane_total(const double* v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

DPAR_VECTOR_LOOP void stats_loop(double* sums, const float* x, int64_t N, int64_t C, int64_t L) {
  for (int64_t c = 0; c < C; ++c) {
    double s[kLanes] = {}, sq[kLanes] = {};
    for (int64_t n = 0; n < N; ++n) {
      const float* p = x + (n * C + c) * L;
      int64_t l = 0;
      for (; l + kLanes <= L; l += kLanes)
        for (int k = 0; k < kLanes; ++k) {
          const double v = p[l + k];
          s[k] += v;
          sq[k] += v * v;
        }
      for (int k = 0; l < L; ++l, ++k) {
        const double v = p[l];
        s[k] += v;
        sq[k] += v * v;
      }
    }
    sums[c] = lane_total(s);
    sums[C + c] = lane_total(sq);
  }
}

DPAR_VECTOR_LOOP void apply_loop(float* out, const float* x, const double* mean_invstd, const float* weight,
                                 const float* bias, int64_t N, int64_t C, int64_t L, bool relu) {
  for (int64_t c = 0; c < C; ++c) {
    // out = x * a + b per channel
    const double w = weight ? weight[c] : 1.0, bb = bias ? bias[c] : 0.0;
    const double a = mean_invstd[C + c] * w, b = bb - mean_invstd[c] * a;
    for (int64_t n = 0; n < N; ++n) {
      const float* p = x + (n * C + c) * L;
      float* q = out + (n * C + c) * L;
      if (relu) {
        for (int64_t l = 0; l < L; ++l) {
          const float v = static_cast<float>(p[l] * a + b);
          q[l] = v < 0.0f ? 0.0f : v;  // relu_forward's select: NaN passes through
        }
      } else {
        for (int64_t l = 0; l < L; ++l) q[l] = static_cast<float>(p[l] * a + b);
      }
    }
  }
}

DPAR_VECTOR_LOOP void backward_reduce_loop(double* sums, const float* dout, const float* x,
                                           const double* mean_invstd, int64_t N, int64_t C, int64_t L) {
  for (int64_t c = 0; c < C; ++c) {
    const double mean = mean_invstd[c], invstd = mean_invstd[C + c];
    double sdy[kLanes] = {}, sdyx[kLanes] = {};
    for (int64_t n = 0; n < N; ++n) {
      const float* dy = dout + (n * C + c) * L;
      const float* p = x + (n * C + c) * L;
      int64_t l = 0;
      for (; l + kLanes <= L; l += kLanes)
        for (int k = 0; k < kLanes; ++k) {
          const double d = dy[l + k];
          sdy[k] += d;
          sdyx[k] += d * ((p[l + k] - mean) * invstd);
        }
      for (int k = 0; l < L; ++l, ++k) {
        const double d = dy[l];
        sdy[k] += d;
        sdyx[k] += d * ((p[l] - mean) * invstd);
      }
    }
    sums[c] = lane_total(sdy);
    sums[C + c] = lane_total(sdyx);
  }
}

DPAR_VECTOR_LOOP void backward_apply_loop(float* dinp, const double* global, double count, const float* dout,
                                          const float* x, const double* mean_invstd, const float* weight, int64_t N,
                                          int64_t C, int64_t L) {
  for (int64_t c = 0; c < C; ++c) {
    const double mean = mean_invstd[c], invstd = mean_invstd[C + c];
    const double k = (weight ? weight[c] : 1.0) * invstd;
    const double mdy = global ? global[c] / count : 0.0, mdyx = global ? global[C + c] / count : 0.0;
    for (int64_t n = 0; n < N; ++n) {
      const float* dy = dout + (n * C + c) * L;
      const float* p = x + (n * C + c) * L;
      float* q = dinp + (n * C + c) * L;
      for (int64_t l = 0; l < L; ++l) q[l] = static_cast<float>(k * (dy[l] - mdy - (p[l] - mean) * invstd * mdyx));
    }
  }
}

}  // namespace

void batchnorm_stats(double* sums, const float* x, int64_t N, int64_t C, int64_t L) {
  run_vector<stats_loop>(sums, x, N, C, L);
}

void batchnorm_moments(double* mean_invstd, float* running_mean, float* running_var, int64_t* num_batches_tracked,
                       const double* sums, double count, int64_t C, float eps, float momentum) {
  for (int64_t c = 0; c < C; ++c) {
    double mean, var;
    if (sums) {
      mean = sums[c] / count;
      var = std::fmax(sums[C + c] / count - mean * mean, 0.0);  // rounding may take a zero variance below 0
      const double unbiased = var * count / (count - 1.0);
      running_mean[c] = static_cast<float>((1.0 - momentum) * running_mean[c] + momentum * mean);
      running_var[c] = static_cast<float>((1.0 - momentum) * running_var[c] + momentum * unbiased);
    } else {
      mean = running_mean[c];
      var = running_var[c];
    }
    mean_invstd[c] = mean;
    mean_invstd[C + c] = 1.0 / std::sqrt(var + static_cast<double>(eps));
  }
  // In int64 as PyTorch adds, wrapping at 2^63 as its two's complement does (through uint64_t: no overflow).
  if (sums && num_batches_tracked)
    *num_batches_tracked = static_cast<int64_t>(static_cast<uint64_t>(*num_batches_tracked) + 1);
}

void batchnorm_apply(float* out, const float* x, const double* mean_invstd, const float* weight, const float* bias,
                     int64_t N, int64_t C, int64_t L, bool relu) {
  run_vector<apply_loop>(out, x, mean_invstd, weight, bias, N, C, L, relu);
}

void batchnorm_backward_reduce(double* sums, const float* dout, const float* x, const double* mean_invstd, int64_t N,
                               int64_t C, int64_t L) {
  run_vector<backward_reduce_loop>(sums, dout, x, mean_invstd, N, C, L);
}

void batchnorm_backward_apply(float* dinp, float* dweight, float* dbias, const double* local, const double* global,
                              double count, const float* dout, const float* x, const double* mean_invstd,
                              const float* weight, int64_t N, int64_t C, int64_t L, bool accumulate) {
  for (int64_t c = 0; c < C; ++c) {
    if (dweight) dweight[c] = static_cast<float>((accumulate ? dweight[c] : 0.0) + local[C + c]);
    if (dbias) dbias[c] = static_cast<float>((accumulate ? dbias[c] : 0.0) + local[c]);
  }
  if (dinp) run_vector<backward_apply_loop>(dinp, global, count, dout, x, mean_invstd, weight, N, C, L);
}

}  // namespace dpar::kernels::cpu
