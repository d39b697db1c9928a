// Whether a GPU test that finds no CUDA device must fail rather than skip. scripts/check_gpu.sh sets
// DPAR_TEST_REQUIRE_GPU where nvidia-smi sees a GPU: there "no device" means dpar failed to find the GPU (a driver
// too old for the runtime, a runtime that did not load), a fault that a skip would hide. Unset (CI, development
// machines without a GPU), such a test skips with the reason, as DPAR_TEST_REQUIRE_DEPS does for other missing
// dependencies.
#pragma once

#include <cstdlib>

namespace dpar::test {

inline bool gpu_required() {
  const char* required = std::getenv("DPAR_TEST_REQUIRE_GPU");
  return required != nullptr && *required != '\0';
}

}  // namespace dpar::test
