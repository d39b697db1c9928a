// Convolution and pooling on cuda through cuDNN (src/backend/cuda/cudnn_ops.*) against the CPU ops through oneDNN
// (the reference), and cuDNN's loader (src/platform/cuda/cudnn_library.*). The loader's tests run everywhere cuDNN
// is installed (no GPU needed: loading and resolving touch no device); the ops' tests skip without a GPU.
//
// Tolerances: the CPU and cuDNN sum a convolution's products in different orders (and cuDNN may use Winograd or FFT
// algorithms, exact in real arithmetic), so the two differ by rounding only: for FP32 sums of at most a few hundred
// products of values in [-1, 1], well under 1e-5 of the result's scale. The bound used, 5e-5, is ten times below
// what TF32 (a 10-bit mantissa, relative error ~5e-4 per product) gives, so that a TF32 kernel cannot pass: built
// with CUDNN_DEFAULT_MATH instead of CUDNN_FMA_MATH, the 16 -> 32 case's backward_data measured 2.9e-4 on an H200.
// Pooling's forward is exact (a maximum, or a sum of at most kernel_h * kernel_w values and one division).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/stream.h"
#include "common/error.h"
#include "cuda_test_util.h"
#include "op_calls.h"
#include "platform/cuda/cuda_check.h"

#ifdef DPAR_HAVE_CUDNN_HEADERS
#include "platform/cuda/cudnn_library.h"
#endif

namespace dpar {
namespace {

using test::bitwise_equal;
using test::DeviceBuffer;
using test::on_gpu;
using test::normalised_error;
using test::random_vector;
using Vec = std::vector<float>;

constexpr double kConvTolerance = 5e-5;

// ---- The loader: no GPU needed -------------------------------------------------------------------------------------

#ifdef DPAR_HAVE_CUDNN_HEADERS

TEST(CudnnLoader, LoadsTheHeadersMajorVersionAndResolvesEveryFunction) {
  const cuda::CudnnLibrary& lib = cuda::cudnn();
  EXPECT_FALSE(lib.path.empty());
  EXPECT_EQ(lib.version / 10000, static_cast<size_t>(CUDNN_MAJOR)) << lib.path << " is cuDNN " << lib.version;
  EXPECT_EQ(lib.get_version(), lib.version);
  // Every member is a function pointer of the same size, between `get_version` and `path`: none may be null.
  const auto* first = reinterpret_cast<const char*>(&lib.get_version);
  const auto* end = reinterpret_cast<const char*>(&lib.path);
  size_t functions = 0;
  for (const char* p = first; p < end; p += sizeof(void*), ++functions) {
    void* fn = nullptr;
    std::memcpy(&fn, p, sizeof fn);
    EXPECT_NE(fn, nullptr) << "function " << functions << " of CudnnLibrary is not resolved";
  }
  EXPECT_EQ(functions, 33u) << "CudnnLibrary's functions changed: update this count";
  EXPECT_STRNE(lib.error_string(CUDNN_STATUS_BAD_PARAM), "");
}

TEST(CudnnLoader, AFailureNamesEveryFileTriedWhyAndWhatToInstall) {
  try {
    cuda::loader::load_cudnn({"libdpar-no-such-cudnn.so.9", "/nonexistent/dir/libcudnn.so.9", "libm.so.6"});
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kNotSupported);
    const std::string what = e.what();
    EXPECT_NE(what.find("libdpar-no-such-cudnn.so.9: "), std::string::npos) << what;
    EXPECT_NE(what.find("/nonexistent/dir/libcudnn.so.9: "), std::string::npos) << what;
    // A library that loads but is not cuDNN: the functions it lacks are named.
    EXPECT_NE(what.find("libm.so.6: lacks cudnnGetVersion"), std::string::npos) << what;
    EXPECT_NE(what.find("install cuDNN " + std::to_string(CUDNN_MAJOR)), std::string::npos) << what;
    EXPECT_NE(what.find("NOT_SUPPORTED naming the missing library"), std::string::npos) << what;
  }
}

TEST(CudnnLoader, TriesItsSonameThenCudnnRootThenTheToolkitsDirectory) {
  const std::string soname = "libcudnn.so." + std::to_string(CUDNN_MAJOR);
  const char* old = std::getenv("CUDNN_ROOT");
  const std::string saved = old ? old : "";
  setenv("CUDNN_ROOT", "/opt/some-cudnn", 1);
  const std::vector<std::string> c = cuda::loader::cudnn_candidates();
  if (old)
    setenv("CUDNN_ROOT", saved.c_str(), 1);
  else
    unsetenv("CUDNN_ROOT");
  ASSERT_GE(c.size(), 2u);
  EXPECT_EQ(c[0], soname);
  EXPECT_EQ(c[1], "/opt/some-cudnn/lib/" + soname);
  if (c.size() > 2) {
    EXPECT_EQ(c[2].substr(c[2].size() - soname.size()), soname);
  }
}

TEST(CudnnLoader, StatusesMapAndMessagesCarryCudnnsText) {
  EXPECT_EQ(cuda::cudnn_error_status(CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED), Status::kOutOfMemory);
  EXPECT_EQ(cuda::cudnn_error_status(CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED), Status::kOutOfMemory);
  EXPECT_EQ(cuda::cudnn_error_status(CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED), Status::kNotSupported);
  EXPECT_EQ(cuda::cudnn_error_status(CUDNN_STATUS_BAD_PARAM), Status::kDevice);
  EXPECT_EQ(cuda::cudnn_error_status(CUDNN_STATUS_EXECUTION_FAILED), Status::kDevice);
  try {
    DPAR_CUDNN_CHECK(CUDNN_STATUS_BAD_PARAM, "preparing ", 3, " descriptors");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kDevice);
    const std::string what = e.what();
    EXPECT_NE(what.find("preparing 3 descriptors"), std::string::npos) << what;
    EXPECT_NE(what.find(cuda::cudnn().error_string(CUDNN_STATUS_BAD_PARAM)), std::string::npos) << what;
    EXPECT_NE(what.find("2000"), std::string::npos) << what;
  }
}

