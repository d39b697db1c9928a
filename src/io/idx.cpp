#include "io/idx.h"

#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

#include "common/error.h"
#include "io/file.h"

namespace dpar::io {
namespace {

struct GzCloser {
  void operator()(gzFile_s* file) const { gzclose(file); }
};
using GzHandle = std::unique_ptr<gzFile_s, GzCloser>;

std::string hex_byte(unsigned value) {
  char text[8];
  std::snprintf(text, sizeof text, "0x%02x", value & 0xffu);
  return text;
}

// Turns zlib's error state after a failed or short gzread into an exception. Z_ERRNO is the operating system
// failing (IO); every other zlib error means the compressed bytes themselves are bad (CORRUPT).
[[noreturn]] void fail_gz(const std::string& path, gzFile file, int saved_errno) {
  int code = Z_OK;
  const char* message = gzerror(file, &code);
  if (code == Z_ERRNO) fail(Status::kIo, path, ": read failed: ", std::strerror(saved_errno));
  fail(Status::kCorrupt, path, ": damaged gzip stream: ", message ? message : "unknown zlib error");
}

// Reads up to `size` bytes; returns how many were read, fewer only at the end of the stream. Throws on errors.
size_t read_some(const std::string& path, gzFile file, uint8_t* out, size_t size) {
  size_t done = 0;
  while (done < size) {
    // gzread takes an unsigned length and returns an int: stay well inside both.
    const unsigned chunk = static_cast<unsigned>(std::min<size_t>(size - done, size_t{1} << 30));
    errno = 0;
    const int got = gzread(file, out + done, chunk);
    if (got < 0) fail_gz(path, file, errno);
    if (got == 0) break;
    done += static_cast<size_t>(got);
  }
  return done;
}

// After a short read, a gzip stream that ended mid-member reports Z_BUF_ERROR; say so, as it explains why.
std::string truncation_note(gzFile file) {
  int code = Z_OK;
  gzerror(file, &code);
  return code == Z_BUF_ERROR ? " (the gzip stream ends unexpectedly)" : "";
}

uint32_t load_be32(const uint8_t* bytes) {
  return (uint32_t{bytes[0]} << 24) | (uint32_t{bytes[1]} << 16) | (uint32_t{bytes[2]} << 8) | uint32_t{bytes[3]};
}

const char* idx_type_name(unsigned type) {
  switch (type) {
    case 0x08: return "u8";
    case 0x09: return "i8";
    case 0x0B: return "i16";
    case 0x0C: return "i32";
    case 0x0D: return "f32";
    case 0x0E: return "f64";
    default: return nullptr;
  }
}

}  // namespace

IdxArray read_idx_u8(const std::string& path) {
  // A regular file only, opened without blocking (a FIFO would wait for a writer forever), and of known size:
  // the size bounds how much data the file can honestly hold.
  const int fd = open_regular_file(path);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int saved = errno;
    ::close(fd);
    fail(Status::kIo, path, ": cannot stat: ", std::strerror(saved));
  }
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  GzHandle handle(gzdopen(fd, "rb"));
  if (!handle) {
    ::close(fd);  // gzdopen leaves the descriptor open when it fails: it could not allocate its state
    fail(Status::kOutOfMemory, path, ": cannot open: zlib could not allocate its state");
  }
  gzFile file = handle.get();
  gzbuffer(file, 1u << 17);  // Fewer, larger reads than zlib's 8 KiB default.

  uint8_t magic[4];
  const size_t magic_got = read_some(path, file, magic, sizeof magic);
  DPAR_ENFORCE(magic_got == sizeof magic, Status::kCorrupt, path, ": truncated header: expected 4 bytes of magic number, got ",
               magic_got, truncation_note(file));
  if (magic[0] != 0 || magic[1] != 0) {
    fail(Status::kCorrupt, path, ": bad magic number ", hex_byte(magic[0]), " ", hex_byte(magic[1]), " ",
         hex_byte(magic[2]), " ", hex_byte(magic[3]), ": an IDX file starts with 0x00 0x00 <type> <ndim>");
  }
  const unsigned type = magic[2];
  if (type != 0x08) {
    const char* name = idx_type_name(type);
    if (name != nullptr) {
      fail(Status::kNotSupported, path, ": IDX element type ", hex_byte(type), " (", name,
           ") is not supported; only 0x08 (u8) is");
    }
    fail(Status::kCorrupt, path, ": unknown IDX element type ", hex_byte(type));
  }
  const unsigned ndim = magic[3];
  DPAR_ENFORCE(ndim > 0, Status::kCorrupt, path, ": the header declares 0 dimensions");

