// The core's status codes: what every dpar::Error carries. The numbers are those the C ABI returns (src/capi/codes.h
// checks that each one equals its C twin), so a shipped code never changes its number; 0 is success, errors are
// negative.
#pragma once

#include <cstdint>
#include <ostream>

namespace dpar {

enum class Status : int32_t {
  kOk = 0,
  kInvalidArgument = -1,  // an argument or handle is null, freed, out of range or inconsistent
  kOutOfMemory = -2,      // an allocation failed (host or device)
  kDevice = -3,           // a device failed, or a device kind is not built into this library
  kCommunication = -4,    // a collective failed locally
  kRemote = -5,           // another participant (worker, rank) failed; this one stopped waiting
  kTimeout = -6,          // a participant did not arrive within the timeout
  kMismatch = -7,         // participants disagree (shapes, operation, sizes, a checkpoint's model)
  kIo = -8,               // a file could not be opened, read or written
  kCorrupt = -9,          // a file's content is malformed, truncated or fails its checksum
  kNotSupported = -10,    // the feature is not built or not available here
  kInvalidState = -11,    // the call is not allowed now (e.g. the engine must be recreated)
  kInternal = -12,        // a bug in dpar
};

// A short name for messages and test output, such as "timeout".
inline const char* status_name(Status status) {
  switch (status) {
    case Status::kOk: return "ok";
    case Status::kInvalidArgument: return "invalid argument";
    case Status::kOutOfMemory: return "out of memory";
    case Status::kDevice: return "device";
    case Status::kCommunication: return "communication";
    case Status::kRemote: return "remote";
    case Status::kTimeout: return "timeout";
    case Status::kMismatch: return "mismatch";
    case Status::kIo: return "io";
    case Status::kCorrupt: return "corrupt";
    case Status::kNotSupported: return "not supported";
    case Status::kInvalidState: return "invalid state";
    case Status::kInternal: return "internal";
  }
  return "unknown";
}

inline std::ostream& operator<<(std::ostream& os, Status status) {
  return os << status_name(status) << " (" << static_cast<int32_t>(status) << ")";
}

}  // namespace dpar
