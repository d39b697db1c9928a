// Devices: a kind and an index. cpu:K is a virtual device (one worker thread); cuda:K a GPU.
#pragma once

#include <cstdint>
#include <string>

namespace dpar {

// The numbers are the C ABI's (src/capi/codes.h checks them).
enum class DeviceKind : int32_t { kCpu = 0, kCuda = 1 };

struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int32_t index = 0;

  bool is_host() const { return kind == DeviceKind::kCpu; }
  std::string str() const;
  bool operator==(const Device& o) const { return kind == o.kind && index == o.index; }
};

// DPAR_CPU_DEVICES if set to a positive integer, else the number of cores.
size_t default_cpu_device_count();
// Parses "cpu", "cpu:3", "cuda:0".
Device parse_device(const std::string& text);

}  // namespace dpar
