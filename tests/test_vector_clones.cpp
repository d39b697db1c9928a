// Every vector copy of the CPU kernels' loops (kernels/cpu/vector_isa.h: AVX-512, AVX2, baseline) gives the
// baseline copy's bits. The copies differ in vector width alone; a copy that computed differently (a contracted
// multiply-add, a reassociated sum) would change the trained parameters on some CPUs and not others. Each kernel
// below runs every loop that has copies, through every copy this CPU supports.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/optimizer_hyper.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/norm_embedding.h"
#include "kernels/cpu/vector_isa.h"

namespace {

namespace k = dpar::kernels::cpu;
using k::VectorIsa;
using Vec = std::vector<float>;
using Bytes = std::vector<unsigned char>;

// Values of every sign and a spread of magnitudes, with the specials the selects must pass through.
Vec values(size_t n, uint32_t seed, bool specials = false) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-20, 20);
  Vec v(n);
  for (float& x : v) x = std::ldexp(normal(gen), exponent(gen));
  if (specials && n >= 6) {
    v[1] = std::numeric_limits<float>::quiet_NaN();
    v[2] = -0.0f;
    v[3] = 0.0f;
    v[4] = std::numeric_limits<float>::infinity();
    v[n - 1] = -std::numeric_limits<float>::infinity();
  }
  return v;
}

template <class T>
void append(Bytes& out, const std::vector<T>& v) {
  const size_t at = out.size(), bytes = v.size() * sizeof(T);
  out.resize(at + bytes);
  if (bytes > 0) std::memcpy(out.data() + at, v.data(), bytes);
}

// Sizes with a vector body and a tail for every width (16 floats in a zmm), and blocks of the blocked loops (Adam's
// 512 elements, the bias sums' 256 columns) with a remainder.
constexpr int64_t kN = 1037;
constexpr int64_t kB = 9, kCin = 21, kCout = 300;

struct Case {
  const char* name;
  std::function<Bytes()> run;  // the kernel's outputs, as bytes
};

Bytes relu_forward() {
  const Vec inp = values(kN, 1, true);
  Vec out(kN);
  k::relu_forward(out.data(), inp.data(), kN);
  Bytes b;
  append(b, out);
  return b;
}

Bytes relu_backward() {
  const Vec out = values(kN, 2, true), dout = values(kN, 3, true);
  Vec dinp(kN);
  k::relu_backward(dinp.data(), dout.data(), out.data(), kN);
  Bytes b;
  append(b, dinp);
  return b;
}

// GELU through the vector math's erf and exp (kernels/cpu/vector_math.h), over values spread by 4 so that both of
// erf's pieces and the range where it rounds to 1 are crossed.
Bytes gelu() {
  Vec inp = values(kN, 11, true);
  for (float& x : inp) x *= 4.0f;
  const Vec dout = values(kN, 12, true);
  Vec out(kN), dinp(kN);
  k::gelu_forward(out.data(), inp.data(), kN);
  k::gelu_backward(dinp.data(), dout.data(), inp.data(), kN);
  Bytes b;
  append(b, out);
  append(b, dinp);
  return b;
}

// LayerNorm's per-element passes (the row sums stay in order): forward with and without the affine, f32 and
// rounded to bf16, and backward, overwriting and accumulating the affine's gradients, and without them.
Bytes layernorm() {
  constexpr int64_t kRows = 7, kD = 149;
  const Vec x = values(kRows * kD, 13), dout = values(kRows * kD, 14), w = values(kD, 15), bias = values(kD, 16);
  Vec out(kRows * kD), plain(kRows * kD), dx(kRows * kD), dx_plain(kRows * kD), dw(kD), db(kD);
  std::vector<uint16_t> rounded(kRows * kD);
  std::vector<double> stats(2 * kRows), stats_plain(2 * kRows);
  k::layernorm_forward(out.data(), stats.data(), x.data(), w.data(), bias.data(), kRows, kD, 1e-5f);
  k::layernorm_forward_rounded(rounded.data(), stats.data(), x.data(), w.data(), bias.data(), kRows, kD, 1e-5f);
  k::layernorm_forward(plain.data(), stats_plain.data(), x.data(), nullptr, nullptr, kRows, kD, 1e-5f);
  k::layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), stats.data(), w.data(), kRows, kD,
                        false);
  k::layernorm_backward(dx.data(), dw.data(), db.data(), dout.data(), x.data(), stats.data(), w.data(), kRows, kD,
                        true);
  k::layernorm_backward(dx_plain.data(), nullptr, nullptr, dout.data(), x.data(), stats_plain.data(), nullptr, kRows,
                        kD, false);
  Bytes b;
  for (const Vec* v : {&out, &plain, &dx, &dx_plain, &dw, &db}) append(b, *v);
  append(b, rounded);
  append(b, stats);
  return b;
}

// The forward GEMM's epilogue in its three forms: bias, bias and ReLU, ReLU alone.
Bytes linear_epilogues() {
  const Vec inp = values(kB * kCin, 4), weight = values(kCout * kCin, 5), bias = values(kCout, 6);
  Vec out(kB * kCout), relu_out(kB * kCout), relu_only(kB * kCout);
  k::linear_forward(out.data(), inp.data(), weight.data(), bias.data(), kB, kCin, kCout);
  k::linear_relu_forward(relu_out.data(), inp.data(), weight.data(), bias.data(), kB, kCin, kCout);
  k::linear_relu_forward(relu_only.data(), inp.data(), weight.data(), nullptr, kB, kCin, kCout);
  Bytes b;
  append(b, out);
  append(b, relu_out);
  append(b, relu_only);
  return b;
}

