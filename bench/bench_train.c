/* bench_train: what dpar's DataParallel engine delivers, through the C ABI only (dpar.h, libdpar.so).
 *
 *   bench_train [--rounds R] [--seconds S] [--pin] [--only a|b|c|d]
 *
 * (a) Training throughput of the demo MLP 784-256-128-10 (ReLU, softmax cross-entropy, Adam lr 1e-3) at batch
 *     256 on synthetic random data: 1 device (1 BLAS thread), 2 devices (1 BLAS thread each), and 1 device with
 *     2 BLAS threads (what a user would otherwise run), interleaved in rounds; medians of per-step times.
 * (b) The engine's own cost per dpar_engine_train_step on a 5->2 linear model at batch 30 (cross-entropy over 2
 *     classes, SGD) over 4, 2 and 1 devices, beside a hand-written C step of the same arithmetic (the compute
 *     that any implementation must do), so that the overhead is separable.
 * (c) The cost of gradient clipping (dpar_engine_set_max_grad_norm) on the model of (a) over 2 devices: off, on
 *     without scaling, on with scaling, interleaved on one engine.
 * (d) The cost of recording a trace (dpar_engine_trace_start) over 2 devices, on the model of (a) and on the tiny
 *     model of (b), where a step is mostly the engine's own work: off and on, interleaved on one engine each.
 *
 * Between rounds it measures the core-to-core latency that tells where the host placed the two vCPUs.
 * --pin pins replica r's worker to CPU r mod ncpu from the forward hook (an experiment: the engine does not pin).
 * See bench/README.md. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench_util.h"
#include "bench_check.h"
#include "dpar.h"

static int g_cpus[1024];
static int g_ncpu = 1;
static int g_pin = 0;
/* A block during which other processes used this share of the CPUs or more is marked disturbed. */
static const double kDisturbed = 0.10;

/* ---- small helpers ---------------------------------------------------------------------------------------- */

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static uint64_t next_u64(void) { return bench_next_u64(&g_rng); }
static float uniform(void) { return bench_uniform(&g_rng); }

static void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  if (!p) {
    fprintf(stderr, "out of memory\n");
    exit(1);
  }
  return p;
}

/* Pins each replica's worker thread once, from the forward hook (it runs on the worker). */
static int g_pinned[256];
static dpar_status pin_hook(void *payload, size_t replica, const int64_t *in, size_t in_ndim, const int64_t *out,
                            size_t out_ndim) {
  (void)payload, (void)in, (void)in_ndim, (void)out, (void)out_ndim;
  if (replica < 256 && !g_pinned[replica]) {
    bench_pin_self(g_cpus[replica % (size_t)g_ncpu]);
    g_pinned[replica] = 1;
  }
  return DPAR_OK;
}

static dpar_engine *make_engine(const dpar_model *model, const dpar_optimizer_options *opt, int32_t loss,
                                size_t num_cpu_devices, size_t devices, int blas_threads) {
  int32_t ids[256];
  for (size_t i = 0; i < devices; ++i) ids[i] = (int32_t)i;
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = num_cpu_devices;
  eo.device_ids = ids;
  eo.num_device_ids = devices;
  eo.loss = loss;
  eo.blas_threads = (size_t)blas_threads;
  dpar_engine *e = NULL;
  CHECK(dpar_engine_create(&e, model, opt, &eo));
  if (g_pin) {
    memset(g_pinned, 0, sizeof g_pinned);
    CHECK(dpar_engine_set_forward_hook(e, pin_hook, NULL, NULL));
  }
  return e;
}

static double probe(void) { return bench_core_latency_ns(g_cpus[0], g_ncpu > 1 ? g_cpus[1] : g_cpus[0]); }

/* A growable list of doubles. */
typedef struct vec {
  double *v;
  size_t n, cap;
} vec;
static void vec_push(vec *a, double x) {
  if (a->n == a->cap) {
    a->cap = a->cap ? 2 * a->cap : 1024;
    double *nv = (double *)realloc(a->v, a->cap * sizeof(double));
    if (!nv) {
      fprintf(stderr, "out of memory\n");
      exit(1);
    }
    a->v = nv;
  }
  a->v[a->n++] = x;
}
static double vec_median(const vec *a) {
  if (!a->n) return 0;
  double *t = (double *)xmalloc(a->n * sizeof(double));
  memcpy(t, a->v, a->n * sizeof(double));
  double m = bench_median(t, a->n);
  free(t);
  return m;
}
static double vec_sum(const vec *a) {
  double s = 0;
  for (size_t i = 0; i < a->n; ++i) s += a->v[i];
  return s;
}

/* Times steps on `engine` for about `seconds` (at least min_steps) after `warmup` steps; appends each step's time
 * to all and returns the block's median. */
static double time_steps(dpar_engine *engine, dpar_tensor **x, dpar_tensor **y, int nbatches, int warmup,
                         int min_steps, double seconds, vec *all) {
  int b = 0;
  for (int i = 0; i < warmup; ++i, b = (b + 1) % nbatches) CHECK(dpar_engine_train_step(NULL, engine, x[b], y[b]));
  vec block = {0};
  const double start = bench_now();
  for (int i = 0;; ++i, b = (b + 1) % nbatches) {
    const double t0 = bench_now();
    CHECK(dpar_engine_train_step(NULL, engine, x[b], y[b]));
    const double t1 = bench_now();
    vec_push(&block, t1 - t0);
    vec_push(all, t1 - t0);
    if (i + 1 >= min_steps && t1 - start >= seconds) break;
  }
  double m = vec_median(&block);
  free(block.v);
  return m;
}

