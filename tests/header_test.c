/* dpar.h alone must compile warning-free as C99 (-Wall -Wextra -pedantic -Werror), _INIT macros included. */
#include "dpar.h"
#include "dpar_api.h"

int dpar_header_test_c(void);

int dpar_header_test_c(void) {
  dpar_model_options model = DPAR_MODEL_OPTIONS_INIT;
  dpar_optimizer_options optimizer = DPAR_OPTIMIZER_OPTIONS_INIT;
  dpar_engine_options engine = DPAR_ENGINE_OPTIONS_INIT;
  dpar_custom_layer layer = DPAR_CUSTOM_LAYER_INIT;
  dpar_device device = {DPAR_DEVICE_CPU, 0};
  int64_t shape[DPAR_MAX_DIMS] = {1, 2, 3, 4};
  int ok = DPAR_VERSION == DPAR_VERSION_MAJOR * 10000 + DPAR_VERSION_MINOR * 100 + DPAR_VERSION_PATCH;
  ok = ok && model.version == DPAR_MODEL_OPTIONS_VERSION && optimizer.version == DPAR_OPTIMIZER_OPTIONS_VERSION;
  ok = ok && engine.version == DPAR_ENGINE_OPTIONS_VERSION && layer.version == DPAR_CUSTOM_LAYER_VERSION;
  ok = ok && engine.size == sizeof(dpar_engine_options) && engine.output_device == -1 && layer.name == NULL;
  ok = ok && device.kind == DPAR_DEVICE_CPU && shape[3] == 4 && optimizer.kind == DPAR_SGD;
  return ok ? (int)DPAR_OK : (int)DPAR_ERR_INTERNAL;
}