// The bias sums, overwritten and accumulated, with and without the ReLU's mask.
Bytes linear_bias_sums_and_masks() {
  const Vec inp = values(kB * kCin, 7), weight = values(kCout * kCin, 8), dout = values(kB * kCout, 9, true);
  Vec out = values(kB * kCout, 10, true);
  Vec dinp(kB * kCin), dweight(kCout * kCin), dbias(kCout), dpre(kB * kCout);
  Bytes b;
  for (bool accumulate : {false, true}) {
    k::linear_backward(dinp.data(), dweight.data(), dbias.data(), dout.data(), inp.data(), weight.data(), kB, kCin,
                       kCout, accumulate);
    append(b, dbias);
    k::linear_relu_backward(dinp.data(), dweight.data(), dbias.data(), dpre.data(), dout.data(), out.data(),
                            inp.data(), weight.data(), kB, kCin, kCout, accumulate);
    append(b, dbias);
    append(b, dpre);
  }
  k::linear_relu_backward(dinp.data(), dweight.data(), nullptr, dpre.data(), dout.data(), out.data(), inp.data(),
                          weight.data(), kB, kCin, kCout, false);  // the mask alone
  append(b, dpre);
  return b;
}

// Three steps of Adam's four loops: L2 decay or not, each with either of ATen's lerp formulas.
Bytes adam(const dpar::AdamHyper& h) {
  Vec param = values(kN, 11), m(kN, 0.0f), v(kN, 0.0f);
  for (int64_t step = 1; step <= 3; ++step) {
    const Vec grad = values(kN, 12 + static_cast<uint32_t>(step));
    k::adam_step(param.data(), m.data(), v.data(), grad.data(), kN, h, step);
  }
  Bytes b;
  append(b, param);
  append(b, m);
  append(b, v);
  return b;
}

// The bf16 conversions both ways, over values that exercise rounding ties, NaNs and infinities.
Bytes bf16_conversions() {
  Vec x = values(kN, 21);
  const float specials[] = {0.0f, -0.0f, 1.0f + 0x1p-8f, 1.0f + 0x1p-8f + 0x1p-23f, 3.4e38f, -3.4e38f,
                            std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                            -std::numeric_limits<float>::quiet_NaN(), 1e-40f};
  for (size_t i = 0; i < sizeof specials / sizeof *specials; ++i) x[i * 37] = specials[i];
  std::vector<uint16_t> low(x.size());
  k::to_bf16(low.data(), x.data(), static_cast<int64_t>(x.size()));
  Vec wide(x.size());
  k::from_bf16(wide.data(), low.data(), static_cast<int64_t>(low.size()));
  Bytes b;
  append(b, low);
  append(b, wide);
  return b;
}

Bytes sum_squares() {
  std::vector<double> sums;
  const Vec x = values(4099, 20);
  for (int64_t n : {0, 1, 7, 8, 9, 63, 1000, 4099}) sums.push_back(k::sum_squares(x.data(), n));
  Bytes b;
  append(b, sums);
  return b;
}

const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {"relu_forward", relu_forward},
      {"relu_backward", relu_backward},
      {"gelu forward and backward", gelu},
      {"layernorm forward (f32, bf16, no affine) and backward", layernorm},
      {"linear epilogues (bias, bias + ReLU, ReLU)", linear_epilogues},
      {"linear bias sums and ReLU masks", linear_bias_sums_and_masks},
      {"adam, L2, small lerp weight", [] { return adam({1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, false}); }},
      {"adam, L2, large lerp weight", [] { return adam({1e-3f, 0.3f, 0.999f, 1e-8f, 0.01f, false}); }},
      {"adamw, small lerp weight", [] { return adam({1e-3f, 0.9f, 0.99f, 1e-6f, 0.1f, true}); }},
      {"adam, no decay, large lerp weight", [] { return adam({1e-2f, 0.2f, 0.95f, 1e-8f, 0.0f, false}); }},
      {"sum_squares", sum_squares},
      {"bf16 conversions", bf16_conversions},
  };
  return all;
}

Bytes run_in(VectorIsa isa, const Case& c) {
  k::ForceVectorIsa force(isa);
  EXPECT_EQ(k::vector_isa(), isa);
  return c.run();
}

TEST(VectorClones, EveryCopyGivesTheBaselineBits) {
  std::string ran = "baseline";
  for (VectorIsa isa : k::kVectorIsas) {
    if (isa == VectorIsa::kBaseline || !k::vector_isa_supported(isa)) continue;
    ran += std::string(", ") + k::vector_isa_name(isa);
    for (const Case& c : cases()) {
      const Bytes want = run_in(VectorIsa::kBaseline, c), got = run_in(isa, c);
      ASSERT_EQ(got.size(), want.size()) << c.name;
      size_t first = 0;
      while (first < want.size() && got[first] == want[first]) ++first;
      EXPECT_EQ(first, want.size()) << c.name << ": the " << k::vector_isa_name(isa)
                                    << " copy differs from the baseline copy from byte " << first << " of "
                                    << want.size();
    }
  }
  std::cout << "vector copies compared on this CPU: " << ran << "\n";
  RecordProperty("vector_copies", ran);
}

// Without a test's choice, the loops run the best copy that the CPU supports.
TEST(VectorClones, TheBestSupportedCopyRunsByDefault) {
  VectorIsa best = VectorIsa::kBaseline;
  for (VectorIsa isa : k::kVectorIsas)
    if (k::vector_isa_supported(isa)) best = isa;
  EXPECT_EQ(k::vector_isa(), best) << k::vector_isa_name(k::vector_isa());
  {
    k::ForceVectorIsa force(VectorIsa::kBaseline);
    EXPECT_EQ(k::vector_isa(), VectorIsa::kBaseline);
  }
  EXPECT_EQ(k::vector_isa(), best);
}

}  // namespace
