/* bench_cnn: the Fashion-MNIST CNN's training throughput on 1 and 2 CPU devices (or on one GPU) beside PyTorch's
 * on the same machine, in the same run; or an MLP's (--model mlp: 784-256-128-10, the demo's; --model wide:
 * 784-1024-1024-1024-10, GEMM-bound), in f32 or under the bf16 precision policy (--precision bf16: dpar's
 * dpar_engine_set_precision beside PyTorch's torch.autocast(dtype=torch.bfloat16)).
 *
 *   bench_cnn [--device cpu|cuda] [--model cnn|mlp|wide] [--precision f32|bf16] [--rounds R] [--seconds S]
 *             [--batch B] [--torch PYTHON] [--reproducible ROWS]
 *
 * The model is examples/c/fashion_cnn.h's (convolutions, BatchNorm, max pooling, one residual block, 32 channels),
 * with Adam lr 1e-3 and softmax cross-entropy, on synthetic data (uniform pixels, random labels; 4 batches, cycled).
 * Each round times dpar on 1 and then 2 CPU devices (fresh engines, 1 GEMM thread per worker, 3 warm-up steps,
 * then at least 10 steps and S seconds), then runs `PYTHON bench/torch_anchor.py --cpu-model cnn --cpu-threads 1,2`
 * (the same module, BatchNorm in training mode, Adam fused) in a process of its own. Figures are medians over rounds
 * of each block's median step; the ratios are dpar's samples/s over PyTorch's at equal cores (1 device : 1 thread,
 * 2 devices : 2 threads). The aim: dpar on 2 devices ahead of PyTorch on 2 threads. Under the table, what each
 * replica's device held after the last round's timed steps and its peak during them (dpar_engine_memory_stats), so
 * that --precision f32 and bf16 runs show what the policy keeps. Never a test.
 *
 * --device cuda times dpar with one replica on cuda:0 (cuDNN's convolutions and pooling, dpar's BatchNorm kernels)
 * beside PyTorch's eager step on the same GPU (`--anchor-device cuda`: cuDNN in FP32 with its autotuner on, a
 * synchronisation after each step, as dpar's step returns once the GPU is done). */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_check.h"
#include "bench_memory.h"
#include "bench_util.h"
#include "dpar.h"
#include "fashion_cnn.h"

#ifndef BENCH_TORCH_ANCHOR
#define BENCH_TORCH_ANCHOR "bench/torch_anchor.py"
#endif

enum { kData = 4, kMaxRounds = 64 };

/* The median step time in seconds of `devices` CPU devices (or, with cuda, one replica on cuda:0) over at least 10
 * steps and `seconds`; what the replicas held into `memory`. */
/* --reproducible ROWS: dpar's engines run in the reproducible mode with micro-chunks of ROWS rows (0: the default
 * mode); PyTorch's step is the same either way, so two invocations give the mode's cost beside the default. */
static int64_t reproducible_rows = 0;

static double time_dpar(const dpar_model *model, int cuda, size_t devices, dpar_tensor **x, dpar_tensor **y,
                        double seconds, int bf16, bench_memory *memory) {
  dpar_optimizer_options oo = DPAR_OPTIMIZER_OPTIONS_INIT;
  oo.kind = DPAR_ADAM;
  oo.lr = 1e-3f;
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  static const int32_t gpu0[1] = {0};
  if (cuda) {
    eo.device_kind = DPAR_DEVICE_CUDA;
    eo.device_ids = gpu0;
    eo.num_device_ids = 1;
  } else {
    eo.num_cpu_devices = devices;
    eo.blas_threads = 1;
  }
  dpar_engine *e = NULL;
  CHECK(dpar_engine_create(&e, model, &oo, &eo));
  if (bf16) CHECK(dpar_engine_set_precision(e, DPAR_BF16));
  if (reproducible_rows > 0) CHECK(dpar_engine_set_reproducible(e, reproducible_rows));
  float loss = 0.0f;
  for (int i = 0; i < 3; ++i) CHECK(dpar_engine_train_step(&loss, e, x[i % kData], y[i % kData]));
  bench_memory_reset(e);
  double times[4096];
  size_t n = 0;
  const double start = bench_now();
  for (;;) {
    const double t0 = bench_now();
    CHECK(dpar_engine_train_step(&loss, e, x[n % kData], y[n % kData]));
    const double t1 = bench_now();
    times[n++] = t1 - t0;
    if ((n >= 10 && t1 - start >= seconds) || n == sizeof times / sizeof *times) break;
  }
  bench_memory_read(memory, e);
  dpar_engine_free(e);
  return bench_median(times, n);
}

