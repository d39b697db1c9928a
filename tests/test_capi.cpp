// The C ABI's promise that bad input gets a clear error and loses nothing, through dpar.h alone.
//
// For every entry point: NULL, freed, foreign and wrong-type handles; NULL pointers; values out of range; malformed
// option structs. Each refusal must return the documented status with a message (dpar_last_error()) that names
// the argument, and must leave the object usable and unchanged: an engine that saw a refused call trains to exactly
// the parameters of one that never saw it. Also: versions and status names, the thread-local error message,
// devices, checkpoints, the IDX dataset and its loader, and the engine's lock.
//
// Not here: custom layers (test_custom_layer.cpp), numerical equivalence and fault injection (test_engine.cpp).
#include <gtest/gtest.h>

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <tuple>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "dpar.h"
#include "require_gpu.h"

namespace {

// =================================================================================================================
// Helpers
// =================================================================================================================

// `got` is `want`, and the calling thread's last error is non-empty and mentions `word`.
::testing::AssertionResult IsDparError(dpar_status got, dpar_status want, const std::string& word) {
  const char* message = dpar_last_error();
  if (got != want)
    return ::testing::AssertionFailure() << "returned " << dpar_status_str(got) << ", expected "
                                         << dpar_status_str(want) << " (message: \""
                                         << (message ? message : "(null)") << "\")";
  if (message == nullptr) return ::testing::AssertionFailure() << "dpar_last_error() is NULL";
  if (message[0] == '\0') return ::testing::AssertionFailure() << "the error message is empty";
  if (std::string(message).find(word) == std::string::npos)
    return ::testing::AssertionFailure() << "the message \"" << message << "\" does not mention \"" << word << "\"";
  return ::testing::AssertionSuccess();
}

// The call (the variadic part, so that braces with commas need no parentheses) fails with `want` and a message
// that mentions `word`. The message is cleared first, so a stale one cannot pass.
#define EXPECT_DPAR_ERROR(want, word, ...)                                            \
  do {                                                                                \
    dpar_clear_error();                                                               \
    const dpar_status status_ = (__VA_ARGS__);                                        \
    EXPECT_TRUE(IsDparError(status_, (want), (word))) << "  call: " << #__VA_ARGS__;  \
  } while (0)

#define EXPECT_INVALID(word, ...) EXPECT_DPAR_ERROR(DPAR_ERR_INVALID_ARGUMENT, word, __VA_ARGS__)

#define ASSERT_OK(...)                                                                                    \
  do {                                                                                                    \
    const dpar_status status_ = (__VA_ARGS__);                                                            \
    ASSERT_EQ(status_, DPAR_OK) << #__VA_ARGS__ << ": " << dpar_status_str(status_) << ": " << dpar_last_error(); \
  } while (0)

#define EXPECT_OK(...)                                                                                    \
  do {                                                                                                    \
    const dpar_status status_ = (__VA_ARGS__);                                                            \
    EXPECT_EQ(status_, DPAR_OK) << #__VA_ARGS__ << ": " << dpar_status_str(status_) << ": " << dpar_last_error(); \
  } while (0)

// A list of calls that must all be refused the same way; the name says which one failed.
struct NamedCall {
  std::string name;
  std::function<dpar_status()> call;
};

void ExpectAllRefused(const std::vector<NamedCall>& calls, dpar_status want, const std::string& word) {
  for (const NamedCall& c : calls) {
    SCOPED_TRACE(c.name);
    dpar_clear_error();
    const dpar_status got = c.call();
    EXPECT_TRUE(IsDparError(got, want, word)) << "  call: " << c.name;
  }
}

// Owning handles.
struct Free {
  void operator()(dpar_tensor* p) const { dpar_tensor_free(p); }
  void operator()(dpar_model* p) const { dpar_model_free(p); }
  void operator()(dpar_engine* p) const { dpar_engine_free(p); }
  void operator()(dpar_dataset* p) const { dpar_dataset_free(p); }
  void operator()(dpar_loader* p) const { dpar_loader_free(p); }
};
using TensorPtr = std::unique_ptr<dpar_tensor, Free>;
using ModelPtr = std::unique_ptr<dpar_model, Free>;
using EnginePtr = std::unique_ptr<dpar_engine, Free>;
using DatasetPtr = std::unique_ptr<dpar_dataset, Free>;
using LoaderPtr = std::unique_ptr<dpar_loader, Free>;

// A pointer that is neither NULL nor a dpar handle: a refused create must overwrite it with NULL.
template <class H>
H* Sentinel() {
  static int storage = 0;
  return reinterpret_cast<H*>(&storage);
}

dpar_device Cpu(int32_t index = 0) { return dpar_device{DPAR_DEVICE_CPU, index}; }
dpar_device Cuda(int32_t index = 0) { return dpar_device{DPAR_DEVICE_CUDA, index}; }

// How this library refuses a CUDA device that cannot be used: NOT_SUPPORTED in a build without CUDA, DEVICE in a
// CUDA build on a machine without a GPU (its message says why), and an index past the last GPU where there are some.
struct CudaRefusal {
  dpar_status status;
  const char* word;
  int32_t index;  // a device index that is refused
};
CudaRefusal cuda_refusal() {
  size_t n = 0;
  const dpar_status s = dpar_device_count(&n, DPAR_DEVICE_CUDA);
  if (s == DPAR_ERR_NOT_SUPPORTED) return {DPAR_ERR_NOT_SUPPORTED, "built without CUDA", 0};
  if (n == 0) return {DPAR_ERR_DEVICE, "no cuda device", 0};
  return {DPAR_ERR_INVALID_ARGUMENT, "out of range", static_cast<int32_t>(n)};
}

// The standard model: linear 4 -> 3 with bias, 15 parameter elements.
constexpr int64_t kIn = 4;
constexpr int64_t kOut = 3;
constexpr size_t kParams = kIn * kOut + kOut;
constexpr int64_t kRows = 6;

TensorPtr NewTensor(int32_t dtype, const std::vector<int64_t>& shape) {
  dpar_tensor* t = nullptr;
  EXPECT_OK(dpar_tensor_create(&t, dtype, shape.data(), shape.size(), Cpu()));
  return TensorPtr(t);
}

TensorPtr F32(const std::vector<int64_t>& shape, const std::vector<float>& values) {
  TensorPtr t = NewTensor(DPAR_F32, shape);
  EXPECT_OK(dpar_tensor_copy_from_host(t.get(), values.data(), values.size() * sizeof(float)));
  return t;
}

TensorPtr I32(const std::vector<int64_t>& shape, const std::vector<int32_t>& values) {
  TensorPtr t = NewTensor(DPAR_I32, shape);
  EXPECT_OK(dpar_tensor_copy_from_host(t.get(), values.data(), values.size() * sizeof(int32_t)));
  return t;
}

std::vector<float> Inputs(int64_t rows, int64_t features, int salt = 0) {
  std::vector<float> x(static_cast<size_t>(rows * features));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(static_cast<int>((i * 7 + salt * 5) % 11) - 5) / 5.0f;
  return x;
}

std::vector<int32_t> Labels(int64_t rows, int32_t classes, int salt = 0) {
  std::vector<int32_t> y(static_cast<size_t>(rows));
  for (size_t i = 0; i < y.size(); ++i) y[i] = static_cast<int32_t>((i + static_cast<size_t>(salt)) % classes);
  return y;
}

// A classification batch for the standard model: (rows, 4) f32 inputs and (rows) i32 labels in [0, 3).
struct Batch {
  TensorPtr x, y;
};
Batch MakeBatch(int64_t rows = kRows, int salt = 0) {
  return Batch{F32({rows, kIn}, Inputs(rows, kIn, salt)), I32({rows}, Labels(rows, kOut, salt))};
}

ModelPtr LinearModel(uint64_t seed = 7, int64_t in = kIn, int64_t out = kOut) {
  dpar_model_options opts = DPAR_MODEL_OPTIONS_INIT;
  opts.seed = seed;
  dpar_model* m = nullptr;
  EXPECT_OK(dpar_model_create(&m, &opts));
  EXPECT_OK(dpar_model_add_linear(m, in, out, 1));
  return ModelPtr(m);
}

// SGD with momentum, so that optimizer state matters (checkpoints, "loses nothing").
dpar_optimizer_options SgdMomentum() {
  dpar_optimizer_options o = DPAR_OPTIMIZER_OPTIONS_INIT;
  o.lr = 0.1f;
  o.momentum = 0.9f;
  return o;
}

EnginePtr NewEngine(const dpar_model* model, size_t devices, int32_t loss = DPAR_LOSS_CROSS_ENTROPY,
                    const dpar_optimizer_options& optimizer = SgdMomentum()) {
  dpar_engine_options opts = DPAR_ENGINE_OPTIONS_INIT;
  opts.num_cpu_devices = devices;
  opts.loss = loss;
  opts.timeout_seconds = 60;
  dpar_engine* e = nullptr;
  EXPECT_OK(dpar_engine_create(&e, model, &optimizer, &opts));
  return EnginePtr(e);
}

std::vector<float> Params(dpar_engine* e, size_t replica = 0, size_t count = kParams) {
  std::vector<float> p(count, std::numeric_limits<float>::quiet_NaN());
  EXPECT_OK(dpar_engine_get_params(p.data(), e, replica, count));
  return p;
}

std::vector<float> ModelParams(const dpar_model* m) {
  size_t n = 0;
  EXPECT_OK(dpar_model_num_param_elements(&n, m));
  size_t count = 0;
  EXPECT_OK(dpar_model_num_params(&count, m));
  std::vector<float> all;
  for (size_t i = 0; i < count; ++i) {
    int64_t shape[DPAR_MAX_DIMS] = {0, 0, 0, 0};
    size_t ndim = 0;
    EXPECT_OK(dpar_model_param_info(shape, &ndim, m, i));
    int64_t numel = 1;
    for (size_t d = 0; d < ndim; ++d) numel *= shape[d];
    std::vector<float> p(static_cast<size_t>(numel));
    EXPECT_OK(dpar_model_get_param(p.data(), m, i, p.size()));
    all.insert(all.end(), p.begin(), p.end());
  }
  EXPECT_EQ(all.size(), static_cast<size_t>(n));
  return all;
}

size_t StepCount(const dpar_engine* e) {
  size_t n = 12345;
  EXPECT_OK(dpar_engine_step_count(&n, e));
  return n;
}

size_t NumLayers(const dpar_model* m) {
  size_t n = 12345;
  EXPECT_OK(dpar_model_num_layers(&n, m));
  return n;
}

template <class T>
std::vector<T> ToHost(const dpar_tensor* t, size_t count) {
  std::vector<T> v(count);
  EXPECT_OK(dpar_tensor_copy_to_host(v.data(), t, count * sizeof(T)));
  return v;
}

std::vector<int64_t> ShapeOf(const dpar_tensor* t) {
  int64_t shape[DPAR_MAX_DIMS] = {0, 0, 0, 0};
  size_t ndim = 0;
  EXPECT_OK(dpar_tensor_shape(shape, &ndim, t, DPAR_MAX_DIMS));
  return std::vector<int64_t>(shape, shape + std::min<size_t>(ndim, DPAR_MAX_DIMS));
}

// Bit-for-bit equality of parameter vectors (EXPECT_EQ on floats would accept -0 == 0 and refuse NaN == NaN).
::testing::AssertionResult SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes " << a.size() << " and " << b.size();
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0)
      return ::testing::AssertionFailure() << "element " << i << ": " << a[i] << " vs " << b[i];
  return ::testing::AssertionSuccess();
}

// A fresh directory, removed with its content at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::random_device rd;
    for (int attempt = 0; attempt < 100; ++attempt) {
      path_ = std::filesystem::temp_directory_path() / ("dpar_test_capi_" + std::to_string(rd()));
      if (std::filesystem::create_directory(path_)) return;
    }
    ADD_FAILURE() << "cannot create a temporary directory";
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << path;
}

// An IDX file: big-endian u32 magic, big-endian u32 extents, u8 data.
void WriteIdx(const std::string& path, uint32_t magic, const std::vector<uint32_t>& dims,
              const std::vector<uint8_t>& data) {
  std::string bytes;
  auto be32 = [&](uint32_t v) {
    for (int shift = 24; shift >= 0; shift -= 8) bytes.push_back(static_cast<char>((v >> shift) & 0xffu));
  };
  be32(magic);
  for (uint32_t d : dims) be32(d);
  bytes.append(data.begin(), data.end());
  WriteFile(path, bytes);
}

// =================================================================================================================
// Versions, status names and the last error
// =================================================================================================================

TEST(Version, RuntimeAgreesWithTheHeader) {
  EXPECT_EQ(dpar_version(), DPAR_VERSION);
  EXPECT_EQ(dpar_version(), DPAR_VERSION_MAJOR * 10000 + DPAR_VERSION_MINOR * 100 + DPAR_VERSION_PATCH);
  ASSERT_NE(dpar_version_string(), nullptr);
  const std::string expected = std::to_string(DPAR_VERSION_MAJOR) + "." + std::to_string(DPAR_VERSION_MINOR) + "." +
                               std::to_string(DPAR_VERSION_PATCH);
  EXPECT_EQ(std::string(dpar_version_string()), expected);
  EXPECT_EQ(dpar_version_string(), dpar_version_string()) << "static storage: the same pointer every time";
}

TEST(Status, EveryCodeHasItsNameAndUnknownCodesAreNamedUnknown) {
  const std::vector<std::pair<dpar_status, const char*>> names = {
      {DPAR_OK, "DPAR_OK"},
      {DPAR_ERR_INVALID_ARGUMENT, "DPAR_ERR_INVALID_ARGUMENT"},
      {DPAR_ERR_OUT_OF_MEMORY, "DPAR_ERR_OUT_OF_MEMORY"},
      {DPAR_ERR_DEVICE, "DPAR_ERR_DEVICE"},
      {DPAR_ERR_COMMUNICATION, "DPAR_ERR_COMMUNICATION"},
      {DPAR_ERR_REMOTE, "DPAR_ERR_REMOTE"},
      {DPAR_ERR_TIMEOUT, "DPAR_ERR_TIMEOUT"},
      {DPAR_ERR_MISMATCH, "DPAR_ERR_MISMATCH"},
      {DPAR_ERR_IO, "DPAR_ERR_IO"},
      {DPAR_ERR_CORRUPT, "DPAR_ERR_CORRUPT"},
      {DPAR_ERR_NOT_SUPPORTED, "DPAR_ERR_NOT_SUPPORTED"},
      {DPAR_ERR_INVALID_STATE, "DPAR_ERR_INVALID_STATE"},
      {DPAR_ERR_INTERNAL, "DPAR_ERR_INTERNAL"},
  };
  // The codes are part of the ABI: they never change.
  EXPECT_EQ(DPAR_OK, 0);
  for (size_t i = 1; i < names.size(); ++i) EXPECT_EQ(names[i].first, -static_cast<int>(i));
  for (const auto& [code, name] : names) {
    ASSERT_NE(dpar_status_str(code), nullptr);
    EXPECT_STREQ(dpar_status_str(code), name);
  }
  for (int unknown : {1, 7, 15, -13, -16}) {
    ASSERT_NE(dpar_status_str(static_cast<dpar_status>(unknown)), nullptr);
    EXPECT_STREQ(dpar_status_str(static_cast<dpar_status>(unknown)), "DPAR_ERR_UNKNOWN") << unknown;
  }
}

TEST(LastError, NeverNullAndClearedByClearError) {
  dpar_clear_error();
  ASSERT_NE(dpar_last_error(), nullptr);
  EXPECT_STREQ(dpar_last_error(), "");

  EXPECT_INVALID("out", dpar_model_create(nullptr, nullptr));
  ASSERT_NE(dpar_last_error(), nullptr);
  EXPECT_STRNE(dpar_last_error(), "");

  dpar_clear_error();
  ASSERT_NE(dpar_last_error(), nullptr);
  EXPECT_STREQ(dpar_last_error(), "");
}

TEST(LastError, IsTheLastFailureAndSurvivesSuccessfulCalls) {
  dpar_clear_error();
  EXPECT_INVALID("out", dpar_model_create(nullptr, nullptr));
  const std::string first = dpar_last_error();
  dpar_device d{};
  EXPECT_INVALID("text", dpar_device_parse(&d, nullptr));
  const std::string second = dpar_last_error();
  EXPECT_NE(first, second) << "a later failure replaces the message";

  // "" only if no call failed since the last dpar_clear_error(): a success leaves the message alone.
  ModelPtr m = LinearModel();
  size_t layers = 0;
  EXPECT_OK(dpar_model_num_layers(&layers, m.get()));
  EXPECT_EQ(std::string(dpar_last_error()), second);
}

