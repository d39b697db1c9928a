// What the NCCL backend's files share (nccl_comm.h says how it works): deadlines, the wait for a non-blocking
// communicator's host-side work, and its abort. Not for other code. NCCL's functions are reached through
// cuda::nccl(), which loads NCCL on first use (platform/cuda/nccl_library.h); a communicator exists only once it has.
#pragma once

#include <nccl.h>

#include <chrono>
#include <new>
#include <thread>

#include "platform/cuda/cuda_check.h"
#include "platform/cuda/nccl_library.h"

namespace dpar::nccl_internal {

using Clock = std::chrono::steady_clock;

// `limit` from now; a limit beyond 3e9 s (dpar's "no limit") never comes.
inline Clock::time_point deadline_after(std::chrono::duration<double> limit) {
  return limit.count() > 3.0e9 ? Clock::time_point::max()
                               : Clock::now() + std::chrono::duration_cast<Clock::duration>(limit);
}

// Waits until a non-blocking communicator's last call has finished its host-side work (ncclCommGetAsyncError leaves
// ncclInProgress), at most until `deadline`; its outcome, or ncclInProgress if the time ran out.
inline ncclResult_t settle(ncclComm_t comm, Clock::time_point deadline) {
  for (int spins = 0;; ++spins) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t got = cuda::nccl().comm_get_async_error(comm, &state);
    if (got != ncclSuccess) return got;
    if (state != ncclInProgress || Clock::now() >= deadline) return state;
    if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

// ncclCommAbort under the communicator's own device (null: nothing). NCCL's teardown makes the communicator's device
// current and then sets back what cudaGetDevice said before: on a thread without a context that is 0, and
// cudaSetDevice(0) would create a context on GPU 0 (in a job of one GPU per process, on a GPU the process never
// uses). Under the scope cudaGetDevice says the communicator's device, and the scope gives the thread back what it
// had.
inline void abort_under_device(ncclComm_t comm, int device) noexcept {
  if (comm == nullptr) return;
  cuda::DeviceScope scope(device, std::nothrow);
  (void)cuda::nccl().comm_abort(comm);
}

}  // namespace dpar::nccl_internal
