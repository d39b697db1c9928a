#include "common/dtype.h"

#include "common/error.h"

namespace dpar {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 4;
    case DType::kI32: return 4;
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kF64: return 8;
    case DType::kI64: return 8;
  }
  fail(Status::kInvalidArgument, "dtype: unknown element type ", static_cast<int32_t>(dtype));
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kI32: return "i32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kF64: return "f64";
    case DType::kI64: return "i64";
  }
  return "unknown dtype";
}

}  // namespace dpar