/* ---- (a) throughput ------------------------------------------------------------------------------------------ */

enum { kBatchA = 256, kFeatures = 784, kClasses = 10, kBatchesA = 8, kConfigs = 3 };

typedef struct config {
  const char *name;
  size_t devices;
  int blas_threads;
} config;

static const config kConfigsA[kConfigs] = {
    {"1 device, 1 BLAS thread", 1, 1},
    {"2 devices, 1 BLAS thread each", 2, 1},
    {"1 device, 2 BLAS threads", 1, 2},
};

/* The demo MLP 784-256-128-10 (ReLU) and kBatchesA random batches of `batch` rows on the host. */
static dpar_model *demo_model_and_batches_of(int batch, dpar_tensor **x, dpar_tensor **y) {
  dpar_model *model = NULL;
  dpar_model_options mo = DPAR_MODEL_OPTIONS_INIT;
  mo.seed = 1;
  CHECK(dpar_model_create(&model, &mo));
  CHECK(dpar_model_add_linear(model, kFeatures, 256, 1));
  CHECK(dpar_model_add_activation(model, DPAR_RELU));
  CHECK(dpar_model_add_linear(model, 256, 128, 1));
  CHECK(dpar_model_add_activation(model, DPAR_RELU));
  CHECK(dpar_model_add_linear(model, 128, kClasses, 1));
  dpar_device cpu0 = {DPAR_DEVICE_CPU, 0};
  float *xs = (float *)xmalloc(sizeof(float) * (size_t)batch * kFeatures);
  int32_t *ys = (int32_t *)xmalloc(sizeof(int32_t) * (size_t)batch);
  for (int b = 0; b < kBatchesA; ++b) {
    for (int i = 0; i < batch * kFeatures; ++i) xs[i] = uniform();  /* pixels in [0, 1) */
    for (int i = 0; i < batch; ++i) ys[i] = (int32_t)(next_u64() % kClasses);
    const int64_t xshape[2] = {batch, kFeatures}, yshape[1] = {batch};
    CHECK(dpar_tensor_create(&x[b], DPAR_F32, xshape, 2, cpu0));
    CHECK(dpar_tensor_create(&y[b], DPAR_I32, yshape, 1, cpu0));
    CHECK(dpar_tensor_copy_from_host(x[b], xs, sizeof(float) * (size_t)batch * kFeatures));
    CHECK(dpar_tensor_copy_from_host(y[b], ys, sizeof(int32_t) * (size_t)batch));
  }
  free(xs);
  free(ys);
  return model;
}

static dpar_model *demo_model_and_batches(dpar_tensor **x, dpar_tensor **y) {
  return demo_model_and_batches_of(kBatchA, x, y);
}

static void free_demo(dpar_model *model, dpar_tensor **x, dpar_tensor **y) {
  for (int b = 0; b < kBatchesA; ++b) {
    dpar_tensor_free(x[b]);
    dpar_tensor_free(y[b]);
  }
  dpar_model_free(model);
}

