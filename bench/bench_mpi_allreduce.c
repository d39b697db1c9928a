/* The MPI side of bench_allreduce; bench_allreduce starts it once under mpirun and drives it size by size.
 *
 *   bench_mpi_allreduce DIR
 *
 * Rank r reads commands from the FIFO DIR/cmd<r>; rank 0 writes results to the FIFO DIR/res. Between commands
 * every rank sleeps in read() on its FIFO, so it takes no CPU while bench_allreduce measures dpar (a rank waiting
 * inside an MPI call would busy-poll a core).
 *
 * Two implementations run in the same ranks, on the same buffer, under the same harness:
 *   0  plain: in-place MPI_Allreduce on MPI_COMM_WORLD (the anchor);
 *   1  dpar:  dpar's MPI backend through the C API, dpar_comm_all_reduce(comm, buf, buf, n, DPAR_F32, DPAR_SUM) on
 *             the communicator that dpar_comm_create_mpi made once at start (after this program's MPI_Init, which
 *             dpar keeps). Only where the companion was built with libdpar's MPI backend (BENCH_HAVE_DPAR_MPI).
 *
 * A command is four uint64: bytes per rank (0: quit), warm-up iterations, timed iterations, implementation (0 or
 * 1). For each iteration every rank rewrites its whole buffer (as a backward pass would), enters MPI_Barrier, and
 * times one in-place all-reduce (f32 sum) of the implementation. The reply is uint64 iterations, int64 ok (1: the
 * sums checked out; 0: a sum was wrong; -1: a dpar call failed or dpar is not available, with dpar's message on
 * this program's stderr, which is mpirun's log), then for each timed iteration the longest time over the ranks, as
 * a double in seconds.
 *
 * At start rank 0 writes the hello: uint64 size; per rank, the uint64 mask of CPUs (0..63) it is bound to; uint64
 * dpar (1: the dpar implementation is ready, 0: not); uint64 length and that many bytes of text (why not, when
 * dpar is 0; else empty). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <mpi.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef BENCH_HAVE_DPAR_MPI
#include "dpar.h"
#endif

enum { IMPL_PLAIN = 0, IMPL_DPAR = 1 };

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int read_full(int fd, void *p, size_t n) {
  char *c = (char *)p;
  while (n > 0) {
    ssize_t got = read(fd, c, n);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return -1;
    c += got;
    n -= (size_t)got;
  }
  return 0;
}

static int write_full(int fd, const void *p, size_t n) {
  const char *c = (const char *)p;
  while (n > 0) {
    ssize_t put = write(fd, c, n);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return -1;
    c += put;
    n -= (size_t)put;
  }
  return 0;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (argc < 2) {
    if (rank == 0) fprintf(stderr, "usage: %s FIFO_DIR (started by bench_allreduce)\n", argv[0]);
    MPI_Finalize();
    return 2;
  }
  char path[4096];
  snprintf(path, sizeof path, "%s/cmd%d", argv[1], rank);
  int cmd_fd = open(path, O_RDONLY);
  int res_fd = -1;
  if (rank == 0) {
    snprintf(path, sizeof path, "%s/res", argv[1]);
    res_fd = open(path, O_WRONLY);
  }
  if (cmd_fd < 0 || (rank == 0 && res_fd < 0)) {
    fprintf(stderr, "bench_mpi_allreduce rank %d: cannot open %s: %s\n", rank, path, strerror(errno));
    MPI_Abort(MPI_COMM_WORLD, 1);
  }

  /* dpar's MPI communicator, made once, as a program that uses dpar's collectives would (a duplicate of
   * MPI_COMM_WORLD, built collectively). Every rank must have one, or none uses it. */
  char dpar_why[512] = "";
#ifdef BENCH_HAVE_DPAR_MPI
  dpar_comm *dcomm = NULL;
  int dpar_mine = dpar_comm_create_mpi(&dcomm, NULL) == DPAR_OK, dpar_all = 0;
  if (!dpar_mine) fprintf(stderr, "bench_mpi_allreduce rank %d: dpar_comm_create_mpi: %s\n", rank, dpar_last_error());
  if (!dpar_mine && rank == 0) snprintf(dpar_why, sizeof dpar_why, "dpar_comm_create_mpi: %s", dpar_last_error());
  MPI_Allreduce(&dpar_mine, &dpar_all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!dpar_all && dpar_mine) {
    dpar_comm_free(dcomm);
    dcomm = NULL;
  }
  if (!dpar_all && !dpar_why[0]) snprintf(dpar_why, sizeof dpar_why, "dpar_comm_create_mpi failed on another rank");
