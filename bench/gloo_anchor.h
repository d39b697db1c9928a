// The Gloo anchor of bench_allreduce: Gloo's ring all-reduce over Gloo's TCP transport on loopback, between the
// threads of this process. Built only where CMake found Gloo; otherwise start() says so and returns null.
#ifndef DPAR_BENCH_GLOO_ANCHOR_H
#define DPAR_BENCH_GLOO_ANCHOR_H

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace bench_gloo {

struct Block {
  std::vector<double> times;  // seconds per timed iteration, longest over participants; empty if Gloo failed
  bool ok = true;             // the sums checked out
  double wall = 0;            // the whole block, including rewrites and barriers
};

class Anchor {
 public:
  virtual ~Anchor() = default;
  // One block of f32 sum all-reduces of n floats per participant: `warmup` untimed iterations, then `iters`
  // timed ones. In each, every participant rewrites its whole buffer, enters a barrier, and times one in-place
  // all-reduce; an iteration's time is the longest over the participants.
  virtual Block run(size_t n, int warmup, int iters) = 0;
  // What is measured, in a line or two for the header of the table.
  virtual std::string describe() const = 0;
};

enum class Api {
  kRing,       // gloo::AllreduceRing<float>: bound buffers, set up once per size, then run() per all-reduce
  kAllreduce,  // gloo::allreduce with Algorithm::RING: unbound buffers, options per call (PyTorch's call)
};

// Connects `participants` Gloo contexts (participant r on a thread pinned to cpus[r % cpus.size()]) with buffers of
// max_floats floats each. Null, with the reason in `why`, if this build has no Gloo or the connection failed.
std::unique_ptr<Anchor> start(Api api, int participants, size_t max_floats, const std::vector<int>& cpus,
                              std::string& why);

}  // namespace bench_gloo

#endif