TEST(LastError, IsThreadLocal) {
  // An error on another thread does not show up here...
  dpar_clear_error();
  std::string seen_there;
  dpar_status status_there = DPAR_OK;
  std::thread other([&] {
    dpar_clear_error();
    status_there = dpar_model_create(nullptr, nullptr);
    seen_there = dpar_last_error();
  });
  other.join();
  EXPECT_EQ(status_there, DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_NE(seen_there.find("out"), std::string::npos) << seen_there;
  EXPECT_STREQ(dpar_last_error(), "");

  // ...and an error here does not show up on a new thread, nor is it cleared by one.
  EXPECT_INVALID("out", dpar_model_create(nullptr, nullptr));
  const std::string here = dpar_last_error();
  ASSERT_FALSE(here.empty());
  std::string fresh = "not read";
  std::thread reader([&] {
    fresh = dpar_last_error();
    dpar_clear_error();
  });
  reader.join();
  EXPECT_EQ(fresh, "");
  EXPECT_EQ(std::string(dpar_last_error()), here);
}

TEST(LastError, AVeryLongMessageIsStillReported) {
  TempDir dir;
  const std::string path = dir / (std::string(3000, 'a') + ".safetensors");
  ModelPtr m = LinearModel();
  EnginePtr e = NewEngine(m.get(), 2);
  dpar_clear_error();
  EXPECT_EQ(dpar_engine_load(e.get(), path.c_str()), DPAR_ERR_IO);
  const std::string message = dpar_last_error();
  ASSERT_FALSE(message.empty());
  EXPECT_EQ(message.substr(0, 200), path.substr(0, 200)) << "the message starts with the path";
}

// =================================================================================================================
// Devices
// =================================================================================================================

TEST(Device, CountChecksItsArguments) {
  size_t n = 0;
  ASSERT_OK(dpar_device_count(&n, DPAR_DEVICE_CPU));
  EXPECT_GE(n, 1u);
  EXPECT_INVALID("out", dpar_device_count(nullptr, DPAR_DEVICE_CPU));
  // Built without CUDA: NOT_SUPPORTED; with CUDA: the number of GPUs (0 without a driver or a GPU).
  const dpar_status cuda = dpar_device_count(&n, DPAR_DEVICE_CUDA);
  if (cuda != DPAR_OK) EXPECT_DPAR_ERROR(DPAR_ERR_NOT_SUPPORTED, "CUDA", dpar_device_count(&n, DPAR_DEVICE_CUDA));
  EXPECT_INVALID("kind", dpar_device_count(&n, 2));
  EXPECT_INVALID("kind", dpar_device_count(&n, -1));
}

TEST(Device, ParseAcceptsCpuAndCudaWithOptionalIndex) {
  const struct {
    const char* text;
    int32_t kind, index;
  } good[] = {
      {"cpu:3", DPAR_DEVICE_CPU, 3},   {"cpu", DPAR_DEVICE_CPU, 0},     {"cpu:0", DPAR_DEVICE_CPU, 0},
      {"cuda:1", DPAR_DEVICE_CUDA, 1}, {"cuda", DPAR_DEVICE_CUDA, 0},   {"cpu:17", DPAR_DEVICE_CPU, 17},
  };
  for (const auto& c : good) {
    SCOPED_TRACE(c.text);
    dpar_device d{-7, -7};
    EXPECT_OK(dpar_device_parse(&d, c.text));
    EXPECT_EQ(d.kind, c.kind);
    EXPECT_EQ(d.index, c.index);
  }
}

TEST(Device, ParseRefusesMalformedTextNamingIt) {
  for (const char* text : {"gpu:0", "cpu:-1", "cpu:x", "cpu:", "CPU:1", "cpu:1:2", "cpu:3x", "cpu:99999999999",
                           "cuda:-2", "cpux"}) {
    SCOPED_TRACE(text);
    dpar_device d{-7, -7};
    EXPECT_INVALID(text, dpar_device_parse(&d, text));
    EXPECT_EQ(d.kind, -7) << "a refused parse leaves the output alone";
    EXPECT_EQ(d.index, -7);
  }
  dpar_device d{};
  EXPECT_INVALID("\"\"", dpar_device_parse(&d, ""));
  EXPECT_INVALID("out", dpar_device_parse(nullptr, "cpu:0"));
  EXPECT_INVALID("text", dpar_device_parse(&d, nullptr));
}

// =================================================================================================================
// Tensors
// =================================================================================================================

TEST(Tensor, CreateGivesAZeroFilledDescribedTensor) {
  const int64_t shape[3] = {2, 3, 4};
  dpar_tensor* raw = nullptr;
  ASSERT_OK(dpar_tensor_create(&raw, DPAR_F32, shape, 3, Cpu(1)));
  TensorPtr t(raw);
  int32_t dtype = -1;
  size_t numel = 12345;
  dpar_device device{-1, -1};
  EXPECT_OK(dpar_tensor_info(&dtype, &numel, &device, t.get()));
  EXPECT_EQ(dtype, DPAR_F32);
  EXPECT_EQ(numel, 24u);
  EXPECT_EQ(device.kind, DPAR_DEVICE_CPU);
  EXPECT_EQ(device.index, 1);
  EXPECT_EQ(ShapeOf(t.get()), (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(ToHost<float>(t.get(), 24), std::vector<float>(24, 0.0f));

  TensorPtr labels = NewTensor(DPAR_I32, {5});
  EXPECT_OK(dpar_tensor_info(&dtype, nullptr, nullptr, labels.get()));  // any output may be NULL
  EXPECT_EQ(dtype, DPAR_I32);
  EXPECT_EQ(ToHost<int32_t>(labels.get(), 5), std::vector<int32_t>(5, 0));

  // Four dimensions is the most.
  TensorPtr four = NewTensor(DPAR_F32, {1, 2, 1, 2});
  EXPECT_EQ(ShapeOf(four.get()), (std::vector<int64_t>{1, 2, 1, 2}));
}

TEST(Tensor, CreateRefusesBadArgumentsAndLeavesOutNull) {
  const int64_t shape[2] = {2, 3};
  dpar_tensor* t = nullptr;

  EXPECT_INVALID("out", dpar_tensor_create(nullptr, DPAR_F32, shape, 2, Cpu()));

  const auto expect_refused = [&](dpar_status want, const char* word, int32_t dtype, const int64_t* s, size_t ndim,
                                  dpar_device device) {
    t = Sentinel<dpar_tensor>();
    EXPECT_DPAR_ERROR(want, word, dpar_tensor_create(&t, dtype, s, ndim, device));
    EXPECT_EQ(t, nullptr) << "a refused create must set *out to NULL";
  };
  expect_refused(DPAR_ERR_INVALID_ARGUMENT, "shape", DPAR_F32, nullptr, 2, Cpu());
  expect_refused(DPAR_ERR_INVALID_ARGUMENT, "ndim", DPAR_F32, shape, 0, Cpu());
  const int64_t five[5] = {1, 1, 1, 1, 1};
  expect_refused(DPAR_ERR_INVALID_ARGUMENT, "ndim", DPAR_F32, five, 5, Cpu());
  const int64_t zero_extent[2] = {2, 0};
  expect_refused(DPAR_ERR_INVALID_ARGUMENT, "extent 1", DPAR_F32, zero_extent, 2, Cpu());
  const int64_t negative_extent[2] = {-2, 3};
  expect_refused(DPAR_ERR_INVALID_ARGUMENT, "extent 0", DPAR_F32, negative_extent, 2, Cpu());
  const int64_t huge[2] = {int64_t{1} << 31, int64_t{1} << 31};
  expect_refused(DPAR_ERR_INVALID_ARGUMENT, "too large", DPAR_F32, huge, 2, Cpu());
  for (int32_t reserved : {DPAR_BF16, DPAR_F16, DPAR_U8}) {
    SCOPED_TRACE(reserved);
    expect_refused(DPAR_ERR_NOT_SUPPORTED, "dtype", reserved, shape, 2, Cpu());
  }
  expect_refused(DPAR_ERR_INVALID_ARGUMENT, "dtype", 99, shape, 2, Cpu());
  for (int32_t collectives_only : {DPAR_F64, DPAR_I64})  // dtypes of collectives, not of tensors
    expect_refused(DPAR_ERR_NOT_SUPPORTED, "collectives", collectives_only, shape, 2, Cpu());
  expect_refused(DPAR_ERR_INVALID_ARGUMENT, "dtype", -1, shape, 2, Cpu());
  const CudaRefusal cuda = cuda_refusal();
  expect_refused(cuda.status, cuda.word, DPAR_F32, shape, 2, Cuda(cuda.index));
  expect_refused(DPAR_ERR_INVALID_ARGUMENT, "device", DPAR_F32, shape, 2, dpar_device{9, 0});
  expect_refused(DPAR_ERR_INVALID_ARGUMENT, "device", DPAR_F32, shape, 2, Cpu(-1));
}

TEST(Tensor, WrapHostSharesTheCallersMemoryAndFreeLeavesIt) {
  std::vector<float> buffer = {1, 2, 3, 4, 5, 6};
  const int64_t shape[2] = {3, 2};
  dpar_tensor* raw = nullptr;
  ASSERT_OK(dpar_tensor_wrap_host(&raw, DPAR_F32, shape, 2, buffer.data()));
  TensorPtr t(raw);
  void* data = nullptr;
  ASSERT_OK(dpar_tensor_data(&data, t.get()));
  EXPECT_EQ(data, buffer.data()) << "no copy";
  buffer[4] = 50.0f;
  EXPECT_EQ(ToHost<float>(t.get(), 6), (std::vector<float>{1, 2, 3, 4, 50, 6}));
  const std::vector<float> written = {6, 5, 4, 3, 2, 1};
  EXPECT_OK(dpar_tensor_copy_from_host(t.get(), written.data(), 6 * sizeof(float)));
  EXPECT_EQ(buffer, written);
  dpar_device device{-1, -1};
  EXPECT_OK(dpar_tensor_info(nullptr, nullptr, &device, t.get()));
  EXPECT_EQ(device.kind, DPAR_DEVICE_CPU);
  EXPECT_EQ(device.index, 0);
  t.reset();  // must not free the vector's memory: the vector's own destructor would then crash
  buffer.assign(100, 1.0f);
}

TEST(Tensor, WrapHostRefusesBadArguments) {
  std::vector<float> buffer(6);
  const int64_t shape[2] = {3, 2};
  dpar_tensor* t = nullptr;
  EXPECT_INVALID("out", dpar_tensor_wrap_host(nullptr, DPAR_F32, shape, 2, buffer.data()));
  t = Sentinel<dpar_tensor>();
  EXPECT_INVALID("data", dpar_tensor_wrap_host(&t, DPAR_F32, shape, 2, nullptr));
  EXPECT_EQ(t, nullptr);
  t = Sentinel<dpar_tensor>();
  EXPECT_INVALID("shape", dpar_tensor_wrap_host(&t, DPAR_F32, nullptr, 2, buffer.data()));
  EXPECT_EQ(t, nullptr);
  t = Sentinel<dpar_tensor>();
  EXPECT_INVALID("ndim", dpar_tensor_wrap_host(&t, DPAR_F32, shape, 0, buffer.data()));
  EXPECT_EQ(t, nullptr);
  const int64_t zero[2] = {0, 2};
  t = Sentinel<dpar_tensor>();
  EXPECT_INVALID("extent", dpar_tensor_wrap_host(&t, DPAR_F32, zero, 2, buffer.data()));
  EXPECT_EQ(t, nullptr);
  t = Sentinel<dpar_tensor>();
  EXPECT_DPAR_ERROR(DPAR_ERR_NOT_SUPPORTED, "dtype", dpar_tensor_wrap_host(&t, DPAR_BF16, shape, 2, buffer.data()));
  EXPECT_EQ(t, nullptr);
  t = Sentinel<dpar_tensor>();
  EXPECT_INVALID("dtype", dpar_tensor_wrap_host(&t, 77, shape, 2, buffer.data()));
  EXPECT_EQ(t, nullptr);
}

TEST(Tensor, CopiesCheckPointersAndByteCountsAndChangeNothingWhenRefused) {
  TensorPtr t = F32({2, 3}, {1, 2, 3, 4, 5, 6});
  const std::vector<float> before = {1, 2, 3, 4, 5, 6};
  std::vector<float> src(7, 9.0f);

  EXPECT_INVALID("tensor", dpar_tensor_copy_from_host(nullptr, src.data(), 6 * sizeof(float)));
  EXPECT_INVALID("src", dpar_tensor_copy_from_host(t.get(), nullptr, 6 * sizeof(float)));
  EXPECT_INVALID("bytes", dpar_tensor_copy_from_host(t.get(), src.data(), 5 * sizeof(float)));
  EXPECT_INVALID("bytes", dpar_tensor_copy_from_host(t.get(), src.data(), 7 * sizeof(float)));
  EXPECT_INVALID("bytes", dpar_tensor_copy_from_host(t.get(), src.data(), 0));
  EXPECT_INVALID("bytes", dpar_tensor_copy_from_host(t.get(), src.data(), 6 * sizeof(float) - 1));
  EXPECT_EQ(ToHost<float>(t.get(), 6), before) << "refused copies wrote nothing";

  std::vector<float> dst(7, -1.0f);
  EXPECT_INVALID("tensor", dpar_tensor_copy_to_host(dst.data(), nullptr, 6 * sizeof(float)));
  EXPECT_INVALID("dst", dpar_tensor_copy_to_host(nullptr, t.get(), 6 * sizeof(float)));
  EXPECT_INVALID("bytes", dpar_tensor_copy_to_host(dst.data(), t.get(), 5 * sizeof(float)));
  EXPECT_INVALID("bytes", dpar_tensor_copy_to_host(dst.data(), t.get(), 7 * sizeof(float)));
  EXPECT_EQ(dst, std::vector<float>(7, -1.0f)) << "refused copies wrote nothing";

  EXPECT_OK(dpar_tensor_copy_to_host(dst.data(), t.get(), 6 * sizeof(float)));
  EXPECT_EQ(std::vector<float>(dst.begin(), dst.begin() + 6), before);
  EXPECT_EQ(dst[6], -1.0f) << "wrote past the tensor's bytes";
}

TEST(Tensor, ShapeInfoAndDataCheckTheirArguments) {
  TensorPtr t = NewTensor(DPAR_F32, {2, 3, 5});
  int64_t shape[DPAR_MAX_DIMS] = {-1, -1, -1, -1};
  size_t ndim = 0;

  EXPECT_INVALID("tensor", dpar_tensor_shape(shape, &ndim, nullptr, DPAR_MAX_DIMS));
  EXPECT_INVALID("out_ndim", dpar_tensor_shape(shape, nullptr, t.get(), DPAR_MAX_DIMS));
  EXPECT_INVALID("capacity", dpar_tensor_shape(shape, &ndim, t.get(), 2));
  EXPECT_EQ(shape[0], -1) << "a refused call wrote no extents";
  // out_shape may be NULL to ask for ndim only.
  ndim = 0;
  EXPECT_OK(dpar_tensor_shape(nullptr, &ndim, t.get(), 0));
  EXPECT_EQ(ndim, 3u);
  EXPECT_OK(dpar_tensor_shape(shape, &ndim, t.get(), 3));
  EXPECT_EQ(shape[0], 2);
  EXPECT_EQ(shape[1], 3);
  EXPECT_EQ(shape[2], 5);
  EXPECT_EQ(shape[3], -1) << "wrote past ndim";

  EXPECT_INVALID("tensor", dpar_tensor_info(nullptr, nullptr, nullptr, nullptr));
  EXPECT_OK(dpar_tensor_info(nullptr, nullptr, nullptr, t.get()));

  void* data = Sentinel<void>();
  EXPECT_INVALID("out", dpar_tensor_data(nullptr, t.get()));
  EXPECT_INVALID("tensor", dpar_tensor_data(&data, nullptr));
  EXPECT_EQ(data, nullptr) << "a refused dpar_tensor_data sets *out to NULL";
  ASSERT_OK(dpar_tensor_data(&data, t.get()));
  ASSERT_NE(data, nullptr);
  static_cast<float*>(data)[29] = 3.5f;  // writes in place are visible
  EXPECT_EQ(ToHost<float>(t.get(), 30)[29], 3.5f);
}

TEST(Tensor, FreeAcceptsNullAndStaleHandles) {
  dpar_tensor_free(nullptr);
  dpar_tensor* t = nullptr;
  const int64_t shape[1] = {3};
  ASSERT_OK(dpar_tensor_create(&t, DPAR_F32, shape, 1, Cpu()));
  dpar_tensor_free(t);
  dpar_tensor_free(t);  // a freed handle is looked up before it is touched: a no-op
  // A handle of another type passed to dpar_tensor_free is not freed.
  ModelPtr m = LinearModel();
  dpar_tensor_free(reinterpret_cast<dpar_tensor*>(m.get()));
  EXPECT_EQ(NumLayers(m.get()), 1u);
}

// Every call that takes a tensor handle refuses a NULL, freed, foreign or wrong-type one, naming the argument.
class TensorHandleCalls {
 public:
  TensorHandleCalls() : model_(LinearModel()), engine_(NewEngine(model_.get(), 2)), batch_(MakeBatch()) {}

  std::vector<std::pair<NamedCall, std::string>> With(dpar_tensor* bad) {
    dpar_engine* e = engine_.get();
    const dpar_tensor* x = batch_.x.get();
    const dpar_tensor* y = batch_.y.get();
    return {
        {{"copy_from_host", [=, this] { return dpar_tensor_copy_from_host(bad, host_.data(), kHostBytes); }}, "tensor"},
        {{"copy_to_host", [=, this] { return dpar_tensor_copy_to_host(host_.data(), bad, kHostBytes); }}, "tensor"},
        {{"shape", [=, this] { return dpar_tensor_shape(shape_, &ndim_, bad, DPAR_MAX_DIMS); }}, "tensor"},
        {{"info", [=] { return dpar_tensor_info(nullptr, nullptr, nullptr, bad); }}, "tensor"},
        {{"data", [=, this] { return dpar_tensor_data(&data_, bad); }}, "tensor"},
        {{"train_step input", [=] { return dpar_engine_train_step(nullptr, e, bad, y); }}, "input"},
        {{"train_step target", [=] { return dpar_engine_train_step(nullptr, e, x, bad); }}, "target"},
        {{"accumulate input", [=] { return dpar_engine_accumulate(nullptr, e, bad, y); }}, "input"},
        {{"accumulate target", [=] { return dpar_engine_accumulate(nullptr, e, x, bad); }}, "target"},
        {{"forward input", [=, this] { return dpar_engine_forward(&out_, e, bad); }}, "input"},
        {{"backward grad_output", [=] { return dpar_engine_backward(e, bad); }}, "grad_output"},
    };
  }

  void Run(dpar_tensor* bad) {
    const auto reference = Params(engine_.get());
    for (auto& [c, word] : With(bad)) ExpectAllRefused({c}, DPAR_ERR_INVALID_ARGUMENT, word);
    EXPECT_EQ(out_, nullptr);
    EXPECT_EQ(data_, nullptr);
    EXPECT_EQ(StepCount(engine_.get()), 0);
    EXPECT_TRUE(SameBits(Params(engine_.get()), reference));
    EXPECT_OK(dpar_engine_train_step(nullptr, engine_.get(), batch_.x.get(), batch_.y.get()));  // still usable
  }

 private:
  ModelPtr model_;
  EnginePtr engine_;
  Batch batch_;
  static constexpr size_t kHostBytes = 4 * sizeof(float);
  std::vector<float> host_ = std::vector<float>(4, 1.0f);
  int64_t shape_[DPAR_MAX_DIMS] = {};
  size_t ndim_ = 0;
  void* data_ = Sentinel<void>();         // a refusal sets it to NULL
  dpar_tensor* out_ = Sentinel<dpar_tensor>();  // a refusal by a live engine sets it to NULL
};

TEST(TensorHandle, NullIsRefusedEverywhere) { TensorHandleCalls().Run(nullptr); }

TEST(TensorHandle, FreedIsRefusedEverywhere) {
  TensorHandleCalls calls;
  dpar_tensor* t = nullptr;
  const int64_t shape[2] = {1, 4};
  ASSERT_OK(dpar_tensor_create(&t, DPAR_F32, shape, 2, Cpu()));
  dpar_tensor_free(t);
  calls.Run(t);
}

TEST(TensorHandle, WrongTypeIsRefusedEverywhere) {
  TensorHandleCalls calls;
  ModelPtr m = LinearModel();
  calls.Run(reinterpret_cast<dpar_tensor*>(m.get()));
  EXPECT_EQ(NumLayers(m.get()), 1u) << "the model was not touched";
}

TEST(TensorHandle, ForeignPointerIsRefusedEverywhere) {
  TensorHandleCalls calls;
  alignas(64) unsigned char not_a_tensor[256] = {};
  calls.Run(reinterpret_cast<dpar_tensor*>(not_a_tensor));
}

// =================================================================================================================
// Models
// =================================================================================================================

TEST(Model, OptionsInitGivesTheMacroDefaults) {
  EXPECT_INVALID("opts", dpar_model_options_init(nullptr));
  dpar_model_options o;
  std::memset(&o, 0xab, sizeof o);
  ASSERT_OK(dpar_model_options_init(&o));
  const dpar_model_options macro = DPAR_MODEL_OPTIONS_INIT;
  EXPECT_EQ(o.size, sizeof(dpar_model_options));
  EXPECT_EQ(o.version, static_cast<unsigned>(DPAR_MODEL_OPTIONS_VERSION));
  EXPECT_EQ(o.seed, 0u);
  EXPECT_EQ(o.size, macro.size);
  EXPECT_EQ(o.version, macro.version);
  EXPECT_EQ(o.seed, macro.seed);
}

TEST(Model, CreateRefusesBadOptionsAndLeavesOutNull) {
  EXPECT_INVALID("out", dpar_model_create(nullptr, nullptr));
  const auto refused = [](const char* word, size_t size, unsigned version) {
    dpar_model_options o = DPAR_MODEL_OPTIONS_INIT;
    o.size = size;
    o.version = version;
    dpar_model* m = Sentinel<dpar_model>();
    EXPECT_INVALID(word, dpar_model_create(&m, &o));
    EXPECT_INVALID("opts", dpar_model_create(&m, &o));
    EXPECT_EQ(m, nullptr);
  };
  refused("version", sizeof(dpar_model_options), 0);
  refused("version", sizeof(dpar_model_options), DPAR_MODEL_OPTIONS_VERSION + 1);
  refused("version", sizeof(dpar_model_options), 0xffffffffu);
  refused("size", 0, DPAR_MODEL_OPTIONS_VERSION);
  refused("size", sizeof(dpar_model_options) - 1, DPAR_MODEL_OPTIONS_VERSION);
  refused("size", sizeof(size_t) + sizeof(unsigned), DPAR_MODEL_OPTIONS_VERSION);
}

TEST(Model, NullOptionsAreTheDefaultsAndTheSeedMatters) {
  dpar_model* raw = nullptr;
  ASSERT_OK(dpar_model_create(&raw, nullptr));
  ModelPtr defaults(raw);
  ASSERT_OK(dpar_model_add_linear(defaults.get(), kIn, kOut, 1));
  ModelPtr seed0 = LinearModel(0);
  ModelPtr seed1 = LinearModel(1);
  EXPECT_TRUE(SameBits(ModelParams(defaults.get()), ModelParams(seed0.get())));
  EXPECT_FALSE(SameBits(ModelParams(seed0.get()), ModelParams(seed1.get())));
  // PyTorch's nn.Linear initialisation: uniform in +-1/sqrt(in_features) = +-0.5.
  for (float v : ModelParams(seed1.get())) EXPECT_LE(std::fabs(v), 0.5f);
}

TEST(Model, ConvolutionAndPoolingLayersAreCheckedAndTrainOn4DInputs) {
  dpar_model_options mo = DPAR_MODEL_OPTIONS_INIT;
  mo.seed = 3;
  dpar_model* raw = nullptr;
  ASSERT_OK(dpar_model_create(&raw, &mo));
  ModelPtr m(raw);
  const int64_t k3[2] = {3, 3}, k2[2] = {2, 2}, one[2] = {1, 1}, two[2] = {2, 2}, zero[2] = {0, 0};
  // NULL stride, padding and dilation are PyTorch's defaults.
  ASSERT_OK(dpar_model_add_conv2d(m.get(), 1, 4, k3, nullptr, one, nullptr, 1, 1));
  ASSERT_OK(dpar_model_add_activation(m.get(), DPAR_RELU));
  ASSERT_OK(dpar_model_add_max_pool2d(m.get(), k2, nullptr, nullptr));   // stride = kernel: (B,4,4,4)
  ASSERT_OK(dpar_model_add_conv2d(m.get(), 4, 4, k3, two, one, one, 4, 0));  // depthwise, no bias: (B,4,2,2)
  ASSERT_OK(dpar_model_add_avg_pool2d(m.get(), k2, one, one));           // (B,4,3,3)
  ASSERT_OK(dpar_model_add_adaptive_avg_pool2d(m.get(), 1, 1));          // (B,4,1,1)
  size_t layers = 0, params = 0;
  ASSERT_OK(dpar_model_num_layers(&layers, m.get()));
  ASSERT_OK(dpar_model_num_params(&params, m.get()));
  EXPECT_EQ(layers, 6u);
  ASSERT_EQ(params, 3u);
  EXPECT_STREQ(dpar_model_param_name(m.get(), 0), "0.weight");
  EXPECT_STREQ(dpar_model_param_name(m.get(), 1), "0.bias");
  EXPECT_STREQ(dpar_model_param_name(m.get(), 2), "3.weight");
  int64_t shape[DPAR_MAX_DIMS] = {0, 0, 0, 0};
  size_t ndim = 0;
  ASSERT_OK(dpar_model_param_info(shape, &ndim, m.get(), 2));
  EXPECT_EQ(ndim, 4u);
  EXPECT_EQ(std::vector<int64_t>(shape, shape + 4), (std::vector<int64_t>{4, 1, 3, 3}));
  for (float v : ModelParams(m.get())) EXPECT_LE(std::fabs(v), 1.0f / 3.0f);  // +-1/sqrt(1*3*3)

  // Refusals name the argument and add nothing.
  const int64_t bad[2] = {3, 0}, negative[2] = {-1, 0};
  EXPECT_INVALID("model", dpar_model_add_conv2d(nullptr, 1, 4, k3, nullptr, nullptr, nullptr, 1, 1));
  EXPECT_INVALID("kernel_size", dpar_model_add_conv2d(m.get(), 1, 4, nullptr, nullptr, nullptr, nullptr, 1, 1));
  EXPECT_INVALID("kernel_size[1]", dpar_model_add_conv2d(m.get(), 1, 4, bad, nullptr, nullptr, nullptr, 1, 1));
  EXPECT_INVALID("stride[1]", dpar_model_add_conv2d(m.get(), 1, 4, k3, bad, nullptr, nullptr, 1, 1));
  EXPECT_INVALID("padding[0]", dpar_model_add_conv2d(m.get(), 1, 4, k3, nullptr, negative, nullptr, 1, 1));
  EXPECT_INVALID("dilation[1]", dpar_model_add_conv2d(m.get(), 1, 4, k3, nullptr, nullptr, bad, 1, 1));
  EXPECT_INVALID("in_channels", dpar_model_add_conv2d(m.get(), 0, 4, k3, nullptr, nullptr, nullptr, 1, 1));
  EXPECT_INVALID("groups", dpar_model_add_conv2d(m.get(), 4, 4, k3, nullptr, nullptr, nullptr, 0, 1));
  EXPECT_INVALID("divisible by groups", dpar_model_add_conv2d(m.get(), 4, 6, k3, nullptr, nullptr, nullptr, 4, 1));
  EXPECT_INVALID("model", dpar_model_add_max_pool2d(nullptr, k2, nullptr, nullptr));
  EXPECT_INVALID("kernel_size", dpar_model_add_max_pool2d(m.get(), nullptr, nullptr, nullptr));
  EXPECT_INVALID("at most half the kernel", dpar_model_add_avg_pool2d(m.get(), k2, nullptr, two));
  EXPECT_INVALID("stride[1]", dpar_model_add_avg_pool2d(m.get(), k2, bad, zero));
  EXPECT_INVALID("model", dpar_model_add_adaptive_avg_pool2d(nullptr, 1, 1));
  EXPECT_INVALID("output_h", dpar_model_add_adaptive_avg_pool2d(m.get(), 0, 1));
  EXPECT_DPAR_ERROR(DPAR_ERR_NOT_SUPPORTED, "only 1x1", dpar_model_add_adaptive_avg_pool2d(m.get(), 2, 2));
  ASSERT_OK(dpar_model_num_layers(&layers, m.get()));
  EXPECT_EQ(layers, 6u);

  // An engine on 2 CPU devices takes (B,1,8,8) inputs, refuses other channel counts naming the layer, and learns.
  EnginePtr e = NewEngine(m.get(), 2, DPAR_LOSS_MSE);
  const int64_t rows = 5;
  TensorPtr x = F32({rows, 1, 8, 8}, Inputs(rows, 64));
  TensorPtr y = F32({rows, 4, 1, 1}, Inputs(rows, 4, 1));
  TensorPtr wrong = F32({rows, 2, 8, 8}, Inputs(rows, 128));
  EXPECT_INVALID("expects 1 input channels", dpar_engine_train_step(nullptr, e.get(), wrong.get(), y.get()));
  float first = 0, loss = 0;
  ASSERT_OK(dpar_engine_train_step(&first, e.get(), x.get(), y.get()));
  for (int s = 0; s < 20; ++s) ASSERT_OK(dpar_engine_train_step(&loss, e.get(), x.get(), y.get()));
  EXPECT_LT(loss, first);
  dpar_tensor* out = nullptr;
  ASSERT_OK(dpar_engine_forward(&out, e.get(), x.get()));
  TensorPtr out_owned(out);
  int64_t out_shape[DPAR_MAX_DIMS] = {0, 0, 0, 0};
  ASSERT_OK(dpar_tensor_shape(out_shape, &ndim, out, DPAR_MAX_DIMS));
  EXPECT_EQ(std::vector<int64_t>(out_shape, out_shape + ndim), (std::vector<int64_t>{rows, 4, 1, 1}));
}

TEST(Model, LayerArgumentsAreCheckedAndRefusalsAddNothing) {
  ModelPtr m = LinearModel();
  const std::vector<float> before = ModelParams(m.get());

  EXPECT_INVALID("model", dpar_model_add_linear(nullptr, 4, 3, 1));
  EXPECT_INVALID("in_features", dpar_model_add_linear(m.get(), 0, 3, 1));
  EXPECT_INVALID("in_features", dpar_model_add_linear(m.get(), -4, 3, 1));
  EXPECT_INVALID("out_features", dpar_model_add_linear(m.get(), 3, 0, 0));
  EXPECT_INVALID("out_features", dpar_model_add_linear(m.get(), 3, (int64_t{1} << 24) + 1, 0));

  EXPECT_INVALID("model", dpar_model_add_activation(nullptr, DPAR_RELU));
  EXPECT_INVALID("activation", dpar_model_add_activation(m.get(), DPAR_SILU + 1));
  EXPECT_INVALID("activation", dpar_model_add_activation(m.get(), -1));

  EXPECT_INVALID("model", dpar_model_add_dropout(nullptr, 0.5f));
  EXPECT_INVALID("dropout probability", dpar_model_add_dropout(m.get(), 1.0f));
  EXPECT_INVALID("dropout probability", dpar_model_add_dropout(m.get(), -0.1f));
  EXPECT_INVALID("dropout probability", dpar_model_add_dropout(m.get(), std::nanf("")));

  EXPECT_INVALID("layer", dpar_custom_layer_init(nullptr));
  dpar_custom_layer layer;
  ASSERT_OK(dpar_custom_layer_init(&layer));
  EXPECT_EQ(layer.size, sizeof(dpar_custom_layer));
  EXPECT_EQ(layer.version, static_cast<unsigned>(DPAR_CUSTOM_LAYER_VERSION));
  EXPECT_EQ(layer.forward, nullptr);
  EXPECT_INVALID("model", dpar_model_add_custom(nullptr, &layer));
  EXPECT_INVALID("layer", dpar_model_add_custom(m.get(), nullptr));
  layer.size = 0;
  EXPECT_INVALID("size", dpar_model_add_custom(m.get(), &layer));

  EXPECT_EQ(NumLayers(m.get()), 1u) << "refused calls added no layer";
  size_t params = 0;
  EXPECT_OK(dpar_model_num_params(&params, m.get()));
  EXPECT_EQ(params, 2u);
  EXPECT_TRUE(SameBits(ModelParams(m.get()), before));

  // Boundary values that are allowed.
  EXPECT_OK(dpar_model_add_dropout(m.get(), 0.0f));
  EXPECT_OK(dpar_model_add_activation(m.get(), DPAR_SILU));
  EXPECT_OK(dpar_model_add_linear(m.get(), kOut, 1, 0));
  EXPECT_EQ(NumLayers(m.get()), 4u);
}

TEST(Model, QueriesRefuseNullOutputsAndHandles) {
  ModelPtr m = LinearModel();
  size_t n = 0;
  size_t elements = 0;
  EXPECT_INVALID("out", dpar_model_num_layers(nullptr, m.get()));
  EXPECT_INVALID("out", dpar_model_num_params(nullptr, m.get()));
  EXPECT_INVALID("out", dpar_model_num_param_elements(nullptr, m.get()));
  EXPECT_INVALID("model", dpar_model_num_layers(&n, nullptr));
  EXPECT_INVALID("model", dpar_model_num_params(&n, nullptr));
  EXPECT_INVALID("model", dpar_model_num_param_elements(&elements, nullptr));
  EXPECT_OK(dpar_model_num_param_elements(&elements, m.get()));
  EXPECT_EQ(elements, static_cast<size_t>(kParams));
}

TEST(Model, ParamInfoGivesStateDictNamesAndChecksTheIndex) {
  dpar_model* raw = nullptr;
  ASSERT_OK(dpar_model_create(&raw, nullptr));
  ModelPtr m(raw);
  ASSERT_OK(dpar_model_add_linear(m.get(), 4, 5, 1));
  ASSERT_OK(dpar_model_add_activation(m.get(), DPAR_RELU));
  ASSERT_OK(dpar_model_add_linear(m.get(), 5, 2, 0));
  size_t count = 0;
  ASSERT_OK(dpar_model_num_params(&count, m.get()));
  ASSERT_EQ(count, 3u);

  const struct {
    const char* name;
    std::vector<int64_t> shape;
  } expected[] = {{"0.weight", {5, 4}}, {"0.bias", {5}}, {"2.weight", {2, 5}}};
  for (size_t i = 0; i < count; ++i) {
    int64_t shape[DPAR_MAX_DIMS] = {};
    size_t ndim = 0;
    ASSERT_OK(dpar_model_param_info(shape, &ndim, m.get(), i));
    const char* name = dpar_model_param_name(m.get(), i);
    ASSERT_NE(name, nullptr) << dpar_last_error();
    EXPECT_STREQ(name, expected[i].name);
    EXPECT_EQ(std::vector<int64_t>(shape, shape + ndim), expected[i].shape);
  }
  EXPECT_OK(dpar_model_param_info(nullptr, nullptr, m.get(), 0));  // all outputs may be NULL
  int64_t shape[DPAR_MAX_DIMS] = {-7, -7, -7, -7};
  EXPECT_INVALID("index", dpar_model_param_info(shape, nullptr, m.get(), 3));
  EXPECT_INVALID("index", dpar_model_param_info(shape, nullptr, m.get(), SIZE_MAX));
  EXPECT_EQ(shape[0], -7);
  EXPECT_INVALID("model", dpar_model_param_info(nullptr, nullptr, nullptr, 0));
  // The name is borrowed and returned directly: NULL, with a message, for a bad index or model.
  dpar_clear_error();
  EXPECT_EQ(dpar_model_param_name(m.get(), 3), nullptr);
  EXPECT_NE(std::string(dpar_last_error()).find("index"), std::string::npos) << dpar_last_error();
  EXPECT_EQ(dpar_model_param_name(nullptr, 0), nullptr);
  EXPECT_NE(std::string(dpar_last_error()).find("model"), std::string::npos) << dpar_last_error();

  // A model without parameters has no index 0.
  dpar_model* empty = nullptr;
  ASSERT_OK(dpar_model_create(&empty, nullptr));
  ModelPtr empty_model(empty);
  EXPECT_INVALID("index", dpar_model_param_info(nullptr, nullptr, empty_model.get(), 0));
}

TEST(Model, GetAndSetParamCheckIndexPointerAndCountAndRefusalsChangeNothing) {
  ModelPtr m = LinearModel();
  const std::vector<float> before = ModelParams(m.get());
  std::vector<float> buf(13, 42.0f);

  EXPECT_INVALID("model", dpar_model_get_param(buf.data(), nullptr, 0, 12));
  EXPECT_INVALID("index", dpar_model_get_param(buf.data(), m.get(), 2, 3));
  EXPECT_INVALID("dst", dpar_model_get_param(nullptr, m.get(), 0, 12));
  EXPECT_INVALID("count", dpar_model_get_param(buf.data(), m.get(), 0, 11));
  EXPECT_INVALID("count", dpar_model_get_param(buf.data(), m.get(), 0, 13));
  EXPECT_EQ(buf, std::vector<float>(13, 42.0f)) << "refused reads wrote nothing";

  EXPECT_INVALID("model", dpar_model_set_param(nullptr, 0, buf.data(), 12));
  EXPECT_INVALID("index", dpar_model_set_param(m.get(), 2, buf.data(), 3));
  EXPECT_INVALID("src", dpar_model_set_param(m.get(), 1, nullptr, 3));
  EXPECT_INVALID("count", dpar_model_set_param(m.get(), 1, buf.data(), 2));
  EXPECT_INVALID("count", dpar_model_set_param(m.get(), 1, buf.data(), 4));
  EXPECT_TRUE(SameBits(ModelParams(m.get()), before)) << "refused writes changed the model";

  const std::vector<float> bias = {0.25f, -0.5f, 0.75f};
  ASSERT_OK(dpar_model_set_param(m.get(), 1, bias.data(), bias.size()));
  std::vector<float> read(3);
  ASSERT_OK(dpar_model_get_param(read.data(), m.get(), 1, 3));
  EXPECT_EQ(read, bias);
  std::vector<float> expected = before;
  std::copy(bias.begin(), bias.end(), expected.begin() + 12);
  EXPECT_TRUE(SameBits(ModelParams(m.get()), expected)) << "the weight was not touched";
}

TEST(Model, FreeAcceptsNullAndStaleHandles) {
  dpar_model_free(nullptr);
  dpar_model* m = nullptr;
  ASSERT_OK(dpar_model_create(&m, nullptr));
  dpar_model_free(m);
  dpar_model_free(m);  // looked up before it is touched: a no-op
  TensorPtr t = NewTensor(DPAR_F32, {2});
  dpar_model_free(reinterpret_cast<dpar_model*>(t.get()));
  EXPECT_EQ(ShapeOf(t.get()), (std::vector<int64_t>{2})) << "the tensor survived";
}

TEST(Model, TheEngineCopiesTheModel) {
  ModelPtr m = LinearModel();
  const std::vector<float> initial = ModelParams(m.get());
  EnginePtr e = NewEngine(m.get(), 2);
  EnginePtr reference = NewEngine(m.get(), 2);
  EXPECT_TRUE(SameBits(Params(e.get()), initial));

  // Changing or freeing the model afterwards does not affect the engine.
  const std::vector<float> zeros(12, 0.0f);
  ASSERT_OK(dpar_model_set_param(m.get(), 0, zeros.data(), zeros.size()));
  ASSERT_OK(dpar_model_add_linear(m.get(), kOut, 2, 1));
  m.reset();
  EXPECT_TRUE(SameBits(Params(e.get()), initial));
  Batch b = MakeBatch();
  ASSERT_OK(dpar_engine_train_step(nullptr, e.get(), b.x.get(), b.y.get()));
  ASSERT_OK(dpar_engine_train_step(nullptr, reference.get(), b.x.get(), b.y.get()));
  EXPECT_TRUE(SameBits(Params(e.get()), Params(reference.get())));
}

// Every call that takes a model handle refuses a NULL, freed, foreign or wrong-type one.
std::vector<NamedCall> ModelCalls(dpar_model* bad, dpar_engine** engine_out) {
  static const dpar_custom_layer layer = DPAR_CUSTOM_LAYER_INIT;
  static std::vector<float> buf(12);
  return {
      {"add_linear", [=] { return dpar_model_add_linear(bad, 4, 3, 1); }},
      {"add_activation", [=] { return dpar_model_add_activation(bad, DPAR_RELU); }},
      {"add_dropout", [=] { return dpar_model_add_dropout(bad, 0.5f); }},
      {"add_custom", [=] { return dpar_model_add_custom(bad, &layer); }},
      {"last_node", [=] { int32_t n; return dpar_model_last_node(&n, bad); }},
      {"branch_from", [=] { return dpar_model_branch_from(bad, DPAR_MODEL_INPUT); }},
      {"set_node_name", [=] { return dpar_model_set_node_name(bad, 0, "fc"); }},
      {"add_sum", [=] { static const int32_t in[2] = {0, DPAR_MODEL_INPUT}; return dpar_model_add_sum(bad, in, 2); }},
      {"add_concat", [=] { static const int32_t in[2] = {0, 0}; return dpar_model_add_concat(bad, in, 2); }},
      {"add_flatten", [=] { return dpar_model_add_flatten(bad); }},
      {"add_reshape", [=] { static const int64_t row[2] = {2, 2}; return dpar_model_add_reshape(bad, row, 2); }},
      {"num_layers", [=] { size_t n; return dpar_model_num_layers(&n, bad); }},
      {"num_params", [=] { size_t n; return dpar_model_num_params(&n, bad); }},
      {"num_param_elements", [=] { size_t n; return dpar_model_num_param_elements(&n, bad); }},
      {"param_info", [=] { return dpar_model_param_info(nullptr, nullptr, bad, 0); }},
      {"param_decays", [=] { int32_t d; return dpar_model_param_decays(&d, bad, 0); }},
      {"get_param", [=] { return dpar_model_get_param(buf.data(), bad, 0, 12); }},
      {"set_param", [=] { return dpar_model_set_param(bad, 0, buf.data(), 12); }},
      {"engine_create", [=] { return dpar_engine_create(engine_out, bad, nullptr, nullptr); }},
  };
}

TEST(ModelHandle, NullIsRefusedEverywhere) {
  dpar_engine* e = Sentinel<dpar_engine>();
  ExpectAllRefused(ModelCalls(nullptr, &e), DPAR_ERR_INVALID_ARGUMENT, "model");
  EXPECT_EQ(e, nullptr);
}

TEST(ModelHandle, FreedIsRefusedEverywhere) {
  dpar_model* m = nullptr;
  ASSERT_OK(dpar_model_create(&m, nullptr));
  dpar_model_free(m);
  dpar_engine* e = Sentinel<dpar_engine>();
  ExpectAllRefused(ModelCalls(m, &e), DPAR_ERR_INVALID_ARGUMENT, "model");
  EXPECT_EQ(e, nullptr);
}

TEST(ModelHandle, WrongTypeIsRefusedEverywhere) {
  ModelPtr real = LinearModel();
  EnginePtr engine = NewEngine(real.get(), 2);
  const std::vector<float> before = Params(engine.get());
  dpar_engine* e = Sentinel<dpar_engine>();
  ExpectAllRefused(ModelCalls(reinterpret_cast<dpar_model*>(engine.get()), &e), DPAR_ERR_INVALID_ARGUMENT, "model");
  EXPECT_EQ(e, nullptr);
  EXPECT_TRUE(SameBits(Params(engine.get()), before)) << "the engine was not touched";
  EXPECT_EQ(StepCount(engine.get()), 0);
}

TEST(ModelHandle, ForeignPointerIsRefusedEverywhere) {
  alignas(64) unsigned char not_a_model[256] = {};
  dpar_engine* e = Sentinel<dpar_engine>();
  ExpectAllRefused(ModelCalls(reinterpret_cast<dpar_model*>(not_a_model), &e), DPAR_ERR_INVALID_ARGUMENT, "model");
  EXPECT_EQ(e, nullptr);
}

// =================================================================================================================
// Optimizer options
// =================================================================================================================

TEST(OptimizerOptions, InitGivesTheMacroDefaults) {
  EXPECT_INVALID("opts", dpar_optimizer_options_init(nullptr));
  dpar_optimizer_options o;
  std::memset(&o, 0xab, sizeof o);
  ASSERT_OK(dpar_optimizer_options_init(&o));
  const dpar_optimizer_options macro = DPAR_OPTIMIZER_OPTIONS_INIT;
  EXPECT_EQ(o.size, sizeof(dpar_optimizer_options));
  EXPECT_EQ(o.version, static_cast<unsigned>(DPAR_OPTIMIZER_OPTIONS_VERSION));
  EXPECT_EQ(o.kind, DPAR_SGD);
  EXPECT_EQ(o.lr, 0.01f);
  EXPECT_EQ(o.momentum, 0.0f);
  EXPECT_EQ(o.dampening, 0.0f);
  EXPECT_EQ(o.nesterov, 0);
  EXPECT_EQ(o.weight_decay, 0.0f);
  EXPECT_EQ(o.beta1, 0.9f);
  EXPECT_EQ(o.beta2, 0.999f);
  EXPECT_EQ(o.eps, 1e-8f);
  EXPECT_EQ(o.size, macro.size);
  EXPECT_EQ(o.lr, macro.lr);
  EXPECT_EQ(o.eps, macro.eps);
}

TEST(OptimizerOptions, BadValuesAreRefusedNamingTheField) {
  ModelPtr m = LinearModel();
  const struct Case {
    const char* word;
    std::function<void(dpar_optimizer_options&)> set;
  } cases[] = {
      {"version", [](auto& o) { o.version = 0; }},
      {"version", [](auto& o) { o.version = DPAR_OPTIMIZER_OPTIONS_VERSION + 1; }},
      {"size", [](auto& o) { o.size = 0; }},
      {"size", [](auto& o) { o.size = sizeof(dpar_optimizer_options) - 4; }},
      {"kind", [](auto& o) { o.kind = DPAR_ADAMW + 1; }},
      {"kind", [](auto& o) { o.kind = -1; }},
      {"lr", [](auto& o) { o.lr = -0.1f; }},
      {"lr", [](auto& o) { o.lr = std::nanf(""); }},
      {"lr", [](auto& o) { o.lr = std::numeric_limits<float>::infinity(); }},
      {"weight_decay", [](auto& o) { o.weight_decay = -1e-4f; }},
      {"momentum", [](auto& o) { o.momentum = -0.5f; }},
      {"dampening", [](auto& o) { o.dampening = std::nanf(""); }},
      {"nesterov", [](auto& o) { o.nesterov = 1; }},  // without momentum
      {"nesterov", [](auto& o) { o.nesterov = 1, o.momentum = 0.9f, o.dampening = 0.1f; }},
      {"beta1", [](auto& o) { o.kind = DPAR_ADAM, o.beta1 = 1.0f; }},
      {"beta1", [](auto& o) { o.kind = DPAR_ADAM, o.beta1 = -0.1f; }},
      {"beta2", [](auto& o) { o.kind = DPAR_ADAM, o.beta2 = 1.0f; }},
      {"beta2", [](auto& o) { o.kind = DPAR_ADAMW, o.beta2 = std::nanf(""); }},
      {"eps", [](auto& o) { o.kind = DPAR_ADAMW, o.eps = -1e-8f; }},
      {"lr", [](auto& o) { o.kind = DPAR_ADAM, o.lr = -1.0f; }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.word);
    dpar_optimizer_options o = DPAR_OPTIMIZER_OPTIONS_INIT;
    c.set(o);
    dpar_engine* e = Sentinel<dpar_engine>();
    EXPECT_INVALID(c.word, dpar_engine_create(&e, m.get(), &o, nullptr));
    EXPECT_INVALID("optimizer", dpar_engine_create(&e, m.get(), &o, nullptr));
    EXPECT_EQ(e, nullptr);
  }
  EXPECT_EQ(NumLayers(m.get()), 1u) << "the model is untouched and usable";
}

TEST(OptimizerOptions, BoundaryValuesAreAccepted) {
  ModelPtr m = LinearModel();
  const std::function<void(dpar_optimizer_options&)> good[] = {
      [](auto& o) { o.nesterov = 1, o.momentum = 0.9f; },
      [](auto& o) { o.lr = 0.0f; },
      [](auto& o) { o.kind = DPAR_ADAM, o.beta1 = 0.0f, o.beta2 = 0.0f, o.eps = 0.0f; },
      [](auto& o) { o.kind = DPAR_ADAMW, o.weight_decay = 0.01f; },
      [](auto& o) { o.beta1 = 5.0f; },  // Adam's fields are ignored by SGD
  };
  for (const auto& set : good) {
    dpar_optimizer_options o = DPAR_OPTIMIZER_OPTIONS_INIT;
    set(o);
    dpar_engine* e = nullptr;
    EXPECT_OK(dpar_engine_create(&e, m.get(), &o, nullptr));
    dpar_engine_free(e);
  }
}

TEST(OptimizerOptions, NullMeansSgdWithItsDefaults) {
  ModelPtr m = LinearModel();
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = 2;
  dpar_engine *implicit = nullptr, *explicit_defaults = nullptr, *other = nullptr;
  const dpar_optimizer_options defaults = DPAR_OPTIMIZER_OPTIONS_INIT;
  dpar_optimizer_options faster = DPAR_OPTIMIZER_OPTIONS_INIT;
  faster.lr = 0.02f;
  ASSERT_OK(dpar_engine_create(&implicit, m.get(), nullptr, &eo));
  EnginePtr a(implicit);
  ASSERT_OK(dpar_engine_create(&explicit_defaults, m.get(), &defaults, &eo));
  EnginePtr b(explicit_defaults);
  ASSERT_OK(dpar_engine_create(&other, m.get(), &faster, &eo));
  EnginePtr c(other);
  Batch batch = MakeBatch();
  for (int i = 0; i < 2; ++i)
    for (dpar_engine* e : {a.get(), b.get(), c.get()})
      ASSERT_OK(dpar_engine_train_step(nullptr, e, batch.x.get(), batch.y.get()));
  EXPECT_TRUE(SameBits(Params(a.get()), Params(b.get())));
  EXPECT_FALSE(SameBits(Params(a.get()), Params(c.get()))) << "the test can tell optimizers apart";
}

TEST(GradientClipping, TheSetterClipsTheNextStepsAndTheNormIsReported) {
  ModelPtr m = LinearModel();
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = 2;
  dpar_engine *a = nullptr, *b = nullptr;
  ASSERT_OK(dpar_engine_create(&a, m.get(), nullptr, &eo));
  EnginePtr plain(a);
  ASSERT_OK(dpar_engine_create(&b, m.get(), nullptr, &eo));
  EnginePtr clipping(b);
  float norm = 0.0f;
  ASSERT_OK(dpar_engine_grad_norm(&norm, b));
  EXPECT_TRUE(std::isnan(norm)) << "no step has clipped yet";
  for (float bad : {-1.0f, std::nanf(""), std::numeric_limits<float>::infinity()}) {
    EXPECT_INVALID("max_grad_norm", dpar_engine_set_max_grad_norm(b, bad));
  }
  EXPECT_INVALID("out", dpar_engine_grad_norm(nullptr, b));
  EXPECT_INVALID("engine", dpar_engine_set_max_grad_norm(nullptr, 1.0f));
  Batch batch = MakeBatch();
  // Off, the default: the same bits as an engine never told.
  ASSERT_OK(dpar_engine_set_max_grad_norm(b, 0.0f));
  for (dpar_engine* e : {a, b}) ASSERT_OK(dpar_engine_train_step(nullptr, e, batch.x.get(), batch.y.get()));
  EXPECT_TRUE(SameBits(Params(a), Params(b)));
  ASSERT_OK(dpar_engine_grad_norm(&norm, b));
  EXPECT_TRUE(std::isnan(norm));
  // Far above the norm: nothing is scaled, and the norm is reported.
  ASSERT_OK(dpar_engine_set_max_grad_norm(b, 1e6f));
  for (dpar_engine* e : {a, b}) ASSERT_OK(dpar_engine_train_step(nullptr, e, batch.x.get(), batch.y.get()));
  EXPECT_TRUE(SameBits(Params(a), Params(b)));
  ASSERT_OK(dpar_engine_grad_norm(&norm, b));
  EXPECT_GT(norm, 0.0f);
  EXPECT_TRUE(std::isfinite(norm));
  // Below it: the step differs.
  ASSERT_OK(dpar_engine_set_max_grad_norm(b, norm / 10));
  for (dpar_engine* e : {a, b}) ASSERT_OK(dpar_engine_train_step(nullptr, e, batch.x.get(), batch.y.get()));
  EXPECT_FALSE(SameBits(Params(a), Params(b))) << "the test can tell clipping from none";
}

// Biases and norms' parameters report 0 (no decay when excluded); the exclusion steps them with weight_decay 0 and
// leaves every other parameter's step as it was, bit for bit.
TEST(WeightDecayExclusion, BiasesAndNormsStepWithoutDecayWhenAsked) {
  dpar_model* raw = nullptr;
  ASSERT_OK(dpar_model_create(&raw, nullptr));
  ModelPtr bn(raw);
  ASSERT_OK(dpar_model_add_linear(raw, 4, 6, 0));
  ASSERT_OK(dpar_model_add_batchnorm1d(raw, 6, 1e-5f, 0.1f, 1));
  ASSERT_OK(dpar_model_add_linear(raw, 6, 3, 1));
  std::vector<int32_t> decays;
  for (size_t i = 0; i < 5; ++i) {
    int32_t d = -1;
    ASSERT_OK(dpar_model_param_decays(&d, raw, i));
    decays.push_back(d);
  }
  EXPECT_EQ(decays, (std::vector<int32_t>{1, 0, 0, 1, 0}));
  int32_t d = 7;
  EXPECT_INVALID("index", dpar_model_param_decays(&d, raw, 5));
  EXPECT_INVALID("out", dpar_model_param_decays(nullptr, raw, 0));
  EXPECT_EQ(d, 7);

  ModelPtr m = LinearModel();  // weight (12 elements, decays), then bias (3, does not)
  dpar_optimizer_options adamw = DPAR_OPTIMIZER_OPTIONS_INIT;
  adamw.kind = DPAR_ADAMW;
  adamw.lr = 0.1f;
  adamw.weight_decay = 0.5f;
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = 2;
  dpar_engine *a = nullptr, *b = nullptr;
  ASSERT_OK(dpar_engine_create(&a, m.get(), &adamw, &eo));
  EnginePtr plain(a);
  ASSERT_OK(dpar_engine_create(&b, m.get(), &adamw, &eo));
  EnginePtr excluding(b);
  for (int32_t bad : {-1, 2}) EXPECT_INVALID("exclude_biases_and_norms", dpar_engine_set_weight_decay_exclusion(b, bad));
  EXPECT_INVALID("engine", dpar_engine_set_weight_decay_exclusion(nullptr, 1));
  ASSERT_OK(dpar_engine_set_weight_decay_exclusion(b, 1));
  Batch batch = MakeBatch();
  for (dpar_engine* e : {a, b}) ASSERT_OK(dpar_engine_train_step(nullptr, e, batch.x.get(), batch.y.get()));
  const std::vector<float> pa = Params(a), pb = Params(b);
  const size_t weights = kIn * kOut;
  EXPECT_TRUE(SameBits(std::vector<float>(pa.begin(), pa.begin() + weights),
                       std::vector<float>(pb.begin(), pb.begin() + weights)));
  for (size_t i = weights; i < kParams; ++i) EXPECT_NE(pa[i], pb[i]) << "bias element " << i - weights;
  // Off again: the one-group step, the same bits as an engine never told.
  ASSERT_OK(dpar_engine_set_weight_decay_exclusion(b, 0));
  dpar_engine* c = nullptr;
  ASSERT_OK(dpar_engine_create(&c, m.get(), &adamw, &eo));
  EnginePtr fresh(c);
  ASSERT_OK(dpar_engine_set_weight_decay_exclusion(c, 1));
  ASSERT_OK(dpar_engine_set_weight_decay_exclusion(c, 0));
  for (int s = 0; s < 3; ++s) ASSERT_OK(dpar_engine_train_step(nullptr, c, batch.x.get(), batch.y.get()));
  for (int s = 0; s < 2; ++s) ASSERT_OK(dpar_engine_train_step(nullptr, a, batch.x.get(), batch.y.get()));
  EXPECT_TRUE(SameBits(Params(a), Params(c)));  // three steps each
}

// Loss scaling through the C ABI: refusals name the value and change nothing; the scale reads 1 when off; a
// power-of-two scale trains as none; a planted overflow (a scale near f32's largest) is reported as skipped.
TEST(LossScaling, RefusesBadValuesAndReportsSkippedSteps) {
  ModelPtr m = LinearModel();
  dpar_optimizer_options sgd = DPAR_OPTIMIZER_OPTIONS_INIT;
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = 2;
  dpar_engine *a = nullptr, *b = nullptr;
  ASSERT_OK(dpar_engine_create(&a, m.get(), &sgd, &eo));
  EnginePtr plain(a);
  ASSERT_OK(dpar_engine_create(&b, m.get(), &sgd, &eo));
  EnginePtr scaled(b);
  float scale = 0.0f;
  int32_t skipped = 7;
  ASSERT_OK(dpar_engine_loss_scale(&scale, b));
  EXPECT_EQ(scale, 1.0f);
  ASSERT_OK(dpar_engine_last_step_skipped(&skipped, b));
  EXPECT_EQ(skipped, 0);
  ASSERT_OK(dpar_engine_set_loss_scaling(b, 1024.0f, 2.0f, 0.5f, 2));
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (float v : {-1.0f, nan, inf}) EXPECT_INVALID("init_scale", dpar_engine_set_loss_scaling(b, v, 2.0f, 0.5f, 2));
  for (float v : {1.0f, 0.0f, nan, inf})
    EXPECT_INVALID("growth_factor", dpar_engine_set_loss_scaling(b, 8.0f, v, 0.5f, 2));
  for (float v : {0.0f, 1.0f, 2.0f, nan})
    EXPECT_INVALID("backoff_factor", dpar_engine_set_loss_scaling(b, 8.0f, 2.0f, v, 2));
  for (int64_t v : {int64_t{0}, int64_t{-1}})
    EXPECT_INVALID("growth_interval", dpar_engine_set_loss_scaling(b, 8.0f, 2.0f, 0.5f, v));
  EXPECT_INVALID("engine", dpar_engine_set_loss_scaling(nullptr, 8.0f, 2.0f, 0.5f, 2));
  EXPECT_INVALID("out", dpar_engine_loss_scale(nullptr, b));
  EXPECT_INVALID("out", dpar_engine_last_step_skipped(nullptr, b));
  ASSERT_OK(dpar_engine_loss_scale(&scale, b));
  EXPECT_EQ(scale, 1024.0f);  // the refusals changed nothing
  Batch batch = MakeBatch();
  for (int s = 0; s < 2; ++s)
    for (dpar_engine* e : {a, b}) ASSERT_OK(dpar_engine_train_step(nullptr, e, batch.x.get(), batch.y.get()));
  EXPECT_TRUE(SameBits(Params(a), Params(b)));
  ASSERT_OK(dpar_engine_loss_scale(&scale, b));
  EXPECT_EQ(scale, 2048.0f);
  // 3e38: the scaled gradient overflows to inf; the step is skipped and the scale halves.
  ASSERT_OK(dpar_engine_set_loss_scaling(b, 3e38f, 2.0f, 0.5f, 2000));
  const std::vector<float> before = Params(b);
  size_t steps = 0;
  ASSERT_OK(dpar_engine_train_step(nullptr, b, batch.x.get(), batch.y.get()));
  ASSERT_OK(dpar_engine_last_step_skipped(&skipped, b));
  EXPECT_EQ(skipped, 1);
  ASSERT_OK(dpar_engine_loss_scale(&scale, b));
  EXPECT_EQ(scale, 1.5e38f);
  ASSERT_OK(dpar_engine_step_count(&steps, b));
  EXPECT_EQ(steps, 2u);
  EXPECT_TRUE(SameBits(Params(b), before));
  // Off again: the scale reads 1.
  ASSERT_OK(dpar_engine_set_loss_scaling(b, 0.0f, 2.0f, 0.5f, 2000));
  ASSERT_OK(dpar_engine_loss_scale(&scale, b));
  EXPECT_EQ(scale, 1.0f);
}

// What clipping does to the step, measured on it: with plain SGD of lr 1 the step moves the parameters by exactly
// the (clipped) gradient, up to the rounding of p - g. Below the norm, the step's global L2 norm is max_norm and
// it points where the unclipped one does; above it, nothing is scaled. The reported norm is the unclipped one.
TEST(GradientClipping, TheClippedStepHasTheNormItWasClippedTo) {
  ModelPtr m = LinearModel();
  const std::vector<float> initial = ModelParams(m.get());
  dpar_optimizer_options sgd = DPAR_OPTIMIZER_OPTIONS_INIT;
  sgd.lr = 1.0f;
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = 2;
  const Batch batch = MakeBatch();
  // The move of one step from the model's parameters, in double, and its L2 norm.
  auto one_step = [&](float max_norm, float* reported) {
    dpar_engine* e = nullptr;
    EXPECT_OK(dpar_engine_create(&e, m.get(), &sgd, &eo));
    EnginePtr engine(e);
    EXPECT_OK(dpar_engine_set_max_grad_norm(e, max_norm));
    EXPECT_OK(dpar_engine_train_step(nullptr, e, batch.x.get(), batch.y.get()));
    EXPECT_OK(dpar_engine_grad_norm(reported, e));
    const std::vector<float> p = Params(e);
    std::vector<double> move(p.size());
    for (size_t i = 0; i < p.size(); ++i) move[i] = double(initial[i]) - double(p[i]);
    return move;
  };
  auto l2 = [](const std::vector<double>& v) {
    double sum = 0;
    for (double x : v) sum += x * x;
    return std::sqrt(sum);
  };
  float no_norm = 0.0f;
  const std::vector<double> plain = one_step(0.0f, &no_norm);
  const double norm = l2(plain);
  ASSERT_GT(norm, 1e-2) << "the step must be large enough to measure";
  // Far above the norm: the same step, and the norm reported is the gradient's.
  float reported = 0.0f;
  EXPECT_EQ(one_step(1e6f, &reported), plain);
  EXPECT_NEAR(reported, norm, 1e-4 * norm);
  for (double fraction : {0.5, 0.1}) {
    const float max_norm = static_cast<float>(norm * fraction);
    const std::vector<double> clipped = one_step(max_norm, &reported);
    EXPECT_NEAR(l2(clipped), max_norm, 1e-4 * max_norm) << "the clipped step's norm";
    EXPECT_NEAR(reported, norm, 1e-4 * norm) << "the norm before clipping";
    for (size_t i = 0; i < plain.size(); ++i)
      EXPECT_NEAR(clipped[i], plain[i] * max_norm / norm, 1e-4 * max_norm) << "element " << i;
  }
}

// =================================================================================================================
// Engine creation and its options
// =================================================================================================================

TEST(EngineOptions, InitGivesTheMacroDefaults) {
  EXPECT_INVALID("opts", dpar_engine_options_init(nullptr));
  dpar_engine_options o;
  std::memset(&o, 0xab, sizeof o);
  ASSERT_OK(dpar_engine_options_init(&o));
  EXPECT_EQ(o.size, sizeof(dpar_engine_options));
  EXPECT_EQ(o.version, static_cast<unsigned>(DPAR_ENGINE_OPTIONS_VERSION));
  EXPECT_EQ(o.device_kind, DPAR_DEVICE_CPU);
  EXPECT_EQ(o.num_cpu_devices, 0u);
  EXPECT_EQ(o.device_ids, nullptr);
  EXPECT_EQ(o.num_device_ids, 0u);
  EXPECT_EQ(o.output_device, -1);
  EXPECT_EQ(o.loss, DPAR_LOSS_CROSS_ENTROPY);
  EXPECT_EQ(o.seed, 0u);
  EXPECT_EQ(o.timeout_seconds, 300.0);
  EXPECT_EQ(o.blas_threads, 1u);
  EXPECT_EQ(o.first_bucket_bytes, 0u);
  EXPECT_EQ(o.bucket_cap_bytes, 0u);
  EXPECT_EQ(o.processes, DPAR_PROCESSES_AUTO);
}

TEST(EngineOptions, AVersionOneStructGetsTheNewFieldsDefaults) {
  // A caller compiled against version 1 passes the shorter struct: the fields appended since keep their defaults.
  ModelPtr m = LinearModel();
  dpar_engine_options o = DPAR_ENGINE_OPTIONS_INIT;
  o.version = 1;
  o.size = offsetof(dpar_engine_options, first_bucket_bytes);
  o.num_cpu_devices = 2;
  o.processes = 99;  // beyond the version-1 size: never read
  dpar_engine* raw = nullptr;
  ASSERT_OK(dpar_engine_create(&raw, m.get(), nullptr, &o));
  EnginePtr e(raw);
  size_t buckets = 0;
  ASSERT_OK(dpar_engine_num_buckets(&buckets, e.get()));
  EXPECT_EQ(buckets, 1u);
  size_t rank = 99, size = 99;
  ASSERT_OK(dpar_engine_processes(&rank, &size, e.get()));
  EXPECT_EQ(rank, 0u);
  EXPECT_EQ(size, 1u);
  const char* transport = dpar_engine_process_transport(e.get());
  ASSERT_NE(transport, nullptr) << dpar_last_error();
  EXPECT_STREQ(transport, "") << "one process has no transport between processes";
  EXPECT_INVALID("compression", dpar_engine_set_gradient_compression(e.get(), 2));
  EXPECT_INVALID("compression", dpar_engine_set_gradient_compression(e.get(), -1));
  ASSERT_OK(dpar_engine_set_gradient_compression(e.get(), DPAR_COMPRESSION_BF16));
  // The reduce dtype: f32 or bf16; another is refused by name and changes nothing.
  int32_t reduce = -1;
  ASSERT_OK(dpar_engine_reduce_dtype(&reduce, e.get()));
  EXPECT_EQ(reduce, DPAR_F32);
  EXPECT_INVALID("reduce_dtype: 3", dpar_engine_set_reduce_dtype(e.get(), DPAR_F16));
  EXPECT_INVALID("reduce_dtype: 1", dpar_engine_set_reduce_dtype(e.get(), DPAR_I32));
  EXPECT_INVALID("reduce_dtype: -1", dpar_engine_set_reduce_dtype(e.get(), -1));
  EXPECT_INVALID("out", dpar_engine_reduce_dtype(nullptr, e.get()));
  ASSERT_OK(dpar_engine_reduce_dtype(&reduce, e.get()));
  EXPECT_EQ(reduce, DPAR_F32);
  ASSERT_OK(dpar_engine_set_reduce_dtype(e.get(), DPAR_BF16));
  ASSERT_OK(dpar_engine_reduce_dtype(&reduce, e.get()));
  EXPECT_EQ(reduce, DPAR_BF16);
  ASSERT_OK(dpar_engine_set_reduce_dtype(e.get(), DPAR_F32));
}

TEST(EngineOptions, InitFillsTheCallersLayoutAndNotAByteMore) {
  // A program compiled against version 1 of the struct passes its own, smaller sizeof: the library writes that
  // layout (version 1) and leaves the bytes after it alone. The guard bytes stand for whatever the caller keeps
  // after its struct.
  constexpr size_t v1 = offsetof(dpar_engine_options, first_bucket_bytes);
  unsigned char buffer[sizeof(dpar_engine_options) + 16];
  std::memset(buffer, 0xab, sizeof buffer);
  auto* o = reinterpret_cast<dpar_engine_options*>(buffer);
  ASSERT_OK(dpar_engine_options_init_sized(o, v1));
  EXPECT_EQ(o->size, v1);
  EXPECT_EQ(o->version, 1u);
  EXPECT_EQ(o->timeout_seconds, 300.0);
  EXPECT_EQ(o->pin_workers, 1);
  for (size_t i = v1; i < sizeof buffer; ++i) ASSERT_EQ(buffer[i], 0xab) << "byte " << i << " written";
  // The struct so filled is read back as version 1: the fields appended since keep their defaults.
  o->num_cpu_devices = 2;
  ModelPtr m = LinearModel();
  dpar_engine* raw = nullptr;
  ASSERT_OK(dpar_engine_create(&raw, m.get(), nullptr, o));
  EnginePtr e(raw);
  size_t replicas = 0;
  ASSERT_OK(dpar_engine_num_replicas(&replicas, e.get()));
  EXPECT_EQ(replicas, 2u);

  // The macro passes the caller's sizeof: the current layout.
  std::memset(buffer, 0xab, sizeof buffer);
  ASSERT_OK(dpar_engine_options_init(o));
  EXPECT_EQ(o->size, sizeof(dpar_engine_options));
  EXPECT_EQ(o->version, static_cast<unsigned>(DPAR_ENGINE_OPTIONS_VERSION));
  EXPECT_EQ(o->processes, DPAR_PROCESSES_AUTO);
  for (size_t i = sizeof(dpar_engine_options); i < sizeof buffer; ++i) ASSERT_EQ(buffer[i], 0xab);
  // The function of that name, which programs built against dpar.h 0.4 call, writes dpar.h 0.4's layout
  // (version 2, which ended before create_timeout_seconds) and not a byte more.
  std::memset(buffer, 0xab, sizeof buffer);
  ASSERT_OK((dpar_engine_options_init)(o));
  const size_t v2 = offsetof(dpar_engine_options, create_timeout_seconds);
  EXPECT_EQ(o->size, v2);
  EXPECT_EQ(o->version, 2u);
  for (size_t i = v2; i < sizeof buffer; ++i) ASSERT_EQ(buffer[i], 0xab) << "byte " << i << " written";

  // A layout newer than the library's: the program was built against a newer dpar.h. Nothing is written.
  std::memset(buffer, 0xab, sizeof buffer);
  EXPECT_DPAR_ERROR(DPAR_ERR_NOT_SUPPORTED, "newer dpar.h", dpar_engine_options_init_sized(o, sizeof(dpar_engine_options) + 8));
  // A size between two layouts, or short of the first, is no struct dpar knows.
  EXPECT_INVALID("no layout of dpar_engine_options", dpar_engine_options_init_sized(o, v1 + 8));
  EXPECT_INVALID("no layout of dpar_engine_options", dpar_engine_options_init_sized(o, 0));
  for (unsigned char b : buffer) ASSERT_EQ(b, 0xab);
  EXPECT_INVALID("opts", dpar_engine_options_init_sized(nullptr, sizeof(dpar_engine_options)));
}

TEST(OptionStructs, EverySizedInitWritesItsLayoutAndRefusesOthers) {
  // One layout each (version 1): the size is sizeof, and any other is refused before a byte is written.
  const auto check = [](auto* tag, auto init_sized, unsigned version) {
    using T = std::remove_pointer_t<decltype(tag)>;
    unsigned char buffer[sizeof(T) + 16];
    std::memset(buffer, 0xab, sizeof buffer);
    auto* o = reinterpret_cast<T*>(buffer);
    ASSERT_OK(init_sized(o, sizeof(T)));
    EXPECT_EQ(o->size, sizeof(T));
    EXPECT_EQ(o->version, version);
    for (size_t i = sizeof(T); i < sizeof buffer; ++i) ASSERT_EQ(buffer[i], 0xab);
    std::memset(buffer, 0xab, sizeof buffer);
    EXPECT_DPAR_ERROR(DPAR_ERR_NOT_SUPPORTED, "newer dpar.h", init_sized(o, sizeof(T) + 8));
    EXPECT_INVALID("no layout", init_sized(o, sizeof(T) - 8));
    for (unsigned char b : buffer) ASSERT_EQ(b, 0xab);
    EXPECT_INVALID("is NULL", init_sized(nullptr, sizeof(T)));
  };
  check(static_cast<dpar_model_options*>(nullptr), dpar_model_options_init_sized, DPAR_MODEL_OPTIONS_VERSION);
  check(static_cast<dpar_custom_layer*>(nullptr), dpar_custom_layer_init_sized, DPAR_CUSTOM_LAYER_VERSION);
  check(static_cast<dpar_optimizer_options*>(nullptr), dpar_optimizer_options_init_sized,
        DPAR_OPTIMIZER_OPTIONS_VERSION);
  check(static_cast<dpar_comm_options*>(nullptr), dpar_comm_options_init_sized, DPAR_COMM_OPTIONS_VERSION);
  check(static_cast<dpar_reducer_options*>(nullptr), dpar_reducer_options_init_sized, DPAR_REDUCER_OPTIONS_VERSION);
}

TEST(EngineOptions, BucketSizesSetTheBuckets) {
  ModelPtr m = LinearModel();  // a weight and a bias
  for (const auto& [first, cap, expected] :
       std::vector<std::tuple<size_t, size_t, size_t>>{{1, 1, 2}, {SIZE_MAX, SIZE_MAX, 1}, {0, 0, 1}}) {
    dpar_engine_options o = DPAR_ENGINE_OPTIONS_INIT;
    o.num_cpu_devices = 2;
    o.first_bucket_bytes = first;
    o.bucket_cap_bytes = cap;
    dpar_engine* raw = nullptr;
    ASSERT_OK(dpar_engine_create(&raw, m.get(), nullptr, &o));
    EnginePtr e(raw);
    size_t buckets = 0;
    ASSERT_OK(dpar_engine_num_buckets(&buckets, e.get()));
    EXPECT_EQ(buckets, expected) << first << " / " << cap;
    EXPECT_INVALID("out", dpar_engine_num_buckets(nullptr, e.get()));
  }
}

TEST(EngineCreate, RefusesNullOutputsModelsAndEmptyModels) {
  ModelPtr m = LinearModel();
  EXPECT_INVALID("out", dpar_engine_create(nullptr, m.get(), nullptr, nullptr));
  dpar_model* raw = nullptr;
  ASSERT_OK(dpar_model_create(&raw, nullptr));
  ModelPtr empty(raw);
  dpar_engine* e = Sentinel<dpar_engine>();
  EXPECT_INVALID("layers", dpar_engine_create(&e, empty.get(), nullptr, nullptr));
  EXPECT_EQ(e, nullptr);
}

TEST(EngineCreate, NullOptionsUseEveryDefaultDevice) {
  ModelPtr m = LinearModel();
  dpar_engine* raw = nullptr;
  ASSERT_OK(dpar_engine_create(&raw, m.get(), nullptr, nullptr));
  EnginePtr e(raw);
  size_t devices = 0, replicas = 0;
  ASSERT_OK(dpar_device_count(&devices, DPAR_DEVICE_CPU));
  ASSERT_OK(dpar_engine_num_replicas(&replicas, e.get()));
  EXPECT_EQ(replicas, devices);
  for (size_t r = 0; r < replicas; ++r) {
    dpar_device d{-1, -1};
    ASSERT_OK(dpar_engine_replica_device(&d, e.get(), r));
    EXPECT_EQ(d.kind, DPAR_DEVICE_CPU);
    EXPECT_EQ(d.index, static_cast<int32_t>(r));
  }
}

TEST(EngineCreate, BadOptionsAreRefusedNamingTheField) {
  ModelPtr m = LinearModel();
  static const int32_t out_of_range[] = {0, 4};
  static const int32_t negative[] = {-1};
  static const int32_t repeated[] = {1, 0, 1};
  static const int32_t two[] = {0, 1};
  const struct Case {
    dpar_status want;
    const char* word;
    std::function<void(dpar_engine_options&)> set;
  } cases[] = {
      {DPAR_ERR_INVALID_ARGUMENT, "version", [](auto& o) { o.version = 0; }},
      {DPAR_ERR_INVALID_ARGUMENT, "version", [](auto& o) { o.version = DPAR_ENGINE_OPTIONS_VERSION + 1; }},
      {DPAR_ERR_INVALID_ARGUMENT, "size", [](auto& o) { o.size = 0; }},
      {DPAR_ERR_INVALID_ARGUMENT, "size", [](auto& o) { o.size = sizeof(dpar_engine_options) - 8; }},
      {DPAR_ERR_INVALID_ARGUMENT, "device_kind", [](auto& o) { o.device_kind = 7; }},
      {DPAR_ERR_INVALID_ARGUMENT, "num_cpu_devices", [](auto& o) { o.num_cpu_devices = 257; }},
      {DPAR_ERR_INVALID_ARGUMENT, "device_ids[1]", [](auto& o) { o.device_ids = out_of_range, o.num_device_ids = 2; }},
      {DPAR_ERR_INVALID_ARGUMENT, "out of range", [](auto& o) { o.device_ids = out_of_range, o.num_device_ids = 2; }},
      {DPAR_ERR_INVALID_ARGUMENT, "device_ids[0]", [](auto& o) { o.device_ids = negative, o.num_device_ids = 1; }},
      {DPAR_ERR_INVALID_ARGUMENT, "device_ids[2]", [](auto& o) { o.device_ids = repeated, o.num_device_ids = 3; }},
      {DPAR_ERR_INVALID_ARGUMENT, "repeated", [](auto& o) { o.device_ids = repeated, o.num_device_ids = 3; }},
      {DPAR_ERR_INVALID_ARGUMENT, "num_device_ids", [](auto& o) { o.device_ids = two, o.num_device_ids = 0; }},
      {DPAR_ERR_INVALID_ARGUMENT, "device_ids", [](auto& o) { o.device_ids = nullptr, o.num_device_ids = 2; }},
      {DPAR_ERR_INVALID_ARGUMENT, "output_device",
       [](auto& o) { o.device_ids = two, o.num_device_ids = 2, o.output_device = 3; }},
      {DPAR_ERR_INVALID_ARGUMENT, "output_device", [](auto& o) { o.output_device = 4; }},  // 4 devices: cpu:0-3
      {DPAR_ERR_INVALID_ARGUMENT, "output_device", [](auto& o) { o.output_device = -2; }},
      {DPAR_ERR_INVALID_ARGUMENT, "loss", [](auto& o) { o.loss = DPAR_LOSS_MSE + 1; }},
      {DPAR_ERR_INVALID_ARGUMENT, "loss", [](auto& o) { o.loss = -1; }},
      {DPAR_ERR_INVALID_ARGUMENT, "timeout_seconds", [](auto& o) { o.timeout_seconds = 0.0; }},
      {DPAR_ERR_INVALID_ARGUMENT, "timeout_seconds", [](auto& o) { o.timeout_seconds = -1.0; }},
      {DPAR_ERR_INVALID_ARGUMENT, "timeout_seconds", [](auto& o) { o.timeout_seconds = std::nan(""); }},
      {DPAR_ERR_INVALID_ARGUMENT, "blas_threads", [](auto& o) { o.blas_threads = 0; }},
      {DPAR_ERR_INVALID_ARGUMENT, "blas_threads", [](auto& o) { o.blas_threads = 1025; }},
      {DPAR_ERR_INVALID_ARGUMENT, "processes", [](auto& o) { o.processes = 3; }},
      {DPAR_ERR_INVALID_ARGUMENT, "processes", [](auto& o) { o.processes = -1; }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.word);
    dpar_engine_options o = DPAR_ENGINE_OPTIONS_INIT;
    o.num_cpu_devices = 4;
    c.set(o);
    dpar_engine* e = Sentinel<dpar_engine>();
    EXPECT_DPAR_ERROR(c.want, c.word, dpar_engine_create(&e, m.get(), nullptr, &o));
    EXPECT_EQ(e, nullptr) << "a refused create must set *out to NULL";
  }
  // The model is untouched and an engine can still be built from it.
  EXPECT_EQ(NumLayers(m.get()), 1u);
  EnginePtr e = NewEngine(m.get(), 4);
  EXPECT_TRUE(e != nullptr);
  // CUDA devices that cannot be used are refused as tensors on them are (cuda_refusal).
  const CudaRefusal cuda = cuda_refusal();
  const int32_t refused_gpu[] = {cuda.index};
  dpar_engine_options o = DPAR_ENGINE_OPTIONS_INIT;
  o.device_kind = DPAR_DEVICE_CUDA;
  o.device_ids = refused_gpu;
  o.num_device_ids = 1;
  dpar_engine* gpu_engine = nullptr;
  EXPECT_DPAR_ERROR(cuda.status, cuda.word, dpar_engine_create(&gpu_engine, m.get(), nullptr, &o));
  EXPECT_EQ(gpu_engine, nullptr);
}

TEST(EngineCreate, DeviceListPicksDevicesInOrderAndTheOutputDevice) {
  ModelPtr m = LinearModel();
  const int32_t ids[] = {3, 1, 0};
  dpar_engine_options o = DPAR_ENGINE_OPTIONS_INIT;
  o.num_cpu_devices = 4;
  o.device_ids = ids;
  o.num_device_ids = 3;
  dpar_engine* raw = nullptr;
  ASSERT_OK(dpar_engine_create(&raw, m.get(), nullptr, &o));
  EnginePtr first_is_output(raw);
  o.output_device = 1;
  ASSERT_OK(dpar_engine_create(&raw, m.get(), nullptr, &o));
  EnginePtr cpu1_is_output(raw);

  size_t replicas = 0;
  ASSERT_OK(dpar_engine_num_replicas(&replicas, first_is_output.get()));
  ASSERT_EQ(replicas, 3u);
  for (size_t r = 0; r < 3; ++r) {
    dpar_device d{-1, -1};
    ASSERT_OK(dpar_engine_replica_device(&d, first_is_output.get(), r));
    EXPECT_EQ(d.kind, DPAR_DEVICE_CPU);
    EXPECT_EQ(d.index, ids[r]);
  }
  Batch b = MakeBatch();
  for (auto [engine, device] : {std::pair{first_is_output.get(), 3}, std::pair{cpu1_is_output.get(), 1}}) {
    dpar_tensor* y = nullptr;
    ASSERT_OK(dpar_engine_forward(&y, engine, b.x.get()));
    TensorPtr out(y);
    dpar_device d{-1, -1};
    ASSERT_OK(dpar_tensor_info(nullptr, nullptr, &d, out.get()));
    EXPECT_EQ(d.index, device) << "forward gathers on the output device";
  }
}

TEST(EngineCreate, MoreCpuDevicesThanCoresAreAllowed) {
  ModelPtr m = LinearModel();
  EnginePtr e = NewEngine(m.get(), 8);
  size_t replicas = 0;
  ASSERT_OK(dpar_engine_num_replicas(&replicas, e.get()));
  EXPECT_EQ(replicas, 8u);
  Batch b = MakeBatch(10);
  EXPECT_OK(dpar_engine_train_step(nullptr, e.get(), b.x.get(), b.y.get()));
}

TEST(EngineCreate, FreeAcceptsNullAndStaleHandles) {
  dpar_engine_free(nullptr);
  ModelPtr m = LinearModel();
  dpar_engine* e = nullptr;
  ASSERT_OK(dpar_engine_create(&e, m.get(), nullptr, nullptr));
  dpar_engine_free(e);
  dpar_engine_free(e);  // looked up before it is touched: a no-op
  dpar_engine_free(reinterpret_cast<dpar_engine*>(m.get()));
  EXPECT_EQ(NumLayers(m.get()), 1u) << "the model survived";
}

// =================================================================================================================
// Engine calls
// =================================================================================================================

// Every call that takes an engine handle refuses a NULL, freed, foreign or wrong-type one. The other arguments are
// valid, so that the handle is what is refused.
class EngineHandleCalls {
 public:
  EngineHandleCalls() : batch_(MakeBatch()), grad_(F32({kRows, kOut}, std::vector<float>(kRows * kOut, 0.1f))) {}

  std::vector<NamedCall> With(dpar_engine* bad) {
    const dpar_tensor* x = batch_.x.get();
    const dpar_tensor* y = batch_.y.get();
    const dpar_tensor* g = grad_.get();
    return {
        {"num_replicas", [=] { size_t n; return dpar_engine_num_replicas(&n, bad); }},
        {"processes", [=] { size_t r, n; return dpar_engine_processes(&r, &n, bad); }},
        // A string, not a status: NULL for a bad engine, and dpar_last_error() names it.
        {"process_transport",
         [=] { return dpar_engine_process_transport(bad) ? DPAR_OK : DPAR_ERR_INVALID_ARGUMENT; }},
        {"num_buckets", [=] { size_t n; return dpar_engine_num_buckets(&n, bad); }},
        {"replica_device", [=] { dpar_device d; return dpar_engine_replica_device(&d, bad, 0); }},
        {"split", [=] { size_t rows[8]; return dpar_engine_split(rows, bad, 6, 8); }},
        {"train_step", [=] { float l; return dpar_engine_train_step(&l, bad, x, y); }},
        {"accumulate", [=] { float l; return dpar_engine_accumulate(&l, bad, x, y); }},
        {"step", [=] { return dpar_engine_step(bad); }},
        {"zero_grad", [=] { return dpar_engine_zero_grad(bad); }},
        {"forward", [=, this] { return dpar_engine_forward(&out_, bad, x); }},
        {"backward", [=] { return dpar_engine_backward(bad, g); }},
        {"set_training", [=] { return dpar_engine_set_training(bad, 0); }},
        {"set_lr", [=] { return dpar_engine_set_lr(bad, 0.5f); }},
        {"set_gradient_compression", [=] { return dpar_engine_set_gradient_compression(bad, DPAR_COMPRESSION_BF16); }},
        {"set_weight_decay_exclusion", [=] { return dpar_engine_set_weight_decay_exclusion(bad, 1); }},
        {"set_reduce_dtype", [=] { return dpar_engine_set_reduce_dtype(bad, DPAR_BF16); }},
        {"reduce_dtype", [=] { int32_t d; return dpar_engine_reduce_dtype(&d, bad); }},
        {"step_count", [=] { size_t n; return dpar_engine_step_count(&n, bad); }},
        {"replica_losses", [=] { float l[8]; return dpar_engine_replica_losses(l, bad, 8); }},
        {"get_params", [=] { float p[kParams]; return dpar_engine_get_params(p, bad, 0, kParams); }},
        {"memory_stats", [=] { int64_t a, p; return dpar_engine_memory_stats(&a, &p, bad, 0); }},
        {"reset_peak_memory", [=] { return dpar_engine_reset_peak_memory(bad, 0); }},
        {"set_forward_hook", [=] { return dpar_engine_set_forward_hook(bad, nullptr, nullptr, nullptr); }},
        {"save", [=, this] { return dpar_engine_save(bad, save_path_.c_str()); }},
        {"load", [=, this] { return dpar_engine_load(bad, save_path_.c_str()); }},
        {"inject_fault", [=] { return dpar_engine_inject_fault(bad, 0, DPAR_FAULT_NONE); }},
    };
  }

  void Run(dpar_engine* bad) {
    ExpectAllRefused(With(bad), DPAR_ERR_INVALID_ARGUMENT, "engine");
    EXPECT_EQ(out_, nullptr);
    EXPECT_FALSE(std::filesystem::exists(save_path_)) << "a refused save wrote a file";
  }

 private:
  TempDir dir_;
  std::string save_path_ = dir_ / "never.safetensors";
  Batch batch_;
  TensorPtr grad_;
  dpar_tensor* out_ = nullptr;
};

TEST(EngineHandle, NullIsRefusedEverywhere) { EngineHandleCalls().Run(nullptr); }

TEST(EngineHandle, FreedIsRefusedEverywhere) {
  EngineHandleCalls calls;
  ModelPtr m = LinearModel();
  dpar_engine* e = nullptr;
  ASSERT_OK(dpar_engine_create(&e, m.get(), nullptr, nullptr));
  dpar_engine_free(e);
  calls.Run(e);
}

TEST(EngineHandle, WrongTypeIsRefusedEverywhere) {
  EngineHandleCalls calls;
  ModelPtr m = LinearModel();
  calls.Run(reinterpret_cast<dpar_engine*>(m.get()));
  EXPECT_EQ(NumLayers(m.get()), 1u) << "the model was not touched";
  TensorPtr t = NewTensor(DPAR_F32, {kRows, kIn});
  calls.Run(reinterpret_cast<dpar_engine*>(t.get()));
}

TEST(EngineHandle, ForeignPointerIsRefusedEverywhere) {
  EngineHandleCalls calls;
  alignas(64) unsigned char not_an_engine[512] = {};
  calls.Run(reinterpret_cast<dpar_engine*>(not_an_engine));
}

// Two engines built alike: `engine` sees the refused calls, `reference` never does. "Loses nothing" means that
// they agree bit for bit, before and after more training.
class EngineFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = LinearModel();
    engine_ = NewEngine(model_.get(), 2);
    reference_ = NewEngine(model_.get(), 2);
    batch_ = MakeBatch();
  }

  dpar_engine* engine() { return engine_.get(); }
  dpar_engine* reference() { return reference_.get(); }

  void TrainBoth(int steps = 1) {
    for (int i = 0; i < steps; ++i) {
      Batch b = MakeBatch(kRows, i + 1);
      float loss_a = -1.0f, loss_b = -2.0f;
      ASSERT_OK(dpar_engine_train_step(&loss_a, engine(), b.x.get(), b.y.get()));
      ASSERT_OK(dpar_engine_train_step(&loss_b, reference(), b.x.get(), b.y.get()));
      EXPECT_EQ(loss_a, loss_b);
    }
  }

  // The engine holds what the reference holds, and trains on to the same parameters on every replica.
  void ExpectSameAsReference() {
    EXPECT_TRUE(SameBits(Params(engine()), Params(reference()))) << "the refused calls changed the parameters";
    EXPECT_EQ(StepCount(engine()), StepCount(reference()));
    TrainBoth(2);
    for (size_t r = 0; r < 2; ++r) EXPECT_TRUE(SameBits(Params(engine(), r), Params(reference(), r))) << r;
    EXPECT_EQ(StepCount(engine()), StepCount(reference()));
  }

  ModelPtr model_;
  EnginePtr engine_, reference_;
  Batch batch_;
};

TEST_F(EngineFixture, TrainStepRefusesBadBatchesAndLosesNothing) {
  TrainBoth(1);  // momentum buffers are non-zero from here on
  const dpar_tensor* x = batch_.x.get();
  const dpar_tensor* y = batch_.y.get();
  TensorPtr wide = F32({kRows, kIn + 1}, Inputs(kRows, kIn + 1));
  TensorPtr three_d = F32({kRows, kIn, 1}, Inputs(kRows, kIn));
  TensorPtr int_input = I32({kRows, kIn}, std::vector<int32_t>(kRows * kIn, 1));
  TensorPtr short_target = I32({kRows - 1}, Labels(kRows - 1, kOut));
  TensorPtr long_target = I32({kRows + 1}, Labels(kRows + 1, kOut));
  TensorPtr two_d_target = I32({kRows, 1}, Labels(kRows, kOut));
  TensorPtr float_target = F32({kRows}, std::vector<float>(kRows, 1.0f));
  std::vector<int32_t> labels = Labels(kRows, kOut);
  labels[2] = -1;
  TensorPtr negative_label = I32({kRows}, labels);
  labels[2] = 1;
  labels[5] = kOut;
  TensorPtr label_too_big = I32({kRows}, labels);

  float loss = 123.0f;
  EXPECT_INVALID("input", dpar_engine_train_step(&loss, engine(), nullptr, y));
  EXPECT_INVALID("target", dpar_engine_train_step(&loss, engine(), x, nullptr));
  EXPECT_INVALID("does not fit", dpar_engine_train_step(&loss, engine(), wide.get(), y));
  EXPECT_INVALID("does not fit", dpar_engine_train_step(&loss, engine(), three_d.get(), y));
  EXPECT_INVALID("f32", dpar_engine_train_step(&loss, engine(), int_input.get(), y));
  EXPECT_INVALID("target", dpar_engine_train_step(&loss, engine(), x, short_target.get()));
  EXPECT_INVALID("target", dpar_engine_train_step(&loss, engine(), x, long_target.get()));
  EXPECT_INVALID("target", dpar_engine_train_step(&loss, engine(), x, two_d_target.get()));
  EXPECT_INVALID("i32", dpar_engine_train_step(&loss, engine(), x, float_target.get()));
  EXPECT_INVALID("target[2]", dpar_engine_train_step(&loss, engine(), x, negative_label.get()));
  EXPECT_INVALID("out of range", dpar_engine_train_step(&loss, engine(), x, negative_label.get()));
  EXPECT_INVALID("target[5]", dpar_engine_train_step(&loss, engine(), x, label_too_big.get()));
  EXPECT_INVALID("f32", dpar_engine_train_step(&loss, engine(), y, x));  // swapped: the labels are no input
  EXPECT_EQ(loss, 123.0f) << "a refused step reported no loss";

  ExpectSameAsReference();
}

TEST_F(EngineFixture, AccumulateRefusesBadBatchesAndLosesNothing) {
  TensorPtr wide = F32({kRows, kIn + 1}, Inputs(kRows, kIn + 1));
  std::vector<int32_t> labels = Labels(kRows, kOut);
  labels[0] = kOut + 10;
  TensorPtr bad_labels = I32({kRows}, labels);
  EXPECT_INVALID("input", dpar_engine_accumulate(nullptr, engine(), nullptr, batch_.y.get()));
  EXPECT_INVALID("target", dpar_engine_accumulate(nullptr, engine(), batch_.x.get(), nullptr));
  EXPECT_INVALID("does not fit", dpar_engine_accumulate(nullptr, engine(), wide.get(), batch_.y.get()));
  EXPECT_INVALID("target[0]", dpar_engine_accumulate(nullptr, engine(), batch_.x.get(), bad_labels.get()));
  // Nothing was accumulated, so nothing is pending.
  EXPECT_DPAR_ERROR(DPAR_ERR_INVALID_STATE, "pending", dpar_engine_step(engine()));
  ExpectSameAsReference();

  // A good accumulate after refused ones equals the reference's.
  float a = -1.0f, b = -2.0f;
  ASSERT_OK(dpar_engine_accumulate(&a, engine(), batch_.x.get(), batch_.y.get()));
  EXPECT_INVALID("does not fit", dpar_engine_accumulate(nullptr, engine(), wide.get(), batch_.y.get()));
  ASSERT_OK(dpar_engine_accumulate(&b, reference(), batch_.x.get(), batch_.y.get()));
  EXPECT_EQ(a, b);
  ASSERT_OK(dpar_engine_step(engine()));
  ASSERT_OK(dpar_engine_step(reference()));
  ExpectSameAsReference();
}

TEST(EngineMse, TargetsMustBeShapedAsTheOutput) {
  ModelPtr m = LinearModel();
  EnginePtr e = NewEngine(m.get(), 2, DPAR_LOSS_MSE);
  EnginePtr reference = NewEngine(m.get(), 2, DPAR_LOSS_MSE);
  TensorPtr x = F32({kRows, kIn}, Inputs(kRows, kIn));
  TensorPtr narrow = F32({kRows, kOut - 1}, std::vector<float>(kRows * (kOut - 1), 0.5f));
  TensorPtr flat = F32({kRows * kOut}, std::vector<float>(kRows * kOut, 0.5f));
  TensorPtr short_target = F32({kRows - 1, kOut}, std::vector<float>((kRows - 1) * kOut, 0.5f));
  TensorPtr labels = I32({kRows, kOut}, std::vector<int32_t>(kRows * kOut, 1));
  TensorPtr good = F32({kRows, kOut}, std::vector<float>(kRows * kOut, 0.5f));
  EXPECT_INVALID("MSE target", dpar_engine_train_step(nullptr, e.get(), x.get(), narrow.get()));
  EXPECT_INVALID("MSE target", dpar_engine_train_step(nullptr, e.get(), x.get(), flat.get()));
  EXPECT_INVALID("MSE target", dpar_engine_train_step(nullptr, e.get(), x.get(), short_target.get()));
  EXPECT_INVALID("f32", dpar_engine_train_step(nullptr, e.get(), x.get(), labels.get()));
  EXPECT_INVALID("MSE target", dpar_engine_accumulate(nullptr, e.get(), x.get(), narrow.get()));
  EXPECT_EQ(StepCount(e.get()), 0);
  ASSERT_OK(dpar_engine_train_step(nullptr, e.get(), x.get(), good.get()));
  ASSERT_OK(dpar_engine_train_step(nullptr, reference.get(), x.get(), good.get()));
  EXPECT_TRUE(SameBits(Params(e.get()), Params(reference.get())));
}

TEST_F(EngineFixture, StepNeedsPendingGradients) {
  EXPECT_DPAR_ERROR(DPAR_ERR_INVALID_STATE, "pending", dpar_engine_step(engine()));
  TrainBoth(1);
  // A fused step leaves nothing pending.
  EXPECT_DPAR_ERROR(DPAR_ERR_INVALID_STATE, "pending", dpar_engine_step(engine()));
  // zero_grad discards an accumulation: nothing is pending and nothing changed.
  ASSERT_OK(dpar_engine_accumulate(nullptr, engine(), batch_.x.get(), batch_.y.get()));
  ASSERT_OK(dpar_engine_zero_grad(engine()));
  EXPECT_DPAR_ERROR(DPAR_ERR_INVALID_STATE, "pending", dpar_engine_step(engine()));
  // zero_grad with nothing to discard is fine.
  EXPECT_OK(dpar_engine_zero_grad(engine()));
  ExpectSameAsReference();
}

TEST_F(EngineFixture, PendingGradientsOfOnePathBlockTheOther) {
  ASSERT_OK(dpar_engine_accumulate(nullptr, engine(), batch_.x.get(), batch_.y.get()));
  EXPECT_DPAR_ERROR(DPAR_ERR_INVALID_STATE, "pending",
                    dpar_engine_train_step(nullptr, engine(), batch_.x.get(), batch_.y.get()));
  dpar_tensor* out = nullptr;
  ASSERT_OK(dpar_engine_forward(&out, engine(), batch_.x.get()));
  TensorPtr y(out);
  EXPECT_DPAR_ERROR(DPAR_ERR_INVALID_STATE, "accumulate", dpar_engine_backward(engine(), y.get()));
  ASSERT_OK(dpar_engine_step(engine()));  // the accumulation was kept through the refusals
  ASSERT_OK(dpar_engine_accumulate(nullptr, reference(), batch_.x.get(), batch_.y.get()));
  ASSERT_OK(dpar_engine_step(reference()));
  EXPECT_EQ(StepCount(engine()), 1);
  ExpectSameAsReference();
}

TEST_F(EngineFixture, BackwardNeedsATrainingModeForward) {
  TensorPtr grad = F32({kRows, kOut}, std::vector<float>(kRows * kOut, 0.1f));
  EXPECT_DPAR_ERROR(DPAR_ERR_INVALID_STATE, "forward", dpar_engine_backward(engine(), grad.get()));
  EXPECT_INVALID("grad_output", dpar_engine_backward(engine(), nullptr));

  // An eval-mode forward keeps nothing for backward.
  ASSERT_OK(dpar_engine_set_training(engine(), 0));
  dpar_tensor* out = nullptr;
  ASSERT_OK(dpar_engine_forward(&out, engine(), batch_.x.get()));
  TensorPtr y(out);
  EXPECT_DPAR_ERROR(DPAR_ERR_INVALID_STATE, "forward", dpar_engine_backward(engine(), grad.get()));
  ASSERT_OK(dpar_engine_set_training(engine(), 1));

  // A backward consumes its forward.
  ASSERT_OK(dpar_engine_forward(&out, engine(), batch_.x.get()));
  TensorPtr y2(out);
  ASSERT_OK(dpar_engine_backward(engine(), grad.get()));
  EXPECT_DPAR_ERROR(DPAR_ERR_INVALID_STATE, "forward", dpar_engine_backward(engine(), grad.get()));
  // Explicit gradients are pending: accumulate and train_step are refused until step.
  EXPECT_DPAR_ERROR(DPAR_ERR_INVALID_STATE, "pending",
                    dpar_engine_accumulate(nullptr, engine(), batch_.x.get(), batch_.y.get()));
  EXPECT_DPAR_ERROR(DPAR_ERR_INVALID_STATE, "pending",
                    dpar_engine_train_step(nullptr, engine(), batch_.x.get(), batch_.y.get()));
  ASSERT_OK(dpar_engine_step(engine()));

  ASSERT_OK(dpar_engine_forward(&out, reference(), batch_.x.get()));
  TensorPtr y3(out);
  ASSERT_OK(dpar_engine_backward(reference(), grad.get()));
  ASSERT_OK(dpar_engine_step(reference()));
  ExpectSameAsReference();
}

TEST_F(EngineFixture, RefusedBackwardKeepsTheForwardState) {
  std::vector<float> g(kRows * kOut);
  for (size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>(i % 5) * 0.05f - 0.1f;
  TensorPtr grad = F32({kRows, kOut}, g);
  TensorPtr narrow = F32({kRows, kOut - 1}, std::vector<float>(kRows * (kOut - 1), 0.1f));
  TensorPtr short_grad = F32({kRows - 1, kOut}, std::vector<float>((kRows - 1) * kOut, 0.1f));
  TensorPtr int_grad = I32({kRows, kOut}, std::vector<int32_t>(kRows * kOut, 1));

  for (dpar_engine* e : {engine(), reference()}) {
    dpar_tensor* out = nullptr;
    ASSERT_OK(dpar_engine_forward(&out, e, batch_.x.get()));
    dpar_tensor_free(out);
  }
  EXPECT_INVALID("grad_output", dpar_engine_backward(engine(), narrow.get()));
  EXPECT_INVALID("grad_output", dpar_engine_backward(engine(), short_grad.get()));
  EXPECT_INVALID("f32", dpar_engine_backward(engine(), int_grad.get()));
  EXPECT_DPAR_ERROR(DPAR_ERR_INVALID_STATE, "pending", dpar_engine_step(engine()));
  for (dpar_engine* e : {engine(), reference()}) {
    ASSERT_OK(dpar_engine_backward(e, grad.get()));
    ASSERT_OK(dpar_engine_step(e));
  }
  ExpectSameAsReference();
}

TEST_F(EngineFixture, ForwardRefusesBadInputAndLeavesOutNull) {
  TensorPtr wide = F32({kRows, kIn + 1}, Inputs(kRows, kIn + 1));
  TensorPtr labels = I32({kRows, kIn}, std::vector<int32_t>(kRows * kIn, 0));
  dpar_tensor* out = Sentinel<dpar_tensor>();
  EXPECT_INVALID("out", dpar_engine_forward(nullptr, engine(), batch_.x.get()));
  EXPECT_INVALID("input", dpar_engine_forward(&out, engine(), nullptr));
  EXPECT_EQ(out, nullptr);
  out = Sentinel<dpar_tensor>();
  EXPECT_INVALID("does not fit", dpar_engine_forward(&out, engine(), wide.get()));
  EXPECT_EQ(out, nullptr);
  out = Sentinel<dpar_tensor>();
  EXPECT_INVALID("f32", dpar_engine_forward(&out, engine(), labels.get()));
  EXPECT_EQ(out, nullptr);

  // A good forward gathers (B, 3) in batch order, equal to the reference's.
  ASSERT_OK(dpar_engine_set_training(engine(), 0));
  ASSERT_OK(dpar_engine_set_training(reference(), 0));
  dpar_tensor *ya = nullptr, *yb = nullptr;
  ASSERT_OK(dpar_engine_forward(&ya, engine(), batch_.x.get()));
  TensorPtr a(ya);
  ASSERT_OK(dpar_engine_forward(&yb, reference(), batch_.x.get()));
  TensorPtr b(yb);
  EXPECT_EQ(ShapeOf(a.get()), (std::vector<int64_t>{kRows, kOut}));
  EXPECT_TRUE(SameBits(ToHost<float>(a.get(), kRows * kOut), ToHost<float>(b.get(), kRows * kOut)));
  ASSERT_OK(dpar_engine_set_training(engine(), 1));
  ASSERT_OK(dpar_engine_set_training(reference(), 1));
  ExpectSameAsReference();
}

TEST_F(EngineFixture, QueriesCheckTheirArguments) {
  size_t n = 0;
  EXPECT_INVALID("out", dpar_engine_num_replicas(nullptr, engine()));

  dpar_device d{-1, -1};
  EXPECT_INVALID("out", dpar_engine_replica_device(nullptr, engine(), 0));
  EXPECT_INVALID("replica", dpar_engine_replica_device(&d, engine(), 2));
  EXPECT_INVALID("replica", dpar_engine_replica_device(&d, engine(), SIZE_MAX));
  EXPECT_EQ(d.index, -1);

  size_t rows[4] = {99, 99, 99, 99};
  EXPECT_INVALID("out", dpar_engine_split(nullptr, engine(), 5, 4));
  EXPECT_INVALID("capacity", dpar_engine_split(rows, engine(), 5, 1));
  EXPECT_INVALID("batch", dpar_engine_split(rows, engine(), 0, 4));
  EXPECT_EQ(rows[0], 99u);
  ASSERT_OK(dpar_engine_split(rows, engine(), 5, 2));
  EXPECT_EQ(rows[0], 3u);
  EXPECT_EQ(rows[1], 2u);
  EXPECT_EQ(rows[2], 99u) << "wrote past the replicas";

  EXPECT_INVALID("out", dpar_engine_step_count(nullptr, engine()));

  float losses[3] = {7, 7, 7};
  EXPECT_INVALID("out", dpar_engine_replica_losses(nullptr, engine(), 2));
  EXPECT_INVALID("capacity", dpar_engine_replica_losses(losses, engine(), 1));
  EXPECT_EQ(losses[0], 7.0f);
  // Before any step no replica got rows: NaN for each.
  ASSERT_OK(dpar_engine_replica_losses(losses, engine(), 3));
  EXPECT_TRUE(std::isnan(losses[0]));
  EXPECT_TRUE(std::isnan(losses[1]));
  EXPECT_EQ(losses[2], 7.0f) << "wrote past the replicas";

  std::vector<float> p(kParams + 1, 42.0f);
  EXPECT_INVALID("dst", dpar_engine_get_params(nullptr, engine(), 0, kParams));
  EXPECT_INVALID("replica", dpar_engine_get_params(p.data(), engine(), 2, kParams));
  EXPECT_INVALID("count", dpar_engine_get_params(p.data(), engine(), 0, kParams - 1));
  EXPECT_INVALID("count", dpar_engine_get_params(p.data(), engine(), 0, kParams + 1));
  EXPECT_INVALID("count", dpar_engine_get_params(p.data(), engine(), 0, 0));
  EXPECT_EQ(p, std::vector<float>(kParams + 1, 42.0f)) << "refused reads wrote nothing";

  ASSERT_OK(dpar_engine_num_replicas(&n, engine()));
  EXPECT_EQ(n, 2u);
  ExpectSameAsReference();
}

TEST_F(EngineFixture, SplitOfAHugeBatchIsRefusedOrCorrect) {
  // A batch too large for the engine's int64 row counts is refused, or split correctly; never split into nothing.
  for (size_t huge : {SIZE_MAX, (SIZE_MAX >> 1) + 1}) {
    SCOPED_TRACE(huge);
    size_t rows[2] = {99, 99};
    dpar_clear_error();
    const dpar_status s = dpar_engine_split(rows, engine(), huge, 2);
    if (s == DPAR_OK)
      EXPECT_EQ(rows[0] + rows[1], huge) << "split into " << rows[0] << " + " << rows[1];
    else
      EXPECT_TRUE(IsDparError(s, DPAR_ERR_INVALID_ARGUMENT, "batch"));
  }
}

TEST_F(EngineFixture, ReplicaLossesAreNaNForReplicasWithoutRows) {
  EnginePtr four = NewEngine(model_.get(), 4);
  Batch three = MakeBatch(3);  // split 1, 1, 1, 0
  float loss = -1.0f;
  ASSERT_OK(dpar_engine_train_step(&loss, four.get(), three.x.get(), three.y.get()));
  float losses[4] = {};
  ASSERT_OK(dpar_engine_replica_losses(losses, four.get(), 4));
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(std::isfinite(losses[r]) && losses[r] >= 0.0f) << r;
  EXPECT_TRUE(std::isnan(losses[3]));
  EXPECT_NEAR((losses[0] + losses[1] + losses[2]) / 3.0f, loss, 1e-5f);
}

TEST_F(EngineFixture, SetLrRefusesNegativeAndNonFiniteRatesAndKeepsTheOldOne) {
  TrainBoth(1);
  EXPECT_INVALID("lr", dpar_engine_set_lr(engine(), -0.1f));
  EXPECT_INVALID("lr", dpar_engine_set_lr(engine(), std::nanf("")));
  EXPECT_INVALID("lr", dpar_engine_set_lr(engine(), std::numeric_limits<float>::infinity()));
  EXPECT_INVALID("lr", dpar_engine_set_lr(engine(), -std::numeric_limits<float>::infinity()));
  ExpectSameAsReference();

  // lr 0 is allowed, and freezes the parameters (even with momentum).
  ASSERT_OK(dpar_engine_set_lr(engine(), 0.0f));
  const std::vector<float> frozen = Params(engine());
  ASSERT_OK(dpar_engine_train_step(nullptr, engine(), batch_.x.get(), batch_.y.get()));
  EXPECT_TRUE(SameBits(Params(engine()), frozen));
}

TEST_F(EngineFixture, InjectFaultChecksReplicaAndKind) {
  EXPECT_INVALID("replica", dpar_engine_inject_fault(engine(), 2, DPAR_FAULT_FORWARD));
  EXPECT_INVALID("fault", dpar_engine_inject_fault(engine(), 0, DPAR_FAULT_BACKWARD + 1));
  EXPECT_INVALID("fault", dpar_engine_inject_fault(engine(), 0, -1));
  // Arming then clearing leaves nothing armed.
  ASSERT_OK(dpar_engine_inject_fault(engine(), 1, DPAR_FAULT_FORWARD));
  ASSERT_OK(dpar_engine_inject_fault(engine(), 1, DPAR_FAULT_NONE));
  ExpectSameAsReference();
}

TEST_F(EngineFixture, SetTrainingTakesAnyNonzeroAsTraining) {
  ASSERT_OK(dpar_engine_set_training(engine(), 7));
  dpar_tensor* out = nullptr;
  ASSERT_OK(dpar_engine_forward(&out, engine(), batch_.x.get()));
  TensorPtr y(out);
  TensorPtr grad = F32({kRows, kOut}, std::vector<float>(kRows * kOut, 0.0f));
  EXPECT_OK(dpar_engine_backward(engine(), grad.get()));  // a training-mode forward was kept
  ASSERT_OK(dpar_engine_zero_grad(engine()));
  ExpectSameAsReference();
}

struct HookLog {
  std::mutex mutex;
  std::vector<std::vector<int64_t>> calls;  // replica, input shape, output shape
  static dpar_status Record(void* payload, size_t replica, const int64_t* in, size_t in_ndim, const int64_t* out,
                            size_t out_ndim) {
    auto* log = static_cast<HookLog*>(payload);
    std::vector<int64_t> entry{static_cast<int64_t>(replica)};
    entry.insert(entry.end(), in, in + in_ndim);
    entry.push_back(-1);
    entry.insert(entry.end(), out, out + out_ndim);
    std::lock_guard<std::mutex> lock(log->mutex);
    log->calls.push_back(entry);
    return DPAR_OK;
  }
};

TEST_F(EngineFixture, ForwardHookSeesEachReplicasChunkAndCanBeRemoved) {
  HookLog log;
  ASSERT_OK(dpar_engine_set_forward_hook(engine(), &HookLog::Record, &log, nullptr));
  Batch three = MakeBatch(3);  // split 2, 1
  dpar_tensor* out = nullptr;
  ASSERT_OK(dpar_engine_forward(&out, engine(), three.x.get()));
  dpar_tensor_free(out);
  std::sort(log.calls.begin(), log.calls.end());
  EXPECT_EQ(log.calls, (std::vector<std::vector<int64_t>>{{0, 2, kIn, -1, 2, kOut}, {1, 1, kIn, -1, 1, kOut}}));

  ASSERT_OK(dpar_engine_set_forward_hook(engine(), nullptr, &log, nullptr));  // removes it
  log.calls.clear();
  ASSERT_OK(dpar_engine_zero_grad(engine()));
  ASSERT_OK(dpar_engine_train_step(nullptr, engine(), batch_.x.get(), batch_.y.get()));
  EXPECT_TRUE(log.calls.empty());
  ASSERT_OK(dpar_engine_train_step(nullptr, reference(), batch_.x.get(), batch_.y.get()));
  ExpectSameAsReference();
}

// A pinned worker gets as many cores as it has GEMM threads (its OpenMP team inherits its affinity; on one core
// the team's threads would take turns), one core with one GEMM thread; the forward hook runs on the worker.
struct AffinityLog {
  std::mutex mutex;
  std::vector<std::pair<size_t, int>> cores;  // replica, CPUs in its worker's affinity mask
  static dpar_status Record(void* payload, size_t replica, const int64_t*, size_t, const int64_t*, size_t) {
    auto* log = static_cast<AffinityLog*>(payload);
    cpu_set_t set;
    CPU_ZERO(&set);
    const int n = pthread_getaffinity_np(pthread_self(), sizeof set, &set) == 0 ? CPU_COUNT(&set) : -1;
    std::lock_guard<std::mutex> lock(log->mutex);
    log->cores.emplace_back(replica, n);
    return DPAR_OK;
  }
};

TEST(EngineWorkers, APinnedWorkerHasACoreForEachGemmThread) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  ASSERT_EQ(sched_getaffinity(0, sizeof allowed, &allowed), 0);
  const int ncpu = CPU_COUNT(&allowed);
  if (ncpu < 2) GTEST_SKIP() << "one CPU allowed: every mask is that CPU";
  ModelPtr m = LinearModel();
  Batch batch = MakeBatch(4);
  for (size_t threads : {size_t{1}, size_t{2}}) {
    dpar_engine_options opts = DPAR_ENGINE_OPTIONS_INIT;
    opts.num_cpu_devices = 2;
    opts.blas_threads = threads;
    opts.pin_workers = 1;
    opts.timeout_seconds = 60;
    const dpar_optimizer_options o = SgdMomentum();
    dpar_engine* raw = nullptr;
    ASSERT_OK(dpar_engine_create(&raw, m.get(), &o, &opts));
    EnginePtr e(raw);
    AffinityLog log;
    ASSERT_OK(dpar_engine_set_forward_hook(e.get(), &AffinityLog::Record, &log, nullptr));
    ASSERT_OK(dpar_engine_train_step(nullptr, e.get(), batch.x.get(), batch.y.get()));
    std::sort(log.cores.begin(), log.cores.end());
    const int want = static_cast<int>(threads);
    EXPECT_EQ(log.cores, (std::vector<std::pair<size_t, int>>{{0, want}, {1, want}})) << threads << " GEMM threads";
  }
}

// =================================================================================================================
// Memory: what each replica's device holds
// =================================================================================================================

struct Held {
  int64_t allocated = -1, peak = -1;
};
Held MemoryStats(const dpar_engine* e, size_t replica) {
  Held h;
  EXPECT_OK(dpar_engine_memory_stats(&h.allocated, &h.peak, e, replica));
  return h;
}

TEST(MemoryStats, EachReplicaHoldsItsStateAndTheResetPeakIsWhatIsHeld) {
  ModelPtr model = LinearModel();
  EnginePtr e = NewEngine(model.get(), 2);  // SGD with momentum: one state buffer as large as the parameters
  Batch batch = MakeBatch();
  float loss = 0;
  ASSERT_OK(dpar_engine_train_step(&loss, e.get(), batch.x.get(), batch.y.get()));
  // Each replica holds its parameters and gradients; the optimizer's state may be cut among the replicas (ZeRO's
  // shards), so the two hold it whole between them.
  const int64_t bytes = static_cast<int64_t>(kParams) * 4;
  int64_t total = 0;
  for (size_t r = 0; r < 2; ++r) {
    const Held h = MemoryStats(e.get(), r);
    EXPECT_GE(h.allocated, 2 * bytes) << "replica " << r;
    EXPECT_GE(h.peak, h.allocated) << "replica " << r;
    total += h.allocated;
    ASSERT_OK(dpar_engine_reset_peak_memory(e.get(), r));
    const Held reset = MemoryStats(e.get(), r);
    EXPECT_EQ(reset.peak, reset.allocated) << "replica " << r;
    EXPECT_EQ(reset.allocated, h.allocated) << "replica " << r;
  }
  EXPECT_GE(total, 2 * 2 * bytes + bytes);
  // Either output may be left out; each alone is the same figure.
  int64_t allocated = -1, peak = -1;
  ASSERT_OK(dpar_engine_memory_stats(&allocated, nullptr, e.get(), 1));
  ASSERT_OK(dpar_engine_memory_stats(nullptr, &peak, e.get(), 1));
  EXPECT_EQ(allocated, MemoryStats(e.get(), 1).allocated);
  EXPECT_EQ(peak, allocated);
  // A second step's scratch lifts the peak above what stays held, or leaves it there; never below.
  ASSERT_OK(dpar_engine_train_step(&loss, e.get(), batch.x.get(), batch.y.get()));
  const Held after = MemoryStats(e.get(), 0);
  EXPECT_GE(after.peak, after.allocated);
}

TEST(MemoryStats, RefusesABadReplicaBothOutputsNullAndABadHandleWritingNothing) {
  ModelPtr model = LinearModel();
  EnginePtr e = NewEngine(model.get(), 2);
  int64_t allocated = 7, peak = 7;
  EXPECT_INVALID("replica: 2", dpar_engine_memory_stats(&allocated, &peak, e.get(), 2));
  EXPECT_INVALID("2 replicas", dpar_engine_memory_stats(&allocated, &peak, e.get(), 2));
  EXPECT_INVALID("replica: 2", dpar_engine_reset_peak_memory(e.get(), 2));
  EXPECT_INVALID("peak_bytes", dpar_engine_memory_stats(nullptr, nullptr, e.get(), 0));
  EXPECT_INVALID("engine", dpar_engine_memory_stats(&allocated, &peak, nullptr, 0));
  EXPECT_INVALID("engine", dpar_engine_reset_peak_memory(nullptr, 0));
  EXPECT_EQ(allocated, 7);
  EXPECT_EQ(peak, 7);
}

// What forward and backward add to what a replica held once the engine was made, in `precision`, for the MLP
// 784-512-(512-)...-10 with `hidden` hidden layers and ReLUs, at 64 rows on one device: the activations kept for
// backward and the gradient buffers (test_activation_memory.cpp's plan). Returns false where the precision is not
// supported here.
constexpr int64_t kMlpIn = 784, kMlpHidden = 512, kMlpOut = 10, kMlpRows = 64;
bool ActivationBytes(int32_t precision, int hidden, int64_t* held, int64_t* created) {
  dpar_model* m = nullptr;
  EXPECT_OK(dpar_model_create(&m, nullptr));
  ModelPtr model(m);
  int64_t in = kMlpIn;
  for (int h = 0; h < hidden; ++h, in = kMlpHidden) {
    EXPECT_OK(dpar_model_add_linear(m, in, kMlpHidden, 1));
    EXPECT_OK(dpar_model_add_activation(m, DPAR_RELU));
  }
  EXPECT_OK(dpar_model_add_linear(m, kMlpHidden, kMlpOut, 1));
  EnginePtr e = NewEngine(m, 1);
  const dpar_status s = dpar_engine_set_precision(e.get(), precision);
  if (s == DPAR_ERR_NOT_SUPPORTED) return false;
  EXPECT_OK(s);
  // The batch first: its tensors are cpu:0's too.
  Batch batch{F32({kMlpRows, kMlpIn}, Inputs(kMlpRows, kMlpIn)), I32({kMlpRows}, Labels(kMlpRows, kMlpOut))};
  *created = MemoryStats(e.get(), 0).allocated;
  float loss = 0;
  EXPECT_OK(dpar_engine_accumulate(&loss, e.get(), batch.x.get(), batch.y.get()));
  *held = MemoryStats(e.get(), 0).allocated - *created;
  return true;
}

TEST(MemoryStats, Bf16KeepsTheHiddenActivationsInHalfTheBytes) {
  for (int hidden : {2, 4}) {
    int64_t f32 = 0, bf16 = 0, f32_created = 0, bf16_created = 0;
    ASSERT_TRUE(ActivationBytes(DPAR_F32, hidden, &f32, &f32_created));
    if (!ActivationBytes(DPAR_BF16, hidden, &bf16, &bf16_created)) GTEST_SKIP() << "no bf16 here: " << dpar_last_error();
    // As test_activation_memory.cpp measures: bf16 keeps each hidden activation in half its f32 bytes, and adds
    // the input's bf16 copy (kept for the first layer's weight gradient) and one buffer for the rounded gradient
    // (the widest layer's). With two hidden layers those cost more than the halves save; from three on, less.
    const int64_t input_copy = kMlpRows * kMlpIn * 2, gradient_room = kMlpRows * kMlpHidden * 2;
    const int64_t hidden_saved = hidden * kMlpRows * kMlpHidden * 2;
    EXPECT_EQ(bf16 - f32, input_copy + gradient_room - hidden_saved)
        << hidden << " hidden layers: f32 " << f32 << " B, bf16 " << bf16 << " B";
    if (hidden == 4) EXPECT_LT(bf16, f32);
    std::printf("%d hidden layers at %lld rows: forward and backward hold f32 %lld B, bf16 %lld B; before them cpu:0 "
                "held f32 %lld B, bf16 %lld B (the engine and the batch; bf16 adds the weights' bf16 copy)\n",
                hidden, static_cast<long long>(kMlpRows), static_cast<long long>(f32), static_cast<long long>(bf16),
                static_cast<long long>(f32_created), static_cast<long long>(bf16_created));
  }
}

// =================================================================================================================
// Checkpoints
// =================================================================================================================

TEST_F(EngineFixture, SaveAndLoadCheckTheirPathAndLoseNothing) {
  TempDir dir;
  TrainBoth(2);
  EXPECT_INVALID("path", dpar_engine_save(engine(), nullptr));
  EXPECT_INVALID("path", dpar_engine_save(engine(), ""));
  EXPECT_INVALID("path", dpar_engine_load(engine(), nullptr));
  EXPECT_INVALID("path", dpar_engine_load(engine(), ""));

  const std::string unwritable = dir / "no/such/directory/ckpt.safetensors";
  EXPECT_DPAR_ERROR(DPAR_ERR_IO, unwritable, dpar_engine_save(engine(), unwritable.c_str()));

  const std::string missing = dir / "missing.safetensors";
  EXPECT_DPAR_ERROR(DPAR_ERR_IO, missing, dpar_engine_load(engine(), missing.c_str()));
  EXPECT_DPAR_ERROR(DPAR_ERR_IO, dir / "", dpar_engine_load(engine(), (dir / "").c_str()));  // a directory

  const std::string garbage = dir / "garbage.safetensors";
  WriteFile(garbage, "this is not a safetensors file, it is just some text that goes on for a while");
  EXPECT_DPAR_ERROR(DPAR_ERR_CORRUPT, garbage, dpar_engine_load(engine(), garbage.c_str()));
  const std::string tiny = dir / "tiny.safetensors";
  WriteFile(tiny, "abc");
  EXPECT_DPAR_ERROR(DPAR_ERR_CORRUPT, tiny, dpar_engine_load(engine(), tiny.c_str()));

  ExpectSameAsReference();
}

TEST(Trace, StartAndStopAreCheckedAndTheFileIsWritten) {
  TempDir dir;
  const std::string path = dir / "trace.json";
  EXPECT_INVALID("engine", dpar_engine_trace_start(nullptr));
  EXPECT_INVALID("engine", dpar_engine_trace_stop(nullptr, path.c_str()));
  ModelPtr m = LinearModel();
  EnginePtr e = NewEngine(m.get(), 2);
  EXPECT_DPAR_ERROR(DPAR_ERR_INVALID_STATE, "no trace was started", dpar_engine_trace_stop(e.get(), nullptr));
  ASSERT_OK(dpar_engine_trace_start(e.get()));
  Batch b = MakeBatch(kRows, 1);
  ASSERT_OK(dpar_engine_train_step(nullptr, e.get(), b.x.get(), b.y.get()));
  EXPECT_INVALID("path", dpar_engine_trace_stop(e.get(), ""));
  EXPECT_DPAR_ERROR(DPAR_ERR_IO, "/nonexistent-dpar-dir/trace.json",
                    dpar_engine_trace_stop(e.get(), "/nonexistent-dpar-dir/trace.json"));
  // NULL only stops; the step after it is not recorded, and what was recorded stays to be written.
  ASSERT_OK(dpar_engine_trace_stop(e.get(), nullptr));
  ASSERT_OK(dpar_engine_train_step(nullptr, e.get(), b.x.get(), b.y.get()));
  ASSERT_OK(dpar_engine_trace_stop(e.get(), path.c_str()));
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("\"traceEvents\""), std::string::npos);
  EXPECT_NE(text.find("replica 1 (cpu:1) worker"), std::string::npos);
  // One step: its call on the calling thread, and each of the 2 replicas' jobs.
  size_t steps = 0;
  for (size_t at = text.find("\"name\":\"train_step\""); at != std::string::npos;
       at = text.find("\"name\":\"train_step\"", at + 1))
    ++steps;
  EXPECT_EQ(steps, 3u);
}

