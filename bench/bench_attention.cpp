// bench_attention: the CPU attention kernel's forward + backward on one thread for the GPT shapes, with its tiles
// computed by its own loops and by oneDNN's sgemm, beside PyTorch's F.scaled_dot_product_attention (f32, one thread,
// bench/attention_anchor.py) when given a Python with torch: bench_attention [--torch /path/to/python].
// Causal self-attention, q, k, v views of one packed (B, T, 3C) projection as a GPT's; the median of the runs, in
// the thread's CPU time (CLOCK_THREAD_CPUTIME_ID; the anchor's time.thread_time), which a shared machine's other
// processes disturb far less than the wall clock.
#include <algorithm>
#include <cmath>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/random.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/gemm.h"

namespace kc = dpar::kernels::cpu;

namespace {

struct Shape {
  int64_t B, T, C, heads;
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
  std::vector<float> scratch(static_cast<size_t>(kc::attention_scratch_floats(D)));  // kept, as the op keeps it
  std::vector<double> times;
  for (int r = 0; r < reps + 2; ++r) {
    const double t0 = thread_ms();
    kc::attention_forward(o, lse.data(), packed(qkv, 0), packed(qkv, 1), packed(qkv, 2), sh, drop, tiles,
                          scratch.data());
    kc::attention_backward(packed(dqkv, 0), packed(dqkv, 1), packed(dqkv, 2), g, packed(qkv, 0), packed(qkv, 1),
                           packed(qkv, 2), o, lse.data(), sh, drop, tiles, scratch.data());
    const double t1 = thread_ms();
    if (r >= 2) times.push_back(t1 - t0);
  }
  return median_ms(times);
}

}  // namespace

int main(int argc, char** argv) {
  const char* python = nullptr;
  bool loops = true;  // --no-loops: the op's tiles (sgemm) alone, for a profile
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--torch") == 0 && i + 1 < argc) python = argv[++i];
    if (std::strcmp(argv[i], "--no-loops") == 0) loops = false;
  }
  const std::vector<Shape> shapes = {{8, 128, 128, 4}, {16, 128, 128, 4}, {32, 128, 128, 4}, {8, 256, 256, 4},
                                     {16, 256, 256, 4}, {32, 256, 256, 4}};
  std::printf("sgemm tiles: %s\n", kc::gemm_backend());
  std::printf("causal self-attention, forward + backward, one thread, ms of thread CPU time (median of 20)\n");
  std::printf("%4s %4s %4s %5s %3s  %10s %10s\n", "B", "T", "C", "heads", "D", "loops", "sgemm");
  for (const Shape& s : shapes) {
    const double with_loops = loops ? time_shape(s, kc::AttentionTiles::kLoops, 20) : 0.0;
    const double gemm = time_shape(s, kc::AttentionTiles::kSgemm, 20);
    std::printf("%4lld %4lld %4lld %5lld %3lld  %10.3f %10.3f\n", static_cast<long long>(s.B),
                static_cast<long long>(s.T), static_cast<long long>(s.C), static_cast<long long>(s.heads),
                static_cast<long long>(s.C / s.heads), with_loops, gemm);
  }
  if (python) {
    const std::string cmd = std::string(python) + " " BENCH_ATTENTION_ANCHOR;
    std::fflush(stdout);
    return std::system(cmd.c_str()) == 0 ? 0 : 1;
  }
  return 0;
}
