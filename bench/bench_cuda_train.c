/* bench_cuda_train: dpar's training step on a GPU, through the C ABI only (dpar.h, libdpar.so); issue 7, section 8.
 *
 *   bench_cuda_train [--only demo|wide] [--batches B1,B2,..] [--steps N] [--blocks K] [--replicas R]
 *                    [--host-input] [--json PATH] [--torch PATH] [--gemms PATH] [--data DIR] [--trace DIR]
 *
 * For the demo MLP 784-256-128-10 (batches 128, 1024, 8192) and the wide MLP 784-4096-4096-4096-10 (256, 1024,
 * 8192): ReLU, softmax cross-entropy, Adam lr 1e-3, f32, synthetic uniform inputs and random labels, on an engine
 * with device_kind CUDA and R replicas on cuda:0 (default 1). One step is one dpar_engine_train_step call: the engine
 * synchronises every replica's stream before the call returns (Engine::run), so the wall time of a call is the time
 * of the step's GPU work plus the host's part of it, as a synchronised PyTorch step is timed by torch_anchor.py.
 * --torch and --gemms read the JSON of bench/torch_anchor.py and bench_cuda_gemms and print dpar beside them, with
 * the ratios and the verdicts of the three aims. --data DIR (Fashion-MNIST's IDX files) adds the loader's
 * part: the demo MLP trained from a shuffling dpar_loader, whose batches come either in host memory (each step
 * copies them) or prepared on cuda:0 one batch ahead (dpar_loader_to_device: gathered and copied while the step
 * before runs); per step, the wall time of dpar_loader_next plus dpar_engine_train_step, and the ratio of the two.
 * --trace DIR writes, for each configuration, a timeline of 5 more steps after the timed ones (dpar_engine_trace_start;
 * DIR/trace-<model>-<batch>.json, for ui.perfetto.dev). No CUDA device: says why and exits 0 ("skipped"). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_check.h"
#include "bench_util.h"
#include "cuda_configs.h"
#include "dpar.h"

enum { kDataBatches = 4, kMaxReplicas = 64, kMaxResults = 2 * kBenchMaxBatches };

typedef struct result {
  const bench_mlp *mlp;
  const char *model;
  int64_t batch;
  int ok;
  char error[256];               /* why the configuration has no figure (ok = 0) */
  double med, p10, p90;          /* ms, over every timed step */
  double block_lo, block_hi;     /* ms, the lowest and highest block median */
  size_t steps;
  float last_loss;
} result;

static void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  if (!p) {
    fprintf(stderr, "out of memory\n");
    exit(1);
  }
  return p;
}

/* Records a failed dpar call in r and returns nonzero: a configuration that does not fit (out of memory) is
 * reported, and the others still run. */
static int failed(result *r, dpar_status s, const char *what) {
  if (s == DPAR_OK) return 0;
  snprintf(r->error, sizeof r->error, "%s: %s: %s", what, dpar_status_str(s), dpar_last_error());
  r->ok = 0;
  return 1;
}

/* The MLP (ReLU between its layers, PyTorch's initialisation from seed 1) and an Adam (lr 1e-3) engine with
 * `replicas` replicas on cuda:0 and softmax cross-entropy. *model is the caller's to free, with the engine. */
static dpar_status make_engine(dpar_engine **engine, dpar_model **model, const bench_mlp *mlp, int replicas) {
  dpar_model_options mo = DPAR_MODEL_OPTIONS_INIT;
  mo.seed = 1;
  CHECK(dpar_model_create(model, &mo));
  for (int l = 0; l < mlp->nlayers; ++l) {
    CHECK(dpar_model_add_linear(*model, mlp->sizes[l], mlp->sizes[l + 1], 1));
    if (l + 1 < mlp->nlayers) CHECK(dpar_model_add_activation(*model, DPAR_RELU));
  }
  dpar_optimizer_options oo = DPAR_OPTIMIZER_OPTIONS_INIT;
  oo.kind = DPAR_ADAM;
  oo.lr = 1e-3f;
  int32_t ids[kMaxReplicas] = {0}; /* every replica on cuda:0 */
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.device_kind = DPAR_DEVICE_CUDA;
  eo.device_ids = ids;
  eo.num_device_ids = (size_t)replicas;
  eo.loss = DPAR_LOSS_CROSS_ENTROPY;
  eo.processes = DPAR_PROCESSES_SINGLE;
  return dpar_engine_create(engine, *model, &oo, &eo);
}

