#include "io/file.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "common/error.h"

namespace dpar::io {
namespace {

std::atomic<AtomicWriteObserver> g_observer{nullptr};

void observe(AtomicWriteStep step, const std::string& path) {
  if (const AtomicWriteObserver observer = g_observer.load(std::memory_order_acquire)) observer(step, path);
}

void write_all(int fd, const void* data, size_t bytes, const std::string& path, const std::string& tmp) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t wrote = ::write(fd, p, std::min<size_t>(bytes, size_t{1} << 30));
    if (wrote < 0) {
      if (errno == EINTR) continue;
      fail(Status::kIo, path, ": cannot write ", tmp, ": ", std::strerror(errno));
    }
    // write(2) returns 0 for a non-empty request only on a device that refuses more; do not spin on it.
    DPAR_ENFORCE(wrote > 0, Status::kIo, path, ": cannot write ", tmp, ": no progress");
    p += wrote;
    bytes -= static_cast<size_t>(wrote);
  }
}

// A save replaces a regular file (or creates one), nothing else: renaming over a character device (/dev/null,
// as root), a FIFO, a socket or a directory would replace the node itself. The path is followed, so a symbolic
// link to a regular file is replaced by the new file, as before, and one to a device is refused.
void refuse_special_target(const std::string& target) {
  struct stat st {};
  if (::stat(target.c_str(), &st) != 0) {
    if (errno == ENOENT) return;  // nothing there yet (or a dangling link, which the rename replaces)
    fail(Status::kIo, target, ": cannot examine the target: ", std::strerror(errno));
  }
  DPAR_ENFORCE(!S_ISDIR(st.st_mode), Status::kIo, target, ": is a directory");
  DPAR_ENFORCE(S_ISREG(st.st_mode), Status::kIo, target,
               ": exists and is not a regular file (a device, FIFO or socket): dpar replaces only regular files");
}

// A temporary name beside `target`, unique to this write: "<dir>/.<up to 64 bytes of the name>.<pid>.<n>.tmp",
// n counting the writes of this process. Distinct concurrent saves to one path therefore never share a file
// (each renames its own, complete one), and the name fits in NAME_MAX (255 bytes) whatever the target's length.
std::string temporary_name(const std::string& target) {
  static std::atomic<uint64_t> counter{0};
  const size_t slash = target.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "" : target.substr(0, slash + 1);
  const std::string base = slash == std::string::npos ? target : target.substr(slash + 1);
  return dir + "." + base.substr(0, 64) + "." + std::to_string(::getpid()) + "." +
         std::to_string(counter.fetch_add(1)) + ".tmp";
}

// The temporary file of an atomic write: removed on every failure, kept once renamed into place.
class TempFile {
 public:
  // Creates a temporary file beside `target` under a name no other writer uses (see temporary_name).
  explicit TempFile(const std::string& target) : target_(target) {
    for (int attempt = 0;; ++attempt) {
      path_ = temporary_name(target_);
      // O_EXCL: the file is this writer's own, never one that another save (of this process or another) is
      // writing, nor a leftover; O_NOFOLLOW: a symbolic link planted at the name must not redirect the write.
      fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0666);
      if (fd_ >= 0) return;
      // Nothing was created, so the destructor (which will not run) has nothing to remove.
      if (errno != EEXIST || attempt == 99)
        fail(Status::kIo, target_, ": cannot create temporary file ", path_, ": ", std::strerror(errno));
    }
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!renamed_) ::unlink(path_.c_str());
  }

  void write(const void* data, size_t bytes) {
    write_all(fd_, data, bytes, target_, path_);
    observe(AtomicWriteStep::kWrite, path_);
  }

  // Makes the content durable before the rename publishes it: otherwise a crash could leave the new name
  // pointing at a file whose blocks never reached the disk.
  void sync_and_close() {
    if (::fsync(fd_) != 0) fail(Status::kIo, target_, ": cannot fsync ", path_, ": ", std::strerror(errno));
    observe(AtomicWriteStep::kSyncFile, path_);
    const int fd = fd_;
    fd_ = -1;
    // close(2) can report a deferred write error (NFS, quotas); the file must not be published then.
    if (::close(fd) != 0) fail(Status::kIo, target_, ": cannot close ", path_, ": ", std::strerror(errno));
    observe(AtomicWriteStep::kCloseFile, path_);
  }

  void rename_over_target() {
    // Checked again just before the rename, which is what would replace a device, FIFO or socket.
    refuse_special_target(target_);
    if (::rename(path_.c_str(), target_.c_str()) != 0) {
      fail(Status::kIo, target_, ": cannot rename ", path_, " to it: ", std::strerror(errno));
    }
    renamed_ = true;
    observe(AtomicWriteStep::kRename, target_);
  }

 private:
  std::string target_;
  std::string path_;
  int fd_ = -1;
  bool renamed_ = false;
};


std::string directory_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// Makes the rename durable: it is an update of the directory, which has its own blocks to flush.
void sync_directory(const std::string& path) {
  const std::string dir = directory_of(path);
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) {
    fail(Status::kIo, path, ": written, but cannot open directory ", dir, " to sync it: ", std::strerror(errno));
  }
  // EINVAL: this file system cannot sync a directory (some network and FUSE ones); there is nothing more to do.
  if (::fsync(fd.get()) != 0 && errno != EINVAL) {
    fail(Status::kIo, path, ": written, but cannot fsync directory ", dir, ": ", std::strerror(errno));
  }
  observe(AtomicWriteStep::kSyncDirectory, dir);
}

}  // namespace

int open_regular_file(const std::string& path) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, forever if none comes (and a
  // checkpoint is opened with the engine's lock held). For a regular file the flag changes nothing.
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK));
  if (fd.get() < 0) fail(Status::kIo, path, ": cannot open: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) fail(Status::kIo, path, ": cannot stat: ", std::strerror(errno));
  DPAR_ENFORCE(!S_ISDIR(st.st_mode), Status::kIo, path, ": is a directory");
  // A FIFO, socket or device has no size to check a header against, and may never end.
  DPAR_ENFORCE(S_ISREG(st.st_mode), Status::kIo, path, ": not a regular file (a FIFO, socket or device)");
  const int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags < 0 || ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK) != 0) {
    fail(Status::kIo, path, ": cannot clear O_NONBLOCK: ", std::strerror(errno));
  }
  return fd.release();
}

void set_atomic_write_observer(AtomicWriteObserver observer) { g_observer.store(observer, std::memory_order_release); }

void write_file_atomically(const std::string& path, const std::vector<FilePiece>& pieces) {
  refuse_special_target(path);  // before writing anything
  TempFile temp(path);
  for (const FilePiece& piece : pieces)
    if (piece.bytes > 0) temp.write(piece.data, piece.bytes);
  temp.sync_and_close();
  temp.rename_over_target();
  sync_directory(path);
}

}  // namespace dpar::io
