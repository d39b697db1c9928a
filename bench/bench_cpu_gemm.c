/* bench_cpu_gemm: single-threaded SGEMM of each candidate CPU GEMM library, on the shapes of dpar's training step.
 *
 *   bench_cpu_gemm [--rounds R] [--provider NAME[=LIBRARY]]...
 *
 * Each provider runs in its own child process (fork), which sets the environment (one thread; OpenBLAS's core
 * type where the provider names one) and only then dlopen()s the library with RTLD_LOCAL: OpenBLAS reads
 * OPENBLAS_CORETYPE and its thread count in its load-time constructor, and two BLAS libraries exporting the same
 * cblas_sgemm must not meet in one process. Providers (the library's path can be overridden with NAME=PATH):
 *
 *   openblas            Debian's OpenBLAS (libopenblas.so.0), its own choice of kernel
 *   openblas-skylakex   the same, OPENBLAS_CORETYPE=SkylakeX (what its feature bits would give it)
 *   openblas-haswell    the same, OPENBLAS_CORETYPE=Haswell (the AVX2 kernels)
 *   blis                Debian's BLIS, single-threaded build (blis-serial/libblis.so.4)
 *   onednn              Debian's oneDNN (libdnnl.so.2), dnnl_sgemm, OMP_NUM_THREADS=1
 *   scipy-openblas      OpenBLAS 0.3.x from PyPI's scipy-openblas32 (scipy_cblas_sgemm); needs its path
 *   mkl                 MKL from PyPI (libmkl_rt.so.2, cblas_sgemm, MKL_NUM_THREADS=1); needs its path
 *
 * Shapes: the demo MLP 784-256-128-10 at batch 256 and 1024, as dpar's linear_forward / linear_backward call
 * them (row-major: forward out = inp W^T, dinp = dout W, dweight = dout^T inp), and 1024^3. Each shape runs in
 * rounds of at least 50 ms; the figure is the best round's GFLOP/s (2MNK / time), the best because the machine
 * is shared and noise only ever slows a round down. Every result is checked against a double-precision reference. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_util.h"

/* A function pointer from dlsym, as POSIX spells it: ISO C has no conversion from an object pointer to a function
 * pointer, so the symbol's address is stored through the pointer's own bytes. */
#define DPAR_DLSYM(fp, handle, name) (*(void **)(&(fp)) = dlsym((handle), (name)))

enum { kRowMajor = 101, kNoTrans = 111, kTrans = 112 };
typedef void (*cblas_sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                               float *, int);
typedef int (*dnnl_sgemm_fn)(char, char, long, long, long, float, const float *, long, const float *, long, float,
                             float *, long);

typedef struct {
  const char *name, *layer;
  int ta, tb, m, n, k;
} shape;

/* linear_forward: out (B,C_out) = inp (B,C_in) W^T; dinp (B,C_in) = dout (B,C_out) W (C_out,C_in);
 * dweight (C_out,C_in) = dout^T inp. The last layer's dinp is computed too (dpar does not skip it). */
static int make_shapes(shape *s) {
  static const int sizes[] = {784, 256, 128, 10};
  static const int batches[] = {256, 1024};
  static const char *layers[] = {"784->256", "256->128", "128->10"};
  int n = 0;
  for (int bi = 0; bi < 2; ++bi) {
    const int B = batches[bi];
    for (int l = 0; l < 3; ++l) {
      const int cin = sizes[l], cout = sizes[l + 1];
      s[n++] = (shape){"fwd", layers[l], 0, 1, B, cout, cin};
      s[n++] = (shape){"dinp", layers[l], 0, 0, B, cin, cout};
      s[n++] = (shape){"dweight", layers[l], 1, 0, cout, cin, B};
    }
  }
  s[n++] = (shape){"square", "1024^3", 0, 0, 1024, 1024, 1024};
  return n;
}

typedef struct {
  const char *name;
  const char *lib;
  const char *env[4][2];
} provider;

static const provider kProviders[] = {
    {"openblas", "libopenblas.so.0", {{"OPENBLAS_NUM_THREADS", "1"}}},
    {"openblas-skylakex", "libopenblas.so.0", {{"OPENBLAS_NUM_THREADS", "1"}, {"OPENBLAS_CORETYPE", "SkylakeX"}}},
    {"openblas-haswell", "libopenblas.so.0", {{"OPENBLAS_NUM_THREADS", "1"}, {"OPENBLAS_CORETYPE", "Haswell"}}},
    {"blis", "/usr/lib/x86_64-linux-gnu/blis-serial/libblis.so.4", {{"BLIS_NUM_THREADS", "1"}}},
    {"onednn", "libdnnl.so.2", {{"OMP_NUM_THREADS", "1"}}},
    {"scipy-openblas", NULL, {{"OPENBLAS_NUM_THREADS", "1"}}},
    {"mkl", NULL, {{"MKL_NUM_THREADS", "1"}, {"OMP_NUM_THREADS", "1"}}},
};

