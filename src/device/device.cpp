#include "device/device.h"

#include <sched.h>

#include <cstdlib>
#include <thread>

#include "common/error.h"

namespace dpar {

std::string Device::str() const {
  return std::string(kind == DeviceKind::kCpu ? "cpu:" : "cuda:") + std::to_string(index);
}

size_t default_cpu_device_count() {
  if (const char* env = std::getenv("DPAR_CPU_DEVICES")) {
    char* end = nullptr;
    long n = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && n > 0 && n <= 4096) return static_cast<size_t>(n);
  }
  // The cores this process may run on: under mpirun --bind-to core (OpenMPI's default for up to two ranks), or
  // taskset, that is fewer than the machine's, and one worker per allowed core is what fits.
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return static_cast<size_t>(CPU_COUNT(&set));
  unsigned cores = std::thread::hardware_concurrency();
  return cores > 0 ? cores : 1;
}

Device parse_device(const std::string& text) {
  auto colon = text.find(':');
  std::string kind = text.substr(0, colon);
  Device d;
  if (kind == "cpu") {
    d.kind = DeviceKind::kCpu;
  } else if (kind == "cuda") {
    d.kind = DeviceKind::kCuda;
  } else {
    fail(Status::kInvalidArgument, "device \"", text, "\": unknown kind (expected cpu or cuda)");
  }
  if (colon == std::string::npos) return d;
  std::string idx = text.substr(colon + 1);
  // Digits only, no sign, no spaces, no leading zeros: one spelling per device.
  const bool digits = !idx.empty() && idx.size() <= 7 && idx.find_first_not_of("0123456789") == std::string::npos &&
                      (idx.size() == 1 || idx[0] != '0');
  DPAR_CHECK_ARG(digits, "device \"", text, "\": index must be a non-negative integer");
  long v = std::strtol(idx.c_str(), nullptr, 10);
  d.index = static_cast<int32_t>(v);
  return d;
}

}  // namespace dpar
