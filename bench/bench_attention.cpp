// bench_attention: the CPU attention kernel's forward + backward on one thread for the GPT shapes, with its tiles
// computed by its own loops and by oneDNN's sgemm, beside PyTorch's F.scaled_dot_product_attention (f32, one thread,
// bench/attention_anchor.py) when given a Python with torch: bench_attention [--torch /path/to/python].
// Causal self-attention, q, k, v views of one packed (B, T, 3C) projection as a GPT's; the median of the runs.
#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/random.h"
#include "kernels/cpu/attention.h"

namespace kc = dpar::kernels::cpu;

namespace {

struct Shape {
  int64_t B, T, C, heads;
};

double median_ms(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Forward + backward of one shape, in milliseconds (median).
double time_shape(const Shape& s, kc::AttentionTiles tiles, int reps) {
  const int64_t C = s.C, D = C / s.heads, n3 = s.B * s.T * 3 * C, n = s.B * s.T * C;
  dpar::Rng rng(1);
  std::vector<float> qkv(static_cast<size_t>(n3)), dqkv(qkv.size()), out(static_cast<size_t>(n)),
      dout(static_cast<size_t>(n)), lse(static_cast<size_t>(s.B * s.heads * s.T));
  for (auto& x : qkv) x = rng.uniform(-1, 1);
  for (auto& x : dout) x = rng.uniform(-1, 1);
  auto packed = [&](std::vector<float>& buf, int role) {
    return kc::AttentionTensor{buf.data() + role * C, s.T * 3 * C, 3 * C};
  };
  const kc::AttentionTensor o{out.data(), s.T * C, C}, g{dout.data(), s.T * C, C};
  kc::AttentionShape sh{s.B, s.T, s.T, s.heads, D, 1.0f / std::sqrt(static_cast<float>(D)), true};
  kc::AttentionDropout drop{};
  std::vector<double> times;
  for (int r = 0; r < reps + 2; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    kc::attention_forward(o, lse.data(), packed(qkv, 0), packed(qkv, 1), packed(qkv, 2), sh, drop, tiles);
    kc::attention_backward(packed(dqkv, 0), packed(dqkv, 1), packed(dqkv, 2), g, packed(qkv, 0), packed(qkv, 1),
                           packed(qkv, 2), o, lse.data(), sh, drop, tiles);
    const auto t1 = std::chrono::steady_clock::now();
    if (r >= 2) times.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  return median_ms(times);
}

}  // namespace

int main(int argc, char** argv) {
  const char* python = nullptr;
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--torch") == 0 && i + 1 < argc) python = argv[++i];
  const std::vector<Shape> shapes = {{8, 128, 128, 4}, {16, 128, 128, 4}, {32, 128, 128, 4}, {8, 256, 256, 4},
                                     {16, 256, 256, 4}, {32, 256, 256, 4}};
  std::printf("causal self-attention, forward + backward, one thread, ms (median of 20)\n");
  std::printf("%4s %4s %4s %5s %3s  %10s %10s\n", "B", "T", "C", "heads", "D", "loops", "sgemm");
  for (const Shape& s : shapes) {
    const double loops = time_shape(s, kc::AttentionTiles::kLoops, 20);
    const double gemm = time_shape(s, kc::AttentionTiles::kSgemm, 20);
    std::printf("%4lld %4lld %4lld %5lld %3lld  %10.3f %10.3f\n", static_cast<long long>(s.B),
                static_cast<long long>(s.T), static_cast<long long>(s.C), static_cast<long long>(s.heads),
                static_cast<long long>(s.C / s.heads), loops, gemm);
  }
  if (python) {
    const std::string cmd = std::string(python) + " " BENCH_ATTENTION_ANCHOR;
    std::fflush(stdout);
    return std::system(cmd.c_str()) == 0 ? 0 : 1;
  }
  return 0;
}
