// Convolution and pooling: the op seam (backend/ops.h), the CPU's oneDNN ops and the layers, against a direct
// double-precision convolution, finite differences of it for every backward, PyTorch's numbers
// (tests/data/conv_reference.json, written by tests/reference/make_conv_reference.py), and the engine on 2 CPU
// devices against one device on the full batch.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "common/error.h"
#include "engine/engine.h"
#include "kernels/cpu/kernels.h"
#include "op_calls.h"

namespace dpar {
namespace {

using Vec = std::vector<float>;

Vec randn(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  Vec v(n);
  for (float& x : v) x = normal(gen) * scale;
  return v;
}

// ---- A direct convolution in double: the reference the op's forward is compared with, and whose finite
// differences every backward is compared with.
struct Geometry {
  Conv2dSpec spec;
  int64_t N, H, W;
  int64_t OH() const { return spec.out_h(H); }
  int64_t OW() const { return spec.out_w(W); }
  size_t in_size() const { return static_cast<size_t>(N * spec.in_channels * H * W); }
  size_t out_size() const { return static_cast<size_t>(N * spec.out_channels * OH() * OW()); }
  size_t weight_size() const {
    return static_cast<size_t>(spec.out_channels * (spec.in_channels / spec.groups) * spec.kernel_h * spec.kernel_w);
  }
};

// out (N,C_out,OH,OW) = conv(x, w) + b, as PyTorch defines it.
std::vector<double> conv_ref(const Geometry& g, const std::vector<double>& x, const std::vector<double>& w,
                             const std::vector<double>& b) {
  const Conv2dSpec& s = g.spec;
  const int64_t cin_g = s.in_channels / s.groups, cout_g = s.out_channels / s.groups;
  std::vector<double> out(g.out_size());
  for (int64_t n = 0; n < g.N; ++n)
    for (int64_t co = 0; co < s.out_channels; ++co)
      for (int64_t oh = 0; oh < g.OH(); ++oh)
        for (int64_t ow = 0; ow < g.OW(); ++ow) {
          double acc = s.bias ? b[static_cast<size_t>(co)] : 0.0;
          const int64_t grp = co / cout_g;
          for (int64_t ci = 0; ci < cin_g; ++ci)
            for (int64_t kh = 0; kh < s.kernel_h; ++kh)
              for (int64_t kw = 0; kw < s.kernel_w; ++kw) {
                const int64_t ih = oh * s.stride_h - s.pad_h + kh * s.dilation_h;
                const int64_t iw = ow * s.stride_w - s.pad_w + kw * s.dilation_w;
                if (ih < 0 || ih >= g.H || iw < 0 || iw >= g.W) continue;
                acc += x[static_cast<size_t>(((n * s.in_channels + grp * cin_g + ci) * g.H + ih) * g.W + iw)] *
                       w[static_cast<size_t>(((co * cin_g + ci) * s.kernel_h + kh) * s.kernel_w + kw)];
              }
          out[static_cast<size_t>(((n * s.out_channels + co) * g.OH() + oh) * g.OW() + ow)] = acc;
        }
  return out;
}

std::vector<double> widen(const Vec& v) { return std::vector<double>(v.begin(), v.end()); }

// d/d(v[i]) of L = sum(f(v) * dy), by central differences, for every i.
template <class F>
std::vector<double> finite_diff(std::vector<double> v, const Vec& dy, F&& f) {
  const double h = 1e-3;
  std::vector<double> grad(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const double keep = v[i];
    auto loss = [&](double value) {
      v[i] = value;
      const std::vector<double> y = f(v);
      double l = 0;
      for (size_t j = 0; j < y.size(); ++j) l += y[j] * dy[j];
      return l;
    };
    grad[i] = (loss(keep + h) - loss(keep - h)) / (2 * h);
    v[i] = keep;
  }
  return grad;
}

// Largest |a - b| over max(1, |b|).
double max_error(const Vec& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    worst = std::max(worst, std::abs(a[i] - b[i]) / std::max(1.0, std::abs(b[i])));
  return worst;
}

std::unique_ptr<Stream> cpu_stream() { return cpu_backend().open_stream(Device{}); }

Conv2dSpec conv_spec(int64_t cin, int64_t cout, int64_t kh, int64_t kw, int64_t sh = 1, int64_t sw = 1,
                     int64_t ph = 0, int64_t pw = 0, int64_t dh = 1, int64_t dw = 1, int64_t groups = 1,
                     bool bias = true) {
  Conv2dSpec s;
  s.in_channels = cin, s.out_channels = cout, s.kernel_h = kh, s.kernel_w = kw, s.stride_h = sh, s.stride_w = sw;
  s.pad_h = ph, s.pad_w = pw, s.dilation_h = dh, s.dilation_w = dw, s.groups = groups, s.bias = bias;
  return s;
}

struct ConvCase {
  const char* name;
  Geometry g;
};

std::vector<ConvCase> conv_cases() {
  return {
      {"basic", {conv_spec(3, 4, 3, 3, 1, 1, 1, 1), 2, 6, 5}},
      {"stride 2, padding 1", {conv_spec(2, 3, 3, 3, 2, 2, 1, 1), 2, 9, 8}},
      {"dilation 2", {conv_spec(2, 3, 3, 3, 1, 1, 2, 2, 2, 2), 1, 9, 8}},
      {"groups 2", {conv_spec(4, 6, 3, 3, 1, 1, 0, 0, 1, 1, 2), 2, 5, 6}},
      {"depthwise", {conv_spec(4, 4, 3, 3, 1, 1, 1, 1, 1, 1, 4), 2, 6, 7}},
      {"1x1", {conv_spec(5, 3, 1, 1), 3, 4, 3}},
      {"no bias", {conv_spec(3, 2, 2, 2, 1, 1, 0, 0, 1, 1, 1, false), 2, 5, 5}},
      {"odd: 3x2 kernel, stride 2x1, padding 1x0, dilation 1x2", {conv_spec(2, 4, 3, 2, 2, 1, 1, 0, 1, 2, 2), 2, 7, 9}},
      {"stride 3 drops the last rows", {conv_spec(2, 2, 2, 2, 3, 3, 0, 0), 1, 8, 7}},
  };
}

TEST(Conv2dOp, ForwardAndEveryBackwardMatchADoubleReferenceAndItsFiniteDifferences) {
  auto stream = cpu_stream();
  uint32_t seed = 1;
  for (const ConvCase& c : conv_cases()) {
    SCOPED_TRACE(c.name);
    const Geometry& g = c.g;
    const Vec x = randn(g.in_size(), seed++), w = randn(g.weight_size(), seed++, 0.5f),
              b = randn(static_cast<size_t>(g.spec.out_channels), seed++, 0.5f), dy = randn(g.out_size(), seed++);
    auto op = stream->make_conv2d(g.spec);
    Vec y(g.out_size()), dx(g.in_size(), 7.0f), dw(g.weight_size(), 7.0f), db(b.size(), 7.0f);
    test::conv_forward(*op, g.spec, y.data(), x.data(), w.data(), b.data(), g.N, g.H, g.W);
    test::conv_backward_data(*op, g.spec, dx.data(), dy.data(), w.data(), g.N, g.H, g.W);
    test::conv_backward_weights(*op, g.spec, dw.data(), db.data(), dy.data(), x.data(), g.N, g.H, g.W, false);

    const auto xd = widen(x), wd = widen(w), bd = widen(b);
    EXPECT_LT(max_error(y, conv_ref(g, xd, wd, bd)), 1e-5);
    EXPECT_LT(max_error(dx, finite_diff(xd, dy, [&](const auto& v) { return conv_ref(g, v, wd, bd); })), 1e-5);
    EXPECT_LT(max_error(dw, finite_diff(wd, dy, [&](const auto& v) { return conv_ref(g, xd, v, bd); })), 1e-5);
    if (g.spec.bias) {
      EXPECT_LT(max_error(db, finite_diff(bd, dy, [&](const auto& v) { return conv_ref(g, xd, wd, v); })), 1e-5);
    } else {
      EXPECT_EQ(db, Vec(b.size(), 7.0f)) << "a convolution without bias wrote a bias gradient";
    }

    // accumulate adds to what is there.
    Vec dw2 = dw, db2 = db;
    test::conv_backward_weights(*op, g.spec, dw2.data(), db2.data(), dy.data(), x.data(), g.N, g.H, g.W, true);
    for (size_t i = 0; i < dw.size(); ++i) ASSERT_NEAR(dw2[i], 2 * dw[i], 1e-5 * std::max(1.0f, std::abs(dw[i])));
    if (g.spec.bias)
      for (size_t i = 0; i < db.size(); ++i) ASSERT_NEAR(db2[i], 2 * db[i], 1e-5 * std::max(1.0f, std::abs(db[i])));
  }
}

void relu_epilogue_case(const Geometry& g);

TEST(Conv2dOp, ReluEpilogueEqualsTheConvolutionThenARelu) {
  // A dense convolution (plain layouts) and a depthwise one (oneDNN's blocked layouts inside).
  for (const Geometry& g : {Geometry{conv_spec(3, 5, 3, 3, 1, 1, 1, 1), 2, 7, 6},
                            Geometry{conv_spec(4, 4, 3, 3, 1, 1, 1, 1, 1, 1, 4), 2, 7, 6}})
    relu_epilogue_case(g);
}

void relu_epilogue_case(const Geometry& g) {
  SCOPED_TRACE(g.spec.str());
  auto stream = cpu_stream();
  const Vec x = randn(g.in_size(), 11), w = randn(g.weight_size(), 12, 0.5f),
            b = randn(static_cast<size_t>(g.spec.out_channels), 13, 0.5f), dy = randn(g.out_size(), 14);
  auto plain = stream->make_conv2d(g.spec);
  Conv2dSpec fused_spec = g.spec;
  fused_spec.epilogue = Epilogue::kRelu;
  auto fused = stream->make_conv2d(fused_spec);
  Vec y(g.out_size()), relu_y(g.out_size()), fused_y(g.out_size());
  test::conv_forward(*plain, g.spec, y.data(), x.data(), w.data(), b.data(), g.N, g.H, g.W);
  test::activation_forward(*stream, Activation::kRelu, relu_y.data(), y.data(), static_cast<int64_t>(y.size()));
  test::conv_forward(*fused, fused_spec, fused_y.data(), x.data(), w.data(), b.data(), g.N, g.H, g.W);
  size_t zeros = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    ASSERT_NEAR(fused_y[i], relu_y[i], 1e-6f) << i;
    zeros += fused_y[i] == 0.0f;
  }
  EXPECT_GT(zeros, y.size() / 5) << "the ReLU should have cut a good part of the outputs";

