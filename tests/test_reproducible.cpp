// The reproducible mode (Engine::set_reproducible, dpar_engine_set_reproducible): an MLP with dropout, trained with
// Adam and gradient clipping on 1, 2, 3, 4 and 8 CPU devices, ends with the same bits in every parameter and every
// loss, and so does a run that stops half-way, saves a checkpoint and goes on from it on another device count, one
// with GEMM thread teams, one under loss scaling that overflows, one accumulating in parts, and the example's GPT
// (dropout in the embeddings and attention, a tied head, ignored targets) on 1, 2 and 3; the default mode does not;
// the devices' micro-chunks; the step's gradient against the default mode's (the same mean, to f32's rounding); the
// elementwise optimizer gives an element the same bits wherever a shard starts; the fixed point's kernels; refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "char_gpt.h"
#include "common/error.h"
#include "engine/engine.h"
#include "engine_test_util.h"
#include "kernels/cpu/fixed_point.h"
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/vector_isa.h"
#include "optim/optimizer.h"

namespace dpar {
namespace {

using test::cpu_devices;

constexpr int64_t kIn = 12, kClasses = 5;

Model make_mlp(bool batchnorm = false) {
  Model m(11);
  m.add(make_linear(kIn, 16, true));
  if (batchnorm) m.add(make_batchnorm(1, 16, 1e-5f, 0.1f, true));
  m.add(make_activation(Activation::kTanh));
  m.add(make_dropout(0.1f));
  m.add(make_linear(16, 16, true));
  m.add(make_activation(Activation::kRelu));
  m.add(make_linear(16, kClasses, true));
  return m;
}

OptimizerConfig adam() {
  OptimizerConfig c;
  c.kind = OptimizerKind::kAdam;
  c.lr = 0.01f;
  c.max_grad_norm = 1.0f;  // clipping on: its norm must not follow the shards
  return c;
}

struct Batch {
  Tensor x, y;
};

// Step s's batch: 37 rows (micro-chunks of 4: nine of 4 and one of 1, spread unevenly over the devices).
Batch batch(int step) {
  constexpr int64_t rows = 37;
  const std::vector<float> x = test::randn(static_cast<size_t>(rows * kIn), static_cast<uint32_t>(100 + step), 2.0f);
  Batch b{test::host_tensor(x, Shape{rows, kIn}), Tensor::empty(DType::kI32, Shape{rows}, Device{})};
  for (int64_t i = 0; i < rows; ++i) b.y.i32()[i] = static_cast<int32_t>((i * 7 + step) % kClasses);
  return b;
}

std::vector<uint32_t> bits(const std::vector<float>& v) {
  std::vector<uint32_t> out(v.size());
  std::memcpy(out.data(), v.data(), v.size() * sizeof(float));
  return out;
}

uint64_t bits(double d) {
  uint64_t u;
  std::memcpy(&u, &d, sizeof u);
  return u;
}

struct Trained {
  std::vector<uint32_t> params;
  std::vector<uint64_t> losses;
  std::vector<uint32_t> buffers;  // BatchNorm's running statistics and counter, as 32-bit words
};

// Every buffer of replica `r` as 32-bit words (f32 as is, int64 as two).
std::vector<uint32_t> buffer_words(const Engine& e, size_t r) {
  std::vector<uint32_t> words;
  const auto& buffers = e.model().buffers();
  for (size_t i = 0; i < buffers.size(); ++i) {
    const size_t n = static_cast<size_t>(buffer_numel(buffers[i].shape)) * (buffers[i].dtype == DType::kF32 ? 1 : 2);
    std::vector<uint32_t> b(n);
    e.read_buffer(b.data(), r, i);
    words.insert(words.end(), b.begin(), b.end());
  }
  return words;
}

// Steps [from, to) on an engine of `devices` devices in the reproducible mode, from `load` if not empty, saving to
// `save` at the end if not empty. Every replica must hold the same parameters.
Trained train(size_t devices, int from, int to, const std::string& load = "", const std::string& save = "",
              int64_t micro_chunk_rows = 4, int32_t blas_threads = 1, bool batchnorm = false) {
  EngineConfig config = cpu_devices(devices);
  config.seed = 5;
  config.blas_threads = blas_threads;
  config.pin_workers = blas_threads == 1;  // teams of several threads on more cores than the machine may have
  Engine e(make_mlp(batchnorm), adam(), config);
  e.set_reproducible(micro_chunk_rows);
  if (!load.empty()) e.load(load);
  Trained run;
  for (int s = from; s < to; ++s) {
    const Batch b = batch(s);
    run.losses.push_back(bits(e.train_step(b.x, b.y)));
  }
  run.params = bits(e.params(0));
  run.buffers = buffer_words(e, 0);
  for (size_t r = 1; r < devices; ++r) {
    EXPECT_EQ(bits(e.params(r)), run.params) << "replica " << r;
    EXPECT_EQ(buffer_words(e, r), run.buffers) << "replica " << r;
  }
  if (!save.empty()) e.save(save);
  return run;
}

constexpr int kSteps = 50;

TEST(Reproducible, SameBitsOnEveryDeviceCount) {
  const Trained one = train(1, 0, kSteps);
  ASSERT_TRUE(std::isfinite(*reinterpret_cast<const double*>(&one.losses.back())));
  for (size_t devices : {2, 3, 4, 8}) {
    const Trained other = train(devices, 0, kSteps);
    EXPECT_EQ(other.losses, one.losses) << devices << " devices";
    EXPECT_EQ(other.params, one.params) << devices << " devices";
  }
}

// BatchNorm normalises over each micro-chunk (ghost batch normalisation) and its running statistics fold the
// micro-chunks' in order: parameters, losses, running statistics and counter alike on every device count, and across
// a restart on another.
TEST(Reproducible, BatchNormSameBitsOnEveryDeviceCount) {
  constexpr int kBnSteps = 20;
  // Micro-chunks of 5 rows: seven of 5 and one of 2 (BatchNorm needs two rows at least).
  const Trained one = train(1, 0, kBnSteps, "", "", 5, 1, true);
  ASSERT_FALSE(one.buffers.empty());
  for (size_t devices : {2, 3, 8}) {
    const Trained other = train(devices, 0, kBnSteps, "", "", 5, 1, true);
    EXPECT_EQ(other.losses, one.losses) << devices << " devices";
    EXPECT_EQ(other.params, one.params) << devices << " devices";
    EXPECT_EQ(other.buffers, one.buffers) << devices << " devices";
  }
  const std::string path = ::testing::TempDir() + "reproducible_bn.safetensors";
  train(3, 0, kBnSteps / 2, "", path, 5, 1, true);
  const Trained resumed = train(2, kBnSteps / 2, kBnSteps, path, "", 5, 1, true);
  std::remove(path.c_str());
  EXPECT_EQ(resumed.params, one.params);
  EXPECT_EQ(resumed.buffers, one.buffers);
}

// The running statistics are those of the micro-chunks run one after another as micro-batches on one device in the
// default mode (accumulate on each, then step), bit for bit.
TEST(Reproducible, BatchNormRunningStatisticsAreTheMicroBatchesInOrder) {
  const Batch b = batch(0);
  EngineConfig config = cpu_devices(3);
  config.seed = 5;
  Engine chunked(make_mlp(true), adam(), config);
  chunked.set_reproducible(5);
  chunked.train_step(b.x, b.y);
  Engine sequential(make_mlp(true), adam(), cpu_devices(1));
  for (int64_t begin = 0; begin < b.x.rows(); begin += 5) {
    const int64_t rows = std::min<int64_t>(5, b.x.rows() - begin);
    sequential.accumulate(b.x.rows(begin, rows), b.y.rows(begin, rows));
  }
  sequential.step();
  EXPECT_EQ(buffer_words(chunked, 0), buffer_words(sequential, 0));
  // The counter: one per micro-chunk (eight: seven of 5 rows and one of 2).
  int64_t tracked = 0;
  chunked.read_buffer(&tracked, 0, 2);
  EXPECT_EQ(tracked, 8);
}

// The CNN's shape: conv 3x3 (1 -> 4), BatchNorm2d, ReLU, max pool 2x2, flatten, linear, on 6x6 images; 20 steps of
// Adam with clipping, micro-chunks of 5 rows, on 1, 2 and 3 devices: the same bits, running statistics included.
TEST(Reproducible, CnnWithBatchNormSameBitsOnOneTwoAndThreeDevices) {
  auto cnn = [] {
    Model m(13);
    Conv2dSpec conv;
    conv.in_channels = 1;
    conv.out_channels = 4;
    conv.kernel_h = conv.kernel_w = 3;
    conv.pad_h = conv.pad_w = 1;
    m.add(make_conv2d(conv));
    m.add(make_batchnorm(2, 4, 1e-5f, 0.1f, true));
    m.add(make_activation(Activation::kRelu));
    Pool2dSpec pool;
    pool.kernel_h = pool.kernel_w = pool.stride_h = pool.stride_w = 2;
    m.add(make_pool2d(pool));
    m.add_flatten();
    m.add(make_linear(4 * 3 * 3, kClasses, true));
    return m;
  };
  auto run = [&](size_t devices, Trained* out) {
    EngineConfig config = cpu_devices(devices);
    config.seed = 5;
    Engine e(cnn(), adam(), config);
    e.set_reproducible(5);
    for (int s = 0; s < 20; ++s) {
      const Batch b = batch(s);  // its labels; the images are the pixels below
      const std::vector<float> pixels = test::randn(37 * 36, static_cast<uint32_t>(200 + s));
      const Tensor x = test::host_tensor(pixels, Shape{37, 1, 6, 6});
      out->losses.push_back(bits(e.train_step(x, b.y)));
    }
    out->params = bits(e.params(0));
    out->buffers = buffer_words(e, 0);
    for (size_t r = 1; r < devices; ++r) EXPECT_EQ(bits(e.params(r)), out->params) << "replica " << r;
  };
  Trained one, other;
  run(1, &one);
  for (size_t devices : {2, 3}) {
    other = {};
    run(devices, &other);
    EXPECT_EQ(other.losses, one.losses) << devices << " devices";
    EXPECT_EQ(other.params, one.params) << devices << " devices";
    EXPECT_EQ(other.buffers, one.buffers) << devices << " devices";
  }
}

// Each worker's GEMMs run on the engine's blas_threads whatever the device count: with teams of 2 threads, one and
// three devices still agree.
TEST(Reproducible, SameBitsWithGemmThreadTeams) {
  const Trained one = train(1, 0, 6, "", "", 4, 2), three = train(3, 0, 6, "", "", 4, 2);
  EXPECT_EQ(three.losses, one.losses);
  EXPECT_EQ(three.params, one.params);
}

// The layout: 37 rows in micro-chunks of 4 are 10 micro-chunks (the last of one row), split over 3 devices as
// DataParallel splits rows (4, 4, 2): each forward sees one micro-chunk.
TEST(Reproducible, DevicesHoldWholeMicroChunksSplitAsDataParallelSplitsRows) {
  Engine e(make_mlp(), adam(), cpu_devices(3));
  e.set_reproducible(4);
  std::mutex m;
  std::vector<std::vector<int64_t>> seen(3);
  e.set_forward_hook([&](size_t replica, const Shape& in, const Shape&) {
    std::lock_guard<std::mutex> lock(m);
    seen[replica].push_back(in[0]);
  });
  const Batch b = batch(0);
  e.train_step(b.x, b.y);
  EXPECT_EQ(seen[0], (std::vector<int64_t>{4, 4, 4, 4}));
  EXPECT_EQ(seen[1], (std::vector<int64_t>{4, 4, 4, 4}));
  EXPECT_EQ(seen[2], (std::vector<int64_t>{4, 1}));
}

// What the mode fixes: the default mode's bits follow the device count (the replicas' sums, their dropout streams).
TEST(Reproducible, DefaultModeDiffersBetweenDeviceCounts) {
  EXPECT_NE(train(1, 0, 5, "", "", 0).params, train(3, 0, 5, "", "", 0).params);
}

TEST(Reproducible, CheckpointResumesOnAnotherDeviceCount) {
  const Trained whole = train(2, 0, kSteps);
  const std::string path = ::testing::TempDir() + "reproducible_half.safetensors";
  const Trained first = train(1, 0, kSteps / 2, "", path);
  const Trained second = train(3, kSteps / 2, kSteps, path);
  std::remove(path.c_str());
  std::vector<uint64_t> losses = first.losses;
  losses.insert(losses.end(), second.losses.begin(), second.losses.end());
  EXPECT_EQ(losses, whole.losses);
  EXPECT_EQ(second.params, whole.params);
}

// One SGD step (no dropout, no clipping): the mode's gradient is the default mode's mean to f32's rounding.
TEST(Reproducible, StepMatchesTheDefaultMode) {
  Model m(3);
  m.add(make_linear(kIn, 16, true));
  m.add(make_activation(Activation::kTanh));
  m.add(make_linear(16, kClasses, true));
  OptimizerConfig sgd;
  sgd.kind = OptimizerKind::kSgd;
  sgd.lr = 1.0f;
  const Batch b = batch(0);
  Engine plain(m, sgd, cpu_devices(1));
  Engine repro(m, sgd, cpu_devices(3));
  repro.set_reproducible(5);
  EXPECT_EQ(repro.reproducible(), 5);
  const double l0 = plain.train_step(b.x, b.y), l1 = repro.train_step(b.x, b.y);
  EXPECT_NEAR(l0, l1, 1e-6 * std::abs(l0));
  // parameter - lr * gradient: the two updates agree to a few f32 roundings of the gradient.
  const std::vector<float> before = m.values(), p0 = plain.params(0), p1 = repro.params(0);
  double worst = 0;
  for (size_t i = 0; i < before.size(); ++i) {
    const double g0 = double(before[i]) - p0[i], g1 = double(before[i]) - p1[i];
    worst = std::max(worst, std::abs(g0 - g1) / std::max(std::abs(g0), 1e-3));
  }
  EXPECT_LT(worst, 1e-4);
}

// Adam's and the scale's arithmetic on an element does not depend on where a shard (a vector body, a scalar tail)
// starts, in any vector copy, against the best copy's whole-buffer bits: the kernels are built without FMA
// contraction.
TEST(Reproducible, ElementwiseKernelsIgnoreShardEdges) {
  constexpr int64_t n = 67;
  const std::vector<float> p0 = test::randn(n, 1), g = test::randn(n, 2), m0 = test::randn(n, 3, 0.1f);
  std::vector<float> v0 = test::randn(n, 4, 0.1f);
  for (float& v : v0) v = v * v;
  const AdamHyper h{0.01f, 0.9f, 0.999f, 1e-8f, 0.01f, false};
  std::vector<float> p = p0, m = m0, v = v0;
  kernels::cpu::adam_step(p.data(), m.data(), v.data(), g.data(), n, h, 3);
  std::vector<float> scaled = g;
  kernels::cpu::scale(scaled.data(), 0.37f, n);
  for (kernels::cpu::VectorIsa isa : kernels::cpu::kVectorIsas) {
    if (!kernels::cpu::vector_isa_supported(isa)) continue;
    kernels::cpu::ForceVectorIsa force(isa);
    for (int64_t start = 1; start < 20; ++start) {
      std::vector<float> ps = p0, ms = m0, vs = v0;
      kernels::cpu::adam_step(ps.data() + start, ms.data() + start, vs.data() + start, g.data() + start, n - start, h,
                              3);
      kernels::cpu::adam_step(ps.data(), ms.data(), vs.data(), g.data(), start, h, 3);
      EXPECT_EQ(bits(ps), bits(p)) << "shard from " << start;
      EXPECT_EQ(bits(ms), bits(m)) << "shard from " << start;
      EXPECT_EQ(bits(vs), bits(v)) << "shard from " << start;
      std::vector<float> ss = g;
      kernels::cpu::scale(ss.data() + start, 0.37f, n - start);
      kernels::cpu::scale(ss.data(), 0.37f, start);
      EXPECT_EQ(bits(ss), bits(scaled)) << "shard from " << start;
    }
  }
}

// Loss scaling from a scale that overflows the gradient: the same steps are skipped (the NaN that an overflowing
// micro-chunk makes of its tensor's sum reaches every replica), and the same bits come out, on 1 and 3 devices.
TEST(Reproducible, LossScalingSkipsAlikeOnEveryDeviceCount) {
  std::vector<std::vector<uint32_t>> params;
  std::vector<std::vector<int>> skipped;
  for (size_t devices : {1, 3}) {
    Engine e(make_mlp(), adam(), cpu_devices(devices));
    e.set_reproducible(4);
    LossScaling scaling;
    scaling.init_scale = 3e38f;
    scaling.growth_interval = 2;
    e.set_loss_scaling(scaling);
    skipped.emplace_back();
    for (int s = 0; s < 8; ++s) {
      const Batch b = batch(s);
      e.train_step(b.x, b.y);
      skipped.back().push_back(e.loss_scaler().last_step_skipped() ? 1 : 0);
    }
    params.push_back(bits(e.params(0)));
  }
  EXPECT_EQ(skipped[0][0], 1) << "a scale of 3e38 did not overflow";
  EXPECT_GT(std::count(skipped[0].begin(), skipped[0].end(), 0), 0) << "no step was taken";
  EXPECT_EQ(skipped[1], skipped[0]);
  EXPECT_EQ(params[1], params[0]);
}

// The example's GPT through the C ABI, in miniature: 7 sequences of 6 tokens with ignored targets spread unevenly,
// micro-chunks of 2 sequences; Adam with clipping.
std::vector<uint32_t> train_gpt(size_t devices, std::vector<uint64_t>* losses) {
  const gpt_config c{11, 6, 1, 2, 8, 0.1f};
  dpar_model* m = gpt_build(&c, 3);
  dpar_optimizer_options oo = DPAR_OPTIMIZER_OPTIONS_INIT;
  oo.kind = DPAR_ADAM;
  oo.lr = 0.01f;
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = devices;
  eo.processes = DPAR_PROCESSES_SINGLE;
  eo.seed = 9;
  dpar_engine* e = nullptr;
  EXPECT_EQ(dpar_engine_create(&e, m, &oo, &eo), DPAR_OK) << dpar_last_error();
  size_t n = 0;
  EXPECT_EQ(dpar_model_num_param_elements(&n, m), DPAR_OK);
  dpar_model_free(m);
  EXPECT_EQ(dpar_engine_set_max_grad_norm(e, 0.5f), DPAR_OK);
  EXPECT_EQ(dpar_engine_set_reproducible(e, 2), DPAR_OK) << dpar_last_error();
  const int64_t B = 7, T = 6;
  std::vector<int32_t> tokens(static_cast<size_t>(B * T)), targets(tokens.size());
  const int64_t shape[2] = {B, T};
  uint64_t rng = 5;
  for (int step = 0; step < 10; ++step) {
    for (size_t i = 0; i < tokens.size(); ++i) {
      tokens[i] = static_cast<int32_t>(gpt_next_u64(&rng) % static_cast<uint64_t>(c.vocab));
      targets[i] = static_cast<int32_t>(gpt_next_u64(&rng) % static_cast<uint64_t>(c.vocab));
      if (i / T == 3 || (i / T == 5 && i % 2 == 0) || i == 1) targets[i] = DPAR_IGNORE_INDEX;
    }
    dpar_tensor *x = nullptr, *y = nullptr;
    EXPECT_EQ(dpar_tensor_wrap_host(&x, DPAR_I32, shape, 2, tokens.data()), DPAR_OK);
    EXPECT_EQ(dpar_tensor_wrap_host(&y, DPAR_I32, shape, 2, targets.data()), DPAR_OK);
    float loss = 0.0f;
    EXPECT_EQ(dpar_engine_train_step(&loss, e, x, y), DPAR_OK) << dpar_last_error();
    losses->push_back(bits(static_cast<double>(loss)));
    dpar_tensor_free(x);
    dpar_tensor_free(y);
  }
  std::vector<float> p(n), other(n);
  EXPECT_EQ(dpar_engine_get_params(p.data(), e, 0, n), DPAR_OK);
  for (size_t r = 1; r < devices; ++r) {
    EXPECT_EQ(dpar_engine_get_params(other.data(), e, r, n), DPAR_OK);
    EXPECT_EQ(bits(other), bits(p)) << "replica " << r;
  }
  dpar_engine_free(e);
  return bits(p);
}

TEST(Reproducible, GptSameBitsOnOneTwoAndThreeDevices) {
  std::vector<uint64_t> one_losses;
  const std::vector<uint32_t> one = train_gpt(1, &one_losses);
  for (size_t devices : {2, 3}) {
    std::vector<uint64_t> losses;
    EXPECT_EQ(train_gpt(devices, &losses), one) << devices << " devices";
    EXPECT_EQ(losses, one_losses) << devices << " devices";
  }
}

// The fixed point's kernels against their definitions (frexp, llrint), in every vector copy the CPU runs: ties to
// even, negative values, the extremes of the grid, subnormals, NaN and infinity.
TEST(Reproducible, FixedPointKernels) {
  namespace k = kernels::cpu;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::vector<float> x = test::randn(203, 8, 3.0f);
  for (float t : {0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -2.5f, 0.0f, -0.0f}) x.push_back(t);
  for (k::VectorIsa isa : k::kVectorIsas) {
    if (!k::vector_isa_supported(isa)) continue;
    k::ForceVectorIsa force(isa);
    const char* name = k::vector_isa_name(isa);
    EXPECT_EQ(k::max_exponent(x.data(), 0), k::kFixedPointAllZero) << name;
    const std::vector<float> zeros(37, 0.0f), one{0.25f, -1.0f, 0.5f}, three_quarters(19, 0.75f);
    EXPECT_EQ(k::max_exponent(zeros.data(), 37), k::kFixedPointAllZero) << name;
    EXPECT_EQ(k::max_exponent(one.data(), 3), 1) << name;  // 1 = 0.5 * 2^1
    EXPECT_EQ(k::max_exponent(three_quarters.data(), 19), 0) << name;
    const float tiny = std::numeric_limits<float>::denorm_min();
    EXPECT_EQ(k::max_exponent(&tiny, 1), -125) << name;
    for (float bad : {nan, inf, -inf}) {
      std::vector<float> y = x;
      y[117] = bad;
      EXPECT_EQ(k::max_exponent(y.data(), static_cast<int64_t>(y.size())), k::kFixedPointNotFinite) << name;
    }
    int e = 0;
    float largest = 0;
    for (float v : x) largest = std::max(largest, std::fabs(v));
    std::frexp(largest, &e);
    EXPECT_EQ(k::max_exponent(x.data(), static_cast<int64_t>(x.size())), e) << name;
    // On the grid that puts the largest value at 2^51, and on a coarse one (exponent 0: the ties above).
    for (int scale : {k::kFixedPointBits - e, 0}) {
      std::vector<int64_t> sum(x.size(), 7), twice(x.size(), 0);
      k::to_grid(sum.data(), x.data(), static_cast<int64_t>(x.size()), scale, false);
      k::to_grid(twice.data(), x.data(), static_cast<int64_t>(x.size()), scale, true);
      k::to_grid(twice.data(), x.data(), static_cast<int64_t>(x.size()), scale, true);
      for (size_t i = 0; i < x.size(); ++i) {
        const int64_t want = std::llrint(std::ldexp(static_cast<double>(x[i]), scale));
        EXPECT_EQ(sum[i], want) << name << ": " << x[i] << " * 2^" << scale;
        EXPECT_EQ(twice[i], 2 * want) << name;
      }
      std::vector<float> back(x.size());
      const double factor = std::ldexp(1.0, -scale) / 3.0;
      k::from_grid(back.data(), sum.data(), static_cast<int64_t>(x.size()), factor);
      for (size_t i = 0; i < x.size(); ++i)
        EXPECT_EQ(bits(std::vector<float>{back[i]}),
                  bits(std::vector<float>{static_cast<float>(double(sum[i]) * factor)}))
            << name;
    }
    const int64_t top = int64_t{1} << k::kFixedPointBits;
    const std::vector<int64_t> edges{top, -top, top - 1, 1 - top, 0, 1, -1, 12345678901};
    std::vector<float> back(edges.size());
    k::from_grid(back.data(), edges.data(), static_cast<int64_t>(edges.size()), 0x1p-20);
    for (size_t i = 0; i < edges.size(); ++i)
      EXPECT_EQ(back[i], static_cast<float>(static_cast<double>(edges[i]) * 0x1p-20)) << name << ": " << edges[i];
  }
}

// Gradient accumulation: the micro-chunks of several accumulate() calls are numbered on, so that accumulating a
// batch in two parts that are whole micro-chunks, then step(), gives train_step's bits on the whole batch; and the
// same bits on 1 and 3 devices.
TEST(Reproducible, AccumulateInPartsIsTrainStepOnTheWhole) {
  std::vector<std::vector<uint32_t>> params;
  for (size_t devices : {1, 3}) {
    for (bool parts : {false, true}) {
      EngineConfig config = cpu_devices(devices);
      config.seed = 5;
      Engine e(make_mlp(), adam(), config);
      e.set_reproducible(4);
      for (int s = 0; s < 4; ++s) {
        const Batch b = batch(s);
        if (!parts) {
          e.train_step(b.x, b.y);
          continue;
        }
        e.accumulate(b.x.rows(0, 20), b.y.rows(0, 20));  // micro-chunks 0-4
        e.accumulate(b.x.rows(20, 17), b.y.rows(20, 17));  // 5-9, the last of one row
        e.step();
      }
      params.push_back(bits(e.params(0)));
    }
  }
  EXPECT_EQ(params[1], params[0]) << "accumulated in parts, one device";
  EXPECT_EQ(params[2], params[0]) << "three devices";
  EXPECT_EQ(params[3], params[0]) << "accumulated in parts, three devices";
}

TEST(Reproducible, Refusals) {
  Engine e(make_mlp(), adam(), cpu_devices(2));
  EXPECT_EQ(e.reproducible(), 0);
  try {
    e.set_reproducible(-3);
    ADD_FAILURE() << "a negative count was taken";
  } catch (const Error& err) {
    EXPECT_EQ(err.status(), Status::kInvalidArgument);
    EXPECT_NE(std::string(err.what()).find("-3"), std::string::npos) << err.what();
  }
  EXPECT_EQ(e.reproducible(), 0);
  const Batch b = batch(0);
  e.accumulate(b.x, b.y);
  try {
    e.set_reproducible(4);
    ADD_FAILURE() << "set while gradients are pending";
  } catch (const Error& err) {
    EXPECT_EQ(err.status(), Status::kInvalidState) << err.what();
  }
  e.zero_grad();
  e.set_reproducible(4);
  EXPECT_TRUE(std::isfinite(e.accumulate(b.x, b.y)));
  try {
    e.train_step(b.x, b.y);
    ADD_FAILURE() << "train_step while accumulated gradients are pending";
  } catch (const Error& err) {
    EXPECT_EQ(err.status(), Status::kInvalidState) << err.what();
  }
  try {
    e.set_reproducible(8);
    ADD_FAILURE() << "set while accumulated gradients are pending";
  } catch (const Error& err) {
    EXPECT_EQ(err.status(), Status::kInvalidState) << err.what();
  }
  EXPECT_EQ(e.reproducible(), 4);
  e.zero_grad();  // the accumulated micro-chunks are forgotten: the next call starts a step
  try {
    e.forward(b.x);
    e.backward(Tensor::zeros(DType::kF32, Shape{37, kClasses}, Device{}));
    ADD_FAILURE() << "backward in the reproducible mode";
  } catch (const Error& err) {
    EXPECT_EQ(err.status(), Status::kNotSupported) << err.what();
  }
  e.set_gradient_reduction(GradientReduction::kReduceScatter);
  try {
    e.train_step(b.x, b.y);
    ADD_FAILURE() << "a step under reduce-scatter in the reproducible mode";
  } catch (const Error& err) {
    EXPECT_EQ(err.status(), Status::kNotSupported) << err.what();
  }
  e.set_gradient_reduction(GradientReduction::kAllReduce);
  EXPECT_TRUE(std::isfinite(e.train_step(b.x, b.y)));
  e.set_reproducible(std::numeric_limits<int64_t>::max());  // one micro-chunk: the whole batch
  EXPECT_TRUE(std::isfinite(e.train_step(b.x, b.y)));
  e.set_reproducible(0);
  EXPECT_TRUE(std::isfinite(e.accumulate(b.x, b.y)));

  Model sync = make_mlp(true);
  sync.convert_sync_batchnorm();
  Engine bn(sync, adam(), cpu_devices(2));
  try {
    bn.set_reproducible(4);
    ADD_FAILURE() << "SyncBatchNorm in the reproducible mode";
  } catch (const Error& err) {
    EXPECT_EQ(err.status(), Status::kNotSupported);
    EXPECT_NE(std::string(err.what()).find("node 1 "), std::string::npos) << err.what();
  }
  EXPECT_EQ(bn.reproducible(), 0);
  // A micro-chunk of one row gives BatchNorm one value per channel: refused before any work.
  Engine one_row(make_mlp(true), adam(), cpu_devices(2));
  one_row.set_reproducible(1);
  const Batch b1 = batch(1);
  try {
    one_row.train_step(b1.x, b1.y);
    ADD_FAILURE() << "micro-chunks of one row through BatchNorm";
  } catch (const Error& err) {
    EXPECT_EQ(err.status(), Status::kInvalidArgument) << err.what();
    EXPECT_NE(std::string(err.what()).find("micro-chunk of 1 rows"), std::string::npos) << err.what();
  }
}

}  // namespace
}  // namespace dpar
