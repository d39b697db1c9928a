// LayerNorm and Embedding layers at the C boundary.
#include "capi/api.h"

using namespace dpar;
using namespace dpar::capi;

extern "C" {

DPAR_API dpar_status dpar_model_add_layernorm(dpar_model* model, int64_t normalized_size, float eps,
                                              int32_t elementwise_affine) {
  return guard([&] {
    checked(model, "model").model.add(make_layernorm(normalized_size, eps, elementwise_affine != 0));
  });
}

DPAR_API dpar_status dpar_model_add_embedding(dpar_model* model, int64_t num_embeddings, int64_t embedding_dim) {
  return guard([&] { checked(model, "model").model.add(make_embedding(num_embeddings, embedding_dim)); });
}

DPAR_API dpar_status dpar_model_add_embedding_padded(dpar_model* model, int64_t num_embeddings, int64_t embedding_dim,
                                                     int64_t padding_idx) {
  return guard([&] {
    checked(model, "model").model.add(make_embedding_padded(num_embeddings, embedding_dim, padding_idx));
  });
}

}  // extern "C"
