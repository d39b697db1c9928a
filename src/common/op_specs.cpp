#include "common/op_specs.h"

#include "common/error.h"

namespace dpar {

std::string Conv2dSpec::str() const {
  return detail::concat("conv2d(", in_channels, " -> ", out_channels, ", kernel ", kernel_h, "x", kernel_w,
                        ", stride ", stride_h, "x", stride_w, ", padding ", pad_h, "x", pad_w, ", dilation ",
                        dilation_h, "x", dilation_w, ", groups ", groups, bias ? "" : ", no bias",
                        epilogue == Epilogue::kNone ? "" : ", ", epilogue == Epilogue::kNone ? "" : epilogue_name(epilogue),
                        ")");
}

const char* epilogue_name(Epilogue epilogue) {
  switch (epilogue) {
    case Epilogue::kNone: return "none";
    case Epilogue::kRelu: return "relu";
    case Epilogue::kGelu: return "gelu";
  }
  return "unknown epilogue";
}

std::string Pool2dSpec::str() const {
  const char* name = kind == PoolKind::kMax ? "max_pool2d" : "avg_pool2d";
  if (global) return kind == PoolKind::kMax ? "adaptive_max_pool2d(1x1)" : "adaptive_avg_pool2d(1x1)";
  return detail::concat(name, "(kernel ", kernel_h, "x", kernel_w, ", stride ", stride_h, "x", stride_w,
                        ", padding ", pad_h, "x", pad_w, ")");
}

}  // namespace dpar
