// The MPI backend of the comm layer: participants are the processes (ranks) of an MPI communicator. This header
// declares MPI's lifetime in the process (MpiRuntime), the communicator's options (MpiOptions), the record each rank
// contributes to a collective's exchange (MpiHeader) and the communicator (MpiCommunicator); this comment says how
// they work. The code is split by concern, and what its files share is in mpi_internal.h (not for other code):
//   mpi_runtime.cpp  MPI's initialisation, and the watched MPI_Finalize at exit;
//   mpi_comm.cpp     creation over a base communicator, teardown, and a collective's frame: the arrival checks,
//                    phase 1, the transfer (phase 2) and the pass that finishes the result;
//   mpi_agree.cpp    phase 1: the exchange of call records, the agreement, the fused small all-reduces;
//   mpi_failure.cpp  notices (abort, timeout, void), the wait that polls for them, the abandoned exchanges;
//   mpi_ops.cpp      MPI's datatypes and operations for dpar's element-wise reductions (comm/reduce_kernels.h).
// The calls are MPI 3's; the tuning and the figures below are Open MPI's.
//
// MPI's lifetime. MpiRuntime::instance() initialises MPI with MPI_Init_thread(MPI_THREAD_MULTIPLE) on first use if
// nobody did, and then finalises it at exit (atexit); if the program or a framework initialised MPI itself, dpar
// uses it as it is and never finalises it. A process started without a launcher (none of mpirun's, srun's or
// PMIx's variables) is a singleton, rank 0 of 1, which dpar starts with Open MPI's isolated launcher
// (OMPI_MCA_plm=isolated, unless the caller set it): the default one needs ssh or rsh, and kills the process inside
// MPI_Init_thread without them. Open MPI's MPI_Finalize waits for every rank of the job, forever for a dead one when
// the launcher lets the others live (mpirun --enable-recovery): so after a collective of the process failed
// (timeout, abort, MPI error), dpar's MPI_Finalize at exit runs on a helper thread and is waited for at most 30 s;
// past that dpar says so on stderr, and the process ends without it, with the status the program chose.
//
// A collective is two phases:
//  1. Arrival and fingerprint (mpi_agree.cpp). Every participant contributes its call's record (communicator.h:
//     sequence number, operation, count, dtype, op, root) and its own refusal, if any, to an allgather of its own
//     over point-to-point messages (Bruck's algorithm, ceil(log2 size) rounds of MPI_Isend/MPI_Irecv on a private
//     communicator), and polls it with MPI_Testall until it completes, the timeout passes, this participant is
//     aborted, or a notice (below) arrives. Everyone then holds the same table and takes the same decision: on a
//     difference all throw Error(MISMATCH) with the one message of every backend (mismatch_message()); a
//     participant whose own arguments were bad (the one call check, or MPI's own limits: bf16 reduced other than
//     by a sum, a count above INT_MAX where MPI has no chunked form) throws its own error (INVALID_ARGUMENT,
//     NOT_SUPPORTED, ...) and the others throw Error(REMOTE) naming it. No data moves in either case and the
//     communicator stays usable. A completed exchange proves that every participant entered the collective:
//     barrier() is this phase alone. Cost: one small-message latency per round (about 0.3-0.6 us between two
//     processes of one machine), which is what dpar adds to a plain MPI_Allreduce.
//     Small all-reduces are fused into this phase: when every message of the exchange stays under Open MPI's eager
//     limit (each rank's data at most 3928 bytes for 2 ranks, 1944 for 4, 952 for 8: (3968 / most blocks per
//     message) - 40), each rank's data rides with its fingerprint and every rank reduces the gathered blocks itself,
//     in rank order (all ranks get the same bits). There is no phase 2 then, and the timeout covers the data too.
//  2. Transfer: the MPI collective itself, on the communicator's duplicate of base (MPI_Allreduce, MPI_Bcast,
//     MPI_Reduce, MPI_Allgather; all_gather_blocks is MPI_Allgatherv in place, with block_range's per-rank counts;
//     reduce_sum is MPI_Reduce, then the root scales; MPI_IN_PLACE for the in-place forms; a mean is a sum divided
//     afterwards, truncating for integers). reduce_scatter and reduce_scatter_sum (block_range's blocks) move the
//     blocks with MPI_Alltoallv and each rank reduces the ones it received in rank order, as a fused all-reduce
//     does: the same bytes as a ring's reduce-scatter, and bits that do not depend on MPI's algorithm (the
//     engine's sharded gradients equal the all-reduce's wherever that adds in rank order). Float sums are MPI_SUM; max and min, integer sums and bf16 sums (bf16 moves as 16-bit words) are
//     dpar's own MPI operations (mpi_ops.cpp), so that NaN, overflow and rounding follow the rules every backend
//     shares. By default the transfer is the blocking call, Open MPI's tuned algorithms at the speed of a plain MPI
//     program: every participant is known to be inside the collective, so the timeout is not needed for arrival
//     any more. The price: a rank that dies during the transfer itself leaves the others inside MPI (mpirun then
//     kills the job, by default). MpiOptions::transfer = kNonBlocking uses MPI_I* polled as in phase 1 instead, so
//     that the deadline covers the transfer too, at the cost of Open MPI's non-blocking collectives (libnbc), about
//     2x slower here. After a timeout in that mode MPI may still write the call's recv buffer if the missing rank
//     arrives later (an MPI request cannot be cancelled): keep it alive or exit.
//
// Notices (mpi_failure.cpp): point-to-point messages on the private communicator, looked for (MPI_Improbe, ~0.07 us
// a look) as a collective starts (twice) and while it waits:
//  - abort(reason) sends ABORT(reason) to every other rank: a rank waiting now throws Error(REMOTE) with the reason
//    at once, and every later call on any rank throws it too (the aborting rank's included).
//  - A participant whose deadline passes sends TIMEOUT(sequence) to every other rank and then listens for a grace
//    period (a quarter of the timeout, 50 ms to 1 s): the participants waiting in the same collective join in (they
//    answer with their own notice), so the ranks that never answered are those that did not arrive, and every
//    waiting participant throws Error(TIMEOUT) naming them. A late participant finds the notices as it arrives and
//    throws Error(REMOTE) without moving data (its exchange would complete with the messages the others sent
//    before they gave up). A timed-out communicator is unusable: Error(INVALID_STATE) from then on. Its requests
//    stay pending until MPI_Finalize, which Open MPI completes regardless. Create a new communicator to go on.
//  - Abandoned exchanges. A late rank can miss the notices (they are still in flight when it looks, or it is
//    descheduled between its look and its first send), complete its exchange with the messages the others sent
//    before they gave up, and enter a blocking transfer. Nothing can interrupt a blocking MPI call, so the ranks
//    that gave up finish what they left instead: a rank that leaves a collective in its fingerprint exchange
//    (timeout, abort, a notice) keeps that exchange and advances it: for a grace period as it leaves, then
//    whenever this communicator is touched again (any call, async_error(), and its destruction, which waits
//    another grace period), and whenever a collective of another MPI communicator of this process waits (under
//    MPI_THREAD_MULTIPLE), such as a program's own agreement after the failure. Once the exchange completes,
//    every rank has arrived, and if a transfer follows, this rank sends VOID(sequence) and joins the transfer
//    with zeros, only to release the others. A rank whose blocking transfer ends looks for TIMEOUT and VOID
//    notices of that collective and throws Error(REMOTE) ("the result is void") if it finds one: the data it
//    received is not the reduction of everyone's. (With more than 2 ranks the data may arrive through another
//    rank before the notice does; the next call then throws instead.) What remains: a rank that gave up and then
//    neither touches MPI through dpar nor destroys the communicator leaves the late rank in its transfer, as a
//    dead rank would. In kNonBlocking mode the transfer is polled and sees the notices itself.
//  - MPI errors: both communicators use MPI_ERRORS_RETURN; a failing MPI call becomes Error(COMMUNICATION) with
//    MPI_Error_string, and the communicator becomes unusable.
//
// A rank that dies (process exit) is a rank that does not arrive: the others throw TIMEOUT naming it. (mpirun kills
// the whole job when a rank exits without MPI_Finalize, unless started with --enable-recovery.)
//
// In place: all_reduce and reduce take send == recv; all_gather takes send == recv + rank * count and send == recv;
// reduce_scatter takes recv == send (the result lands at the start of the buffer, and the rest of it is
// clobbered) and recv == send + rank * count (block 0 is clobbered on other ranks than 0). Other overlaps are
// refused, by the one call check of every backend (call_check.cpp). Counts above INT_MAX are split into several MPI
// calls for all_reduce, broadcast and reduce; all_gather, reduce_scatter, reduce_scatter_sum and all_gather_blocks
// refuse them (NOT_SUPPORTED).
//
// Threads: calls on one communicator are serialised by a mutex (the communication thread of async_* and the
// caller never run MPI at once); abort() may be called from any thread at any time. Communicators may be used from
// different threads concurrently only if MPI provides MPI_THREAD_MULTIPLE (dpar asks for it; a framework may have
// chosen less: MpiRuntime::thread_level()). Below MPI_THREAD_SERIALIZED only the main thread may call at all
// (NOT_SUPPORTED otherwise), so async_* needs MPI_THREAD_SERIALIZED or more.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "common/error.h"

