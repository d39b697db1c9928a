// The engine on CUDA devices, against the CPU engine (the reference) and against itself on one replica. Every test
// needs a GPU and reports SKIPPED with the reason where there is none.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/stream.h"
#include "cuda_test_util.h"
#include "engine/engine.h"
#include "io/safetensors.h"
#include "engine_test_util.h"

namespace dpar {
namespace {

using test::max_relative_error;

Model make_mlp(uint64_t seed, float dropout) {
  Model m(seed);
  m.add(make_linear(12, 32, true));
  m.add(make_activation(Activation::kGelu));
  if (dropout > 0) m.add(make_dropout(dropout));
  m.add(make_linear(32, 16, true));
  m.add(make_activation(Activation::kTanh));
  m.add(make_linear(16, 5, true));
  return m;
}

struct Batch {
  Tensor x, y;
};

Batch make_batch(int64_t rows, uint64_t seed) {
  std::mt19937 gen(static_cast<uint32_t>(seed));
  std::normal_distribution<float> normal;
  Batch b{Tensor::empty(DType::kF32, Shape{rows, 12}, Device{}), Tensor::empty(DType::kI32, Shape{rows}, Device{})};
  for (int64_t i = 0; i < rows * 12; ++i) b.x.f32()[i] = normal(gen);
  for (int64_t i = 0; i < rows; ++i) b.y.i32()[i] = static_cast<int32_t>(gen() % 5);
  return b;
}

OptimizerConfig adam() {
  OptimizerConfig c;
  c.kind = OptimizerKind::kAdam;
  c.lr = 1e-3f;
  return c;
}

EngineConfig devices(DeviceKind kind, std::vector<int32_t> ids) {
  EngineConfig c;
  for (int32_t i : ids) c.devices.push_back(Device{kind, i});
  c.timeout_seconds = 60;
  return c;
}

std::vector<Batch> data(int64_t rows) {
  std::vector<Batch> d;
  for (int i = 0; i < 4; ++i) d.push_back(make_batch(rows, 100 + static_cast<uint64_t>(i)));
  return d;
}

void train(Engine& e, const std::vector<Batch>& d, int steps) {
  for (int s = 0; s < steps; ++s) e.train_step(d[static_cast<size_t>(s) % d.size()].x, d[static_cast<size_t>(s) % d.size()].y);
}

TEST(CudaEngine, TwentyAdamStepsOnTheGpuEqualTheCpu) {
  DPAR_REQUIRE_GPU();
  const Model model = make_mlp(3, 0.2f);  // dropout too: a GPU replica draws its CPU twin's masks
  const auto d = data(29);
  Engine cpu(model, adam(), devices(DeviceKind::kCpu, {0}));
  Engine gpu(model, adam(), devices(DeviceKind::kCuda, {0}));
  for (int s = 0; s < 20; ++s) {
    const Batch& b = d[static_cast<size_t>(s) % d.size()];
    const double lc = cpu.train_step(b.x, b.y), lg = gpu.train_step(b.x, b.y);
    EXPECT_NEAR(lg, lc, 1e-4 * std::abs(lc)) << "step " << s;
  }
  EXPECT_LT(max_relative_error(gpu.params(0), cpu.params(0)), 1e-4);
  EXPECT_GT(max_relative_error(gpu.params(0), model.values()), 1e-3) << "training did not move the parameters";
}

// A graph: a residual block (its linear and ReLU fused), a projection shortcut, a concatenation of 4-D views (the
// strided copies) and a flatten: on one GPU shared by two replicas as on one CPU device.
TEST(CudaEngine, AGraphModelOnTheGpuEqualsTheCpu) {
  DPAR_REQUIRE_GPU();
  Model m(17);
  m.add(make_linear(12, 16, true));            // 0
  m.add(make_activation(Activation::kRelu));   // 1
  m.add(make_linear(16, 12, true));            // 2
  m.add_sum({2, kModelInput});                 // 3: + x
  m.add(make_linear(12, 8, true));             // 4
  m.add_reshape({2, 2, 2});                    // 5
  m.branch_from(3);
  m.add(make_linear(12, 8, false));            // 6: a projection
  m.add_reshape({2, 2, 2});                    // 7
  m.add_concat({5, 7, 5});                     // 8: (B, 6, 2, 2)
  m.add_flatten();                             // 9
  m.add(make_linear(24, 5, true));             // 10
  const auto d = data(29);
  Engine cpu(m, adam(), devices(DeviceKind::kCpu, {0}));
  Engine gpu(m, adam(), devices(DeviceKind::kCuda, {0, 0}));
  for (int s = 0; s < 10; ++s) {
    const Batch& b = d[static_cast<size_t>(s) % d.size()];
    const double lc = cpu.train_step(b.x, b.y), lg = gpu.train_step(b.x, b.y);
    EXPECT_NEAR(lg, lc, 1e-4 * std::abs(lc)) << "step " << s;
  }
  EXPECT_LT(max_relative_error(gpu.params(0), cpu.params(0)), 1e-4);
  EXPECT_EQ(gpu.params(1), gpu.params(0));
  EXPECT_GT(max_relative_error(gpu.params(0), m.values()), 1e-3) << "training did not move the parameters";
}

std::vector<float> values(const Tensor& t);

// A small residual CNN as the Fashion-MNIST example's, at 2x6x6: convolution (cuDNN on the GPU, oneDNN on the CPU),
// BatchNorm, ReLU, max pooling, a basic block with its skip connection, global average pooling and a classifier.
Model make_cnn(uint64_t seed) {
  auto conv = [](int64_t cin, int64_t cout) {
    Conv2dSpec s;
    s.in_channels = cin;
    s.out_channels = cout;
    s.kernel_h = s.kernel_w = 3;
    s.pad_h = s.pad_w = 1;
    s.bias = false;
    return make_conv2d(s);
  };
  Model m(seed);
  m.add_reshape({2, 6, 6});
  m.add(conv(2, 4));
  m.add(make_batchnorm(2, 4, 1e-5f, 0.1f, true));
  m.add(make_activation(Activation::kRelu));
  Pool2dSpec pool;
  pool.kind = PoolKind::kMax;
  pool.kernel_h = pool.kernel_w = pool.stride_h = pool.stride_w = 2;
  const int32_t block_in = m.add(make_pool2d(pool));  // (4, 3, 3)
  m.add(conv(4, 4));
  m.add(make_batchnorm(2, 4, 1e-5f, 0.1f, true));
  m.add(make_activation(Activation::kRelu));
  m.add(conv(4, 4));
  const int32_t bn2 = m.add(make_batchnorm(2, 4, 1e-5f, 0.1f, true));
  m.add_sum({bn2, block_in});
  m.add(make_activation(Activation::kRelu));
  m.add(make_adaptive_avg_pool2d(1, 1));
  m.add_flatten();
  m.add(make_linear(4, 5, true));
  return m;
}

std::vector<Batch> cnn_data(int64_t rows) {
  std::vector<Batch> d;
  for (uint32_t i = 0; i < 4; ++i) {
    std::mt19937 gen(200 + i);
    std::normal_distribution<float> normal;
    Batch b{Tensor::empty(DType::kF32, Shape{rows, 72}, Device{}), Tensor::empty(DType::kI32, Shape{rows}, Device{})};
    for (int64_t k = 0; k < rows * 72; ++k) b.x.f32()[k] = normal(gen);
    for (int64_t k = 0; k < rows; ++k) b.y.i32()[k] = static_cast<int32_t>(gen() % 5);
    d.push_back(std::move(b));
  }
  return d;
}

// SGD with momentum: a gradient's rounding difference moves a parameter by as much, where Adam's normalised step
// would turn the rounding of a gradient near zero into a move of up to lr.
OptimizerConfig sgd_momentum() {
  OptimizerConfig c;
  c.lr = 0.05f;
  c.momentum = 0.9f;
  return c;
}

// Every buffer of every BatchNorm (running mean and variance; num_batches_tracked as a float's worth of int64).
std::vector<float> float_buffers(const Engine& e, size_t replica) {
  std::vector<float> all;
  const auto& specs = e.model().buffers();
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].dtype != DType::kF32) continue;
    std::vector<float> v(static_cast<size_t>(specs[i].shape.numel()));
    e.read_buffer(v.data(), replica, i);
    all.insert(all.end(), v.begin(), v.end());
  }
  return all;
}

