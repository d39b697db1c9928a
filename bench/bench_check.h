/* CHECK(call) for the benchmark programs that use dpar's C API: a failing call ends the program with its status
 * and dpar's message (a benchmark has no recovery to offer). */
#ifndef DPAR_BENCH_CHECK_H
#define DPAR_BENCH_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#include "dpar.h"

#define CHECK(call)                                                                          \
  do {                                                                                       \
    dpar_status s_ = (call);                                                                 \
    if (s_ != DPAR_OK) {                                                                     \
      fprintf(stderr, "%s failed: %s: %s\n", #call, dpar_status_str(s_), dpar_last_error()); \
      exit(1);                                                                               \
    }                                                                                        \
  } while (0)

#endif
