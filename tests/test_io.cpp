// Tests of the file formats: IDX (MNIST-like data sets) and safetensors (checkpoints).
// Damaged input must be refused with the right status and a message naming the file, never crash: several
// tests therefore cut or flip files at every position rather than at a few chosen ones.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <zlib.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <set>
#include <sstream>
#include <thread>

#include "common/error.h"
#include "io/idx.h"
#include "io/safetensors.h"

// A test that needs something outside dpar (Python's safetensors, Debian's Fashion-MNIST) skips without it, except
// where DPAR_TEST_REQUIRE_DEPS is set: CI installs every such dependency, so there a skip would hide a failure.
#define SKIP_MISSING_DEPENDENCY(message)                                                                  \
  do {                                                                                                    \
    if (const char* require_ = std::getenv("DPAR_TEST_REQUIRE_DEPS"); require_ && *require_) {            \
      ADD_FAILURE() << "missing dependency (DPAR_TEST_REQUIRE_DEPS is set): " << message;                 \
      return;                                                                                             \
    }                                                                                                     \
    GTEST_SKIP() << message;                                                                              \
  } while (0)

namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<uint8_t>;
using dpar::Status;
using dpar::io::IdxArray;
using dpar::io::read_idx_u8;
using dpar::io::SafetensorsFile;
using dpar::io::TensorView;
using dpar::io::write_safetensors;

// Runs f and expects a dpar::Error of `status` whose message contains every needle.
void expect_error(const std::function<void()>& f, Status status, const std::vector<std::string>& needles,
                  const char* file, int line) {
  ::testing::ScopedTrace trace(file, line, "expect_error");
  try {
    f();
  } catch (const dpar::Error& e) {
    EXPECT_EQ(e.status(), status) << e.what();
    for (const std::string& needle : needles) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "'" << needle << "' not in: " << e.what();
    }
    return;
  }
  ADD_FAILURE() << "no dpar::Error was thrown";
}
#define EXPECT_DPAR_ERROR(stmt, status, ...) \
  expect_error([&] { (void)(stmt); }, (status), {__VA_ARGS__}, __FILE__, __LINE__)

void write_file(const std::string& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

Bytes read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_gz(const std::string& path, const Bytes& bytes, int level = 6) {
  const std::string mode = "wb" + std::to_string(level);
  gzFile file = gzopen(path.c_str(), mode.c_str());
  ASSERT_NE(file, nullptr) << path;
  size_t done = 0;
  while (done < bytes.size()) {
    const unsigned chunk = static_cast<unsigned>(std::min<size_t>(bytes.size() - done, size_t{1} << 20));
    ASSERT_EQ(gzwrite(file, bytes.data() + done, chunk), static_cast<int>(chunk));
    done += chunk;
  }
  ASSERT_EQ(gzclose(file), Z_OK);
}

Bytes gz_bytes(const Bytes& bytes, const std::string& scratch) {
  write_gz(scratch, bytes);
  return read_file(scratch);
}

std::set<std::string> list_dir(const std::string& dir) {
  std::set<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.insert(entry.path().filename().string());
  return names;
}

// A fresh directory per test, removed afterwards (permissions restored first, in case a test took them).
class IoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/dpar_test_io.XXXXXX";
    ASSERT_NE(mkdtemp(templ.data()), nullptr) << std::strerror(errno);
    dir_ = templ;
  }
  void TearDown() override {
    std::error_code ec;
    for (const auto& entry : fs::recursive_directory_iterator(dir_, ec)) {
      if (entry.is_directory(ec)) fs::permissions(entry.path(), fs::perms::owner_all, fs::perm_options::add, ec);
    }
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  std::string dir_;
};

// ----------------------------------------------------------------------------------------------------------- IDX

Bytes idx_bytes(uint8_t type, const std::vector<uint32_t>& dims, const Bytes& data) {
  Bytes out = {0, 0, type, static_cast<uint8_t>(dims.size())};
  for (uint32_t d : dims) {
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<uint8_t>(d >> shift));
  }
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

Bytes pattern(size_t n) {
  Bytes data(n);
  for (size_t i = 0; i < n; ++i) data[i] = static_cast<uint8_t>((i * 7) ^ (i >> 9));
  return data;
}

TEST_F(IoTest, IdxReadsPlainAndGzipFiles) {
  const Bytes images = pattern(3 * 2 * 4);
  const Bytes labels = {0, 9, 3, 3, 1};
  write_file(path("images"), idx_bytes(0x08, {3, 2, 4}, images));
  write_gz(path("images.gz"), idx_bytes(0x08, {3, 2, 4}, images));
  write_file(path("labels"), idx_bytes(0x08, {5}, labels));
  write_gz(path("labels.gz"), idx_bytes(0x08, {5}, labels));
  for (const char* name : {"images", "images.gz"}) {
    const IdxArray a = read_idx_u8(path(name));
    EXPECT_EQ(a.dims, (std::vector<int64_t>{3, 2, 4})) << name;
    EXPECT_EQ(a.data, images) << name;
  }
  for (const char* name : {"labels", "labels.gz"}) {
    const IdxArray a = read_idx_u8(path(name));
    EXPECT_EQ(a.dims, (std::vector<int64_t>{5})) << name;
    EXPECT_EQ(a.data, labels) << name;
  }
}

// The buffer grows in steps from 16 MiB; 40 MiB takes two steps and must end exactly sized.
TEST_F(IoTest, IdxReadsDataLargerThanOneChunk) {
  const Bytes data = pattern(size_t{5} * 2048 * 4096);
  const Bytes file = idx_bytes(0x08, {5, 2048, 4096}, data);
  write_file(path("big"), file);
  write_gz(path("big.gz"), file, 1);
  for (const char* name : {"big", "big.gz"}) {
    const IdxArray a = read_idx_u8(path(name));
    EXPECT_EQ(a.dims, (std::vector<int64_t>{5, 2048, 4096})) << name;
    ASSERT_EQ(a.data.size(), data.size()) << name;
    EXPECT_TRUE(a.data == data) << name;
    EXPECT_EQ(a.data.capacity(), data.size()) << name << ": the buffer should not overshoot";
  }
}

TEST_F(IoTest, IdxIgnoresTrailingData) {
  Bytes file = idx_bytes(0x08, {2, 2}, {1, 2, 3, 4});
  file.insert(file.end(), {0xde, 0xad, 0xbe});
  write_file(path("plain"), file);
  write_gz(path("gz"), file);
  for (const char* name : {"plain", "gz"}) {
    const IdxArray a = read_idx_u8(path(name));
    EXPECT_EQ(a.data, (Bytes{1, 2, 3, 4})) << name;
  }
}

TEST_F(IoTest, IdxRefusesTruncatedData) {
  const Bytes file = idx_bytes(0x08, {3, 2, 4}, pattern(10));
  write_file(path("short"), file);
  write_gz(path("short.gz"), file);
  // A plain file's size shows the truncation before any data is read.
  EXPECT_DPAR_ERROR(read_idx_u8(path("short")), Status::kCorrupt, path("short"),
                    "dimensions describe 24 bytes of data, more than the 26-byte file holds");
  EXPECT_DPAR_ERROR(read_idx_u8(path("short.gz")), Status::kCorrupt, path("short.gz"),
                    "truncated: expected 24 bytes of data, got 10");
}

