// MPI's lifetime in this process (mpi_comm.h: MpiRuntime): initialisation, and a watched MPI_Finalize at exit
// after a failed collective.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/mpi_internal.h"
#include "comm/reduce_kernels.h"
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <memory>

namespace dpar {

using namespace mpi_internal;
using enum Collective;

namespace {

constexpr int kFinalizeWaitSeconds = 30;

void finalize_at_exit() {
  int finalized = 1;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (!g_group_failed.load()) {
    MPI_Finalize();
    return;
  }
  // After a failed collective MPI_Finalize may wait forever for a rank that is gone. A library must neither end
  // its host nor hang it at exit: finalize on a helper thread, wait a bounded time, and if it has not returned
  // say so and let the process end with the status the program chose.
  struct State {
    std::mutex mutex;
    std::condition_variable done_cv;
    bool done = false;
  };
  auto state = std::make_shared<State>();
  std::thread([state] {
    MPI_Finalize();
    std::lock_guard<std::mutex> lock(state->mutex);
    state->done = true;
    state->done_cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(state->mutex);
  if (!state->done_cv.wait_for(lock, std::chrono::seconds(kFinalizeWaitSeconds), [&] { return state->done; })) {
    std::fprintf(stderr, "dpar: MPI_Finalize did not return within %d s after a failed collective (a rank is "
                 "probably gone); the process exits without it\n", kFinalizeWaitSeconds);
    std::fflush(stderr);
  }
}

}  // namespace

namespace mpi_internal {

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return detail::concat("MPI error ", code);
  return std::string(text, static_cast<size_t>(len));
}

// Set once a collective of this process timed out, was aborted or failed in MPI: a rank may be dead, and OpenMPI's
// MPI_Finalize waits for every rank of the job (forever, for a dead one under mpirun --enable-recovery).
std::atomic<bool> g_group_failed{false};

const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
  }
  return "unknown thread level";
}

}  // namespace mpi_internal

namespace {

// Whether a launcher (mpirun, srun, a PMIx server) started this process: each of them sets one of these.
bool started_by_a_launcher() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMIX_NAMESPACE"})
    if (std::getenv(name) != nullptr) return true;
  return false;
}

}  // namespace

MpiRuntime::MpiRuntime() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    // A process started alone is a job of one (a singleton). Open MPI then starts its run-time daemon through its
    // default process launcher, which needs ssh or rsh on the PATH, and without either it kills the process inside
    // MPI_Init_thread. The "isolated" launcher starts nothing beyond this process, which is all a singleton needs.
    // A setting of the caller's own (the variable already set) is kept; other MPIs ignore OMPI_ variables.
    if (!started_by_a_launcher()) setenv("OMPI_MCA_plm", "isolated", /*overwrite=*/0);
    int provided = MPI_THREAD_SINGLE;
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) fail(Status::kCommunication, "mpi: MPI_Init_thread failed: ", mpi_error_string(rc));
    initialized_by_dpar_ = true;
    thread_level_ = provided;
    // After every static constructed so far is destroyed (atexit runs in reverse order of registration, mixed
    // with static destructors): a communicator destroyed later sees MPI_Finalized and frees nothing.
    std::atexit(finalize_at_exit);
  } else {
    MPI_Query_thread(&thread_level_);
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size_);
}

MpiRuntime& MpiRuntime::instance() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  DPAR_ENFORCE(!finalized, Status::kInvalidState, "mpi: MPI was finalized already; it cannot be used again");
  // Never destroyed: MPI outlives every static object (it is finalized by atexit, if by dpar).
  static MpiRuntime* runtime = new MpiRuntime();
  return *runtime;
}

}  // namespace dpar