namespace dpar {

// MPI's lifetime in this process.
class MpiRuntime {
 public:
  // Initialises MPI (MPI_Init_thread, asking for MPI_THREAD_MULTIPLE) unless it is initialised already; then the
  // same object for the life of the process. Thread-safe. Throws Error(INVALID_STATE) if MPI was finalised, and
  // Error(COMMUNICATION) if MPI_Init_thread fails.
  static MpiRuntime& instance();
  // True if dpar initialised MPI (and so finalises it at exit); false if the program had done it.
  bool initialized_by_dpar() const { return initialized_by_dpar_; }
  // The thread support MPI provides: MPI_THREAD_SINGLE ... MPI_THREAD_MULTIPLE.
  int thread_level() const { return thread_level_; }
  int world_rank() const { return world_rank_; }
  int world_size() const { return world_size_; }

 private:
  MpiRuntime();
  bool initialized_by_dpar_ = false;
  int thread_level_ = MPI_THREAD_SINGLE;
  int world_rank_ = 0;
  int world_size_ = 1;
};

// What every rank contributes to a collective's exchange: the call's record (communicator.h), which must agree,
// this rank's own refusal (a status, 0 if none) and the size of the data that follows in a fused all-reduce.
struct MpiHeader {
  CallRecord record;
  int64_t error = 0;
  int64_t payload_bytes = 0;
};

struct MpiOptions {
  // How long a participant waits for the others in a collective (and in the constructor); anything above 3e9
  // (such as INFINITY) waits forever. Must be positive.
  double timeout_seconds = 300.0;
  // How long the constructor waits for every rank of the base communicator to construct theirs (ranks start at
  // different times); 0: timeout_seconds.
  double create_timeout_seconds = 0.0;
  // How the data of a collective moves once the fingerprints agree (see above).
  enum class Transfer { kBlocking, kNonBlocking };
  Transfer transfer = Transfer::kBlocking;
};

class MpiCommunicator final : public Communicator {
 public:
  // Collective over `base`: every rank of it must construct one (MPI_Comm_idup, twice, polled under the creation
  // timeout, MpiOptions::create_timeout_seconds).
  // The participants are base's ranks, in base's order; base itself is used for nothing else. After a timeout
  // here the duplication stays pending on base (an MPI request cannot be cancelled, and OpenMPI allocates the
  // ids of communicators in creation order), so the ranks' creations over base no longer pair: later creations
  // over the same base handle in this process are refused with Error(INVALID_STATE).
  explicit MpiCommunicator(MPI_Comm base = MPI_COMM_WORLD, MpiOptions options = {});
  // Runs the async work already queued, gives a late rank a grace period to be released from a collective this
  // rank left, then frees the private communicators: at once if this one is usable; if it failed or was aborted,
  // once the next communicator of this process is created (the others may have sent it messages it never
  // received); never after MPI_Finalize, nor with requests left pending by a timeout or an abort.
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend() const override { return "mpi"; }