typedef struct {
  cblas_sgemm_fn cblas;
  dnnl_sgemm_fn dnnl;
} gemm;

static void run_gemm(const gemm *g, const shape *s, const float *A, const float *B, float *C) {
  const int lda = s->ta ? s->m : s->k, ldb = s->tb ? s->k : s->n;
  if (g->dnnl) {
    g->dnnl(s->ta ? 'T' : 'N', s->tb ? 'T' : 'N', s->m, s->n, s->k, 1.0f, A, lda, B, ldb, 0.0f, C, s->n);
  } else {
    g->cblas(kRowMajor, s->ta ? kTrans : kNoTrans, s->tb ? kTrans : kNoTrans, s->m, s->n, s->k, 1.0f, A, lda, B, ldb,
             0.0f, C, s->n);
  }
}

/* What the library says it runs: its version and the kernel it chose. */
static void describe(void *h, const char *name, char *out, size_t cap) {
  snprintf(out, cap, "%s", name);
  char *(*corename)(void);
  DPAR_DLSYM(corename, h, "openblas_get_corename");
  if (!corename) DPAR_DLSYM(corename, h, "scipy_openblas_get_corename");
  char *(*config)(void);
  DPAR_DLSYM(config, h, "openblas_get_config");
  if (!config) DPAR_DLSYM(config, h, "scipy_openblas_get_config");
  if (corename) {
    snprintf(out, cap, "%s, %s kernels", config ? config() : "OpenBLAS", corename());
    return;
  }
  typedef struct {
    int major, minor, patch;
    const char *hash;
    unsigned cpu_runtime, gpu_runtime;
  } dnnl_version_t;
  const dnnl_version_t *(*dv)(void);
  DPAR_DLSYM(dv, h, "dnnl_version");
  int (*isa)(void);
  DPAR_DLSYM(isa, h, "dnnl_get_effective_cpu_isa");
  if (dv && isa) {
    const dnnl_version_t *v = dv();
    snprintf(out, cap, "oneDNN %d.%d.%d, effective ISA mask 0x%x", v->major, v->minor, v->patch, isa());
    return;
  }
  int (*arch_id)(void);
  DPAR_DLSYM(arch_id, h, "bli_arch_query_id");
  const char *(*arch_str)(int);
  DPAR_DLSYM(arch_str, h, "bli_arch_string");
  const char *(*blis_ver)(void);
  DPAR_DLSYM(blis_ver, h, "bli_info_get_version_str");
  if (arch_id && arch_str) {
    snprintf(out, cap, "BLIS %s, %s kernels", blis_ver ? blis_ver() : "?", arch_str(arch_id()));
    return;
  }
  void (*mkl_ver)(char *, int);
  DPAR_DLSYM(mkl_ver, h, "mkl_get_version_string");
  if (!mkl_ver) DPAR_DLSYM(mkl_ver, h, "MKL_Get_Version_String");
  if (mkl_ver) {
    char buf[512] = {0};
    mkl_ver(buf, (int)sizeof buf - 1);
    snprintf(out, cap, "%s", buf);
  }
}

