// The ABI boundary: handle structs, handle checks, option-struct versioning, and the guard that turns every
// exception into a status and a thread-local message. Only src/capi/ knows that a C caller exists.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <atomic>
#include <memory>
#include <mutex>
#include <new>
#include <shared_mutex>
#include <vector>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "comm/threads_comm.h"
#include "common/error.h"
#include "dpar.h"
#include "engine/engine.h"
#include "io/dataset.h"
#include "nn/model.h"
#include "reducer/reducer.h"
#include "tensor/tensor.h"

struct dpar_tensor {
  dpar::Tensor tensor;
  bool owned_by_parent = false;  // a loader's batch or a custom layer's argument: dpar_tensor_free ignores it
  std::shared_ptr<void> external;  // what the memory belongs to (a DLPack tensor), released with the handle
};
struct dpar_model {
  explicit dpar_model(uint64_t seed) : model(seed) {}
  dpar::Model model;
};
struct dpar_engine {
  // Shared with the calls in flight: dpar_engine_free on one thread while another is inside a call leaves the
  // engine alive until that call returns.
  std::shared_ptr<dpar::Engine> engine;
};
struct dpar_dataset {
  std::shared_ptr<dpar::io::Dataset> dataset;  // shared with loaders, so either may be freed first
};
struct dpar_loader {
  template <class... Args>
  explicit dpar_loader(Args&&... args) : loader(std::forward<Args>(args)...) {}
  dpar::io::Loader loader;
  dpar_tensor inputs, labels;
  bool has_batch = false;  // the last dpar_loader_next found a batch
};

struct dpar_comm_group {
  std::shared_ptr<dpar::Group> group;  // shared with its members, so they may be freed in any order
  std::vector<dpar::Device> devices;   // participant r's buffers are memory of devices[r]
  std::vector<void*> streams;          // participant r's collectives are ordered on the caller's streams[r]
};
struct dpar_comm {
  std::shared_ptr<dpar::Group> group;        // null for MPI
  std::shared_ptr<dpar::Communicator> comm;  // shared with reducers, so either may be freed first
  dpar::Device device;                       // where its buffers are (cpu:0: host memory)
  void* stream = nullptr;                    // the caller's stream its collectives are ordered on
  std::atomic<bool> async_started{false};    // an asynchronous collective was started: see run_blocking
};
struct dpar_reducer {
  std::shared_ptr<dpar::Group> group;  // what the communicator needs alive (null for MPI)
  std::shared_ptr<dpar::Communicator> comm;
  std::mutex mutex;                          // the reducer's calls may come from several threads
  bool in_step = false;                      // a grad_ready since the last wait
  std::unique_ptr<dpar::Stream> stream;      // the reducer's staging copies
  std::unique_ptr<dpar::Reducer> reducer;    // last: destroyed first, while the communicator and stream live
};
struct dpar_work {
  std::shared_ptr<dpar::Work> work;
};

namespace dpar::capi {

enum class HandleKind : uint8_t { kTensor, kModel, kEngine, kDataset, kLoader, kCommGroup, kComm, kWork, kReducer };

// Live handles, so that a NULL, freed or foreign pointer is refused with a message instead of crashing.
void register_handle(const void* handle, HandleKind kind);
void unregister_handle(const void* handle);
bool is_live(const void* handle, HandleKind kind);
// Unregisters a live handle of this kind in one step, so that of two threads freeing the same handle exactly one
// gets true and deletes it. `may_take` (optional) runs under the registry's lock, while the handle is certainly
// alive, and can keep the handle (a tensor owned by its parent); false: not live, or kept.
bool take_handle(const void* handle, HandleKind kind, const std::function<bool()>& may_take = nullptr);

// Holds the registry's shared lock: a handle found live through it cannot be unregistered (freed) until the guard
// is gone, so the caller can take a strong reference to what the handle owns.
class LiveHandleGuard {
 public:
  LiveHandleGuard();
  bool live(const void* handle, HandleKind kind) const;

