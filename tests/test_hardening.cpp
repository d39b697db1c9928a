// Hostile input and racing callers, through dpar.h alone: every file is untrusted (a crafted checkpoint or data set
// must be refused with a status and a message naming what is wrong, never crash, hang or exhaust the host), and
// handles freed from several threads or from callbacks behave as dpar.h documents.
//
// Each test here is the regression test of a bug that was found: it fails on the code before its fix.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "dpar.h"

// A 4 TiB tensor must fail to allocate with a status: the sanitizers' allocators report such a request as an
// error unless told to return NULL, as the system's allocator does.
// A small quarantine: the test of a leak measures the resident size, which a large one would fill with freed
// error messages.
extern "C" __attribute__((visibility("default"), used)) const char* __asan_default_options() {
  return "allocator_may_return_null=1:quarantine_size_mb=8";
}
extern "C" __attribute__((visibility("default"), used)) const char* __tsan_default_options() {
  return "allocator_may_return_null=1";
}

namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<uint8_t>;

#define ASSERT_OK(...)                                                                                    \
  do {                                                                                                    \
    const dpar_status status_ = (__VA_ARGS__);                                                            \
    ASSERT_EQ(status_, DPAR_OK) << #__VA_ARGS__ << ": " << dpar_status_str(status_) << ": " << dpar_last_error(); \
  } while (0)

// The call fails with `want` and a message that contains every one of `words`.
::testing::AssertionResult Refused(dpar_status got, dpar_status want, std::initializer_list<std::string> words) {
  const std::string message = dpar_last_error();
  if (got != want)
    return ::testing::AssertionFailure() << "returned " << dpar_status_str(got) << ", expected "
                                         << dpar_status_str(want) << " (message: \"" << message << "\")";
  for (const std::string& w : words)
    if (message.find(w) == std::string::npos)
      return ::testing::AssertionFailure() << "the message \"" << message << "\" does not mention \"" << w << "\"";
  return ::testing::AssertionSuccess();
}

// EXPECT_REFUSED(status, call, words...): the call returns status with a message holding every word.
#define EXPECT_REFUSED(want, call, ...)                                 \
  do {                                                                  \
    dpar_clear_error();                                                 \
    EXPECT_TRUE(Refused((call), (want), {__VA_ARGS__})) << #call;       \
  } while (0)

struct Free {
  void operator()(dpar_tensor* p) const { dpar_tensor_free(p); }
  void operator()(dpar_model* p) const { dpar_model_free(p); }
  void operator()(dpar_engine* p) const { dpar_engine_free(p); }
  void operator()(dpar_dataset* p) const { dpar_dataset_free(p); }
};
using TensorPtr = std::unique_ptr<dpar_tensor, Free>;
using ModelPtr = std::unique_ptr<dpar_model, Free>;
using EnginePtr = std::unique_ptr<dpar_engine, Free>;
using DatasetPtr = std::unique_ptr<dpar_dataset, Free>;

class TempDir {
 public:
  TempDir() {
    std::string templ = (fs::temp_directory_path() / "dpar_hardening.XXXXXX").string();
    if (!mkdtemp(templ.data())) throw std::runtime_error("mkdtemp failed");
    path_ = templ;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

Bytes ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void WriteFile(const std::string& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

// A model of two linear layers (4 -> 8 -> 3) and an engine over `devices` CPU devices with SGD and momentum.
ModelPtr Mlp(uint64_t seed = 3) {
  dpar_model_options o = DPAR_MODEL_OPTIONS_INIT;
  o.seed = seed;
  dpar_model* m = nullptr;
  EXPECT_EQ(dpar_model_create(&m, &o), DPAR_OK);
  EXPECT_EQ(dpar_model_add_linear(m, 4, 8, 1), DPAR_OK);
  EXPECT_EQ(dpar_model_add_linear(m, 8, 3, 1), DPAR_OK);
  return ModelPtr(m);
}

EnginePtr NewEngine(const dpar_model* m, size_t devices) {
  dpar_optimizer_options opt = DPAR_OPTIMIZER_OPTIONS_INIT;
  opt.lr = 0.05f;
  opt.momentum = 0.9f;
  dpar_engine_options o = DPAR_ENGINE_OPTIONS_INIT;
  o.num_cpu_devices = devices;
  o.timeout_seconds = 60;
  dpar_engine* e = nullptr;
  EXPECT_EQ(dpar_engine_create(&e, m, &opt, &o), DPAR_OK) << dpar_last_error();
  return EnginePtr(e);
}

struct Batch {
  TensorPtr x, y;
};

Batch MakeBatch(int64_t rows, uint32_t seed = 1) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(rows * 4));
  std::vector<int32_t> y(static_cast<size_t>(rows));
  for (float& v : x) v = u(rng);
  for (int64_t i = 0; i < rows; ++i) y[static_cast<size_t>(i)] = static_cast<int32_t>(i % 3);
  dpar_tensor *tx = nullptr, *ty = nullptr;
  const int64_t xs[2] = {rows, 4}, ys[1] = {rows};
  EXPECT_EQ(dpar_tensor_create(&tx, DPAR_F32, xs, 2, dpar_device{DPAR_DEVICE_CPU, 0}), DPAR_OK);
  EXPECT_EQ(dpar_tensor_create(&ty, DPAR_I32, ys, 1, dpar_device{DPAR_DEVICE_CPU, 0}), DPAR_OK);
  EXPECT_EQ(dpar_tensor_copy_from_host(tx, x.data(), x.size() * sizeof(float)), DPAR_OK);
  EXPECT_EQ(dpar_tensor_copy_from_host(ty, y.data(), y.size() * sizeof(int32_t)), DPAR_OK);
  return Batch{TensorPtr(tx), TensorPtr(ty)};
}

constexpr size_t kMlpParams = 4 * 8 + 8 + 8 * 3 + 3;

std::vector<float> Params(dpar_engine* e, size_t replica = 0) {
  std::vector<float> p(kMlpParams);
  EXPECT_EQ(dpar_engine_get_params(p.data(), e, replica, p.size()), DPAR_OK) << dpar_last_error();
  return p;
}

// A safetensors file as (header JSON, data buffer), to be edited and written back.
struct Safetensors {
  nlohmann::ordered_json header;
  Bytes data;
};

Safetensors ParseSafetensors(const Bytes& file) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | file[static_cast<size_t>(i)];
  Safetensors s;
  s.header = nlohmann::ordered_json::parse(file.begin() + 8, file.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  s.data.assign(file.begin() + 8 + static_cast<std::ptrdiff_t>(n), file.end());
  return s;
}

Bytes SafetensorsBytes(const std::string& header, const Bytes& data) {
  Bytes out(8);
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<uint8_t>((header.size() >> (8 * i)) & 0xff);
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

// A checkpoint of a trained engine, with its checksums removed so that its metadata can be edited (a file without
// either checksum key is read without the checks, as one written by Python's safetensors is).
class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = Mlp();
    engine_ = NewEngine(model_.get(), 2);
    Batch b = MakeBatch(8);
    for (int s = 0; s < 3; ++s) ASSERT_OK(dpar_engine_train_step(nullptr, engine_.get(), b.x.get(), b.y.get()));
    ASSERT_OK(dpar_engine_save(engine_.get(), (dir_ / "good.safetensors").c_str()));
    original_ = ParseSafetensors(ReadFile(dir_ / "good.safetensors"));
    original_.header["__metadata__"].erase("dpar.crc32");
    original_.header["__metadata__"].erase("dpar.header_crc32");
    before_ = Params(engine_.get());
  }

