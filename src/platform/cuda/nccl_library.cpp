#include "platform/cuda/nccl_library.h"

#include <dlfcn.h>

#include <mutex>

#include "common/error.h"
#include "platform/cuda/library_loading.h"

namespace dpar::cuda {
namespace {

constexpr const char* kSoname = "libnccl.so.2";

// Every function of NcclLibrary from `handle`; the names of those missing.
std::vector<std::string> resolve_all(void* handle, NcclLibrary& lib) {
  std::vector<std::string> missing;
  resolve(handle, "ncclGetVersion", lib.get_version, missing);
  resolve(handle, "ncclGetErrorString", lib.error_string, missing);
  resolve(handle, "ncclGetLastError", lib.last_error, missing);
  resolve(handle, "ncclGetUniqueId", lib.get_unique_id, missing);
  resolve(handle, "ncclCommInitRankConfig", lib.comm_init_rank_config, missing);
  resolve(handle, "ncclCommGetAsyncError", lib.comm_get_async_error, missing);
  resolve(handle, "ncclCommAbort", lib.comm_abort, missing);
  resolve(handle, "ncclGroupStart", lib.group_start, missing);
  resolve(handle, "ncclGroupEnd", lib.group_end, missing);
  resolve(handle, "ncclAllReduce", lib.all_reduce, missing);
  resolve(handle, "ncclBroadcast", lib.broadcast, missing);
  resolve(handle, "ncclReduce", lib.reduce, missing);
  resolve(handle, "ncclAllGather", lib.all_gather, missing);
  resolve(handle, "ncclReduceScatter", lib.reduce_scatter, missing);
  return missing;
}

// The directory of the libnccl that CMake found when dpar was built, with a trailing slash; empty if none.
std::string build_directory() {
#ifdef DPAR_NCCL_LIBRARY_DIR
  const std::string dir = DPAR_NCCL_LIBRARY_DIR;
  return dir.empty() || dir.back() == '/' ? dir : dir + "/";
#else
  return {};
#endif
}

}  // namespace

std::string nccl_version_string(int code) {
  // NCCL_VERSION's two encodings: major * 1000 + minor * 100 + patch up to 2.8, major * 10000 + ... from 2.9.
  const bool wide = code >= 10000;
  const int major = wide ? code / 10000 : code / 1000;
  const int minor = wide ? code % 10000 / 100 : code % 1000 / 100;
  const int patch = code % 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

namespace loader {

std::vector<NcclCandidate> nccl_candidates() {
  std::vector<NcclCandidate> candidates{{kSoname, true}, {kSoname, false}};
  for (const std::string& dir : {build_directory(), toolkit_library_directory()}) {
    if (dir.empty()) continue;
    bool seen = false;
    for (const NcclCandidate& c : candidates) seen = seen || c.file == dir + kSoname;
    if (!seen) candidates.push_back({dir + kSoname, false});
  }
  return candidates;
}

NcclLibrary load_nccl(const std::vector<NcclCandidate>& candidates, int minimum_version) {
  const std::string minimum = nccl_version_string(minimum_version);
  std::string tried;
  auto note = [&](const std::string& place, const std::string& why) {
    tried += (tried.empty() ? "" : "; ") + place + ": " + why;
  };
  for (const NcclCandidate& candidate : candidates) {
    const std::string place = candidate.in_process_only ? candidate.file + " (in the process)" : candidate.file;
    const int mode = RTLD_NOW | RTLD_LOCAL | (candidate.in_process_only ? RTLD_NOLOAD : 0);
    void* handle = dlopen(candidate.file.c_str(), mode);
    if (handle == nullptr) {
      const char* why = dlerror();
      note(place, candidate.in_process_only ? std::string("none loaded") : std::string(why ? why : "not loadable"));
      continue;
    }
    NcclLibrary lib;
    const std::vector<std::string> missing = resolve_all(handle, lib);
    std::string refusal;
    if (!missing.empty()) {
      refusal = "lacks " + join_names(missing);
    } else if (lib.get_version(&lib.version) != ncclSuccess) {
      refusal = "ncclGetVersion failed";
    } else if (lib.version < minimum_version) {
      refusal = "is NCCL " + nccl_version_string(lib.version) + ", older than " + minimum + ", which dpar needs";
    }
    if (!refusal.empty()) {
      const std::string file = lib.get_version != nullptr
                                   ? file_of(reinterpret_cast<const void*>(lib.get_version), candidate.file)
                                   : candidate.file;
      dlclose(handle);
      // One found in the process ends the search: loading another NCCL beside a framework's (from another path)
      // would give the process two copies with separate state.
      if (candidate.in_process_only)
        fail(Status::kNotSupported, "NCCL ", minimum, " or later, which collectives between GPUs need, is not usable: ",
             "the ", candidate.file, " already in the process (", file, ") ", refusal,
             ". Another library loaded it before dpar asked for NCCL, and dpar does not load a second one beside it: ",
             "load a newer NCCL first, or none, and dpar loads its own");
      note(place, file == candidate.file ? refusal : file + " " + refusal);
      continue;
    }
    lib.path = file_of(reinterpret_cast<const void*>(lib.get_version), candidate.file);
    lib.already_loaded = candidate.in_process_only;
    return lib;  // the handle stays open for the life of the process
  }
  fail(Status::kNotSupported, "NCCL ", minimum, " or later, which collectives between GPUs need, could not be loaded (",
       tried.empty() ? std::string("no file to try") : tried,
       "): install NCCL (NVIDIA's libnccl2 package, or pip's nvidia-nccl-cu*), or add the directory of its ", kSoname,
       " to LD_LIBRARY_PATH");
}

}  // namespace loader

const NcclLibrary& nccl() {
  // call_once runs the load again on a later call when it threw; once it returned, a call is one atomic load.
  static std::once_flag once;
  static NcclLibrary loaded;
  std::call_once(once, [] { loaded = loader::load_nccl(loader::nccl_candidates()); });
  return loaded;
}

}  // namespace dpar::cuda
