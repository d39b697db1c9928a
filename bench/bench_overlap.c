/* bench_overlap: what the bucketed, overlapped gradient all-reduce buys in a training step.
 *
 *   bench_overlap [--devices N] [--batch B] [--rounds R] [--steps S] [--hidden H1,H2,...]
 *                 [--first-kib K] [--cap-kib C]
 *   mpirun -np P bench_overlap ...      (every process runs N devices; the engine spans the processes)
 *
 * Model: MLP 784-H1-...-10 (default 784-2048-1024-10: 3.7 M parameters, 14.9 MB of gradients), ReLU, softmax
 * cross-entropy, Adam, synthetic data, global batch B (default 256, split over the processes).
 * Two engines, measured in interleaved rounds (medians of per-step times):
 *   overlap    buckets (by default dpar's: first 1 MiB, then 25 MiB; or --first-kib, --cap-kib), each all-reduced
 *              while backward goes on;
 *   one        a single bucket (bucket_cap_bytes = SIZE_MAX): one all-reduce after backward, the baseline;
 * with several processes a third,
 *   bf16       overlap's buckets, sent between the processes as bfloat16 (dpar_engine_set_gradient_compression):
 *              half the bytes across; ovl/bf16 is what that buys the step;
 * and the anchor, the all-reduce alone: the same bytes through the same path with no computation (the threads
 * of one process: a dpar_comm group of N; several processes: the MPI communicator between them, after the local
 * sum, which is what the engine's hierarchy does).
 * hidden = (one - overlap) / all-reduce: the share of the all-reduce time that the overlap took off the step.
 * Only rank 0 prints. See bench/README.md. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "bench_check.h"
#include "dpar.h"

enum { kMaxRounds = 64, kMaxSteps = 256 };

enum { kMaxHidden = 8 };
typedef struct options {
  size_t devices, batch;
  int rounds, steps;
  int64_t hidden[kMaxHidden];
  int layers;               /* hidden layers */
  size_t first_kib, cap_kib; /* 0: dpar's defaults */
} options;

static dpar_engine *make_engine(const dpar_model *model, const options *o, size_t first, size_t cap) {
  dpar_optimizer_options opt = DPAR_OPTIMIZER_OPTIONS_INIT;
  opt.kind = DPAR_ADAM;
  opt.lr = 1e-4f;
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = o->devices;
  eo.first_bucket_bytes = first;
  eo.bucket_cap_bytes = cap;
  dpar_engine *e = NULL;
  CHECK(dpar_engine_create(&e, model, &opt, &eo));
  return e;
}

/* Median seconds per step of `steps` steps. */
static double time_steps(dpar_engine *e, const dpar_tensor *x, const dpar_tensor *y, int steps) {
  double t[kMaxSteps];
  for (int s = 0; s < steps; ++s) {
    const double t0 = bench_now();
    CHECK(dpar_engine_train_step(NULL, e, x, y));
    t[s] = bench_now() - t0;
  }
  return bench_median(t, (size_t)steps);
}

/* Thread body of the anchor: one participant of the in-process group, `reps` all-reduces of `count` floats. */
typedef struct anchor_arg {
  dpar_comm *comm;
  float *buf;
  size_t count;
  int reps;
  double seconds; /* median, participant 0 */
} anchor_arg;

static void *anchor_thread(void *p) {
  anchor_arg *a = (anchor_arg *)p;
  double t[kMaxSteps];
  for (int i = 0; i < a->reps; ++i) {
    CHECK(dpar_comm_barrier(a->comm));
    const double t0 = bench_now();
    CHECK(dpar_comm_all_reduce(a->comm, a->buf, a->buf, a->count, DPAR_F32, DPAR_SUM));
    t[i] = bench_now() - t0;
  }
  a->seconds = bench_median(t, (size_t)a->reps);
  return NULL;
}

