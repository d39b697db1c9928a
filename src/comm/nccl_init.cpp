// The creation of an in-process NCCL group (nccl_comm.h: NcclGroup): its communicators, non-blocking, created in
// one NCCL group under a timeout.
#include "comm/nccl_comm.h"
#include "comm/nccl_internal.h"
#include "common/error.h"
#include "platform/cuda/cuda_check.h"
#include "platform/cuda/nccl_library.h"

namespace dpar {

using namespace nccl_internal;

// ncclCommInitAll's communicators, but non-blocking (ncclCommInitRankConfig, blocking = 0, in one NCCL group), so
// that an abort always reaches a call in progress: NCCL connects peers inside the first collectives and, on a
// blocking communicator, waits there on the host for a peer that may never call, where no abort can reach it.
// The creation itself is polled under `timeout`.
std::vector<ncclComm_t> NcclGroup::init_group(const std::vector<int>& devices, std::chrono::duration<double> timeout) {
  const int n = static_cast<int>(devices.size());
  DPAR_CHECK_ARG(n > 0, "nccl group: no devices");
  const cuda::NcclLibrary& nccl = cuda::nccl();  // the first use loads NCCL (NOT_SUPPORTED, naming why, without it)
  ncclUniqueId id;
  DPAR_NCCL_CHECK(nccl.get_unique_id(&id), "nccl group of ", n, " GPUs");
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  ncclResult_t r = ncclSuccess;
  std::exception_ptr device_error;
  {
    // Each rank is created with its device current (a scope each, never a bare cudaSetDevice, so that the caller's
    // thread gets back exactly the context it had); the group ends under the last device's.
    cuda::DeviceScope scope(devices.back());
    DPAR_NCCL_CHECK(nccl.group_start(), "nccl group of ", n, " GPUs");
    for (int i = 0; i < n && (r == ncclSuccess || r == ncclInProgress); ++i) {
      try {
        cuda::DeviceScope rank_device(devices[i]);
        r = nccl.comm_init_rank_config(&comms[i], n, id, i, &config);
      } catch (...) {
        device_error = std::current_exception();
        break;
      }
    }
    const ncclResult_t end = nccl.group_end();  // always, to close the group the loop opened
    if (r == ncclSuccess || r == ncclInProgress) r = end;
  }
  // Aborted each under its own device (abort_under_device).
  auto abort_all = [&] {
    for (size_t i = 0; i < comms.size(); ++i) abort_under_device(comms[i], devices[i]);
  };
  if (device_error) {
    abort_all();
    std::rethrow_exception(device_error);
  }
  if (r != ncclSuccess && r != ncclInProgress) {
    abort_all();
    DPAR_NCCL_CHECK(r, "nccl group of ", n, " GPUs");
  }
  const auto deadline = deadline_after(timeout);
  for (int i = 0; i < n; ++i) {
    const ncclResult_t state = settle(comms[i], deadline);
    if (state == ncclSuccess) continue;
    abort_all();
    if (state == ncclInProgress)
      fail(Status::kTimeout, "nccl group of ", n, " GPUs: rank ", i, " (cuda:", devices[i],
           ") was not created within ", timeout.count(), " s");
    DPAR_NCCL_CHECK(state, "nccl group of ", n, " GPUs: rank ", i, " (cuda:", devices[i], ")");
  }
  return comms;
}

}  // namespace dpar
