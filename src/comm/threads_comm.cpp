#include "comm/threads_comm.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <type_traits>
#include <utility>

#include "comm/reduce_kernels.h"
#include "common/error.h"

namespace dpar {
namespace {

constexpr size_t kMaxParticipants = ThreadGroup::kMaxParticipants;

using Kernels = ReduceKernels;

// ---- The reduction pass ----------------------------------------------------------------------------------------

// Blocks stay in L1 while every participant's buffer is visited.
constexpr size_t kBlockBytes = 8192;
// Slices start on cache-line boundaries (relative to the buffers' starts) so no two participants write a line.
constexpr size_t kLineBytes = 64;

// Reduces the elements [begin, end) of `ni` inputs, in their order, and writes the result to `no` outputs. The
// pointers are the buffers' element 0. `target` is where each block is accumulated: an output that is input 0 or
// overlaps no input, or null for a block on the stack (an output that is another input must not be written before
// that input is read).
struct ReducePass {
  const Kernels* k = nullptr;
  size_t esz = 0;
  const char* in[kMaxParticipants];
  size_t ni = 0;
  char* out[kMaxParticipants];
  size_t no = 0;
  char* target = nullptr;
  size_t divisor = 1;  // kMean: the number of participants
  float scale = 1.0f;  // all_reduce_sum (f32)

  void run(size_t begin, size_t end) const {
    alignas(64) unsigned char local[kBlockBytes];
    const size_t block = kBlockBytes / esz;
    for (size_t b = begin; b < end; b += block) {
      const size_t len = std::min(block, end - b);
      const size_t off = b * esz, bytes = len * esz;
      char* acc = target ? target + off : reinterpret_cast<char*>(local);
      if (ni == 0) {
        std::memset(acc, 0, bytes);
      } else if (ni == 1) {
        if (acc != in[0] + off) std::memcpy(acc, in[0] + off, bytes);
      } else {
        // Rank order, always: the same bits on every run and every participant.
        if (acc == in[0] + off)
          k->into(acc, in[1] + off, len);
        else
          k->two(acc, in[0] + off, in[1] + off, len);
        for (size_t i = 2; i < ni; ++i) k->into(acc, in[i] + off, len);
      }
      if (divisor != 1) k->div(acc, len, divisor);
      if (scale != 1.0f) scale_f32(reinterpret_cast<float*>(acc), scale, len);
      for (size_t o = 0; o < no; ++o) {
        char* dst = out[o] + off;
        if (dst != acc) std::memcpy(dst, acc, bytes);
      }
    }
  }
};

// Participant `rank`'s slice [begin, end) of `count` elements of `esz` bytes.
std::pair<size_t, size_t> slice_of(size_t count, size_t esz, int rank, int n) {
  const size_t line = kLineBytes / esz;
  size_t per = (count + static_cast<size_t>(n) - 1) / static_cast<size_t>(n);
  per = (per + line - 1) / line * line;
  const size_t begin = std::min(count, per * static_cast<size_t>(rank));
  return {begin, std::min(count, begin + per)};
}

bool overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return x < y + b_bytes && y < x + a_bytes;
}

char* at(void* p, size_t offset) { return static_cast<char*>(p) + offset; }
const char* at(const void* p, size_t offset) { return static_cast<const char*>(p) + offset; }

}  // namespace

// ---- A participant ---------------------------------------------------------------------------------------------

class ThreadCommunicator final : public Communicator {
 public:
  using enum Collective;

  ThreadCommunicator(ThreadGroup& group, int rank) : group_(group), rank_(rank) {}
  // The communication thread calls this object's collectives: it must stop while the object is whole.
  ~ThreadCommunicator() override { stop_async(); }

  int rank() const override { return rank_; }
  int size() const override { return group_.size(); }
  const char* backend() const override { return "threads"; }
  bool moves(DType dtype) const override { return dtype != DType::kBF16; }

  void abort(const std::string& reason) override { group_.abort(reason); }

  Status async_error(std::string* reason) override {
    if (!group_.aborted()) return Status::kOk;
    *reason = detail::concat(group_.name(rank_), " cannot run collectives: ", group_.abort_reason());
    return Status::kRemote;
  }