static void run_config(result *r, const bench_mlp *mlp, int64_t batch, int replicas, int steps, int blocks,
                       int host_input, const char *trace_dir) {
  memset(r, 0, sizeof *r);
  r->mlp = mlp;
  r->model = mlp->name;
  r->batch = batch;
  const int64_t in = mlp->sizes[0], classes = mlp->sizes[mlp->nlayers];

  dpar_model *model = NULL;
  dpar_engine *engine = NULL;
  dpar_tensor *x[kDataBatches] = {0}, *y[kDataBatches] = {0};
  double *t = NULL;
  if (failed(r, make_engine(&engine, &model, mlp, replicas), "dpar_engine_create")) goto done;

  /* A few distinct batches, cycled, on cuda:0 as the PyTorch anchor's are: a replica there takes its rows as a
   * view. --host-input keeps them in host memory, so that the step includes each replica's copy to its GPU. */
  {
    uint64_t rng = 0x9E3779B97F4A7C15ull ^ (uint64_t)batch;
    const dpar_device where = {host_input ? DPAR_DEVICE_CPU : DPAR_DEVICE_CUDA, 0};
    float *xs = (float *)xmalloc(sizeof(float) * (size_t)(batch * in));
    int32_t *ys = (int32_t *)xmalloc(sizeof(int32_t) * (size_t)batch);
    const int64_t xshape[2] = {batch, in}, yshape[1] = {batch};
    dpar_status s = DPAR_OK;
    for (int b = 0; b < kDataBatches && s == DPAR_OK; ++b) {
      for (int64_t i = 0; i < batch * in; ++i) xs[i] = bench_uniform(&rng);
      for (int64_t i = 0; i < batch; ++i) ys[i] = (int32_t)(bench_next_u64(&rng) % (uint64_t)classes);
      if (s == DPAR_OK) s = dpar_tensor_create(&x[b], DPAR_F32, xshape, 2, where);
      if (s == DPAR_OK) s = dpar_tensor_create(&y[b], DPAR_I32, yshape, 1, where);
      if (s == DPAR_OK) s = dpar_tensor_copy_from_host(x[b], xs, sizeof(float) * (size_t)(batch * in));
      if (s == DPAR_OK) s = dpar_tensor_copy_from_host(y[b], ys, sizeof(int32_t) * (size_t)batch);
    }
    free(xs);
    free(ys);
    if (failed(r, s, "input tensors")) goto done;
  }

  /* Warm-up: the caching allocator fills, cuBLAS picks its kernels, clocks rise. */
  const int warmup = 10;
  for (int i = 0; i < warmup; ++i)
    if (failed(r, dpar_engine_train_step(&r->last_loss, engine, x[i % kDataBatches], y[i % kDataBatches]),
               "dpar_engine_train_step (warm-up)"))
      goto done;
  const size_t n = (size_t)steps * (size_t)blocks;
  t = (double *)xmalloc(sizeof(double) * n);
  r->block_lo = INFINITY;
  for (int k = 0; k < blocks; ++k) {
    double *bt = t + (size_t)k * (size_t)steps;
    for (int i = 0; i < steps; ++i) {
      const int b = (k * steps + i) % kDataBatches;
      const double t0 = bench_now();
      const dpar_status s = dpar_engine_train_step(&r->last_loss, engine, x[b], y[b]);
      bt[i] = (bench_now() - t0) * 1e3;
      if (failed(r, s, "dpar_engine_train_step")) goto done;
    }
    double *tmp = (double *)xmalloc(sizeof(double) * (size_t)steps);
    memcpy(tmp, bt, sizeof(double) * (size_t)steps);
    const double m = bench_median(tmp, (size_t)steps);
    free(tmp);
    r->block_lo = m < r->block_lo ? m : r->block_lo;
    r->block_hi = m > r->block_hi ? m : r->block_hi;
  }
  r->med = bench_median(t, n);
  r->p10 = bench_quantile_sorted(t, n, 0.1);
  r->p90 = bench_quantile_sorted(t, n, 0.9);
  r->steps = n;
  /* --trace: a few more steps, untimed, recorded as a timeline of the engine's threads. */
  if (trace_dir) {
    char path[1024];
    snprintf(path, sizeof path, "%s/trace-%s-%lld.json", trace_dir, r->model, (long long)batch);
    if (failed(r, dpar_engine_trace_start(engine), "dpar_engine_trace_start")) goto done;
    for (int i = 0; i < 5; ++i)
      if (failed(r, dpar_engine_train_step(&r->last_loss, engine, x[i % kDataBatches], y[i % kDataBatches]),
                 "dpar_engine_train_step (traced)"))
        goto done;
    if (failed(r, dpar_engine_trace_stop(engine, path), "dpar_engine_trace_stop")) goto done;
  }
  r->ok = 1;
done:
  free(t);
  for (int b = 0; b < kDataBatches; ++b) {
    dpar_tensor_free(x[b]);
    dpar_tensor_free(y[b]);
  }
  dpar_engine_free(engine);
  dpar_model_free(model);
}

