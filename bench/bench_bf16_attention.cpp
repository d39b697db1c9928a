// bench_bf16_attention: the CPU attention kernel's forward + backward in f32 (oneDNN sgemm tiles) and in bf16
// (AttentionSpec::dtype: oneDNN's bf16 matmul on the same blocks), one thread, causal self-attention on views of one
// packed (B, T, 3C) projection as a GPT's. The median of the runs in the thread's CPU time (CLOCK_THREAD_CPUTIME_ID).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <vector>

#include "common/bf16.h"
#include "common/random.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/dnnl_ops.h"
#include "kernels/cpu/gemm.h"

namespace kc = dpar::kernels::cpu;

namespace {

struct Shape {
  int64_t B, heads, T, D;
};

double thread_ms() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}

double median_ms(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Forward + backward, milliseconds (median of reps after 2 warm-up runs): {f32, bf16}.
void time_shape(const Shape& s, bool causal, int reps, double& f32_ms, double& bf16_ms) {
  const int64_t C = s.heads * s.D, n3 = s.B * s.T * 3 * C, n = s.B * s.T * C;
  dpar::Rng rng(1);
  std::vector<float> qkv(static_cast<size_t>(n3)), dqkv(qkv.size()), out(static_cast<size_t>(n)),
      dout(static_cast<size_t>(n)), lse(static_cast<size_t>(s.B * s.heads * s.T));
  for (auto& x : qkv) x = rng.uniform(-1, 1);
  for (auto& x : dout) x = rng.uniform(-1, 1);
  std::vector<uint16_t> qkv16(qkv.size());
  for (size_t i = 0; i < qkv.size(); ++i) qkv16[i] = dpar::to_bf16(qkv[i]);
  auto packed = [&](std::vector<float>& buf, int role) {
    return kc::AttentionTensor{buf.data() + role * C, s.T * 3 * C, 3 * C};
  };
  auto packed16 = [&](int role) { return kc::AttentionTensorBf16{qkv16.data() + role * C, s.T * 3 * C, 3 * C}; };
  const kc::AttentionTensor o{out.data(), s.T * C, C}, g{dout.data(), s.T * C, C};
  const kc::AttentionShape sh{s.B, s.T, s.T, s.heads, s.D, 1.0f / std::sqrt(static_cast<float>(s.D)), causal};
  const kc::AttentionDropout drop{};
  std::vector<float> scratch(static_cast<size_t>(kc::attention_scratch_floats(s.D)));
  std::vector<char> scratch16(static_cast<size_t>(kc::attention_bf16_scratch_bytes(sh, true)) + 64);
  kc::Bf16Gemm gemm;
  std::vector<double> t32, t16;
  for (int r = 0; r < reps + 2; ++r) {
    double t0 = thread_ms();
    kc::attention_forward(o, lse.data(), packed(qkv, 0), packed(qkv, 1), packed(qkv, 2), sh, drop,
                          kc::AttentionTiles::kSgemm, scratch.data());
    kc::attention_backward(packed(dqkv, 0), packed(dqkv, 1), packed(dqkv, 2), g, packed(qkv, 0), packed(qkv, 1),
                           packed(qkv, 2), o, lse.data(), sh, drop, kc::AttentionTiles::kSgemm, scratch.data());
    double t1 = thread_ms();
    if (r >= 2) t32.push_back(t1 - t0);
    t0 = thread_ms();
    kc::attention_forward_bf16(gemm, o, lse.data(), packed16(0), packed16(1), packed16(2), sh, drop, scratch16.data());
    kc::attention_backward_bf16(gemm, packed(dqkv, 0), packed(dqkv, 1), packed(dqkv, 2), g, packed16(0), packed16(1),
                                packed16(2), o, lse.data(), sh, drop, scratch16.data());
    t1 = thread_ms();
    if (r >= 2) t16.push_back(t1 - t0);
  }
  f32_ms = median_ms(t32);
  bf16_ms = median_ms(t16);
}

}  // namespace

int main() {
  const char* why = "";
  if (!kc::bf16_support(&why)) {
    std::printf("no bf16 on this CPU: %s\n", why);
    return 0;
  }
  // The char GPT of bench_gpt (32 sequences of 128, 4 heads of 32), a longer one, and heads of 64 at T = 1024.
  const std::vector<Shape> shapes = {{32, 4, 128, 32}, {8, 4, 256, 32}, {4, 8, 1024, 64}};
  std::printf("f32 tiles: %s; bf16: oneDNN matmul\n", kc::gemm_backend());
  std::printf("self-attention on a packed projection, forward + backward, one thread, ms of thread CPU time "
              "(median of 10)\n");
  std::printf("%3s %5s %5s %3s %7s  %10s %10s %8s\n", "B", "heads", "T", "D", "causal", "f32", "bf16", "f32/bf16");
  for (const Shape& s : shapes)
    for (bool causal : {true, false}) {
      double a = 0, b = 0;
      time_shape(s, causal, 10, a, b);
      std::printf("%3lld %5lld %5lld %3lld %7s  %10.2f %10.2f %8.2f\n", static_cast<long long>(s.B),
                  static_cast<long long>(s.heads), static_cast<long long>(s.T), static_cast<long long>(s.D),
                  causal ? "yes" : "no", a, b, a / b);
    }
  return 0;
}
