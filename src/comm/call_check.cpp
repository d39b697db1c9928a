// The one call check of the comm layer (communicator.h), as NCCL's ArgsCheck: every public collective builds its
// CallRecord and checks its arguments here, once, for every backend; a backend receives a call that is valid, and
// compares records (each by its own transport) and names a difference with the one mismatch_message().
#include <cstring>
#include <sstream>

#include "comm/communicator.h"
#include "comm/reduce_kernels.h"
#include "common/error.h"

namespace dpar {
namespace {

using enum Collective;

bool has_op(Collective kind) { return kind == kAllReduce || kind == kReduce || kind == kReduceScatter; }
bool has_root(Collective kind) { return kind == kBroadcast || kind == kReduce || kind == kReduceSum; }
bool has_data(Collective kind) { return kind != kBarrier; }

// A value that is no code of its enum stays one in the record's byte (out of range: 255).
uint8_t code(int32_t value) { return value >= 0 && value < 255 ? static_cast<uint8_t>(value) : uint8_t{255}; }

// The dtypes collectives move (communicator.h): f16 is none of them.
bool known_dtype(uint8_t dtype) {
  switch (static_cast<DType>(dtype)) {
    case DType::kF32:
    case DType::kF64:
    case DType::kI32:
    case DType::kI64:
    case DType::kBF16: return true;
    default: return false;
  }
}
bool known_op(uint8_t op) { return op <= static_cast<uint8_t>(ReduceOp::kMin); }

CommCall make_call(Collective kind, size_t count, DType dtype, ReduceOp op, int root) {
  CommCall call;
  call.operation = collective_name(kind);
  call.record.kind = static_cast<uint8_t>(kind);
  if (has_data(kind)) {
    call.record.count = count;
    call.record.dtype = code(static_cast<int32_t>(dtype));
  }
  if (has_op(kind)) call.record.op = code(static_cast<int32_t>(op));
  if (has_root(kind)) call.record.root = root;
  return call;
}

CommCall make_sum(Collective kind, float* buffer, size_t count, bool contributes, float scale, int root = 0) {
  CommCall call = make_call(kind, count, DType::kF32, ReduceOp::kSum, root);
  call.send = call.recv = buffer;
  call.contributes = contributes;
  call.scale = scale;
  return call;
}

bool overlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return x < y + b_bytes && y < x + a_bytes;
}
const void* at(const void* p, size_t offset) { return static_cast<const char*>(p) + offset; }

// Throws Error(INVALID_ARGUMENT) naming the first bad argument of `c`, called by participant `rank` of `size`.
void check_call(const CommCall& c, int rank, int size) {
  const char* what = c.operation;
  const Collective kind = c.kind();
  if (!has_data(kind)) return;
  DPAR_CHECK_ARG(known_dtype(c.record.dtype), what, ": unknown dtype ", int(c.record.dtype));
  if (has_op(kind)) DPAR_CHECK_ARG(known_op(c.record.op), what, ": unknown reduce op ", int(c.record.op));
  if (has_root(kind))
    DPAR_CHECK_ARG(c.root() >= 0 && c.root() < size, what, ": root ", c.root(), " is not a participant (size ", size,
                   ")");
  const size_t count = c.count(), esz = dtype_size(c.dtype());
  const size_t n = static_cast<size_t>(size);
  const bool whole = kind == kAllGather || kind == kReduceScatter;  // one buffer of size() blocks of count
  DPAR_CHECK_ARG(count <= SIZE_MAX / esz / (whole ? n : 1), what, ": count ", count, " is too large");
  if (count == 0) return;  // no buffer is read or written
  const size_t bytes = count * esz;
  switch (kind) {
    case kAllReduce:
      DPAR_CHECK_ARG(c.send, what, ": send is null (count ", count, ")");
      DPAR_CHECK_ARG(c.recv, what, ": recv is null (count ", count, ")");
      DPAR_CHECK_ARG(c.send == c.recv || !overlap(c.send, bytes, c.recv, bytes), what,
                     ": send and recv overlap without being equal");
      break;
    case kReduce:
      DPAR_CHECK_ARG(c.send, what, ": send is null (count ", count, ")");
      if (rank == c.root()) {
        DPAR_CHECK_ARG(c.recv, what, ": recv is null at the root (count ", count, ")");
        DPAR_CHECK_ARG(c.send == c.recv || !overlap(c.send, bytes, c.recv, bytes), what,
                       ": send and recv overlap without being equal");
      }
      break;
    case kAllGather:
      DPAR_CHECK_ARG(c.send, what, ": send is null (count ", count, ")");
      DPAR_CHECK_ARG(c.recv, what, ": recv is null (count ", count, ")");
      DPAR_CHECK_ARG(c.send == c.recv || c.send == at(c.recv, rank * bytes) ||
                         !overlap(c.send, bytes, c.recv, n * bytes),
                     what, ": send overlaps recv, but is neither recv nor recv + rank * count (in place)");
      break;
    case kReduceScatter:
      DPAR_CHECK_ARG(c.send, what, ": send is null (count ", count, ")");
      DPAR_CHECK_ARG(c.recv, what, ": recv is null (count ", count, ")");
      DPAR_CHECK_ARG(c.recv == c.send || c.recv == at(c.send, rank * bytes) ||
                         !overlap(c.send, n * bytes, c.recv, bytes),
                     what, ": recv overlaps send, but is neither send (MPI in place) nor send + rank * count (NCCL)");
      break;
    default:  // broadcast and the gradient path: one buffer
      DPAR_CHECK_ARG(c.recv, what, ": buffer is null (count ", count, ")");
      break;
  }
}

std::string describe(const CallRecord& r, bool with_seq) {
  std::ostringstream os;
  const Collective kind = r.collective();
  os << collective_name(kind);
  if (has_data(kind)) {
    const auto dtype = static_cast<DType>(r.dtype);
    os << " of " << r.count << " " << (known_dtype(r.dtype) ? dtype_name(dtype) : "unknown dtype");
    if (has_op(kind))
      os << " (" << (known_op(r.op) ? reduce_op_name(static_cast<ReduceOp>(r.op)) : "unknown op") << ")";
    if (kind == kBroadcast) os << " from root " << r.root;
    if (kind == kReduce || kind == kReduceSum) os << " to root " << r.root;
  }
  if (with_seq) os << " as its collective #" << r.seq;
  return os.str();
}

}  // namespace

