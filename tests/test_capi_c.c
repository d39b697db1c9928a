/* The C ABI from plain C99: build a tiny model, train it with MSE over 3 CPU devices, check the loss decreases and
 * the replicas agree, check a few error paths, free everything. Exits nonzero with a message on any failure. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "dpar.h"

static int failures = 0;

#define FAIL(...)                                      \
  do {                                                 \
    fprintf(stderr, "test_capi_c:%d: ", __LINE__);     \
    fprintf(stderr, __VA_ARGS__);                      \
    fputc('\n', stderr);                               \
    ++failures;                                        \
  } while (0)

/* A call that must succeed; on failure the test cannot go on. */
#define REQUIRE_OK(call)                                                                     \
  do {                                                                                       \
    dpar_status s_ = (call);                                                                 \
    if (s_ != DPAR_OK) {                                                                     \
      FAIL("%s returned %s: %s", #call, dpar_status_str(s_), dpar_last_error());             \
      goto done;                                                                             \
    }                                                                                        \
  } while (0)

/* A call that must fail with `want` and a message that mentions `word`. */
#define EXPECT_ERROR(want, word, call)                                                               \
  do {                                                                                               \
    dpar_status s_;                                                                                  \
    const char *m_;                                                                                  \
    dpar_clear_error();                                                                              \
    s_ = (call);                                                                                     \
    m_ = dpar_last_error();                                                                          \
    if (s_ != (want)) FAIL("%s returned %s, expected %s", #call, dpar_status_str(s_), dpar_status_str(want)); \
    if (m_ == NULL || m_[0] == '\0') FAIL("%s left an empty error message", #call);                 \
    else if (strstr(m_, (word)) == NULL) FAIL("%s: message \"%s\" does not mention \"%s\"", #call, m_, (word)); \
  } while (0)

enum { kRows = 12, kIn = 4, kOut = 2, kSteps = 30, kDevices = 3 };

int main(void) {
  dpar_model *model = NULL;
  dpar_engine *engine = NULL;
  dpar_tensor *input = NULL, *target = NULL, *output = NULL;
  float x[kRows * kIn], y[kRows * kOut];
  float first_loss = 0.0f, last_loss = 0.0f;
  int64_t in_shape[2] = {kRows, kIn}, out_shape[2] = {kRows, kOut};
  size_t num_elements = 0;
  size_t replicas = 0, r, i, j;
  int step;
  float losses[kDevices];
  float params[kDevices][kOut * kIn + kOut];

  dpar_model_options mopts = DPAR_MODEL_OPTIONS_INIT;
  dpar_optimizer_options oopts = DPAR_OPTIMIZER_OPTIONS_INIT;
  dpar_engine_options eopts = DPAR_ENGINE_OPTIONS_INIT;

  /* Data: y = A x + c, a target the linear model can fit exactly. */
  for (i = 0; i < kRows; ++i) {
    for (j = 0; j < kIn; ++j) x[i * kIn + j] = (float)((int)((i * 7 + j * 3) % 11) - 5) / 5.0f;
    y[i * kOut + 0] = 0.5f * x[i * kIn + 0] - x[i * kIn + 1] + 0.25f;
    y[i * kOut + 1] = x[i * kIn + 2] + 0.5f * x[i * kIn + 3] - 0.5f;
  }

  if (dpar_version() != DPAR_VERSION) FAIL("dpar_version() is %d, the header says %d", dpar_version(), DPAR_VERSION);

  mopts.seed = 42;
  REQUIRE_OK(dpar_model_create(&model, &mopts));
  REQUIRE_OK(dpar_model_add_linear(model, kIn, kOut, 1));
  REQUIRE_OK(dpar_model_num_param_elements(&num_elements, model));
  if (num_elements != kOut * kIn + kOut) FAIL("the model has %zu parameter elements, expected %d",
                                              num_elements, kOut * kIn + kOut);

  oopts.lr = 0.1f;
  eopts.num_cpu_devices = kDevices;
  eopts.loss = DPAR_LOSS_MSE;
  REQUIRE_OK(dpar_engine_create(&engine, model, &oopts, &eopts));
  REQUIRE_OK(dpar_engine_num_replicas(&replicas, engine));
  if (replicas != kDevices) FAIL("the engine has %zu replicas, expected %d", replicas, kDevices);

  REQUIRE_OK(dpar_tensor_create(&input, DPAR_F32, in_shape, 2, (dpar_device){DPAR_DEVICE_CPU, 0}));
  REQUIRE_OK(dpar_tensor_create(&target, DPAR_F32, out_shape, 2, (dpar_device){DPAR_DEVICE_CPU, 0}));
  REQUIRE_OK(dpar_tensor_copy_from_host(input, x, sizeof x));
  REQUIRE_OK(dpar_tensor_copy_from_host(target, y, sizeof y));

  for (step = 0; step < kSteps; ++step) {
    float loss = -1.0f;
    REQUIRE_OK(dpar_engine_train_step(&loss, engine, input, target));
    if (!(loss >= 0.0f) || !isfinite(loss)) FAIL("step %d: loss %g is not a finite non-negative number", step, loss);
    if (step == 0) first_loss = loss;
    last_loss = loss;
  }
  if (!(last_loss < 0.5f * first_loss))
    FAIL("the loss did not decrease enough: %g after the first step, %g after %d", first_loss, last_loss, kSteps);

  {
    size_t steps = 0;
    REQUIRE_OK(dpar_engine_step_count(&steps, engine));
    if (steps != kSteps) FAIL("step_count is %zu, expected %d", steps, kSteps);
  }

  /* 12 rows over 3 devices: 4 each, so every replica reports a loss. */
  REQUIRE_OK(dpar_engine_replica_losses(losses, engine, kDevices));
  for (r = 0; r < kDevices; ++r)
    if (!isfinite(losses[r]) || losses[r] < 0.0f) FAIL("replica %zu's loss is %g", r, losses[r]);

  /* Every replica holds the same parameters after the same steps. */
  for (r = 0; r < kDevices; ++r)
    REQUIRE_OK(dpar_engine_get_params(params[r], engine, r, num_elements));
  for (r = 1; r < kDevices; ++r)
    if (memcmp(params[0], params[r], sizeof params[0]) != 0) FAIL("replica %zu's parameters differ from replica 0's", r);

  /* The gathered forward output has the batch's shape and matches the loss. */
  REQUIRE_OK(dpar_engine_set_training(engine, 0));
  REQUIRE_OK(dpar_engine_forward(&output, engine, input));
  {
    int64_t shape[DPAR_MAX_DIMS];
    size_t ndim = 0;
    float out[kRows * kOut];
    double mse = 0.0;
    REQUIRE_OK(dpar_tensor_shape(shape, &ndim, output, DPAR_MAX_DIMS));
    if (ndim != 2 || shape[0] != kRows || shape[1] != kOut)
      FAIL("forward's output is %zu-D (%lld, %lld), expected (%d, %d)", ndim, (long long)shape[0],
           (long long)shape[1], kRows, kOut);
    REQUIRE_OK(dpar_tensor_copy_to_host(out, output, sizeof out));
    for (i = 0; i < kRows * kOut; ++i) mse += (double)(out[i] - y[i]) * (double)(out[i] - y[i]);
    mse /= kRows * kOut;
    if (!(mse < last_loss)) FAIL("the MSE after training, %g, is not below the last step's loss %g", mse, last_loss);
  }
  dpar_tensor_free(output);
  output = NULL;

  /* Error paths: a NULL output pointer, a bad option version, a freed handle. Each is refused with a message. */
  EXPECT_ERROR(DPAR_ERR_INVALID_ARGUMENT, "out", dpar_model_create(NULL, &mopts));
  EXPECT_ERROR(DPAR_ERR_INVALID_ARGUMENT, "out", dpar_engine_num_replicas(NULL, engine));
  {
    dpar_engine_options bad = DPAR_ENGINE_OPTIONS_INIT;
    dpar_engine *never = (dpar_engine *)&bad; /* must be overwritten with NULL */
    bad.version = 99;
    EXPECT_ERROR(DPAR_ERR_INVALID_ARGUMENT, "version", dpar_engine_create(&never, model, NULL, &bad));
    if (never != NULL) FAIL("a refused dpar_engine_create left *out = %p, expected NULL", (void *)never);
  }
  {
    dpar_model_options bad = DPAR_MODEL_OPTIONS_INIT;
    dpar_model *never = NULL;
    bad.version = 0;
    EXPECT_ERROR(DPAR_ERR_INVALID_ARGUMENT, "version", dpar_model_create(&never, &bad));
    bad.version = DPAR_MODEL_OPTIONS_VERSION;
    bad.size = 4;
    EXPECT_ERROR(DPAR_ERR_INVALID_ARGUMENT, "size", dpar_model_create(&never, &bad));
  }
  EXPECT_ERROR(DPAR_ERR_INVALID_STATE, "step", dpar_engine_step(engine));
  EXPECT_ERROR(DPAR_ERR_INVALID_ARGUMENT, "engine", dpar_engine_train_step(NULL, NULL, input, target));
  {
    dpar_tensor *gone = NULL;
    REQUIRE_OK(dpar_tensor_create(&gone, DPAR_F32, in_shape, 2, (dpar_device){DPAR_DEVICE_CPU, 0}));
    dpar_tensor_free(gone);
    EXPECT_ERROR(DPAR_ERR_INVALID_ARGUMENT, "input", dpar_engine_train_step(NULL, engine, gone, target));
  }
  {
    /* A CUDA device that cannot be used: NOT_SUPPORTED without CUDA in the build, DEVICE without a GPU, an index
       past the last GPU otherwise. */
    size_t gpus = 0;
    const dpar_status built = dpar_device_count(&gpus, DPAR_DEVICE_CUDA);
    const dpar_status want = built == DPAR_ERR_NOT_SUPPORTED ? DPAR_ERR_NOT_SUPPORTED
                             : gpus == 0                      ? DPAR_ERR_DEVICE
                                                              : DPAR_ERR_INVALID_ARGUMENT;
    EXPECT_ERROR(want, "cuda", dpar_tensor_create(&output, DPAR_F32, in_shape, 2,
                                                  (dpar_device){DPAR_DEVICE_CUDA, (int32_t)gpus}));
  }
  if (output != NULL) FAIL("a refused dpar_tensor_create left *out non-NULL");

  /* After the refused calls the engine still trains. */
  REQUIRE_OK(dpar_engine_set_training(engine, 1));
  {
    float loss = -1.0f;
    size_t steps = 0;
    REQUIRE_OK(dpar_engine_train_step(&loss, engine, input, target));
    REQUIRE_OK(dpar_engine_step_count(&steps, engine));
    if (steps != kSteps + 1) FAIL("step_count is %zu after one more step, expected %d", steps, kSteps + 1);
    if (!(loss <= last_loss)) FAIL("the loss went up after the refused calls: %g, was %g", loss, last_loss);
  }

  /* dpar_last_error() is never NULL and dpar_clear_error() empties it. */
  dpar_clear_error();
  if (dpar_last_error() == NULL || dpar_last_error()[0] != '\0') FAIL("dpar_clear_error() did not clear the message");

done:
  dpar_tensor_free(output);
  dpar_tensor_free(target);
  dpar_tensor_free(input);
  dpar_engine_free(engine);
  dpar_model_free(model);
  /* Freeing NULL is a no-op. */
  dpar_engine_free(NULL);
  dpar_model_free(NULL);
  dpar_tensor_free(NULL);
  if (failures) {
    fprintf(stderr, "test_capi_c: %d failure(s)\n", failures);
    return 1;
  }
  printf("test_capi_c: OK (loss %g -> %g over %d steps on %d devices)\n", first_loss, last_loss, kSteps, kDevices);
  return 0;
}
