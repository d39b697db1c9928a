// The ABI boundary: handle structs, handle checks, option-struct versioning, and the guard that turns every
// exception into a status and a thread-local message. Only src/capi/ knows that a C caller exists.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <functional>
#include <iterator>
#include <string>
#include <atomic>
#include <memory>
#include <mutex>
#include <new>
#include <shared_mutex>
#include <vector>

#include "backend/backend.h"
#include "capi/codes.h"
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
  std::unique_ptr<dpar::ReplicaSet> set;     // over the communicator (and the processes, when given)
  float scale = 1.0f;                        // on every sum: 1, or 1 / replicas for DPAR_MEAN
  std::unique_ptr<dpar::Reducer> reducer;    // last: destroyed first, while the set, communicator and stream live
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

// A device from a C caller: a built kind, a non-negative index, and (for kinds with real devices) one that exists.
Device checked_device(dpar_device device, const char* argument);

// Bucket sizes from an options struct: 0 keeps the default.
inline BucketOptions bucket_options(size_t first_bucket_bytes, size_t bucket_cap_bytes) {
  BucketOptions b;
  if (first_bucket_bytes) b.first_bucket_bytes = first_bucket_bytes;
  if (bucket_cap_bytes) b.bucket_cap_bytes = bucket_cap_bytes;
  return b;
}

// Every versioned struct of dpar.h: its defaults, the size of each version's layout, version 1 first (the
// current version is the last), and the version that the unsized X_init() symbol writes. A struct grows only by
// appending fields, so the first `layout` bytes of the defaults are the defaults of that version.
//
// The unsized symbol is what programs built against dpar.h 0.4 or older call (later headers make X_init a macro
// over X_init_sized): it writes the layout those headers declared, forever, so that a struct grown later does
// not overrun them. A layout's size is the sizeof of the struct as that version declared it: where the first
// appended field is aligned as strictly as the struct, that is the field's offset (as in dpar_engine_options).
template <class T>
struct Versioned;
template <>
struct Versioned<dpar_model_options> {
  static constexpr const char* name = "dpar_model_options";
  static dpar_model_options defaults() { return DPAR_MODEL_OPTIONS_INIT; }
  static constexpr size_t layouts[] = {sizeof(dpar_model_options)};
  static constexpr uint32_t unsized_init_version = 1;
};
template <>
struct Versioned<dpar_custom_layer> {
  static constexpr const char* name = "dpar_custom_layer";
  static dpar_custom_layer defaults() { return DPAR_CUSTOM_LAYER_INIT; }
  static constexpr size_t layouts[] = {sizeof(dpar_custom_layer)};
  static constexpr uint32_t unsized_init_version = 1;
};
template <>
struct Versioned<dpar_optimizer_options> {
  static constexpr const char* name = "dpar_optimizer_options";
  static dpar_optimizer_options defaults() { return DPAR_OPTIMIZER_OPTIONS_INIT; }
  static constexpr size_t layouts[] = {sizeof(dpar_optimizer_options)};
  static constexpr uint32_t unsized_init_version = 1;
};
template <>
struct Versioned<dpar_engine_options> {
  static constexpr const char* name = "dpar_engine_options";
  static dpar_engine_options defaults() { return DPAR_ENGINE_OPTIONS_INIT; }
  // Version 1 ended before first_bucket_bytes, version 2 before create_timeout_seconds.
  static constexpr size_t layouts[] = {offsetof(dpar_engine_options, first_bucket_bytes),
                                       offsetof(dpar_engine_options, create_timeout_seconds),
                                       sizeof(dpar_engine_options)};
  static constexpr uint32_t unsized_init_version = 2;  // dpar.h 0.4's
  static_assert(offsetof(dpar_engine_options, first_bucket_bytes) % alignof(dpar_engine_options) == 0,
                "version 1's sizeof is no longer the offset of version 2's first field");
  static_assert(offsetof(dpar_engine_options, create_timeout_seconds) % alignof(dpar_engine_options) == 0,
                "version 2's sizeof is no longer the offset of version 3's first field");
};
template <>
struct Versioned<dpar_comm_options> {
  static constexpr const char* name = "dpar_comm_options";
  static dpar_comm_options defaults() { return DPAR_COMM_OPTIONS_INIT; }
  static constexpr size_t layouts[] = {sizeof(dpar_comm_options)};
  static constexpr uint32_t unsized_init_version = 1;
};
template <>
struct Versioned<dpar_reducer_options> {
  static constexpr const char* name = "dpar_reducer_options";
  static dpar_reducer_options defaults() { return DPAR_REDUCER_OPTIONS_INIT; }
  // Version 1 ended before processes.
  static constexpr size_t layouts[] = {offsetof(dpar_reducer_options, processes), sizeof(dpar_reducer_options)};
  static constexpr uint32_t unsized_init_version = 1;  // dpar.h 0.4's
  static_assert(offsetof(dpar_reducer_options, processes) % alignof(dpar_reducer_options) == 0,
                "version 1's sizeof is no longer the offset of version 2's first field");
};