#endif  // DPAR_HAVE_CUDNN_HEADERS

// ---- The ops against the CPU's -------------------------------------------------------------------------------------

const Device kGpu{DeviceKind::kCuda, 0};

struct Streams {
  std::unique_ptr<Stream> cpu = cpu_backend().open_stream(Device{});
  std::unique_ptr<Stream> gpu = cuda_backend().open_stream(kGpu);
};

Conv2dSpec conv(int64_t cin, int64_t cout, int64_t kh, int64_t kw, int64_t sh = 1, int64_t sw = 1, int64_t ph = 0,
                int64_t pw = 0, int64_t dh = 1, int64_t dw = 1, int64_t groups = 1, bool bias = true,
                Epilogue epilogue = Epilogue::kNone) {
  Conv2dSpec s;
  s.in_channels = cin, s.out_channels = cout, s.kernel_h = kh, s.kernel_w = kw, s.stride_h = sh, s.stride_w = sw;
  s.pad_h = ph, s.pad_w = pw, s.dilation_h = dh, s.dilation_w = dw, s.groups = groups, s.bias = bias;
  s.epilogue = epilogue;
  return s;
}

struct ConvCase {
  const char* name;
  Conv2dSpec spec;
  int64_t N, H, W;
  size_t in() const { return static_cast<size_t>(N * spec.in_channels * H * W); }
  size_t out() const { return static_cast<size_t>(N * spec.out_channels * spec.out_h(H) * spec.out_w(W)); }
  size_t weight() const {
    return static_cast<size_t>(spec.out_channels * (spec.in_channels / spec.groups) * spec.kernel_h * spec.kernel_w);
  }
};

// What one op computes for one input: forward, backward_data, backward_weights overwriting (into buffers full of
// NaN: beta 0 must not read them) and accumulating onto g0.
struct ConvResults {
  Vec y, dx, dw, db, dw_acc, db_acc;
};