// Every prefix of a valid file, plain or compressed, is refused: none is a valid file.
TEST_F(IoTest, IdxRefusesEveryTruncation) {
  const Bytes plain = idx_bytes(0x08, {4, 5, 6}, pattern(120));
  const Bytes gz = gz_bytes(plain, path("scratch.gz"));
  for (const Bytes* whole : {&plain, &gz}) {
    for (size_t n = 0; n < whole->size(); ++n) {
      SCOPED_TRACE((whole == &plain ? "plain, " : "gzip, ") + std::to_string(n) + " bytes");
      write_file(path("cut"), Bytes(whole->begin(), whole->begin() + static_cast<std::ptrdiff_t>(n)));
      EXPECT_DPAR_ERROR(read_idx_u8(path("cut")), Status::kCorrupt, path("cut"));
    }
  }
}

TEST_F(IoTest, IdxRefusesBadHeaders) {
  struct Case {
    const char* name;
    Bytes bytes;
    Status status;
    std::string needle;
  };
  Bytes many_dims = {0, 0, 0x08, 255};
  for (int i = 0; i < 255; ++i) many_dims.insert(many_dims.end(), {0, 0, 0, 2});
  const std::vector<Case> cases = {
      {"empty", {}, Status::kCorrupt, "truncated header: expected 4 bytes of magic number, got 0"},
      {"bad_magic", {0x01, 0x00, 0x08, 0x01, 0, 0, 0, 1, 7}, Status::kCorrupt, "bad magic number 0x01 0x00 0x08 0x01"},
      {"text", {'h', 'e', 'l', 'l', 'o', '\n'}, Status::kCorrupt, "bad magic number"},
      {"f32", idx_bytes(0x0D, {1}, {0, 0, 0, 0}), Status::kNotSupported, "element type 0x0d (f32) is not supported"},
      {"i32", idx_bytes(0x0C, {1}, {0, 0, 0, 0}), Status::kNotSupported, "0x0c (i32)"},
      {"unknown_type", idx_bytes(0x42, {1}, {0}), Status::kCorrupt, "unknown IDX element type 0x42"},
      {"no_dims", {0, 0, 0x08, 0}, Status::kCorrupt, "declares 0 dimensions"},
      {"short_dims", {0, 0, 0x08, 3, 0, 0, 0, 2, 0, 0}, Status::kCorrupt,
       "truncated header: expected 12 bytes of dimensions, got 6"},
      {"zero_extent", idx_bytes(0x08, {3, 0, 2}, {}), Status::kCorrupt, "dimension 1 is 0"},
      {"overflow", idx_bytes(0x08, {0xffffffffu, 0xffffffffu, 0xffffffffu}, {1, 2, 3}), Status::kCorrupt,
       "dimensions [4294967295, 4294967295, 4294967295] describe more than 17179869184 bytes"},
      {"too_big", idx_bytes(0x08, {1u << 17, 1u << 17, 2}, {1, 2, 3}), Status::kCorrupt, "describe more than"},
      {"255_dims", many_dims, Status::kCorrupt, "describe more than"},
      // The largest size allowed, claimed by a tiny file: refused before reading, without a 16 GiB allocation.
      {"huge_claim", idx_bytes(0x08, {1u << 16, 1u << 16, 4}, pattern(100)), Status::kCorrupt,
       "dimensions describe 17179869184 bytes of data, more than the"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    write_file(path(c.name), c.bytes);
    EXPECT_DPAR_ERROR(read_idx_u8(path(c.name)), c.status, path(c.name), c.needle);
    // The same damage inside a gzip stream is reported the same way.
    write_gz(path(std::string(c.name) + ".gz"), c.bytes);
    EXPECT_DPAR_ERROR(read_idx_u8(path(std::string(c.name) + ".gz")), c.status, c.needle);
  }
}

// Damage inside the compressed stream or its trailer is caught by zlib's checks, including damage to the CRC
// of a stream whose data was all read: the reader goes on to the end of the stream to have it verified.
TEST_F(IoTest, IdxRefusesDamagedGzipStreams) {
  const Bytes gz = gz_bytes(idx_bytes(0x08, {4, 50}, pattern(200)), path("good.gz"));
  ASSERT_NO_THROW(read_idx_u8(path("good.gz")));
  // Bytes 0-9 are the gzip header, whose time stamp and OS fields nothing checks; start after them.
  for (size_t i = 10; i < gz.size(); ++i) {
    SCOPED_TRACE("byte " + std::to_string(i) + " of " + std::to_string(gz.size()));
    Bytes bad = gz;
    bad[i] ^= 0xff;
    write_file(path("bad.gz"), bad);
    EXPECT_DPAR_ERROR(read_idx_u8(path("bad.gz")), Status::kCorrupt, path("bad.gz"));
  }
  Bytes bad_crc = gz;
  bad_crc[gz.size() - 8] ^= 0x01;
  write_file(path("bad_crc.gz"), bad_crc);
  EXPECT_DPAR_ERROR(read_idx_u8(path("bad_crc.gz")), Status::kCorrupt, path("bad_crc.gz"), "damaged gzip stream");
}

TEST_F(IoTest, IdxRefusesMissingFilesWithIo) {
  EXPECT_DPAR_ERROR(read_idx_u8(path("missing.gz")), Status::kIo, path("missing.gz"), std::strerror(ENOENT));
  fs::create_directory(path("a_directory"));
  EXPECT_DPAR_ERROR(read_idx_u8(path("a_directory")), Status::kIo, path("a_directory"));
}

TEST(IoFashionMnist, ReadsTheRealFiles) {
  const std::string dir = "/usr/share/datasets/fashion-mnist/";
  const std::string images_path = dir + "train-images-idx3-ubyte.gz";
  const std::string labels_path = dir + "train-labels-idx1-ubyte.gz";
  if (!fs::exists(images_path) || !fs::exists(labels_path)) {
    SKIP_MISSING_DEPENDENCY("Fashion-MNIST is not installed at " << dir);
  }
  const IdxArray images = read_idx_u8(images_path);
  EXPECT_EQ(images.dims, (std::vector<int64_t>{60000, 28, 28}));
  EXPECT_EQ(images.data.size(), size_t{60000} * 28 * 28);
  const IdxArray labels = read_idx_u8(labels_path);
  ASSERT_EQ(labels.dims, (std::vector<int64_t>{60000}));
  std::vector<int> per_class(10, 0);
  for (uint8_t label : labels.data) {
    ASSERT_LT(label, 10);
    ++per_class[label];
  }
  // The training set is balanced (6000 of each class) and starts with an ankle boot (9).
  EXPECT_EQ(per_class, std::vector<int>(10, 6000));
  EXPECT_EQ(Bytes(labels.data.begin(), labels.data.begin() + 10), (Bytes{9, 0, 0, 3, 0, 2, 7, 2, 5, 5}));
}

// --------------------------------------------------------------------------------------------------- safetensors

// A safetensors file from a header text (padded with spaces to a multiple of 8 if asked) and a data buffer.
Bytes st_bytes(std::string header, const Bytes& buffer, bool pad = true) {
  if (pad) header.append((8 - header.size() % 8) % 8, ' ');
  Bytes out(8);
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(static_cast<uint64_t>(header.size()) >> (8 * i));
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), buffer.begin(), buffer.end());
  return out;
}

