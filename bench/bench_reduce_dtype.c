/*
 * bench_reduce_dtype: the gradient reduction in f32 against the reduce dtype bf16 (dpar_engine_set_reduce_dtype),
 * for a 784-1024-256-10 MLP (1,068,810 parameters), Adam, batch 256:
 *   bench_reduce_dtype [--devices N] [--steps S]                  (one process, N CPU devices)
 *   mpirun -np 2 bench_reduce_dtype --mpi [--devices N] [--steps S]  (every process of MPI_COMM_WORLD)
 *   bench_reduce_dtype --reproducible ROWS [--devices N] [--steps S]
 * Prints the median step time of each, and the bytes each replica hands the reduction per step within its process
 * and (replica 0) across the processes: the collectives count no bytes, so they are computed from the buckets,
 * which together hold every parameter's gradient once: elements x 4 in f32, x 2 in bf16 across processes; within a
 * process CPU replicas sum the rounded values in f32 through shared memory, elements x 4 either way. What the links then carry
 * is the collective's algorithm's multiple of it (a ring all-reduce over p sends 2 (p - 1) / p of it).
 * With --reproducible ROWS it times the default mode (f32) against the reproducible mode with micro-chunks of ROWS
 * rows (dpar_engine_set_reproducible) instead, on the same model and batches.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "dpar.h"

#define CHECK(call)                                                                                            \
  do {                                                                                                         \
    dpar_status s_ = (call);                                                                                   \
    if (s_ != DPAR_OK) {                                                                                       \
      fprintf(stderr, "%s:%d: %s: %s: %s\n", __FILE__, __LINE__, #call, dpar_status_str(s_), dpar_last_error()); \
      exit(1);                                                                                                 \
    }                                                                                                          \
  } while (0)

enum { kBatch = 256, kFeatures = 784, kHidden1 = 1024, kHidden2 = 256, kClasses = 10, kBatches = 4 };

static dpar_engine *make_engine(const dpar_model *model, size_t devices, int mpi, int32_t reduce_dtype,
                                int64_t micro_chunk_rows) {
  int32_t ids[64];
  for (size_t i = 0; i < devices; ++i) ids[i] = (int32_t)i;
  dpar_optimizer_options opt = DPAR_OPTIMIZER_OPTIONS_INIT;
  opt.kind = DPAR_ADAM;
  opt.lr = 1e-3f;
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = devices;
  eo.device_ids = ids;
  eo.num_device_ids = devices;
  eo.processes = mpi ? DPAR_PROCESSES_MPI : DPAR_PROCESSES_SINGLE;
  dpar_engine *e = NULL;
  CHECK(dpar_engine_create(&e, model, &opt, &eo));
  CHECK(dpar_engine_set_reduce_dtype(e, reduce_dtype));
  CHECK(dpar_engine_set_reproducible(e, micro_chunk_rows));
  return e;
}

/* The median of `steps` timed training steps after two untimed ones; the mean loss of the last four in *loss. */
static double time_steps(dpar_engine *e, dpar_tensor **x, dpar_tensor **y, int steps, double *loss) {
  double t[512];
  if (steps > 512) steps = 512;
  *loss = 0;
  for (int i = 0; i < 2; ++i) CHECK(dpar_engine_train_step(NULL, e, x[i % kBatches], y[i % kBatches]));
  for (int i = 0; i < steps; ++i) {
    float l = 0;
    const double t0 = bench_now();
    CHECK(dpar_engine_train_step(&l, e, x[i % kBatches], y[i % kBatches]));
    t[i] = bench_now() - t0;
    if (i >= steps - 4) *loss += l / 4.0;
  }
  return bench_median(t, (size_t)steps);
}