ConvResults run_conv(Conv2dOp& op, bool gpu, const ConvCase& c, const Vec& x, const Vec& w, const Vec& b,
                     const Vec& dy, const Vec& gw0, const Vec& gb0) {
  ConvResults r;
  const Vec nan_w(c.weight(), NAN), nan_b(b.size(), NAN);
  if (!gpu) {
    r.y.assign(c.out(), 0.0f), r.dx.assign(c.in(), NAN), r.dw = nan_w, r.db = nan_b, r.dw_acc = gw0, r.db_acc = gb0;
    test::conv_forward(op, c.spec, r.y.data(), x.data(), w.data(), b.data(), c.N, c.H, c.W);
    test::conv_backward_data(op, c.spec, r.dx.data(), dy.data(), w.data(), c.N, c.H, c.W);
    test::conv_backward_weights(op, c.spec, r.dw.data(), r.db.data(), dy.data(), x.data(), c.N, c.H, c.W, false);
    test::conv_backward_weights(op, c.spec, r.dw_acc.data(), r.db_acc.data(), dy.data(), x.data(), c.N, c.H, c.W, true);
    return r;
  }
  auto dx_ = on_gpu(Vec(c.in(), NAN)), y_ = on_gpu(Vec(c.out(), NAN)), x_ = on_gpu(x), w_ = on_gpu(w), b_ = on_gpu(b),
       dy_ = on_gpu(dy), dw_ = on_gpu(nan_w), db_ = on_gpu(nan_b), dwa_ = on_gpu(gw0), dba_ = on_gpu(gb0);
  test::conv_forward(op, c.spec, y_->get(), x_->get(), w_->get(), b_->get(), c.N, c.H, c.W);
  test::conv_backward_data(op, c.spec, dx_->get(), dy_->get(), w_->get(), c.N, c.H, c.W);
  test::conv_backward_weights(op, c.spec, dw_->get(), db_->get(), dy_->get(), x_->get(), c.N, c.H, c.W, false);
  test::conv_backward_weights(op, c.spec, dwa_->get(), dba_->get(), dy_->get(), x_->get(), c.N, c.H, c.W, true);
  r.y = y_->download(), r.dx = dx_->download(), r.dw = dw_->download(), r.db = db_->download();
  r.dw_acc = dwa_->download(), r.db_acc = dba_->download();
  return r;
}

void expect_conv_matches_cpu(Streams& s, Conv2dOp& gpu_op, const ConvCase& c, uint64_t seed) {
  SCOPED_TRACE(std::string(c.name) + ": " + c.spec.str() + " on (" + std::to_string(c.N) + ", " +
               std::to_string(c.spec.in_channels) + ", " + std::to_string(c.H) + ", " + std::to_string(c.W) + ")");
  const Vec x = random_vector(c.in(), seed), w = random_vector(c.weight(), seed + 1),
            b = random_vector(static_cast<size_t>(c.spec.out_channels), seed + 2),
            dy = random_vector(c.out(), seed + 3), gw0 = random_vector(c.weight(), seed + 4),
            gb0 = random_vector(b.size(), seed + 5);
  auto cpu_op = s.cpu->make_conv2d(c.spec);
  const ConvResults ref = run_conv(*cpu_op, false, c, x, w, b, dy, gw0, gb0);
  const ConvResults got = run_conv(gpu_op, true, c, x, w, b, dy, gw0, gb0);
  EXPECT_LT(normalised_error(got.y, ref.y), kConvTolerance) << "forward";
  EXPECT_LT(normalised_error(got.dx, ref.dx), kConvTolerance) << "backward_data";
  EXPECT_LT(normalised_error(got.dw, ref.dw), kConvTolerance) << "backward_weights, overwriting";
  EXPECT_LT(normalised_error(got.dw_acc, ref.dw_acc), kConvTolerance) << "backward_weights, accumulating";
  if (c.spec.bias) {
    EXPECT_LT(normalised_error(got.db, ref.db), kConvTolerance) << "bias gradient, overwriting";
    EXPECT_LT(normalised_error(got.db_acc, ref.db_acc), kConvTolerance) << "bias gradient, accumulating";
  } else {  // without a bias, dbias is not touched
    EXPECT_TRUE(bitwise_equal(got.db, ref.db));
    EXPECT_TRUE(bitwise_equal(got.db_acc, gb0));
  }
  if (c.spec.epilogue == Epilogue::kRelu) {  // the ReLU ran: no negative output, some zeros
    size_t zeros = 0;
    for (float v : got.y) zeros += v == 0.0f;
    EXPECT_GT(zeros, 0u);
  }
}

