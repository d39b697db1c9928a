// Losses of the fused training step: the target's checks on the host (which count the samples the mean divides
// by), and each replica's forward + backward of the SUM of its rows' losses through the replica's backend (the
// engine divides by the global count of samples).
#pragma once

#include <cstdint>
#include <vector>

#include "nn/layer.h"
#include "tensor/tensor.h"

namespace dpar {

enum class LossKind : int32_t { kCrossEntropy = 0, kMse = 1 };

// Checks a target against the model's output shape for a whole batch and counts the loss's samples in each row
// (leading index) of the batch, which the engine adds up into the divisor of the mean:
//  - cross-entropy: an output (B, ..., classes), the classes on the LAST dimension, as a GPT applies it to
//    logits.view(-1, V) and targets.view(-1) (PyTorch's CrossEntropyLoss itself takes (N, C, d1...) instead); an
//    i32 target (B, ...) of the output's leading shape, each in [0, classes) or kIgnoreIndex. A row's samples are
//    its targets that are not ignored.
//  - MSE: an f32 target shaped as the output; each row is one sample (its loss is the mean over its elements).
// Throws INVALID_ARGUMENT naming `operation` and what does not fit (a target out of range by its value and its
// position). Labels on a device are copied to the host for the range check (a device kernel cannot refuse a
// label); where a target may live is the caller's check.
std::vector<int64_t> check_loss_target(LossKind kind, const Shape& output, const Tensor& target,
                                       const char* operation);

// *loss_sum (a double in the replica's device memory) = the sum over the rows of out of their losses (over their
// targets that are not ignored, for cross-entropy), and dout = d(that sum)/d(out) * grad_scale (zero where a target
// is ignored). out and dout (rows, ...), target the matching rows on the same device.
void loss_forward_backward(LossKind kind, const ReplicaContext& ctx, double* loss_sum, const Tensor& dout,
                           const Tensor& out, const Tensor& target, float grad_scale);

}  // namespace dpar
