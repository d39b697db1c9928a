// The NCCL backend: participants are GPUs, one per thread in one process (NcclGroup, ncclCommInitAll), or one per
// process (nccl_rank_communicator, ncclCommInitRank with a unique id the caller distributes, e.g. through MPI).
//
// Streams. A participant is built with its replica's compute stream. Each collective makes the communicator's own
// communication stream wait for an event recorded on the compute stream (the inputs are complete) and queues the
// NCCL call there. It returns once the host has seen the call complete, so work queued after it on any stream sees
// the result; the compute stream itself never waits for the communication stream, so that the kernels queued on
// it meanwhile (the rest of backward) run beside the collective.
//
// NCCL itself is loaded on first use (platform/cuda/nccl_library.h): the one already in the process (a framework's)
// if there is one, else the system's. Without it, creating a group or a communicator throws Error(NOT_SUPPORTED)
// naming every file tried.
//
// Blocking and errors, not hangs. A collective returns when its NCCL work has finished on the GPU: it waits for the
// completion event by polling, and meanwhile polls ncclCommGetAsyncError (a failed peer or network shows there),
// abort() of the participant or of its group, and the others' failures. A collective that has not finished within
// the timeout throws Error(TIMEOUT) naming the operation; an asynchronous NCCL error throws its Error
// (COMMUNICATION, REMOTE, ...); an abort makes a waiting or later call throw Error(REMOTE). Any of them aborts
// (ncclCommAbort) every NCCL communicator of the group, once, so that the others' kernels waiting for this
// participant end too, and the others throw Error(REMOTE) with the first reason. After that the communicators are
// unusable (Error(INVALID_STATE) or REMOTE): build new ones. Every communicator is non-blocking (blocking = 0), in
// a process as across processes: an NCCL call returns at once, ncclInProgress while NCCL still waits on the host
// (for peers to connect, inside the first collectives), and is polled with the communicator's lock taken only for
// each poll, so that an abort always reaches it. The engine runs collectives on the communication thread
// (async_*), so this wait does not block the replica's worker.
//
// Call records (communicator.h) are agreed before any data moves, so that a participant calling another collective
// makes all of them throw Error(MISMATCH) with the one message of every backend: in one process over a ThreadGroup (host all-gather of each call's record, with its
// timeout), across processes by a small ncclAllGather of the records (one extra latency per collective).
//
// Supported: every Communicator collective for f32, f64, i32, i64 with sum, max, min, and mean for f32 and f64
// (ncclAvg). all_reduce_sum with contributes == false zeroes the participant's buffer first; scale multiplies
// after the sum (on the communication stream). reduce_scatter_sum and all_gather_blocks are ncclReduceScatter and
// ncclAllGather in place, whose blocks are equal: where count is not size() blocks of Communicator::block_range, the
// buffer is staged through a padded device buffer of the communicator's (kept for the next call). Buffers are device
// memory of the participant's GPU.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/threads_comm.h"

namespace dpar {

class NcclComms;  // the NCCL communicators that fail together (nccl_comm.cpp)

// One communicator per GPU of this process. devices[r] is participant r's CUDA device (each at most once: NCCL
// refuses two ranks on one GPU, use CudaDeviceGroup there).
class NcclGroup {
 public:
  // Creates the communicators (non-blocking, in one NCCL group), waiting at most `timeout` for them.
  NcclGroup(std::vector<int> devices, std::vector<std::string> names, std::chrono::duration<double> timeout);
  ~NcclGroup();
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  int size() const { return host_.size(); }
  void abort(const std::string& reason) { host_.abort(reason); }
  // Participant `rank`'s view; `compute_stream` is on devices[rank]. The group must outlive it.
  std::unique_ptr<Communicator> communicator(int rank, cudaStream_t compute_stream);

 private:
  static std::vector<ncclComm_t> init_group(const std::vector<int>& devices, std::chrono::duration<double> timeout);
  ThreadGroup host_;
  std::chrono::duration<double> timeout_;
  std::vector<int> devices_;
  std::shared_ptr<NcclComms> comms_;
};

// A new id for nccl_rank_communicator (ncclGetUniqueId), made on one rank and sent to the others. The first use of
// NCCL loads it: throws Error(NOT_SUPPORTED) naming every file tried where there is none, as NcclGroup does.
ncclUniqueId nccl_unique_id();

// This process's participant of an NCCL communicator over `nranks` processes: every rank passes the same id (made
// by ncclGetUniqueId on one rank and broadcast by the caller). Owns the NCCL communicator, which is non-blocking
// (ncclCommInitRankConfig, blocking = 0): its creation returns once every rank has joined, or throws TIMEOUT when
// one has not within `join_within` (a blocking creation would wait for it forever); collectives time out after
// `timeout`. A call that NCCL leaves in
// progress is waited for before the next. `watch`, if given, is another communicator over the same processes (MPI)
// whose failures end this one's waits too, the creation's included: a process that fails outside NCCL tells the
// others through it, and they throw Error(REMOTE) at once instead of waiting out the timeout for it.
std::unique_ptr<Communicator> nccl_rank_communicator(const ncclUniqueId& id, int nranks, int rank, int device,
                                                     cudaStream_t compute_stream, std::string name,
                                                     std::chrono::duration<double> timeout,
                                                     std::chrono::duration<double> join_within,
                                                     std::shared_ptr<Communicator> watch = nullptr);

}  // namespace dpar
