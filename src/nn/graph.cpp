// The host-side model graph: nodes, their shapes, names and parameters.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <sstream>

#include "common/error.h"
#include "nn/model.h"

namespace dpar {

namespace {

std::string node_id(int32_t id) { return id == kModelInput ? std::string("input") : std::to_string(id); }

std::string node_list(const std::vector<int32_t>& ids) {
  std::ostringstream s;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) s << ", ";
    s << node_id(ids[i]);
  }
  return s.str();
}

// A state_dict key's pieces: identifiers separated by dots, none empty.
bool valid_name(const std::string& name) {
  if (name.empty() || name.front() == '.' || name.back() == '.') return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(name[i]);
    if (c == '.') {
      if (name[i + 1] == '.') return false;
    } else if (!std::isalnum(c) && c != '_') {
      return false;
    }
  }
  return true;
}

bool all_digits(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c) != 0; });
}

}  // namespace

Node Node::clone() const {
  Node n;
  n.kind = kind;
  n.inputs = inputs;
  if (layer) n.layer = layer->clone();
  n.view_row = view_row;
  n.name = name;
  return n;
}

std::string Node::describe() const {
  switch (kind) {
    case NodeKind::kLayer: return layer->describe();
    case NodeKind::kSum: return "sum of nodes " + node_list(inputs);
    case NodeKind::kConcat: return "concat of nodes " + node_list(inputs);
    case NodeKind::kView: {
      if (view_row.empty()) return "flatten";
      std::ostringstream s;
      s << "reshape to (B";
      for (int64_t d : view_row) s << ", " << d;
      s << ")";
      return s.str();
    }
  }
  return "?";
}

Shape Node::output_shape(const std::vector<Shape>& in) const {
  switch (kind) {
    case NodeKind::kLayer: return layer->output_shape_of(in);
    case NodeKind::kSum:
      for (size_t k = 1; k < in.size(); ++k)
        DPAR_CHECK_ARG(in[k] == in[0], "node ", node_id(inputs[k]), "'s output ", in[k].str(), " differs from node ",
                       node_id(inputs[0]), "'s ", in[0].str(), ": a sum needs equal shapes");
      return in[0];
    case NodeKind::kConcat: {
      Shape out = in[0];
      DPAR_CHECK_ARG(out.ndim() >= 2, "concatenation along dim 1 needs inputs of 2 or more dims, got ", out.str());
      for (size_t k = 1; k < in.size(); ++k) {
        bool fits = in[k].ndim() == in[0].ndim();
        for (size_t d = 0; fits && d < in[0].ndim(); ++d) fits = d == 1 || in[k][d] == in[0][d];
        DPAR_CHECK_ARG(fits, "node ", node_id(inputs[k]), "'s output ", in[k].str(), " and node ", node_id(inputs[0]),
                       "'s ", in[0].str(), " differ in a dimension other than 1: no concatenation along dim 1");
        // Each extent is at most 2^60 and so is the sum so far: the sum cannot overflow before with_dim checks it.
        out = out.with_dim(1, out[1] + in[k][1]);
      }
      return out;
    }
    case NodeKind::kView: {
      const Shape& s = in[0];
      if (view_row.empty()) return Shape{s[0], s.row_numel()};
      const int64_t prod = Shape::checked_product(view_row.data(), view_row.size());
      DPAR_CHECK_ARG(prod == s.row_numel(), "a row of ", s.str(), " holds ", s.row_numel(),
                     " elements, not the ", prod, " of the new shape");
      std::vector<int64_t> dims{s[0]};
      dims.insert(dims.end(), view_row.begin(), view_row.end());
      return Shape::of(dims.data(), dims.size());
    }
  }
  fail(Status::kInternal, "unknown node kind");
}

std::vector<Shape> graph_shapes(const std::vector<Node>& nodes, const Shape& input) {
  std::vector<Shape> out;
  out.reserve(nodes.size());
  for (size_t i = 0; i < nodes.size(); ++i) {
    std::vector<Shape> in;
    for (int32_t j : nodes[i].inputs) in.push_back(j == kModelInput ? input : out[static_cast<size_t>(j)]);
    try {
      out.push_back(nodes[i].output_shape(in));
    } catch (const Error& e) {
      fail(e.status(), "node ", i, " \"", nodes[i].name, "\" (", nodes[i].describe(), "): ", e.what());
    }
  }
  return out;
}