 private:
  std::shared_lock<std::shared_mutex> lock_;
};

template <class H> HandleKind kind_of();
template <> inline HandleKind kind_of<dpar_tensor>() { return HandleKind::kTensor; }
template <> inline HandleKind kind_of<dpar_model>() { return HandleKind::kModel; }
template <> inline HandleKind kind_of<dpar_engine>() { return HandleKind::kEngine; }
template <> inline HandleKind kind_of<dpar_dataset>() { return HandleKind::kDataset; }
template <> inline HandleKind kind_of<dpar_loader>() { return HandleKind::kLoader; }
template <> inline HandleKind kind_of<dpar_comm_group>() { return HandleKind::kCommGroup; }
template <> inline HandleKind kind_of<dpar_comm>() { return HandleKind::kComm; }
template <> inline HandleKind kind_of<dpar_work>() { return HandleKind::kWork; }
template <> inline HandleKind kind_of<dpar_reducer>() { return HandleKind::kReducer; }

template <class H>
H& checked(H* handle, const char* argument) {
  DPAR_CHECK_ARG(handle != nullptr, argument, ": handle is NULL");
  DPAR_CHECK_ARG(is_live(handle, kind_of<std::remove_const_t<H>>()), argument,
                 ": not a live handle of this type (freed already, or never created by dpar)");
  return *handle;
}

template <class P>
P* checked_out(P* out, const char* argument = "out") {
  DPAR_CHECK_ARG(out != nullptr, argument, ": output pointer is NULL");
  return out;
}

// Creates a handle and registers it.
template <class H, class... Args>
H* new_handle(Args&&... args) {
  auto h = std::make_unique<H>(std::forward<Args>(args)...);
  register_handle(h.get(), kind_of<H>());
  return h.release();
}
template <class H>
void free_handle(H* handle) {
  if (handle && take_handle(handle, kind_of<H>())) delete handle;
}

// A device kind from a C caller: unknown kinds are invalid; kinds not built into this library are not supported.
DeviceKind checked_device_kind(int32_t kind, const char* argument);
// A device from a C caller: a built kind, a non-negative index, and (for kinds with real devices) one that exists.
Device checked_device(dpar_device device, const char* argument);

// Bucket sizes from an options struct: 0 keeps the default.
inline BucketOptions bucket_options(size_t first_bucket_bytes, size_t bucket_cap_bytes) {
  BucketOptions b;
  if (first_bucket_bytes) b.first_bucket_bytes = first_bucket_bytes;
  if (bucket_cap_bytes) b.bucket_cap_bytes = bucket_cap_bytes;
  return b;
}

// Reads a versioned options struct: NULL gives the defaults; fields the caller's version predates keep them.
// `version_sizes` lists the size of each version's layout, version 1 first (empty: a struct with one version,
// sizeof(T)). A size smaller than its version's layout is a struct that was never initialised: refused, for
// every version alike.
template <class T>
T read_options(const T* user, const T& defaults, unsigned current_version, const char* argument,
               std::initializer_list<size_t> version_sizes = {}) {
  if (!user) return defaults;
  DPAR_CHECK_ARG(user->version >= 1 && user->version <= current_version, argument, ": unknown version ",
                 user->version, " (this dpar knows 1 to ", current_version, "; use the _INIT macro or _init())");
  DPAR_ENFORCE(version_sizes.size() == 0 || version_sizes.size() == current_version, DPAR_ERR_INTERNAL, argument,
               ": the layout sizes do not match the version");
  const size_t layout = version_sizes.size() == 0 ? sizeof(T) : version_sizes.begin()[user->version - 1];
  DPAR_CHECK_ARG(user->size >= layout, argument, ": size ", user->size, " is too small for version ", user->version,
                 " (expected at least ", layout, "; use the _INIT macro or _init())");
  T out = defaults;
  std::memcpy(static_cast<void*>(&out), user, layout);
  out.size = sizeof(T);
  out.version = current_version;
  return out;
}

void set_last_error(const char* message);

// Runs body; turns any exception into a status and the calling thread's last error.
template <class F>
dpar_status guard(F&& body) noexcept {
  try {
    body();
    return DPAR_OK;
  } catch (const Error& e) {
    set_last_error(e.what());
    return e.status();
  } catch (const std::bad_alloc&) {
    set_last_error("out of memory");
    return DPAR_ERR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    set_last_error(e.what());
    return DPAR_ERR_INTERNAL;
  } catch (...) {
    set_last_error("unknown exception");
    return DPAR_ERR_INTERNAL;
  }
}

// The custom-layer bridge (custom_layer.cpp).
std::unique_ptr<Layer> make_custom_layer(const dpar_custom_layer& desc);

}  // namespace dpar::capi
