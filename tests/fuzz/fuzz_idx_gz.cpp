// libFuzzer harness: the gzip path of the IDX reader. The input always starts as a gzip member does (1f 8b 08),
// so that every mutation exercises inflation, the stream's checks, the bound on what a header may claim for a
// compressed file and the bound on trailing data, rather than the plain path.
#include <vector>

#include "fuzz_util.h"
#include "io/idx.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace dpar;
  std::vector<uint8_t> bytes = {0x1f, 0x8b, 0x08};
  if (size >= 3 && data[0] == 0x1f && data[1] == 0x8b && data[2] == 0x08) bytes.clear();
  bytes.insert(bytes.end(), data, data + size);
  const std::string& path = fuzz::scratch_path("idx_gz");
  fuzz::write_input(path, bytes.data(), bytes.size());
  fuzz::expect_only_documented_errors(
      [&] {
        const io::IdxArray a = io::read_idx_u8(path);
        uint64_t total = 1;
        for (int64_t d : a.dims) total *= static_cast<uint64_t>(d);
        if (a.dims.empty() || total != a.data.size()) std::abort();
      },
      {Status::kCorrupt, Status::kNotSupported});
  return 0;
}