static int measure(const provider *p, const char *lib, int rounds) {
  for (int i = 0; i < 4 && p->env[i][0]; ++i) setenv(p->env[i][0], p->env[i][1], 1);
  void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    printf("%-18s not available: %s\n", p->name, dlerror());
    return 0;
  }
  gemm g = {0};
  DPAR_DLSYM(g.dnnl, h, "dnnl_sgemm");
  if (!g.dnnl) DPAR_DLSYM(g.cblas, h, "cblas_sgemm");
  if (!g.dnnl && !g.cblas) DPAR_DLSYM(g.cblas, h, "scipy_cblas_sgemm");
  if (!g.dnnl && !g.cblas) {
    printf("%-18s %s has no sgemm\n", p->name, lib);
    return 1;
  }
  shape s[32];
  const int ns = make_shapes(s);
  size_t most = 0;
  for (int i = 0; i < ns; ++i) {
    size_t a = (size_t)s[i].m * s[i].k, b = (size_t)s[i].k * s[i].n, c = (size_t)s[i].m * s[i].n;
    if (a > most) most = a;
    if (b > most) most = b;
    if (c > most) most = c;
  }
  float *A = malloc(most * sizeof(float)), *B = malloc(most * sizeof(float)), *C = malloc(most * sizeof(float));
  uint64_t rng = 42;
  for (size_t i = 0; i < most; ++i) A[i] = bench_uniform(&rng) - 0.5f, B[i] = bench_uniform(&rng) - 0.5f;

  char what[600];
  run_gemm(&g, &s[0], A, B, C); /* the first call initialises the library (kernel choice, buffers) */
  describe(h, p->name, what, sizeof what);
  printf("%-18s %s\n", p->name, what);
  double total_flop = 0, total_s = 0;
  for (int i = 0; i < ns; ++i) {
    const shape *t = &s[i];
    const double flop = 2.0 * t->m * t->n * t->k;
    run_gemm(&g, t, A, B, C);
    /* check a few entries against a double-precision dot product */
    const int lda = t->ta ? t->m : t->k, ldb = t->tb ? t->k : t->n;
    double worst = 0;
    for (int q = 0; q < 16; ++q) {
      const int r = (q * 7919) % t->m, c = (q * 104729) % t->n;
      double ref = 0, mag = 0;
      for (int kk = 0; kk < t->k; ++kk) {
        const double a = t->ta ? A[(size_t)kk * lda + r] : A[(size_t)r * lda + kk];
        const double b = t->tb ? B[(size_t)c * ldb + kk] : B[(size_t)kk * ldb + c];
        ref += a * b, mag += fabs(a * b);
      }
      const double err = fabs(C[(size_t)r * t->n + c] - ref) / (mag > 0 ? mag : 1);
      if (err > worst) worst = err;
    }
    int reps = 1;
    for (double t0 = bench_now(); bench_now() - t0 < 0.005; reps *= 2)
      for (int r = 0; r < reps; ++r) run_gemm(&g, t, A, B, C);
    reps = reps * 10 > 1 ? reps * 10 : 1; /* ~50 ms a round */
    double best = 1e30;
    for (int round = 0; round < rounds; ++round) {
      const double t0 = bench_now();
      for (int r = 0; r < reps; ++r) run_gemm(&g, t, A, B, C);
      const double dt = (bench_now() - t0) / reps;
      if (dt < best) best = dt;
    }
    if (t->m != 1024 || t->k != 1024) total_flop += flop * (t->ta ? 1 : 1), total_s += best;
    printf("  %-8s %-8s M=%5d N=%5d K=%5d  %8.1f GFLOP/s  %9.1f us%s\n", t->name, t->layer, t->m, t->n, t->k,
           flop / best * 1e-9, best * 1e6, worst > 1e-5 ? "  WRONG RESULT" : "");
  }
  printf("  all demo-MLP GEMMs above (both batches): %.1f GFLOP/s overall\n", total_flop / total_s * 1e-9);
  free(A), free(B), free(C);
  return 0;
}

int main(int argc, char **argv) {
  int rounds = 7;
  const char *chosen[16][2];
  int nchosen = 0;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--rounds") && i + 1 < argc) {
      rounds = atoi(argv[++i]);
    } else if (!strcmp(argv[i], "--provider") && i + 1 < argc && nchosen < 16) {
      char *spec = argv[++i], *eq = strchr(spec, '=');
      if (eq) *eq = 0;
      chosen[nchosen][0] = spec, chosen[nchosen][1] = eq ? eq + 1 : NULL, ++nchosen;
    } else {
      fprintf(stderr, "usage: %s [--rounds R] [--provider NAME[=LIBRARY]]...\n", argv[0]);
      return 2;
    }
  }
  if (nchosen == 0)
    for (int i = 0; i < 5; ++i) chosen[nchosen][0] = kProviders[i].name, chosen[nchosen][1] = NULL, ++nchosen;
  char cpu[256] = "?";
  FILE *f = fopen("/proc/cpuinfo", "r");
  if (f) {
    char line[512];
    while (fgets(line, sizeof line, f))
      if (!strncmp(line, "model name", 10)) {
        snprintf(cpu, sizeof cpu, "%s", strchr(line, ':') + 2);
        cpu[strcspn(cpu, "\n")] = 0;
        break;
      }
    fclose(f);
  }
  double load[3] = {0};
  f = fopen("/proc/loadavg", "r");
  if (f) {
    if (fscanf(f, "%lf %lf %lf", &load[0], &load[1], &load[2]) != 3) load[0] = -1;
    fclose(f);
  }
  printf("bench_cpu_gemm: one-thread SGEMM, best of %d rounds; CPU: %s; load %.2f %.2f %.2f\n", rounds, cpu, load[0],
         load[1], load[2]);
  fflush(stdout);
  for (int i = 0; i < nchosen; ++i) {
    const provider *p = NULL;
    for (size_t j = 0; j < sizeof kProviders / sizeof kProviders[0]; ++j)
      if (!strcmp(kProviders[j].name, chosen[i][0])) p = &kProviders[j];
    if (!p) {
      printf("%-18s unknown provider\n", chosen[i][0]);
      continue;
    }
    const char *lib = chosen[i][1] ? chosen[i][1] : p->lib;
    if (!lib) {
      printf("%-18s needs its library's path: --provider %s=/path/to/lib.so\n", p->name, p->name);
      continue;
    }
    fflush(stdout);
    const pid_t pid = fork();
    if (pid == 0) {
      const int rc = measure(p, lib, rounds);
      fflush(stdout);
      _exit(rc);
    }
    int status = 0;
    waitpid(pid, &status, 0);
  }
  return 0;
}
