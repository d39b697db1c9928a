// The collective interface: one participant's view of a group. Backends implement it: threads (the worker threads
// of one process, over shared memory) and mpi (processes, through OpenMPI); NCCL comes with CUDA. The comm layer
// knows nothing of layers, models or devices: it moves typed buffers.
//
// Every collective is blocking here; async_* runs the same operation on the participant's communication thread and
// returns a Work handle. The public collectives are this class's, not the backends': each checks its arguments
// and builds the call's record (CallRecord) once, in comm/call_check.cpp, as NCCL's ArgsCheck does, and then runs
// the backend's implementation (run()). A participant whose arguments are bad does not arrive: refuse() tells the
// others (they throw Error(REMOTE)) and it throws its own error. Every collective has a timeout (the backend's
// option) and, before it moves data, the participants compare their records (sequence number, operation, count,
// dtype, op, root), each backend by its own transport: a participant that calls another collective than the
// others makes all of them throw Error(MISMATCH) with the one message of mismatch_message(), whatever the backend,
// instead of hanging or mixing data. A participant that does not arrive makes the others throw
// Error(TIMEOUT) naming it; a participant that fails calls abort(), and the others throw Error(REMOTE).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "common/dtype.h"
#include "common/error.h"

namespace dpar {

namespace detail {
class CommThread;  // communicator.cpp / comm_thread.h: a participant's communication thread
}  // namespace detail

enum class ReduceOp : int32_t { kSum = 0, kMean = 1, kMax = 2, kMin = 3 };
// Collectives move f32, f64, i32, i64 and bf16 (common/dtype.h). kBF16 (common/bf16.h) is what the engine's
// compressed gradient buckets cross the processes in: the MPI backend reduces it with sums only (in float, each sum
// rounded back to bfloat16), NCCL natively; the threads backend refuses it (NOT_SUPPORTED), dpar's CUDA device
// group reduces f32 alone, and the C ABI does not offer it. f16 is refused everywhere.

// What a collective is, in the fingerprints that participants compare and in the messages that name a call: one
// list for every backend, each using the kinds it has. 64-bit because the backends put it in fingerprints of
// 64-bit words; the values are only compared between participants of one build.
enum class Collective : int64_t {
  kBarrier = 1,
  kAllReduceSum,
  kReduceSum,
  kAllReduce,
  kBroadcast,
  kReduce,
  kAllGather,
  kReduceScatter,
  kReduceScatterSum,
  kAllGatherBlocks,
};

const char* reduce_op_name(ReduceOp op);
// "all_gather", "barrier", ...; "unknown collective" for a value that is none of them.
const char* collective_name(Collective kind);

// What participants compare before any data moves: one record for every backend, 24 bytes without padding (the
// backends compare it as three 64-bit words). Fields a collective does not have are 0 (root, op; count and dtype
// of a barrier).
struct CallRecord {
  uint64_t count = 0;
  uint32_t seq = 0;  // this participant's collectives on its communicator, from 1: set by the backend
  int32_t root = 0;
  uint8_t kind = 0;  // a Collective
  uint8_t dtype = 0;
  uint8_t op = 0;
  uint8_t reserved[5] = {};
  Collective collective() const { return static_cast<Collective>(kind); }
};
static_assert(sizeof(CallRecord) == 24, "compared as three 64-bit words");

bool same_call(const CallRecord& a, const CallRecord& b);
// The one message of a mismatch, in every backend: "all_reduce: participant 1 called all_reduce of 200 f32 (sum)
// but participant 0 called all_reduce of 100 f32 (sum); nothing was moved". `operation` is what the caller called
// (a barrier's own label), `other` the first participant whose record differs from participant 0's.
std::string mismatch_message(const char* operation, int other, const CallRecord& theirs, const CallRecord& first);
[[noreturn]] void fail_mismatch(const char* operation, int other, const CallRecord& theirs, const CallRecord& first);

// A collective as the caller made it: its record and its buffers, checked (call_check.cpp) before a backend runs it.
struct CommCall {
  CallRecord record;
  const char* operation = "";  // for messages: the collective's name, or a barrier's label
  const void* send = nullptr;
  void* recv = nullptr;         // the buffer of the one-buffer collectives (broadcast, all_reduce_sum, ...)
  bool contributes = true;      // all_reduce_sum, reduce_sum, reduce_scatter_sum
  float scale = 1.0f;           // the same
  Collective kind() const { return record.collective(); }
  size_t count() const { return record.count; }
  DType dtype() const { return static_cast<DType>(record.dtype); }
  ReduceOp op() const { return static_cast<ReduceOp>(record.op); }
  int root() const { return record.root; }
};

// The completion of an asynchronous collective.
class Work {
 public:
  virtual ~Work() = default;
  // True once the operation has finished (successfully or not); never blocks.
  virtual bool test() = 0;
  // Blocks until the operation has finished; rethrows its error, if any.
  virtual void wait() = 0;
};

class Communicator {
 public:
  Communicator();
  // Stops the communication thread if a derived class has not (see stop_async()).
  virtual ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The backend's name for messages: "threads", "mpi".
  virtual const char* backend() const = 0;
  // Whether its collectives move `dtype` at all, for a caller to refuse a setting when it is made rather than at
  // every later call (the threads backend moves no bf16).
  virtual bool moves(DType /*dtype*/) const { return true; }
  // Changes how long a collective waits for the other participants, from the next collective on (between
  // collectives: none in flight). A caller that created the communicator with a longer timeout for its own setup
  // (the engine's creation across processes) shortens it here. Error(NOT_SUPPORTED) where a backend cannot.
  virtual void set_timeout(std::chrono::duration<double> timeout);
  // A new communicator over the same participants (each keeps its rank) with its own sequence of collectives and
  // this one's timeout and failure handling: for a second thread of each participant that must not queue behind
  // this communicator's collectives (the engine's link between the replicas of one index in every process).
  // Collective: every participant calls it at the same point of its collectives here, none in flight.
  // Error(NOT_SUPPORTED) where a backend cannot (the default).
  virtual std::unique_ptr<Communicator> duplicate();
  // Whether duplicate() would succeed here, and the duplicate's collectives may run on another thread at the same
  // time as this one's: asked before duplicating, so that participants can agree first (the creation is
  // collective). Never blocks.
  virtual bool can_duplicate() const { return false; }

