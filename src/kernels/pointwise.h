// Pointwise activations defined once for every backend: each is a struct whose forward and backward are the math
// of one element, compiled for the host (the CPU kernels' loop) and for the device (the CUDA kernels' grid-stride
// loop) from this one definition, so the two compute the same operations in the same order.
//
// Adding one is adding its struct and its line in DPAR_POINTWISE_ACTIVATIONS below: the Activation enum
// (backend/kernel_calls.h), its name, and both backends' kernels follow from the list. (ReLU, GELU, tanh and
// sigmoid predate this list: their kernels are written out per backend, the CPU's vectorised.)
#pragma once

#include <cmath>
#include <cstdint>

#include "common/host_device.h"

namespace dpar::kernels {

// SiLU (swish): out = x * sigmoid(x), as PyTorch's nn.SiLU computes it: x / (1 + exp(-x)).
// Backward, as PyTorch's silu_backward: dinp = dout * s * (1 + x * (1 - s)) with s = 1 / (1 + exp(-x)).
struct Silu {
  DPAR_HOST_DEVICE static inline float forward(float x) { return x / (1.0f + expf(-x)); }
  // Reads the forward input x (its output y is not used).
  DPAR_HOST_DEVICE static inline float backward(float dy, float x, float /*y*/) {
    const float s = 1.0f / (1.0f + expf(-x));
    return dy * (s * (1.0f + x * (1.0f - s)));
  }
};

// X(EnumName, struct, "name"): the activations above, in the order of their Activation numbers after kSigmoid.
#define DPAR_POINTWISE_ACTIVATIONS(X) X(kSilu, Silu, "silu")

}  // namespace dpar::kernels
