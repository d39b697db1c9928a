// A replica's copy of the model graph: forward in append order, backward in reverse, with a liveness plan for the
// activation gradients.
#include <algorithm>
#include <cmath>

#include "common/error.h"
#include "nn/model.h"

namespace dpar {

ReplicaModel::ReplicaModel(const Model& model, const ReplicaContext& ctx, int64_t param_capacity) {
  const int64_t n = std::max<int64_t>({model.num_param_elements(), param_capacity, 1});
  params_ = ctx.alloc(DType::kF32, Shape{n});
  grads_ = ctx.alloc(DType::kF32, Shape{n});
  ctx.stream->fill_zero(params_.raw(), params_.bytes());
  ctx.stream->fill_zero(grads_.raw(), grads_.bytes());
  ctx.stream->copy_from_host(params_.f32(), model.values().data(), model.values().size() * sizeof(float));
  check_graph_used(model.nodes());
  for (const Node& node : model.nodes()) nodes_.push_back(node.clone());
  std::vector<int> consumers(nodes_.size(), 0);
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const Node& node = nodes_[i];
    for (int32_t j : node.inputs)
      if (j != kModelInput) ++consumers[static_cast<size_t>(j)];
    storage_.push_back(node.kind == NodeKind::kView ? storage(node.inputs[0]) : static_cast<int32_t>(i));
    if (!node.layer) continue;
    // One view per param_specs() slot: the node's own parameters and those it reads through a tie.
    const size_t slots = node.layer->param_specs().size();
    std::vector<Tensor> p(slots), g(slots);
    auto bind_slot = [&](const ParamInfo& info, size_t slot) {
      p[slot] = params_.rows(info.offset, info.shape.numel()).reshaped(info.shape);
      g[slot] = grads_.rows(info.offset, info.shape.numel()).reshaped(info.shape);
    };
    for (const ParamInfo& info : model.params()) {
      if (info.node == i) bind_slot(info, info.slot);
      for (const ParamAlias& a : info.aliases)
        if (a.node == i) bind_slot(info, a.slot);
    }
    for (size_t k = 0; k < slots; ++k)
      DPAR_ENFORCE(p[k].defined(), Status::kInternal, "node ", i, " reads no parameter in slot ", k);
    nodes_[i].layer->bind(std::move(p), std::move(g));
  }
  // Tied parameters: every reader's backward writes the one gradient. The first in backward order (the highest
  // node) writes it as every parameter is written (overwriting, or adding when the caller accumulates); each later
  // reader must add to it. A later reader therefore runs with accumulate = true, and where the caller does not
  // accumulate, the gradients that node writes first (its untied parameters, and tied ones it is the highest reader
  // of) are zeroed before, so that adding to them is writing them. The sum is the two readers' exactly, as
  // PyTorch's autograd sums a leaf's gradient over its uses.
  tied_zero_.resize(nodes_.size());
  tied_adds_.assign(nodes_.size(), 0);
  for (const ParamInfo& info : model.params()) {
    if (info.aliases.empty()) continue;
    size_t highest = info.node;
    for (const ParamAlias& a : info.aliases) highest = std::max(highest, a.node);
    for (size_t reader = 0; reader < nodes_.size(); ++reader)
      if (info.read_by(reader) && reader != highest) tied_adds_[reader] = 1;
  }
  for (const ParamInfo& info : model.params()) {
    size_t highest = info.node;
    for (const ParamAlias& a : info.aliases) highest = std::max(highest, a.node);
    if (tied_adds_[highest]) tied_zero_[highest].push_back(grads_.rows(info.offset, info.shape.numel()));
  }
  // Buffers: this replica's own copy, from the model's values.
  n_buf_f32_ = static_cast<int64_t>(model.buffer_f32().size());
  n_buf_i64_ = static_cast<int64_t>(model.buffer_i64().size());
  if (n_buf_f32_ > 0) {
    buf_f32_ = ctx.alloc(DType::kF32, Shape{n_buf_f32_});
    ctx.stream->copy_from_host(buf_f32_.raw(), model.buffer_f32().data(), buf_f32_.bytes());
  }
  if (n_buf_i64_ > 0) {
    buf_i64_ = ctx.alloc(DType::kI64, Shape{n_buf_i64_});
    ctx.stream->copy_from_host(buf_i64_.raw(), model.buffer_i64().data(), buf_i64_.bytes());
  }
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (!nodes_[i].layer) continue;
    std::vector<Tensor> b;
    for (const BufferInfo& info : model.buffers())
      if (info.node == i) {
        if (info.dtype == DType::kF32)
          b.push_back(buf_f32_.rows(info.offset, buffer_numel(info.shape)));
        else
          b.push_back(buf_i64_.rows(info.offset, buffer_numel(info.shape)));
      }
    nodes_[i].layer->bind_buffers(std::move(b));
  }
  // The fusion pass: an activation node runs as the epilogue of the layer before it where it reads that layer and
  // nothing else does (the layer's own output is then never written) and the layer takes it (Layer::as_epilogue,
  // takes_epilogue). A layer that is another's epilogue is not fused with the one after it: pairs do not chain.
  for (size_t i = 0; i + 1 < nodes_.size(); ++i) {
    const Node& a = nodes_[i];
    const Node& b = nodes_[i + 1];
    const Epilogue e = b.layer ? b.layer->as_epilogue() : Epilogue::kNone;
    const bool fuse = (i == 0 || epilogue_[i - 1] == Epilogue::kNone) && a.layer && e != Epilogue::kNone &&
                      b.inputs[0] == static_cast<int32_t>(i) && consumers[i] == 1 && a.layer->takes_epilogue(e);
    epilogue_.push_back(fuse ? e : Epilogue::kNone);
  }
  epilogue_.push_back(Epilogue::kNone);
  check_kernels(*ctx.stream);
  output_dtype_ = plan_rounded_outputs(*ctx.stream);
}

