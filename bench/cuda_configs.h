/* The models and batches of the GPU training benchmark (issue 7, section 8), shared by bench_cuda_train.c and
 * bench_cuda_gemms.cpp; bench/torch_anchor.py repeats them, and the programs' JSON files name each configuration by
 * model name and batch so that bench_cuda_train --torch/--gemms can join them. */
#ifndef DPAR_BENCH_CUDA_CONFIGS_H
#define DPAR_BENCH_CUDA_CONFIGS_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { kBenchMaxLayers = 8, kBenchMaxBatches = 16 };

/* An MLP of Linear layers sizes[0] -> sizes[1] -> ... -> sizes[nlayers], ReLU between them, none after the last. */
typedef struct bench_mlp {
  const char *name;
  int nlayers;
  int64_t sizes[kBenchMaxLayers + 1];
  int nbatches;
  int64_t batches[kBenchMaxBatches];
} bench_mlp;

static const bench_mlp kBenchMlps[2] = {
    {"demo", 3, {784, 256, 128, 10}, 3, {128, 1024, 8192}},
    {"wide", 4, {784, 4096, 4096, 4096, 10}, 3, {256, 1024, 8192}},
};

/* Parses "128,1024,8192" into out (at most kBenchMaxBatches positive values); returns how many, or -1. */
static inline int bench_parse_batches(const char *text, int64_t *out) {
  int n = 0;
  const char *p = text;
  while (*p) {
    char *end = NULL;
    const long long v = strtoll(p, &end, 10);
    if (end == p || v < 1 || n == kBenchMaxBatches) return -1;
    out[n++] = (int64_t)v;
    p = end;
    if (*p == ',') ++p;
    else if (*p) return -1;
  }
  return n > 0 ? n : -1;
}

#endif
