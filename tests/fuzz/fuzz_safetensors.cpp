// libFuzzer harness: the safetensors reader (header JSON, entries, tiling, both checksums) on arbitrary bytes.
// A refusal is Status::kCorrupt; a file that is accepted must be self-consistent.
#include <cstring>

#include "fuzz_util.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace dpar;
  fuzz::expect_only_documented_errors(
      [&] {
        const io::SafetensorsFile file = io::SafetensorsFile::parse("input", std::vector<uint8_t>(data, data + size));
        size_t total = 0;
        for (const std::string& name : file.names()) {
          const io::SafetensorsEntry& e = file.entry(name);
          if (e.offset != total) std::abort();  // tensors tile the buffer in order
          total += e.bytes;
          std::vector<uint8_t> copy(e.bytes);
          file.copy_to(name, copy.data(), copy.size());
          if (e.bytes && std::memcmp(copy.data(), file.data(name), e.bytes) != 0) std::abort();
        }
        if (total != file.buffer().size()) std::abort();
      },
      {Status::kCorrupt});
  return 0;
}