void check_graph_used(const std::vector<Node>& nodes) {
  std::vector<bool> used(nodes.size(), false);
  if (!nodes.empty()) used.back() = true;
  for (const Node& n : nodes)
    for (int32_t j : n.inputs)
      if (j != kModelInput) used[static_cast<size_t>(j)] = true;
  for (size_t i = 0; i < nodes.size(); ++i)
    DPAR_CHECK_ARG(used[i], "node ", i, " \"", nodes[i].name, "\" (", nodes[i].describe(),
                   ") is read by no later node and is not the output (the last node): its branch leads nowhere");
}

Model::Model(const Model& other)
    : next_input_(other.next_input_),
      params_(other.params_),
      values_(other.values_),
      buffers_(other.buffers_),
      buffer_f32_(other.buffer_f32_),
      buffer_i64_(other.buffer_i64_),
      init_rng_(other.init_rng_) {
  for (const Node& n : other.nodes_) nodes_.push_back(n.clone());
}

void Model::check_input(int32_t id, const char* what) const {
  DPAR_CHECK_ARG(id == kModelInput || (id >= 0 && id <= last_node()), what, ": node ", id,
                 id < kModelInput ? " is not a node id" : " has not been added",
                 " (the model has ", nodes_.size(), " nodes; -1 is the model input)");
}

