// The instruction sets that the CPU kernels' elementwise and reduction loops are compiled for, and the choice
// among them.
//
// A loop is written once, as an always-inline function (DPAR_VECTOR_LOOP), and called through run_vector, which
// holds one copy of it compiled for AVX-512, one for AVX2 and one for baseline x86-64, and runs the best that the
// CPU supports. None of these targets brings FMA (and -ffp-contract=off forbids contraction anyway), so every
// copy computes the same bits; they differ in vector width alone. A test runs each copy (ForceVectorIsa) and
// compares their bits, so a copy that starts to compute differently (a contraction, a reassociation) is caught.
#pragma once

namespace dpar::kernels::cpu {

enum class VectorIsa : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };
constexpr VectorIsa kVectorIsas[] = {VectorIsa::kBaseline, VectorIsa::kAvx2, VectorIsa::kAvx512};

// "baseline", "avx2", "avx512f": the target each copy is compiled for.
const char* vector_isa_name(VectorIsa isa);
// Whether this CPU (and its OS) can run the copy for `isa`.
bool vector_isa_supported(VectorIsa isa);
// The copy that the calling thread's loops run: the best the CPU supports, unless a ForceVectorIsa says otherwise.
VectorIsa vector_isa();

// For tests: while it lives, the calling thread's loops run the copy compiled for `isa`, which the CPU must support
// (throws dpar::Error INVALID_ARGUMENT otherwise). Scopes nest; other threads are unaffected.
class ForceVectorIsa {
 public:
  explicit ForceVectorIsa(VectorIsa isa);
  ~ForceVectorIsa();
  ForceVectorIsa(const ForceVectorIsa&) = delete;
  ForceVectorIsa& operator=(const ForceVectorIsa&) = delete;

 private:
  int before_;
};

// A loop's body: inlined into each copy, and compiled there for that copy's target.
#define DPAR_VECTOR_LOOP inline __attribute__((always_inline))

namespace vector_detail {
// The AVX-512 and AVX2 copies of kLoop. Unlike target_clones, which Clang (the fuzz build) cannot apply to a
// template and whose load-time resolver crashes under ThreadSanitizer, a target attribute works in every build, and
// each copy can be called by name.
template <auto kLoop, class... Args>
__attribute__((target("avx512f"))) auto avx512(Args... args) {
  return kLoop(args...);
}
template <auto kLoop, class... Args>
__attribute__((target("avx2"))) auto avx2(Args... args) {
  return kLoop(args...);
}
}  // namespace vector_detail

// Runs kLoop(args...) in the copy that vector_isa() names.
template <auto kLoop, class... Args>
auto run_vector(Args... args) {
  switch (vector_isa()) {
    case VectorIsa::kAvx512: return vector_detail::avx512<kLoop>(args...);
    case VectorIsa::kAvx2: return vector_detail::avx2<kLoop>(args...);
    case VectorIsa::kBaseline: break;
  }
  return kLoop(args...);
}

}  // namespace dpar::kernels::cpu
