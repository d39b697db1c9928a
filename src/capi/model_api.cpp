#include "capi/api.h"

#include <array>

using namespace dpar;
using namespace dpar::capi;

extern "C" {

// What programs built against dpar.h 0.4 or older call (dpar.h now makes the name a macro that passes the
// caller's size to dpar_model_options_init_sized): it writes dpar.h 0.4's layout, whatever this library's is.
DPAR_API dpar_status (dpar_model_options_init)(dpar_model_options* opts) {
  return guard([&] { init_unsized_options(opts, "opts"); });
}

DPAR_API dpar_status dpar_model_options_init_sized(dpar_model_options* opts, size_t size) {
  return guard([&] { init_options(opts, size, "opts"); });
}

DPAR_API dpar_status dpar_model_create(dpar_model** out, const dpar_model_options* opts) {
  return guard([&] {
    checked_out(out);
    *out = nullptr;
    const dpar_model_options o =
        read_options(opts, "opts");
    *out = new_handle<dpar_model>(o.seed);
  });
}

DPAR_API void dpar_model_free(dpar_model* model) { free_handle(model); }

DPAR_API dpar_status dpar_model_add_linear(dpar_model* model, int64_t in_features, int64_t out_features,
                                           int32_t has_bias) {
  return guard([&] { checked(model, "model").model.add(make_linear(in_features, out_features, has_bias != 0)); });
}

static_assert(static_cast<int>(Activation::kRelu) == DPAR_RELU && static_cast<int>(Activation::kGelu) == DPAR_GELU &&
              static_cast<int>(Activation::kTanh) == DPAR_TANH && static_cast<int>(Activation::kSigmoid) == DPAR_SIGMOID &&
              static_cast<int>(Activation::kSilu) == DPAR_SILU);

DPAR_API dpar_status dpar_model_add_activation(dpar_model* model, int32_t activation) {
  return guard([&] {
    Model& m = checked(model, "model").model;
    DPAR_CHECK_ARG(activation >= DPAR_RELU && activation <= DPAR_SILU, "activation: unknown kind ", activation);
    m.add(make_activation(static_cast<Activation>(activation)));
  });
}

DPAR_API dpar_status dpar_model_add_dropout(dpar_model* model, float p) {
  return guard([&] { checked(model, "model").model.add(make_dropout(p)); });
}

// A pair (height, width) from a C caller: `fallback` for NULL (kernel_size has none: NULL is refused).
static std::array<int64_t, 2> pair_arg(const int64_t* pair, const char* name, const std::array<int64_t, 2>* fallback) {
  if (pair == nullptr) {
    DPAR_CHECK_ARG(fallback != nullptr, name, ": is NULL");
    return *fallback;
  }
  return {pair[0], pair[1]};
}

DPAR_API dpar_status dpar_model_add_conv2d(dpar_model* model, int64_t in_channels, int64_t out_channels,
                                           const int64_t kernel_size[2], const int64_t stride[2],
                                           const int64_t padding[2], const int64_t dilation[2], int64_t groups,
                                           int32_t has_bias) {
  return guard([&] {
    Model& m = checked(model, "model").model;
    static constexpr std::array<int64_t, 2> ones{1, 1}, zeros{0, 0};
    const auto k = pair_arg(kernel_size, "kernel_size", nullptr), s = pair_arg(stride, "stride", &ones),
               p = pair_arg(padding, "padding", &zeros), d = pair_arg(dilation, "dilation", &ones);
    Conv2dSpec spec;
    spec.in_channels = in_channels, spec.out_channels = out_channels, spec.groups = groups, spec.bias = has_bias != 0;
    spec.kernel_h = k[0], spec.kernel_w = k[1], spec.stride_h = s[0], spec.stride_w = s[1];
    spec.pad_h = p[0], spec.pad_w = p[1], spec.dilation_h = d[0], spec.dilation_w = d[1];
    m.add(make_conv2d(spec));
  });
}

static void add_pool2d(dpar_model* model, PoolKind kind, const int64_t* kernel_size, const int64_t* stride,
                       const int64_t* padding) {
  Model& m = checked(model, "model").model;
  static constexpr std::array<int64_t, 2> zeros{0, 0};
  const auto k = pair_arg(kernel_size, "kernel_size", nullptr), s = pair_arg(stride, "stride", &k),
             p = pair_arg(padding, "padding", &zeros);
  Pool2dSpec spec;
  spec.kind = kind;
  spec.kernel_h = k[0], spec.kernel_w = k[1], spec.stride_h = s[0], spec.stride_w = s[1];
  spec.pad_h = p[0], spec.pad_w = p[1];
  m.add(make_pool2d(spec));
}

DPAR_API dpar_status dpar_model_add_max_pool2d(dpar_model* model, const int64_t kernel_size[2],
                                               const int64_t stride[2], const int64_t padding[2]) {
  return guard([&] { add_pool2d(model, PoolKind::kMax, kernel_size, stride, padding); });
}

DPAR_API dpar_status dpar_model_add_avg_pool2d(dpar_model* model, const int64_t kernel_size[2],
                                               const int64_t stride[2], const int64_t padding[2]) {
  return guard([&] { add_pool2d(model, PoolKind::kAvg, kernel_size, stride, padding); });
}

DPAR_API dpar_status dpar_model_add_adaptive_avg_pool2d(dpar_model* model, int64_t output_h, int64_t output_w) {
  return guard([&] { checked(model, "model").model.add(make_adaptive_avg_pool2d(output_h, output_w)); });
}

// What programs built against dpar.h 0.4 or older call (dpar.h now makes the name a macro that passes the
// caller's size to dpar_custom_layer_init_sized): it writes dpar.h 0.4's layout, whatever this library's is.
DPAR_API dpar_status (dpar_custom_layer_init)(dpar_custom_layer* layer) {
  return guard([&] { init_unsized_options(layer, "layer"); });
}

DPAR_API dpar_status dpar_custom_layer_init_sized(dpar_custom_layer* layer, size_t size) {
  return guard([&] { init_options(layer, size, "layer"); });
}

DPAR_API dpar_status dpar_model_add_custom(dpar_model* model, const dpar_custom_layer* layer) {
  return guard([&] {
    auto& m = checked(model, "model").model;
    DPAR_CHECK_ARG(layer != nullptr, "layer: is NULL");
    // A struct dpar cannot read (unknown version) is refused before its destroy is trusted.
    const dpar_custom_layer desc =
        read_options(layer, "layer");
    // The layer owns the payload from make_custom_layer's first line: one refused there or by add() releases it.
    m.add(make_custom_layer(desc));
  });
}

static std::vector<int32_t> node_ids(const int32_t* inputs, size_t n) {
  DPAR_CHECK_ARG(inputs != nullptr || n == 0, "inputs: is NULL");
  // Bounded before the list is copied: a count no array holds must not become an allocation.
  DPAR_CHECK_ARG(n <= kMaxJoinInputs, "n: ", n, " inputs; a join reads 2 or more (at most ", kMaxJoinInputs, ")");
  return std::vector<int32_t>(inputs, inputs + n);
}

DPAR_API dpar_status dpar_model_last_node(int32_t* out, const dpar_model* model) {
  return guard([&] { *checked_out(out) = checked(model, "model").model.last_node(); });
}

DPAR_API dpar_status dpar_model_branch_from(dpar_model* model, int32_t node) {
  return guard([&] { checked(model, "model").model.branch_from(node); });
}

DPAR_API dpar_status dpar_model_set_node_name(dpar_model* model, int32_t node, const char* name) {
  return guard([&] {
    Model& m = checked(model, "model").model;
    DPAR_CHECK_ARG(name != nullptr, "name: is NULL");
    m.set_node_name(node, name);
  });
}

DPAR_API dpar_status dpar_model_tie_param(dpar_model* model, int32_t node, const char* param, int32_t source_node,
                                          const char* source_param) {
  return guard([&] {
    Model& m = checked(model, "model").model;
    DPAR_CHECK_ARG(param != nullptr, "param: is NULL");
    DPAR_CHECK_ARG(source_param != nullptr, "source_param: is NULL");
    m.tie_param(node, param, source_node, source_param);
  });
}

DPAR_API dpar_status dpar_model_add_sum(dpar_model* model, const int32_t* inputs, size_t n) {
  return guard([&] {
    Model& m = checked(model, "model").model;
    m.add_sum(node_ids(inputs, n));
  });
}

DPAR_API dpar_status dpar_model_add_concat(dpar_model* model, const int32_t* inputs, size_t n) {
  return guard([&] {
    Model& m = checked(model, "model").model;
    m.add_concat(node_ids(inputs, n));
  });
}

DPAR_API dpar_status dpar_model_add_flatten(dpar_model* model) {
  return guard([&] { checked(model, "model").model.add_flatten(); });
}

DPAR_API dpar_status dpar_model_add_reshape(dpar_model* model, const int64_t* row_shape, size_t ndim) {
  return guard([&] {
    Model& m = checked(model, "model").model;
    DPAR_CHECK_ARG(row_shape != nullptr || ndim == 0, "row_shape: is NULL");
    DPAR_CHECK_ARG(ndim >= 1 && ndim < DPAR_MAX_DIMS, "ndim: ", ndim, " must be 1 to ", DPAR_MAX_DIMS - 1,
                   " (the batch dimension comes on top)");
    m.add_reshape(std::vector<int64_t>(row_shape, row_shape + ndim));
  });
}

DPAR_API dpar_status dpar_model_num_layers(size_t* out, const dpar_model* model) {
  return guard([&] { *checked_out(out) = checked(model, "model").model.num_nodes(); });
}

DPAR_API dpar_status dpar_model_num_params(size_t* out, const dpar_model* model) {
  return guard([&] { *checked_out(out) = checked(model, "model").model.params().size(); });
}

DPAR_API dpar_status dpar_model_num_param_elements(size_t* out, const dpar_model* model) {
  return guard([&] { *checked_out(out) = checked(model, "model").model.num_param_elements(); });
}

static const ParamInfo& param_at(const Model& m, size_t index) {
  DPAR_CHECK_ARG(index < m.params().size(), "index: ", index, " is out of range (the model has ", m.params().size(),
                 " parameters)");
  return m.params()[index];
}

DPAR_API dpar_status dpar_model_param_info(int64_t* out_shape, size_t* out_ndim, const dpar_model* model,
                                           size_t index) {
  return guard([&] {
    const ParamInfo& p = param_at(checked(model, "model").model, index);
    if (out_shape)
      for (size_t i = 0; i < p.shape.ndim(); ++i) out_shape[i] = p.shape[i];
    if (out_ndim) *out_ndim = p.shape.ndim();
  });
}

DPAR_API const char* dpar_model_param_name(const dpar_model* model, size_t index) {
  const char* name = nullptr;
  guard([&] { name = param_at(checked(model, "model").model, index).name.c_str(); });
  return name;
}

DPAR_API dpar_status dpar_model_param_decays(int32_t* out, const dpar_model* model, size_t index) {
  return guard([&] {
    int32_t* dst = checked_out(out);
    *dst = param_at(checked(model, "model").model, index).decays ? 1 : 0;
  });
}

DPAR_API dpar_status dpar_model_get_param(float* dst, const dpar_model* model, size_t index, size_t count) {
  return guard([&] {
    const Model& m = checked(model, "model").model;
    const ParamInfo& p = param_at(m, index);
    DPAR_CHECK_ARG(dst != nullptr, "dst: is NULL");
    DPAR_CHECK_ARG(count == static_cast<size_t>(p.shape.numel()), "count: ", count, " differs from parameter \"",
                   p.name, "\"'s ", p.shape.numel(), " elements");
    std::memcpy(dst, m.values().data() + p.offset, count * sizeof(float));
  });
}

DPAR_API dpar_status dpar_model_set_param(dpar_model* model, size_t index, const float* src, size_t count) {
  return guard([&] {
    Model& m = checked(model, "model").model;
    const ParamInfo& p = param_at(m, index);
    DPAR_CHECK_ARG(src != nullptr, "src: is NULL");
    DPAR_CHECK_ARG(count == static_cast<size_t>(p.shape.numel()), "count: ", count, " differs from parameter \"",
                   p.name, "\"'s ", p.shape.numel(), " elements");
    std::memcpy(m.values().data() + p.offset, src, count * sizeof(float));
  });
}

// What programs built against dpar.h 0.4 or older call (dpar.h now makes the name a macro that passes the
// caller's size to dpar_optimizer_options_init_sized): it writes dpar.h 0.4's layout, whatever this library's is.
DPAR_API dpar_status (dpar_optimizer_options_init)(dpar_optimizer_options* opts) {
  return guard([&] { init_unsized_options(opts, "opts"); });
}

DPAR_API dpar_status dpar_optimizer_options_init_sized(dpar_optimizer_options* opts, size_t size) {
  return guard([&] { init_options(opts, size, "opts"); });
}

}  // extern "C"
