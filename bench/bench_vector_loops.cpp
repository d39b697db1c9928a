// bench_vector_loops: the CPU kernels' elementwise loops (kernels/cpu/vector_isa.h) in each copy this CPU runs
// (AVX-512, AVX2, baseline x86-64), nanoseconds per element and the ratio to the baseline copy. Every copy computes
// the same bits (tests/test_vector_clones.cpp); what differs is whether the compiler vectorised the loop for that
// target, which this program makes visible: a ratio near 1 means the copy runs scalar code.
// One thread, n = 1M elements (4 MiB per f32 array: out of L2, in L3 or memory), median of 15 runs of the thread's
// CPU time after 2 warm-up runs.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <functional>
#include <vector>

#include "common/bf16.h"
#include "common/optimizer_hyper.h"
#include "common/random.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/vector_isa.h"

namespace kc = dpar::kernels::cpu;

namespace {

constexpr int64_t kN = 1 << 20;

double thread_ns() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e9 + static_cast<double>(ts.tv_nsec);
}

// Nanoseconds per element of `loop` run in the copy `isa`.
double ns_per_element(kc::VectorIsa isa, const std::function<void()>& loop) {
  kc::ForceVectorIsa force(isa);
  std::vector<double> t;
  for (int r = 0; r < 17; ++r) {
    const double t0 = thread_ns();
    loop();
    if (r >= 2) t.push_back((thread_ns() - t0) / static_cast<double>(kN));
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main() {
  dpar::Rng rng(7);
  std::vector<float> x(kN), g(kN), y(kN), dx(kN), m(kN, 0.0f), v(kN, 0.0f);
  for (auto& a : x) a = rng.uniform(-4, 4);
  for (auto& a : g) a = rng.uniform(-1, 1);
  std::vector<uint16_t> x16(kN), y16(kN);
  for (int64_t i = 0; i < kN; ++i) x16[i] = dpar::to_bf16(x[i]);
  const dpar::AdamHyper adam{1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, false};

  struct Loop {
    const char* name;
    std::function<void()> run;
  };
  const std::vector<Loop> loops = {
      {"relu_forward", [&] { kc::relu_forward(y.data(), x.data(), kN); }},
      {"gelu_forward", [&] { kc::gelu_forward(y.data(), x.data(), kN); }},
      {"gelu_backward", [&] { kc::gelu_backward(dx.data(), g.data(), x.data(), kN); }},
      {"gelu_forward_rounded (bf16)", [&] { kc::gelu_forward_rounded(y16.data(), x16.data(), kN); }},
      {"gelu_backward_rounded (bf16)", [&] { kc::gelu_backward_rounded(dx.data(), g.data(), x16.data(), kN); }},
      {"tanh_forward", [&] { kc::tanh_forward(y.data(), x.data(), kN); }},
      {"sigmoid_forward", [&] { kc::sigmoid_forward(y.data(), x.data(), kN); }},
      {"to_bf16 (f32 -> bf16)", [&] { kc::to_bf16(y16.data(), x.data(), kN); }},
      {"adam_step", [&] { kc::adam_step(y.data(), m.data(), v.data(), g.data(), kN, adam, 1); }},
  };

  std::printf("CPU loops, one thread, n = %lld, ns per element (median of 15); ratio = baseline / copy\n",
              static_cast<long long>(kN));
  std::vector<kc::VectorIsa> isas;
  for (kc::VectorIsa isa : kc::kVectorIsas)
    if (kc::vector_isa_supported(isa)) isas.push_back(isa);
  std::printf("%-30s", "loop");
  for (kc::VectorIsa isa : isas) std::printf(" %12s", kc::vector_isa_name(isa));
  for (size_t i = 1; i < isas.size(); ++i) std::printf(" %9s", "ratio");
  std::printf("\n");
  for (const Loop& loop : loops) {
    std::vector<double> ns;
    for (kc::VectorIsa isa : isas) ns.push_back(ns_per_element(isa, loop.run));
    std::printf("%-30s", loop.name);
    for (double t : ns) std::printf(" %12.3f", t);
    for (size_t i = 1; i < ns.size(); ++i) std::printf(" %8.2fx", ns[0] / ns[i]);
    std::printf("\n");
  }
  return 0;
}