  // Backward: the caller masks dout with the fused output, then the op's backward equals conv-then-relu's.
  Vec dpre(dy.size()), dx_fused(g.in_size()), dx_plain(g.in_size()), dpre_plain(dy.size());
  test::activation_backward(*stream, Activation::kRelu, dpre.data(), dy.data(), nullptr, fused_y.data(),
                            static_cast<int64_t>(dy.size()));
  test::activation_backward(*stream, Activation::kRelu, dpre_plain.data(), dy.data(), nullptr, relu_y.data(),
                            static_cast<int64_t>(dy.size()));
  test::conv_backward_data(*fused, fused_spec, dx_fused.data(), dpre.data(), w.data(), g.N, g.H, g.W);
  test::conv_backward_data(*plain, g.spec, dx_plain.data(), dpre_plain.data(), w.data(), g.N, g.H, g.W);
  for (size_t i = 0; i < dx_fused.size(); ++i) ASSERT_NEAR(dx_fused[i], dx_plain[i], 1e-6f) << i;
}

TEST(Conv2dOp, ShapesAlternateThroughItsCacheWithTheSameResults) {
  // A training batch, a smaller last batch and back: each shape's prepared primitives are kept and reused.
  auto stream = cpu_stream();
  Geometry big{conv_spec(2, 3, 3, 3, 1, 1, 1, 1), 4, 6, 6}, small = big, wide = big;
  small.N = 1;
  wide.W = 9;
  const Vec w = randn(big.weight_size(), 21), b = randn(3, 22);
  auto op = stream->make_conv2d(big.spec);
  for (int round = 0; round < 2; ++round)
    for (const Geometry* g : {&big, &small, &wide}) {
      const Vec x = randn(g->in_size(), 23 + static_cast<uint32_t>(g->N + g->W));
      Vec y(g->out_size());
      test::conv_forward(*op, g->spec, y.data(), x.data(), w.data(), b.data(), g->N, g->H, g->W);
      EXPECT_LT(max_error(y, conv_ref(*g, widen(x), widen(w), widen(b))), 1e-5) << "round " << round;
    }
}

// ---- Pooling --------------------------------------------------------------------------------------------------

std::vector<double> pool_ref(const Pool2dSpec& s, int64_t N, int64_t C, int64_t H, int64_t W,
                             const std::vector<double>& x) {
  const int64_t kh = s.global ? H : s.kernel_h, kw = s.global ? W : s.kernel_w;
  const int64_t sh = s.global ? 1 : s.stride_h, sw = s.global ? 1 : s.stride_w;
  const int64_t ph = s.global ? 0 : s.pad_h, pw = s.global ? 0 : s.pad_w;
  const int64_t OH = s.out_h(H), OW = s.out_w(W);
  std::vector<double> out(static_cast<size_t>(N * C * OH * OW));
  for (int64_t nc = 0; nc < N * C; ++nc)
    for (int64_t oh = 0; oh < OH; ++oh)
      for (int64_t ow = 0; ow < OW; ++ow) {
        double acc = s.kind == PoolKind::kMax ? -INFINITY : 0.0;
        for (int64_t i = 0; i < kh; ++i)
          for (int64_t j = 0; j < kw; ++j) {
            const int64_t ih = oh * sh - ph + i, iw = ow * sw - pw + j;
            if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
            const double v = x[static_cast<size_t>((nc * H + ih) * W + iw)];
            acc = s.kind == PoolKind::kMax ? std::max(acc, v) : acc + v;
          }
        out[static_cast<size_t>((nc * OH + oh) * OW + ow)] = s.kind == PoolKind::kMax ? acc : acc / double(kh * kw);
      }
  return out;
}

Pool2dSpec pool_spec(PoolKind kind, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw) {
  Pool2dSpec s;
  s.kind = kind, s.kernel_h = kh, s.kernel_w = kw, s.stride_h = sh, s.stride_w = sw, s.pad_h = ph, s.pad_w = pw;
  return s;
}

TEST(Pool2dOp, ForwardAndBackwardMatchADoubleReferenceAndItsFiniteDifferences) {
  struct Case {
    const char* name;
    Pool2dSpec spec;
    int64_t N, C, H, W;
  };
  Pool2dSpec global;
  global.kind = PoolKind::kAvg;
  global.global = true;
  const std::vector<Case> cases = {
      {"max 2x2", pool_spec(PoolKind::kMax, 2, 2, 2, 2, 0, 0), 2, 3, 6, 7},
      {"max 3x3 stride 2 padding 1", pool_spec(PoolKind::kMax, 3, 3, 2, 2, 1, 1), 2, 2, 7, 8},
      {"max 3x2 stride 1x2 padding 1x1", pool_spec(PoolKind::kMax, 3, 2, 1, 2, 1, 1), 1, 3, 5, 7},
      {"avg 2x2", pool_spec(PoolKind::kAvg, 2, 2, 2, 2, 0, 0), 2, 3, 6, 7},
      {"avg 3x3 stride 2 padding 1 (padding counted)", pool_spec(PoolKind::kAvg, 3, 3, 2, 2, 1, 1), 2, 2, 7, 8},
      {"adaptive avg 1x1", global, 2, 3, 5, 4},
  };
  auto stream = cpu_stream();
  uint32_t seed = 100;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const int64_t OH = c.spec.out_h(c.H), OW = c.spec.out_w(c.W);
    const Vec x = randn(static_cast<size_t>(c.N * c.C * c.H * c.W), seed++);  // distinct: no ties near a step
    const Vec dy = randn(static_cast<size_t>(c.N * c.C * OH * OW), seed++);
    auto op = stream->make_pool2d(c.spec);
    Vec y(dy.size()), dx(x.size(), 7.0f);
    test::pool_forward(*op, c.spec, y.data(), x.data(), c.N, c.C, c.H, c.W);
    test::pool_backward(*op, c.spec, dx.data(), dy.data(), x.data(), y.data(), c.N, c.C, c.H, c.W);
    const auto xd = widen(x);
    EXPECT_LT(max_error(y, pool_ref(c.spec, c.N, c.C, c.H, c.W, xd)), 1e-6);
    EXPECT_LT(
        max_error(dx, finite_diff(xd, dy, [&](const auto& v) { return pool_ref(c.spec, c.N, c.C, c.H, c.W, v); })),
        1e-5);
  }
}