// The CNN on one GPU (cuDNN, dpar's BatchNorm kernels) trains as on one CPU device (oneDNN, the CPU's), running
// statistics included, and evaluates the same afterwards; two replicas sharing the GPU with SyncBatchNorm train as
// one replica on the full batch (BatchNorm's statistics summed over both, 15 and 14 rows).
TEST(CudaEngine, ACnnWithBatchNormOnTheGpuEqualsTheCpu) {
  DPAR_REQUIRE_GPU();
  const Model model = make_cnn(23);
  Model synced = make_cnn(23);
  synced.convert_sync_batchnorm();
  const auto d = cnn_data(29);
  Engine cpu(model, sgd_momentum(), devices(DeviceKind::kCpu, {0}));
  Engine gpu(model, sgd_momentum(), devices(DeviceKind::kCuda, {0}));
  Engine two(synced, sgd_momentum(), devices(DeviceKind::kCuda, {0, 0}));
  for (int s = 0; s < 10; ++s) {
    const Batch& b = d[static_cast<size_t>(s) % d.size()];
    const double lc = cpu.train_step(b.x, b.y), lg = gpu.train_step(b.x, b.y), l2 = two.train_step(b.x, b.y);
    EXPECT_NEAR(lg, lc, 1e-4 * std::abs(lc)) << "step " << s;
    EXPECT_NEAR(l2, lc, 1e-4 * std::abs(lc)) << "step " << s << ", two replicas with SyncBatchNorm";
  }
  // Convolutions sum in another order on each side (cuDNN's algorithm, oneDNN's blocked kernels): parameters agree
  // within rounding carried through ten steps, not bit for bit.
  EXPECT_LT(max_relative_error(gpu.params(0), cpu.params(0)), 1e-3);
  EXPECT_LT(max_relative_error(two.params(0), cpu.params(0)), 1e-3);
  EXPECT_EQ(two.params(1), two.params(0));
  EXPECT_LT(max_relative_error(float_buffers(gpu, 0), float_buffers(cpu, 0)), 1e-3);
  EXPECT_LT(max_relative_error(float_buffers(two, 0), float_buffers(cpu, 0)), 1e-3);
  EXPECT_EQ(float_buffers(two, 1), float_buffers(two, 0));
  EXPECT_GT(max_relative_error(gpu.params(0), model.values()), 1e-3) << "training did not move the parameters";
  // Evaluation: BatchNorm normalises with the running statistics.
  cpu.set_training(false);
  gpu.set_training(false);
  EXPECT_LT(max_relative_error(values(gpu.forward(d[0].x)), values(cpu.forward(d[0].x))), 1e-3);
}

