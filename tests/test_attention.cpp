// The CPU attention op (kernels/cpu/attention.cpp through Stream::make_attention): against a naive double-precision
// reference written here (dropout drawn from the documented formula), against central finite differences, against
// PyTorch's F.scaled_dot_product_attention (tests/data/attention_reference.json, written by
// tests/reference/make_attention_reference.py), and its refusals of bad input.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/stream.h"
#include "common/error.h"
#include "common/random.h"
#include "kernels/cpu/attention.h"
#include "kernels/dropout_rng.h"

namespace dpar {
namespace {

using Vec = std::vector<float>;
using DVec = std::vector<double>;

Vec random_vec(size_t n, uint64_t seed, float scale = 1.0f) {
  Rng rng(seed);
  Vec v(n);
  for (auto& x : v) x = rng.uniform(-scale, scale);
  return v;
}

struct Case {
  int64_t B, L, S, heads, D;
  bool causal;
  float dropout_p = 0.0f;
  bool packed = false;  // q, k, v (and dq, dk, dv) views of one (B, T, 3C) buffer; needs L == S
  float scale = 0.0f;   // 0: 1/sqrt(D)
  int64_t C() const { return heads * D; }
  std::string str() const {
    return "B=" + std::to_string(B) + " L=" + std::to_string(L) + " S=" + std::to_string(S) +
           " heads=" + std::to_string(heads) + " D=" + std::to_string(D) + (causal ? " causal" : "") +
           " p=" + std::to_string(dropout_p) + (packed ? " packed" : "");
  }
};

constexpr uint64_t kSeed = 1234, kOffset = 777;

// Inputs of a case, as the op sees them: q, k, v (and the gradients' memory) either views of one packed buffer
// per role or separate contiguous buffers.
struct Inputs {
  Case c;
  Vec qkv, q, k, v;           // packed: qkv (B,T,3C); else q (B,L,C), k and v (B,S,C)
  Vec dqkv, dq, dk, dv;       // the gradients' memory, laid out as the inputs'
  Vec dout;                   // (B,L,C)
  Vec out, lse;               // (B,L,C), (B,heads,L)

  explicit Inputs(const Case& cs, uint64_t seed = 7) : c(cs) {
    const int64_t C = c.C();
    if (c.packed) {
      qkv = random_vec(static_cast<size_t>(c.B * c.L * 3 * C), seed, 2.0f);
      dqkv.assign(qkv.size(), std::numeric_limits<float>::quiet_NaN());  // overwritten, never read
    } else {
      q = random_vec(static_cast<size_t>(c.B * c.L * C), seed, 2.0f);
      k = random_vec(static_cast<size_t>(c.B * c.S * C), seed + 1, 2.0f);
      v = random_vec(static_cast<size_t>(c.B * c.S * C), seed + 2, 2.0f);
      dq.assign(q.size(), std::numeric_limits<float>::quiet_NaN());
      dk.assign(k.size(), std::numeric_limits<float>::quiet_NaN());
      dv.assign(v.size(), std::numeric_limits<float>::quiet_NaN());
    }
    dout = random_vec(static_cast<size_t>(c.B * c.L * C), seed + 3);
    out.assign(dout.size(), 0.0f);
    lse.assign(static_cast<size_t>(c.B * c.heads * c.L), 0.0f);
  }
  TensorRef ref(Vec& packed_buf, Vec& own, int role, int64_t positions) {
    const int64_t C = c.C();
    if (c.packed) return TensorRef::of(packed_buf.data(), {c.B, c.L, 3 * C}).narrow_last(role * C, C);
    return TensorRef::of(own.data(), {c.B, positions, C});
  }
  TensorRef q_ref() { return ref(qkv, q, 0, c.L); }
  TensorRef k_ref() { return ref(qkv, k, 1, c.S); }
  TensorRef v_ref() { return ref(qkv, v, 2, c.S); }
  TensorRef dq_ref() { return ref(dqkv, dq, 0, c.L); }
  TensorRef dk_ref() { return ref(dqkv, dk, 1, c.S); }
  TensorRef dv_ref() { return ref(dqkv, dv, 2, c.S); }
  TensorRef out_ref() { return TensorRef::of(out.data(), {c.B, c.L, c.C()}); }
  TensorRef dout_ref() { return TensorRef::of(dout.data(), {c.B, c.L, c.C()}); }
  TensorRef lse_ref() { return TensorRef::of(lse.data(), {c.B, c.heads, c.L}); }

