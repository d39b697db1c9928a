// A model as a graph built append-only. Model is the host-side template a caller builds; ReplicaModel is one
// device's copy, with all parameters in one flat buffer and all gradients in another, so that communication and
// the optimizer see one array each.
//
// A node names its inputs: earlier nodes, or the model's input (kModelInput). Append order is therefore a
// topological order: forward walks the nodes in order, backward in reverse. A node added without explicit inputs
// reads the node before it (or the one branch_from() chose), so a model built as a sequence is the sequential
// model it always was. The model's output is the last node.
#pragma once

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/random.h"
#include "nn/layer.h"

namespace dpar {

// The model's input, as a node id.
constexpr int32_t kModelInput = -1;
// The most inputs a join (sum, concatenation) reads: far past any real model, and a count a caller's array can
// hold without the list itself being a hazard.
constexpr size_t kMaxJoinInputs = 65536;
// The first identifier of the checkpoint keys of the optimizer's state ("optimizer.exp_avg.0.weight"): no node may
// take it as its name's first.
constexpr const char* kOptimizerKeys = "optimizer";

// A further node that reads a parameter (tied weights: PyTorch's lm_head.weight = wte.weight). The parameter is
// held, reduced and stepped once; this is only where the other node finds it and the key it is also saved under.
struct ParamAlias {
  std::string name;  // "<node name>.<param>" of the reading node: "5.weight", "lm_head.weight"
  size_t node = 0;   // the node that reads it
  size_t slot = 0;   // which of that node's param_specs() it stands for
};

struct ParamInfo {
  std::string name;  // "<node name>.<param>": "0.weight", "layer1.0.conv1.weight", as PyTorch's state_dict
  Shape shape;
  int64_t offset = 0;  // in the flat buffer, in elements
  size_t node = 0;     // the node that owns it
  bool decays = true;  // !ParamSpec::no_decay: in the decayed group when biases and norms are excluded
  size_t slot = 0;     // which of the owner's param_specs() it is
  std::vector<ParamAlias> aliases;  // the other nodes that read it (Model::tie_param); empty unless tied

  // The node whose backward writes its gradient last: backward walks the nodes last to first, so the lowest of its
  // readers. Its gradient is final, and may be reduced, only after that node's backward.
  size_t last_writer() const {
    size_t n = node;
    for (const ParamAlias& a : aliases) n = std::min(n, a.node);
    return n;
  }
  // Whether `reader` reads it (as the owner or through an alias).
  bool read_by(size_t reader) const {
    if (reader == node) return true;
    for (const ParamAlias& a : aliases)
      if (a.node == reader) return true;
    return false;
  }
};

// What a node computes. Joins and views are executed by the graph itself with the stream's copy and axpy, so they
// run on every backend; kLayer nodes run a single-input Layer.
enum class NodeKind {
  kLayer,   // layer(inputs...): one input for most layers, q, k and v for attention
  kSum,     // inputs[0] + inputs[1] + ...: equal shapes (a residual)
  kConcat,  // inputs along dim 1 (channels): equal shapes but for dim 1
  kView,    // inputs[0] with another shape, the same memory (flatten, reshape): no copy forward or backward
};

struct Node {
  NodeKind kind = NodeKind::kLayer;
  std::vector<int32_t> inputs;
  std::unique_ptr<Layer> layer;       // kLayer only
  std::vector<int64_t> view_row;      // kView: the shape of one row; empty = flatten to (B, prod)
  std::string name;                   // unique; the node's index by default

