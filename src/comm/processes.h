// The connection between the processes of a job, for an engine that spans them: which transport, and whether a
// job exists at all. The C ABI only converts its options into a ProcessMode.
#pragma once

#include <memory>

#include "comm/communicator.h"

namespace dpar {

enum class ProcessMode : int32_t {
  kAuto = 0,    // every process of the MPI job when an MPI launcher started this one (or the program initialised
                // a multi-rank MPI itself); this process alone otherwise
  kSingle = 1,  // this process alone, even under mpirun
  kMpi = 2,     // every process of MPI_COMM_WORLD (initialising MPI if needed); NOT_SUPPORTED without MPI
};

// One participant per process (rank = this process), or null for a single process. Its creation waits
// `create_timeout_seconds` (0: timeout_seconds) for every process, and its collectives `timeout_seconds`.
std::shared_ptr<Communicator> connect_processes(ProcessMode mode, double timeout_seconds,
                                                double create_timeout_seconds = 0.0);
// A participant of MPI_COMM_WORLD (initialising MPI if needed), its timeouts as above. Throws NOT_SUPPORTED
// without MPI.
std::shared_ptr<Communicator> world_communicator(double timeout_seconds, double create_timeout_seconds = 0.0);

}  // namespace dpar
