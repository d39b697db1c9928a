// The CUDA kernels of BatchNorm, LayerNorm and Embedding against their CPU twins (the reference), on the same
// random inputs, and through the CUDA backend's Stream. Without a GPU every test reports SKIPPED with the reason.
//
// Tolerances, and why:
//  - a kernel whose every output element is the CPU twin's expression in the same order (the elementwise passes,
//    batchnorm_moments, LayerNorm's parameter gradients, Embedding both ways) must give the CPU's bits: the kernels
//    are built with --fmad=false and use IEEE double division and sqrt, so any difference is a bug;
//  - a sum the GPU adds in a tree (BatchNorm's per-channel sums, LayerNorm's per-row mean and variance) differs from
//    the CPU's sequential sum by double rounding alone: within 1e-12 of the sum of the terms' magnitudes (about
//    4500 ulps of double; random rounding errors grow as sqrt(n) ulps, about 100 for the largest n = 9900 here,
//    and a missing or doubled element moves a sum by a whole term, 1e-4 of it or more);
//  - a float computed from such a double (LayerNorm's output and input gradient, a whole BatchNorm step) is the
//    CPU's float or its neighbour: a normalised error of at most 2^-22 (two float ulps of the tensor's scale).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "cuda_test_util.h"
#include "kernels/cpu/batchnorm.h"
#include "kernels/cpu/norm_embedding.h"
#include "kernels/cuda/kernels.h"
#include "op_calls.h"

namespace dpar {
namespace {

namespace cpu = kernels::cpu;
namespace gpu = kernels::cuda;
using test::bitwise_equal;
using test::DeviceBuffer;
using test::normalised_error;
using test::random_vector;

constexpr double kTwoUlps = 0x1p-22;

// Bit-for-bit equality of doubles, naming the first difference.
::testing::AssertionResult bitwise_equal_d(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes " << a.size() << " vs " << b.size();
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(double)) != 0)
      return ::testing::AssertionFailure() << "element " << i << ": " << a[i] << " vs reference " << b[i];
  return ::testing::AssertionSuccess();
}

// Each a[i] within 1e-12 * magnitude[i] of b[i] (magnitude: the sum of |term| that b[i] adds up).
::testing::AssertionResult sums_close(const std::vector<double>& a, const std::vector<double>& b,
                                      const std::vector<double>& magnitude) {
  if (a.size() != b.size() || a.size() != magnitude.size())
    return ::testing::AssertionFailure() << "sizes " << a.size() << ", " << b.size() << ", " << magnitude.size();
  for (size_t i = 0; i < a.size(); ++i)
    if (!(std::fabs(a[i] - b[i]) <= 1e-12 * magnitude[i]))
      return ::testing::AssertionFailure() << "element " << i << ": " << a[i] << " vs reference " << b[i]
                                           << " (terms' magnitude " << magnitude[i] << ")";
  return ::testing::AssertionSuccess();
}

std::vector<float> abs_of(std::vector<float> v) {
  for (float& x : v) x = std::fabs(x);
  return v;
}

