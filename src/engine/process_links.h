// What an engine's replica sets cross the processes with (collectives/replica_set.h, ProcessLinks).
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "collectives/replica_set.h"

namespace dpar {

// The links of this process's replicas (replica r on devices[r], with streams[r]) to the other processes: the
// processes' communicator and replica 0's link for its device's memory (Backend::link_processes) and, where every
// process has as many replicas (`same_replica_counts`, the same answer on every process), one link per replica
// index, so that the optimizer's shards can span every replica of every process (ZeRO over the world): a duplicate of
// the processes' communicator and the device link of replica r. Collective over `processes`, each process making
// the same calls in the same order. Where a process's communicator cannot be duplicated for another thread's use
// (Communicator::can_duplicate: a backend without MPI_Comm_dup's counterpart, or MPI below MPI_THREAD_MULTIPLE),
// every process learns it first and the shards stay within each process.
std::shared_ptr<ProcessLinks> connect_replicas(Backend& backend, const std::shared_ptr<Communicator>& processes,
                                               const std::vector<Device>& devices, const std::vector<Stream*>& streams,
                                               std::chrono::duration<double> timeout, bool same_replica_counts);

}  // namespace dpar
