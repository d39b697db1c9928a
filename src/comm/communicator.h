// The collective interface, one participant's view of a group. Backends: threads (worker threads of one process,
// shared memory). The MPI and NCCL backends implement the same interface. The comm layer knows nothing of layers.
#pragma once

#include <cstddef>
#include <string>

namespace dpar {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Sums `count` floats over the participants and writes (sum * scale) into every participant's buffer.
  // A participant with contributes == false (it produced no gradient) receives the result without adding its
  // buffer, whose content is then ignored. Throws Error(TIMEOUT) naming a participant that did not arrive, or
  // Error(REMOTE) when another participant aborted the group.
  virtual void all_reduce_sum(float* buffer, size_t count, bool contributes, float scale) = 0;
  // Returns once every participant has entered it (same errors as all_reduce_sum).
  virtual void barrier(const char* operation) = 0;
  // Called by a participant that failed: every participant waiting now or later in this group throws
  // Error(REMOTE) with `reason` instead of waiting for it.
  virtual void abort(const std::string& reason) = 0;
};

}  // namespace dpar
