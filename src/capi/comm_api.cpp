// The collectives for frameworks that bring their own tensors and autograd.
#include <chrono>
#include <cmath>

#include "capi/api.h"
#include "comm/processes.h"

using namespace dpar;
using namespace dpar::capi;

namespace {

CommDType comm_dtype(int32_t dtype) {
  switch (dtype) {
    case DPAR_F32: return CommDType::kF32;
    case DPAR_F64: return CommDType::kF64;
    case DPAR_I32: return CommDType::kI32;
    case DPAR_I64: return CommDType::kI64;
    case DPAR_BF16:
    case DPAR_F16:
    case DPAR_U8: fail(DPAR_ERR_NOT_SUPPORTED, "dtype: ", dtype, " is not supported by collectives yet");
    default: fail(DPAR_ERR_INVALID_ARGUMENT, "dtype: unknown dtype ", dtype);
  }
}

ReduceOp reduce_op(int32_t op) {
  DPAR_CHECK_ARG(op >= DPAR_SUM && op <= DPAR_MIN, "op: unknown reduction ", op);
  return static_cast<ReduceOp>(op);
}

std::chrono::duration<double> comm_timeout(const dpar_comm_options* opts) {
  const auto o = read_options(opts, dpar_comm_options DPAR_COMM_OPTIONS_INIT, DPAR_COMM_OPTIONS_VERSION, "opts");
  DPAR_CHECK_ARG(o.timeout_seconds > 0, "opts.timeout_seconds: ", o.timeout_seconds,
                 " must be positive (INFINITY for none)");
  return std::chrono::duration<double>(o.timeout_seconds);
}

Communicator& comm_of(dpar_comm* comm) { return *checked(comm, "comm").comm; }

void check_buffer(const void* p, size_t count, const char* argument) {
  DPAR_CHECK_ARG(p != nullptr || count == 0, argument, ": is NULL");
}

int check_root(const Communicator& c, size_t root) {
  DPAR_CHECK_ARG(root < static_cast<size_t>(c.size()), "root: ", root, " is out of range (the group has ", c.size(),
                 " participants)");
  return static_cast<int>(root);
}

dpar_work* new_work(std::shared_ptr<Work> w) {
  auto* h = new_handle<dpar_work>();
  h->work = std::move(w);
  return h;
}

// The body of every dpar_comm_*_async: `*out` is reset before anything can fail, then `out` and `comm` are checked
// (in that order), and `start` checks its own arguments and returns the collective it started.
template <class Start>
dpar_status start_async(dpar_work** out, dpar_comm* comm, Start&& start) {
  if (out) *out = nullptr;
  return guard([&] {
    checked_out(out);
    *out = new_work(start(comm_of(comm)));
  });
}

}  // namespace

