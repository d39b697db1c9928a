#include "comm/mpi_comm.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <condition_variable>
#include <thread>
#include <mutex>

#include "comm/reduce_kernels.h"

namespace dpar {
namespace {

using SteadyClock = std::chrono::steady_clock;

// What a collective is (communicator.h); fingerprints and notices carry it as an int64.
using enum Collective;

bool has_op(Collective coll) { return coll == kAllReduce || coll == kReduce || coll == kReduceScatter; }
bool has_root(Collective coll) { return coll == kBroadcast || coll == kReduce; }

// A fingerprint: 8 int64 per rank, gathered by every rank. The fields before kError must agree; kPayloadBytes is
// the size of the data that follows the fingerprint in a fused all-reduce (0 otherwise).
enum Field { kSeq = 0, kColl, kCount, kDType, kOp, kRoot, kError, kPayloadBytes, kFields };
const char* const kFieldNames[kFields] = {"sequence number", "operation", "count", "dtype", "op", "root", "error",
                                          "payload"};
constexpr size_t kHeaderBytes = kFields * sizeof(int64_t);
// Fused all-reduces: the data rides with the fingerprints when every message of the exchange stays within this
// size, under OpenMPI's eager limit for shared memory (4 KiB with the transport's own header). Beyond it a message
// goes by rendezvous, which costs 3x as long (3.4 us instead of 1.1 us at 4 KiB here) and more than the separate
// MPI_Allreduce that it would save.
constexpr size_t kEagerMessageBytes = 3968;

size_t round_up8(size_t n) { return (n + 7) & ~size_t{7}; }

// out = the reduction of in[0..m) (rank order), or zeros for m == 0, with the rules every backend shares
// (comm/reduce_kernels.h: NaN propagates in max and min, integer sums wrap, bf16 sums round in float).
void reduce_blocks(void* out, const char* const* in, size_t m, size_t count, CommDType dtype, ReduceOp op) {
  const size_t bytes = count * comm_dtype_size(dtype);
  if (m == 0) {
    std::memset(out, 0, bytes);
    return;
  }
  std::memcpy(out, in[0], bytes);
  for (size_t k = 1; k < m; ++k) reduce_into(dtype, op, out, in[k], count);
}

// Notices on the private communicator: int64 kind, sequence number, operation; then the text.
constexpr int kNoticeTag = 1;
constexpr int kFingerprintTag = 2;
enum NoticeKind : int64_t { kAbortNotice = 1, kTimeoutNotice = 2, kVoidNotice = 3 };
constexpr size_t kNoticeHeader = 3 * sizeof(int64_t);

size_t g_max_chunk = INT_MAX;  // elements per MPI call (tests lower it)
std::atomic<bool> g_skip_arrival_check{false};  // tests only

const char* status_name(int64_t status) {
  switch (status) {
    case DPAR_ERR_INVALID_ARGUMENT: return "invalid argument";
    case DPAR_ERR_NOT_SUPPORTED: return "not supported";
    case DPAR_ERR_INVALID_STATE: return "invalid state";
    default: return "error";
  }
}

bool valid_dtype(CommDType dtype) {
  switch (dtype) {
    case CommDType::kF32:
    case CommDType::kF64:
    case CommDType::kI32:
    case CommDType::kI64:
    case CommDType::kBF16: return true;
  }
  return false;
}

bool valid_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean:
    case ReduceOp::kMax:
    case ReduceOp::kMin: return true;
  }
  return false;
}

MPI_Datatype mpi_type(CommDType dtype) {
  switch (dtype) {
    case CommDType::kF32: return MPI_FLOAT;
    case CommDType::kF64: return MPI_DOUBLE;
    case CommDType::kI32: return MPI_INT32_T;
    case CommDType::kI64: return MPI_INT64_T;
    case CommDType::kBF16: return MPI_UINT16_T;  // moved as bits; summed by dpar's bf16 sum
  }
  return MPI_DATATYPE_NULL;
}

// inout[i] = in[i] op inout[i] with dpar's element-wise reduction (comm/reduce_kernels.h); `in` is the earlier
// operand (MPI's order), so ties keep it, as the fused path and the threads backend do.
template <CommDType D, ReduceOp O>
void dpar_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  const size_t n = static_cast<size_t>(*len);
  const ReduceKernels& k = reduce_kernels(D, O);
  // dst = a op b may not alias: combine through a block on the stack.
  constexpr size_t kBlock = 1024;
  alignas(64) unsigned char tmp[kBlock * 8];
  const size_t esz = comm_dtype_size(D);
  for (size_t at = 0; at < n; at += kBlock) {
    const size_t m = std::min(kBlock, n - at);
    char* io = static_cast<char*>(inout) + at * esz;
    k.two(tmp, static_cast<const char*>(in) + at * esz, io, m);
    std::memcpy(io, tmp, m * esz);
  }
}

// One MPI operation per (dtype, op) of dpar's own, made once MPI runs and never freed (it lives as long as MPI
// does). MPI has no bfloat16: its sum is one of them.
template <CommDType D, ReduceOp O>
MPI_Op dpar_op() {
  static std::once_flag once;
  static MPI_Op op = MPI_OP_NULL;
  std::call_once(once, [] {
    if (MPI_Op_create(&dpar_reduce<D, O>, 1, &op) != MPI_SUCCESS) op = MPI_OP_NULL;
  });
  DPAR_ENFORCE(op != MPI_OP_NULL, DPAR_ERR_COMMUNICATION, "mpi: MPI_Op_create for ", comm_dtype_name(D), " ",
               reduce_op_name(O), " failed");
  return op;
}

template <CommDType D>
MPI_Op dpar_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean: return dpar_op<D, ReduceOp::kSum>();
    case ReduceOp::kMax: return dpar_op<D, ReduceOp::kMax>();
    case ReduceOp::kMin: return dpar_op<D, ReduceOp::kMin>();
  }
  return MPI_OP_NULL;
}

// kMean is a sum, divided afterwards. bf16 has sums only (validate() refuses the rest). Float sums are MPI_SUM's
// (IEEE sums, no other rule to keep); max and min, and integer sums, are dpar's own operations: MPI_MAX and MPI_MIN
// drop a NaN depending on the order of the operands, and MPI_SUM's integer overflow is the C library's
// (undefined in C); dpar's wrap and propagate NaN, as every backend does (comm/reduce_kernels.h).
MPI_Op mpi_op(CommDType dtype, ReduceOp op) {
  const bool sum = op == ReduceOp::kSum || op == ReduceOp::kMean;
  switch (dtype) {
    case CommDType::kF32: return sum ? MPI_SUM : dpar_op<CommDType::kF32>(op);
    case CommDType::kF64: return sum ? MPI_SUM : dpar_op<CommDType::kF64>(op);
    case CommDType::kI32: return dpar_op<CommDType::kI32>(op);
    case CommDType::kI64: return dpar_op<CommDType::kI64>(op);
    case CommDType::kBF16: return dpar_op<CommDType::kBF16, ReduceOp::kSum>();
  }
  return MPI_OP_NULL;
}

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return detail::concat("MPI error ", code);
  return std::string(text, static_cast<size_t>(len));
}

