// CPU math kernels. See kernels.h for the contracts.
//
// Writing rules for this file, which keep results deterministic and the loops vectorisable:
//  - An elementwise loop body is straight-line float arithmetic with no reassociation, so the vector body and
//    the scalar tail the compiler generates compute each element identically (GCC never reassociates float
//    math without -ffast-math, and the default x86-64 target has no FMA to contract into; with -march=native
//    GCC contracts a*b+c into FMA in both paths alike, which changes last bits but not determinism).
//  - Reductions run in a fixed order (and in double where they feed a loss), never split across lanes.
//  - Scalars that PyTorch computes in Python (double) are computed in double here, then rounded to float
//    exactly where PyTorch passes them to a float tensor op.
#include "kernels/cpu/kernels.h"


#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "common/error.h"
#include "common/bf16.h"
#include "common/f16.h"
#include "kernels/cpu/dnnl_ops.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/vector_math.h"
#include "kernels/dropout_rng.h"
#include "kernels/cpu/vector_isa.h"

namespace dpar::kernels::cpu {

namespace {

// out[i] = sqrt(in[i]) for a short block. std::sqrt must set errno for negative arguments, and GCC cannot
// vectorise a loop that might (no function-level attribute turns it off, and the build flags are not ours to
// change), so the block goes through SSE's sqrtps directly. Every IEEE square root is correctly rounded, so the
// vector and scalar paths give identical bits.
inline void sqrt_block(float* out, const float* in, int64_t n) {
  int64_t i = 0;
#if defined(__SSE2__)
  for (; i + 4 <= n; i += 4) _mm_storeu_ps(out + i, _mm_sqrt_ps(_mm_loadu_ps(in + i)));
  for (; i < n; ++i) out[i] = _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(in[i])));
#endif
  for (; i < n; ++i) out[i] = std::sqrt(in[i]);
}

// Arguments that every kernel on n elements shares.
inline void check_count(int64_t n) { DPAR_CHECK_ARG(n >= 0, "element count must be >= 0, got ", n); }

// Extents stay within 32 bits, as cuBLAS's do for the CUDA twins: the same shapes are accepted on every device.
inline int64_t blas_dim(int64_t v, const char* name) {
  DPAR_CHECK_ARG(v >= 0 && v <= static_cast<int64_t>(std::numeric_limits<int32_t>::max()), "linear: ", name,
                 " = ", v, " is out of the BLAS range");
  return v;
}

// A leading dimension must be at least 1 even when the extent is 0.
inline int64_t ld(int64_t v) { return v > 0 ? v : 1; }

inline void fill_zero(float* x, int64_t n) {
  if (n > 0) std::memset(x, 0, static_cast<size_t>(n) * sizeof(float));
}

}  // namespace

// -------------------------------------------------------------------------------------------------------------
// Linear

