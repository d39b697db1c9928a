// The gradient reducer for frameworks that bring their own autograd: DDP's bucketed, overlapped all-reduce over a
// dpar communicator, and over the processes (hierarchically, through the replica set) when given their communicator.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <numeric>

#include "capi/api.h"

using namespace dpar;
using namespace dpar::capi;

namespace {

// Runs body on a checked reducer with its lock held.
template <class F>
dpar_status with_reducer(dpar_reducer* reducer, F&& body) {
  return guard([&] {
    dpar_reducer& r = checked(reducer, "reducer");
    std::lock_guard<std::mutex> lock(r.mutex);
    body(r);
  });
}

}  // namespace

extern "C" {

// What programs built against dpar.h 0.4 or older call (dpar.h now makes the name a macro that passes the
// caller's size to dpar_reducer_options_init_sized): it writes dpar.h 0.4's layout, whatever this library's is.
DPAR_API dpar_status (dpar_reducer_options_init)(dpar_reducer_options* opts) {
  return guard([&] { init_unsized_options(opts, "opts"); });
}

DPAR_API dpar_status dpar_reducer_options_init_sized(dpar_reducer_options* opts, size_t size) {
  return guard([&] { init_options(opts, size, "opts"); });
}

DPAR_API dpar_status dpar_reducer_create(dpar_reducer** out, dpar_comm* comm, float* const* grads,
                                         const size_t* counts, size_t num_grads, const dpar_reducer_options* opts) {
  return guard([&] {
    checked_out(out);
    *out = nullptr;
    dpar_comm& c = checked(comm, "comm");
    const auto o = read_options(opts, "opts");
    DPAR_CHECK_ARG(o.op == DPAR_SUM || o.op == DPAR_MEAN, "opts.op: ", o.op, " must be DPAR_SUM or DPAR_MEAN");
    DPAR_CHECK_ARG(o.compression == DPAR_COMPRESSION_NONE || o.compression == DPAR_COMPRESSION_BF16,
                   "opts.compression: ", o.compression, " is not a gradient compression (0: none, 1: bf16)");
    std::shared_ptr<ProcessLinks> processes;
    if (o.processes) {
      const dpar_comm& p = checked(o.processes, "opts.processes");
      DPAR_CHECK_ARG(o.processes != comm, "opts.processes: is the reducer's own communicator");
      DPAR_CHECK_ARG(p.device.is_host(), "opts.processes: its buffers are memory of ", p.device.str(),
                     "; the processes are reached through host memory (dpar_comm_create_mpi())");
      processes = std::make_shared<ProcessLinks>();
      processes->host = p.comm;
      processes->transport = p.comm->backend();
    }
    DPAR_CHECK_ARG(grads != nullptr, "grads: is NULL");
    DPAR_CHECK_ARG(counts != nullptr, "counts: is NULL");
    DPAR_CHECK_ARG(num_grads > 0, "num_grads: no gradient buffer to reduce");
    std::vector<Reducer::Grad> list;
    for (size_t i = 0; i < num_grads; ++i) {
      DPAR_CHECK_ARG(grads[i] != nullptr, "grads[", i, "]: is NULL");
      DPAR_CHECK_ARG(counts[i] > 0, "counts[", i, "]: is 0");
      DPAR_CHECK_ARG(counts[i] <= SIZE_MAX / sizeof(float), "counts[", i, "]: ", counts[i], " is too large");
      backend_for(c.device).check_memory(grads[i], counts[i] * sizeof(float), c.device,
                                         ("grads[" + std::to_string(i) + "]").c_str());
      list.push_back({grads[i], counts[i]});
    }
    // Overlapping buffers would be reduced twice: refused, naming a pair.
    std::vector<size_t> order(num_grads);
    std::iota(order.begin(), order.end(), size_t{0});
    std::sort(order.begin(), order.end(),
              [&](size_t a, size_t b) { return std::less<const float*>()(grads[a], grads[b]); });
    for (size_t k = 1; k < order.size(); ++k) {
      const size_t a = order[k - 1], b = order[k];
      const auto end_a = reinterpret_cast<uintptr_t>(grads[a]) + counts[a] * sizeof(float);
      DPAR_CHECK_ARG(end_a <= reinterpret_cast<uintptr_t>(grads[b]), "grads[", std::min(a, b), "] and grads[",
                     std::max(a, b), "]: the buffers overlap");
    }

    auto h = std::make_unique<dpar_reducer>();
    h->group = c.group;
    h->comm = c.comm;
    Communicator* raw = h->comm.get();
    // The reducer's copies and fills are ordered with the framework's work on the communicator's device: a CPU
    // stream for host memory, the caller's own stream on a GPU.
    h->stream = backend_for(c.device).wrap_stream(c.device, c.stream);
    h->set = std::make_unique<ReplicaSet>(*raw, *h->stream, std::move(processes));
    h->scale = o.op == DPAR_MEAN ? h->set->mean_scale() : 1.0f;
    const BucketStrategyKind strategy = !h->set->spans_processes()               ? BucketStrategyKind::kFlat
                                        : o.compression == DPAR_COMPRESSION_BF16 ? BucketStrategyKind::kHierarchicalBf16
                                                                                 : BucketStrategyKind::kHierarchical;
    h->reducer = std::make_unique<Reducer>(
        std::move(list), bucket_options(o.first_bucket_bytes, o.bucket_cap_bytes), *h->stream,
        make_bucket_strategy(strategy, *h->set),
        [raw](std::function<void()> op) { return raw->async_run("gradient bucket", std::move(op)); });
    register_handle(h.get(), HandleKind::kReducer);
    *out = h.release();
  });
}

DPAR_API void dpar_reducer_free(dpar_reducer* reducer) { free_handle(reducer); }

DPAR_API dpar_status dpar_reducer_num_buckets(size_t* out, const dpar_reducer* reducer) {
  return with_reducer(const_cast<dpar_reducer*>(reducer), [&](dpar_reducer& r) {
    *checked_out(out) = r.reducer->num_buckets();
  });
}

DPAR_API dpar_status dpar_reducer_grad_ready(dpar_reducer* reducer, size_t index) {
  return with_reducer(reducer, [&](dpar_reducer& r) {
    DPAR_CHECK_ARG(index < r.reducer->num_grads(), "index: ", index, " is out of range (", r.reducer->num_grads(),
                   " gradients registered)");
    if (!r.in_step) {
      r.reducer->prepare(r.scale);
      r.in_step = true;
    }
    r.reducer->mark_ready(index);
  });
}

DPAR_API dpar_status dpar_reducer_wait(dpar_reducer* reducer) {
  return with_reducer(reducer, [&](dpar_reducer& r) {
    if (!r.in_step) r.reducer->prepare(r.scale);
    r.in_step = false;  // whatever happens, the next grad_ready starts a new step
    try {
      r.reducer->finish();
    } catch (const Error& e) {
      // A failure of this participant's own (not one every participant sees alike) releases the others.
      if (e.status() != Status::kRemote && e.status() != Status::kTimeout && e.status() != Status::kMismatch)
        r.comm->abort(std::string("dpar_reducer_wait: ") + e.what());
      throw;
    }
  });
}

}  // extern "C"