bool same_call(const CallRecord& a, const CallRecord& b) { return std::memcmp(&a, &b, sizeof a) == 0; }

std::string mismatch_message(const char* operation, int other, const CallRecord& theirs, const CallRecord& first) {
  const bool with_seq = theirs.seq != first.seq;
  return detail::concat(operation, ": participant ", other, " called ", describe(theirs, with_seq),
                        " but participant 0 called ", describe(first, with_seq), "; nothing was moved");
}

void fail_mismatch(const char* operation, int other, const CallRecord& theirs, const CallRecord& first) {
  throw Error(Status::kMismatch, mismatch_message(operation, other, theirs, first));
}

std::pair<size_t, size_t> Communicator::block_range(size_t count, int size, int rank) {
  constexpr size_t kAlign = 16;  // elements: 64 bytes of f32, so that no two participants write one cache line
  const size_t n = static_cast<size_t>(size);
  size_t per = count / n + (count % n != 0);
  per = (per + kAlign - 1) / kAlign * kAlign;
  const size_t begin = std::min(count, per * static_cast<size_t>(rank));
  return {begin, std::min(count, begin + per)};
}

void Communicator::check_and_run(const CommCall& call) {
  try {
    check_call(call, rank(), size());
  } catch (const Error& e) {
    refuse(call, e);
  }
  run(call);
}

void Communicator::refuse(const CommCall&, const Error& error) {
  abort(detail::concat(backend(), " participant ", rank(), " failed: ", error.what()));
  throw error;
}

void Communicator::all_reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) {
  CommCall c = make_call(kAllReduce, count, dtype, op, 0);
  c.send = send, c.recv = recv;
  check_and_run(c);
}

void Communicator::broadcast(void* buffer, size_t count, DType dtype, int root) {
  CommCall c = make_call(kBroadcast, count, dtype, ReduceOp::kSum, root);
  c.send = c.recv = buffer;
  check_and_run(c);
}

void Communicator::reduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op, int root) {
  CommCall c = make_call(kReduce, count, dtype, op, root);
  c.send = send, c.recv = recv;
  check_and_run(c);
}

void Communicator::all_gather(const void* send, void* recv, size_t count, DType dtype) {
  CommCall c = make_call(kAllGather, count, dtype, ReduceOp::kSum, 0);
  c.send = send, c.recv = recv;
  check_and_run(c);
}

void Communicator::reduce_scatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp op) {
  CommCall c = make_call(kReduceScatter, count, dtype, op, 0);
  c.send = send, c.recv = recv;
  check_and_run(c);
}

void Communicator::barrier(const char* operation) {
  CommCall c = make_call(kBarrier, 0, DType::kF32, ReduceOp::kSum, 0);
  if (operation && *operation) c.operation = operation;
  check_and_run(c);
}

void Communicator::all_reduce_sum(float* buffer, size_t count, bool contributes, float scale) {
  check_and_run(make_sum(kAllReduceSum, buffer, count, contributes, scale));
}

void Communicator::reduce_sum(float* buffer, size_t count, bool contributes, float scale, int root) {
  check_and_run(make_sum(kReduceSum, buffer, count, contributes, scale, root));
}

void Communicator::reduce_scatter_sum(float* buffer, size_t count, bool contributes, float scale) {
  check_and_run(make_sum(kReduceScatterSum, buffer, count, contributes, scale));
}

void Communicator::all_gather_blocks(float* buffer, size_t count) {
  check_and_run(make_sum(kAllGatherBlocks, buffer, count, true, 1.0f));
}

void Communicator::reduce_sum_through_reduce(const CommCall& c) {
  float* buffer = static_cast<float*>(c.recv);
  const size_t count = c.count();
  if (!c.contributes && buffer) std::fill(buffer, buffer + count, 0.0f);
  const bool at_root = rank() == c.root();
  reduce(buffer, at_root ? buffer : nullptr, count, DType::kF32, ReduceOp::kSum, c.root());
  if (at_root && c.scale != 1.0f) scale_f32(buffer, c.scale, count);
}

}  // namespace dpar
