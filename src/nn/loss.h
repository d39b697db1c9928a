// Losses of the fused training step: the target's checks on the host, and each replica's forward + backward of
// the SUM of its rows' losses through the replica's backend (the engine scales by the global batch).
#pragma once

#include <cstdint>

#include "nn/layer.h"
#include "tensor/tensor.h"

namespace dpar {

enum class LossKind : int32_t { kCrossEntropy = 0, kMse = 1 };

// Checks a target against the model's output shape for a whole batch: cross-entropy takes (B) i32 labels in
// [0, classes) for a (B, classes) output, MSE an f32 target shaped as the output. Throws INVALID_ARGUMENT naming
// `operation` and what does not fit. Labels on a device are copied to the host for the range check (a device
// kernel cannot refuse a label); where a target may live is the caller's check.
void check_loss_target(LossKind kind, const Shape& output, const Tensor& target, const char* operation);

// *loss_sum (a double in the replica's device memory) = the sum over the rows of out of their losses, and
// dout = d(that sum)/d(out) * grad_scale. out and dout (rows, ...), target the matching rows on the same device.
void loss_forward_backward(LossKind kind, const ReplicaContext& ctx, double* loss_sum, const Tensor& dout,
                           const Tensor& out, const Tensor& target, float grad_scale);

}  // namespace dpar