/* The all-reduce alone over the engine's path: threads within the process, then MPI across processes. */
static double anchor_allreduce(size_t devices, dpar_comm *mpi, size_t count, int reps) {
  double local = 0;
  if (devices > 1) {
    dpar_comm_group *g = NULL;
    CHECK(dpar_comm_group_create(&g, devices, NULL));
    pthread_t th[256];
    anchor_arg args[256];
    for (size_t r = 0; r < devices; ++r) {
      CHECK(dpar_comm_group_member(&args[r].comm, g, r));
      args[r].buf = (float *)calloc(count, sizeof(float));
      args[r].count = count;
      args[r].reps = reps;
      pthread_create(&th[r], NULL, anchor_thread, &args[r]);
    }
    for (size_t r = 0; r < devices; ++r) pthread_join(th[r], NULL);
    local = args[0].seconds;
    for (size_t r = 0; r < devices; ++r) {
      dpar_comm_free(args[r].comm);
      free(args[r].buf);
    }
    dpar_comm_group_free(g);
  }
  double across = 0;
  if (mpi) {
    float *buf = (float *)calloc(count, sizeof(float));
    double t[kMaxSteps];
    for (int i = 0; i < reps; ++i) {
      CHECK(dpar_comm_barrier(mpi));
      const double t0 = bench_now();
      CHECK(dpar_comm_all_reduce(mpi, buf, buf, count, DPAR_F32, DPAR_SUM));
      t[i] = bench_now() - t0;
    }
    across = bench_median(t, (size_t)reps);
    free(buf);
  }
  return local + across;
}

static void usage(void) {
  fprintf(stderr, "usage: bench_overlap [--devices N] [--batch B] [--rounds R] [--steps S] [--hidden H1,H2,...]\n"
                  "                     [--first-kib K] [--cap-kib C]\n");
  exit(2);
}

