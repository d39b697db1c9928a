/* Trains a small character-level GPT (nanoGPT's model: token and position embeddings, pre-LayerNorm blocks of causal
 * self-attention and a GELU MLP, a final LayerNorm and a language-model head tied to the token embedding) on a text
 * corpus that Debian ships, over every available device with dpar's DataParallel engine, then samples text from it.
 *
 *   train_char_gpt [--data FILE|DIR] [--device auto|cuda|cpu] [--devices N] [--steps S] [--eval-every K]
 *                  [--batch-size B] [--block T] [--layers L] [--heads H] [--embd C] [--dropout P] [--lr LR]
 *                  [--seed S] [--checkpoint PATH] [--max-val-loss X] [--sample N] [--eval-batches E]
 *                  [--precision f32|bf16]
 *
 * The corpus is every plain file of /usr/share/games/fortunes (Debian's `fortunes` and `fortunes-min` packages,
 * about 2.5 MB of quotations) in name order, or the file (or the directory's plain files) given by --data. Its
 * distinct bytes are the vocabulary, as nanoGPT's shakespeare_char takes the distinct characters; the first 90% is
 * the training text, the rest the validation text. A batch is B windows of T + 1 bytes at random offsets (the same
 * draw in every process: under mpirun each process takes its rows of the global batch); the targets are the inputs
 * shifted by one. Every --eval-every steps it prints the training loss (the mean of those steps), the validation
 * loss (the mean over --eval-batches fixed batches of the validation text, in eval mode) and the tokens per second;
 * at the end it samples --sample bytes from the model (rank 0: a forward in eval mode on the growing prefix, the
 * last position's softmax at temperature 0.8) and saves a checkpoint whose names are nanoGPT's state_dict keys.
 * With --max-val-loss it exits 1 if the final validation loss is higher.
 *
 * AdamW (lr 3e-3 by default, betas 0.9 and 0.99, weight decay 0.1 on the matrices only, as nanoGPT's
 * configure_optimizers), a cosine learning rate after a linear warm-up, gradients clipped to norm 1; the weights
 * initialised as nanoGPT's _init_weights (normal with std 0.02; the residual projections 0.02 / sqrt(2 L)). */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <dirent.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "char_gpt.h"
#include "dpar.h"

static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void *xmalloc(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) {
    fprintf(stderr, "out of memory (%zu bytes)\n", bytes);
    exit(1);
  }
  return p;
}

/* ---- The corpus ---------------------------------------------------------------------------------------------- */

typedef struct {
  unsigned char *bytes;
  size_t size, capacity;
} text;

static void append_file(text *t, const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "cannot open %s\n", path);
    exit(1);
  }
  unsigned char buffer[1 << 16];
  size_t n;
  while ((n = fread(buffer, 1, sizeof buffer, f)) > 0) {
    if (t->size + n > t->capacity) {
      t->capacity = 2 * (t->size + n);
      unsigned char *grown = realloc(t->bytes, t->capacity);
      if (!grown) {
        fprintf(stderr, "out of memory reading %s\n", path);
        exit(1);
      }
      t->bytes = grown;
    }
    memcpy(t->bytes + t->size, buffer, n);
    t->size += n;
  }
  fclose(f);
}