class CudaNorm : public ::testing::Test {
 protected:
  void SetUp() override {
    DPAR_REQUIRE_GPU();
    DPAR_CUDA_CHECK(cudaSetDevice(0), "test device");
    // A blocking stream: the tests' cudaMemcpy uploads and downloads (legacy stream) are ordered with it.
    DPAR_CUDA_CHECK(cudaStreamCreate(&stream_), "test stream");
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  cudaStream_t stream_ = nullptr;
};

struct BnShape {
  int64_t N, C, L;
};
// L = 1 ((N,C) inputs) and L > 1, L below, at and above the channel block (256) and not dividing it, C not a
// multiple of anything, and no rows.
const BnShape kBnShapes[] = {{1, 1, 1},   {7, 3, 1},    {64, 13, 1},  {300, 2, 1}, {5, 7, 49},  {3, 4, 255},
                             {3, 4, 256}, {3, 4, 257},  {33, 17, 300}, {2, 5, 1000}, {0, 3, 5},  {0, 6, 1}};

::testing::Message bn_trace(const BnShape& s) {
  return ::testing::Message() << "N " << s.N << " C " << s.C << " L " << s.L;
}

TEST_F(CudaNorm, BatchNormStatsAndBackwardReduceMatchCpu) {
  uint64_t seed = 1;
  for (const BnShape& s : kBnShapes) {
    SCOPED_TRACE(bn_trace(s));
    const size_t n = static_cast<size_t>(s.N * s.C * s.L), c = static_cast<size_t>(s.C);
    const auto x = random_vector(n, seed++, 1.0f, 3.0f);  // far from zero: Σx² is not Σx's square
    const auto dy = random_vector(n, seed++);
    // Statistics, and the magnitudes that bound their rounding: Σ|x| and Σx² (already positive).
    std::vector<double> want(2 * c), mag(2 * c);
    cpu::batchnorm_stats(want.data(), x.data(), s.N, s.C, s.L);
    cpu::batchnorm_stats(mag.data(), abs_of(x).data(), s.N, s.C, s.L);
    DeviceBuffer<float> dx(x), ddy(dy);
    DeviceBuffer<double> sums(2 * c);
    gpu::batchnorm_stats(sums.get(), dx.get(), s.N, s.C, s.L, stream_);
    const auto got = sums.download();
    EXPECT_TRUE(sums_close(got, want, mag));
    if (s.N == 0) {
      for (double v : got) EXPECT_EQ(v, 0.0) << "no rows: zeros";
    }

    // Backward's sums, from the CPU's mean_invstd (the same for both).
    std::vector<double> mean_invstd(2 * c);
    std::vector<float> rm(c, 0.0f), rv(c, 1.0f);
    if (s.N * s.L >= 2)
      cpu::batchnorm_moments(mean_invstd.data(), rm.data(), rv.data(), nullptr, want.data(),
                             static_cast<double>(s.N * s.L), s.C, 1e-5f, 0.1f);
    else
      cpu::batchnorm_moments(mean_invstd.data(), rm.data(), rv.data(), nullptr, nullptr, 0.0, s.C, 1e-5f, 0.1f);
    std::vector<double> want_b(2 * c), mag_b(2 * c);
    cpu::batchnorm_backward_reduce(want_b.data(), dy.data(), x.data(), mean_invstd.data(), s.N, s.C, s.L);
    // Σ|dy| and Σ|dy·x̂|: the reduction of |dy| with x̂ taken as |x̂| (x̂'s sign flips with x - mean, so the bound
    // uses the CPU's x̂ per element).
    for (int64_t ch = 0; ch < s.C; ++ch)
      for (int64_t r = 0; r < s.N; ++r)
        for (int64_t l = 0; l < s.L; ++l) {
          const size_t i = static_cast<size_t>((r * s.C + ch) * s.L + l);
          const double xhat = (x[i] - mean_invstd[static_cast<size_t>(ch)]) * mean_invstd[c + static_cast<size_t>(ch)];
          mag_b[static_cast<size_t>(ch)] += std::fabs(dy[i]);
          mag_b[c + static_cast<size_t>(ch)] += std::fabs(dy[i] * xhat);
        }
    DeviceBuffer<double> dmi(mean_invstd), bsums(2 * c);
    gpu::batchnorm_backward_reduce(bsums.get(), ddy.get(), dx.get(), dmi.get(), s.N, s.C, s.L, stream_);
    EXPECT_TRUE(sums_close(bsums.download(), want_b, mag_b));

    // The same bits call after call.
    DeviceBuffer<double> again(2 * c), again_b(2 * c);
    gpu::batchnorm_stats(again.get(), dx.get(), s.N, s.C, s.L, stream_);
    gpu::batchnorm_backward_reduce(again_b.get(), ddy.get(), dx.get(), dmi.get(), s.N, s.C, s.L, stream_);
    EXPECT_TRUE(bitwise_equal_d(again.download(), got));
    EXPECT_TRUE(bitwise_equal_d(again_b.download(), bsums.download()));
  }
}

TEST_F(CudaNorm, BatchNormMomentsAreTheCpusBitForBit) {
  const int64_t C = 37;
  const size_t c = C;
  const auto x = random_vector(static_cast<size_t>(9 * C * 5), 3, -2.0f, 5.0f);
  std::vector<double> sums(2 * c);
  cpu::batchnorm_stats(sums.data(), x.data(), 9, C, 5);
  const double count = 45.0;
  const auto rm0 = random_vector(c, 4), rv0 = random_vector(c, 5, 0.5f, 2.0f);
  for (bool training : {true, false}) {
    for (bool tracked : {true, false}) {
      SCOPED_TRACE(::testing::Message() << "training " << training << " tracked " << tracked);
      std::vector<double> want(2 * c);
      std::vector<float> rm = rm0, rv = rv0;
      int64_t nbt = 41;
      cpu::batchnorm_moments(want.data(), rm.data(), rv.data(), tracked ? &nbt : nullptr,
                             training ? sums.data() : nullptr, training ? count : 0.0, C, 1e-5f, 0.1f);
      DeviceBuffer<double> dsums(sums), mi(2 * c);
      DeviceBuffer<float> drm(rm0), drv(rv0);
      DeviceBuffer<int64_t> dnbt(std::vector<int64_t>{41});
      gpu::batchnorm_moments(mi.get(), drm.get(), drv.get(), tracked ? dnbt.get() : nullptr,
                             training ? dsums.get() : nullptr, training ? count : 0.0, C, 1e-5f, 0.1f, stream_);
      EXPECT_TRUE(bitwise_equal_d(mi.download(), want));
      EXPECT_TRUE(bitwise_equal(drm.download(), rm));
      EXPECT_TRUE(bitwise_equal(drv.download(), rv));
      EXPECT_EQ(dnbt.download()[0], tracked ? nbt : 41);
      if (training) {
        EXPECT_FALSE(bitwise_equal(rm, rm0)) << "training moves the running mean";
      } else {
        EXPECT_TRUE(bitwise_equal(drm.download(), rm0)) << "eval leaves the running statistics alone";
      }
    }
  }
}

TEST_F(CudaNorm, BatchNormApplyAndBackwardApplyAreTheCpusBitForBit) {
  uint64_t seed = 100;
  for (const BnShape& s : kBnShapes) {
    const size_t n = static_cast<size_t>(s.N * s.C * s.L), c = static_cast<size_t>(s.C);
    const auto x = random_vector(n, seed++, -3.0f, 2.0f), dy = random_vector(n, seed++);
    const auto w = random_vector(c, seed++, 0.5f, 1.5f), b = random_vector(c, seed++);
    std::vector<double> mean_invstd(2 * c), local(2 * c), global(2 * c);
    for (size_t i = 0; i < c; ++i) {
      mean_invstd[i] = 0.25 * static_cast<double>(i) - 1.0 + 1e-3 * static_cast<double>(seed);
      mean_invstd[c + i] = 0.5 + 0.1 * static_cast<double>(i) + 1.0 / 3.0;
      local[i] = 0.3 * static_cast<double>(i) - 2.0 / 7.0;
      local[c + i] = -0.2 * static_cast<double>(i) + 1.0 / 9.0;
      global[i] = 3.0 * local[i] + 1.0 / 11.0;
      global[c + i] = 3.0 * local[c + i] - 1.0 / 13.0;
    }
    const double count = static_cast<double>(3 * (s.N * s.L + 2));
    DeviceBuffer<float> dx(x), ddy(dy), dw(w), db(b), out(n), dinp(n);
    DeviceBuffer<double> dmi(mean_invstd), dlocal(local), dglobal(global);
    for (bool affine : {true, false}) {
      SCOPED_TRACE(bn_trace(s) << " affine " << affine);
      std::vector<float> want(n);
      cpu::batchnorm_apply(want.data(), x.data(), mean_invstd.data(), affine ? w.data() : nullptr,
                           affine ? b.data() : nullptr, s.N, s.C, s.L);
      gpu::batchnorm_apply(out.get(), dx.get(), dmi.get(), affine ? dw.get() : nullptr, affine ? db.get() : nullptr,
                           s.N, s.C, s.L, false, stream_);
      EXPECT_TRUE(bitwise_equal(out.download(), want));
      for (bool training : {true, false}) {
        for (bool accumulate : {false, true}) {
          SCOPED_TRACE(::testing::Message() << "training " << training << " accumulate " << accumulate);
          const auto g0 = random_vector(c, seed++), h0 = random_vector(c, seed++);
          std::vector<float> want_dinp(n), want_dw = g0, want_db = h0;
          cpu::batchnorm_backward_apply(want_dinp.data(), affine ? want_dw.data() : nullptr,
                                        affine ? want_db.data() : nullptr, local.data(),
                                        training ? global.data() : nullptr, count, dy.data(), x.data(),
                                        mean_invstd.data(), affine ? w.data() : nullptr, s.N, s.C, s.L, accumulate);
          DeviceBuffer<float> gw(g0), gb(h0);
          gpu::batchnorm_backward_apply(dinp.get(), affine ? gw.get() : nullptr, affine ? gb.get() : nullptr,
                                        dlocal.get(), training ? dglobal.get() : nullptr, count, ddy.get(), dx.get(),
                                        dmi.get(), affine ? dw.get() : nullptr, s.N, s.C, s.L, accumulate, stream_);
          EXPECT_TRUE(bitwise_equal(dinp.download(), want_dinp));
          EXPECT_TRUE(bitwise_equal(gw.download(), affine ? want_dw : g0));
          EXPECT_TRUE(bitwise_equal(gb.download(), affine ? want_db : h0));
          // No input gradient asked for: the parameters' alone.
          if (affine) {
            DeviceBuffer<float> gw2(g0), gb2(h0);
            gpu::batchnorm_backward_apply(nullptr, gw2.get(), gb2.get(), dlocal.get(),
                                          training ? dglobal.get() : nullptr, count, ddy.get(), dx.get(), dmi.get(),
                                          dw.get(), s.N, s.C, s.L, accumulate, stream_);
            EXPECT_TRUE(bitwise_equal(gw2.download(), want_dw));
            EXPECT_TRUE(bitwise_equal(gb2.download(), want_db));
          }
        }
      }
    }
  }
}

// A whole training step of BatchNorm on each side (statistics, moments, apply, backward): the GPU's sums differ
// from the CPU's by double rounding, so every float is within two ulps of the tensor's scale.
TEST_F(CudaNorm, BatchNormTrainingStepMatchesCpu) {
  const BnShape shapes[] = {{16, 6, 1}, {4, 3, 81}, {65, 10, 7}};
  uint64_t seed = 200;
  for (const BnShape& s : shapes) {
    SCOPED_TRACE(bn_trace(s));
    const size_t n = static_cast<size_t>(s.N * s.C * s.L), c = static_cast<size_t>(s.C);
    const auto x = random_vector(n, seed++, -1.0f, 4.0f), dy = random_vector(n, seed++);
    const auto w = random_vector(c, seed++, 0.5f, 1.5f), b = random_vector(c, seed++);
    const double count = static_cast<double>(s.N * s.L);
    std::vector<double> sums(2 * c), mi(2 * c), local(2 * c);
    std::vector<float> rm(c, 0.0f), rv(c, 1.0f), out(n), dinp(n), dw(c), db(c);
    cpu::batchnorm_stats(sums.data(), x.data(), s.N, s.C, s.L);
    cpu::batchnorm_moments(mi.data(), rm.data(), rv.data(), nullptr, sums.data(), count, s.C, 1e-5f, 0.1f);
    cpu::batchnorm_apply(out.data(), x.data(), mi.data(), w.data(), b.data(), s.N, s.C, s.L);
    cpu::batchnorm_backward_reduce(local.data(), dy.data(), x.data(), mi.data(), s.N, s.C, s.L);
    cpu::batchnorm_backward_apply(dinp.data(), dw.data(), db.data(), local.data(), local.data(), count, dy.data(),
                                  x.data(), mi.data(), w.data(), s.N, s.C, s.L, false);

    DeviceBuffer<float> gx(x), gdy(dy), gw(w), gb(b), grm(std::vector<float>(c, 0.0f)),
        grv(std::vector<float>(c, 1.0f)), gout(n), gdinp(n), gdw(c), gdb(c);
    DeviceBuffer<double> gsums(2 * c), gmi(2 * c), glocal(2 * c);
    gpu::batchnorm_stats(gsums.get(), gx.get(), s.N, s.C, s.L, stream_);
    gpu::batchnorm_moments(gmi.get(), grm.get(), grv.get(), nullptr, gsums.get(), count, s.C, 1e-5f, 0.1f, stream_);
    gpu::batchnorm_apply(gout.get(), gx.get(), gmi.get(), gw.get(), gb.get(), s.N, s.C, s.L, false, stream_);
    gpu::batchnorm_backward_reduce(glocal.get(), gdy.get(), gx.get(), gmi.get(), s.N, s.C, s.L, stream_);
    gpu::batchnorm_backward_apply(gdinp.get(), gdw.get(), gdb.get(), glocal.get(), glocal.get(), count, gdy.get(),
                                  gx.get(), gmi.get(), gw.get(), s.N, s.C, s.L, false, stream_);
    EXPECT_LE(normalised_error(gout.download(), out), kTwoUlps);
    EXPECT_LE(normalised_error(grm.download(), rm), kTwoUlps);
    EXPECT_LE(normalised_error(grv.download(), rv), kTwoUlps);
    EXPECT_LE(normalised_error(gdinp.download(), dinp), kTwoUlps);
    EXPECT_LE(normalised_error(gdw.download(), dw), kTwoUlps);
    EXPECT_LE(normalised_error(gdb.download(), db), kTwoUlps);
  }
}

struct LnShape {
  int64_t N, D;
};
// D small, below, at and above the row block (256), large (4096) and not a power of two; no rows.
const LnShape kLnShapes[] = {{1, 1}, {3, 7}, {64, 33}, {5, 256}, {4, 257}, {3, 4096}, {2, 5000}, {300, 12}, {0, 8}};

TEST_F(CudaNorm, LayerNormForwardMatchesCpu) {
  uint64_t seed = 300;
  for (const LnShape& s : kLnShapes) {
    const size_t n = static_cast<size_t>(s.N * s.D), d = static_cast<size_t>(s.D), rows = static_cast<size_t>(s.N);
    const auto x = random_vector(n, seed++, -2.0f, 6.0f);
    const auto w = random_vector(d, seed++, 0.5f, 1.5f), b = random_vector(d, seed++);
    DeviceBuffer<float> dx(x), dw(w), db(b), out(n), out2(n);
    DeviceBuffer<double> mr(2 * rows), mr2(2 * rows);
    for (bool affine : {true, false}) {
      SCOPED_TRACE(::testing::Message() << "N " << s.N << " D " << s.D << " affine " << affine);
      std::vector<float> want(n);
      std::vector<double> want_mr(2 * rows);
      cpu::layernorm_forward(want.data(), want_mr.data(), x.data(), affine ? w.data() : nullptr,
                             affine ? b.data() : nullptr, s.N, s.D, 1e-5f);
      gpu::layernorm_forward(out.get(), mr.get(), dx.get(), affine ? dw.get() : nullptr, affine ? db.get() : nullptr,
                             s.N, s.D, 1e-5f, stream_);
      const auto got = out.download();
      const auto got_mr = mr.download();
      EXPECT_LE(normalised_error(got, want), kTwoUlps);
      // The mean's terms are |x| <= 6; rstd is about 1/(the spread), near 0.4 here: relative 1e-12 of either.
      std::vector<double> mag(2 * rows);
      for (size_t r = 0; r < rows; ++r) {
        mag[r] = 6.0;
        mag[rows + r] = std::fabs(want_mr[rows + r]);
      }
      EXPECT_TRUE(sums_close(got_mr, want_mr, mag));
      gpu::layernorm_forward(out2.get(), mr2.get(), dx.get(), affine ? dw.get() : nullptr,
                             affine ? db.get() : nullptr, s.N, s.D, 1e-5f, stream_);
      EXPECT_TRUE(bitwise_equal(out2.download(), got)) << "the same bits call after call";
      EXPECT_TRUE(bitwise_equal_d(mr2.download(), got_mr));
    }
  }
}

TEST_F(CudaNorm, LayerNormBackwardMatchesCpu) {
  uint64_t seed = 400;
  for (const LnShape& s : kLnShapes) {
    const size_t n = static_cast<size_t>(s.N * s.D), d = static_cast<size_t>(s.D), rows = static_cast<size_t>(s.N);
    const auto x = random_vector(n, seed++, -2.0f, 6.0f), dy = random_vector(n, seed++);
    const auto w = random_vector(d, seed++, 0.5f, 1.5f), b = random_vector(d, seed++);
    std::vector<float> y(n);
    std::vector<double> mr(2 * rows);
    cpu::layernorm_forward(y.data(), mr.data(), x.data(), w.data(), b.data(), s.N, s.D, 1e-5f);
    DeviceBuffer<float> dx(x), ddy(dy), dw(w), dinp(n), dinp2(n);
    DeviceBuffer<double> dmr(mr);  // the CPU's mean_rstd for both: what differs is the backward's own work
    for (bool affine : {true, false}) {
      for (bool accumulate : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "N " << s.N << " D " << s.D << " affine " << affine << " accumulate "
                                          << accumulate);
        const auto g0 = random_vector(d, seed++), h0 = random_vector(d, seed++);
        std::vector<float> want(n), want_dw = g0, want_db = h0;
        cpu::layernorm_backward(want.data(), affine ? want_dw.data() : nullptr, affine ? want_db.data() : nullptr,
                                dy.data(), x.data(), mr.data(), affine ? w.data() : nullptr, s.N, s.D, accumulate);
        DeviceBuffer<float> gw(g0), gb(h0);
        gpu::layernorm_backward(dinp.get(), affine ? gw.get() : nullptr, affine ? gb.get() : nullptr, ddy.get(),
                                dx.get(), dmr.get(), affine ? dw.get() : nullptr, s.N, s.D, accumulate, stream_);
        const auto got = dinp.download();
        EXPECT_LE(normalised_error(got, want), kTwoUlps);
        // The parameter gradients are added row after row in float, as the CPU adds them: its bits.
        EXPECT_TRUE(bitwise_equal(gw.download(), affine ? want_dw : g0));
        EXPECT_TRUE(bitwise_equal(gb.download(), affine ? want_db : h0));
        gpu::layernorm_backward(dinp2.get(), nullptr, nullptr, ddy.get(), dx.get(), dmr.get(),
                                affine ? dw.get() : nullptr, s.N, s.D, accumulate, stream_);
        EXPECT_TRUE(bitwise_equal(dinp2.download(), got)) << "the same bits call after call, without dweight";
      }
    }
  }
}