namespace {

// The epilogue of the forward GEMM, over out (B,C_out) in one pass: out = out + bias (when there is a bias), then
// out = relu(out) when asked. The sum is the GEMM's value plus the bias, each element rounded once, so that a
// linear layer gives the same bits with or without the ReLU fused after it.
DPAR_VECTOR_LOOP void forward_epilogue(float* out, const float* bias, int64_t B, int64_t C_out, bool relu) {
  for (int64_t i = 0; i < B; ++i) {
    float* row = out + i * C_out;
    if (bias != nullptr && relu) {
      for (int64_t j = 0; j < C_out; ++j) {
        const float v = row[j] + bias[j];
        row[j] = v < 0.0f ? 0.0f : v;  // relu_forward's select: NaN passes through
      }
    } else if (bias != nullptr) {
      for (int64_t j = 0; j < C_out; ++j) row[j] = row[j] + bias[j];
    } else if (relu) {
      for (int64_t j = 0; j < C_out; ++j) row[j] = row[j] < 0.0f ? 0.0f : row[j];
    }
  }
}

// out (B,C_out) = [relu](inp @ weight^T + bias): the GEMM overwrites out (beta 0, so whatever out held, even NaN,
// is ignored), then one pass adds the bias and applies the ReLU.
void linear_forward_impl(float* out, const float* inp, const float* weight, const float* bias, int64_t B,
                         int64_t C_in, int64_t C_out, bool relu) {
  const int64_t b = blas_dim(B, "B"), cin = blas_dim(C_in, "C_in"), cout = blas_dim(C_out, "C_out");
  if (B == 0 || C_out == 0) return;
  DPAR_CHECK_ARG(out != nullptr, "linear_forward: out is null");
  DPAR_CHECK_ARG(C_in == 0 || (inp != nullptr && weight != nullptr), "linear_forward: inp or weight is null");
  if (C_in == 0) {  // an empty sum (the GEMM would reject lda = 0): zeros, then the bias
    fill_zero(out, B * C_out);
  } else {
    sgemm(false, true, b, cout, cin, 1.0f, inp, ld(cin), weight, ld(cin), 0.0f, out, ld(cout));
  }
  if (bias != nullptr || relu) run_vector<forward_epilogue>(out, bias, B, C_out, relu);
}

// dbias (C_out) from the column sums of d (B,C_out), summed over rows in order in double (no allocation: blocks
// of columns on the stack), rounded once and only then added when accumulating: "old + this batch's gradient", as
// autograd's accumulation is. With relu_out, d is first masked, d = relu_out > 0 ? d : 0, and written to masked
// in the same pass (relu_backward's arithmetic): the masked gradient and its sums are read from memory once.
// relu_out is f32, or the forward's output rounded to bf16 (a linear layer's activation kept in bf16), read widened:
// the same sign as the f32 output it rounds.
inline float widened(float x) { return x; }
inline float widened(uint16_t x) { return dpar::from_bf16(x); }

template <class Out>
DPAR_VECTOR_LOOP void bias_grad_of(float* dbias, float* masked, const float* d, const Out* relu_out, int64_t B,
                                   int64_t C_out, bool accumulate) {
  constexpr int64_t kBlock = 256;
  double acc[kBlock];
  for (int64_t j0 = 0; j0 < C_out; j0 += kBlock) {
    const int64_t jn = std::min(kBlock, C_out - j0);
    for (int64_t j = 0; j < jn; ++j) acc[j] = 0.0;
    for (int64_t i = 0; i < B; ++i) {
      const float* row = d + i * C_out + j0;
      if (relu_out != nullptr) {
        const Out* y = relu_out + i * C_out + j0;
        float* m = masked + i * C_out + j0;
        for (int64_t j = 0; j < jn; ++j) {
          const float g = widened(y[j]) <= 0.0f ? 0.0f : row[j];
          m[j] = g;
          if (dbias != nullptr) acc[j] += static_cast<double>(g);
        }
      } else {
        for (int64_t j = 0; j < jn; ++j) acc[j] += static_cast<double>(row[j]);
      }
    }
    if (dbias == nullptr) continue;
    float* db = dbias + j0;
    if (accumulate) {
      for (int64_t j = 0; j < jn; ++j) db[j] = db[j] + static_cast<float>(acc[j]);
    } else {
      for (int64_t j = 0; j < jn; ++j) db[j] = static_cast<float>(acc[j]);
    }
  }
}

constexpr auto bias_grad = bias_grad_of<float>;
constexpr auto bias_grad_rounded_out = bias_grad_of<uint16_t>;

void check_backward_args(const float* dweight, const float* dout, int64_t B, int64_t C_in, int64_t C_out) {
  blas_dim(B, "B"), blas_dim(C_in, "C_in"), blas_dim(C_out, "C_out");
  DPAR_CHECK_ARG(dweight != nullptr || C_out * C_in == 0, "linear_backward: dweight is null");
  DPAR_CHECK_ARG(B == 0 || C_out == 0 || dout != nullptr, "linear_backward: dout is null");
}

// The GEMMs of linear_backward, from dout (B,C_out) = dL/d(the linear's output); check_backward_args has
// checked the extents and dout.
void linear_backward_gemms(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                           int64_t B, int64_t C_in, int64_t C_out, bool accumulate) {
  // dinp (B,C_in) = dout (B,C_out) @ weight (C_out,C_in)
  if (dinp != nullptr && B > 0 && C_in > 0) {
    if (C_out == 0) {
      fill_zero(dinp, B * C_in);
    } else {
      DPAR_CHECK_ARG(weight != nullptr, "linear_backward: weight is null");
      sgemm(false, false, B, C_in, C_out, 1.0f, dout, ld(C_out), weight, ld(C_in), 0.0f, dinp, ld(C_in));
    }
  }
  // dweight (C_out,C_in) = dout^T (C_out,B) @ inp (B,C_in); beta 1 adds to the gradient already there.
  if (C_out > 0 && C_in > 0) {
    if (B == 0) {
      if (!accumulate) fill_zero(dweight, C_out * C_in);
    } else {
      DPAR_CHECK_ARG(inp != nullptr, "linear_backward: inp is null");
      sgemm(true, false, C_out, C_in, B, 1.0f, dout, ld(C_out), inp, ld(C_in), accumulate ? 1.0f : 0.0f, dweight,
            ld(C_in));
    }
  }
}

}  // namespace

// inp (B,C_in), weight (C_out,C_in), bias (C_out) or nullptr, out (B,C_out)
void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t B, int64_t C_in,
                    int64_t C_out) {
  linear_forward_impl(out, inp, weight, bias, B, C_in, C_out, false);
}