std::vector<DType> ReplicaModel::plan_rounded_outputs(const Stream& stream) const {
  const size_t n = nodes_.size();
  std::vector<DType> dtypes(n, DType::kF32);
  if (compute_dtype_ == DType::kF32) return dtypes;
  // Who reads each node's output: a view of it, or a reader of more than one input, keeps it f32.
  std::vector<char> only_rounded_readers(n, 1);
  for (size_t j = 0; j < n; ++j) {
    const Node& reader = nodes_[j];
    if (j > 0 && fused_away(j - 1)) continue;  // the second of a pair reads the first's unwritten output
    const bool rounded =
        reader.kind == NodeKind::kLayer && reader.inputs.size() == 1 && reader.layer->reads_rounded_input(stream);
    for (int32_t in : reader.inputs)
      if (in != kModelInput && !rounded) only_rounded_readers[static_cast<size_t>(in)] = 0;
  }
  for (size_t i = 0; i + 1 < n; ++i) {
    if (nodes_[i].kind != NodeKind::kLayer || fused_away(i) || !only_rounded_readers[i]) continue;
    // The layer that writes node i's output: node i itself, or the head of the pair it closes.
    const bool closes_pair = i > 0 && fused_away(i - 1);
    const Layer& writer = *nodes_[closes_pair ? i - 1 : i].layer;
    if (!closes_pair && nodes_[i].inputs.size() != 1) continue;
    const std::vector<KernelKey> keys =
        writer.rounded_output_kernels(closes_pair ? epilogue_[i - 1] : Epilogue::kNone, compute_dtype_);
    const bool runnable = !keys.empty() && std::all_of(keys.begin(), keys.end(),
                                                       [&](const KernelKey& k) { return stream.can_run(k); });
    if (runnable) dtypes[i] = compute_dtype_;
  }
  return dtypes;
}

size_t ReplicaModel::num_rounded_outputs() const {
  return static_cast<size_t>(std::count_if(output_dtype_.begin(), output_dtype_.end(),
                                           [](DType d) { return d != DType::kF32; }));
}

void ReplicaModel::check_kernels(const Stream& stream) const {
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const Node& node = nodes_[i];
    std::vector<KernelKey> keys;
    if (node.layer) keys = node.layer->kernels(epilogue_[i]);
    if (node.kind == NodeKind::kSum) keys.push_back({Op::kAxpy});
    for (const KernelKey& key : keys) {
      if (stream.can_run(key)) continue;
      const std::string why = stream.lacks_why(key);
      fail(Status::kNotSupported, "node '", node.name, "' (", node.describe(), ") needs the kernel ", key.str(),
           ", which ", stream.device().str(), "'s backend does not have", why.empty() ? "" : ": " + why);
    }
  }
}