struct EmbShape {
  int64_t N, V, E;
  int64_t padding_idx;
};
// Many repeats (V small), fewer than and more than the 64 buckets, E below, at and above a block (256) and odd,
// padding, and no indices.
const EmbShape kEmbShapes[] = {{1, 1, 1, -1},   {1000, 5, 3, -1}, {1000, 5, 3, 2},   {257, 70, 300, 0},
                               {64, 1000, 256, 999}, {3000, 129, 17, -1}, {50, 3, 513, 1}, {0, 4, 6, -1}};

std::vector<int32_t> random_indices(size_t n, int64_t V, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> v(n);
  for (auto& i : v) i = static_cast<int32_t>(rng.below(static_cast<uint64_t>(V)));
  return v;
}

TEST_F(CudaNorm, EmbeddingIsTheCpusBitForBit) {
  uint64_t seed = 500;
  for (const EmbShape& s : kEmbShapes) {
    const size_t n = static_cast<size_t>(s.N), ve = static_cast<size_t>(s.V * s.E), ne = static_cast<size_t>(s.N * s.E);
    const auto idx = random_indices(n, s.V, seed++);
    const auto w = random_vector(ve, seed++), dy = random_vector(ne, seed++);
    DeviceBuffer<int32_t> didx(idx);
    DeviceBuffer<float> dw(w), ddy(dy), out(ne);
    SCOPED_TRACE(::testing::Message() << "N " << s.N << " V " << s.V << " E " << s.E << " padding " << s.padding_idx);
    std::vector<float> want(ne);
    cpu::embedding_forward(want.data(), idx.data(), w.data(), s.N, s.V, s.E);
    gpu::embedding_forward(out.get(), didx.get(), dw.get(), s.N, s.V, s.E, stream_);
    EXPECT_TRUE(bitwise_equal(out.download(), want));
    for (bool accumulate : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "accumulate " << accumulate);
      const auto g0 = random_vector(ve, seed++);
      std::vector<float> want_dw = g0;
      cpu::embedding_backward(want_dw.data(), dy.data(), idx.data(), s.N, s.V, s.E, s.padding_idx, accumulate);
      DeviceBuffer<float> gw(g0), gw2(g0);
      gpu::embedding_backward(gw.get(), ddy.get(), didx.get(), s.N, s.V, s.E, s.padding_idx, accumulate, stream_);
      // A repeated index's rows are added in index order, in float, as the CPU adds them: its bits.
      const auto got = gw.download();
      EXPECT_TRUE(bitwise_equal(got, want_dw));
      gpu::embedding_backward(gw2.get(), ddy.get(), didx.get(), s.N, s.V, s.E, s.padding_idx, accumulate, stream_);
      EXPECT_TRUE(bitwise_equal(gw2.download(), got)) << "the same bits call after call";
      if (s.padding_idx >= 0 && !accumulate) {
        for (int64_t e = 0; e < s.E; ++e) EXPECT_EQ(got[static_cast<size_t>(s.padding_idx * s.E + e)], 0.0f);
      }
    }
  }
}