template <class T>
Bytes to_bytes(const std::vector<T>& values) {
  Bytes out(values.size() * sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), values.data(), out.size());
  return out;
}

uint32_t crc_of(const Bytes& bytes) {
  return static_cast<uint32_t>(crc32_z(0, bytes.empty() ? nullptr : bytes.data(), bytes.size()));
}

// Tensors of several dtypes, one of them a scalar, one empty, and one of odd size so that what follows it is
// not aligned in the buffer.
struct Sample {
  std::vector<float> weight{1.5f, -2.0f, 3.25f, 0.0f, -0.5f, 1e-3f};
  std::vector<int64_t> step{42};
  std::vector<uint64_t> rng{0x0123456789abcdefULL, 0xfedcba9876543210ULL, 7, 0};
  Bytes mask{1, 0, 1, 1, 0};
  std::vector<uint16_t> bf16{0x3f80, 0xc000, 0x7f80};
  std::vector<float> none;

  std::vector<TensorView> views() const {
    return {
        {"layer0.weight", "F32", {2, 3}, weight.data(), weight.size() * 4},
        {"step", "I64", {}, step.data(), 8},
        {"mask", "U8", {5}, mask.data(), 5},
        {"rng", "U64", {4}, rng.data(), 32},
        {"half", "BF16", {3}, bf16.data(), 6},
        {"empty", "F32", {0, 7}, nullptr, 0},
    };
  }
  Bytes buffer() const {
    Bytes all;
    for (const Bytes& part : {to_bytes(weight), to_bytes(step), mask, to_bytes(rng), to_bytes(bf16)}) {
      all.insert(all.end(), part.begin(), part.end());
    }
    return all;
  }
};

// Metadata with characters that JSON must escape, including a NUL (written as \u0000, so still allowed).
const std::map<std::string, std::string> kSampleMetadata = {{"format", "dpar"},
                                                            {"step", "42"},
                                                            {"note", "gr\xc3\xb6\xc3\x9f" "e \"quoted\" \\ \n"},
                                                            {"nul", std::string("a\0b", 3)}};

TEST_F(IoTest, SafetensorsRoundTrip) {
  const Sample sample;
  write_safetensors(path("ckpt.safetensors"), sample.views(), kSampleMetadata);
  EXPECT_EQ(list_dir(dir_), (std::set<std::string>{"ckpt.safetensors"})) << "no temporary file is left";

  const SafetensorsFile file = SafetensorsFile::read(path("ckpt.safetensors"));
  EXPECT_EQ(file.path(), path("ckpt.safetensors"));
  // Names come in file order, which is the order written; the empty tensor sits at the end of the data, at the
  // same offset as nothing else, after "half".
  EXPECT_EQ(file.names(), (std::vector<std::string>{"layer0.weight", "step", "mask", "rng", "half", "empty"}));
  EXPECT_EQ(file.size(), 6u);
  size_t offset = 0;
  for (const TensorView& v : sample.views()) {
    SCOPED_TRACE(v.name);
    ASSERT_TRUE(file.has(v.name));
    const dpar::io::SafetensorsEntry& e = file.entry(v.name);
    EXPECT_EQ(e.dtype, v.dtype);
    EXPECT_EQ(e.shape, v.shape);
    EXPECT_EQ(e.bytes, v.bytes);
    EXPECT_EQ(e.offset, offset);
    offset += v.bytes;
    if (v.bytes > 0) {
      EXPECT_EQ(std::memcmp(file.data(v.name), v.data, v.bytes), 0);
    }
  }
  EXPECT_EQ(file.buffer(), sample.buffer());

  std::map<std::string, std::string> expected_metadata = kSampleMetadata;
  expected_metadata["dpar.crc32"] = std::to_string(crc_of(sample.buffer()));
  ASSERT_EQ(file.metadata().count("dpar.header_crc32"), 1u);
  expected_metadata["dpar.header_crc32"] = file.metadata().at("dpar.header_crc32");
  EXPECT_EQ(file.metadata(), expected_metadata);

  // The typed accessors a checkpoint loader uses.
  std::vector<uint64_t> rng(4);
  file.copy_to("rng", rng.data(), 32);
  EXPECT_EQ(rng, sample.rng);
  EXPECT_NO_THROW(file.expect("layer0.weight", "F32", {2, 3}));
  EXPECT_DPAR_ERROR(file.expect("layer0.weight", "F32", {3, 2}), Status::kMismatch, path("ckpt.safetensors"),
                    "'layer0.weight' is F32 [2, 3], expected F32 [3, 2]");
  EXPECT_DPAR_ERROR(file.expect("step", "U64", {}), Status::kMismatch, "is I64 [], expected U64 []");
  EXPECT_DPAR_ERROR(file.copy_to("rng", rng.data(), 24), Status::kMismatch, "'rng' holds 32 bytes");
  EXPECT_FALSE(file.has("layer1.weight"));
  EXPECT_DPAR_ERROR(file.entry("layer1.weight"), Status::kMismatch, path("ckpt.safetensors"),
                    "no tensor named 'layer1.weight'");
  EXPECT_DPAR_ERROR(file.data("layer1.weight"), Status::kMismatch, "layer1.weight");

  // Writing again replaces the file, still leaving nothing else behind.
  const std::vector<float> other = {9.0f};
  write_safetensors(path("ckpt.safetensors"), {{"only", "F32", {1}, other.data(), 4}}, {});
  const SafetensorsFile again = SafetensorsFile::read(path("ckpt.safetensors"));
  EXPECT_EQ(again.names(), (std::vector<std::string>{"only"}));
  EXPECT_EQ(list_dir(dir_), (std::set<std::string>{"ckpt.safetensors"}));
}

TEST_F(IoTest, SafetensorsWritesNoTensors) {
  write_safetensors(path("empty.safetensors"), {}, {});
  const SafetensorsFile file = SafetensorsFile::read(path("empty.safetensors"));
  EXPECT_EQ(file.size(), 0u);
  EXPECT_TRUE(file.buffer().empty());
  EXPECT_EQ(file.metadata().at("dpar.crc32"), "0");
}

