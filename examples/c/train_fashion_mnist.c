/* Trains a model on Fashion-MNIST over every available device with dpar's DataParallel engine: an MLP
 * 784-256-128-10 (train_fashion_mnist), or a small residual CNN (train_fashion_mnist_cnn, or --model cnn):
 * convolutions, BatchNorm, max pooling and one ResNet basic block, named as torchvision's ResNet names its modules
 * (fashion_cnn.h).
 *
 *   train_fashion_mnist [--model mlp|cnn] [--device auto|cuda|cpu] [--devices N] [--epochs E] [--batch-size B]
 *                       [--lr LR] [--optimizer adam|sgd] [--data DIR] [--checkpoint PATH] [--seed S]
 *                       [--min-accuracy PCT] [--trace PATH] [--gradient-compression none|bf16]
 *                       [--sync-batchnorm] [--steps-per-epoch N] [--precision f32|bf16]
 *
 * --sync-batchnorm normalises over the whole global batch (dpar_model_convert_sync_batchnorm, as
 * torch.nn.SyncBatchNorm.convert_sync_batchnorm) instead of each replica's chunk. --steps-per-epoch N ends each
 * epoch after N batches (of the epoch's shuffled order): a shortened run, for tests.
 *
 * --device auto (the default) trains over every GPU when dpar finds any, and over the CPU devices otherwise.
 * --devices N sets the number of replicas: CPU devices, or replicas spread over the GPUs in turn (with one GPU,
 * --devices 2 puts two replicas on it).
 *   mpirun -np P train_fashion_mnist ...
 *
 * Under mpirun the engine spans the P processes (each with its own devices: by default one per core it is bound
 * to): every process loads the data, takes its shard of each global batch (dpar_loader_shard), and rank 0 alone
 * prints, evaluates and writes the checkpoint. --batch-size is the global batch.
 *
 * The learning rate follows a cosine schedule from --lr down to zero over the run (dpar_engine_set_lr before each
 * step), as torch.optim.lr_scheduler.CosineAnnealingLR does per step.
 * Prints per-epoch train loss, test accuracy and samples per second, with a progress bar on a terminal, and
 * saves a checkpoint at the end. With --min-accuracy it exits 1 if the final test accuracy is lower. --trace PATH
 * writes a timeline of the first epoch's training steps (dpar_engine_trace_start; rank 0's), for ui.perfetto.dev.
 * --gradient-compression bf16 sends gradients between processes as bfloat16 (dpar_engine_set_gradient_compression;
 * no effect on one process). --precision bf16 runs the linear layers and convolutions on bf16 operands with f32
 * accumulation (dpar_engine_set_precision; master weights, the optimizer and the checkpoint stay f32). */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, isatty */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "dpar.h"
#include "fashion_cnn.h"