extern "C" {

DPAR_API dpar_status dpar_comm_options_init(dpar_comm_options* opts) {
  return guard([&] { *checked_out(opts, "opts") = dpar_comm_options DPAR_COMM_OPTIONS_INIT; });
}

DPAR_API dpar_status dpar_comm_group_create(dpar_comm_group** out, size_t size, const dpar_comm_options* opts) {
  return guard([&] {
    checked_out(out);
    *out = nullptr;
    DPAR_CHECK_ARG(size >= 1 && size <= 256, "size: ", size, " must be 1 to 256");
    std::vector<std::string> names;
    for (size_t r = 0; r < size; ++r) names.push_back("participant " + std::to_string(r));
    auto group = std::make_shared<ThreadGroup>(std::move(names), comm_timeout(opts));
    auto* h = new_handle<dpar_comm_group>();
    h->group = std::move(group);
    *out = h;
  });
}

DPAR_API void dpar_comm_group_free(dpar_comm_group* group) { free_handle(group); }

DPAR_API dpar_status dpar_comm_group_member(dpar_comm** out, dpar_comm_group* group, size_t rank) {
  return guard([&] {
    checked_out(out);
    *out = nullptr;
    auto& g = checked(group, "group").group;
    DPAR_CHECK_ARG(rank < static_cast<size_t>(g->size()), "rank: ", rank, " is out of range (the group has ", g->size(),
                   " participants)");
    auto comm = g->communicator(static_cast<int>(rank));
    auto* h = new_handle<dpar_comm>();
    h->group = g;
    h->comm = std::move(comm);
    *out = h;
  });
}

DPAR_API dpar_status dpar_comm_create_mpi(dpar_comm** out, const dpar_comm_options* opts) {
  return guard([&] {
    checked_out(out);
    *out = nullptr;
    auto comm = world_communicator(comm_timeout(opts).count());
    auto* h = new_handle<dpar_comm>();
    h->comm = std::move(comm);
    *out = h;
  });
}

DPAR_API void dpar_comm_free(dpar_comm* comm) { free_handle(comm); }

DPAR_API dpar_status dpar_comm_info(size_t* out_rank, size_t* out_size, const dpar_comm* comm) {
  return guard([&] {
    const Communicator& c = *checked(comm, "comm").comm;
    if (out_rank) *out_rank = static_cast<size_t>(c.rank());
    if (out_size) *out_size = static_cast<size_t>(c.size());
  });
}

DPAR_API dpar_status dpar_comm_abort(dpar_comm* comm, const char* reason) {
  return guard([&] {
    Communicator& c = comm_of(comm);
    c.abort(detail::concat("participant ", c.rank(), " called dpar_comm_abort",
                           reason && *reason ? std::string(": ") + reason : std::string()));
  });
}

DPAR_API dpar_status dpar_comm_get_async_error(dpar_status* out, dpar_comm* comm) {
  std::string reason;
  const dpar_status rc = guard([&] {
    checked_out(out);
    *out = DPAR_OK;
    *out = comm_of(comm).async_error(&reason);
  });
  if (rc == DPAR_OK) set_last_error(reason.c_str());
  return rc;
}

DPAR_API dpar_status dpar_comm_all_reduce(dpar_comm* comm, const void* send, void* recv, size_t count,
                                          int32_t dtype, int32_t op) {
  return guard([&] {
    Communicator& c = comm_of(comm);
    check_buffer(send, count, "send");
    check_buffer(recv, count, "recv");
    c.all_reduce(send, recv, count, comm_dtype(dtype), reduce_op(op));
  });
}

DPAR_API dpar_status dpar_comm_broadcast(dpar_comm* comm, void* buffer, size_t count, int32_t dtype, size_t root) {
  return guard([&] {
    Communicator& c = comm_of(comm);
    check_buffer(buffer, count, "buffer");
    const int r = check_root(c, root);
    c.broadcast(buffer, count, comm_dtype(dtype), r);
  });
}

DPAR_API dpar_status dpar_comm_reduce(dpar_comm* comm, const void* send, void* recv, size_t count, int32_t dtype,
                                      int32_t op, size_t root) {
  return guard([&] {
    Communicator& c = comm_of(comm);
    check_buffer(send, count, "send");
    const int r = check_root(c, root);
    if (c.rank() == r) check_buffer(recv, count, "recv");
    c.reduce(send, recv, count, comm_dtype(dtype), reduce_op(op), r);
  });
}

DPAR_API dpar_status dpar_comm_all_gather(dpar_comm* comm, const void* send, void* recv, size_t count,
                                          int32_t dtype) {
  return guard([&] {
    Communicator& c = comm_of(comm);
    check_buffer(send, count, "send");
    check_buffer(recv, count, "recv");
    c.all_gather(send, recv, count, comm_dtype(dtype));
  });
}

DPAR_API dpar_status dpar_comm_reduce_scatter(dpar_comm* comm, const void* send, void* recv, size_t count,
                                              int32_t dtype, int32_t op) {
  return guard([&] {
    Communicator& c = comm_of(comm);
    check_buffer(send, count, "send");
    check_buffer(recv, count, "recv");
    c.reduce_scatter(send, recv, count, comm_dtype(dtype), reduce_op(op));
  });
}

DPAR_API dpar_status dpar_comm_barrier(dpar_comm* comm) {
  return guard([&] { comm_of(comm).barrier("barrier"); });
}

DPAR_API dpar_status dpar_comm_all_reduce_async(dpar_work** out, dpar_comm* comm, const void* send, void* recv,
                                                size_t count, int32_t dtype, int32_t op) {
  return start_async(out, comm, [&](Communicator& c) {
    check_buffer(send, count, "send");
    check_buffer(recv, count, "recv");
    return c.async_all_reduce(send, recv, count, comm_dtype(dtype), reduce_op(op));
  });
}

DPAR_API dpar_status dpar_comm_broadcast_async(dpar_work** out, dpar_comm* comm, void* buffer, size_t count,
                                               int32_t dtype, size_t root) {
  return start_async(out, comm, [&](Communicator& c) {
    check_buffer(buffer, count, "buffer");
    const int r = check_root(c, root);
    return c.async_broadcast(buffer, count, comm_dtype(dtype), r);
  });
}

DPAR_API dpar_status dpar_comm_all_gather_async(dpar_work** out, dpar_comm* comm, const void* send, void* recv,
                                                size_t count, int32_t dtype) {
  return start_async(out, comm, [&](Communicator& c) {
    check_buffer(send, count, "send");
    check_buffer(recv, count, "recv");
    return c.async_all_gather(send, recv, count, comm_dtype(dtype));
  });
}

DPAR_API dpar_status dpar_comm_reduce_scatter_async(dpar_work** out, dpar_comm* comm, const void* send, void* recv,
                                                    size_t count, int32_t dtype, int32_t op) {
  return start_async(out, comm, [&](Communicator& c) {
    check_buffer(send, count, "send");
    check_buffer(recv, count, "recv");
    return c.async_reduce_scatter(send, recv, count, comm_dtype(dtype), reduce_op(op));
  });
}

DPAR_API dpar_status dpar_work_test(int32_t* out, dpar_work* work) {
  return guard([&] {
    checked_out(out);
    *out = checked(work, "work").work->test() ? 1 : 0;
  });
}

DPAR_API dpar_status dpar_work_wait(dpar_work* work) {
  return guard([&] { checked(work, "work").work->wait(); });
}

DPAR_API void dpar_work_free(dpar_work* work) {
  // Taken first, so that a second free of the same handle returns at once instead of waiting on a deleted one.
  if (!work || !take_handle(work, HandleKind::kWork)) return;
  // The operation writes into the caller's buffers: it must be over before the handle goes.
  try {
    work->work->wait();
  } catch (...) {
  }
  delete work;
}

}  // extern "C"
