#include "io/file.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/error.h"

namespace dpar::io {
namespace {

void write_all(int fd, const void* data, size_t bytes, const std::string& path, const std::string& tmp) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t wrote = ::write(fd, p, std::min<size_t>(bytes, size_t{1} << 30));
    if (wrote < 0) {
      if (errno == EINTR) continue;
      fail(DPAR_ERR_IO, path, ": cannot write ", tmp, ": ", std::strerror(errno));
    }
    // write(2) returns 0 for a non-empty request only on a device that refuses more; do not spin on it.
    DPAR_ENFORCE(wrote > 0, DPAR_ERR_IO, path, ": cannot write ", tmp, ": no progress");
    p += wrote;
    bytes -= static_cast<size_t>(wrote);
  }
}

// The temporary file of an atomic write: removed on every failure, kept once renamed into place.
class TempFile {
 public:
  TempFile(const std::string& target, std::string tmp) : target_(target), path_(std::move(tmp)) {
    // O_NOFOLLOW: a symbolic link planted at the temporary name must not redirect the write elsewhere.
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0666);
    // Nothing was created, so the destructor (which will not run) has nothing to remove.
    if (fd_ < 0) fail(DPAR_ERR_IO, target_, ": cannot create temporary file ", path_, ": ", std::strerror(errno));
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!renamed_) ::unlink(path_.c_str());
  }

  void write(const void* data, size_t bytes) { write_all(fd_, data, bytes, target_, path_); }

  // Makes the content durable before the rename publishes it: otherwise a crash could leave the new name
  // pointing at a file whose blocks never reached the disk.
  void sync_and_close() {
    if (::fsync(fd_) != 0) fail(DPAR_ERR_IO, target_, ": cannot fsync ", path_, ": ", std::strerror(errno));
    const int fd = fd_;
    fd_ = -1;
    // close(2) can report a deferred write error (NFS, quotas); the file must not be published then.
    if (::close(fd) != 0) fail(DPAR_ERR_IO, target_, ": cannot close ", path_, ": ", std::strerror(errno));
  }

  void rename_over_target() {
    if (::rename(path_.c_str(), target_.c_str()) != 0) {
      fail(DPAR_ERR_IO, target_, ": cannot rename ", path_, " to it: ", std::strerror(errno));
    }
    renamed_ = true;
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
    fail(DPAR_ERR_IO, path, ": written, but cannot open directory ", dir, " to sync it: ", std::strerror(errno));
  }
  // EINVAL: this file system cannot sync a directory (some network and FUSE ones); there is nothing more to do.
  if (::fsync(fd.get()) != 0 && errno != EINVAL) {
    fail(DPAR_ERR_IO, path, ": written, but cannot fsync directory ", dir, ": ", std::strerror(errno));
  }
}

}  // namespace

int open_regular_file(const std::string& path) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, forever if none comes (and a
  // checkpoint is opened with the engine's lock held). For a regular file the flag changes nothing.
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK));
  if (fd.get() < 0) fail(DPAR_ERR_IO, path, ": cannot open: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) fail(DPAR_ERR_IO, path, ": cannot stat: ", std::strerror(errno));
  DPAR_ENFORCE(!S_ISDIR(st.st_mode), DPAR_ERR_IO, path, ": is a directory");
  // A FIFO, socket or device has no size to check a header against, and may never end.
  DPAR_ENFORCE(S_ISREG(st.st_mode), DPAR_ERR_IO, path, ": not a regular file (a FIFO, socket or device)");
  const int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags < 0 || ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK) != 0) {
    fail(DPAR_ERR_IO, path, ": cannot clear O_NONBLOCK: ", std::strerror(errno));
  }
  return fd.release();
}

void write_file_atomically(const std::string& path, const std::vector<FilePiece>& pieces) {
  TempFile temp(path, path + ".tmp." + std::to_string(::getpid()));
  for (const FilePiece& piece : pieces)
    if (piece.bytes > 0) temp.write(piece.data, piece.bytes);
  temp.sync_and_close();
  temp.rename_over_target();
  sync_directory(path);
}

}  // namespace dpar::io