  // `count` is the number of elements each participant contributes. `send` may equal `recv` (in place). For
  // kMean on integer dtypes the division truncates toward zero.
  void all_reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op);
  // root's buffer is copied into every participant's.
  void broadcast(void* buffer, size_t count, DType dtype, int root);
  // The reduction lands in root's `recv`; `recv` is ignored (may be null) elsewhere.
  void reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op, int root);
  // recv (size() * count) holds every participant's send (count), in rank order.
  void all_gather(const void* send, void* recv, size_t count, DType dtype);
  // send (size() * count) is reduced element-wise; participant r receives block r (count) in recv.
  void reduce_scatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp op);
  // Returns once every participant has entered it.
  void barrier(const char* operation);

  // The engine's gradient path: sums `count` floats in place and writes (sum * scale) into every participant's
  // buffer. A participant with contributes == false (it produced no gradient) receives the result without adding
  // its buffer, whose content is then ignored.
  void all_reduce_sum(float* buffer, size_t count, bool contributes, float scale);
  // The same sum, scaled, into root's buffer only (the first step of a hierarchical reduction): other participants'
  // buffers are unspecified afterwards.
  void reduce_sum(float* buffer, size_t count, bool contributes, float scale, int root);

  // The sharded gradient path (ZeRO-2): a buffer of `count` floats cut into size() blocks by block_range().
  // Block r is [begin, end); blocks are ceil(count / size) rounded up to a multiple of 16 elements (64 bytes of
  // f32), so the last ones may be shorter or empty.
  static std::pair<size_t, size_t> block_range(size_t count, int size, int rank);
  // In place: participant r's block r of `buffer` receives (sum over participants of that block) * scale; the rest
  // of its buffer is unspecified afterwards. contributes == false as in all_reduce_sum. Block r holds the bits that
  // all_reduce_sum would leave there.
  void reduce_scatter_sum(float* buffer, size_t count, bool contributes, float scale);
  // In place: every participant's block r (of `count` f32 elements) is copied into block r of every buffer.
  void all_gather_blocks(float* buffer, size_t count);

  // Asynchronous forms: the operation runs on this participant's communication thread, in the order of the
  // calls; buffers must stay valid and untouched until the Work completes. The thread starts with the first
  // async_* call. A blocking collective must not be called on this participant while its async work is pending.
  // An operation that fails on the thread for a local reason (not REMOTE, TIMEOUT or MISMATCH, which every
  // participant sees alike) calls abort(), so that the others do not wait for this participant.
  std::shared_ptr<Work> async_all_reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op);
  std::shared_ptr<Work> async_broadcast(void* buffer, size_t count, DType dtype, int root);
  std::shared_ptr<Work> async_reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                                     int root);
  std::shared_ptr<Work> async_all_gather(const void* send, void* recv, size_t count, DType dtype);
  std::shared_ptr<Work> async_reduce_scatter(const void* send, void* recv, size_t count, DType dtype,
                                             ReduceOp op);
  std::shared_ptr<Work> async_reduce_scatter_sum(float* buffer, size_t count, bool contributes, float scale);
  std::shared_ptr<Work> async_all_gather_blocks(float* buffer, size_t count);

  // Runs `op` on the communication thread, in order with the async_* operations: a composite step (several
  // collectives, on this communicator and possibly others) that must not block the caller, such as a gradient
  // bucket's reduction. `op` calls blocking collectives; a failure is handled as the async_* ones' are.
  std::shared_ptr<Work> async_run(const char* operation, std::function<void()> op);

  // Called by a participant that failed: every participant waiting now or later in this group throws
  // Error(REMOTE) with `reason` instead of waiting for it.
  virtual void abort(const std::string& reason) = 0;

  // Whether this participant's collectives fail from now on without one having run yet (NCCL's
  // ncclCommGetAsyncError): Status::kOk while usable, else the status the next collective throws, with its reason in
  // `reason`. Never blocks; any thread, any time.
  virtual Status async_error(std::string* reason) = 0;

 protected:
  // The backend's implementation of a checked call (call.record.seq is 0: the backend numbers its calls). A
  // backend that cannot run a collective throws Error(NOT_SUPPORTED), through refuse() if the others would wait.
  virtual void run(const CommCall& call) = 0;
  // A participant whose call is refused before it arrives (bad arguments, or a backend's own limit): it must not
  // leave the others waiting. The default aborts the group (they throw Error(REMOTE)) and throws `error`; a backend
  // whose transport can tell the others without breaking the group (MPI) overrides it.
  [[noreturn]] virtual void refuse(const CommCall& call, const Error& error);
  // reduce_sum as reduce() followed by a scaling pass at the root, for a backend that does not fuse them.
  void reduce_sum_through_reduce(const CommCall& call);

  // Runs first on this participant's communication thread, when the first async_* call starts it. A backend whose
  // work is bound to a device makes that device current there, once, as a worker thread does when it starts, so
  // that no call on the thread has to change it and change it back. Must not throw.
  virtual void prepare_thread() noexcept {}

  // Lets the operations queued so far run, then joins the communication thread (a no-op if none started).
  // Every derived class's destructor must call it first: the thread calls the derived class's virtual collectives,
  // and by the time ~Communicator runs the derived part is destroyed (its vtable is gone too). ~Communicator only
  // catches a derived class that forgot: it fails the operations not yet started, without running them, and
  // joins.
  void stop_async() noexcept;

 private:
  // Checks `call` (call_check.cpp) and runs it, or refuses it.
  void check_and_run(const CommCall& call);
  // Queues `op` on the communication thread, starting the thread first if needed.
  std::shared_ptr<Work> submit_async(const char* operation, std::function<void()> op);
  std::mutex async_mutex_;                     // guards the lazy start and stop of async_
  std::unique_ptr<detail::CommThread> async_;  // null until the first async_* call
};

}  // namespace dpar