TEST(Pool2dOp, MaxBackwardWithoutItsForwardIsRefused) {
  auto stream = cpu_stream();
  auto op = stream->make_pool2d(pool_spec(PoolKind::kMax, 2, 2, 2, 2, 0, 0));
  Vec dy(4), dx(16);
  try {
    test::pool_backward(*op, pool_spec(PoolKind::kMax, 2, 2, 2, 2, 0, 0), dx.data(), dy.data(), nullptr, nullptr, 1, 1,
                        4, 4);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidState);
    EXPECT_NE(std::string(e.what()).find("without its forward"), std::string::npos) << e.what();
  }
}

// ---- PyTorch's numbers ----------------------------------------------------------------------------------------

nlohmann::json load_reference() {
  std::ifstream f(std::string(DPAR_TEST_DATA_DIR) + "/conv_reference.json");
  EXPECT_TRUE(f.good()) << "tests/data/conv_reference.json is missing";
  return nlohmann::json::parse(f);
}

Vec floats(const nlohmann::json& j) { return j.get<Vec>(); }

void expect_close(const Vec& got, const Vec& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], tol * std::max(1.0f, std::abs(want[i]))) << what << "[" << i << "]";
}

// Runs a layer alone on one replica (the test's thread): forward, then backward from dy.
struct LayerRun {
  Vec y, dx;
  std::vector<Vec> grads;
};
LayerRun run_layer(std::unique_ptr<Layer> layer, const std::vector<Vec>& params, const Shape& in_shape, const Vec& x,
                   const Vec& dy) {
  auto stream = cpu_stream();
  ReplicaContext ctx;
  ctx.stream = stream.get();
  std::vector<Tensor> p, g;
  const std::vector<ParamSpec> specs = layer->param_specs();  // a copy: param_specs() returns a temporary
  for (size_t i = 0; i < params.size(); ++i) {
    const ParamSpec& spec = specs[i];
    p.push_back(Tensor::empty(DType::kF32, spec.shape, Device{}));
    EXPECT_EQ(static_cast<size_t>(spec.shape.numel()), params[i].size()) << spec.name;
    p.back().copy_from_host(params[i].data());
    g.push_back(Tensor::zeros(DType::kF32, spec.shape, Device{}));
  }
  layer->bind(p, g);
  const Shape out_shape = layer->output_shape(in_shape);
  Tensor in = Tensor::empty(DType::kF32, in_shape, Device{}), out = Tensor::empty(DType::kF32, out_shape, Device{});
  Tensor dout = Tensor::empty(DType::kF32, out_shape, Device{}), din = Tensor::empty(DType::kF32, in_shape, Device{});
  in.copy_from_host(x.data());
  dout.copy_from_host(dy.data());
  layer->forward(ctx, in, out);
  layer->backward(ctx, in, out, dout, din, false);
  LayerRun r{Vec(static_cast<size_t>(out.numel())), Vec(x.size()), {}};
  out.copy_to_host(r.y.data());
  din.copy_to_host(r.dx.data());
  for (const Tensor& t : g) {
    r.grads.emplace_back(static_cast<size_t>(t.numel()));
    t.copy_to_host(r.grads.back().data());
  }
  return r;
}