void linear_relu_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t B,
                         int64_t C_in, int64_t C_out) {
  linear_forward_impl(out, inp, weight, bias, B, C_in, C_out, true);
}

// dinp (B,C_in), dweight (C_out,C_in), dbias (C_out), dout (B,C_out), inp (B,C_in), weight (C_out,C_in)
void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t B, int64_t C_in, int64_t C_out, bool accumulate) {
  check_backward_args(dweight, dout, B, C_in, C_out);
  linear_backward_gemms(dinp, dweight, dout, inp, weight, B, C_in, C_out, accumulate);
  if (dbias != nullptr && C_out > 0) run_vector<bias_grad>(dbias, nullptr, dout, nullptr, B, C_out, accumulate);
}

void linear_relu_backward(float* dinp, float* dweight, float* dbias, float* dpre, const float* dout,
                          const float* out, const float* inp, const float* weight, int64_t B, int64_t C_in,
                          int64_t C_out, bool accumulate) {
  check_backward_args(dweight, dout, B, C_in, C_out);
  if (C_out > 0) {
    DPAR_CHECK_ARG(B == 0 || (dpre != nullptr && out != nullptr), "linear_relu_backward: dpre or out is null");
    // The mask pass reads dout in full before the GEMMs write dinp, which may therefore be dout's memory.
    run_vector<bias_grad>(dbias, dpre, dout, out, B, C_out, accumulate);
  }
  linear_backward_gemms(dinp, dweight, dpre, inp, weight, B, C_in, C_out, accumulate);
}

// inp (B,C_in) bf16, weight (C_out,C_in) bf16, bias (C_out) or nullptr, out and pre (B,C_out)
void linear_forward_bf16(Bf16Gemm& gemm, float* out, float* pre, const uint16_t* inp, const uint16_t* weight,
                         const float* bias, int64_t B, int64_t C_in, int64_t C_out, Epilogue epilogue) {
  blas_dim(B, "B"), blas_dim(C_in, "C_in"), blas_dim(C_out, "C_out");
  if (B == 0 || C_out == 0) return;
  const bool gelu = epilogue == Epilogue::kGelu, relu = epilogue == Epilogue::kRelu;
  DPAR_CHECK_ARG(out != nullptr, "linear_forward (bf16): out is null");
  DPAR_CHECK_ARG(!gelu || pre != nullptr, "linear_forward (bf16): a GELU epilogue needs pre");
  DPAR_CHECK_ARG(C_in == 0 || (inp != nullptr && weight != nullptr), "linear_forward (bf16): inp or weight is null");
  float* gemm_out = gelu ? pre : out;
  if (C_in == 0) {  // an empty sum: zeros, then the bias
    fill_zero(gemm_out, B * C_out);
  } else {
    gemm.run(false, true, B, C_out, C_in, inp, C_in, weight, C_in, false, gemm_out, C_out);
  }
  if (bias != nullptr || relu) run_vector<forward_epilogue>(gemm_out, bias, B, C_out, relu);
  if (gelu) gelu_forward(out, pre, B * C_out);
}

// inp (B,C_in) bf16, weight (C_out,C_in) bf16, bias (C_out) or nullptr, out and pre (B,C_out) bf16
void linear_forward_bf16_rounded(Bf16Gemm& gemm, uint16_t* out, uint16_t* pre, const uint16_t* inp,
                                 const uint16_t* weight, const float* bias, int64_t B, int64_t C_in, int64_t C_out,
                                 Epilogue epilogue) {
  blas_dim(B, "B"), blas_dim(C_in, "C_in"), blas_dim(C_out, "C_out");
  const bool gelu = epilogue == Epilogue::kGelu, relu = epilogue == Epilogue::kRelu;
  DPAR_CHECK_ARG(epilogue == Epilogue::kNone || relu || gelu, "linear_forward (bf16 out): the ",
                 epilogue_name(epilogue), " epilogue has no bf16 output here");
  if (B == 0 || C_out == 0) return;
  DPAR_CHECK_ARG(out != nullptr, "linear_forward (bf16 out): out is null");
  DPAR_CHECK_ARG(!gelu || pre != nullptr, "linear_forward (bf16 out): a GELU epilogue needs pre");
  // With a GELU the GEMM's rounded result is the pre-activation, and the GELU reads it rounded.
  uint16_t* gemm_out = gelu ? pre : out;
  if (C_in == 0) {  // an empty sum: the bias (and ReLU) alone, rounded
    for (int64_t i = 0; i < B; ++i)
      for (int64_t j = 0; j < C_out; ++j) {
        const float v = bias != nullptr ? bias[j] : 0.0f;
        gemm_out[i * C_out + j] = dpar::to_bf16(relu && v <= 0.0f && !std::isnan(v) ? 0.0f : v);
      }
  } else {
    DPAR_CHECK_ARG(inp != nullptr && weight != nullptr, "linear_forward (bf16 out): inp or weight is null");
    gemm.run_rounded(B, C_out, C_in, inp, C_in, weight, C_in, bias, relu, gemm_out, C_out);
  }
  if (gelu) gelu_forward_rounded(out, pre, B * C_out);
}

