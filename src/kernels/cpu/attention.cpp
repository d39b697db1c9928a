// Flash-attention style on one core: per head, a block of kBq queries against blocks of kBk keys. Forward keeps a
// running maximum m, sum l and output accumulator per query (the online softmax: a new key block rescales what came
// before by exp(m_old - m_new)), and writes out = acc / l and lse = m + log l. Backward, per query block and key
// block, recomputes P = exp(scale q k^T - lse) and accumulates
//   dv += P_drop^T dout,   dP = (dout v^T) * mask / (1-p),   dS = P * (dP - D_i) with D_i = dout_i . out_i,
//   dq += scale dS k,      dk += scale dS^T q.
// Causal: key blocks above the diagonal are never visited. Everything is f32 (as PyTorch's CPU SDPA); the only
// memory beyond the tensors is a few tiles of one query block.
//
// The per-head routines are compiled for every vector ISA (vector_isa.h) and picked at run time; their elementwise
// loops run along a tile's fixed kBk keys or along D channels, so the compiler vectorizes them, and the products
// are sgemm calls on tiles (or, for comparison, loops: AttentionTiles). exp is a polynomial of our own that
// vectorizes (std::exp stays a scalar call per element). kBq = 64, kBk = 128 measured best of 32/64/128 x 64/128/256
// on the GPT shapes; the key range of a query block ends at its last query when causal, so a wide key block costs no
// work above the diagonal.
#include "kernels/cpu/attention.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/bf16.h"
#include "common/error.h"
#include "kernels/cpu/dnnl_ops.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/vector_isa.h"
#include "kernels/cpu/vector_math.h"
#include "kernels/dropout_rng.h"