TEST(Conv2dLayer, MatchesPyTorch) {
  const nlohmann::json ref = load_reference();
  ASSERT_GE(ref["conv"].size(), 8u);
  for (const auto& c : ref["conv"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    const auto k = c["kernel"], s = c["stride"], p = c["padding"], d = c["dilation"];
    const Conv2dSpec spec = conv_spec(c["c_in"], c["c_out"], k[0], k[1], s[0], s[1], p[0], p[1], d[0], d[1],
                                      c["groups"], c["bias"].get<bool>());
    std::vector<Vec> params{floats(c["weight"])};
    if (spec.bias) params.push_back(floats(c["b"]));
    const Shape in_shape{c["n"], c["c_in"], c["h"], c["w"]};
    auto layer = make_conv2d(spec);
    const auto os = c["out_shape"];
    EXPECT_EQ(layer->output_shape(in_shape), (Shape{os[0], os[1], os[2], os[3]}));
    const LayerRun r = run_layer(std::move(layer), params, in_shape, floats(c["x"]), floats(c["dy"]));
    expect_close(r.y, floats(c["y"]), 1e-5, "y");
    expect_close(r.dx, floats(c["dx"]), 1e-5, "dx");
    expect_close(r.grads[0], floats(c["dweight"]), 1e-5, "dweight");
    if (spec.bias) expect_close(r.grads[1], floats(c["dbias"]), 1e-5, "dbias");
  }
}

TEST(Pool2dLayer, MatchesPyTorchTiesIncluded) {
  const nlohmann::json ref = load_reference();
  ASSERT_GE(ref["pool"].size(), 6u);
  size_t tied_windows = 0;
  for (const auto& c : ref["pool"]) {
    const std::string kind = c["kind"];
    SCOPED_TRACE(c["name"].get<std::string>());
    const auto k = c["kernel"], s = c["stride"], p = c["padding"];
    auto layer = kind == "adaptive_avg"
                     ? make_adaptive_avg_pool2d(1, 1)
                     : make_pool2d(pool_spec(kind == "max" ? PoolKind::kMax : PoolKind::kAvg, k[0], k[1], s[0], s[1],
                                             p[0], p[1]));
    const Shape in_shape{c["n"], c["c"], c["h"], c["w"]};
    const Vec x = floats(c["x"]);
    const LayerRun r = run_layer(std::move(layer), {}, in_shape, x, floats(c["dy"]));
    expect_close(r.y, floats(c["y"]), 1e-6, "y");
    // Max: each window's gradient goes to its first maximum; a tie broken otherwise moves a whole dy (an element
    // that is the maximum of overlapping windows sums their dy, in another order than PyTorch's: rounding only).
    expect_close(r.dx, floats(c["dx"]), 1e-6, "dx");
    if (kind == "max") {
      const Vec y = floats(c["y"]);
      for (float v : y) tied_windows += std::count(x.begin(), x.end(), v) > 1;  // a loose count: some tie
    }
  }
  EXPECT_GT(tied_windows, 10u) << "the max pooling cases should hold ties";
}

// ---- The layers' shapes, parameters and refusals ----------------------------------------------------------------

template <class F>
void expect_error(F&& f, Status status, const std::string& words) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one saying \"" << words << "\"";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), status) << e.what();
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  }
}

