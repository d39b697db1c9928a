// dpar's counter-based dropout stream, one definition for the CPU kernels and the CUDA kernels (host and device
// code alike), so that a CUDA replica draws exactly its CPU twin's masks: element i of a dropout call with (seed,
// offset) is kept iff uniform24(stream_key(seed), offset + i) >= p.
#pragma once

#include <cstdint>

#include "common/host_device.h"
#include "common/random.h"

namespace dpar::kernels::rng {

// The key of stream `seed`. Mixing the seed first keeps nearby seeds (seed, seed+1, ...) from being shifted copies
// of one splitmix64 sequence; the constant keeps seed 0 from mapping to state 0.
DPAR_HOST_DEVICE inline uint64_t stream_key(uint64_t seed) { return mix64(seed ^ 0x243F6A8885A308D3ULL); }

// Draw `counter` of the stream with key `key`: splitmix64's output for state key + (counter+1)*golden, i.e. a
// counter-based generator. The top 24 bits give a float in [0, 1) exactly (a multiple of 2^-24).
DPAR_HOST_DEVICE inline float uniform24(uint64_t key, uint64_t counter) {
  const uint64_t h = mix64(key + (counter + 1) * kSplitmixGolden);
  return static_cast<float>(static_cast<int32_t>(h >> 40)) * 0x1p-24f;
}

}  // namespace dpar::kernels::rng