void ReplicaModel::set_compute_dtype(const ReplicaContext& ctx, DType dtype) {
  DPAR_CHECK_ARG(dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16, "compute dtype: ",
                 dtype_name(dtype), " is not one a model computes in (f32, bf16, f16)");
  if (dtype == compute_dtype_) return;
  const DType before = compute_dtype_;
  auto apply = [&](DType d) {
    for (Node& node : nodes_)
      if (node.layer && node.layer->autocasts()) node.layer->set_compute_dtype(d);
  };
  apply(dtype);
  try {
    check_kernels(*ctx.stream);
  } catch (...) {
    apply(before);
    throw;
  }
  Tensor low;
  if (dtype != DType::kF32) {
    try {
      low = ctx.alloc(dtype, params_.shape());
    } catch (...) {
      apply(before);
      throw;
    }
    // Each layer reads its parameters' copies at their offsets in the flat array (tied ones included).
    const auto* base = static_cast<const char*>(params_.raw());
    for (Node& node : nodes_) {
      if (!node.layer || !node.layer->autocasts()) continue;
      std::vector<TensorRef> views;
      for (const TensorRef& p : node.layer->param_refs()) {
        TensorRef v = p;
        v.dtype = dtype;
        v.data = static_cast<char*>(low.raw()) +
                 (static_cast<const char*>(p.data) - base) / static_cast<std::ptrdiff_t>(sizeof(float)) *
                     static_cast<std::ptrdiff_t>(dtype_size(dtype));
        views.push_back(v);
      }
      node.layer->bind_low_precision(std::move(views));
    }
  }
  params_low_ = std::move(low);
  params_low_current_ = false;
  compute_dtype_ = dtype;
  // The activations' dtypes follow: the next forward plans its buffers again.
  output_dtype_ = plan_rounded_outputs(*ctx.stream);
  outputs_.clear();
  capacity_rows_ = 0;
}

size_t ReplicaModel::num_fused() const {
  return static_cast<size_t>(std::count_if(epilogue_.begin(), epilogue_.end(),
                                           [](Epilogue e) { return e != Epilogue::kNone; }));
}

int32_t ReplicaModel::storage(int32_t node) const {
  return node == kModelInput ? kModelInput : storage_[static_cast<size_t>(node)];
}

Tensor ReplicaModel::output(int32_t node) const {
  if (node == kModelInput) return input_;
  const auto i = static_cast<size_t>(node);
  const Shape shape = row_shapes_[i].with_rows(forward_rows_);
  if (nodes_[i].kind == NodeKind::kView) return output(nodes_[i].inputs[0]).reshaped(shape);
  DPAR_ENFORCE(outputs_[i].defined(), Status::kInternal, "node ", i, " runs as the epilogue's input of node ", i + 1,
               ": its own output is never written");
  return outputs_[i].rows(0, forward_rows_);
}

Tensor ReplicaModel::grad_of(int32_t node) const {
  const int32_t s = storage(node);
  const int32_t slot = grad_slot_[static_cast<size_t>(s + 1)];
  DPAR_ENFORCE(slot >= 0, Status::kInternal, "node ", node, " has no gradient buffer in the plan");
  const Shape shape =
      node == kModelInput ? input_.shape() : row_shapes_[static_cast<size_t>(node)].with_rows(forward_rows_);
  return grad_slots_[static_cast<size_t>(slot)].rows(0, shape.numel()).reshaped(shape);
}

