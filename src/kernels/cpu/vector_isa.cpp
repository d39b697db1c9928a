#include "kernels/cpu/vector_isa.h"

#include "common/error.h"

namespace dpar::kernels::cpu {
namespace {

constexpr int kNotForced = -1;
thread_local int t_forced = kNotForced;

VectorIsa best_supported() {
  static const VectorIsa best = [] {
    for (int i = static_cast<int>(VectorIsa::kAvx512); i > 0; --i)
      if (vector_isa_supported(static_cast<VectorIsa>(i))) return static_cast<VectorIsa>(i);
    return VectorIsa::kBaseline;
  }();
  return best;
}

}  // namespace

const char* vector_isa_name(VectorIsa isa) {
  switch (isa) {
    case VectorIsa::kBaseline: return "baseline";
    case VectorIsa::kAvx2: return "avx2";
    case VectorIsa::kAvx512: return "avx512f";
  }
  return "unknown";
}

bool vector_isa_supported(VectorIsa isa) {
  // The compiler's runtime reads CPUID and XGETBV: a feature counts only when the OS saves its registers.
  __builtin_cpu_init();
  switch (isa) {
    case VectorIsa::kBaseline: return true;
    case VectorIsa::kAvx2: return __builtin_cpu_supports("avx2");
    case VectorIsa::kAvx512: return __builtin_cpu_supports("avx512f");
  }
  return false;
}

VectorIsa vector_isa() { return t_forced == kNotForced ? best_supported() : static_cast<VectorIsa>(t_forced); }

ForceVectorIsa::ForceVectorIsa(VectorIsa isa) : before_(t_forced) {
  DPAR_CHECK_ARG(vector_isa_supported(isa), "ForceVectorIsa: this CPU cannot run the ", vector_isa_name(isa),
                 " loops");
  t_forced = static_cast<int>(isa);
}

ForceVectorIsa::~ForceVectorIsa() { t_forced = before_; }

}  // namespace dpar::kernels::cpu