  // Writes the checkpoint with metadata key = value and returns its path.
  std::string WithMetadata(const std::string& key, const std::string& value) {
    Safetensors s = original_;
    s.header["__metadata__"][key] = value;
    const std::string path = dir_ / "edited.safetensors";
    WriteFile(path, SafetensorsBytes(s.header.dump(), s.data));
    return path;
  }

  // The refused load changed nothing, and the engine still trains.
  void ExpectUnchangedAndUsable() {
    EXPECT_EQ(Params(engine_.get()), before_);
    Batch b = MakeBatch(8, 2);
    float loss = 0;
    ASSERT_OK(dpar_engine_train_step(&loss, engine_.get(), b.x.get(), b.y.get()));
    EXPECT_TRUE(std::isfinite(loss));
    before_ = Params(engine_.get());
  }

  TempDir dir_;
  ModelPtr model_;
  EnginePtr engine_;
  Safetensors original_;
  std::vector<float> before_;
};

// =================================================================================================================
// Checkpoints
// =================================================================================================================

// A header nested 100,000 deep, with both checksum keys present (the checksum code walked the parsed header
// recursively before any entry was checked): the process crashed with a stack overflow.
TEST_F(CheckpointTest, DeeplyNestedHeaderIsRefusedNotACrash) {
  const size_t depth = 100000;
  std::string header = R"({"__metadata__":{"dpar.crc32":"0","dpar.header_crc32":"0","format":"dpar-checkpoint-1"},)"
                       R"("x":)";
  header += std::string(depth, '[') + std::string(depth, ']') + "}";
  const std::string path = dir_ / "deep.safetensors";
  WriteFile(path, SafetensorsBytes(header, {}));
  EXPECT_REFUSED(DPAR_ERR_CORRUPT, dpar_engine_load(engine_.get(), path.c_str()), "deep.safetensors", "nests", "64 deep");
  // Objects as well as arrays, and nesting inside the metadata.
  header = R"({"__metadata__":{"a":)";
  for (size_t i = 0; i < depth; ++i) header += R"({"k":)";
  header += "1" + std::string(depth, '}') + "}}";
  WriteFile(path, SafetensorsBytes(header, {}));
  EXPECT_REFUSED(DPAR_ERR_CORRUPT, dpar_engine_load(engine_.get(), path.c_str()), "nests");
  ExpectUnchangedAndUsable();
}

// Integer metadata is checked in range and named: beyond 2^64 was DPAR_ERR_INTERNAL "stoull"; beyond 2^63 it
// loaded, and the next step overflowed a signed counter.
TEST_F(CheckpointTest, MetadataIntegersOutOfRangeAreCorruptAndNamed) {
  struct Case {
    std::string key, value, words;
  };
  const std::vector<Case> cases = {
      {"dpar.step", "18446744073709551616", "exceeds 2^64 - 1"},   // 2^64
      {"dpar.step", "99999999999999999999", "exceeds 2^64 - 1"},   // 20 digits
      {"dpar.step", "9223372036854775808", "out of range"},        // 2^63
      {"dpar.step", "18446744073709551615", "out of range"},       // 2^64 - 1
      {"dpar.step", "4611686018427387905", "out of range"},        // 2^62 + 1
      {"dpar.step", "-1", "not an unsigned integer"},
      {"dpar.step", "", "not an unsigned integer"},
      {"dpar.step", "12x", "not an unsigned integer"},
      {"dpar.replicas", "0", "out of range"},
      {"dpar.replicas", "18446744073709551615", "out of range"},
      {"dpar.replicas", "123456789012345678901234567890", "exceeds 2^64 - 1"},
      {"dpar.rng_offset.0", "18446744073709551616", "exceeds 2^64 - 1"},
      {"dpar.rng_offset.1", "1e5", "not an unsigned integer"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.key + " = \"" + c.value + "\"");
    const std::string path = WithMetadata(c.key, c.value);
    EXPECT_REFUSED(DPAR_ERR_CORRUPT, dpar_engine_load(engine_.get(), path.c_str()), c.key, c.words, "edited.safetensors");
    ExpectUnchangedAndUsable();
  }
  // The limits themselves load: the largest step accepted, and the largest RNG offset (2^64 - 1).
  ASSERT_OK(dpar_engine_load(engine_.get(), WithMetadata("dpar.step", "4611686018427387904").c_str()));
  size_t steps = 0;
  ASSERT_OK(dpar_engine_step_count(&steps, engine_.get()));
  EXPECT_EQ(steps, size_t{1} << 62);
  ASSERT_OK(dpar_engine_load(engine_.get(), WithMetadata("dpar.rng_offset.0", "18446744073709551615").c_str()));
  Batch b = MakeBatch(8, 3);
  ASSERT_OK(dpar_engine_train_step(nullptr, engine_.get(), b.x.get(), b.y.get()));
}

// The optimizer state is sharded across replicas (each updates a slice of the parameters) and gathered on save:
// with a model smaller than one shard only replica 0's slice was ever gathered. This model (75 parameters) spans
// three shards over three replicas; resuming must restore every shard's momentum, so that training on is
// bit-identical to training straight, and every replica must hold the same parameters.
TEST(CheckpointShards, RoundTripRestoresEveryOptimizerShard) {
  TempDir dir;
  const std::string path = dir / "shards.safetensors";
  ModelPtr m = Mlp(11);
  EnginePtr straight = NewEngine(m.get(), 3), saved = NewEngine(m.get(), 3);
  std::vector<Batch> batches;
  for (uint32_t i = 0; i < 8; ++i) batches.push_back(MakeBatch(12, 100 + i));
  for (int s = 0; s < 4; ++s) {
    ASSERT_OK(dpar_engine_train_step(nullptr, straight.get(), batches[s].x.get(), batches[s].y.get()));
    ASSERT_OK(dpar_engine_train_step(nullptr, saved.get(), batches[s].x.get(), batches[s].y.get()));
  }
  ASSERT_OK(dpar_engine_save(saved.get(), path.c_str()));
  // The saved momentum covers every parameter: no slice of it left at zero by a missing shard.
  const Safetensors file = ParseSafetensors(ReadFile(path));
  size_t momentum_values = 0, zero_values = 0;
  for (const auto& [name, entry] : file.header.items()) {
    if (name.rfind("optimizer.", 0) != 0) continue;
    const uint64_t begin = entry["data_offsets"][0], end = entry["data_offsets"][1];
    for (uint64_t at = begin; at < end; at += 4) {
      float v = 0;
      std::memcpy(&v, file.data.data() + at, 4);
      ++momentum_values;
      zero_values += v == 0.0f;
    }
  }
  EXPECT_EQ(momentum_values, kMlpParams);
  EXPECT_EQ(zero_values, 0u) << "momentum values saved as zero";

  ModelPtr other = Mlp(12);
  EnginePtr resumed = NewEngine(other.get(), 3);
  ASSERT_OK(dpar_engine_load(resumed.get(), path.c_str()));
  for (int s = 4; s < 8; ++s) {
    ASSERT_OK(dpar_engine_train_step(nullptr, straight.get(), batches[s].x.get(), batches[s].y.get()));
    ASSERT_OK(dpar_engine_train_step(nullptr, resumed.get(), batches[s].x.get(), batches[s].y.get()));
  }
  const std::vector<float> want = Params(straight.get());
  for (size_t r = 0; r < 3; ++r) EXPECT_EQ(Params(resumed.get(), r), want) << "replica " << r;
}

