/* A host program that loads dpar at run time, as a framework with a plug-in system would: it dlopen()s
 * libdpar.so.0, resolves the one symbol dpar_get_api, and calls everything through the table it returns.
 * Only dpar_api.h's (and dpar.h's) types are used at compile time; the program is not linked against libdpar.
 *
 *   dlopen_host [path/to/libdpar.so.0] */
#include <dlfcn.h>
#include <stdio.h>

#include "dpar_api.h"

int main(int argc, char **argv) {
  const char *path = argc > 1 ? argv[1] : "libdpar.so.0";
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) return fprintf(stderr, "dlopen %s: %s\n", path, dlerror()), 1;
  dpar_get_api_fn get_api;
  *(void **)(&get_api) = dlsym(lib, "dpar_get_api"); /* POSIX's way from an object pointer to a function */
  if (!get_api) return fprintf(stderr, "dlsym dpar_get_api: %s\n", dlerror()), 1;
  const dpar_api_v1 *dp = (const dpar_api_v1 *)get_api(DPAR_API_TABLE_VERSION);
  if (!dp || dp->version != DPAR_API_TABLE_VERSION || dp->size < sizeof(dpar_api_v1))
    return fprintf(stderr, "%s does not offer version %d of the function table\n", path, DPAR_API_TABLE_VERSION), 1;
  printf("loaded dpar %s from %s\n", dp->dpar_version_string(), path);

  /* Learn y = x0 - 2 x1 over 2 CPU devices. */
  float x[16 * 2], y[16];
  for (int i = 0; i < 16; ++i) x[2 * i] = (float)(i % 4) / 4.0f, x[2 * i + 1] = (float)(i / 4) / 4.0f;
  for (int i = 0; i < 16; ++i) y[i] = x[2 * i] - 2.0f * x[2 * i + 1];
  int64_t xs[2] = {16, 2}, ys[2] = {16, 1};
  dpar_model *model = NULL;
  dpar_engine *engine = NULL;
  dpar_tensor *input = NULL, *target = NULL;
  dpar_optimizer_options opt;
  dpar_engine_options eo;
  if (dp->dpar_model_create(&model, NULL) || dp->dpar_model_add_linear(model, 2, 1, 1) ||
      dp->dpar_optimizer_options_init_sized(&opt, sizeof opt) || dp->dpar_engine_options_init_sized(&eo, sizeof eo))
    return fprintf(stderr, "%s\n", dp->dpar_last_error()), 1;
  opt.lr = 0.3f;
  eo.num_cpu_devices = 2;
  eo.loss = DPAR_LOSS_MSE;
  if (dp->dpar_engine_create(&engine, model, &opt, &eo) ||
      dp->dpar_tensor_wrap_host(&input, DPAR_F32, xs, 2, x) || dp->dpar_tensor_wrap_host(&target, DPAR_F32, ys, 2, y))
    return fprintf(stderr, "%s\n", dp->dpar_last_error()), 1;
  float loss = 0.0f;
  for (int step = 0; step < 300; ++step)
    if (dp->dpar_engine_train_step(&loss, engine, input, target)) return fprintf(stderr, "%s\n", dp->dpar_last_error()), 1;
  printf("loss after 300 steps through the table: %g\n", loss);
  dp->dpar_tensor_free(input);
  dp->dpar_tensor_free(target);
  dp->dpar_engine_free(engine);
  dp->dpar_model_free(model);
  dlclose(lib);
  return loss < 1e-4f ? 0 : 1;
}
