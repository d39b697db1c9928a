// The one place where dpar.h's codes meet the core's: statuses, element types, device kinds and faults. The core's
// enums carry the C numbers, checked here pair by pair, so that every conversion is a cast that cannot drift.
#pragma once

#include <cstdint>

#include "common/status.h"
#include "device/device.h"
#include "dpar.h"
#include "nn/layer.h"
#include "tensor/tensor.h"

namespace dpar::capi {

static_assert(static_cast<int32_t>(Status::kOk) == DPAR_OK);
static_assert(static_cast<int32_t>(Status::kInvalidArgument) == DPAR_ERR_INVALID_ARGUMENT);
static_assert(static_cast<int32_t>(Status::kOutOfMemory) == DPAR_ERR_OUT_OF_MEMORY);
static_assert(static_cast<int32_t>(Status::kDevice) == DPAR_ERR_DEVICE);
static_assert(static_cast<int32_t>(Status::kCommunication) == DPAR_ERR_COMMUNICATION);
static_assert(static_cast<int32_t>(Status::kRemote) == DPAR_ERR_REMOTE);
static_assert(static_cast<int32_t>(Status::kTimeout) == DPAR_ERR_TIMEOUT);
static_assert(static_cast<int32_t>(Status::kMismatch) == DPAR_ERR_MISMATCH);
static_assert(static_cast<int32_t>(Status::kIo) == DPAR_ERR_IO);
static_assert(static_cast<int32_t>(Status::kCorrupt) == DPAR_ERR_CORRUPT);
static_assert(static_cast<int32_t>(Status::kNotSupported) == DPAR_ERR_NOT_SUPPORTED);
static_assert(static_cast<int32_t>(Status::kInvalidState) == DPAR_ERR_INVALID_STATE);
static_assert(static_cast<int32_t>(Status::kInternal) == DPAR_ERR_INTERNAL);
// DPAR_ERR_INTERNAL is the last code: a new C code needs its core twin above, and from_c_error learns it.
static_assert(DPAR_ERR_INTERNAL == -12, "a status was added to dpar.h: give the core its twin and check it here");

static_assert(static_cast<int32_t>(DType::kF32) == DPAR_F32);
static_assert(static_cast<int32_t>(DType::kI32) == DPAR_I32);
static_assert(static_cast<int32_t>(DType::kBF16) == DPAR_BF16);
static_assert(static_cast<int32_t>(DType::kF16) == DPAR_F16);
static_assert(static_cast<int32_t>(DType::kF64) == DPAR_F64);
static_assert(static_cast<int32_t>(DType::kI64) == DPAR_I64);

static_assert(static_cast<int32_t>(DeviceKind::kCpu) == DPAR_DEVICE_CPU);
static_assert(static_cast<int32_t>(DeviceKind::kCuda) == DPAR_DEVICE_CUDA);

static_assert(static_cast<int32_t>(Fault::kNone) == DPAR_FAULT_NONE);
static_assert(static_cast<int32_t>(Fault::kAlloc) == DPAR_FAULT_ALLOC);
static_assert(static_cast<int32_t>(Fault::kForward) == DPAR_FAULT_FORWARD);
static_assert(static_cast<int32_t>(Fault::kBackward) == DPAR_FAULT_BACKWARD);

static_assert(Shape::kMaxDims == DPAR_MAX_DIMS);

constexpr dpar_status to_c(Status status) { return static_cast<dpar_status>(status); }
constexpr int32_t to_c(DType dtype) { return static_cast<int32_t>(dtype); }
constexpr int32_t to_c(DeviceKind kind) { return static_cast<int32_t>(kind); }
inline dpar_device to_c(Device device) { return dpar_device{to_c(device.kind), device.index}; }

// The status of an error a caller's callback returned: one dpar knows keeps its code; anything else (an unknown
// code, or a non-negative one where an error was expected) is an internal error.
constexpr Status from_c_error(dpar_status status) {
  return status < DPAR_OK && status >= DPAR_ERR_INTERNAL ? static_cast<Status>(status) : Status::kInternal;
}

// A device kind from a C caller: unknown kinds are invalid; kinds not built into this library are not supported.
DeviceKind checked_device_kind(int32_t kind, const char* argument);
// A fault from a C caller: unknown faults are invalid arguments.
Fault checked_fault(int32_t fault, const char* argument);
// A tensor's element type from a C caller: reserved types and the collectives' wider ones are not supported.
DType checked_dtype(int32_t dtype, const char* argument);

}  // namespace dpar::capi
