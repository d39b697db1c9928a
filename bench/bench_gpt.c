/* bench_gpt: the character-level GPT's training throughput (tokens/s) on 1 and 2 CPU devices beside PyTorch's on the
 * same machine, in the same run.
 *
 *   bench_gpt [--rounds R] [--seconds S] [--batch B] [--block T] [--layers L] [--heads H] [--embd C] [--vocab V]
 *             [--torch PYTHON] [--precision f32|bf16] [--reproducible ROWS]
 *
 * The model is examples/c/char_gpt.h's (nanoGPT's GPT: 4 layers, 4 heads, 128 channels, context 128 by default,
 * lm_head tied to wte), with AdamW (lr 1e-3, betas 0.9/0.99, weight decay 0.1 on the matrices), gradients clipped to
 * norm 1 and the cross-entropy over (B, T, V) logits, on random tokens (4 batches, cycled): train_char_gpt's step.
 * Each round times dpar on 1 and then 2 CPU devices (fresh engines, 1 GEMM thread per worker, 3 warm-up steps, then
 * at least 5 steps and S seconds), then runs `PYTHON bench/gpt_anchor.py --threads 1,2` (the same module in PyTorch,
 * its SDPA, AdamW foreach, clip_grad_norm_) in a process of its own. Figures are medians over rounds of each block's
 * median step; the ratios are dpar's tokens/s over PyTorch's at equal cores (1 device : 1 thread, 2 devices : 2
 * threads). The aim: dpar on 2 devices ahead of PyTorch on 2 threads. Under the table, what each replica's device
 * held after the last round's timed steps and its peak during them (dpar_engine_memory_stats), so that --precision
 * f32 and bf16 runs show what the policy keeps. Never a test. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_check.h"
#include "bench_memory.h"
#include "bench_util.h"
#include "char_gpt.h"
#include "dpar.h"

#ifndef BENCH_GPT_ANCHOR
#define BENCH_GPT_ANCHOR "bench/gpt_anchor.py"
#endif

enum { kData = 4, kMaxRounds = 64 };

/* The median step time in seconds of `devices` CPU devices over at least 5 steps and `seconds`; what the replicas
 * held into `memory`. */
/* --reproducible ROWS: dpar's engines run in the reproducible mode with micro-chunks of ROWS rows (0: the default
 * mode); PyTorch's step is the same either way, so two invocations give the mode's cost beside the default. */
static int64_t reproducible_rows = 0;

static double time_dpar(const dpar_model *model, size_t devices, dpar_tensor **x, dpar_tensor **y, double seconds,
                        int bf16, bench_memory *memory) {
  dpar_optimizer_options oo = DPAR_OPTIMIZER_OPTIONS_INIT;
  oo.kind = DPAR_ADAMW;
  oo.lr = 1e-3f;
  oo.beta2 = 0.99f;
  oo.weight_decay = 0.1f;
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = devices;
  eo.blas_threads = 1;
  dpar_engine *e = NULL;
  CHECK(dpar_engine_create(&e, model, &oo, &eo));
  CHECK(dpar_engine_set_weight_decay_exclusion(e, 1));
  CHECK(dpar_engine_set_max_grad_norm(e, 1.0f));
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
    if ((n >= 5 && t1 - start >= seconds) || n == sizeof times / sizeof *times) break;
  }
  bench_memory_read(memory, e);
  dpar_engine_free(e);
  return bench_median(times, n);
}

/* PyTorch's median step at 1 and 2 threads (s[0], s[1], in seconds; 0 where it gave none). gpt_anchor.py prints one
 * JSON line per thread count. */
static int time_torch(const char *python, const gpt_config *c, int batch, double seconds, int bf16, double s[2],
                      char *version, size_t cap) {
  char cmd[2048];
  snprintf(cmd, sizeof cmd,
           "'%s' '%s' --threads 1,2 --batch %d --block %lld --layers %lld --heads %lld --embd %lld --vocab %lld "
           "--seconds %g --precision %s 2>&1",
           python, BENCH_GPT_ANCHOR, batch, (long long)c->block, (long long)c->layers, (long long)c->heads,
           (long long)c->embd, (long long)c->vocab, seconds, bf16 ? "bf16" : "f32");
  s[0] = s[1] = 0;
  FILE *p = popen(cmd, "r");
  if (!p) return 0;
  char line[4096];
  int got = 0;
  while (fgets(line, sizeof line, p)) {
    const char *t = strstr(line, "\"threads\": "), *m = strstr(line, "\"median_step_s\": ");
    const char *v = strstr(line, "\"torch\": \"");
    if (!t || !m) {
      if (strstr(line, "skipped")) snprintf(version, cap, "%.200s", line);
      continue;
    }
    const int threads = atoi(t + 11);
    if (threads >= 1 && threads <= 2) s[threads - 1] = atof(m + 17), ++got;
    if (v) {
      v += 10;
      const char *end = strchr(v, '"');
      snprintf(version, cap, "torch %.*s", end ? (int)(end - v) : 0, v);
    }
  }
  pclose(p);
  return got;
}

