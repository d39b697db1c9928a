// NCCL, loaded on first use as cuBLAS and cuDNN are (cublas_library.h, cudnn_library.h), never linked. dpar shares
// processes with frameworks that bring their own NCCL (PyTorch's wheels carry nvidia-nccl): a libdpar that named
// libnccl.so.2 as a load-time dependency mapped the CUDA toolkit's NCCL under the soname theirs has too, and a
// framework loaded after dpar then bound to that one (PyTorch's libtorch_cuda failed to load: "undefined symbol:
// ncclCommResume"). Now the first collective between GPUs looks for the libnccl.so.2 already in the process and
// uses that one, and loads one only where there is none. Only nccl.h is needed to build.
#pragma once

#include <nccl.h>

#include <string>
#include <vector>

namespace dpar::cuda {

// The oldest NCCL dpar runs with: 2.14, the first with ncclCommInitRankConfig, ncclConfig_t's `blocking` and
// ncclInProgress, on which every dpar communicator is built (non-blocking, so that an abort reaches a call in
// progress). A newer nccl.h's ncclConfig_t is read by an older NCCL up to its own size (the struct's first field).
constexpr int kMinimumNcclVersion = NCCL_VERSION(2, 14, 0);

// "2.28.3" for ncclGetVersion's code (major * 10000 + minor * 100 + patch since 2.9; major * 1000 + ... before).
std::string nccl_version_string(int code);

// The NCCL functions dpar calls, with the types of nccl.h's declarations.
struct NcclLibrary {
  decltype(&ncclGetVersion) get_version = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  decltype(&ncclGetLastError) last_error = nullptr;
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRankConfig) comm_init_rank_config = nullptr;
  decltype(&ncclCommGetAsyncError) comm_get_async_error = nullptr;
  decltype(&ncclCommAbort) comm_abort = nullptr;
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclBroadcast) broadcast = nullptr;
  decltype(&ncclReduce) reduce = nullptr;
  decltype(&ncclAllGather) all_gather = nullptr;
  decltype(&ncclReduceScatter) reduce_scatter = nullptr;
  std::string path;             // the file whose functions these are
  int version = 0;              // ncclGetVersion()
  bool already_loaded = false;  // it was in the process before dpar looked (a framework's), not loaded by dpar
};

// NCCL (libnccl.so.2), resolved once per process and never unloaded: the one already in the process if there is
// one (dlopen with RTLD_NOLOAD: a framework's, e.g. PyTorch's), else loaded by name (the dynamic loader's search:
// LD_LIBRARY_PATH, the system's directories, libdpar's run path), else from the directory of the NCCL dpar was built
// against. An NCCL older than kMinimumNcclVersion is refused, naming it; one already in the process is never
// joined by a second copy. Throws Error(Status::kNotSupported) naming every file tried and why it failed (not
// found, a function missing, too old); a later call tries again. Thread-safe.
const NcclLibrary& nccl();

namespace loader {
// A place nccl() looks: a file, or with `in_process_only`, a name matched only against the libraries the process
// has already loaded (dlopen's RTLD_NOLOAD).
struct NcclCandidate {
  std::string file;
  bool in_process_only = false;
};
// The places nccl() looks, in order.
std::vector<NcclCandidate> nccl_candidates();
// Resolves NCCL from the first of `candidates` that has every function and a version of at least `minimum_version`;
// throws as nccl() does. An NCCL found in the process but unusable ends the search (a second copy beside it is not
// loaded). nccl() is this over nccl_candidates(); tests give it other lists.
NcclLibrary load_nccl(const std::vector<NcclCandidate>& candidates, int minimum_version = kMinimumNcclVersion);
}  // namespace loader

}  // namespace dpar::cuda