TEST(Conv2dLayer, ParametersAreNamedShapedAndBoundedAsPyTorchs) {
  auto layer = make_conv2d(conv_spec(6, 8, 3, 5, 1, 1, 0, 0, 1, 1, 2));
  const auto specs = layer->param_specs();
  ASSERT_EQ(specs.size(), 2u);
  EXPECT_EQ(specs[0].name, "weight");
  EXPECT_EQ(specs[0].shape, (Shape{8, 3, 3, 5}));
  EXPECT_EQ(specs[1].name, "bias");
  EXPECT_EQ(specs[1].shape, (Shape{8}));
  const float bound = 1.0f / std::sqrt(3.0f * 3 * 5);  // fan_in = in/groups * kh * kw
  EXPECT_FLOAT_EQ(specs[0].bound, bound);
  EXPECT_FLOAT_EQ(specs[1].bound, bound);
  EXPECT_EQ(make_conv2d(conv_spec(2, 2, 1, 1, 1, 1, 0, 0, 1, 1, 1, false))->param_specs().size(), 1u);
}

TEST(Conv2dLayer, OutputShapeChecksTheInput) {
  auto conv = make_conv2d(conv_spec(3, 4, 5, 5, 1, 1, 1, 1));
  EXPECT_EQ(conv->output_shape(Shape{2, 3, 8, 9}), (Shape{2, 4, 6, 7}));
  expect_error([&] { conv->output_shape(Shape{2, 3, 8}); }, Status::kInvalidArgument, "4-D");
  expect_error([&] { conv->output_shape(Shape{2, 5, 8, 8}); }, Status::kInvalidArgument, "expects 3 input channels");
  expect_error([&] { conv->output_shape(Shape{2, 3, 2, 8}); }, Status::kInvalidArgument, "smaller than the kernel");
  expect_error([&] { make_conv2d(conv_spec(3, 4, 3, 3, 1, 1, 0, 0, 1, 1, 2)); }, Status::kInvalidArgument,
               "in_channels: 3 is not divisible by groups (2)");
  expect_error([&] { make_conv2d(conv_spec(4, 3, 3, 3, 1, 1, 0, 0, 1, 1, 2)); }, Status::kInvalidArgument,
               "out_channels: 3 is not divisible by groups (2)");
  expect_error([&] { make_conv2d(conv_spec(3, 4, 3, 3, 0, 1)); }, Status::kInvalidArgument, "stride[0]");
  expect_error([&] { make_conv2d(conv_spec(3, 4, 3, 3, 1, 1, -1, 0)); }, Status::kInvalidArgument, "padding[0]");
  expect_error([&] { make_conv2d(conv_spec(3, 4, 3, 3, 1, 1, 0, 0, 1, 0)); }, Status::kInvalidArgument, "dilation[1]");
  auto pool = make_pool2d(pool_spec(PoolKind::kMax, 3, 3, 2, 2, 1, 1));
  EXPECT_EQ(pool->output_shape(Shape{2, 3, 7, 8}), (Shape{2, 3, 4, 4}));
  expect_error([&] { pool->output_shape(Shape{2, 3}); }, Status::kInvalidArgument, "4-D");
  expect_error([&] { make_pool2d(pool_spec(PoolKind::kMax, 4, 4, 1, 1, 3, 0)); }, Status::kInvalidArgument,
               "at most half the kernel");
  expect_error([&] { make_pool2d(pool_spec(PoolKind::kAvg, 4, 4, 1, 1, 0, 0))->output_shape(Shape{1, 1, 3, 5}); },
               Status::kInvalidArgument, "smaller than the window");
  EXPECT_EQ(make_adaptive_avg_pool2d(1, 1)->output_shape(Shape{3, 5, 7, 2}), (Shape{3, 5, 1, 1}));
  expect_error([&] { make_adaptive_avg_pool2d(2, 2); }, Status::kNotSupported, "only 1x1");
}