/* ---- the other programs' JSON (written by torch_anchor.py and bench_cuda_gemms) -------------------------------
 * Just enough of a reader for those files: a top-level object whose "results" array holds flat objects, each
 * naming "model" and "batch" and holding numbers or null. */

typedef struct json_file {
  char *text;
  size_t len;
} json_file;

static int read_json(json_file *f, const char *path) {
  f->text = NULL;
  FILE *fp = fopen(path, "rb");
  if (!fp) return 0;
  fseek(fp, 0, SEEK_END);
  const long len = ftell(fp);
  fseek(fp, 0, SEEK_SET);
  f->text = (char *)xmalloc((size_t)(len > 0 ? len : 0) + 1);
  f->len = fread(f->text, 1, (size_t)(len > 0 ? len : 0), fp);
  f->text[f->len] = 0;
  fclose(fp);
  return 1;
}

/* Just inside the top-level object. */
static const char *json_body(const json_file *f) {
  const char *p = strchr(f->text, '{');
  return p ? p + 1 : f->text + f->len;
}

/* Past the string that starts at p (at its opening quote). */
static const char *skip_string(const char *p, const char *end) {
  for (++p; p < end && *p != '"'; ++p)
    if (*p == '\\' && p + 1 < end) ++p;
  return p < end ? p + 1 : end;
}

/* The value of "key" among [p, end) at nesting depth 0 of that range (after its colon), or NULL. */
static const char *find_key(const char *p, const char *end, const char *key) {
  const size_t kl = strlen(key);
  int depth = 0;
  while (p < end) {
    if (*p == '"') {
      const char *s = p + 1, *after = skip_string(p, end);
      if (depth == 0 && (size_t)(after - 1 - s) == kl && !strncmp(s, key, kl)) {
        const char *v = after;
        while (v < end && (*v == ' ' || *v == '\n' || *v == '\t' || *v == '\r' || *v == ':')) ++v;
        return v;
      }
      p = after;
    } else {
      if (*p == '{' || *p == '[') ++depth;
      if (*p == '}' || *p == ']') --depth;
      ++p;
    }
  }
  return NULL;
}

/* Past the object or array that starts at p. */
static const char *skip_nested(const char *p, const char *end) {
  int depth = 0;
  while (p < end) {
    if (*p == '"') {
      p = skip_string(p, end);
      continue;
    }
    if (*p == '{' || *p == '[') ++depth;
    if ((*p == '}' || *p == ']') && --depth == 0) return p + 1;
    ++p;
  }
  return end;
}

static double json_number(const char *v) {
  if (!v || !strncmp(v, "null", 4)) return NAN;
  char *e = NULL;
  const double d = strtod(v, &e);
  return e == v ? NAN : d;
}

