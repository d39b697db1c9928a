// The MPI backend's element-wise reductions: MPI datatypes and operations over dpar's one reduction module
// (comm/reduce_kernels.h), for MPI's own collectives and for the fused all-reduces.
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

namespace {

// inout[i] = in[i] op inout[i] with dpar's element-wise reduction (comm/reduce_kernels.h); `in` is the earlier
// operand (MPI's order), so ties keep it, as the fused path and the threads backend do.
template <DType D, ReduceOp O>

void dpar_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  const size_t n = static_cast<size_t>(*len);
  const ReduceKernels& k = reduce_kernels(D, O);
  // dst = a op b may not alias: combine through a block on the stack.
  constexpr size_t kBlock = 1024;
  alignas(64) unsigned char tmp[kBlock * 8];
  const size_t esz = dtype_size(D);
  for (size_t at = 0; at < n; at += kBlock) {
    const size_t m = std::min(kBlock, n - at);
    char* io = static_cast<char*>(inout) + at * esz;
    k.two(tmp, static_cast<const char*>(in) + at * esz, io, m);
    std::memcpy(io, tmp, m * esz);
  }
}

// One MPI operation per (dtype, op) of dpar's own, made once MPI runs and never freed (it lives as long as MPI
// does). MPI has no bfloat16: its sum is one of them.
template <DType D, ReduceOp O>

MPI_Op dpar_op() {
  static std::once_flag once;
  static MPI_Op op = MPI_OP_NULL;
  std::call_once(once, [] {
    if (MPI_Op_create(&dpar_reduce<D, O>, 1, &op) != MPI_SUCCESS) op = MPI_OP_NULL;
  });
  DPAR_ENFORCE(op != MPI_OP_NULL, Status::kCommunication, "mpi: MPI_Op_create for ", dtype_name(D), " ",
               reduce_op_name(O), " failed");
  return op;
}

template <DType D>

MPI_Op dpar_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean: return dpar_op<D, ReduceOp::kSum>();
    case ReduceOp::kMax: return dpar_op<D, ReduceOp::kMax>();
    case ReduceOp::kMin: return dpar_op<D, ReduceOp::kMin>();
  }
  return MPI_OP_NULL;
}

}  // namespace

namespace mpi_internal {

// out = the reduction of in[0..m) (rank order), or zeros for m == 0, with the rules every backend shares
// (comm/reduce_kernels.h: NaN propagates in max and min, integer sums wrap, bf16 sums round in float).
void reduce_blocks(void* out, const char* const* in, size_t m, size_t count, DType dtype, ReduceOp op) {
  const size_t bytes = count * dtype_size(dtype);
  if (m == 0) {
    std::memset(out, 0, bytes);
    return;
  }
  std::memcpy(out, in[0], bytes);
  for (size_t k = 1; k < m; ++k) reduce_into(dtype, op, out, in[k], count);
}

MPI_Datatype mpi_type(DType dtype) {
  switch (dtype) {
    case DType::kF32: return MPI_FLOAT;
    case DType::kF64: return MPI_DOUBLE;
    case DType::kI32: return MPI_INT32_T;
    case DType::kI64: return MPI_INT64_T;
    case DType::kBF16: return MPI_UINT16_T;  // moved as bits; summed by dpar's bf16 sum
    case DType::kF16: break;  // refused by the call check
  }
  return MPI_DATATYPE_NULL;
}

// kMean is a sum, divided afterwards. bf16 has sums only (check_limits() refuses the rest). Float sums are MPI_SUM's
// (IEEE sums, no other rule to keep); max and min, and integer sums, are dpar's own operations: MPI_MAX and MPI_MIN
// drop a NaN depending on the order of the operands, and MPI_SUM's integer overflow is the C library's
// (undefined in C); dpar's wrap and propagate NaN, as every backend does (comm/reduce_kernels.h).
MPI_Op mpi_op(DType dtype, ReduceOp op) {
  const bool sum = op == ReduceOp::kSum || op == ReduceOp::kMean;
  switch (dtype) {
    case DType::kF32: return sum ? MPI_SUM : dpar_op<DType::kF32>(op);
    case DType::kF64: return sum ? MPI_SUM : dpar_op<DType::kF64>(op);
    case DType::kI32: return dpar_op<DType::kI32>(op);
    case DType::kI64: return dpar_op<DType::kI64>(op);
    case DType::kBF16: return dpar_op<DType::kBF16, ReduceOp::kSum>();
    case DType::kF16: break;
  }
  return MPI_OP_NULL;
}

}  // namespace mpi_internal



}  // namespace dpar