static void part_a(int rounds, double seconds) {
  printf("(a) training throughput: MLP 784-256-128-10 (ReLU), softmax cross-entropy, Adam lr 1e-3, batch %d,\n"
         "    synthetic data (%d random batches, cycled). %d rounds; each round runs every configuration once (the\n"
         "    order rotates) on a fresh engine (each worker sets its own GEMM thread count when it starts), 10\n"
         "    warm-up steps, then ~%.2f s of timed steps; samples/s = %d / median step time\n",
         kBatchA, kBatchesA, rounds, seconds, kBatchA);
  dpar_tensor *x[kBatchesA], *y[kBatchesA];
  dpar_model *model = demo_model_and_batches(x, y);
  size_t nparams = 0;
  CHECK(dpar_model_num_param_elements(&nparams, model));
  printf("    %zu parameters (%.2f MiB of f32 gradients all-reduced per step with 2 devices)\n", nparams,
         (double)nparams * 4.0 / 1048576.0);

  dpar_optimizer_options oo = DPAR_OPTIMIZER_OPTIONS_INIT;
  oo.kind = DPAR_ADAM;
  oo.lr = 1e-3f;

  vec all[kConfigs] = {{0}};
  double *round_med = (double *)xmalloc(sizeof(double) * (size_t)rounds * kConfigs);
  double *lat = (double *)xmalloc(sizeof(double) * (size_t)(rounds + 1));
  int *clean = (int *)xmalloc(sizeof(int) * (size_t)rounds);
  printf("\n    %-22s | %9s %9s %9s | %8s %8s | %s\n", "round (placement)", "1dev/1bt", "2dev/1bt", "1dev/2bt",
         "2dev/1dev", "2dev/2bt", "other processes");
  printf("    %-22s | %29s | %17s | (most in a block)\n", "", "samples/s (block median)", "ratios");
  for (int r = 0; r < rounds; ++r) {
    lat[r] = probe();
    double others = 0;
    for (int k = 0; k < kConfigs; ++k) {
      const int c = (k + r) % kConfigs;
      dpar_engine *e = make_engine(model, &oo, DPAR_LOSS_CROSS_ENTROPY, 2, kConfigsA[c].devices,
                                   kConfigsA[c].blas_threads);
      bench_cpu_usage u0, u1;
      bench_cpu_usage_now(&u0);
      const double m = time_steps(e, x, y, kBatchesA, 10, 20, seconds, &all[c]);
      bench_cpu_usage_now(&u1);
      const double o = bench_others_share(&u0, &u1, g_ncpu);
      others = o > others ? o : others;
      round_med[r * kConfigs + c] = m;
      dpar_engine_free(e);
      /* With 2 GEMM threads, OpenMP's idle thread spins a while before it sleeps: let it, before the next block. */
      usleep(150000);
    }
    clean[r] = others < kDisturbed;
    const double *m = &round_med[r * kConfigs];
    char label[64];
    snprintf(label, sizeof label, "%d (%.0f ns %s)", r, lat[r], bench_placement_tag(lat[r]));
    printf("    %-22s | %9.0f %9.0f %9.0f | %8.2fx %7.2fx | %4.0f%%%s\n", label, kBatchA / m[0], kBatchA / m[1],
           kBatchA / m[2], m[0] / m[1], m[2] / m[1], 100 * others, clean[r] ? "" : "  disturbed");
  }
  lat[rounds] = probe();
  printf("    latency after the last round: %.0f ns (%s)\n\n", lat[rounds], bench_placement_class(lat[rounds]));

  double med[kConfigs];
  printf("    %-32s | %9s | %10s | %10s | %6s\n", "configuration", "median ms", "samples/s", "samples/s", "steps");
  printf("    %-32s | %9s | %10s | %10s |\n", "", "per step", "(median)", "(mean)");
  for (int c = 0; c < kConfigs; ++c) {
    med[c] = vec_median(&all[c]);
    printf("    %-32s | %9.3f | %10.0f | %10.0f | %6zu\n", kConfigsA[c].name, med[c] * 1e3, kBatchA / med[c],
           (double)kBatchA * (double)all[c].n / vec_sum(&all[c]), all[c].n);
  }
  /* Ratios of the overall medians, and the medians of the per-round ratios (each round at one placement), over
   * all rounds and over the rounds that no other process disturbed. */
  double r1[64], r2[64], c1[64], c2[64];
  int nr = 0, nc = 0;
  for (int r = 0; r < rounds; ++r) {
    r1[nr] = round_med[r * kConfigs + 0] / round_med[r * kConfigs + 1];
    r2[nr] = round_med[r * kConfigs + 2] / round_med[r * kConfigs + 1];
    if (clean[r]) {
      c1[nc] = r1[nr];
      c2[nc++] = r2[nr];
    }
    ++nr;
  }
  const double ratio1 = med[0] / med[1], ratio2 = med[2] / med[1];
  printf("\n    %-42s | %8s | %s | %s\n", "", "overall", "per-round ratios, median", "undisturbed rounds");
  printf("    %-42s | %8s | %24s | %s\n", "", "medians", "(all rounds)", "only (median)");
  char cl1[64] = "none", cl2[64] = "none";
  if (nc) {
    snprintf(cl1, sizeof cl1, "%.2fx (%d of %d)", bench_median(c1, (size_t)nc), nc, rounds);
    snprintf(cl2, sizeof cl2, "%.2fx (%d of %d)", bench_median(c2, (size_t)nc), nc, rounds);
  }
  printf("    %-42s | %7.2fx | %23.2fx | %s\n", "2 devices / 1 device (1 BLAS thread)", ratio1,
         bench_median(r1, (size_t)nr), cl1);
  printf("    %-42s | %7.2fx | %23.2fx | %s\n", "2 devices / 1 device with 2 BLAS threads", ratio2,
         bench_median(r2, (size_t)nr), cl2);
  /* The aims, judged on the undisturbed rounds when there are any. */
  const double a1 = nc ? bench_median(c1, (size_t)nc) : ratio1, a2 = nc ? bench_median(c2, (size_t)nc) : ratio2;
  printf("    aims (%s): 2dev/1dev %.2fx >= 1.70x: %s; 2dev/(1dev, 2 BLAS threads) %.2fx >= 1.00x: %s\n",
         nc ? "undisturbed rounds" : "all rounds; every round was disturbed", a1, a1 >= 1.7 ? "met" : "NOT met", a2,
         a2 >= 1.0 ? "met" : "NOT met");

  for (int c = 0; c < kConfigs; ++c) free(all[c].v);
  free(round_med);
  free(lat);
  free(clean);
  free_demo(model, x, y);
}

/* ---- (e) against PyTorch ---------------------------------------------------------------------------------- */

#ifndef BENCH_TORCH_ANCHOR
#define BENCH_TORCH_ANCHOR "bench/torch_anchor.py"
#endif
enum { kTorchBatches = 2, kTorchThreads = 2 };
static const int kBatchesE[kTorchBatches] = {256, 1024};

/* Runs torch_anchor.py --cpu-threads 1,2 once (a process of its own, so that PyTorch's OpenMP threads are gone
 * when dpar's next block starts) and reads its medians, ms[threads-1][batch index]; 0 where it gave none. */
