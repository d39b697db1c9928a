// Shared by the fuzz harnesses: the input as a file (the readers under test take paths, as dpar's callers give
// them), and the rule that a refusal is a dpar::Error and nothing else.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/error.h"

namespace dpar::fuzz {

// One file per fuzzing process, rewritten for every input (in /dev/shm where it exists: no disk traffic).
inline const std::string& scratch_path(const char* name) {
  static const std::string path = [name] {
    const char* dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    return std::string(dir) + "/dpar_" + name + "." + std::to_string(getpid());
  }();
  return path;
}

inline void write_input(const std::string& path, const uint8_t* data, size_t size) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (size && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
}

// A refusal must be a dpar::Error with a status the reader documents; anything else (another exception type, an
// internal error) is a finding, and aborting makes libFuzzer keep the input.
template <class F>
void expect_only_documented_errors(F&& body, std::initializer_list<Status> allowed) {
  try {
    body();
  } catch (const Error& e) {
    for (Status s : allowed)
      if (e.status() == s) return;
    std::fprintf(stderr, "undocumented status %d: %s\n", static_cast<int>(e.status()), e.what());
    std::abort();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "unexpected exception: %s\n", e.what());
    std::abort();
  }
}

}  // namespace dpar::fuzz
