#include <algorithm>
#include "kernels/cpu/norm_embedding.h"

#include <cmath>
#include <cstring>

#include "common/bf16.h"
#include "common/error.h"
#include "kernels/cpu/vector_isa.h"

namespace dpar::kernels::cpu {

namespace {
inline void store(float* p, float v) { *p = v; }
inline void store(uint16_t* p, float v) { *p = dpar::to_bf16(v); }

// The per-element passes run through run_vector's copies (each element's arithmetic is the same in every copy, so
// the bits are); the sums over a row stay one double accumulator in order, as the CUDA twin's.
// y[d] = ((x[d] - mean) rstd) w[d] + b[d] (w, b absent: no affine), in double, rounded to Out.
template <class Out>
DPAR_VECTOR_LOOP void normalise_row(Out* __restrict y, const float* __restrict x, const float* __restrict w,
                                    const float* __restrict b, int64_t D, double mean, double rstd) {
  if (w)
    for (int64_t d = 0; d < D; ++d) store(y + d, static_cast<float>((x[d] - mean) * rstd * w[d] + b[d]));
  else
    for (int64_t d = 0; d < D; ++d) store(y + d, static_cast<float>((x[d] - mean) * rstd));
}
// dw[d] += g[d] (x[d] - mean) rstd, db[d] += g[d].
DPAR_VECTOR_LOOP void affine_grad_row(float* __restrict dw, float* __restrict db, const float* __restrict g,
                                      const float* __restrict x, int64_t D, double mean, double rstd) {
  for (int64_t d = 0; d < D; ++d) {
    dw[d] += static_cast<float>(g[d] * ((x[d] - mean) * rstd));
    db[d] += g[d];
  }
}
// dx[d] = rstd (g'[d] - mg - (x[d] - mean) rstd mgx), g' = g w (or g).
DPAR_VECTOR_LOOP void input_grad_row(float* __restrict dx, const float* __restrict g, const float* __restrict x,
                                     const float* __restrict w, int64_t D, double mean, double rstd, double mg,
                                     double mgx) {
  for (int64_t d = 0; d < D; ++d) {
    const double gw = w ? static_cast<double>(g[d]) * w[d] : g[d];
    dx[d] = static_cast<float>(rstd * (gw - mg - (x[d] - mean) * rstd * mgx));
  }
}

template <class Out>
void layernorm_forward_of(Out* out, double* mean_rstd, const float* x, const float* weight, const float* bias,
                          int64_t N, int64_t D, float eps) {
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * D;
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
    run_vector<normalise_row<Out>>(out + n * D, xr, weight, bias, D, mean, rstd);
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
    if (dweight) run_vector<affine_grad_row>(dweight, dbias, gr, xr, D, mean, rstd);
    if (!dinp) continue;
    double sum_g = 0.0, sum_gx = 0.0;
    for (int64_t d = 0; d < D; ++d) {
      const double g = weight ? static_cast<double>(gr[d]) * weight[d] : gr[d];
      sum_g += g;
      sum_gx += g * ((xr[d] - mean) * rstd);
    }
    const double mg = sum_g / static_cast<double>(D), mgx = sum_gx / static_cast<double>(D);
    run_vector<input_grad_row>(dinp + n * D, gr, xr, weight, D, mean, rstd, mg, mgx);
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
