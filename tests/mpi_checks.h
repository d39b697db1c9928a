// The checks of the MPI test programs that run under mpirun without GoogleTest (test_mpi_engine, test_mpi_zero,
// test_mpi_reducer, test_mpi_reproducible): each rank prints its own failures as "[rank r] FAIL ..." and counts
// them, and a dpar call that fails where the test cannot go on ends the rank with its status and message.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#include "dpar.h"

namespace mpi_checks {

// This process's rank and the number of processes, once the test knows them; the failures seen so far.
inline int g_rank = 0, g_size = 1, g_failures = 0;

inline void expect(bool ok, const std::string& what) {
  if (ok) return;
  ++g_failures;
  std::fprintf(stderr, "[rank %d] FAIL %s\n", g_rank, what.c_str());
}

}  // namespace mpi_checks

#define CHECK_OK(call)                                                                                          \
  do {                                                                                                          \
    const dpar_status s_ = (call);                                                                              \
    if (s_ != DPAR_OK) {                                                                                        \
      std::fprintf(stderr, "[rank %d] FATAL %s:%d: %s: %s: %s\n", ::mpi_checks::g_rank, __FILE__, __LINE__,    \
                   #call, dpar_status_str(s_), dpar_last_error());                                              \
      std::exit(2);                                                                                             \
    }                                                                                                           \
  } while (0)