  // Element (b, t, channel) of a role's tensor (0 q, 1 k, 2 v; or their gradients with grad).
  float& at(int role, int64_t b, int64_t t, int64_t ch, bool grad = false) {
    const int64_t C = c.C();
    if (c.packed) return (grad ? dqkv : qkv)[static_cast<size_t>((b * c.L + t) * 3 * C + role * C + ch)];
    const int64_t positions = role == 0 ? c.L : c.S;
    Vec& buf = grad ? (role == 0 ? dq : role == 1 ? dk : dv) : (role == 0 ? q : role == 1 ? k : v);
    return buf[static_cast<size_t>((b * positions + t) * C + ch)];
  }
};

void run_forward(AttentionOp& op, Inputs& in) {
  op.forward(in.out_ref(), in.lse_ref(), in.q_ref(), in.k_ref(), in.v_ref(), in.c.dropout_p, kSeed, kOffset);
}
void run_backward(AttentionOp& op, Inputs& in) {
  op.backward(in.dq_ref(), in.dk_ref(), in.dv_ref(), in.dout_ref(), in.q_ref(), in.k_ref(), in.v_ref(),
              in.out_ref(), in.lse_ref(), in.c.dropout_p, kSeed, kOffset);
}

std::unique_ptr<AttentionOp> make_op(const Case& c) {
  static std::unique_ptr<Stream> stream = cpu_backend().open_stream(Device{});
  AttentionSpec spec;
  spec.heads = c.heads;
  spec.causal = c.causal;
  spec.scale = c.scale;
  return stream->make_attention(spec);
}

// The naive reference in double: per head, the full L x S weights.
struct Reference {
  DVec out, lse, dq, dk, dv;  // out, dq (B,L,C); dk, dv (B,S,C); lse (B,heads,L)
};

Reference reference(Inputs& in) {
  const Case& c = in.c;
  const int64_t C = c.C(), L = c.L, S = c.S, D = c.D;
  const double scale = c.scale != 0.0f ? c.scale : 1.0 / std::sqrt(static_cast<double>(D));
  const double p = c.dropout_p;
  const uint64_t key = kernels::rng::stream_key(kSeed);
  Reference r;
  r.out.assign(static_cast<size_t>(c.B * L * C), 0.0);
  r.dq.assign(r.out.size(), 0.0);
  r.dk.assign(static_cast<size_t>(c.B * S * C), 0.0);
  r.dv.assign(r.dk.size(), 0.0);
  r.lse.assign(static_cast<size_t>(c.B * c.heads * L), 0.0);
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.heads; ++h) {
      DVec P(static_cast<size_t>(L * S), 0.0), F(P.size(), 0.0);  // weights; dropout factors
      auto X = [&](int role, int64_t t, int64_t d) { return static_cast<double>(in.at(role, b, t, h * D + d)); };
      for (int64_t i = 0; i < L; ++i) {
        double m = -INFINITY;
        DVec s(static_cast<size_t>(S), -INFINITY);
        for (int64_t j = 0; j < S; ++j) {
          if (c.causal && j > i) continue;
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += X(0, i, d) * X(1, j, d);
          s[static_cast<size_t>(j)] = dot * scale;
          m = std::max(m, s[static_cast<size_t>(j)]);
        }
        double sum = 0;
        for (int64_t j = 0; j < S; ++j) sum += std::exp(s[static_cast<size_t>(j)] - m);
        r.lse[static_cast<size_t>((b * c.heads + h) * L + i)] = m + std::log(sum);
        for (int64_t j = 0; j < S; ++j) {
          const size_t ij = static_cast<size_t>(i * S + j);
          P[ij] = std::exp(s[static_cast<size_t>(j)] - m) / sum;
          const uint64_t counter = kOffset + static_cast<uint64_t>(((b * c.heads + h) * L + i) * S + j);
          const bool kept = kernels::rng::uniform24(key, counter) >= static_cast<float>(p);
          F[ij] = kept ? 1.0 / (1.0 - p) : 0.0;
        }
      }
      auto G = [&](int64_t i, int64_t d) { return static_cast<double>(in.dout[static_cast<size_t>((b * L + i) * C + h * D + d)]); };
      for (int64_t i = 0; i < L; ++i) {
        DVec dP(static_cast<size_t>(S), 0.0);
        double Di = 0;
        for (int64_t j = 0; j < S; ++j) {
          const size_t ij = static_cast<size_t>(i * S + j);
          const double w = P[ij] * F[ij];
          double g = 0;
          for (int64_t d = 0; d < D; ++d) {
            r.out[static_cast<size_t>((b * L + i) * C + h * D + d)] += w * X(2, j, d);
            r.dv[static_cast<size_t>((b * S + j) * C + h * D + d)] += w * G(i, d);
            g += G(i, d) * X(2, j, d);
          }
          dP[static_cast<size_t>(j)] = g * F[ij];
          Di += P[ij] * dP[static_cast<size_t>(j)];
        }
        for (int64_t j = 0; j < S; ++j) {
          const double ds = P[static_cast<size_t>(i * S + j)] * (dP[static_cast<size_t>(j)] - Di) * scale;
          for (int64_t d = 0; d < D; ++d) {
            r.dq[static_cast<size_t>((b * L + i) * C + h * D + d)] += ds * X(1, j, d);
            r.dk[static_cast<size_t>((b * S + j) * C + h * D + d)] += ds * X(0, i, d);
          }
        }
      }
    }
  return r;
}

// Largest |a - b| over max(1, max |b|).
double error(const DVec& a, const DVec& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0, scale = 1;
  for (double x : b) scale = std::max(scale, std::abs(x));
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    worst = std::max(worst, std::abs(a[i] - b[i]));
  }
  return worst / scale;
}