 protected:
  void run(const CommCall& c) override {
    Busy busy(*this, c.operation);
    if (c.kind() != kBarrier && !moves(c.dtype()))
      local_failure(Status::kNotSupported, c.operation, ": the threads backend does not move bf16 (threads share "
                    "memory: compressing would only cost)");
    switch (c.kind()) {
      case kAllReduce: return all_reduce(c);
      case kBroadcast: return broadcast(c);
      case kReduce: return reduce(c);
      case kAllGather: return all_gather(c);
      case kReduceScatter: return reduce_scatter(c);
      case kBarrier: start(c, nullptr, nullptr); return;
      case kAllReduceSum:
      case kReduceSum: return sum_pass(c);
      case kReduceScatterSum: return reduce_scatter_sum(c);
      case kAllGatherBlocks: return all_gather_blocks(c);
    }
    local_failure(Status::kInternal, c.operation, ": not a collective of the threads backend");
  }

  // A refused call does not arrive: the others are released (Error(REMOTE) naming this participant).
  [[noreturn]] void refuse(const CommCall&, const Error& error) override {
    local_failure(error.status(), error.what());
  }

 private:
  void all_reduce(const CommCall& c) {
    const char* kOp = c.operation;
    const size_t count = c.count(), esz = dtype_size(c.dtype());
    const size_t p = start(c, c.send, c.recv);
    if (count == 0) return;

    const int n = size();
    ReducePass pass = reduce_pass(c.dtype(), c.op());
    for (int r = 0; r < n; ++r) {
      pass.in[pass.ni++] = static_cast<const char*>(peer(r, p).send);
      pass.out[pass.no++] = static_cast<char*>(peer(r, p).recv);
    }
    pass.target = pass.out[0];  // participant 0's recv is its send (input 0) or overlaps no input
    const auto [begin, end] = slice_of(count, esz, rank_, n);
    pass.run(begin, end);
    group_.arrive_and_wait(rank_, kOp);
  }

  void reduce(const CommCall& c) {
    const char* kOp = c.operation;
    const size_t count = c.count(), esz = dtype_size(c.dtype());
    const int root = c.root();
    const size_t p = start(c, c.send, rank_ == root ? c.recv : nullptr);
    if (count == 0) return;

    const int n = size();
    ReducePass pass = reduce_pass(c.dtype(), c.op());
    for (int r = 0; r < n; ++r) pass.in[pass.ni++] = static_cast<const char*>(peer(r, p).send);
    const auto& root_slot = peer(root, p);
    pass.out[pass.no++] = static_cast<char*>(root_slot.recv);
    // In place at a root other than 0, root's recv is a later input: accumulate on the stack.
    pass.target = (root_slot.recv == root_slot.send && root != 0) ? nullptr : pass.out[0];
    const auto [begin, end] = slice_of(count, esz, rank_, n);
    pass.run(begin, end);
    group_.arrive_and_wait(rank_, kOp);
  }

  void reduce_scatter(const CommCall& c) {
    const char* kOp = c.operation;
    const void* send = c.send;
    void* recv = c.recv;
    const size_t count = c.count();
    const int n = size();
    const size_t bytes = count * dtype_size(c.dtype());
    // The result lands where participant 0 reads (MPI in place): write it after the second barrier. (The call check
    // allowed recv == send and recv == send + rank * count as the only overlaps.)
    const bool deferred = count && recv == send && rank_ != 0;
    if (deferred) reserve_scratch(kOp, bytes);
    const size_t p = start(c, send, recv);
    if (count == 0) return;

    // This participant reduces block `rank_` of every send and writes it to its own recv.
    ReducePass pass = reduce_pass(c.dtype(), c.op());
    for (int r = 0; r < n; ++r) pass.in[pass.ni++] = at(peer(r, p).send, bytes * static_cast<size_t>(rank_));
    char* dst = deferred ? reinterpret_cast<char*>(scratch_.get()) : static_cast<char*>(recv);
    pass.out[pass.no++] = dst;
    // NCCL in place at rank > 0: recv is input `rank_`, read after input 0. Accumulate on the stack.
    pass.target = (dst != pass.in[0] && dst == pass.in[rank_]) ? nullptr : dst;
    pass.run(0, count);
    group_.arrive_and_wait(rank_, kOp);
    if (deferred) std::memcpy(recv, scratch_.get(), bytes);
  }