TEST(Checkpoint, SaveThenLoadRoundTripsParametersOptimizerStateAndStepCount) {
  TempDir dir;
  const std::string path = dir / "ckpt.safetensors";
  ModelPtr m = LinearModel();
  EnginePtr e = NewEngine(m.get(), 2);
  auto train = [](dpar_engine* engine, int first, int count) {
    for (int i = first; i < first + count; ++i) {
      Batch b = MakeBatch(kRows, i);
      ASSERT_OK(dpar_engine_train_step(nullptr, engine, b.x.get(), b.y.get()));
    }
  };
  train(e.get(), 0, 3);
  ASSERT_OK(dpar_engine_save(e.get(), path.c_str()));
  EXPECT_TRUE(std::filesystem::exists(path));
  const std::vector<float> saved = Params(e.get());
  train(e.get(), 3, 2);
  const std::vector<float> straight = Params(e.get());
  ASSERT_FALSE(SameBits(saved, straight));

  // Load into the same engine: back to step 3, and training on gives the same parameters as training straight.
  ASSERT_OK(dpar_engine_load(e.get(), path.c_str()));
  EXPECT_EQ(StepCount(e.get()), 3);
  for (size_t r = 0; r < 2; ++r) EXPECT_TRUE(SameBits(Params(e.get(), r), saved)) << r;
  train(e.get(), 3, 2);
  EXPECT_TRUE(SameBits(Params(e.get()), straight)) << "the momentum buffers were restored";

  // Load into a fresh engine whose model had another seed: the same again.
  ModelPtr other_init = LinearModel(99);
  EnginePtr fresh = NewEngine(other_init.get(), 2);
  ASSERT_FALSE(SameBits(Params(fresh.get()), saved));
  ASSERT_OK(dpar_engine_load(fresh.get(), path.c_str()));
  EXPECT_EQ(StepCount(fresh.get()), 3);
  EXPECT_TRUE(SameBits(Params(fresh.get()), saved));
  train(fresh.get(), 3, 2);
  EXPECT_TRUE(SameBits(Params(fresh.get()), straight));

  // Another replica count loads the same state into every replica. (Training on is not compared bit for bit:
  // another split sums the gradient in another order.)
  EnginePtr three = NewEngine(other_init.get(), 3);
  ASSERT_OK(dpar_engine_load(three.get(), path.c_str()));
  EXPECT_EQ(StepCount(three.get()), 3);
  for (size_t r = 0; r < 3; ++r) EXPECT_TRUE(SameBits(Params(three.get(), r), saved)) << r;
}