std::vector<ConvCase> conv_cases() {
  return {
      {"3x3, padding 1, stride 1, odd 7x5", conv(3, 8, 3, 3, 1, 1, 1, 1), 2, 7, 5},
      {"3x3, padding 1, stride 2", conv(4, 6, 3, 3, 2, 2, 1, 1), 3, 9, 8},
      {"1x1", conv(5, 3, 1, 1), 2, 4, 3},
      {"dilation 2, N = 1", conv(2, 3, 3, 3, 1, 1, 2, 2, 2, 2), 1, 9, 8},
      {"groups 2", conv(4, 6, 3, 3, 1, 1, 0, 0, 1, 1, 2), 2, 5, 6},
      {"depthwise", conv(4, 4, 3, 3, 1, 1, 1, 1, 1, 1, 4), 2, 6, 7},
      {"no bias", conv(3, 2, 2, 2, 1, 1, 0, 0, 1, 1, 1, false), 2, 5, 5},
      {"ReLU epilogue", conv(3, 4, 3, 3, 1, 1, 1, 1, 1, 1, 1, true, Epilogue::kRelu), 2, 7, 5},
      {"ReLU epilogue, no bias", conv(3, 4, 3, 3, 1, 1, 1, 1, 1, 1, 1, false, Epilogue::kRelu), 1, 6, 6},
      {"3x2 kernel, stride 2x1, padding 1x0, dilation 1x2, groups 2", conv(2, 4, 3, 2, 2, 1, 1, 0, 1, 2, 2), 2, 7, 9},
      {"stride 3 drops the last rows", conv(2, 2, 2, 2, 3, 3, 0, 0), 1, 8, 7},
      {"a ResNet-like 3x3, 16 -> 32", conv(16, 32, 3, 3, 1, 1, 1, 1), 4, 16, 16},
  };
}

TEST(CudnnConv2d, EveryDirectionMatchesTheCpuOp) {
  DPAR_REQUIRE_GPU();
  Streams s;
  uint64_t seed = 100;
  for (const ConvCase& c : conv_cases()) {
    auto op = s.gpu->make_conv2d(c.spec);
    expect_conv_matches_cpu(s, *op, c, seed += 10);
  }
}

TEST(CudnnConv2d, OneOpServesSeveralShapesFromItsCache) {
  DPAR_REQUIRE_GPU();
  Streams s;
  const Conv2dSpec spec = conv(3, 5, 3, 3, 2, 1, 1, 1);
  auto op = s.gpu->make_conv2d(spec);
  expect_conv_matches_cpu(s, *op, {"first shape", spec, 2, 8, 8}, 1);
  expect_conv_matches_cpu(s, *op, {"second shape", spec, 3, 5, 7}, 2);
  expect_conv_matches_cpu(s, *op, {"first shape again", spec, 2, 8, 8}, 3);
  expect_conv_matches_cpu(s, *op, {"N = 1", spec, 1, 8, 8}, 4);
}

TEST(CudnnConv2d, TwoRunsGiveTheSameBits) {
  DPAR_REQUIRE_GPU();
  Streams s;
  // Large enough for cuDNN's heuristics to consider split-reduction algorithms, which are the nondeterministic ones.
  const ConvCase c{"determinism", conv(32, 32, 3, 3, 1, 1, 1, 1), 8, 16, 16};
  const Vec x = random_vector(c.in(), 7), w = random_vector(c.weight(), 8), b = random_vector(32, 9),
            dy = random_vector(c.out(), 10), gw0 = random_vector(c.weight(), 11), gb0 = random_vector(32, 12);
  auto op = s.gpu->make_conv2d(c.spec);
  const ConvResults a = run_conv(*op, true, c, x, w, b, dy, gw0, gb0);
  const ConvResults again = run_conv(*op, true, c, x, w, b, dy, gw0, gb0);
  auto other_op = s.gpu->make_conv2d(c.spec);  // a replica's own op chooses the same algorithms
  const ConvResults other = run_conv(*other_op, true, c, x, w, b, dy, gw0, gb0);
  for (const ConvResults* r : {&again, &other}) {
    EXPECT_TRUE(bitwise_equal(r->y, a.y)) << "forward";
    EXPECT_TRUE(bitwise_equal(r->dx, a.dx)) << "backward_data";
    EXPECT_TRUE(bitwise_equal(r->dw, a.dw)) << "backward_weights";
    EXPECT_TRUE(bitwise_equal(r->db, a.db)) << "bias gradient";
    EXPECT_TRUE(bitwise_equal(r->dw_acc, a.dw_acc)) << "backward_weights, accumulating";
  }
}