int main(int argc, char **argv) {
  int rounds = 3, batch = 32, bf16 = 0;
  double seconds = 10.0;
  gpt_config cfg = {178, 128, 4, 4, 128, 0.0f};
  const char *python = "python3";
  for (int i = 1; i < argc; ++i) {
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(argv[i], "--rounds") && v) rounds = atoi(v), ++i;
    else if (!strcmp(argv[i], "--seconds") && v) seconds = atof(v), ++i;
    else if (!strcmp(argv[i], "--batch") && v) batch = atoi(v), ++i;
    else if (!strcmp(argv[i], "--block") && v) cfg.block = atoll(v), ++i;
    else if (!strcmp(argv[i], "--layers") && v) cfg.layers = atoll(v), ++i;
    else if (!strcmp(argv[i], "--heads") && v) cfg.heads = atoll(v), ++i;
    else if (!strcmp(argv[i], "--embd") && v) cfg.embd = atoll(v), ++i;
    else if (!strcmp(argv[i], "--vocab") && v) cfg.vocab = atoll(v), ++i;
    else if (!strcmp(argv[i], "--torch") && v) python = v, ++i;
    else if (!strcmp(argv[i], "--reproducible") && v && atoll(v) > 0) reproducible_rows = atoll(v), ++i;
    else if (!strcmp(argv[i], "--precision") && v && (!strcmp(v, "f32") || !strcmp(v, "bf16")))
      bf16 = !strcmp(v, "bf16"), ++i;
    else {
      printf("usage: %s [--rounds R] [--seconds S] [--batch B] [--block T] [--layers L] [--heads H] [--embd C]\n"
             "          [--vocab V] [--torch PYTHON] [--precision f32|bf16] [--reproducible ROWS]\n", argv[0]);
      return strcmp(argv[i], "--help") ? 2 : 0;
    }
  }
  if (rounds < 1 || rounds > kMaxRounds || batch < 2 || cfg.block < 1 || cfg.vocab < 2) {
    fprintf(stderr, "%s: --rounds must be 1 to %d, --batch at least 2, --block positive, --vocab at least 2\n",
            argv[0], kMaxRounds);
    return 2;
  }
  const double tokens = (double)batch * (double)cfg.block;
  printf("bench_gpt: dpar %s through its C ABI; nanoGPT's GPT (examples/c/char_gpt.h) beside PyTorch\n",
         dpar_version_string());
  bench_print_machine(stdout);
  if (reproducible_rows > 0)
    printf("dpar in the reproducible mode (dpar_engine_set_reproducible): micro-chunks of %lld rows\n",
           (long long)reproducible_rows);
  printf("CPU GEMM: %s; attention: dpar's fused CPU kernel (its tiles through the same sgemm)\n",
         dpar_cpu_gemm_backend());
  if (bf16)
    printf("precision bf16: dpar's linear layers on bf16 operands through oneDNN's bf16 matmul (f32 accumulation), the\n"
           "rest f32; PyTorch's forward under torch.autocast(\"cpu\", dtype=torch.bfloat16)\n");
  printf("model: %lld layers, %lld heads, %lld channels, context %lld, vocabulary %lld, lm_head tied; AdamW lr 1e-3,\n"
         "clip 1.0, cross-entropy over (B, T, V); batch %d x %lld tokens, random tokens; %d rounds of dpar 1 and 2\n"
         "CPU devices (1 GEMM thread each), then PyTorch (%s %s) at 1 and 2 threads, ~%.0f s of timed steps each\n\n",
         (long long)cfg.layers, (long long)cfg.heads, (long long)cfg.embd, (long long)cfg.block, (long long)cfg.vocab,
         batch, (long long)cfg.block, rounds, python, BENCH_GPT_ANCHOR, seconds);

  dpar_model *model = gpt_build(&cfg, 0);
  gpt_init_like_nanogpt(model, &cfg, 0);
  dpar_tensor *x[kData], *y[kData];
  uint64_t rng = 42;
  const int64_t shape[2] = {batch, cfg.block};
  const size_t n = (size_t)batch * (size_t)cfg.block;
  int32_t *values = malloc(sizeof(int32_t) * n);
  if (!values) return 1;
  const dpar_device host = {DPAR_DEVICE_CPU, 0};
  for (int d = 0; d < kData; ++d) {
    CHECK(dpar_tensor_create(&x[d], DPAR_I32, shape, 2, host));
    CHECK(dpar_tensor_create(&y[d], DPAR_I32, shape, 2, host));
    for (size_t i = 0; i < n; ++i) values[i] = (int32_t)(gpt_next_u64(&rng) % (uint64_t)cfg.vocab);
    CHECK(dpar_tensor_copy_from_host(x[d], values, sizeof(int32_t) * n));
    for (size_t i = 0; i < n; ++i) values[i] = (int32_t)(gpt_next_u64(&rng) % (uint64_t)cfg.vocab);
    CHECK(dpar_tensor_copy_from_host(y[d], values, sizeof(int32_t) * n));
  }
  free(values);

  double m[kMaxRounds][4]; /* dpar 1, dpar 2, torch 1, torch 2: seconds per step */
  char version[1024] = "";
  int have_torch = 1;
  bench_memory memory[2] = {{0}, {0}}; /* dpar 1 and 2 devices, the last round's */
  for (int r = 0; r < rounds; ++r) {
    m[r][0] = time_dpar(model, 1, x, y, seconds, bf16, &memory[0]);
    m[r][1] = time_dpar(model, 2, x, y, seconds, bf16, &memory[1]);
    double t[2] = {0, 0};
    if (have_torch && time_torch(python, &cfg, batch, seconds, bf16, t, version, sizeof version) < 2) {
      printf("    PyTorch did not run (%s): its columns stay empty; give a Python with torch: --torch PYTHON\n",
             version[0] ? version : "no figures from gpt_anchor.py");
      have_torch = 0;
    }
    m[r][2] = t[0];
    m[r][3] = t[1];
    printf("    round %d: dpar %6.0f %6.0f  PyTorch %6.0f %6.0f tokens/s (1 and 2 devices / threads)\n", r,
           tokens / m[r][0], tokens / m[r][1], t[0] > 0 ? tokens / t[0] : 0, t[1] > 0 ? tokens / t[1] : 0);
    fflush(stdout);
  }
  if (version[0]) printf("    PyTorch: %s\n", version);
  double med[4];
  for (int c = 0; c < 4; ++c) {
    double v[kMaxRounds];
    for (int r = 0; r < rounds; ++r) v[r] = m[r][c];
    med[c] = bench_median(v, (size_t)rounds);
  }
  static const char *names[4] = {"dpar, 1 device", "dpar, 2 devices", "PyTorch, 1 thread", "PyTorch, 2 threads"};
  printf("\n    %-20s | %10s | %10s | %s\n", "configuration", "median ms", "tokens/s", "dpar / PyTorch (tokens/s)");
  for (int c = 0; c < 4; ++c) {
    printf("    %-20s | %10.1f | %10.0f |", names[c], med[c] * 1e3, med[c] > 0 ? tokens / med[c] : 0);
    if (c < 2 && med[2 + c] > 0) printf(" %.2fx PyTorch at %d thread%s", med[2 + c] / med[c], c + 1, c ? "s" : "");
    printf("\n");
  }
  if (med[2] > 0)
    printf("    dpar 2 devices over dpar 1: %.2fx; PyTorch 2 threads over 1: %.2fx\n", med[0] / med[1], med[2] / med[3]);
  printf("\n");
  for (int c = 0; c < 2; ++c) bench_memory_print(names[c], &memory[c]);
  printf("    (%s; replica 0's device, cpu:0, also holds the %d input and %d target batches: %.3f MiB)\n",
         bf16 ? "bf16" : "f32", kData, kData, (double)(2 * kData) * (double)n * 4.0 / 1048576.0);
  for (int d = 0; d < kData; ++d) dpar_tensor_free(x[d]), dpar_tensor_free(y[d]);
  dpar_model_free(model);
  return 0;
}
