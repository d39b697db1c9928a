#include "io/safetensors.h"

#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>
#include <utility>

#include "common/error.h"
#include "io/file.h"

namespace dpar::io {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

// The size in bytes of a tensor, or false if the shape's product overflows or does not fill whole bytes.
bool tensor_bytes(const std::vector<uint64_t>& shape, size_t bits, uint64_t* out) {
  uint64_t total = bits;
  for (uint64_t extent : shape) {
    if (__builtin_mul_overflow(total, extent, &total)) return false;
  }
  if (total % 8 != 0) return false;
  *out = total / 8;
  return true;
}

// CRC-32 of a buffer of any length; crc32_z takes a size_t, but it returns 0 for a null pointer whatever the
// running value, so empty pieces are skipped rather than passed.
uint32_t crc_update(uint32_t crc, const void* data, size_t bytes) {
  if (bytes == 0) return crc;
  return static_cast<uint32_t>(crc32_z(crc, static_cast<const Bytef*>(data), bytes));
}


// Reads exactly `bytes`; the file was measured beforehand, so an early end means it shrank meanwhile.
void read_exact(int fd, void* out, size_t bytes, const std::string& path) {
  char* p = static_cast<char*>(out);
  while (bytes > 0) {
    const ssize_t got = ::read(fd, p, std::min<size_t>(bytes, size_t{1} << 30));
    if (got < 0) {
      if (errno == EINTR) continue;
      fail(Status::kIo, path, ": read failed: ", std::strerror(errno));
    }
    DPAR_ENFORCE(got > 0, Status::kCorrupt, path, ": truncated: the file ended ", bytes,
                 " bytes early (did it shrink while being read?)");
    p += got;
    bytes -= static_cast<size_t>(got);
  }
}

struct ParsedEntry {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t begin;
  uint64_t end;
};

ParsedEntry parse_entry(const std::string& path, const std::string& name, const json& value) {
  const std::string where = path + ": tensor '" + name + "': ";
  DPAR_ENFORCE(value.is_object(), Status::kCorrupt, where, "its entry is not a JSON object");
  ParsedEntry entry;
  entry.name = name;

  const auto dtype = value.find("dtype");
  DPAR_ENFORCE(dtype != value.end(), Status::kCorrupt, where, "no \"dtype\"");
  DPAR_ENFORCE(dtype->is_string(), Status::kCorrupt, where, "\"dtype\" is not a string");
  entry.dtype = dtype->get<std::string>();
  const size_t bits = safetensors_dtype_bits(entry.dtype);
  DPAR_ENFORCE(bits != 0, Status::kCorrupt, where, "unknown dtype \"", entry.dtype, "\"");

  const auto shape = value.find("shape");
  DPAR_ENFORCE(shape != value.end(), Status::kCorrupt, where, "no \"shape\"");
  DPAR_ENFORCE(shape->is_array(), Status::kCorrupt, where, "\"shape\" is not an array");
  std::vector<uint64_t> extents;
  for (const json& extent : *shape) {
    // nlohmann stores every non-negative integer literal that fits 64 bits as unsigned; anything else (a
    // negative, a fraction, an exponent, a huge literal) is some other kind of number or not a number.
    DPAR_ENFORCE(!extent.is_number_integer() || extent.is_number_unsigned(), Status::kCorrupt, where,
                 "negative extent ", extent.dump(), " in \"shape\"");
    DPAR_ENFORCE(extent.is_number_unsigned(), Status::kCorrupt, where, "extent ", extent.dump().substr(0, 40),
                 " in \"shape\" is not a non-negative 64-bit integer");
    const uint64_t n = extent.get<uint64_t>();
    DPAR_ENFORCE(n <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), Status::kCorrupt, where,
                 "extent ", n, " in \"shape\" overflows int64");
    extents.push_back(n);
    entry.shape.push_back(static_cast<int64_t>(n));
  }

