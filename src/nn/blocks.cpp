// Blocks of several nodes that a model adds in one call, as PyTorch users take them from a module: nanoGPT's
// CausalSelfAttention.
#include "common/error.h"
#include "nn/model.h"

namespace dpar {

int32_t add_causal_self_attention(Model& model, int64_t n_embd, int64_t n_head, float dropout_p, bool bias,
                                  const std::string& name) {
  DPAR_CHECK_ARG(n_embd >= 1 && n_embd <= (1 << 16), "n_embd: ", n_embd, " must be 1 to 65536");
  DPAR_CHECK_ARG(n_head >= 1 && n_embd % n_head == 0, "n_head: ", n_head, " must be >= 1 and divide n_embd ",
                 n_embd);
  AttentionSpec spec;
  spec.heads = n_head;
  spec.causal = true;
  // The layers are made (and their arguments checked) before the model changes; then the nodes go onto a copy, so
  // that a refusal half-way (a name another node has) leaves the model as it was.
  std::unique_ptr<Layer> c_attn = make_linear(n_embd, 3 * n_embd, bias);
  std::unique_ptr<Layer> attention = make_attention(spec, dropout_p, 1);
  std::unique_ptr<Layer> c_proj = make_linear(n_embd, n_embd, bias);
  std::unique_ptr<Layer> resid_dropout = dropout_p > 0.0f ? make_dropout(dropout_p) : nullptr;
  Model built(model);
  const int32_t attn_node = built.add(std::move(c_attn));
  built.add(std::move(attention));
  const int32_t proj_node = built.add(std::move(c_proj));
  if (resid_dropout) built.add(std::move(resid_dropout));
  if (!name.empty()) {
    built.set_node_name(attn_node, name + ".c_attn");
    built.set_node_name(proj_node, name + ".c_proj");
  }
  model = std::move(built);
  return model.last_node();
}

}  // namespace dpar