// "rank 1", "ranks 0, 2"; "no rank" for none.
std::string rank_list(const std::vector<int>& ranks) {
  if (ranks.empty()) return "no rank";
  std::ostringstream os;
  os << (ranks.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i];
  return os.str();
}

std::string describe(const int64_t* fp) {
  std::ostringstream os;
  const auto coll = static_cast<Collective>(fp[kColl]);
  os << collective_name(coll) << " #" << fp[kSeq];
  if (coll == kBarrier) return os.str();
  const auto dtype = static_cast<CommDType>(fp[kDType]);
  os << " (" << fp[kCount] << " x " << (valid_dtype(dtype) ? comm_dtype_name(dtype) : "unknown dtype");
  if (has_op(coll)) {
    const auto op = static_cast<ReduceOp>(fp[kOp]);
    os << ", " << (valid_op(op) ? reduce_op_name(op) : "unknown op");
  }
  if (has_root(coll)) os << ", root " << fp[kRoot];
  os << ")";
  return os.str();
}

bool overlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return a_bytes && b_bytes && x < y + b_bytes && y < x + a_bytes;
}

const char* cbytes(const void* p, size_t offset) { return static_cast<const char*>(p) + offset; }
char* bytes_at(void* p, size_t offset) { return static_cast<char*>(p) + offset; }

// Set once a collective of this process timed out, was aborted or failed in MPI: a rank may be dead, and OpenMPI's
// MPI_Finalize waits for every rank of the job (forever, for a dead one under mpirun --enable-recovery).
std::atomic<bool> g_group_failed{false};

constexpr int kFinalizeWaitSeconds = 30;

void finalize_at_exit() {
  int finalized = 1;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (!g_group_failed.load()) {
    MPI_Finalize();
    return;
  }
  // After a failed collective MPI_Finalize may wait forever for a rank that is gone. A library must neither end
  // its host nor hang it at exit: finalize on a helper thread, wait a bounded time, and if it has not returned
  // say so and let the process end with the status the program chose.
  struct State {
    std::mutex mutex;
    std::condition_variable done_cv;
    bool done = false;
  };
  auto state = std::make_shared<State>();
  std::thread([state] {
    MPI_Finalize();
    std::lock_guard<std::mutex> lock(state->mutex);
    state->done = true;
    state->done_cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(state->mutex);
  if (!state->done_cv.wait_for(lock, std::chrono::seconds(kFinalizeWaitSeconds), [&] { return state->done; })) {
    std::fprintf(stderr, "dpar: MPI_Finalize did not return within %d s after a failed collective (a rank is "
                 "probably gone); the process exits without it\n", kFinalizeWaitSeconds);
    std::fflush(stderr);
  }
}

// How long a rank that gave up listens for the others' notices (and advances what it left): a quarter of the
// timeout, 50 ms to 1 s (1 s when the timeout is infinite).
SteadyClock::duration grace_period(double timeout_seconds) {
  const double timeout = timeout_seconds > 3.0e9 ? 4.0 : timeout_seconds;
  return std::chrono::duration_cast<SteadyClock::duration>(
      std::chrono::duration<double>(std::clamp(timeout / 4, 0.05, 1.0)));
}

// The communicators that left a collective in its fingerprint exchange (see "Abandoned exchanges" in the header):
// a collective of any communicator of this process advances them while it waits, so that a late rank in one is
// released even while this process waits in another (such as a test's or a program's own agreement after a
// failure). Entries whose exchange is done are dropped lazily; a communicator removes itself as it is destroyed.
std::mutex g_abandoned_mutex;
std::vector<MpiCommunicator*> g_abandoned;
std::atomic<int> g_abandoned_count{0};

// The base communicators over which a creation timed out: their MPI_Comm_idup is still pending (an MPI request
// cannot be cancelled), so the ranks' creations over them no longer pair by order.
std::mutex g_stale_bases_mutex;

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
std::vector<MPI_Comm> g_stale_bases;

const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
  }
  return "unknown thread level";
}

}  // namespace

namespace detail {
void set_mpi_max_chunk_for_tests(size_t elements) { g_max_chunk = elements ? elements : INT_MAX; }
void set_mpi_skip_arrival_check_for_tests(bool skip) { g_skip_arrival_check.store(skip); }
}  // namespace detail

// ---------------------------------------------------------------------------------------------------------------
// MpiRuntime

MpiRuntime::MpiRuntime() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = MPI_THREAD_SINGLE;
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) fail(DPAR_ERR_COMMUNICATION, "mpi: MPI_Init_thread failed: ", mpi_error_string(rc));
    initialized_by_dpar_ = true;
    thread_level_ = provided;
    // After every static constructed so far is destroyed (atexit runs in reverse order of registration, mixed
    // with static destructors): a communicator destroyed later sees MPI_Finalized and frees nothing.
    std::atexit(finalize_at_exit);
  } else {
    MPI_Query_thread(&thread_level_);
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size_);
}

MpiRuntime& MpiRuntime::instance() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  DPAR_ENFORCE(!finalized, DPAR_ERR_INVALID_STATE, "mpi: MPI was finalized already; it cannot be used again");
  // Never destroyed: MPI outlives every static object (it is finalized by atexit, if by dpar).
  static MpiRuntime* runtime = new MpiRuntime();
  return *runtime;
}

// ---------------------------------------------------------------------------------------------------------------
// MpiCommunicator

struct MpiCommunicator::Call {
  Collective coll;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;
  CommDType dtype = CommDType::kF32;
  ReduceOp op = ReduceOp::kSum;
  int root = -1;
  bool contributes = true;
  float scale = 1.0f;
  const char* label = nullptr;  // barrier's operation name
};