  // Participant r copies its slice of root's buffer into every other participant's, block by block (the block
  // stays in L1 while it is written n - 1 times). Measured on 2 threads beside "every participant copies root's
  // whole buffer into its own" (each owner then reads its result): 3.8 vs 11.5 us at 64 KiB and 60 vs 90 us at
  // 1 MiB. Pulling the whole buffer leaves root idle and puts the whole copy on one participant's critical path;
  // the slices split it n ways, as the reductions do.
  void broadcast(const CommCall& c) {
    const char* kOp = c.operation;
    const size_t count = c.count(), esz = dtype_size(c.dtype());
    const int root = c.root();
    const size_t p = start(c, c.recv, c.recv);
    if (count == 0) return;

    const int n = size();
    const char* src = static_cast<const char*>(peer(root, p).recv);
    const auto [begin, end] = slice_of(count, esz, rank_, n);
    const size_t block = kBlockBytes / esz;
    for (size_t b = begin; b < end; b += block) {
      const size_t off = b * esz, bytes = std::min(block, end - b) * esz;
      for (int r = 0; r < n; ++r)
        if (r != root) std::memcpy(at(peer(r, p).recv, off), src + off, bytes);
    }
    group_.arrive_and_wait(rank_, kOp);
  }

  void all_gather(const CommCall& c) {
    const char* kOp = c.operation;
    const void* send = c.send;
    void* recv = c.recv;
    const size_t count = c.count();
    const int n = size();
    const size_t bytes = count * dtype_size(c.dtype());
    const size_t total = bytes * static_cast<size_t>(n);
    if (count) {
      if (bytes <= group_.stage_limit()) return staged_all_gather(c, bytes);
      // In place: send is already in its block. Any other overlap (send == recv at rank > 0) would be
      // overwritten while the others read it: contribute a copy.
      if (overlaps(send, bytes, recv, total) && send != at(recv, bytes * static_cast<size_t>(rank_))) {
        reserve_scratch(kOp, bytes);
        std::memcpy(scratch_.get(), send, bytes);
        send = scratch_.get();
      }
    }
    const size_t p = start(c, send, recv);
    if (count == 0) return;

    // Participant r copies every send into its own recv: reads of the others' sends, writes to its own lines
    // only. Measured on 2 threads beside "participant r copies its send into block r of every recv" (each owner
    // then reads its result): 9.7 vs 33 us at 64 KiB, 110 vs 500 us at 1 MiB; writing into another participant's
    // recv moves the lines away from the owner, who reads them next.
    for (int r = 0; r < n; ++r) {
      char* dst = at(recv, bytes * static_cast<size_t>(r));
      const void* src = peer(r, p).send;
      if (dst != src) std::memcpy(dst, src, bytes);
    }
    group_.arrive_and_wait(rank_, kOp);
  }

  // The gradient path's sum, scaled, into every participant's buffer (kAllReduceSum) or root's alone (kReduceSum). Participants
  // with contributes == false are left out of the sum. Accumulates in the first contributor's buffer (input 0 and,
  // for all_reduce_sum, an output), so with a root a non-root contributor's buffer is clobbered; with no
  // contributor the outputs get zeros.
  void sum_pass(const CommCall& c) {
    const char* operation = c.operation;
    float* buffer = static_cast<float*>(c.recv);
    const size_t count = c.count();
    const bool to_root = c.kind() == kReduceSum;
    const int root = c.root();
    const float scale = c.scale;
    const int n = size();
    if (count && !to_root && count <= group_.stage_limit() / sizeof(float) / static_cast<size_t>(n))
      return staged_all_reduce_sum(c);
    const size_t p = start(c, c.contributes ? buffer : nullptr, buffer);
    if (count == 0) return;

    ReducePass pass;
    pass.k = &reduce_kernels(DType::kF32, ReduceOp::kSum);
    pass.esz = sizeof(float);
    for (int r = 0; r < n; ++r) {
      const auto& s = peer(r, p);
      if (!to_root || r == root) pass.out[pass.no++] = static_cast<char*>(s.recv);
      if (s.send) pass.in[pass.ni++] = static_cast<const char*>(s.send);
    }
    pass.target = pass.ni ? const_cast<char*>(pass.in[0]) : pass.out[0];
    pass.scale = scale;
    const auto [begin, end] = slice_of(count, sizeof(float), rank_, n);
    pass.run(begin, end);
    group_.arrive_and_wait(rank_, operation);
  }

  // The sharded gradient path: participant r sums block r (Communicator::block_range) of every contributor's
  // buffer, in rank order, with all_reduce_sum's pass and kernels (so block r holds the bits all_reduce_sum would
  // leave there), into its own buffer only. Its block of its own buffer is a later input unless it is the first
  // contributor: then the block is accumulated on the stack. The second barrier keeps every buffer readable until
  // all participants have read their blocks of it.
  void reduce_scatter_sum(const CommCall& c) {
    float* buffer = static_cast<float*>(c.recv);
    const size_t p = start(c, c.contributes ? buffer : nullptr, buffer);
    if (c.count() == 0) return;
    ReducePass pass;
    pass.k = &reduce_kernels(DType::kF32, ReduceOp::kSum);
    pass.esz = sizeof(float);
    for (int r = 0; r < size(); ++r)
      if (const void* s = peer(r, p).send) pass.in[pass.ni++] = static_cast<const char*>(s);
    pass.out[pass.no++] = reinterpret_cast<char*>(buffer);
    pass.target = c.contributes && pass.in[0] != pass.out[0] ? nullptr : pass.out[0];
    pass.scale = c.scale;
    const auto [begin, end] = block_range(c.count(), size(), rank_);
    pass.run(begin, end);
    group_.arrive_and_wait(rank_, c.operation);
  }