TEST(CudnnConv2d, NoRowsAndUnwantedGradients) {
  DPAR_REQUIRE_GPU();
  Streams s;
  const ConvCase c{"", conv(2, 3, 3, 3, 1, 1, 1, 1), 2, 4, 4};
  auto op = s.gpu->make_conv2d(c.spec);
  auto dw = on_gpu(Vec(c.weight(), 5.0f)), db = on_gpu(Vec(3, 5.0f));
  test::conv_backward_weights(*op, c.spec, dw->get(), db->get(), nullptr, nullptr, 0, 4, 4,
                              true);  // accumulating nothing
  EXPECT_TRUE(bitwise_equal(dw->download(), Vec(c.weight(), 5.0f)));
  test::conv_backward_weights(*op, c.spec, dw->get(), db->get(), nullptr, nullptr, 0, 4, 4,
                              false);  // no rows: a zero gradient
  EXPECT_TRUE(bitwise_equal(dw->download(), Vec(c.weight(), 0.0f)));
  EXPECT_TRUE(bitwise_equal(db->download(), Vec(3, 0.0f)));
  // Only the bias's gradient wanted: the weights' stays as it is.
  const Vec x = random_vector(c.in(), 1), dy = random_vector(c.out(), 2);
  auto x_ = on_gpu(x), dy_ = on_gpu(dy), dw2 = on_gpu(Vec(c.weight(), 5.0f));
  test::conv_backward_weights(*op, c.spec, nullptr, db->get(), dy_->get(), x_->get(), c.N, c.H, c.W, false);
  auto cpu_op = s.cpu->make_conv2d(c.spec);
  Vec dw_ref(c.weight()), db_ref(3);
  test::conv_backward_weights(*cpu_op, c.spec, dw_ref.data(), db_ref.data(), dy.data(), x.data(), c.N, c.H, c.W, false);
  EXPECT_LT(normalised_error(db->download(), db_ref), kConvTolerance);
}

TEST(CudnnConv2d, ShapesBeyond32BitsAreRefusedWithAReason) {
  DPAR_REQUIRE_GPU();
  Streams s;
  auto op = s.gpu->make_conv2d(conv(3, 4, 3, 3, 1, 1, 1, 1));
  try {
    // 2^20 * 3 * 1024 * 1024 elements: refused while the shape is prepared, before any memory is read.
    test::conv_forward(*op, conv(3, 4, 3, 3, 1, 1, 1, 1), nullptr, nullptr, nullptr, nullptr, int64_t{1} << 20, 1024,
                       1024);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kNotSupported);
    EXPECT_NE(std::string(e.what()).find("32-bit"), std::string::npos) << e.what();
  }
}

TEST(CudnnConv2d, AnOpThatOutlivesItsStreamSaysSo) {
  DPAR_REQUIRE_GPU();
  auto stream = cuda_backend().open_stream(kGpu);
  auto op = stream->make_conv2d(conv(1, 1, 1, 1));
  stream.reset();
  try {
    test::conv_forward(*op, conv(1, 1, 1, 1), nullptr, nullptr, nullptr, nullptr, 1, 1, 1);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidState);
    EXPECT_NE(std::string(e.what()).find("after its stream was destroyed"), std::string::npos) << e.what();
  }
}

// ---- Pooling -------------------------------------------------------------------------------------------------------

Pool2dSpec pool(PoolKind kind, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw,
                bool global = false) {
  Pool2dSpec p;
  p.kind = kind, p.kernel_h = kh, p.kernel_w = kw, p.stride_h = sh, p.stride_w = sw, p.pad_h = ph, p.pad_w = pw;
  p.global = global;
  return p;
}

