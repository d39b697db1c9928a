// The MPI communicator (mpi_comm.h): creation over a base communicator, teardown, and the collectives' frame
// (arrival checks, agreement, transfer through MPI's own collectives, finish).
#include <mpi.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/mpi_internal.h"
#include "comm/reduce_kernels.h"

namespace dpar {

using namespace mpi_internal;
using enum Collective;

namespace {

size_t g_max_chunk = INT_MAX;  // elements per MPI call (tests lower it)
std::atomic<bool> g_skip_arrival_check{false};  // tests only

const char* cbytes(const void* p, size_t offset) { return static_cast<const char*>(p) + offset; }
char* bytes_at(void* p, size_t offset) { return static_cast<char*>(p) + offset; }

// The base communicators over which a creation timed out: their MPI_Comm_idup is still pending (an MPI request
// cannot be cancelled), so the ranks' creations over them no longer pair by order.
std::mutex g_stale_bases_mutex;
std::vector<MPI_Comm> g_stale_bases;

// The duplicates of communicators that failed, waiting to be freed. A rank that gave up on a collective may have
// sent notices or fingerprints that this rank never received, and OpenMPI gives a freed communicator's context id
// to the next one created, with the messages still queued for it: a later communicator would read an earlier one's
// abort. So a failed communicator is freed only once every rank has created the next one over the same base (the
// duplication is collective: what the others sent before it has been sent), and what reached it is received first.
struct Quarantined {
  MPI_Comm comm, control;
};

std::mutex g_quarantine_mutex;
std::vector<Quarantined> g_quarantine;

// Receives every point-to-point message that has reached `comm` (some looks: a message still in shared memory
// shows only at a later one), then frees it.
void drain_and_free(MPI_Comm& comm) {
  for (int empty = 0; empty < 64;) {
    int flag = 0;
    MPI_Message message;
    MPI_Status status;
    if (MPI_Improbe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm, &flag, &message, &status) != MPI_SUCCESS) break;
    if (!flag) {
      ++empty;
      continue;
    }
    int count = 0;
    MPI_Get_count(&status, MPI_BYTE, &count);
    std::vector<char> data(static_cast<size_t>(std::max(count, 1)));
    MPI_Mrecv(data.data(), count, MPI_BYTE, &message, MPI_STATUS_IGNORE);
  }
  MPI_Comm_free(&comm);
}

void free_quarantined() {
  std::vector<Quarantined> ready;
  {
    std::lock_guard<std::mutex> lock(g_quarantine_mutex);
    ready.swap(g_quarantine);
  }
  for (Quarantined& q : ready) {
    drain_and_free(q.control);
    drain_and_free(q.comm);
  }
}


}  // namespace

namespace detail {

void set_mpi_max_chunk_for_tests(size_t elements) { g_max_chunk = elements ? elements : INT_MAX; }

void set_mpi_skip_arrival_check_for_tests(bool skip) { g_skip_arrival_check.store(skip); }
}  // namespace detail

