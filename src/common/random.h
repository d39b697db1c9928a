// Seeded random numbers. splitmix64 is a counter-based generator: a stream is (seed, counter), so a replica's
// RNG state is one integer that a checkpoint can save.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace dpar {

// splitmix64's output function (Steele, Lea, Flood 2014): a bijective 64-bit mixer. For host and device: the
// dropout stream (kernels/dropout_rng.h) draws with it inside CUDA kernels too.
DPAR_HOST_DEVICE inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// splitmix64's increment (odd, so counter -> state is 1:1).
constexpr uint64_t kSplitmixGolden = 0x9E3779B97F4A7C15ull;

inline uint64_t splitmix64(uint64_t x) { return mix64(x + kSplitmixGolden); }

// Mixes a seed with a stream number (replica, epoch) into an independent seed.
inline uint64_t derive_seed(uint64_t seed, uint64_t stream) { return splitmix64(seed ^ splitmix64(stream + 1)); }

class Rng {
 public:
  explicit Rng(uint64_t seed) : seed_(seed) {}
  uint64_t next() { return splitmix64(seed_ + counter_++ * kSplitmixGolden); }
  // Uniform in [0, 1) with 24 random bits (every float it returns is exact).
  float uniform() { return static_cast<float>(next() >> 40) * (1.0f / 16777216.0f); }
  float uniform(float lo, float hi) { return lo + (hi - lo) * uniform(); }
  // Uniform integer in [0, n) (n > 0), without modulo bias worth noticing for n << 2^64.
  uint64_t below(uint64_t n) {
    __extension__ typedef unsigned __int128 u128;  // the multiply-shift range reduction needs 128 bits
    return static_cast<uint64_t>((static_cast<u128>(next()) * n) >> 64);
  }

 private:
  uint64_t seed_;
  uint64_t counter_ = 0;
};

}  // namespace dpar