// dout, dpre, out, pre (B,C_out); dout_low (B,C_out) bf16; dinp (B,C_in); dweight (C_out,C_in); dbias (C_out)
void linear_backward_bf16(Bf16Gemm& gemm, float* dinp, float* dweight, float* dbias, float* dpre, uint16_t* dout_low,
                          const float* dout, const float* out, const uint16_t* out_rounded, const float* pre,
                          const uint16_t* pre_rounded, const uint16_t* inp, const uint16_t* weight, int64_t B,
                          int64_t C_in, int64_t C_out, Epilogue epilogue, bool accumulate) {
  check_backward_args(dweight, dout, B, C_in, C_out);
  const bool rows = B > 0 && C_out > 0;
  // The f32 gradient of the GEMMs' result: the epilogue's backward first (with dbias's sums in the ReLU's pass,
  // as linear_relu_backward does; after GELU's, as linear_backward does on the composed call's dpre).
  const float* g = dout;
  if (rows && epilogue != Epilogue::kNone) {
    DPAR_CHECK_ARG(dpre != nullptr, "linear_backward (bf16): an epilogue needs dpre");
    if (epilogue == Epilogue::kRelu) {
      DPAR_CHECK_ARG(out != nullptr || out_rounded != nullptr, "linear_backward (bf16): a ReLU epilogue needs out");
      if (out_rounded != nullptr)
        run_vector<bias_grad_rounded_out>(dbias, dpre, dout, out_rounded, B, C_out, accumulate);
      else
        run_vector<bias_grad>(dbias, dpre, dout, out, B, C_out, accumulate);
    } else {
      DPAR_CHECK_ARG(pre != nullptr || pre_rounded != nullptr, "linear_backward (bf16): a GELU epilogue needs pre");
      if (pre_rounded != nullptr)
        gelu_backward_rounded(dpre, dout, pre_rounded, B * C_out);
      else
        gelu_backward(dpre, dout, pre, B * C_out);
    }
    g = dpre;
  }
  if (dbias != nullptr && C_out > 0 && !(epilogue == Epilogue::kRelu && rows))
    run_vector<bias_grad>(dbias, nullptr, g, nullptr, B, C_out, accumulate);
  if (rows && C_in > 0) {
    DPAR_CHECK_ARG(dout_low != nullptr, "linear_backward (bf16): dout_low is null");
    to_bf16(dout_low, g, B * C_out);
  }
  // dinp (B,C_in) = dout_low (B,C_out) @ weight (C_out,C_in)
  if (dinp != nullptr && B > 0 && C_in > 0) {
    if (C_out == 0) {
      fill_zero(dinp, B * C_in);
    } else {
      DPAR_CHECK_ARG(weight != nullptr, "linear_backward (bf16): weight is null");
      gemm.run(false, false, B, C_in, C_out, dout_low, C_out, weight, C_in, false, dinp, C_in);
    }
  }
  // dweight (C_out,C_in) (+)= dout_low^T (C_out,B) @ inp (B,C_in)
  if (C_out > 0 && C_in > 0) {
    if (B == 0) {
      if (!accumulate) fill_zero(dweight, C_out * C_in);
    } else {
      DPAR_CHECK_ARG(inp != nullptr, "linear_backward (bf16): inp is null");
      gemm.run(true, false, C_out, C_in, B, dout_low, C_out, inp, C_in, accumulate, dweight, C_in);
    }
  }
}

// -------------------------------------------------------------------------------------------------------------
// Activations. Formulas and operation order follow PyTorch's CPU kernels (scalar paths), in float.

// inp (n), out (n)
namespace {
DPAR_VECTOR_LOOP void relu_forward_loop(float* out, const float* inp, int64_t n) {
  // Written as a select on x < 0 rather than std::max so that NaN passes through, as torch.relu does.
  for (int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    out[i] = x < 0.0f ? 0.0f : x;
  }
}

DPAR_VECTOR_LOOP void relu_backward_loop(float* dinp, const float* dout, const float* out, int64_t n) {
  // Both loads are unconditional so the select vectorises (a conditional load cannot be if-converted).
  for (int64_t i = 0; i < n; ++i) {
    const float g = dout[i], y = out[i];
    dinp[i] = y <= 0.0f ? 0.0f : g;
  }
}
}  // namespace

void relu_forward(float* out, const float* inp, int64_t n) {
  check_count(n);
  run_vector<relu_forward_loop>(out, inp, n);
}