  Node clone() const;
  std::string describe() const;  // "linear(4 -> 8)", "sum of nodes 1, 3"
  // The output shape for the input shapes (one per entry of inputs); throws Error(INVALID_ARGUMENT).
  Shape output_shape(const std::vector<Shape>& in) const;
};

// Shapes of every node's output for a model input shape; throws naming the first node that rejects its inputs.
std::vector<Shape> graph_shapes(const std::vector<Node>& nodes, const Shape& input);
// Refuses a graph whose nodes cannot all reach the output (a node no later node reads, but the last).
void check_graph_used(const std::vector<Node>& nodes);

struct BufferInfo {
  std::string name;  // "1.running_mean", as PyTorch's state_dict names it
  DType dtype = DType::kF32;
  Shape shape;
  int64_t offset = 0;  // in the model's flat buffer of its dtype, in elements
  size_t node = 0;     // the node that owns it
};

class Model {
 public:
  explicit Model(uint64_t seed) : init_rng_(seed) {}
  Model(const Model& other);
  Model& operator=(Model&& other) = default;

  // Appends a layer reading the next input (the last node, or the branch_from() node), draws its initial
  // parameters from the model's seeded stream, and returns its id.
  int32_t add(std::unique_ptr<Layer> layer);
  // Appends a layer reading `inputs` (added nodes or kModelInput; as many as layer->num_inputs()), as add() does
  // otherwise: attention's q, k and v.
  int32_t add(std::unique_ptr<Layer> layer, const std::vector<int32_t>& inputs);
  // Joins: the elementwise sum of >= 2 nodes of equal shape, and their concatenation along dim 1.
  int32_t add_sum(const std::vector<int32_t>& inputs);
  int32_t add_concat(const std::vector<int32_t>& inputs);
  // Views of the next input: (B, ...) -> (B, prod), and (B, ...) -> (B, row...) (nn.Unflatten(1, row)).
  int32_t add_flatten();
  int32_t add_reshape(const std::vector<int64_t>& row);
  // The id of the last node added; kModelInput for an empty model.
  int32_t last_node() const { return static_cast<int32_t>(nodes_.size()) - 1; }
  // The next node added without explicit inputs reads `node` (an added node or kModelInput).
  void branch_from(int32_t node);
  // Ties node `node`'s parameter `param` to node `source_node`'s `source_param` (PyTorch's
  // lm_head.weight = wte.weight): the node reads the source's parameter, which keeps its name and values; the
  // node's own copy leaves the model (its elements leave the flat array, so later parameters' offsets shift) and its
  // key stays as the parameter's alias, saved beside the parameter's own. Throws Error(INVALID_ARGUMENT) naming what
  // does not fit (a node that is not a layer, an unknown parameter name, shapes that differ, a parameter tied
  // already, a node tied to itself or to a parameter it reads already), changing nothing.
  void tie_param(int32_t node, const std::string& param, int32_t source_node, const std::string& source_param);
  // Renames a node and its parameters. Names are unique, dot-separated identifiers ([A-Za-z0-9_]+ each); a name
  // made of digits only is reserved for the node of that index (the default).
  void set_node_name(int32_t node, const std::string& name);

