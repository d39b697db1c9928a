/* A host program that has PyTorch's libraries and dlopen()s dpar's C library beside them, in the order its first
 * argument names, as a framework with a plug-in system would. Both must load; tensors then cross by DLPack both
 * ways without a copy, dpar trains beside PyTorch, and the process holds one copy of each CUDA library, PyTorch's.
 *
 *   dlopen_beside_torch dpar-first|torch-first <libdpar.so.0> <torch_side.so> <PyTorch's site-packages>
 *
 * torch_side.so (tests/torch/torch_side.cpp, built by check_torch_guest.sh) is PyTorch's side: its load-time
 * dependencies are PyTorch's libraries, so that loading it loads them (libtorch_cuda and the CUDA runtime, cuBLAS,
 * cuDNN and NCCL it needs). Exits 0 when every check passed, 1 otherwise, saying which failed. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <dlpack/dlpack.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dpar_api.h"

typedef int (*cuda_available_fn)(void);
typedef DLManagedTensor *(*arange_fn)(long n, int cuda);
typedef int (*check_fn)(DLManagedTensor *managed, long n, double scale, const void *data, int cuda);

static const char *order;
static const dpar_api_v1 *dp;

static int fail(const char *what, const char *why) {
  fprintf(stderr, "%s: FAILED: %s: %s\n", order, what, why ? why : "(no message)");
  return 1;
}

static void *open_library(const char *path) {
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) fail("dlopen", dlerror());
  return lib;
}

static void *symbol(void *lib, const char *name) {
  void *fn = dlsym(lib, name);
  if (fn == NULL) fail("dlsym", dlerror());
  return fn;
}

/* PyTorch -> dpar -> PyTorch on the host (cuda = 0) or GPU 0, then dpar -> PyTorch: no copy either way. */
static int exchange(arange_fn arange, check_fn check, int cuda) {
  const char *where = cuda ? "cuda:0" : "cpu";
  DLManagedTensor *from_torch = arange(12, cuda);
  if (from_torch == NULL) return fail(where, "PyTorch made no tensor");
  const void *torch_data = (const char *)from_torch->dl_tensor.data + from_torch->dl_tensor.byte_offset;
  dpar_tensor *t = NULL;
  if (dp->dpar_tensor_from_dlpack(&t, from_torch) != DPAR_OK) {
    from_torch->deleter(from_torch);
    return fail("dpar_tensor_from_dlpack", dp->dpar_last_error());
  }
  int32_t dtype = 0;
  size_t numel = 0;
  dpar_device device = {0, 0};
  if (dp->dpar_tensor_info(&dtype, &numel, &device, t) != DPAR_OK)
    return fail("dpar_tensor_info", dp->dpar_last_error());
  if (dtype != DPAR_F32 || numel != 12 || device.kind != (cuda ? DPAR_DEVICE_CUDA : DPAR_DEVICE_CPU))
    return fail(where, "dpar sees another tensor than PyTorch made");
  double scale = 0.5;
  if (!cuda) { /* dpar writes PyTorch's memory in place (arange * 0.5 becomes arange * 2): PyTorch must see it */
    float *data = NULL;
    if (dp->dpar_tensor_data((void **)&data, t) != DPAR_OK) return fail("dpar_tensor_data", dp->dpar_last_error());
    if ((const void *)data != torch_data) return fail(where, "dpar copied PyTorch's tensor");
    for (int i = 0; i < 12; ++i) data[i] *= 4.0f;
    scale = 2.0;
  }
  DLManagedTensor *to_torch = NULL;
  if (dp->dpar_tensor_to_dlpack(&to_torch, t) != DPAR_OK) return fail("dpar_tensor_to_dlpack", dp->dpar_last_error());
  dp->dpar_tensor_free(t);
  if (check(to_torch, 12, scale, torch_data, cuda) != 0) return fail(where, "torch -> dpar -> torch");

  /* A tensor dpar made, read by PyTorch. */
  const int64_t shape[1] = {12};
  float host[12];
  for (int i = 0; i < 12; ++i) host[i] = 3.0f * (float)i;
  dpar_device on = {cuda ? DPAR_DEVICE_CUDA : DPAR_DEVICE_CPU, 0};
  dpar_tensor *mine = NULL;
  if (dp->dpar_tensor_create(&mine, DPAR_F32, shape, 1, on) != DPAR_OK ||
      dp->dpar_tensor_copy_from_host(mine, host, sizeof host) != DPAR_OK ||
      dp->dpar_tensor_to_dlpack(&to_torch, mine) != DPAR_OK)
    return fail("a dpar tensor for PyTorch", dp->dpar_last_error());
  const void *dpar_data = (const char *)to_torch->dl_tensor.data + to_torch->dl_tensor.byte_offset;
  dp->dpar_tensor_free(mine);
  if (check(to_torch, 12, 3.0, dpar_data, cuda) != 0) return fail(where, "dpar -> torch");
  printf("%s: %s: torch -> dpar -> torch shares the memory, dpar -> torch reads dpar's tensor\n", order, where);
  return 0;
}