// dinp (n), dout (n), out (n)
void relu_backward(float* dinp, const float* dout, const float* out, int64_t n) {
  check_count(n);
  run_vector<relu_backward_loop>(dinp, dout, out, n);
}

namespace {
constexpr float kSqrt1_2 = 0.70710678118654752440f;          // 1/sqrt(2)
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;       // 1/sqrt(2*pi), PyTorch's M_2_SQRTPI*M_SQRT1_2*0.5
}  // namespace

// GELU's loops, exact form (erf), as PyTorch's default: erf and exp through vector_math.h, so they vectorize. The
// input is f32, or a bf16 pre-activation (a linear layer's output kept in bf16) read widened; the rounded forward
// writes its result rounded once, as PyTorch's bf16 GELU (computed in float, stored in bf16) does.
DPAR_VECTOR_LOOP float gelu_of(float x) { return x * 0.5f * (1.0f + erf_approx(x * kSqrt1_2)); }
DPAR_VECTOR_LOOP void gelu_forward_loop(float* out, const float* inp, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = gelu_of(inp[i]);
}
DPAR_VECTOR_LOOP void gelu_backward_loop(float* dinp, const float* dout, const float* inp, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    const float cdf = 0.5f * (1.0f + erf_approx(x * kSqrt1_2));
    const float pdf = kInvSqrt2Pi * exp_nonpositive(x * x * -0.5f);
    dinp[i] = dout[i] * (cdf + x * pdf);
  }
}

// inp (n), out (n)
void gelu_forward(float* out, const float* inp, int64_t n) {
  check_count(n);
  run_vector<gelu_forward_loop>(out, inp, n);
}

// dinp (n), dout (n), inp (n)
void gelu_backward(float* dinp, const float* dout, const float* inp, int64_t n) {
  check_count(n);
  run_vector<gelu_backward_loop>(dinp, dout, inp, n);
}

// The bf16 forms widen a block into f32 on the stack and run the f32 loops on it: one loop mixing the 16-bit loads
// and stores with erf's arithmetic is not vectorised by GCC (it took 40 % of the char GPT's bf16 step).
constexpr int64_t kWidenBlock = 2048;

// out (n) bf16, inp (n) bf16
void gelu_forward_rounded(uint16_t* out, const uint16_t* inp, int64_t n) {
  check_count(n);
  float x[kWidenBlock], y[kWidenBlock];
  for (int64_t i = 0; i < n; i += kWidenBlock) {
    const int64_t m = std::min(kWidenBlock, n - i);
    from_bf16(x, inp + i, m);
    run_vector<gelu_forward_loop>(y, x, m);
    to_bf16(out + i, y, m);
  }
}

// dinp (n), dout (n), inp (n) bf16
void gelu_backward_rounded(float* dinp, const float* dout, const uint16_t* inp, int64_t n) {
  check_count(n);
  float x[kWidenBlock];
  for (int64_t i = 0; i < n; i += kWidenBlock) {
    const int64_t m = std::min(kWidenBlock, n - i);
    from_bf16(x, inp + i, m);
    run_vector<gelu_backward_loop>(dinp + i, dout + i, x, m);
  }
}

// inp (n), out (n)
void tanh_forward(float* out, const float* inp, int64_t n) {
  check_count(n);
  for (int64_t i = 0; i < n; ++i) out[i] = std::tanh(inp[i]);
}

// dinp (n), dout (n), out (n)
void tanh_backward(float* dinp, const float* dout, const float* out, int64_t n) {
  check_count(n);
  for (int64_t i = 0; i < n; ++i) {
    const float y = out[i];
    dinp[i] = dout[i] * (1.0f - y * y);
  }
}

// inp (n), out (n)
void sigmoid_forward(float* out, const float* inp, int64_t n) {
  check_count(n);
  // exp(-x) overflows to inf for x < -88, giving exactly 0; no NaN arises for any finite x.
  for (int64_t i = 0; i < n; ++i) out[i] = 1.0f / (1.0f + std::exp(-inp[i]));
}

// dinp (n), dout (n), out (n)
void sigmoid_backward(float* dinp, const float* dout, const float* out, int64_t n) {
  check_count(n);
  for (int64_t i = 0; i < n; ++i) {
    const float y = out[i];
    dinp[i] = dout[i] * (1.0f - y) * y;
  }
}

// -------------------------------------------------------------------------------------------------------------
// Dropout

float dropout_uniform(uint64_t seed, uint64_t counter) { return rng::uniform24(rng::stream_key(seed), counter); }