/* Copies the string value v (at its quote) into out. */
static void json_string(const char *v, const char *end, char *out, size_t cap) {
  out[0] = 0;
  if (!v || *v != '"') return;
  size_t n = 0;
  for (++v; v < end && *v != '"' && n + 1 < cap; ++v) out[n++] = *v == '\\' && v + 1 < end ? *++v : *v;
  out[n] = 0;
}

/* Finds the results entry for (model, batch); sets [*obj, *obj_end). */
static int find_entry(const json_file *f, const char *model, int64_t batch, const char **obj, const char **obj_end) {
  const char *end = f->text + f->len;
  const char *p = find_key(json_body(f), end, "results");
  if (!p || *p != '[') return 0;
  const char *arr_end = skip_nested(p, end) - 1;
  for (++p; p < arr_end; ++p) {
    if (*p != '{') continue;
    const char *oe = skip_nested(p, arr_end + 1);
    char m[64];
    json_string(find_key(p + 1, oe, "model"), oe, m, sizeof m);
    if (!strcmp(m, model) && json_number(find_key(p + 1, oe, "batch")) == (double)batch) {
      *obj = p + 1;
      *obj_end = oe;
      return 1;
    }
    p = oe - 1;
  }
  return 0;
}

static double entry_number(const json_file *f, const char *model, int64_t batch, const char *key) {
  const char *o, *oe;
  if (!f->text || !find_entry(f, model, batch, &o, &oe)) return NAN;
  return json_number(find_key(o, oe, key));
}

/* Prints a top-level string of the file (the GPU's name, versions, errors), if it is there. */
static void print_top_string(const json_file *f, const char *key, const char *label) {
  if (!f->text) return;
  char s[512];
  const char *end = f->text + f->len;
  json_string(find_key(json_body(f), end, key), end, s, sizeof s);
  if (s[0]) printf("  %s: %s\n", label, s);
}

/* Prints each string of a top-level array (the anchors' errors). */
static void print_top_strings(const json_file *f, const char *key, const char *label) {
  if (!f->text) return;
  const char *end = f->text + f->len, *p = find_key(json_body(f), end, key);
  if (!p || *p != '[') return;
  const char *arr_end = skip_nested(p, end);
  for (++p; p < arr_end; ++p) {
    if (*p != '"') continue;
    char s[512];
    json_string(p, arr_end, s, sizeof s);
    printf("  %s: %s\n", label, s);
    p = skip_string(p, arr_end) - 1;
  }
}

/* ---- output ------------------------------------------------------------------------------------------------------ */

static void fmt_ms(char *out, size_t cap, double v) {
  if (isnan(v)) snprintf(out, cap, "-");
  else snprintf(out, cap, "%.3f", v);
}
static void fmt_ratio(char *out, size_t cap, double a, double b) {
  if (isnan(a) || isnan(b) || !(b > 0)) snprintf(out, cap, "-");
  else snprintf(out, cap, "%.2fx", a / b);
}

/* Writes s as a JSON string (quotes and backslashes escaped, control characters as spaces). */
static void put_json_string(FILE *f, const char *s) {
  fputc('"', f);
  for (; *s; ++s) {
    if (*s == '"' || *s == '\\') fputc('\\', f);
    fputc((unsigned char)*s < 0x20 ? ' ' : *s, f);
  }
  fputc('"', f);
}

static void write_json(const char *path, const result *res, int nres, int replicas, int host_input, int steps,
                       int blocks, const char *skipped) {
  FILE *f = fopen(path, "w");
  if (!f) {
    fprintf(stderr, "cannot write %s\n", path);
    return;
  }
  fprintf(f, "{\n  \"program\": \"bench_cuda_train\",\n  \"dpar_version\": \"%s\",\n  \"device\": \"cuda:0\",\n",
          dpar_version_string());
  fprintf(f, "  \"replicas\": %d,\n  \"input\": \"%s\",\n  \"steps_per_block\": %d,\n  \"blocks\": %d,\n",
          replicas, host_input ? "host" : "cuda:0", steps, blocks);
  fprintf(f, "  \"skipped\": ");
  if (skipped[0]) put_json_string(f, skipped);
  else fprintf(f, "null");
  fprintf(f, ",\n  \"results\": [\n");
  for (int i = 0; i < nres; ++i) {
    const result *r = &res[i];
    fprintf(f, "    {\"model\": \"%s\", \"batch\": %lld, ", r->model, (long long)r->batch);
    if (r->ok)
      fprintf(f, "\"median_ms\": %.6f, \"p10_ms\": %.6f, \"p90_ms\": %.6f, \"samples_per_s\": %.1f, \"steps\": %zu}",
              r->med, r->p10, r->p90, (double)r->batch / r->med * 1e3, r->steps);
    else {
      fprintf(f, "\"median_ms\": null, \"error\": ");
      put_json_string(f, r->error);
      fprintf(f, "}");
    }
    fprintf(f, "%s\n", i + 1 < nres ? "," : "");
  }
  fprintf(f, "  ]\n}\n");
  fclose(f);
  printf("\nwrote %s\n", path);
}