  size_t num_nodes() const { return nodes_.size(); }  // layers, joins and views
  const Node& node(size_t i) const { return nodes_[i]; }
  // Node i's layer; throws for a join or view node, which has none.
  const Layer& layer(size_t i) const;
  const std::vector<Node>& nodes() const { return nodes_; }
  const std::vector<ParamInfo>& params() const { return params_; }
  int64_t num_param_elements() const { return static_cast<int64_t>(values_.size()); }
  const std::vector<float>& values() const { return values_; }
  std::vector<float>& values() { return values_; }
  // Buffers (Layer::buffer_specs), kept apart from the parameters: f32 ones in one flat array, i64 ones in another.
  const std::vector<BufferInfo>& buffers() const { return buffers_; }
  const std::vector<float>& buffer_f32() const { return buffer_f32_; }
  std::vector<float>& buffer_f32() { return buffer_f32_; }
  const std::vector<int64_t>& buffer_i64() const { return buffer_i64_; }
  std::vector<int64_t>& buffer_i64() { return buffer_i64_; }
  // Replaces every BatchNorm layer with its SyncBatchNorm twin (to_sync_batchnorm), parameters and buffers kept.
  void convert_sync_batchnorm();
  // Shapes through the whole model; throws naming the first node that rejects its input, or a node whose output
  // no later node reads.
  Shape output_shape(const Shape& input) const;
  // Whether a layer calls the replica set's collectives (Layer::uses_collectives): then every replica runs forward
  // and backward on every call, a replica given no rows of the batch included.
  bool uses_collectives() const;
  // The dtype of the input the model takes: i32 where its input is read by a layer of indices (Embedding), f32
  // otherwise; throws Error(INVALID_ARGUMENT) where nodes read the input as both.
  DType input_dtype() const;
  // Throws Error(INVALID_ARGUMENT) naming the first layer that could not take its training statistics
  // (Layer::check_statistics_input) from a training-mode call on `input` split into `chunks` (the rows of each of
  // this process's replicas). `global_rows`, the rows of every process, is the batch that the layers whose
  // statistics span every replica see; 0 leaves them out (the caller checks them once it knows it).
  // micro_chunk_rows > 0: `chunks` are the reproducible mode's micro-chunks of that many rows (the messages say so).
  void check_training_batch(const Shape& input, const std::vector<int64_t>& chunks, int64_t global_rows,
                            int64_t micro_chunk_rows = 0) const;
  // Throws Error(INVALID_ARGUMENT) naming the first input value a node reading the input refuses (an index out of
  // range); host_input is a host copy of the whole batch.
  void check_input_values(const Tensor& host_input) const;

 private:
  int32_t append(Node node);
  // Refuses `keys` (the parameter and buffer names node `node` would have) where another node has one of them.
  void check_keys_free(const std::vector<std::string>& keys, size_t node, const char* argument) const;
  void check_input(int32_t id, const char* what) const;
  // The slot of node `node`'s parameter named `param` (an index into its layer's param_specs()); `argument` names
  // the caller's arguments in a refusal.
  size_t param_slot(int32_t node, const std::string& param, const char* argument) const;
  // The index in params_ of the parameter node `node` reads in `slot` (its own or, tied, another's).
  size_t param_read(size_t node, size_t slot) const;
  int32_t next_input_ = kModelInput;  // what the next node without explicit inputs reads
  std::vector<Node> nodes_;
  std::vector<ParamInfo> params_;
  std::vector<float> values_;  // flat, in params_ order
  std::vector<BufferInfo> buffers_;
  std::vector<float> buffer_f32_;      // flat, the f32 buffers in buffers_ order
  std::vector<int64_t> buffer_i64_;    // flat, the i64 buffers in buffers_ order
  Rng init_rng_;
};

// nanoGPT's CausalSelfAttention on the next input x (B, T, n_embd): c_attn = Linear(n_embd, 3 n_embd, bias),
// causal attention of n_head heads on its packed q|k|v with attention dropout dropout_p, c_proj = Linear(n_embd,
// n_embd, bias), then resid_dropout (left out for p = 0, where it is the identity). With a name ("transformer.h.0.attn")
// the linear nodes are "<name>.c_attn" and "<name>.c_proj", so the parameters carry nanoGPT's state_dict keys.
// All or nothing; returns the last node's id. (nn/blocks.cpp)
int32_t add_causal_self_attention(Model& model, int64_t n_embd, int64_t n_head, float dropout_p, bool bias,
                                  const std::string& name);

class ReplicaModel {
 public:
  // The parameter buffer holds at least `param_capacity` elements (the engine pads it so that every worker's
  // optimizer shard has the same size); the elements past the model's are zero.
  ReplicaModel(const Model& model, const ReplicaContext& ctx, int64_t param_capacity = 0);