// A role's tensor (or gradient) gathered to (B, positions, C) doubles.
DVec gather(Inputs& in, int role, bool grad) {
  const int64_t positions = role == 0 ? in.c.L : in.c.S, C = in.c.C();
  DVec r;
  for (int64_t b = 0; b < in.c.B; ++b)
    for (int64_t t = 0; t < positions; ++t)
      for (int64_t ch = 0; ch < C; ++ch) r.push_back(in.at(role, b, t, ch, grad));
  return r;
}
DVec as_double(const Vec& v) { return DVec(v.begin(), v.end()); }

void check_against_reference(const Case& c) {
  SCOPED_TRACE(c.str());
  Inputs in(c);
  auto op = make_op(c);
  run_forward(*op, in);
  run_backward(*op, in);
  const Reference r = reference(in);
  EXPECT_LT(error(as_double(in.out), r.out), 2e-6);
  EXPECT_LT(error(as_double(in.lse), r.lse), 2e-6);
  EXPECT_LT(error(gather(in, 0, true), r.dq), 1e-5);
  EXPECT_LT(error(gather(in, 1, true), r.dk), 1e-5);
  EXPECT_LT(error(gather(in, 2, true), r.dv), 1e-5);
  if (c.packed) {  // the op writes dq, dk, dv only: nothing else of the packed gradient buffer
    // (every element of the packed buffer belongs to one of them, so all must now be finite)
    for (float x : in.dqkv) ASSERT_TRUE(std::isfinite(x));
  }
}

TEST(Attention, MatchesTheNaiveReference) {
  const std::vector<Case> cases = {
      {1, 1, 1, 1, 8, true},        {2, 5, 5, 1, 8, false},      {2, 7, 7, 2, 16, true},
      {1, 64, 64, 4, 32, true},     {1, 65, 65, 2, 32, true},    {2, 130, 130, 4, 8, true},
      {1, 130, 130, 2, 64, false},  {2, 3, 70, 2, 16, false},    {1, 70, 3, 1, 24, false},
      {1, 33, 33, 4, 12, false, 0.0f, false, 0.7f},
  };
  for (const Case& c : cases) check_against_reference(c);
}

TEST(Attention, PackedStridedViewsOfOneProjection) {
  for (const Case& c : std::vector<Case>{{2, 9, 9, 2, 8, true, 0.0f, true},
                                         {2, 70, 70, 4, 16, true, 0.0f, true},
                                         {1, 66, 66, 1, 64, false, 0.0f, true}})
    check_against_reference(c);
}

TEST(Attention, DropoutDrawsTheDocumentedMask) {
  for (const Case& c : std::vector<Case>{{2, 9, 9, 2, 8, true, 0.3f, true},
                                         {1, 70, 70, 4, 16, false, 0.5f},
                                         {2, 130, 130, 2, 32, true, 0.1f, true}})
    check_against_reference(c);
}

