// What a transformer adds to a model at the C boundary: learned positions and attention.
#include "capi/api.h"

using namespace dpar;
using namespace dpar::capi;

extern "C" {

DPAR_API dpar_status dpar_model_add_position_embedding(dpar_model* model, int64_t max_positions,
                                                       int64_t embedding_dim) {
  return guard([&] { checked(model, "model").model.add(make_position_embedding(max_positions, embedding_dim)); });
}

DPAR_API dpar_status dpar_model_add_attention(dpar_model* model, const int32_t* inputs, size_t n, int64_t num_heads,
                                              int32_t is_causal, float dropout_p, float scale) {
  return guard([&] {
    Model& m = checked(model, "model").model;
    DPAR_CHECK_ARG(n == 0 || n == 1 || n == 3, "n: ", n,
                   " inputs; attention reads q, k and v (3), one packed projection (1), or the next input (0)");
    DPAR_CHECK_ARG(n == 0 || inputs != nullptr, "inputs: is NULL for ", n, " inputs");
    AttentionSpec spec;
    spec.heads = num_heads;
    spec.causal = is_causal != 0;
    spec.scale = scale;
    auto layer = make_attention(spec, dropout_p, n == 3 ? 3 : 1);
    if (n == 0)
      m.add(std::move(layer));
    else
      m.add(std::move(layer), std::vector<int32_t>(inputs, inputs + n));
  });
}

DPAR_API dpar_status dpar_model_add_multihead_attention(dpar_model* model, int64_t embed_dim, int64_t num_heads,
                                                        float dropout_p, int32_t has_bias, int32_t is_causal) {
  return guard([&] {
    Model& m = checked(model, "model").model;
    AttentionSpec spec;
    spec.heads = num_heads;
    spec.causal = is_causal != 0;
    m.add(make_multihead_attention(embed_dim, spec, dropout_p, has_bias != 0));
  });
}

DPAR_API dpar_status dpar_model_add_causal_self_attention(dpar_model* model, int64_t n_embd, int64_t n_head,
                                                          float dropout_p, int32_t has_bias, const char* name) {
  return guard([&] {
    Model& m = checked(model, "model").model;
    add_causal_self_attention(m, n_embd, n_head, dropout_p, has_bias != 0, name ? std::string(name) : std::string());
  });
}

}  // extern "C"
