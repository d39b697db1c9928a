// The kernel calls' names and keys, and the compositions a Stream runs for a kernel its backend lacks.
#include "backend/kernel_calls.h"

#include <array>
#include <type_traits>
#include <utility>
#include <vector>

#include "backend/stream.h"
#include "common/error.h"

namespace dpar {

Activation epilogue_activation(Epilogue epilogue) {
  switch (epilogue) {
    case Epilogue::kRelu: return Activation::kRelu;
    case Epilogue::kGelu: return Activation::kGelu;
    case Epilogue::kNone: break;
  }
  fail(Status::kInternal, "epilogue_activation: the epilogue ", epilogue_name(epilogue), " has no activation");
}

const char* activation_name(Activation kind) {
  switch (kind) {
    case Activation::kRelu: return "relu";
    case Activation::kGelu: return "gelu";
    case Activation::kTanh: return "tanh";
    case Activation::kSigmoid: return "sigmoid";
#define DPAR_ACTIVATION_NAME(Enum, Struct, name) \
  case Activation::Enum: return name;
      DPAR_POINTWISE_ACTIVATIONS(DPAR_ACTIVATION_NAME)
#undef DPAR_ACTIVATION_NAME
  }
  return "unknown activation";
}

namespace {
template <size_t... I>
constexpr std::array<const char*, sizeof...(I)> call_names(std::index_sequence<I...>) {
  return {std::variant_alternative_t<I, KernelCall>::kName...};
}
constexpr auto kOpNames = call_names(std::make_index_sequence<std::variant_size_v<KernelCall>>());
}  // namespace

const char* op_name(Op op) {
  const auto i = static_cast<size_t>(op);
  return i < kOpNames.size() ? kOpNames[i] : "unknown kernel";
}

std::string KernelKey::str() const {
  std::string s = std::string(op_name(op)) + " (" + dtype_name(dtype);
  if (epilogue != Epilogue::kNone) s += std::string(", ") + epilogue_name(epilogue) + " epilogue";
  if (out != DType::kF32) s += std::string(", ") + dtype_name(out) + " out";
  return s + ")";
}

namespace {
template <class C>
DType out_dtype_of(const C& c) {
  if constexpr (requires { c.out_dtype(); })
    return c.out_dtype();
  else
    return DType::kF32;
}
template <class C>
Epilogue epilogue_of(const C& c) {
  if constexpr (requires { c.epilogue; })
    return c.epilogue;
  else
    return Epilogue::kNone;
}
}  // namespace

KernelKey key_of(const KernelCall& call) {
  return std::visit(
      [&](const auto& c) {
        return KernelKey{static_cast<Op>(call.index()), c.dtype(), epilogue_of(c), out_dtype_of(c)};
      },
      call);
}

// ---- A Stream's run: the backend's kernel, or a composition of its kernels ---------------------------------------
namespace {

// The kernels a composition runs instead of an epilogue the backend does not fuse: the call without its epilogue,
// and the activation as its own pass. Bit for bit the fused kernel's result: the same operations on the same
// values, only with the intermediate in memory. Empty where the call has no composition.
std::vector<KernelCall> composition(const KernelCall& call) {
  std::vector<KernelCall> parts;
  if (const auto* c = std::get_if<call::LinearForward>(&call); c && c->epilogue != Epilogue::kNone) {
    // GELU's backward reads its input, so the GEMM writes pre (given for that); ReLU's reads out, so in place.
    const TensorRef& mid = c->epilogue == Epilogue::kGelu ? c->pre : c->out;
    if (!mid.defined()) return {};
    call::LinearForward plain = *c;
    plain.out = mid;
    plain.pre = {};
    plain.epilogue = Epilogue::kNone;
    parts.push_back(plain);
    parts.push_back(call::ActivationForward{epilogue_activation(c->epilogue), c->out, mid});
  } else if (const auto* c = std::get_if<call::LinearBackward>(&call); c && c->epilogue != Epilogue::kNone) {
    if (!c->dpre.defined()) return {};
    parts.push_back(call::ActivationBackward{epilogue_activation(c->epilogue), c->dpre, c->dout, c->pre, c->out});
    call::LinearBackward plain = *c;
    plain.dout = c->dpre;
    plain.dpre = plain.out = plain.pre = {};
    plain.epilogue = Epilogue::kNone;
    parts.push_back(plain);
  } else if (const auto* c = std::get_if<call::BatchNormApply>(&call); c && c->epilogue != Epilogue::kNone) {
    call::BatchNormApply plain = *c;
    plain.epilogue = Epilogue::kNone;
    parts.push_back(plain);
    parts.push_back(call::ActivationForward{epilogue_activation(c->epilogue), c->out, c->out});
  }
  return parts;
}

}  // namespace

bool Stream::can_run(const KernelKey& key) const {
  if (supports(key)) return true;
  if (key.epilogue == Epilogue::kNone || key.out != DType::kF32) return false;
  // The compositions above: the kernel without its epilogue and the activation, forward or backward.
  const bool backward = key.op == Op::kLinearBackward;
  // The activation runs on the kernel's output: a linear layer's is f32 in every compute dtype (its bf16 operands
  // give an f32 result), BatchNorm's is its input's dtype.
  const DType activation_dtype = key.op == Op::kBatchNormApply ? key.dtype : DType::kF32;
  return (key.op == Op::kLinearForward || key.op == Op::kLinearBackward || key.op == Op::kBatchNormApply) &&
         supports({key.op, key.dtype, Epilogue::kNone}) &&
         supports({backward ? Op::kActivationBackward : Op::kActivationForward, activation_dtype, Epilogue::kNone});
}

void Stream::run(const KernelCall& call) {
  const KernelKey key = key_of(call);
  if (supports(key)) return execute(call);
  // A rounded output has no composition: the activation would run on the rounded values.
  std::vector<KernelCall> parts = key.out == DType::kF32 ? composition(call) : std::vector<KernelCall>{};
  bool composable = !parts.empty();
  for (const KernelCall& part : parts) composable = composable && supports(key_of(part));
  if (!composable) {
    std::string lacking;
    for (const KernelCall& part : parts)
      if (!supports(key_of(part))) lacking += (lacking.empty() ? "" : ", ") + key_of(part).str();
    const std::string why = lacks_why(key);
    fail(Status::kNotSupported, key.str(), " on ", device().str(), ": this backend has no such kernel",
         why.empty() ? std::string() : " (" + why + ")",
         parts.empty() ? std::string(" and no composition of others stands in for it")
                       : " and cannot compose it (it lacks " + lacking + ")");
  }
  for (const KernelCall& part : parts) execute(part);
}

}  // namespace dpar
