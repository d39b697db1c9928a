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

constexpr size_t kMaxParticipants = 256;

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

  void all_reduce_sum(float* buffer, size_t count, bool contributes, float scale) override {
    sum_pass("all_reduce_sum", kAllReduceSum, buffer, count, contributes, scale, 0);
  }

  void reduce_sum(float* buffer, size_t count, bool contributes, float scale, int root) override {
    sum_pass("reduce_sum", kReduceSum, buffer, count, contributes, scale, root);
  }

  void all_reduce(const void* send, void* recv, size_t count, CommDType dtype, ReduceOp op) override {
    static constexpr const char* kOp = "all_reduce";
    Busy busy(*this, kOp);
    const size_t esz = check_types(kOp, dtype, op);
    if (count) {
      const size_t bytes = check_bytes(kOp, count, esz, 1);
      check_buffers(kOp, send, recv);
      check_in_place(kOp, send, recv, bytes);
    }
    const size_t p = start(kOp, kAllReduce, count, dtype, op, 0, send, recv);
    if (count == 0) return;

    const int n = size();
    ReducePass pass = reduce_pass(dtype, op);
    for (int r = 0; r < n; ++r) {
      pass.in[pass.ni++] = static_cast<const char*>(peer(r, p).send);
      pass.out[pass.no++] = static_cast<char*>(peer(r, p).recv);
    }
    pass.target = pass.out[0];  // participant 0's recv is its send (input 0) or overlaps no input
    const auto [begin, end] = slice_of(count, esz, rank_, n);
    pass.run(begin, end);
    group_.arrive_and_wait(rank_, kOp);
  }

  void reduce(const void* send, void* recv, size_t count, CommDType dtype, ReduceOp op, int root) override {
    static constexpr const char* kOp = "reduce";
    Busy busy(*this, kOp);
    const size_t esz = check_types(kOp, dtype, op);
    check_root(kOp, root);
    if (count) {
      const size_t bytes = check_bytes(kOp, count, esz, 1);
      if (!send) local_failure(DPAR_ERR_INVALID_ARGUMENT, kOp, ": send is null");
      if (rank_ == root) {
        if (!recv) local_failure(DPAR_ERR_INVALID_ARGUMENT, kOp, ": recv is null at the root");
        check_in_place(kOp, send, recv, bytes);
      }
    }
    const size_t p = start(kOp, kReduce, count, dtype, op, root, send, rank_ == root ? recv : nullptr);
    if (count == 0) return;

    const int n = size();
    ReducePass pass = reduce_pass(dtype, op);
    for (int r = 0; r < n; ++r) pass.in[pass.ni++] = static_cast<const char*>(peer(r, p).send);
    const auto& root_slot = peer(root, p);
    pass.out[pass.no++] = static_cast<char*>(root_slot.recv);
    // In place at a root other than 0, root's recv is a later input: accumulate on the stack.
    pass.target = (root_slot.recv == root_slot.send && root != 0) ? nullptr : pass.out[0];
    const auto [begin, end] = slice_of(count, esz, rank_, n);
    pass.run(begin, end);
    group_.arrive_and_wait(rank_, kOp);
  }

  void reduce_scatter(const void* send, void* recv, size_t count, CommDType dtype, ReduceOp op) override {
    static constexpr const char* kOp = "reduce_scatter";
    Busy busy(*this, kOp);
    const size_t esz = check_types(kOp, dtype, op);
    const int n = size();
    size_t bytes = 0;
    bool deferred = false;  // the result lands where participant 0 reads: write it after the second barrier
    if (count) {
      const size_t total = check_bytes(kOp, count, esz, static_cast<size_t>(n));
      bytes = total / static_cast<size_t>(n);
      check_buffers(kOp, send, recv);
      if (overlaps(send, total, recv, bytes)) {
        if (recv == send) {
          deferred = rank_ != 0;
        } else if (recv != at(send, bytes * static_cast<size_t>(rank_))) {
          local_failure(DPAR_ERR_INVALID_ARGUMENT, kOp,
                        ": recv overlaps send, but is neither send (MPI in place) nor send + rank * count (NCCL)");
        }
      }
      if (deferred) reserve_scratch(kOp, bytes);
    }
    const size_t p = start(kOp, kReduceScatter, count, dtype, op, 0, send, recv);
    if (count == 0) return;

    // This participant reduces block `rank_` of every send and writes it to its own recv.
    ReducePass pass = reduce_pass(dtype, op);
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
  void broadcast(void* buffer, size_t count, CommDType dtype, int root) override {
    static constexpr const char* kOp = "broadcast";
    Busy busy(*this, kOp);
    const size_t esz = check_types(kOp, dtype, ReduceOp::kSum);
    check_root(kOp, root);
    if (count) {
      check_bytes(kOp, count, esz, 1);
      if (!buffer) local_failure(DPAR_ERR_INVALID_ARGUMENT, kOp, ": buffer is null");
    }
    const size_t p = start(kOp, kBroadcast, count, dtype, ReduceOp::kSum, root, buffer, buffer);
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

  void all_gather(const void* send, void* recv, size_t count, CommDType dtype) override {
    static constexpr const char* kOp = "all_gather";
    Busy busy(*this, kOp);
    const size_t esz = check_types(kOp, dtype, ReduceOp::kSum);
    const int n = size();
    size_t bytes = 0;
    if (count) {
      const size_t total = check_bytes(kOp, count, esz, static_cast<size_t>(n));
      bytes = total / static_cast<size_t>(n);
      check_buffers(kOp, send, recv);
      if (bytes <= group_.stage_limit()) return staged_all_gather(send, recv, count, dtype, bytes);
      // In place: send is already in its block. Any other overlap (send == recv at rank > 0) would be
      // overwritten while the others read it: contribute a copy.
      if (overlaps(send, bytes, recv, total) && send != at(recv, bytes * static_cast<size_t>(rank_))) {
        reserve_scratch(kOp, bytes);
        std::memcpy(scratch_.get(), send, bytes);
        send = scratch_.get();
      }
    }
    const size_t p = start(kOp, kAllGather, count, dtype, ReduceOp::kSum, 0, send, recv);
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

  void barrier(const char* operation) override {
    Busy busy(*this, operation);
    start(operation, kBarrier, 0, CommDType::kF32, ReduceOp::kSum, 0, nullptr, nullptr);
  }

  void abort(const std::string& reason) override { group_.abort(reason); }

  dpar_status async_error(std::string* reason) override {
    if (!group_.aborted()) return DPAR_OK;
    *reason = detail::concat(group_.name(rank_), " cannot run collectives: ", group_.abort_reason());
    return DPAR_ERR_REMOTE;
  }

 private:
  // The gradient path's sum, scaled, into every participant's buffer (kAllReduceSum) or root's alone (kReduceSum). Participants
  // with contributes == false are left out of the sum. Accumulates in the first contributor's buffer (input 0 and,
  // for all_reduce_sum, an output), so with a root a non-root contributor's buffer is clobbered; with no
  // contributor the outputs get zeros.
  void sum_pass(const char* operation, Collective kind, float* buffer, size_t count, bool contributes, float scale,
                int root) {
    Busy busy(*this, operation);
    const bool to_root = kind == kReduceSum;
    if (to_root) check_root(operation, root);
    const int n = size();
    if (count) {
      check_bytes(operation, count, 4, 1);
      if (!buffer) local_failure(DPAR_ERR_INVALID_ARGUMENT, operation, ": buffer is null");
      if (!to_root && count <= group_.stage_limit() / sizeof(float) / static_cast<size_t>(n))
        return staged_all_reduce_sum(buffer, count, contributes, scale);
    }
    const size_t p = start(operation, kind, count, CommDType::kF32, ReduceOp::kSum, to_root ? root : 0,
                           contributes ? buffer : nullptr, buffer);
    if (count == 0) return;

    ReducePass pass;
    pass.k = &reduce_kernels(CommDType::kF32, ReduceOp::kSum);
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

  // all_gather with one barrier (threads_comm.h): the others read this participant's staging buffer, never its
  // send or recv, so it may return as soon as its own recv is whole. A copy of the contribution also makes every
  // overlap of send and recv harmless. count > 0, buffers checked.
  void staged_all_gather(const void* send, void* recv, size_t count, CommDType dtype, size_t bytes) {
    static constexpr const char* kOp = "all_gather";
    if (size() == 1) {  // nobody reads what this participant publishes: no copy to stage
      start(kOp, kAllGather, count, dtype, ReduceOp::kSum, 0, send, recv);
      if (send != recv) std::memmove(recv, send, bytes);
      return;
    }
    unsigned char* stage = next_stage(kOp);
    std::memcpy(stage, send, bytes);
    const size_t p = start(kOp, kAllGather, count, dtype, ReduceOp::kSum, 0, stage, recv);
    for (int r = 0; r < size(); ++r) {
      char* dst = at(recv, bytes * static_cast<size_t>(r));
      if (r != rank_ || dst != send) std::memcpy(dst, peer(r, p).send, bytes);  // else in place: already there
    }
  }

  // all_reduce_sum with one barrier (threads_comm.h), when every participant reducing the whole buffer costs less
  // than a barrier: each sums the staged contributions itself, in rank order with the same kernels as the sliced
  // pass, so every participant gets the bits that the sliced pass would give. count > 0, buffer checked.
  void staged_all_reduce_sum(float* buffer, size_t count, bool contributes, float scale) {
    static constexpr const char* kOp = "all_reduce_sum";
    // Alone, nobody reads what this participant publishes: its buffer is its contribution, as in the sliced pass.
    const void* mine = buffer;
    if (size() > 1) {
      unsigned char* stage = next_stage(kOp);
      if (contributes) std::memcpy(stage, buffer, count * sizeof(float));
      mine = stage;
    }
    const size_t p =
        start(kOp, kAllReduceSum, count, CommDType::kF32, ReduceOp::kSum, 0, contributes ? mine : nullptr, buffer);
    ReducePass pass;
    pass.k = &reduce_kernels(CommDType::kF32, ReduceOp::kSum);
    pass.esz = sizeof(float);
    for (int r = 0; r < size(); ++r)
      if (const void* s = peer(r, p).send) pass.in[pass.ni++] = static_cast<const char*>(s);
    pass.out[pass.no++] = reinterpret_cast<char*>(buffer);
    pass.target = pass.out[0];  // input 0 (alone) or no input (those are staging buffers)
    pass.scale = scale;
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
      local_failure(DPAR_ERR_OUT_OF_MEMORY, operation, ": out of memory for ", 2 * ThreadGroup::kStageBytes,
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
        comm.local_failure(DPAR_ERR_INVALID_STATE, operation, ": ", comm.group_.name(comm.rank_),
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
  size_t start(const char* operation, Collective kind, size_t count, CommDType dtype, ReduceOp op, int root,
               const void* send, void* recv) {
    auto& self = slot();
    // Every participant enters each barrier round with the same count of arrivals (reset() evens them out).
    const uint64_t round = self.arrivals.load(std::memory_order_relaxed) + 1;
    const size_t p = round & 1;
    auto& pub = self.pub[p];
    pub.send = send;
    pub.recv = recv;
    auto& fp = pub.fp;
    fp.count = count;
    fp.seq = ++self.seq;
    fp.root = static_cast<uint8_t>(root);
    fp.kind = static_cast<uint8_t>(kind);
    fp.dtype = static_cast<uint8_t>(dtype);
    fp.op = static_cast<uint8_t>(op);
    group_.arrive_and_wait(rank_, operation);
    group_.check_fingerprints(rank_, round, operation);
    return p;
  }
  // What participant r published for the collective that start() returned parity `p` for.
  const ThreadGroup::Published& peer(int r, size_t p) const { return group_.slots_[r].pub[p]; }

  ReducePass reduce_pass(CommDType dtype, ReduceOp op) const {
    ReducePass pass;
    pass.k = &reduce_kernels(dtype, op);
    pass.esz = comm_dtype_size(dtype);
    if (op == ReduceOp::kMean) pass.divisor = static_cast<size_t>(size());
    return pass;
  }

  // A failure before this participant arrives: release the others (they would wait for it), then throw.
  template <class... Args>
  [[noreturn]] void local_failure(dpar_status status, const Args&... args) {
    std::string message = detail::concat(args...);
    group_.abort(group_.name(rank_) + " failed: " + message);
    throw Error(status, message);
  }

  size_t check_types(const char* operation, CommDType dtype, ReduceOp op) {
    const auto d = static_cast<int32_t>(dtype), o = static_cast<int32_t>(op);
    if (dtype == CommDType::kBF16)
      local_failure(DPAR_ERR_NOT_SUPPORTED, operation, ": the threads backend does not move bf16 (threads share "
                    "memory: compressing would only cost)");
    if (d < 0 || d > 3) local_failure(DPAR_ERR_INVALID_ARGUMENT, operation, ": unknown dtype ", d);
    if (o < 0 || o > 3) local_failure(DPAR_ERR_INVALID_ARGUMENT, operation, ": unknown reduce op ", o);
    return comm_dtype_size(dtype);
  }
  void check_root(const char* operation, int root) {
    if (root < 0 || root >= size())
      local_failure(DPAR_ERR_INVALID_ARGUMENT, operation, ": root ", root, " is not a participant (size ", size(), ")");
  }
  // count * esz * blocks, refused if it overflows.
  size_t check_bytes(const char* operation, size_t count, size_t esz, size_t blocks) {
    if (count > SIZE_MAX / esz / blocks)
      local_failure(DPAR_ERR_INVALID_ARGUMENT, operation, ": count ", count, " is too large");
    return count * esz * blocks;
  }
  void check_buffers(const char* operation, const void* send, const void* recv) {
    if (!send) local_failure(DPAR_ERR_INVALID_ARGUMENT, operation, ": send is null");
    if (!recv) local_failure(DPAR_ERR_INVALID_ARGUMENT, operation, ": recv is null");
  }
  void check_in_place(const char* operation, const void* send, const void* recv, size_t bytes) {
    if (send != recv && overlaps(send, bytes, recv, bytes))
      local_failure(DPAR_ERR_INVALID_ARGUMENT, operation, ": send and recv overlap without being equal");
  }
  void reserve_scratch(const char* operation, size_t bytes) {
    if (bytes <= scratch_bytes_) return;
    try {
      scratch_.reset(new unsigned char[bytes]);
    } catch (const std::bad_alloc&) {
      local_failure(DPAR_ERR_OUT_OF_MEMORY, operation, ": out of memory for ", bytes, " bytes of scratch");
    }
    scratch_bytes_ = bytes;
  }

  ThreadGroup& group_;
  int rank_;
  // For the in-place forms that cannot write where the others read (see reduce_scatter, all_gather).
  std::unique_ptr<unsigned char[]> scratch_;
  size_t scratch_bytes_ = 0;
};

// ---- The group -------------------------------------------------------------------------------------------------

ThreadGroup::ThreadGroup(std::vector<std::string> names, std::chrono::duration<double> timeout)
    : names_(std::move(names)),
      timeout_(timeout),
      spin_(spin_policy(names_.size())),
      stage_limit_(spin_ == Spin::kYes ? size_t{1} << 10 : kStageBytes),
      slots_(names_.size()),
      stages_(names_.size()) {
  DPAR_ENFORCE(!names_.empty() && names_.size() <= kMaxParticipants, DPAR_ERR_INVALID_ARGUMENT,
               "thread group: size must be 1 to ", kMaxParticipants, ", got ", names_.size());
}

std::unique_ptr<Communicator> ThreadGroup::communicator(int rank) {
  DPAR_ENFORCE(rank >= 0 && rank < size(), DPAR_ERR_INVALID_ARGUMENT, "thread group: rank ", rank, " out of range");
  return std::make_unique<ThreadCommunicator>(*this, rank);
}

void ThreadGroup::reset() {
  arrived_.store(0, std::memory_order_relaxed);
  uint64_t most = 0;
  for (auto& s : slots_) most = std::max(most, s.arrivals.load());
  for (auto& s : slots_) {
    s.arrivals.store(most);
    s.seq = 0;
  }
  {
    std::lock_guard<std::mutex> lock(abort_mutex_);
    abort_reason_.clear();
  }
  aborted_.store(false, std::memory_order_release);
}

std::string ThreadGroup::abort_reason() {
  std::lock_guard<std::mutex> lock(abort_mutex_);
  return abort_reason_;
}

void ThreadGroup::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(abort_mutex_);
    if (abort_reason_.empty()) abort_reason_ = reason;
  }
  aborted_.store(true, std::memory_order_seq_cst);
  generation_.increment_and_wake();
}

void ThreadGroup::check_fingerprints(int rank, uint64_t round, const char* operation) const {
  // On the critical path of every collective: two 64-bit words per participant and one branch for all of them.
  const size_t p = round & 1;
  uint64_t first[2], diff = 0;
  std::memcpy(first, &slots_[0].pub[p].fp, sizeof first);
  for (int r = 1; r < size(); ++r) {
    uint64_t f[2];
    std::memcpy(f, &slots_[r].pub[p].fp, sizeof f);
    diff |= (f[0] ^ first[0]) | (f[1] ^ first[1]);
  }
  if (diff == 0) [[likely]]
    return;
  for (int r = 1; r < size(); ++r)
    if (!(slots_[r].pub[p].fp == first_fp(p))) fail_mismatch(rank, r, round, operation);
}

void ThreadGroup::fail_mismatch(int rank, int other, uint64_t round, const char* operation) const {
  const size_t p = round & 1;
  const Fingerprint& a = slots_[other].pub[p].fp;
  const Fingerprint& b = first_fp(p);
  auto describe = [&](const Fingerprint& f) {
    std::ostringstream os;
    const auto kind = static_cast<Collective>(f.kind);
    os << collective_name(kind);
    const auto dtype = comm_dtype_name(static_cast<CommDType>(f.dtype));
    const auto op = reduce_op_name(static_cast<ReduceOp>(f.op));
    switch (kind) {
      case Collective::kBarrier: break;
      case Collective::kAllReduceSum:
      case Collective::kAllGather: os << " of " << f.count << " " << dtype; break;
      case Collective::kAllReduce:
      case Collective::kReduceScatter: os << " of " << f.count << " " << dtype << " (" << op << ")"; break;
      case Collective::kReduce:
        os << " of " << f.count << " " << dtype << " (" << op << ") to root " << int(f.root);
        break;
      case Collective::kReduceSum:
        os << " of " << f.count << " " << dtype << " to root " << int(f.root);
        break;
      case Collective::kBroadcast:
        os << " of " << f.count << " " << dtype << " from root " << int(f.root);
        break;
    }
    if (a.seq != b.seq) os << " as its collective #" << f.seq;
    return os.str();
  };
  fail(DPAR_ERR_MISMATCH, operation, ": participant ", other, " (", names_[other], ") called ", describe(a),
       " but participant 0 (", names_[0], ") called ", describe(b), " (seen by ", names_[rank], ")");
}

unsigned char* ThreadGroup::stage(int rank, size_t parity) {
  auto& stage = stages_[static_cast<size_t>(rank)];
  if (!stage) stage = std::make_unique<Stage>();
  return stage->bytes[parity];
}

void ThreadGroup::remote_failure(int rank, const char* operation) {
  std::lock_guard<std::mutex> lock(abort_mutex_);
  fail(DPAR_ERR_REMOTE, operation, ": ", names_[rank], " stopped waiting because ", abort_reason_);
}

void ThreadGroup::arrive_and_wait(int rank, const char* operation) {
  if (size() == 1) {  // nobody to wait for or to release
    if (aborted()) remote_failure(rank, operation);
    slots_[rank].arrivals.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  // The generation is read before the abort flag: abort() sets the flag and then bumps the generation, so an
  // abort that lands after this read either shows in the flag or ends the wait below.
  const uint32_t gen = generation_.load();
  if (aborted()) remote_failure(rank, operation);
  const uint64_t my_arrival = slots_[rank].arrivals.fetch_add(1, std::memory_order_relaxed) + 1;
  if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<uint32_t>(size())) {
    arrived_.store(0, std::memory_order_relaxed);
    generation_.increment_and_wake();  // releases everyone; the release publishes this round's slots
    if (aborted()) remote_failure(rank, operation);
    return;
  }
  // A timeout beyond a century means none (and must not overflow the clock's nanoseconds).
  const auto deadline = timeout_.count() > 3.0e9 ? Clock::time_point::max()
                                                 : Clock::now() + std::chrono::duration_cast<Clock::duration>(timeout_);
  while (generation_.load() == gen) {
    if (!generation_.wait_while_equal(gen, deadline, spin_)) {
      std::ostringstream missing;
      for (int r = 0; r < size(); ++r)
        if (slots_[r].arrivals.load() < my_arrival) missing << (missing.tellp() ? ", " : "") << names_[r];
      // Tell the others too: a timed-out group cannot continue.
      std::ostringstream reason;
      reason << operation << " timed out waiting for " << missing.str();
      abort(reason.str());
      fail(DPAR_ERR_TIMEOUT, operation, ": ", missing.str(), " did not arrive within ", timeout_.count(), " s (",
           names_[rank], " waited)");
    }
  }
  if (aborted()) remote_failure(rank, operation);
}

}  // namespace dpar
