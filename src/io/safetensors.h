// Reading and writing safetensors files (https://huggingface.co/docs/safetensors), the checkpoint format.
//
// Layout: an 8-byte little-endian u64 N, then N bytes of UTF-8 JSON padded with spaces, then the data buffer.
// The JSON maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the
// buffer), plus an optional "__metadata__" object of string values. Tensors tile the buffer exactly.
//
// Files written here carry two checksums in their metadata, so that a damaged checkpoint is refused rather than
// loaded: "dpar.crc32", the zlib CRC-32 of the whole data buffer as a decimal string, and "dpar.header_crc32",
// the CRC-32 of the header's canonical JSON (keys sorted, no whitespace, as nlohmann::json dumps it) without that
// key. The second exists because the header's consistency checks cannot see every change there: a different
// character in a tensor name, a metadata value or the shape of an empty tensor still describes a valid file.
// Files with neither key (written by Python's safetensors, for example) are read without the checks; a file with
// only one of them is refused, since damage to the other key's name would otherwise switch its check off.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace dpar::io {

// The metadata key holding the CRC-32 of the data buffer.
inline constexpr const char* kSafetensorsCrcKey = "dpar.crc32";
// The metadata key holding the CRC-32 of the canonical header without this key.
inline constexpr const char* kSafetensorsHeaderCrcKey = "dpar.header_crc32";
// The largest header accepted, as Python's safetensors limits it: a larger length is a damaged file.
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;
// The deepest nesting of JSON arrays and objects accepted in a header. A valid header needs 3 (the root object,
// a tensor's entry, its shape); the limit leaves room for extra fields and keeps every recursive walk of the
// parsed header (copy, dump, destruction) far from the stack's end.
inline constexpr size_t kSafetensorsMaxJsonDepth = 64;

// The size in bits of one element of a safetensors dtype ("F32" -> 32, "F4" -> 4), or 0 for an unknown dtype.
size_t safetensors_dtype_bits(const std::string& dtype);

// One tensor to write; the data is borrowed for the duration of the call.
struct TensorView {
  std::string name;            // Unique; "__metadata__" is reserved by the format.
  std::string dtype;           // A safetensors dtype: "F32", "I64", "U64", "BF16", "U8", ...
  std::vector<int64_t> shape;  // Extents, each >= 0; empty for a scalar.
  const void* data;            // May be null only when bytes is 0.
  size_t bytes;                // Must equal the product of shape times the dtype's size.
};

// Writes a safetensors file atomically: the bytes go to "<path>.tmp.<pid>" in the same directory, which is
// fsynced and renamed over path, and then the directory is fsynced; a crash leaves the old file or the new one.
// Tensors are laid out in the given order, without padding between them, so an element wider than a byte is
// aligned in the buffer only if the tensors before it keep it so (as Python's writer does by sorting by
// dtype size). Adds kSafetensorsCrcKey and kSafetensorsHeaderCrcKey to the metadata. Two threads of one process must not write the same path
// at once (they would share the temporary name). Throws dpar::Error:
//   Status::kInvalidArgument  a duplicate, reserved or non-UTF-8 name, an unknown dtype, a negative extent, a
//                              size that does not match the shape, a null data pointer, one of the two checksum
//                              keys in the metadata or "__metadata__" used as a tensor name;
//   Status::kIo                any system call failing, naming the path and the system's reason; the temporary
//                              file is removed and an existing file at path is left as it was.
void write_safetensors(const std::string& path, const std::vector<TensorView>& tensors,
                       const std::map<std::string, std::string>& metadata);

// Where one tensor lies in a file's data buffer.
struct SafetensorsEntry {
  std::string dtype;
  std::vector<int64_t> shape;
  size_t offset;  // From the start of the data buffer.
  size_t bytes;
};

// A whole safetensors file in memory, validated when read.
class SafetensorsFile {
 public:
  // Reads and validates the whole file. Throws dpar::Error naming the file:
  //   Status::kIo       it cannot be opened or read, or is not a regular file;
  //   Status::kCorrupt  shorter than 8 bytes; a header length beyond the file or kSafetensorsMaxHeaderBytes; a
  //                     header that is not a JSON object (or has duplicate keys, or nests deeper than
  //                     kSafetensorsMaxJsonDepth); an entry without dtype, shape
  //                     or data_offsets, or with values of the wrong JSON type; an unknown dtype; a negative or
  //                     overflowing shape; a size that does not match the shape; tensors that overlap, leave
  //                     gaps or do not end exactly at the end of the file; a metadata value that is not a
  //                     string; a checksum that is malformed or does not match, or only one of the two.
  static SafetensorsFile read(const std::string& path);
  // read() in two halves, for a file read in one place and parsed in others (a checkpoint that rank 0 reads and
  // broadcasts): read_bytes throws only Status::kIo (and CORRUPT for a file too large for memory); parse throws the
  // CORRUPT errors above, naming `path`.
  static std::vector<uint8_t> read_bytes(const std::string& path);
  static SafetensorsFile parse(const std::string& path, std::vector<uint8_t> bytes);

  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  size_t size() const { return order_.size(); }  // The number of tensors.
  bool has(const std::string& name) const { return entries_.count(name) != 0; }
  // Throws Status::kMismatch naming the file and a missing tensor.
  const SafetensorsEntry& entry(const std::string& name) const;
  // The tensor's bytes. Only byte-aligned: the buffer starts 16-byte aligned but a tensor's offset need not be a
  // multiple of its element size, so copy (copy_to, memcpy) rather than cast to a wider type.
  const uint8_t* data(const std::string& name) const;
  // The entry, after checking that it has this dtype and shape; throws Status::kMismatch naming both otherwise.
  // What a checkpoint loader needs to refuse a file of another model.
  const SafetensorsEntry& expect(const std::string& name, const std::string& dtype,
                                 const std::vector<int64_t>& shape) const;
  // Copies the tensor into dst, which holds `bytes`; throws Status::kMismatch if the tensor's size differs.
  void copy_to(const std::string& name, void* dst, size_t bytes) const;
  // Tensor names in the order of their data in the file.
  std::vector<std::string> names() const { return order_; }
  // The whole data buffer.
  const std::vector<uint8_t>& buffer() const { return buffer_; }

 private:
  std::string path_;
  std::map<std::string, std::string> metadata_;
  std::map<std::string, SafetensorsEntry> entries_;
  std::vector<std::string> order_;
  std::vector<uint8_t> buffer_;
};

}  // namespace dpar::io