// The exact bytes, worked out by hand: the data is 1.0f = 00 00 80 3f and -2.0f = 00 00 00 c0; zlib's CRC-32 of
// those 8 bytes is 3280414294. The header checksum is the CRC-32 of the canonical header without it,
//   {"__metadata__":{"dpar.crc32":"3280414294"},"x":{"data_offsets":[0,8],"dtype":"F32","shape":[2]}}
// which is 851831600 (both computed independently with Python's zlib). The header text is then 129 bytes,
// padded with 7 spaces to 136 = 0x88, so that the data starts at byte 144, a multiple of 8.
TEST_F(IoTest, SafetensorsHeaderLayoutIsByteExact) {
  const std::vector<float> x = {1.0f, -2.0f};
  write_safetensors(path("x.safetensors"), {{"x", "F32", {2}, x.data(), 8}}, {});
  const std::string json =
      "{\"__metadata__\":{\"dpar.crc32\":\"3280414294\",\"dpar.header_crc32\":\"851831600\"},"
      "\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";
  ASSERT_EQ(json.size(), 129u);
  Bytes expected = {0x88, 0, 0, 0, 0, 0, 0, 0};
  expected.insert(expected.end(), json.begin(), json.end());
  expected.insert(expected.end(), 7, ' ');
  expected.insert(expected.end(), {0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0xc0});
  ASSERT_EQ(expected.size(), 152u);
  EXPECT_EQ(read_file(path("x.safetensors")), expected);
  EXPECT_EQ(crc_of({0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0xc0}), 3280414294u);
}