// Opens `fifo` for writing after `after`, so that a reader blocked in open(2) wakes up; the test then fails
// rather than hangs.
class FifoUnblocker {
 public:
  explicit FifoUnblocker(std::string fifo) : fifo_(std::move(fifo)) {}
  // Runs call on another thread; returns its status, or fails the test if it blocked for 10 s.
  template <class F>
  dpar_status Run(F call, std::string* message) {
    auto result = std::async(std::launch::async, [&] {
      dpar_clear_error();
      const dpar_status s = call();
      *message = dpar_last_error();
      return s;
    });
    if (result.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
      ADD_FAILURE() << "the call blocked on the FIFO " << fifo_;
      const int fd = ::open(fifo_.c_str(), O_WRONLY);  // wakes the reader: it then reads an empty file
      if (fd >= 0) ::close(fd);
    }
    return result.get();
  }

 private:
  std::string fifo_;
};

TEST_F(CheckpointTest, FifoIsRefusedWithoutBlocking) {
  const std::string fifo = dir_ / "checkpoint.fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  std::string message;
  const dpar_status s =
      FifoUnblocker(fifo).Run([&] { return dpar_engine_load(engine_.get(), fifo.c_str()); }, &message);
  EXPECT_EQ(s, DPAR_ERR_IO) << message;
  EXPECT_NE(message.find("not a regular file"), std::string::npos) << message;
  EXPECT_NE(message.find("checkpoint.fifo"), std::string::npos) << message;
  ExpectUnchangedAndUsable();
}

// =================================================================================================================
// IDX data sets
// =================================================================================================================

Bytes IdxHeader(std::initializer_list<uint32_t> dims) {
  Bytes b = {0, 0, 0x08, static_cast<uint8_t>(dims.size())};
  for (uint32_t d : dims)
    for (int shift = 24; shift >= 0; shift -= 8) b.push_back(static_cast<uint8_t>((d >> shift) & 0xff));
  return b;
}

// Appends one gzip member holding `bytes` to `path`.
void AppendGzipMember(const std::string& path, const Bytes& bytes) {
  gzFile f = gzopen(path.c_str(), "ab9");
  ASSERT_NE(f, nullptr);
  size_t done = 0;
  while (done < bytes.size()) {
    const unsigned chunk = static_cast<unsigned>(std::min<size_t>(bytes.size() - done, size_t{1} << 24));
    ASSERT_EQ(gzwrite(f, bytes.data() + done, chunk), static_cast<int>(chunk));
    done += chunk;
  }
  ASSERT_EQ(gzclose(f), Z_OK);
}

TEST(IdxHardening, FifoIsRefusedWithoutBlocking) {
  TempDir dir;
  const std::string fifo = dir / "data.fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  const std::string labels = dir / "labels";
  Bytes l = IdxHeader({2});
  l.insert(l.end(), {0, 1});
  WriteFile(labels, l);
  for (bool fifo_is_images : {true, false}) {
    SCOPED_TRACE(fifo_is_images ? "images" : "labels");
    std::string message;
    dpar_dataset* d = nullptr;
    const dpar_status s = FifoUnblocker(fifo).Run(
        [&] {
          return fifo_is_images ? dpar_dataset_load_idx(&d, fifo.c_str(), labels.c_str())
                                : dpar_dataset_load_idx(&d, labels.c_str(), fifo.c_str());
        },
        &message);
    DatasetPtr owned(d);
    EXPECT_EQ(s, DPAR_ERR_IO) << message;
    EXPECT_NE(message.find("data.fifo: not a regular file"), std::string::npos) << message;
  }
}

// The header claims more data than a gzip file of this size could inflate to: refused before reading on.
TEST(IdxHardening, GzipClaimBeyondDeflateRatioIsRefusedAtOnce) {
  TempDir dir;
  const std::string images = dir / "images.gz", labels = dir / "labels";
  // 60000 x 200 x 200 = 2.4 GB claimed, 64 MiB of zeros present: a ~65 KB file.
  Bytes body = IdxHeader({60000, 200, 200});
  body.resize(body.size() + (size_t{64} << 20), 0);
  AppendGzipMember(images, body);
  Bytes l = IdxHeader({60000});
  l.resize(l.size() + 60000, 1);
  WriteFile(labels, l);
  dpar_dataset* d = nullptr;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_REFUSED(DPAR_ERR_CORRUPT, dpar_dataset_load_idx(&d, images.c_str(), labels.c_str()), "images.gz", "describe 2400000000 bytes", "gzip file can inflate to");
  DatasetPtr owned(d);
  EXPECT_EQ(d, nullptr);
  // Refused from the header alone: inflating the 64 MiB would take far longer than the header's 12 bytes.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
}

long StatusKiB(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string prefix = std::string(field) + ":";
  while (std::getline(in, line))
    if (line.rfind(prefix, 0) == 0) return std::strtol(line.c_str() + prefix.size(), nullptr, 10);
  return -1;
}

// A gzip bomb within the ratio (256 MiB claimed, 128 MiB present): the reader used to grow its buffer by
// doubling, holding the old and the new one (384 MiB here, 2.3 GiB for a 1.25 GiB bomb) before refusing it.
// Now it holds at most what is present, once.
TEST(IdxHardening, GzipBombIsNotHeldTwice) {
  {
    std::ofstream reset("/proc/self/clear_refs");
    reset << "5";  // resets the peak resident size (VmHWM)
    if (!reset.good()) GTEST_SKIP() << "cannot reset the peak resident size through /proc/self/clear_refs";
  }
  TempDir dir;
  const std::string images = dir / "bomb.gz", labels = dir / "labels";
  const size_t claimed = size_t{256} << 20, present = size_t{128} << 20;
  Bytes body = IdxHeader({256, 1024, 1024});
  body.resize(body.size() + present, 0);
  AppendGzipMember(images, body);
  // Incompressible padding: makes the file large enough for its claim to be within deflate's ratio, and adds
  // only 300 KB of data.
  Bytes noise(300 << 10);
  std::mt19937 rng(5);
  for (uint8_t& b : noise) b = static_cast<uint8_t>(rng());
  AppendGzipMember(images, noise);
  ASSERT_GT(fs::file_size(images) * 1032, claimed);
  Bytes l = IdxHeader({256});
  l.resize(l.size() + 256, 1);
  WriteFile(labels, l);
  body = Bytes();

  std::ofstream("/proc/self/clear_refs") << "5";
  const long rss_before = StatusKiB("VmRSS");
  dpar_dataset* d = nullptr;
  EXPECT_REFUSED(DPAR_ERR_CORRUPT, dpar_dataset_load_idx(&d, images.c_str(), labels.c_str()), "bomb.gz", "truncated: expected 268435456 bytes");
  DatasetPtr owned(d);
  const long peak = StatusKiB("VmHWM");
  ASSERT_GT(peak, 0);
  const long grew_mib = (peak - rss_before) / 1024;
  // 128 MiB held, plus a sanitizer's shadow memory; doubling would have reached 384 MiB.
  EXPECT_LT(grew_mib, 224) << "peak resident size grew by " << grew_mib << " MiB";
}

// =================================================================================================================
// Handles
// =================================================================================================================

long ResidentKiB() { return StatusKiB("VmRSS"); }