MpiCommunicator::MpiCommunicator(MPI_Comm base, MpiOptions options)
    : options_(options), timeout_seconds_(options.timeout_seconds) {
  DPAR_CHECK_ARG(options_.timeout_seconds > 0, "mpi communicator: timeout_seconds must be positive, got ",
                 options_.timeout_seconds);
  DPAR_CHECK_ARG(options_.create_timeout_seconds >= 0, "mpi communicator: create_timeout_seconds must be >= 0, got ",
                 options_.create_timeout_seconds);
  const double create_timeout =
      options_.create_timeout_seconds > 0 ? options_.create_timeout_seconds : options_.timeout_seconds;
  DPAR_CHECK_ARG(options_.transfer == MpiOptions::Transfer::kBlocking ||
                     options_.transfer == MpiOptions::Transfer::kNonBlocking,
                 "mpi communicator: unknown transfer mode");
  thread_level_ = MpiRuntime::instance().thread_level();
  DPAR_CHECK_ARG(base != MPI_COMM_NULL, "mpi communicator: the base communicator is MPI_COMM_NULL");

  // Two duplicates of base, each created by a non-blocking collective polled under the timeout: a rank that never
  // constructs its communicator makes the others fail instead of hanging.
  const bool forever = create_timeout > 3.0e9;
  const auto deadline = forever ? SteadyClock::time_point::max()
                                : SteadyClock::now() + std::chrono::duration_cast<SteadyClock::duration>(
                                                           std::chrono::duration<double>(create_timeout));
  auto dup = [&](MPI_Comm from, MPI_Comm* out, const char* what) {
    MPI_Request request;
    int rc = MPI_Comm_idup(from, out, &request);
    if (rc != MPI_SUCCESS)
      fail(Status::kCommunication, "mpi communicator: MPI_Comm_idup (", what, ") failed: ", mpi_error_string(rc));
    for (unsigned i = 0;; ++i) {
      int done = 0;
      rc = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS)
        fail(Status::kCommunication, "mpi communicator: MPI_Comm_idup (", what, ") failed: ", mpi_error_string(rc));
      if (done) break;
      if ((i & 63) == 63) {
        if (SteadyClock::now() >= deadline)
          fail(Status::kTimeout, "mpi communicator: not every rank of the base communicator created its "
               "communicator within ", create_timeout, " s (the creation is collective)");
        sched_yield();
      }
    }
    MPI_Comm_set_errhandler(*out, MPI_ERRORS_RETURN);
  };
  {
    std::lock_guard<std::mutex> lock(g_stale_bases_mutex);
    DPAR_ENFORCE(std::find(g_stale_bases.begin(), g_stale_bases.end(), base) == g_stale_bases.end(),
                 Status::kInvalidState, "mpi communicator: a creation over this base communicator timed out "
                 "earlier in this process, and its duplication is still pending on the base: a new creation would "
                 "pair with the wrong ranks' duplications. Create communicators over another base (a new "
                 "duplicate of MPI_COMM_WORLD, made by every rank) or restart the job");
  }
  try {
    dup(base, &comm_, "collectives");
    dup(base, &control_, "control");
    free_quarantined();
  } catch (const Error& e) {
    if (e.status() == Status::kTimeout) {
      std::lock_guard<std::mutex> lock(g_stale_bases_mutex);
      g_stale_bases.push_back(base);
    }
    throw;
  }
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  table_.assign(static_cast<size_t>(size_), Header{});
  size_t most_blocks = 1;  // the most blocks one message of the exchange carries
  for (int d = 1; d < size_; d *= 2) most_blocks = std::max(most_blocks, static_cast<size_t>(std::min(d, size_ - d)));
  const size_t per_block = kEagerMessageBytes / most_blocks;
  fused_max_bytes_ = per_block > kHeaderBytes ? (per_block - kHeaderBytes) & ~size_t{7} : 0;
  gather_.assign(static_cast<size_t>(size_) * (kHeaderBytes + fused_max_bytes_) / sizeof(int64_t), 0);
  offsets_.assign(static_cast<size_t>(size_) + 1, 0);
  payloads_.assign(static_cast<size_t>(size_), nullptr);
  timeout_notice_seq_.assign(static_cast<size_t>(size_), -1);
  void_notice_seq_.assign(static_cast<size_t>(size_), -1);
}

void MpiCommunicator::set_timeout(std::chrono::duration<double> timeout) {
  DPAR_CHECK_ARG(timeout.count() > 0, "mpi communicator: the timeout must be positive, got ", timeout.count(), " s");
  timeout_seconds_.store(timeout.count(), std::memory_order_relaxed);
}

bool MpiCommunicator::can_duplicate() const {
  return thread_level_ >= MPI_THREAD_MULTIPLE && state_.load(std::memory_order_acquire) == kUsable;
}

std::unique_ptr<Communicator> MpiCommunicator::duplicate() {
  // Under the lock: the duplication is a collective on comm_, ordered with this rank's other collectives there.
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_.load(std::memory_order_acquire) != kUsable) {
    std::lock_guard<std::mutex> reason(reason_mutex_);
    fail(Status::kInvalidState, "mpi communicator: cannot duplicate a communicator that failed: ", broken_reason_);
  }
  MpiOptions options = options_;
  options.timeout_seconds = timeout_seconds();
  options.create_timeout_seconds = 0.0;
  return std::make_unique<MpiCommunicator>(comm_, options);
}

