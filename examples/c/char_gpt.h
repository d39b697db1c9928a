/* nanoGPT's GPT built through dpar's C ABI, node by node with nanoGPT's module names, and its weight initialisation:
 * the model of train_char_gpt and bench_gpt. Each call exits the program with a message on failure (CHECK). */
#ifndef DPAR_EXAMPLES_CHAR_GPT_H
#define DPAR_EXAMPLES_CHAR_GPT_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dpar.h"

#ifndef CHECK
#define CHECK(call)                                                                         \
  do {                                                                                      \
    dpar_status s_ = (call);                                                                \
    if (s_ != DPAR_OK) {                                                                    \
      fprintf(stderr, "%s failed: %s: %s\n", #call, dpar_status_str(s_), dpar_last_error()); \
      exit(1);                                                                              \
    }                                                                                       \
  } while (0)
#endif

/* splitmix64: the example's own random numbers (batch offsets, initial weights, sampling). */
static inline uint64_t gpt_next_u64(uint64_t *state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}
static inline double gpt_next_uniform(uint64_t *state) { return (double)(gpt_next_u64(state) >> 11) * 0x1p-53; }
static inline double gpt_next_normal(uint64_t *state) {
  const double u1 = 1.0 - gpt_next_uniform(state), u2 = gpt_next_uniform(state);
  return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

typedef struct {
  int64_t vocab, block, layers, heads, embd;
  float dropout;
} gpt_config;

static inline void gpt_set_name(dpar_model *m, const char *fmt, int64_t layer) {
  char name[128];
  snprintf(name, sizeof name, fmt, (long long)layer);
  int32_t node = 0;
  CHECK(dpar_model_last_node(&node, m));
  CHECK(dpar_model_set_node_name(m, node, name));
}

/* nanoGPT's GPT, node by node, with its module names: transformer.wte, transformer.wpe, transformer.h.<i>.ln_1,
 * .attn.c_attn, .attn.c_proj, .ln_2, .mlp.c_fc, .mlp.c_proj, transformer.ln_f, lm_head (tied to wte). */
static inline dpar_model *gpt_build(const gpt_config *c, uint64_t seed) {
  dpar_model_options opts = DPAR_MODEL_OPTIONS_INIT;
  opts.seed = seed;
  dpar_model *m = NULL;
  CHECK(dpar_model_create(&m, &opts));
  CHECK(dpar_model_add_embedding(m, c->vocab, c->embd)); /* (B, T) bytes -> (B, T, C) */
  gpt_set_name(m, "transformer.wte", 0);
  const int32_t wte = 0;
  CHECK(dpar_model_add_position_embedding(m, c->block, c->embd));
  gpt_set_name(m, "transformer.wpe", 0);
  if (c->dropout > 0.0f) CHECK(dpar_model_add_dropout(m, c->dropout));
  int32_t x = 0;
  CHECK(dpar_model_last_node(&x, m));
  for (int64_t l = 0; l < c->layers; ++l) {
    char prefix[64];
    int32_t y = 0, sum[2];
    /* x = x + attn(ln_1(x)) */
    CHECK(dpar_model_branch_from(m, x));
    CHECK(dpar_model_add_layernorm(m, c->embd, 1e-5f, 1));
    gpt_set_name(m, "transformer.h.%lld.ln_1", l);
    snprintf(prefix, sizeof prefix, "transformer.h.%lld.attn", (long long)l);
    CHECK(dpar_model_add_causal_self_attention(m, c->embd, c->heads, c->dropout, 1, prefix));
    CHECK(dpar_model_last_node(&y, m));
    sum[0] = x, sum[1] = y;
    CHECK(dpar_model_add_sum(m, sum, 2));
    CHECK(dpar_model_last_node(&x, m));
    /* x = x + mlp(ln_2(x)) */
    CHECK(dpar_model_add_layernorm(m, c->embd, 1e-5f, 1));
    gpt_set_name(m, "transformer.h.%lld.ln_2", l);
    CHECK(dpar_model_add_linear(m, c->embd, 4 * c->embd, 1));
    gpt_set_name(m, "transformer.h.%lld.mlp.c_fc", l);
    CHECK(dpar_model_add_activation(m, DPAR_GELU));
    CHECK(dpar_model_add_linear(m, 4 * c->embd, c->embd, 1));
    gpt_set_name(m, "transformer.h.%lld.mlp.c_proj", l);
    if (c->dropout > 0.0f) CHECK(dpar_model_add_dropout(m, c->dropout));
    CHECK(dpar_model_last_node(&y, m));
    sum[0] = x, sum[1] = y;
    CHECK(dpar_model_add_sum(m, sum, 2));
    CHECK(dpar_model_last_node(&x, m));
  }
  CHECK(dpar_model_add_layernorm(m, c->embd, 1e-5f, 1));
  gpt_set_name(m, "transformer.ln_f", 0);
  CHECK(dpar_model_add_linear(m, c->embd, c->vocab, 0)); /* (B, T, C) -> (B, T, V) logits */
  gpt_set_name(m, "lm_head", 0);
  int32_t head = 0;
  CHECK(dpar_model_last_node(&head, m));
  CHECK(dpar_model_tie_param(m, head, "weight", wte, "weight"));
  return m;
}

/* nanoGPT's _init_weights: every Linear's and Embedding's weight from N(0, 0.02), biases zero (LayerNorms keep ones
 * and zeros), then the residual projections (c_proj) from N(0, 0.02 / sqrt(2 L)). */
static inline void gpt_init_like_nanogpt(dpar_model *m, const gpt_config *c, uint64_t seed) {
  size_t n = 0;
  CHECK(dpar_model_num_params(&n, m));
  uint64_t rng = seed ^ 0x5DEECE66DULL;
  for (size_t i = 0; i < n; ++i) {
    const char *name = dpar_model_param_name(m, i);
    if (!name) CHECK(DPAR_ERR_INTERNAL);
    if (strstr(name, "ln_")) continue;
    int64_t shape[DPAR_MAX_DIMS];
    size_t ndim = 0, count = 1;
    CHECK(dpar_model_param_info(shape, &ndim, m, i));
    for (size_t d = 0; d < ndim; ++d) count *= (size_t)shape[d];
    float *values = (float *)malloc(count * sizeof(float));
    if (!values) CHECK(DPAR_ERR_OUT_OF_MEMORY);
    const size_t len = strlen(name);
    const int bias = len > 5 && !strcmp(name + len - 5, ".bias");
    const double std = strstr(name, "c_proj.weight") ? 0.02 / sqrt(2.0 * (double)c->layers) : 0.02;
    for (size_t k = 0; k < count; ++k) values[k] = bias ? 0.0f : (float)(std * gpt_next_normal(&rng));
    CHECK(dpar_model_set_param(m, i, values, count));
    free(values);
  }
}

#endif /* DPAR_EXAMPLES_CHAR_GPT_H */