TEST(Checkpoint, AnotherModelsOrOptimizersCheckpointIsAMismatchAndChangesNothing) {
  TempDir dir;
  const std::string narrow_path = dir / "narrow.safetensors";
  const std::string adam_path = dir / "adam.safetensors";
  ModelPtr narrow_model = LinearModel(7, kIn, 2);
  EnginePtr narrow = NewEngine(narrow_model.get(), 2);
  ASSERT_OK(dpar_engine_save(narrow.get(), narrow_path.c_str()));
  ModelPtr m = LinearModel();
  dpar_optimizer_options adam_opts = DPAR_OPTIMIZER_OPTIONS_INIT;
  adam_opts.kind = DPAR_ADAM;
  adam_opts.lr = 1e-3f;
  EnginePtr adam = NewEngine(m.get(), 2, DPAR_LOSS_CROSS_ENTROPY, adam_opts);
  ASSERT_OK(dpar_engine_save(adam.get(), adam_path.c_str()));

  EnginePtr e = NewEngine(m.get(), 2);
  EnginePtr reference = NewEngine(m.get(), 2);
  Batch b = MakeBatch();
  ASSERT_OK(dpar_engine_train_step(nullptr, e.get(), b.x.get(), b.y.get()));
  ASSERT_OK(dpar_engine_train_step(nullptr, reference.get(), b.x.get(), b.y.get()));
  EXPECT_DPAR_ERROR(DPAR_ERR_MISMATCH, narrow_path, dpar_engine_load(e.get(), narrow_path.c_str()));
  EXPECT_DPAR_ERROR(DPAR_ERR_MISMATCH, "optimizer", dpar_engine_load(e.get(), adam_path.c_str()));
  EXPECT_EQ(StepCount(e.get()), 1);
  EXPECT_TRUE(SameBits(Params(e.get()), Params(reference.get())));
  ASSERT_OK(dpar_engine_train_step(nullptr, e.get(), b.x.get(), b.y.get()));
  ASSERT_OK(dpar_engine_train_step(nullptr, reference.get(), b.x.get(), b.y.get()));
  EXPECT_TRUE(SameBits(Params(e.get()), Params(reference.get())));
}

