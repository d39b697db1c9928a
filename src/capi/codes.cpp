// The checks of codes a C caller passes in (codes.h): each names the argument it refuses.
#include "capi/codes.h"

#include "backend/backend.h"
#include "common/error.h"

namespace dpar::capi {

DType checked_dtype(int32_t dtype, const char* argument) {
  switch (dtype) {
    case DPAR_F32: return DType::kF32;
    case DPAR_I32: return DType::kI32;
    case DPAR_BF16:
    case DPAR_F16:
    case DPAR_U8:
      fail(Status::kNotSupported, argument, ": dtype ", dtype, " is reserved and not supported yet (use f32 or i32)");
    case DPAR_F64:
    case DPAR_I64: fail(Status::kNotSupported, argument, ": dtype ", dtype, " is for collectives; tensors hold f32 or i32");
    default: fail(Status::kInvalidArgument, argument, ": unknown dtype ", dtype);
  }
}

DeviceKind checked_device_kind(int32_t kind, const char* argument) {
  DeviceKind k;
  switch (kind) {
    case DPAR_DEVICE_CPU: k = DeviceKind::kCpu; break;
    case DPAR_DEVICE_CUDA: k = DeviceKind::kCuda; break;
    default: fail(Status::kInvalidArgument, argument, ": unknown device kind ", kind);
  }
  DPAR_ENFORCE(backend_built(k), Status::kNotSupported, argument, ": device kind ", kind == DPAR_DEVICE_CUDA ? "cuda" : "?",
               ": this dpar was built without CUDA");
  return k;
}

Fault checked_fault(int32_t fault, const char* argument) {
  DPAR_CHECK_ARG(fault >= DPAR_FAULT_NONE && fault <= DPAR_FAULT_BACKWARD, argument, ": unknown fault ", fault);
  return static_cast<Fault>(fault);
}

}  // namespace dpar::capi
