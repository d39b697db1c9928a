#include "nn/loss.h"

#include <vector>

#include "backend/backend.h"
#include "common/error.h"

namespace dpar {

void check_loss_target(LossKind kind, const Shape& out, const Tensor& target, const char* operation) {
  if (kind == LossKind::kCrossEntropy) {
    DPAR_CHECK_ARG(out.ndim() == 2, operation, ": cross-entropy needs a (batch, classes) output, the model gives ",
                   out.str());
    DPAR_CHECK_ARG(target.dtype() == DType::kI32, operation, ": target must be i32 class labels, got ",
                   dtype_name(target.dtype()));
    DPAR_CHECK_ARG(target.shape().ndim() == 1 && target.rows() == out[0], operation, ": target ",
                   target.shape().str(), " must be (", out[0], ") labels, one per input row");
    // Checked here, on the host: a device kernel cannot refuse a label.
    std::vector<int32_t> copied;
    const int32_t* labels = target.i32();
    if (!target.device().is_host()) {
      copied.resize(static_cast<size_t>(target.rows()));
      backend_for(target.device()).copy_to_host(copied.data(), labels, copied.size() * sizeof(int32_t),
                                                target.device());
      labels = copied.data();
    }
    for (int64_t i = 0; i < target.rows(); ++i)
      DPAR_CHECK_ARG(labels[i] >= 0 && labels[i] < out[1], operation, ": target[", i, "] = ", labels[i],
                     " is out of range [0, ", out[1], ")");
  } else {
    DPAR_CHECK_ARG(target.dtype() == DType::kF32, operation, ": MSE target must be f32, got ",
                   dtype_name(target.dtype()));
    DPAR_CHECK_ARG(target.shape() == out, operation, ": MSE target ", target.shape().str(),
                   " must be shaped as the output ", out.str());
  }
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
