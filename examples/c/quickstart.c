#include <stdio.h>
#include "dpar.h"

int main(void) {
  float x[8 * 4], y[8 * 2];                      /* 8 samples: learn y = 2x[0] - x[1] and x[2] + x[3] */
  for (int i = 0; i < 8 * 4; ++i) x[i] = (float)((i * 7) % 11) / 11.0f - 0.5f;
  for (int i = 0; i < 8; ++i) y[2 * i] = 2 * x[4 * i] - x[4 * i + 1], y[2 * i + 1] = x[4 * i + 2] + x[4 * i + 3];
  int64_t xs[2] = {8, 4}, ys[2] = {8, 2};
  dpar_tensor *input, *target;
  dpar_model *model;
  dpar_engine *engine;
  dpar_model_create(&model, NULL);
  dpar_model_add_linear(model, 4, 2, 1);
  dpar_optimizer_options opt = DPAR_OPTIMIZER_OPTIONS_INIT;   /* SGD, lr 0.01 */
  opt.lr = 0.2f, opt.momentum = 0.9f;
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;          /* every CPU device */
  eo.loss = DPAR_LOSS_MSE;
  if (dpar_engine_create(&engine, model, &opt, &eo) != DPAR_OK) return printf("%s\n", dpar_last_error()), 1;
  dpar_tensor_wrap_host(&input, DPAR_F32, xs, 2, x);
  dpar_tensor_wrap_host(&target, DPAR_F32, ys, 2, y);
  float loss = 0;
  for (int step = 0; step < 200; ++step) dpar_engine_train_step(&loss, engine, input, target);
  printf("loss after 200 steps: %g\n", loss);
  dpar_tensor_free(input), dpar_tensor_free(target), dpar_engine_free(engine), dpar_model_free(model);
  return loss < 1e-3f ? 0 : 1;
}
