/* Helpers shared by the benchmarks (C, so that both the C and the C++ programs use them): clocks, medians,
 * thread pinning, the core-to-core latency probe that tells where the host placed the two vCPUs, and a CPU-use
 * account that says whether something else ran on the machine during a measurement. */
#ifndef DPAR_BENCH_UTIL_H
#define DPAR_BENCH_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Monotonic time in seconds. */
double bench_now(void);

/* Synthetic data: a splitmix64 stream (one state per caller), and floats uniform in [0, 1) drawn from it. */
uint64_t bench_next_u64(uint64_t *state);
float bench_uniform(uint64_t *state);
/** The median of v[0..n) (sorts v in place); 0 for n = 0. */
double bench_median(double *v, size_t n);
/** The q-quantile (0..1) of v[0..n) after bench_median() sorted it (nearest rank). */
double bench_quantile_sorted(const double *v, size_t n, double q);

/** The CPUs this process may run on, ascending; returns how many (at most capacity). */
int bench_allowed_cpus(int *cpus, int capacity);
/** Pins the calling thread to one CPU. Returns 0 or an errno value. */
int bench_pin_self(int cpu);
/** Restores the calling thread's affinity to all allowed CPUs. */
void bench_unpin_self(void);

/** The one-way core-to-core latency in ns between cpu_a and cpu_b: two threads pinned there ping-pong a cache
 *  line; the median of several runs. Negative if the threads could not be pinned. Takes about 2 ms. */
double bench_core_latency_ns(int cpu_a, int cpu_b);
/** The placement class of a one-way latency: "SMT siblings", "shared L3" or "far (other L3)". */
const char *bench_placement_class(double ns);
/** A short tag of the class ("smt", "L3", "far"). */
const char *bench_placement_tag(double ns);

/** Prints the machine: CPU model, allowed CPUs, caches, load average. */
void bench_print_machine(FILE *f);

/** A snapshot of CPU use, to account after a run for the CPU time other processes took. */
typedef struct bench_cpu_usage {
  double wall;        /* seconds */
  double busy_all;    /* CPU-seconds busy on the machine (user, nice, system, irq, softirq) */
  double steal;       /* CPU-seconds the hypervisor stole */
  double self;        /* CPU-seconds of this process and its waited-for children */
} bench_cpu_usage;
void bench_cpu_usage_now(bench_cpu_usage *out);
/** The share (0..1) of the allowed CPUs that other processes used between two snapshots. */
double bench_others_share(const bench_cpu_usage *begin, const bench_cpu_usage *end, int ncpu);
/** Prints what other processes used between two snapshots (as a share of the allowed CPUs) and the steal. */
void bench_print_cpu_usage(FILE *f, const bench_cpu_usage *begin, const bench_cpu_usage *end, int ncpu);

/** One figure of torch_anchor.py's step anchor, a line "cpu_anchor threads=T batch=B median_ms=M steps=N
 *  min_ms=S" (bench_train's part (e), bench_cnn). */
typedef struct bench_torch_figure {
  int threads, batch;
  double median_s, min_s; /* seconds per step */
} bench_torch_figure;
/** Runs `command` (torch_anchor.py with its arguments, through the shell, in a process of its own so that
 *  PyTorch's threads are gone when it returns) and reads its figures into figs (at most cap; the count is
 *  returned, 0 when it could not start); its "cpu_anchor ..." version line goes to version, and every other line
 *  it prints to stdout after "    torch_anchor: ". */
int bench_run_torch_anchor(const char *command, bench_torch_figure *figs, int cap, char *version, size_t version_cap);

#ifdef __cplusplus
}
#endif

#endif