static int run_torch(const char *python, double seconds, double ms[kTorchThreads][kTorchBatches],
                     double best[kTorchThreads][kTorchBatches], char *version, size_t cap) {
  char cmd[2048];
  snprintf(cmd, sizeof cmd, "'%s' '%s' --cpu-threads 1,2 --batches %d,%d --seconds %g 2>&1", python,
           BENCH_TORCH_ANCHOR, kBatchesE[0], kBatchesE[1], seconds);
  memset(ms, 0, sizeof(double) * kTorchThreads * kTorchBatches);
  memset(best, 0, sizeof(double) * kTorchThreads * kTorchBatches);
  bench_torch_figure figs[16];
  const int n = bench_run_torch_anchor(cmd, figs, 16, version, cap);
  int got = 0;
  for (int f = 0; f < n; ++f)
    for (int i = 0; i < kTorchBatches; ++i)
      if (figs[f].batch == kBatchesE[i] && figs[f].threads >= 1 && figs[f].threads <= kTorchThreads) {
        ms[figs[f].threads - 1][i] = figs[f].median_s;
        best[figs[f].threads - 1][i] = figs[f].min_s;
        ++got;
      }
  return got;
}

/* The demo MLP with Adam at batch 256 and 1024: dpar on 1 and 2 devices (1 GEMM thread each) against PyTorch on
 * the CPU at 1 and 2 threads, interleaved round by round. */
static void part_e(int rounds, double seconds, const char *python) {
  printf("(e) against PyTorch: MLP 784-256-128-10 (ReLU), softmax cross-entropy, Adam lr 1e-3, batch %d and %d,\n"
         "    synthetic data. %d rounds; each runs dpar on 1 and 2 devices (fresh engines, 1 GEMM thread per worker)\n"
         "    and then PyTorch at 1 and 2 threads (%s %s --cpu-threads 1,2, a process per round),\n"
         "    ~%.2f s of timed steps per configuration; figures are medians over rounds of each block's median\n"
         "    step time. The floor: dpar 2 devices >= 1.3x PyTorch 2 threads, dpar 1 device >= 1.0x PyTorch 1 thread.\n",
         kBatchesE[0], kBatchesE[1], rounds, python, BENCH_TORCH_ANCHOR, seconds);
  printf("    CPU GEMM: %s\n", dpar_cpu_gemm_backend());
  dpar_optimizer_options oo = DPAR_OPTIMIZER_OPTIONS_INIT;
  oo.kind = DPAR_ADAM;
  oo.lr = 1e-3f;
  /* [round][batch][config]: configs 0 dpar 1 device, 1 dpar 2 devices, 2 torch 1 thread, 3 torch 2 threads */
  double *m = (double *)xmalloc(sizeof(double) * (size_t)rounds * kTorchBatches * 4);
  double fastest[kTorchBatches][4] = {{0}}; /* the shortest step of each configuration over all rounds */
  int *clean = (int *)xmalloc(sizeof(int) * (size_t)rounds);
  char torch_version[1024] = "";
  int have_torch = 1;
  for (int r = 0; r < rounds; ++r) {
    bench_cpu_usage u0, u1;
    bench_cpu_usage_now(&u0);
    for (int bi = 0; bi < kTorchBatches; ++bi) {
      dpar_tensor *x[kBatchesA], *y[kBatchesA];
      dpar_model *model = demo_model_and_batches_of(kBatchesE[bi], x, y);
      for (int d = 0; d < 2; ++d) {
        vec all = {0};
        dpar_engine *e = make_engine(model, &oo, DPAR_LOSS_CROSS_ENTROPY, 2, (size_t)d + 1, 1);
        m[(r * kTorchBatches + bi) * 4 + d] = time_steps(e, x, y, kBatchesA, 10, 20, seconds, &all);
        for (size_t i = 0; i < all.n; ++i)
          if (fastest[bi][d] == 0 || all.v[i] < fastest[bi][d]) fastest[bi][d] = all.v[i];
        dpar_engine_free(e);
        free(all.v);
      }
      free_demo(model, x, y);
    }
    double t[kTorchThreads][kTorchBatches], tb[kTorchThreads][kTorchBatches];
    if (have_torch &&
        run_torch(python, seconds, t, tb, torch_version, sizeof torch_version) < kTorchThreads * kTorchBatches) {
      printf("    PyTorch did not run (%s): the PyTorch columns stay empty; give a Python with torch: --torch PYTHON\n",
             torch_version[0] ? torch_version : "no figures from torch_anchor.py");
      have_torch = 0;
    }
    for (int bi = 0; bi < kTorchBatches; ++bi)
      for (int th = 0; th < kTorchThreads; ++th) {
        m[(r * kTorchBatches + bi) * 4 + 2 + th] = have_torch ? t[th][bi] : 0;
        if (have_torch && (fastest[bi][2 + th] == 0 || tb[th][bi] < fastest[bi][2 + th]))
          fastest[bi][2 + th] = tb[th][bi];
      }
    bench_cpu_usage_now(&u1);
    /* PyTorch runs in a child process: this process's own account excludes it only while it is alive, so the
     * share is judged loosely here (a whole round, both sides). */
    const double others = bench_others_share(&u0, &u1, g_ncpu);
    clean[r] = others < kDisturbed;
    printf("    round %2d:", r);
    for (int bi = 0; bi < kTorchBatches; ++bi) {
      const double *q = &m[(r * kTorchBatches + bi) * 4];
      printf("  batch %4d: dpar %6.0f %6.0f torch %6.0f %6.0f samples/s |", kBatchesE[bi], kBatchesE[bi] / q[0],
             kBatchesE[bi] / q[1], q[2] > 0 ? kBatchesE[bi] / q[2] : 0, q[3] > 0 ? kBatchesE[bi] / q[3] : 0);
    }
    printf(" others %3.0f%%\n", 100 * others);
  }
  if (torch_version[0]) printf("    PyTorch: %s\n", torch_version);
  printf("\n    %-6s | %-22s | %10s | %10s | %s\n", "batch", "configuration", "median ms", "samples/s",
         "dpar / PyTorch (samples/s; median of per-round ratios in brackets)");
  for (int bi = 0; bi < kTorchBatches; ++bi) {
    double med[4], v[64], ratio[2][64];
    for (int c = 0; c < 4; ++c) {
      for (int r = 0; r < rounds; ++r) v[r] = m[(r * kTorchBatches + bi) * 4 + c];
      med[c] = bench_median(v, (size_t)rounds);
    }
    for (int r = 0; r < rounds; ++r)
      for (int d = 0; d < 2; ++d) {
        const double *q = &m[(r * kTorchBatches + bi) * 4];
        ratio[d][r] = q[0 + d] > 0 && q[2 + d] > 0 ? q[2 + d] / q[0 + d] : 0;
      }
    static const char *names[4] = {"dpar, 1 device", "dpar, 2 devices", "PyTorch, 1 thread", "PyTorch, 2 threads"};
    for (int c = 0; c < 4; ++c) {
      printf("    %-6d | %-22s | %10.3f | %10.0f |", kBatchesE[bi], names[c], med[c] * 1e3,
             med[c] > 0 ? kBatchesE[bi] / med[c] : 0);
      if (c < 2 && med[2 + c] > 0) {
        const double rr = bench_median(ratio[c], (size_t)rounds);
        printf(" %.2fx PyTorch %d thread%s [%.2fx]; floor %.1fx: %s", med[2 + c] / med[c], c + 1, c ? "s" : "", rr,
               c ? 1.3 : 1.0, med[2 + c] / med[c] >= (c ? 1.3 : 1.0) ? "met" : "NOT met");
      }
      printf("\n");
    }
  }
  /* On a shared machine every figure is slowed by the others' work, never sped up: the shortest step of each
   * configuration is the one least disturbed, and its ratio is the other reading of the same comparison. */
  printf("\n    shortest step over all rounds (the least disturbed), samples/s:\n");
  for (int bi = 0; bi < kTorchBatches; ++bi) {
    const double *f = fastest[bi];
    printf("    batch %4d: dpar 1 device %7.0f, 2 devices %7.0f; PyTorch 1 thread %7.0f, 2 threads %7.0f", kBatchesE[bi],
           kBatchesE[bi] / f[0], kBatchesE[bi] / f[1], f[2] > 0 ? kBatchesE[bi] / f[2] : 0,
           f[3] > 0 ? kBatchesE[bi] / f[3] : 0);
    if (f[2] > 0 && f[3] > 0) printf("; ratios %.2fx (1 vs 1), %.2fx (2 vs 2)", f[2] / f[0], f[3] / f[1]);
    printf("\n");
  }
  free(m);
  free(clean);
}