TEST(Checkpoint, ATruncatedCheckpointIsCorruptAndChangesNothing) {
  TempDir dir;
  const std::string path = dir / "ckpt.safetensors";
  ModelPtr m = LinearModel();
  EnginePtr e = NewEngine(m.get(), 2);
  Batch b = MakeBatch();
  ASSERT_OK(dpar_engine_train_step(nullptr, e.get(), b.x.get(), b.y.get()));
  ASSERT_OK(dpar_engine_save(e.get(), path.c_str()));
  ASSERT_OK(dpar_engine_train_step(nullptr, e.get(), b.x.get(), b.y.get()));
  const std::vector<float> before = Params(e.get());
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 10);
  EXPECT_DPAR_ERROR(DPAR_ERR_CORRUPT, path, dpar_engine_load(e.get(), path.c_str()));
  EXPECT_TRUE(SameBits(Params(e.get()), before));
  EXPECT_EQ(StepCount(e.get()), 2);
}

// =================================================================================================================
// The engine's lock
// =================================================================================================================

TEST(EngineLock, ConcurrentTrainStepsOnOneEngineAreSerialised) {
  ModelPtr m = LinearModel();
  EnginePtr e = NewEngine(m.get(), 2);
  Batch b = MakeBatch();
  constexpr int kStepsPerThread = 50;
  std::atomic<int> failures{0};
  std::atomic<bool> done{false};
  auto trainer = [&] {
    for (int i = 0; i < kStepsPerThread; ++i)
      if (dpar_engine_train_step(nullptr, e.get(), b.x.get(), b.y.get()) != DPAR_OK) ++failures;
  };
  // A third thread reads while the two train: the count only grows.
  std::atomic<int> reader_failures{0};
  std::thread reader([&] {
    size_t last = 0;
    while (!done) {
      size_t n = 0;
      if (dpar_engine_step_count(&n, e.get()) != DPAR_OK || n < last || n > 2 * kStepsPerThread) ++reader_failures;
      last = n;
      std::vector<float> p(kParams);
      if (dpar_engine_get_params(p.data(), e.get(), 1, kParams) != DPAR_OK) ++reader_failures;
    }
  });
  std::thread a(trainer), c(trainer);
  a.join();
  c.join();
  done = true;
  reader.join();
  EXPECT_EQ(failures, 0);
  EXPECT_EQ(reader_failures, 0);
  EXPECT_EQ(StepCount(e.get()), 2 * kStepsPerThread);
  EXPECT_TRUE(SameBits(Params(e.get(), 0), Params(e.get(), 1))) << "replicas stayed identical";

  // The same 100 steps one after another give the same parameters: the batch is the same every step.
  EnginePtr serial = NewEngine(m.get(), 2);
  for (int i = 0; i < 2 * kStepsPerThread; ++i)
    ASSERT_OK(dpar_engine_train_step(nullptr, serial.get(), b.x.get(), b.y.get()));
  EXPECT_TRUE(SameBits(Params(e.get()), Params(serial.get())));
}

