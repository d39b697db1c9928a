// Plain loops, one channel's plane at a time, accumulating in double: the statistics of a channel are sums over
// N*L elements, where float accumulation would lose digits that SyncBatchNorm's comparison with one device needs.
#include "kernels/cpu/batchnorm.h"

#include <cmath>

namespace dpar::kernels::cpu {

void batchnorm_stats(double* sums, const float* x, int64_t N, int64_t C, int64_t L) {
  for (int64_t c = 0; c < C; ++c) {
    double s = 0.0, sq = 0.0;
    for (int64_t n = 0; n < N; ++n) {
      const float* p = x + (n * C + c) * L;
      for (int64_t l = 0; l < L; ++l) {
        const double v = p[l];
        s += v;
        sq += v * v;
      }
    }
    sums[c] = s;
    sums[C + c] = sq;
  }
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
  if (sums && num_batches_tracked) ++*num_batches_tracked;
}

void batchnorm_apply(float* out, const float* x, const double* mean_invstd, const float* weight, const float* bias,
                     int64_t N, int64_t C, int64_t L) {
  for (int64_t c = 0; c < C; ++c) {
    // out = x * a + b per channel
    const double w = weight ? weight[c] : 1.0, bb = bias ? bias[c] : 0.0;
    const double a = mean_invstd[C + c] * w, b = bb - mean_invstd[c] * a;
    for (int64_t n = 0; n < N; ++n) {
      const float* p = x + (n * C + c) * L;
      float* q = out + (n * C + c) * L;
      for (int64_t l = 0; l < L; ++l) q[l] = static_cast<float>(p[l] * a + b);
    }
  }
}

void batchnorm_backward_reduce(double* sums, const float* dout, const float* x, const double* mean_invstd, int64_t N,
                               int64_t C, int64_t L) {
  for (int64_t c = 0; c < C; ++c) {
    const double mean = mean_invstd[c], invstd = mean_invstd[C + c];
    double sdy = 0.0, sdyx = 0.0;
    for (int64_t n = 0; n < N; ++n) {
      const float* dy = dout + (n * C + c) * L;
      const float* p = x + (n * C + c) * L;
      for (int64_t l = 0; l < L; ++l) {
        sdy += dy[l];
        sdyx += dy[l] * ((p[l] - mean) * invstd);
      }
    }
    sums[c] = sdy;
    sums[C + c] = sdyx;
  }
}

void batchnorm_backward_apply(float* dinp, float* dweight, float* dbias, const double* local, const double* global,
                              double count, const float* dout, const float* x, const double* mean_invstd,
                              const float* weight, int64_t N, int64_t C, int64_t L, bool accumulate) {
  for (int64_t c = 0; c < C; ++c) {
    if (dweight) dweight[c] = static_cast<float>((accumulate ? dweight[c] : 0.0) + local[C + c]);
    if (dbias) dbias[c] = static_cast<float>((accumulate ? dbias[c] : 0.0) + local[c]);
    if (!dinp) continue;
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

}  // namespace dpar::kernels::cpu