MpiCommunicator::~MpiCommunicator() {
  stop_async();
  int finalized = 1;
  MPI_Finalized(&finalized);
  if (finalized) return;  // MPI freed everything
  std::lock_guard<std::mutex> lock(mutex_);
  if (abort_requested_.load()) send_abort_notices_locked();
  // A rank that arrived late may be inside the transfer of a collective this rank left: give it a grace period.
  const auto end = SteadyClock::now() + grace_period(timeout_seconds());
  while (!release_abandoned() && SteadyClock::now() < end) std::this_thread::sleep_for(std::chrono::microseconds(100));
  {
    std::lock_guard<std::mutex> registry(g_abandoned_mutex);
    auto it = std::find(g_abandoned.begin(), g_abandoned.end(), this);
    if (it != g_abandoned.end()) g_abandoned.erase(it), g_abandoned_count.fetch_sub(1);
  }
  test_pending_sends();
  for (auto& s : pending_sends_) {
    // A notice to a rank that never received it (dead, or gone): MPI may still read the buffer, so it is left
    // allocated (a few bytes, only after a failure).
    MPI_Request_free(&s.request);
    (void)new std::shared_ptr<std::vector<char>>(std::move(s.data));
  }
  pending_sends_.clear();
  // A communicator with a request that never completes is left to MPI_Finalize, and so are the buffers that such
  // a request may still write into if the rank it waits for arrives after all. One that failed waits in quarantine
  // for the next creation (g_quarantine): the others may have sent it messages it never received.
  if (requests_left_pending_) {
    (void)new std::vector<int64_t>(std::move(gather_));
  } else if (state_.load() == kUsable && !abort_requested_.load()) {
    MPI_Comm_free(&comm_);
    MPI_Comm_free(&control_);
  } else {
    std::lock_guard<std::mutex> lock(g_quarantine_mutex);
    g_quarantine.push_back({comm_, control_});
  }
}

std::string MpiCommunicator::where(const CommCall& call, uint64_t seq) const {
  std::ostringstream os;
  os << "mpi " << collective_name(call.kind());
  if (call.kind() == kBarrier && std::strcmp(call.operation, "barrier") != 0) os << " '" << call.operation << "'";
  os << " #" << seq << " (rank " << rank_ << " of " << size_ << ")";
  return os.str();
}

void MpiCommunicator::check_usable(const CommCall& call) {
  if (thread_level_ < MPI_THREAD_SERIALIZED) {
    int main_thread = 0;
    MPI_Is_thread_main(&main_thread);
    DPAR_ENFORCE(main_thread, Status::kNotSupported, where(call, seq_.load()), ": MPI was initialised with ",
                 thread_level_name(thread_level_), ", so only the main thread may call MPI (async_* needs "
                 "MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE)");
  }
  const uint64_t seq = seq_.load();
  if (abort_requested_.load()) send_abort_notices_locked();
  if (state_.load() != kUsable) {
    release_abandoned();
    throw_unusable(where(call, seq));
  }
  if (g_skip_arrival_check.load(std::memory_order_relaxed)) return;
  // Notices already there mean that this rank is late (the others gave up on this collective) or that the group
  // broke. Two looks: OpenMPI's probe looks at its queue before it makes progress, so a notice still in shared
  // memory shows at the second. (A late rank would otherwise complete the exchange with the messages the others
  // sent before they gave up, and go on to a transfer that nobody joins.)
  check_late(call, seq, 2);
}