// =================================================================================================================
// Datasets and loaders
// =================================================================================================================

// A tiny IDX pair: 10 images of 2x3 pixels, pixel j of sample i = 16 i + j (so each sample is recognisable by its
// content), and label (7 i) mod 4, so 4 classes.
constexpr size_t kSamples = 10;
constexpr size_t kFeatures = 6;
int32_t LabelOf(size_t sample) { return static_cast<int32_t>((7 * sample) % 4); }

struct IdxFiles {
  TempDir dir;
  std::string images = dir / "images-idx3-ubyte";
  std::string labels = dir / "labels-idx1-ubyte";
  IdxFiles() {
    std::vector<uint8_t> pixels, labels_data;
    for (size_t i = 0; i < kSamples; ++i) {
      for (size_t j = 0; j < kFeatures; ++j) pixels.push_back(static_cast<uint8_t>(16 * i + j));
      labels_data.push_back(static_cast<uint8_t>(LabelOf(i)));
    }
    WriteIdx(images, 0x00000803u, {kSamples, 2, 3}, pixels);
    WriteIdx(labels, 0x00000801u, {kSamples}, labels_data);
  }
};

DatasetPtr LoadDataset(const IdxFiles& files) {
  dpar_dataset* d = nullptr;
  EXPECT_OK(dpar_dataset_load_idx(&d, files.images.c_str(), files.labels.c_str()));
  return DatasetPtr(d);
}