// dpar_tensor_create registered its handle before allocating the storage; a failed allocation left the handle
// registered and unreachable. 100,000 failures leaked about 12 MB.
TEST(HandleHardening, FailedTensorCreateLeaksNothing) {
  {
    std::ifstream in("/proc/sys/vm/overcommit_memory");
    int mode = 0;
    if (in >> mode && mode == 1) GTEST_SKIP() << "vm.overcommit_memory is 1: a 4 TiB allocation would succeed";
  }
  const int64_t huge[1] = {int64_t{1} << 40};  // 4 TiB of f32: the largest shape accepted
  auto fail_many = [&](int n) {
    for (int i = 0; i < n; ++i) {
      dpar_tensor* t = reinterpret_cast<dpar_tensor*>(&n);
      ASSERT_EQ(dpar_tensor_create(&t, DPAR_F32, huge, 1, dpar_device{DPAR_DEVICE_CPU, 0}), DPAR_ERR_OUT_OF_MEMORY);
      ASSERT_EQ(t, nullptr);
    }
  };
  fail_many(50000);  // fills whatever the allocator keeps (a sanitizer's quarantine of freed memory)
  const long before = ResidentKiB();
  fail_many(100000);
  const long grew_kib = ResidentKiB() - before;
  EXPECT_LT(grew_kib, 2048) << "100,000 failed creates grew the resident size by " << grew_kib << " KiB";
  EXPECT_NE(std::string(dpar_last_error()).find("out of memory"), std::string::npos);
}

// Two threads freeing the same tensor: checking, unregistering and deleting were three steps, so both could
// delete it. Now exactly one does (ASan reports a double free otherwise; glibc often aborts).
TEST(HandleHardening, ConcurrentFreesOfOneHandleFreeItOnce) {
  const int64_t shape[1] = {16};
  for (int round = 0; round < 500; ++round) {
    dpar_tensor* t = nullptr;
    ASSERT_OK(dpar_tensor_create(&t, DPAR_F32, shape, 1, dpar_device{DPAR_DEVICE_CPU, 0}));
    dpar_model* m = nullptr;
    ASSERT_OK(dpar_model_create(&m, nullptr));
    std::atomic<int> ready{0};
    auto free_both = [&] {
      ready++;
      while (ready.load() < 2) std::this_thread::yield();
      dpar_tensor_free(t);
      dpar_model_free(m);
    };
    std::thread a(free_both), b(free_both);
    a.join();
    b.join();
    int32_t dtype = 0;
    EXPECT_REFUSED(DPAR_ERR_INVALID_ARGUMENT, dpar_tensor_info(&dtype, nullptr, nullptr, t), "not a live handle");
    if (HasFailure()) break;
  }
}

// An engine created inside another engine's callback: dpar_engine_free refused on every worker thread, so it
// could never be freed there and leaked. Now only the engine's own workers are refused.
struct Nested {
  dpar_model* model = nullptr;
  dpar_engine* outer = nullptr;
  std::atomic<int> created{0}, used{0}, freed{0}, own_refused{0};
};

dpar_status NestingHook(void* payload, size_t replica, const int64_t*, size_t, const int64_t*, size_t) {
  auto* n = static_cast<Nested*>(payload);
  if (replica != 0) return DPAR_OK;
  dpar_engine_options o = DPAR_ENGINE_OPTIONS_INIT;
  o.num_cpu_devices = 2;
  o.pin_workers = 0;
  dpar_engine* inner = nullptr;
  if (dpar_engine_create(&inner, n->model, nullptr, &o) != DPAR_OK) return DPAR_OK;
  n->created++;
  size_t replicas = 0;
  if (dpar_engine_num_replicas(&replicas, inner) == DPAR_OK && replicas == 2) n->used++;
  dpar_engine_free(inner);
  // Freed: the handle is no longer live.
  if (dpar_engine_num_replicas(&replicas, inner) == DPAR_ERR_INVALID_ARGUMENT) n->freed++;
  // The engine whose callback this is still refuses, and is not freed.
  if (dpar_engine_num_replicas(&replicas, n->outer) == DPAR_ERR_INVALID_STATE) n->own_refused++;
  dpar_engine_free(n->outer);
  return DPAR_OK;
}

TEST(HandleHardening, EngineCreatedInACallbackIsFreedThere) {
  ModelPtr m = Mlp();
  EnginePtr outer = NewEngine(m.get(), 2);
  Nested n;
  n.model = m.get();
  n.outer = outer.get();
  ASSERT_OK(dpar_engine_set_forward_hook(outer.get(), NestingHook, &n, nullptr));
  Batch b = MakeBatch(8);
  for (int s = 0; s < 3; ++s) ASSERT_OK(dpar_engine_train_step(nullptr, outer.get(), b.x.get(), b.y.get()));
  EXPECT_EQ(n.created.load(), 3);
  EXPECT_EQ(n.used.load(), 3);
  EXPECT_EQ(n.freed.load(), 3);
  EXPECT_EQ(n.own_refused.load(), 3);
  size_t replicas = 0;
  ASSERT_OK(dpar_engine_num_replicas(&replicas, outer.get()));  // survived its own callbacks' free
  EXPECT_EQ(replicas, 2u);
}

// =================================================================================================================
// Option structs
// =================================================================================================================

// Engine options with size 0 and version 1 were taken as defaults, while model options with the same mistake
// were refused: every option struct now refuses a size smaller than its version's layout.
TEST(OptionsHardening, SizeTooSmallForItsVersionIsRefusedEverywhere) {
  ModelPtr m = Mlp();
  for (size_t size : {size_t{0}, size_t{8}, offsetof(dpar_engine_options, first_bucket_bytes) - 1}) {
    SCOPED_TRACE("engine options, version 1, size " + std::to_string(size));
    dpar_engine_options o = DPAR_ENGINE_OPTIONS_INIT;
    o.version = 1;
    o.size = size;
    dpar_engine* e = nullptr;
    EXPECT_REFUSED(DPAR_ERR_INVALID_ARGUMENT, dpar_engine_create(&e, m.get(), nullptr, &o), "opts", "size");
    EnginePtr owned(e);
  }
  {
    // Version 1's own layout is accepted, and the fields it predates take their defaults.
    dpar_engine_options o = DPAR_ENGINE_OPTIONS_INIT;
    o.version = 1;
    o.size = offsetof(dpar_engine_options, first_bucket_bytes);
    o.num_cpu_devices = 2;
    o.processes = 12345;  // not read: version 1 predates it
    dpar_engine* e = nullptr;
    ASSERT_OK(dpar_engine_create(&e, m.get(), nullptr, &o));
    EnginePtr owned(e);
  }
  {
    dpar_model_options o = DPAR_MODEL_OPTIONS_INIT;
    o.size = 0;
    dpar_model* bad = nullptr;
    EXPECT_REFUSED(DPAR_ERR_INVALID_ARGUMENT, dpar_model_create(&bad, &o), "opts", "size");
    ModelPtr owned(bad);
  }
  {
    dpar_optimizer_options o = DPAR_OPTIMIZER_OPTIONS_INIT;
    o.size = 0;
    dpar_engine* e = nullptr;
    EXPECT_REFUSED(DPAR_ERR_INVALID_ARGUMENT, dpar_engine_create(&e, m.get(), &o, nullptr), "optimizer", "size");
    EnginePtr owned(e);
  }
}