namespace dpar::kernels::cpu {
namespace {

constexpr int64_t kBq = 64;  // queries per block
constexpr int64_t kBk = 128;  // keys per block
constexpr int kLanes = 16;   // partial maxima and sums of a tile row
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Row helpers over a tile row of kBk scores: separate functions with restrict rows, so that GCC sees no store into
// the row touching a scalar it reads (which kept the loops in the head routines scalar).
// row[j] = scale * row[j] for the visible j < lim, -inf for the rest.
DPAR_VECTOR_LOOP void scale_and_mask(float* __restrict row, int64_t lim, float scale) {
  for (int64_t j = 0; j < kBk; ++j) row[j] = j < lim ? row[j] * scale : kNegInf;
}
// row[j] = exp(row[j] - m).
DPAR_VECTOR_LOOP void exp_shifted(float* __restrict row, float m) {
  for (int64_t j = 0; j < kBk; ++j) row[j] = exp_nonpositive(row[j] - m);
}
// p[j] = exp(scale s[j] - lse) for the visible j < lim, 0 for the rest (backward's weights from the forward's lse).
DPAR_VECTOR_LOOP void weights_from_lse(float* __restrict row, int64_t lim, float scale, float lse) {
  for (int64_t j = 0; j < kBk; ++j) {
    const float e = exp_nonpositive(row[j] * scale - lse);
    row[j] = j < lim ? e : 0.0f;
  }
}
// ds[j] = p[j] (dp[j] - di) scale, in dp's place.
DPAR_VECTOR_LOOP void softmax_grad(float* __restrict dp, const float* __restrict p, float di, float scale) {
  for (int64_t j = 0; j < kBk; ++j) dp[j] = p[j] * (dp[j] - di) * scale;
}
// c[d] += x b[d] over D.
DPAR_VECTOR_LOOP void axpy(float* __restrict c, float x, const float* __restrict b, int64_t D) {
  for (int64_t d = 0; d < D; ++d) c[d] += x * b[d];
}

// What one head's routine needs: its pointers (head h's column offset applied) and leading dimensions.
struct HeadJob {
  const float *q, *k, *v, *out, *dout, *lse;  // lse: backward's input
  float *out_w, *lse_w, *dq, *dk, *dv;         // out_w, lse_w: forward's outputs
  int64_t ldq, ldk, ldv, ldo, lddo, lddq, lddk, lddv;
  int64_t L, S, D;
  float scale;
  bool causal;
  float p;           // dropout probability
  uint64_t key;      // rng::stream_key(seed)
  uint64_t counter;  // the counter of weight (i=0, j=0): offset + (b*heads + h)*L*S
  AttentionTiles tiles;
  float* scratch;
};


// s (mq, kBk) = a (mq, D) b (nk, D)^T, columns nk.. of s left as they come (zero in the loops' version).
// bt (D, kBk): scratch for b transposed, so that the inner loop runs along kBk keys.
DPAR_VECTOR_LOOP void tile_abt(float* s, const float* a, int64_t lda, const float* b, int64_t ldb, int64_t mq,
                               int64_t nk, int64_t D, float* bt, AttentionTiles tiles) {
  if (tiles == AttentionTiles::kSgemm) {
    sgemm(false, true, mq, nk, D, 1.0f, a, lda, b, ldb, 0.0f, s, kBk);
    return;
  }
  for (int64_t d = 0; d < D; ++d) {
    float* row = bt + d * kBk;
    for (int64_t j = 0; j < nk; ++j) row[j] = b[j * ldb + d];
    for (int64_t j = nk; j < kBk; ++j) row[j] = 0.0f;
  }
  int64_t i = 0;
  // Two query rows at a time: eight independent vector chains where one row had four.
  for (; i + 2 <= mq; i += 2) {
    float r0[kBk] = {}, r1[kBk] = {};
    const float* a0 = a + i * lda;
    const float* a1 = a0 + lda;
    for (int64_t d = 0; d < D; ++d) {
      const float x0 = a0[d], x1 = a1[d];
      const float* col = bt + d * kBk;
      for (int64_t j = 0; j < kBk; ++j) {
        r0[j] += x0 * col[j];
        r1[j] += x1 * col[j];
      }
    }
    std::memcpy(s + i * kBk, r0, sizeof r0);
    std::memcpy(s + (i + 1) * kBk, r1, sizeof r1);
  }
  for (; i < mq; ++i) {
    float r0[kBk] = {};
    const float* a0 = a + i * lda;
    for (int64_t d = 0; d < D; ++d) {
      const float x0 = a0[d];
      const float* col = bt + d * kBk;
      for (int64_t j = 0; j < kBk; ++j) r0[j] += x0 * col[j];
    }
    std::memcpy(s + i * kBk, r0, sizeof r0);
  }
}

// c (mq, D) += w (mq, nk) b (nk, D).
DPAR_VECTOR_LOOP void tile_wb(float* c, int64_t ldc, const float* w, const float* b, int64_t ldb, int64_t mq,
                              int64_t nk, int64_t D, AttentionTiles tiles) {
  if (tiles == AttentionTiles::kSgemm) {
    sgemm(false, false, mq, D, nk, 1.0f, w, kBk, b, ldb, 1.0f, c, ldc);
    return;
  }
  for (int64_t i = 0; i < mq; ++i) {
    float* ci = c + i * ldc;
    const float* wi = w + i * kBk;
    for (int64_t j = 0; j < nk; ++j) {
      const float x = wi[j];
      if (x == 0.0f) continue;  // masked and dropped weights
      axpy(ci, x, b + j * ldb, D);
    }
  }
}

// c (nk, D) += w (mq, nk)^T b (mq, D).
DPAR_VECTOR_LOOP void tile_wtb(float* c, int64_t ldc, const float* w, const float* b, int64_t ldb, int64_t mq,
                               int64_t nk, int64_t D, AttentionTiles tiles) {
  if (tiles == AttentionTiles::kSgemm) {
    sgemm(true, false, nk, D, mq, 1.0f, w, kBk, b, ldb, 1.0f, c, ldc);
    return;
  }
  for (int64_t i = 0; i < mq; ++i) {
    const float* wi = w + i * kBk;
    const float* bi = b + i * ldb;
    for (int64_t j = 0; j < nk; ++j) {
      const float x = wi[j];
      if (x == 0.0f) continue;
      axpy(c + j * ldc, x, bi, D);
    }
  }
}

// Keys j0 + j with j < the result are visible to query i0 + i (causal: j0 + j <= i0 + i).
DPAR_VECTOR_LOOP int64_t visible(const HeadJob& job, int64_t i0, int64_t i, int64_t j0, int64_t nk) {
  if (!job.causal) return nk;
  return std::max<int64_t>(0, std::min<int64_t>(nk, i0 + i - j0 + 1));
}

// The last key (exclusive) that any query of the block [i0, i0 + mq) sees.
DPAR_VECTOR_LOOP int64_t keys_end(const HeadJob& job, int64_t i0, int64_t mq) {
  return job.causal ? std::min(job.S, i0 + mq) : job.S;
}

DPAR_VECTOR_LOOP float row_max(const float* row) {
  float m[kLanes];
  for (int t = 0; t < kLanes; ++t) m[t] = row[t];
  for (int64_t j = kLanes; j < kBk; j += kLanes)
    for (int t = 0; t < kLanes; ++t) m[t] = row[j + t] > m[t] ? row[j + t] : m[t];
  float r = m[0];
  for (int t = 1; t < kLanes; ++t) r = m[t] > r ? m[t] : r;
  return r;
}

DPAR_VECTOR_LOOP float row_sum(const float* row) {
  float s[kLanes] = {};
  for (int64_t j = 0; j < kBk; j += kLanes)
    for (int t = 0; t < kLanes; ++t) s[t] += row[j + t];
  float r = 0.0f;
  for (int t = 0; t < kLanes; ++t) r += s[t];
  return r;
}

// The dropout factor of weight (i, j) of the head: 0 (dropped) or 1/(1-p).
DPAR_VECTOR_LOOP float keep_factor(const HeadJob& job, int64_t i, int64_t j, float inv_keep) {
  return rng::uniform24(job.key, job.counter + static_cast<uint64_t>(i * job.S + j)) >= job.p ? inv_keep : 0.0f;
}

DPAR_VECTOR_LOOP void forward_head(const HeadJob* jp) {
  const HeadJob& job = *jp;
  const int64_t D = job.D;
  float* s = job.scratch;
  float* bt = s + 2 * kBq * kBk;
  float* acc = bt + 2 * D * kBk;
  const float inv_keep = job.p > 0.0f ? 1.0f / (1.0f - job.p) : 1.0f;
  float m[kBq], l[kBq];
  for (int64_t i0 = 0; i0 < job.L; i0 += kBq) {
    const int64_t mq = std::min(kBq, job.L - i0);
    for (int64_t i = 0; i < mq; ++i) m[i] = kNegInf, l[i] = 0.0f;
    std::fill(acc, acc + mq * D, 0.0f);
    const int64_t jend = keys_end(job, i0, mq);
    for (int64_t j0 = 0; j0 < jend; j0 += kBk) {
      const int64_t nk = std::min(kBk, jend - j0);
      tile_abt(s, job.q + i0 * job.ldq, job.ldq, job.k + j0 * job.ldk, job.ldk, mq, nk, D, bt, job.tiles);
      for (int64_t i = 0; i < mq; ++i) {
        float* row = s + i * kBk;
        const int64_t lim = visible(job, i0, i, j0, nk);
        scale_and_mask(row, lim, job.scale);
        const float mx = row_max(row);
        const float m_new = mx > m[i] ? mx : m[i];
        if (m_new == kNegInf) continue;  // nothing visible yet: the row is all -inf, its weights all 0
        const float corr = exp_nonpositive(m[i] - m_new);
        exp_shifted(row, m_new);
        l[i] = l[i] * corr + row_sum(row);
        m[i] = m_new;
        if (job.p > 0.0f)
          for (int64_t j = 0; j < lim; ++j) row[j] *= keep_factor(job, i0 + i, j0 + j, inv_keep);
        float* ai = acc + i * D;
        if (corr != 1.0f)
          for (int64_t d = 0; d < D; ++d) ai[d] *= corr;
      }
      for (int64_t i = 0; i < mq; ++i)
        if (m[i] == kNegInf) std::fill(s + i * kBk, s + (i + 1) * kBk, 0.0f);
      tile_wb(acc, D, s, job.v + j0 * job.ldv, job.ldv, mq, nk, D, job.tiles);
    }
    for (int64_t i = 0; i < mq; ++i) {
      // A query that sees no key (only possible with S == 0) gets 0, as PyTorch's CPU flash kernel gives.
      const float inv_l = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
      float* o = job.out_w + (i0 + i) * job.ldo;
      const float* ai = acc + i * D;
      for (int64_t d = 0; d < D; ++d) o[d] = ai[d] * inv_l;
      job.lse_w[i0 + i] = l[i] > 0.0f ? m[i] + std::log(l[i]) : kNegInf;
    }
  }
}

DPAR_VECTOR_LOOP void backward_head(const HeadJob* jp) {
  const HeadJob& job = *jp;
  const int64_t D = job.D;
  float* s = job.scratch;  // P, then P with dropout applied
  float* t = s + kBq * kBk;  // dP, then dS (scaled)
  float* bt = t + kBq * kBk;
  float* di = bt + 2 * D * kBk + kBq * D;
  const float inv_keep = job.p > 0.0f ? 1.0f / (1.0f - job.p) : 1.0f;
  for (int64_t i = 0; i < job.L; ++i) std::fill(job.dq + i * job.lddq, job.dq + i * job.lddq + D, 0.0f);
  for (int64_t j = 0; j < job.S; ++j) {
    std::fill(job.dk + j * job.lddk, job.dk + j * job.lddk + D, 0.0f);
    std::fill(job.dv + j * job.lddv, job.dv + j * job.lddv + D, 0.0f);
  }
  for (int64_t i0 = 0; i0 < job.L; i0 += kBq) {
    const int64_t mq = std::min(kBq, job.L - i0);
    for (int64_t i = 0; i < mq; ++i) {
      const float* o = job.out + (i0 + i) * job.ldo;
      const float* g = job.dout + (i0 + i) * job.lddo;
      float sum = 0.0f;
      for (int64_t d = 0; d < D; ++d) sum += g[d] * o[d];
      di[i] = sum;
    }
    const int64_t jend = keys_end(job, i0, mq);
    for (int64_t j0 = 0; j0 < jend; j0 += kBk) {
      const int64_t nk = std::min(kBk, jend - j0);
      tile_abt(s, job.q + i0 * job.ldq, job.ldq, job.k + j0 * job.ldk, job.ldk, mq, nk, D, bt, job.tiles);
      tile_abt(t, job.dout + i0 * job.lddo, job.lddo, job.v + j0 * job.ldv, job.ldv, mq, nk, D, bt + D * kBk,
               job.tiles);
      for (int64_t i = 0; i < mq; ++i) {
        float* prow = s + i * kBk;
        float* trow = t + i * kBk;
        const int64_t lim = visible(job, i0, i, j0, nk);
        const float lse = job.lse[i0 + i], dii = di[i];
        weights_from_lse(prow, lim, job.scale, lse);
        if (job.p > 0.0f) {
          for (int64_t j = 0; j < lim; ++j) {
            const float f = keep_factor(job, i0 + i, j0 + j, inv_keep);
            trow[j] = prow[j] * (trow[j] * f - dii) * job.scale;
            prow[j] *= f;
          }
        } else {
          softmax_grad(trow, prow, dii, job.scale);
        }
        for (int64_t j = lim; j < kBk; ++j) trow[j] = 0.0f;
      }
      tile_wtb(job.dv + j0 * job.lddv, job.lddv, s, job.dout + i0 * job.lddo, job.lddo, mq, nk, D, job.tiles);
      tile_wb(job.dq + i0 * job.lddq, job.lddq, t, job.k + j0 * job.ldk, job.ldk, mq, nk, D, job.tiles);
      tile_wtb(job.dk + j0 * job.lddk, job.lddk, t, job.q + i0 * job.ldq, job.ldq, mq, nk, D, job.tiles);
    }
  }
}

// Head h of batch b of a (B, positions, C) tensor.
float* head_of(const AttentionTensor& x, int64_t b, int64_t h, int64_t D) {
  return x.data + b * x.batch_stride + h * D;
}

HeadJob job_for(const AttentionShape& sh, const AttentionDropout& dropout, AttentionTiles tiles, float* scratch) {
  HeadJob job{};
  job.L = sh.L, job.S = sh.S, job.D = sh.D;
  job.scale = sh.scale;
  job.causal = sh.causal;
  job.p = dropout.p;
  job.key = rng::stream_key(dropout.seed);
  job.tiles = tiles;
  job.scratch = scratch;
  return job;
}

// kHead for every head (b, h), in the copy for the calling thread's vector ISA; set_head points the job at it.
template <auto kHead>
void run_heads(HeadJob& job, const AttentionShape& sh, const AttentionDropout& dropout, auto&& set_head) {
  for (int64_t b = 0; b < sh.B; ++b)
    for (int64_t h = 0; h < sh.heads; ++h) {
      set_head(b, h);
      job.counter = dropout.offset + static_cast<uint64_t>((b * sh.heads + h) * sh.L * sh.S);
      run_vector<kHead>(static_cast<const HeadJob*>(&job));
    }
}

}  // namespace

// Two score tiles, two transposed key tiles, one accumulator tile, and D_i.
int64_t attention_scratch_floats(int64_t D) { return 2 * kBq * kBk + 2 * D * kBk + kBq * D + kBq; }

void attention_forward(const AttentionTensor& out, float* lse, const AttentionTensor& q, const AttentionTensor& k,
                       const AttentionTensor& v, const AttentionShape& sh, const AttentionDropout& dropout,
                       AttentionTiles tiles, float* scratch) {
  std::vector<float> own(scratch ? 0 : static_cast<size_t>(attention_scratch_floats(sh.D)));
  HeadJob job = job_for(sh, dropout, tiles, scratch ? scratch : own.data());
  job.ldq = q.row_stride, job.ldk = k.row_stride, job.ldv = v.row_stride, job.ldo = out.row_stride;
  run_heads<forward_head>(job, sh, dropout, [&](int64_t b, int64_t h) {
    job.q = head_of(q, b, h, sh.D), job.k = head_of(k, b, h, sh.D), job.v = head_of(v, b, h, sh.D);
    job.out_w = head_of(out, b, h, sh.D);
    job.lse_w = lse + (b * sh.heads + h) * sh.L;
  });
}

void attention_backward(const AttentionTensor& dq, const AttentionTensor& dk, const AttentionTensor& dv,
                        const AttentionTensor& dout, const AttentionTensor& q, const AttentionTensor& k,
                        const AttentionTensor& v, const AttentionTensor& out, const float* lse,
                        const AttentionShape& sh, const AttentionDropout& dropout, AttentionTiles tiles,
                        float* scratch) {
  std::vector<float> own(scratch ? 0 : static_cast<size_t>(attention_scratch_floats(sh.D)));
  HeadJob job = job_for(sh, dropout, tiles, scratch ? scratch : own.data());
  job.ldq = q.row_stride, job.ldk = k.row_stride, job.ldv = v.row_stride, job.ldo = out.row_stride;
  job.lddo = dout.row_stride, job.lddq = dq.row_stride, job.lddk = dk.row_stride, job.lddv = dv.row_stride;
  run_heads<backward_head>(job, sh, dropout, [&](int64_t b, int64_t h) {
    job.q = head_of(q, b, h, sh.D), job.k = head_of(k, b, h, sh.D), job.v = head_of(v, b, h, sh.D);
    job.out = head_of(out, b, h, sh.D), job.dout = head_of(dout, b, h, sh.D);
    job.dq = head_of(dq, b, h, sh.D), job.dk = head_of(dk, b, h, sh.D), job.dv = head_of(dv, b, h, sh.D);
    job.lse = lse + (b * sh.heads + h) * sh.L;
  });
}

// ---- bf16 -----------------------------------------------------------------------------------------------------
// Every product runs on dense operands: per head, k and v (and q and bf16(dout) per query block) are copied out of
// their strided views into dense rows, and dq, dk, dv are summed in dense f32 blocks and written out at the end.
// oneDNN 2.6 runs its AMX (brgemm) matmul only on dense operands and falls back to its AVX-512 bf16 GEMM for any
// leading dimension wider than a row, at half the speed on these shapes; the copies are a few passes over B T C.
namespace {

// Keys per product of the bf16 routines: every product is on a chunk of this many keys or the last chunk's
// remainder, so the GEMM's primitives are a few per product whatever S is.
constexpr int64_t kChunk = 512;
// Queries per block: 128 rather than the f32 kernel's 64, measured best of 64/128/256 (bench_bf16_attention):
// each product re-packs its B operand into AMX's layout, which a taller A amortises.
constexpr int64_t kBqLow = 128;

// The leading dimension of a block's score rows: its computed keys rounded up to whole lanes (softmax_row pads to
// them). A block of one chunk whose keys are a multiple of 16 has dense rows, as AMX's products need.
int64_t rows_ld(int64_t jend) { return std::max<int64_t>((jend + kLanes - 1) / kLanes * kLanes, kLanes); }

// The keys a causal query block computes on: up to its last query, rounded up to whole kBk blocks (fewer distinct
// chunk remainders), never past S; every key for a non-causal one.
int64_t bf16_keys_end(const AttentionShape& sh, int64_t i0, int64_t mq) {
  if (!sh.causal) return sh.S;
  return std::min(sh.S, (i0 + mq + kBk - 1) / kBk * kBk);
}

// Forward: row (lim visible of jend computed keys) holds q.k; returns lse and leaves p = exp(scale q.k - lse) in
// the visible keys' places. The maximum and the sum run in kLanes partial lanes (as the f32 kernel's row_max and
// row_sum), so that they vectorise: the row is padded to whole lanes with -inf (rows_ld leaves room for it).
DPAR_VECTOR_LOOP float softmax_row(float* __restrict row, int64_t lim, float scale) {
  const int64_t n = (lim + kLanes - 1) / kLanes * kLanes;
  for (int64_t j = 0; j < n; ++j) row[j] = j < lim ? row[j] * scale : kNegInf;
  float m[kLanes];
  for (int t = 0; t < kLanes; ++t) m[t] = kNegInf;
  for (int64_t j = 0; j < n; j += kLanes)
    for (int t = 0; t < kLanes; ++t) m[t] = row[j + t] > m[t] ? row[j + t] : m[t];
  float mx = m[0];
  for (int t = 1; t < kLanes; ++t) mx = m[t] > mx ? m[t] : mx;
  if (mx == kNegInf) return kNegInf;
  float l[kLanes] = {};
  for (int64_t j = 0; j < n; j += kLanes)
    for (int t = 0; t < kLanes; ++t) l[t] += exp_nonpositive(row[j + t] - mx);
  float sum = 0.0f;
  for (int t = 0; t < kLanes; ++t) sum += l[t];
  const float lse = mx + std::log(sum);
  for (int64_t j = 0; j < lim; ++j) row[j] = exp_nonpositive(row[j] - lse);
  return lse;
}

// w[j] = bf16(x[j]) for j < lim, 0 up to jend.
DPAR_VECTOR_LOOP void round_row(uint16_t* __restrict w, const float* __restrict x, int64_t lim, int64_t jend) {
  for (int64_t j = 0; j < lim; ++j) w[j] = to_bf16(x[j]);
  for (int64_t j = lim; j < jend; ++j) w[j] = 0;
}

// Backward without dropout: s = q.k, t = g.v in; w = bf16(p), ds = bf16(p (t - di)) out, p = exp(scale s - lse).
DPAR_VECTOR_LOOP void grad_row(uint16_t* __restrict w, uint16_t* __restrict ds, const float* __restrict s,
                               const float* __restrict t, int64_t lim, int64_t jend, float scale, float lse,
                               float di) {
  for (int64_t j = 0; j < lim; ++j) {
    const float p = exp_nonpositive(s[j] * scale - lse);
    w[j] = to_bf16(p);
    ds[j] = to_bf16(p * (t[j] - di));
  }
  for (int64_t j = lim; j < jend; ++j) w[j] = 0, ds[j] = 0;
}

// y[d] = a x[d] over n (a strided row of an f32 result from its dense sum).
DPAR_VECTOR_LOOP void scaled_copy(float* __restrict y, const float* __restrict x, float a, int64_t n) {
  for (int64_t d = 0; d < n; ++d) y[d] = x[d] * a;
}

// dst (rows x D, dense) = rows of src (row stride ld), bf16 bits.
void dense_rows(uint16_t* dst, const uint16_t* src, int64_t ld, int64_t rows, int64_t D) {
  for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * D, src + r * ld, static_cast<size_t>(D) * 2);
}

// The visible keys of query i (of jend computed).
int64_t visible_bf16(const AttentionShape& sh, int64_t i, int64_t jend) {
  return sh.causal ? std::min(jend, i + 1) : jend;
}

float keep(const AttentionShape& sh, const AttentionDropout& dr, uint64_t key, uint64_t counter, int64_t i, int64_t j,
           float inv_keep) {
  return rng::uniform24(key, counter + static_cast<uint64_t>(i * sh.S + j)) >= dr.p ? inv_keep : 0.0f;
}

// The scratch of one call, carved in 64-byte aligned pieces; the same layout for attention_bf16_scratch_bytes (with
// base null) and for the routines.
struct Bf16Scratch {
  float *srow, *trow, *di, *dq, *dk, *dv, *o;  // backward: srow, trow, di, dq, dk, dv; forward: srow, o
  uint16_t *w, *ds, *q, *k, *v, *g;            // backward: all; forward: w, q, k, v
  int64_t bytes = 0;
  Bf16Scratch(void* base, const AttentionShape& sh, bool backward) {
    char* at = static_cast<char*>(base);
    auto take = [&](int64_t n) {
      char* p = at == nullptr ? nullptr : at + bytes;
      bytes += (n + 63) / 64 * 64;
      return p;
    };
    const int64_t rows = kBqLow * rows_ld(sh.S), D = sh.D;
    srow = reinterpret_cast<float*>(take(rows * 4));
    w = reinterpret_cast<uint16_t*>(take(rows * 2));
    q = reinterpret_cast<uint16_t*>(take(kBqLow * D * 2));
    k = reinterpret_cast<uint16_t*>(take(sh.S * D * 2));
    v = reinterpret_cast<uint16_t*>(take(sh.S * D * 2));
    if (!backward) {
      o = reinterpret_cast<float*>(take(kBqLow * D * 4));
      trow = di = dq = dk = dv = nullptr, ds = g = nullptr;
      return;
    }
    o = nullptr;
    trow = reinterpret_cast<float*>(take(rows * 4));
    ds = reinterpret_cast<uint16_t*>(take(rows * 2));
    g = reinterpret_cast<uint16_t*>(take(kBqLow * D * 2));
    di = reinterpret_cast<float*>(take(kBqLow * 4));
    dq = reinterpret_cast<float*>(take(kBqLow * D * 4));
    dk = reinterpret_cast<float*>(take(sh.S * D * 4));
    dv = reinterpret_cast<float*>(take(sh.S * D * 4));
  }
};

}  // namespace