/* The side-by-side table and the aims. */
static void compare(const result *res, int nres, const json_file *torch, const json_file *gemms) {
  printf("\ndpar beside PyTorch and the GEMMs alone (ms per step, medians; ratios are dpar / other, < 1 is dpar "
         "faster)\n");
  print_top_string(torch, "gpu", "PyTorch's GPU");
  print_top_string(torch, "torch_version", "PyTorch");
  print_top_string(torch, "matmul_precision", "PyTorch's f32 matmul precision");
  print_top_string(gemms, "gpu", "cuBLAS GEMMs' GPU");
  print_top_strings(torch, "errors", "PyTorch anchor error");
  printf("\n  %-11s | %8s %10s | %8s %8s %8s %8s %8s | %7s %7s %7s %7s\n", "config", "dpar", "samples/s", "plain",
         "DP", "DDP", "graph", "GEMMs", "/plain", "/DDP", "/graph", "/GEMMs");
  int ddp_n = 0, ddp_bad = 0, demo128 = -1, wide8192 = -1;
  char ddp_fails[512] = "";
  double wide_ratio = NAN;
  for (int i = 0; i < nres; ++i) {
    const result *r = &res[i];
    const double d = r->ok ? r->med : NAN;
    const double plain = entry_number(torch, r->model, r->batch, "plain_ms");
    const double dp = entry_number(torch, r->model, r->batch, "dataparallel_ms");
    const double ddp = entry_number(torch, r->model, r->batch, "ddp_ms");
    const double graph = entry_number(torch, r->model, r->batch, "graph_ms");
    const double gm = entry_number(gemms, r->model, r->batch, "gemms_ms");
    char cfg[32], c[5][16], q[4][16], sps[16];
    snprintf(cfg, sizeof cfg, "%s,%lld", r->model, (long long)r->batch);
    fmt_ms(c[0], 16, plain), fmt_ms(c[1], 16, dp), fmt_ms(c[2], 16, ddp), fmt_ms(c[3], 16, graph),
        fmt_ms(c[4], 16, gm);
    fmt_ratio(q[0], 16, d, plain), fmt_ratio(q[1], 16, d, ddp), fmt_ratio(q[2], 16, d, graph),
        fmt_ratio(q[3], 16, d, gm);
    if (isnan(d)) snprintf(sps, sizeof sps, "-");
    else snprintf(sps, sizeof sps, "%.0f", (double)r->batch / d * 1e3);
    char dm[16];
    fmt_ms(dm, sizeof dm, d);
    printf("  %-11s | %8s %10s | %8s %8s %8s %8s %8s | %7s %7s %7s %7s\n", cfg, dm, sps, c[0], c[1], c[2], c[3],
           c[4], q[0], q[1], q[2], q[3]);
    if (!isnan(d) && !isnan(ddp)) {
      ++ddp_n;
      if (d > ddp) {
        ++ddp_bad;
        size_t l = strlen(ddp_fails);
        snprintf(ddp_fails + l, sizeof ddp_fails - l, " %s", cfg);
      }
    }
    if (!strcmp(r->model, "demo") && r->batch == 128) demo128 = i;
    if (!strcmp(r->model, "wide") && r->batch == 8192) {
      wide8192 = i;
      wide_ratio = d / gm;
    }
  }
  printf("\n  aims:\n");
  if (ddp_n == 0) printf("    dpar <= PyTorch DDP at every size: not judged (no DDP figure beside a dpar one)\n");
  else
    printf("    dpar <= PyTorch DDP at every size: %s (at %d of the %d configurations with both figures, of %d%s%s)\n",
           ddp_bad ? "NOT met" : ddp_n < nres ? "met where measured" : "met", ddp_n - ddp_bad, ddp_n, nres,
           ddp_bad ? "; slower at" : "", ddp_fails);
  if (demo128 < 0 || !res[demo128].ok) printf("    demo at batch 128 under 0.3 ms: not judged (not measured)\n");
  else
    printf("    demo at batch 128 under 0.3 ms: %.3f ms, %s\n", res[demo128].med,
           res[demo128].med < 0.3 ? "met" : "NOT met");
  if (wide8192 < 0 || isnan(wide_ratio))
    printf("    wide at batch 8192 within 5%% of its GEMMs alone: not judged (%s)\n",
           wide8192 < 0 || !res[wide8192].ok ? "not measured" : "no GEMMs figure: --gemms");
  else
    printf("    wide at batch 8192 within 5%% of its GEMMs alone: %.3fx, %s\n", wide_ratio,
           wide_ratio <= 1.05 ? "met" : "NOT met");
}