// out (n), mask (n), inp (n)
void dropout_forward(float* out, float* mask, const float* inp, int64_t n, float p, uint64_t seed, uint64_t offset) {
  check_count(n);
  DPAR_CHECK_ARG(p >= 0.0f && p < 1.0f, "dropout: p must lie in [0, 1), got ", p);
  // PyTorch computes the scale in double and multiplies by it (input * mask * scale), rather than dividing.
  const float keep_scale = static_cast<float>(1.0 / (1.0 - static_cast<double>(p)));
  const uint64_t key = rng::stream_key(seed);
  for (int64_t i = 0; i < n; ++i) {
    const float u = rng::uniform24(key, offset + static_cast<uint64_t>(i));
    const float m = u >= p ? keep_scale : 0.0f;
    mask[i] = m;
    out[i] = inp[i] * m;
  }
}

// dinp (n), dout (n), mask (n)
void dropout_backward(float* dinp, const float* dout, const float* mask, int64_t n) {
  check_count(n);
  for (int64_t i = 0; i < n; ++i) dinp[i] = dout[i] * mask[i];
}

// -------------------------------------------------------------------------------------------------------------
// Losses

// dlogits (B,C) or nullptr, logits (B,C), labels (B)
double cross_entropy_forward_backward(float* dlogits, const float* logits, const int32_t* labels, int64_t B,
                                      int64_t C, float grad_scale) {
  DPAR_CHECK_ARG(B >= 0, "cross_entropy: B must be >= 0, got ", B);
  DPAR_CHECK_ARG(C > 0, "cross_entropy: C must be > 0, got ", C);
  double total = 0.0;
  for (int64_t b = 0; b < B; ++b) {
    const int32_t label = labels[b];
    if (label == kIgnoreIndex) {
      if (dlogits != nullptr) std::fill(dlogits + b * C, dlogits + (b + 1) * C, 0.0f);
      continue;
    }
    DPAR_CHECK_ARG(label >= 0 && label < C, "cross_entropy: label ", label, " of row ", b, " is outside [0, ", C,
                   ")");
    const float* x = logits + b * C;
    // Subtracting the row max makes every exponent <= 0: no overflow for huge logits, and the largest term is 1
    // so the sum never underflows to 0.
    float mx = x[0];
    for (int64_t j = 1; j < C; ++j) mx = x[j] > mx ? x[j] : mx;
    double sum = 0.0;
    if (dlogits != nullptr) {
      float* d = dlogits + b * C;
      for (int64_t j = 0; j < C; ++j) {
        const float e = std::exp(x[j] - mx);
        d[j] = e;  // kept for the softmax below, saving a second exp per element
        sum += static_cast<double>(e);
      }
      const float inv_sum = static_cast<float>(1.0 / sum);
      const float p_label = d[label] * inv_sum;  // softmax at the label, before d[label] is scaled
      for (int64_t j = 0; j < C; ++j) d[j] = d[j] * inv_sum * grad_scale;
      d[label] = (p_label - 1.0f) * grad_scale;
    } else {
      for (int64_t j = 0; j < C; ++j) sum += static_cast<double>(std::exp(x[j] - mx));
    }
    // loss = logsumexp(x) - x[label] = (mx + log(sum)) - x[label], in double.
    total += (static_cast<double>(mx) - static_cast<double>(x[label])) + std::log(sum);
  }
  return total;
}

// dpred (B,D) or nullptr, pred (B,D), target (B,D)
double mse_forward_backward(float* dpred, const float* pred, const float* target, int64_t B, int64_t D,
                            float grad_scale) {
  DPAR_CHECK_ARG(B >= 0, "mse: B must be >= 0, got ", B);
  DPAR_CHECK_ARG(D > 0, "mse: D must be > 0, got ", D);
  double total = 0.0;
  for (int64_t b = 0; b < B; ++b) {
    const float* p = pred + b * D;
    const float* t = target + b * D;
    double s = 0.0;
    for (int64_t j = 0; j < D; ++j) {
      const double diff = static_cast<double>(p[j]) - static_cast<double>(t[j]);
      s += diff * diff;
    }
    total += s / static_cast<double>(D);
  }
  if (dpred != nullptr) {
    // The same factor PyTorch's mse_loss_backward applies (2/numel times the incoming gradient), folded into one
    // float so each element costs a subtract and a multiply.
    const float coef = static_cast<float>(2.0 * static_cast<double>(grad_scale) / static_cast<double>(D));
    const int64_t n = B * D;
    for (int64_t i = 0; i < n; ++i) dpred[i] = (pred[i] - target[i]) * coef;
  }
  return total;
}

// -------------------------------------------------------------------------------------------------------------
// Optimizers: torch/optim/sgd.py and adam.py, `_single_tensor_*`, with the ATen CPU kernels' float op order:
//   t.add(o, alpha=a)     -> t + a*o
//   t.mul_(s)             -> t * s
//   t.addcmul_(a, b, v)   -> t + (v*a)*b
//   t.addcdiv_(a, b, v)   -> t + (v*a)/b
//   t.lerp_(e, w)         -> |w| < 0.5 ? t + w*(e-t) : e - (e-t)*(1-w)
// where every Python-float scalar is rounded to float once, as ATen does for a float tensor.
// (ATen's AVX kernels fuse some of these into FMAs; the default x86-64 target here cannot, so the last bit may
// differ from PyTorch's in rare elements.)