TEST(CudaEngine, GradientClippingOnTheGpuEqualsTheCpu) {
  DPAR_REQUIRE_GPU();
  const Model model = make_mlp(4, 0.0f);
  const auto d = data(29);
  OptimizerConfig opt = adam();
  opt.max_grad_norm = 0.05f;  // below every step's norm: each step is clipped
  Engine cpu(model, opt, devices(DeviceKind::kCpu, {0, 1}));
  Engine gpu(model, opt, devices(DeviceKind::kCuda, {0, 0}));
  train(cpu, d, 20);
  train(gpu, d, 20);
  EXPECT_LT(max_relative_error(gpu.params(0), cpu.params(0)), 1e-4);
  const auto norms = gpu.replica_grad_norms();  // each replica scales its shard by its own norm's coefficient
  ASSERT_EQ(norms.size(), 2u);
  EXPECT_TRUE(std::isfinite(norms[0]) && norms[0] > 0.0f) << norms[0];
  EXPECT_EQ(std::memcmp(&norms[0], &norms[1], sizeof(float)), 0) << norms[0] << " vs " << norms[1];
  EXPECT_NEAR(gpu.grad_norm(), cpu.grad_norm(), 1e-3 * cpu.grad_norm());  // trajectories within rounding
  opt.max_grad_norm = 0.0f;
  Engine unclipped(model, opt, devices(DeviceKind::kCpu, {0, 1}));
  train(unclipped, d, 20);
  EXPECT_GT(max_relative_error(unclipped.params(0), cpu.params(0)), 1e-3) << "the clipping changed nothing";
}

