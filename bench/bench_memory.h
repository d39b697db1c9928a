/* What a timed engine's replicas hold on their devices (dpar_engine_memory_stats), for the C benchmarks: each
 * replica's peak is reset after the warm-up steps, and read with what is held after the timed steps, so that an
 * f32 and a bf16 run (--precision) show what the precision policy keeps and saves. The count is the device's: dpar's
 * tensors there (parameters, gradients, optimizer state, activations, scratch, and the benchmark's own batches on
 * replica 0's device), not oneDNN's or cuBLAS's workspaces. */
#ifndef DPAR_BENCH_MEMORY_H
#define DPAR_BENCH_MEMORY_H

#include <stdint.h>
#include <stdio.h>

#include "bench_check.h"

enum { kBenchMemoryReplicas = 16 };

typedef struct bench_memory {
  size_t replicas;                    /* 0 until read */
  int64_t held[kBenchMemoryReplicas]; /* bytes held after the timed steps */
  int64_t peak[kBenchMemoryReplicas]; /* the most held at once during them */
} bench_memory;

/* Before the timed steps: every replica's device's peak starts again from what it holds. */
static inline void bench_memory_reset(dpar_engine *e) {
  size_t n = 0;
  CHECK(dpar_engine_num_replicas(&n, e));
  for (size_t r = 0; r < n; ++r) CHECK(dpar_engine_reset_peak_memory(e, r));
}

/* After them, before the engine is freed. */
static inline void bench_memory_read(bench_memory *m, const dpar_engine *e) {
  size_t n = 0;
  CHECK(dpar_engine_num_replicas(&n, e));
  m->replicas = n < kBenchMemoryReplicas ? n : kBenchMemoryReplicas;
  for (size_t r = 0; r < m->replicas; ++r) CHECK(dpar_engine_memory_stats(&m->held[r], &m->peak[r], e, r));
}

/* One line under a benchmark's table: "    <label> | held / peak per replica: 1.234 / 2.345 MiB, ...". */
static inline void bench_memory_print(const char *label, const bench_memory *m) {
  if (m->replicas == 0) return;
  printf("    %-20s | MiB held after the timed steps / peak during them, per replica:", label);
  for (size_t r = 0; r < m->replicas; ++r)
    printf("%s %.3f / %.3f", r ? "," : "", (double)m->held[r] / 1048576.0, (double)m->peak[r] / 1048576.0);
  printf("\n");
}

#endif