  const auto offsets = value.find("data_offsets");
  DPAR_ENFORCE(offsets != value.end(), Status::kCorrupt, where, "no \"data_offsets\"");
  DPAR_ENFORCE(offsets->is_array() && offsets->size() == 2 && (*offsets)[0].is_number_unsigned() &&
                   (*offsets)[1].is_number_unsigned(),
               Status::kCorrupt, where, "\"data_offsets\" is not an array of two non-negative integers");
  entry.begin = (*offsets)[0].get<uint64_t>();
  entry.end = (*offsets)[1].get<uint64_t>();
  DPAR_ENFORCE(entry.begin <= entry.end, Status::kCorrupt, where, "\"data_offsets\" [", entry.begin, ", ",
               entry.end, "] end before they begin");

  uint64_t bytes = 0;
  DPAR_ENFORCE(tensor_bytes(extents, bits, &bytes), Status::kCorrupt, where, "shape ", shape_text(entry.shape),
               " of ", entry.dtype, " overflows or does not fill whole bytes");
  DPAR_ENFORCE(bytes == entry.end - entry.begin, Status::kCorrupt, where, "shape ", shape_text(entry.shape),
               " of ", entry.dtype, " needs ", bytes, " bytes but \"data_offsets\" [", entry.begin, ", ", entry.end,
               "] span ", entry.end - entry.begin);
  return entry;
}

// Parses the JSON header, refusing duplicate keys: JSON parsers disagree on which duplicate wins, so a file
// with them means different things to different readers.
json parse_header(const std::string& path, const std::string& header) {
  DPAR_ENFORCE(!header.empty() && header[0] == '{', Status::kCorrupt, path,
               ": the header does not start with '{'");
  // nlohmann's lexer takes a NUL byte for the end of the input and would ignore whatever follows it; JSON never
  // contains one (not even inside a string, where it must be escaped), and Python's reader refuses it too.
  const size_t nul = header.find('\0');
  DPAR_ENFORCE(nul == std::string::npos, Status::kCorrupt, path, ": the header has a NUL byte at offset ", nul,
               ", which JSON does not allow");
  std::vector<std::set<std::string>> open_objects;
  std::string duplicate;
  bool has_duplicate = false;
  // The depth is capped while parsing, before anything recursive (copying, dumping, destroying the tree) runs
  // on it: a header nested 100,000 deep would otherwise overflow the stack.
  const json::parser_callback_t track_keys = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start || event == json::parse_event_t::array_start) {
      // `depth` counts the enclosing containers: 0 for the root object.
      if (depth >= static_cast<int>(kSafetensorsMaxJsonDepth)) {
        fail(Status::kCorrupt, path, ": the header nests JSON arrays and objects more than ",
             kSafetensorsMaxJsonDepth, " deep");
      }
    }
    if (event == json::parse_event_t::object_start) {
      open_objects.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      if (!open_objects.empty()) open_objects.pop_back();
    } else if (event == json::parse_event_t::key && !open_objects.empty() && parsed.is_string()) {
      if (!open_objects.back().insert(parsed.get<std::string>()).second && !has_duplicate) {
        has_duplicate = true;
        duplicate = parsed.get<std::string>();
      }
    }
    return true;
  };
  json root;
  try {
    root = json::parse(header.begin(), header.end(), track_keys);
  } catch (const json::exception& e) {
    // The parser's message quotes the last token, which a damaged file can make huge.
    fail(Status::kCorrupt, path, ": the header is not valid JSON: ", std::string(e.what()).substr(0, 300));
  }
  DPAR_ENFORCE(!has_duplicate, Status::kCorrupt, path, ": the header has the key '", duplicate, "' twice");
  DPAR_ENFORCE(root.is_object(), Status::kCorrupt, path, ": the header is not a JSON object");
  return root;
}

bool parse_crc(const std::string& text, uint32_t* out) {
  if (text.empty() || text.size() > 10) return false;
  uint64_t value = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
    value = value * 10 + static_cast<uint64_t>(c - '0');
  }
  if (value > 0xffffffffu) return false;
  *out = static_cast<uint32_t>(value);
  return true;
}

