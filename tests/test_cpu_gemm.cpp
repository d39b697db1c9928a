// The CPU GEMM's choice of kernels, checked by oneDNN's own report of its ISA: a CPU with AVX-512 never runs a
// generic or AVX2 kernel, one with AVX2 never less; dpar's description and its warning say what oneDNN chose.
#include <gtest/gtest.h>

#include <dnnl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu/gemm.h"

namespace k = dpar::kernels::cpu;

namespace {

bool cpu_has_avx512_core() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
bool has(unsigned isa, unsigned level) { return (isa & level) == level; }

// Runs this test binary again with one test selected and `env` added; returns its exit status and stderr.
int rerun(const std::string& test, const std::string& env, std::string* err) {
  const std::string cmd = env + " DPAR_TEST_GEMM_CHILD=1 /proc/" + std::to_string(getpid()) +
                          "/exe --gtest_filter=" + test + " 2>&1 >/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return -1;
  std::array<char, 512> buf;
  while (fgets(buf.data(), buf.size(), p)) *err += buf.data();
  return pclose(p);
}

}  // namespace

TEST(CpuGemm, KernelsAreTheBestTheCpuSupports) {
  if (std::getenv("ONEDNN_MAX_CPU_ISA") || std::getenv("DNNL_MAX_CPU_ISA"))
    GTEST_SKIP() << "ONEDNN_MAX_CPU_ISA or DNNL_MAX_CPU_ISA caps oneDNN's choice in this environment";
  if (!cpu_has_avx2()) GTEST_SKIP() << "this CPU has no AVX2 (and FMA): nothing better than generic is demanded";
  const unsigned isa = static_cast<unsigned>(dnnl_get_effective_cpu_isa());
  const std::string desc = k::gemm_backend();
  if (cpu_has_avx512_core()) {
    EXPECT_TRUE(has(isa, dnnl_cpu_isa_avx512_core)) << "a CPU with AVX-512 got oneDNN ISA 0x" << std::hex << isa;
    EXPECT_NE(desc.find("avx512_core f32 kernels"), std::string::npos) << desc;
  } else {
    EXPECT_TRUE(has(isa, dnnl_cpu_isa_avx2)) << "a CPU with AVX2 got oneDNN ISA 0x" << std::hex << isa;
    EXPECT_NE(desc.find("avx2 f32 kernels"), std::string::npos) << desc;
  }
  const char* why = nullptr;
  EXPECT_FALSE(k::gemm_backend_is_generic(&why)) << why;
  EXPECT_EQ(desc.rfind("oneDNN ", 0), 0u) << desc;
  EXPECT_EQ(k::gemm_backend(), k::gemm_backend()) << "static storage: the same pointer every time";
}

// Run only as a child of CappedIsaIsReportedAndWarnedOnce, with oneDNN capped at AVX.
TEST(CpuGemm, CappedChild) {
  if (!std::getenv("DPAR_TEST_GEMM_CHILD")) GTEST_SKIP() << "runs only as a child of CappedIsaIsReportedAndWarnedOnce";
  const char* why = nullptr;
  EXPECT_TRUE(k::gemm_backend_is_generic(&why)) << k::gemm_backend();
  EXPECT_NE(std::string(k::gemm_backend()).find("avx f32 kernels"), std::string::npos) << k::gemm_backend();
  // The GEMM still computes: a 2x2 product on the capped kernels.
  const std::vector<float> a{1, 2, 3, 4}, b{5, 6, 7, 8};
  std::vector<float> c(4, -1);
  k::sgemm(false, false, 2, 2, 2, 1.0f, a.data(), 2, b.data(), 2, 0.0f, c.data(), 2);
  EXPECT_EQ(c, (std::vector<float>{19, 22, 43, 50}));
  k::warn_if_gemm_generic();
  k::warn_if_gemm_generic();  // once per process
}

TEST(CpuGemm, CappedIsaIsReportedAndWarnedOnce) {
  if (std::getenv("DPAR_TEST_GEMM_CHILD")) GTEST_SKIP() << "the child runs CappedChild only";
  if (!cpu_has_avx2()) GTEST_SKIP() << "this CPU has no AVX2 (and FMA): a cap at AVX is not below its best";
  std::string err;
  const int status = rerun("CpuGemm.CappedChild", "ONEDNN_MAX_CPU_ISA=AVX", &err);
  EXPECT_EQ(status, 0) << err;
  const std::string warning = "dpar: warning: the CPU GEMM runs avx code on a CPU with ";
  const size_t at = err.find(warning);
  ASSERT_NE(at, std::string::npos) << err;
  EXPECT_EQ(err.find(warning, at + 1), std::string::npos) << "warned more than once:\n" << err;
  EXPECT_NE(err.find("ONEDNN_MAX_CPU_ISA"), std::string::npos) << "the remedy is missing:\n" << err;
}

// A thread's GEMM thread count is its own: after this thread asks for 2 and then 1 again, a fresh thread (at
// the default, 1) gives the same bits, as device workers on one count must; and the product is right.
TEST(CpuGemm, ThreadCountIsPerThreadAndResultsRepeat) {
  const int64_t M = 64, N = 96, K = 700;
  std::vector<float> a(M * K), b(K * N);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>((i * 7919) % 1000) / 1000.0f - 0.5f;
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>((i * 104729) % 1000) / 1000.0f - 0.5f;
  std::vector<float> c1(M * N), c2(M * N);
  k::set_gemm_threads(2);
  k::set_gemm_threads(1);
  k::sgemm(false, false, M, N, K, 1.0f, a.data(), K, b.data(), N, 0.0f, c1.data(), N);
  std::thread([&] { k::sgemm(false, false, M, N, K, 1.0f, a.data(), K, b.data(), N, 0.0f, c2.data(), N); }).join();
  EXPECT_EQ(c1, c2);
  double worst = 0;
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double ref = 0;
      for (int64_t kk = 0; kk < K; ++kk) ref += static_cast<double>(a[i * K + kk]) * b[kk * N + j];
      worst = std::max(worst, std::abs(ref - c1[i * N + j]));
    }
  EXPECT_LT(worst, 1e-3);
}
