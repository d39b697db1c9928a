// The CUDA device group: several replicas on one GPU (NCCL refuses two ranks on one device), or on GPUs that reach
// each other's memory by peer access (enabled by the caller), reducing in device memory.
//
// Participants are threads of one process, each with the CUDA stream of its replica's compute work. Host
// synchronisation, fingerprints, timeouts and abort are a ThreadGroup's (threads_comm.h): every collective starts
// with an all-gather over the thread group of each participant's call record (operation, count, dtype, op, root,
// buffers, events); all participants then compare the CallRecords and throw Error(MISMATCH) alike on a difference,
// and a missing or failed participant gives TIMEOUT or REMOTE exactly as in the threads backend.
//
// The device work is the threads backend's one-pass algorithm, on the GPU: participant r waits (on its stream) for
// an event every participant recorded on its own stream when it called, so that every input is complete; reduces
// its slice of every participant's buffer with kernels::cuda::sum_slice_into_all and writes the sum into all of
// them; records its own event. A second host barrier then lets every participant make its stream wait for all
// those events, so that nothing it queues later reads a slice before it is written. The host never waits for the
// GPU: a collective returns once its work is queued, and its result is visible to work queued later on the
// participant's stream (the stream passed at construction). Sum order is participant order, whoever computes a
// slice: every participant gets the same bits, the threads backend's bits for the same inputs.
//
// Supported: all_reduce_sum, reduce_sum and reduce_scatter_sum (both are all_reduce_sum's pass: it writes every
// participant's buffer, which they allow, since the rest of a buffer is unspecified), all_reduce (f32 and f64, sum),
// broadcast, all_gather and all_gather_blocks (copies), barrier. reduce, reduce_scatter and the other dtypes and ops
// of all_reduce throw Error(NOT_SUPPORTED) on every participant, without waiting. Arguments are checked by the one
// call check (communicator.h); a participant refused there releases the others (they throw Error(REMOTE)).
// Buffers are device memory of the participant's GPU. In place: all_reduce takes send == recv; all_gather takes
// send == recv + rank * count; other overlaps are not supported.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/threads_comm.h"

namespace dpar {

class CudaDeviceGroup {
 public:
  // devices[r] is participant r's CUDA device (the same one several times, or GPUs with peer access); names[r]
  // names it in messages ("replica 1 (cuda:0)").
  CudaDeviceGroup(std::vector<int> devices, std::vector<std::string> names, std::chrono::duration<double> timeout);

  int size() const { return host_.size(); }
  // Every participant waiting now or later throws Error(REMOTE) with `reason`.
  void abort(const std::string& reason) { host_.abort(reason); }
  // Makes an aborted group usable again (no participant inside a collective).
  void reset() { host_.reset(); }

  // Participant `rank`'s view, queuing its device work on `stream` (of devices[rank], the device of its buffers).
  // Each call makes that device current for its span, whatever thread calls it. The group and the stream must
  // outlive it. At most kernels::cuda::SumBuffers::kMaxBuffers (64) participants: more throw NOT_SUPPORTED.
  std::unique_ptr<Communicator> communicator(int rank, cudaStream_t stream);

 private:
  ThreadGroup host_;
  std::vector<int> devices_;
};

}  // namespace dpar