MpiCommunicator::MpiCommunicator(MPI_Comm base, MpiOptions options) : options_(options) {
  DPAR_CHECK_ARG(options_.timeout_seconds > 0, "mpi communicator: timeout_seconds must be positive, got ",
                 options_.timeout_seconds);
  DPAR_CHECK_ARG(options_.transfer == MpiOptions::Transfer::kBlocking ||
                     options_.transfer == MpiOptions::Transfer::kNonBlocking,
                 "mpi communicator: unknown transfer mode");
  thread_level_ = MpiRuntime::instance().thread_level();
  DPAR_CHECK_ARG(base != MPI_COMM_NULL, "mpi communicator: the base communicator is MPI_COMM_NULL");

  // Two duplicates of base, each created by a non-blocking collective polled under the timeout: a rank that never
  // constructs its communicator makes the others fail instead of hanging.
  const bool forever = options_.timeout_seconds > 3.0e9;
  const auto deadline = forever ? SteadyClock::time_point::max()
                                : SteadyClock::now() + std::chrono::duration_cast<SteadyClock::duration>(
                                                           std::chrono::duration<double>(options_.timeout_seconds));
  auto dup = [&](MPI_Comm from, MPI_Comm* out, const char* what) {
    MPI_Request request;
    int rc = MPI_Comm_idup(from, out, &request);
    if (rc != MPI_SUCCESS)
      fail(DPAR_ERR_COMMUNICATION, "mpi communicator: MPI_Comm_idup (", what, ") failed: ", mpi_error_string(rc));
    for (unsigned i = 0;; ++i) {
      int done = 0;
      rc = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS)
        fail(DPAR_ERR_COMMUNICATION, "mpi communicator: MPI_Comm_idup (", what, ") failed: ", mpi_error_string(rc));
      if (done) break;
      if ((i & 63) == 63) {
        if (SteadyClock::now() >= deadline)
          fail(DPAR_ERR_TIMEOUT, "mpi communicator: not every rank of the base communicator created its "
               "communicator within ", options_.timeout_seconds, " s (the creation is collective)");
        sched_yield();
      }
    }
    MPI_Comm_set_errhandler(*out, MPI_ERRORS_RETURN);
  };
  {
    std::lock_guard<std::mutex> lock(g_stale_bases_mutex);
    DPAR_ENFORCE(std::find(g_stale_bases.begin(), g_stale_bases.end(), base) == g_stale_bases.end(),
                 DPAR_ERR_INVALID_STATE, "mpi communicator: a creation over this base communicator timed out "
                 "earlier in this process, and its duplication is still pending on the base: a new creation would "
                 "pair with the wrong ranks' duplications. Create communicators over another base (a new "
                 "duplicate of MPI_COMM_WORLD, made by every rank) or restart the job");
  }
  try {
    dup(base, &comm_, "collectives");
    dup(base, &control_, "control");
    free_quarantined();
  } catch (const Error& e) {
    if (e.status() == DPAR_ERR_TIMEOUT) {
      std::lock_guard<std::mutex> lock(g_stale_bases_mutex);
      g_stale_bases.push_back(base);
    }
    throw;
  }
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  table_.assign(static_cast<size_t>(size_) * kFields, 0);
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

MpiCommunicator::~MpiCommunicator() {
  stop_async();
  int finalized = 1;
  MPI_Finalized(&finalized);
  if (finalized) return;  // MPI freed everything
  std::lock_guard<std::mutex> lock(mutex_);
  if (abort_requested_.load()) send_abort_notices_locked();
  // A rank that arrived late may be inside the transfer of a collective this rank left: give it a grace period.
  const auto end = SteadyClock::now() + grace_period(options_.timeout_seconds);
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

std::string MpiCommunicator::where(const Call& call, uint64_t seq) const {
  std::ostringstream os;
  os << "mpi " << collective_name(call.coll);
  if (call.coll == kBarrier && call.label && *call.label) os << " '" << call.label << "'";
  os << " #" << seq << " (rank " << rank_ << " of " << size_ << ")";
  return os.str();
}

void MpiCommunicator::mark(State state, const std::string& reason) {
  g_group_failed.store(true);
  std::lock_guard<std::mutex> lock(reason_mutex_);
  if (state_.load() != kUsable) return;  // the first failure is the one to report
  broken_reason_ = reason;
  state_.store(state, std::memory_order_release);
}

void MpiCommunicator::throw_unusable(const std::string& where) {
  std::string reason;
  {
    std::lock_guard<std::mutex> lock(reason_mutex_);
    reason = broken_reason_;
  }
  if (state_.load() == kAborted) fail(DPAR_ERR_REMOTE, where, ": stopped because ", reason);
  fail(DPAR_ERR_INVALID_STATE, where, ": this communicator is unusable since ", reason,
       "; create a new one to go on");
}

void MpiCommunicator::mpi_failed(const char* function, int code, const std::string& where) {
  requests_left_pending_ = true;
  exchange_.abandoned = false;  // MPI itself failed: nothing more is attempted on this communicator
  const std::string message = detail::concat(where, ": ", function, " failed: ", mpi_error_string(code));
  mark(kFailed, message);
  throw Error(DPAR_ERR_COMMUNICATION, message);
}

void MpiCommunicator::abort(const std::string& reason) {
  mark(kAborted, detail::concat("rank ", rank_, " aborted the group: ", reason));
  {
    std::lock_guard<std::mutex> lock(reason_mutex_);
    if (abort_reason_.empty()) abort_reason_ = reason;
  }
  abort_requested_.store(true, std::memory_order_seq_cst);
  // Tell the other ranks now if no collective of ours is running; otherwise the thread inside it does, at once
  // if it is waiting, or when its transfer ends. Under less than MPI_THREAD_MULTIPLE another thread may be in MPI
  // (another communicator), so the next collective on this one sends them instead.
  if (thread_level_ == MPI_THREAD_MULTIPLE && mutex_.try_lock()) {
    std::lock_guard<std::mutex> lock(mutex_, std::adopt_lock);
    send_abort_notices_locked();
  }
}

dpar_status MpiCommunicator::async_error(std::string* reason) {
  // Progress when no collective runs: send this rank's pending abort notices and read the others' (a collective in
  // flight does both itself). Under less than MPI_THREAD_MULTIPLE another thread may be in MPI: only the state.
  if (thread_level_ == MPI_THREAD_MULTIPLE && mutex_.try_lock()) {
    std::lock_guard<std::mutex> lock(mutex_, std::adopt_lock);
    if (abort_requested_.load()) send_abort_notices_locked();
    if (state_.load() == kUsable)
      drain_notices(seq_.load(), 2);
    else
      release_abandoned();
  }
  const int state = state_.load(std::memory_order_acquire);
  if (state == kUsable) return DPAR_OK;
  std::lock_guard<std::mutex> lock(reason_mutex_);
  *reason = broken_reason_;
  return state == kAborted ? DPAR_ERR_REMOTE : DPAR_ERR_INVALID_STATE;
}

void MpiCommunicator::send_abort_notices_locked() {
  if (abort_notices_sent_ || !abort_requested_.load()) return;
  abort_notices_sent_ = true;
  std::string reason;
  {
    std::lock_guard<std::mutex> lock(reason_mutex_);
    reason = abort_reason_;
  }
  send_notice(kAbortNotice, seq_.load(), 0, reason);
}

void MpiCommunicator::send_notice(int64_t kind, uint64_t seq, int64_t coll, const std::string& text) {
  test_pending_sends();
  auto data = std::make_shared<std::vector<char>>(kNoticeHeader + text.size());
  const int64_t header[3] = {kind, static_cast<int64_t>(seq), coll};
  std::memcpy(data->data(), header, kNoticeHeader);
  std::memcpy(data->data() + kNoticeHeader, text.data(), text.size());
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    MPI_Request request;
    // Best effort: a rank that is gone cannot be told.
    if (MPI_Isend(data->data(), static_cast<int>(data->size()), MPI_BYTE, r, kNoticeTag, control_, &request) ==
        MPI_SUCCESS)
      pending_sends_.push_back({request, data});
  }
  test_pending_sends();
}