int64_t attention_bf16_scratch_bytes(const AttentionShape& sh, bool backward) {
  return Bf16Scratch(nullptr, sh, backward).bytes + 64;  // + 64: the caller's base need not be aligned
}

namespace {
void* aligned64(void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  return reinterpret_cast<void*>((a + 63) / 64 * 64);
}
}  // namespace

void attention_forward_bf16(Bf16Gemm& gemm, const AttentionTensor& out, float* lse, const AttentionTensorBf16& q,
                            const AttentionTensorBf16& k, const AttentionTensorBf16& v, const AttentionShape& sh,
                            const AttentionDropout& dropout, void* scratch) {
  const int64_t D = sh.D;
  const Bf16Scratch sc(aligned64(scratch), sh, false);
  const uint64_t key = rng::stream_key(dropout.seed);
  const float inv_keep = dropout.p > 0.0f ? 1.0f / (1.0f - dropout.p) : 1.0f;
  for (int64_t b = 0; b < sh.B; ++b)
    for (int64_t h = 0; h < sh.heads; ++h) {
      const uint16_t* qh = q.data + b * q.batch_stride + h * D;
      float* oh = out.data + b * out.batch_stride + h * D;
      float* lh = lse + (b * sh.heads + h) * sh.L;
      const uint64_t counter = dropout.offset + static_cast<uint64_t>((b * sh.heads + h) * sh.L * sh.S);
      dense_rows(sc.k, k.data + b * k.batch_stride + h * D, k.row_stride, sh.S, D);
      dense_rows(sc.v, v.data + b * v.batch_stride + h * D, v.row_stride, sh.S, D);
      for (int64_t i0 = 0; i0 < sh.L; i0 += kBqLow) {
        const int64_t mq = std::min(kBqLow, sh.L - i0);
        const int64_t jend = bf16_keys_end(sh, i0, mq), ld = rows_ld(jend);
        if (jend == 0) {  // no keys (S == 0): out 0 and lse -inf, as the f32 kernel gives
          for (int64_t i = 0; i < mq; ++i) {
            std::fill(oh + (i0 + i) * out.row_stride, oh + (i0 + i) * out.row_stride + D, 0.0f);
            lh[i0 + i] = kNegInf;
          }
          continue;
        }
        dense_rows(sc.q, qh + i0 * q.row_stride, q.row_stride, mq, D);
        for (int64_t c0 = 0; c0 < jend; c0 += kChunk)
          gemm.run(false, true, mq, std::min(kChunk, jend - c0), D, sc.q, D, sc.k + c0 * D, D, false, sc.srow + c0,
                   ld);
        for (int64_t i = 0; i < mq; ++i) {
          float* row = sc.srow + i * ld;
          const int64_t lim = visible_bf16(sh, i0 + i, jend);
          lh[i0 + i] = run_vector<softmax_row>(row, lim, sh.scale);
          if (dropout.p > 0.0f)
            for (int64_t j = 0; j < lim; ++j) row[j] *= keep(sh, dropout, key, counter, i0 + i, j, inv_keep);
          run_vector<round_row>(sc.w + i * ld, static_cast<const float*>(row), lim, jend);
        }
        for (int64_t c0 = 0; c0 < jend; c0 += kChunk)
          gemm.run(false, false, mq, D, std::min(kChunk, jend - c0), sc.w + c0, ld, sc.v + c0 * D, D, c0 > 0, sc.o,
                   D);
        for (int64_t i = 0; i < mq; ++i) std::memcpy(oh + (i0 + i) * out.row_stride, sc.o + i * D, static_cast<size_t>(D) * 4);
      }
    }
}

