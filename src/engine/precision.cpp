// The engine's mixed-precision settings: what the replicas' layers compute in, and TF32. The settings are the
// caller's to change between calls, while the workers are idle (as the bucket strategies are).
#include "common/error.h"
#include "engine/engine.h"

namespace dpar {

void Engine::set_compute_dtype(DType dtype) {
  DPAR_CHECK_ARG(dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16, "precision: ",
                 dtype_name(dtype), " is not a compute dtype (f32, bf16, f16)");
  // All or nothing: a replica refuses bf16 or f16 before changing anything (its device lacks a kernel, or memory for
  // the weights' copy), and the replicas set before it go back to f32, which never fails.
  size_t done = 0;
  try {
    for (; done < replicas_.size(); ++done) replicas_[done]->model->set_compute_dtype(replicas_[done]->ctx, dtype);
  } catch (...) {
    for (size_t r = 0; r < done; ++r) replicas_[r]->model->set_compute_dtype(replicas_[r]->ctx, compute_dtype_);
    throw;
  }
  compute_dtype_ = dtype;
}

bool Engine::set_allow_tf32(bool allow) {
  bool has = true;
  for (auto& rep : replicas_) has = rep->stream->set_allow_tf32(allow) && has;
  return has;
}

}  // namespace dpar
