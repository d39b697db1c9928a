// The engine's checks of an input's dtype and values against the model: a model whose input an Embedding reads
// takes i32 indices, checked on the host before any replica runs so that a bad one changes nothing.
#include "common/error.h"
#include "engine/engine.h"

namespace dpar {

void Engine::check_input_dtype(const Tensor& input, const char* operation) const {
  DType want = DType::kF32;
  try {
    want = model_.input_dtype();
  } catch (const Error& e) {
    fail(e.status(), operation, ": ", e.what());
  }
  DPAR_CHECK_ARG(input.dtype() == want, operation, ": input must be ", dtype_name(want),
                 want == DType::kI32 ? " (the model's input is read by a layer of indices)" : "", ", got ",
                 dtype_name(input.dtype()));
}

void Engine::check_input_values(const Tensor& input, const char* operation) const {
  if (input.dtype() != DType::kI32) return;
  // An input on a device is copied to the host first: the check reads every index once, before the step.
  Tensor host = input;
  if (!input.device().is_host()) {
    host = Tensor::empty(DType::kI32, input.shape(), Device{});
    backend_.copy_to_host(host.raw(), input.raw(), input.bytes(), input.device());
  }
  try {
    model_.check_input_values(host);
  } catch (const Error& e) {
    fail(e.status(), operation, ": ", e.what());
  }
}

}  // namespace dpar