void ReplicaModel::reserve(const ReplicaContext& ctx, const Shape& input) {
  const int64_t rows = input[0];
  // Per-row shapes of every output; recomputed per call because a later input may have another row shape.
  std::vector<Shape> shapes = graph_shapes(nodes_, input.with_rows(1));
  if (rows <= capacity_rows_ && shapes == row_shapes_ && input.row_numel() == input_row_numel_) return;
  const int64_t cap = std::max(rows, capacity_rows_);
  const size_t n = nodes_.size();
  // The old buffers go first, so that the new ones need not fit beside them. Until the new plan is complete the
  // model holds none (capacity 0), so an allocation that fails leaves nothing half-planned: the next call plans
  // again from scratch, for its own batch.
  outputs_.clear();
  grad_slots_.clear();
  grad_slot_.clear();
  scratch_ = Tensor();
  row_shapes_.clear();
  capacity_rows_ = 0;
  input_row_numel_ = 0;
  std::vector<Tensor> outputs(n);
  for (size_t i = 0; i < n; ++i)
    if (nodes_[i].kind != NodeKind::kView && !fused_away(i)) outputs[i] = ctx.alloc(output_dtype_[i], shapes[i].with_rows(cap));

  // The gradient plan: walk backward as backward() does. A storage node's gradient buffer is taken when the first
  // contribution to it is written (its last consumer's backward, or the loss for the output) and given back once
  // its own backward ran; a buffer given back is reused, the smallest that fits first.
  auto row_numel = [&](int32_t s) {
    return s == kModelInput ? input.row_numel() : shapes[static_cast<size_t>(s)].row_numel();
  };
  std::vector<int64_t> slot_rows;  // per slot, its widest row
  std::vector<int32_t> free_slots;
  std::vector<int32_t> grad_slot(n + 1, -1);
  std::vector<int> contributions(n + 1, 0);
  auto acquire = [&](int32_t s) {
    int32_t& slot = grad_slot[static_cast<size_t>(s + 1)];
    if (slot >= 0) return;
    const int64_t need = row_numel(s);
    auto best = free_slots.end();
    for (auto it = free_slots.begin(); it != free_slots.end(); ++it) {
      const int64_t have = slot_rows[static_cast<size_t>(*it)];
      if (best == free_slots.end()) {
        best = it;
        continue;
      }
      const int64_t best_have = slot_rows[static_cast<size_t>(*best)];
      // Prefer a slot that fits, the smallest; else the widest (grown the least).
      if ((have >= need && (best_have < need || have < best_have)) || (best_have < need && have > best_have)) best = it;
    }
    if (best == free_slots.end()) {
      slot = static_cast<int32_t>(slot_rows.size());
      slot_rows.push_back(need);
    } else {
      slot = *best;
      free_slots.erase(best);
      slot_rows[static_cast<size_t>(slot)] = std::max(slot_rows[static_cast<size_t>(slot)], need);
    }
  };
  auto release = [&](int32_t s) { free_slots.push_back(grad_slot[static_cast<size_t>(s + 1)]); };
  acquire(storage_[n - 1]);
  for (size_t i = n; i-- > 0;) {
    if (nodes_[i].kind == NodeKind::kView) continue;
    const bool pair = i > 0 && epilogue_[i - 1] != Epilogue::kNone;
    const size_t first = pair ? i - 1 : i;
    if (pair) {
      // The pair's scratch between its two layers; then its din may take dout's buffer (the pair reads dout in
      // full before it writes din), as the two ping-pong buffers of a chain always did.
      acquire(static_cast<int32_t>(first));
      ++contributions[first + 1];
      release(static_cast<int32_t>(i));
    }
    for (int32_t in : nodes_[first].inputs) {
      const int32_t s = storage(in);
      if (s == kModelInput) continue;
      acquire(s);
      ++contributions[static_cast<size_t>(s + 1)];
    }
    release(static_cast<int32_t>(pair ? first : i));
    i = first;
  }
  std::vector<Tensor> grad_slots;
  for (int64_t width : slot_rows)
    grad_slots.push_back(ctx.alloc(DType::kF32, Shape{checked_mul(cap, std::max<int64_t>(width, 1))}));
  int64_t widest = 0;
  bool shared = false;
  for (size_t s = 0; s <= n; ++s)
    if (contributions[s] > 1) shared = true, widest = std::max(widest, row_numel(static_cast<int32_t>(s) - 1));
  Tensor scratch = shared ? ctx.alloc(DType::kF32, Shape{checked_mul(cap, widest)}) : Tensor();
  // Every allocation succeeded: the plan is committed as a whole.
  outputs_ = std::move(outputs);
  grad_slot_ = std::move(grad_slot);
  grad_slots_ = std::move(grad_slots);
  scratch_ = std::move(scratch);
  row_shapes_ = std::move(shapes);
  input_row_numel_ = input.row_numel();
  capacity_rows_ = cap;
}