/* ---- (b) engine overhead ------------------------------------------------------------------------------------- */

enum { kBatchB = 30, kInB = 5, kOutB = 2, kBatchesB = 4 };

/* The same step by hand: logits = x W^T + b, softmax cross-entropy (mean), its gradient, SGD. The arithmetic any
 * implementation must do for this model, with no hand-off, no allocation and no BLAS call overhead. */
static float hand_step(float *w, float *bias, const float *x, const int32_t *y, float lr) {
  float gw[kOutB * kInB] = {0}, gb[kOutB] = {0};
  float loss = 0;
  for (int i = 0; i < kBatchB; ++i) {
    float z[kOutB], mx = -INFINITY;
    for (int o = 0; o < kOutB; ++o) {
      float s = bias[o];
      for (int k = 0; k < kInB; ++k) s += x[i * kInB + k] * w[o * kInB + k];
      z[o] = s;
      mx = z[o] > mx ? z[o] : mx;
    }
    float sum = 0;
    for (int o = 0; o < kOutB; ++o) sum += expf(z[o] - mx);
    loss += logf(sum) + mx - z[y[i]];
    for (int o = 0; o < kOutB; ++o) {
      float g = (expf(z[o] - mx) / sum - (o == y[i] ? 1.0f : 0.0f)) / kBatchB;
      gb[o] += g;
      for (int k = 0; k < kInB; ++k) gw[o * kInB + k] += g * x[i * kInB + k];
    }
  }
  for (int j = 0; j < kOutB * kInB; ++j) w[j] -= lr * gw[j];
  for (int o = 0; o < kOutB; ++o) bias[o] -= lr * gb[o];
  return loss / kBatchB;
}

