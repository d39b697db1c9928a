// bench_bf16_cpu: the CPU's mixed-precision kernels against their f32 twins, one call at a time on the calling
// thread's GEMM thread count (argv[1], default 1): a linear layer's forward + backward (the bias, the two backward
// GEMMs, the bf16 rounding of the gradient) at batch 512 for 784->4096, 4096->4096 and 4096->10, and a 3x3
// convolution's forward + backward data + backward weights (batch 64, 32->64, 28x28), and each linear's three GEMMs
// alone. Prints the median ms per call, the ratio, the first call (which creates the oneDNN primitives of the
// shape), the CPU model and the oneDNN implementations that ran. On one thread the clock is the thread's CPU time
// (steady on a machine shared with other work, where wall-clock time moves by 2x); on more, wall-clock time.
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/bf16.h"
#include "common/op_specs.h"
#include "kernels/cpu/dnnl_ops.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/kernels.h"

#include "bench_util.h"

namespace k = dpar::kernels::cpu;

namespace {

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown CPU";
}

std::vector<float> randn(size_t n, unsigned seed, float scale) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  std::vector<float> v(n);
  for (float& x : v) x = normal(gen) * scale;
  return v;
}
std::vector<uint16_t> bits(const std::vector<float>& v) {
  std::vector<uint16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = dpar::to_bf16(v[i]);
  return b;
}

bool g_thread_clock = true;

double now() {
  if (!g_thread_clock) return bench_now();
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct Timing {
  double first_ms, median_ms;
};

// The first call apart (it prepares the shape), then the median of `reps` calls.
Timing time_calls(const std::function<void()>& call, int reps) {
  double t0 = now();
  call();
  const double first = (now() - t0) * 1e3;
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    t0 = now();
    call();
    ms.push_back((now() - t0) * 1e3);
  }
  return {first, bench_median(ms.data(), ms.size())};
}

void row(const char* what, const Timing& f32, const Timing& bf16) {
  std::printf("| %-34s | %9.2f | %9.2f | %5.2fx | %9.1f | %9.1f |\n", what, f32.median_ms, bf16.median_ms,
              f32.median_ms / bf16.median_ms, f32.first_ms, bf16.first_ms);
}

void bench_linear(int64_t B, int64_t Ci, int64_t Co, int reps) {
  const auto x = randn(static_cast<size_t>(B * Ci), 1, 1.0f), w = randn(static_cast<size_t>(Co * Ci), 2, 0.02f);
  const auto bias = randn(static_cast<size_t>(Co), 3, 0.1f), dout = randn(static_cast<size_t>(B * Co), 4, 1.0f);
  const auto xb = bits(x), wb = bits(w);
  std::vector<float> out(static_cast<size_t>(B * Co)), dinp(static_cast<size_t>(B * Ci)), dw(w.size()),
      db(bias.size());
  std::vector<uint16_t> dout_low(dout.size());
  const Timing f32 = time_calls(
      [&] {
        k::linear_forward(out.data(), x.data(), w.data(), bias.data(), B, Ci, Co);
        k::linear_backward(dinp.data(), dw.data(), db.data(), dout.data(), x.data(), w.data(), B, Ci, Co, false);
      },
      reps);
  k::Bf16Gemm gemm;
  std::string impls;
  const Timing bf16 = time_calls(
      [&] {
        k::linear_forward_bf16(gemm, out.data(), nullptr, xb.data(), wb.data(), bias.data(), B, Ci, Co,
                               dpar::Epilogue::kNone);
        if (impls.empty()) impls = "forward " + gemm.last_impl();
        k::linear_backward_bf16(gemm, dinp.data(), dw.data(), db.data(), nullptr, dout_low.data(), dout.data(),
                                nullptr, nullptr, nullptr, nullptr, xb.data(), wb.data(), B, Ci, Co,
                                dpar::Epilogue::kNone, false);
        if (impls.find("backward") == std::string::npos) impls += ", backward (dinp, dweight) " + gemm.last_impl();
      },
      reps);
  const std::string what = "linear " + std::to_string(B) + "x" + std::to_string(Ci) + "->" + std::to_string(Co);
  row(what.c_str(), f32, bf16);
  // Its three GEMMs alone: where the time goes.
  const struct {
    const char* name;
    bool ta, tb;
    int64_t M, N, K;
    const float *a, *b;
    const uint16_t *ab, *bb;
    float* c;
  } gemms[] = {{"  GEMM out = x w^T", false, true, B, Co, Ci, x.data(), w.data(), xb.data(), wb.data(), out.data()},
               {"  GEMM dinp = g w", false, false, B, Ci, Co, dout.data(), w.data(), dout_low.data(), wb.data(),
                dinp.data()},
               {"  GEMM dweight = g^T x", true, false, Co, Ci, B, dout.data(), x.data(), dout_low.data(), xb.data(),
                dw.data()}};
  for (const auto& g : gemms) {
    const int64_t lda = g.ta ? g.M : g.K, ldb = g.tb ? g.K : g.N;
    const Timing t32 = time_calls(
        [&] { k::sgemm(g.ta, g.tb, g.M, g.N, g.K, 1.0f, g.a, lda, g.b, ldb, 0.0f, g.c, g.N); }, reps);
    const Timing t16 =
        time_calls([&] { gemm.run(g.ta, g.tb, g.M, g.N, g.K, g.ab, lda, g.bb, ldb, false, g.c, g.N); }, reps);
    row(g.name, t32, t16);
  }
  std::printf("|   bf16 kernels: %s\n", impls.c_str());
}