int main(int argc, char **argv) {
  options o = {2, 256, 7, 12, {2048, 1024}, 2, 0, 0};
  for (int i = 1; i < argc; ++i) {
    if (i + 1 >= argc) usage();
    if (!strcmp(argv[i], "--devices")) o.devices = (size_t)atoi(argv[++i]);
    else if (!strcmp(argv[i], "--batch")) o.batch = (size_t)atoi(argv[++i]);
    else if (!strcmp(argv[i], "--rounds")) o.rounds = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--steps")) o.steps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--first-kib")) o.first_kib = (size_t)atol(argv[++i]);
    else if (!strcmp(argv[i], "--cap-kib")) o.cap_kib = (size_t)atol(argv[++i]);
    else if (!strcmp(argv[i], "--hidden")) {
      o.layers = 0;
      for (char *t = strtok(argv[++i], ","); t && o.layers < kMaxHidden; t = strtok(NULL, ",")) o.hidden[o.layers++] = atol(t);
    } else usage();
  }
  if (o.devices < 1 || o.devices > 256 || o.batch < 1 || o.rounds < 1 || o.rounds > kMaxRounds || o.steps < 1 ||
      o.steps > kMaxSteps || o.layers < 1)
    usage();
  for (int l = 0; l < o.layers; ++l)
    if (o.hidden[l] < 1) usage();

  dpar_model *model = NULL;
  CHECK(dpar_model_create(&model, NULL));
  size_t params = 0;
  char shape[256] = "784";
  int64_t in = 784;
  for (int l = 0; l <= o.layers; ++l) {
    const int64_t out = l < o.layers ? o.hidden[l] : 10;
    CHECK(dpar_model_add_linear(model, in, out, 1));
    if (l < o.layers) CHECK(dpar_model_add_activation(model, DPAR_RELU));
    params += (size_t)(in * out + out);
    snprintf(shape + strlen(shape), sizeof shape - strlen(shape), "-%ld", (long)out);
    in = out;
  }

  dpar_engine *overlap = make_engine(model, &o, o.first_kib * 1024, o.cap_kib * 1024);
  dpar_engine *one = make_engine(model, &o, SIZE_MAX, SIZE_MAX);
  size_t rank = 0, nproc = 1;
  CHECK(dpar_engine_processes(&rank, &nproc, overlap));
  size_t buckets = 0;
  CHECK(dpar_engine_num_buckets(&buckets, overlap));
  dpar_comm *mpi = NULL;
  dpar_engine *packed = NULL; /* with several processes: overlap's buckets, bf16 between the processes */
  if (nproc > 1) {
    CHECK(dpar_comm_create_mpi(&mpi, NULL));
    packed = make_engine(model, &o, o.first_kib * 1024, o.cap_kib * 1024);
    CHECK(dpar_engine_set_gradient_compression(packed, DPAR_COMPRESSION_BF16));
  }

  /* This process's part of the global batch. */
  const size_t local = o.batch / nproc + (rank < o.batch % nproc ? 1 : 0);
  const int64_t xs[2] = {(int64_t)local, 784}, ys[1] = {(int64_t)local};
  dpar_tensor *x = NULL, *y = NULL;
  const dpar_device host = {DPAR_DEVICE_CPU, 0};
  CHECK(dpar_tensor_create(&x, DPAR_F32, xs, 2, host));
  CHECK(dpar_tensor_create(&y, DPAR_I32, ys, 1, host));
  void *xp = NULL, *yp = NULL;
  CHECK(dpar_tensor_data(&xp, x));
  CHECK(dpar_tensor_data(&yp, y));
  float *xd = (float *)xp;
  int32_t *yd = (int32_t *)yp;
  uint64_t rng = 0x9E3779B97F4A7C15ull;
  for (size_t i = 0; i < local * 784; ++i) xd[i] = bench_uniform(&rng);
  for (size_t i = 0; i < local; ++i) yd[i] = (int32_t)(bench_next_u64(&rng) % 10);

  if (rank == 0) {
    bench_print_machine(stdout);
    printf("CPU GEMM: %s\n", dpar_cpu_gemm_backend());
    printf("bench_overlap: MLP %s, %.1f MB of gradients in %zu buckets (first %zu KiB, cap %zu KiB), Adam, "
           "global batch %zu over %zu process(es) x %zu device(s); %d rounds of %d steps, medians\n\n",
           shape, (double)params * 4 / 1e6, buckets, o.first_kib ? o.first_kib : 1024,
           o.cap_kib ? o.cap_kib : 25 * 1024, o.batch, nproc, o.devices, o.rounds, o.steps);
    printf("%6s %14s %14s %14s %9s %8s", "round", "overlap ms", "one bucket ms", "all-reduce ms", "one/ovl",
           "hidden");
    if (packed) printf(" %10s %9s", "bf16 ms", "ovl/bf16");
    printf("\n");
  }
  double t_ovl[kMaxRounds], t_one[kMaxRounds], t_ar[kMaxRounds], hidden[kMaxRounds], t_bf16[kMaxRounds];
  time_steps(overlap, x, y, 3); /* warm-up: first-touch of activations, BLAS buffers */
  time_steps(one, x, y, 3);
  if (packed) time_steps(packed, x, y, 3);
  for (int r = 0; r < o.rounds; ++r) {
    /* Rotate the order, so that no engine always runs right after another. */
    dpar_engine *order[3] = {overlap, one, packed};
    double *slot[3] = {&t_ovl[r], &t_one[r], &t_bf16[r]};
    const int engines = packed ? 3 : 2;
    for (int k = 0; k < engines; ++k) {
      const int e = (k + r) % engines;
      *slot[e] = time_steps(order[e], x, y, o.steps);
    }
    t_ar[r] = anchor_allreduce(o.devices, mpi, params, o.steps);
    hidden[r] = (t_one[r] - t_ovl[r]) / t_ar[r];
    if (rank == 0) {
      printf("%6d %14.3f %14.3f %14.3f %9.3f %7.0f%%", r, t_ovl[r] * 1e3, t_one[r] * 1e3, t_ar[r] * 1e3,
             t_one[r] / t_ovl[r], hidden[r] * 100);
      if (packed) printf(" %10.3f %9.3f", t_bf16[r] * 1e3, t_ovl[r] / t_bf16[r]);
      printf("\n");
    }
  }
  const double m_ovl = bench_median(t_ovl, (size_t)o.rounds), m_one = bench_median(t_one, (size_t)o.rounds);
  const double m_ar = bench_median(t_ar, (size_t)o.rounds), m_hidden = bench_median(hidden, (size_t)o.rounds);
  if (rank == 0) {
    printf("%6s %14.3f %14.3f %14.3f %9.3f %7.0f%%", "median", m_ovl * 1e3, m_one * 1e3, m_ar * 1e3,
           m_one / m_ovl, m_hidden * 100);
    const double m_bf16 = packed ? bench_median(t_bf16, (size_t)o.rounds) : 0;
    if (packed) printf(" %10.3f %9.3f", m_bf16 * 1e3, m_ovl / m_bf16);
    printf("\n\nsamples/s: overlap %.0f, one bucket %.0f", (double)o.batch / m_ovl, (double)o.batch / m_one);
    if (packed) printf(", bf16 between processes %.0f", (double)o.batch / m_bf16);
    printf("; hidden = (one - overlap) / all-reduce, median of rounds (aim: at least 50%%)\n");
  }
  dpar_tensor_free(x);
  dpar_tensor_free(y);
  dpar_comm_free(mpi);
  dpar_engine_free(overlap);
  dpar_engine_free(one);
  dpar_engine_free(packed);
  dpar_model_free(model);
  return 0;
}