int32_t Model::append(Node node) {
  const int32_t id = static_cast<int32_t>(nodes_.size());
  node.name = std::to_string(id);
  std::vector<ParamSpec> specs;
  std::vector<BufferSpec> buffer_specs;
  int64_t n_values = 0, n_f32 = 0, n_i64 = 0;  // what the node adds to each flat array
  if (node.layer) {
    // Every shape a layer declares is checked where it is made (Shape's constructor); the totals are checked here,
    // so that the model's flat arrays can be sized without overflow. A refusal names the layer.
    try {
      specs = node.layer->param_specs();
      buffer_specs = node.layer->buffer_specs();
      // Each term is at most 2^60 (a shape's bound), so a sum of two cannot overflow before it is checked.
      auto add = [&](int64_t& total, int64_t n) {
        total += n;
        DPAR_CHECK_ARG(total <= Shape::kMaxElements, "the model would hold more than 2^60 elements in one array");
      };
      for (const ParamSpec& spec : specs) add(n_values, spec.shape.numel());
      for (const BufferSpec& spec : buffer_specs)
        add(spec.dtype == DType::kF32 ? n_f32 : n_i64, buffer_numel(spec.shape));
      add(n_values, num_param_elements());
      add(n_f32, static_cast<int64_t>(buffer_f32_.size()));
      add(n_i64, static_cast<int64_t>(buffer_i64_.size()));
    } catch (const Error& e) {
      fail(e.status(), node.layer->describe(), ": ", e.what());
    }
  }
  {
    std::vector<std::string> keys;
    for (const ParamSpec& spec : specs) keys.push_back(node.name + "." + spec.name);
    for (const BufferSpec& spec : buffer_specs) keys.push_back(node.name + "." + spec.name);
    check_keys_free(keys, static_cast<size_t>(id), "layer");
  }
  // All or nothing: what a refused node added (a host allocation that failed) is taken back, the initialisation
  // stream included, so that the model is as it was.
  const std::string described = node.describe();
  const Rng rng = init_rng_;
  const size_t old_params = params_.size(), old_values = values_.size(), old_buffers = buffers_.size();
  const size_t old_f32 = buffer_f32_.size(), old_i64 = buffer_i64_.size();
  try {
    values_.reserve(static_cast<size_t>(n_values));
    buffer_f32_.reserve(static_cast<size_t>(n_f32));
    buffer_i64_.reserve(static_cast<size_t>(n_i64));
    for (size_t slot = 0; slot < specs.size(); ++slot) {
      const ParamSpec& spec = specs[slot];
      ParamInfo info{node.name + "." + spec.name, spec.shape, static_cast<int64_t>(values_.size()),
                     static_cast<size_t>(id), !spec.no_decay, slot, {}};
      const int64_t n = spec.shape.numel();
      for (int64_t i = 0; i < n; ++i) {
        float v = 0.0f;
        if (spec.init == InitKind::kUniform) v = init_rng_.uniform(-spec.bound, spec.bound);
        if (spec.init == InitKind::kOnes) v = 1.0f;
        if (spec.init == InitKind::kNormal) {
          // Box-Muller from two draws of the model's stream; 1 - u keeps the logarithm's argument in (0, 1].
          const double u1 = 1.0 - init_rng_.uniform(), u2 = init_rng_.uniform();
          v = static_cast<float>(spec.bound * std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
        }
        values_.push_back(v);
      }
      if (spec.zero_row >= 0) {
        const int64_t row = n / spec.shape[0];
        std::fill_n(values_.end() - n + spec.zero_row * row, row, 0.0f);
      }
      params_.push_back(std::move(info));
    }
    for (const BufferSpec& spec : buffer_specs) {
      const bool f32 = spec.dtype == DType::kF32;
      const int64_t offset = static_cast<int64_t>(f32 ? buffer_f32_.size() : buffer_i64_.size());
      buffers_.push_back({node.name + "." + spec.name, spec.dtype, spec.shape, offset, static_cast<size_t>(id)});
      const int64_t v = spec.init == InitKind::kOnes ? 1 : 0;
      for (int64_t i = 0; i < buffer_numel(spec.shape); ++i) {
        if (f32)
          buffer_f32_.push_back(static_cast<float>(v));
        else
          buffer_i64_.push_back(v);
      }
    }
    nodes_.push_back(std::move(node));
  } catch (const std::bad_alloc&) {
    init_rng_ = rng;
    params_.resize(old_params);
    values_.resize(old_values);
    buffers_.resize(old_buffers);
    buffer_f32_.resize(old_f32);
    buffer_i64_.resize(old_i64);
    fail(Status::kOutOfMemory, described, ": the model's ", n_values, " parameter elements (", n_values * 4,
         " bytes) do not fit in host memory");
  }
  next_input_ = id;
  return id;
}

int32_t Model::add(std::unique_ptr<Layer> layer) {
  DPAR_CHECK_ARG(layer != nullptr, "layer: is null");
  // Every node's output is f32: only the model's input can be indices.
  DPAR_CHECK_ARG(layer->input_dtype() == DType::kF32 || next_input_ == kModelInput, layer->describe(),
                 " reads int32 indices, so it must read the model's input, not node ", next_input_,
                 "'s float output");
  Node n;
  n.inputs = {next_input_};
  n.layer = std::move(layer);
  return append(std::move(n));
}

int32_t Model::add(std::unique_ptr<Layer> layer, const std::vector<int32_t>& inputs) {
  DPAR_CHECK_ARG(layer != nullptr, "layer: is null");
  DPAR_CHECK_ARG(inputs.size() == layer->num_inputs(), layer->describe(), " reads ", layer->num_inputs(),
                 layer->num_inputs() == 1 ? " input" : " inputs", ", got ", inputs.size());
  for (int32_t id : inputs) check_input(id, "inputs");
  DPAR_CHECK_ARG(layer->input_dtype() == DType::kF32, layer->describe(), " reads int32 indices: add it without inputs");
  Node n;
  n.inputs = inputs;
  n.layer = std::move(layer);
  return append(std::move(n));
}

int32_t Model::add_sum(const std::vector<int32_t>& inputs) {
  DPAR_CHECK_ARG(inputs.size() >= 2 && inputs.size() <= kMaxJoinInputs, "sum: needs 2 or more inputs (at most ",
                 kMaxJoinInputs, "), got ", inputs.size());
  for (int32_t id : inputs) check_input(id, "sum");
  Node n;
  n.kind = NodeKind::kSum;
  n.inputs = inputs;
  return append(std::move(n));
}

int32_t Model::add_concat(const std::vector<int32_t>& inputs) {
  DPAR_CHECK_ARG(inputs.size() >= 2 && inputs.size() <= kMaxJoinInputs, "concat: needs 2 or more inputs (at most ",
                 kMaxJoinInputs, "), got ", inputs.size());
  for (int32_t id : inputs) check_input(id, "concat");
  Node n;
  n.kind = NodeKind::kConcat;
  n.inputs = inputs;
  return append(std::move(n));
}

int32_t Model::add_flatten() {
  Node n;
  n.kind = NodeKind::kView;
  n.inputs = {next_input_};
  return append(std::move(n));
}

int32_t Model::add_reshape(const std::vector<int64_t>& row) {
  DPAR_CHECK_ARG(!row.empty() && row.size() < Shape::kMaxDims, "reshape: a row shape has 1 to ",
                 Shape::kMaxDims - 1, " dims (with the batch, at most ", Shape::kMaxDims, "), got ", row.size());
  for (size_t i = 0; i < row.size(); ++i)
    DPAR_CHECK_ARG(row[i] >= 1, "reshape: row_shape[", i, "] = ", row[i], " must be >= 1");
  try {
    Shape::checked_product(row.data(), row.size());
  } catch (const Error& e) {
    fail(e.status(), "reshape: row_shape: ", e.what());
  }
  Node n;
  n.kind = NodeKind::kView;
  n.inputs = {next_input_};
  n.view_row = row;
  return append(std::move(n));
}

void Model::branch_from(int32_t node) {
  check_input(node, "branch_from");
  next_input_ = node;
}

void Model::set_node_name(int32_t node, const std::string& name) {
  DPAR_CHECK_ARG(node >= 0 && node <= last_node(), "node: ", node, " is not a node of the model (it has ",
                 nodes_.size(), ")");
  DPAR_CHECK_ARG(valid_name(name), "name: \"", name,
                 "\" is not a state_dict name (identifiers of letters, digits and '_', separated by single dots)");
  DPAR_CHECK_ARG(!all_digits(name) || name == std::to_string(node), "name: \"", name,
                 "\" is all digits: such a name is the default of the node of that index, not of node ", node);
  DPAR_CHECK_ARG(name.substr(0, name.find('.')) != kOptimizerKeys, "name: \"", name, "\" begins with \"",
                 kOptimizerKeys, "\", which checkpoints reserve for the optimizer's state");
  for (size_t i = 0; i < nodes_.size(); ++i)
    DPAR_CHECK_ARG(static_cast<int32_t>(i) == node || nodes_[i].name != name, "name: \"", name,
                   "\" is already node ", i, "'s name");
  Node& n = nodes_[static_cast<size_t>(node)];
  const auto renamed = [&](const std::string& key) { return name + key.substr(n.name.size()); };
  const auto at = static_cast<size_t>(node);
  // The node's keys: its own parameters', the aliases under which it reads tied ones, its buffers'.
  std::vector<std::string> keys;
  for (const ParamInfo& p : params_) {
    if (p.node == at) keys.push_back(renamed(p.name));
    for (const ParamAlias& a : p.aliases)
      if (a.node == at) keys.push_back(renamed(a.name));
  }
  for (const BufferInfo& b : buffers_)
    if (b.node == at) keys.push_back(renamed(b.name));
  check_keys_free(keys, at, "name");
  for (ParamInfo& p : params_) {
    if (p.node == at) p.name = renamed(p.name);
    for (ParamAlias& a : p.aliases)
      if (a.node == at) a.name = renamed(a.name);
  }
  for (BufferInfo& b : buffers_)
    if (b.node == at) b.name = renamed(b.name);
  n.name = name;
}

size_t Model::param_slot(int32_t node, const std::string& param, const char* argument) const {
  DPAR_CHECK_ARG(node >= 0 && node <= last_node(), argument, ": node ", node, " is not a node of the model (it has ",
                 nodes_.size(), ")");
  const Node& n = nodes_[static_cast<size_t>(node)];
  const std::vector<ParamSpec> specs = n.layer ? n.layer->param_specs() : std::vector<ParamSpec>{};
  std::string names;
  for (size_t k = 0; k < specs.size(); ++k) {
    if (specs[k].name == param) return k;
    names += (k ? ", \"" : "\"") + specs[k].name + "\"";
  }
  fail(Status::kInvalidArgument, argument, ": node ", node, " \"", n.name, "\" (", n.describe(),
       ") has no parameter \"", param, "\" (", specs.empty() ? std::string("it has no parameters") : "it has " + names,
       ")");
}

size_t Model::param_read(size_t node, size_t slot) const {
  for (size_t i = 0; i < params_.size(); ++i) {
    const ParamInfo& p = params_[i];
    if (p.node == node && p.slot == slot) return i;
    for (const ParamAlias& a : p.aliases)
      if (a.node == node && a.slot == slot) return i;
  }
  fail(Status::kInternal, "node ", node, " reads no parameter in slot ", slot);
}

void Model::tie_param(int32_t node, const std::string& param, int32_t source_node, const std::string& source_param) {
  const size_t slot = param_slot(node, param, "node");
  const size_t source_slot = param_slot(source_node, source_param, "source_node");
  const auto at = static_cast<size_t>(node), from = static_cast<size_t>(source_node);
  const std::string key = nodes_[at].name + "." + param;
  const std::string source_key = nodes_[from].name + "." + source_param;
  DPAR_CHECK_ARG(at != from, "source_node: node ", node, " cannot be tied to itself (\"", key, "\" to \"",
                 source_key, "\"): a parameter is tied to another node's");
  const size_t own = param_read(at, slot);
  const size_t shared = param_read(from, source_slot);
  ParamInfo& mine = params_[own];
  DPAR_CHECK_ARG(mine.node == at && mine.aliases.empty(), "node: \"", key, "\" is tied already (",
                 mine.node != at ? "it reads \"" + mine.name + "\"" : "node " + std::to_string(mine.aliases[0].node) +
                                                                         " reads it as \"" + mine.aliases[0].name + "\"",
                 "): a parameter is tied once");
  ParamInfo& source = params_[shared];
  DPAR_CHECK_ARG(!source.read_by(at), "source_node: \"", source_key, "\" is \"", source.name, "\", which node ",
                 node, " reads already: a layer reads a parameter once");
  DPAR_CHECK_ARG(mine.shape == source.shape, "source_node: \"", key, "\" is ", mine.shape.str(), " but \"",
                 source_key, "\" is ", source.shape.str(), ": tied parameters have one shape");
  // The alias is added before anything is taken away, so that an allocation that fails leaves the model as it was.
  source.aliases.push_back({mine.name, at, slot});
  const int64_t offset = mine.offset, n = mine.shape.numel();
  values_.erase(values_.begin() + offset, values_.begin() + offset + n);
  for (ParamInfo& p : params_)
    if (p.offset > offset) p.offset -= n;
  params_.erase(params_.begin() + static_cast<std::ptrdiff_t>(own));
}

void Model::check_keys_free(const std::vector<std::string>& keys, size_t node, const char* argument) const {
  // A name that dots join can be reached two ways ("a" + "b.c" and "a.b" + "c"): the keys themselves are compared.
  // A tied parameter's aliases are keys of their own (a checkpoint holds the parameter under each).
  for (const ParamInfo& p : params_) {
    if (p.node != node)
      for (const std::string& key : keys)
        DPAR_CHECK_ARG(key != p.name, argument, ": node ", node, "'s \"", key, "\" would be node ", p.node,
                       "'s parameter of that name too: every parameter and buffer needs a name of its own");
    for (const ParamAlias& a : p.aliases)
      if (a.node != node)
        for (const std::string& key : keys)
          DPAR_CHECK_ARG(key != a.name, argument, ": node ", node, "'s \"", key, "\" would be node ", a.node,
                         "'s (tied) parameter of that name too: every parameter and buffer needs a name of its own");
  }
  for (const BufferInfo& b : buffers_)
    if (b.node != node)
      for (const std::string& key : keys)
        DPAR_CHECK_ARG(key != b.name, argument, ": node ", node, "'s \"", key, "\" would be node ", b.node,
                       "'s buffer of that name too: every parameter and buffer needs a name of its own");
}

void Model::convert_sync_batchnorm() {
  for (Node& n : nodes_)
    if (n.layer)
      if (auto sync = to_sync_batchnorm(*n.layer)) n.layer = std::move(sync);
}

const Layer& Model::layer(size_t i) const {
  DPAR_CHECK_ARG(i < nodes_.size() && nodes_[i].layer, "node ", i, " is not a layer node");
  return *nodes_[i].layer;
}

Shape Model::output_shape(const Shape& input) const {
  DPAR_CHECK_ARG(!nodes_.empty(), "the model has no nodes");
  check_graph_used(nodes_);
  return graph_shapes(nodes_, input).back();
}

bool Model::uses_collectives() const {
  for (const Node& n : nodes_)
    if (n.layer && n.layer->uses_collectives()) return true;
  return false;
}

DType Model::input_dtype() const {
  // The nodes that read the input directly must agree: an i32 input can only be read by a layer of indices (a sum,
  // a concatenation or a view of it would treat the indices as floats).
  bool any_i32 = false;
  std::string f32_reader;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const Node& n = nodes_[i];
    for (int32_t in : n.inputs) {
      if (in != kModelInput) continue;
      if (n.layer && n.layer->input_dtype() == DType::kI32)
        any_i32 = true;
      else if (f32_reader.empty())
        f32_reader = "node " + std::to_string(i) + " (" + n.describe() + ")";
    }
  }
  DPAR_CHECK_ARG(!any_i32 || f32_reader.empty(), "the model's input is read both as i32 indices and as f32 by ",
                 f32_reader);
  return any_i32 ? DType::kI32 : DType::kF32;
}