// A backend's stream that has no ops of its own: the seam's defaults answer.
class BareStream final : public Stream {
 public:
  BareStream() : Stream(Device{DeviceKind::kCuda, 1}) {}
  void copy(void*, const void*, size_t) override {}
  void copy_from_host(void*, const void*, size_t) override {}
  void copy_to_host(void*, const void*, size_t) override {}
  void fill_zero(void*, size_t) override {}
  void synchronize() override {}
  bool supports(const KernelKey&) const override { return true; }
  double sum_squares(const TensorRef&) override { return 0.0; }

 protected:
  void execute(const KernelCall&) override {}
};

TEST(OpSeam, ABackendWithoutTheOpsAnswersNotSupportedNamingTheDeviceAndTheOp) {
  BareStream stream;
  expect_error([&] { stream.make_conv2d(conv_spec(3, 4, 3, 3)); }, Status::kNotSupported,
               "conv2d(3 -> 4, kernel 3x3, stride 1x1, padding 0x0, dilation 1x1, groups 1) on cuda:1: this "
               "backend has no convolution");
  expect_error([&] { stream.make_pool2d(pool_spec(PoolKind::kMax, 2, 2, 2, 2, 0, 0)); }, Status::kNotSupported,
               "max_pool2d(kernel 2x2, stride 2x2, padding 0x0) on cuda:1: this backend has no pooling");
  // A layer meets it on its first forward, on the replica's stream.
  ReplicaContext ctx;
  ctx.stream = &stream;
  auto layer = make_conv2d(conv_spec(1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, false));
  Tensor w = Tensor::zeros(DType::kF32, Shape{1, 1, 1, 1}, Device{}), g = w;
  layer->bind({w}, {g});
  Tensor x = Tensor::zeros(DType::kF32, Shape{1, 1, 2, 2}, Device{}), y = x;
  expect_error([&] { layer->forward(ctx, x, y); }, Status::kNotSupported, "has no convolution");
}

