#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "bench_util.h"

#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

double bench_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

double bench_median(double *v, size_t n) {
  if (n == 0) return 0.0;
  qsort(v, n, sizeof(double), cmp_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double bench_quantile_sorted(const double *v, size_t n, double q) {
  if (n == 0) return 0.0;
  size_t i = (size_t)(q * (double)(n - 1) + 0.5);
  if (i >= n) i = n - 1;
  return v[i];
}

/* The affinity the process started with, captured once, so that unpinning restores it. */
static cpu_set_t g_initial;
static pthread_once_t g_initial_once = PTHREAD_ONCE_INIT;
static void capture_initial(void) {
  CPU_ZERO(&g_initial);
  if (sched_getaffinity(0, sizeof g_initial, &g_initial) != 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) CPU_SET(c, &g_initial);
  }
}

int bench_allowed_cpus(int *cpus, int capacity) {
  pthread_once(&g_initial_once, capture_initial);
  int n = 0;
  for (int c = 0; c < CPU_SETSIZE && n < capacity; ++c)
    if (CPU_ISSET(c, &g_initial)) cpus[n++] = c;
  return n;
}

int bench_pin_self(int cpu) {
  pthread_once(&g_initial_once, capture_initial);
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

void bench_unpin_self(void) {
  pthread_once(&g_initial_once, capture_initial);
  pthread_setaffinity_np(pthread_self(), sizeof g_initial, &g_initial);
}

/* ---- core-to-core latency ---------------------------------------------------------------------------------- */

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

enum { kPingWarmup = 200, kPingRounds = 2000, kPingRuns = 7 };

typedef struct ping_state {
  _Alignas(64) atomic_uint flag;
  char pad[60];
  int cpu_a, cpu_b;
  int pin_failed;
  double seconds[kPingRuns];
} ping_state;

/* Side B: answers every odd value with the next even one. */
static void *ping_b(void *arg) {
  ping_state *s = (ping_state *)arg;
  if (bench_pin_self(s->cpu_b) != 0) s->pin_failed = 1;
  unsigned v = 0;
  for (int run = 0; run < kPingRuns; ++run) {
    for (int i = 0; i < kPingWarmup + kPingRounds; ++i) {
      ++v;
      while (atomic_load_explicit(&s->flag, memory_order_acquire) != v) relax();
      atomic_store_explicit(&s->flag, ++v, memory_order_release);
    }
  }
  return NULL;
}

/* Side A: sends odd values and times the round trips. */
static void *ping_a(void *arg) {
  ping_state *s = (ping_state *)arg;
  if (bench_pin_self(s->cpu_a) != 0) s->pin_failed = 1;
  unsigned v = 0;
  for (int run = 0; run < kPingRuns; ++run) {
    double t0 = 0.0;
    for (int i = 0; i < kPingWarmup + kPingRounds; ++i) {
      if (i == kPingWarmup) t0 = bench_now();
      atomic_store_explicit(&s->flag, ++v, memory_order_release);
      ++v;
      while (atomic_load_explicit(&s->flag, memory_order_acquire) != v) relax();
    }
    s->seconds[run] = bench_now() - t0;
  }
  return NULL;
}

double bench_core_latency_ns(int cpu_a, int cpu_b) {
  ping_state *s = NULL;
  if (posix_memalign((void **)&s, 64, sizeof *s) != 0) return -1.0;
  memset(s, 0, sizeof *s);
  atomic_init(&s->flag, 0);
  s->cpu_a = cpu_a;
  s->cpu_b = cpu_b;
  pthread_t a, b;
  if (pthread_create(&b, NULL, ping_b, s) != 0) {
    free(s);
    return -1.0;
  }
  if (pthread_create(&a, NULL, ping_a, s) != 0) {
    /* B waits for a value that never comes: cannot happen short of resource exhaustion; give up loudly. */
    fprintf(stderr, "bench: cannot start a latency probe thread\n");
    exit(1);
  }
  pthread_join(a, NULL);
  pthread_join(b, NULL);
  double ns[kPingRuns];
  for (int r = 0; r < kPingRuns; ++r) ns[r] = s->seconds[r] * 1e9 / (2.0 * kPingRounds);
  double result = s->pin_failed ? -1.0 : bench_median(ns, kPingRuns);
  free(s);
  return result;
}

const char *bench_placement_class(double ns) {
  if (ns < 0) return "unknown (could not pin)";
  if (ns < 25.0) return "SMT siblings";
  if (ns < 120.0) return "shared L3";
  return "far (other L3)";
}

const char *bench_placement_tag(double ns) {
  if (ns < 0) return "?";
  if (ns < 25.0) return "smt";
  if (ns < 120.0) return "L3";
  return "far";
}

/* ---- machine description ------------------------------------------------------------------------------------ */

static void read_first_line(const char *path, char *out, size_t cap) {
  out[0] = 0;
  FILE *f = fopen(path, "r");
  if (!f) return;
  if (fgets(out, (int)cap, f)) out[strcspn(out, "\n")] = 0;
  fclose(f);
}

void bench_print_machine(FILE *f) {
  char model[256] = "?";
  FILE *ci = fopen("/proc/cpuinfo", "r");
  if (ci) {
    char line[512];
    while (fgets(line, sizeof line, ci)) {
      if (strncmp(line, "model name", 10) == 0) {
        char *colon = strchr(line, ':');
        if (colon) {
          snprintf(model, sizeof model, "%s", colon + 2);
          model[strcspn(model, "\n")] = 0;
        }
        break;
      }
    }
    fclose(ci);
  }
  int cpus[1024];
  int n = bench_allowed_cpus(cpus, 1024);
  long online = sysconf(_SC_NPROCESSORS_ONLN);
  fprintf(f, "machine: %s; %ld CPUs online, %d allowed {", model, online, n);
  for (int i = 0; i < n; ++i) fprintf(f, "%s%d", i ? "," : "", cpus[i]);
  fprintf(f, "}");
  /* Caches of CPU 0: index2 = L2, index3 = L3. */
  char l2[64], l3[64], l3share[64];
  read_first_line("/sys/devices/system/cpu/cpu0/cache/index2/size", l2, sizeof l2);
  read_first_line("/sys/devices/system/cpu/cpu0/cache/index3/size", l3, sizeof l3);
  read_first_line("/sys/devices/system/cpu/cpu0/cache/index3/shared_cpu_list", l3share, sizeof l3share);
  if (l2[0]) fprintf(f, "; L2 %s per core", l2);
  if (l3[0]) fprintf(f, "; L3 %s shared by CPUs %s (as the guest sees it)", l3, l3share[0] ? l3share : "?");
  char load[128];
  read_first_line("/proc/loadavg", load, sizeof load);
  fprintf(f, "\nload average at start: %s\n", load);
}

/* ---- CPU-use account ---------------------------------------------------------------------------------------- */

/* CPU-seconds of the live descendants of this process (such as mpirun and its ranks), which RUSAGE_CHILDREN counts
 * only once they have been waited for. */
static double descendants_cpu_seconds(void) {
  enum { kMax = 4096 };
  static int pids[kMax], ppids[kMax];
  static double cpu[kMax];
  int n = 0;
  DIR *d = opendir("/proc");
  if (!d) return 0.0;
  const double hz = (double)sysconf(_SC_CLK_TCK);
  struct dirent *e;
  while ((e = readdir(d)) != NULL && n < kMax) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    char path[300], buf[1024];
    snprintf(path, sizeof path, "/proc/%s/stat", e->d_name);
    FILE *f = fopen(path, "r");
    if (!f) continue;
    size_t len = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[len] = 0;
    /* pid (comm) state ppid ... field 14 utime, 15 stime, 16 cutime, 17 cstime; comm may hold spaces. */
    char *close_paren = strrchr(buf, ')');
    if (!close_paren) continue;
    char state;
    int ppid;
    unsigned long long skip, utime, stime;
    long long cutime, cstime;
    if (sscanf(close_paren + 2, "%c %d %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu %lld %lld", &state,
               &ppid, &skip, &skip, &skip, &skip, &skip, &skip, &skip, &skip, &skip, &utime, &stime, &cutime,
               &cstime) != 15)
      continue;
    pids[n] = atoi(e->d_name);
    ppids[n] = ppid;
    cpu[n] = (double)(utime + stime + (unsigned long long)cutime + (unsigned long long)cstime) / hz;
    ++n;
  }
  closedir(d);
  /* Mark descendants of this process: repeat until no new one is found (trees are shallow). */
  static char mark[kMax];
  memset(mark, 0, sizeof mark);
  const int self = (int)getpid();
  double total = 0.0;
  for (int changed = 1; changed;) {
    changed = 0;
    for (int i = 0; i < n; ++i) {
      if (mark[i] || pids[i] == self) continue;
      int parent_marked = ppids[i] == self;
      for (int j = 0; j < n && !parent_marked; ++j) parent_marked = mark[j] && pids[j] == ppids[i];
      if (parent_marked) {
        mark[i] = 1;
        total += cpu[i];
        changed = 1;
      }
    }
  }
  return total;
}

void bench_cpu_usage_now(bench_cpu_usage *out) {
  memset(out, 0, sizeof *out);
  out->wall = bench_now();
  const double hz = (double)sysconf(_SC_CLK_TCK);
  FILE *f = fopen("/proc/stat", "r");
  if (f) {
    unsigned long long user = 0, nice = 0, sys = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
    if (fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &user, &nice, &sys, &idle, &iowait, &irq, &softirq,
               &steal) == 8) {
      out->busy_all = (double)(user + nice + sys + irq + softirq) / hz;
      out->steal = (double)steal / hz;
    }
    fclose(f);
  }
  out->self = descendants_cpu_seconds();
  struct rusage self, children;
  getrusage(RUSAGE_SELF, &self);
  getrusage(RUSAGE_CHILDREN, &children);
  out->self += (double)self.ru_utime.tv_sec + 1e-6 * (double)self.ru_utime.tv_usec + (double)self.ru_stime.tv_sec +
              1e-6 * (double)self.ru_stime.tv_usec + (double)children.ru_utime.tv_sec +
              1e-6 * (double)children.ru_utime.tv_usec + (double)children.ru_stime.tv_sec +
              1e-6 * (double)children.ru_stime.tv_usec;
}

