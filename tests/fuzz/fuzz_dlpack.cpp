// libFuzzer harness: dpar_tensor_from_dlpack on DLPack descriptors built field by field from the input
// (FuzzedDataProvider): device type and id as raw integers, dtype, ndim, shape, strides, data pointer alignment and
// byte_offset. The memory a descriptor claims is allocated exactly (when it is small enough), so an accepted
// tensor is read in full under AddressSanitizer: a check that lets a wrapping, overflowing or misaligned offset
// through reads outside it, or misaligned (UBSan). A refusal must be INVALID_ARGUMENT or NOT_SUPPORTED and leave
// the producer's tensor alone; an accepted one calls the deleter exactly once, after its export is released too.
#include <dlpack/dlpack.h>
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "dpar.h"

namespace {

struct Producer {
  int deleted = 0;
};

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_dlpack: %s (%s)\n", what, dpar_last_error());
    std::abort();
  }
}

// Bytes a descriptor claims beyond data: byte_offset + numel * element size, or 0 when that does not fit in
// `limit` (the descriptor then gets a token buffer and must not be read).
uint64_t claimed_bytes(const DLTensor& d, uint64_t limit) {
  if (d.ndim < 1 || d.ndim > 8 || !d.shape) return 0;
  uint64_t n = 4;  // dpar takes 4-byte elements only; anything else is refused before the memory matters
  for (int i = 0; i < d.ndim; ++i) {
    if (d.shape[i] < 0) return 0;
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d.shape[i]), &n)) return 0;
  }
  uint64_t total = 0;
  if (__builtin_add_overflow(n, d.byte_offset, &total) || total > limit) return 0;
  return total;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  DLManagedTensor m{};
  DLTensor& d = m.dl_tensor;
  const int32_t device_type = in.ConsumeBool() ? in.ConsumeIntegral<int32_t>() : in.ConsumeIntegralInRange(1, 3);
  std::memcpy(&d.device.device_type, &device_type, sizeof device_type);  // any integer, as a producer may send
  d.device.device_id = in.ConsumeBool() ? 0 : in.ConsumeIntegral<int32_t>();
  d.dtype.code = in.ConsumeBool() ? static_cast<uint8_t>(kDLFloat) : in.ConsumeIntegral<uint8_t>();
  d.dtype.bits = in.ConsumeBool() ? 32 : in.ConsumeIntegral<uint8_t>();
  d.dtype.lanes = in.ConsumeBool() ? 1 : in.ConsumeIntegral<uint16_t>();
  d.ndim = in.ConsumeIntegralInRange<int32_t>(-1, 6);
  std::vector<int64_t> shape(8), strides(8);
  for (auto& s : shape) s = in.ConsumeBool() ? in.ConsumeIntegralInRange<int64_t>(1, 8) : in.ConsumeIntegral<int64_t>();
  for (auto& s : strides) s = in.ConsumeIntegral<int64_t>();
  d.shape = in.ConsumeIntegralInRange(0, 15) == 0 ? nullptr : shape.data();
  const int stride_kind = in.ConsumeIntegralInRange(0, 2);  // none, the compact ones, fuzzed
  if (stride_kind == 1 && d.ndim >= 1 && d.ndim <= 8) {
    int64_t expected = 1;
    for (int i = d.ndim - 1; i >= 0; --i) {
      strides[i] = expected;
      expected *= shape[i] > 0 && shape[i] < (1 << 20) ? shape[i] : 1;
    }
  }
  d.strides = stride_kind == 0 ? nullptr : strides.data();
  switch (in.ConsumeIntegralInRange(0, 3)) {
    case 0: d.byte_offset = 0; break;
    case 1: d.byte_offset = in.ConsumeIntegralInRange<uint64_t>(0, 64); break;
    case 2: d.byte_offset = ~uint64_t{0} - in.ConsumeIntegralInRange<uint64_t>(0, 64); break;  // wraps
    default: d.byte_offset = in.ConsumeIntegral<uint64_t>(); break;
  }
  const size_t misalign = in.ConsumeIntegralInRange<size_t>(0, 3);
  // The memory the descriptor claims, exactly (heap: reads past it are ASan reports), else a token.
  const uint64_t claimed = claimed_bytes(d, uint64_t{1} << 20);
  const bool truthful = claimed > 0;
  std::vector<uint8_t> backing(misalign + (truthful ? claimed : 4));
  for (size_t i = 0; i < backing.size(); ++i) backing[i] = static_cast<uint8_t>(i * 31);
  d.data = in.ConsumeIntegralInRange(0, 31) == 0 ? nullptr : backing.data() + misalign;

  Producer producer;
  m.manager_ctx = &producer;
  m.deleter = [](DLManagedTensor* self) { static_cast<Producer*>(self->manager_ctx)->deleted++; };
  dpar_tensor* t = nullptr;
  const dpar_status rc = dpar_tensor_from_dlpack(&t, &m);
  if (rc != DPAR_OK) {
    check(rc == DPAR_ERR_INVALID_ARGUMENT || rc == DPAR_ERR_NOT_SUPPORTED, "undocumented status");
    check(t == nullptr && producer.deleted == 0, "a refusal touched the producer's tensor");
    return 0;
  }
  check(producer.deleted == 0, "the deleter ran while dpar holds the tensor");
  size_t numel = 0;
  dpar_device device{};
  check(dpar_tensor_info(nullptr, &numel, &device, t) == DPAR_OK, "info");
  check(device.kind == DPAR_DEVICE_CPU, "an accepted tensor on a device this build does not have");
  // What dpar.h promises of an accepted descriptor: data + byte_offset neither wraps nor spans more than
  // PTRDIFF_MAX bytes with the tensor, and is aligned to the 4-byte elements.
  const uint64_t bytes = uint64_t{numel} * 4;
  const auto base = reinterpret_cast<uintptr_t>(d.data);
  check(d.byte_offset <= static_cast<uint64_t>(PTRDIFF_MAX) - bytes, "accepted a span beyond PTRDIFF_MAX");
  check(d.byte_offset <= UINTPTR_MAX - base && bytes <= UINTPTR_MAX - base - d.byte_offset,
        "accepted a byte_offset that wraps around the address space");
  void* first = nullptr;
  check(dpar_tensor_data(&first, t) == DPAR_OK, "data");
  check(reinterpret_cast<uintptr_t>(first) == base + d.byte_offset, "the tensor does not start at data + byte_offset");
  check(reinterpret_cast<uintptr_t>(first) % 4 == 0, "accepted misaligned elements");
  if (truthful) {
    // Typed reads, as dpar's kernels make them (UBSan's alignment check sees a misaligned one).
    int64_t sum = 0;
    for (size_t i = 0; i < numel; ++i) sum += static_cast<const int32_t*>(first)[i];
    static volatile int64_t sink;
    sink = sum;  // keeps the reads
    // Every element, through dpar: outside the claimed memory is an ASan report, a misaligned one UBSan's.
    std::vector<uint8_t> out(numel * 4);
    check(dpar_tensor_copy_to_host(out.data(), t, out.size()) == DPAR_OK, "copy_to_host");
    check(std::memcmp(out.data(), static_cast<const uint8_t*>(d.data) + d.byte_offset, out.size()) == 0,
          "the tensor is not the descriptor's memory");
  }
  DLManagedTensor* exported = nullptr;
  check(dpar_tensor_to_dlpack(&exported, t) == DPAR_OK, "an imported tensor must export");
  dpar_tensor_free(t);
  check(producer.deleted == 0, "the deleter ran while an export still points into the memory");
  exported->deleter(exported);
  check(producer.deleted == 1, "the deleter did not run exactly once");
  return 0;
}