#ifdef DPAR_HAVE_CUDA
// A CUDA stream makes its convolutions and poolings through cuDNN (tests/test_cuda_cudnn.cpp checks their numbers
// against these CPU ops), or says what is missing: cuDNN's headers when dpar was built, or its library now.
TEST(OpSeam, CudaMakesTheOpsThroughCudnnOrNamesWhatIsMissing) {
  // Reachable only with a GPU: a CUDA stream cannot be opened without one.
  if (backend_for(DeviceKind::kCuda).device_count() == 0) GTEST_SKIP() << "no CUDA device";
  auto stream = backend_for(DeviceKind::kCuda).open_stream(Device{DeviceKind::kCuda, 0});
#ifdef DPAR_HAVE_CUDNN_HEADERS
  try {
    EXPECT_NE(stream->make_conv2d(conv_spec(3, 4, 3, 3)), nullptr);
    EXPECT_NE(stream->make_pool2d(pool_spec(PoolKind::kAvg, 2, 2, 2, 2, 0, 0)), nullptr);
  } catch (const Error& e) {  // no cuDNN on this machine: the files tried are named
    EXPECT_EQ(e.status(), Status::kNotSupported) << e.what();
    EXPECT_NE(std::string(e.what()).find("libcudnn.so"), std::string::npos) << e.what();
  }
#else
  expect_error([&] { stream->make_conv2d(conv_spec(3, 4, 3, 3)); }, Status::kNotSupported,
               "on cuda:0: dpar was built without cuDNN's headers");
  expect_error([&] { stream->make_pool2d(pool_spec(PoolKind::kAvg, 2, 2, 2, 2, 0, 0)); }, Status::kNotSupported,
               "on cuda:0: dpar was built without cuDNN's headers");
#endif
}
#endif

