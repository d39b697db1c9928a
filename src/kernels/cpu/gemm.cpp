#include "kernels/cpu/gemm.h"

#include <dnnl.h>

#include <cstdio>
#include <mutex>
#include <string>

#include "common/error.h"

#if DNNL_CPU_THREADING_RUNTIME == DNNL_RUNTIME_OMP
// oneDNN's OpenMP runtime, the one libdnnl itself is linked with (CMake links it too): declared here rather than
// through <omp.h> and -fopenmp, which under clang would bring LLVM's runtime beside oneDNN's GNU one, and these
// calls would then set a thread count that oneDNN never reads.
extern "C" int omp_get_max_threads(void);
extern "C" void omp_set_num_threads(int);
#define DPAR_GEMM_OMP 1
#elif DNNL_CPU_THREADING_RUNTIME != DNNL_RUNTIME_SEQ
#error "dpar needs a oneDNN built with the OpenMP or the sequential CPU runtime (its thread count per caller)"
#endif

namespace dpar::kernels::cpu {
namespace {

thread_local int t_gemm_threads = 1;

// oneDNN's ISA levels are bit masks, each including the ones below it; the f32 GEMM has kernels for these
// (oneDNN 2.x: gemm_driver's avx512_core, avx2, avx and sse41 kernels; below that, its reference C++ loop).
struct IsaLevel {
  unsigned mask;
  const char* name;
};
constexpr IsaLevel kGemmLevels[] = {{dnnl_cpu_isa_avx512_core, "avx512_core"},
                                    {dnnl_cpu_isa_avx2, "avx2"},
                                    {dnnl_cpu_isa_avx, "avx"},
                                    {dnnl_cpu_isa_sse41, "sse41"}};

const char* isa_name(unsigned isa) {
  switch (isa) {
    case dnnl_cpu_isa_all: return "all";
    case dnnl_cpu_isa_sse41: return "sse41";
    case dnnl_cpu_isa_avx: return "avx";
    case dnnl_cpu_isa_avx2: return "avx2";
    case dnnl_cpu_isa_avx512_mic: return "avx512_mic";
    case dnnl_cpu_isa_avx512_mic_4ops: return "avx512_mic_4ops";
    case dnnl_cpu_isa_avx512_core: return "avx512_core";
    case dnnl_cpu_isa_avx512_core_vnni: return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core_bf16: return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_amx: return "avx512_core_amx";
    case dnnl_cpu_isa_avx2_vnni: return "avx2_vnni";
    default: return "unknown";
  }
}

// The f32 GEMM kernels that oneDNN runs at effective ISA `isa`; nullptr for its generic C++ code.
const char* gemm_kernels(unsigned isa) {
  for (const IsaLevel& l : kGemmLevels)
    if ((isa & l.mask) == l.mask) return l.name;
  return nullptr;
}

// The best of those levels that this CPU (and its OS, which must save the vector registers) supports, as the
// compiler's runtime reads the CPUID feature bits: what oneDNN should have chosen.
const char* best_for_this_cpu() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    return "avx512_core";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "avx2";
  return nullptr;  // below AVX2 nothing is demanded
}

int level_rank(const char* name) {
  if (name == nullptr) return 0;
  const std::string n = name;
  return n == "sse41" ? 1 : n == "avx" ? 2 : n == "avx2" ? 3 : n == "avx512_core" ? 4 : 0;
}

struct Report {
  std::string text;
  std::string generic_why;  // empty when the kernels are the best this CPU supports
};

const Report& report() {
  static const Report r = [] {
    Report out;
    const dnnl_version_t* v = dnnl_version();
    const unsigned isa = static_cast<unsigned>(dnnl_get_effective_cpu_isa());
    const char* kernels = gemm_kernels(isa);
    const char* runtime = v->cpu_runtime == DNNL_RUNTIME_OMP ? "OpenMP" : v->cpu_runtime == DNNL_RUNTIME_SEQ ? "sequential" : "other";
    out.text = "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch) +
               " (" + runtime + "), " + (kernels ? std::string(kernels) + " f32 kernels" : "generic C++ f32 code") +
               " (CPU ISA " + isa_name(isa) + ")";
    const char* best = best_for_this_cpu();
    if (level_rank(kernels) < level_rank(best)) {
      out.generic_why = std::string("the CPU GEMM runs ") + (kernels ? kernels : "generic C++") +
                        " code on a CPU with " + best + " (" + out.text +
                        "); unset ONEDNN_MAX_CPU_ISA and DNNL_MAX_CPU_ISA, which cap oneDNN's choice, or install a "
                        "oneDNN that knows this CPU";
    }
    return out;
  }();
  return r;
}

}  // namespace

void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  dnnl_status_t st;
  {
    GemmThreadsScope threads;
    st = dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
  if (st == dnnl_out_of_memory) fail(Status::kOutOfMemory, "sgemm: oneDNN ran out of memory (M=", M, ", N=", N, ", K=", K, ")");
  DPAR_CHECK_ARG(st == dnnl_success, "sgemm: dnnl_sgemm failed with status ", static_cast<int>(st), " (M=", M,
                 ", N=", N, ", K=", K, ", lda=", lda, ", ldb=", ldb, ", ldc=", ldc, ")");
}

// Set the caller's OpenMP thread count for the call and give it back after: a worker has set it once (no change
// then), and a caller's own OpenMP settings survive a GEMM run on its thread.
GemmThreadsScope::GemmThreadsScope() {
#ifdef DPAR_GEMM_OMP
  before_ = omp_get_max_threads();
  changed_ = before_ != t_gemm_threads;
  if (changed_) omp_set_num_threads(t_gemm_threads);
#endif
}

GemmThreadsScope::~GemmThreadsScope() {
#ifdef DPAR_GEMM_OMP
  if (changed_) omp_set_num_threads(before_);
#endif
}

void set_gemm_threads(int threads) {
  t_gemm_threads = threads >= 1 ? threads : 1;
#ifdef DPAR_GEMM_OMP
  omp_set_num_threads(t_gemm_threads);
#endif
}

int gemm_threads() { return t_gemm_threads; }

bool bf16_support(const char** why) {
  static const std::string reason = [] {
    const unsigned isa = static_cast<unsigned>(dnnl_get_effective_cpu_isa());
    const unsigned bf16 = static_cast<unsigned>(dnnl_cpu_isa_avx512_core_bf16);  // the AMX levels include it
    if ((isa & bf16) == bf16) return std::string();
    return std::string("bf16 needs AVX512-BF16 or AMX (oneDNN's avx512_core_bf16); this CPU runs ") + isa_name(isa);
  }();
  if (why) *why = reason.c_str();
  return reason.empty();
}

const char* gemm_backend() { return report().text.c_str(); }

bool gemm_backend_is_generic(const char** why) {
  const Report& r = report();
  if (why) *why = r.generic_why.c_str();
  return !r.generic_why.empty();
}

void warn_if_gemm_generic() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* why = nullptr;
    if (gemm_backend_is_generic(&why)) std::fprintf(stderr, "dpar: warning: %s\n", why);
  });
}

}  // namespace dpar::kernels::cpu