TEST(CudaEngine, ReplicasSharingOneGpuEqualOneReplicaOnTheFullBatch) {
  DPAR_REQUIRE_GPU();
  const Model model = make_mlp(5, 0.0f);
  const auto d = data(31);  // 31 over 3 replicas: 11, 11, 9
  Engine one(model, adam(), devices(DeviceKind::kCuda, {0}));
  Engine three(model, adam(), devices(DeviceKind::kCuda, {0, 0, 0}));
  train(one, d, 20);
  train(three, d, 20);
  EXPECT_LT(max_relative_error(three.params(0), one.params(0)), 1e-5);
  for (size_t r = 1; r < 3; ++r) EXPECT_EQ(three.params(r), three.params(0)) << "replica " << r << " differs";
}

// Tied weights (lm_head.weight = wte.weight) over (B, T) tokens, with a bucket per parameter: the tied gradient's
// bucket goes to the communication stream only after the embedding's backward added to it, so three replicas of
// one GPU train as the CPU does.
TEST(CudaEngine, ATiedWeightTrainsOnThreeReplicasAsOnTheCpu) {
  DPAR_REQUIRE_GPU();
  constexpr int64_t kVocab = 11, kDim = 8, kSeq = 4;
  Model model(9);
  model.add(make_embedding(kVocab, kDim));
  model.add(make_linear(kDim, kDim, true));
  model.add(make_activation(Activation::kTanh));
  model.add(make_linear(kDim, kVocab, false));
  model.add_flatten();
  model.tie_param(3, "weight", 0, "weight");
  std::mt19937 gen(17);
  const int64_t rows = 10;
  Tensor x = Tensor::empty(DType::kI32, Shape{rows, kSeq}, Device{}), y = Tensor::empty(DType::kI32, Shape{rows}, Device{});
  for (int64_t i = 0; i < x.numel(); ++i) x.i32()[i] = static_cast<int32_t>(gen() % kVocab);
  for (int64_t i = 0; i < rows; ++i) y.i32()[i] = static_cast<int32_t>(gen() % (kSeq * kVocab));
  EngineConfig gpu_config = devices(DeviceKind::kCuda, {0, 0, 0}), cpu_config = devices(DeviceKind::kCpu, {0});
  gpu_config.buckets.first_bucket_bytes = gpu_config.buckets.bucket_cap_bytes = 64;
  Engine cpu(model, adam(), cpu_config);
  Engine gpu(model, adam(), gpu_config);
  for (int s = 0; s < 5; ++s) {
    const double lc = cpu.train_step(x, y), lg = gpu.train_step(x, y);
    EXPECT_NEAR(lg, lc, 1e-4 * (1 + std::fabs(lc))) << "step " << s;
  }
  EXPECT_LT(max_relative_error(gpu.params(0), cpu.params(0)), 1e-4);
  for (size_t r = 1; r < 3; ++r) EXPECT_EQ(gpu.params(r), gpu.params(0)) << "replica " << r << " differs";
}

TEST(CudaEngine, TheSteadyStateStepNeverCallsCudaMalloc) {
  DPAR_REQUIRE_GPU();
  const Model model = make_mlp(7, 0.1f);
  const auto d = data(64);
  Engine e(model, adam(), devices(DeviceKind::kCuda, {0, 0}));
  train(e, d, 3);  // the first steps size every buffer
  const uint64_t before = cuda_allocator_stats(0).device_mallocs;
  train(e, d, 20);
  EXPECT_EQ(cuda_allocator_stats(0).device_mallocs, before);
}

TEST(CudaEngine, CheckpointsMoveBetweenGpuAndCpu) {
  DPAR_REQUIRE_GPU();
  const Model model = make_mlp(9, 0.0f);
  const auto d = data(16);
  const std::string path = ::testing::TempDir() + "dpar_cuda_engine.safetensors";
  Engine gpu(model, adam(), devices(DeviceKind::kCuda, {0, 0}));
  train(gpu, d, 5);
  gpu.save(path);
  Engine cpu(model, adam(), devices(DeviceKind::kCpu, {0, 1}));
  cpu.load(path);
  EXPECT_EQ(cpu.params(0), gpu.params(0)) << "written on the GPU, loaded on the CPU";
  train(cpu, d, 3);
  cpu.save(path);
  Engine back(model, adam(), devices(DeviceKind::kCuda, {0}));
  back.load(path);
  EXPECT_EQ(back.params(0), cpu.params(0)) << "written on the CPU, loaded on the GPU";
  EXPECT_EQ(back.step_count(), 8);
  // The optimizer's state too, which each engine holds in shards of its own (two on the CPU, one on the GPU):
  // written again from the GPU, every tensor has the CPU file's bytes.
  const std::string again = ::testing::TempDir() + "dpar_cuda_engine_again.safetensors";
  back.save(again);
  const auto cpu_file = io::SafetensorsFile::parse(path, io::SafetensorsFile::read_bytes(path));
  const auto gpu_file = io::SafetensorsFile::parse(again, io::SafetensorsFile::read_bytes(again));
  ASSERT_EQ(gpu_file.names(), cpu_file.names());
  for (const std::string& name : cpu_file.names()) {
    ASSERT_EQ(gpu_file.entry(name).bytes, cpu_file.entry(name).bytes) << name;
    EXPECT_EQ(std::memcmp(gpu_file.data(name), cpu_file.data(name), cpu_file.entry(name).bytes), 0) << name;
  }
  std::remove(path.c_str());
  std::remove(again.c_str());
}