/* PyTorch's median step at 1 and 2 threads (ms[0], ms[1], in seconds; 0 where it gave none); with cuda, on cuda:0
 * (ms[0] only). */
static int time_torch(const char *python, const char *model, int cuda, int batch, double seconds, int bf16,
                      double ms[2], char *version, size_t cap) {
  char cmd[2048];
  snprintf(cmd, sizeof cmd,
           "'%s' '%s' --cpu-model %s --cpu-threads %s --anchor-device %s --batches %d --seconds %g --precision %s 2>&1",
           python, BENCH_TORCH_ANCHOR, strcmp(model, "mlp") ? model : "demo", cuda ? "1" : "1,2",
           cuda ? "cuda" : "cpu", batch, seconds, bf16 ? "bf16" : "f32");
  ms[0] = ms[1] = 0;
  bench_torch_figure figs[4];
  const int n = bench_run_torch_anchor(cmd, figs, 4, version, cap);
  int got = 0;
  for (int f = 0; f < n; ++f)
    if (figs[f].threads >= 1 && figs[f].threads <= 2) ms[figs[f].threads - 1] = figs[f].median_s, ++got;
  return got;
}

int main(int argc, char **argv) {
  int rounds = 5, batch = 128, cuda = 0, bf16 = 0;
  double seconds = 2.0;
  const char *python = "python3", *model_kind = "cnn";
  for (int i = 1; i < argc; ++i) {
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(argv[i], "--rounds") && v) rounds = atoi(v), ++i;
    else if (!strcmp(argv[i], "--seconds") && v) seconds = atof(v), ++i;
    else if (!strcmp(argv[i], "--batch") && v) batch = atoi(v), ++i;
    else if (!strcmp(argv[i], "--torch") && v) python = v, ++i;
    else if (!strcmp(argv[i], "--device") && v && (!strcmp(v, "cpu") || !strcmp(v, "cuda")))
      cuda = !strcmp(v, "cuda"), ++i;
    else if (!strcmp(argv[i], "--model") && v && (!strcmp(v, "cnn") || !strcmp(v, "mlp") || !strcmp(v, "wide")))
      model_kind = v, ++i;
    else if (!strcmp(argv[i], "--reproducible") && v && atoll(v) > 0) reproducible_rows = atoll(v), ++i;
    else if (!strcmp(argv[i], "--precision") && v && (!strcmp(v, "f32") || !strcmp(v, "bf16")))
      bf16 = !strcmp(v, "bf16"), ++i;
    else {
      printf("usage: %s [--device cpu|cuda] [--model cnn|mlp|wide] [--precision f32|bf16] [--rounds R] [--seconds S]\n"
             "          [--batch B] [--torch PYTHON] [--reproducible ROWS]\n", argv[0]);
      return strcmp(argv[i], "--help") ? 2 : 0;
    }
  }
  if (rounds < 1 || rounds > kMaxRounds || batch < 1) {
    fprintf(stderr, "%s: --rounds must be 1 to %d and --batch positive\n", argv[0], kMaxRounds);
    return 2;
  }
  printf("bench_cnn: dpar %s through its C ABI; the Fashion-MNIST CNN (examples/c/fashion_cnn.h) beside PyTorch\n",
         dpar_version_string());
  bench_print_machine(stdout);
  if (reproducible_rows > 0)
    printf("dpar in the reproducible mode (dpar_engine_set_reproducible): micro-chunks of %lld rows\n",
           (long long)reproducible_rows);
  printf("CPU GEMM: %s\n", dpar_cpu_gemm_backend());
  const int cnn = !strcmp(model_kind, "cnn");
  printf("model: %s; Adam lr 1e-3,\n"
         "softmax cross-entropy, batch %d, synthetic data; %d rounds of %s, then PyTorch %s (%s %s),\n"
         "~%.1f s of timed steps each; precision %s\n\n",
         cnn ? "conv 1->32 + BN + ReLU + maxpool, a basic block of 32 channels, maxpool, fc 1568->10"
             : strcmp(model_kind, "wide") ? "MLP 784-256-128-10 (ReLU)" : "MLP 784-1024-1024-1024-10 (ReLU)",
         batch, rounds, cuda ? "dpar on cuda:0 (one replica)" : "dpar 1 and 2 CPU devices (1 GEMM thread each)",
         cuda ? "on cuda:0" : "at 1 and 2 threads", python, BENCH_TORCH_ANCHOR, seconds,
         bf16 ? "bf16 (dpar_engine_set_precision; PyTorch's forward under torch.autocast(dtype=torch.bfloat16))"
              : "f32");
  const dpar_device where = {cuda ? DPAR_DEVICE_CUDA : DPAR_DEVICE_CPU, 0};

  dpar_model *model = NULL;
  CHECK(dpar_model_create(&model, NULL));
  if (cnn) {
    CHECK(fashion_cnn_add(model, 10));
  } else {
    const int64_t demo[] = {784, 256, 128, 10}, wide[] = {784, 1024, 1024, 1024, 10};
    const int64_t *sizes = strcmp(model_kind, "wide") ? demo : wide;
    const int layers = strcmp(model_kind, "wide") ? 3 : 4;
    for (int l = 0; l < layers; ++l) {
      CHECK(dpar_model_add_linear(model, sizes[l], sizes[l + 1], 1));
      if (l + 1 < layers) CHECK(dpar_model_add_activation(model, DPAR_RELU));
    }
  }
  dpar_tensor *x[kData], *y[kData];
  uint64_t rng = 42;
  const int64_t xs[2] = {batch, 784}, ys[1] = {batch};
  float *xv = malloc(sizeof(float) * (size_t)batch * 784);
  int32_t *yv = malloc(sizeof(int32_t) * (size_t)batch);
  if (!xv || !yv) return 1;
  for (int d = 0; d < kData; ++d) {
    for (int i = 0; i < batch * 784; ++i) xv[i] = bench_uniform(&rng);
    for (int i = 0; i < batch; ++i) yv[i] = (int32_t)(bench_next_u64(&rng) % 10);
    CHECK(dpar_tensor_create(&x[d], DPAR_F32, xs, 2, where));
    CHECK(dpar_tensor_create(&y[d], DPAR_I32, ys, 1, where));
    CHECK(dpar_tensor_copy_from_host(x[d], xv, sizeof(float) * (size_t)batch * 784));
    CHECK(dpar_tensor_copy_from_host(y[d], yv, sizeof(int32_t) * (size_t)batch));
  }
  free(xv);
  free(yv);
  const double batch_bytes = (double)kData * (double)batch * (784.0 * 4.0 + 4.0);

  double m[kMaxRounds][4]; /* dpar 1, dpar 2, torch 1, torch 2: seconds per step */
  char version[1024] = "";
  int have_torch = 1;
  bench_memory memory[2] = {{0}, {0}}; /* dpar 1 and 2 devices (or cuda:0), the last round's */
  for (int r = 0; r < rounds; ++r) {
    m[r][0] = time_dpar(model, cuda, 1, x, y, seconds, bf16, &memory[0]);
    m[r][1] = cuda ? 0 : time_dpar(model, 0, 2, x, y, seconds, bf16, &memory[1]);
    double t[2] = {0, 0};
    if (have_torch && time_torch(python, model_kind, cuda, batch, seconds, bf16, t, version, sizeof version) < (cuda ? 1 : 2)) {
      printf("    PyTorch did not run (%s): its columns stay empty; give a Python with torch: --torch PYTHON\n",
             version[0] ? version : "no figures from torch_anchor.py");
      have_torch = 0;
    }
    m[r][2] = t[0];
    m[r][3] = t[1];
    if (cuda)
      printf("    round %d: dpar %6.0f  PyTorch %6.0f samples/s (cuda:0)\n", r, batch / m[r][0],
             t[0] > 0 ? batch / t[0] : 0);
    else
      printf("    round %d: dpar %6.0f %6.0f  PyTorch %6.0f %6.0f samples/s (1 and 2 devices / threads)\n", r,
             batch / m[r][0], batch / m[r][1], t[0] > 0 ? batch / t[0] : 0, t[1] > 0 ? batch / t[1] : 0);
    fflush(stdout);
  }
  if (version[0]) printf("    PyTorch: %s\n", version);
  double med[4];
  for (int c = 0; c < 4; ++c) {
    double v[kMaxRounds];
    for (int r = 0; r < rounds; ++r) v[r] = m[r][c];
    med[c] = bench_median(v, (size_t)rounds);
  }
  if (cuda) {
    printf("\n    %-20s | %10s | %10s | %s\n", "configuration", "median ms", "samples/s", "dpar / PyTorch (samples/s)");
    printf("    %-20s | %10.3f | %10.0f | %.2fx PyTorch\n", "dpar, cuda:0", med[0] * 1e3, batch / med[0],
           med[2] > 0 ? med[2] / med[0] : 0);
    printf("    %-20s | %10.3f | %10.0f |\n", "PyTorch, cuda:0", med[2] * 1e3, med[2] > 0 ? batch / med[2] : 0);
    printf("\n");
    bench_memory_print("dpar, cuda:0", &memory[0]);
    printf("    (%s; cuda:0 also holds the %d input and %d target batches: %.3f MiB)\n", bf16 ? "bf16" : "f32",
           kData, kData, batch_bytes / 1048576.0);
    for (int d = 0; d < kData; ++d) dpar_tensor_free(x[d]), dpar_tensor_free(y[d]);
    dpar_model_free(model);
    return 0;
  }
  static const char *names[4] = {"dpar, 1 device", "dpar, 2 devices", "PyTorch, 1 thread", "PyTorch, 2 threads"};
  printf("\n    %-20s | %10s | %10s | %s\n", "configuration", "median ms", "samples/s", "dpar / PyTorch (samples/s)");
  for (int c = 0; c < 4; ++c) {
    printf("    %-20s | %10.2f | %10.0f |", names[c], med[c] * 1e3, med[c] > 0 ? batch / med[c] : 0);
    if (c < 2 && med[2 + c] > 0) printf(" %.2fx PyTorch at %d thread%s", med[2 + c] / med[c], c + 1, c ? "s" : "");
    printf("\n");
  }
  if (med[2] > 0) printf("    dpar 2 devices over dpar 1: %.2fx; PyTorch 2 threads over 1: %.2fx\n", med[0] / med[1],
                         med[2] / med[3]);
  printf("\n");
  for (int c = 0; c < 2; ++c) bench_memory_print(names[c], &memory[c]);
  printf("    (%s; replica 0's device, cpu:0, also holds the %d input and %d target batches: %.3f MiB)\n",
         bf16 ? "bf16" : "f32", kData, kData, batch_bytes / 1048576.0);
  for (int d = 0; d < kData; ++d) dpar_tensor_free(x[d]), dpar_tensor_free(y[d]);
  dpar_model_free(model);
  return 0;
}