// ---- The engine ----------------------------------------------------------------------------------------------

Model small_cnn(uint64_t seed) {
  Model m(seed);
  m.add(make_conv2d(conv_spec(1, 4, 3, 3, 1, 1, 1, 1)));         // (B,1,8,8) -> (B,4,8,8)
  m.add(make_activation(Activation::kRelu));
  m.add(make_pool2d(pool_spec(PoolKind::kMax, 2, 2, 2, 2, 0, 0)));  // -> (B,4,4,4)
  m.add(make_conv2d(conv_spec(4, 6, 3, 3, 2, 2, 1, 1, 1, 1, 2)));  // -> (B,6,2,2), groups 2
  m.add(make_activation(Activation::kTanh));
  m.add(make_pool2d(pool_spec(PoolKind::kAvg, 2, 2, 1, 1, 1, 1)));  // -> (B,6,3,3)
  m.add(make_adaptive_avg_pool2d(1, 1));                            // -> (B,6,1,1)
  return m;
}

TEST(Engine, ACnnOnTwoCpuDevicesTrainsAsOneDeviceOnTheFullBatch) {
  const Model model = small_cnn(9);
  const int64_t rows = 7;  // uneven: 4 and 3
  const Vec xs = randn(static_cast<size_t>(rows * 64), 31), ys = randn(static_cast<size_t>(rows * 6), 32, 0.3f);
  Tensor x = Tensor::empty(DType::kF32, Shape{rows, 1, 8, 8}, Device{});
  Tensor y = Tensor::empty(DType::kF32, Shape{rows, 6, 1, 1}, Device{});
  x.copy_from_host(xs.data());
  y.copy_from_host(ys.data());
  OptimizerConfig opt;
  opt.kind = OptimizerKind::kSgd;
  opt.lr = 0.5f;
  opt.momentum = 0.9f;
  std::vector<std::vector<float>> params;
  std::vector<std::vector<double>> losses;
  // 1 device, 2 devices, and 1 device whose worker runs oneDNN on 2 threads (the GEMM's per-worker setting,
  // which the convolutions follow): all the same training within rounding.
  struct Run {
    size_t devices;
    int32_t threads;
  };
  for (const Run run : {Run{1, 1}, Run{2, 1}, Run{1, 2}}) {
    const size_t devices = run.devices;
    EngineConfig config;
    for (size_t i = 0; i < devices; ++i) config.devices.push_back(Device{DeviceKind::kCpu, static_cast<int32_t>(i)});
    config.loss = LossKind::kMse;
    config.timeout_seconds = 30;
    config.blas_threads = run.threads;
    config.pin_workers = false;
    Engine engine(model, opt, config);
    losses.emplace_back();
    for (int s = 0; s < 12; ++s) losses.back().push_back(engine.train_step(x, y));
    params.push_back(engine.params(0));
    if (devices == 2) EXPECT_EQ(engine.params(1), engine.params(0)) << "replicas drifted apart";
  }
  EXPECT_LT(losses[0].back(), 0.8 * losses[0].front()) << "the CNN did not learn";
  for (size_t r = 1; r < losses.size(); ++r) {
    SCOPED_TRACE(r == 1 ? "2 devices" : "1 device, 2 threads");
    for (size_t s = 0; s < losses[0].size(); ++s) EXPECT_NEAR(losses[r][s], losses[0][s], 1e-5 * losses[0][s]) << s;
    double worst = 0;
    for (size_t i = 0; i < params[0].size(); ++i)
      worst = std::max(worst,
                       std::abs(double(params[r][i]) - params[0][i]) / std::max(1e-2, std::abs(double(params[0][i]))));
    EXPECT_LT(worst, 1e-4);
  }
}

}  // namespace
}  // namespace dpar
