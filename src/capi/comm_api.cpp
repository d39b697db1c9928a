// The collectives for frameworks that bring their own tensors and autograd.
#include <chrono>
#include <cmath>

#include "capi/api.h"
#include "comm/processes.h"

using namespace dpar;
using namespace dpar::capi;

namespace {

DType comm_dtype(int32_t dtype) {
  switch (dtype) {
    case DPAR_F32:
    case DPAR_F64:
    case DPAR_I32:
    case DPAR_I64: return static_cast<DType>(dtype);
    case DPAR_BF16:
    case DPAR_F16:
    case DPAR_U8: fail(Status::kNotSupported, "dtype: ", dtype, " is not supported by collectives yet");
    default: fail(Status::kInvalidArgument, "dtype: unknown dtype ", dtype);
  }
}

ReduceOp reduce_op(int32_t op) {
  DPAR_CHECK_ARG(op >= DPAR_SUM && op <= DPAR_MIN, "op: unknown reduction ", op);
  return static_cast<ReduceOp>(op);
}

std::chrono::duration<double> comm_timeout(const dpar_comm_options* opts) {
  const auto o = read_options(opts, "opts");
  DPAR_CHECK_ARG(o.timeout_seconds > 0, "opts.timeout_seconds: ", o.timeout_seconds,
                 " must be positive (INFINITY for none)");
  return std::chrono::duration<double>(o.timeout_seconds);
}

// A collective's buffer of `elements` elements of `dtype`: not NULL unless empty, and memory of the
// communicator's device where that can be told.
void check_buffer(const dpar_comm& c, const void* p, size_t elements, int32_t dtype, const char* argument) {
  DPAR_CHECK_ARG(p != nullptr || elements == 0, argument, ": is NULL");
  if (elements == 0 || c.device.is_host()) return;
  const size_t esz = dtype_size(comm_dtype(dtype));
  DPAR_CHECK_ARG(elements <= SIZE_MAX / esz, argument, ": ", elements, " elements overflow the address space");
  backend_for(c.device).check_memory(p, elements * esz, c.device, argument);
}

// Elements of a buffer that holds one block of `count` per participant (an all-gather's recv, a reduce-scatter's
// send).
size_t per_participant(const Communicator& c, size_t count) {
  const auto n = static_cast<size_t>(c.size());
  DPAR_CHECK_ARG(count <= SIZE_MAX / n, "count: ", count, " x ", n, " participants overflows");
  return count * n;
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
    dpar_comm& h = checked(comm, "comm");
    h.async_started.store(true, std::memory_order_release);
    *out = new_work(start(h));
  });
}

// A blocking collective of a participant that started asynchronous ones runs on its communication thread, after
// those already queued: in the order of the calls, and never beside one of them on the same participant (its
// collectives must not overlap). Before any asynchronous call it runs on the caller's thread.
template <class Op>
void run_blocking(dpar_comm& h, const char* operation, Op&& op) {
  if (!h.async_started.load(std::memory_order_acquire)) return op();
  h.comm->async_run(operation, std::forward<Op>(op))->wait();
}

}  // namespace

extern "C" {

// What programs built against dpar.h 0.4 or older call (dpar.h now makes the name a macro that passes the
// caller's size to dpar_comm_options_init_sized): it writes dpar.h 0.4's layout, whatever this library's is.
DPAR_API dpar_status (dpar_comm_options_init)(dpar_comm_options* opts) {
  return guard([&] { init_unsized_options(opts, "opts"); });
}

DPAR_API dpar_status dpar_comm_options_init_sized(dpar_comm_options* opts, size_t size) {
  return guard([&] { init_options(opts, size, "opts"); });
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
    h->devices.assign(size, Device{});
    h->streams.assign(size, nullptr);
    *out = h;
  });
}