template <class T>
constexpr uint32_t current_version() {
  return static_cast<uint32_t>(std::size(Versioned<T>::layouts));
}
// Every version's layout is larger than the one before (a size names one version) and the unsized symbol's
// version exists.
template <class T>
constexpr bool layouts_are_sound() {
  for (size_t v = 1; v < std::size(Versioned<T>::layouts); ++v)
    if (Versioned<T>::layouts[v] <= Versioned<T>::layouts[v - 1]) return false;
  return Versioned<T>::unsized_init_version >= 1 && Versioned<T>::unsized_init_version <= current_version<T>();
}
static_assert(layouts_are_sound<dpar_model_options>() && layouts_are_sound<dpar_custom_layer>() &&
              layouts_are_sound<dpar_optimizer_options>() && layouts_are_sound<dpar_engine_options>() &&
              layouts_are_sound<dpar_comm_options>() && layouts_are_sound<dpar_reducer_options>());
static_assert(current_version<dpar_model_options>() == DPAR_MODEL_OPTIONS_VERSION &&
              current_version<dpar_custom_layer>() == DPAR_CUSTOM_LAYER_VERSION &&
              current_version<dpar_optimizer_options>() == DPAR_OPTIMIZER_OPTIONS_VERSION &&
              current_version<dpar_engine_options>() == DPAR_ENGINE_OPTIONS_VERSION &&
              current_version<dpar_comm_options>() == DPAR_COMM_OPTIONS_VERSION &&
              current_version<dpar_reducer_options>() == DPAR_REDUCER_OPTIONS_VERSION,
              "a struct's version grew without its layout's size");

// Reads a versioned options struct: NULL gives the defaults; fields the caller's version predates keep them.
// A size smaller than its version's layout is a struct that was never initialised: refused, for every version
// alike.
template <class T>
T read_options(const T* user, const char* argument) {
  using V = Versioned<T>;
  constexpr uint32_t current = current_version<T>();
  if (!user) return V::defaults();
  DPAR_CHECK_ARG(user->version >= 1 && user->version <= current, argument, ": unknown version ", user->version,
                 " (this dpar knows 1 to ", current, "; use the _INIT macro or _init())");
  const size_t layout = V::layouts[user->version - 1];
  DPAR_CHECK_ARG(user->size >= layout, argument, ": size ", user->size, " is too small for version ", user->version,
                 " (expected at least ", layout, "; use the _INIT macro or _init())");
  T out = V::defaults();
  std::memcpy(static_cast<void*>(&out), user, layout);
  out.size = sizeof(T);
  out.version = current;
  return out;
}

// Fills the caller's struct with the defaults of the version whose layout is `size` bytes, writing those bytes and
// no more: a program compiled against an older dpar.h passes its own, smaller sizeof. A size of no version's
// layout is refused: larger than the newest one, the program was compiled against a newer dpar.h than this library.
template <class T>
void init_options(T* opts, size_t size, const char* argument);

// What the unsized X_init() symbol does: the layout of the version it has always written.
template <class T>
void init_unsized_options(T* opts, const char* argument) {
  init_options(opts, Versioned<T>::layouts[Versioned<T>::unsized_init_version - 1], argument);
}

template <class T>
void init_options(T* opts, size_t size, const char* argument) {
  using V = Versioned<T>;
  constexpr uint32_t current = current_version<T>();
  DPAR_CHECK_ARG(opts != nullptr, argument, ": is NULL");
  uint32_t version = 0;
  for (uint32_t v = 1; v <= current; ++v)
    if (V::layouts[v - 1] == size) version = v;
  if (version == 0) {
    std::string known;
    for (uint32_t v = 1; v <= current; ++v)
      known += (v > 1 ? ", " : "") + std::to_string(V::layouts[v - 1]) + " (version " + std::to_string(v) + ")";
    DPAR_ENFORCE(size <= V::layouts[current - 1], Status::kNotSupported, "size: ", V::name, " is ", size,
                 " bytes in the caller, larger than any layout this dpar (", DPAR_VERSION_MAJOR, ".",
                 DPAR_VERSION_MINOR, ".", DPAR_VERSION_PATCH, ") knows: ", known,
                 "; the program was compiled against a newer dpar.h than the library it runs with");
    fail(Status::kInvalidArgument, "size: ", size, " bytes is no layout of ", V::name, ": this dpar knows ", known,
         "; pass sizeof(", V::name, ")");
  }
  T defaults = V::defaults();
  defaults.size = size;
  defaults.version = version;
  std::memcpy(static_cast<void*>(opts), &defaults, size);
}

void set_last_error(const char* message);

// Runs body; turns any exception into a status and the calling thread's last error.
template <class F>
dpar_status guard(F&& body) noexcept {
  try {
    body();
    return to_c(Status::kOk);
  } catch (const Error& e) {
    set_last_error(e.what());
    return to_c(e.status());
  } catch (const std::bad_alloc&) {
    set_last_error("out of memory");
    return to_c(Status::kOutOfMemory);
  } catch (const std::exception& e) {
    set_last_error(e.what());
    return to_c(Status::kInternal);
  } catch (...) {
    set_last_error("unknown exception");
    return to_c(Status::kInternal);
  }
}

// The custom-layer bridge (custom_layer.cpp).
std::unique_ptr<Layer> make_custom_layer(const dpar_custom_layer& desc);

}  // namespace dpar::capi