TEST(Attention, DropoutDropsAboutPAndDependsOnSeedAndOffset) {
  // With v = 1 in every channel, out_i = sum_j P_ij F_ij: its mean over many queries is about 1.
  Case c{1, 256, 256, 1, 8, false, 0.25f};
  Inputs in(c);
  std::fill(in.v.begin(), in.v.end(), 1.0f);
  auto op = make_op(c);
  run_forward(*op, in);
  double mean = 0;
  for (float x : in.out) mean += x;
  mean /= static_cast<double>(in.out.size());
  EXPECT_NEAR(mean, 1.0, 0.02);
  const Vec first = in.out;
  op->forward(in.out_ref(), in.lse_ref(), in.q_ref(), in.k_ref(), in.v_ref(), c.dropout_p, kSeed, kOffset + 1);
  EXPECT_NE(first, in.out);
  op->forward(in.out_ref(), in.lse_ref(), in.q_ref(), in.k_ref(), in.v_ref(), c.dropout_p, kSeed + 1, kOffset);
  EXPECT_NE(first, in.out);
  run_forward(*op, in);
  EXPECT_EQ(first, in.out);
}

// The loss sum(out * dout) in double from the reference's forward, perturbing one input element.
double reference_loss(Inputs& in) {
  const Reference r = reference(in);
  double loss = 0;
  for (size_t i = 0; i < r.out.size(); ++i) loss += r.out[i] * in.dout[i];
  return loss;
}

// The reference's backward against central differences of its own forward (in double: tight), then the op's
// backward against central differences of the op's forward (in f32: loose), both with dropout's fixed mask.
TEST(Attention, BackwardMatchesFiniteDifferences) {
  for (const Case& c : std::vector<Case>{{1, 4, 4, 2, 3, true}, {2, 3, 5, 1, 4, false}, {1, 5, 5, 2, 2, true, 0.4f}}) {
    SCOPED_TRACE(c.str());
    Inputs in(c, 11);
    const Reference r = reference(in);
    auto op = make_op(c);
    run_forward(*op, in);
    run_backward(*op, in);
    auto op_loss = [&] {
      Vec out(in.out.size()), lse(in.lse.size());
      op->forward(TensorRef::of(out.data(), {c.B, c.L, c.C()}), TensorRef::of(lse.data(), {c.B, c.heads, c.L}),
                  in.q_ref(), in.k_ref(), in.v_ref(), c.dropout_p, kSeed, kOffset);
      double loss = 0;
      for (size_t i = 0; i < out.size(); ++i) loss += static_cast<double>(out[i]) * in.dout[i];
      return loss;
    };
    for (int role = 0; role < 3; ++role) {
      const DVec& analytic = role == 0 ? r.dq : role == 1 ? r.dk : r.dv;
      const DVec op_grad = gather(in, role, true);
      const int64_t positions = role == 0 ? c.L : c.S;
      size_t idx = 0;
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t t = 0; t < positions; ++t)
          for (int64_t ch = 0; ch < c.C(); ++ch, ++idx) {
            float& x = in.at(role, b, t, ch);
            const float x0 = x;
            // double reference: a small step (the input is read as float, so the step is a float too)
            const float h = 1e-3f;
            x = x0 + h;
            const double up = reference_loss(in);
            x = x0 - h;
            const double down = reference_loss(in);
            x = x0;
            const double step = static_cast<double>(x0 + h) - static_cast<double>(x0 - h);
            EXPECT_NEAR((up - down) / step, analytic[idx], 1e-5) << "role " << role << " element " << idx;
            // the op in f32: a larger step against rounding
            const float hf = 1e-2f;
            x = x0 + hf;
            const double up_f = op_loss();
            x = x0 - hf;
            const double down_f = op_loss();
            x = x0;
            const double step_f = static_cast<double>(x0 + hf) - static_cast<double>(x0 - hf);
            EXPECT_NEAR((up_f - down_f) / step_f, op_grad[idx], 2e-3) << "role " << role << " element " << idx;
          }
    }
  }
}

