// Internal errors: exceptions that carry a Status and a message with context.
// Only src/capi/ turns them into a status for a C caller.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

#include "common/status.h"

namespace dpar {

class Error : public std::runtime_error {
 public:
  Error(Status status, const std::string& message) : std::runtime_error(message), status_(status) {}
  Status status() const noexcept { return status_; }

 private:
  Status status_;
};

namespace detail {
template <class... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

// Throws Error(status, message built from args...).
template <class... Args>
[[noreturn]] void fail(Status status, const Args&... args) {
  throw Error(status, detail::concat(args...));
}

}  // namespace dpar

// DPAR_ENFORCE(cond, status, "message ", value, ...): an invariant or argument check that throws with context.
#define DPAR_ENFORCE(cond, status, ...)  \
  do {                                   \
    if (!(cond)) ::dpar::fail((status), __VA_ARGS__); \
  } while (0)

#define DPAR_CHECK_ARG(cond, ...) DPAR_ENFORCE(cond, ::dpar::Status::kInvalidArgument, __VA_ARGS__)
