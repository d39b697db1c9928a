/*
 * bench_zero [--rounds R] [--seconds S] [--devices N,M,...]
 *
 * The sharded optimizer's two gradient reductions side by side (dpar_engine_set_gradient_reduction): today's
 * all-reduce (every replica receives the whole sum) and the reduce-scatter of ZeRO stage 2 (each replica receives
 * only the block of every bucket that its optimizer steps). Either way an all-gather of the parameters follows.
 * For the demo MLP 784-256-128-10 and a wider MLP 784-1024-1024-10 (Adam, batch 256), on each device count: the
 * median training step of each reduction over R interleaved rounds, their ratio, and the bytes each moves per step
 * (nccl-tests' bus bytes for the gradient of S bytes over n replicas: all-reduce 2(n-1)/n S, reduce-scatter and
 * all-gather (n-1)/n S each). Under mpirun each process runs the same and rank 0 prints; between the processes both
 * reductions sum every bucket whole (replica 0 of each process), 2(P-1)/P S, so only the traffic within a process
 * differs.
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

enum { kBatch = 256, kFeatures = 784, kClasses = 10, kBatches = 4, kMaxDevices = 64 };

typedef struct shape {
  const char *name;
  int64_t hidden1, hidden2;
} shape;

static dpar_model *make_model(const shape *s) {
  dpar_model *model = NULL;
  CHECK(dpar_model_create(&model, NULL));
  CHECK(dpar_model_add_linear(model, kFeatures, s->hidden1, 1));
  CHECK(dpar_model_add_activation(model, DPAR_RELU));
  CHECK(dpar_model_add_linear(model, s->hidden1, s->hidden2, 1));
  CHECK(dpar_model_add_activation(model, DPAR_RELU));
  CHECK(dpar_model_add_linear(model, s->hidden2, kClasses, 1));
  return model;
}

static dpar_engine *make_engine(const dpar_model *model, size_t devices, int32_t reduction) {
  int32_t ids[kMaxDevices];
  for (size_t i = 0; i < devices; ++i) ids[i] = (int32_t)i;
  dpar_optimizer_options opt = DPAR_OPTIMIZER_OPTIONS_INIT;
  opt.kind = DPAR_ADAM;
  opt.lr = 1e-3f;
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = devices;
  eo.device_ids = ids;
  eo.num_device_ids = devices;
  dpar_engine *e = NULL;
  CHECK(dpar_engine_create(&e, model, &opt, &eo));
  CHECK(dpar_engine_set_gradient_reduction(e, reduction));
  return e;
}

/* The median of `steps` timed training steps, after two untimed ones. */
static double time_steps(dpar_engine *e, dpar_tensor **x, dpar_tensor **y, int steps) {
  double t[256];
  if (steps > 256) steps = 256;
  for (int i = 0; i < 2; ++i) CHECK(dpar_engine_train_step(NULL, e, x[i % kBatches], y[i % kBatches]));
  for (int i = 0; i < steps; ++i) {
    const double t0 = bench_now();
    CHECK(dpar_engine_train_step(NULL, e, x[i % kBatches], y[i % kBatches]));
    t[i] = bench_now() - t0;
  }
  return bench_median(t, (size_t)steps);
}

int main(int argc, char **argv) {
  int rounds = 7;
  double seconds = 0.3;
  size_t devices[8] = {2, 4};
  size_t ndevices = 2;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--rounds") && i + 1 < argc) {
      rounds = atoi(argv[++i]);
    } else if (!strcmp(argv[i], "--seconds") && i + 1 < argc) {
      seconds = atof(argv[++i]);
    } else if (!strcmp(argv[i], "--devices") && i + 1 < argc) {
      ndevices = 0;
      for (char *p = argv[++i]; *p && ndevices < 8;) {
        devices[ndevices++] = (size_t)strtoul(p, &p, 10);
        if (*p == ',') ++p;
      }
    } else {
      fprintf(stderr, "usage: %s [--rounds R] [--seconds S] [--devices N,M,...]\n", argv[0]);
      return 2;
    }
  }
  for (size_t d = 0; d < ndevices; ++d)
    if (devices[d] < 1 || devices[d] > kMaxDevices) {
      fprintf(stderr, "--devices: 1 to %d each\n", kMaxDevices);
      return 2;
    }
  if (rounds < 1 || rounds > 64 || !(seconds > 0)) return 2;

  /* Random batches on the host. */
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

  const shape shapes[2] = {{"784-256-128-10", 256, 128}, {"784-1024-1024-10", 1024, 1024}};
  int printed_header = 0;
  for (size_t si = 0; si < 2; ++si) {
    dpar_model *model = make_model(&shapes[si]);
    const double params = (double)(kFeatures * shapes[si].hidden1 + shapes[si].hidden1) +
                          (double)(shapes[si].hidden1 * shapes[si].hidden2 + shapes[si].hidden2) +
                          (double)(shapes[si].hidden2 * kClasses + kClasses);
    for (size_t d = 0; d < ndevices; ++d) {
      const size_t n = devices[d];
      dpar_engine *all = make_engine(model, n, DPAR_REDUCTION_ALL_REDUCE);
      dpar_engine *scatter = make_engine(model, n, DPAR_REDUCTION_REDUCE_SCATTER);
      size_t rank = 0, processes = 1;
      CHECK(dpar_engine_processes(&rank, &processes, all));
      if (!printed_header && rank == 0) {
        printf("bench_zero: %s; %zu process(es); Adam, batch %d (per process), %d interleaved rounds\n",
               dpar_cpu_gemm_backend(), processes, kBatch, rounds);
        printf("%-18s %7s %11s %11s %7s | bus bytes per step within a process (MB): all-reduce+all-gather, "
               "reduce-scatter+all-gather\n",
               "model", "devices", "all-reduce", "red-scatter", "ratio");
        printed_header = 1;
      }
      double ta[64], ts[64];
      int steps = 0;
      { /* As many steps per round as fit `seconds` on the slower of the two. */
        const double t = time_steps(all, x, y, 3);
        steps = t > 0 ? (int)(seconds / t) : 256;
        if (steps < 3) steps = 3;
      }
      for (int r = 0; r < rounds; ++r) {
        ta[r] = time_steps(all, x, y, steps);
        ts[r] = time_steps(scatter, x, y, steps);
      }
      const double ma = bench_median(ta, (size_t)rounds), ms = bench_median(ts, (size_t)rounds);
      const double bytes = params * 4.0, part = n > 1 ? (double)(n - 1) / (double)n : 0.0;
      if (rank == 0)
        printf("%-18s %7zu %9.3f ms %9.3f ms %6.3fx | %.2f, %.2f\n", shapes[si].name, n, ma * 1e3, ms * 1e3,
               ma / ms, 3.0 * part * bytes / 1e6, 2.0 * part * bytes / 1e6);
      dpar_engine_free(all);
      dpar_engine_free(scatter);
    }
    dpar_model_free(model);
  }
  for (int b = 0; b < kBatches; ++b) {
    dpar_tensor_free(x[b]);
    dpar_tensor_free(y[b]);
  }
  return 0;
}