Tensor ReplicaModel::forward(const ReplicaContext& ctx, const Tensor& input) {
  has_forward_ = false;
  reserve(ctx, input.shape());
  ctx.maybe_fail(Fault::kForward, "forward");
  if (params_low_.defined() && !params_low_current_) {
    ctx.stream->run(call::Convert{params_low_.ref(), params_.ref()});
    params_low_current_ = true;
  }
  const int64_t rows = input.rows();
  input_ = input;
  forward_rows_ = rows;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    const Node& node = nodes_[i];
    if (epilogue_[i] != Epilogue::kNone) {  // nodes i and i + 1 at once; node i's own output is not written
      node.layer->forward_with_epilogue(ctx, epilogue_[i], output(node.inputs[0]), output(static_cast<int32_t>(i + 1)));
      ++i;
      continue;
    }
    const Tensor y = output(static_cast<int32_t>(i));
    switch (node.kind) {
      case NodeKind::kLayer:
        if (node.inputs.size() == 1) {
          node.layer->forward(ctx, output(node.inputs[0]), y);
        } else {
          std::vector<Tensor> in;
          for (int32_t j : node.inputs) in.push_back(output(j));
          node.layer->forward_inputs(ctx, in, y);
        }
        break;
      case NodeKind::kSum:
        ctx.stream->copy(y.raw(), output(node.inputs[0]).raw(), y.bytes());
        for (size_t k = 1; k < node.inputs.size(); ++k)
          ctx.stream->run(call::Axpy{y.ref(), output(node.inputs[k]).ref()});
        break;
      case NodeKind::kConcat: {
        // Each row of the output is the inputs' rows one after another (dim 1 is the outermost after the batch).
        const size_t pitch = static_cast<size_t>(y.shape().row_numel()) * sizeof(float);
        int64_t offset = 0;
        for (int32_t in : node.inputs) {
          const Tensor x = output(in);
          const int64_t w = x.shape().row_numel();
          const size_t bytes = static_cast<size_t>(w) * sizeof(float);
          ctx.stream->copy_2d(y.f32() + offset, pitch, x.f32(), bytes, bytes, static_cast<size_t>(rows));
          offset += w;
        }
        break;
      }
      case NodeKind::kView: break;  // its output is its input's memory
    }
  }
  has_forward_ = true;
  return output(static_cast<int32_t>(nodes_.size() - 1));
}

Tensor ReplicaModel::output_grad_buffer(const ReplicaContext&) {
  return grad_of(static_cast<int32_t>(nodes_.size() - 1));
}

void ReplicaModel::contribute(const ReplicaContext& ctx, int32_t node,
                              const std::function<void(const Tensor& dst)>& write) {
  const Tensor g = grad_of(node);
  char& started = grad_started_[static_cast<size_t>(storage(node) + 1)];
  if (!started) {
    write(g);
    started = 1;
    return;
  }
  // A second consumer's gradient: written aside, then added (the layer's backward overwrites its din).
  const Tensor tmp = scratch_.rows(0, g.numel()).reshaped(g.shape());
  write(tmp);
  ctx.stream->run(call::Axpy{g.ref(), tmp.ref()});
}

void ReplicaModel::backward_inputs(const ReplicaContext& ctx, int32_t id, const Tensor& dout, bool accumulate) {
  const Node& node = nodes_[static_cast<size_t>(id)];
  std::vector<Tensor> in, din;
  // An input's gradient is written in place where this is its first contribution; a second one (an input read
  // twice here, or one whose gradient another reader began) goes to scratch of its own and is added after the call,
  // as contribute() does for one input. The model's input needs none: scratch takes it.
  std::vector<std::pair<int32_t, Tensor>> added;
  std::vector<int32_t> direct;
  for (int32_t j : node.inputs) {
    in.push_back(output(j));
    const int32_t s = storage(j);
    const bool fresh = s != kModelInput && !grad_started_[static_cast<size_t>(s + 1)] &&
                       std::find(direct.begin(), direct.end(), s) == direct.end();
    if (fresh) {
      direct.push_back(s);
      din.push_back(grad_of(j));
      continue;
    }
    Tensor scratch = ctx.alloc(DType::kF32, in.back().shape());
    if (s != kModelInput) added.emplace_back(j, scratch);
    din.push_back(std::move(scratch));
  }
  node.layer->backward_inputs(ctx, in, output(id), dout, din, accumulate);
  for (int32_t s : direct) grad_started_[static_cast<size_t>(s + 1)] = 1;
  for (const auto& [j, scratch] : added) {
    char& started = grad_started_[static_cast<size_t>(storage(j) + 1)];
    if (started)
      ctx.stream->run(call::Axpy{grad_of(j).ref(), scratch.ref()});
    else
      ctx.stream->copy(grad_of(j).raw(), scratch.raw(), scratch.bytes());
    started = 1;
  }
}