#else
  const int dpar_all = 0;
  snprintf(dpar_why, sizeof dpar_why, "this build has no MPI backend in libdpar (DPAR_HAVE_MPI is OFF)");
#endif

  /* Hello: where each rank is bound, and whether the dpar implementation is there. */
  cpu_set_t set;
  CPU_ZERO(&set);
  sched_getaffinity(0, sizeof set, &set);
  uint64_t mask = 0;
  for (int c = 0; c < 64; ++c)
    if (CPU_ISSET(c, &set)) mask |= (uint64_t)1 << c;
  uint64_t *masks = (uint64_t *)calloc((size_t)size, sizeof(uint64_t));
  MPI_Gather(&mask, 1, MPI_UINT64_T, masks, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  if (rank == 0) {
    const uint64_t n = (uint64_t)size, dpar = dpar_all ? 1 : 0, why_len = dpar_all ? 0 : strlen(dpar_why);
    write_full(res_fd, &n, sizeof n);
    write_full(res_fd, masks, sizeof(uint64_t) * (size_t)size);
    write_full(res_fd, &dpar, sizeof dpar);
    write_full(res_fd, &why_len, sizeof why_len);
    write_full(res_fd, dpar_why, why_len);
  }

  float *buf = NULL;
  size_t cap = 0;
  double *times = NULL, *longest = NULL;
  size_t tcap = 0;
  for (;;) {
    uint64_t cmd[4];
    if (read_full(cmd_fd, cmd, sizeof cmd) != 0 || cmd[0] == 0) break;
    const size_t n = (size_t)(cmd[0] / sizeof(float));
    const uint64_t warmup = cmd[1], iters = cmd[2], impl = cmd[3];
    if (n > cap) {
      free(buf);
      if (posix_memalign((void **)&buf, 64, n * sizeof(float)) != 0) MPI_Abort(MPI_COMM_WORLD, 1);
      cap = n;
    }
    if (iters > tcap) {
      free(times);
      free(longest);
      times = (double *)malloc(iters * sizeof(double));
      longest = (double *)malloc(iters * sizeof(double));
      if (!times || !longest) MPI_Abort(MPI_COMM_WORLD, 1);
      tcap = iters;
    }
    /* A failed dpar call ends the block's dpar calls on this rank, but not its barriers: every rank still enters
     * the same number of MPI_Barrier, so a failure is reported instead of hanging the others. */
    int failed = impl != IMPL_PLAIN && (impl != IMPL_DPAR || !dpar_all);
    if (failed && rank == 0) fprintf(stderr, "bench_mpi_allreduce: implementation %llu is not available\n",
                                     (unsigned long long)impl);
    uint64_t last = 0;
    for (uint64_t it = 0; it < warmup + iters; ++it) {
      const float v = (float)((it & 7) + (uint64_t)rank);
      for (size_t i = 0; i < n; ++i) buf[i] = v;
      MPI_Barrier(MPI_COMM_WORLD);
      double t0 = now(), t1 = t0;
      if (impl == IMPL_PLAIN) {
        MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        t1 = now();
      }
#ifdef BENCH_HAVE_DPAR_MPI
      else if (!failed) {
        const dpar_status st = dpar_comm_all_reduce(dcomm, buf, buf, n, DPAR_F32, DPAR_SUM);
        t1 = now();
        if (st != DPAR_OK) {
          fprintf(stderr, "bench_mpi_allreduce rank %d: dpar_comm_all_reduce (%zu floats): %s\n", rank, n,
                  dpar_last_error());
          failed = 1;
        }
      }
#endif
      if (it >= warmup) times[it - warmup] = t1 - t0;
      last = it;
    }
    double expected = 0.0;
    for (int r = 0; r < size; ++r) expected += (double)((last & 7) + (uint64_t)r);
    int ok = failed ? -1
                    : n == 0 || ((double)buf[0] == expected && (double)buf[n - 1] == expected &&
                                 (double)buf[n / 2] == expected);
    int all_ok = 0;
    MPI_Reduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, 0, MPI_COMM_WORLD);
    MPI_Reduce(times, longest, (int)iters, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) {
      const uint64_t head[2] = {iters, (uint64_t)(int64_t)all_ok};
      if (write_full(res_fd, head, sizeof head) != 0 || write_full(res_fd, longest, iters * sizeof(double)) != 0)
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
  }
#ifdef BENCH_HAVE_DPAR_MPI
  dpar_comm_free(dcomm); /* before MPI_Finalize: it frees its duplicates of MPI_COMM_WORLD */
#endif
  free(buf);
  free(times);
  free(longest);
  free(masks);
  MPI_Finalize();
  return 0;
}
