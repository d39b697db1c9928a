// The CPU attention op in bf16 (AttentionSpec::dtype, kernels/cpu/attention.cpp's bf16 routines) against a double
// reference that applies the roundings op_specs.h defines: w = bf16(p f) before w v, g = bf16(dout), ds = bf16(...)
// before ds k and ds^T q, everything else exact. The op's f32 sums differ from it by f32 accumulation (about 1e-5 of
// the sum of the terms' magnitudes), and a rounded value whose f32 computation lands within its own error of a
// rounding boundary may round either way: each such term adds one bf16 unit of its magnitude to the bound.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/stream.h"
#include "common/bf16.h"
#include "common/error.h"
#include "common/random.h"
#include "kernels/cpu/gemm.h"
#include "kernels/dropout_rng.h"

namespace dpar {
namespace {

constexpr uint64_t kSeed = 99, kOffset = 4242;

struct Case {
  int64_t B, L, S, heads, D;
  bool causal;
  float p = 0.0f;
  bool packed = false;
  int64_t C() const { return heads * D; }
  std::string str() const {
    return "B=" + std::to_string(B) + " L=" + std::to_string(L) + " S=" + std::to_string(S) + " heads=" +
           std::to_string(heads) + " D=" + std::to_string(D) + (causal ? " causal" : "") + " p=" + std::to_string(p) +
           (packed ? " packed" : "");
  }
};

double bf(double x) { return from_bf16(to_bf16(static_cast<float>(x))); }

// The bf16 unit of x where x (computed in f32 with absolute error up to `err`) may round either way, else 0.
double ambiguous_unit(double x, double err) {
  if (x == 0.0) return 0.0;
  int e = 0;
  std::frexp(x, &e);
  const double unit = std::ldexp(1.0, e - 8);
  const double r = bf(x);
  const double to_mid = unit / 2 - std::abs(x - r);
  return to_mid <= err + 1e-7 * std::abs(x) ? unit : 0.0;
}

struct Run {
  Case c;
  std::vector<uint16_t> q, k, v, qkv;  // bf16 operands (qkv packed)
  std::vector<float> dout, out, lse, dq, dk, dv, dqkv;
  int64_t ldq() const { return c.packed ? 3 * c.C() : c.C(); }
  // Operand (role 0 q, 1 k, 2 v) element as a double.
  double x(int role, int64_t b, int64_t t, int64_t ch) const {
    const int64_t C = c.C();
    if (c.packed) return from_bf16(qkv[static_cast<size_t>((b * c.L + t) * 3 * C + role * C + ch)]);
    const int64_t n = role == 0 ? c.L : c.S;
    const auto& buf = role == 0 ? q : role == 1 ? k : v;
    return from_bf16(buf[static_cast<size_t>((b * n + t) * C + ch)]);
  }
  double grad(int role, int64_t b, int64_t t, int64_t ch) const {
    const int64_t C = c.C();
    if (c.packed) return dqkv[static_cast<size_t>((b * c.L + t) * 3 * C + role * C + ch)];
    const int64_t n = role == 0 ? c.L : c.S;
    const auto& buf = role == 0 ? dq : role == 1 ? dk : dv;
    return buf[static_cast<size_t>((b * n + t) * C + ch)];
  }
};

std::vector<uint16_t> random_bf16(size_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = to_bf16(rng.uniform(-2.0f, 2.0f));
  return v;
}

TensorRef bf16_ref(std::vector<uint16_t>& buf, std::initializer_list<int64_t> dims) {
  return TensorRef::contiguous(buf.data(), DType::kBF16, dims);
}

void run_op(Run& r) {
  static std::unique_ptr<Stream> stream = cpu_backend().open_stream(Device{});
  const Case& c = r.c;
  const int64_t C = c.C();
  AttentionSpec spec;
  spec.heads = c.heads;
  spec.causal = c.causal;
  spec.dtype = DType::kBF16;
  auto op = stream->make_attention(spec);
  TensorRef q, k, v, dq, dk, dv;
  r.out.assign(static_cast<size_t>(c.B * c.L * C), 0.0f);
  r.lse.assign(static_cast<size_t>(c.B * c.heads * c.L), 0.0f);
  if (c.packed) {
    r.qkv = random_bf16(static_cast<size_t>(c.B * c.L * 3 * C), 11);
    r.dqkv.assign(r.qkv.size(), NAN);
    const TensorRef all = bf16_ref(r.qkv, {c.B, c.L, 3 * C});
    const TensorRef dall = TensorRef::of(r.dqkv.data(), {c.B, c.L, 3 * C});
    q = all.narrow_last(0, C), k = all.narrow_last(C, C), v = all.narrow_last(2 * C, C);
    dq = dall.narrow_last(0, C), dk = dall.narrow_last(C, C), dv = dall.narrow_last(2 * C, C);
  } else {
    r.q = random_bf16(static_cast<size_t>(c.B * c.L * C), 11);
    r.k = random_bf16(static_cast<size_t>(c.B * c.S * C), 12);
    r.v = random_bf16(static_cast<size_t>(c.B * c.S * C), 13);
    r.dq.assign(r.q.size(), NAN), r.dk.assign(r.k.size(), NAN), r.dv.assign(r.v.size(), NAN);
    q = bf16_ref(r.q, {c.B, c.L, C}), k = bf16_ref(r.k, {c.B, c.S, C}), v = bf16_ref(r.v, {c.B, c.S, C});
    dq = TensorRef::of(r.dq.data(), {c.B, c.L, C});
    dk = TensorRef::of(r.dk.data(), {c.B, c.S, C});
    dv = TensorRef::of(r.dv.data(), {c.B, c.S, C});
  }
  Rng rng(21);
  r.dout.resize(r.out.size());
  for (auto& g : r.dout) g = rng.uniform(-1.0f, 1.0f);
  const TensorRef out = TensorRef::of(r.out.data(), {c.B, c.L, C}), lse = TensorRef::of(r.lse.data(), {c.B, c.heads, c.L});
  op->forward(out, lse, q, k, v, c.p, kSeed, kOffset);
  op->backward(dq, dk, dv, TensorRef::of(r.dout.data(), {c.B, c.L, C}), q, k, v, out, lse, c.p, kSeed, kOffset);
}

// Checks |got - want| <= 1e-5 sum|terms| + ambiguity for every element; counts them.
struct Check {
  std::string what;
  int64_t bad = 0, n = 0;
  double worst = 0;
  void operator()(double got, double want, double terms, double amb) {
    ++n;
    const double err = std::abs(got - want), tol = 1e-5 * terms + amb + 1e-30;
    worst = std::max(worst, err / tol);
    if (!(err <= tol)) {
      if (bad < 5) ADD_FAILURE() << what << ": got " << got << ", want " << want << " (tolerance " << tol << ")";
      ++bad;
    }
  }
};

void check_case(const Case& c) {
  SCOPED_TRACE(c.str());
  Run r{c};
  run_op(r);
  const int64_t L = c.L, S = c.S, D = c.D, C = c.C();
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const uint64_t key = kernels::rng::stream_key(kSeed);
  Check out_ok{"out"}, lse_ok{"lse"}, dq_ok{"dq"}, dk_ok{"dk"}, dv_ok{"dv"};
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.heads; ++h) {
      auto X = [&](int role, int64_t t, int64_t d) { return r.x(role, b, t, h * D + d); };
      auto Gf = [&](int64_t i, int64_t d) { return static_cast<double>(r.dout[static_cast<size_t>((b * L + i) * C + h * D + d)]); };
      std::vector<double> P(static_cast<size_t>(L * S), 0), W(P.size(), 0), Wamb(P.size(), 0), F(P.size(), 0);
      std::vector<double> DS(P.size(), 0), DSamb(P.size(), 0), sabs(P.size(), 0);
      for (int64_t i = 0; i < L; ++i) {
        std::vector<double> s(static_cast<size_t>(S), -INFINITY);
        double m = -INFINITY;
        for (int64_t j = 0; j < S; ++j) {
          if (c.causal && j > i) continue;
          double dot = 0, mag = 0;
          for (int64_t d = 0; d < D; ++d) dot += X(0, i, d) * X(1, j, d), mag += std::abs(X(0, i, d) * X(1, j, d));
          s[static_cast<size_t>(j)] = dot * scale;
          sabs[static_cast<size_t>(i * S + j)] = mag * scale;
          m = std::max(m, dot * scale);
        }
        double sum = 0;
        for (int64_t j = 0; j < S; ++j) sum += std::exp(s[static_cast<size_t>(j)] - m);
        const double lse = m + std::log(sum);
        double smax = 0;
        for (int64_t j = 0; j < S; ++j) smax = std::max(smax, sabs[static_cast<size_t>(i * S + j)]);
        lse_ok(r.lse[static_cast<size_t>((b * c.heads + h) * L + i)], lse, 10 * (std::abs(lse) + smax), 0);
        for (int64_t j = 0; j < S; ++j) {
          const size_t ij = static_cast<size_t>(i * S + j);
          if (c.causal && j > i) continue;
          P[ij] = std::exp(s[static_cast<size_t>(j)] - lse);
          const uint64_t counter = kOffset + static_cast<uint64_t>(((b * c.heads + h) * L + i) * S + j);
          F[ij] = kernels::rng::uniform24(key, counter) >= c.p ? 1.0 / (1.0 - static_cast<double>(c.p)) : 0.0;
          W[ij] = bf(P[ij] * F[ij]);
          // p's f32 error: the score's (f32 sums, relative to their terms) through exp, and exp's own few ulps.
          const double perr = P[ij] * F[ij] * (2e-6 * (sabs[ij] + smax) + 1e-6);
          Wamb[ij] = ambiguous_unit(P[ij] * F[ij], perr);
        }
      }
      std::vector<double> O(static_cast<size_t>(L * D), 0);
      for (int64_t i = 0; i < L; ++i)
        for (int64_t d = 0; d < D; ++d) {
          double o = 0, mag = 0, amb = 0;
          for (int64_t j = 0; j < S; ++j) {
            const size_t ij = static_cast<size_t>(i * S + j);
            o += W[ij] * X(2, j, d), mag += std::abs(W[ij] * X(2, j, d)), amb += Wamb[ij] * std::abs(X(2, j, d));
          }
          O[static_cast<size_t>(i * D + d)] = o;
          out_ok(r.out[static_cast<size_t>((b * L + i) * C + h * D + d)], o, mag, amb);
        }
      // Backward.
      auto G = [&](int64_t i, int64_t d) { return bf(Gf(i, d)); };
      for (int64_t i = 0; i < L; ++i) {
        double Di = 0, Dmag = 0;
        // D_i from the out that backward reads (the op's), as the definition has it.
        for (int64_t d = 0; d < D; ++d) {
          const double o = r.out[static_cast<size_t>((b * L + i) * C + h * D + d)];
          Di += Gf(i, d) * o, Dmag += std::abs(Gf(i, d) * o);
        }
        for (int64_t j = 0; j < S; ++j) {
          const size_t ij = static_cast<size_t>(i * S + j);
          if (c.causal && j > i) continue;
          double dp = 0, dpmag = 0;
          for (int64_t d = 0; d < D; ++d) dp += G(i, d) * X(2, j, d), dpmag += std::abs(G(i, d) * X(2, j, d));
          const double x = P[ij] * (dp * F[ij] - Di);
          DS[ij] = bf(x);
          const double err = P[ij] * (2e-6 * (dpmag * F[ij] + Dmag) + 1e-5 * (std::abs(dp * F[ij]) + std::abs(Di))) +
                             2e-6 * std::abs(x);
          DSamb[ij] = ambiguous_unit(x, err);
        }
      }
      for (int64_t i = 0; i < L; ++i)
        for (int64_t d = 0; d < D; ++d) {
          double g = 0, mag = 0, amb = 0;
          for (int64_t j = 0; j < S; ++j) {
            const size_t ij = static_cast<size_t>(i * S + j);
            g += DS[ij] * X(1, j, d), mag += std::abs(DS[ij] * X(1, j, d)), amb += DSamb[ij] * std::abs(X(1, j, d));
          }
          dq_ok(r.grad(0, b, i, h * D + d), scale * g, scale * mag, scale * amb);
        }
      for (int64_t j = 0; j < S; ++j)
        for (int64_t d = 0; d < D; ++d) {
          double gk = 0, mk = 0, ak = 0, gv = 0, mv = 0, av = 0;
          for (int64_t i = 0; i < L; ++i) {
            const size_t ij = static_cast<size_t>(i * S + j);
            gk += DS[ij] * X(0, i, d), mk += std::abs(DS[ij] * X(0, i, d)), ak += DSamb[ij] * std::abs(X(0, i, d));
            gv += W[ij] * G(i, d), mv += std::abs(W[ij] * G(i, d)), av += Wamb[ij] * std::abs(G(i, d));
          }
          dk_ok(r.grad(1, b, j, h * D + d), scale * gk, scale * mk, scale * ak);
          dv_ok(r.grad(2, b, j, h * D + d), gv, mv, av);
        }
    }
  for (const Check* ch : {&out_ok, &lse_ok, &dq_ok, &dk_ok, &dv_ok}) {
    EXPECT_EQ(ch->bad, 0) << ch->what << ": " << ch->bad << " of " << ch->n << " outside the bound";
    std::printf("  %-24s %-4s worst error / bound %.3f\n", c.str().c_str(), ch->what.c_str(), ch->worst);
  }
}

bool skip_without_bf16() {
  const char* why = "";
  if (kernels::cpu::bf16_support(&why)) return false;
  std::printf("skipped: %s\n", why);
  return true;
}

TEST(Bf16Attention, MatchesRoundedReference) {
  if (skip_without_bf16()) GTEST_SKIP() << "no bf16 on this CPU";
  check_case({2, 37, 37, 2, 16, false});
  check_case({2, 70, 70, 2, 16, true});
  check_case({1, 150, 150, 2, 32, true});   // more than one query block, a key chunk's remainder
  check_case({2, 33, 600, 2, 8, false});    // L != S (cross-attention), more than one key chunk
  check_case({1, 530, 530, 1, 8, true});    // causal over more than one key chunk
  check_case({2, 40, 40, 3, 16, false, 0.2f});
  check_case({2, 70, 70, 2, 16, true, 0.3f});
  check_case({2, 45, 45, 2, 16, true, 0.0f, true});   // packed strided views
  check_case({1, 80, 80, 4, 8, false, 0.1f, true});
}

TEST(Bf16Attention, RefusesOtherDtypes) {
  std::unique_ptr<Stream> stream = cpu_backend().open_stream(Device{});
  AttentionSpec spec;
  spec.dtype = DType::kF64;
  try {
    stream->make_attention(spec);
    FAIL() << "an f64 attention op was made";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kNotSupported);
    EXPECT_NE(std::string(e.what()).find("f32 or bf16"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dpar