LoaderPtr NewLoader(const dpar_dataset* d, size_t batch, int shuffle, uint64_t seed, int drop_last) {
  dpar_loader* l = nullptr;
  EXPECT_OK(dpar_loader_create(&l, d, batch, shuffle, seed, drop_last));
  return LoaderPtr(l);
}

// Which sample a row of pixels is, from its content; -1 if it is none of them.
int SampleOf(const float* row) {
  const int first = static_cast<int>(std::lround(row[0] * 255.0f));
  if (first % 16 != 0) return -1;
  const int sample = first / 16;
  for (size_t j = 0; j < kFeatures; ++j)
    if (std::lround(row[j] * 255.0f) != 16 * sample + static_cast<int>(j)) return -1;
  return sample;
}

// One epoch: the samples in the order they came and the batch sizes; checks every label against its sample.
struct Epoch {
  std::vector<int> order;
  std::vector<int64_t> batch_sizes;
};
// dpar_loader_next, then the loader's borrowed batch (NULLs at the end of the epoch, or after a refusal).
dpar_status NextBatch(const dpar_tensor** x, const dpar_tensor** y, dpar_loader* loader) {
  int32_t more = -1;
  const dpar_status s = dpar_loader_next(&more, loader);
  *x = *y = nullptr;
  if (s != DPAR_OK) return s;
  EXPECT_TRUE(more == 0 || more == 1) << more;
  *x = dpar_loader_inputs(loader);
  *y = dpar_loader_labels(loader);
  EXPECT_EQ(*x != nullptr, more == 1) << dpar_last_error();
  EXPECT_EQ(*y != nullptr, more == 1) << dpar_last_error();
  return s;
}

Epoch ReadEpoch(dpar_loader* loader) {
  Epoch epoch;
  for (size_t guard = 0; guard < 100; ++guard) {
    const dpar_tensor *x = Sentinel<const dpar_tensor>(), *y = Sentinel<const dpar_tensor>();
    EXPECT_OK(NextBatch(&x, &y, loader));
    if (x == nullptr) {
      EXPECT_EQ(y, nullptr);
      return epoch;
    }
    const std::vector<int64_t> xs = ShapeOf(x), ys = ShapeOf(y);
    EXPECT_EQ(xs.size(), 2u);
    EXPECT_EQ(xs[1], static_cast<int64_t>(kFeatures));
    EXPECT_EQ(ys, (std::vector<int64_t>{xs[0]}));
    int32_t dtype = -1;
    EXPECT_OK(dpar_tensor_info(&dtype, nullptr, nullptr, y));
    EXPECT_EQ(dtype, DPAR_I32);
    const auto pixels = ToHost<float>(x, static_cast<size_t>(xs[0]) * kFeatures);
    const auto labels = ToHost<int32_t>(y, static_cast<size_t>(xs[0]));
    for (int64_t r = 0; r < xs[0]; ++r) {
      const int sample = SampleOf(pixels.data() + r * kFeatures);
      EXPECT_GE(sample, 0) << "row " << r << " is no sample of the dataset";
      if (sample >= 0) EXPECT_EQ(labels[static_cast<size_t>(r)], LabelOf(static_cast<size_t>(sample)));
      epoch.order.push_back(sample);
    }
    epoch.batch_sizes.push_back(xs[0]);
  }
  ADD_FAILURE() << "the epoch did not end";
  return epoch;
}

std::vector<int> AllSamples() {
  std::vector<int> all(kSamples);
  for (size_t i = 0; i < kSamples; ++i) all[i] = static_cast<int>(i);
  return all;
}

TEST(Dataset, LoadsAnIdxPairAndDescribesIt) {
  IdxFiles files;
  DatasetPtr d = LoadDataset(files);
  size_t samples = 0, features = 0, classes = 0;
  ASSERT_OK(dpar_dataset_info(&samples, &features, &classes, d.get()));
  EXPECT_EQ(samples, kSamples);
  EXPECT_EQ(features, kFeatures);
  EXPECT_EQ(classes, 4u);
  EXPECT_OK(dpar_dataset_info(nullptr, nullptr, nullptr, d.get()));  // outputs may be NULL
  EXPECT_INVALID("dataset", dpar_dataset_info(&samples, nullptr, nullptr, nullptr));
}

TEST(Dataset, LoadRefusesNullsAndNamesTheFileThatFails) {
  IdxFiles files;
  const char* images = files.images.c_str();
  const char* labels = files.labels.c_str();
  dpar_dataset* d = nullptr;
  EXPECT_INVALID("out", dpar_dataset_load_idx(nullptr, images, labels));
  d = Sentinel<dpar_dataset>();
  EXPECT_INVALID("images_path", dpar_dataset_load_idx(&d, nullptr, labels));
  EXPECT_EQ(d, nullptr);
  d = Sentinel<dpar_dataset>();
  EXPECT_INVALID("labels_path", dpar_dataset_load_idx(&d, images, nullptr));
  EXPECT_EQ(d, nullptr);

  const std::string missing = files.dir / "missing-images-idx3-ubyte";
  d = Sentinel<dpar_dataset>();
  EXPECT_DPAR_ERROR(DPAR_ERR_IO, missing, dpar_dataset_load_idx(&d, missing.c_str(), labels));
  EXPECT_EQ(d, nullptr);
  const std::string missing_labels = files.dir / "missing-labels.gz";
  EXPECT_DPAR_ERROR(DPAR_ERR_IO, missing_labels, dpar_dataset_load_idx(&d, images, missing_labels.c_str()));

  const std::string garbage = files.dir / "garbage";
  WriteFile(garbage, "GIF89a and so on, not an IDX file");
  EXPECT_DPAR_ERROR(DPAR_ERR_CORRUPT, garbage, dpar_dataset_load_idx(&d, garbage.c_str(), labels));
  const std::string truncated = files.dir / "truncated";
  WriteIdx(truncated, 0x00000803u, {kSamples, 2, 3}, std::vector<uint8_t>(kSamples * kFeatures - 1, 1));
  EXPECT_DPAR_ERROR(DPAR_ERR_CORRUPT, truncated, dpar_dataset_load_idx(&d, truncated.c_str(), labels));
  const std::string nine_labels = files.dir / "nine-labels";
  WriteIdx(nine_labels, 0x00000801u, {kSamples - 1}, std::vector<uint8_t>(kSamples - 1, 0));
  EXPECT_DPAR_ERROR(DPAR_ERR_MISMATCH, nine_labels, dpar_dataset_load_idx(&d, images, nine_labels.c_str()));
  EXPECT_EQ(d, nullptr);
}

TEST(Dataset, NormalizeChecksMeanAndStdAndRefusalsChangeNothing) {
  IdxFiles files;
  DatasetPtr d = LoadDataset(files);
  EXPECT_INVALID("dataset", dpar_dataset_normalize(nullptr, 0.5f, 0.25f));
  EXPECT_INVALID("std", dpar_dataset_normalize(d.get(), 0.5f, 0.0f));
  EXPECT_INVALID("std", dpar_dataset_normalize(d.get(), 0.5f, -1.0f));
  EXPECT_INVALID("std", dpar_dataset_normalize(d.get(), 0.5f, std::nanf("")));
  EXPECT_INVALID("mean", dpar_dataset_normalize(d.get(), std::nanf(""), 1.0f));
  EXPECT_INVALID("mean", dpar_dataset_normalize(d.get(), std::numeric_limits<float>::infinity(), 1.0f));
  {
    LoaderPtr l = NewLoader(d.get(), kSamples, 0, 0, 0);
    EXPECT_EQ(ReadEpoch(l.get()).order, AllSamples()) << "refused normalisations changed the pixels";
  }
  ASSERT_OK(dpar_dataset_normalize(d.get(), 0.5f, 0.25f));
  LoaderPtr l = NewLoader(d.get(), kSamples, 0, 0, 0);
  const dpar_tensor *x = nullptr, *y = nullptr;
  ASSERT_OK(NextBatch(&x, &y, l.get()));
  const auto pixels = ToHost<float>(x, kSamples * kFeatures);
  const float raw = static_cast<float>(16 * 3 + 2) / 255.0f;  // sample 3, pixel 2
  EXPECT_NEAR(pixels[3 * kFeatures + 2], (raw - 0.5f) / 0.25f, 1e-5f);
}

TEST(Loader, CreateChecksItsArguments) {
  IdxFiles files;
  DatasetPtr d = LoadDataset(files);
  dpar_loader* l = nullptr;
  EXPECT_INVALID("out", dpar_loader_create(nullptr, d.get(), 4, 1, 0, 0));
  l = Sentinel<dpar_loader>();
  EXPECT_INVALID("dataset", dpar_loader_create(&l, nullptr, 4, 1, 0, 0));
  EXPECT_EQ(l, nullptr);
  l = Sentinel<dpar_loader>();
  EXPECT_INVALID("batch_size", dpar_loader_create(&l, d.get(), 0, 1, 0, 0));
  EXPECT_EQ(l, nullptr);
  l = Sentinel<dpar_loader>();
  EXPECT_INVALID("batch_size", dpar_loader_create(&l, d.get(), kSamples + 1, 1, 0, 1));  // drop_last: no batch
  EXPECT_EQ(l, nullptr);
  // Without drop_last a batch larger than the dataset is one short batch.
  LoaderPtr big = NewLoader(d.get(), kSamples + 5, 1, 0, 0);
  size_t n = 0;
  ASSERT_OK(dpar_loader_num_batches(&n, big.get()));
  EXPECT_EQ(n, 1u);
  EXPECT_EQ(ReadEpoch(big.get()).batch_sizes, (std::vector<int64_t>{kSamples}));
}

TEST(Loader, AHugeBatchSizeIsRefusedOrCountedRight) {
  IdxFiles files;
  DatasetPtr d = LoadDataset(files);
  for (size_t huge : {SIZE_MAX, SIZE_MAX - 3}) {
    SCOPED_TRACE(huge);
    dpar_loader* raw = nullptr;
    dpar_clear_error();
    const dpar_status s = dpar_loader_create(&raw, d.get(), huge, 1, 0, 0);
    LoaderPtr l(raw);
    if (s != DPAR_OK) {
      EXPECT_TRUE(IsDparError(s, DPAR_ERR_INVALID_ARGUMENT, "batch_size"));
      continue;
    }
    size_t n = 0;
    ASSERT_OK(dpar_loader_num_batches(&n, l.get()));
    const Epoch epoch = ReadEpoch(l.get());
    EXPECT_EQ(n, epoch.batch_sizes.size()) << "num_batches disagrees with the batches next() yields";
    EXPECT_EQ(epoch.batch_sizes, (std::vector<int64_t>{kSamples}));
  }
}

TEST(Loader, YieldsEveryBatchWithTheLastSmallerUnlessDropped) {
  IdxFiles files;
  DatasetPtr d = LoadDataset(files);
  LoaderPtr keep = NewLoader(d.get(), 4, 1, 5, 0);
  LoaderPtr drop = NewLoader(d.get(), 4, 1, 5, 1);
  size_t n = 0;
  EXPECT_INVALID("out", dpar_loader_num_batches(nullptr, keep.get()));
  ASSERT_OK(dpar_loader_num_batches(&n, keep.get()));
  EXPECT_EQ(n, 3u);
  ASSERT_OK(dpar_loader_num_batches(&n, drop.get()));
  EXPECT_EQ(n, 2u);

  const Epoch kept = ReadEpoch(keep.get());
  EXPECT_EQ(kept.batch_sizes, (std::vector<int64_t>{4, 4, 2}));
  std::vector<int> sorted = kept.order;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, AllSamples()) << "every sample exactly once per epoch";

  const Epoch dropped = ReadEpoch(drop.get());
  EXPECT_EQ(dropped.batch_sizes, (std::vector<int64_t>{4, 4}));
  EXPECT_EQ(std::set<int>(dropped.order.begin(), dropped.order.end()).size(), 8u) << "no sample twice";
  EXPECT_EQ(dropped.order, std::vector<int>(kept.order.begin(), kept.order.begin() + 8))
      << "same seed and epoch: the same permutation";

  // After the end, next keeps answering NULL until the next epoch.
  const dpar_tensor *x = Sentinel<const dpar_tensor>(), *y = Sentinel<const dpar_tensor>();
  EXPECT_OK(NextBatch(&x, &y, keep.get()));
  EXPECT_EQ(x, nullptr);
  EXPECT_EQ(y, nullptr);
}

// A shuffle draws every permutation alike, so over many epochs every sample lands in every position about equally
// often (1 in kSamples of the epochs), keeping its own place included. Checked on the counts: each is within half
// of its expectation, many standard deviations away for a fair shuffle, while a shuffle that can never leave a
// sample where it was (or never move it, or favours some positions) has counts of 0 or far off.
TEST(Loader, ShufflePutsEverySampleInEveryPositionAlike) {
  IdxFiles files;
  DatasetPtr d = LoadDataset(files);
  LoaderPtr l = NewLoader(d.get(), kSamples, 1, 5, 0);
  constexpr int kEpochs = 1000;
  std::vector<std::vector<int>> count(kSamples, std::vector<int>(kSamples, 0));  // [sample][position]
  for (uint64_t epoch = 0; epoch < kEpochs; ++epoch) {
    ASSERT_OK(dpar_loader_start_epoch(l.get(), epoch));
    const Epoch e = ReadEpoch(l.get());
    ASSERT_EQ(e.order.size(), kSamples);
    for (size_t pos = 0; pos < kSamples; ++pos) {
      ASSERT_GE(e.order[pos], 0);
      ++count[static_cast<size_t>(e.order[pos])][pos];
    }
  }
  const int expected = kEpochs / static_cast<int>(kSamples);
  for (size_t sample = 0; sample < kSamples; ++sample)
    for (size_t pos = 0; pos < kSamples; ++pos)
      EXPECT_TRUE(count[sample][pos] > expected / 2 && count[sample][pos] < expected * 3 / 2)
          << "sample " << sample << " was at position " << pos << " in " << count[sample][pos] << " of " << kEpochs
          << " epochs (expected about " << expected << ")";
}

TEST(Loader, OrderIsAFunctionOfSeedAndEpoch) {
  IdxFiles files;
  DatasetPtr d = LoadDataset(files);
  LoaderPtr a = NewLoader(d.get(), 3, 1, 42, 0);
  LoaderPtr b = NewLoader(d.get(), 3, 1, 42, 0);
  LoaderPtr other_seed = NewLoader(d.get(), 3, 1, 43, 0);
  LoaderPtr unshuffled = NewLoader(d.get(), 3, 0, 42, 0);

  std::vector<std::vector<int>> orders;
  for (uint64_t epoch : {0u, 1u, 2u, 3u}) {
    ASSERT_OK(dpar_loader_start_epoch(a.get(), epoch));
    ASSERT_OK(dpar_loader_start_epoch(b.get(), epoch));
    ASSERT_OK(dpar_loader_start_epoch(unshuffled.get(), epoch));
    const Epoch ea = ReadEpoch(a.get());
    EXPECT_EQ(ea.order, ReadEpoch(b.get()).order) << "epoch " << epoch;
    std::vector<int> sorted = ea.order;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(sorted, AllSamples()) << "epoch " << epoch;
    EXPECT_EQ(ReadEpoch(unshuffled.get()).order, AllSamples()) << "no shuffle: the file's order";
    orders.push_back(ea.order);
  }
  EXPECT_EQ(std::set<std::vector<int>>(orders.begin(), orders.end()).size(), orders.size())
      << "different epochs give different orders";
  EXPECT_NE(orders[0], AllSamples()) << "shuffled";
  ASSERT_OK(dpar_loader_start_epoch(other_seed.get(), 0));
  EXPECT_NE(ReadEpoch(other_seed.get()).order, orders[0]) << "another seed, another order";

  // Restarting an epoch midway replays it from the start, whatever came before.
  ASSERT_OK(dpar_loader_start_epoch(a.get(), 2));
  const dpar_tensor *x = nullptr, *y = nullptr;
  ASSERT_OK(NextBatch(&x, &y, a.get()));
  ASSERT_OK(dpar_loader_start_epoch(a.get(), 3));
  ASSERT_OK(dpar_loader_start_epoch(a.get(), 1));
  EXPECT_EQ(ReadEpoch(a.get()).order, orders[1]);
}

TEST(Loader, NextChecksItsOutputs) {
  IdxFiles files;
  DatasetPtr d = LoadDataset(files);
  LoaderPtr l = NewLoader(d.get(), 4, 0, 0, 0);
  EXPECT_INVALID("out", dpar_loader_next(nullptr, l.get()));
  int32_t more = 7;
  EXPECT_INVALID("loader", dpar_loader_next(&more, nullptr));
  EXPECT_EQ(more, 0);
  // No batch yet: the accessors answer NULL; a bad loader gets NULL and a message.
  EXPECT_EQ(dpar_loader_inputs(l.get()), nullptr);
  EXPECT_EQ(dpar_loader_labels(l.get()), nullptr);
  dpar_clear_error();
  EXPECT_EQ(dpar_loader_inputs(nullptr), nullptr);
  EXPECT_NE(std::string(dpar_last_error()).find("loader"), std::string::npos);
  EXPECT_EQ(dpar_loader_labels(reinterpret_cast<dpar_loader*>(d.get())), nullptr);
  EXPECT_NE(std::string(dpar_last_error()).find("loader"), std::string::npos);
  // The refused calls consumed no batch.
  EXPECT_EQ(ReadEpoch(l.get()).order, AllSamples());
}

TEST(Loader, BorrowedBatchesAreOrdinaryTensorsThatFreeIgnores) {
  IdxFiles files;
  DatasetPtr d = LoadDataset(files);
  LoaderPtr l = NewLoader(d.get(), 4, 1, 9, 0);
  dpar_model_options mo = DPAR_MODEL_OPTIONS_INIT;
  dpar_model* raw = nullptr;
  ASSERT_OK(dpar_model_create(&raw, &mo));
  ModelPtr m(raw);
  ASSERT_OK(dpar_model_add_linear(m.get(), kFeatures, 4, 1));
  EnginePtr e = NewEngine(m.get(), 2);

  const dpar_tensor *x = nullptr, *y = nullptr;
  ASSERT_OK(NextBatch(&x, &y, l.get()));
  ASSERT_NE(x, nullptr);
  // Accepted by every call that reads a tensor: the engine trains on them.
  EXPECT_OK(dpar_engine_train_step(nullptr, e.get(), x, y));
  size_t numel = 0;
  EXPECT_OK(dpar_tensor_info(nullptr, &numel, nullptr, x));
  EXPECT_EQ(numel, static_cast<size_t>(4 * kFeatures));
  const auto first_batch = ToHost<float>(x, 4 * kFeatures);

  // Freeing a borrowed tensor is a no-op: it stays readable and the loader keeps working.
  dpar_tensor_free(const_cast<dpar_tensor*>(x));
  dpar_tensor_free(const_cast<dpar_tensor*>(y));
  EXPECT_EQ(ToHost<float>(x, 4 * kFeatures), first_batch);
  const Epoch remaining = ReadEpoch(l.get());
  EXPECT_EQ(remaining.batch_sizes, (std::vector<int64_t>{4, 2}));

  std::vector<int> seen = remaining.order;
  for (size_t r = 0; r < 4; ++r) seen.push_back(SampleOf(first_batch.data() + r * kFeatures));
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, AllSamples());

  // The next epoch works as usual.
  ASSERT_OK(dpar_loader_start_epoch(l.get(), 1));
  EXPECT_EQ(ReadEpoch(l.get()).batch_sizes, (std::vector<int64_t>{4, 4, 2}));
}