// Files as Python's safetensors writes them (no checksums; tensors sorted by alignment, then name) are read;
// so are files whose header is not padded, and files without metadata, tensors or data.
TEST_F(IoTest, SafetensorsReadsFilesFromOtherWriters) {
  const std::vector<float> a = {1, 2, 3, 4};
  Bytes buffer = to_bytes(a);
  buffer.insert(buffer.end(), {'x', 'y', 'z'});
  // Byte for byte what safetensors.numpy.save({"b": uint8[3], "a": float32[2,2]}, metadata={"k": "v"}) returns.
  write_file(path("python.safetensors"),
             st_bytes("{\"__metadata__\":{\"k\":\"v\"},\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]},"
                      "\"b\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[16,19]}}",
                      buffer));
  ASSERT_EQ(read_file(path("python.safetensors"))[0], 0x88) << "the header is 136 bytes, as Python writes it";
  const SafetensorsFile python = SafetensorsFile::read(path("python.safetensors"));
  EXPECT_EQ(python.metadata(), (std::map<std::string, std::string>{{"k", "v"}}));
  EXPECT_EQ(python.names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(python.entry("a").shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(python.data("b")), 3), "xyz");

  // Unpadded, no metadata, keys in another order and extra keys in an entry (ignored, as Python ignores them).
  write_file(path("unpadded.safetensors"),
             st_bytes("{\"b\":{\"data_offsets\":[16,19],\"shape\":[3],\"dtype\":\"U8\",\"extra\":[1]},"
                      "\"a\":{\"shape\":[2,2],\"dtype\":\"F32\",\"data_offsets\":[0,16]}}",
                      buffer, false));
  const SafetensorsFile unpadded = SafetensorsFile::read(path("unpadded.safetensors"));
  EXPECT_TRUE(unpadded.metadata().empty());
  EXPECT_EQ(unpadded.names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(unpadded.buffer(), buffer);

  write_file(path("nothing.safetensors"), st_bytes("{}", {}, false));
  EXPECT_EQ(SafetensorsFile::read(path("nothing.safetensors")).size(), 0u);

  // Scalars, empty tensors and sub-byte dtypes whose sizes come out in whole bytes.
  write_file(path("odd.safetensors"),
             st_bytes("{\"e\":{\"dtype\":\"F64\",\"shape\":[3,0],\"data_offsets\":[0,0]},"
                      "\"s\":{\"dtype\":\"I32\",\"shape\":[],\"data_offsets\":[0,4]},"
                      "\"f4\":{\"dtype\":\"F4\",\"shape\":[2,3],\"data_offsets\":[4,7]},"
                      "\"f6\":{\"dtype\":\"F6_E2M3\",\"shape\":[4],\"data_offsets\":[7,10]},"
                      "\"z\":{\"dtype\":\"BOOL\",\"shape\":[0],\"data_offsets\":[10,10]}}",
                      Bytes(10, 0x11)));
  const SafetensorsFile odd = SafetensorsFile::read(path("odd.safetensors"));
  EXPECT_EQ(odd.names(), (std::vector<std::string>{"e", "s", "f4", "f6", "z"}));
  EXPECT_EQ(odd.entry("s").shape, std::vector<int64_t>{});
  EXPECT_EQ(odd.entry("f4").bytes, 3u);
}

TEST_F(IoTest, SafetensorsRefusesCorruptFiles) {
  const Bytes buf8(8, 0x5a);
  const std::string ok_entry = "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}";
  auto with_length = [](uint64_t length, const Bytes& rest) {
    Bytes out(8);
    for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(length >> (8 * i));
    out.insert(out.end(), rest.begin(), rest.end());
    return out;
  };
  auto entry = [](const std::string& body) { return "{\"a\":{" + body + "}}"; };
  struct Case {
    const char* name;
    Bytes bytes;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {"empty", {}, "the file is 0 bytes, shorter than the 8-byte header length"},
      {"seven_bytes", {8, 0, 0, 0, 0, 0, 0}, "the file is 7 bytes"},
      {"length_beyond_file", with_length(100, Bytes(50, ' ')), "the header length is 100 bytes but only 50 follow"},
      {"length_absurd", with_length(uint64_t{1} << 40, Bytes(16, ' ')), "exceeds the limit of 100000000 bytes"},
      {"length_max", with_length(~uint64_t{0}, Bytes(16, ' ')), "exceeds the limit"},
      {"empty_header", st_bytes("", {}), "does not start with '{'"},
      {"leading_space", st_bytes(" {}", {}), "does not start with '{'"},
      {"not_json", st_bytes("{abc}", {}), "not valid JSON"},
      {"unterminated", st_bytes("{\"a\":{", {}), "not valid JSON"},
      {"trailing_junk", st_bytes("{}x", {}), "not valid JSON"},
      {"nul_padding", st_bytes(std::string("{}\0\0\0\0\0\0", 8), {}, false), "a NUL byte at offset 2"},
      {"nul_inside", st_bytes(std::string("{\"a\0\":{}}", 9), {}), "a NUL byte at offset 3"},
      {"bad_utf8", st_bytes("{\"a\xff\":{}}", {}), "not valid JSON"},
      {"duplicate_tensor", st_bytes("{" + ok_entry + "," + ok_entry + "}", buf8), "the key 'a' twice"},
      {"duplicate_field",
       st_bytes(entry("\"dtype\":\"F32\",\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,8]"), buf8),
       "the key 'dtype' twice"},
      {"entry_not_object", st_bytes("{\"a\":[1,2]}", {}), "tensor 'a': its entry is not a JSON object"},
      {"no_dtype", st_bytes(entry("\"shape\":[2],\"data_offsets\":[0,8]"), buf8), "tensor 'a': no \"dtype\""},
      {"no_shape", st_bytes(entry("\"dtype\":\"F32\",\"data_offsets\":[0,8]"), buf8), "no \"shape\""},
      {"no_offsets", st_bytes(entry("\"dtype\":\"F32\",\"shape\":[2]"), buf8), "no \"data_offsets\""},
      {"dtype_number", st_bytes(entry("\"dtype\":5,\"shape\":[2],\"data_offsets\":[0,8]"), buf8),
       "\"dtype\" is not a string"},
      {"unknown_dtype", st_bytes(entry("\"dtype\":\"F33\",\"shape\":[2],\"data_offsets\":[0,8]"), buf8),
       "unknown dtype \"F33\""},
      {"lowercase_dtype", st_bytes(entry("\"dtype\":\"f32\",\"shape\":[2],\"data_offsets\":[0,8]"), buf8),
       "unknown dtype"},
      {"shape_string", st_bytes(entry("\"dtype\":\"F32\",\"shape\":\"2\",\"data_offsets\":[0,8]"), buf8),
       "\"shape\" is not an array"},
      {"shape_fraction", st_bytes(entry("\"dtype\":\"F32\",\"shape\":[2.0],\"data_offsets\":[0,8]"), buf8),
       "extent 2.0 in \"shape\" is not a non-negative 64-bit integer"},
      {"shape_negative", st_bytes(entry("\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]"), buf8),
       "negative extent -2"},
      {"shape_nested", st_bytes(entry("\"dtype\":\"F32\",\"shape\":[[2]],\"data_offsets\":[0,8]"), buf8),
       "is not a non-negative 64-bit integer"},
      {"shape_huge_literal",
       st_bytes(entry("\"dtype\":\"F32\",\"shape\":[18446744073709551616],\"data_offsets\":[0,8]"), buf8),
       "is not a non-negative 64-bit integer"},
      {"shape_over_int64",
       st_bytes(entry("\"dtype\":\"U8\",\"shape\":[9223372036854775808],\"data_offsets\":[0,8]"), buf8),
       "overflows int64"},
      {"shape_product_overflow",
       st_bytes(entry("\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,2],\"data_offsets\":[0,8]"), buf8),
       "overflows or does not fill whole bytes"},
      {"shape_partial_byte", st_bytes(entry("\"dtype\":\"F4\",\"shape\":[3],\"data_offsets\":[0,8]"), buf8),
       "does not fill whole bytes"},
      {"size_mismatch", st_bytes(entry("\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]"), buf8),
       "shape [3] of F32 needs 12 bytes but \"data_offsets\" [0, 8] span 8"},
      {"offsets_short", st_bytes(entry("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8]"), buf8),
       "\"data_offsets\" is not an array of two non-negative integers"},
      {"offsets_strings", st_bytes(entry("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[\"0\",\"8\"]"), buf8),
       "not an array of two non-negative integers"},
      {"offsets_negative", st_bytes(entry("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[-8,0]"), buf8),
       "not an array of two non-negative integers"},
      {"offsets_reversed", st_bytes(entry("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]"), buf8),
       "end before they begin"},
      {"not_from_zero", st_bytes(entry("\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]"), Bytes(16, 0)),
       "a gap of 8 bytes before tensor 'a'"},
      {"gap",
       st_bytes("{" + ok_entry + ",\"b\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[10,12]}}", Bytes(12, 0)),
       "a gap of 2 bytes before tensor 'b'"},
      {"overlap",
       st_bytes("{" + ok_entry + ",\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[6,10]}}", Bytes(10, 0)),
       "tensor 'b' (bytes 6 to 10) overlaps tensor 'a' (bytes 0 to 8)"},
      {"same_range",
       st_bytes("{" + ok_entry + ",\"b\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[0,8]}}", buf8),
       "overlaps"},
      {"data_truncated", st_bytes("{" + ok_entry + "}", Bytes(5, 0)),
       "truncated: the header describes 8 bytes of tensor data but the file holds 5"},
      {"data_trailing", st_bytes("{" + ok_entry + "}", Bytes(9, 0)), "1 bytes follow the last tensor's data"},
      {"data_without_tensors", st_bytes("{}", Bytes(3, 0)), "3 bytes follow"},
      {"metadata_number", st_bytes("{\"__metadata__\":{\"k\":1}}", {}), "the metadata value of 'k' is not a string"},
      {"metadata_array", st_bytes("{\"__metadata__\":[]}", {}), "\"__metadata__\" is not a JSON object"},
      {"metadata_nested", st_bytes("{\"__metadata__\":{\"k\":{\"x\":\"y\"}}}", {}), "is not a string"},
      {"crc_without_header_crc", st_bytes("{\"__metadata__\":{\"dpar.crc32\":\"0\"}}", {}),
       "has 'dpar.crc32' without 'dpar.header_crc32'"},
      {"header_crc_without_crc", st_bytes("{\"__metadata__\":{\"dpar.header_crc32\":\"0\"}}", {}),
       "has 'dpar.header_crc32' without 'dpar.crc32'"},
      {"crc_malformed",
       st_bytes("{\"__metadata__\":{\"dpar.crc32\":\"0\",\"dpar.header_crc32\":\"0x1f\"}}", {}),
       "the checksum '0x1f' under dpar.header_crc32 is not a 32-bit decimal number"},
      {"crc_too_big",
       st_bytes("{\"__metadata__\":{\"dpar.crc32\":\"0\",\"dpar.header_crc32\":\"4294967296\"}}", {}),
       "is not a 32-bit decimal number"},
      {"header_crc_wrong",
       st_bytes("{\"__metadata__\":{\"dpar.crc32\":\"0\",\"dpar.header_crc32\":\"12345\"}}", {}),
       "header checksum mismatch"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string file = path(std::string(c.name) + ".safetensors");
    write_file(file, c.bytes);
    EXPECT_DPAR_ERROR(SafetensorsFile::read(file), Status::kCorrupt, file, c.needle);
  }
}

TEST_F(IoTest, SafetensorsRefusesMissingFilesWithIo) {
  EXPECT_DPAR_ERROR(SafetensorsFile::read(path("missing.safetensors")), Status::kIo, path("missing.safetensors"),
                    std::strerror(ENOENT));
  fs::create_directory(path("dir.safetensors"));
  EXPECT_DPAR_ERROR(SafetensorsFile::read(path("dir.safetensors")), Status::kIo, path("dir.safetensors"),
                    "is a directory");
}

// Every prefix of a file is refused, from ours (with checksums) and from other writers (without).
TEST_F(IoTest, SafetensorsRefusesEveryTruncation) {
  const Sample sample;
  write_safetensors(path("ours.safetensors"), sample.views(), kSampleMetadata);
  const std::vector<float> a = {1, 2, 3, 4};
  write_file(path("python.safetensors"),
             st_bytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]},"
                      "\"e\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[16,16]}}",
                      to_bytes(a)));
  for (const char* name : {"ours.safetensors", "python.safetensors"}) {
    const Bytes whole = read_file(path(name));
    ASSERT_NO_THROW(SafetensorsFile::read(path(name)));
    for (size_t n = 0; n < whole.size(); ++n) {
      SCOPED_TRACE(std::string(name) + " cut to " + std::to_string(n) + " of " + std::to_string(whole.size()));
      write_file(path("cut"), Bytes(whole.begin(), whole.begin() + static_cast<std::ptrdiff_t>(n)));
      EXPECT_DPAR_ERROR(SafetensorsFile::read(path("cut")), Status::kCorrupt, path("cut"));
    }
  }
}

