// The Gloo anchor of bench_allreduce (see gloo_anchor.h and bench/README.md).
//
// The participants are threads of this process, rendezvousing through an in-process gloo::rendezvous::HashStore,
// rather than processes meeting in a FileStore, because that measures the same Gloo with less in the way:
//  * Gloo's TCP transport has no shared-memory path: between threads of one process every byte still goes through
//    a loopback socket and the kernel, exactly as between processes.
//  * Each participant has its own tcp::Device (its own event-loop thread) and its own context, as each process of
//    a PyTorch job would. The device is created on the participant's pinned thread, so its loop thread inherits
//    that CPU, as `mpirun --bind-to core` binds the whole of a rank.
//  * The harness is dpar's: the same first touch, rewrite of the buffer, barrier and clock, and no driver
//    process. Between blocks Gloo's threads sleep in epoll_wait (waking only for its 10 ms timeout), so they take
//    next to no CPU while the others are measured.
//  * The barrier before each all-reduce spins in shared memory, so it releases the participants together and the
//    longest participant's time is not inflated by the barrier (a Gloo barrier releases them a TCP message
//    apart).
//
// Gloo runs with its defaults: asynchronous pairs served by the event loop (no busy polling), Gloo's own
// gloo::sum<float>.
#include "gloo_anchor.h"

#ifdef BENCH_HAVE_GLOO

#include <gloo/allreduce.h>
#include <gloo/allreduce_ring.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/hash_store.h>
#include <gloo/transport/tcp/device.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <new>
#include <stdexcept>
#include <thread>

#include "bench_util.h"

namespace bench_gloo {
namespace {

constexpr std::chrono::seconds kTimeout(60);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// A generation-counting barrier that spins, then yields (so that it still makes progress with more participants
// than CPUs). abort() releases the waiters for good, so that a participant that fails does not strand the others.
class SpinBarrier {
 public:
  explicit SpinBarrier(int n) : n_(n) {}
  void wait() {
    const unsigned gen = gen_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
      count_.store(0, std::memory_order_relaxed);
      gen_.fetch_add(1, std::memory_order_release);
      return;
    }
    for (int spins = 0; gen_.load(std::memory_order_acquire) == gen; ++spins) {
      if (aborted_.load(std::memory_order_relaxed)) throw std::runtime_error("another participant failed");
      if (spins < 4000)
        cpu_relax();
      else
        std::this_thread::yield();
    }
  }
  void abort() { aborted_.store(true, std::memory_order_relaxed); }

 private:
  const int n_;
  std::atomic<int> count_{0};
  std::atomic<unsigned> gen_{0};
  std::atomic<bool> aborted_{false};
};

class RingAnchor final : public Anchor {
 public:
  RingAnchor(Api api, int participants, std::vector<int> cpus)
      : api_(api), n_(participants), cpus_(std::move(cpus)), barrier_(participants), bufs_(participants, nullptr),
        contexts_(participants), rings_(participants), ring_floats_(participants, 0) {}
  ~RingAnchor() override {
    // The algorithms and pairs go before the buffers they point into.
    rings_.clear();
    contexts_.clear();
    for (float* b : bufs_) free(b);
  }