int main(int argc, char **argv) {
  size_t devices = 2;
  int steps = 40, mpi = 0;
  int64_t reproducible = 0;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--devices") && i + 1 < argc) {
      devices = (size_t)strtoul(argv[++i], NULL, 10);
    } else if (!strcmp(argv[i], "--steps") && i + 1 < argc) {
      steps = atoi(argv[++i]);
    } else if (!strcmp(argv[i], "--mpi")) {
      mpi = 1;
    } else if (!strcmp(argv[i], "--reproducible") && i + 1 < argc) {
      reproducible = strtoll(argv[++i], NULL, 10);
    } else {
      fprintf(stderr, "usage: %s [--devices N] [--steps S] [--mpi] [--reproducible ROWS]\n", argv[0]);
      return 2;
    }
  }
  if (devices < 1 || devices > 64 || steps < 4 || reproducible < 0) return 2;

  uint64_t rng = 42;
  dpar_tensor *x[kBatches], *y[kBatches];
  for (int b = 0; b < kBatches; ++b) {
    const int64_t xs[2] = {kBatch, kFeatures}, ys[1] = {kBatch};
    const dpar_device host = {DPAR_DEVICE_CPU, 0};
    CHECK(dpar_tensor_create(&x[b], DPAR_F32, xs, 2, host));
    CHECK(dpar_tensor_create(&y[b], DPAR_I32, ys, 1, host));
    float *xd = NULL;
    int32_t *yd = NULL;
    CHECK(dpar_tensor_data((void **)&xd, x[b]));
    CHECK(dpar_tensor_data((void **)&yd, y[b]));
    for (int64_t i = 0; i < (int64_t)kBatch * kFeatures; ++i) xd[i] = bench_uniform(&rng);
    for (int64_t i = 0; i < kBatch; ++i) yd[i] = (int32_t)(bench_next_u64(&rng) % kClasses);
  }
  dpar_model *model = NULL;
  CHECK(dpar_model_create(&model, NULL));
  CHECK(dpar_model_add_linear(model, kFeatures, kHidden1, 1));
  CHECK(dpar_model_add_activation(model, DPAR_RELU));
  CHECK(dpar_model_add_linear(model, kHidden1, kHidden2, 1));
  CHECK(dpar_model_add_activation(model, DPAR_RELU));
  CHECK(dpar_model_add_linear(model, kHidden2, kClasses, 1));
  size_t elements = 0;
  CHECK(dpar_model_num_param_elements(&elements, model));

  if (reproducible > 0) {
    /* The default mode against the reproducible mode, interleaved in rounds so that the other builds' load falls
       on both alike. */
    dpar_engine *e[2] = {make_engine(model, devices, mpi, DPAR_F32, 0),
                         make_engine(model, devices, mpi, DPAR_F32, reproducible)};
    for (int round = 0; round < 3; ++round)
      for (int m = 0; m < 2; ++m) {
        double loss = 0;
        const double t = time_steps(e[m], x, y, steps, &loss);
        printf("round %d, %zu device(s), %-33s step %.2f ms (median of %d); loss %.4f\n", round, devices,
               m ? "reproducible mode (micro-chunks):" : "default mode:", t * 1e3, steps, loss);
      }
    dpar_engine_free(e[0]);
    dpar_engine_free(e[1]);
  }
  const int32_t dtypes[2] = {DPAR_F32, DPAR_BF16};
  for (int d = 0; d < 2 && reproducible == 0; ++d) {
    dpar_engine *e = make_engine(model, devices, mpi, dtypes[d], 0);
    size_t rank = 0, size = 1, buckets = 0;
    CHECK(dpar_engine_processes(&rank, &size, e));
    CHECK(dpar_engine_num_buckets(&buckets, e));
    double loss = 0;
    const double t = time_steps(e, x, y, steps, &loss);
    const size_t esz = dtypes[d] == DPAR_BF16 ? 2 : 4;
    /* Within a process, CPU replicas (threads) sum the bf16-rounded values in f32 through shared memory: f32's
       bytes either way (on GPUs NCCL's bf16 collectives would carry elements x 2). MPI carries bf16 across. */
    const size_t within = devices > 1 ? elements * 4 : 0, across = size > 1 ? elements * esz : 0;
    if (rank == 0)
      printf("%zu process(es) x %zu device(s), reduce dtype %-4s: %zu elements in %zu buckets; per replica per step "
             "%zu bytes within the process, %zu bytes across (replica 0); step %.2f ms (median of %d); loss %.4f\n",
             size, devices, dtypes[d] == DPAR_BF16 ? "bf16" : "f32", elements, buckets, within, across, t * 1e3,
             steps, loss);
    dpar_engine_free(e);
  }
  dpar_model_free(model);
  for (int b = 0; b < kBatches; ++b) {
    dpar_tensor_free(x[b]);
    dpar_tensor_free(y[b]);
  }
  return 0;
}