DPAR_API dpar_status dpar_comm_group_create_on_devices(dpar_comm_group** out, const dpar_device* devices,
                                                      void* const* streams, size_t size,
                                                      const dpar_comm_options* opts) {
  return guard([&] {
    checked_out(out);
    *out = nullptr;
    DPAR_CHECK_ARG(devices != nullptr, "devices: is NULL");
    DPAR_CHECK_ARG(size >= 1 && size <= 256, "size: ", size, " must be 1 to 256");
    const auto timeout = comm_timeout(opts);
    std::vector<Device> devs;
    std::vector<std::string> names;
    for (size_t r = 0; r < size; ++r) {
      const std::string argument = "devices[" + std::to_string(r) + "]";
      devs.push_back(checked_device(devices[r], argument.c_str()));
      DPAR_CHECK_ARG(devs[r].kind == devs[0].kind, argument, ": ", devs[r].str(), " is not of the kind of devices[0] (",
                     devs[0].str(), "): a group's participants are all of one kind");
      DPAR_CHECK_ARG(!devs[r].is_host() || streams == nullptr || streams[r] == nullptr, "streams[", r, "]: ",
                     devs[r].str(), " has no streams (CPU buffers are host memory): pass NULL");
      names.push_back("participant " + std::to_string(r) + " (" + devs[r].str() + ")");
    }
    Backend& backend = backend_for(devs[0]);
    std::vector<void*> native(size, nullptr);
    if (streams != nullptr) native.assign(streams, streams + size);
    // The backend's group queues each participant's work on its Stream: here, views of the caller's streams.
    std::vector<std::unique_ptr<Stream>> views;
    std::vector<Stream*> view_ptrs;
    for (size_t r = 0; r < size; ++r) {
      views.push_back(backend.wrap_stream(devs[r], native[r]));
      view_ptrs.push_back(views.back().get());
    }
    std::shared_ptr<Group> group = backend.make_group(devs, view_ptrs, std::move(names), timeout);
    auto* h = new_handle<dpar_comm_group>();
    h->group = std::move(group);
    h->devices = std::move(devs);
    h->streams = std::move(native);
    *out = h;
  });
}

DPAR_API void dpar_comm_group_free(dpar_comm_group* group) { free_handle(group); }

