// Layers: forward and backward of one stage of a sequential model, on one replica.
// A Layer object belongs to one replica (clone() makes the others); its parameters are views into the replica's
// flat parameter and gradient buffers, which the reducer and optimizer treat as single arrays.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/stream.h"
#include "device/device.h"
#include "tensor/tensor.h"

namespace dpar {

enum class Fault : int32_t { kNone = DPAR_FAULT_NONE, kAlloc = DPAR_FAULT_ALLOC, kForward = DPAR_FAULT_FORWARD, kBackward = DPAR_FAULT_BACKWARD };

// What a layer may know about the replica that runs it.
struct ReplicaContext {
  size_t replica = 0;
  Device device;
  Stream* stream = nullptr;        // the replica's kernels and ordered copies
  bool training = true;
  uint64_t rng_seed = 0;       // this replica's stream
  uint64_t* rng_offset = nullptr;  // advanced by every draw; persists across steps
  Fault* armed_fault = nullptr;    // one-shot fault injection (tests)

  // Allocates on this replica's device (honouring an armed allocation fault).
  Tensor alloc(DType dtype, const Shape& shape) const;
  // Throws if `fault` is armed, and disarms it.
  void maybe_fail(Fault fault, const char* where) const;
};

enum class InitKind { kZeros, kUniform };

struct ParamSpec {
  std::string name;  // "weight"
  Shape shape;
  InitKind init = InitKind::kZeros;
  float bound = 0.0f;  // for kUniform: U(-bound, bound)
};

class Layer {
 public:
  virtual ~Layer() = default;
  virtual std::string describe() const = 0;  // "linear(784 -> 256)"
  virtual std::vector<ParamSpec> param_specs() const { return {}; }
  // The output shape for an input shape; throws Error(INVALID_ARGUMENT) naming what does not fit.
  virtual Shape output_shape(const Shape& in) const = 0;
  virtual std::unique_ptr<Layer> clone() const = 0;

  // Points the layer at its parameters and gradients (one pointer per param_specs() entry), and gives it the
  // same as tensors sharing the replica's storage, for a layer that hands them out (a custom layer's callback may
  // export one through DLPack, and the export must keep the memory alive).
  void bind(std::vector<float*> params, std::vector<float*> grads, std::vector<Tensor> param_views = {},
            std::vector<Tensor> grad_views = {}) {
    params_ = std::move(params);
    grads_ = std::move(grads);
    bound_params_ = std::move(param_views);
    bound_grads_ = std::move(grad_views);
  }

  // in (B, ...) -> out (B, ...), with out preallocated to output_shape(in).
  virtual void forward(const ReplicaContext& ctx, const Tensor& in, const Tensor& out) = 0;
  // Given dout, writes din (when din is defined) and the parameter gradients: overwriting them when
  // accumulate is false, adding to them when true. in/out are the tensors of the matching forward.
  virtual void backward(const ReplicaContext& ctx, const Tensor& in, const Tensor& out, const Tensor& dout,
                        const Tensor& din, bool accumulate) = 0;

 protected:
  std::vector<float*> params_;
  std::vector<float*> grads_;
  std::vector<Tensor> bound_params_, bound_grads_;  // views (shape of param_specs()[i]) of params_[i], grads_[i]
};

std::unique_ptr<Layer> make_linear(int64_t in_features, int64_t out_features, bool bias);
std::unique_ptr<Layer> make_activation(Activation activation);
std::unique_ptr<Layer> make_dropout(float p);

}  // namespace dpar