TEST(Attention, LoopsAndSgemmTilesAgree) {
  namespace kc = kernels::cpu;
  Case c{2, 100, 100, 2, 32, true, 0.2f};
  Inputs in(c);
  kc::AttentionShape sh{c.B, c.L, c.S, c.heads, c.D, 1.0f / std::sqrt(32.0f), true};
  kc::AttentionDropout drop{c.dropout_p, kSeed, kOffset};
  const int64_t C = c.C();
  auto t = [&](Vec& v, int64_t positions) { return kc::AttentionTensor{v.data(), positions * C, C}; };
  Vec out_loops(in.out.size()), out_gemm(in.out.size()), lse_loops(in.lse.size()), lse_gemm(in.lse.size());
  kc::attention_forward(t(out_loops, c.L), lse_loops.data(), t(in.q, c.L), t(in.k, c.S), t(in.v, c.S), sh, drop,
                        kc::AttentionTiles::kLoops);
  kc::attention_forward(t(out_gemm, c.L), lse_gemm.data(), t(in.q, c.L), t(in.k, c.S), t(in.v, c.S), sh, drop,
                        kc::AttentionTiles::kSgemm);
  EXPECT_LT(error(as_double(out_gemm), as_double(out_loops)), 1e-6);
  EXPECT_LT(error(as_double(lse_gemm), as_double(lse_loops)), 1e-6);
  Vec g[2][3];
  for (int tiles = 0; tiles < 2; ++tiles) {
    for (auto& x : g[tiles]) x.assign(in.q.size(), 0.0f);
    kc::attention_backward(t(g[tiles][0], c.L), t(g[tiles][1], c.S), t(g[tiles][2], c.S), t(in.dout, c.L),
                           t(in.q, c.L), t(in.k, c.S), t(in.v, c.S), t(out_loops, c.L), lse_loops.data(), sh, drop,
                           static_cast<kc::AttentionTiles>(tiles));
  }
  for (int i = 0; i < 3; ++i) EXPECT_LT(error(as_double(g[1][i]), as_double(g[0][i])), 1e-5) << i;
}

TEST(Attention, MatchesPyTorch) {
  std::ifstream f(std::string(DPAR_TEST_DATA_DIR) + "/attention_reference.json");
  ASSERT_TRUE(f.good()) << "tests/data/attention_reference.json is missing";
  const nlohmann::json ref = nlohmann::json::parse(f);
  ASSERT_FALSE(ref["cases"].empty());
  for (const auto& j : ref["cases"]) {
    SCOPED_TRACE(j["name"].get<std::string>());
    Case c{j["B"], j["L"], j["S"], j["heads"], j["D"], j["causal"], 0.0f, false, j["scale"].get<float>()};
    Inputs in(c);
    in.q = j["q"].get<Vec>(), in.k = j["k"].get<Vec>(), in.v = j["v"].get<Vec>(), in.dout = j["dout"].get<Vec>();
    auto op = make_op(c);
    run_forward(*op, in);
    run_backward(*op, in);
    EXPECT_LT(error(as_double(in.out), j["out"].get<DVec>()), 1e-5);
    EXPECT_LT(error(as_double(in.dq), j["dq"].get<DVec>()), 1e-5);
    EXPECT_LT(error(as_double(in.dk), j["dk"].get<DVec>()), 1e-5);
    EXPECT_LT(error(as_double(in.dv), j["dv"].get<DVec>()), 1e-5);
  }
}

void expect_invalid(const std::function<void()>& call, const std::string& needle) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one mentioning " << needle;
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(Attention, RefusesNonF32AndNonContiguousRows) {
  Case c{1, 4, 4, 2, 4, true};
  Inputs in(c);
  auto op = make_op(c);
  std::vector<double> q64(in.q.size());
  TensorRef q64_ref = TensorRef::of(q64.data(), {1, 4, 8});
  expect_invalid([&] { op->forward(in.out_ref(), in.lse_ref(), q64_ref, in.k_ref(), in.v_ref(), 0, 0, 0); }, "f64");
  // q read as (B, C, L) transposed: each position's channels strided
  TensorRef q_t = TensorRef::of(in.q.data(), {1, 8, 4}).transposed(1, 2);
  expect_invalid([&] { op->forward(in.out_ref(), in.lse_ref(), q_t, in.k_ref(), in.v_ref(), 0, 0, 0); },
                 "contiguous");
  // out must be contiguous: a view of a wider buffer is refused
  Vec wide(static_cast<size_t>(4 * 16));
  TensorRef out_view = TensorRef::of(wide.data(), {1, 4, 16}).narrow_last(0, 8);
  expect_invalid([&] { op->forward(out_view, in.lse_ref(), in.q_ref(), in.k_ref(), in.v_ref(), 0, 0, 0); },
                 "contiguous");
  expect_invalid([&] { op->forward(in.out_ref(), in.lse_ref(), in.q_ref(), in.k_ref(), in.v_ref(), 1.0f, 0, 0); },
                 "dropout_p");
  std::vector<double> dq64(in.q.size());
  expect_invalid(
      [&] {
        op->backward(TensorRef::of(dq64.data(), {1, 4, 8}), in.dk_ref(), in.dv_ref(), in.dout_ref(), in.q_ref(),
                     in.k_ref(), in.v_ref(), in.out_ref(), in.lse_ref(), 0, 0, 0);
      },
      "dq");
}

}  // namespace
}  // namespace dpar
