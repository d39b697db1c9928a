#include <algorithm>
#include "kernels/cpu/norm_embedding.h"

#include <cmath>
#include <cstring>

#include "common/bf16.h"
#include "common/error.h"

namespace dpar::kernels::cpu {

namespace {
inline void store(float* p, float v) { *p = v; }
inline void store(uint16_t* p, float v) { *p = dpar::to_bf16(v); }

template <class Out>
void layernorm_forward_of(Out* out, double* mean_rstd, const float* x, const float* weight, const float* bias,
                          int64_t N, int64_t D, float eps) {
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * D;
    Out* yr = out + n * D;
    // Two passes in double: the mean, then the centred squares (no cancellation for rows far from zero).
    double sum = 0.0;
    for (int64_t d = 0; d < D; ++d) sum += xr[d];
    const double mean = sum / static_cast<double>(D);
    double sq = 0.0;
    for (int64_t d = 0; d < D; ++d) {
      const double c = xr[d] - mean;
      sq += c * c;
    }
    const double rstd = 1.0 / std::sqrt(sq / static_cast<double>(D) + static_cast<double>(eps));
    mean_rstd[n] = mean;
    mean_rstd[N + n] = rstd;
    for (int64_t d = 0; d < D; ++d) {
      double y = (xr[d] - mean) * rstd;
      if (weight) y = y * weight[d] + bias[d];
      store(yr + d, static_cast<float>(y));
    }
  }
}
}  // namespace

void layernorm_forward(float* out, double* mean_rstd, const float* x, const float* weight, const float* bias,
                       int64_t N, int64_t D, float eps) {
  layernorm_forward_of(out, mean_rstd, x, weight, bias, N, D, eps);
}

void layernorm_forward_rounded(uint16_t* out, double* mean_rstd, const float* x, const float* weight,
                               const float* bias, int64_t N, int64_t D, float eps) {
  layernorm_forward_of(out, mean_rstd, x, weight, bias, N, D, eps);
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* x,
                        const double* mean_rstd, const float* weight, int64_t N, int64_t D, bool accumulate) {
  if (dweight && !accumulate) std::memset(dweight, 0, static_cast<size_t>(D) * sizeof(float));
  if (dbias && !accumulate) std::memset(dbias, 0, static_cast<size_t>(D) * sizeof(float));
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * D;
    const float* gr = dout + n * D;
    const double mean = mean_rstd[n], rstd = mean_rstd[N + n];
    if (dweight)
      for (int64_t d = 0; d < D; ++d) {
        dweight[d] += static_cast<float>(gr[d] * ((xr[d] - mean) * rstd));
        dbias[d] += gr[d];
      }
    if (!dinp) continue;
    double sum_g = 0.0, sum_gx = 0.0;
    for (int64_t d = 0; d < D; ++d) {
      const double g = weight ? static_cast<double>(gr[d]) * weight[d] : gr[d];
      sum_g += g;
      sum_gx += g * ((xr[d] - mean) * rstd);
    }
    const double mg = sum_g / static_cast<double>(D), mgx = sum_gx / static_cast<double>(D);
    float* dr = dinp + n * D;
    for (int64_t d = 0; d < D; ++d) {
      const double g = weight ? static_cast<double>(gr[d]) * weight[d] : gr[d];
      dr[d] = static_cast<float>(rstd * (g - mg - (xr[d] - mean) * rstd * mgx));
    }
  }
}

namespace {
void check_indices(const int32_t* idx, int64_t N, int64_t V) {
  for (int64_t n = 0; n < N; ++n)
    DPAR_CHECK_ARG(idx[n] >= 0 && idx[n] < V, "embedding: index ", idx[n], " at position ", n,
                   " is out of range [0, ", V, ")");
}
}  // namespace

void embedding_forward(float* out, const int32_t* idx, const float* weight, int64_t N, int64_t V, int64_t E) {
  check_indices(idx, N, V);
  for (int64_t n = 0; n < N; ++n)
    std::memcpy(out + n * E, weight + static_cast<int64_t>(idx[n]) * E, static_cast<size_t>(E) * sizeof(float));
}

void embedding_backward(float* dweight, const float* dout, const int32_t* idx, int64_t N, int64_t V, int64_t E,
                        int64_t padding_idx, bool accumulate) {
  check_indices(idx, N, V);
  if (!accumulate) std::memset(dweight, 0, static_cast<size_t>(V * E) * sizeof(float));
  for (int64_t n = 0; n < N; ++n) {
    if (idx[n] == padding_idx) continue;
    float* row = dweight + static_cast<int64_t>(idx[n]) * E;
    const float* g = dout + n * E;
    for (int64_t e = 0; e < E; ++e) row[e] += g[e];
  }
}

void position_embedding_forward(float* out, const float* inp, const float* weight, int64_t B, int64_t T, int64_t C) {
  const int64_t row = T * C;  // one sequence: its positions' rows are the table's first T, in order
  for (int64_t b = 0; b < B; ++b) {
    const float* x = inp + b * row;
    float* y = out + b * row;
    for (int64_t i = 0; i < row; ++i) y[i] = x[i] + weight[i];
  }
}

void position_embedding_backward(float* dweight, const float* dout, int64_t B, int64_t T, int64_t C, int64_t P,
                                 bool accumulate) {
  const int64_t row = T * C;
  if (!accumulate) std::fill(dweight, dweight + P * C, 0.0f);
  for (int64_t b = 0; b < B; ++b) {
    const float* g = dout + b * row;
    for (int64_t i = 0; i < row; ++i) dweight[i] += g[i];
  }
}

}  // namespace dpar::kernels::cpu