double bench_others_share(const bench_cpu_usage *begin, const bench_cpu_usage *end, int ncpu) {
  const double wall = end->wall - begin->wall;
  if (wall <= 0 || ncpu <= 0) return 0.0;
  double others = (end->busy_all - begin->busy_all) - (end->self - begin->self);
  return others > 0 ? others / (wall * ncpu) : 0.0;
}

void bench_print_cpu_usage(FILE *f, const bench_cpu_usage *begin, const bench_cpu_usage *end, int ncpu) {
  const double wall = end->wall - begin->wall;
  if (wall <= 0 || ncpu <= 0) return;
  const double others = bench_others_share(begin, end, ncpu);
  const double steal = end->steal - begin->steal;
  fprintf(f, "during the run (%.1f s): other processes used %.1f%% of the %d CPUs; hypervisor steal %.1f%%%s\n", wall,
          100.0 * others, ncpu, 100.0 * steal / (wall * ncpu),
          others > 0.05 ? "  <-- figures are disturbed where marked; rerun on a quiet machine" : "");
}

uint64_t bench_next_u64(uint64_t *state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

float bench_uniform(uint64_t *state) { return (float)((double)(bench_next_u64(state) >> 11) * (1.0 / 9007199254740992.0)); }

int bench_run_torch_anchor(const char *command, bench_torch_figure *figs, int cap, char *version, size_t version_cap) {
  FILE *p = popen(command, "r");
  if (!p) return 0;
  char line[1024];
  int got = 0;
  while (fgets(line, sizeof line, p)) {
    bench_torch_figure f;
    int steps = 0;
    if (sscanf(line, "cpu_anchor threads=%d batch=%d median_ms=%lf steps=%d min_ms=%lf", &f.threads, &f.batch,
               &f.median_s, &steps, &f.min_s) == 5) {
      f.median_s *= 1e-3;
      f.min_s *= 1e-3;
      if (got < cap) figs[got++] = f;
    } else if (!strncmp(line, "cpu_anchor ", 11)) {
      line[strcspn(line, "\n")] = 0;
      snprintf(version, version_cap, "%s", line + 11);
    } else {
      fputs("    torch_anchor: ", stdout);
      fputs(line, stdout);
    }
  }
  pclose(p);
  return got;
}