// The engine refuses an index outside [0, V) on the host; one that reaches a kernel anyway is never read through:
// forward writes zeros for it and backward skips it (the CPU twin throws, so the reference is the CPU's on the
// in-range positions alone).
TEST_F(CudaNorm, EmbeddingKernelsStayInBoundsForBadIndices) {
  const int64_t V = 6, E = 5;
  const std::vector<int32_t> idx = {2, -1, 5, 6, 2, 1 << 30, -(1 << 30), 0};
  const int64_t N = static_cast<int64_t>(idx.size());
  const auto w = random_vector(static_cast<size_t>(V * E), 7), dy = random_vector(static_cast<size_t>(N * E), 8);
  std::vector<int32_t> good_idx;
  std::vector<float> want_out(static_cast<size_t>(N * E), 0.0f), good_dy;
  for (int64_t n = 0; n < N; ++n) {
    const int32_t i = idx[static_cast<size_t>(n)];
    if (i < 0 || i >= V) continue;
    good_idx.push_back(i);
    for (int64_t e = 0; e < E; ++e) {
      want_out[static_cast<size_t>(n * E + e)] = w[static_cast<size_t>(i * E + e)];
      good_dy.push_back(dy[static_cast<size_t>(n * E + e)]);
    }
  }
  std::vector<float> want_dw(static_cast<size_t>(V * E));
  cpu::embedding_backward(want_dw.data(), good_dy.data(), good_idx.data(), static_cast<int64_t>(good_idx.size()), V,
                          E, -1, false);
  DeviceBuffer<int32_t> didx(idx);
  DeviceBuffer<float> dw(w), ddy(dy), out(static_cast<size_t>(N * E)), gw(static_cast<size_t>(V * E));
  gpu::embedding_forward(out.get(), didx.get(), dw.get(), N, V, E, stream_);
  gpu::embedding_backward(gw.get(), ddy.get(), didx.get(), N, V, E, -1, false, stream_);
  EXPECT_TRUE(bitwise_equal(out.download(), want_out));
  EXPECT_TRUE(bitwise_equal(gw.download(), want_dw));
  DPAR_CUDA_CHECK(cudaDeviceSynchronize(), "the kernels ran without a fault");
}