/* ---- the loader's part: host batches against batches prepared ahead on the GPU ----------------------------------- */

/* Median ms of a loader step (next batch + train step) over `steps` steps after 10 warm-up ones; the loader's
 * batches prepared on cuda:0 when `ahead`. NAN (and a message) when a call fails. */
static double loader_step_ms(const dpar_dataset *train, size_t batch, int ahead, int steps) {
  dpar_model *model = NULL;
  dpar_engine *engine = NULL;
  dpar_loader *loader = NULL;
  double *t = (double *)xmalloc(sizeof(double) * (size_t)steps);
  double med = NAN;
  dpar_status s = make_engine(&engine, &model, &kBenchMlps[0], 1);
  if (s == DPAR_OK) s = dpar_loader_create(&loader, train, batch, 1, 0, 1);
  if (s == DPAR_OK && ahead) s = dpar_loader_to_device(loader, (dpar_device){DPAR_DEVICE_CUDA, 0});
  uint64_t epoch = 0;
  for (int i = -10; i < steps && s == DPAR_OK; ++i) {
    const double t0 = bench_now();
    int32_t more = 0;
    s = dpar_loader_next(&more, loader);
    if (s == DPAR_OK && !more) { /* a new epoch, outside the timing */
      s = dpar_loader_start_epoch(loader, ++epoch);
      --i;
      continue;
    }
    if (s == DPAR_OK)
      s = dpar_engine_train_step(NULL, engine, dpar_loader_inputs(loader), dpar_loader_labels(loader));
    if (i >= 0) t[i] = (bench_now() - t0) * 1e3;
  }
  if (s == DPAR_OK)
    med = bench_median(t, (size_t)steps);
  else
    printf("  loader, batch %zu, %s: failed: %s: %s\n", batch, ahead ? "ahead on cuda:0" : "host batches",
           dpar_status_str(s), dpar_last_error());
  free(t);
  dpar_loader_free(loader);
  dpar_engine_free(engine);
  dpar_model_free(model);
  return med;
}

