#include "common/op_specs.h"

#include <cmath>

#include "common/error.h"

namespace dpar {

std::string Conv2dSpec::str() const {
  return detail::concat("conv2d(", in_channels, " -> ", out_channels, ", kernel ", kernel_h, "x", kernel_w,
                        ", stride ", stride_h, "x", stride_w, ", padding ", pad_h, "x", pad_w, ", dilation ",
                        dilation_h, "x", dilation_w, ", groups ", groups, bias ? "" : ", no bias",
                        epilogue == Epilogue::kNone ? "" : ", ", epilogue == Epilogue::kNone ? "" : epilogue_name(epilogue),
                        ")");
}

float AttentionSpec::scale_for(int64_t head_dim) const {
  return scale != 0.0f ? scale : static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
}

std::string AttentionSpec::str() const {
  return detail::concat("attention(", heads, heads == 1 ? " head" : " heads", causal ? ", causal" : "",
                        scale != 0.0f ? ", scale " : "", scale != 0.0f ? std::to_string(scale) : "", ")");
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