// Through the CUDA backend's Stream (as the layers call them), against the CPU backend's: the wiring of every one.
TEST(CudaNormStream, EveryKernelRunsThroughTheCudaStream) {
  DPAR_REQUIRE_GPU();
  const Device g{DeviceKind::kCuda, 0};
  Backend& be = cuda_backend();
  std::unique_ptr<Stream> gs = be.open_stream(g);
  std::unique_ptr<Stream> cs = cpu_backend().open_stream(Device{});
  std::vector<void*> owned;
  auto up = [&](const auto& host) {
    using T = typename std::decay_t<decltype(host)>::value_type;
    void* p = be.allocate(g, std::max<size_t>(host.size(), 1) * sizeof(T));
    owned.push_back(p);
    gs->copy_from_host(p, host.data(), host.size() * sizeof(T));
    return static_cast<T*>(p);
  };
  auto down = [&](const auto* p, size_t n) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(p)>>;
    std::vector<T> host(n);
    gs->copy_to_host(host.data(), p, n * sizeof(T));
    return host;
  };

  // BatchNorm (N,C,L) = (6,4,3): a training step, then eval.
  const int64_t N = 6, C = 4, L = 3;
  const size_t n = N * C * L, c = C;
  const auto x = random_vector(n, 1, -1.0f, 2.0f), dy = random_vector(n, 2), w = random_vector(c, 3),
             b = random_vector(c, 4);
  std::vector<double> sums(2 * c + 1), mi(2 * c), local(2 * c);
  std::vector<float> rm(c, 0.0f), rv(c, 1.0f), out(n), dinp(n), dw(c), db(c);
  std::vector<int64_t> nbt = {0};
  const double count = N * L;
  test::batchnorm_stats(*cs, sums.data(), x.data(), N, C, L);
  test::batchnorm_moments(*cs, mi.data(), rm.data(), rv.data(), nbt.data(), sums.data(), count, C, 1e-5f, 0.1f);
  test::batchnorm_apply(*cs, out.data(), x.data(), mi.data(), w.data(), b.data(), N, C, L);
  test::batchnorm_backward_reduce(*cs, local.data(), dy.data(), x.data(), mi.data(), N, C, L);
  test::batchnorm_backward_apply(*cs, dinp.data(), dw.data(), db.data(), local.data(), local.data(), count, dy.data(),
                               x.data(), mi.data(), w.data(), N, C, L, false);
  float *gx = up(x), *gdy = up(dy), *gw = up(w), *gb = up(b), *grm = up(std::vector<float>(c, 0.0f)),
        *grv = up(std::vector<float>(c, 1.0f)), *gout = up(std::vector<float>(n)), *gdinp = up(std::vector<float>(n)),
        *gdw = up(std::vector<float>(c)), *gdb = up(std::vector<float>(c));
  double *gsums = up(std::vector<double>(2 * c + 1)), *gmi = up(std::vector<double>(2 * c)),
         *glocal = up(std::vector<double>(2 * c));
  int64_t* gnbt = up(std::vector<int64_t>{0});
  test::batchnorm_stats(*gs, gsums, gx, N, C, L);
  test::batchnorm_moments(*gs, gmi, grm, grv, gnbt, gsums, count, C, 1e-5f, 0.1f);
  test::batchnorm_apply(*gs, gout, gx, gmi, gw, gb, N, C, L);
  test::batchnorm_backward_reduce(*gs, glocal, gdy, gx, gmi, N, C, L);
  test::batchnorm_backward_apply(*gs, gdinp, gdw, gdb, glocal, glocal, count, gdy, gx, gmi, gw, N, C, L, false);
  EXPECT_LE(normalised_error(down(gout, n), out), kTwoUlps);
  EXPECT_LE(normalised_error(down(grm, c), rm), kTwoUlps);
  EXPECT_LE(normalised_error(down(grv, c), rv), kTwoUlps);
  EXPECT_LE(normalised_error(down(gdinp, n), dinp), kTwoUlps);
  EXPECT_LE(normalised_error(down(gdw, c), dw), kTwoUlps);
  EXPECT_LE(normalised_error(down(gdb, c), db), kTwoUlps);
  EXPECT_EQ(down(gnbt, 1)[0], 1);
  // Eval: the running statistics as constants.
  test::batchnorm_moments(*cs, mi.data(), rm.data(), rv.data(), nullptr, nullptr, 0.0, C, 1e-5f, 0.0f);
  test::batchnorm_apply(*cs, out.data(), x.data(), mi.data(), w.data(), b.data(), N, C, L);
  test::batchnorm_moments(*gs, gmi, grm, grv, nullptr, nullptr, 0.0, C, 1e-5f, 0.0f);
  test::batchnorm_apply(*gs, gout, gx, gmi, gw, gb, N, C, L);
  EXPECT_LE(normalised_error(down(gout, n), out), kTwoUlps);

  // LayerNorm (N,D) = (5,40).
  const int64_t D = 40;
  const size_t nd = 5 * D;
  const auto lx = random_vector(nd, 5, -1.0f, 3.0f), ldy = random_vector(nd, 6), lw = random_vector(D, 7),
             lb = random_vector(D, 8);
  std::vector<float> ly(nd), ldinp(nd), ldw(D), ldb(D);
  std::vector<double> lmr(10);
  test::layernorm_forward(*cs, ly.data(), lmr.data(), lx.data(), lw.data(), lb.data(), 5, D, 1e-5f);
  test::layernorm_backward(*cs, ldinp.data(), ldw.data(), ldb.data(), ldy.data(), lx.data(), lmr.data(), lw.data(), 5,
                           D, false);
  float *glx = up(lx), *gldy = up(ldy), *glw = up(lw), *glb = up(lb), *gly = up(std::vector<float>(nd)),
        *gldinp = up(std::vector<float>(nd)), *gldw = up(std::vector<float>(D)), *gldb = up(std::vector<float>(D));
  double* glmr = up(std::vector<double>(10));
  test::layernorm_forward(*gs, gly, glmr, glx, glw, glb, 5, D, 1e-5f);
  test::layernorm_backward(*gs, gldinp, gldw, gldb, gldy, glx, glmr, glw, 5, D, false);
  EXPECT_LE(normalised_error(down(gly, nd), ly), kTwoUlps);
  EXPECT_LE(normalised_error(down(gldinp, nd), ldinp), kTwoUlps);
  EXPECT_LE(normalised_error(down(gldw, D), ldw), kTwoUlps);
  EXPECT_TRUE(bitwise_equal(down(gldb, D), ldb)) << "Σ dout in float, in row order, on both";

  // Embedding (V,E) = (9,6), 20 indices with repeats, padding row 3.
  const int64_t V = 9, E = 6, NI = 20;
  const auto idx = random_indices(NI, V, 9);
  const auto ew = random_vector(V * E, 10), edy = random_vector(NI * E, 11);
  std::vector<float> eo(NI * E), edw(V * E);
  test::embedding_forward(*cs, eo.data(), idx.data(), ew.data(), NI, V, E);
  test::embedding_backward(*cs, edw.data(), edy.data(), idx.data(), NI, V, E, 3, false);
  int32_t* gidx = up(idx);
  float *gew = up(ew), *gedy = up(edy), *geo = up(std::vector<float>(NI * E)), *gedw = up(std::vector<float>(V * E));
  test::embedding_forward(*gs, geo, gidx, gew, NI, V, E);
  test::embedding_backward(*gs, gedw, gedy, gidx, NI, V, E, 3, false);
  EXPECT_TRUE(bitwise_equal(down(geo, NI * E), eo));
  EXPECT_TRUE(bitwise_equal(down(gedw, V * E), edw));

  gs->synchronize();
  for (void* p : owned) be.deallocate(g, p);
}

}  // namespace
}  // namespace dpar
