#include "nn/loss.h"

#include <string>
#include <vector>

#include "backend/backend.h"
#include "common/error.h"
#include "common/op_specs.h"

namespace dpar {

std::vector<int64_t> check_loss_target(LossKind kind, const Shape& out, const Tensor& target,
                                       const char* operation) {
  const int64_t B = out[0];
  if (kind == LossKind::kCrossEntropy) {
    DPAR_CHECK_ARG(out.ndim() >= 2, operation, ": cross-entropy needs a (batch, ..., classes) output, the model gives ",
                   out.str());
    DPAR_CHECK_ARG(target.dtype() == DType::kI32, operation, ": target must be i32 class labels, got ",
                   dtype_name(target.dtype()));
    // The output's shape without its classes: one label per position.
    const Shape want = Shape::of(out.data(), out.ndim() - 1);
    DPAR_CHECK_ARG(target.shape() == want, operation, ": target ", target.shape().str(), " must be ", want.str(),
                   " labels, one per position of the output ", out.str(), " (the classes on its last dimension)");
    const int64_t classes = out[out.ndim() - 1];
    const int64_t n = target.numel();
    // Checked here, on the host: a device kernel cannot refuse a label.
    std::vector<int32_t> copied;
    const int32_t* labels = target.i32();
    if (!target.device().is_host()) {
      copied.resize(static_cast<size_t>(n));
      backend_for(target.device()).copy_to_host(copied.data(), labels, copied.size() * sizeof(int32_t),
                                                target.device());
      labels = copied.data();
    }
    const int64_t per_row = B > 0 ? n / B : 0;
    std::vector<int64_t> samples(static_cast<size_t>(B), 0);
    for (int64_t i = 0; i < n; ++i) {
      const int32_t label = labels[i];
      if (label == kIgnoreIndex) continue;
      if (label < 0 || label >= classes) {
        // The label's position as an index of the target: target[1, 3] of a (B, T) target.
        std::string at;
        for (size_t d = want.ndim(), rest = static_cast<size_t>(i); d-- > 0;) {
          const auto extent = static_cast<size_t>(want[d]);
          at = std::to_string(rest % extent) + (at.empty() ? "" : ", ") + at;
          rest /= extent;
        }
        fail(Status::kInvalidArgument, operation, ": target[", at, "] = ", label, " is out of range [0, ", classes,
             ") and is not the ignored index ", kIgnoreIndex);
      }
      ++samples[static_cast<size_t>(i / per_row)];
    }
    return samples;
  }
  DPAR_CHECK_ARG(target.dtype() == DType::kF32, operation, ": MSE target must be f32, got ",
                 dtype_name(target.dtype()));
  DPAR_CHECK_ARG(target.shape() == out, operation, ": MSE target ", target.shape().str(),
                 " must be shaped as the output ", out.str());
  return std::vector<int64_t>(static_cast<size_t>(B), 1);
}

void loss_forward_backward(LossKind kind, const ReplicaContext& ctx, double* loss_sum, const Tensor& dout,
                           const Tensor& out, const Tensor& target, float grad_scale) {
  if (kind == LossKind::kCrossEntropy) {
    ctx.stream->run(call::CrossEntropy{TensorRef::of(loss_sum, {1}), dout.ref(), out.ref(), target.ref(), grad_scale});
  } else {
    // Every element of a row is one of the row's D errors.
    const int64_t B = out.rows(), D = out.shape().row_numel();
    ctx.stream->run(call::MeanSquaredError{TensorRef::of(loss_sum, {1}), dout.ref().view({B, D}),
                                           out.ref().view({B, D}), target.ref().view({B, D}), grad_scale});
  }
}

}  // namespace dpar
