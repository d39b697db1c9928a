// The creation of an in-process NCCL group (nccl_comm.h: NcclGroup): its communicators, non-blocking, created in
// one NCCL group under a timeout.
#include "backend/cuda/cuda_check.h"
#include "comm/nccl_comm.h"
#include "comm/nccl_internal.h"
#include "common/error.h"

namespace dpar {

using namespace nccl_internal;

// ncclCommInitAll's communicators, but non-blocking (ncclCommInitRankConfig, blocking = 0, in one NCCL group), so
// that an abort always reaches a call in progress: NCCL connects peers inside the first collectives and, on a
// blocking communicator, waits there on the host for a peer that may never call, where no abort can reach it.
// The creation itself is polled under `timeout`.
std::vector<ncclComm_t> NcclGroup::init_group(const std::vector<int>& devices, std::chrono::duration<double> timeout) {
  const int n = static_cast<int>(devices.size());
  DPAR_CHECK_ARG(n > 0, "nccl group: no devices");
  ncclUniqueId id;
  DPAR_NCCL_CHECK(ncclGetUniqueId(&id), "nccl group of ", n, " GPUs");
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  ncclResult_t r = ncclSuccess;
  cudaError_t device_error = cudaSuccess;
  int failed_device = -1;
  {
    // The loop makes each device current in turn and ends on the last, which is this scope's own: the scope then
    // gives the caller's thread back its context.
    cuda::DeviceScope scope(devices.back());
    DPAR_NCCL_CHECK(ncclGroupStart(), "nccl group of ", n, " GPUs");
    for (int i = 0; i < n && (r == ncclSuccess || r == ncclInProgress); ++i) {
      device_error = cudaSetDevice(devices[i]);
      if (device_error != cudaSuccess) {
        failed_device = devices[i];
        break;
      }
      r = ncclCommInitRankConfig(&comms[i], n, id, i, &config);
    }
    const ncclResult_t end = ncclGroupEnd();  // always, to close the group the loop opened
    if (r == ncclSuccess || r == ncclInProgress) r = end;
    if (device_error != cudaSuccess) (void)cudaSetDevice(devices.back());
  }
  auto abort_all = [&] {
    for (ncclComm_t c : comms)
      if (c != nullptr) ncclCommAbort(c);
  };
  if (device_error != cudaSuccess) {
    abort_all();
    cuda::fail_cuda(device_error, "cudaSetDevice", detail::concat("nccl group: cuda:", failed_device));
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
      fail(DPAR_ERR_TIMEOUT, "nccl group of ", n, " GPUs: rank ", i, " (cuda:", devices[i],
           ") was not created within ", timeout.count(), " s");
    DPAR_NCCL_CHECK(state, "nccl group of ", n, " GPUs: rank ", i, " (cuda:", devices[i], ")");
  }
  return comms;
}

}  // namespace dpar