TEST_F(IoTest, SafetensorsRefusesFlippedDataBytes) {
  const Sample sample;
  write_safetensors(path("good.safetensors"), sample.views(), kSampleMetadata);
  const Bytes whole = read_file(path("good.safetensors"));
  const size_t data_start = whole.size() - sample.buffer().size();
  for (size_t i = data_start; i < whole.size(); ++i) {
    for (uint8_t mask : {0x01, 0x80, 0xff}) {
      SCOPED_TRACE("byte " + std::to_string(i) + " ^ " + std::to_string(mask));
      Bytes bad = whole;
      bad[i] ^= mask;
      write_file(path("bad.safetensors"), bad);
      EXPECT_DPAR_ERROR(SafetensorsFile::read(path("bad.safetensors")), Status::kCorrupt, path("bad.safetensors"),
                        "data checksum mismatch");
    }
  }
}

// Every single-bit flip (and every byte inversion) in the length and the header is refused. Some leave a valid
// JSON header describing a valid layout (a changed letter in a name or a metadata value, a changed extent of an
// empty tensor); the header checksum catches those. A flip that left a semantically identical header (only
// whitespace changed) could be accepted, and then must read exactly as the original.
TEST_F(IoTest, SafetensorsRefusesFlippedHeaderBytes) {
  const Sample sample;
  write_safetensors(path("good.safetensors"), sample.views(), kSampleMetadata);
  const SafetensorsFile good = SafetensorsFile::read(path("good.safetensors"));
  const Bytes whole = read_file(path("good.safetensors"));
  const size_t header_end = whole.size() - sample.buffer().size();
  int checksum_refusals = 0;
  for (size_t i = 0; i < header_end; ++i) {
    for (uint8_t mask : {0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0xff}) {
      SCOPED_TRACE("byte " + std::to_string(i) + " ^ " + std::to_string(mask));
      Bytes bad = whole;
      bad[i] ^= mask;
      write_file(path("bad.safetensors"), bad);
      try {
        const SafetensorsFile read = SafetensorsFile::read(path("bad.safetensors"));
        EXPECT_EQ(read.names(), good.names());
        EXPECT_EQ(read.metadata(), good.metadata());
        EXPECT_EQ(read.buffer(), good.buffer());
        for (const std::string& name : good.names()) {
          EXPECT_EQ(read.entry(name).dtype, good.entry(name).dtype);
          EXPECT_EQ(read.entry(name).shape, good.entry(name).shape);
        }
      } catch (const dpar::Error& e) {
        EXPECT_EQ(e.status(), Status::kCorrupt) << e.what();
        if (std::strstr(e.what(), "header checksum mismatch")) ++checksum_refusals;
      }
    }
  }
  // Plenty of the flips land inside strings and are caught only by the checksum.
  EXPECT_GT(checksum_refusals, 100);
}

// Edits that keep the header valid and consistent (as a careless tool or a bit of damage could make) are
// refused by the header checksum.
TEST_F(IoTest, SafetensorsHeaderChecksumCatchesConsistentEdits) {
  const Sample sample;
  write_safetensors(path("good.safetensors"), sample.views(), kSampleMetadata);
  const Bytes whole = read_file(path("good.safetensors"));
  const std::string text(whole.begin(), whole.end());
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"\"step\":\"42\"", "\"step\":\"43\""},
           {"\"layer0.weight\"", "\"layer1.weight\""},
           {"[0,7]", "[0,8]"},
           {"\"dtype\":\"U64\"", "\"dtype\":\"I64\""}}) {
    SCOPED_TRACE(from + " -> " + to);
    std::string edited = text;
    const size_t at = edited.find(from);
    ASSERT_NE(at, std::string::npos);
    edited.replace(at, from.size(), to);
    write_file(path("edited.safetensors"), Bytes(edited.begin(), edited.end()));
    EXPECT_DPAR_ERROR(SafetensorsFile::read(path("edited.safetensors")), Status::kCorrupt, "header checksum mismatch");
  }
}

TEST_F(IoTest, SafetensorsWriteRefusesBadArguments) {
  const std::vector<float> v = {1, 2};
  const std::string file = path("never.safetensors");
  struct Case {
    const char* name;
    std::vector<TensorView> tensors;
    std::map<std::string, std::string> metadata;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {"duplicate", {{"a", "F32", {2}, v.data(), 8}, {"a", "F32", {2}, v.data(), 8}}, {}, "used twice"},
      {"reserved_name", {{"__metadata__", "F32", {2}, v.data(), 8}}, {}, "reserved"},
      {"unknown_dtype", {{"a", "F31", {2}, v.data(), 8}}, {}, "unknown dtype \"F31\""},
      {"negative", {{"a", "F32", {-2}, v.data(), 8}}, {}, "negative extent"},
      {"size", {{"a", "F32", {3}, v.data(), 8}}, {}, "needs 12 bytes, got 8"},
      {"overflow", {{"a", "F32", {int64_t{1} << 62, 16}, v.data(), 8}}, {}, "overflows"},
      {"null", {{"a", "F32", {2}, nullptr, 8}}, {}, "null data"},
      {"crc_key", {}, {{"dpar.crc32", "1"}}, "reserved for a checksum"},
      {"header_crc_key", {}, {{"dpar.header_crc32", "1"}}, "reserved for a checksum"},
      {"utf8_name", {{"a\xff", "F32", {2}, v.data(), 8}}, {}, "not valid UTF-8"},
      {"utf8_metadata", {}, {{"k", "\xc3"}}, "not valid UTF-8"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    EXPECT_DPAR_ERROR(write_safetensors(file, c.tensors, c.metadata), Status::kInvalidArgument, c.needle);
    EXPECT_TRUE(list_dir(dir_).empty()) << "nothing may be created";
  }
  EXPECT_DPAR_ERROR(write_safetensors("", {}, {}), Status::kInvalidArgument, "empty");
}

// Failures at each step of the atomic write leave the old file as it was and no temporary file behind.
TEST_F(IoTest, SafetensorsAtomicWriteFailuresLeaveOldFile) {
  const std::string target = path("ckpt.safetensors");
  const Sample sample;
  write_safetensors(target, sample.views(), kSampleMetadata);
  const Bytes old_bytes = read_file(target);
  const std::vector<float> big(1 << 16, 1.0f);
  const std::vector<TensorView> new_tensors = {{"big", "F32", {1 << 16}, big.data(), big.size() * 4}};

  // The directory does not exist: nothing is created, not even the directory.
  const std::string nowhere = path("no_such_dir/ckpt.safetensors");
  EXPECT_DPAR_ERROR(write_safetensors(nowhere, new_tensors, {}), Status::kIo, nowhere, std::strerror(ENOENT));
  EXPECT_FALSE(fs::exists(path("no_such_dir")));
  EXPECT_EQ(list_dir(dir_), (std::set<std::string>{"ckpt.safetensors"}));

  // Writing fails midway (the file size limit, as a full disk would): the partial temporary file is removed.
  {
    struct rlimit saved {};
    ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &saved), 0);
    struct rlimit small = saved;
    small.rlim_cur = 4096;
    const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);  // Otherwise the kernel kills the process.
    ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
    EXPECT_DPAR_ERROR(write_safetensors(target, new_tensors, {}), Status::kIo, target, "cannot write",
                      std::strerror(EFBIG));
    ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &saved), 0);
    std::signal(SIGXFSZ, old_handler);
  }
  EXPECT_EQ(read_file(target), old_bytes);
  EXPECT_EQ(list_dir(dir_), (std::set<std::string>{"ckpt.safetensors"}));

  // The target is a directory: refused before anything is written.
  const std::string dir_target = path("taken");
  ASSERT_TRUE(fs::create_directory(dir_target));
  write_file(dir_target + "/inside", {1});
  EXPECT_DPAR_ERROR(write_safetensors(dir_target, new_tensors, {}), Status::kIo, dir_target, "is a directory");
  EXPECT_TRUE(fs::exists(dir_target + "/inside"));
  EXPECT_EQ(list_dir(dir_), (std::set<std::string>{"ckpt.safetensors", "taken"}));

  // After all that, the old file is still whole and valid.
  EXPECT_NO_THROW(SafetensorsFile::read(target));
}

