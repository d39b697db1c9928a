// Phase 1 of an MPI collective (mpi_comm.h): the exchange of call records (Bruck's allgather over point-to-point
// messages), the agreement every rank reaches from the same table, and the fused small all-reduces.
#include <mpi.h>

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

namespace mpi_internal {

// "rank 1", "ranks 0, 2"; "no rank" for none.
std::string rank_list(const std::vector<int>& ranks) {
  if (ranks.empty()) return "no rank";
  std::ostringstream os;
  os << (ranks.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i];
  return os.str();
}

}  // namespace mpi_internal

void MpiCommunicator::check_limits(const CommCall& c) const {
  // The arguments themselves were checked by the one call check (call_check.cpp): these are MPI's own limits.
  if (c.kind() != kBarrier && c.dtype() == DType::kBF16)  // a collective without an op has kSum's 0
    DPAR_ENFORCE(c.op() == ReduceOp::kSum, Status::kNotSupported, c.operation, ": bf16 ", reduce_op_name(c.op()),
                 ": the MPI backend reduces bf16 with sums only");
  const bool int_counts = c.kind() == kAllGather || c.kind() == kReduceScatter || c.kind() == kReduceScatterSum ||
                          c.kind() == kAllGatherBlocks;
  if (int_counts)
    DPAR_ENFORCE(c.count() <= static_cast<size_t>(INT_MAX), Status::kNotSupported, c.operation, ": count ",
                 c.count(), " exceeds MPI's int counts (", INT_MAX, ")");
}

// Bruck's allgather over point-to-point messages on the control communicator: ceil(log2(size)) rounds; in the
// round at distance d, a rank sends the first min(d, size - d) blocks it holds to rank - d and receives as many
// from rank + d, so that it then holds those of ranks rank .. rank + 2d - 1 (mod size). A rank completes only
// after every rank has entered. A block is a fingerprint and, in a fused all-reduce, that rank's data; blocks are
// packed, so a message's blocks are parsed by their payload_bytes. (OpenMPI's MPI_Iallgather takes 2x as long for
// the fingerprints alone: its non-blocking collectives make progress on every 8th call of the progress engine.)
void MpiCommunicator::gather_fingerprints(const Header& mine, const void* payload, const CommCall& c, uint64_t seq) {
  const auto start = SteadyClock::now();
  char* buf = reinterpret_cast<char*>(gather_.data());
  const size_t payload_bytes = static_cast<size_t>(mine.payload_bytes);
  std::memcpy(buf, &mine, kHeaderBytes);
  if (payload_bytes) std::memcpy(buf + kHeaderBytes, payload, payload_bytes);
  offsets_[0] = 0;
  offsets_[1] = kHeaderBytes + round_up8(payload_bytes);
  exchange_.seq = seq;
  exchange_.coll = c.kind();
  exchange_.distance = 1;
  if (size_ > 1) post_round(c, seq);
  while (exchange_.distance < size_) {
    wait(exchange_.requests, 2, exchange_.statuses, c, seq, false, start);
    finish_round(c, seq);
  }
  collect_table();
}