#define CHECK(call)                                                                         \
  do {                                                                                      \
    dpar_status s_ = (call);                                                                \
    if (s_ != DPAR_OK) {                                                                    \
      fprintf(stderr, "%s failed: %s: %s\n", #call, dpar_status_str(s_), dpar_last_error()); \
      exit(1);                                                                              \
    }                                                                                       \
  } while (0)

static double now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void progress(size_t done, size_t total, float loss) {
  const int width = 30;
  int filled = (int)((double)done / (double)total * width);
  fprintf(stderr, "\r  [%.*s%*s] %zu/%zu loss %.4f", filled, "==============================", width - filled, "",
          done, total, loss);
  if (done == total) fprintf(stderr, "\r%*s\r", width + 40, "");
}

/* Fraction of the dataset whose arg-max output equals its label, in eval mode. */
static double evaluate(dpar_engine *engine, const dpar_dataset *test, size_t batch) {
  dpar_loader *loader = NULL;
  CHECK(dpar_loader_create(&loader, test, batch, 0, 0, 0));
  CHECK(dpar_engine_set_training(engine, 0));
  size_t correct = 0, seen = 0, capacity = 0;
  float *logits = NULL;  // the gathered output, copied to the host (on a GPU engine it lives on the output GPU)
  for (;;) {
    int32_t more = 0;
    CHECK(dpar_loader_next(&more, loader));
    if (!more) break;
    const dpar_tensor *x = dpar_loader_inputs(loader), *y = dpar_loader_labels(loader);
    dpar_tensor *out = NULL;
    CHECK(dpar_engine_forward(&out, engine, x));
    int64_t shape[DPAR_MAX_DIMS];
    size_t ndim = 0;
    CHECK(dpar_tensor_shape(shape, &ndim, out, DPAR_MAX_DIMS));
    const size_t count = (size_t)(shape[0] * shape[1]);
    if (count > capacity) {
      float *grown = realloc(logits, count * sizeof(float));
      if (!grown) {
        fprintf(stderr, "out of memory for %zu logits\n", count);
        exit(1);
      }
      logits = grown;
      capacity = count;
    }
    CHECK(dpar_tensor_copy_to_host(logits, out, count * sizeof(float)));
    void *labels_ptr = NULL;
    CHECK(dpar_tensor_data(&labels_ptr, (dpar_tensor *)y));  // the test loader's batches are host memory
    const int32_t *labels = labels_ptr;
    for (int64_t i = 0; i < shape[0]; ++i) {
      int64_t best = 0;
      for (int64_t c = 1; c < shape[1]; ++c)
        if (logits[i * shape[1] + c] > logits[i * shape[1] + best]) best = c;
      correct += best == labels[i];
    }
    seen += (size_t)shape[0];
    dpar_tensor_free(out);
  }
  CHECK(dpar_engine_set_training(engine, 1));
  free(logits);
  dpar_loader_free(loader);
  return (double)correct / (double)seen;
}

#ifndef DEFAULT_MODEL
#define DEFAULT_MODEL "mlp"
#endif

/* 784-256-128-10 with ReLUs, as nn.Sequential(Linear, ReLU, Linear, ReLU, Linear): parameters "0.weight" ... */
static void add_mlp(dpar_model *model, int64_t features, int64_t classes) {
  CHECK(dpar_model_add_linear(model, features, 256, 1));
  CHECK(dpar_model_add_activation(model, DPAR_RELU));
  CHECK(dpar_model_add_linear(model, 256, 128, 1));
  CHECK(dpar_model_add_activation(model, DPAR_RELU));
  CHECK(dpar_model_add_linear(model, 128, classes, 1));
}

int main(int argc, char **argv) {
  size_t devices = 0, epochs = 10, batch = 128;
  const char *device = "auto";
  float lr = 1e-3f;
  const char *optimizer = "adam";
  const char *data = "/usr/share/datasets/fashion-mnist";
  const char *checkpoint = NULL; /* fashion_mnist.safetensors, or fashion_mnist_cnn.safetensors for the CNN */
  const char *trace = NULL;
  const char *compression = "none";
  const char *precision = "f32";
  unsigned long long seed = 0;
  double min_accuracy = 0.0;
  const char *model_kind = DEFAULT_MODEL;
  int sync_batchnorm = 0;
  size_t steps_per_epoch = 0;
  for (int i = 1; i < argc; ++i) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--sync-batchnorm")) {
      sync_batchnorm = 1;
      continue;
    }
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      printf("usage: %s [--model mlp|cnn] [--device auto|cuda|cpu] [--devices N] [--epochs E] [--batch-size B] [--lr LR]\n"
             "          [--optimizer adam|sgd] [--data DIR] [--checkpoint PATH] [--seed S] [--min-accuracy PCT]\n"
             "          [--trace PATH]   (a timeline of the first epoch's steps, for ui.perfetto.dev; rank 0's)\n"
             "          [--gradient-compression none|bf16]   (gradients between processes as bfloat16)\n"
             "          [--sync-batchnorm]   (the CNN's BatchNorm over the global batch)\n"
             "          [--steps-per-epoch N]   (end each epoch after N batches: a shortened run)\n"
             "          [--precision f32|bf16]   (linear layers and convolutions on bf16 operands)\n",
             argv[0]);
      return 0;
    }
    if (!v) {
      fprintf(stderr, "%s: %s needs a value (see --help)\n", argv[0], a);
      return 2;
    }
    if (!strcmp(a, "--model")) model_kind = v;
    else if (!strcmp(a, "--steps-per-epoch")) steps_per_epoch = strtoul(v, NULL, 10);
    else if (!strcmp(a, "--device")) device = v;
    else if (!strcmp(a, "--devices")) devices = strtoul(v, NULL, 10);
    else if (!strcmp(a, "--epochs")) epochs = strtoul(v, NULL, 10);
    else if (!strcmp(a, "--batch-size")) batch = strtoul(v, NULL, 10);
    else if (!strcmp(a, "--lr")) lr = strtof(v, NULL);
    else if (!strcmp(a, "--optimizer")) optimizer = v;
    else if (!strcmp(a, "--data")) data = v;
    else if (!strcmp(a, "--checkpoint")) checkpoint = v;
    else if (!strcmp(a, "--seed")) seed = strtoull(v, NULL, 10);
    else if (!strcmp(a, "--min-accuracy")) min_accuracy = strtod(v, NULL);
    else if (!strcmp(a, "--trace")) trace = v;
    else if (!strcmp(a, "--gradient-compression")) compression = v;
    else if (!strcmp(a, "--precision")) precision = v;
    else {
      fprintf(stderr, "%s: unknown option %s (see --help)\n", argv[0], a);
      return 2;
    }
    ++i;
  }
  const int cnn = !strcmp(model_kind, "cnn");
  if (!cnn && strcmp(model_kind, "mlp")) {
    fprintf(stderr, "%s: --model %s: expected mlp or cnn\n", argv[0], model_kind);
    return 2;
  }
  if (!checkpoint) checkpoint = cnn ? "fashion_mnist_cnn.safetensors" : "fashion_mnist.safetensors";
  if (strcmp(precision, "f32") && strcmp(precision, "bf16")) {
    fprintf(stderr, "%s: --precision %s: expected f32 or bf16\n", argv[0], precision);
    return 2;
  }
  if (strcmp(compression, "none") && strcmp(compression, "bf16")) {
    fprintf(stderr, "%s: --gradient-compression %s: expected none or bf16\n", argv[0], compression);
    return 2;
  }
  /* The GPUs when there are any (auto) or when asked for (cuda: an error names why there are none). */
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
    fprintf(stderr, "%s: --device must be auto, cuda or cpu (see --help)\n", argv[0]);
    return 2;
  }
  if (devices == 0) {
    if (use_cuda) devices = gpus;
    else CHECK(dpar_device_count(&devices, DPAR_DEVICE_CPU));
  }

  char images[1024], labels[1024];
  dpar_dataset *train = NULL, *test = NULL;
  snprintf(images, sizeof images, "%s/train-images-idx3-ubyte.gz", data);
  snprintf(labels, sizeof labels, "%s/train-labels-idx1-ubyte.gz", data);
  CHECK(dpar_dataset_load_idx(&train, images, labels));
  snprintf(images, sizeof images, "%s/t10k-images-idx3-ubyte.gz", data);
  snprintf(labels, sizeof labels, "%s/t10k-labels-idx1-ubyte.gz", data);
  CHECK(dpar_dataset_load_idx(&test, images, labels));
  /* Fashion-MNIST's pixel mean and standard deviation. */
  CHECK(dpar_dataset_normalize(train, 0.2860f, 0.3530f));
  CHECK(dpar_dataset_normalize(test, 0.2860f, 0.3530f));
  size_t n_train = 0, features = 0, classes = 0, n_test = 0;
  CHECK(dpar_dataset_info(&n_train, &features, &classes, train));
  CHECK(dpar_dataset_info(&n_test, NULL, NULL, test));

  dpar_model_options mopts = DPAR_MODEL_OPTIONS_INIT;
  mopts.seed = seed;
  dpar_model *model = NULL;
  CHECK(dpar_model_create(&model, &mopts));
  if (cnn) {
    if (features != 28 * 28) {
      fprintf(stderr, "%s: the CNN takes 28x28 images; %s has %zu features\n", argv[0], data, features);
      return 1;
    }
    CHECK(fashion_cnn_add(model, (int64_t)classes));
    if (sync_batchnorm) CHECK(dpar_model_convert_sync_batchnorm(model));
  } else {
    add_mlp(model, (int64_t)features, (int64_t)classes);
  }

  dpar_optimizer_options oopts = DPAR_OPTIMIZER_OPTIONS_INIT;
  oopts.kind = strcmp(optimizer, "sgd") ? DPAR_ADAM : DPAR_SGD;
  oopts.lr = lr;
  if (oopts.kind == DPAR_SGD) oopts.momentum = 0.9f;
  dpar_engine_options eopts = DPAR_ENGINE_OPTIONS_INIT;
  int32_t *device_ids = NULL;
  if (use_cuda) {
    device_ids = malloc(devices * sizeof *device_ids);
    if (!device_ids) {
      fprintf(stderr, "%s: out of memory\n", argv[0]);
      return 1;
    }
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
  dpar_model_free(model); /* the engine holds its own replicas */
  free(device_ids);
  size_t rank = 0, nproc = 1;
  CHECK(dpar_engine_processes(&rank, &nproc, engine));
  const int root = rank == 0;

  if (root)
    printf("dpar %s: %s, %s lr %g, batch %zu over %zu process%s x %zu %s, %zu train / "
           "%zu test samples; CPU GEMM: %s\n",
           dpar_version_string(),
           cnn ? (sync_batchnorm ? "CNN with a residual block (SyncBatchNorm)" : "CNN with a residual block")
               : "MLP 784-256-128-10",
           optimizer, (double)lr, batch, nproc, nproc > 1 ? "es" : "",
           devices, use_cuda ? (gpus == 1 ? "replicas on 1 GPU" : "replicas on GPUs") : "CPU devices", n_train,
           n_test, dpar_cpu_gemm_backend());
  CHECK(dpar_engine_set_gradient_compression(engine, strcmp(compression, "bf16") ? DPAR_COMPRESSION_NONE
                                                                                   : DPAR_COMPRESSION_BF16));
  if (!strcmp(precision, "bf16")) {
    CHECK(dpar_engine_set_precision(engine, DPAR_BF16));
    if (root) printf("precision: bf16 operands for the linear layers and convolutions, f32 accumulation\n");
  }
  if (root && nproc > 1)
    printf("gradients cross the processes by %s%s\n", dpar_engine_process_transport(engine),
           strcmp(compression, "bf16") ? "" : ", as bfloat16");

  /* Every process draws the same permutation (same seed) and takes its own slice of each batch. */
  dpar_loader *loader = NULL;
  CHECK(dpar_loader_create(&loader, train, batch, 1, seed, 0));
  if (nproc > 1) CHECK(dpar_loader_shard(loader, rank, nproc));
  if (use_cuda) {
    /* Batches on the first replica's GPU, each copied while the step before it runs: that replica takes its rows
     * as a view, the others copy theirs from it. */
    dpar_device first;
    CHECK(dpar_engine_replica_device(&first, engine, 0));
    CHECK(dpar_loader_to_device(loader, first));
  }
  size_t batches = 0, epoch_batches = 0;
  CHECK(dpar_loader_num_batches(&epoch_batches, loader));
  batches = steps_per_epoch && steps_per_epoch < epoch_batches ? steps_per_epoch : epoch_batches;
  const int tty = root && isatty(STDERR_FILENO);
  double accuracy = 0.0;
  if (trace && root) CHECK(dpar_engine_trace_start(engine));
  for (size_t epoch = 0; epoch < epochs; ++epoch) {
    CHECK(dpar_loader_start_epoch(loader, epoch));
    double loss_sum = 0.0, t0 = now_seconds();
    size_t samples = 0, b = 0;
    while (b < batches) {
      int32_t more = 0;
      CHECK(dpar_loader_next(&more, loader));
      if (!more) break;
      const dpar_tensor *x = dpar_loader_inputs(loader), *y = dpar_loader_labels(loader);
      const double progress_done = (double)(epoch * batches + b) / (double)(epochs * batches);
      CHECK(dpar_engine_set_lr(engine, (float)(0.5 * lr * (1.0 + cos(3.14159265358979 * progress_done)))));
      float loss = 0.0f; /* the mean over the global batch */
      CHECK(dpar_engine_train_step(&loss, engine, x, y));
      const size_t rows = b + 1 == epoch_batches && n_train % batch ? n_train % batch : batch; /* global rows */
      loss_sum += (double)loss * (double)rows;
      samples += rows;
      ++b;
      if (tty && (b % 20 == 0 || b == batches)) progress(b, batches, loss);
    }
    double seconds = now_seconds() - t0;
    if (!root) continue;
    if (trace && epoch == 0) {
      CHECK(dpar_engine_trace_stop(engine, trace));
      printf("wrote the timeline of epoch 1's steps to %s\n", trace);
    } /* forward() is local: rank 0 evaluates alone, the parameters being the same */
    accuracy = evaluate(engine, test, 1000);
    printf("epoch %2zu  train loss %.4f  test accuracy %.2f%%  %.0f samples/s\n", epoch + 1,
           loss_sum / (double)samples, 100.0 * accuracy, (double)samples / seconds);
    fflush(stdout);
  }
  CHECK(dpar_engine_save(engine, checkpoint)); /* every process calls it; rank 0 writes */
  if (root) printf("saved %s\n", checkpoint);

  dpar_loader_free(loader);
  dpar_engine_free(engine);
  dpar_dataset_free(train);
  dpar_dataset_free(test);
  if (root && min_accuracy > 0.0 && 100.0 * accuracy < min_accuracy) {
    fprintf(stderr, "test accuracy %.2f%% is below the required %.2f%%\n", 100.0 * accuracy, min_accuracy);
    return 1;
  }
  return 0;
}
