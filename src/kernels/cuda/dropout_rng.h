// dpar's counter-based dropout stream, for host and device: the same integer arithmetic as
// cpu::dropout_uniform (kernels/cpu/kernels.cpp), so a CUDA replica draws exactly its CPU twin's masks.
// Included by CUDA code and by the tests (which check it against cpu::dropout_uniform on the host, GPU or not).
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define DPAR_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DPAR_HOST_DEVICE inline
#endif

namespace dpar::kernels::cuda::rng {

// splitmix64's output function (Steele, Lea, Flood 2014): a bijective 64-bit mixer.
DPAR_HOST_DEVICE uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

// The key of stream `seed` (mixed first, so that nearby seeds are unrelated streams).
DPAR_HOST_DEVICE uint64_t stream_key(uint64_t seed) { return mix64(seed ^ 0x243F6A8885A308D3ULL); }

// Draw `counter` of the stream with key `key`: the top 24 bits of splitmix64 at state key + (counter+1)*golden,
// as a float in [0, 1) (a multiple of 2^-24, exact).
DPAR_HOST_DEVICE float uniform24(uint64_t key, uint64_t counter) {
  const uint64_t h = mix64(key + (counter + 1) * kGolden);
  return static_cast<float>(static_cast<int32_t>(h >> 40)) * 0x1p-24f;
}

}  // namespace dpar::kernels::cuda::rng