  void abort(const std::string& reason) override;
  Status async_error(std::string* reason) override;
  void set_timeout(std::chrono::duration<double> timeout) override;
  // A communicator over a duplicate of this one's (MPI_Comm_idup, as the constructor does), with its options and
  // its timeout now: collective over the ranks, under that timeout.
  std::unique_ptr<Communicator> duplicate() override;
  // Usable, and MPI gives MPI_THREAD_MULTIPLE (two communicators' collectives on two threads at once).
  bool can_duplicate() const override;
  // The collectives' timeout now (MpiOptions::timeout_seconds until set_timeout()).
  double timeout_seconds() const { return timeout_seconds_.load(std::memory_order_relaxed); }

  // The communicator the collectives run on (a duplicate of base), e.g. to hand to another MPI library.
  MPI_Comm comm() const { return comm_; }
  const MpiOptions& options() const { return options_; }
  // Collectives started so far (the next one's sequence number).
  uint64_t sequence() const { return seq_.load(std::memory_order_relaxed); }
  // True once an abort, a timeout or an MPI error made this communicator unusable.
  bool broken() const { return state_.load(std::memory_order_acquire) != kUsable; }

 private:
  enum State : int { kUsable = 0, kAborted = 1, kFailed = 2 };

  // A checked call runs; a refused one (bad arguments) takes part in the exchange with its error, so that the
  // others throw Error(REMOTE) naming this rank and the communicator stays usable.
  void run(const CommCall& call) override;
  [[noreturn]] void refuse(const CommCall& call, const Error& error) override;
  void execute(const CommCall& call, const Error* refused);
  // MPI's own limits, beyond the one call check: bf16 sums only, int counts where MPI has no chunked form.
  void check_limits(const CommCall& call) const;
  void check_usable(const CommCall& call);
  // Phase 1; returns true for a fused all-reduce, whose data came with the fingerprints.
  bool agree(const CommCall& call, uint64_t seq, const Error* refused);
  void reduce_fused(const CommCall& call);
  void transfer(const CommCall& call, uint64_t seq);
  // The transfer of a reduce-scatter: block r of `whole` (counts[r] elements at displs[r]) to rank r, and this
  // rank's blocks from every rank reduced with `op` in rank order into `out`.
  void reduce_scatter_in_rank_order(const CommCall& call, uint64_t seq, const void* whole,
                                    const std::vector<int>& counts, const std::vector<int>& displs, void* out,
                                    ReduceOp op);
  void finish(const CommCall& call);
  // Waits for `request` to complete: until the deadline (then the TIMEOUT protocol), a local abort or a notice.
  void wait(MPI_Request* requests, int count, MPI_Status* statuses, const CommCall& call, uint64_t seq,
            bool transferring, std::chrono::steady_clock::time_point start);
  // Throws REMOTE if a notice says the group broke, or that the others gave up on collective `seq` already.
  void check_late(const CommCall& call, uint64_t seq, int looks);
  void gather_fingerprints(const MpiHeader& mine, const void* payload, const CommCall& call, uint64_t seq);
  // One round of the exchange: post its messages; parse what came and go to the next round.
  void post_round(const CommCall& call, uint64_t seq);
  void finish_round(const CommCall& call, uint64_t seq);
  // Copies the gathered fingerprints into table_, in rank order.
  void collect_table();
  // Advances an abandoned exchange without waiting; once it completes, joins the transfer that follows (if any)
  // with zeros, to release the ranks inside it. Returns true when nothing is left abandoned.
  bool release_abandoned();
  // Marks the current exchange abandoned (kBlocking only) and lists it for release_others(); with `linger`,
  // advances it for a grace period first.
  void abandon_exchange(bool linger);
  // Advances the exchanges that other communicators of this process abandoned (those not busy now).
  void release_others();
  // Throws REMOTE if a rank that gave up on collective `seq` joined its transfer only to release this rank.
  void check_void(const CommCall& call, uint64_t seq);
  [[noreturn]] void give_up(const CommCall& call, uint64_t seq, bool transferring, int first_notifier);
  // Receives the notices that have arrived (while in collective `current_seq`); returns true if any did.
  bool drain_notices(uint64_t current_seq, int looks);
  void send_notice(int64_t kind, uint64_t seq, int64_t coll, const std::string& text);
  void send_abort_notices_locked();
  void test_pending_sends();
  [[noreturn]] void mpi_failed(const char* function, int code, const std::string& where);
  [[noreturn]] void throw_unusable(const std::string& where);
  // The first failure wins: later calls report it.
  void mark(State state, const std::string& reason);
  std::string where(const CommCall& call, uint64_t seq) const;