DPAR_API dpar_status dpar_comm_group_member(dpar_comm** out, dpar_comm_group* group, size_t rank) {
  return guard([&] {
    checked_out(out);
    *out = nullptr;
    dpar_comm_group& g = checked(group, "group");
    DPAR_CHECK_ARG(rank < g.devices.size(), "rank: ", rank, " is out of range (the group has ", g.devices.size(),
                   " participants)");
    auto comm = g.group->communicator(static_cast<int>(rank));
    auto* h = new_handle<dpar_comm>();
    h->group = g.group;
    h->comm = std::move(comm);
    h->device = g.devices[rank];
    h->stream = g.streams[rank];
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

DPAR_API dpar_status dpar_comm_device(dpar_device* out, const dpar_comm* comm) {
  return guard([&] {
    checked_out(out);
    const dpar_comm& c = checked(comm, "comm");
    *out = to_c(c.device);
  });
}

DPAR_API dpar_status dpar_comm_abort(dpar_comm* comm, const char* reason) {
  return guard([&] {
    Communicator& c = *checked(comm, "comm").comm;
    c.abort(detail::concat("participant ", c.rank(), " called dpar_comm_abort",
                           reason && *reason ? std::string(": ") + reason : std::string()));
  });
}

DPAR_API dpar_status dpar_comm_get_async_error(dpar_status* out, dpar_comm* comm) {
  std::string reason;
  const dpar_status rc = guard([&] {
    checked_out(out);
    *out = DPAR_OK;
    *out = to_c(checked(comm, "comm").comm->async_error(&reason));
  });
  if (rc == DPAR_OK) set_last_error(reason.c_str());
  return rc;
}

DPAR_API dpar_status dpar_comm_all_reduce(dpar_comm* comm, const void* send, void* recv, size_t count,
                                          int32_t dtype, int32_t op) {
  return guard([&] {
    dpar_comm& h = checked(comm, "comm");
    Communicator& c = *h.comm;
    check_buffer(h, send, count, dtype, "send");
    check_buffer(h, recv, count, dtype, "recv");
    run_blocking(h, "all_reduce", [&] { c.all_reduce(send, recv, count, comm_dtype(dtype), reduce_op(op)); });
  });
}

DPAR_API dpar_status dpar_comm_broadcast(dpar_comm* comm, void* buffer, size_t count, int32_t dtype, size_t root) {
  return guard([&] {
    dpar_comm& h = checked(comm, "comm");
    Communicator& c = *h.comm;
    check_buffer(h, buffer, count, dtype, "buffer");
    const int r = check_root(c, root);
    run_blocking(h, "broadcast", [&] { c.broadcast(buffer, count, comm_dtype(dtype), r); });
  });
}

DPAR_API dpar_status dpar_comm_reduce(dpar_comm* comm, const void* send, void* recv, size_t count, int32_t dtype,
                                      int32_t op, size_t root) {
  return guard([&] {
    dpar_comm& h = checked(comm, "comm");
    Communicator& c = *h.comm;
    check_buffer(h, send, count, dtype, "send");
    const int r = check_root(c, root);
    if (c.rank() == r) check_buffer(h, recv, count, dtype, "recv");
    run_blocking(h, "reduce", [&] { c.reduce(send, recv, count, comm_dtype(dtype), reduce_op(op), r); });
  });
}

DPAR_API dpar_status dpar_comm_all_gather(dpar_comm* comm, const void* send, void* recv, size_t count,
                                          int32_t dtype) {
  return guard([&] {
    dpar_comm& h = checked(comm, "comm");
    Communicator& c = *h.comm;
    check_buffer(h, send, count, dtype, "send");
    check_buffer(h, recv, per_participant(c, count), dtype, "recv");
    run_blocking(h, "all_gather", [&] { c.all_gather(send, recv, count, comm_dtype(dtype)); });
  });
}

DPAR_API dpar_status dpar_comm_reduce_scatter(dpar_comm* comm, const void* send, void* recv, size_t count,
                                              int32_t dtype, int32_t op) {
  return guard([&] {
    dpar_comm& h = checked(comm, "comm");
    Communicator& c = *h.comm;
    check_buffer(h, send, per_participant(c, count), dtype, "send");
    check_buffer(h, recv, count, dtype, "recv");
    run_blocking(h, "reduce_scatter",
                 [&] { c.reduce_scatter(send, recv, count, comm_dtype(dtype), reduce_op(op)); });
  });
}

DPAR_API dpar_status dpar_comm_barrier(dpar_comm* comm) {
  return guard([&] {
    dpar_comm& h = checked(comm, "comm");
    run_blocking(h, "barrier", [&] { h.comm->barrier("barrier"); });
  });
}

DPAR_API dpar_status dpar_comm_all_reduce_async(dpar_work** out, dpar_comm* comm, const void* send, void* recv,
                                                size_t count, int32_t dtype, int32_t op) {
  return start_async(out, comm, [&](dpar_comm& h) {
    Communicator& c = *h.comm;
    check_buffer(h, send, count, dtype, "send");
    check_buffer(h, recv, count, dtype, "recv");
    return c.async_all_reduce(send, recv, count, comm_dtype(dtype), reduce_op(op));
  });
}

DPAR_API dpar_status dpar_comm_broadcast_async(dpar_work** out, dpar_comm* comm, void* buffer, size_t count,
                                               int32_t dtype, size_t root) {
  return start_async(out, comm, [&](dpar_comm& h) {
    Communicator& c = *h.comm;
    check_buffer(h, buffer, count, dtype, "buffer");
    const int r = check_root(c, root);
    return c.async_broadcast(buffer, count, comm_dtype(dtype), r);
  });
}

DPAR_API dpar_status dpar_comm_all_gather_async(dpar_work** out, dpar_comm* comm, const void* send, void* recv,
                                                size_t count, int32_t dtype) {
  return start_async(out, comm, [&](dpar_comm& h) {
    Communicator& c = *h.comm;
    check_buffer(h, send, count, dtype, "send");
    check_buffer(h, recv, per_participant(c, count), dtype, "recv");
    return c.async_all_gather(send, recv, count, comm_dtype(dtype));
  });
}

DPAR_API dpar_status dpar_comm_reduce_scatter_async(dpar_work** out, dpar_comm* comm, const void* send, void* recv,
                                                    size_t count, int32_t dtype, int32_t op) {
  return start_async(out, comm, [&](dpar_comm& h) {
    Communicator& c = *h.comm;
    check_buffer(h, send, per_participant(c, count), dtype, "send");
    check_buffer(h, recv, count, dtype, "recv");
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
