// Attention on CUDA (kernels/cuda/attention.h). Row-major through column-major cuBLAS as linear.cu explains: a
// row-major product Y (M,N) = P (M,K) Q (K,N) is the column-major Y^T = Q^T P^T.
//
// Batching: head h of batch b of q sits at q + b*batch_stride + h*D, so (b, h) is not one uniform stride. Each
// product is one cublasSgemmStridedBatched per head, batched over b (the batch stride is the tensor's, the
// workspace's is heads*L*S): `heads` launches per product, no device array of pointers to build and upload on
// every call (which pointer-array batching needs, since the tensors move between calls), and heads (4..16 in a GPT)
// is smaller than B.
//
// The softmax kernels run one warp per row of the workspace ((b, h, i): L*S floats per head), its reductions in a
// fixed shuffle tree, so a row's result does not depend on the launch. Precision: f32 throughout, as the CPU twin.
#include "kernels/cuda/attention.h"

#include <limits>

#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/dropout_rng.h"
#include "platform/cuda/cublas_library.h"

namespace dpar::kernels::cuda {

using detail::kThreads;

namespace {

constexpr int kWarp = 32;
constexpr int kRowsPerBlock = kThreads / kWarp;

int blas_dim(int64_t v, const char* name) {
  DPAR_CHECK_ARG(v >= 0 && v <= static_cast<int64_t>(std::numeric_limits<int>::max()), "attention: ", name, " = ", v,
                 " is out of the BLAS range");
  return static_cast<int>(v);
}

// One operand of a per-head product: head h of batch b at data + b*batch + h*head, leading dimension ld.
struct Operand {
  const float* data;
  int64_t ld, batch, head;
};

// For every head: C = alpha op(A) op(B) (column-major, as cuBLAS reads them), batched over b.
void gemm_heads(cublasHandle_t blas, cublasOperation_t op_a, cublasOperation_t op_b, int64_t m, int64_t n, int64_t k,
                const Operand& A, const Operand& B, float* C, int64_t ldc, int64_t batch_c, int64_t head_c,
                const AttentionShape& sh, const char* what) {
  const float alpha = 1.0f, beta = 0.0f;
  for (int64_t h = 0; h < sh.heads; ++h)
    DPAR_CUBLAS_CHECK(::dpar::cuda::cublas().sgemm_strided_batched(
                          blas, op_a, op_b, blas_dim(m, "m"), blas_dim(n, "n"), blas_dim(k, "k"), &alpha,
                          A.data + h * A.head, blas_dim(A.ld, "lda"), A.batch, B.data + h * B.head,
                          blas_dim(B.ld, "ldb"), B.batch, &beta, C + h * head_c, blas_dim(ldc, "ldc"), batch_c,
                          blas_dim(sh.B, "batch")),
                      "attention: ", what);
}

__device__ float warp_max(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ float warp_sum(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ float keep_factor(uint64_t key, uint64_t counter, float p, float inv_keep) {
  return rng::uniform24(key, counter) >= p ? inv_keep : 0.0f;
}

// w (rows, S): scores q.k in, weights out (dropped ones 0, kept ones scaled by 1/(1-p)); lse (rows). Row r =
// (b*heads + h)*L + i.
__global__ void __launch_bounds__(kThreads)
    softmax_forward_kernel(float* w, float* lse, int64_t rows, int64_t L, int64_t S, float scale, bool causal,
                           float p, uint64_t key, uint64_t offset) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  if (r >= rows) return;
  const int64_t i = r % L;
  const int64_t visible = causal ? min(S, i + 1) : S;
  float* row = w + r * S;
  float m = -INFINITY;
  for (int64_t j = lane; j < visible; j += kWarp) m = fmaxf(m, row[j] * scale);
  m = warp_max(m);
  float sum = 0.0f;
  for (int64_t j = lane; j < visible; j += kWarp) sum += expf(row[j] * scale - m);
  sum = warp_sum(sum);
  const float l = m + logf(sum);
  if (lane == 0) lse[r] = sum > 0.0f ? l : -INFINITY;
  const float inv_keep = p > 0.0f ? 1.0f / (1.0f - p) : 1.0f;
  for (int64_t j = lane; j < S; j += kWarp) {
    float x = j < visible ? expf(row[j] * scale - l) : 0.0f;
    if (p > 0.0f && j < visible) x *= keep_factor(key, offset + static_cast<uint64_t>(r * S + j), p, inv_keep);
    row[j] = x;
  }
}

// In: w (rows, S) = q.k, g (rows, S) = dout.v. Out: w = the weights with dropout (for dv), g = dS * scale (for dq
// and dk). D_i = dout_i . out_i of the row's head.
__global__ void __launch_bounds__(kThreads)
    softmax_backward_kernel(float* w, float* g, const float* lse, const float* dout, int64_t dout_batch,
                            int64_t dout_row, const float* out, int64_t out_batch, int64_t out_row, int64_t rows,
                            int64_t heads, int64_t L, int64_t S, int64_t D, float scale, bool causal, float p,
                            uint64_t key, uint64_t offset) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  if (r >= rows) return;
  const int64_t i = r % L, h = (r / L) % heads, b = r / (L * heads);
  const float* go = dout + b * dout_batch + i * dout_row + h * D;
  const float* o = out + b * out_batch + i * out_row + h * D;
  float di = 0.0f;
  for (int64_t d = lane; d < D; d += kWarp) di += go[d] * o[d];
  di = warp_sum(di);
  const int64_t visible = causal ? min(S, i + 1) : S;
  const float l = lse[r], inv_keep = p > 0.0f ? 1.0f / (1.0f - p) : 1.0f;
  float* wr = w + r * S;
  float* gr = g + r * S;
  for (int64_t j = lane; j < S; j += kWarp) {
    if (j >= visible) {
      wr[j] = 0.0f, gr[j] = 0.0f;
      continue;
    }
    const float pw = expf(wr[j] * scale - l);
    const float f = p > 0.0f ? keep_factor(key, offset + static_cast<uint64_t>(r * S + j), p, inv_keep) : 1.0f;
    gr[j] = pw * (gr[j] * f - di) * scale;
    wr[j] = pw * f;
  }
}

Operand head_operand(const AttentionTensor& t, int64_t D) { return {t.data, t.row_stride, t.batch_stride, D}; }

// S (B, heads, L, S) = a b^T per head: a (B,L,C), b (B,S,C).
void scores(float* ws, const AttentionTensor& a, const AttentionTensor& b, const AttentionShape& sh,
            cublasHandle_t blas, const char* what) {
  gemm_heads(blas, CUBLAS_OP_T, CUBLAS_OP_N, sh.S, sh.L, sh.D, head_operand(b, sh.D), head_operand(a, sh.D), ws,
             sh.S, sh.heads * sh.L * sh.S, sh.L * sh.S, sh, what);
}

// y (B,L,C) = W x per head: W (B, heads, L, S), x (B,S,C).
void weights_times(const AttentionTensor& y, const float* ws, const AttentionTensor& x, const AttentionShape& sh,
                   cublasHandle_t blas, const char* what) {
  const Operand W{ws, sh.S, sh.heads * sh.L * sh.S, sh.L * sh.S};
  gemm_heads(blas, CUBLAS_OP_N, CUBLAS_OP_N, sh.D, sh.L, sh.S, head_operand(x, sh.D), W, y.data, y.row_stride,
             y.batch_stride, sh.D, sh, what);
}

// y (B,S,C) = W^T x per head: W (B, heads, L, S), x (B,L,C).
void weights_t_times(const AttentionTensor& y, const float* ws, const AttentionTensor& x, const AttentionShape& sh,
                     cublasHandle_t blas, const char* what) {
  const Operand W{ws, sh.S, sh.heads * sh.L * sh.S, sh.L * sh.S};
  gemm_heads(blas, CUBLAS_OP_N, CUBLAS_OP_T, sh.D, sh.S, sh.L, head_operand(x, sh.D), W, y.data, y.row_stride,
             y.batch_stride, sh.D, sh, what);
}

unsigned row_blocks(int64_t rows) { return static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock); }

// ---- bf16 ---------------------------------------------------------------------------------------------------------

// x rounded to bf16 as common/bf16.h's to_bf16 (elementwise.cu's kernel): ties to even, a NaN kept quiet.
__device__ uint16_t round_bf16(float x) {
  const uint32_t bits = __float_as_uint(x);
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  return static_cast<uint16_t>(nan ? (bits >> 16) | 0x0040u : (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// One operand of a per-head bf16 product, as Operand.
struct OperandBf16 {
  const uint16_t* data;
  int64_t ld, batch, head;
};

// For every head: C (f32) = alpha op(A) op(B) + beta C, A and B bf16, f32 accumulation; batched over b.
void gemm_heads_bf16(cublasHandle_t blas, cublasOperation_t op_a, cublasOperation_t op_b, int64_t m, int64_t n,
                     int64_t k, float alpha, const OperandBf16& A, const OperandBf16& B, float* C, int64_t ldc,
                     int64_t batch_c, int64_t head_c, const AttentionShape& sh, const char* what) {
  const float beta = 0.0f;
  for (int64_t h = 0; h < sh.heads; ++h)
    DPAR_CUBLAS_CHECK(::dpar::cuda::cublas().gemm_strided_batched_ex(
                          blas, op_a, op_b, blas_dim(m, "m"), blas_dim(n, "n"), blas_dim(k, "k"), &alpha,
                          A.data + h * A.head, CUDA_R_16BF, blas_dim(A.ld, "lda"), A.batch, B.data + h * B.head,
                          CUDA_R_16BF, blas_dim(B.ld, "ldb"), B.batch, &beta, C + h * head_c, CUDA_R_32F,
                          blas_dim(ldc, "ldc"), batch_c, blas_dim(sh.B, "batch"), CUBLAS_COMPUTE_32F,
                          CUBLAS_GEMM_DEFAULT),
                      "attention (bf16): ", what);
}

OperandBf16 head_operand(const AttentionTensorBf16& t, int64_t D) { return {t.data, t.row_stride, t.batch_stride, D}; }
// The weights of every head, (B, heads, L, S) bf16.
OperandBf16 weights_operand(const uint16_t* w, const AttentionShape& sh) {
  return {w, sh.S, sh.heads * sh.L * sh.S, sh.L * sh.S};
}

// s (rows, S) f32: scores q.k in. Out: lse (rows), w (rows, S) = bf16(p f), p = exp(scale s - lse) (0 where masked).
__global__ void __launch_bounds__(kThreads)
    softmax_forward_bf16_kernel(const float* s, uint16_t* w, float* lse, int64_t rows, int64_t L, int64_t S,
                                float scale, bool causal, float p, uint64_t key, uint64_t offset) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  if (r >= rows) return;
  const int64_t i = r % L;
  const int64_t visible = causal ? min(S, i + 1) : S;
  const float* row = s + r * S;
  uint16_t* wr = w + r * S;
  float m = -INFINITY;
  for (int64_t j = lane; j < visible; j += kWarp) m = fmaxf(m, row[j] * scale);
  m = warp_max(m);
  float sum = 0.0f;
  for (int64_t j = lane; j < visible; j += kWarp) sum += expf(row[j] * scale - m);
  sum = warp_sum(sum);
  const float l = m + logf(sum);
  if (lane == 0) lse[r] = sum > 0.0f ? l : -INFINITY;
  const float inv_keep = p > 0.0f ? 1.0f / (1.0f - p) : 1.0f;
  for (int64_t j = lane; j < S; j += kWarp) {
    float x = j < visible ? expf(row[j] * scale - l) : 0.0f;
    if (p > 0.0f && j < visible) x *= keep_factor(key, offset + static_cast<uint64_t>(r * S + j), p, inv_keep);
    wr[j] = round_bf16(x);
  }
}

// In: s (rows, S) = q.k, t (rows, S) = bf16(dout).v, f32. Out: w = bf16(p f) (for dv), ds = bf16(p (t f - D_i))
// (for dq and dk, which the products scale). D_i = dout_i . out_i of the row's head, f32.
__global__ void __launch_bounds__(kThreads)
    softmax_backward_bf16_kernel(const float* s, const float* t, uint16_t* w, uint16_t* ds, const float* lse,
                                 const float* dout, int64_t dout_batch, int64_t dout_row, const float* out,
                                 int64_t out_batch, int64_t out_row, int64_t rows, int64_t heads, int64_t L, int64_t S,
                                 int64_t D, float scale, bool causal, float p, uint64_t key, uint64_t offset) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarp;
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  if (r >= rows) return;
  const int64_t i = r % L, h = (r / L) % heads, b = r / (L * heads);
  const float* go = dout + b * dout_batch + i * dout_row + h * D;
  const float* o = out + b * out_batch + i * out_row + h * D;
  float di = 0.0f;
  for (int64_t d = lane; d < D; d += kWarp) di += go[d] * o[d];
  di = warp_sum(di);
  const int64_t visible = causal ? min(S, i + 1) : S;
  const float l = lse[r], inv_keep = p > 0.0f ? 1.0f / (1.0f - p) : 1.0f;
  const float* sr = s + r * S;
  const float* tr = t + r * S;
  uint16_t* wr = w + r * S;
  uint16_t* dsr = ds + r * S;
  for (int64_t j = lane; j < S; j += kWarp) {
    if (j >= visible) {
      wr[j] = 0, dsr[j] = 0;
      continue;
    }
    const float pw = expf(sr[j] * scale - l);
    const float f = p > 0.0f ? keep_factor(key, offset + static_cast<uint64_t>(r * S + j), p, inv_keep) : 1.0f;
    wr[j] = round_bf16(pw * f);
    dsr[j] = round_bf16(pw * (tr[j] * f - di));
  }
}

// S (B, heads, L, S) f32 = a b^T per head: a (B,L,C), b (B,S,C) bf16.
void scores_bf16(float* ws, const OperandBf16& a, const OperandBf16& b, const AttentionShape& sh, cublasHandle_t blas,
                 const char* what) {
  gemm_heads_bf16(blas, CUBLAS_OP_T, CUBLAS_OP_N, sh.S, sh.L, sh.D, 1.0f, b, a, ws, sh.S, sh.heads * sh.L * sh.S,
                  sh.L * sh.S, sh, what);
}

// y (B,L,C) = alpha W x per head: W (B, heads, L, S) bf16, x (B,S,C) bf16.
void weights_times_bf16(const AttentionTensor& y, float alpha, const uint16_t* w, const OperandBf16& x,
                        const AttentionShape& sh, cublasHandle_t blas, const char* what) {
  gemm_heads_bf16(blas, CUBLAS_OP_N, CUBLAS_OP_N, sh.D, sh.L, sh.S, alpha, x, weights_operand(w, sh), y.data,
                  y.row_stride, y.batch_stride, sh.D, sh, what);
}

// y (B,S,C) = alpha W^T x per head: W (B, heads, L, S) bf16, x (B,L,C) bf16.
void weights_t_times_bf16(const AttentionTensor& y, float alpha, const uint16_t* w, const OperandBf16& x,
                          const AttentionShape& sh, cublasHandle_t blas, const char* what) {
  gemm_heads_bf16(blas, CUBLAS_OP_N, CUBLAS_OP_T, sh.D, sh.S, sh.L, alpha, x, weights_operand(w, sh), y.data,
                  y.row_stride, y.batch_stride, sh.D, sh, what);
}

// The workspace's pieces, 256-byte aligned: scores s and t (f32), weights w and ds (bf16), g = bf16(dout).
struct Bf16Workspace {
  float *s, *t;
  uint16_t *w, *ds, *g;
  int64_t bytes = 0;
  Bf16Workspace(void* base, const AttentionShape& sh, bool backward) {
    char* at = static_cast<char*>(base);
    auto take = [&](int64_t n) {
      char* p = at == nullptr ? nullptr : at + bytes;
      bytes += (n + 255) / 256 * 256;
      return p;
    };
    const int64_t n = sh.B * sh.heads * sh.L * sh.S;
    s = reinterpret_cast<float*>(take(n * 4));
    w = reinterpret_cast<uint16_t*>(take(n * 2));
    t = backward ? reinterpret_cast<float*>(take(n * 4)) : nullptr;
    ds = backward ? reinterpret_cast<uint16_t*>(take(n * 2)) : nullptr;
    g = backward ? reinterpret_cast<uint16_t*>(take(sh.B * sh.L * sh.heads * sh.D * 2)) : nullptr;
  }
};

}  // namespace

int64_t attention_workspace_floats(const AttentionShape& sh, bool backward) {
  return (backward ? 2 : 1) * sh.B * sh.heads * sh.L * sh.S;
}

void attention_forward(const AttentionTensor& out, float* lse, const AttentionTensor& q, const AttentionTensor& k,
                       const AttentionTensor& v, const AttentionShape& sh, const AttentionDropout& dropout,
                       float* workspace, cublasHandle_t blas, cudaStream_t stream) {
  const int64_t rows = sh.B * sh.heads * sh.L;
  if (rows == 0) return;
  scores(workspace, q, k, sh, blas, "forward q k^T");
  detail::launch("attention softmax_forward_kernel", softmax_forward_kernel, dim3(row_blocks(rows)), dim3(kThreads),
                 stream, workspace, lse, rows, sh.L, sh.S, sh.scale, sh.causal, dropout.p,
                 rng::stream_key(dropout.seed), dropout.offset);
  weights_times(out, workspace, v, sh, blas, "forward P v");
}

void attention_backward(const AttentionTensor& dq, const AttentionTensor& dk, const AttentionTensor& dv,
                        const AttentionTensor& dout, const AttentionTensor& q, const AttentionTensor& k,
                        const AttentionTensor& v, const AttentionTensor& out, const float* lse,
                        const AttentionShape& sh, const AttentionDropout& dropout, float* workspace,
                        cublasHandle_t blas, cudaStream_t stream) {
  const int64_t rows = sh.B * sh.heads * sh.L;
  if (rows == 0) return;
  float* w = workspace;
  float* g = workspace + rows * sh.S;
  scores(w, q, k, sh, blas, "backward q k^T");
  scores(g, dout, v, sh, blas, "backward dout v^T");
  detail::launch("attention softmax_backward_kernel", softmax_backward_kernel, dim3(row_blocks(rows)), dim3(kThreads),
                 stream, w, g, lse, static_cast<const float*>(dout.data), dout.batch_stride, dout.row_stride,
                 static_cast<const float*>(out.data), out.batch_stride, out.row_stride, rows, sh.heads, sh.L, sh.S,
                 sh.D, sh.scale, sh.causal, dropout.p, rng::stream_key(dropout.seed), dropout.offset);
  weights_t_times(dv, w, dout, sh, blas, "backward dv = P^T dout");
  weights_times(dq, g, k, sh, blas, "backward dq = dS k");
  weights_t_times(dk, g, q, sh, blas, "backward dk = dS^T q");
}

int64_t attention_bf16_workspace_bytes(const AttentionShape& sh, bool backward) {
  return Bf16Workspace(nullptr, sh, backward).bytes;
}

void attention_forward_bf16(const AttentionTensor& out, float* lse, const AttentionTensorBf16& q,
                            const AttentionTensorBf16& k, const AttentionTensorBf16& v, const AttentionShape& sh,
                            const AttentionDropout& dropout, void* workspace, cublasHandle_t blas,
                            cudaStream_t stream) {
  const int64_t rows = sh.B * sh.heads * sh.L;
  if (rows == 0) return;
  const Bf16Workspace ws(workspace, sh, false);
  scores_bf16(ws.s, head_operand(q, sh.D), head_operand(k, sh.D), sh, blas, "forward q k^T");
  detail::launch("attention softmax_forward_bf16_kernel", softmax_forward_bf16_kernel, dim3(row_blocks(rows)),
                 dim3(kThreads), stream, static_cast<const float*>(ws.s), ws.w, lse, rows, sh.L, sh.S, sh.scale,
                 sh.causal, dropout.p, rng::stream_key(dropout.seed), dropout.offset);
  weights_times_bf16(out, 1.0f, ws.w, head_operand(v, sh.D), sh, blas, "forward w v");
}

void attention_backward_bf16(const AttentionTensor& dq, const AttentionTensor& dk, const AttentionTensor& dv,
                             const AttentionTensor& dout, const AttentionTensorBf16& q, const AttentionTensorBf16& k,
                             const AttentionTensorBf16& v, const AttentionTensor& out, const float* lse,
                             const AttentionShape& sh, const AttentionDropout& dropout, void* workspace,
                             cublasHandle_t blas, cudaStream_t stream) {
  const int64_t rows = sh.B * sh.heads * sh.L, C = sh.heads * sh.D;
  if (rows == 0) return;
  const Bf16Workspace ws(workspace, sh, true);
  // dout is contiguous (B, L, C): rounded once for every head, the operand of g v^T and w^T g.
  to_bf16(ws.g, dout.data, sh.B * sh.L * C, stream);
  const OperandBf16 g{ws.g, C, sh.L * C, sh.D};
  scores_bf16(ws.s, head_operand(q, sh.D), head_operand(k, sh.D), sh, blas, "backward q k^T");
  scores_bf16(ws.t, g, head_operand(v, sh.D), sh, blas, "backward g v^T");
  detail::launch("attention softmax_backward_bf16_kernel", softmax_backward_bf16_kernel, dim3(row_blocks(rows)),
                 dim3(kThreads), stream, static_cast<const float*>(ws.s), static_cast<const float*>(ws.t), ws.w,
                 ws.ds, lse, static_cast<const float*>(dout.data), dout.batch_stride, dout.row_stride,
                 static_cast<const float*>(out.data), out.batch_stride, out.row_stride, rows, sh.heads, sh.L, sh.S,
                 sh.D, sh.scale, sh.causal, dropout.p, rng::stream_key(dropout.seed), dropout.offset);
  weights_t_times_bf16(dv, 1.0f, ws.w, g, sh, blas, "backward dv = w^T g");
  weights_times_bf16(dq, sh.scale, ws.ds, head_operand(k, sh.D), sh, blas, "backward dq = scale ds k");
  weights_t_times_bf16(dk, sh.scale, ws.ds, head_operand(q, sh.D), sh, blas, "backward dk = scale ds^T q");
}

}  // namespace dpar::kernels::cuda