  MpiOptions options_;
  std::atomic<double> timeout_seconds_;  // see timeout_seconds()
  MPI_Comm comm_ = MPI_COMM_NULL;     // the collectives
  MPI_Comm control_ = MPI_COMM_NULL;  // point-to-point: fingerprints and notices
  int rank_ = 0;
  int size_ = 1;
  int thread_level_ = MPI_THREAD_MULTIPLE;

  std::mutex mutex_;  // one collective at a time; guards everything below but the atomics
  std::atomic<uint64_t> seq_{0};
  std::vector<MpiHeader> table_;        // the gathered records (with refusals, payload sizes), in rank order
  std::vector<int64_t> gather_;         // the blocks as they arrive (rotated by rank_): fingerprint + data
  std::vector<char> scatter_stage_;     // a reduce-scatter's blocks from every rank (reduce_scatter_in_rank_order)
  std::vector<size_t> offsets_;         // byte offset of block j in gather_
  std::vector<const char*> payloads_;   // rank r's data in gather_ (fused all-reduce), or null
  size_t fused_max_bytes_ = 0;          // the most data one rank sends with its fingerprint
  std::atomic<int> state_{kUsable};
  // Set by abort() on this rank, from any thread; whoever holds mutex_ next sends the notices.
  std::atomic<bool> abort_requested_{false};
  bool abort_notices_sent_ = false;
  std::mutex reason_mutex_;     // guards the two strings
  std::string broken_reason_;   // why the communicator is unusable
  std::string abort_reason_;    // abort()'s reason, for the notices
  // Notices received: per rank, the sequence number of its last TIMEOUT notice and of its last VOID notice (or -1).
  std::vector<int64_t> timeout_notice_seq_;
  std::vector<int64_t> void_notice_seq_;
  // The fingerprint exchange of the current collective (Bruck's round at `distance`, its two requests). It stays
  // `abandoned` when the collective is left in it, until release_abandoned() completes it.
  struct Exchange {
    uint64_t seq = 0;
    Collective coll = Collective::kBarrier;
    int distance = 1;
    MPI_Request requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    MPI_Status statuses[2];
    bool abandoned = false;
  };
  Exchange exchange_;
  struct PendingSend {
    MPI_Request request;
    std::shared_ptr<std::vector<char>> data;  // one buffer for every destination
  };
  std::deque<PendingSend> pending_sends_;
  bool requests_left_pending_ = false;  // a timeout or abort left an MPI request that never completes
};

namespace detail {
// Tests only: the most elements one MPI call moves (0: INT_MAX, the default), to exercise the chunked path.
void set_mpi_max_chunk_for_tests(size_t elements);
// Tests only: skip the look for notices as a collective starts, as a rank descheduled between that look and its
// first send would (the others' TIMEOUT notices are then found too late).
void set_mpi_skip_arrival_check_for_tests(bool skip);
}  // namespace detail

}  // namespace dpar