// The CRC-32 of a header in canonical form (sorted keys, no whitespace) without its own checksum key, so that
// the writer can compute it before the key exists and the reader after removing it.
uint32_t header_crc(json header) {
  const auto metadata = header.find("__metadata__");
  if (metadata != header.end() && metadata->is_object()) metadata->erase(kSafetensorsHeaderCrcKey);
  const std::string canonical = header.dump();
  return crc_update(0, canonical.data(), canonical.size());
}

void check_crc(const std::string& path, const std::map<std::string, std::string>& metadata, const char* key,
               uint32_t actual, const char* what) {
  const std::string& text = metadata.at(key);
  uint32_t stored = 0;
  DPAR_ENFORCE(parse_crc(text, &stored), Status::kCorrupt, path, ": the checksum '", text.substr(0, 40), "' under ",
               key, " is not a 32-bit decimal number");
  DPAR_ENFORCE(stored == actual, Status::kCorrupt, path, ": ", what, " checksum mismatch: the CRC-32 is ", actual,
               " but ", key, " records ", stored, " (the file is damaged)");
}

}  // namespace

size_t safetensors_dtype_bits(const std::string& dtype) {
  static const std::map<std::string, size_t> kBits = {
      {"BOOL", 8},        {"U8", 8},           {"I8", 8},          {"F8_E5M2", 8},  {"F8_E4M3", 8},
      {"F8_E4M3FNUZ", 8}, {"F8_E5M2FNUZ", 8},  {"F8_E8M0", 8},     {"I16", 16},     {"U16", 16},
      {"F16", 16},        {"BF16", 16},        {"I32", 32},        {"U32", 32},     {"F32", 32},
      {"F64", 64},        {"I64", 64},         {"U64", 64},        {"C64", 64},     {"F4", 4},
      {"F6_E2M3", 6},     {"F6_E3M2", 6},
  };
  const auto it = kBits.find(dtype);
  return it == kBits.end() ? 0 : it->second;
}

void write_safetensors(const std::string& path, const std::vector<TensorView>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  DPAR_CHECK_ARG(!path.empty(), "write_safetensors: the path is empty");
  for (const char* key : {kSafetensorsCrcKey, kSafetensorsHeaderCrcKey}) {
    DPAR_CHECK_ARG(metadata.count(key) == 0, path, ": the metadata key '", key, "' is reserved for a checksum");
  }

  ordered_json entries = ordered_json::object();
  std::set<std::string> seen;
  uint64_t offset = 0;
  uint32_t crc = 0;
  for (const TensorView& t : tensors) {
    const std::string where = path + ": tensor '" + t.name + "': ";
    DPAR_CHECK_ARG(t.name != "__metadata__", where, "the name is reserved by the format");
    DPAR_CHECK_ARG(seen.insert(t.name).second, where, "the name is used twice");
    const size_t bits = safetensors_dtype_bits(t.dtype);
    DPAR_CHECK_ARG(bits != 0, where, "unknown dtype \"", t.dtype, "\"");
    std::vector<uint64_t> extents;
    for (int64_t extent : t.shape) {
      DPAR_CHECK_ARG(extent >= 0, where, "negative extent in shape ", shape_text(t.shape));
      extents.push_back(static_cast<uint64_t>(extent));
    }
    uint64_t bytes = 0;
    DPAR_CHECK_ARG(tensor_bytes(extents, bits, &bytes), where, "shape ", shape_text(t.shape), " of ", t.dtype,
                   " overflows or does not fill whole bytes");
    DPAR_CHECK_ARG(bytes == t.bytes, where, "shape ", shape_text(t.shape), " of ", t.dtype, " needs ", bytes,
                   " bytes, got ", t.bytes);
    DPAR_CHECK_ARG(t.data != nullptr || t.bytes == 0, where, "null data");
    ordered_json entry = ordered_json::object();
    entry["dtype"] = t.dtype;
    entry["shape"] = extents;
    entry["data_offsets"] = {offset, offset + bytes};  // No overflow: these bytes all exist in memory.
    entries[t.name] = std::move(entry);
    offset += bytes;
    crc = crc_update(crc, t.data, t.bytes);
  }

  // "__metadata__" first, then the tensors in buffer order, as Python's safetensors lays a header out.
  std::map<std::string, std::string> all_metadata = metadata;
  all_metadata[kSafetensorsCrcKey] = std::to_string(crc);
  const auto build_header = [&] {
    ordered_json root = ordered_json::object();
    root["__metadata__"] = all_metadata;
    for (const auto& item : entries.items()) root[item.key()] = item.value();
    return root.dump();
  };
  std::string header;
  try {
    all_metadata[kSafetensorsHeaderCrcKey] = std::to_string(header_crc(json::parse(build_header())));
    header = build_header();
  } catch (const json::exception& e) {
    fail(Status::kInvalidArgument, path, ": a tensor name or a metadata string is not valid UTF-8 (", e.what(), ")");
  }
  // Pad so that the data buffer starts 8-byte aligned in the file, as the format recommends.
  header.append((8 - header.size() % 8) % 8, ' ');

  std::string prefix(8, '\0');
  const uint64_t header_size = header.size();
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<char>((header_size >> (8 * i)) & 0xff);  // Little-endian.
  prefix += header;

  std::vector<FilePiece> pieces{{prefix.data(), prefix.size()}};
  for (const TensorView& t : tensors) pieces.push_back({t.data, t.bytes});
  write_file_atomically(path, pieces);
}

