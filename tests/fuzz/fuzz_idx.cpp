// libFuzzer harness: the IDX reader on arbitrary files (plain, or gzip when the bytes say so). A refusal is
// CORRUPT or NOT_SUPPORTED; an accepted file holds exactly the product of its extents.
#include "fuzz_util.h"
#include "io/idx.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace dpar;
  const std::string& path = fuzz::scratch_path("idx");
  fuzz::write_input(path, data, size);
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
