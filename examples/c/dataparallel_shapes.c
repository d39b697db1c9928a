/* The classic DataParallel tutorial (PyTorch's "Optional: Data Parallelism"), with dpar.
 *
 * A 5 -> 2 linear model, 100 random samples in batches of 30. Every replica reports the shapes it sees from
 * inside the model (the forward hook); the caller reports the gathered output. With 8 devices and the last
 * batch of 10, five devices get 2 rows each, as torch.nn.DataParallel splits it. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "dpar.h"

#define CHECK(call)                                                                         \
  do {                                                                                      \
    dpar_status s_ = (call);                                                                \
    if (s_ != DPAR_OK) {                                                                    \
      fprintf(stderr, "%s failed: %s: %s\n", #call, dpar_status_str(s_), dpar_last_error()); \
      exit(1);                                                                              \
    }                                                                                       \
  } while (0)

static pthread_mutex_t print_lock = PTHREAD_MUTEX_INITIALIZER;

/* Replicas call this concurrently from their worker threads. */
static dpar_status in_model(void *payload, size_t replica, const int64_t *in, size_t in_ndim, const int64_t *out,
                     size_t out_ndim) {
  (void)payload;
  (void)in_ndim;
  (void)out_ndim;
  pthread_mutex_lock(&print_lock);
  printf("\tIn Model (replica %zu): input size [%lld, %lld] output size [%lld, %lld]\n", replica, (long long)in[0],
         (long long)in[1], (long long)out[0], (long long)out[1]);
  pthread_mutex_unlock(&print_lock);
  return DPAR_OK;
}

int main(void) {
  enum { kInput = 5, kOutput = 2, kSamples = 100, kBatch = 30 };
  static float data[kSamples * kInput];
  for (int i = 0; i < kSamples * kInput; ++i) data[i] = (float)rand() / (float)RAND_MAX;

  dpar_model_options mopts = DPAR_MODEL_OPTIONS_INIT;
  dpar_model *model = NULL;
  CHECK(dpar_model_create(&model, &mopts));
  CHECK(dpar_model_add_linear(model, kInput, kOutput, 1));

  const size_t device_counts[] = {1, 2, 3, 8};
  for (size_t d = 0; d < sizeof device_counts / sizeof device_counts[0]; ++d) {
    dpar_engine_options opts = DPAR_ENGINE_OPTIONS_INIT;
    opts.num_cpu_devices = device_counts[d];
    dpar_engine *engine = NULL;
    CHECK(dpar_engine_create(&engine, model, NULL, &opts));
    CHECK(dpar_engine_set_forward_hook(engine, in_model, NULL, NULL));
    printf("Let's use %zu devices!\n", device_counts[d]);
    for (int begin = 0; begin < kSamples; begin += kBatch) {
      int rows = kSamples - begin < kBatch ? kSamples - begin : kBatch;
      int64_t shape[2] = {rows, kInput};
      dpar_tensor *input = NULL, *output = NULL;
      CHECK(dpar_tensor_wrap_host(&input, DPAR_F32, shape, 2, data + begin * kInput));
      CHECK(dpar_engine_forward(&output, engine, input));
      int64_t out_shape[DPAR_MAX_DIMS];
      size_t out_ndim = 0;
      CHECK(dpar_tensor_shape(out_shape, &out_ndim, output, DPAR_MAX_DIMS));
      printf("Outside: input size [%d, %d] output_size [%lld, %lld]\n", rows, kInput, (long long)out_shape[0],
             (long long)out_shape[1]);
      dpar_tensor_free(output);
      dpar_tensor_free(input);
    }
    /* This tutorial never trains: drop the activations kept for a backward. */
    CHECK(dpar_engine_zero_grad(engine));
    dpar_engine_free(engine);
  }
  dpar_model_free(model);
  return 0;
}