// Saves (checkpoints and traces) of two engines to one path at once: each write has a temporary file of its own,
// so every save succeeds, the file left is complete (it loads, its checksums pass) and no temporary file stays.
// Also run under ThreadSanitizer (the writer's shared state is the counter of temporary names).
TEST(WriterHardening, ConcurrentSavesToOnePathLeaveOneCompleteFile) {
  TempDir dir;
  const std::string ckpt = dir / "shared.safetensors";
  const std::string trace = dir / "shared.json";
  ModelPtr m = Mlp();
  EnginePtr a = NewEngine(m.get(), 2), b = NewEngine(m.get(), 1);
  std::atomic<int> failures{0};
  std::string first_failure;
  std::mutex failure_mutex;
  auto saver = [&](dpar_engine* e) {
    for (int round = 0; round < 40; ++round) {
      dpar_status s = dpar_engine_save(e, ckpt.c_str());
      if (s == DPAR_OK) s = dpar_engine_trace_start(e);
      if (s == DPAR_OK) s = dpar_engine_trace_stop(e, trace.c_str());
      if (s != DPAR_OK) {
        std::lock_guard<std::mutex> lock(failure_mutex);
        if (failures++ == 0) first_failure = dpar_last_error();
      }
    }
  };
  std::thread ta(saver, a.get()), tb(saver, b.get());
  ta.join();
  tb.join();
  EXPECT_EQ(failures.load(), 0) << first_failure;
  ASSERT_OK(dpar_engine_load(a.get(), ckpt.c_str()));
  std::ifstream in(trace);
  nlohmann::json parsed;
  EXPECT_NO_THROW(parsed = nlohmann::json::parse(in));
  EXPECT_TRUE(parsed.is_object() || parsed.is_array());
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(fs::path(ckpt).parent_path())) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"shared.json", "shared.safetensors"}));
}

// An IDX data set of `n` 2x2 images whose pixel values are the sample's index (mod 256), with labels i % 3.
DatasetPtr IndexDataset(const TempDir& dir, uint32_t n) {
  Bytes images = IdxHeader({n, 2, 2}), labels = IdxHeader({n});
  for (uint32_t i = 0; i < n; ++i) {
    for (int p = 0; p < 4; ++p) images.push_back(static_cast<uint8_t>(i));
    labels.push_back(static_cast<uint8_t>(i % 3));
  }
  WriteFile(dir / "images", images);
  WriteFile(dir / "labels", labels);
  dpar_dataset* d = nullptr;
  EXPECT_EQ(dpar_dataset_load_idx(&d, (dir / "images").c_str(), (dir / "labels").c_str()), DPAR_OK)
      << dpar_last_error();
  return DatasetPtr(d);
}

// Normalising a dataset that a loader on a device is reading (its thread prepares the next batch while the caller
// holds this one) is refused while the loader is open, so no batch is ever half old, half new and nothing races
// (ThreadSanitizer ran this too). Once the loader is freed, normalising works and new loaders see it.
TEST(LoaderHardening, NormalizeIsRefusedWhileADeviceLoaderReadsTheDataset) {
  TempDir dir;
  DatasetPtr d = IndexDataset(dir, 64);
  ASSERT_NE(d, nullptr);
  dpar_loader* l = nullptr;
  ASSERT_OK(dpar_loader_create(&l, d.get(), 8, 1, 7, 0));
  ASSERT_OK(dpar_loader_to_device(l, dpar_device{DPAR_DEVICE_CPU, 0}));
  std::atomic<bool> done{false};
  std::atomic<int> accepted{0}, refused_other{0}, attempts{0};
  std::thread normaliser([&] {
    while (!done.load()) {
      const dpar_status s = dpar_dataset_normalize(d.get(), 1.0f, 2.0f);
      attempts++;
      if (s == DPAR_OK) accepted++;
      else if (s != DPAR_ERR_INVALID_STATE) refused_other++;
      std::this_thread::yield();
    }
  });
  // Every batch holds raw pixels: each row's four values equal, and a whole number (the sample index).
  int bad_rows = 0, batches = 0;
  uint64_t epoch = 0;
  // At least 20 epochs, and on until the other thread has tried a few times while batches were prepared.
  for (; epoch < 20 || attempts.load() < 5; ++epoch) {
    ASSERT_OK(dpar_loader_start_epoch(l, epoch));
    int32_t more = 0;
    for (;;) {
      ASSERT_OK(dpar_loader_next(&more, l));
      if (!more) break;
      ++batches;
      const dpar_tensor* x = dpar_loader_inputs(l);
      size_t numel = 0;
      ASSERT_OK(dpar_tensor_info(nullptr, &numel, nullptr, x));
      std::vector<float> v(numel);
      ASSERT_OK(dpar_tensor_copy_to_host(v.data(), x, numel * sizeof(float)));
      for (size_t r = 0; r < numel / 4; ++r) {
        const float raw = v[r * 4] * 255.0f;
        if (std::fabs(raw - std::round(raw)) > 1e-3f || v[r * 4 + 3] != v[r * 4]) ++bad_rows;
      }
    }
  }
  done = true;
  normaliser.join();
  EXPECT_EQ(batches, static_cast<int>(epoch) * 8);
  EXPECT_EQ(accepted.load(), 0) << "normalised while a loader was reading the dataset";
  EXPECT_EQ(refused_other.load(), 0);
  EXPECT_EQ(bad_rows, 0);
  EXPECT_REFUSED(DPAR_ERR_INVALID_STATE, dpar_dataset_normalize(d.get(), 1.0f, 2.0f), "loader");
  dpar_loader_free(l);

  // No loader open: accepted, and a new loader yields normalised values ((i/255 - 1) / 2 for sample i).
  ASSERT_OK(dpar_dataset_normalize(d.get(), 1.0f, 2.0f));
  ASSERT_OK(dpar_loader_create(&l, d.get(), 64, 0, 0, 0));
  ASSERT_OK(dpar_loader_to_device(l, dpar_device{DPAR_DEVICE_CPU, 0}));
  int32_t more = 0;
  ASSERT_OK(dpar_loader_next(&more, l));
  ASSERT_EQ(more, 1);
  std::vector<float> v(64 * 4);
  ASSERT_OK(dpar_tensor_copy_to_host(v.data(), dpar_loader_inputs(l), v.size() * sizeof(float)));
  for (int i = 0; i < 64; ++i) EXPECT_NEAR(v[i * 4], (float(i) / 255.0f - 1.0f) / 2.0f, 1e-6f) << i;
  dpar_loader_free(l);
}

// ---- The layers' entry points: shapes, refused steps, allocation failures, names ---------------------------------

ModelPtr NewModel(uint64_t seed = 3) {
  dpar_model_options o = DPAR_MODEL_OPTIONS_INIT;
  o.seed = seed;
  dpar_model* m = nullptr;
  EXPECT_EQ(dpar_model_create(&m, &o), DPAR_OK);
  return ModelPtr(m);
}

// A host tensor of `shape` filled from a fixed stream (f32), or with i % classes (i32).
TensorPtr HostTensor(std::vector<int64_t> shape, int32_t dtype = DPAR_F32, uint32_t seed = 1, int32_t classes = 3) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  dpar_tensor* t = nullptr;
  EXPECT_EQ(dpar_tensor_create(&t, dtype, shape.data(), shape.size(), dpar_device{DPAR_DEVICE_CPU, 0}), DPAR_OK)
      << dpar_last_error();
  if (dtype == DPAR_F32) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = u(rng);
    EXPECT_EQ(dpar_tensor_copy_from_host(t, v.data(), v.size() * sizeof(float)), DPAR_OK);
  } else {
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = static_cast<int32_t>(i % classes);
    EXPECT_EQ(dpar_tensor_copy_from_host(t, v.data(), v.size() * sizeof(int32_t)), DPAR_OK);
  }
  return TensorPtr(t);
}

std::vector<float> AllParams(dpar_engine* e, const dpar_model* m, size_t replica = 0) {
  size_t n = 0;
  EXPECT_EQ(dpar_model_num_param_elements(&n, m), DPAR_OK);
  std::vector<float> p(n);
  EXPECT_EQ(dpar_engine_get_params(p.data(), e, replica, n), DPAR_OK) << dpar_last_error();
  return p;
}