  int64_t num_params() const { return params_.numel(); }
  // Node i's layer in this replica (null for a join or a view).
  Layer* layer(size_t node) const { return nodes_[node].layer.get(); }
  // The f32 parameters, to read; params_for_writing() to change them (the optimizer, a checkpoint's load), which
  // tells the low-precision copy (set_compute_dtype) to follow at the next forward.
  const float* params() const { return params_.f32(); }
  float* params_for_writing() {
    params_low_current_ = false;
    return params_.f32();
  }
  float* grads() const { return grads_.f32(); }
  // The buffers' memory on the device: every f32 buffer in one array, every i64 buffer in another (stored as i32
  // pairs); BufferInfo::offset places each. Null where the model has none of that dtype.
  float* buffer_f32() const { return buf_f32_.defined() ? buf_f32_.f32() : nullptr; }
  int64_t* buffer_i64() const { return buf_i64_.defined() ? buf_i64_.data<int64_t>() : nullptr; }
  int64_t num_buffer_f32() const { return n_buf_f32_; }
  int64_t num_buffer_i64() const { return n_buf_i64_; }

  // Mixed precision: the dtype the layers that autocast (Layer::autocasts: linear, convolution) compute in from the
  // next forward on, f32, bf16 or f16. Under bf16 or f16 the replica keeps a mirror of its flat parameters in that
  // dtype, rewritten from the f32 masters at the first forward after they change (params_for_writing): each step's
  // weights are rounded once, not once per use nor once per forward (autocast's cast cache lives for one forward; a
  // step that accumulates several micro-batches, or evaluation between steps, rounds them once here). Throws
  // Error(NOT_SUPPORTED) naming the first node whose kernel the device lacks in that dtype, and the backend's reason
  // where it gives one, changing nothing.
  void set_compute_dtype(const ReplicaContext& ctx, DType dtype);
  DType compute_dtype() const { return compute_dtype_; }
  // Bytes of the parameters' low-precision mirror (0 in f32).
  size_t low_precision_bytes() const { return params_low_.defined() ? params_low_.bytes() : 0; }

  // Runs every node; keeps each node's output for backward. Returns a view of the last output.
  Tensor forward(const ReplicaContext& ctx, const Tensor& input);
  // Backward from dL/d(output) of the last forward. Overwrites or adds to the gradients (see Layer::backward).
  // node_done(i), if given, runs as soon as node i's gradients are final (nodes go last to first): the reducer
  // starts communicating them while the earlier nodes compute.
  void backward(const ReplicaContext& ctx, const Tensor& grad_output, bool accumulate,
                const std::function<void(size_t node)>& node_done = nullptr);
  bool has_forward_state() const { return has_forward_; }
  void clear_forward_state() { has_forward_ = false; }
  // dL/d(output) buffer of the right size for the last forward, for a loss to write into.
  Tensor output_grad_buffer(const ReplicaContext& ctx);
  // Node i's output of the last forward (a view of its input's memory for a view node; the model input for
  // kModelInput). Valid until the next forward.
  Tensor node_output(int32_t node) const { return output(node); }
  // The number of activation-gradient buffers the plan for the last input shape uses (tests: the liveness plan).
  size_t num_grad_buffers() const { return grad_slots_.size(); }
  // The activation nodes the fusion pass runs as the epilogue of the layer before them (tests).
  size_t num_fused() const;
  // The nodes whose output the plan keeps in the compute dtype (plan_rounded_outputs; tests).
  size_t num_rounded_outputs() const;

