/* The MPI side of bench_allreduce; bench_allreduce starts it once under mpirun and drives it size by size.
 *
 *   bench_mpi_allreduce DIR
 *
 * Rank r reads commands from the FIFO DIR/cmd<r>; rank 0 writes results to the FIFO DIR/res. Between commands
 * every rank sleeps in read() on its FIFO, so it takes no CPU while bench_allreduce measures dpar (a rank waiting
 * inside an MPI call would busy-poll a core).
 *
 * A command is three uint64: bytes per rank (0: quit), warm-up iterations, timed iterations. For each iteration
 * every rank rewrites its whole buffer (as a backward pass would), enters MPI_Barrier, and times one in-place
 * MPI_Allreduce (f32 sum). The reply is uint64 iterations, int64 ok (the sums checked out), then for each timed
 * iteration the longest time over the ranks, as a double in seconds.
 * At start rank 0 writes uint64 size and then, per rank, the uint64 mask of CPUs (0..63) it is bound to. */
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

  /* Hello: where each rank is bound. */
  cpu_set_t set;
  CPU_ZERO(&set);
  sched_getaffinity(0, sizeof set, &set);
  uint64_t mask = 0;
  for (int c = 0; c < 64; ++c)
    if (CPU_ISSET(c, &set)) mask |= (uint64_t)1 << c;
  uint64_t *masks = (uint64_t *)calloc((size_t)size, sizeof(uint64_t));
  MPI_Gather(&mask, 1, MPI_UINT64_T, masks, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  if (rank == 0) {
    uint64_t n = (uint64_t)size;
    write_full(res_fd, &n, sizeof n);
    write_full(res_fd, masks, sizeof(uint64_t) * (size_t)size);
  }

  float *buf = NULL;
  size_t cap = 0;
  double *times = NULL, *longest = NULL;
  size_t tcap = 0;
  for (;;) {
    uint64_t cmd[3];
    if (read_full(cmd_fd, cmd, sizeof cmd) != 0 || cmd[0] == 0) break;
    const size_t n = (size_t)(cmd[0] / sizeof(float));
    const uint64_t warmup = cmd[1], iters = cmd[2];
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
    uint64_t last = 0;
    for (uint64_t it = 0; it < warmup + iters; ++it) {
      const float v = (float)((it & 7) + (uint64_t)rank);
      for (size_t i = 0; i < n; ++i) buf[i] = v;
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = now();
      MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      const double t1 = now();
      if (it >= warmup) times[it - warmup] = t1 - t0;
      last = it;
    }
    double expected = 0.0;
    for (int r = 0; r < size; ++r) expected += (double)((last & 7) + (uint64_t)r);
    int ok = n == 0 || ((double)buf[0] == expected && (double)buf[n - 1] == expected && (double)buf[n / 2] == expected);
    int all_ok = 0;
    MPI_Reduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, 0, MPI_COMM_WORLD);
    MPI_Reduce(times, longest, (int)iters, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) {
      uint64_t head[2] = {iters, (uint64_t)all_ok};
      if (write_full(res_fd, head, sizeof head) != 0 || write_full(res_fd, longest, iters * sizeof(double)) != 0)
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
  }
  free(buf);
  free(times);
  free(longest);
  free(masks);
  MPI_Finalize();
  return 0;
}