static double time_hand_step(const float *xs, const int32_t *ys) {
  float w[kOutB * kInB], b[kOutB];
  for (int j = 0; j < kOutB * kInB; ++j) w[j] = uniform() - 0.5f;
  for (int o = 0; o < kOutB; ++o) b[o] = 0;
  volatile float sink = 0;
  enum { kReps = 1000, kRuns = 31 };
  double runs[kRuns];
  for (int run = 0; run < kRuns; ++run) {
    const double t0 = bench_now();
    for (int i = 0; i < kReps; ++i) sink += hand_step(w, b, xs + (size_t)(i % kBatchesB) * kBatchB * kInB,
                                                      ys + (size_t)(i % kBatchesB) * kBatchB, 0.01f);
    runs[run] = (bench_now() - t0) / kReps;
  }
  (void)sink;
  return bench_median(runs, kRuns);
}

/* The linear model 5->2 (bias) and kBatchesB random batches of kBatchB rows, filled into xs and ys on the host
 * and copied into tensors. */
static dpar_model *tiny_model_and_batches(dpar_tensor **x, dpar_tensor **y, float xs[kBatchesB * kBatchB * kInB],
                                          int32_t ys[kBatchesB * kBatchB]) {
  dpar_model *model = NULL;
  CHECK(dpar_model_create(&model, NULL));
  CHECK(dpar_model_add_linear(model, kInB, kOutB, 1));
  dpar_device cpu0 = {DPAR_DEVICE_CPU, 0};
  for (int i = 0; i < kBatchesB * kBatchB * kInB; ++i) xs[i] = 2 * uniform() - 1;
  for (int i = 0; i < kBatchesB * kBatchB; ++i) ys[i] = (int32_t)(next_u64() % kOutB);
  for (int b = 0; b < kBatchesB; ++b) {
    const int64_t xshape[2] = {kBatchB, kInB}, yshape[1] = {kBatchB};
    CHECK(dpar_tensor_create(&x[b], DPAR_F32, xshape, 2, cpu0));
    CHECK(dpar_tensor_create(&y[b], DPAR_I32, yshape, 1, cpu0));
    CHECK(dpar_tensor_copy_from_host(x[b], xs + b * kBatchB * kInB, sizeof(float) * kBatchB * kInB));
    CHECK(dpar_tensor_copy_from_host(y[b], ys + b * kBatchB, sizeof(int32_t) * kBatchB));
  }
  return model;
}

static void part_b(int rounds, double seconds) {
  printf("(b) engine overhead: linear 5->2 (bias), cross-entropy over 2 classes, SGD lr 0.01, batch %d, synthetic\n"
         "    data; median time of one dpar_engine_train_step (timed one by one) over %d interleaved rounds of\n"
         "    ~%.2f s per configuration (after 200 warm-up steps); engines on num_cpu_devices = 4\n",
         kBatchB, rounds, seconds);
  dpar_tensor *x[kBatchesB], *y[kBatchesB];
  float xs[kBatchesB * kBatchB * kInB];
  int32_t ys[kBatchesB * kBatchB];
  dpar_model *model = tiny_model_and_batches(x, y, xs, ys);
  dpar_optimizer_options oo = DPAR_OPTIMIZER_OPTIONS_INIT; /* SGD, lr 0.01 */

  enum { kN = 3 };
  const size_t devs[kN] = {4, 2, 1};
  dpar_engine *eng[kN];
  for (int c = 0; c < kN; ++c) eng[c] = make_engine(model, &oo, DPAR_LOSS_CROSS_ENTROPY, 4, devs[c], 1);
  vec all[kN] = {{0}};
  printf("\n    %-22s | %9s %9s %9s | %s\n", "round (placement)", "4 dev", "2 dev", "1 dev", "other processes");
  printf("    %-22s | %29s | (most in a block)\n", "", "us per step (block median)");
  for (int r = 0; r < rounds; ++r) {
    const double l = probe();
    double m[kN], others = 0;
    for (int k = 0; k < kN; ++k) {
      const int c = (k + r) % kN;
      bench_cpu_usage u0, u1;
      bench_cpu_usage_now(&u0);
      m[c] = time_steps(eng[c], x, y, kBatchesB, 200, 200, seconds, &all[c]);
      bench_cpu_usage_now(&u1);
      const double o = bench_others_share(&u0, &u1, g_ncpu);
      others = o > others ? o : others;
    }
    char label[64];
    snprintf(label, sizeof label, "%d (%.0f ns %s)", r, l, bench_placement_tag(l));
    printf("    %-22s | %9.2f %9.2f %9.2f | %4.0f%%%s\n", label, m[0] * 1e6, m[1] * 1e6, m[2] * 1e6, 100 * others,
           others < kDisturbed ? "" : "  disturbed");
  }
  const double l = probe();
  printf("    latency after the last round: %.0f ns (%s)\n\n", l, bench_placement_class(l));
  for (int c = 0; c < kN; ++c) dpar_engine_free(eng[c]);

  const double hand = time_hand_step(xs, ys);
  double med[kN];
  printf("    %-44s | %9s | %9s | %9s | %8s\n", "", "median us", "p10 us", "p90 us", "steps");
  for (int c = 0; c < kN; ++c) {
    double *t = (double *)xmalloc(all[c].n * sizeof(double));
    memcpy(t, all[c].v, all[c].n * sizeof(double));
    med[c] = bench_median(t, all[c].n);
    char name[64];
    snprintf(name, sizeof name, "dpar_engine_train_step, %zu device%s", devs[c], devs[c] > 1 ? "s" : "");
    printf("    %-44s | %9.2f | %9.2f | %9.2f | %8zu\n", name, med[c] * 1e6,
           bench_quantile_sorted(t, all[c].n, 0.1) * 1e6, bench_quantile_sorted(t, all[c].n, 0.9) * 1e6, all[c].n);
    free(t);
    free(all[c].v);
  }
  printf("    %-44s | %9.3f |\n", "hand-written C step, whole batch (compute)", hand * 1e6);
  printf("\n    engine overhead per step = step time - compute (the whole batch's compute, an upper bound of the\n"
         "    critical path's compute with several devices):\n");
  for (int c = 0; c < kN; ++c)
    printf("      %zu device%s: %7.2f us%s\n", devs[c], devs[c] > 1 ? "s" : " ", (med[c] - hand) * 1e6,
           devs[c] == 4 ? ((med[c] - hand) * 1e6 < 50.0 ? "   aim < 50 us: met" : "   aim < 50 us: NOT met") : "");

  for (int b = 0; b < kBatchesB; ++b) {
    dpar_tensor_free(x[b]);
    dpar_tensor_free(y[b]);
  }
  dpar_model_free(model);
}