TEST(CudaEngine, DeviceMemoryExhaustionIsACleanErrorAndTheEngineTrainsOn) {
  DPAR_REQUIRE_GPU();
  const Model model = make_mlp(11, 0.0f);
  const auto d = data(8);
  Engine e(model, adam(), devices(DeviceKind::kCuda, {0}));
  train(e, d, 1);
  try {
    Tensor::empty(DType::kF32, Shape{int64_t{1} << 20, int64_t{1} << 20}, Device{DeviceKind::kCuda, 0});  // 4 TiB
    FAIL() << "a 4 TiB allocation succeeded";
  } catch (const Error& err) {
    EXPECT_EQ(err.status(), Status::kOutOfMemory) << err.what();
    EXPECT_NE(std::string(err.what()).find("cuda:0"), std::string::npos) << err.what();
  }
  train(e, d, 2);
  EXPECT_EQ(e.step_count(), 3);
}

// A copy of a host tensor on `device`.
Tensor on(const Tensor& host, Device device) {
  Tensor t = Tensor::empty(host.dtype(), host.shape(), device);
  t.copy_from_host(host.raw());
  return t;
}

std::vector<float> values(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  t.copy_to_host(v.data());
  return v;
}

// A batch already on the GPU (a framework's tensor, a device-side loader): each replica on that GPU takes its rows
// as a view, without a copy; the result is the host batch's. (Within rounding, not bit for bit: a view may start at
// another alignment than the staging buffer a host batch is copied into, and cuBLAS may pick its kernel by it.)
TEST(CudaEngine, ABatchOnTheGpuTrainsAsTheSameBatchOnTheHost) {
  DPAR_REQUIRE_GPU();
  const Model model = make_mlp(13, 0.0f);
  const Device gpu{DeviceKind::kCuda, 0};
  Engine from_host(model, adam(), devices(DeviceKind::kCuda, {0, 0}));
  Engine from_gpu(model, adam(), devices(DeviceKind::kCuda, {0, 0}));
  const auto d = data(23);
  for (int s = 0; s < 6; ++s) {
    const Batch& b = d[static_cast<size_t>(s) % d.size()];
    const Tensor x = on(b.x, gpu), y = on(b.y, gpu);
    const double lg = from_gpu.train_step(x, y), lh = from_host.train_step(b.x, b.y);
    EXPECT_NEAR(lg, lh, 1e-6 * std::abs(lh)) << "step " << s;
  }
  EXPECT_LT(max_relative_error(from_gpu.params(0), from_host.params(0)), 1e-5);
  EXPECT_EQ(from_gpu.params(1), from_gpu.params(0)) << "the replicas differ";
  // forward and backward take the GPU's memory too, with the same result.
  const Batch& b = d[0];
  const std::vector<float> out_host = values(from_host.forward(b.x));
  const Tensor out_gpu = from_gpu.forward(on(b.x, gpu));
  EXPECT_LT(max_relative_error(values(out_gpu), out_host), 1e-5);
  Tensor ones = Tensor::empty(DType::kF32, out_gpu.shape(), Device{});
  std::fill(ones.f32(), ones.f32() + ones.numel(), 1.0f);
  from_host.backward(ones);
  from_gpu.backward(on(ones, gpu));
  from_host.step();
  from_gpu.step();
  EXPECT_LT(max_relative_error(from_gpu.params(0), from_host.params(0)), 1e-5);
  // A label out of range on the GPU is refused as on the host, and the engine goes on.
  Tensor bad = on(b.y, Device{});
  bad.i32()[3] = 5;
  try {
    from_gpu.train_step(on(b.x, gpu), on(bad, gpu));
    FAIL() << "a label out of range on the GPU was accepted";
  } catch (const Error& err) {
    EXPECT_EQ(err.status(), Status::kInvalidArgument);
    EXPECT_NE(std::string(err.what()).find("target[3] = 5 is out of range"), std::string::npos) << err.what();
  }
  from_gpu.train_step(on(b.x, gpu), on(b.y, gpu));
}