 private:
  // Makes sure activation buffers hold `rows` rows and plans the gradient buffers; grows, never shrinks.
  void reserve(const ReplicaContext& ctx, const Shape& input);
  // The accumulate flag node `node`'s backward runs with: true where it adds to a tied gradient a higher node wrote
  // (the gradients it writes first are then zeroed here, when the caller does not accumulate), else the caller's.
  bool tied_accumulate(const ReplicaContext& ctx, size_t node, bool accumulate);
  // Throws Error(NOT_SUPPORTED) naming the first node that needs a kernel `stream` cannot run.
  void check_kernels(const Stream& stream) const;
  // The dtype of every node's output under compute_dtype_: f32, or the compute dtype where autocast would keep the
  // activation so and rounding it changes nothing the graph computes. A node's output is kept rounded where the
  // layer that writes it can write it so (Layer::rounded_output_kernels, all runnable on `stream`), every node that
  // reads it reads it only rounded (Layer::reads_rounded_input; no view of it), and it is not the model's output.
  std::vector<DType> plan_rounded_outputs(const Stream& stream) const;
  // Whether node i computes node i + 1 as its epilogue: its own output is then never written, and no buffer holds
  // it.
  bool fused_away(size_t i) const { return epilogue_[i] != Epilogue::kNone; }
  // The node whose memory a node's output is (following views back); kModelInput for the input.
  int32_t storage(int32_t node) const;
  // Node i's output of the last forward (a view of its storage for a view node).
  Tensor output(int32_t node) const;
  // dL/d(node's output) in its storage's gradient buffer, shaped as the node's output.
  Tensor grad_of(int32_t node) const;
  // Adds `write(dst)`'s result to node's gradient: into its buffer directly for the first contribution, through
  // the scratch buffer and an axpy for the next ones.
  void contribute(const ReplicaContext& ctx, int32_t node, const std::function<void(const Tensor& dst)>& write);
  // The backward of node `id`, a layer of several inputs (attention's q, k and v), contributing to each input's
  // gradient.
  void backward_inputs(const ReplicaContext& ctx, int32_t id, const Tensor& dout, bool accumulate);

  std::vector<Node> nodes_;
  std::vector<int32_t> storage_;         // per node: storage(node)
  std::vector<Epilogue> epilogue_;       // node i computes node i + 1 as its epilogue (kNone: it does not)
  // Tied parameters (see the constructor): per node, whether its backward adds to a gradient an earlier backward
  // wrote (it reads a tied parameter that a higher node reads too), and the gradients it then writes first, zeroed
  // before it runs when the caller does not accumulate.
  std::vector<char> tied_adds_;
  std::vector<std::vector<Tensor>> tied_zero_;
  Tensor params_, grads_;
  DType compute_dtype_ = DType::kF32;
  Tensor params_low_;  // the parameters in compute_dtype_ (set_compute_dtype); undefined in f32
  bool params_low_current_ = false;  // params_low_ holds the f32 parameters' present values rounded
  Tensor buf_f32_, buf_i64_;           // the buffers (see buffer_f32(), buffer_i64())
  int64_t n_buf_f32_ = 0, n_buf_i64_ = 0;
  std::vector<Shape> row_shapes_;        // per node output, for one row: shapes with rows = 1
  std::vector<Tensor> outputs_;          // per non-view node output, capacity rows; none for a fused_away node
  std::vector<DType> output_dtype_;      // per node: its output's dtype (plan_rounded_outputs)
  // The gradient plan: node i's gradient (a non-view node, or the input when it is the output's storage) lives in
  // grad_slots_[grad_slot_[i + 1]] from its last consumer's backward to its own; freed slots are reused.
  std::vector<Tensor> grad_slots_;
  std::vector<int32_t> grad_slot_;       // per storage node + 1 (index 0: the model input); -1: none
  Tensor scratch_;                       // a second contribution to one gradient; undefined when none has two
  std::vector<char> grad_started_;        // per storage node + 1, during backward: its gradient has a contribution
  int64_t capacity_rows_ = 0;
  int64_t input_row_numel_ = 0;         // of the input the plan was made for
  Tensor input_;                      // the last forward's input (a view; the caller keeps it alive for backward)
  Tensor external_dout_;              // a caller's dL/d(output) used in place during backward
  int64_t forward_rows_ = 0;          // rows of the last forward (0 for a replica given no rows)
  bool has_forward_ = false;          // the last forward's state is kept for a backward
};

}  // namespace dpar
