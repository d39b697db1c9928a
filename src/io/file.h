// Files, for the readers and writers of src/io/ and the engine's outputs: descriptors closed on every path,
// regular files opened without blocking, and writes that replace a file atomically.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <string>
#include <vector>

namespace dpar::io {

// Closes a descriptor on every path out of a function.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

// Opens `path` for reading, refusing anything but a regular file without blocking on it (a FIFO with no writer,
// a device). Returns the descriptor, close-on-exec, in blocking mode; the caller closes it. Throws dpar::Error
// Status::kIo naming the path: it cannot be opened or examined, or is a directory, FIFO, socket or device.
int open_regular_file(const std::string& path);

// A piece of a file's content: `bytes` bytes at `data` (null only when bytes is 0).
struct FilePiece {
  const void* data;
  size_t bytes;
};

// Writes the pieces, in order, as the whole content of `path`, atomically: into a temporary file beside it (a
// name of its own, so concurrent writes to one path never share one, short enough for any target name), made
// durable (fsync), renamed over `path`, and the directory synced. A reader sees the old file or the new one,
// never a part; of concurrent writes, the last renamed wins, each complete. A failure (dpar::Error Status::kIo
// naming the path) leaves the old file and no temporary one. A `path` that exists and is not a regular file (a
// device, FIFO, socket or directory, or a link to one) is refused before anything is written.
void write_file_atomically(const std::string& path, const std::vector<FilePiece>& pieces);

// The system calls of write_file_atomically that make it crash-safe. Their order is the guarantee (content
// durable before it is published, the rename durable before the call returns), and a crash between two of them
// is the only thing that would tell a wrong order apart: a test observes the order instead.
enum class AtomicWriteStep { kWrite, kSyncFile, kCloseFile, kRename, kSyncDirectory };

// Called after each step has succeeded, on the writing thread, with the file or directory it acted on (the
// temporary file for kWrite, kSyncFile and kCloseFile; the target for kRename; the directory for kSyncDirectory).
using AtomicWriteObserver = void (*)(AtomicWriteStep step, const std::string& path);

// Installs the process's observer (nullptr: none, the default). For tests: production code never sets one.
void set_atomic_write_observer(AtomicWriteObserver observer);

}  // namespace dpar::io