void MpiCommunicator::post_round(const CommCall& c, uint64_t seq) {
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

void MpiCommunicator::finish_round(const CommCall& c, uint64_t seq) {
  const char* buf = reinterpret_cast<const char*>(gather_.data());
  const int d = exchange_.distance;
  const int blocks = std::min(d, size_ - d);
  int got = 0;
  MPI_Get_count(&exchange_.statuses[0], MPI_BYTE, &got);
  size_t at = offsets_[d];
  const size_t end = at + static_cast<size_t>(std::max(got, 0));
  for (int j = d; j < d + blocks; ++j) {
    int64_t bytes = -1;
    if (at + kHeaderBytes <= end) std::memcpy(&bytes, buf + at + offsetof(Header, payload_bytes), sizeof bytes);
    if (bytes < 0 || static_cast<size_t>(bytes) > fused_max_bytes_) {
      const std::string message =
          detail::concat(where(c, seq), ": malformed fingerprint message from rank ", (rank_ + d) % size_);
      exchange_.abandoned = false;
      mark(kFailed, message);
      throw Error(Status::kCommunication, message);
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
    std::memcpy(&table_[r], buf + offsets_[j], kHeaderBytes);
    payloads_[r] = table_[r].payload_bytes ? buf + offsets_[j] + kHeaderBytes : nullptr;
  }
}

bool MpiCommunicator::agree(const CommCall& c, uint64_t seq, const Error* refused) {
  Header mine;
  mine.record = c.record;
  mine.record.seq = static_cast<uint32_t>(seq + 1);  // from 1, as every backend counts
  // A refused call still takes part, so that the others learn it instead of waiting.
  Status own_status = Status::kOk;
  std::string own_error;
  try {
    if (refused) throw *refused;
    check_limits(c);
  } catch (const Error& e) {
    own_status = e.status();
    own_error = e.what();
    mine.error = static_cast<int64_t>(own_status);
  }

  // Small all-reduces send their data with the fingerprint (a non-contributor of all_reduce_sum sends none).
  const size_t bytes = own_status == Status::kOk ? c.count() * dtype_size(c.dtype()) : 0;
  const bool fused = (c.kind() == kAllReduce || c.kind() == kAllReduceSum) && own_status == Status::kOk &&
                     c.count() > 0 && bytes <= fused_max_bytes_;
  const bool sends_data = fused && (c.kind() == kAllReduce || c.contributes);
  mine.payload_bytes = sends_data ? static_cast<int64_t>(bytes) : 0;
  seq_.store(seq + 1);
  gather_fingerprints(mine, sends_data ? (c.kind() == kAllReduce ? c.send : c.recv) : nullptr, c, seq);
  // Nothing between the exchange and the transfer: a progress call here (such as a probe for notices) lets the
  // first fragment of another rank's MPI_Allreduce in before this rank has posted its own, and OpenMPI then takes
  // a slower path (+40 us at 1 MiB in about half the calls, measured). Notices are looked for before (check_usable).

  // Every rank holds the same table and decides alike.
  if (own_status != Status::kOk)
    fail(own_status, own_error, " (", where(c, seq), "; the other ranks were told; nothing was moved)");
  for (int r = 1; r < size_; ++r)
    if (!same_call(table_[static_cast<size_t>(r)].record, table_[0].record))
      fail_mismatch(c.operation, r, table_[static_cast<size_t>(r)].record, table_[0].record);
  std::vector<int> refusing;
  int64_t refused_status = 0;
  for (int r = 0; r < size_; ++r)
    if (table_[static_cast<size_t>(r)].error != 0)
      refusing.push_back(r), refused_status = table_[static_cast<size_t>(r)].error;
  if (!refusing.empty())
    fail(Status::kRemote, where(c, seq), ": ", rank_list(refusing), " refused the call (",
         status_name(static_cast<Status>(refused_status)), "; its message is on that rank). Nothing was moved");
  return fused;  // every rank decided `fused` alike, from the same record
}

void MpiCommunicator::reduce_fused(const CommCall& c) {
  const char* in[kEagerMessageBytes / kHeaderBytes * 2];  // fused only while size_ <= 2 * most_blocks <= this
  size_t m = 0;
  const int64_t bytes = static_cast<int64_t>(c.count() * dtype_size(c.dtype()));
  for (int r = 0; r < size_; ++r) {
    const int64_t sent = table_[static_cast<size_t>(r)].payload_bytes;
    DPAR_ENFORCE(sent == bytes || (sent == 0 && c.kind() == kAllReduceSum), Status::kInternal, "mpi ",
                 collective_name(c.kind()), ": rank ", r, " sent ", sent, " bytes of data instead of ", bytes);
    if (payloads_[static_cast<size_t>(r)]) in[m++] = payloads_[static_cast<size_t>(r)];
  }
  reduce_blocks(c.recv, in, m, c.count(), c.dtype(), c.op());
}

}  // namespace dpar