/* dpar trains beside PyTorch: y = x0 - 2 x1 over 2 CPU devices. */
static int train(void) {
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
    return fail("a model", dp->dpar_last_error());
  opt.lr = 0.3f;
  eo.num_cpu_devices = 2;
  eo.loss = DPAR_LOSS_MSE;
  if (dp->dpar_engine_create(&engine, model, &opt, &eo) || dp->dpar_tensor_wrap_host(&input, DPAR_F32, xs, 2, x) ||
      dp->dpar_tensor_wrap_host(&target, DPAR_F32, ys, 2, y))
    return fail("an engine", dp->dpar_last_error());
  float loss = 0.0f;
  for (int step = 0; step < 300; ++step)
    if (dp->dpar_engine_train_step(&loss, engine, input, target)) return fail("train_step", dp->dpar_last_error());
  dp->dpar_tensor_free(input);
  dp->dpar_tensor_free(target);
  dp->dpar_engine_free(engine);
  dp->dpar_model_free(model);
  if (!(loss < 1e-4f)) return fail("training", "the loss did not fall below 1e-4 in 300 steps");
  printf("%s: dpar trained beside PyTorch (loss %g after 300 steps)\n", order, loss);
  return 0;
}

/* Each CUDA library mapped into the process is one file, under PyTorch's directory. */
static int one_copy_each_and_pytorchs(const char *torch_root) {
  static const char *const families[] = {"libcudart.so", "libnccl.so", "libcublas.so", "libcublasLt.so", "libcudnn.so"};
  enum { kFamilies = sizeof families / sizeof families[0] };
  char seen[kFamilies][PATH_MAX];
  memset(seen, 0, sizeof seen);
  char root[PATH_MAX];
  if (realpath(torch_root, root) == NULL) return fail("realpath", torch_root);
  FILE *maps = fopen("/proc/self/maps", "r");
  if (maps == NULL) return fail("/proc/self/maps", "cannot be read");
  char line[PATH_MAX + 256];
  int status = 0;
  while (fgets(line, sizeof line, maps) != NULL) {
    char *path = strchr(line, '/');
    if (path == NULL) continue;
    path[strcspn(path, "\n")] = '\0';
    const char *name = strrchr(path, '/') + 1;
    for (int f = 0; f < kFamilies; ++f) {
      if (strncmp(name, families[f], strlen(families[f])) != 0) continue;
      char real[PATH_MAX];
      if (realpath(path, real) == NULL) snprintf(real, sizeof real, "%s", path);
      if (seen[f][0] == '\0') {
        snprintf(seen[f], sizeof seen[f], "%s", real);
        printf("%s: %s*: %s\n", order, families[f], real);
        if (strncmp(real, root, strlen(root)) != 0 || real[strlen(root)] != '/')
          status = fail(real, "a CUDA library that is not PyTorch's was loaded");
      } else if (strcmp(seen[f], real) != 0) {
        fprintf(stderr, "%s: FAILED: two copies of %s*: %s and %s\n", order, families[f], seen[f], real);
        status = 1;
      }
    }
  }
  fclose(maps);
  return status;
}

int main(int argc, char **argv) {
  if (argc != 5 || (strcmp(argv[1], "dpar-first") != 0 && strcmp(argv[1], "torch-first") != 0)) {
    fprintf(stderr, "usage: dlopen_beside_torch dpar-first|torch-first <libdpar.so.0> <torch_side.so> "
                    "<site-packages>\n");
    return 2;
  }
  order = argv[1];
  const int dpar_first = strcmp(order, "dpar-first") == 0;
  void *first = open_library(dpar_first ? argv[2] : argv[3]);
  if (first == NULL) return 1;
  void *second = open_library(dpar_first ? argv[3] : argv[2]);
  if (second == NULL) return 1;
  void *dpar = dpar_first ? first : second, *torch_side = dpar_first ? second : first;

  dpar_get_api_fn get_api;
  *(void **)(&get_api) = symbol(dpar, "dpar_get_api");
  cuda_available_fn cuda_available;
  *(void **)(&cuda_available) = symbol(torch_side, "torch_side_cuda_available");
  arange_fn arange;
  *(void **)(&arange) = symbol(torch_side, "torch_side_arange");
  check_fn check;
  *(void **)(&check) = symbol(torch_side, "torch_side_check");
  if (!get_api || !cuda_available || !arange || !check) return 1;
  dp = (const dpar_api_v1 *)get_api(DPAR_API_TABLE_VERSION);
  if (dp == NULL || dp->size < sizeof(dpar_api_v1)) return fail("dpar_get_api", "no table of this version");
  printf("%s: dpar %s and PyTorch's libraries loaded\n", order, dp->dpar_version_string());

  int status = exchange(arange, check, 0);
  if (cuda_available())
    status |= exchange(arange, check, 1);
  else
    printf("%s: no GPU visible to PyTorch: the CUDA tensors' exchange is not run\n", order);
  status |= train();
  status |= one_copy_each_and_pytorchs(argv[4]);
  if (status == 0) printf("%s: passed\n", order);
  return status;
}
