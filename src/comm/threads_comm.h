// The threads backend: participants are threads of one process and buffers are in shared memory.
//
// Every collective is one pass between two barriers. Before the first barrier each participant publishes, in its
// slot, its buffers and a fingerprint of its call; after it, every participant checks the fingerprints and then
// moves its share of the data directly between the participants' buffers; the second barrier makes the result
// visible to all (and tells each participant that the others are done reading its buffers).
//
// Except small ones, which have one barrier: an all_gather of at most kStageBytes per participant, and an
// all_reduce_sum of at most kStageBytes for all participants together. Each participant copies its contribution
// into a staging buffer of the group's and publishes that instead of its buffer; after the barrier, each builds
// its own result from the staging buffers (all_gather copies them into its recv; all_reduce_sum sums them all, in
// rank order, instead of a slice) and returns, since nobody reads its buffers. The staging buffer of a round is
// not written again before the next round of the same parity, which every reader has finished by entering the
// round between (see Published). What a small collective costs is its barriers, not its copies: this saves one
// of two, for one more copy of the contribution (the engine's step is an all_reduce_sum and an all_gather, both
// small for a small model).
//
// The reductions (all_reduce, all_reduce_sum, reduce, reduce_scatter) split the elements, not the participants:
// participant r reduces its own slice of every participant's buffer, in rank order, and writes the result to every
// destination of that slice. Every byte is read once and written once per destination: the lower bound, and no
// participant does more than 1/size of the work (not "thread 0 sums everything"). all_reduce writes the slice to
// every participant's recv, reduce only to root's, and reduce_scatter's slice for participant r is block r, which
// lands in r's recv. broadcast: participant r copies its slice of root's buffer into everyone else's. all_gather:
// participant r copies every send (or staging buffer) into its own recv. (threads_comm.cpp says what was measured.)
// The sharded gradient path splits by Communicator::block_range: reduce_scatter_sum is all_reduce_sum's pass over
// participant r's block, written to r's buffer only (the same bits there); all_gather_blocks: participant r copies
// every other participant's block of that participant's buffer into its own.
//
// The reduction order is rank order, whoever computes a slice, and no FMA is involved: every participant gets the
// same bits, run after run, whatever the vector width (the float loops are compiled for AVX2 and baseline).
// Integer sums wrap; kMean divides the sum by size() (truncating toward zero for integers); float max and min
// propagate NaN.
//
// In place: all_reduce and reduce take send == recv. all_gather takes send == recv + rank * count (the
// contribution already in its block, as MPI_IN_PLACE and NCCL) and also send == recv (the contribution at the
// start of recv). reduce_scatter takes recv == send (the result lands at the start of the buffer, as
// MPI_IN_PLACE) and recv == send + rank * count (NCCL). Other overlaps of a participant's send and recv are refused;
// buffers of different participants must not overlap.
//
// Fingerprints: every call publishes its CallRecord (communicator.h: its sequence number on this participant,
// operation, count, dtype, op, root), and after the first barrier each participant compares every slot with
// participant 0's. All see the same slots, so on a difference all throw Error(MISMATCH) with the one message of
// mismatch_message(), naming the first participant that differs, and none touches data.
// Fingerprints, like everything a participant publishes, are double-buffered by the parity of the barrier round,
// so a participant that leaves early (after a barrier() or a mismatch, which have no second barrier) cannot
// overwrite what the others are still reading.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/group.h"
#include "common/sync.h"

namespace dpar {

class ThreadGroup final : public Group {
 public:
  static constexpr size_t kMaxParticipants = 256;
  // names[r] names participant r in messages ("replica 2 (cpu:2)"). At most kMaxParticipants. A timeout beyond
  // a century means none.
  ThreadGroup(std::vector<std::string> names, std::chrono::duration<double> timeout);