struct PoolCase {
  const char* name;
  Pool2dSpec spec;
  int64_t N, C, H, W;
  float shift;  // added to the inputs: -2 makes every input negative, so a padded zero would win a max
  bool ties = false;  // inputs rounded to halves: most windows hold several maxima
  size_t in() const { return static_cast<size_t>(N * C * H * W); }
  size_t out() const { return static_cast<size_t>(N * C * spec.out_h(H) * spec.out_w(W)); }
};

void expect_pool_matches_cpu(Streams& s, Pool2dOp& gpu_op, const PoolCase& c, uint64_t seed) {
  SCOPED_TRACE(std::string(c.name) + ": " + c.spec.str() + " on (" + std::to_string(c.N) + ", " +
               std::to_string(c.C) + ", " + std::to_string(c.H) + ", " + std::to_string(c.W) + ")");
  Vec x = random_vector(c.in(), seed);
  for (float& v : x) v = (c.ties ? std::round(v * 2.0f) / 2.0f : v) + c.shift;
  const Vec dy = random_vector(c.out(), seed + 1);
  auto cpu_op = s.cpu->make_pool2d(c.spec);
  Vec y(c.out()), dx(c.in(), NAN);
  test::pool_forward(*cpu_op, c.spec, y.data(), x.data(), c.N, c.C, c.H, c.W);
  test::pool_backward(*cpu_op, c.spec, dx.data(), dy.data(), x.data(), y.data(), c.N, c.C, c.H, c.W);
  if (c.ties) {  // the case must hold ties to test their rule: windows whose maximum occurs more than once in them
    const int64_t OH = c.spec.out_h(c.H), OW = c.spec.out_w(c.W);
    size_t tied = 0;
    for (int64_t nc = 0; nc < c.N * c.C; ++nc)
      for (int64_t oh = 0; oh < OH; ++oh)
        for (int64_t ow = 0; ow < OW; ++ow) {
          const int64_t i0 = oh * c.spec.stride_h - c.spec.pad_h, j0 = ow * c.spec.stride_w - c.spec.pad_w;
          const float m = y[static_cast<size_t>((nc * OH + oh) * OW + ow)];
          int maxima = 0;
          for (int64_t i = std::max<int64_t>(i0, 0); i < std::min(i0 + c.spec.kernel_h, c.H); ++i)
            for (int64_t j = std::max<int64_t>(j0, 0); j < std::min(j0 + c.spec.kernel_w, c.W); ++j)
              maxima += x[static_cast<size_t>((nc * c.H + i) * c.W + j)] == m;
          tied += maxima > 1;
        }
    EXPECT_GT(tied, y.size() / 8) << "the case should hold windows with several maxima";  // ~37% for 2x2
  }
  auto x_ = on_gpu(x), dy_ = on_gpu(dy), y_ = on_gpu(Vec(c.out(), NAN)), dx_ = on_gpu(Vec(c.in(), NAN));
  test::pool_forward(gpu_op, c.spec, y_->get(), x_->get(), c.N, c.C, c.H, c.W);
  test::pool_backward(gpu_op, c.spec, dx_->get(), dy_->get(), x_->get(), y_->get(), c.N, c.C, c.H, c.W);
  const Vec gy = y_->download(), gdx = dx_->download();
  if (c.spec.kind == PoolKind::kMax) {
    // A maximum is one of the inputs, and each input's gradient a sum of the dy of the windows it won (several only
    // where windows overlap; in an order that may differ: a few ulp).
    EXPECT_TRUE(bitwise_equal(gy, y)) << "forward";
    const double err = normalised_error(gdx, dx);
    EXPECT_LT(err, 1e-6) << "backward; first difference: " << (err < 1e-6 ? "" : bitwise_equal(gdx, dx).message());
  } else {
    EXPECT_LT(normalised_error(gy, y), 1e-6) << "forward";
    EXPECT_LT(normalised_error(gdx, dx), 1e-6) << "backward";
  }
}