// The sanitizers' runtimes need descriptors of their own to report anything (UBSan's type check opens a pipe), so
// a process with none left cannot be tested under them.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

// The temporary file cannot be created, in ways that fail as root too (CI runs as root, where a read-only
// directory is writable): a path under a regular file; no descriptor left (RLIMIT_NOFILE, as a process at its
// limit would be; not under the sanitizers, see above); and, for a user that is not root, a read-only directory.
// Each leaves the old file (or what is in the way) as it was and nothing beside it.
TEST_F(IoTest, SafetensorsWriteThatCannotCreateItsTemporaryFileLeavesOldFile) {
  const std::vector<float> w = {3, 4};
  {
    const std::string file = path("a_file");
    write_file(file, {1, 2, 3});
    const std::string under = file + "/ckpt.safetensors";
    EXPECT_DPAR_ERROR(write_safetensors(under, {{"v", "F32", {2}, w.data(), 8}}, {}), Status::kIo, under,
                      std::strerror(ENOTDIR));
    EXPECT_EQ(read_file(file), (Bytes{1, 2, 3}));
    EXPECT_EQ(list_dir(dir_), (std::set<std::string>{"a_file"}));
    fs::remove(file);
  }
  const std::string sub = path("ro");
  ASSERT_TRUE(fs::create_directory(sub));
  const std::string target = sub + "/ckpt.safetensors";
  const std::vector<float> v = {1, 2};
  write_safetensors(target, {{"v", "F32", {2}, v.data(), 8}}, {});
  const Bytes old_bytes = read_file(target);
  if (!kSanitized) {
    struct rlimit saved {};
    ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
    const int lowest_free = ::dup(0);  // the descriptor open(2) would return next
    ASSERT_GE(lowest_free, 0);
    ::close(lowest_free);
    struct rlimit none = saved;
    none.rlim_cur = static_cast<rlim_t>(lowest_free);
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &none), 0);
    bool threw = false;
    Status status = Status::kOk;
    std::string what;
    try {
      write_safetensors(target, {{"v", "F32", {2}, w.data(), 8}}, {});
    } catch (const dpar::Error& e) {
      threw = true;
      status = e.status();
      what = e.what();
    }
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);  // before any check can return early
    EXPECT_TRUE(threw);
    EXPECT_EQ(status, Status::kIo) << what;
    EXPECT_NE(what.find("cannot create temporary file"), std::string::npos) << what;
    EXPECT_NE(what.find(std::strerror(EMFILE)), std::string::npos) << what;
    EXPECT_EQ(read_file(target), old_bytes);
    EXPECT_EQ(list_dir(sub), (std::set<std::string>{"ckpt.safetensors"}));
  }
  if (::geteuid() != 0) {
    ASSERT_EQ(::chmod(sub.c_str(), 0555), 0);
    EXPECT_DPAR_ERROR(write_safetensors(target, {{"v", "F32", {2}, w.data(), 8}}, {}), Status::kIo, target,
                      std::strerror(EACCES));
    ASSERT_EQ(::chmod(sub.c_str(), 0755), 0);
    EXPECT_EQ(read_file(target), old_bytes);
    EXPECT_EQ(list_dir(sub), (std::set<std::string>{"ckpt.safetensors"}));
  }
}

// Two writers of one path in one process (two engines saving to one checkpoint path, say) each write a temporary
// file of their own: every write succeeds, the file left is one complete write, and no temporary file remains.
TEST_F(IoTest, ConcurrentWritesToOnePathEachLeaveACompleteFile) {
  const std::string target = path("shared.safetensors");
  constexpr int kThreads = 4, kRounds = 50;
  std::vector<std::vector<float>> contents(kThreads);
  for (int t = 0; t < kThreads; ++t) contents[t].assign(4096, float(t + 1));
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int r = 0; r < kRounds; ++r) {
        try {
          write_safetensors(target, {{"v", "F32", {4096}, contents[t].data(), 4096 * 4}}, {});
        } catch (const dpar::Error&) {
          failures++;
        }
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  const SafetensorsFile file = SafetensorsFile::read(target);  // complete: its own checks pass
  const Bytes bytes = read_file(target);
  bool matches_one = false;
  for (int t = 0; t < kThreads; ++t) {
    write_safetensors(path("ref"), {{"v", "F32", {4096}, contents[t].data(), 4096 * 4}}, {});
    matches_one = matches_one || read_file(path("ref")) == bytes;
  }
  EXPECT_TRUE(matches_one) << "the file is none of the writes";
  fs::remove(path("ref"));
  EXPECT_EQ(list_dir(dir_), (std::set<std::string>{"shared.safetensors"}));
}

// A name of up to NAME_MAX (255) bytes can be written: the temporary name does not grow with it.
TEST_F(IoTest, LongestFileNamesCanBeWritten) {
  const std::vector<float> v = {1, 2, 3};
  for (size_t length : {200, 246, 250, 255}) {
    const std::string target = path(std::string(length - 12, 'n') + ".safetensors");
    ASSERT_EQ(fs::path(target).filename().string().size(), length);
    EXPECT_NO_THROW(write_safetensors(target, {{"v", "F32", {3}, v.data(), 12}}, {})) << length << " bytes";
    EXPECT_NO_THROW(write_safetensors(target, {{"v", "F32", {3}, v.data(), 12}}, {})) << length << " bytes, again";
    EXPECT_NO_THROW(SafetensorsFile::read(target)) << length;
    fs::remove(target);
  }
  EXPECT_TRUE(list_dir(dir_).empty());
}