  // Participant r copies every other participant's block of that participant's buffer into its own buffer: it reads
  // blocks that their owners do not write, and writes its own buffer only (as all_gather, for the same reason).
  void all_gather_blocks(const CommCall& c) {
    float* buffer = static_cast<float*>(c.recv);
    const auto [first_begin, first_end] = block_range(c.count(), size(), 0);  // the largest block
    if (c.count() && (first_end - first_begin) * sizeof(float) <= group_.stage_limit())
      return staged_all_gather_blocks(c);
    const size_t p = start(c, buffer, buffer);
    if (c.count() == 0) return;
    for (int r = 0; r < size(); ++r) {
      if (r == rank_) continue;
      const auto [begin, end] = block_range(c.count(), size(), r);
      const float* src = static_cast<const float*>(peer(r, p).send);
      if (end > begin) std::memcpy(buffer + begin, src + begin, (end - begin) * sizeof(float));
    }
    group_.arrive_and_wait(rank_, c.operation);
  }

  // all_gather_blocks with one barrier, as staged_all_gather: the others read this participant's block from its
  // staging buffer, never from its buffer, so it may return as soon as its own buffer is whole (the engine's
  // parameter all-gather of a small model, every step). count > 0, the largest block within the stage.
  void staged_all_gather_blocks(const CommCall& c) {
    float* buffer = static_cast<float*>(c.recv);
    if (size() == 1) {  // its one block is its buffer already
      start(c, buffer, buffer);
      return;
    }
    const auto [mine_begin, mine_end] = block_range(c.count(), size(), rank_);
    unsigned char* stage = next_stage(c.operation);
    if (mine_end > mine_begin) std::memcpy(stage, buffer + mine_begin, (mine_end - mine_begin) * sizeof(float));
    const size_t p = start(c, stage, buffer);
    for (int r = 0; r < size(); ++r) {
      if (r == rank_) continue;
      const auto [begin, end] = block_range(c.count(), size(), r);
      if (end > begin) std::memcpy(buffer + begin, peer(r, p).send, (end - begin) * sizeof(float));
    }
  }

  // all_gather with one barrier (threads_comm.h): the others read this participant's staging buffer, never its
  // send or recv, so it may return as soon as its own recv is whole. A copy of the contribution also makes every
  // overlap of send and recv harmless. count > 0, buffers checked.
  void staged_all_gather(const CommCall& c, size_t bytes) {
    const void* send = c.send;
    void* recv = c.recv;
    if (size() == 1) {  // nobody reads what this participant publishes: no copy to stage
      start(c, send, recv);
      if (send != recv) std::memmove(recv, send, bytes);
      return;
    }
    unsigned char* stage = next_stage(c.operation);
    std::memcpy(stage, send, bytes);
    const size_t p = start(c, stage, recv);
    for (int r = 0; r < size(); ++r) {
      char* dst = at(recv, bytes * static_cast<size_t>(r));
      if (r != rank_ || dst != send) std::memcpy(dst, peer(r, p).send, bytes);  // else in place: already there
    }
  }

  // all_reduce_sum with one barrier (threads_comm.h), when every participant reducing the whole buffer costs less
  // than a barrier: each sums the staged contributions itself, in rank order with the same kernels as the sliced
  // pass, so every participant gets the bits that the sliced pass would give. count > 0, buffer checked.
  void staged_all_reduce_sum(const CommCall& c) {
    float* buffer = static_cast<float*>(c.recv);
    const size_t count = c.count();
    const bool contributes = c.contributes;
    // Alone, nobody reads what this participant publishes: its buffer is its contribution, as in the sliced pass.
    const void* mine = buffer;
    if (size() > 1) {
      unsigned char* stage = next_stage(c.operation);
      if (contributes) std::memcpy(stage, buffer, count * sizeof(float));
      mine = stage;
    }
    const size_t p = start(c, contributes ? mine : nullptr, buffer);
    ReducePass pass;
    pass.k = &reduce_kernels(DType::kF32, ReduceOp::kSum);
    pass.esz = sizeof(float);
    for (int r = 0; r < size(); ++r)
      if (const void* s = peer(r, p).send) pass.in[pass.ni++] = static_cast<const char*>(s);
    pass.out[pass.no++] = reinterpret_cast<char*>(buffer);
    pass.target = pass.out[0];  // input 0 (alone) or no input (those are staging buffers)
    pass.scale = c.scale;
    pass.run(0, count);
  }