std::vector<PoolCase> pool_cases() {
  return {
      {"max 2x2 stride 2", pool(PoolKind::kMax, 2, 2, 2, 2, 0, 0), 2, 3, 8, 8, 0.0f},
      {"max 3x3 stride 2 padding 1, all negative", pool(PoolKind::kMax, 3, 3, 2, 2, 1, 1), 2, 3, 7, 5, -2.0f},
      {"max 3x3 stride 1 padding 1 (overlapping), N = 1", pool(PoolKind::kMax, 3, 3, 1, 1, 1, 1), 1, 4, 6, 7, -2.0f},
      {"max 3x2 stride 2x1 padding 1x0", pool(PoolKind::kMax, 3, 2, 2, 1, 1, 0), 2, 2, 9, 6, 0.0f},
      {"avg 3x3 stride 2 padding 1 (padding counts)", pool(PoolKind::kAvg, 3, 3, 2, 2, 1, 1), 2, 3, 7, 5, 0.0f},
      {"avg 2x2 stride 1", pool(PoolKind::kAvg, 2, 2, 1, 1, 0, 0), 2, 3, 5, 6, 0.0f},
      {"global avg", pool(PoolKind::kAvg, 1, 1, 1, 1, 0, 0, true), 3, 5, 7, 5, 0.0f},
      {"global max", pool(PoolKind::kMax, 1, 1, 1, 1, 0, 0, true), 3, 5, 7, 5, -2.0f},
      // PyTorch's rule, the CPU op's: a window's gradient goes to its first maximum in row-major order.
      {"max 3x3 stride 2 padding 1, ties", pool(PoolKind::kMax, 3, 3, 2, 2, 1, 1), 2, 3, 9, 8, 0.0f, true},
      {"max 2x2 stride 2, ties", pool(PoolKind::kMax, 2, 2, 2, 2, 0, 0), 2, 3, 8, 8, 0.0f, true},
  };
}

TEST(CudnnPool2d, ForwardAndBackwardMatchTheCpuOp) {
  DPAR_REQUIRE_GPU();
  Streams s;
  uint64_t seed = 500;
  for (const PoolCase& c : pool_cases()) {
    auto op = s.gpu->make_pool2d(c.spec);
    expect_pool_matches_cpu(s, *op, c, seed += 10);
  }
}

TEST(CudnnPool2d, OneOpServesSeveralShapesFromItsCache) {
  DPAR_REQUIRE_GPU();
  Streams s;
  const Pool2dSpec max3x3 = pool(PoolKind::kMax, 3, 3, 2, 2, 1, 1);
  const Pool2dSpec global_avg = pool(PoolKind::kAvg, 1, 1, 1, 1, 0, 0, true);
  for (const Pool2dSpec& spec : {max3x3, global_avg}) {
    auto op = s.gpu->make_pool2d(spec);
    expect_pool_matches_cpu(s, *op, {"first shape", spec, 2, 3, 8, 8, 0.0f}, 1);
    expect_pool_matches_cpu(s, *op, {"second shape", spec, 3, 3, 5, 7, 0.0f}, 2);
    expect_pool_matches_cpu(s, *op, {"first shape again", spec, 2, 3, 8, 8, 0.0f}, 3);
  }
}

TEST(CudnnPool2d, TwoRunsGiveTheSameBits) {
  DPAR_REQUIRE_GPU();
  Streams s;
  const PoolCase c{"", pool(PoolKind::kMax, 3, 3, 1, 1, 1, 1), 4, 16, 12, 12, 0.0f};
  const Vec x = random_vector(c.in(), 3), dy = random_vector(c.out(), 4);
  auto op = s.gpu->make_pool2d(c.spec);
  auto x_ = on_gpu(x), dy_ = on_gpu(dy), y_ = on_gpu(Vec(c.out())), dx_ = on_gpu(Vec(c.in()));
  Vec first;
  for (int run = 0; run < 2; ++run) {
    test::pool_forward(*op, c.spec, y_->get(), x_->get(), c.N, c.C, c.H, c.W);
    test::pool_backward(*op, c.spec, dx_->get(), dy_->get(), x_->get(), y_->get(), c.N, c.C, c.H, c.W);
    if (run == 0)
      first = dx_->download();
    else
      EXPECT_TRUE(bitwise_equal(dx_->download(), first));
  }
}

}  // namespace
}  // namespace dpar