namespace {
// The SGD loop with its branches resolved at compile time, so each variant is a straight vectorisable loop.
// kMomentum: 0 none, 1 first step (buf = clone(d)), 2 later steps.
template <bool kWd, int kMomentum, bool kNesterov>
void sgd_loop(float* param, float* momentum_buf, const float* grad, int64_t n, float wd, float mom,
              float one_minus_damp, float neg_lr) {
  for (int64_t i = 0; i < n; ++i) {
    const float p = param[i];
    float d = grad[i];
    if (kWd) d = d + wd * p;  // grad = grad.add(param, alpha=weight_decay)
    if (kMomentum != 0) {
      float buf;
      if (kMomentum == 1) {
        buf = d;  // buf = torch.clone(grad).detach()
      } else {
        buf = momentum_buf[i] * mom;     // buf.mul_(momentum)
        buf = buf + one_minus_damp * d;  //    .add_(grad, alpha=1 - dampening)
      }
      momentum_buf[i] = buf;
      d = kNesterov ? d + mom * buf : buf;  // grad = grad.add(buf, alpha=momentum) or buf
    }
    param[i] = p + neg_lr * d;  // param.add_(grad, alpha=-lr)
  }
}

template <bool kWd>
void sgd_dispatch(float* param, float* momentum_buf, const float* grad, int64_t n, const SgdHyper& h,
                  bool first_step) {
  const float wd = h.weight_decay, mom = h.momentum, neg_lr = -h.lr;
  const float omd = static_cast<float>(1.0 - static_cast<double>(h.dampening));  // Python float, then float
  if (mom == 0.0f) {
    sgd_loop<kWd, 0, false>(param, momentum_buf, grad, n, wd, mom, omd, neg_lr);
  } else if (first_step) {
    if (h.nesterov)
      sgd_loop<kWd, 1, true>(param, momentum_buf, grad, n, wd, mom, omd, neg_lr);
    else
      sgd_loop<kWd, 1, false>(param, momentum_buf, grad, n, wd, mom, omd, neg_lr);
  } else {
    if (h.nesterov)
      sgd_loop<kWd, 2, true>(param, momentum_buf, grad, n, wd, mom, omd, neg_lr);
    else
      sgd_loop<kWd, 2, false>(param, momentum_buf, grad, n, wd, mom, omd, neg_lr);
  }
}
}  // namespace

// param (n), momentum_buf (n) or nullptr, grad (n)
void sgd_step(float* param, float* momentum_buf, const float* grad, int64_t n, const SgdHyper& h, bool first_step) {
  check_count(n);
  DPAR_CHECK_ARG(h.momentum == 0.0f || momentum_buf != nullptr || n == 0, "sgd: momentum needs a momentum buffer");
  DPAR_CHECK_ARG(!h.nesterov || (h.momentum > 0.0f && h.dampening == 0.0f),
                 "sgd: Nesterov momentum requires a momentum and zero dampening");
  // PyTorch skips the decay term when weight_decay == 0 (it matters for inf/NaN parameters).
  if (h.weight_decay != 0.0f)
    sgd_dispatch<true>(param, momentum_buf, grad, n, h, first_step);
  else
    sgd_dispatch<false>(param, momentum_buf, grad, n, h, first_step);
}

namespace {
// The Adam loop with its branches resolved at compile time. It runs in blocks that fit in L1: the moments of a
// block first (a vectorisable loop), then the square roots (sqrt_block), then the parameters (vectorisable).
// One copy per vector ISA (kernels/cpu/vector_isa.h).
template <bool kL2, bool kSmallLerpWeight>
DPAR_VECTOR_LOOP void adam_loop(float* param, float* m_buf, float* v_buf, const float* grad, int64_t n, float wd,
                                float w1, float one_minus_w1, float beta2, float one_minus_beta2, float bc2_sqrt,
                                float eps, float neg_step) {
  constexpr int64_t kBlock = 512;
  float root[kBlock];
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t nb = std::min(kBlock, n - i0);
    float* p = param + i0;
    float* m = m_buf + i0;
    float* v = v_buf + i0;
    const float* gr = grad + i0;
    for (int64_t i = 0; i < nb; ++i) {
      float g = gr[i];
      if (kL2) g = g + wd * p[i];  // grad = grad.add(param, alpha=weight_decay)
      const float mi = m[i];
      // exp_avg.lerp_(grad, 1-beta1): ATen's two-sided lerp formula, chosen by the size of the weight
      m[i] = kSmallLerpWeight ? mi + w1 * (g - mi) : g - (g - mi) * one_minus_w1;
      const float vi = v[i] * beta2;         // exp_avg_sq.mul_(beta2)
      v[i] = vi + (one_minus_beta2 * g) * g;  //   .addcmul_(grad, grad, value=1-beta2)
    }
    sqrt_block(root, v, nb);  // exp_avg_sq.sqrt()
    for (int64_t i = 0; i < nb; ++i) {
      const float denom = root[i] / bc2_sqrt + eps;  // (... / bias_correction2_sqrt).add_(eps)
      p[i] = p[i] + (neg_step * m[i]) / denom;       // param.addcdiv_(exp_avg, denom, value=-step_size)
    }
  }
}

