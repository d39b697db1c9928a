// Status names, the thread-local last error, versions and the live-handle registry.
#include <mutex>
#include <shared_mutex>
#include <unordered_map>

#include "backend/backend.h"
#include "capi/api.h"

namespace dpar::capi {
namespace {
// A fixed buffer: reporting an error, out-of-memory included, never allocates.
thread_local char tl_last_error[2048] = "";

std::shared_mutex& registry_mutex() {
  static std::shared_mutex m;
  return m;
}
// Destroyed when the library is unloaded (a host may dlclose it): a leaked map would be a leak for every host
// that loads and unloads dpar.
std::unordered_map<const void*, HandleKind>& registry() {
  static std::unordered_map<const void*, HandleKind> r;
  return r;
}
}  // namespace

void set_last_error(const char* message) {
  size_t n = std::strlen(message);
  if (n >= sizeof(tl_last_error)) n = sizeof(tl_last_error) - 1;
  std::memcpy(tl_last_error, message, n);
  tl_last_error[n] = '\0';
}

void register_handle(const void* handle, HandleKind kind) {
  std::unique_lock lock(registry_mutex());
  registry()[handle] = kind;
}

void unregister_handle(const void* handle) {
  std::unique_lock lock(registry_mutex());
  registry().erase(handle);
}

bool take_handle(const void* handle, HandleKind kind, const std::function<bool()>& may_take) {
  std::unique_lock lock(registry_mutex());
  auto it = registry().find(handle);
  if (it == registry().end() || it->second != kind) return false;
  if (may_take && !may_take()) return false;
  registry().erase(it);
  return true;
}

LiveHandleGuard::LiveHandleGuard() : lock_(registry_mutex()) {}

bool LiveHandleGuard::live(const void* handle, HandleKind kind) const {
  auto it = registry().find(handle);
  return it != registry().end() && it->second == kind;
}

bool is_live(const void* handle, HandleKind kind) {
  std::shared_lock lock(registry_mutex());
  auto it = registry().find(handle);
  return it != registry().end() && it->second == kind;
}

}  // namespace dpar::capi

extern "C" {

DPAR_API int32_t dpar_version(void) { return DPAR_VERSION; }

DPAR_API const char* dpar_version_string(void) {
#define DPAR_STR2(x) #x
#define DPAR_STR(x) DPAR_STR2(x)
  return DPAR_STR(DPAR_VERSION_MAJOR) "." DPAR_STR(DPAR_VERSION_MINOR) "." DPAR_STR(DPAR_VERSION_PATCH);
}

DPAR_API const char* dpar_cpu_gemm_backend(void) {
  // dpar.h promises static storage: a plain buffer, which no destructor ever frees, so that a thread still running
  // at exit, or an atexit handler registered before the first call (whose handler runs after the destructors of
  // statics made later), still reads the text. The backend's text is about 90 bytes.
  static char text[512];
  try {
    static const bool filled = [] {
      const std::string what = dpar::backend_for(dpar::DeviceKind::kCpu).math_library();
      const size_t n = std::min(what.size(), sizeof(text) - 1);
      std::memcpy(text, what.data(), n);
      text[n] = '\0';
      return true;
    }();
    (void)filled;
    return text;
  } catch (...) {  // building the string cannot fail short of memory; the ABI still promises a string
    return "unknown (out of memory describing the CPU GEMM)";
  }
}

DPAR_API const char* dpar_last_error(void) { return dpar::capi::tl_last_error; }

DPAR_API void dpar_clear_error(void) { dpar::capi::tl_last_error[0] = '\0'; }

DPAR_API dpar_status dpar_set_error(dpar_status status, const char* message) {
  dpar::capi::set_last_error(message ? message : "");
  return status;
}

DPAR_API const char* dpar_status_str(dpar_status status) {
  switch (status) {
    case DPAR_OK: return "DPAR_OK";
    case DPAR_ERR_INVALID_ARGUMENT: return "DPAR_ERR_INVALID_ARGUMENT";
    case DPAR_ERR_OUT_OF_MEMORY: return "DPAR_ERR_OUT_OF_MEMORY";
    case DPAR_ERR_DEVICE: return "DPAR_ERR_DEVICE";
    case DPAR_ERR_COMMUNICATION: return "DPAR_ERR_COMMUNICATION";
    case DPAR_ERR_REMOTE: return "DPAR_ERR_REMOTE";
    case DPAR_ERR_TIMEOUT: return "DPAR_ERR_TIMEOUT";
    case DPAR_ERR_MISMATCH: return "DPAR_ERR_MISMATCH";
    case DPAR_ERR_IO: return "DPAR_ERR_IO";
    case DPAR_ERR_CORRUPT: return "DPAR_ERR_CORRUPT";
    case DPAR_ERR_NOT_SUPPORTED: return "DPAR_ERR_NOT_SUPPORTED";
    case DPAR_ERR_INVALID_STATE: return "DPAR_ERR_INVALID_STATE";
    case DPAR_ERR_INTERNAL: return "DPAR_ERR_INTERNAL";
  }
  return "DPAR_ERR_UNKNOWN";
}

}  // extern "C"