void bench_conv(int reps) {
  dpar::Conv2dSpec s;
  s.in_channels = 32, s.out_channels = 64, s.kernel_h = s.kernel_w = 3, s.pad_h = s.pad_w = 1;
  const int64_t N = 64, H = 28, W = 28;
  const size_t in_n = static_cast<size_t>(N * 32 * H * W), out_n = static_cast<size_t>(N * 64 * H * W);
  const auto x = randn(in_n, 5, 1.0f), w = randn(64 * 32 * 9, 6, 0.05f), bias = randn(64, 7, 0.1f);
  const auto dout = randn(out_n, 8, 1.0f);
  const auto xb = bits(x), wb = bits(w);
  std::vector<float> out(out_n), dinp(in_n), dw(w.size()), db(64);
  k::Conv2d c32(s);
  const Timing f32 = time_calls(
      [&] {
        c32.forward(out.data(), x.data(), w.data(), bias.data(), N, H, W);
        c32.backward_data(dinp.data(), dout.data(), w.data(), N, H, W);
        c32.backward_weights(dw.data(), db.data(), dout.data(), x.data(), N, H, W, false);
      },
      reps);
  s.dtype = dpar::DType::kBF16;
  k::Conv2d c16(s);
  const Timing bf16 = time_calls(
      [&] {
        c16.forward(out.data(), xb.data(), wb.data(), bias.data(), N, H, W);
        c16.backward_data(dinp.data(), dout.data(), wb.data(), N, H, W);
        c16.backward_weights(dw.data(), db.data(), dout.data(), xb.data(), N, H, W, false);
      },
      reps);
  row("conv 64x32x28x28, 3x3 -> 64", f32, bf16);
  std::printf("|   f32 kernels: %s\n|   bf16 kernels: %s\n", c32.impl_info().c_str(), c16.impl_info().c_str());
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 1;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 5;
  const char* why = "";
  g_thread_clock = threads == 1;
  std::printf("CPU: %s\nGEMM: %s\nthreads: %d, median of %d calls after the first, ms of %s\n",
              cpu_model().c_str(), k::gemm_backend(), threads, reps,
              g_thread_clock ? "the thread's CPU time" : "wall-clock time");
  if (!k::bf16_support(&why)) {
    std::printf("no bf16 kernels here: %s\n", why);
    return 0;
  }
  k::set_gemm_threads(threads);
  std::printf("| %-34s | %9s | %9s | %6s | %9s | %9s |\n", "forward + backward", "f32 ms", "bf16 ms", "ratio",
              "f32 1st", "bf16 1st");
  std::printf("|%s|%s|%s|%s|%s|%s|\n", std::string(36, '-').c_str(), std::string(11, '-').c_str(),
              std::string(11, '-').c_str(), std::string(8, '-').c_str(), std::string(11, '-').c_str(),
              std::string(11, '-').c_str());
  bench_linear(512, 784, 4096, reps);
  bench_linear(512, 4096, 4096, reps);
  bench_linear(512, 4096, 10, reps);
  bench_conv(reps);
  return 0;
}