template <bool kL2, bool kSmallLerpWeight>
void run_adam(float* param, float* m_buf, float* v_buf, const float* grad, int64_t n, const AdamScalars& s) {
  run_vector<adam_loop<kL2, kSmallLerpWeight>>(param, m_buf, v_buf, grad, n, s.weight_decay, s.w1, s.one_minus_w1,
                                               s.beta2, s.one_minus_beta2, s.bias_correction2_sqrt, s.eps,
                                               s.neg_step_size);
}
}  // namespace

// param (n), exp_avg (n), exp_avg_sq (n), grad (n)
void adam_step(float* param, float* exp_avg, float* exp_avg_sq, const float* grad, int64_t n, const AdamHyper& h,
               int64_t step) {
  check_count(n);
  DPAR_CHECK_ARG(step >= 1, "adam: step is 1-based, got ", step);
  const AdamScalars s = adam_scalars(h, step);
  if (s.decay) scale(param, s.param_scale, n);  // param.mul_(1 - lr*wd)
  const auto run = s.l2 ? (s.small_weight ? run_adam<true, true> : run_adam<true, false>)
                        : (s.small_weight ? run_adam<false, true> : run_adam<false, false>);
  run(param, exp_avg, exp_avg_sq, grad, n, s);
}

// -------------------------------------------------------------------------------------------------------------
// Helpers

// y (n), x (n)
void axpy(float* y, const float* x, float a, int64_t n) {
  check_count(n);
  for (int64_t i = 0; i < n; ++i) y[i] = y[i] + a * x[i];
}

// x (n)
void scale(float* x, float a, int64_t n) {
  check_count(n);
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] * a;
}

// x (n)
void fill(float* x, float value, int64_t n) {
  check_count(n);
  for (int64_t i = 0; i < n; ++i) x[i] = value;
}

namespace {
// Independent lanes: the loop vectorises without reordering any lane's additions.
DPAR_VECTOR_LOOP double sum_squares_loop(const float* x, int64_t n) {
  constexpr int64_t L = kSumSquaresLanes;
  double lane[L] = {};
  int64_t i = 0;
  for (; i + L <= n; i += L)
    for (int64_t l = 0; l < L; ++l) {
      const double v = x[i + l];
      lane[l] += v * v;
    }
  for (int64_t l = 0; i + l < n; ++l) {
    const double v = x[i + l];
    lane[l] += v * v;
  }
  for (int64_t width = L / 2; width > 0; width /= 2)
    for (int64_t l = 0; l < width; ++l) lane[l] += lane[l + width];
  return lane[0];
}
}  // namespace

// x (n)
double sum_squares(const float* x, int64_t n) {
  check_count(n);
  return run_vector<sum_squares_loop>(x, n);
}

// dst (n), src (n)
// The conversions run every step over every parameter (the bf16 copy of the weights) and every autocast layer's
// input, so they are vector loops: integer arithmetic and a select, the same bits in every copy.
DPAR_VECTOR_LOOP void to_bf16_loop(uint16_t* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = dpar::to_bf16(src[i]);
}
DPAR_VECTOR_LOOP void from_bf16_loop(float* dst, const uint16_t* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = dpar::from_bf16(src[i]);
}

void to_bf16(uint16_t* dst, const float* src, int64_t n) {
  check_count(n);
  run_vector<to_bf16_loop>(dst, src, n);
}

// dst (n), src (n)
void from_bf16(float* dst, const uint16_t* src, int64_t n) {
  check_count(n);
  run_vector<from_bf16_loop>(dst, src, n);
}

// dst (n), src (n)
void to_f16(uint16_t* dst, const float* src, int64_t n) {
  check_count(n);
  for (int64_t i = 0; i < n; ++i) dst[i] = dpar::to_f16(src[i]);
}

// dst (n), src (n)
void from_f16(float* dst, const uint16_t* src, int64_t n) {
  check_count(n);
  for (int64_t i = 0; i < n; ++i) dst[i] = dpar::from_f16(src[i]);
}

}  // namespace dpar::kernels::cpu