TEST(CudaEngine, AGpuBatchForACpuEngineIsRefusedNamingWhereItMustBe) {
  DPAR_REQUIRE_GPU();
  Engine e(make_mlp(13, 0.0f), adam(), devices(DeviceKind::kCpu, {0}));
  Batch b = make_batch(4, 1);
  Tensor on_gpu = on(b.x, Device{DeviceKind::kCuda, 0});
  try {
    e.train_step(on_gpu, b.y);
    FAIL() << "a GPU input was accepted by a CPU engine";
  } catch (const Error& err) {
    EXPECT_EQ(err.status(), Status::kInvalidArgument);
    EXPECT_NE(std::string(err.what()).find("input is on cuda:0"), std::string::npos) << err.what();
    EXPECT_NE(std::string(err.what()).find("host memory"), std::string::npos) << err.what();
  }
  e.train_step(b.x, b.y);  // and the engine goes on
}

// The reproducible mode runs where the backend has its kernels (the fixed point's, and the fill of a non-finite
// gradient): the CUDA backend lacks them, says why, and set_reproducible refuses naming the kernel, the device and
// the reason, the engine unchanged.
TEST(CudaEngine, TheReproducibleModeIsRefusedForTheKernelsTheBackendLacks) {
  DPAR_REQUIRE_GPU();
  auto stream = cuda_backend().open_stream(Device{DeviceKind::kCuda, 0});
  for (Op op : {Op::kMaxExponent, Op::kToGrid, Op::kFromGrid, Op::kFill}) {
    EXPECT_FALSE(stream->supports({op, DType::kF32})) << op_name(op);
    EXPECT_FALSE(stream->can_run({op, DType::kF32})) << op_name(op);
    EXPECT_NE(stream->lacks_why({op, DType::kF32}).find("has no CUDA kernel yet"), std::string::npos) << op_name(op);
  }
  Engine e(make_mlp(13, 0.0f), adam(), devices(DeviceKind::kCuda, {0}));
  try {
    e.set_reproducible(4);
    FAIL() << "the reproducible mode was accepted on a GPU";
  } catch (const Error& err) {
    EXPECT_EQ(err.status(), Status::kNotSupported);
    EXPECT_NE(std::string(err.what()).find("set_reproducible: the reproducible mode needs the kernel max_exponent "
                                           "(f32), which cuda:0's backend does not have (the reproducible mode's "
                                           "fixed point has no CUDA kernel yet)"),
              std::string::npos)
        << err.what();
  }
  EXPECT_EQ(e.reproducible(), 0);
  Batch b = make_batch(4, 1);
  e.train_step(b.x, b.y);  // and the engine goes on
}

