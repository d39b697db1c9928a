// dpar.h alone must compile warning-free as C++11 (-Wall -Wextra -pedantic -Werror), _INIT macros included.
#include "dpar.h"
#include "dpar_api.h"

int dpar_header_test_cpp();

int dpar_header_test_cpp() {
  dpar_model_options model = DPAR_MODEL_OPTIONS_INIT;
  dpar_optimizer_options optimizer = DPAR_OPTIMIZER_OPTIONS_INIT;
  dpar_engine_options engine = DPAR_ENGINE_OPTIONS_INIT;
  dpar_custom_layer layer = DPAR_CUSTOM_LAYER_INIT;
  dpar_device device = {DPAR_DEVICE_CPU, 0};
  int64_t shape[DPAR_MAX_DIMS] = {1, 2, 3, 4};
  static_assert(DPAR_VERSION == DPAR_VERSION_MAJOR * 10000 + DPAR_VERSION_MINOR * 100 + DPAR_VERSION_PATCH,
                "DPAR_VERSION");
  bool ok = model.version == DPAR_MODEL_OPTIONS_VERSION && optimizer.version == DPAR_OPTIMIZER_OPTIONS_VERSION;
  ok = ok && engine.version == DPAR_ENGINE_OPTIONS_VERSION && layer.version == DPAR_CUSTOM_LAYER_VERSION;
  ok = ok && engine.size == sizeof(dpar_engine_options) && engine.output_device == -1 && layer.name == nullptr;
  ok = ok && device.kind == DPAR_DEVICE_CPU && shape[3] == 4 && optimizer.kind == DPAR_SGD;
  // The status type is a plain C enum: it converts to int and compares against the codes.
  dpar_status status = ok ? DPAR_OK : DPAR_ERR_INTERNAL;
  return static_cast<int>(status);
}
