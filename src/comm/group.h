// A group of participants in one process (an engine's replicas), seen as a whole: it makes each participant's
// communicator, and can be aborted and reset together. Backends: threads (comm/threads_comm.h) and, with CUDA,
// NCCL between GPUs and dpar's device reduction between replicas that share a GPU.
#pragma once

#include <memory>
#include <string>

#include "comm/communicator.h"

namespace dpar {

class Group {
 public:
  virtual ~Group() = default;
  virtual int size() const = 0;
  // Participant `rank`'s view. The group must outlive it.
  virtual std::unique_ptr<Communicator> communicator(int rank) = 0;
  // Every participant waiting now or later throws Error(REMOTE) with `reason` (the first reason is kept).
  virtual void abort(const std::string& reason) = 0;
  // After a failure: makes the group usable again if its transport allows it, and says whether it did (NCCL
  // communicators cannot be reused after an abort: their owner must be rebuilt). Only while no participant is
  // inside a collective (nor has one queued).
  virtual bool recover() = 0;
};

}  // namespace dpar
