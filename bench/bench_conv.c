/* Convolution layers on the CPU: dpar's training step of one Conv2d (oneDNN primitives cached per shape) against
 * PyTorch's, through the C ABI only.
 *
 *   bench_conv [--seconds S] [--torch PYTHON]
 *
 * For each configuration a model of one conv2d layer, MSE against a fixed target, SGD lr 0.01, on 1 CPU device
 * with 1 GEMM thread: dpar_engine_train_step's median time over S seconds (after 5 warm-up steps). The step holds
 * the convolution's forward, its backward (input gradient excluded: dpar's first layer needs none, so the anchor's
 * figure, which includes it, is an upper bound of PyTorch's), the loss and the optimizer. With --torch, PyTorch's
 * same step at 1 thread (bench/conv_anchor.py) beside it, and the ratio. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_check.h"
#include "bench_util.h"
#include "dpar.h"

#ifndef BENCH_CONV_ANCHOR
#define BENCH_CONV_ANCHOR "bench/conv_anchor.py"
#endif

typedef struct {
  const char *name;
  int64_t batch, c_in, c_out, hw, kernel, stride, padding, groups;
} config;

/* bench/conv_anchor.py's CONFIGS, in the same order. */
static const config kConfigs[] = {
    {"3x3_32to64_16px", 32, 32, 64, 16, 3, 1, 1, 1},
    {"3x3_s2_64to128_16px", 32, 64, 128, 16, 3, 2, 1, 1},
    {"1x1_64to64_16px", 32, 64, 64, 16, 1, 1, 0, 1},
    {"depthwise3x3_64_16px", 32, 64, 64, 16, 3, 1, 1, 64},
};
enum { kNumConfigs = sizeof kConfigs / sizeof kConfigs[0] };

static dpar_tensor *uniform_tensor(const int64_t *shape, uint64_t seed) {
  int64_t n = shape[0] * shape[1] * shape[2] * shape[3];
  float *v = (float *)malloc(sizeof(float) * (size_t)n);
  for (int64_t i = 0; i < n; ++i) v[i] = bench_uniform(&seed);
  dpar_tensor *t = NULL;
  CHECK(dpar_tensor_create(&t, DPAR_F32, shape, 4, (dpar_device){DPAR_DEVICE_CPU, 0}));
  CHECK(dpar_tensor_copy_from_host(t, v, sizeof(float) * (size_t)n));
  free(v);
  return t;
}

static double time_dpar(const config *c, double seconds) {
  dpar_model *m = NULL;
  CHECK(dpar_model_create(&m, NULL));
  const int64_t k[2] = {c->kernel, c->kernel}, s[2] = {c->stride, c->stride}, p[2] = {c->padding, c->padding};
  CHECK(dpar_model_add_conv2d(m, c->c_in, c->c_out, k, s, p, NULL, c->groups, 1));
  const int64_t out_hw = (c->hw + 2 * c->padding - c->kernel) / c->stride + 1;
  const int64_t xs[4] = {c->batch, c->c_in, c->hw, c->hw}, ys[4] = {c->batch, c->c_out, out_hw, out_hw};
  dpar_tensor *x = uniform_tensor(xs, 1), *y = uniform_tensor(ys, 2);
  dpar_optimizer_options oo = DPAR_OPTIMIZER_OPTIONS_INIT;
  oo.lr = 0.01f;
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = 1;
  eo.loss = DPAR_LOSS_MSE;
  eo.blas_threads = 1;
  dpar_engine *e = NULL;
  CHECK(dpar_engine_create(&e, m, &oo, &eo));
  double *times = (double *)malloc(sizeof(double) * 100000);
  size_t n = 0;
  const double start = bench_now();
  for (int i = 0; n < 100000; ++i) {
    const double t0 = bench_now();
    CHECK(dpar_engine_train_step(NULL, e, x, y));
    const double t1 = bench_now();
    if (i >= 5) {
      times[n++] = t1 - t0;
      if (t1 - start > seconds && n >= 10) break;
    }
  }
  const double median = bench_median(times, n);
  free(times);
  dpar_engine_free(e);
  dpar_tensor_free(x);
  dpar_tensor_free(y);
  dpar_model_free(m);
  return median;
}

/* PyTorch's medians in seconds, by configuration; returns how many it gave. */
static int run_torch(const char *python, double seconds, double *ms, char *version, size_t cap) {
  char cmd[2048];
  snprintf(cmd, sizeof cmd, "'%s' '%s' --threads 1 --seconds %g 2>&1", python, BENCH_CONV_ANCHOR, seconds);
  FILE *f = popen(cmd, "r");
  if (!f) return 0;
  char line[1024], name[256];
  int got = 0;
  while (fgets(line, sizeof line, f)) {
    double v = 0;
    if (sscanf(line, "conv_anchor name=%255s median_ms=%lf", name, &v) == 2) {
      for (int i = 0; i < kNumConfigs; ++i)
        if (!strcmp(name, kConfigs[i].name)) ms[i] = v * 1e-3, ++got;
    } else if (!strncmp(line, "conv_anchor ", 12)) {
      line[strcspn(line, "\n")] = 0;
      snprintf(version, cap, "%s", line + 12);
    }
  }
  pclose(f);
  return got;
}

int main(int argc, char **argv) {
  double seconds = 1.0;
  const char *python = NULL;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--seconds") && i + 1 < argc) {
      seconds = atof(argv[++i]);
    } else if (!strcmp(argv[i], "--torch") && i + 1 < argc) {
      python = argv[++i];
    } else {
      fprintf(stderr, "usage: %s [--seconds S] [--torch PYTHON]\n", argv[0]);
      return 2;
    }
  }
  bench_print_machine(stdout);
  printf("CPU GEMM: %s\n", dpar_cpu_gemm_backend());
  printf("one conv2d layer, MSE, SGD; 1 CPU device, 1 thread; median step over %.2f s\n", seconds);
  double torch_s[kNumConfigs] = {0};
  char version[1024] = "";
  const int have_torch = python && run_torch(python, seconds, torch_s, version, sizeof version) == kNumConfigs;
  if (python && !have_torch) printf("PyTorch gave no figures (%s)\n", version[0] ? version : "no output");
  if (have_torch) printf("PyTorch: %s\n", version);
  printf("%-24s %12s %12s %8s\n", "configuration", "dpar ms", "torch ms", "ratio");
  for (int i = 0; i < kNumConfigs; ++i) {
    const double d = time_dpar(&kConfigs[i], seconds);
    if (have_torch)
      printf("%-24s %12.3f %12.3f %7.2fx\n", kConfigs[i].name, d * 1e3, torch_s[i] * 1e3, torch_s[i] / d);
    else
      printf("%-24s %12.3f %12s %8s\n", kConfigs[i].name, d * 1e3, "-", "-");
  }
  printf("ratio: PyTorch's time over dpar's (above 1: dpar is faster)\n");
  return 0;
}