  // This participant's staging buffer for its next barrier round. In an aborted group, a participant that stopped
  // waiting may still be reading that buffer from two rounds ago: none is returned then (start() would throw the
  // same error).
  unsigned char* next_stage(const char* operation) {
    const size_t parity = (slot().arrivals.load(std::memory_order_relaxed) + 1) & 1;
    group_.fail_if_aborted(rank_, operation);
    try {
      return group_.stage(rank_, parity);
    } catch (const std::bad_alloc&) {
      local_failure(Status::kOutOfMemory, operation, ": out of memory for ", 2 * ThreadGroup::kStageBytes,
                    " bytes of staging");
    }
  }

  // Marks this participant inside a collective, to catch a blocking call made while its asynchronous work runs
  // (best effort: plain loads and stores, no read-modify-write on the fast path). The flag lives in the
  // participant's private line of its slot: in the communicator object it would share a line with another
  // participant's communicator (they are allocated together) and cost a line transfer per call.
  struct Busy {
    Busy(ThreadCommunicator& c, const char* operation) : comm(c) {
      auto& busy = comm.slot().busy;
      if (busy.load(std::memory_order_relaxed))
        comm.local_failure(Status::kInvalidState, operation, ": ", comm.group_.name(comm.rank_),
                           " called a collective while another of its collectives is in progress (a blocking call "
                           "while its asynchronous work is pending?)");
      busy.store(true, std::memory_order_relaxed);
    }
    ~Busy() { comm.slot().busy.store(false, std::memory_order_relaxed); }
    ThreadCommunicator& comm;
  };

  ThreadGroup::Slot& slot() { return group_.slots_[rank_]; }

  // Publishes this call's fingerprint and buffers, waits for every participant and compares the fingerprints.
  // Returns the parity under which every participant's buffers are published (see peer()).
  size_t start(const CommCall& call, const void* send, void* recv) {
    auto& self = slot();
    // Every participant enters each barrier round with the same count of arrivals (reset() evens them out).
    const uint64_t round = self.arrivals.load(std::memory_order_relaxed) + 1;
    const size_t p = round & 1;
    auto& pub = self.pub[p];
    pub.send = send;
    pub.recv = recv;
    pub.record = call.record;
    pub.record.seq = ++self.seq;
    group_.arrive_and_wait(rank_, call.operation);
    group_.check_records(round, call.operation);
    return p;
  }
  // What participant r published for the collective that start() returned parity `p` for.
  const ThreadGroup::Published& peer(int r, size_t p) const { return group_.slots_[r].pub[p]; }

  ReducePass reduce_pass(DType dtype, ReduceOp op) const {
    ReducePass pass;
    pass.k = &reduce_kernels(dtype, op);
    pass.esz = dtype_size(dtype);
    if (op == ReduceOp::kMean) pass.divisor = static_cast<size_t>(size());
    return pass;
  }

  // A failure before this participant arrives: release the others (they would wait for it), then throw.
  template <class... Args>
  [[noreturn]] void local_failure(Status status, const Args&... args) {
    std::string message = detail::concat(args...);
    group_.abort(group_.name(rank_) + " failed: " + message);
    throw Error(status, message);
  }

  void reserve_scratch(const char* operation, size_t bytes) {
    if (bytes <= scratch_bytes_) return;
    try {
      scratch_.reset(new unsigned char[bytes]);
    } catch (const std::bad_alloc&) {
      local_failure(Status::kOutOfMemory, operation, ": out of memory for ", bytes, " bytes of scratch");
    }
    scratch_bytes_ = bytes;
  }

  ThreadGroup& group_;
  int rank_;
  // For the in-place forms that cannot write where the others read (see reduce_scatter, all_gather).
  std::unique_ptr<unsigned char[]> scratch_;
  size_t scratch_bytes_ = 0;
};

std::unique_ptr<Communicator> ThreadGroup::communicator(int rank) {
  DPAR_ENFORCE(rank >= 0 && rank < size(), Status::kInvalidArgument, "thread group: rank ", rank, " out of range");
  return std::make_unique<ThreadCommunicator>(*this, rank);
}

}  // namespace dpar