static void run_loader_part(const char *dir, int steps) {
  char images[1024], labels[1024];
  snprintf(images, sizeof images, "%s/train-images-idx3-ubyte.gz", dir);
  snprintf(labels, sizeof labels, "%s/train-labels-idx1-ubyte.gz", dir);
  dpar_dataset *train = NULL;
  if (dpar_dataset_load_idx(&train, images, labels) != DPAR_OK) {
    printf("\nloader part: cannot load %s: %s\n", dir, dpar_last_error());
    return;
  }
  CHECK(dpar_dataset_normalize(train, 0.2860f, 0.3530f));
  printf("\nthe loader's part: demo MLP on Fashion-MNIST, 1 replica on cuda:0; per step, dpar_loader_next + "
         "dpar_engine_train_step,\nmedian of %d steps (3 rounds alternating, the median round shown)\n", steps);
  printf("  %-6s | %14s | %17s | %s\n", "batch", "host batches ms", "ahead on cuda:0 ms", "host / ahead");
  const size_t batches[] = {128, 1024, 8192};
  for (size_t b = 0; b < sizeof batches / sizeof batches[0]; ++b) {
    double host[3], ahead[3];
    for (int round = 0; round < 3; ++round) {
      host[round] = loader_step_ms(train, batches[b], 0, steps);
      ahead[round] = loader_step_ms(train, batches[b], 1, steps);
    }
    const double h = bench_median(host, 3), a = bench_median(ahead, 3);
    printf("  %-6zu | %14.3f | %17.3f | %.2fx\n", batches[b], h, a, h / a);
  }
  dpar_dataset_free(train);
}

/* ---- main ------------------------------------------------------------------------------------------------------ */

static void usage(const char *argv0) {
  fprintf(stderr,
          "usage: %s [--only demo|wide] [--batches B1,B2,..] [--steps N] [--blocks K] [--replicas R] [--host-input]\n"
          "          [--json PATH] [--torch PATH] [--gemms PATH] [--data DIR] [--trace DIR]\n"
          "  --only M        one model: demo (784-256-128-10) or wide (784-4096-4096-4096-10)\n"
          "  --batches L     batch sizes for the chosen model(s) (default demo 128,1024,8192; wide 256,1024,8192)\n"
          "  --steps N       timed steps per block (default 50); --blocks K blocks (default 5), after 10 warm-up steps\n"
          "  --replicas R    R replicas, all on cuda:0 (default 1)\n"
          "  --host-input    batches in host memory, copied to the GPU in the step; default on cuda:0, as PyTorch's\n"
          "  --json PATH     write the results as JSON\n"
          "  --torch PATH    JSON of bench/torch_anchor.py: print dpar beside PyTorch, with ratios and the aims\n"
          "  --gemms PATH    JSON of bench_cuda_gemms: the step's GEMMs in cuBLAS alone\n"
          "  --data DIR      Fashion-MNIST's IDX files: time training from the loader, host batches against\n"
          "                  batches prepared ahead on cuda:0\n"
          "  --trace DIR     after each configuration's timed steps, a timeline of 5 more: DIR/trace-<model>-<batch>.json\n",
          argv0);
  exit(2);
}