TEST(Loader, BorrowedBatchesDieWithTheirLoader) {
  IdxFiles files;
  DatasetPtr d = LoadDataset(files);
  dpar_loader* l = nullptr;
  ASSERT_OK(dpar_loader_create(&l, d.get(), 4, 0, 0, 0));
  const dpar_tensor *x = nullptr, *y = nullptr;
  ASSERT_OK(NextBatch(&x, &y, l));
  dpar_loader_free(l);
  size_t numel = 0;
  EXPECT_INVALID("tensor", dpar_tensor_info(nullptr, &numel, nullptr, x));
  EXPECT_INVALID("tensor", dpar_tensor_info(nullptr, &numel, nullptr, y));
  dpar_tensor_free(const_cast<dpar_tensor*>(x));  // still a no-op
}

TEST(Loader, FreeingTheDatasetFirstDoesNotBreakItsLoader) {
  IdxFiles files;
  dpar_dataset* d = nullptr;
  ASSERT_OK(dpar_dataset_load_idx(&d, files.images.c_str(), files.labels.c_str()));
  dpar_loader* l = nullptr;
  ASSERT_OK(dpar_loader_create(&l, d, 4, 1, 3, 0));
  dpar_dataset_free(d);  // the caller's mistake: the loader borrows the dataset
  const Epoch epoch = ReadEpoch(l);
  std::vector<int> sorted = epoch.order;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, AllSamples());
  dpar_loader_free(l);
  dpar_dataset_free(d);  // frees it now, or a no-op if it was freed with the loader
  size_t samples = 0;
  EXPECT_INVALID("dataset", dpar_dataset_info(&samples, nullptr, nullptr, d));
}

TEST(Loader, FreeFunctionsAcceptNullAndStaleHandles) {
  dpar_dataset_free(nullptr);
  dpar_loader_free(nullptr);
  IdxFiles files;
  DatasetPtr d = LoadDataset(files);
  dpar_loader* l = nullptr;
  ASSERT_OK(dpar_loader_create(&l, d.get(), 4, 1, 0, 0));
  dpar_loader_free(l);
  dpar_loader_free(l);  // looked up before it is touched: a no-op
  // Handles of another type are not freed.
  dpar_loader_free(reinterpret_cast<dpar_loader*>(d.get()));
  ModelPtr m = LinearModel();
  dpar_dataset_free(reinterpret_cast<dpar_dataset*>(m.get()));
  EXPECT_EQ(NumLayers(m.get()), 1u);
  size_t samples = 0;
  EXPECT_OK(dpar_dataset_info(&samples, nullptr, nullptr, d.get()));
  EXPECT_EQ(samples, kSamples);
}

// Every call that takes a dataset or loader handle refuses a NULL, freed, foreign or wrong-type one.
std::vector<NamedCall> DatasetCalls(const dpar_dataset* bad, dpar_loader** loader_out) {
  return {
      {"dataset_info", [=] { size_t n; return dpar_dataset_info(&n, nullptr, nullptr, bad); }},
      {"dataset_normalize", [=] { return dpar_dataset_normalize(const_cast<dpar_dataset*>(bad), 0.0f, 1.0f); }},
      {"loader_create", [=] { return dpar_loader_create(loader_out, bad, 4, 1, 0, 0); }},
  };
}

std::vector<NamedCall> LoaderCalls(dpar_loader* bad, int32_t* more) {
  return {
      {"loader_start_epoch", [=] { return dpar_loader_start_epoch(bad, 1); }},
      {"loader_num_batches", [=] { size_t n; return dpar_loader_num_batches(&n, bad); }},
      {"loader_next", [=] { return dpar_loader_next(more, bad); }},
      {"loader_shard", [=] { return dpar_loader_shard(bad, 0, 1); }},
      {"loader_to_device", [=] { return dpar_loader_to_device(bad, dpar_device{DPAR_DEVICE_CPU, 0}); }},
  };
}

// The devices a loader may prepare batches on here: cpu:0, and cuda:0 where there is a GPU (which must be found
// where DPAR_TEST_REQUIRE_GPU says there is one).
std::vector<dpar_device> AheadDevices() {
  std::vector<dpar_device> devices = {{DPAR_DEVICE_CPU, 0}};
  size_t gpus = 0;
  if (dpar_device_count(&gpus, DPAR_DEVICE_CUDA) == DPAR_OK && gpus > 0)
    devices.push_back({DPAR_DEVICE_CUDA, 0});
  else if (dpar::test::gpu_required())
    ADD_FAILURE() << "DPAR_TEST_REQUIRE_GPU is set, but dpar finds no CUDA device: cuda:0 is not tested";
  return devices;
}

TEST(Loader, BatchesPreparedAheadOnADeviceAreTheSameBatches) {
  IdxFiles files;
  DatasetPtr d = LoadDataset(files);
  for (const dpar_device device : AheadDevices()) {
    for (int drop_last : {0, 1}) {
      LoaderPtr plain = NewLoader(d.get(), 3, 1, 42, drop_last);
      LoaderPtr ahead = NewLoader(d.get(), 3, 1, 42, drop_last);
      // Switched after a batch: the next batch is the one the plain loader yields next.
      const dpar_tensor *x = nullptr, *y = nullptr;
      ASSERT_OK(NextBatch(&x, &y, plain.get()));
      ASSERT_OK(NextBatch(&x, &y, ahead.get()));
      ASSERT_OK(dpar_loader_to_device(ahead.get(), device));
      EXPECT_EQ(ReadEpoch(ahead.get()).order, ReadEpoch(plain.get()).order) << "the rest of epoch 0";
      for (uint64_t epoch : {1u, 2u, 3u}) {
        ASSERT_OK(dpar_loader_start_epoch(plain.get(), epoch));
        ASSERT_OK(dpar_loader_start_epoch(ahead.get(), epoch));
        const Epoch a = ReadEpoch(ahead.get()), p = ReadEpoch(plain.get());
        EXPECT_EQ(a.order, p.order) << "epoch " << epoch << ", device kind " << device.kind;
        EXPECT_EQ(a.batch_sizes, p.batch_sizes) << "epoch " << epoch;
      }
      // Restarting midway, while the next batch is in preparation, replays the epoch from its start.
      ASSERT_OK(dpar_loader_start_epoch(ahead.get(), 2));
      ASSERT_OK(NextBatch(&x, &y, ahead.get()));
      dpar_device where{-1, -1};
      ASSERT_OK(dpar_tensor_info(nullptr, nullptr, &where, x));
      EXPECT_EQ(where.kind, device.kind);
      EXPECT_EQ(where.index, device.index);
      ASSERT_OK(dpar_tensor_info(nullptr, nullptr, &where, y));
      EXPECT_EQ(where.kind, device.kind);
      ASSERT_OK(dpar_loader_start_epoch(ahead.get(), 2));
      ASSERT_OK(dpar_loader_start_epoch(plain.get(), 2));
      EXPECT_EQ(ReadEpoch(ahead.get()).order, ReadEpoch(plain.get()).order) << "epoch 2 replayed";
      // A new shard takes effect from the next batch, though the batch after was prepared with the old one.
      ASSERT_OK(dpar_loader_start_epoch(ahead.get(), 4));
      ASSERT_OK(dpar_loader_start_epoch(plain.get(), 4));
      ASSERT_OK(NextBatch(&x, &y, ahead.get()));
      ASSERT_OK(NextBatch(&x, &y, plain.get()));
      ASSERT_OK(dpar_loader_shard(ahead.get(), 1, 2));
      ASSERT_OK(dpar_loader_shard(plain.get(), 1, 2));
      const Epoch a = ReadEpoch(ahead.get()), p = ReadEpoch(plain.get());
      EXPECT_EQ(a.order, p.order) << "sharded";
      EXPECT_EQ(a.batch_sizes, p.batch_sizes) << "sharded";
    }
  }
}

TEST(Loader, ToDeviceChecksItsDeviceAndARefusalChangesNothing) {
  IdxFiles files;
  DatasetPtr d = LoadDataset(files);
  LoaderPtr l = NewLoader(d.get(), 4, 0, 0, 0);
  EXPECT_INVALID("device", dpar_loader_to_device(l.get(), dpar_device{7, 0}));
  EXPECT_INVALID("device", dpar_loader_to_device(l.get(), dpar_device{DPAR_DEVICE_CPU, -1}));
  size_t gpus = 0;
  const bool cuda_built = dpar_device_count(&gpus, DPAR_DEVICE_CUDA) == DPAR_OK;
  const dpar_status s = dpar_loader_to_device(l.get(), dpar_device{DPAR_DEVICE_CUDA, static_cast<int32_t>(gpus)});
  EXPECT_EQ(s, !cuda_built ? DPAR_ERR_NOT_SUPPORTED : gpus == 0 ? DPAR_ERR_DEVICE : DPAR_ERR_INVALID_ARGUMENT)
      << dpar_last_error();
  EXPECT_NE(std::string(dpar_last_error()).find("device"), std::string::npos) << dpar_last_error();
  // Still host batches, from the start of the epoch.
  const dpar_tensor *x = nullptr, *y = nullptr;
  ASSERT_OK(NextBatch(&x, &y, l.get()));
  ASSERT_NE(x, nullptr);
  dpar_device where{-1, -1};
  ASSERT_OK(dpar_tensor_info(nullptr, nullptr, &where, x));
  EXPECT_EQ(where.kind, DPAR_DEVICE_CPU);
  EXPECT_EQ(ToHost<float>(x, 4 * kFeatures)[0], 0.0f) << "the first batch starts with sample 0";
}

TEST(Loader, ShardArgumentsAreCheckedAndARefusalChangesNothing) {
  IdxFiles files;
  DatasetPtr d = LoadDataset(files);
  dpar_loader* raw = nullptr;
  ASSERT_OK(dpar_loader_create(&raw, d.get(), 4, 0, 0, 0));
  EXPECT_INVALID("shard", dpar_loader_shard(raw, 2, 2));
  EXPECT_INVALID("num_shards", dpar_loader_shard(raw, 0, 5));  // more shards than rows in a batch
  EXPECT_INVALID("shard", dpar_loader_shard(raw, 0, 0));
  const dpar_tensor *x = nullptr, *y = nullptr;
  ASSERT_OK(NextBatch(&x, &y, raw));
  ASSERT_NE(x, nullptr);
  EXPECT_EQ(ShapeOf(y), std::vector<int64_t>({4})) << "a refused shard changed the batches";
  ASSERT_OK(dpar_loader_shard(raw, 1, 2));
  ASSERT_OK(NextBatch(&x, &y, raw));
  EXPECT_EQ(ShapeOf(y), std::vector<int64_t>({2}));
  dpar_loader_free(raw);
}

TEST(DatasetHandle, NullFreedForeignAndWrongTypeAreRefusedEverywhere) {
  IdxFiles files;
  ModelPtr m = LinearModel();
  alignas(64) unsigned char foreign[256] = {};
  dpar_dataset* freed = nullptr;
  ASSERT_OK(dpar_dataset_load_idx(&freed, files.images.c_str(), files.labels.c_str()));
  dpar_dataset_free(freed);
  for (const dpar_dataset* bad : {static_cast<const dpar_dataset*>(nullptr), static_cast<const dpar_dataset*>(freed),
                                  reinterpret_cast<const dpar_dataset*>(m.get()),
                                  reinterpret_cast<const dpar_dataset*>(foreign)}) {
    dpar_loader* l = Sentinel<dpar_loader>();
    ExpectAllRefused(DatasetCalls(bad, &l), DPAR_ERR_INVALID_ARGUMENT, "dataset");
    EXPECT_EQ(l, nullptr);
  }
  EXPECT_EQ(NumLayers(m.get()), 1u);
}

TEST(LoaderHandle, NullFreedForeignAndWrongTypeAreRefusedEverywhere) {
  IdxFiles files;
  DatasetPtr d = LoadDataset(files);
  alignas(64) unsigned char foreign[256] = {};
  dpar_loader* freed = nullptr;
  ASSERT_OK(dpar_loader_create(&freed, d.get(), 4, 1, 0, 0));
  dpar_loader_free(freed);
  for (dpar_loader* bad : {static_cast<dpar_loader*>(nullptr), freed, reinterpret_cast<dpar_loader*>(d.get()),
                           reinterpret_cast<dpar_loader*>(foreign)}) {
    int32_t more = 7;
    ExpectAllRefused(LoaderCalls(bad, &more), DPAR_ERR_INVALID_ARGUMENT, "loader");
    EXPECT_EQ(more, 0);
    dpar_clear_error();
    EXPECT_EQ(dpar_loader_inputs(bad), nullptr);
    EXPECT_NE(std::string(dpar_last_error()).find("loader"), std::string::npos);
    dpar_clear_error();
    EXPECT_EQ(dpar_loader_labels(bad), nullptr);
    EXPECT_NE(std::string(dpar_last_error()).find("loader"), std::string::npos);
  }
  size_t samples = 0;
  EXPECT_OK(dpar_dataset_info(&samples, nullptr, nullptr, d.get()));
  EXPECT_EQ(samples, kSamples) << "the dataset passed as a loader was not touched";
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// Engine state across calls: callbacks, timeouts, losses and forward state

namespace {

struct Reentry {
  dpar_engine* engine = nullptr;
  std::atomic<int> calls{0};
  std::atomic<int> refused{0};
};

dpar_status reenter_hook(void* payload, size_t, const int64_t*, size_t, const int64_t*, size_t) {
  auto* r = static_cast<Reentry*>(payload);
  size_t n = 0;
  r->calls++;
  // The caller holds the engine while its workers run this: a call back into it must be refused, not block.
  if (dpar_engine_num_replicas(&n, r->engine) == DPAR_ERR_INVALID_STATE &&
      std::string(dpar_last_error()).find("worker thread") != std::string::npos)
    r->refused++;
  dpar_engine_free(r->engine);  // does nothing from here
  return DPAR_OK;
}

}  // namespace

TEST(EngineState, CallbacksCannotCallBackIntoTheEngine) {
  ModelPtr m = LinearModel();
  EnginePtr e = NewEngine(m.get(), 3);
  Reentry r;
  r.engine = e.get();
  ASSERT_OK(dpar_engine_set_forward_hook(e.get(), reenter_hook, &r, nullptr));
  Batch b = MakeBatch(6);
  ASSERT_OK(dpar_engine_train_step(nullptr, e.get(), b.x.get(), b.y.get()));
  EXPECT_EQ(r.calls.load(), 3);
  EXPECT_EQ(r.refused.load(), 3);
  size_t n = 0;
  ASSERT_OK(dpar_engine_num_replicas(&n, e.get()));  // the engine survived the free attempts
  EXPECT_EQ(n, 3u);
}

TEST(EngineState, InfiniteTimeoutMeansNoLimit) {
  ModelPtr m = LinearModel();
  dpar_engine_options o = DPAR_ENGINE_OPTIONS_INIT;
  o.num_cpu_devices = 2;
  o.timeout_seconds = std::numeric_limits<double>::infinity();
  dpar_engine* raw = nullptr;
  ASSERT_OK(dpar_engine_create(&raw, m.get(), nullptr, &o));
  EnginePtr e(raw);
  Batch b = MakeBatch(6);
  for (int s = 0; s < 20; ++s) ASSERT_OK(dpar_engine_train_step(nullptr, e.get(), b.x.get(), b.y.get()));
}

TEST(EngineState, ReplicaLossesStayThoseOfTheLastTrainingStep) {
  ModelPtr m = LinearModel();
  EnginePtr e = NewEngine(m.get(), 4);
  Batch b = MakeBatch(16);
  ASSERT_OK(dpar_engine_train_step(nullptr, e.get(), b.x.get(), b.y.get()));
  float before[4], after[4];
  ASSERT_OK(dpar_engine_replica_losses(before, e.get(), 4));
  ASSERT_OK(dpar_engine_set_training(e.get(), 0));
  Batch small = MakeBatch(2, 5);
  dpar_tensor* out = nullptr;
  ASSERT_OK(dpar_engine_forward(&out, e.get(), small.x.get()));
  dpar_tensor_free(out);
  ASSERT_OK(dpar_engine_replica_losses(after, e.get(), 4));
  for (int r = 0; r < 4; ++r) EXPECT_EQ(after[r], before[r]) << "replica " << r;
}

TEST(EngineState, StepDropsActivationsOfTheOldParameters) {
  // accumulate -> forward -> step -> backward would mix pre-step activations with post-step weights.
  ModelPtr m = LinearModel();
  EnginePtr e = NewEngine(m.get(), 2);
  Batch b = MakeBatch(6);
  ASSERT_OK(dpar_engine_accumulate(nullptr, e.get(), b.x.get(), b.y.get()));
  dpar_tensor* out = nullptr;
  ASSERT_OK(dpar_engine_forward(&out, e.get(), b.x.get()));
  ASSERT_OK(dpar_engine_step(e.get()));
  EXPECT_DPAR_ERROR(DPAR_ERR_INVALID_STATE, "forward", dpar_engine_backward(e.get(), out));
  dpar_tensor_free(out);
}

TEST(EngineState, AbortChecksItsHandleAndEndsTheEngine) {
  EXPECT_INVALID("engine", dpar_engine_abort(nullptr));
  ModelPtr m = LinearModel();
  dpar_engine* freed = nullptr;
  {
    EnginePtr e = NewEngine(m.get(), 2);
    freed = e.get();
    Batch b = MakeBatch(6);
    ASSERT_OK(dpar_engine_abort(e.get()));  // nothing in flight: every later call is refused
    EXPECT_DPAR_ERROR(DPAR_ERR_INVALID_STATE, "aborted", dpar_engine_train_step(nullptr, e.get(), b.x.get(), b.y.get()));
  }
  EXPECT_INVALID("engine", dpar_engine_abort(freed));
}

// ---- BatchNorm and buffers ---------------------------------------------------------------------------------------

ModelPtr BatchNormModel(bool sync) {
  dpar_model* m = nullptr;
  EXPECT_OK(dpar_model_create(&m, nullptr));
  EXPECT_OK(dpar_model_add_linear(m, kIn, 6, 0));
  EXPECT_OK(dpar_model_add_batchnorm1d(m, 6, 1e-5f, 0.1f, 1));
  EXPECT_OK(dpar_model_add_linear(m, 6, kOut, 1));
  if (sync) EXPECT_OK(dpar_model_convert_sync_batchnorm(m));
  return ModelPtr(m);
}

TEST(BatchNorm, BuffersAreNamedTypedAndReadableOnModelAndEngine) {
  ModelPtr m = BatchNormModel(false);
  size_t n = 0, params = 0;
  ASSERT_OK(dpar_model_num_buffers(&n, m.get()));
  ASSERT_EQ(n, 3u);
  ASSERT_OK(dpar_model_num_params(&params, m.get()));
  EXPECT_EQ(params, 5u);  // 0.weight (no bias), 1.weight, 1.bias, 2.weight, 2.bias
  EXPECT_STREQ(dpar_model_buffer_name(m.get(), 0), "1.running_mean");
  EXPECT_STREQ(dpar_model_buffer_name(m.get(), 1), "1.running_var");
  EXPECT_STREQ(dpar_model_buffer_name(m.get(), 2), "1.num_batches_tracked");
  int32_t dtype = -1;
  int64_t shape[DPAR_MAX_DIMS] = {0};
  size_t ndim = 9;
  ASSERT_OK(dpar_model_buffer_info(&dtype, shape, &ndim, m.get(), 1));
  EXPECT_EQ(dtype, DPAR_F32);
  EXPECT_EQ(ndim, 1u);
  EXPECT_EQ(shape[0], 6);
  ASSERT_OK(dpar_model_buffer_info(&dtype, nullptr, &ndim, m.get(), 2));
  EXPECT_EQ(dtype, DPAR_I64);
  EXPECT_EQ(ndim, 0u);
  std::vector<float> var(6, 0.0f);
  ASSERT_OK(dpar_model_get_buffer(var.data(), m.get(), 1, 6));
  EXPECT_EQ(var, std::vector<float>(6, 1.0f));
  const std::vector<float> mean{0.5f, -0.5f, 0, 0, 0, 0.25f};
  ASSERT_OK(dpar_model_set_buffer(m.get(), 0, mean.data(), 6));
  std::vector<float> back(6);
  ASSERT_OK(dpar_model_get_buffer(back.data(), m.get(), 0, 6));
  EXPECT_EQ(back, mean);

  EXPECT_INVALID("model", dpar_model_num_buffers(&n, nullptr));
  EXPECT_INVALID("index", dpar_model_buffer_info(&dtype, shape, &ndim, m.get(), 3));
  EXPECT_INVALID("count", dpar_model_get_buffer(back.data(), m.get(), 0, 5));
  EXPECT_INVALID("dst", dpar_model_get_buffer(nullptr, m.get(), 0, 6));
  EXPECT_INVALID("src", dpar_model_set_buffer(m.get(), 0, nullptr, 6));
  EXPECT_INVALID("num_features", dpar_model_add_batchnorm2d(m.get(), 0, 1e-5f, 0.1f, 1));
  EXPECT_INVALID("momentum", dpar_model_add_sync_batchnorm(m.get(), 4, 1e-5f, -1.0f, 1));
  EXPECT_INVALID("model", dpar_model_convert_sync_batchnorm(nullptr));
  EXPECT_INVALID("model", dpar_model_add_layernorm(nullptr, 4, 1e-5f, 1));
  EXPECT_INVALID("normalized_size", dpar_model_add_layernorm(m.get(), 0, 1e-5f, 1));
  EXPECT_INVALID("eps", dpar_model_add_layernorm(m.get(), 4, -1.0f, 1));
  EXPECT_INVALID("model", dpar_model_add_embedding(nullptr, 4, 2));
  EXPECT_INVALID("num_embeddings", dpar_model_add_embedding(m.get(), 0, 2));
  EXPECT_INVALID("embedding_dim", dpar_model_add_embedding(m.get(), 4, -2));
  EXPECT_INVALID("model", dpar_model_add_embedding_padded(nullptr, 4, 2, 0));
  EXPECT_INVALID("padding_idx", dpar_model_add_embedding_padded(m.get(), 4, 2, 4));
  EXPECT_INVALID("padding_idx", dpar_model_add_embedding_padded(m.get(), 4, 2, -5));
  dpar_clear_error();
  EXPECT_EQ(dpar_model_buffer_name(m.get(), 3), nullptr);
  EXPECT_NE(std::string(dpar_last_error()).find("index"), std::string::npos) << dpar_last_error();

  // An engine of 3 replicas: after a step every replica holds replica 0's buffers, moved from the model's.
  for (bool sync : {false, true}) {
    ModelPtr bm = BatchNormModel(sync);
    EnginePtr e = NewEngine(bm.get(), 3);
    Batch b = MakeBatch(9);
    ASSERT_OK(dpar_engine_train_step(nullptr, e.get(), b.x.get(), b.y.get()));
    std::vector<float> r0(6), r2(6);
    int64_t tracked = 0;
    ASSERT_OK(dpar_engine_get_buffer(r0.data(), e.get(), 0, 0, 6));
    ASSERT_OK(dpar_engine_get_buffer(r2.data(), e.get(), 2, 0, 6));
    ASSERT_OK(dpar_engine_get_buffer(&tracked, e.get(), 1, 2, 1));
    EXPECT_EQ(r0, r2);
    EXPECT_NE(r0, std::vector<float>(6, 0.0f));
    EXPECT_EQ(tracked, 1);
    EXPECT_INVALID("replica", dpar_engine_get_buffer(r0.data(), e.get(), 3, 0, 6));
    EXPECT_INVALID("index", dpar_engine_get_buffer(r0.data(), e.get(), 0, 3, 6));
    EXPECT_INVALID("count", dpar_engine_get_buffer(r0.data(), e.get(), 0, 0, 7));
    EXPECT_INVALID("dst", dpar_engine_get_buffer(nullptr, e.get(), 0, 0, 6));
  }
}
