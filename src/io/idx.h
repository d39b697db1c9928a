// Reader of IDX files, the format of MNIST and Fashion-MNIST, plain or gzip-compressed.
//
// Layout (all integers big-endian): a magic number 0x00 0x00 <type> <ndim>, then ndim u32 extents, then the
// elements in row-major order. Only type 0x08 (unsigned byte) is read: it is what every MNIST-like data set
// uses, and the other types would need byte-swapping that no caller needs yet.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dpar::io {

// An n-dimensional array of bytes as stored in an IDX file.
struct IdxArray {
  std::vector<int64_t> dims;  // Extents, outermost first; each at least 1.
  std::vector<uint8_t> data;  // The product of dims elements, row-major.
};

// The most data an IDX file may claim (2^34 bytes = 16 GiB). A larger product of extents is treated as a
// damaged header rather than attempted: no data set this library trains on comes near it.
inline constexpr uint64_t kIdxMaxDataBytes = uint64_t{1} << 34;

// The most bytes deflate can produce per compressed byte (zlib's technical notes: 1032:1). A gzip file's IDX
// header claiming more data than its compressed size times this is refused before anything is allocated.
inline constexpr uint64_t kDeflateMaxRatio = 1032;

// The most bytes a gzip-compressed file may hold after the data (padding); more is refused as damaged.
inline constexpr uint64_t kIdxMaxTrailingBytes = uint64_t{16} << 20;

// Reads an IDX file of type 0x08 (u8). The file may be plain or gzip-compressed (zlib detects which).
// Data after the last element is ignored (up to kIdxMaxTrailingBytes), as some tools pad files; a gzip stream's
// checksum is verified.
// The file must be a regular file (a FIFO or device is refused without blocking on it). Memory: the data is
// read into one buffer of the size the header claims, which must be no more than the file can hold (its size,
// or kDeflateMaxRatio times it compressed), so a small gzip file cannot make the reader allocate gigabytes.
// Throws dpar::Error, with a message that names the file:
//   Status::kIo             the file cannot be opened or read (with the system's reason), or is not a regular file;
//   Status::kCorrupt        bad magic number, unknown element type, zero dimensions or a zero extent, extents
//                           whose product exceeds kIdxMaxDataBytes or what the file can hold, a truncated header
//                           or data, a damaged gzip stream;
//   Status::kNotSupported  a valid IDX element type other than u8 (i8, i16, i32, f32, f64).
IdxArray read_idx_u8(const std::string& path);

}  // namespace dpar::io