bool ReplicaModel::tied_accumulate(const ReplicaContext& ctx, size_t node, bool accumulate) {
  // A later reader of a tied parameter adds to it (see the constructor): what it writes first is zeroed.
  if (!tied_adds_[node] || accumulate) return accumulate;
  for (const Tensor& g : tied_zero_[node]) ctx.stream->fill_zero(g.raw(), g.bytes());
  return true;
}

void ReplicaModel::backward(const ReplicaContext& ctx, const Tensor& grad_output, bool accumulate,
                            const std::function<void(size_t node)>& node_done) {
  DPAR_ENFORCE(has_forward_, Status::kInvalidState, "backward: no forward state on ", ctx.device.str());
  ctx.maybe_fail(Fault::kBackward, "backward");
  const auto last = static_cast<int32_t>(nodes_.size() - 1);
  grad_started_.assign(nodes_.size() + 1, 0);
  // A caller's gradient in memory of its own is read in place when the output is a node's own memory; behind a
  // view it starts that node's gradient, which other consumers add to, so it is copied into the buffer.
  Tensor out_grad = grad_of(last);
  external_dout_ = Tensor();
  if (grad_output.raw() != out_grad.raw()) {
    if (storage(last) == last)
      external_dout_ = grad_output;
    else
      ctx.stream->copy(out_grad.raw(), grad_output.raw(), out_grad.bytes());
  }
  grad_started_[static_cast<size_t>(storage(last) + 1)] = 1;
  for (size_t i = nodes_.size(); i-- > 0;) {
    const Node& node = nodes_[i];
    const auto id = static_cast<int32_t>(i);
    if (node.kind == NodeKind::kView) {  // no math: its consumers wrote into its input's gradient
      if (node_done) node_done(i);
      continue;
    }
    DPAR_ENFORCE(grad_started_[i + 1], Status::kInternal, "node ", i, "'s gradient was never written");
    const Tensor dout = id == last && external_dout_.defined() ? external_dout_ : grad_of(id);
    const bool pair = i > 0 && epilogue_[i - 1] != Epilogue::kNone;  // nodes i - 1 and i run as one
    const size_t first = pair ? i - 1 : i;
    if (!pair && node.kind == NodeKind::kLayer && node.inputs.size() > 1) {
      backward_inputs(ctx, static_cast<int32_t>(i), dout, tied_accumulate(ctx, i, accumulate));
      if (node_done) node_done(i);
      continue;
    }
    if (pair || node.kind == NodeKind::kLayer) {
      const Node& head = nodes_[first];
      const int32_t in_id = head.inputs[0];
      const Tensor in = output(in_id);
      const Tensor out = output(id);
      const bool acc = tied_accumulate(ctx, first, accumulate);
      auto run = [&](const Tensor& din) {
        if (pair)
          head.layer->backward_with_epilogue(ctx, epilogue_[first], in, out, dout, grad_of(static_cast<int32_t>(first)),
                                             din, acc);
        else
          node.layer->backward(ctx, in, out, dout, din, acc);
      };
      if (storage(in_id) == kModelInput)
        run(Tensor());
      else
        contribute(ctx, in_id, run);
      if (node_done) {
        node_done(i);
        if (pair) node_done(first);
      }
      i = first;
      continue;
    }
    if (node.kind == NodeKind::kSum) {
      for (int32_t in : node.inputs) {
        if (storage(in) == kModelInput) continue;
        const Tensor g = grad_of(in);
        char& started = grad_started_[static_cast<size_t>(storage(in) + 1)];
        if (started)
          ctx.stream->run(call::Axpy{g.ref(), dout.ref()});
        else
          ctx.stream->copy(g.raw(), dout.raw(), g.bytes());
        started = 1;
      }
    } else {  // kConcat: each input's gradient is its columns of dout
      const auto rows = static_cast<size_t>(forward_rows_);
      const size_t pitch = static_cast<size_t>(dout.shape().row_numel()) * sizeof(float);
      int64_t offset = 0;
      for (int32_t in : node.inputs) {
        const int64_t w = output(in).shape().row_numel();
        const size_t bytes = static_cast<size_t>(w) * sizeof(float);
        if (storage(in) != kModelInput)
          contribute(ctx, in, [&](const Tensor& dst) {
            ctx.stream->copy_2d(dst.f32(), bytes, dout.f32() + offset, pitch, bytes, rows);
          });
        offset += w;
      }
    }
    if (node_done) node_done(i);
  }
  has_forward_ = false;
  input_ = Tensor();
  external_dout_ = Tensor();
}

}  // namespace dpar