/* The demo MLP's engine of parts (c) and (d): Adam lr 1e-3, cross-entropy, 2 devices with 1 BLAS thread each. */
static dpar_engine *demo_adam_engine(const dpar_model *model) {
  dpar_optimizer_options oo = DPAR_OPTIMIZER_OPTIONS_INIT;
  oo.kind = DPAR_ADAM;
  oo.lr = 1e-3f;
  return make_engine(model, &oo, DPAR_LOSS_CROSS_ENTROPY, 2, 2, 1);
}

/* ---- (c) gradient clipping ----------------------------------------------------------------------------------- */

enum { kClipConfigs = 3 };

static void part_c(int rounds, double seconds) {
  printf("(c) gradient clipping (dpar_engine_set_max_grad_norm): the demo MLP of (a), Adam, 2 devices, batch %d.\n"
         "    One engine; each round times a block of steps per setting (the order rotates): off; on with a norm far\n"
         "    above the gradient's (the norm is computed, nothing is scaled); on with a norm below it (each step\n"
         "    scales). The anchor is the step without clipping: the ratios are the feature's cost.\n",
         kBatchA);
  dpar_tensor *x[kBatchesA], *y[kBatchesA];
  dpar_model *model = demo_model_and_batches(x, y);
  dpar_engine *e = demo_adam_engine(model);
  static const char *const names[kClipConfigs] = {"off", "on, max_norm 1e6 (no scaling)",
                                                  "on, max_norm 1e-3 (scales)"};
  static const float max_norm[kClipConfigs] = {0.0f, 1e6f, 1e-3f};
  vec all[kClipConfigs] = {{0}};
  for (int r = 0; r < rounds; ++r) {
    for (int k = 0; k < kClipConfigs; ++k) {
      const int c = (k + r) % kClipConfigs;
      CHECK(dpar_engine_set_max_grad_norm(e, max_norm[c]));
      time_steps(e, x, y, kBatchesA, 5, 20, seconds, &all[c]);
    }
  }
  float norm = 0.0f;
  CHECK(dpar_engine_grad_norm(&norm, e));
  printf("\n    %-32s | %9s | %9s | %6s\n", "clipping", "median ms", "vs off", "steps");
  const double off = vec_median(&all[0]);
  for (int c = 0; c < kClipConfigs; ++c) {
    const double m = vec_median(&all[c]);
    printf("    %-32s | %9.3f | %8.3fx | %6zu\n", names[c], m * 1e3, m / off, all[c].n);
    free(all[c].v);
  }
  printf("    (the last clipped step's gradient norm: %.4g)\n", norm);
  dpar_engine_free(e);
  free_demo(model, x, y);
}

/* ---- (d) tracing --------------------------------------------------------------------------------------------- */