void Model::check_training_batch(const Shape& input, const std::vector<int64_t>& chunks, int64_t global_rows,
                                 int64_t micro_chunk_rows) const {
  // The layers that see `rows` rows: those whose statistics are their replica's own (collective false), or those
  // whose statistics span every replica (true).
  auto check = [&](int64_t rows, bool collective, const std::string& whose) {
    const Shape batch = input.with_rows(rows);
    const std::vector<Shape> shapes = graph_shapes(nodes_, batch);
    for (size_t i = 0; i < nodes_.size(); ++i) {
      const Node& n = nodes_[i];
      if (!n.layer || n.layer->uses_collectives() != collective) continue;
      const int32_t in = n.inputs[0];
      try {
        n.layer->check_statistics_input(in == kModelInput ? batch : shapes[static_cast<size_t>(in)]);
      } catch (const Error& e) {
        fail(e.status(), "node ", i, " \"", n.name, "\": ", e.what(), " (", whose, ")");
      }
    }
  };
  int64_t batch = 0;
  for (int64_t rows : chunks) batch += rows;
  for (size_t r = 0; r < chunks.size(); ++r) {
    // Equal chunks see equal shapes: each size is checked once.
    if (chunks[r] == 0 || std::find(chunks.begin(), chunks.begin() + static_cast<std::ptrdiff_t>(r), chunks[r]) !=
                              chunks.begin() + static_cast<std::ptrdiff_t>(r))
      continue;
    check(chunks[r], false,
          micro_chunk_rows > 0
              ? detail::concat("a micro-chunk of ", chunks[r], " rows: the reproducible mode cuts the batch into ",
                               "micro-chunks of ", micro_chunk_rows, " rows")
              : detail::concat("replica ", r, "'s ", chunks[r], " rows of the batch of ", batch, " over ",
                               chunks.size(), " replicas"));
  }
  if (global_rows > 0) check(global_rows, true, detail::concat("the ", global_rows, " rows of every replica"));
}

void Model::check_input_values(const Tensor& host_input) const {
  for (const Node& n : nodes_)
    for (int32_t in : n.inputs)
      if (in == kModelInput && n.layer) n.layer->check_input_values(host_input);
}

}  // namespace dpar