// Every buffer of a replica, as raw bytes (f32 and i64 alike), in the model's order.
Bytes AllBuffers(dpar_engine* e, const dpar_model* m, size_t replica) {
  size_t n = 0;
  EXPECT_EQ(dpar_model_num_buffers(&n, m), DPAR_OK);
  Bytes out;
  for (size_t i = 0; i < n; ++i) {
    int64_t shape[4] = {0, 0, 0, 0};
    size_t ndim = 0;
    int32_t dtype = 0;
    EXPECT_EQ(dpar_model_buffer_info(&dtype, shape, &ndim, m, i), DPAR_OK) << dpar_last_error();
    size_t count = 1;  // a scalar (ndim 0) holds one
    for (size_t d = 0; d < ndim; ++d) count *= static_cast<size_t>(shape[d]);
    Bytes b(count * 8);
    EXPECT_EQ(dpar_engine_get_buffer(b.data(), e, replica, i, count), DPAR_OK) << dpar_last_error();
    b.resize(count * (dtype == DPAR_I64 ? 8 : 4));
    out.insert(out.end(), b.begin(), b.end());
  }
  return out;
}

TEST(EntryPoints, ShapesWhoseElementCountOverflowsAreRefusedWhereMade) {
  // A weight of 2^24 x 2^24 x 256 x 256 elements: 2^64, refused when the layer is added, naming the shape.
  ModelPtr m = NewModel();
  const int64_t k256[2] = {256, 256};
  EXPECT_REFUSED(DPAR_ERR_INVALID_ARGUMENT,
                 dpar_model_add_conv2d(m.get(), 1 << 24, 1 << 24, k256, nullptr, nullptr, nullptr, 1, 1),
                 "(16777216, 16777216, 256, 256)", "2^60");
  // A weight whose fan-in alone (in_channels x kernel) is 2^72: refused by the same check, before any product of
  // its extents is taken (the fan-in for the initialisation bound used to overflow first).
  const int64_t k24[2] = {1 << 24, 1 << 24};
  EXPECT_REFUSED(DPAR_ERR_INVALID_ARGUMENT,
                 dpar_model_add_conv2d(m.get(), 1 << 24, 1, k24, nullptr, nullptr, nullptr, 1, 0),
                 "(1, 16777216, 16777216, 16777216)");
  size_t layers = 9;
  ASSERT_OK(dpar_model_num_layers(&layers, m.get()));
  EXPECT_EQ(layers, 0u);  // nothing of the refused layer stays

  // A reshape to (2^32, 2^32, 1) per row: refused when added, naming the row shape (not "holds 64 elements, not 0").
  const int64_t huge_row[3] = {int64_t{1} << 32, int64_t{1} << 32, 1};
  EXPECT_REFUSED(DPAR_ERR_INVALID_ARGUMENT, dpar_model_add_reshape(m.get(), huge_row, 3),
                 "(4294967296, 4294967296, 1)", "2^60");

  // An output whose extents multiply past int64 only once the batch flows in: a 1x1 image padded by 2^24 on every
  // side into 2^14 channels is (1, 16384, 33554433, 33554433), about 2^64 elements. The step is refused before
  // anything is allocated (the first forward used to allocate the wrapped size and crash).
  ModelPtr c = NewModel();
  const int64_t row[3] = {1, 1, 1}, k1[2] = {1, 1}, pad[2] = {1 << 24, 1 << 24};
  ASSERT_OK(dpar_model_add_reshape(c.get(), row, 3));
  ASSERT_OK(dpar_model_add_conv2d(c.get(), 1, 1 << 14, k1, nullptr, pad, nullptr, 1, 1));
  ASSERT_OK(dpar_model_add_flatten(c.get()));
  EnginePtr e = NewEngine(c.get(), 1);
  ASSERT_TRUE(e);
  TensorPtr x = HostTensor({1, 1});
  dpar_tensor* out = nullptr;
  EXPECT_REFUSED(DPAR_ERR_INVALID_ARGUMENT, dpar_engine_forward(&out, e.get(), x.get()),
                 "(1, 16384, 33554433, 33554433)", "2^60");
  EXPECT_EQ(out, nullptr);
}

TEST(EntryPoints, WindowsWiderThanThePaddedInputAreRefusedAsPyTorchRefusesThem) {
  // PyTorch's output extent is floor((8 - 9) / s) + 1 = 0: refused, where integer division toward zero gave 1.
  const int64_t row[3] = {1, 8, 8}, k9[2] = {9, 9}, s2[2] = {2, 2}, k8[2] = {8, 8};
  struct Case {
    const char* what;
    std::function<dpar_status(dpar_model*)> add;
    bool fits;
  };
  const std::vector<Case> cases = {
      {"avg_pool2d 9x9", [&](dpar_model* m) { return dpar_model_add_avg_pool2d(m, k9, nullptr, nullptr); }, false},
      {"max_pool2d 9x9 stride 2", [&](dpar_model* m) { return dpar_model_add_max_pool2d(m, k9, s2, nullptr); }, false},
      {"conv2d 9x9 stride 2",
       [&](dpar_model* m) { return dpar_model_add_conv2d(m, 1, 2, k9, s2, nullptr, nullptr, 1, 1); }, false},
      {"avg_pool2d 8x8", [&](dpar_model* m) { return dpar_model_add_avg_pool2d(m, k8, nullptr, nullptr); }, true},
      {"conv2d 8x8 stride 2",
       [&](dpar_model* m) { return dpar_model_add_conv2d(m, 1, 2, k8, s2, nullptr, nullptr, 1, 1); }, true},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    ModelPtr m = NewModel();
    ASSERT_OK(dpar_model_add_reshape(m.get(), row, 3));
    ASSERT_OK(k.add(m.get()));
    ASSERT_OK(dpar_model_add_flatten(m.get()));
    EnginePtr e = NewEngine(m.get(), 1);
    ASSERT_TRUE(e);
    TensorPtr x = HostTensor({2, 64});
    dpar_tensor* out = nullptr;
    if (!k.fits) {
      EXPECT_REFUSED(DPAR_ERR_INVALID_ARGUMENT, dpar_engine_forward(&out, e.get(), x.get()), "8, 8)", "0x0");
      continue;
    }
    ASSERT_OK(dpar_engine_forward(&out, e.get(), x.get()));
    int64_t shape[4];
    size_t ndim = 0;
    ASSERT_OK(dpar_tensor_shape(shape, &ndim, out, 4));
    EXPECT_EQ(ndim, 2u);
    EXPECT_EQ(shape[1], k.what[0] == 'a' ? 1 : 2);  // 1x1 for the pool, 2 channels of 1x1 for the convolution
    dpar_tensor_free(out);
  }
}

// Linear(4, 4) -> BatchNorm1d(4) -> Linear(4, 3) over `devices` CPU devices.
struct BatchNormRig {
  ModelPtr model;
  EnginePtr engine;
  explicit BatchNormRig(size_t devices, float dropout = 0.0f) {
    model = NewModel(7);
    EXPECT_EQ(dpar_model_add_linear(model.get(), 4, 4, 1), DPAR_OK);
    EXPECT_EQ(dpar_model_add_batchnorm1d(model.get(), 4, 1e-5f, 0.1f, 1), DPAR_OK);
    if (dropout > 0.0f) EXPECT_EQ(dpar_model_add_dropout(model.get(), dropout), DPAR_OK);
    EXPECT_EQ(dpar_model_add_linear(model.get(), 4, 3, 1), DPAR_OK);
    engine = NewEngine(model.get(), devices);
  }
  float step(int64_t rows, uint32_t seed = 1) {
    TensorPtr x = HostTensor({rows, 4}, DPAR_F32, seed), y = HostTensor({rows}, DPAR_I32);
    float loss = NAN;
    EXPECT_EQ(dpar_engine_train_step(&loss, engine.get(), x.get(), y.get()), DPAR_OK) << dpar_last_error();
    return loss;
  }
  int64_t batches_tracked(size_t replica) {
    int64_t n = -1;
    EXPECT_EQ(dpar_engine_get_buffer(&n, engine.get(), replica, 2, 1), DPAR_OK) << dpar_last_error();
    return n;
  }
};

