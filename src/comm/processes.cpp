#include "comm/processes.h"

#include <cstdlib>

#include "common/error.h"
#ifdef DPAR_HAVE_MPI
#include "comm/mpi_comm.h"
#endif

namespace dpar {
namespace {

// The size of the MPI job this process belongs to, as its launcher tells it (1 if none did).
long launched_job_size() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"}) {
    if (const char* v = std::getenv(name)) {
      char* end = nullptr;
      const long n = std::strtol(v, &end, 10);
      if (end != v && n > 0) return n;
    }
  }
  return 1;
}

}  // namespace

std::shared_ptr<Communicator> connect_processes(ProcessMode mode, [[maybe_unused]] double timeout_seconds,
                                                [[maybe_unused]] double create_timeout_seconds) {
  if (mode == ProcessMode::kSingle) return nullptr;
  const long job = launched_job_size();
#ifdef DPAR_HAVE_MPI
  bool mpi = mode == ProcessMode::kMpi || job > 1;
  if (!mpi) {
    // A program that initialised MPI itself without a launcher variable dpar knows.
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (initialized && !finalized) mpi = MpiRuntime::instance().world_size() > 1;
  }
  if (!mpi) return nullptr;
  return world_communicator(timeout_seconds, create_timeout_seconds);
#else
  DPAR_ENFORCE(mode != ProcessMode::kMpi, Status::kNotSupported,
               "opts.processes: this dpar was built without MPI");
  DPAR_ENFORCE(job <= 1, Status::kNotSupported, "opts.processes: this process is one of ", job,
               " started by an MPI launcher, but this dpar was built without MPI (set opts.processes to single to "
               "train each process alone)");
  return nullptr;
#endif
}

std::shared_ptr<Communicator> world_communicator(double timeout_seconds, double create_timeout_seconds) {
#ifdef DPAR_HAVE_MPI
  MpiOptions mo;
  mo.timeout_seconds = timeout_seconds;
  mo.create_timeout_seconds = create_timeout_seconds;
  return std::make_shared<MpiCommunicator>(MPI_COMM_WORLD, mo);
#else
  (void)timeout_seconds;
  (void)create_timeout_seconds;
  fail(Status::kNotSupported, "the MPI world communicator: this dpar was built without MPI");
#endif
}

}  // namespace dpar