int main(int argc, char **argv) {
  const char *only = NULL, *json = NULL, *torch_path = NULL, *gemms_path = NULL, *data = NULL, *trace_dir = NULL;
  int64_t batches[kBenchMaxBatches];
  int nbatches = 0, steps = 50, blocks = 5, replicas = 1, host_input = 0;
  for (int i = 1; i < argc; ++i) {
    const int more = i + 1 < argc;
    if (!strcmp(argv[i], "--only") && more) only = argv[++i];
    else if (!strcmp(argv[i], "--batches") && more) {
      if ((nbatches = bench_parse_batches(argv[++i], batches)) < 0) usage(argv[0]);
    } else if (!strcmp(argv[i], "--steps") && more) steps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--blocks") && more) blocks = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--replicas") && more) replicas = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--host-input")) host_input = 1;
    else if (!strcmp(argv[i], "--json") && more) json = argv[++i];
    else if (!strcmp(argv[i], "--torch") && more) torch_path = argv[++i];
    else if (!strcmp(argv[i], "--gemms") && more) gemms_path = argv[++i];
    else if (!strcmp(argv[i], "--data") && more) data = argv[++i];
    else if (!strcmp(argv[i], "--trace") && more) trace_dir = argv[++i];
    else usage(argv[0]);
  }
  if (only && strcmp(only, "demo") && strcmp(only, "wide")) usage(argv[0]);
  if (steps < 1 || blocks < 1 || replicas < 1 || replicas > kMaxReplicas) usage(argv[0]);
  setvbuf(stdout, NULL, _IOLBF, 0);

  printf("bench_cuda_train: dpar %s through its C ABI; the training step on cuda:0 (issue 7, section 8)\n",
         dpar_version_string());
  /* Files named on the command line are read first, so that a wrong path is told before minutes of measuring. */
  json_file torch = {0}, gemms = {0};
  if (torch_path && !read_json(&torch, torch_path)) {
    fprintf(stderr, "cannot read %s\n", torch_path);
    return 2;
  }
  if (gemms_path && !read_json(&gemms, gemms_path)) {
    fprintf(stderr, "cannot read %s\n", gemms_path);
    return 2;
  }

  /* The configurations, each without a figure until measured. */
  result res[kMaxResults];
  int nres = 0;
  for (int m = 0; m < 2; ++m) {
    const bench_mlp *mlp = &kBenchMlps[m];
    if (only && strcmp(only, mlp->name)) continue;
    const int nb = nbatches ? nbatches : mlp->nbatches;
    for (int b = 0; b < nb; ++b, ++nres) {
      memset(&res[nres], 0, sizeof res[nres]);
      res[nres].mlp = mlp;
      res[nres].model = mlp->name;
      res[nres].batch = nbatches ? batches[b] : mlp->batches[b];
    }
  }

  /* Without a GPU nothing is measured; the anchors' figures, if given, are still printed. */
  char skipped[512] = "";
  size_t ngpu = 0;
  const dpar_status cs = dpar_device_count(&ngpu, DPAR_DEVICE_CUDA);
  if (cs != DPAR_OK) {
    snprintf(skipped, sizeof skipped, "no CUDA in this dpar (%s: %s)", dpar_status_str(cs), dpar_last_error());
  } else if (ngpu == 0) {
    /* dpar_device_count says how many; making a tensor there says why there are none. */
    dpar_tensor *probe = NULL;
    const int64_t one = 1;
    const dpar_device gpu0 = {DPAR_DEVICE_CUDA, 0};
    const dpar_status s = dpar_tensor_create(&probe, DPAR_F32, &one, 1, gpu0);
    snprintf(skipped, sizeof skipped, "no CUDA device (%s)",
             s != DPAR_OK ? dpar_last_error() : "dpar_device_count says 0");
    dpar_tensor_free(probe);
  }
  if (skipped[0]) {
    printf("skipped: %s\n", skipped);
    for (int i = 0; i < nres; ++i) snprintf(res[i].error, sizeof res[i].error, "skipped");
  } else {
    printf("GPU: cuda:0 of %zu (this program sees the GPU only through dpar; the anchors' JSON names it)\n", ngpu);
    printf("%d replica%s on cuda:0; inputs %s; Adam lr 1e-3, softmax cross-entropy, f32; 10 warm-up steps, then %d "
           "blocks of %d timed steps;\nstep = wall time of one dpar_engine_train_step (it returns once the GPU's "
           "work is done); median, p10, p90 over all timed steps\n\n",
           replicas, replicas > 1 ? "s" : "",
           host_input ? "in host memory (copied to the GPU in the step)" : "on cuda:0", blocks, steps);
    printf("  %-11s | %9s %9s %9s | %17s | %10s | %7s\n", "config", "median ms", "p10 ms", "p90 ms",
           "block medians ms", "samples/s", "loss");
    for (int i = 0; i < nres; ++i) {
      result *r = &res[i];
      run_config(r, r->mlp, r->batch, replicas, steps, blocks, host_input, trace_dir);
      char cfg[32];
      snprintf(cfg, sizeof cfg, "%s,%lld", r->model, (long long)r->batch);
      if (!r->ok) {
        printf("  %-11s | failed: %s\n", cfg, r->error);
        continue;
      }
      printf("  %-11s | %9.3f %9.3f %9.3f | %8.3f-%-8.3f | %10.0f | %7.4f\n", cfg, r->med, r->p10, r->p90,
             r->block_lo, r->block_hi, (double)r->batch / r->med * 1e3, r->last_loss);
    }
    if (data) run_loader_part(data, steps);
  }
  if (json) write_json(json, res, nres, replicas, host_input, steps, blocks, skipped);
  if (torch_path || gemms_path) compare(res, nres, &torch, &gemms);
  free(torch.text);
  free(gemms.text);
  return 0;
}
