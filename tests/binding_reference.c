/* The reference every binding's test compares against: a small MLP trained for a few steps over 2 CPU devices
 * with a fixed seed, through the C ABI. Prints each step's loss as the hex of its IEEE bits, one per line, so that
 * a binding that trains the same model on the same data must print the same lines (bit for bit).
 *
 * The recipe (each binding repeats it):
 *   model seed 7: linear 4 -> 8 (bias), ReLU, linear 8 -> 3 (bias); SGD lr 0.1, momentum 0.9;
 *   engine: 2 CPU devices (num_cpu_devices 2), cross-entropy, engine seed 0;
 *   batch of 10 rows: x[i] = ((i * 37) % 101) / 101 - 0.5 for i in 0..40, labels[r] = r % 3; 5 train steps.
 *
 *   binding_reference [output file]   (standard output without one) */
#include <stdio.h>
#include <string.h>

#include "dpar.h"

#define CHECK(call)                                                                    \
  do {                                                                                 \
    dpar_status s_ = (call);                                                           \
    if (s_ != DPAR_OK) {                                                               \
      fprintf(stderr, "%s: %s: %s\n", #call, dpar_status_str(s_), dpar_last_error()); \
      return 1;                                                                        \
    }                                                                                  \
  } while (0)

int main(int argc, char **argv) {
  enum { kRows = 10, kIn = 4, kSteps = 5 };
  float x[kRows * kIn];
  int32_t y[kRows];
  for (int i = 0; i < kRows * kIn; ++i) x[i] = (float)((i * 37) % 101) / 101.0f - 0.5f;
  for (int r = 0; r < kRows; ++r) y[r] = r % 3;
  dpar_model_options mo = DPAR_MODEL_OPTIONS_INIT;
  mo.seed = 7;
  dpar_model *model = NULL;
  CHECK(dpar_model_create(&model, &mo));
  CHECK(dpar_model_add_linear(model, kIn, 8, 1));
  CHECK(dpar_model_add_activation(model, DPAR_RELU));
  CHECK(dpar_model_add_linear(model, 8, 3, 1));
  dpar_optimizer_options oo = DPAR_OPTIMIZER_OPTIONS_INIT;
  oo.lr = 0.1f;
  oo.momentum = 0.9f;
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = 2;
  eo.processes = DPAR_PROCESSES_SINGLE;
  dpar_engine *engine = NULL;
  CHECK(dpar_engine_create(&engine, model, &oo, &eo));
  const int64_t xs[2] = {kRows, kIn}, ys[1] = {kRows};
  dpar_tensor *input = NULL, *labels = NULL;
  CHECK(dpar_tensor_wrap_host(&input, DPAR_F32, xs, 2, x));
  CHECK(dpar_tensor_wrap_host(&labels, DPAR_I32, ys, 1, y));
  FILE *out = argc > 1 ? fopen(argv[1], "w") : stdout;
  if (!out) return perror(argv[1]), 1;
  for (int step = 0; step < kSteps; ++step) {
    float loss = 0.0f;
    CHECK(dpar_engine_train_step(&loss, engine, input, labels));
    uint32_t bits;
    memcpy(&bits, &loss, sizeof bits);
    fprintf(out, "%08x\n", (unsigned)bits);
  }
  if (out != stdout) fclose(out);
  dpar_tensor_free(input);
  dpar_tensor_free(labels);
  dpar_engine_free(engine);
  dpar_model_free(model);
  return 0;
}