TEST(EntryPoints, AStepOneReplicaRefusesChangesNoReplica) {
  // 3 rows over 2 devices: replica 1 gets 1 row, and BatchNorm1d takes no statistics from 1 value per channel.
  BatchNormRig rig(2);
  const Bytes before = AllBuffers(rig.engine.get(), rig.model.get(), 0);
  const std::vector<float> params = AllParams(rig.engine.get(), rig.model.get());
  TensorPtr x = HostTensor({3, 4}), y = HostTensor({3}, DPAR_I32);
  EXPECT_REFUSED(DPAR_ERR_INVALID_ARGUMENT, dpar_engine_train_step(nullptr, rig.engine.get(), x.get(), y.get()),
                 "more than 1 value per channel", "replica 1", "(1, 4)");
  EXPECT_REFUSED(DPAR_ERR_INVALID_ARGUMENT, dpar_engine_accumulate(nullptr, rig.engine.get(), x.get(), y.get()),
                 "more than 1 value per channel", "replica 1");
  dpar_tensor* out = nullptr;
  EXPECT_REFUSED(DPAR_ERR_INVALID_ARGUMENT, dpar_engine_forward(&out, rig.engine.get(), x.get()),
                 "more than 1 value per channel", "replica 1");
  for (size_t r = 0; r < 2; ++r) EXPECT_EQ(AllBuffers(rig.engine.get(), rig.model.get(), r), before) << r;
  EXPECT_EQ(AllParams(rig.engine.get(), rig.model.get()), params);
  // The next good step counts once on every replica, as one good step does on a fresh engine.
  BatchNormRig fresh(2);
  rig.step(4);
  fresh.step(4);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(rig.batches_tracked(r), 1) << r;
    EXPECT_EQ(AllBuffers(rig.engine.get(), rig.model.get(), r), AllBuffers(fresh.engine.get(), fresh.model.get(), r));
  }
  EXPECT_EQ(AllParams(rig.engine.get(), rig.model.get()), AllParams(fresh.engine.get(), fresh.model.get()));
  // In eval mode BatchNorm takes no statistics: the same 3 rows are a valid forward.
  ASSERT_OK(dpar_engine_set_training(rig.engine.get(), 0));
  ASSERT_OK(dpar_engine_forward(&out, rig.engine.get(), x.get()));
  dpar_tensor_free(out);
}

TEST(EntryPoints, AStepThatFailsOnOneReplicaPutsEveryReplicasStateBack) {
  // Replica 1 fails in backward after replica 0 moved its running statistics and every replica drew its dropout
  // mask: the failed step must leave buffers and RNG streams as they were, so that the engine then trains exactly
  // as one that never saw the failure.
  for (int32_t fault : {DPAR_FAULT_FORWARD, DPAR_FAULT_BACKWARD, DPAR_FAULT_ALLOC}) {
    SCOPED_TRACE(fault);
    BatchNormRig rig(2, 0.25f), fresh(2, 0.25f);
    rig.step(6, 1);
    fresh.step(6, 1);
    ASSERT_OK(dpar_engine_inject_fault(rig.engine.get(), 1, fault));
    TensorPtr x = HostTensor({8, 4}, DPAR_F32, 2), y = HostTensor({8}, DPAR_I32);
    dpar_clear_error();
    const dpar_status s = dpar_engine_train_step(nullptr, rig.engine.get(), x.get(), y.get());
    EXPECT_NE(s, DPAR_OK);
    EXPECT_NE(std::string(dpar_last_error()).find("remains usable"), std::string::npos) << dpar_last_error();
    for (size_t r = 0; r < 2; ++r)
      EXPECT_EQ(AllBuffers(rig.engine.get(), rig.model.get(), r), AllBuffers(fresh.engine.get(), fresh.model.get(), r));
    for (uint32_t seed : {3u, 4u}) {
      EXPECT_EQ(rig.step(6, seed), fresh.step(6, seed));
      EXPECT_EQ(AllParams(rig.engine.get(), rig.model.get(), 1), AllParams(fresh.engine.get(), fresh.model.get(), 1));
      EXPECT_EQ(AllBuffers(rig.engine.get(), rig.model.get(), 1), AllBuffers(fresh.engine.get(), fresh.model.get(), 1));
    }
  }
}

// Linear(4, 2048) -> ReLU -> Linear(2048, 3) over one CPU device: a batch of B rows needs about 3 x B x 8 KiB of
// activations and gradients.
struct WideRig {
  ModelPtr model;
  EnginePtr engine;
  WideRig() {
    model = NewModel(11);
    EXPECT_EQ(dpar_model_add_linear(model.get(), 4, 2048, 1), DPAR_OK);
    EXPECT_EQ(dpar_model_add_activation(model.get(), DPAR_RELU), DPAR_OK);
    EXPECT_EQ(dpar_model_add_linear(model.get(), 2048, 3, 1), DPAR_OK);
    engine = NewEngine(model.get(), 1);
  }
  dpar_status step(int64_t rows, uint32_t seed) {
    TensorPtr x = HostTensor({rows, 4}, DPAR_F32, seed), y = HostTensor({rows}, DPAR_I32);
    dpar_clear_error();
    return dpar_engine_train_step(nullptr, engine.get(), x.get(), y.get());
  }
};

TEST(EntryPoints, AnInjectedAllocationFailureLeavesTheEngineUsableForSmallerBatches) {
  WideRig rig, fresh;
  ASSERT_OK(rig.step(4, 1));
  ASSERT_OK(fresh.step(4, 1));
  // A larger batch plans new buffers; the first allocation fails.
  ASSERT_OK(dpar_engine_inject_fault(rig.engine.get(), 0, DPAR_FAULT_ALLOC));
  EXPECT_REFUSED(DPAR_ERR_OUT_OF_MEMORY, rig.step(64, 2), "remains usable");
  for (int64_t rows : {2, 4, 3}) {
    ASSERT_OK(rig.step(rows, 5));
    ASSERT_OK(fresh.step(rows, 5));
    EXPECT_EQ(AllParams(rig.engine.get(), rig.model.get()), AllParams(fresh.engine.get(), fresh.model.get()));
  }
}

// The process's virtual memory in bytes (/proc/self/status VmSize).
size_t VirtualBytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmSize:", 0) == 0) return std::stoull(line.substr(7)) * 1024;
  return 0;
}