static int compare_names(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* A file, or a directory's regular files in name order, leaving out fortune's index files (.dat) and the links to
 * UTF-8 copies (.u8). */
static text load_corpus(const char *path) {
  text t = {NULL, 0, 0};
  struct stat st;
  if (stat(path, &st) != 0) {
    fprintf(stderr, "%s not found: install Debian's fortunes packages (apt-get install fortunes fortunes-min) or "
                    "pass --data FILE\n", path);
    exit(1);
  }
  if (!S_ISDIR(st.st_mode)) {
    append_file(&t, path);
    return t;
  }
  DIR *dir = opendir(path);
  if (!dir) {
    fprintf(stderr, "cannot read the directory %s\n", path);
    exit(1);
  }
  char **names = NULL;
  size_t count = 0;
  for (struct dirent *e; (e = readdir(dir)) != NULL;) {
    const size_t len = strlen(e->d_name);
    if (e->d_name[0] == '.' || (len > 4 && !strcmp(e->d_name + len - 4, ".dat")) ||
        (len > 3 && !strcmp(e->d_name + len - 3, ".u8")))
      continue;
    char **grown = realloc(names, (count + 1) * sizeof *names);
    if (!grown) exit(1);
    names = grown;
    names[count] = xmalloc(strlen(path) + len + 2);
    sprintf(names[count], "%s/%s", path, e->d_name);
    if (stat(names[count], &st) == 0 && S_ISREG(st.st_mode))
      ++count;
    else
      free(names[count]);
  }
  closedir(dir);
  qsort(names, count, sizeof *names, compare_names);
  for (size_t i = 0; i < count; ++i) {
    append_file(&t, names[i]);
    free(names[i]);
  }
  free(names);
  return t;
}

/* ---- Batches ------------------------------------------------------------------------------------------------- */

/* Rows [first, first + rows) of a global batch of `batch` windows at offsets drawn from `rng` (every process draws
 * the whole batch's offsets and keeps its rows). x and y: (rows, T) token ids, y shifted by one. */
static void draw_batch(int32_t *x, int32_t *y, const int32_t *tokens, size_t n_tokens, size_t batch, size_t first,
                       size_t rows, int64_t T, uint64_t *rng) {
  for (size_t b = 0; b < batch; ++b) {
    const size_t offset = (size_t)(gpt_next_u64(rng) % (uint64_t)(n_tokens - (size_t)T - 1));
    if (b < first || b >= first + rows) continue;
    const size_t r = b - first;
    memcpy(x + r * (size_t)T, tokens + offset, (size_t)T * sizeof(int32_t));
    memcpy(y + r * (size_t)T, tokens + offset + 1, (size_t)T * sizeof(int32_t));
  }
}

/* The mean loss over `batches` fixed batches of the validation text, in eval mode: the engine's forward gives the
 * logits, and the cross-entropy is computed here (log-sum-exp per position), as PyTorch's F.cross_entropy would. */
static double validation_loss(dpar_engine *engine, const int32_t *tokens, size_t n_tokens, size_t batch, int64_t T,
                              int64_t V, size_t batches) {
  CHECK(dpar_engine_set_training(engine, 0));
  int32_t *x = xmalloc(batch * (size_t)T * sizeof(int32_t)), *y = xmalloc(batch * (size_t)T * sizeof(int32_t));
  float *logits = xmalloc(batch * (size_t)T * (size_t)V * sizeof(float));
  uint64_t rng = 1234567; /* the same validation batches every time */
  double total = 0.0;
  size_t count = 0;
  for (size_t k = 0; k < batches; ++k) {
    draw_batch(x, y, tokens, n_tokens, batch, 0, batch, T, &rng);
    const int64_t shape[2] = {(int64_t)batch, T};
    dpar_tensor *input = NULL, *out = NULL;
    CHECK(dpar_tensor_wrap_host(&input, DPAR_I32, shape, 2, x));
    CHECK(dpar_engine_forward(&out, engine, input));
    CHECK(dpar_tensor_copy_to_host(logits, out, batch * (size_t)T * (size_t)V * sizeof(float)));
    for (size_t p = 0; p < batch * (size_t)T; ++p) {
      const float *row = logits + p * (size_t)V;
      float max = row[0];
      for (int64_t v = 1; v < V; ++v) max = row[v] > max ? row[v] : max;
      double sum = 0.0;
      for (int64_t v = 0; v < V; ++v) sum += exp((double)(row[v] - max));
      total += log(sum) + (double)max - (double)row[y[p]];
      ++count;
    }
    dpar_tensor_free(out);
    dpar_tensor_free(input);
  }
  free(x);
  free(y);
  free(logits);
  CHECK(dpar_engine_set_training(engine, 1));
  return total / (double)count;
}

/* `n` bytes sampled after a newline: each step a forward in eval mode on the last T bytes (one sequence), the next
 * byte drawn from the last position's softmax at `temperature`. No key/value cache: the whole prefix each time. */
static void sample_text(dpar_engine *engine, const unsigned char *vocab, int64_t V, int64_t T, size_t n,
                        double temperature, uint64_t seed) {
  CHECK(dpar_engine_set_training(engine, 0));
  int32_t *context = xmalloc((n + 1) * sizeof(int32_t));
  float *logits = xmalloc((size_t)T * (size_t)V * sizeof(float));
  double *p = xmalloc((size_t)V * sizeof(double));
  size_t len = 0;
  for (int64_t v = 0; v < V; ++v)
    if (vocab[v] == '\n') context[len++] = (int32_t)v;
  if (len == 0) context[len++] = 0;
  uint64_t rng = seed;
  for (size_t i = 0; i < n; ++i) {
    const size_t start = len > (size_t)T ? len - (size_t)T : 0, t = len - start;
    const int64_t shape[2] = {1, (int64_t)t};
    dpar_tensor *input = NULL, *out = NULL;
    CHECK(dpar_tensor_wrap_host(&input, DPAR_I32, shape, 2, context + start));
    CHECK(dpar_engine_forward(&out, engine, input));
    CHECK(dpar_tensor_copy_to_host(logits, out, t * (size_t)V * sizeof(float)));
    const float *last = logits + (t - 1) * (size_t)V;
    double max = last[0], sum = 0.0;
    for (int64_t v = 1; v < V; ++v) max = last[v] > max ? last[v] : max;
    for (int64_t v = 0; v < V; ++v) sum += p[v] = exp(((double)last[v] - max) / temperature);
    double u = gpt_next_uniform(&rng) * sum;
    int64_t next = V - 1;
    for (int64_t v = 0; v < V; ++v) {
      if (u < p[v]) {
        next = v;
        break;
      }
      u -= p[v];
    }
    context[len++] = (int32_t)next;
    putchar(vocab[next]);
    dpar_tensor_free(out);
    dpar_tensor_free(input);
  }
  putchar('\n');
  free(context);
  free(logits);
  free(p);
  CHECK(dpar_engine_set_training(engine, 1));
}

int main(int argc, char **argv) {
  const char *data = "/usr/share/games/fortunes", *device = "auto", *checkpoint = "char_gpt.safetensors";
  const char *precision = "f32";
  size_t devices = 0, steps = 1500, eval_every = 250, batch = 32, sample = 400, eval_batches = 8;
  gpt_config cfg = {0, 128, 4, 4, 128, 0.0f};
  float lr = 3e-3f;
  unsigned long long seed = 0;
  double max_val_loss = 0.0;
  for (int i = 1; i < argc; ++i) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      printf("usage: %s [--data FILE|DIR] [--device auto|cuda|cpu] [--devices N] [--steps S] [--eval-every K]\n"
             "          [--batch-size B] [--block T] [--layers L] [--heads H] [--embd C] [--dropout P] [--lr LR]\n"
             "          [--seed S] [--checkpoint PATH] [--max-val-loss X] [--sample N] [--eval-batches E]\n"
             "          [--precision f32|bf16]\n",
             argv[0]);
      return 0;
    }
    if (!v) {
      fprintf(stderr, "%s: %s needs a value (see --help)\n", argv[0], a);
      return 2;
    }
    if (!strcmp(a, "--data")) data = v;
    else if (!strcmp(a, "--device")) device = v;
    else if (!strcmp(a, "--devices")) devices = strtoul(v, NULL, 10);
    else if (!strcmp(a, "--steps")) steps = strtoul(v, NULL, 10);
    else if (!strcmp(a, "--eval-every")) eval_every = strtoul(v, NULL, 10);
    else if (!strcmp(a, "--batch-size")) batch = strtoul(v, NULL, 10);
    else if (!strcmp(a, "--block")) cfg.block = strtoll(v, NULL, 10);
    else if (!strcmp(a, "--layers")) cfg.layers = strtoll(v, NULL, 10);
    else if (!strcmp(a, "--heads")) cfg.heads = strtoll(v, NULL, 10);
    else if (!strcmp(a, "--embd")) cfg.embd = strtoll(v, NULL, 10);
    else if (!strcmp(a, "--dropout")) cfg.dropout = strtof(v, NULL);
    else if (!strcmp(a, "--lr")) lr = strtof(v, NULL);
    else if (!strcmp(a, "--seed")) seed = strtoull(v, NULL, 10);
    else if (!strcmp(a, "--checkpoint")) checkpoint = v;
    else if (!strcmp(a, "--precision")) precision = v;
    else if (!strcmp(a, "--max-val-loss")) max_val_loss = strtod(v, NULL);
    else if (!strcmp(a, "--sample")) sample = strtoul(v, NULL, 10);
    else if (!strcmp(a, "--eval-batches")) eval_batches = strtoul(v, NULL, 10);
    else {
      fprintf(stderr, "%s: unknown option %s (see --help)\n", argv[0], a);
      return 2;
    }
    ++i;
  }
  if (steps == 0 || eval_every == 0 || batch == 0 || cfg.block < 1 || cfg.layers < 1) {
    fprintf(stderr, "%s: --steps, --eval-every, --batch-size, --block and --layers must be positive\n", argv[0]);
    return 2;
  }

  /* The corpus, its vocabulary (the distinct bytes, in byte order) and the two splits as token ids. */
  text corpus = load_corpus(data);
  int present[256] = {0};
  for (size_t i = 0; i < corpus.size; ++i) present[corpus.bytes[i]] = 1;
  unsigned char vocab[256];
  int32_t id_of[256];
  for (int b = 0; b < 256; ++b)
    if (present[b]) vocab[cfg.vocab] = (unsigned char)b, id_of[b] = (int32_t)cfg.vocab++;
  int32_t *tokens = xmalloc(corpus.size * sizeof(int32_t));
  for (size_t i = 0; i < corpus.size; ++i) tokens[i] = id_of[corpus.bytes[i]];
  const size_t n_train = corpus.size * 9 / 10, n_val = corpus.size - n_train;
  if (n_val <= (size_t)cfg.block + 1) {
    fprintf(stderr, "%s: the corpus (%zu bytes) is too short for windows of %lld\n", argv[0], corpus.size,
            (long long)cfg.block);
    return 1;
  }

  /* The GPUs when there are any (auto) or when asked for (cuda). */
  size_t gpus = 0;
  int use_cuda = 0;
  if (!strcmp(device, "cuda")) {
    CHECK(dpar_device_count(&gpus, DPAR_DEVICE_CUDA));
    if (gpus == 0) {
      fprintf(stderr, "%s: --device cuda: no CUDA device\n", argv[0]);
      return 1;
    }
    use_cuda = 1;
  } else if (!strcmp(device, "auto")) {
    use_cuda = dpar_device_count(&gpus, DPAR_DEVICE_CUDA) == DPAR_OK && gpus > 0;
  } else if (strcmp(device, "cpu")) {
    fprintf(stderr, "%s: --device must be auto, cuda or cpu\n", argv[0]);
    return 2;
  }
  if (devices == 0) {
    if (use_cuda) devices = gpus;
    else CHECK(dpar_device_count(&devices, DPAR_DEVICE_CPU));
  }

  dpar_model *model = gpt_build(&cfg, seed);
  gpt_init_like_nanogpt(model, &cfg, seed);
  size_t n_params = 0;
  CHECK(dpar_model_num_param_elements(&n_params, model));

  dpar_optimizer_options oopts = DPAR_OPTIMIZER_OPTIONS_INIT;
  oopts.kind = DPAR_ADAMW;
  oopts.lr = lr;
  oopts.beta2 = 0.99f;
  oopts.weight_decay = 0.1f;
  dpar_engine_options eopts = DPAR_ENGINE_OPTIONS_INIT;
  int32_t *device_ids = NULL;
  if (use_cuda) {
    device_ids = xmalloc(devices * sizeof *device_ids);
    for (size_t i = 0; i < devices; ++i) device_ids[i] = (int32_t)(i % gpus);
    eopts.device_kind = DPAR_DEVICE_CUDA;
    eopts.device_ids = device_ids;
    eopts.num_device_ids = devices;
  } else {
    eopts.num_cpu_devices = devices;
  }
  eopts.seed = seed;
  dpar_engine *engine = NULL;
  CHECK(dpar_engine_create(&engine, model, &oopts, &eopts));
  dpar_model_free(model);
  free(device_ids);
  /* nanoGPT decays the matrices only: biases and LayerNorms' weights go without (the embeddings decay). */
  CHECK(dpar_engine_set_weight_decay_exclusion(engine, 1));
  CHECK(dpar_engine_set_max_grad_norm(engine, 1.0f));
  /* bf16: the linear layers (every GEMM but attention's) on bf16 operands with f32 accumulation; the rest f32. */
  if (!strcmp(precision, "bf16")) {
    CHECK(dpar_engine_set_precision(engine, DPAR_BF16));
  } else if (strcmp(precision, "f32")) {
    fprintf(stderr, "%s: --precision must be f32 or bf16\n", argv[0]);
    return 2;
  }
  size_t rank = 0, nproc = 1;
  CHECK(dpar_engine_processes(&rank, &nproc, engine));
  const int root = rank == 0;
  if (root)
    printf("dpar %s: GPT of %lld layers, %lld heads, %lld channels, context %lld, vocabulary %lld bytes: %.2fM "
           "parameters; %zu train / %zu validation bytes of %s; batch %zu x %lld tokens over %zu process%s x %zu %s\n",
           dpar_version_string(), (long long)cfg.layers, (long long)cfg.heads, (long long)cfg.embd,
           (long long)cfg.block, (long long)cfg.vocab, (double)n_params / 1e6, n_train, n_val, data, batch,
           (long long)cfg.block, nproc, nproc > 1 ? "es" : "", devices, use_cuda ? "replicas on GPUs" : "CPU devices");
  if (root) fflush(stdout);

  /* This process's rows of each global batch: as even as DataParallel splits them. */
  const size_t first = batch * rank / nproc, rows = batch * (rank + 1) / nproc - first;
  int32_t *x = xmalloc((rows ? rows : 1) * (size_t)cfg.block * sizeof(int32_t));
  int32_t *y = xmalloc((rows ? rows : 1) * (size_t)cfg.block * sizeof(int32_t));
  const int64_t shape[2] = {(int64_t)rows, cfg.block};
  dpar_tensor *input = NULL, *target = NULL;
  CHECK(dpar_tensor_wrap_host(&input, DPAR_I32, shape, 2, x));
  CHECK(dpar_tensor_wrap_host(&target, DPAR_I32, shape, 2, y));
  uint64_t rng = seed * 0x9E3779B97F4A7C15ULL + 1;
  const size_t warmup = steps / 20;
  double val = 0.0, loss_sum = 0.0, t0 = now_seconds(), start = t0;
  size_t since = 0;
  for (size_t step = 1; step <= steps; ++step) {
    draw_batch(x, y, tokens, n_train, batch, first, rows, cfg.block, &rng);
    const double progress = (double)(step - 1) / (double)steps;
    const double scale = step <= warmup ? (double)step / (double)warmup : 0.5 * (1.0 + cos(3.14159265358979 * progress));
    CHECK(dpar_engine_set_lr(engine, (float)(lr * (0.1 + 0.9 * scale))));
    float loss = 0.0f; /* the mean over every token of the global batch */
    CHECK(dpar_engine_train_step(&loss, engine, input, target));
    loss_sum += loss;
    ++since;
    if (step % eval_every && step != steps) continue;
    const double seconds = now_seconds() - t0;
    /* forward() is local: rank 0 evaluates alone, the parameters being the same in every process */
    if (root) {
      val = validation_loss(engine, tokens + n_train, n_val, batch, cfg.block, cfg.vocab, eval_batches);
      printf("step %5zu  train loss %.4f  val loss %.4f  %.0f tokens/s  (%.0f s)\n", step, loss_sum / (double)since,
             val, (double)(since * batch * (size_t)cfg.block) / seconds, now_seconds() - start);
      fflush(stdout);
    }
    loss_sum = 0.0;
    since = 0;
    t0 = now_seconds();
  }
  CHECK(dpar_engine_save(engine, checkpoint)); /* every process calls it; rank 0 writes */
  if (root) {
    printf("saved %s\n", checkpoint);
    if (sample > 0) {
      printf("---- %zu sampled bytes ----\n", sample);
      sample_text(engine, vocab, cfg.vocab, cfg.block, sample, 0.8, seed + 7);
    }
  }
  dpar_tensor_free(input);
  dpar_tensor_free(target);
  dpar_engine_free(engine);
  free(x);
  free(y);
  free(tokens);
  free(corpus.bytes);
  if (root && max_val_loss > 0.0 && !(val <= max_val_loss)) {
    fprintf(stderr, "validation loss %.4f is above the required %.4f\n", val, max_val_loss);
    return 1;
  }
  return 0;
}
