// What the files of the MPI backend share (mpi_comm.h says how the backend works): the layout of the exchange and
// of notices, MPI's reductions, and the process-wide state that failed collectives leave. Not for other code.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "comm/mpi_comm.h"

namespace dpar::mpi_internal {

using SteadyClock = std::chrono::steady_clock;

// A block of the exchange: a rank's MpiHeader, then its data in a fused all-reduce (payload_bytes, padded to 8).
using Header = MpiHeader;
constexpr size_t kHeaderBytes = sizeof(Header);
static_assert(kHeaderBytes % 8 == 0, "blocks of the exchange are packed in 64-bit words");
// Fused all-reduces: the data rides with the fingerprints when every message of the exchange stays within this
// size, under OpenMPI's eager limit for shared memory (4 KiB with the transport's own header). Beyond it a message
// goes by rendezvous, which costs 3x as long (3.4 us instead of 1.1 us at 4 KiB here) and more than the separate
// MPI_Allreduce that it would save.
constexpr size_t kEagerMessageBytes = 3968;
inline size_t round_up8(size_t n) { return (n + 7) & ~size_t{7}; }

// Notices on the private communicator: int64 kind, sequence number, operation; then the text.
constexpr int kNoticeTag = 1;
constexpr int kFingerprintTag = 2;
enum NoticeKind : int64_t { kAbortNotice = 1, kTimeoutNotice = 2, kVoidNotice = 3 };
constexpr size_t kNoticeHeader = 3 * sizeof(int64_t);

// mpi_ops.cpp: out = the reduction of in[0..m) (rank order), or zeros for m == 0; the MPI datatype and operation of
// a dtype and op (dpar's own operations where MPI's differ from dpar's rules).
void reduce_blocks(void* out, const char* const* in, size_t m, size_t count, DType dtype, ReduceOp op);
MPI_Datatype mpi_type(DType dtype);
MPI_Op mpi_op(DType dtype, ReduceOp op);

// mpi_runtime.cpp
std::string mpi_error_string(int code);
const char* thread_level_name(int level);
// Set once a collective of this process timed out, was aborted or failed in MPI (MPI_Finalize is watched then).
extern std::atomic<bool> g_group_failed;

// mpi_agree.cpp: "rank 1", "ranks 0, 2"; "no rank" for none.
std::string rank_list(const std::vector<int>& ranks);

// mpi_failure.cpp: how long a rank that gave up listens for the others' notices (and advances what it left).
SteadyClock::duration grace_period(double timeout_seconds);
// The communicators that left a collective in its fingerprint exchange (see "Abandoned exchanges" in mpi_comm.h).
extern std::mutex g_abandoned_mutex;
extern std::vector<MpiCommunicator*> g_abandoned;
extern std::atomic<int> g_abandoned_count;

}  // namespace dpar::mpi_internal