  bool connect(size_t max_floats, std::string& why) {
    if (api_ == Api::kRing && max_floats > static_cast<size_t>(INT_MAX) / sizeof(float)) {
      why = "gloo::AllreduceRing counts bytes in an int; the largest size does not fit";
      return false;
    }
    gloo::rendezvous::HashStore store;
    std::vector<std::string> errors(n_);
    std::vector<std::thread> ts;
    for (int r = 0; r < n_; ++r)
      ts.emplace_back([&, r] {
        pin(r);
        try {
          void* p = nullptr;
          if (posix_memalign(&p, 64, max_floats * sizeof(float)) != 0) throw std::bad_alloc();
          bufs_[r] = static_cast<float*>(p);
          std::fill(bufs_[r], bufs_[r] + max_floats, 0.0f);  // first touch by the owning thread, on its CPU
          gloo::transport::tcp::attr attr;
          attr.hostname = "127.0.0.1";
          auto device = gloo::transport::tcp::CreateDevice(attr);
          auto context = std::make_shared<gloo::rendezvous::Context>(r, n_);
          context->setTimeout(kTimeout);
          context->connectFullMesh(store, device);
          contexts_[r] = context;
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    for (auto& t : ts) t.join();
    for (int r = 0; r < n_; ++r)
      if (!errors[r].empty()) {
        why = "participant " + std::to_string(r) + " could not connect: " + errors[r];
        return false;
      }
    return true;
  }

  Block run(size_t n, int warmup, int iters) override {
    Block res;
    if (broken_) return res;
    std::vector<std::vector<double>> per(n_, std::vector<double>(static_cast<size_t>(iters)));
    std::vector<int> ok(n_, 1);
    std::vector<std::string> errors(n_);
    const double w0 = bench_now();
    std::vector<std::thread> ts;
    for (int r = 0; r < n_; ++r)
      ts.emplace_back([&, r] {
        pin(r);
        float* buf = bufs_[r];
        int last = 0;
        try {
          // AllreduceRing binds its buffers (and its inbox and outbox, first touched here) when it is built: once
          // per size, untimed, by every participant in the same order, as its slots are numbered by the context.
          if (api_ == Api::kRing && ring_floats_[r] != n) {
            rings_[r].reset();
            rings_[r] = std::make_unique<gloo::AllreduceRing<float>>(contexts_[r], std::vector<float*>{buf},
                                                                      static_cast<int>(n));
            ring_floats_[r] = n;
          }
          for (int it = 0; it < warmup + iters; ++it) {
            // The backward pass: this participant rewrites its own gradient buffer.
            std::fill(buf, buf + n, static_cast<float>((it & 7) + r));
            barrier_.wait();
            const auto t0 = std::chrono::steady_clock::now();
            if (api_ == Api::kRing) {
              rings_[r]->run();
            } else {
              // The options are built per call, as a caller hands a new buffer to every all-reduce (PyTorch's
              // ProcessGroupGloo does the same).
              gloo::AllreduceOptions opts(contexts_[r]);
              opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
              opts.setOutput(buf, n);
              opts.setReduceFunction(
                  static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
              opts.setTag(0);
              gloo::allreduce(opts);
            }
            const auto t1 = std::chrono::steady_clock::now();
            if (it >= warmup) per[r][static_cast<size_t>(it - warmup)] = std::chrono::duration<double>(t1 - t0).count();
            last = it;
          }
        } catch (const std::exception& e) {
          // The others leave the barrier at once; those inside Gloo leave through its timeout.
          errors[r] = e.what();
          ok[r] = 0;
          barrier_.abort();
          return;
        }
        double expected = 0;
        for (int q = 0; q < n_; ++q) expected += (last & 7) + q;
        if (n && (buf[0] != expected || buf[n - 1] != expected || buf[n / 2] != expected)) ok[r] = 0;
      });
    for (auto& t : ts) t.join();
    res.wall = bench_now() - w0;
    for (int r = 0; r < n_; ++r) {
      if (!errors[r].empty()) {
        fprintf(stderr, "Gloo participant %d failed: %s\n", r, errors[r].c_str());
        broken_ = true;
      }
      res.ok = res.ok && ok[r];
    }
    if (broken_) {
      res.ok = false;
      return res;
    }
    res.times.resize(static_cast<size_t>(iters));
    for (int i = 0; i < iters; ++i) {
      double m = 0;
      for (int r = 0; r < n_; ++r) m = std::max(m, per[r][static_cast<size_t>(i)]);
      res.times[static_cast<size_t>(i)] = m;
    }
    return res;
  }

  std::string describe() const override {
    const std::string call = api_ == Api::kRing
                                 ? "gloo::AllreduceRing<float> (in place; built once per size, run() timed)"
                                 : "gloo::allreduce (Algorithm::RING, in place, options built per call)";
    return call + " over " + std::to_string(n_) +
           " threads of one process,\n"
           "        pinned as dpar's, each with its own tcp::Device on 127.0.0.1 (event-loop thread on the same CPU)\n"
           "        and context, rendezvous through an in-process HashStore; each rewrites its buffer, then a spinning\n"
           "        barrier; time = the longest of the participants' calls";
  }

 private:
  void pin(int r) { bench_pin_self(cpus_[static_cast<size_t>(r) % cpus_.size()]); }

  const Api api_;
  const int n_;
  std::vector<int> cpus_;
  SpinBarrier barrier_;
  std::vector<float*> bufs_;
  std::vector<std::shared_ptr<gloo::Context>> contexts_;
  std::vector<std::unique_ptr<gloo::AllreduceRing<float>>> rings_;
  std::vector<size_t> ring_floats_;  // the size each participant's AllreduceRing is built for
  bool broken_ = false;
};

}  // namespace

std::unique_ptr<Anchor> start(Api api, int participants, size_t max_floats, const std::vector<int>& cpus,
                              std::string& why) {
  auto anchor = std::make_unique<RingAnchor>(api, participants, cpus);
  if (!anchor->connect(max_floats, why)) return nullptr;
  return anchor;
}

}  // namespace bench_gloo

#else

namespace bench_gloo {

std::unique_ptr<Anchor> start(Api, int, size_t, const std::vector<int>&, std::string& why) {
  why = "the Gloo anchor was not built (CMake found no Gloo headers and libgloo; Debian: libgloo-dev)";
  return nullptr;
}

}  // namespace bench_gloo

#endif