TEST(EntryPoints, ARealOutOfMemoryLeavesTheEngineUsable) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "a sanitizer's shadow memory takes the address space that RLIMIT_AS limits";
#else
  // A real limit on the address space (RLIMIT_AS), not the injected fault: each budget lets a batch of 32768 rows
  // (256 MiB per activation of 2048 columns, about 3 of them) allocate some of its buffers and fail on a later one,
  // the activations' or the gradients'. After each failure smaller batches train exactly as on an engine that never
  // failed (the plan used to stay half-made: INTERNAL "rows out of ()", or a read of freed gradient memory).
  constexpr int64_t kRows = 32768;
  constexpr size_t kActivation = size_t{kRows} * 2048 * sizeof(float);
  WideRig rig, fresh;
  ASSERT_OK(rig.step(4, 1));
  ASSERT_OK(fresh.step(4, 1));
  TensorPtr x = HostTensor({kRows, 4}, DPAR_F32, 2), y = HostTensor({kRows}, DPAR_I32);
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_AS, &old), 0);
  for (double budget : {2.5, 1.5, 0.5}) {
    SCOPED_TRACE(budget);
    rlimit limit = old;
    limit.rlim_cur = static_cast<rlim_t>(VirtualBytes() + static_cast<size_t>(budget * kActivation));
    ASSERT_EQ(setrlimit(RLIMIT_AS, &limit), 0);
    dpar_clear_error();
    const dpar_status s = dpar_engine_train_step(nullptr, rig.engine.get(), x.get(), y.get());
    const std::string message = dpar_last_error();
    ASSERT_EQ(setrlimit(RLIMIT_AS, &old), 0);
    EXPECT_EQ(s, DPAR_ERR_OUT_OF_MEMORY) << message;
    EXPECT_NE(message.find("remains usable"), std::string::npos) << message;
    for (int64_t rows : {2, 4, 3}) {
      ASSERT_OK(rig.step(rows, 5));
      ASSERT_OK(fresh.step(rows, 5));
      EXPECT_EQ(AllParams(rig.engine.get(), rig.model.get()), AllParams(fresh.engine.get(), fresh.model.get()));
    }
  }
#endif
}

TEST(EntryPoints, NodeNamesThatWouldCollideWithCheckpointKeysAreRefusedWhenGiven) {
  ModelPtr m = NewModel();
  ASSERT_OK(dpar_model_add_linear(m.get(), 4, 3, 1));
  ASSERT_OK(dpar_model_add_linear(m.get(), 3, 3, 1));
  // "optimizer.exp_avg.0" + ".weight" is the key of Adam's first moment of "0.weight".
  EXPECT_REFUSED(DPAR_ERR_INVALID_ARGUMENT, dpar_model_set_node_name(m.get(), 1, "optimizer.exp_avg.0"),
                 "optimizer", "reserve");
  EXPECT_REFUSED(DPAR_ERR_INVALID_ARGUMENT, dpar_model_set_node_name(m.get(), 1, "optimizer"), "optimizer");
  ASSERT_OK(dpar_model_set_node_name(m.get(), 1, "optimizers.head"));
  // The names given are a checkpoint that can be written and read back.
  dpar_optimizer_options opt = DPAR_OPTIMIZER_OPTIONS_INIT;
  opt.kind = DPAR_ADAM;
  dpar_engine_options o = DPAR_ENGINE_OPTIONS_INIT;
  o.num_cpu_devices = 2;
  dpar_engine* raw = nullptr;
  ASSERT_OK(dpar_engine_create(&raw, m.get(), &opt, &o));
  EnginePtr e(raw);
  Batch b = MakeBatch(6);
  ASSERT_OK(dpar_engine_train_step(nullptr, e.get(), b.x.get(), b.y.get()));
  TempDir dir;
  ASSERT_OK(dpar_engine_save(e.get(), (dir / "named.safetensors").c_str()));
  ASSERT_OK(dpar_engine_load(e.get(), (dir / "named.safetensors").c_str()));
}

TEST(EntryPoints, JoinCountsAndEmbeddingExtentsAreArgumentErrors) {
  ModelPtr m = NewModel();
  ASSERT_OK(dpar_model_add_linear(m.get(), 4, 3, 1));
  const int32_t nodes[2] = {0, 0};
  EXPECT_REFUSED(DPAR_ERR_INVALID_ARGUMENT, dpar_model_add_sum(m.get(), nodes, SIZE_MAX), "n:", "65536");
  EXPECT_REFUSED(DPAR_ERR_INVALID_ARGUMENT, dpar_model_add_concat(m.get(), nodes, SIZE_MAX / 4), "n:", "65536");
  ASSERT_OK(dpar_model_add_sum(m.get(), nodes, 2));  // a node read twice by one sum is fine
  ModelPtr e = NewModel();
  EXPECT_REFUSED(DPAR_ERR_INVALID_ARGUMENT, dpar_model_add_embedding_padded(e.get(), INT64_MIN, 4, 0),
                 "num_embeddings: -9223372036854775808");
  EXPECT_REFUSED(DPAR_ERR_INVALID_ARGUMENT, dpar_model_add_embedding_padded(e.get(), 10, 4, INT64_MIN),
                 "padding_idx", "[-10, 10)");
  ASSERT_OK(dpar_model_add_embedding_padded(e.get(), 10, 4, -1));  // row 9, as PyTorch's padding_idx=-1
}

TEST(EntryPoints, BatchCountersAddInInt64AsPyTorchDoes) {
  // num_batches_tracked past 2^53 (where a double loses the last digit) and at INT64_MAX (where PyTorch's int64
  // add wraps): one step adds exactly 1 on every replica.
  for (int64_t start : {(int64_t{1} << 53) + 1, int64_t{INT64_MAX}}) {
    BatchNormRig rig(2);
    ModelPtr m = NewModel(7);
    ASSERT_OK(dpar_model_add_linear(m.get(), 4, 4, 1));
    ASSERT_OK(dpar_model_add_batchnorm1d(m.get(), 4, 1e-5f, 0.1f, 1));
    ASSERT_OK(dpar_model_add_linear(m.get(), 4, 3, 1));
    ASSERT_OK(dpar_model_set_buffer(m.get(), 2, &start, 1));
    rig.engine = NewEngine(m.get(), 2);
    rig.model = std::move(m);
    rig.step(6);
    const int64_t want = static_cast<int64_t>(static_cast<uint64_t>(start) + 1);
    for (size_t r = 0; r < 2; ++r) EXPECT_EQ(rig.batches_tracked(r), want) << r;
  }
}

TEST(EntryPoints, Bf16AcrossALinkThatCannotMoveItIsRefusedAtCreation) {
  // A threads communicator as the processes' link: it moves no bf16, so a reducer compressing to bf16 across it is
  // refused when created, not by every dpar_reducer_wait() after.
  dpar_comm_group *local = nullptr, *procs = nullptr;
  ASSERT_OK(dpar_comm_group_create(&local, 1, nullptr));
  ASSERT_OK(dpar_comm_group_create(&procs, 2, nullptr));
  dpar_comm *comm = nullptr, *link = nullptr;
  ASSERT_OK(dpar_comm_group_member(&comm, local, 0));
  ASSERT_OK(dpar_comm_group_member(&link, procs, 0));
  std::vector<float> grad(8, 1.0f);
  float* grads[1] = {grad.data()};
  const size_t counts[1] = {grad.size()};
  dpar_reducer_options o = DPAR_REDUCER_OPTIONS_INIT;
  o.op = DPAR_SUM;
  o.processes = link;
  o.compression = DPAR_COMPRESSION_BF16;
  dpar_reducer* r = nullptr;
  EXPECT_REFUSED(DPAR_ERR_NOT_SUPPORTED, dpar_reducer_create(&r, comm, grads, counts, 1, &o), "bf16", "threads");
  EXPECT_EQ(r, nullptr);
  dpar_comm_free(comm);
  dpar_comm_free(link);
  dpar_comm_group_free(local);
  dpar_comm_group_free(procs);
}

}  // namespace
