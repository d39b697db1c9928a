// The order of write_file_atomically's system calls (io/file.h): write, fsync, close, rename, fsync of the
// directory. Only a crash between two of them would show a wrong order, so the writer's observer reports each step
// as it succeeds and the test checks the whole sequence, and what a reader of the target sees at each step.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "io/file.h"

namespace {

namespace fs = std::filesystem;
using dpar::io::AtomicWriteStep;

struct Seen {
  AtomicWriteStep step;
  std::string path;
  std::string target_content;  // what a reader of the target saw right after the step
};

std::string g_target;
std::vector<Seen> g_seen;

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void record(AtomicWriteStep step, const std::string& path) { g_seen.push_back({step, path, read_all(g_target)}); }

const char* step_name(AtomicWriteStep step) {
  switch (step) {
    case AtomicWriteStep::kWrite: return "write";
    case AtomicWriteStep::kSyncFile: return "fsync(file)";
    case AtomicWriteStep::kCloseFile: return "close(file)";
    case AtomicWriteStep::kRename: return "rename";
    case AtomicWriteStep::kSyncDirectory: return "fsync(directory)";
  }
  return "?";
}

class AtomicWriteTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/dpar_test_atomic_write.XXXXXX";
    ASSERT_NE(mkdtemp(templ.data()), nullptr) << std::strerror(errno);
    dir_ = templ;
    g_target = dir_ + "/model.safetensors";
    g_seen.clear();
    dpar::io::set_atomic_write_observer(record);
  }
  void TearDown() override {
    dpar::io::set_atomic_write_observer(nullptr);
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string dir_;
};

TEST_F(AtomicWriteTest, SyncsTheContentBeforeTheRenameAndTheDirectoryAfter) {
  std::ofstream(g_target, std::ios::binary) << "old";
  const std::string head = "new content, ", tail = "in two pieces";
  dpar::io::write_file_atomically(g_target, {{head.data(), head.size()}, {nullptr, 0}, {tail.data(), tail.size()}});

  std::string order;
  for (const Seen& s : g_seen) order += std::string(order.empty() ? "" : ", ") + step_name(s.step);
  ASSERT_EQ(order, "write, write, fsync(file), close(file), rename, fsync(directory)")
      << "the content must be durable (fsync) and closed before the rename publishes it, and the directory synced "
         "after the rename (an empty piece is not written)";

  // Every step before the rename acts on one temporary file beside the target, and leaves the old content.
  const std::string temp = g_seen[0].path;
  EXPECT_NE(temp, g_target);
  EXPECT_EQ(fs::path(temp).parent_path(), fs::path(g_target).parent_path());
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(g_seen[i].path, temp) << step_name(g_seen[i].step);
    EXPECT_EQ(g_seen[i].target_content, "old") << step_name(g_seen[i].step) << " published the content";
  }
  EXPECT_EQ(g_seen[4].path, g_target);
  EXPECT_EQ(g_seen[4].target_content, head + tail);
  EXPECT_EQ(g_seen[5].path, dir_);
  EXPECT_FALSE(fs::exists(temp));
}

// No target there yet: the same order; a target in the working directory syncs ".".
TEST_F(AtomicWriteTest, ANewFileInTheWorkingDirectorySyncsIt) {
  const fs::path before = fs::current_path();
  fs::current_path(dir_);
  g_target = "fresh.bin";
  const std::string bytes = "abc";
  dpar::io::write_file_atomically(g_target, {{bytes.data(), bytes.size()}});
  fs::current_path(before);

  ASSERT_EQ(g_seen.size(), 5u);
  const AtomicWriteStep want[] = {AtomicWriteStep::kWrite, AtomicWriteStep::kSyncFile, AtomicWriteStep::kCloseFile,
                                  AtomicWriteStep::kRename, AtomicWriteStep::kSyncDirectory};
  for (size_t i = 0; i < 5; ++i) EXPECT_STREQ(step_name(g_seen[i].step), step_name(want[i])) << "step " << i;
  EXPECT_EQ(g_seen[3].target_content, "abc");
  EXPECT_EQ(g_seen[4].path, ".");
}

}  // namespace