void MpiCommunicator::transfer(const CommCall& c, uint64_t seq) {
  if (c.count() == 0 || c.kind() == kBarrier) return;
  const bool nonblocking = options_.transfer == MpiOptions::Transfer::kNonBlocking;
  const MPI_Datatype type = mpi_type(c.dtype());
  const size_t esz = dtype_size(c.dtype());
  const size_t bytes = c.count() * esz;
  // One MPI call, blocking or non-blocking and polled.
  auto invoke = [&](const char* function, auto&& blocking, auto&& start) {
    int rc;
    if (nonblocking) {
      MPI_Request request;
      rc = start(&request);
      if (rc == MPI_SUCCESS) {
        wait(&request, 1, MPI_STATUSES_IGNORE, c, seq, true, SteadyClock::now());
        return;
      }
    } else {
      rc = blocking();
    }
    if (rc != MPI_SUCCESS) mpi_failed(function, rc, where(c, seq));
  };
  // all_reduce, broadcast and reduce in chunks of at most INT_MAX elements.
  auto chunks = [&](auto&& each) {
    for (size_t done = 0; done < c.count();) {
      const size_t n = std::min(c.count() - done, g_max_chunk);
      each(done * esz, static_cast<int>(n));
      done += n;
    }
  };
  switch (c.kind()) {
    case kAllReduce:
    case kAllReduceSum: {
      const bool in_place = c.kind() == kAllReduceSum || c.send == c.recv;
      if (c.kind() == kAllReduceSum && !c.contributes) std::memset(c.recv, 0, bytes);
      const MPI_Op op = mpi_op(c.dtype(), c.op());
      chunks([&](size_t off, int n) {
        const void* send = in_place ? MPI_IN_PLACE : cbytes(c.send, off);
        void* recv = bytes_at(c.recv, off);
        invoke(
            "MPI_Allreduce", [&] { return MPI_Allreduce(send, recv, n, type, op, comm_); },
            [&](MPI_Request* r) { return MPI_Iallreduce(send, recv, n, type, op, comm_, r); });
      });
      break;
    }
    case kBroadcast:
      chunks([&](size_t off, int n) {
        void* buffer = bytes_at(c.recv, off);
        invoke(
            "MPI_Bcast", [&] { return MPI_Bcast(buffer, n, type, c.root(), comm_); },
            [&](MPI_Request* r) { return MPI_Ibcast(buffer, n, type, c.root(), comm_, r); });
      });
      break;
    case kReduce: {
      const bool is_root = rank_ == c.root();
      const MPI_Op op = mpi_op(c.dtype(), c.op());
      chunks([&](size_t off, int n) {
        const void* send = is_root && c.send == c.recv ? MPI_IN_PLACE : cbytes(c.send, off);
        void* recv = is_root ? bytes_at(c.recv, off) : nullptr;
        invoke(
            "MPI_Reduce", [&] { return MPI_Reduce(send, recv, n, type, op, c.root(), comm_); },
            [&](MPI_Request* r) { return MPI_Ireduce(send, recv, n, type, op, c.root(), comm_, r); });
      });
      break;
    }
    case kAllGather: {
      const int n = static_cast<int>(c.count());
      void* own_block = bytes_at(c.recv, rank_ * bytes);
      const bool in_place = c.send == c.recv || c.send == own_block;
      if (c.send == c.recv && rank_ != 0) std::memmove(own_block, c.recv, bytes);
      const void* send = in_place ? MPI_IN_PLACE : c.send;
      invoke(
          "MPI_Allgather", [&] { return MPI_Allgather(send, n, type, c.recv, n, type, comm_); },
          [&](MPI_Request* r) { return MPI_Iallgather(send, n, type, c.recv, n, type, comm_, r); });
      break;
    }
    case kReduceScatter: {
      // Equal blocks, summed in rank order (below); the result lands in recv (in place or not: the blocks were
      // moved out of the buffer first).
      const std::vector<int> counts(static_cast<size_t>(size_), static_cast<int>(c.count()));
      std::vector<int> displs(static_cast<size_t>(size_));
      for (int r = 0; r < size_; ++r) displs[static_cast<size_t>(r)] = r * static_cast<int>(c.count());
      reduce_scatter_in_rank_order(c, seq, c.send, counts, displs, c.recv, c.op());
      break;
    }
    case kReduceScatterSum:
    case kAllGatherBlocks: {
      // Per-rank counts: block_range's blocks, some shorter or empty (check_limits() keeps count within int).
      std::vector<int> counts(static_cast<size_t>(size_)), displs(static_cast<size_t>(size_));
      for (int r = 0; r < size_; ++r) {
        const auto [begin, end] = block_range(c.count(), size_, r);
        counts[static_cast<size_t>(r)] = static_cast<int>(end - begin);
        displs[static_cast<size_t>(r)] = static_cast<int>(begin);
      }
      if (c.kind() == kAllGatherBlocks) {
        invoke(
            "MPI_Allgatherv",
            [&] {
              return MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, c.recv, counts.data(), displs.data(), type,
                                    comm_);
            },
            [&](MPI_Request* r) {
              return MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, c.recv, counts.data(), displs.data(), type,
                                     comm_, r);
            });
        break;
      }
      if (!c.contributes) std::memset(c.recv, 0, bytes);
      const size_t mine = static_cast<size_t>(rank_);
      reduce_scatter_in_rank_order(c, seq, c.recv, counts, displs, bytes_at(c.recv, static_cast<size_t>(displs[mine]) * esz),
                                   ReduceOp::kSum);
      break;
    }
    default: break;
  }
}