  int size() const override { return static_cast<int>(names_.size()); }
  const std::string& name(int rank) const { return names_[static_cast<size_t>(rank)]; }
  // Makes an aborted group usable again and restarts the sequence numbers of the fingerprints. Only while no
  // participant is inside a collective (nor has one queued on its communication thread).
  void reset();
  bool recover() override {
    reset();
    return true;
  }
  bool aborted() const { return aborted_.load(std::memory_order_acquire); }
  // Every participant waiting now or later throws Error(REMOTE) with `reason` (the first reason is kept).
  void abort(const std::string& reason) override;
  // An all_gather of at most stage_limit() bytes per participant (all_gather_blocks: per block), or an
  // all_reduce_sum of at most stage_limit() bytes for all participants together, has one barrier instead of two
  // (see above); its staging buffers hold
  // kStageBytes. The limit is where one barrier saved stops paying for the copies, measured on 2 cores (2026-11-23,
  // medians of 2 runs of 3000 calls): while the participants fit on the cores a barrier is a spin of well under a
  // microsecond, and staging wins only up to 1 KiB (2 threads, all_gather of 4 KiB: 0.5-0.6 us in two barriers,
  // 0.8-0.9 us staged); with more participants than cores each barrier sleeps for microseconds, and staging wins up
  // to 16 KiB (4 threads, all_gather of 4 KiB: 6.7-8.9 us in two barriers, 4.8-5.8 us staged).
  static constexpr size_t kStageBytes = size_t{16} << 10;
  size_t stage_limit() const { return stage_limit_; }
  // The first abort's reason ("" if none).
  std::string abort_reason();

  // Participant `rank`'s view. The group must outlive it.
  std::unique_ptr<Communicator> communicator(int rank) override;

 private:
  friend class ThreadCommunicator;

  // What a participant publishes for one collective: written before the collective's first barrier round, read by
  // the others after it and before they arrive at their next round. Kept by the parity of that round: a
  // participant writes the copy of round R + 2 only after the barrier of round R + 1, which every reader of round R
  // has entered, so no write meets a read (a participant that leaves after one barrier, as barrier() and a
  // mismatch do, may write before the others have read).
  struct alignas(64) Published {
    CallRecord record;
    const void* send = nullptr;  // all_reduce_sum, reduce_sum: null when the participant contributes nothing
    void* recv = nullptr;
  };
  // Three cache lines per participant. The first two are what the others read in a collective, one per parity
  // (the 24-byte record and two pointers do not fit two copies in one line): its owner writes one of them once per
  // call, before the first barrier. The third is written on every barrier and read by the others only to name who
  // is missing: kept apart, the owner's barrier arrivals do not pull back a line that the others are reading, and a
  // collective costs one transfer of a published line to the others and one back.
  struct alignas(64) Slot {
    Published pub[2];                               // by the parity of the barrier round
    alignas(64) std::atomic<uint64_t> arrivals{0};  // barriers this participant has entered: names who is missing
    uint32_t seq = 0;                               // written by its participant only (and reset())
    std::atomic<bool> busy{false};                  // inside a collective (catches a blocking call beside async work)
  };
  static_assert(sizeof(Published) == 64 && sizeof(Slot) == 192);

  void arrive_and_wait(int rank, const char* operation);
  // Throws Error(REMOTE) if the group is aborted (what arrive_and_wait() throws then).
  void fail_if_aborted(int rank, const char* operation) {
    if (aborted()) remote_failure(rank, operation);
  }
  [[noreturn]] void remote_failure(int rank, const char* operation);
  // Participant `rank`'s staging buffer for parity `parity` (kStageBytes), allocated on first use (std::bad_alloc);
  // called by participant `rank` only.
  unsigned char* stage(int rank, size_t parity);
  // After round `round`'s barrier: throws Error(MISMATCH) if any record differs from participant 0's.
  void check_records(uint64_t round, const char* operation) const;

  std::vector<std::string> names_;
  std::chrono::duration<double> timeout_;
  Spin spin_;  // whether all participants fit on the cores
  size_t stage_limit_;  // see stage_limit()
  std::vector<Slot> slots_;
  // Participant r's staging buffers, one per parity, allocated by r on its first staged call. Owned by the group,
  // not the communicator: the others may still be reading them after r has returned, and its communicator may be
  // gone by then.
  struct alignas(64) Stage {
    unsigned char bytes[2][kStageBytes];
  };
  std::vector<std::unique_ptr<Stage>> stages_;
  alignas(64) std::atomic<uint32_t> arrived_{0};
  alignas(64) WaitWord generation_;
  std::atomic<bool> aborted_{false};
  std::mutex abort_mutex_;
  std::string abort_reason_;
};

}  // namespace dpar