// BatchNorm1d (affine and not), plain and converted to SyncBatchNorm (its f64 sums through the device group of the
// replicas sharing the GPU), on two replicas sharing the GPU against two CPU devices: the same chunks, so the same
// per-chunk (or, synced, whole-batch) statistics; parameters and running statistics within rounding, the counters
// exact.
TEST(CudaEngine, BatchNormOnTwoGpuReplicasEqualsTwoCpuDevices) {
  DPAR_REQUIRE_GPU();
  for (bool sync : {false, true}) {
    SCOPED_TRACE(sync ? "SyncBatchNorm" : "BatchNorm1d");
    Model m(21);
    m.add(make_linear(12, 16, false));
    m.add(make_batchnorm(1, 16, 1e-5f, 0.1f, true));
    m.add(make_activation(Activation::kTanh));
    m.add(make_linear(16, 8, false));
    m.add(make_batchnorm(1, 8, 1e-5f, 0.3f, false));
    m.add(make_linear(8, 5, true));
    if (sync) m.convert_sync_batchnorm();
    OptimizerConfig sgd;
    sgd.lr = 0.05f;
    sgd.momentum = 0.9f;
    const auto d = data(29);  // 15 and 14 rows a replica
    Engine cpu(m, sgd, devices(DeviceKind::kCpu, {0, 1}));
    Engine gpu(m, sgd, devices(DeviceKind::kCuda, {0, 0}));
    constexpr int kSteps = 8;
    train(cpu, d, kSteps);
    train(gpu, d, kSteps);
    EXPECT_LT(max_relative_error(gpu.params(0), cpu.params(0)), 1e-4);
    EXPECT_GT(max_relative_error(gpu.params(0), m.values()), 1e-3) << "training did not move the parameters";
    for (size_t i = 0; i < m.buffers().size(); ++i) {
      const BufferInfo& b = m.buffers()[i];
      SCOPED_TRACE(b.name);
      if (b.dtype == DType::kI64) {
        int64_t got = 0, want = 0;
        gpu.read_buffer(&got, 0, i);
        cpu.read_buffer(&want, 0, i);
        EXPECT_EQ(got, kSteps);
        EXPECT_EQ(want, kSteps);
        continue;
      }
      std::vector<float> got(static_cast<size_t>(buffer_numel(b.shape))), want(got.size()), other(got.size());
      gpu.read_buffer(got.data(), 0, i);
      gpu.read_buffer(other.data(), 1, i);
      cpu.read_buffer(want.data(), 0, i);
      EXPECT_LT(max_relative_error(got, want), 1e-4);
      EXPECT_EQ(other, got) << "replica 1 holds replica 0's running statistics";
    }
    EXPECT_EQ(gpu.params(1), gpu.params(0));
  }
}

// Embedding (with a padding row) -> LayerNorm -> Flatten -> Linear over (B, T) int32 tokens, on two replicas sharing
// the GPU against two CPU devices; an index out of range is refused before the step, as on the CPU.
TEST(CudaEngine, EmbeddingAndLayerNormOnTwoGpuReplicasEqualTwoCpuDevices) {
  DPAR_REQUIRE_GPU();
  constexpr int64_t kVocab = 11, kDim = 6, kSeq = 4;
  Model m(23);
  m.add(make_embedding(kVocab, kDim, 1));
  m.add(make_layernorm(kDim, 1e-5f, true));
  m.add_flatten();
  m.add(make_linear(kSeq * kDim, 5, true));
  std::vector<Batch> d;
  for (uint32_t k = 0; k < 3; ++k) {
    std::mt19937 gen(70 + k);
    const int64_t rows = 13;
    Batch b{Tensor::empty(DType::kI32, Shape{rows, kSeq}, Device{}), Tensor::empty(DType::kI32, Shape{rows}, Device{})};
    for (int64_t i = 0; i < rows * kSeq; ++i) b.x.i32()[i] = static_cast<int32_t>(gen() % kVocab);  // repeats
    for (int64_t i = 0; i < rows; ++i) b.y.i32()[i] = static_cast<int32_t>(gen() % 5);
    d.push_back(std::move(b));
  }
  OptimizerConfig sgd;
  sgd.lr = 0.1f;
  Engine cpu(m, sgd, devices(DeviceKind::kCpu, {0, 1}));
  Engine gpu(m, sgd, devices(DeviceKind::kCuda, {0, 0}));
  train(cpu, d, 6);
  train(gpu, d, 6);
  EXPECT_LT(max_relative_error(gpu.params(0), cpu.params(0)), 1e-4);
  EXPECT_GT(max_relative_error(gpu.params(0), m.values()), 1e-3) << "training did not move the parameters";
  EXPECT_EQ(gpu.params(1), gpu.params(0));
  const auto before = gpu.params(0);
  Batch bad{on(d[0].x, Device{}), d[0].y};
  bad.x.i32()[6] = static_cast<int32_t>(kVocab);
  try {
    gpu.train_step(bad.x, bad.y);
    FAIL() << "an index out of range was accepted";
  } catch (const Error& err) {
    EXPECT_EQ(err.status(), Status::kInvalidArgument);
    EXPECT_NE(std::string(err.what()).find("index 11 at position (1, 2) is out of range [0, 11)"), std::string::npos)
        << err.what();
  }
  EXPECT_EQ(gpu.params(0), before) << "a refused step changed nothing";
}

}  // namespace
}  // namespace dpar