  uint8_t dim_bytes[4 * 255];
  const size_t dims_size = 4 * size_t{ndim};
  const size_t dims_got = read_some(path, file, dim_bytes, dims_size);
  DPAR_ENFORCE(dims_got == dims_size, Status::kCorrupt, path, ": truncated header: expected ", dims_size,
               " bytes of dimensions, got ", dims_got, truncation_note(file));

  IdxArray result;
  result.dims.reserve(ndim);
  uint64_t total = 1;
  for (unsigned i = 0; i < ndim; ++i) {
    const uint32_t extent = load_be32(dim_bytes + 4 * i);
    // An empty data set is never useful, and an extent of 0 is what a zeroed (damaged) header looks like.
    DPAR_ENFORCE(extent != 0, Status::kCorrupt, path, ": dimension ", i, " is 0");
    // total <= kIdxMaxDataBytes before this step, so the division keeps the product from overflowing.
    if (extent > kIdxMaxDataBytes / total) {
      std::string dims_text;
      for (unsigned j = 0; j < ndim; ++j) dims_text += (j ? ", " : "") + std::to_string(load_be32(dim_bytes + 4 * j));
      fail(Status::kCorrupt, path, ": dimensions [", dims_text, "] describe more than ", kIdxMaxDataBytes,
           " bytes of data");
    }
    total *= extent;
    result.dims.push_back(static_cast<int64_t>(extent));
  }

  // What the file can honestly hold: a plain file its own bytes after the header, a gzip file at most
  // kDeflateMaxRatio times its compressed bytes. A header claiming more is damaged or hostile, and is refused
  // before anything is allocated for it.
  const uint64_t header_bytes = 4 + 4 * uint64_t{ndim};
  const bool plain = gzdirect(file) != 0;
  const uint64_t honest = plain ? (file_size > header_bytes ? file_size - header_bytes : 0)
                                : (file_size > kIdxMaxDataBytes / kDeflateMaxRatio ? kIdxMaxDataBytes
                                                                                  : file_size * kDeflateMaxRatio);
  DPAR_ENFORCE(total <= honest, Status::kCorrupt, path, ": the header's dimensions describe ", total,
               " bytes of data, more than the ", file_size, "-byte ", plain ? "file holds" : "gzip file can inflate to");

  // One allocation of the claimed size, filled as the data arrives: the buffer is never copied to grow, so the
  // reader holds at most the claimed bytes, once. reserve() only maps address space: a file that ends early has
  // made the reader touch no more memory than the data it really held.
  const size_t expected = static_cast<size_t>(total);
  result.data.reserve(expected);
  size_t filled = 0;
  while (filled < expected) {
    const size_t chunk = std::min<size_t>(expected - filled, size_t{4} << 20);
    result.data.resize(filled + chunk);  // Within the capacity: no reallocation.
    const size_t got = read_some(path, file, result.data.data() + filled, chunk);
    filled += got;
    if (got < chunk) {
      fail(Status::kCorrupt, path, ": truncated: expected ", expected, " bytes of data, got ", filled,
           truncation_note(file));
    }
  }

  // A gzip member's CRC is checked only when its end is reached: read on to it, ignoring any bytes after the
  // data (tolerated, see the header), so that a damaged .gz is refused. A plain file has nothing to verify.
  // The bytes after the data are bounded too: a small file that inflates to terabytes of padding would
  // otherwise keep the reader busy for hours.
  if (!plain) {
    uint8_t scratch[1 << 14];
    uint64_t trailing = 0;
    for (size_t got = sizeof scratch; got == sizeof scratch;) {
      got = read_some(path, file, scratch, sizeof scratch);
      trailing += got;
      DPAR_ENFORCE(trailing <= kIdxMaxTrailingBytes, Status::kCorrupt, path, ": more than ", kIdxMaxTrailingBytes,
                   " bytes follow the data the header describes");
    }
    int code = Z_OK;
    gzerror(file, &code);
    DPAR_ENFORCE(code == Z_OK, Status::kCorrupt, path, ": damaged gzip stream: it ends unexpectedly after the data");
  }
  return result;
}

}  // namespace dpar::io