void MpiCommunicator::test_pending_sends() {
  for (auto it = pending_sends_.begin(); it != pending_sends_.end();) {
    int done = 0;
    if (MPI_Test(&it->request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || done)
      it = pending_sends_.erase(it);
    else
      ++it;
  }
}

bool MpiCommunicator::drain_notices(uint64_t current_seq, int looks) {
  // A look costs ~0.07 us. OpenMPI's probe looks at its queue before it makes progress, so a notice still in
  // shared memory may show only at a later look.
  bool any = false;
  for (int empty = 0;;) {
    int flag = 0;
    MPI_Message message;
    MPI_Status status;
    if (MPI_Improbe(MPI_ANY_SOURCE, kNoticeTag, control_, &flag, &message, &status) != MPI_SUCCESS) return any;
    if (!flag) {
      if (++empty >= looks) return any;
      continue;
    }
    int count = 0;
    MPI_Get_count(&status, MPI_BYTE, &count);
    std::vector<char> data(static_cast<size_t>(std::max(count, 0)));
    if (MPI_Mrecv(data.data(), count, MPI_BYTE, &message, MPI_STATUS_IGNORE) != MPI_SUCCESS) return any;
    any = true;
    if (data.size() < kNoticeHeader) continue;
    int64_t header[3];
    std::memcpy(header, data.data(), kNoticeHeader);
    const std::string text(data.data() + kNoticeHeader, data.size() - kNoticeHeader);
    const int from = status.MPI_SOURCE;
    if (header[0] == kAbortNotice) {
      mark(kAborted, detail::concat("rank ", from, " aborted the group: ", text));
    } else if (header[0] == kTimeoutNotice && from >= 0 && from < size_) {
      const auto seq = static_cast<uint64_t>(header[1]);
      timeout_notice_seq_[static_cast<size_t>(from)] = header[1];
      // For the current collective the callers decide (a late rank, or a waiter that joins the timeout); any
      // other one means that the group cannot go on.
      if (seq != current_seq)
        mark(kFailed, detail::concat("rank ", from, " gave up waiting in ",
                                     collective_name(static_cast<Collective>(header[2])), " #", seq,
                                     " after its timeout"));
    } else if (header[0] == kVoidNotice && from >= 0 && from < size_) {
      const auto seq = static_cast<uint64_t>(header[1]);
      void_notice_seq_[static_cast<size_t>(from)] = header[1];
      if (seq != current_seq)
        mark(kFailed, detail::concat("rank ", from, " had left ", collective_name(static_cast<Collective>(header[2])), " #", seq, " (", text,
                                     ") and joined its transfer only to release the others: its result was void"));
    }
  }
}

void MpiCommunicator::check_usable(const Call& call) {
  if (thread_level_ < MPI_THREAD_SERIALIZED) {
    int main_thread = 0;
    MPI_Is_thread_main(&main_thread);
    DPAR_ENFORCE(main_thread, DPAR_ERR_NOT_SUPPORTED, where(call, seq_.load()), ": MPI was initialised with ",
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

void MpiCommunicator::validate(const Call& c) const {
  DPAR_CHECK_ARG(valid_dtype(c.dtype), "unknown dtype ", static_cast<int32_t>(c.dtype));
  if (has_op(c.coll)) {
    DPAR_CHECK_ARG(valid_op(c.op), "unknown reduce op ", static_cast<int32_t>(c.op));
    DPAR_ENFORCE(c.dtype != CommDType::kBF16 || c.op == ReduceOp::kSum, DPAR_ERR_NOT_SUPPORTED, "bf16 ",
                 reduce_op_name(c.op), ": the MPI backend reduces bf16 with sums only");
  }
  if (has_root(c.coll))
    DPAR_CHECK_ARG(c.root >= 0 && c.root < size_, "root ", c.root, " is not a rank of this ",
                   size_, "-rank communicator");
  const size_t esz = comm_dtype_size(c.dtype);
  const size_t n = static_cast<size_t>(size_);
  if (c.coll == kAllGather || c.coll == kReduceScatter) {
    DPAR_ENFORCE(c.count <= static_cast<size_t>(INT_MAX), DPAR_ERR_NOT_SUPPORTED, "count ", c.count,
                 " exceeds MPI's int counts (", INT_MAX, ")");
  }
  DPAR_CHECK_ARG(c.count <= SIZE_MAX / esz / n, "count ", c.count, " is too large");
  if (c.count == 0) return;
  const size_t bytes = c.count * esz;
  switch (c.coll) {
    case kAllReduce:
      DPAR_CHECK_ARG(c.send && c.recv, "null buffer with count ", c.count);
      DPAR_CHECK_ARG(c.send == c.recv || !overlap(c.send, bytes, c.recv, bytes),
                     "send and recv overlap without being equal");
      break;
    case kAllReduceSum:
      DPAR_CHECK_ARG(c.recv, "null buffer with count ", c.count);
      break;
    case kBroadcast:
      DPAR_CHECK_ARG(c.recv, "null buffer with count ", c.count);
      break;
    case kReduce:
      DPAR_CHECK_ARG(c.send, "null send buffer with count ", c.count);
      if (rank_ == c.root) {
        DPAR_CHECK_ARG(c.recv, "null recv buffer on the root with count ", c.count);
        DPAR_CHECK_ARG(c.send == c.recv || !overlap(c.send, bytes, c.recv, bytes),
                       "send and recv overlap without being equal");
      }
      break;
    case kAllGather:
      DPAR_CHECK_ARG(c.send && c.recv, "null buffer with count ", c.count);
      DPAR_CHECK_ARG(c.send == c.recv || c.send == cbytes(c.recv, rank_ * bytes) ||
                         !overlap(c.send, bytes, c.recv, n * bytes),
                     "send overlaps recv without being recv or recv + rank * count");
      break;
    case kReduceScatter:
      DPAR_CHECK_ARG(c.send && c.recv, "null buffer with count ", c.count);
      DPAR_CHECK_ARG(c.recv == c.send || c.recv == cbytes(c.send, rank_ * bytes) ||
                         !overlap(c.send, n * bytes, c.recv, bytes),
                     "recv overlaps send without being send or send + rank * count");
      break;
    default: break;
  }
}

void MpiCommunicator::wait(MPI_Request* requests, int count, MPI_Status* statuses, const Call& call, uint64_t seq,
                           bool transferring, SteadyClock::time_point start) {
  const bool forever = options_.timeout_seconds > 3.0e9;
  const auto deadline = forever ? SteadyClock::time_point::max()
                                : start + std::chrono::duration_cast<SteadyClock::duration>(
                                              std::chrono::duration<double>(options_.timeout_seconds));
  bool sleeping = false;  // past the spinning phase: every round sleeps, and checks everything
  for (unsigned i = 0;; ++i) {
    int done = 0;
    const int rc = MPI_Testall(count, requests, &done, statuses);
    if (rc != MPI_SUCCESS) mpi_failed("MPI_Testall", rc, where(call, seq));
    if (done) return;
    // Leaving the exchange: keep it, to release a late rank that completes its own (see the header).
    if (abort_requested_.load(std::memory_order_relaxed)) {
      requests_left_pending_ = true;
      send_abort_notices_locked();
      if (!transferring) abandon_exchange(true);
      throw_unusable(where(call, seq));
    }
    if (!sleeping && (i & 15) != 15) continue;
    if (drain_notices(seq, 1)) {
      if (state_.load() != kUsable) {
        requests_left_pending_ = true;
        if (!transferring) abandon_exchange(true);
        std::lock_guard<std::mutex> lock(reason_mutex_);
        fail(DPAR_ERR_REMOTE, where(call, seq), ": stopped because ", broken_reason_);
      }
      for (int r = 0; r < size_; ++r)
        if (timeout_notice_seq_[static_cast<size_t>(r)] == static_cast<int64_t>(seq))
          give_up(call, seq, transferring, r);
    }
    if (sleeping && g_abandoned_count.load(std::memory_order_relaxed) > 0) release_others();
    const auto now = SteadyClock::now();
    if (now >= deadline) give_up(call, seq, transferring, -1);
    // Spin for a short while (the others are usually close), then sleep in slices of 1/16 of the time waited so
    // far (at most 200 us): a waiter that polled on would take the core from the computation it overlaps (a
    // bucket's all-reduce beside backward), while the slices add at most ~6% to a long wait.
    const auto waited = now - start;
    if (waited > std::chrono::microseconds(50)) {
      sleeping = true;
      const auto slice = std::clamp<SteadyClock::duration>(waited / 16, std::chrono::microseconds(5),
                                                           std::chrono::microseconds(200));
      std::this_thread::sleep_for(slice);
    }
  }
}

void MpiCommunicator::give_up(const Call& call, uint64_t seq, bool transferring, int first_notifier) {
  requests_left_pending_ = true;
  send_notice(kTimeoutNotice, seq, static_cast<int64_t>(call.coll), "");
  // Listen: every rank waiting in this collective answers with its own notice. Meanwhile the exchange this rank
  // leaves goes on, for a late rank that completes its own without seeing the notice (see the header).
  if (!transferring) abandon_exchange(false);
  const auto end = SteadyClock::now() + grace_period(options_.timeout_seconds);
  std::vector<int> waiting{rank_}, silent;
  bool released = false;  // the exchange completed after all: the late ranks arrived in the grace period
  while (true) {
    drain_notices(seq, 1);
    if (exchange_.abandoned && release_abandoned()) released = true;
    waiting.assign(1, rank_);
    silent.clear();
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      if (timeout_notice_seq_[static_cast<size_t>(r)] == static_cast<int64_t>(seq))
        waiting.push_back(r);
      else
        silent.push_back(r);
    }
    if ((silent.empty() && !exchange_.abandoned) || released || SteadyClock::now() >= end) break;
    test_pending_sends();
    sched_yield();
  }
  std::sort(waiting.begin(), waiting.end());
  std::ostringstream os;
  os << where(call, seq) << ": ";
  const std::string limit = options_.timeout_seconds > 3.0e9 && first_notifier >= 0
                                ? detail::concat("rank ", first_notifier, "'s timeout")
                                : detail::concat(options_.timeout_seconds, " s");
  if (!transferring) {
    if (!silent.empty())
      os << rank_list(silent) << " did not arrive within " << limit << " ("
         << rank_list(waiting) << " waited"
         << (released ? "; they arrived in the grace period after it, and their transfer was released with a void "
                        "result"
                      : "")
         << ")";
    else
      os << "every rank arrived but the fingerprint exchange did not complete within " << limit;
  } else {
    os << "the transfer did not complete within " << limit << " although every rank had arrived (still waiting: "
       << rank_list(waiting) << "; not answering, stopped or dead: " << rank_list(silent) << ")";
  }
  if (first_notifier >= 0) os << "; rank " << first_notifier << "'s timeout passed first";
  const std::string message = os.str();
  mark(kFailed, message);
  throw Error(DPAR_ERR_TIMEOUT, message);
}

void MpiCommunicator::check_late(const Call& c, uint64_t seq, int looks) {
  drain_notices(seq, looks);
  if (state_.load() != kUsable) {
    std::lock_guard<std::mutex> lock(reason_mutex_);
    fail(DPAR_ERR_REMOTE, where(c, seq), ": stopped because ", broken_reason_);
  }
  for (int r = 0; r < size_; ++r) {
    if (timeout_notice_seq_[static_cast<size_t>(r)] != static_cast<int64_t>(seq)) continue;
    const std::string reason = detail::concat("rank ", r, " gave up waiting in ", collective_name(c.coll), " #", seq,
                                              " after its timeout, before this rank arrived");
    mark(kFailed, reason);
    fail(DPAR_ERR_REMOTE, where(c, seq), ": ", reason, "; nothing was moved");
  }
}

// Bruck's allgather over point-to-point messages on the control communicator: ceil(log2(size)) rounds; in the
// round at distance d, a rank sends the first min(d, size - d) blocks it holds to rank - d and receives as many
// from rank + d, so that it then holds those of ranks rank .. rank + 2d - 1 (mod size). A rank completes only
// after every rank has entered. A block is a fingerprint and, in a fused all-reduce, that rank's data; blocks are
// packed, so a message's blocks are parsed by their kPayloadBytes. (OpenMPI's MPI_Iallgather takes 2x as long for
// the fingerprints alone: its non-blocking collectives make progress on every 8th call of the progress engine.)
void MpiCommunicator::gather_fingerprints(const int64_t* mine, const void* payload, const Call& c, uint64_t seq) {
  const auto start = SteadyClock::now();
  char* buf = reinterpret_cast<char*>(gather_.data());
  const size_t payload_bytes = static_cast<size_t>(mine[kPayloadBytes]);
  std::memcpy(buf, mine, kHeaderBytes);
  if (payload_bytes) std::memcpy(buf + kHeaderBytes, payload, payload_bytes);
  offsets_[0] = 0;
  offsets_[1] = kHeaderBytes + round_up8(payload_bytes);
  exchange_.seq = seq;
  exchange_.coll = c.coll;
  exchange_.distance = 1;
  if (size_ > 1) post_round(c, seq);
  while (exchange_.distance < size_) {
    wait(exchange_.requests, 2, exchange_.statuses, c, seq, false, start);
    finish_round(c, seq);
  }
  collect_table();
}

void MpiCommunicator::post_round(const Call& c, uint64_t seq) {
  char* buf = reinterpret_cast<char*>(gather_.data());
  const int d = exchange_.distance;
  const int blocks = std::min(d, size_ - d);
  const int from = (rank_ + d) % size_;
  const size_t capacity = static_cast<size_t>(blocks) * (kHeaderBytes + fused_max_bytes_);
  int rc = MPI_Irecv(buf + offsets_[d], static_cast<int>(capacity), MPI_BYTE, from, kFingerprintTag, control_,
                     &exchange_.requests[0]);
  if (rc != MPI_SUCCESS) mpi_failed("MPI_Irecv", rc, where(c, seq));
  rc = MPI_Isend(buf, static_cast<int>(offsets_[blocks]), MPI_BYTE, (rank_ - d + size_) % size_, kFingerprintTag,
                 control_, &exchange_.requests[1]);
  if (rc != MPI_SUCCESS) mpi_failed("MPI_Isend", rc, where(c, seq));
}

void MpiCommunicator::finish_round(const Call& c, uint64_t seq) {
  const char* buf = reinterpret_cast<const char*>(gather_.data());
  const int d = exchange_.distance;
  const int blocks = std::min(d, size_ - d);
  int got = 0;
  MPI_Get_count(&exchange_.statuses[0], MPI_BYTE, &got);
  size_t at = offsets_[d];
  const size_t end = at + static_cast<size_t>(std::max(got, 0));
  for (int j = d; j < d + blocks; ++j) {
    int64_t bytes = -1;
    if (at + kHeaderBytes <= end) std::memcpy(&bytes, buf + at + kPayloadBytes * sizeof(int64_t), sizeof bytes);
    if (bytes < 0 || static_cast<size_t>(bytes) > fused_max_bytes_) {
      const std::string message =
          detail::concat(where(c, seq), ": malformed fingerprint message from rank ", (rank_ + d) % size_);
      exchange_.abandoned = false;
      mark(kFailed, message);
      throw Error(DPAR_ERR_COMMUNICATION, message);
    }
    at += kHeaderBytes + round_up8(static_cast<size_t>(bytes));
    offsets_[j + 1] = at;
  }
  exchange_.distance = d * 2;
  if (exchange_.distance < size_) post_round(c, seq);
}

void MpiCommunicator::collect_table() {
  const char* buf = reinterpret_cast<const char*>(gather_.data());
  for (int j = 0; j < size_; ++j) {
    const size_t r = static_cast<size_t>((rank_ + j) % size_);
    std::memcpy(&table_[r * kFields], buf + offsets_[j], kHeaderBytes);
    payloads_[r] = table_[r * kFields + kPayloadBytes] ? buf + offsets_[j] + kHeaderBytes : nullptr;
  }
}

void MpiCommunicator::abandon_exchange(bool linger) {
  if (options_.transfer != MpiOptions::Transfer::kBlocking) return;  // the others' transfers see the notices
  exchange_.abandoned = true;
  {
    std::lock_guard<std::mutex> registry(g_abandoned_mutex);
    if (std::find(g_abandoned.begin(), g_abandoned.end(), this) == g_abandoned.end())
      g_abandoned.push_back(this), g_abandoned_count.fetch_add(1);
  }
  if (!linger) return;
  // A late rank is most likely to slip through just now: give it a grace period before leaving.
  const auto end = SteadyClock::now() + grace_period(options_.timeout_seconds);
  while (!release_abandoned() && SteadyClock::now() < end) {
    test_pending_sends();
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void MpiCommunicator::release_others() {
  // Another thread may be inside MPI for another communicator only under MPI_THREAD_MULTIPLE.
  if (thread_level_ != MPI_THREAD_MULTIPLE) return;
  std::lock_guard<std::mutex> registry(g_abandoned_mutex);
  for (auto it = g_abandoned.begin(); it != g_abandoned.end();) {
    MpiCommunicator* other = *it;
    bool done = false;
    if (other != this && other->mutex_.try_lock()) {
      std::lock_guard<std::mutex> lock(other->mutex_, std::adopt_lock);
      done = other->release_abandoned();
    }
    if (done) {
      it = g_abandoned.erase(it);
      g_abandoned_count.fetch_sub(1);
    } else {
      ++it;
    }
  }
}

bool MpiCommunicator::release_abandoned() {
  if (!exchange_.abandoned) return true;
  Call c{exchange_.coll};
  const uint64_t seq = exchange_.seq;
  try {
    while (exchange_.distance < size_) {
      int done = 0;
      if (MPI_Testall(2, exchange_.requests, &done, exchange_.statuses) != MPI_SUCCESS) {
        exchange_.abandoned = false;
        return true;
      }
      if (!done) return false;
      finish_round(c, seq);
    }
    exchange_.abandoned = false;
    // Every rank has arrived. Those whose exchange completed take the same decision as agree(), from the same
    // table: a transfer follows only if the fingerprints agree and the data did not ride with them.
    collect_table();
    const int64_t* first = &table_[0];
    for (int r = 0; r < size_; ++r) {
      const int64_t* fp = &table_[static_cast<size_t>(r) * kFields];
      if (!std::equal(first, first + kError, fp) || fp[kError] != 0) return true;
    }
    c.count = static_cast<size_t>(first[kCount]);
    c.dtype = static_cast<CommDType>(first[kDType]);
    if (has_op(c.coll)) c.op = static_cast<ReduceOp>(first[kOp]);
    if (has_root(c.coll)) c.root = static_cast<int>(first[kRoot]);
    const size_t bytes = c.count * comm_dtype_size(c.dtype);
    const bool fused = (c.coll == kAllReduce || c.coll == kAllReduceSum) && c.count > 0 && bytes <= fused_max_bytes_;
    if (fused || c.count == 0 || c.coll == kBarrier) return true;
    // Zeros, in place: every form of transfer() accepts send == recv.
    const bool whole = c.coll == kAllGather || c.coll == kReduceScatter;
    std::vector<char> scratch(whole ? bytes * static_cast<size_t>(size_) : bytes, 0);
    c.send = c.recv = scratch.data();
    std::string reason;
    {
      std::lock_guard<std::mutex> lock(reason_mutex_);
      reason = broken_reason_;
    }
    send_notice(kVoidNotice, seq, static_cast<int64_t>(c.coll), reason);
    transfer(c, seq);
  } catch (const std::exception&) {
    exchange_.abandoned = false;  // MPI failed, or no memory for the zeros: nothing more can be done
  }
  return true;
}

void MpiCommunicator::check_void(const Call& c, uint64_t seq) {
  // One look: the notice was sent before its sender joined, so it came in before the data that ended the
  // transfer and waits in MPI's queue already (through another rank, it may not: the next call finds it).
  drain_notices(seq, 1);
  for (int r = 0; r < size_; ++r) {
    const auto i = static_cast<size_t>(r);
    if (timeout_notice_seq_[i] != static_cast<int64_t>(seq) && void_notice_seq_[i] != static_cast<int64_t>(seq))
      continue;
    const std::string reason = detail::concat("rank ", r, " had given up on ", collective_name(c.coll), " #", seq,
                                              " and joined its transfer only to release this rank");
    mark(kFailed, reason);
    fail(DPAR_ERR_REMOTE, where(c, seq), ": ", reason, ": the result is void");
  }
}

bool MpiCommunicator::agree(const Call& c, uint64_t seq) {
  int64_t mine[kFields] = {static_cast<int64_t>(seq), static_cast<int64_t>(c.coll), static_cast<int64_t>(c.count),
                           static_cast<int64_t>(c.dtype), -1, -1, 0};
  if (has_op(c.coll)) mine[kOp] = static_cast<int64_t>(c.op);
  if (has_root(c.coll)) mine[kRoot] = c.root;
  if (c.coll == kBarrier) mine[kCount] = 0, mine[kDType] = -1;
  // A local argument error still takes part, so that the others learn it instead of waiting.
  dpar_status own_status = DPAR_OK;
  std::string own_error;
  try {
    validate(c);
  } catch (const Error& e) {
    own_status = e.status();
    own_error = e.what();
    mine[kError] = own_status;
  }

  // Small all-reduces send their data with the fingerprint (a non-contributor of all_reduce_sum sends none).
  const size_t bytes = own_status == DPAR_OK ? c.count * comm_dtype_size(c.dtype) : 0;
  const bool fused = (c.coll == kAllReduce || c.coll == kAllReduceSum) && own_status == DPAR_OK && c.count > 0 &&
                     bytes <= fused_max_bytes_;
  const bool sends_data = fused && (c.coll == kAllReduce || c.contributes);
  mine[kPayloadBytes] = sends_data ? static_cast<int64_t>(bytes) : 0;
  seq_.store(seq + 1);
  gather_fingerprints(mine, sends_data ? (c.coll == kAllReduce ? c.send : c.recv) : nullptr, c, seq);
  // Nothing between the exchange and the transfer: a progress call here (such as a probe for notices) lets the
  // first fragment of another rank's MPI_Allreduce in before this rank has posted its own, and OpenMPI then takes
  // a slower path (+40 us at 1 MiB in about half the calls, measured). Notices are looked for before (check_usable).

  // Every rank holds the same table and decides alike.
  if (own_status != DPAR_OK)
    fail(own_status, where(c, seq), ": ", own_error, " (the other ranks were told; nothing was moved)");
  const int64_t* first = &table_[0];
  bool all_agree = true;
  for (int r = 1; r < size_ && all_agree; ++r)
    all_agree = std::equal(first, first + kError, &table_[static_cast<size_t>(r) * kFields]);
  for (int r = 0; r < size_ && all_agree; ++r) all_agree = table_[static_cast<size_t>(r) * kFields + kError] == 0;
  if (all_agree) return fused;  // every rank decided `fused` alike, from the same fingerprint
  std::vector<const int64_t*> kinds;  // distinct fingerprints, in rank order of first appearance
  std::vector<std::vector<int>> ranks;
  bool differs[kFields] = {};
  for (int r = 0; r < size_; ++r) {
    const int64_t* fp = &table_[static_cast<size_t>(r) * kFields];
    for (int f = 0; f < kError; ++f) differs[f] |= fp[f] != first[f];
    size_t k = 0;
    while (k < kinds.size() && !std::equal(fp, fp + kError, kinds[k])) ++k;
    if (k == kinds.size()) kinds.push_back(fp), ranks.emplace_back();
    ranks[k].push_back(r);
  }
  if (kinds.size() > 1) {
    std::ostringstream os;
    os << where(c, seq) << ": the ranks called different collectives (differing in ";
    bool comma = false;
    for (int f = 0; f < kError; ++f)
      if (differs[f]) os << (comma ? ", " : "") << kFieldNames[f], comma = true;
    os << "): ";
    for (size_t k = 0; k < kinds.size(); ++k)
      os << (k ? "; " : "") << rank_list(ranks[k]) << " called " << describe(kinds[k]);
    os << ". Nothing was moved";
    throw Error(DPAR_ERR_MISMATCH, os.str());
  }
  std::vector<int> refused;
  int64_t refused_status = 0;
  for (int r = 0; r < size_; ++r)
    if (table_[static_cast<size_t>(r) * kFields + kError] != 0)
      refused.push_back(r), refused_status = table_[static_cast<size_t>(r) * kFields + kError];
  if (!refused.empty())
    fail(DPAR_ERR_REMOTE, where(c, seq), ": ", rank_list(refused), " refused the call (", status_name(refused_status),
         "; its message is on that rank). Nothing was moved");
  return fused;
}

void MpiCommunicator::reduce_fused(const Call& c) {
  const char* in[kEagerMessageBytes / kHeaderBytes * 2];  // fused only while size_ <= 2 * most_blocks <= this
  size_t m = 0;
  const int64_t bytes = static_cast<int64_t>(c.count * comm_dtype_size(c.dtype));
  for (int r = 0; r < size_; ++r) {
    const int64_t sent = table_[static_cast<size_t>(r) * kFields + kPayloadBytes];
    DPAR_ENFORCE(sent == bytes || (sent == 0 && c.coll == kAllReduceSum), DPAR_ERR_INTERNAL, "mpi ",
                 collective_name(c.coll), ": rank ", r, " sent ", sent, " bytes of data instead of ", bytes);
    if (payloads_[static_cast<size_t>(r)]) in[m++] = payloads_[static_cast<size_t>(r)];
  }
  reduce_blocks(c.recv, in, m, c.count, c.dtype, c.op);
}

void MpiCommunicator::transfer(const Call& c, uint64_t seq) {
  if (c.count == 0 || c.coll == kBarrier) return;
  const bool nonblocking = options_.transfer == MpiOptions::Transfer::kNonBlocking;
  const MPI_Datatype type = mpi_type(c.dtype);
  const size_t esz = comm_dtype_size(c.dtype);
  const size_t bytes = c.count * esz;
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
    for (size_t done = 0; done < c.count;) {
      const size_t n = std::min(c.count - done, g_max_chunk);
      each(done * esz, static_cast<int>(n));
      done += n;
    }
  };
  switch (c.coll) {
    case kAllReduce:
    case kAllReduceSum: {
      const bool in_place = c.coll == kAllReduceSum || c.send == c.recv;
      if (c.coll == kAllReduceSum && !c.contributes) std::memset(c.recv, 0, bytes);
      const MPI_Op op = mpi_op(c.dtype, c.op);
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
            "MPI_Bcast", [&] { return MPI_Bcast(buffer, n, type, c.root, comm_); },
            [&](MPI_Request* r) { return MPI_Ibcast(buffer, n, type, c.root, comm_, r); });
      });
      break;
    case kReduce: {
      const bool is_root = rank_ == c.root;
      const MPI_Op op = mpi_op(c.dtype, c.op);
      chunks([&](size_t off, int n) {
        const void* send = is_root && c.send == c.recv ? MPI_IN_PLACE : cbytes(c.send, off);
        void* recv = is_root ? bytes_at(c.recv, off) : nullptr;
        invoke(
            "MPI_Reduce", [&] { return MPI_Reduce(send, recv, n, type, op, c.root, comm_); },
            [&](MPI_Request* r) { return MPI_Ireduce(send, recv, n, type, op, c.root, comm_, r); });
      });
      break;
    }
    case kAllGather: {
      const int n = static_cast<int>(c.count);
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
      const int n = static_cast<int>(c.count);
      const MPI_Op op = mpi_op(c.dtype, c.op);
      // In place, MPI takes the input from the receive buffer (all blocks) and leaves the result at its start.
      void* whole = const_cast<void*>(c.send);
      const bool nccl_in_place = c.recv != c.send && c.recv == bytes_at(whole, rank_ * bytes);
      const bool in_place = c.recv == c.send || nccl_in_place;
      const void* send = in_place ? MPI_IN_PLACE : c.send;
      void* recv = in_place ? whole : c.recv;
      invoke(
          "MPI_Reduce_scatter_block", [&] { return MPI_Reduce_scatter_block(send, recv, n, type, op, comm_); },
          [&](MPI_Request* r) { return MPI_Ireduce_scatter_block(send, recv, n, type, op, comm_, r); });
      if (nccl_in_place) std::memmove(c.recv, whole, bytes);
      break;
    }
    default: break;
  }
}

void MpiCommunicator::finish(const Call& c) {
  if (c.count == 0) return;
  switch (c.coll) {
    case kAllReduce:
    case kReduceScatter:
      if (c.op == ReduceOp::kMean) divide_by(c.dtype, c.recv, c.count, static_cast<size_t>(size_));
      break;
    case kReduce:
      if (c.op == ReduceOp::kMean && rank_ == c.root) divide_by(c.dtype, c.recv, c.count, static_cast<size_t>(size_));
      break;
    case kAllReduceSum:
      if (c.scale != 1.0f) scale_f32(static_cast<float*>(c.recv), c.scale, c.count);
      break;
    default: break;
  }
}

void MpiCommunicator::run(Call& call) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_usable(call);
  const uint64_t seq = seq_.load();
  // From here on every rank is inside this collective with the same arguments: a local abort() waits for its end.
  if (agree(call, seq)) {
    reduce_fused(call);
  } else {
    transfer(call, seq);
    // A blocking transfer may have been joined only to release this rank (see "Abandoned exchanges").
    if (options_.transfer == MpiOptions::Transfer::kBlocking && call.count && call.coll != kBarrier)
      check_void(call, seq);
  }
  finish(call);
  if (abort_requested_.load()) send_abort_notices_locked();
}

void MpiCommunicator::all_reduce(const void* send, void* recv, size_t count, CommDType dtype, ReduceOp op) {
  Call c{kAllReduce};
  c.send = send, c.recv = recv, c.count = count, c.dtype = dtype, c.op = op;
  run(c);
}

void MpiCommunicator::broadcast(void* buffer, size_t count, CommDType dtype, int root) {
  Call c{kBroadcast};
  c.send = buffer, c.recv = buffer, c.count = count, c.dtype = dtype, c.root = root;
  run(c);
}

void MpiCommunicator::reduce(const void* send, void* recv, size_t count, CommDType dtype, ReduceOp op, int root) {
  Call c{kReduce};
  c.send = send, c.recv = recv, c.count = count, c.dtype = dtype, c.op = op, c.root = root;
  run(c);
}

void MpiCommunicator::all_gather(const void* send, void* recv, size_t count, CommDType dtype) {
  Call c{kAllGather};
  c.send = send, c.recv = recv, c.count = count, c.dtype = dtype;
  run(c);
}

void MpiCommunicator::reduce_scatter(const void* send, void* recv, size_t count, CommDType dtype, ReduceOp op) {
  Call c{kReduceScatter};
  c.send = send, c.recv = recv, c.count = count, c.dtype = dtype, c.op = op;
  run(c);
}

void MpiCommunicator::barrier(const char* operation) {
  Call c{kBarrier};
  c.label = operation;
  run(c);
}

void MpiCommunicator::all_reduce_sum(float* buffer, size_t count, bool contributes, float scale) {
  Call c{kAllReduceSum};
  c.send = buffer, c.recv = buffer, c.count = count, c.dtype = CommDType::kF32, c.contributes = contributes,
  c.scale = scale;
  run(c);
}

}  // namespace dpar