static void part_d(int rounds, double seconds) {
  printf("(d) recording a trace (dpar_engine_trace_start): 2 devices; the demo MLP of (a) (Adam, batch %d) and the\n"
         "    5->2 linear model of (b) (SGD, batch %d), whose step is mostly the engine's own work. One engine\n"
         "    each; each round times a block with the trace off and one with it on (restarted, so that it never\n"
         "    reaches its cap; the order rotates). The anchor is the step without the trace.\n",
         kBatchA, kBatchB);
  dpar_tensor *xa[kBatchesA], *ya[kBatchesA];
  dpar_model *demo = demo_model_and_batches(xa, ya);
  dpar_engine *demo_engine = demo_adam_engine(demo);
  dpar_tensor *xb[kBatchesB], *yb[kBatchesB];
  float xs[kBatchesB * kBatchB * kInB];
  int32_t ys[kBatchesB * kBatchB];
  dpar_model *tiny = tiny_model_and_batches(xb, yb, xs, ys);
  dpar_optimizer_options sgd = DPAR_OPTIMIZER_OPTIONS_INIT;
  dpar_engine *tiny_engine = make_engine(tiny, &sgd, DPAR_LOSS_CROSS_ENTROPY, 2, 2, 1);
  /* A block of the tiny model records 23 spans per step: 0.1 s of steps stays under the trace's 2^20 spans. */
  const double tiny_seconds = seconds < 0.1 ? seconds : 0.1;
  vec all[2][2] = {{{0}}};
  for (int r = 0; r < rounds; ++r) {
    for (int k = 0; k < 2; ++k) {
      const int on = (k + r) % 2;
      if (on) {
        CHECK(dpar_engine_trace_start(demo_engine));
        CHECK(dpar_engine_trace_start(tiny_engine));
      }
      time_steps(demo_engine, xa, ya, kBatchesA, 5, 20, seconds, &all[0][on]);
      time_steps(tiny_engine, xb, yb, kBatchesB, 200, 200, tiny_seconds, &all[1][on]);
      if (on) {
        CHECK(dpar_engine_trace_stop(demo_engine, NULL));
        CHECK(dpar_engine_trace_stop(tiny_engine, NULL));
      }
    }
  }
  static const char *const models[2] = {"demo MLP, batch 256", "linear 5->2, batch 30"};
  printf("\n    %-24s | %12s | %12s | %8s | %s\n", "model", "off (median)", "on (median)", "on / off", "steps");
  for (int m = 0; m < 2; ++m) {
    const double off = vec_median(&all[m][0]), on = vec_median(&all[m][1]);
    const int us = m == 1;
    printf("    %-24s | %9.3f %s | %9.3f %s | %7.3fx | %zu, %zu\n", models[m], off * (us ? 1e6 : 1e3), us ? "us" : "ms",
           on * (us ? 1e6 : 1e3), us ? "us" : "ms", on / off, all[m][0].n, all[m][1].n);
    free(all[m][0].v);
    free(all[m][1].v);
  }
  dpar_engine_free(demo_engine);
  dpar_engine_free(tiny_engine);
  free_demo(demo, xa, ya);
  for (int b = 0; b < kBatchesB; ++b) {
    dpar_tensor_free(xb[b]);
    dpar_tensor_free(yb[b]);
  }
  dpar_model_free(tiny);
}

/* ---- main ------------------------------------------------------------------------------------------------------ */

static void usage(const char *argv0) {
  fprintf(stderr,
          "usage: %s [--rounds R] [--seconds S] [--pin] [--only a|b|c|d|e] [--torch PYTHON]\n"
          "  --rounds R   interleaved rounds (default 12; at most 64)\n"
          "  --seconds S  timed seconds per configuration per round (default 0.3)\n"
          "  --pin        pin replica r's worker to CPU r mod ncpu (from the forward hook), as an experiment\n"
          "  --only a|b|c|d|e run one part (e, against PyTorch on the CPU, runs only when named or with --torch)\n"
          "  --torch PYTHON  a Python with torch for part (e) (default python3)\n",
          argv0);
  exit(2);
}

int main(int argc, char **argv) {
  int rounds = 12;
  double seconds = 0.3;
  int run_a = 1, run_b = 1, run_c = 1, run_d = 1, run_e = 0;
  const char *python = "python3";
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--rounds") && i + 1 < argc)
      rounds = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--seconds") && i + 1 < argc)
      seconds = atof(argv[++i]);
    else if (!strcmp(argv[i], "--pin"))
      g_pin = 1;
    else if (!strcmp(argv[i], "--only") && i + 1 < argc) {
      ++i;
      run_a = !strcmp(argv[i], "a");
      run_b = !strcmp(argv[i], "b");
      run_c = !strcmp(argv[i], "c");
      run_d = !strcmp(argv[i], "d");
      run_e = !strcmp(argv[i], "e");
    } else if (!strcmp(argv[i], "--torch") && i + 1 < argc) {
      python = argv[++i];
      run_e = 1;
    } else
      usage(argv[0]);
  }
  if (rounds < 1 || rounds > 64 || !(seconds > 0)) usage(argv[0]);
  setvbuf(stdout, NULL, _IOLBF, 0);
  g_ncpu = bench_allowed_cpus(g_cpus, 1024);

  printf("bench_train: dpar %s through its C ABI; training throughput and the engine's overhead per step\n",
         dpar_version_string());
  printf("CPU GEMM: %s\n", dpar_cpu_gemm_backend());
  bench_cpu_usage u0, u1;
  bench_cpu_usage_now(&u0);
  bench_print_machine(stdout);
  printf("workers: %s; placement = one-way latency CPU %d <-> CPU %d (~15 ns SMT siblings, 35-45 ns shared L3,\n"
         "180-230 ns far; compare configurations only at equal placement)\n\n",
         g_pin ? "pinned, replica r on CPU r mod ncpu (--pin)" : "not pinned (the engine's default)", g_cpus[0],
         g_ncpu > 1 ? g_cpus[1] : g_cpus[0]);
  if (run_a) part_a(rounds, seconds);
  if (run_a && run_b) printf("\n");
  if (run_b) part_b(rounds, seconds);
  if ((run_a || run_b) && run_c) printf("\n");
  if (run_c) part_c(rounds, seconds);
  if ((run_a || run_b || run_c) && run_d) printf("\n");
  if (run_d) part_d(rounds, seconds);
  if ((run_a || run_b || run_c || run_d) && run_e) printf("\n");
  if (run_e) part_e(rounds, seconds, python);
  bench_cpu_usage_now(&u1);
  printf("\n");
  bench_print_cpu_usage(stdout, &u0, &u1, g_ncpu);
  return 0;
}