// A path that holds something other than a regular file is refused, not replaced: renaming over a FIFO, a socket
// or a device (/dev/null, as root) would replace the node itself. A link to one is refused too.
TEST_F(IoTest, WriterRefusesTargetsThatAreNotRegularFiles) {
  const std::vector<float> v = {1, 2};
  const std::string fifo = path("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  EXPECT_DPAR_ERROR(write_safetensors(fifo, {{"v", "F32", {2}, v.data(), 8}}, {}), Status::kIo, fifo,
                    "not a regular file");
  EXPECT_TRUE(fs::is_fifo(fifo));

  const std::string sock = path("sock");
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  ASSERT_LT(sock.size(), sizeof addr.sun_path);
  std::memcpy(addr.sun_path, sock.c_str(), sock.size() + 1);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0) << std::strerror(errno);
  EXPECT_DPAR_ERROR(write_safetensors(sock, {{"v", "F32", {2}, v.data(), 8}}, {}), Status::kIo, sock,
                    "not a regular file");
  EXPECT_TRUE(fs::is_socket(sock));
  ::close(fd);

  const std::string link = path("link");
  fs::create_symlink(fifo, link);
  EXPECT_DPAR_ERROR(write_safetensors(link, {{"v", "F32", {2}, v.data(), 8}}, {}), Status::kIo, link,
                    "not a regular file");
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_TRUE(fs::is_fifo(fifo));
  EXPECT_EQ(list_dir(dir_), (std::set<std::string>{"fifo", "sock", "link"}));
}

// Python's safetensors (the reference implementation) reads our files and writes files we read. The Python is
// $DPAR_TEST_PYTHON, else the one the build chose for every Python-based check (the top-level CMakeLists.txt:
// scripts/install-deps.sh's build-pyenv where it exists, else python3). Skipped without one that has safetensors
// and numpy; in CI, which installs them, a missing one fails (DPAR_TEST_REQUIRE_DEPS).
TEST_F(IoTest, SafetensorsInteroperatesWithPython) {
  const char* env = std::getenv("DPAR_TEST_PYTHON");
  const std::string python = env && *env ? env : DPAR_TEST_PYTHON_DEFAULT;
  if (python.find('/') != std::string::npos && ::access(python.c_str(), X_OK) != 0)
    SKIP_MISSING_DEPENDENCY(python << " not found (set DPAR_TEST_PYTHON)");
  if (std::system(("'" + python + "' -c 'import numpy, safetensors.numpy' >/dev/null 2>&1").c_str()) != 0) {
    SKIP_MISSING_DEPENDENCY(python << " lacks numpy or safetensors");
  }

  // BF16 is left out: numpy has no such type to load it into.
  const std::vector<float> f32 = {1.5f, -2.0f, 3.25f, 0.0f, -0.5f, 1e-3f};
  const std::vector<int64_t> i64 = {-1, 2, -3, int64_t{1} << 40};
  const std::vector<uint64_t> u64 = {0xfedcba9876543210ULL};
  const Bytes u8 = {1, 2, 3, 250, 255};
  const std::vector<uint16_t> f16 = {0x3c00, 0xc000, 0x7bff};
  const std::vector<int32_t> i32 = {7, -8, 9, -10};
  const std::vector<double> f64 = {3.141592653589793};
  const std::vector<TensorView> views = {
      {"w", "F32", {2, 3}, f32.data(), 24}, {"i", "I64", {4}, i64.data(), 32}, {"u", "U64", {}, u64.data(), 8},
      {"b", "U8", {5}, u8.data(), 5},       {"h", "F16", {3}, f16.data(), 6},  {"j", "I32", {2, 2}, i32.data(), 16},
      {"d", "F64", {1}, f64.data(), 8}};
  write_safetensors(path("ours.safetensors"), views, {{"origin", "dpar"}});

  std::ofstream(path("check.py")) << R"PY(
import sys, zlib
import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
src, out, dst = sys.argv[1:4]
tensors = load_file(src)
with safe_open(src, framework="np") as f:
    meta = f.metadata()
lines = []
for name in sorted(tensors):
    a = tensors[name]  # tobytes() is row-major whatever the layout (ascontiguousarray would make a scalar 1-d).
    lines.append("%s %s %s %d" % (name, a.dtype.str, list(a.shape), zlib.crc32(a.tobytes())))
for key in sorted(meta):
    lines.append("meta %s=%s" % (key, meta[key]))
with open(out, "w") as f:
    f.write("\n".join(lines) + "\n")
save_file({"w": np.arange(12, dtype=np.float32).reshape(3, 4), "idx": np.array([5, -6, 7], dtype=np.int64),
           "flag": np.array([1, 0, 1], dtype=np.uint8)}, dst, metadata={"origin": "python"})
)PY";
  const std::string command = "'" + python + "' '" + path("check.py") + "' '" + path("ours.safetensors") + "' '" +
                              path("out.txt") + "' '" + path("python.safetensors") + "'";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;

  const SafetensorsFile ours = SafetensorsFile::read(path("ours.safetensors"));
  const std::map<std::string, std::string> numpy_type = {{"w", "<f4"}, {"i", "<i8"}, {"u", "<u8"}, {"b", "|u1"},
                                                         {"h", "<f2"}, {"j", "<i4"}, {"d", "<f8"}};
  std::ostringstream expected;
  for (const auto& [name, type] : numpy_type) {  // Sorted by name, as the script prints them.
    const auto& e = ours.entry(name);
    std::string shape = "[";
    for (size_t k = 0; k < e.shape.size(); ++k) shape += (k ? ", " : "") + std::to_string(e.shape[k]);
    expected << name << " " << type << " " << shape << "] "
             << crc_of(Bytes(ours.data(name), ours.data(name) + e.bytes)) << "\n";
  }
  for (const auto& [key, value] : ours.metadata()) expected << "meta " << key << "=" << value << "\n";
  const Bytes out = read_file(path("out.txt"));
  EXPECT_EQ(std::string(out.begin(), out.end()), expected.str());

  const SafetensorsFile theirs = SafetensorsFile::read(path("python.safetensors"));
  EXPECT_EQ(theirs.metadata(), (std::map<std::string, std::string>{{"origin", "python"}}));
  const std::vector<std::string> names = theirs.names();
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()),
            (std::set<std::string>{"w", "idx", "flag"}));
  std::vector<float> w(12);
  theirs.expect("w", "F32", {3, 4});
  theirs.copy_to("w", w.data(), 48);
  for (int k = 0; k < 12; ++k) EXPECT_EQ(w[k], static_cast<float>(k));
  std::vector<int64_t> idx(3);
  theirs.expect("idx", "I64", {3});
  theirs.copy_to("idx", idx.data(), 24);
  EXPECT_EQ(idx, (std::vector<int64_t>{5, -6, 7}));
  theirs.expect("flag", "U8", {3});
  EXPECT_EQ(Bytes(theirs.data("flag"), theirs.data("flag") + 3), (Bytes{1, 0, 1}));
}

}  // namespace