void attention_backward_bf16(Bf16Gemm& gemm, const AttentionTensor& dq, const AttentionTensor& dk,
                             const AttentionTensor& dv, const AttentionTensor& dout, const AttentionTensorBf16& q,
                             const AttentionTensorBf16& k, const AttentionTensorBf16& v, const AttentionTensor& out,
                             const float* lse, const AttentionShape& sh, const AttentionDropout& dropout,
                             void* scratch) {
  const int64_t D = sh.D;
  const Bf16Scratch sc(aligned64(scratch), sh, true);
  const uint64_t key = rng::stream_key(dropout.seed);
  const float inv_keep = dropout.p > 0.0f ? 1.0f / (1.0f - dropout.p) : 1.0f;
  for (int64_t b = 0; b < sh.B; ++b)
    for (int64_t h = 0; h < sh.heads; ++h) {
      const uint16_t* qh = q.data + b * q.batch_stride + h * D;
      const float* doh = dout.data + b * dout.batch_stride + h * D;
      const float* oh = out.data + b * out.batch_stride + h * D;
      float* dqh = dq.data + b * dq.batch_stride + h * D;
      float* dkh = dk.data + b * dk.batch_stride + h * D;
      float* dvh = dv.data + b * dv.batch_stride + h * D;
      const float* lh = lse + (b * sh.heads + h) * sh.L;
      const uint64_t counter = dropout.offset + static_cast<uint64_t>((b * sh.heads + h) * sh.L * sh.S);
      dense_rows(sc.k, k.data + b * k.batch_stride + h * D, k.row_stride, sh.S, D);
      dense_rows(sc.v, v.data + b * v.batch_stride + h * D, v.row_stride, sh.S, D);
      std::fill(sc.dk, sc.dk + sh.S * D, 0.0f);
      std::fill(sc.dv, sc.dv + sh.S * D, 0.0f);
      for (int64_t i0 = 0; i0 < sh.L; i0 += kBqLow) {
        const int64_t mq = std::min(kBqLow, sh.L - i0);
        const int64_t jend = bf16_keys_end(sh, i0, mq), ld = rows_ld(jend);
        if (jend == 0) {
          for (int64_t i = 0; i < mq; ++i)
            std::fill(dqh + (i0 + i) * dq.row_stride, dqh + (i0 + i) * dq.row_stride + D, 0.0f);
          continue;
        }
        dense_rows(sc.q, qh + i0 * q.row_stride, q.row_stride, mq, D);
        for (int64_t i = 0; i < mq; ++i) {
          const float* o = oh + (i0 + i) * out.row_stride;
          const float* gi = doh + (i0 + i) * dout.row_stride;
          float sum = 0.0f;
          for (int64_t d = 0; d < D; ++d) sum += gi[d] * o[d];
          sc.di[i] = sum;
          run_vector<round_row>(sc.g + i * D, gi, D, D);  // g = bf16(dout), the operand of g v^T and w^T g
        }
        for (int64_t c0 = 0; c0 < jend; c0 += kChunk) {
          const int64_t nc = std::min(kChunk, jend - c0);
          gemm.run(false, true, mq, nc, D, sc.q, D, sc.k + c0 * D, D, false, sc.srow + c0, ld);
          gemm.run(false, true, mq, nc, D, sc.g, D, sc.v + c0 * D, D, false, sc.trow + c0, ld);
        }
        for (int64_t i = 0; i < mq; ++i) {
          const int64_t lim = visible_bf16(sh, i0 + i, jend);
          const float* s = sc.srow + i * ld;
          const float* t = sc.trow + i * ld;
          uint16_t* w = sc.w + i * ld;
          uint16_t* ds = sc.ds + i * ld;
          if (dropout.p > 0.0f) {
            for (int64_t j = 0; j < lim; ++j) {
              const float p = exp_nonpositive(s[j] * sh.scale - lh[i0 + i]);
              const float f = keep(sh, dropout, key, counter, i0 + i, j, inv_keep);
              w[j] = to_bf16(p * f);
              ds[j] = to_bf16(p * (t[j] * f - sc.di[i]));
            }
            for (int64_t j = lim; j < jend; ++j) w[j] = 0, ds[j] = 0;
          } else {
            run_vector<grad_row>(w, ds, s, t, lim, jend, sh.scale, lh[i0 + i], sc.di[i]);
          }
        }
        for (int64_t c0 = 0; c0 < jend; c0 += kChunk) {
          const int64_t nc = std::min(kChunk, jend - c0);
          gemm.run(true, false, nc, D, mq, sc.w + c0, ld, sc.g, D, true, sc.dv + c0 * D, D);
          gemm.run(false, false, mq, D, nc, sc.ds + c0, ld, sc.k + c0 * D, D, c0 > 0, sc.dq, D);
          gemm.run(true, false, nc, D, mq, sc.ds + c0, ld, sc.q, D, true, sc.dk + c0 * D, D);
        }
        for (int64_t i = 0; i < mq; ++i)
          run_vector<scaled_copy>(dqh + (i0 + i) * dq.row_stride, static_cast<const float*>(sc.dq + i * D), sh.scale,
                                  D);
      }
      for (int64_t j = 0; j < sh.S; ++j) {
        run_vector<scaled_copy>(dkh + j * dk.row_stride, static_cast<const float*>(sc.dk + j * D), sh.scale, D);
        std::memcpy(dvh + j * dv.row_stride, sc.dv + j * D, static_cast<size_t>(D) * 4);
      }
    }
}

}  // namespace dpar::kernels::cpu
