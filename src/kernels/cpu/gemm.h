// The CPU GEMM: oneDNN's dnnl_sgemm, which picks its kernels from the CPU's feature bits (AVX2, AVX-512, ...) at
// run time, on Intel and AMD alike, rather than from a table of CPU models that a new CPU is missing from.
//
// Threads: oneDNN (Debian's build) parallelises with OpenMP, whose thread count is per calling thread. Each call
// runs on the calling thread's count set by set_gemm_threads (1 where it was never set), so that device workers
// never oversubscribe the cores and a GEMM's arithmetic (which depends on how it is split over threads) is the same
// on every thread that asks for the same count.
#pragma once

#include <cstdint>

namespace dpar::kernels::cpu {

// C (M,N) = alpha op(A) op(B) + beta C, all row-major; op(X) is X^T when its flag is set. beta == 0 ignores
// whatever C held (even NaN). Throws dpar::Error on a failure that oneDNN reports.
void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// The number of threads the calling thread's GEMMs use from now on (>= 1).
void set_gemm_threads(int threads);
// The calling thread's GEMM thread count (1 where set_gemm_threads was never called): a oneDNN primitive splits its
// work for the count it was created with, so a cache of primitives keys on it.
int gemm_threads();

// For its lifetime, oneDNN calls on the calling thread run on that thread's GEMM thread count (set_gemm_threads);
// the caller's own OpenMP count comes back after. Every oneDNN call of the CPU kernels (the GEMM, the convolutions
// and poolings of dnnl_ops.h) runs inside one, so that a worker's convolutions split over threads as its GEMMs do.
class GemmThreadsScope {
 public:
  GemmThreadsScope();
  ~GemmThreadsScope();
  GemmThreadsScope(const GemmThreadsScope&) = delete;
  GemmThreadsScope& operator=(const GemmThreadsScope&) = delete;

 private:
  int before_ = 0;
  bool changed_ = false;
};

// What runs the GEMMs, as the library reports it: "oneDNN 2.6.3 (OpenMP), avx512_core f32 kernels (CPU ISA
// avx512_core_amx)". Static storage; the same pointer on every call.
const char* gemm_backend();

// True when the kernels are below the best that this CPU supports among AVX2 and AVX-512 (say, a CPU with
// AVX-512 on AVX2 kernels, or one with AVX2 on SSE4.1 or generic code); *why names both and the remedy.
bool gemm_backend_is_generic(const char** why);

// Whether oneDNN runs bf16 GEMMs and convolutions natively here (bf16 products with f32 accumulation in hardware:
// effective ISA avx512_core_bf16, AVX512-BF16, or an AMX one); the CPU backend has bf16 kernels only then. Where it
// does not, *why (static storage) names the missing ISA and this CPU's: "bf16 needs AVX512-BF16 or AMX (oneDNN's
// avx512_core_bf16); this CPU runs avx2". Where it does, *why is "".
bool bf16_support(const char** why);

// Says once per process, on stderr, when gemm_backend_is_generic: the engine calls it when it starts CPU workers.
void warn_if_gemm_generic();

}  // namespace dpar::kernels::cpu
