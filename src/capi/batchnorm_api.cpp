// BatchNorm layers and the model's buffers (state that is not a parameter, such as BatchNorm's running statistics)
// at the C boundary.
#include "capi/api.h"

using namespace dpar;
using namespace dpar::capi;

namespace {

const BufferInfo& buffer_at(const Model& m, size_t index) {
  DPAR_CHECK_ARG(index < m.buffers().size(), "index: ", index, " is out of range (the model has ",
                 m.buffers().size(), " buffers)");
  return m.buffers()[index];
}

void check_count(const BufferInfo& b, size_t count) {
  DPAR_CHECK_ARG(count == static_cast<size_t>(buffer_numel(b.shape)), "count: ", count, " differs from buffer \"",
                 b.name, "\"'s ", buffer_numel(b.shape), " elements");
}

dpar_status add_batchnorm(dpar_model* model, int dims, int64_t num_features, float eps, float momentum,
                          int32_t affine) {
  return guard([&] { checked(model, "model").model.add(make_batchnorm(dims, num_features, eps, momentum, affine != 0)); });
}

}  // namespace

extern "C" {

DPAR_API dpar_status dpar_model_add_batchnorm1d(dpar_model* model, int64_t num_features, float eps, float momentum,
                                                int32_t affine) {
  return add_batchnorm(model, 1, num_features, eps, momentum, affine);
}

DPAR_API dpar_status dpar_model_add_batchnorm2d(dpar_model* model, int64_t num_features, float eps, float momentum,
                                                int32_t affine) {
  return add_batchnorm(model, 2, num_features, eps, momentum, affine);
}

DPAR_API dpar_status dpar_model_add_sync_batchnorm(dpar_model* model, int64_t num_features, float eps,
                                                   float momentum, int32_t affine) {
  return add_batchnorm(model, 0, num_features, eps, momentum, affine);
}

DPAR_API dpar_status dpar_model_convert_sync_batchnorm(dpar_model* model) {
  return guard([&] { checked(model, "model").model.convert_sync_batchnorm(); });
}

DPAR_API dpar_status dpar_model_num_buffers(size_t* out, const dpar_model* model) {
  return guard([&] { *checked_out(out) = checked(model, "model").model.buffers().size(); });
}

DPAR_API const char* dpar_model_buffer_name(const dpar_model* model, size_t index) {
  const char* name = nullptr;
  guard([&] { name = buffer_at(checked(model, "model").model, index).name.c_str(); });
  return name;
}

DPAR_API dpar_status dpar_model_buffer_info(int32_t* out_dtype, int64_t* out_shape, size_t* out_ndim,
                                            const dpar_model* model, size_t index) {
  return guard([&] {
    const BufferInfo& b = buffer_at(checked(model, "model").model, index);
    if (out_dtype) *out_dtype = b.dtype == DType::kF32 ? DPAR_F32 : DPAR_I64;
    if (out_shape)
      for (size_t i = 0; i < b.shape.ndim(); ++i) out_shape[i] = b.shape[i];
    if (out_ndim) *out_ndim = b.shape.ndim();
  });
}

DPAR_API dpar_status dpar_model_get_buffer(void* dst, const dpar_model* model, size_t index, size_t count) {
  return guard([&] {
    const Model& m = checked(model, "model").model;
    const BufferInfo& b = buffer_at(m, index);
    DPAR_CHECK_ARG(dst != nullptr, "dst: is NULL");
    check_count(b, count);
    if (b.dtype == DType::kF32)
      std::memcpy(dst, m.buffer_f32().data() + b.offset, count * sizeof(float));
    else
      std::memcpy(dst, m.buffer_i64().data() + b.offset, count * sizeof(int64_t));
  });
}

DPAR_API dpar_status dpar_model_set_buffer(dpar_model* model, size_t index, const void* src, size_t count) {
  return guard([&] {
    Model& m = checked(model, "model").model;
    const BufferInfo& b = buffer_at(m, index);
    DPAR_CHECK_ARG(src != nullptr, "src: is NULL");
    check_count(b, count);
    if (b.dtype == DType::kF32)
      std::memcpy(m.buffer_f32().data() + b.offset, src, count * sizeof(float));
    else
      std::memcpy(m.buffer_i64().data() + b.offset, src, count * sizeof(int64_t));
  });
}

}  // extern "C"