void MpiCommunicator::reduce_scatter_in_rank_order(const CommCall& c, uint64_t seq, const void* whole,
                                                   const std::vector<int>& counts, const std::vector<int>& displs,
                                                   void* out, ReduceOp op) {
  // Block r of every rank's buffer goes to rank r (MPI_Alltoallv: (P-1)/P of the buffer leaves and enters each
  // rank, as in a ring's reduce-scatter), and each rank sums the blocks it received in rank order with the kernels
  // of a fused all-reduce: the sum's bits do not depend on MPI's choice of algorithm, and equal those of an
  // all-reduce that adds in rank order (fused, and the threads backend's).
  const MPI_Datatype type = mpi_type(c.dtype());
  const size_t esz = dtype_size(c.dtype());
  const int mine = counts[static_cast<size_t>(rank_)];
  const size_t block_bytes = static_cast<size_t>(mine) * esz;
  scatter_stage_.resize(std::max<size_t>(static_cast<size_t>(size_) * block_bytes, 1));
  const std::vector<int> from_each(static_cast<size_t>(size_), mine);
  std::vector<int> at(static_cast<size_t>(size_));
  for (int r = 0; r < size_; ++r) at[static_cast<size_t>(r)] = r * mine;
  char* stage = scatter_stage_.data();
  int rc;
  if (options_.transfer == MpiOptions::Transfer::kNonBlocking) {
    MPI_Request request;
    rc = MPI_Ialltoallv(whole, counts.data(), displs.data(), type, stage, from_each.data(), at.data(), type, comm_,
                        &request);
    if (rc == MPI_SUCCESS) wait(&request, 1, MPI_STATUSES_IGNORE, c, seq, true, SteadyClock::now());
  } else {
    rc = MPI_Alltoallv(whole, counts.data(), displs.data(), type, stage, from_each.data(), at.data(), type, comm_);
  }
  if (rc != MPI_SUCCESS) mpi_failed("MPI_Alltoallv", rc, where(c, seq));
  std::vector<const char*> in(static_cast<size_t>(size_));
  for (int r = 0; r < size_; ++r) in[static_cast<size_t>(r)] = stage + static_cast<size_t>(r) * block_bytes;
  if (mine > 0) reduce_blocks(out, in.data(), in.size(), static_cast<size_t>(mine), c.dtype(), op);
}

void MpiCommunicator::finish(const CommCall& c) {
  if (c.count() == 0) return;
  switch (c.kind()) {
    case kAllReduce:
    case kReduceScatter:
      if (c.op() == ReduceOp::kMean) divide_by(c.dtype(), c.recv, c.count(), static_cast<size_t>(size_));
      break;
    case kReduce:
      if (c.op() == ReduceOp::kMean && rank_ == c.root())
        divide_by(c.dtype(), c.recv, c.count(), static_cast<size_t>(size_));
      break;
    case kAllReduceSum:
      if (c.scale != 1.0f) scale_f32(static_cast<float*>(c.recv), c.scale, c.count());
      break;
    case kReduceScatterSum:
      if (c.scale != 1.0f) {
        const auto [begin, end] = block_range(c.count(), size_, rank_);
        scale_f32(static_cast<float*>(c.recv) + begin, c.scale, end - begin);
      }
      break;
    default: break;
  }
}

void MpiCommunicator::run(const CommCall& call) {
  if (call.kind() == kReduceSum) return reduce_sum_through_reduce(call);  // MPI_Reduce, then the root scales
  execute(call, nullptr);
}

void MpiCommunicator::refuse(const CommCall& call, const Error& error) {
  // The others run a reduce_sum as a reduce (run()): a refused one takes part in that exchange.
  CommCall as_run = call;
  if (call.kind() == kReduceSum) {
    as_run.record.kind = static_cast<uint8_t>(kReduce);
    as_run.operation = collective_name(kReduce);
  }
  execute(as_run, &error);  // throws: the exchange tells the others, and this rank throws its own error
  throw error;
}

void MpiCommunicator::execute(const CommCall& call, const Error* refused) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_usable(call);
  const uint64_t seq = seq_.load();
  // From here on every rank is inside this collective with the same arguments: a local abort() waits for its end.
  if (agree(call, seq, refused)) {
    reduce_fused(call);
  } else {
    transfer(call, seq);
    // A blocking transfer may have been joined only to release this rank (see "Abandoned exchanges").
    if (options_.transfer == MpiOptions::Transfer::kBlocking && call.count() && call.kind() != kBarrier)
      check_void(call, seq);
  }
  finish(call);
  if (abort_requested_.load()) send_abort_notices_locked();
}

}  // namespace dpar