std::vector<uint8_t> SafetensorsFile::read_bytes(const std::string& path) {
  Fd fd(open_regular_file(path));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) fail(Status::kIo, path, ": cannot stat: ", std::strerror(errno));
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  DPAR_ENFORCE(file_size <= std::numeric_limits<size_t>::max(), Status::kCorrupt, path,
               ": the file does not fit in memory");
  std::vector<uint8_t> bytes(static_cast<size_t>(file_size));
  read_exact(fd.get(), bytes.data(), bytes.size(), path);
  return bytes;
}

SafetensorsFile SafetensorsFile::read(const std::string& path) { return parse(path, read_bytes(path)); }

SafetensorsFile SafetensorsFile::parse(const std::string& path, std::vector<uint8_t> bytes) {
  const uint64_t file_size = bytes.size();
  DPAR_ENFORCE(file_size >= 8, Status::kCorrupt, path, ": the file is ", file_size,
               " bytes, shorter than the 8-byte header length");
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = (header_size << 8) | bytes[static_cast<size_t>(i)];
  DPAR_ENFORCE(header_size <= kSafetensorsMaxHeaderBytes, Status::kCorrupt, path, ": the header length ",
               header_size, " exceeds the limit of ", kSafetensorsMaxHeaderBytes, " bytes");
  DPAR_ENFORCE(header_size <= file_size - 8, Status::kCorrupt, path, ": truncated: the header length is ",
               header_size, " bytes but only ", file_size - 8, " follow it");
  const std::string header(reinterpret_cast<const char*>(bytes.data()) + 8, static_cast<size_t>(header_size));
  const uint64_t buffer_size = file_size - 8 - header_size;

  const json root = parse_header(path, header);
  SafetensorsFile file;
  file.path_ = path;
  const auto metadata = root.find("__metadata__");
  if (metadata != root.end()) {
    DPAR_ENFORCE(metadata->is_object(), Status::kCorrupt, path, ": \"__metadata__\" is not a JSON object");
    for (const auto& meta : metadata->items()) {
      DPAR_ENFORCE(meta.value().is_string(), Status::kCorrupt, path, ": the metadata value of '", meta.key(),
                   "' is not a string");
      file.metadata_[meta.key()] = meta.value().get<std::string>();
    }
  }
  // Both checksums or neither: were one optional, damage to the other's key name would disable its check.
  const bool has_data_crc = file.metadata_.count(kSafetensorsCrcKey) != 0;
  const bool has_checksums = file.metadata_.count(kSafetensorsHeaderCrcKey) != 0;
  DPAR_ENFORCE(has_data_crc == has_checksums, Status::kCorrupt, path, ": the metadata has '",
               has_data_crc ? kSafetensorsCrcKey : kSafetensorsHeaderCrcKey, "' without '",
               has_data_crc ? kSafetensorsHeaderCrcKey : kSafetensorsCrcKey, "'");
  // Checked before the entries, so that damage to the header is reported as such rather than as whatever
  // inconsistency it happens to cause.
  if (has_checksums) check_crc(path, file.metadata_, kSafetensorsHeaderCrcKey, header_crc(root), "header");

  std::vector<ParsedEntry> parsed;
  for (const auto& item : root.items()) {
    if (item.key() != "__metadata__") parsed.push_back(parse_entry(path, item.key(), item.value()));
  }

  // The tensors must tile the buffer: sorted by offsets, each begins where the previous one ended.
  std::sort(parsed.begin(), parsed.end(), [](const ParsedEntry& a, const ParsedEntry& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  uint64_t expected = 0;
  const ParsedEntry* previous = nullptr;
  for (const ParsedEntry& e : parsed) {
    if (e.begin < expected) {
      fail(Status::kCorrupt, path, ": tensor '", e.name, "' (bytes ", e.begin, " to ", e.end, ") overlaps tensor '",
           previous->name, "' (bytes ", previous->begin, " to ", previous->end, ")");
    }
    DPAR_ENFORCE(e.begin == expected, Status::kCorrupt, path, ": a gap of ", e.begin - expected,
                 " bytes before tensor '", e.name, "'");
    expected = e.end;
    previous = &e;
  }
  DPAR_ENFORCE(buffer_size >= expected, Status::kCorrupt, path, ": truncated: the header describes ", expected,
               " bytes of tensor data but the file holds ", buffer_size);
  DPAR_ENFORCE(buffer_size == expected, Status::kCorrupt, path, ": ", buffer_size - expected,
               " bytes follow the last tensor's data");

  // The data buffer is what follows the header: moved to the front of the same allocation, not copied.
  bytes.erase(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(8 + header_size));
  file.buffer_ = std::move(bytes);

  if (has_checksums) {
    check_crc(path, file.metadata_, kSafetensorsCrcKey, crc_update(0, file.buffer_.data(), file.buffer_.size()),
              "data");
  }

  for (ParsedEntry& e : parsed) {
    file.order_.push_back(e.name);
    file.entries_[e.name] = SafetensorsEntry{std::move(e.dtype), std::move(e.shape), static_cast<size_t>(e.begin),
                                             static_cast<size_t>(e.end - e.begin)};
  }
  return file;
}

const SafetensorsEntry& SafetensorsFile::entry(const std::string& name) const {
  const auto it = entries_.find(name);
  if (it == entries_.end()) fail(Status::kMismatch, path_, ": no tensor named '", name, "'");
  return it->second;
}

const uint8_t* SafetensorsFile::data(const std::string& name) const {
  return buffer_.data() + entry(name).offset;
}

const SafetensorsEntry& SafetensorsFile::expect(const std::string& name, const std::string& dtype,
                                                const std::vector<int64_t>& shape) const {
  const SafetensorsEntry& e = entry(name);
  if (e.dtype != dtype || e.shape != shape) {
    fail(Status::kMismatch, path_, ": tensor '", name, "' is ", e.dtype, " ", shape_text(e.shape), ", expected ",
         dtype, " ", shape_text(shape));
  }
  return e;
}

void SafetensorsFile::copy_to(const std::string& name, void* dst, size_t bytes) const {
  const SafetensorsEntry& e = entry(name);
  DPAR_ENFORCE(e.bytes == bytes, Status::kMismatch, path_, ": tensor '", name, "' holds ", e.bytes,
               " bytes, the destination ", bytes);
  if (bytes > 0) std::memcpy(dst, buffer_.data() + e.offset, bytes);
}

}  // namespace dpar::io
