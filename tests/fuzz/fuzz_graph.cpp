// libFuzzer harness: the model graph builder and its layers' arguments through the C ABI. The input is decoded
// (FuzzedDataProvider) into a small input shape, then up to 32 dpar_model_* calls (every add_*, branch_from,
// set_node_name, the parameter and buffer queries) whose extents fit the shape the node reads (so that deep graphs
// are valid), or are small and sane, or extreme (0, 1, negatives, INT64_MIN/MAX, 2^24, 2^31, 2^32, square and cube
// roots of 2^63, ...); then an engine over 1 or 2 CPU devices takes a training step, a forward, backward and step,
// or an eval forward on an input of that shape. An input that runs out of bytes takes the fitting, sane choices.
//
// The harness keeps its own copy of the graph ("the mirror": the shapes and parameter counts dpar.h documents,
// exact in 128-bit arithmetic), which bounds memory and is an oracle:
//  - an add_* whose layer would hold more parameters than a run can afford (2^22 elements), but not so many that
//    no allocation could hold them (2^61: dpar must refuse those without allocating), is not made; the step runs
//    only where the parameters (asked of dpar) and the activations (from the mirror's shapes) fit in a few MB;
//  - every call's status is DPAR_OK or a documented error, never DPAR_ERR_INTERNAL or an unknown code, and a failing
//    call leaves a non-empty dpar_last_error();
//  - an accepted add_* appends exactly one node, a refused one changes nothing, an argument dpar.h says is refused
//    is refused, and dpar's parameter count is the mirror's (a wrapped element count shows here);
//  - no two parameters or buffers share a state_dict key, and a checkpoint a trained engine saves loads back into it;
//  - a graph the documented shapes refuse (a node's input of the wrong shape, a window larger than its padded input,
//    a dead branch, indices read as floats) is refused by the engine or the step, and an accepted forward's output
//    has the mirror's shape.
// Anything else is a crash, a leak or a sanitizer report. A finding aborts with its message (libFuzzer keeps the
// input). With FUZZ_GRAPH_TRACE=1 in the environment, each call is printed before it runs and its status after: the
// call sequence an input decodes to.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "dpar.h"
#include "fuzz_util.h"

namespace {

using i128 = __int128;

// Limits of what the harness lets dpar allocate.
constexpr i128 kAddParams = i128{1} << 22;        // an add_* of more parameters is not made (unless unallocatable)
constexpr i128 kUnallocatable = i128{1} << 61;    // 4-byte elements past this cannot exist: dpar must refuse
constexpr i128 kStepParams = i128{1} << 18;       // a step runs only with at most this many parameters...
constexpr i128 kStepActivations = i128{1} << 18;  // ...and this many activation elements (all nodes, all rows)
constexpr i128 kHuge = i128{1} << 100;            // the mirror's extents saturate here

const bool kTrace = std::getenv("FUZZ_GRAPH_TRACE") != nullptr;

void note(const std::string& what) {
  if (kTrace) std::fprintf(stderr, "fuzz_graph: %s\n", what.c_str());
}

[[noreturn]] void finding(const std::string& what) {
  std::fprintf(stderr, "fuzz_graph finding: %s\n", what.c_str());
  std::fflush(stderr);
  __builtin_trap();
}

std::string str(i128 v) {
  if (v >= kHuge) return "huge";
  if (v <= -kHuge) return "-huge";
  return std::to_string(static_cast<long long>(v));
}

// Every call goes through here: a status must be one dpar.h lists, never INTERNAL, and a failure must say why.
dpar_status check(dpar_status st, const std::string& call, bool traced = true) {
  if (kTrace && traced)
    std::fprintf(stderr, "fuzz_graph:   %s -> %s%s%s\n", call.c_str(), dpar_status_str(st), st == DPAR_OK ? "" : ": ",
                 st == DPAR_OK ? "" : dpar_last_error());
  if (st == DPAR_OK) return st;
  const char* msg = dpar_last_error();
  if (st < DPAR_ERR_INTERNAL || st > 0) finding(call + ": unknown status " + std::to_string(st) + " (" + msg + ")");
  if (st == DPAR_ERR_INTERNAL) finding(call + ": DPAR_ERR_INTERNAL: " + msg);
  if (msg == nullptr || msg[0] == '\0') finding(call + ": " + dpar_status_str(st) + " with an empty dpar_last_error()");
  return st;
}

i128 sat_mul(i128 a, i128 b) {
  if (a == 0 || b == 0) return 0;
  if (a >= kHuge || b >= kHuge || a > kHuge / b) return kHuge;
  return a * b;
}

i128 floor_div(i128 a, i128 b) {  // b > 0
  i128 q = a / b;
  if (a % b != 0 && a < 0) --q;
  return q;
}

// ---- Decoding ----------------------------------------------------------------------------------------------------

const int64_t kExtremes[] = {
    0, -1, -2, INT64_MIN, INT64_MIN + 1, INT64_MAX, INT64_MAX - 1, int64_t{1} << 62,
    int64_t{1} << 24, (int64_t{1} << 24) + 1, INT32_MAX, int64_t{1} << 31, int64_t{1} << 32, (int64_t{1} << 32) + 1,
    int64_t{1} << 40,
    3037000500,  // its square passes 2^63
    2097152,     // 2^21: its cube is 2^63
    46341,       // its square passes 2^31
    65536, 1, 2, 64};

// An extent: mostly small and sane, else extreme, else any.
int64_t extent(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange(0, 7)) {
    case 0:
    case 1:
    case 2:
    case 3: return in.ConsumeIntegralInRange<int64_t>(1, 6);
    case 4: return in.ConsumeIntegralInRange<int64_t>(0, 32);
    case 5:
    case 6: return kExtremes[in.ConsumeIntegralInRange<size_t>(0, std::size(kExtremes) - 1)];
    default: return in.ConsumeIntegral<int64_t>();
  }
}

// A rare branch: one draw in `n + 1`, and never once the input is used up (FuzzedDataProvider then answers the low
// end of every range, and an input that ends early takes the sane branches).
bool rare(FuzzedDataProvider& in, int n) { return in.ConsumeIntegralInRange(0, n) == n; }

float real(FuzzedDataProvider& in, float sane) {
  static const float kFloats[] = {0.0f, -0.0f, 1e-5f, 0.1f, 0.5f, 0.999f, 1.0f, 1.0000001f, -1e-5f, -1.0f,
                                  NAN, INFINITY, -INFINITY, FLT_MIN, 1e-45f, FLT_MAX, 2.0f};
  switch (in.ConsumeIntegralInRange(0, 3)) {
    case 0:
    case 1: return sane;
    case 2: return kFloats[in.ConsumeIntegralInRange<size_t>(0, std::size(kFloats) - 1)];
    default: return in.ConsumeFloatingPoint<float>();
  }
}

int32_t node_id(FuzzedDataProvider& in, int32_t last) {
  switch (in.ConsumeIntegralInRange(0, 7)) {
    case 0: return -1;
    case 1: return last;
    case 2: return last + 1;
    case 3: return in.PickValueInArray({-2, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()});
    case 4: return in.ConsumeIntegral<int32_t>();
    default: return last < 0 ? -1 : in.ConsumeIntegralInRange<int32_t>(0, last);
  }
}

// ---- The mirror: the graph as dpar.h documents it -----------------------------------------------------------------

enum class Kind { kLinear, kActivation, kDropout, kConv, kPool, kAdaptive, kBatchNorm, kLayerNorm, kEmbedding,
                  kSum, kConcat, kFlatten, kReshape };

struct Node {
  Kind kind = Kind::kActivation;
  std::vector<int32_t> inputs;
  // kLinear: in, out; kBatchNorm: dims (0: sync), channels; kLayerNorm: size; kEmbedding: rows, dim.
  int64_t a = 0, b = 0;
  // kConv: in, out, kernel, stride, padding, dilation, groups; kPool: kernel, stride, padding.
  int64_t in_ch = 0, out_ch = 0, k[2]{}, s[2]{}, p[2]{}, d[2]{1, 1}, groups = 1;
  std::vector<int64_t> row;  // kReshape
};

using Shape = std::vector<i128>;

std::string str(const Shape& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + str(s[i]);
  return out + ")";
}

i128 row_numel(const Shape& s) {
  i128 n = 1;
  for (size_t i = 1; i < s.size(); ++i) n = sat_mul(n, s[i]);
  return n;
}

// Node n's output shape y for its inputs' shapes; "" or why the documented shapes refuse them. work: the elements
// the node holds over all rows (its output, and a convolution's unfolded input, as a GEMM-based one may hold).
std::string node_shape(const Node& n, const std::vector<const Shape*>& in, Shape& y, i128& work) {
  const Shape& x = *in[0];
  work = 0;
  switch (n.kind) {
    case Kind::kLinear:
      if (x.size() < 2 || x.back() != n.a) return "linear expects (B, ..., " + std::to_string(n.a) + ")";
      y = x;
      y.back() = n.b;
      break;
    case Kind::kActivation:
    case Kind::kDropout: y = x; break;
    case Kind::kConv:
    case Kind::kPool:
    case Kind::kAdaptive: {
      if (x.size() != 4) return "a 2-D window expects (N, C, H, W)";
      if (n.kind == Kind::kConv && x[1] != n.in_ch) return "a convolution of another channel count";
      if (n.kind == Kind::kAdaptive) {
        y = {x[0], x[1], 1, 1};
        break;
      }
      i128 o[2];
      for (int e = 0; e < 2; ++e) {
        const i128 reach = n.kind == Kind::kConv ? i128{n.d[e]} * (n.k[e] - 1) + 1 : i128{n.k[e]};
        o[e] = floor_div(x[2 + e] + 2 * i128{n.p[e]} - reach, n.s[e]) + 1;
      }
      if (o[0] < 1 || o[1] < 1)
        return "the window is larger than the padded input: output " + str(o[0]) + "x" + str(o[1]);
      y = {x[0], n.kind == Kind::kConv ? i128{n.out_ch} : x[1], o[0], o[1]};
      if (n.kind == Kind::kConv)
        work = sat_mul(sat_mul(sat_mul(x[0], n.in_ch / n.groups), sat_mul(n.k[0], n.k[1])), sat_mul(o[0], o[1]));
      // A pooling window's cost is its area, padding included (oneDNN's max pooling visits every position of it):
      // a valid 65536x65536 window over a 1x2 input takes seconds, so it counts as work, not only its output.
      if (n.kind == Kind::kPool)
        work = sat_mul(sat_mul(sat_mul(x[0], x[1]), sat_mul(n.k[0], n.k[1])), sat_mul(o[0], o[1]));
      break;
    }
    case Kind::kBatchNorm: {
      const size_t lo = n.a == 2 ? 4 : 2, hi = n.a == 1 ? 3 : 4;
      if (x.size() < lo || x.size() > hi || x[1] != n.b) return "a batchnorm of another channel count or rank";
      y = x;
      break;
    }
    case Kind::kLayerNorm:
      if (x.size() < 2 || x.back() != n.a) return "a layernorm of another last dim";
      y = x;
      break;
    case Kind::kEmbedding:
      if (x.size() != 1 && x.size() != 2) return "an embedding reads (B) or (B, T)";
      y = x;
      y.push_back(n.b);
      break;
    case Kind::kSum:
      for (const Shape* s : in)
        if (*s != x) return "a sum of unequal shapes";
      y = x;
      break;
    case Kind::kConcat: {
      if (x.size() < 2) return "a concat needs 2 or more dims";
      y = x;
      for (size_t k = 1; k < in.size(); ++k) {
        const Shape& s = *in[k];
        bool fits = s.size() == x.size();
        for (size_t d = 0; fits && d < x.size(); ++d) fits = d == 1 || s[d] == x[d];
        if (!fits) return "a concat of shapes that differ beside dim 1";
        y[1] = std::min(y[1] + s[1], kHuge);
      }
      break;
    }
    case Kind::kFlatten: y = {x[0], row_numel(x)}; break;
    case Kind::kReshape: {
      i128 prod = 1;
      for (int64_t v : n.row) prod = sat_mul(prod, v);
      if (prod != row_numel(x)) return "a reshape to another element count";
      y = {x[0]};
      y.insert(y.end(), n.row.begin(), n.row.end());
      break;
    }
  }
  if (n.kind != Kind::kFlatten && n.kind != Kind::kReshape) work = std::min(work + sat_mul(y[0], row_numel(y)), kHuge);
  return "";
}

struct Mirror {
  std::vector<Node> nodes;
  int32_t next_input = -1;
  i128 params = 0;
  // The input shape the step will use (chosen first, so that arguments can be drawn to fit it; empty where it is
  // not a valid shape), and every node's output shape for it where the documented shapes accept the nodes so far.
  Shape input;
  std::vector<std::optional<Shape>> known;

  int32_t last() const { return static_cast<int32_t>(nodes.size()) - 1; }
  const Shape* shape_of(int32_t id) const {
    if (id == -1) return input.empty() ? nullptr : &input;
    const auto& s = known[static_cast<size_t>(id)];
    return s ? &*s : nullptr;
  }
  void add(Node n, i128 layer_params) {
    if (n.inputs.empty()) n.inputs = {next_input};
    std::vector<const Shape*> in;
    for (int32_t j : n.inputs) in.push_back(shape_of(j));
    Shape y;
    i128 work = 0;
    const bool fits = std::find(in.begin(), in.end(), nullptr) == in.end() && node_shape(n, in, y, work).empty();
    known.push_back(fits ? std::optional<Shape>(std::move(y)) : std::nullopt);
    nodes.push_back(std::move(n));
    next_input = last();
    params += layer_params;
  }

  // Whether the model's input is i32 indices (an Embedding reads it); "" or why dpar must refuse the model.
  std::string input_dtype(bool& i32) const {
    bool any_i32 = false, any_f32 = false;
    for (const Node& n : nodes)
      for (int32_t j : n.inputs)
        if (j == -1) (n.kind == Kind::kEmbedding ? any_i32 : any_f32) = true;
    i32 = any_i32;
    return any_i32 && any_f32 ? "the input is read both as indices and as floats" : "";
  }

  std::string dead_branch() const {
    std::vector<bool> used(nodes.size(), false);
    if (!nodes.empty()) used.back() = true;
    for (const Node& n : nodes)
      for (int32_t j : n.inputs)
        if (j >= 0) used[static_cast<size_t>(j)] = true;
    for (size_t i = 0; i < nodes.size(); ++i)
      if (!used[i]) return "node " + std::to_string(i) + " is read by no later node";
    return "";
  }

  // Every node's output shape for `input`; "" or why the documented shapes refuse the graph (shapes then stops at
  // the node that refuses). activations: the elements all nodes hold over all rows (node_shape's work).
  std::string shapes(std::vector<Shape>& out, i128& activations) const {
    out.clear();
    activations = 0;
    for (size_t i = 0; i < nodes.size(); ++i) {
      std::vector<const Shape*> in;
      for (int32_t j : nodes[i].inputs) in.push_back(j == -1 ? &input : &out[static_cast<size_t>(j)]);
      Shape y;
      i128 work = 0;
      const std::string why = node_shape(nodes[i], in, y, work);
      if (!why.empty()) return "node " + std::to_string(i) + " on " + str(*in[0]) + ": " + why;
      activations = std::min(activations + work, kHuge);
      out.push_back(std::move(y));
    }
    return "";
  }
};

// ---- The model calls ----------------------------------------------------------------------------------------------

struct Builder {
  FuzzedDataProvider& in;
  dpar_model* model;
  Mirror mirror;

  size_t num_nodes() {
    size_t n = 0;
    check(dpar_model_num_layers(&n, model), "dpar_model_num_layers", false);
    return n;
  }

  // What one add_* call is: its text for messages, why dpar.h refuses its arguments ("" where it does not), the node
  // the mirror appends if dpar accepts it, and the mirror's parameter count for the layer (kHuge where it
  // overflows). A layer too big to allocate here is not added, unless `limited`: dpar refuses it before allocating
  // (an extent past the layer's limit, such as Linear's 2^24). `not_supported`: dpar.h says it is not implemented.
  struct Call {
    std::string text, refused;
    Node node;
    i128 params = 0;
    bool limited = false, not_supported = false;
  };

  template <class F>
  void add(Call c, F&& run) {
    if (c.refused.empty() && !c.limited && c.params > kAddParams && c.params < kUnallocatable) return;
    const size_t before = num_nodes();
    note(c.text);
    const dpar_status st = check(run(), c.text);
    const size_t after = num_nodes();
    if (st != DPAR_OK) {
      if (after != before) finding(c.text + " failed but changed the model's node count");
      return;
    }
    if (!c.refused.empty()) finding(c.text + " accepted what dpar.h refuses: " + c.refused);
    if (c.not_supported) finding(c.text + " accepted an output size dpar.h says is not supported");
    if (after != before + 1) finding(c.text + " succeeded but did not add exactly one node");
    mirror.add(std::move(c.node), c.params);
    size_t count = 0;
    check(dpar_model_num_param_elements(&count, model), "dpar_model_num_param_elements", false);
    if (i128{count} != mirror.params)
      finding(c.text + ": dpar counts " + std::to_string(count) + " parameter elements, the layers' shapes " +
              str(mirror.params));
    int32_t last = 0;
    check(dpar_model_last_node(&last, model), "dpar_model_last_node", false);
    if (last != mirror.last()) finding(c.text + ": dpar_model_last_node is not the node just added");
  }

  static std::string positive(const char* name, int64_t v) {
    return v < 1 ? std::string(name) + " = " + std::to_string(v) + " < 1" : "";
  }

  static std::string x2(const int64_t* v) { return std::to_string(v[0]) + "x" + std::to_string(v[1]); }

  // The shape the next node reads, where the mirror knows it (null where not).
  const Shape* current() const { return mirror.shape_of(mirror.next_input); }

  // An extent that, half the time (and always once the input is used up), fits the shape the next node reads: its
  // dim `d` (a negative d counts from the end), where it has one; else extent().
  int64_t fitted(int d) {
    const Shape* s = current();
    const bool fit = in.ConsumeIntegralInRange(0, 1) == 0;
    if (fit && s && static_cast<int>(s->size()) > (d < 0 ? -d - 1 : d)) {
      const i128 v = (*s)[static_cast<size_t>(d < 0 ? static_cast<int>(s->size()) + d : d)];
      if (v <= INT64_MAX) return static_cast<int64_t>(v);
    }
    return extent(in);
  }

  void linear() {
    Call c;
    c.node.kind = Kind::kLinear;
    const Shape* s = current();
    const int64_t i = c.node.a = s && s->size() != 2 ? extent(in) : fitted(1), o = c.node.b = extent(in);
    const bool bias = in.ConsumeBool();
    c.text = "add_linear(" + std::to_string(i) + ", " + std::to_string(o) + ")";
    c.refused = positive("in_features", i);
    if (c.refused.empty()) c.refused = positive("out_features", o);
    c.params = sat_mul(i, o) + (bias ? o : 0);
    c.limited = i > (1 << 24) || o > (1 << 24);
    add(c, [&] { return dpar_model_add_linear(model, i, o, bias); });
  }

  void activation() {
    const int32_t kind = in.ConsumeBool() ? in.ConsumeIntegralInRange(0, 4) : in.ConsumeIntegral<int32_t>();
    Call c;
    c.node.kind = Kind::kActivation;
    c.text = "add_activation(" + std::to_string(kind) + ")";
    if (kind < DPAR_RELU || kind > DPAR_SILU) c.refused = "an unknown activation";
    add(c, [&] { return dpar_model_add_activation(model, kind); });
  }

  void dropout() {
    const float p = real(in, 0.5f);
    Call c;
    c.node.kind = Kind::kDropout;
    c.text = "add_dropout(" + std::to_string(p) + ")";
    if (!(p >= 0.0f && p < 1.0f)) c.refused = "p outside [0, 1)";
    add(c, [&] { return dpar_model_add_dropout(model, p); });
  }

  // A pair argument: NULL (where allowed) or two values.
  int64_t* pair(int64_t* storage, bool nullable) {
    if (nullable && rare(in, 3)) return nullptr;
    storage[0] = extent(in);
    storage[1] = in.ConsumeBool() ? storage[0] : extent(in);
    return storage;
  }

  void conv2d() {
    Call c;
    Node& n = c.node;
    n.kind = Kind::kConv;
    n.in_ch = fitted(1), n.out_ch = extent(in);
    int64_t k[2], s[2], p[2], d[2];
    const int64_t* kp = pair(k, true);
    const int64_t* sp = pair(s, true);
    int64_t* pp = pair(p, true);
    if (pp && in.ConsumeBool()) pp[0] = pp[1] = 0;  // padding 0 and dilation 1 more often than not
    int64_t* dp = pair(d, true);
    if (dp && in.ConsumeBool()) dp[0] = dp[1] = 1;
    n.groups = in.ConsumeBool() ? 1 : extent(in);
    const bool bias = in.ConsumeBool();
    c.refused = positive("in_channels", n.in_ch);
    if (c.refused.empty()) c.refused = positive("out_channels", n.out_ch);
    if (c.refused.empty() && !kp) c.refused = "kernel_size is NULL";
    for (int e = 0; e < 2; ++e) {
      n.k[e] = kp ? kp[e] : 1;
      n.s[e] = sp ? sp[e] : 1;
      n.p[e] = pp ? pp[e] : 0;
      n.d[e] = dp ? dp[e] : 1;
      if (!c.refused.empty()) continue;
      if (n.k[e] < 1) c.refused = "kernel_size < 1";
      if (n.s[e] < 1) c.refused = "stride < 1";
      if (n.p[e] < 0) c.refused = "padding < 0";
      if (n.d[e] < 1) c.refused = "dilation < 1";
    }
    if (c.refused.empty() && n.groups < 1) c.refused = "groups < 1";
    if (c.refused.empty() && (n.in_ch % n.groups != 0 || n.out_ch % n.groups != 0))
      c.refused = "groups does not divide the channels";
    if (c.refused.empty())
      c.params = std::min(sat_mul(n.out_ch, sat_mul(sat_mul(n.in_ch / n.groups, n.k[0]), n.k[1])) +
                              (bias ? n.out_ch : 0),
                          kHuge);
    c.limited = std::max({n.in_ch, n.out_ch, n.k[0], n.k[1], n.s[0], n.s[1], n.p[0], n.p[1], n.d[0], n.d[1],
                          n.groups}) > (1 << 24);  // dpar's limit on every extent
    c.text = "add_conv2d(" + std::to_string(n.in_ch) + " -> " + std::to_string(n.out_ch) + ", kernel " + x2(n.k) +
             ", stride " + x2(n.s) + ", padding " + x2(n.p) + ", dilation " + x2(n.d) + ", groups " +
             std::to_string(n.groups) + (kp && sp && pp && dp ? "" : ", NULL pairs as defaults") + ")";
    add(c, [&] { return dpar_model_add_conv2d(model, n.in_ch, n.out_ch, kp, sp, pp, dp, n.groups, bias); });
  }

  void pool2d() {
    const bool max = in.ConsumeBool();
    Call c;
    Node& n = c.node;
    n.kind = Kind::kPool;
    int64_t k[2], s[2], p[2];
    const int64_t* kp = pair(k, rare(in, 7));
    const int64_t* sp = pair(s, true);
    int64_t* pp = pair(p, true);
    if (pp && in.ConsumeBool()) pp[0] = pp[1] = 0;
    if (!kp) c.refused = "kernel_size is NULL";
    for (int e = 0; e < 2; ++e) {
      n.k[e] = kp ? kp[e] : 1;
      n.s[e] = sp ? sp[e] : n.k[e];
      n.p[e] = pp ? pp[e] : 0;
      if (!c.refused.empty()) continue;
      if (n.k[e] < 1) c.refused = "kernel_size < 1";
      if (n.s[e] < 1) c.refused = "stride < 1";
      if (n.p[e] < 0) c.refused = "padding < 0";
      if (2 * i128{n.p[e]} > n.k[e]) c.refused = "padding more than half the kernel";
    }
    c.text = std::string(max ? "add_max_pool2d" : "add_avg_pool2d") + "(kernel " + x2(n.k) + ", stride " + x2(n.s) +
             ", padding " + x2(n.p) + (kp && sp && pp ? "" : ", NULL pairs as defaults") + ")";
    add(c, [&] {
      return max ? dpar_model_add_max_pool2d(model, kp, sp, pp) : dpar_model_add_avg_pool2d(model, kp, sp, pp);
    });
  }

  void adaptive() {
    const int64_t h = in.ConsumeBool() ? 1 : extent(in), w = in.ConsumeBool() ? 1 : extent(in);
    Call c;
    c.node.kind = Kind::kAdaptive;
    c.text = "add_adaptive_avg_pool2d(" + std::to_string(h) + ", " + std::to_string(w) + ")";
    c.refused = positive("output_h", h);
    if (c.refused.empty()) c.refused = positive("output_w", w);
    c.not_supported = c.refused.empty() && (h != 1 || w != 1);
    add(c, [&] { return dpar_model_add_adaptive_avg_pool2d(model, h, w); });
  }

  void batchnorm() {
    Call c;
    Node& n = c.node;
    n.kind = Kind::kBatchNorm;
    n.a = in.ConsumeIntegralInRange(0, 2);  // 0: SyncBatchNorm
    n.b = fitted(1);
    const float eps = real(in, 1e-5f), momentum = real(in, 0.1f);
    const bool affine = in.ConsumeBool();
    c.refused = positive("num_features", n.b);
    if (c.refused.empty() && !(eps > 0.0f)) c.refused = "eps not positive";
    if (c.refused.empty() && !(momentum >= 0.0f && momentum <= 1.0f)) c.refused = "momentum outside [0, 1]";
    // Its buffers are allocated with or without parameters; past 2^24 channels dpar refuses them.
    if (c.refused.empty() && n.b <= (1 << 24) && 2 * i128{n.b} > kAddParams) return;
    c.params = affine ? 2 * i128{n.b} : 0;
    c.limited = n.b > (1 << 24);
    c.text = std::string(n.a == 0 ? "add_sync_batchnorm" : n.a == 1 ? "add_batchnorm1d" : "add_batchnorm2d") + "(" +
             std::to_string(n.b) + ", eps " + std::to_string(eps) + ", momentum " + std::to_string(momentum) + ")";
    add(c, [&] {
      if (n.a == 0) return dpar_model_add_sync_batchnorm(model, n.b, eps, momentum, affine);
      return (n.a == 1 ? dpar_model_add_batchnorm1d : dpar_model_add_batchnorm2d)(model, n.b, eps, momentum, affine);
    });
  }

  void layernorm() {
    Call c;
    c.node.kind = Kind::kLayerNorm;
    const int64_t size = c.node.a = fitted(-1);
    const float eps = real(in, 1e-5f);
    const bool affine = in.ConsumeBool();
    if (size < 1 || size > (1 << 24)) c.refused = "normalized_size outside 1 to 2^24";
    if (c.refused.empty() && !(eps > 0.0f)) c.refused = "eps not positive";
    c.params = affine ? 2 * i128{size} : 0;
    c.text = "add_layernorm(" + std::to_string(size) + ", eps " + std::to_string(eps) + ")";
    add(c, [&] { return dpar_model_add_layernorm(model, size, eps, affine); });
  }

  void embedding() {
    Call c;
    c.node.kind = Kind::kEmbedding;
    const int64_t v = c.node.a = extent(in), e = c.node.b = extent(in);
    const bool padded = in.ConsumeBool();
    const int64_t pad = padded ? (in.ConsumeBool() ? in.ConsumeIntegralInRange<int64_t>(-3, 3) : extent(in)) : 0;
    if (v < 1 || v > (1 << 24)) c.refused = "num_embeddings outside 1 to 2^24";
    if (c.refused.empty() && (e < 1 || e > (1 << 24))) c.refused = "embedding_dim outside 1 to 2^24";
    if (c.refused.empty() && padded && (pad < -v || pad >= v)) c.refused = "padding_idx out of range";
    if (c.refused.empty() && mirror.next_input != -1) c.refused = "an embedding must read the model's input";
    c.params = sat_mul(v, e);
    c.limited = c.params > (i128{1} << 31);  // dpar's limit on a table
    c.text = "add_embedding(" + std::to_string(v) + ", " + std::to_string(e) +
             (padded ? ", padding_idx " + std::to_string(pad) : std::string()) + ")";
    add(c, [&] {
      return padded ? dpar_model_add_embedding_padded(model, v, e, pad) : dpar_model_add_embedding(model, v, e);
    });
  }

  // add_sum / add_concat: a real array of the count's entries, or (for a count no array can have, more than
  // PTRDIFF_MAX bytes) a small one that dpar must not read past.
  void join(bool sum) {
    Call c;
    c.node.kind = sum ? Kind::kSum : Kind::kConcat;
    size_t count = 0;
    bool unreadable = false, null = false;
    switch (in.ConsumeIntegralInRange(0, 9)) {
      default: count = in.ConsumeIntegralInRange<size_t>(2, 4); break;
      case 6: count = in.ConsumeIntegralInRange<size_t>(0, 1); break;
      case 7: null = true, count = 2; break;
      case 8: count = 1000; break;
      case 9:
        unreadable = true;
        count = in.PickValueInArray({size_t{1} << 61, size_t{1} << 62, SIZE_MAX / 2, SIZE_MAX});
        break;
    }
    // The nodes: the next input first, then, half the time, nodes whose shapes join it (equal, or equal beside dim
    // 1 for a concat), else any id.
    std::vector<int32_t> fitting;
    const Shape* first = current();
    for (int32_t j = -1; first && j <= mirror.last(); ++j) {
      const Shape* s = mirror.shape_of(j);
      bool fits = s && s->size() == first->size() && (sum || s->size() >= 2);
      for (size_t d = 0; fits && d < s->size(); ++d) fits = (!sum && d == 1) || (*s)[d] == (*first)[d];
      if (fits) fitting.push_back(j);
    }
    std::vector<int32_t> ids(unreadable ? 4 : count);
    for (size_t k = 0; k < ids.size(); ++k) {
      const bool fit = in.ConsumeIntegralInRange(0, 1) == 0;
      if (fit && k == 0) ids[k] = mirror.next_input;
      else if (fit && !fitting.empty()) ids[k] = fitting[in.ConsumeIntegralInRange<size_t>(0, fitting.size() - 1)];
      else ids[k] = node_id(in, mirror.last());
    }
    if (null) c.refused = "inputs is NULL";
    if (c.refused.empty() && count < 2) c.refused = "fewer than 2 inputs";
    if (c.refused.empty() && unreadable) c.refused = "a count no array can hold";
    for (int32_t id : ids)
      if (c.refused.empty() && (id < -1 || id > mirror.last())) c.refused = "node " + std::to_string(id) + " not added";
    if (c.refused.empty()) c.node.inputs = ids;
    c.text = std::string(sum ? "add_sum" : "add_concat") + "(count " + std::to_string(count) + ": ";
    for (size_t i = 0; i < ids.size() && i < 8; ++i) c.text += (i ? ", " : "") + std::to_string(ids[i]);
    c.text += std::string(ids.size() > 8 ? ", ..." : "") + (null ? ", inputs NULL)" : ")");
    const int32_t* inputs = null ? nullptr : ids.data();
    add(c, [&] {
      return sum ? dpar_model_add_sum(model, inputs, count) : dpar_model_add_concat(model, inputs, count);
    });
  }

  void flatten() {
    Call c;
    c.node.kind = Kind::kFlatten;
    c.text = "add_flatten()";
    add(c, [&] { return dpar_model_add_flatten(model); });
  }

  void reshape() {
    Call c;
    c.node.kind = Kind::kReshape;
    size_t ndim = in.PickValueInArray<size_t>({1, 2, 3, 0, 4, 5});
    const bool unreadable = rare(in, 15);
    if (unreadable) ndim = in.PickValueInArray({size_t{1} << 61, SIZE_MAX});
    std::vector<int64_t> row(unreadable ? 4 : ndim);
    for (int64_t& v : row) v = extent(in);
    // Half the time, a row of the element count of the shape the next node reads: factors drawn as divisors.
    const Shape* s = current();
    if (!unreadable && ndim >= 1 && in.ConsumeIntegralInRange(0, 1) == 0 && s && row_numel(*s) <= INT64_MAX) {
      int64_t rest = static_cast<int64_t>(row_numel(*s));
      for (size_t i = 0; i + 1 < ndim; ++i) {
        row[i] = std::gcd(rest, in.ConsumeIntegralInRange<int64_t>(1, 8));
        rest /= row[i];
      }
      row[ndim - 1] = rest;
    }
    const bool null = rare(in, 15);
    if (null) c.refused = "row_shape is NULL";
    if (c.refused.empty() && (ndim < 1 || ndim >= DPAR_MAX_DIMS)) c.refused = "ndim outside 1 to DPAR_MAX_DIMS - 1";
    for (int64_t v : row)
      if (c.refused.empty() && v < 1) c.refused = "an extent < 1";
    if (c.refused.empty()) c.node.row = row;
    c.text = "add_reshape(ndim " + std::to_string(ndim) + ": ";
    for (size_t i = 0; i < row.size(); ++i) c.text += (i ? ", " : "") + std::to_string(row[i]);
    c.text += null ? ", row_shape NULL)" : ")";
    const int64_t* row_shape = null ? nullptr : row.data();
    add(c, [&] { return dpar_model_add_reshape(model, row_shape, ndim); });
  }

  void branch_from() {
    const int32_t node = node_id(in, mirror.last());
    const dpar_status st = check(dpar_model_branch_from(model, node), "branch_from(" + std::to_string(node) + ")");
    const bool valid = node >= -1 && node <= mirror.last();
    if (st == DPAR_OK && !valid) finding("branch_from accepted node " + std::to_string(node) + " not added");
    if (st == DPAR_OK) mirror.next_input = node;
  }

  void set_node_name() {
    static const char* const kNames[] = {
        "fc", "layer1.0.conv1", "0", "1", "2", "3", "0.weight", "1.weight", "weight", "bias", "running_mean",
        "1.running_mean", "num_batches_tracked", "fc.weight", "a..b", ".a", "a.", "", "a b", "a/b", "\xc3\xa9",
        "layer1", "layer1.0", "x_1.y_2", "bn", "bn.running_var",
        // the keys a checkpoint holds beside the parameters: optimizer state of parameter "0.weight", metadata
        "optimizer.momentum_buffer.0", "optimizer.exp_avg.0", "optimizer", "dpar", "__metadata__"};
    const int32_t node = node_id(in, mirror.last());
    std::string name;
    const bool null = rare(in, 31);
    switch (in.ConsumeIntegralInRange(0, 3)) {
      case 0: name = in.ConsumeRandomLengthString(40); break;
      case 1: name = std::string(in.ConsumeIntegralInRange<size_t>(1, 5000), 'n'); break;
      default: name = kNames[in.ConsumeIntegralInRange<size_t>(0, std::size(kNames) - 1)]; break;
    }
    const size_t before = num_nodes();
    check(dpar_model_set_node_name(model, node, null ? nullptr : name.c_str()),
          "set_node_name(" + std::to_string(node) + ", \"" + name.substr(0, 60) + "\")");
    if (num_nodes() != before) finding("set_node_name changed the node count");
  }

  void convert_sync() {
    if (check(dpar_model_convert_sync_batchnorm(model), "convert_sync_batchnorm") != DPAR_OK) return;
    for (Node& n : mirror.nodes)
      if (n.kind == Kind::kBatchNorm) n.a = 0;
  }

  // The queries: names, shapes and values of parameters and buffers (an index from anywhere, the exact count or not).
  void query() {
    size_t params = 0, buffers = 0;
    check(dpar_model_num_params(&params, model), "num_params", false);
    check(dpar_model_num_buffers(&buffers, model), "num_buffers", false);
    const bool buffer = in.ConsumeBool();
    const size_t total = buffer ? buffers : params;
    const size_t index = in.ConsumeBool() && total ? in.ConsumeIntegralInRange<size_t>(0, total - 1)
                                                   : in.ConsumeIntegral<size_t>();
    int64_t shape[DPAR_MAX_DIMS] = {};
    size_t ndim = 0;
    int32_t dtype = 0;
    const std::string at = std::string(buffer ? "buffer " : "param ") + std::to_string(index);
    const dpar_status st = buffer ? dpar_model_buffer_info(&dtype, shape, &ndim, model, index)
                                  : dpar_model_param_info(shape, &ndim, model, index);
    if (check(st, at + " info") != DPAR_OK) {
      if (index < total) finding(at + ": info refused an index below the count");
      return;
    }
    if (index >= total) finding(at + ": info accepted an index past the count");
    const char* name = buffer ? dpar_model_buffer_name(model, index) : dpar_model_param_name(model, index);
    if (!name) finding(at + ": no name");
    i128 n = 1;
    for (size_t i = 0; i < ndim && i < DPAR_MAX_DIMS; ++i) n = sat_mul(n, shape[i]);
    if (n > 4096) return;
    size_t count = static_cast<size_t>(n);
    if (rare(in, 3)) count = in.ConsumeIntegralInRange<size_t>(0, 4097);
    std::vector<int64_t> values(count + 1);  // room for i64 buffers too
    const bool set = in.ConsumeBool();
    if (set) std::fill(values.begin(), values.end(), in.ConsumeIntegral<int64_t>());
    dpar_status got;
    if (buffer)
      got = set ? dpar_model_set_buffer(model, index, values.data(), count)
                : dpar_model_get_buffer(values.data(), model, index, count);
    else
      got = set ? dpar_model_set_param(model, index, reinterpret_cast<const float*>(values.data()), count)
                : dpar_model_get_param(reinterpret_cast<float*>(values.data()), model, index, count);
    if (check(got, at + (set ? " set" : " get")) == DPAR_OK && count != static_cast<size_t>(n))
      finding(at + ": accepted a count other than its element count");
  }

  // No two parameters or buffers may share a state_dict key (a checkpoint would hold one of them).
  void check_names() {
    size_t params = 0, buffers = 0;
    check(dpar_model_num_params(&params, model), "num_params", false);
    check(dpar_model_num_buffers(&buffers, model), "num_buffers", false);
    std::set<std::string> keys;
    for (size_t i = 0; i < params + buffers; ++i) {
      const char* name = i < params ? dpar_model_param_name(model, i) : dpar_model_buffer_name(model, i - params);
      if (!name) finding("parameter or buffer " + std::to_string(i) + " has no name: " + dpar_last_error());
      if (!keys.insert(name).second) finding(std::string("two state_dict entries are named \"") + name + "\"");
    }
  }
};

// ---- The step -----------------------------------------------------------------------------------------------------

// An engine saves its checkpoint after a step (dpar.h: DPAR_OK or DPAR_ERR_IO), and the file loads back into it: a
// key written twice (a node named as another tensor's key, such as an optimizer state's) shows here.
void round_trip(dpar_engine* engine, const std::string& what) {
  const std::string& path = dpar::fuzz::scratch_path("graph.safetensors");
  const dpar_status saved = check(dpar_engine_save(engine, path.c_str()), "save after " + what);
  if (saved != DPAR_OK && saved != DPAR_ERR_IO)
    finding(std::string("save after ") + what + ": " + dpar_status_str(saved) + ": " + dpar_last_error());
  if (saved != DPAR_OK) return;
  const dpar_status st = check(dpar_engine_load(engine, path.c_str()), "load after " + what);
  std::remove(path.c_str());
  if (st != DPAR_OK) finding("the checkpoint saved after " + what + " does not load back: " + dpar_last_error());
}

struct Handles {
  dpar_model* model = nullptr;
  dpar_engine* engine = nullptr;
  dpar_tensor *input = nullptr, *target = nullptr, *output = nullptr, *grad = nullptr;
  ~Handles() {
    dpar_tensor_free(grad);
    dpar_tensor_free(output);
    dpar_tensor_free(target);
    dpar_tensor_free(input);
    dpar_engine_free(engine);
    dpar_model_free(model);
  }
};

// The input's shape: a batch and a row, mostly small and valid.
std::vector<int64_t> input_shape(FuzzedDataProvider& in) {
  const size_t ndim = rare(in, 15) ? in.PickValueInArray<size_t>({0, 5}) : in.PickValueInArray<size_t>({2, 4, 1, 3});
  std::vector<int64_t> shape(ndim);
  for (size_t i = 0; i < ndim; ++i)
    shape[i] = rare(in, 31) ? in.ConsumeIntegralInRange<int64_t>(-1, 0)
                            : in.ConsumeIntegralInRange<int64_t>(1, i == 0 ? 5 : 6);
  return shape;
}

void run_step(FuzzedDataProvider& in, Handles& h, const Mirror& mirror, const std::vector<int64_t>& shape) {
  const size_t ndim = shape.size();
  const bool valid_input = !mirror.input.empty();
  const std::string input = str(Shape(shape.begin(), shape.end()));
  // Why the documented shapes and dtypes refuse this step ("" where they do not).
  bool i32 = false;
  std::string refused = mirror.input_dtype(i32);
  if (rare(in, 15)) {
    i32 = !i32;
    if (refused.empty()) refused = std::string("an ") + (i32 ? "i32" : "f32") + " input to a model of the other";
  }
  const std::string dead = mirror.dead_branch();
  if (refused.empty()) refused = dead;
  std::vector<Shape> shapes;
  i128 activations = 0;
  if (refused.empty() && valid_input) refused = mirror.shapes(shapes, activations);
  size_t params = 0;
  check(dpar_model_num_param_elements(&params, h.model), "num_param_elements", false);
  // Only a step whose memory is bounded runs; a graph the shapes refuse allocates no activations.
  if (params > kStepParams || (refused.empty() && activations > kStepActivations)) return;

  const size_t devices = in.ConsumeIntegralInRange<size_t>(1, 2);
  enum Mode { kForwardBackward, kCrossEntropy, kMse, kEval };
  static const char* const kModes[] = {"forward, backward, step", "train_step, cross-entropy", "train_step, MSE",
                                       "eval forward"};
  const Mode mode = static_cast<Mode>(in.ConsumeIntegralInRange(0, 3));
  dpar_optimizer_options opt = DPAR_OPTIMIZER_OPTIONS_INIT;
  opt.momentum = in.ConsumeBool() ? 0.9f : 0.0f;
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = devices;
  eo.timeout_seconds = 20;
  eo.pin_workers = 0;
  eo.blas_threads = 1;
  eo.loss = mode == kMse ? DPAR_LOSS_MSE : DPAR_LOSS_CROSS_ENTROPY;
  note("engine over " + std::to_string(devices) + " CPU devices, " + kModes[mode] + ", input " +
       (i32 ? "i32 " : "f32 ") + input + (refused.empty() ? "" : ", expected refused: " + refused));
  if (check(dpar_engine_create(&h.engine, h.model, &opt, &eo), "engine_create") != DPAR_OK) {
    if (h.engine) finding("engine_create failed but gave an engine");
    return;
  }
  if (!dead.empty()) finding("engine_create accepted a graph with a dead branch: " + dead);

  // The input: indices in range (mostly) for an embedding, else floats.
  i128 numel = 1;
  for (int64_t v : shape) numel = sat_mul(numel, std::max<int64_t>(v, 1));
  std::vector<float> x(static_cast<size_t>(numel));
  const int64_t rows = ndim ? std::max<int64_t>(shape[0], 1) : 1;
  int64_t vocab = std::numeric_limits<int32_t>::max();
  for (const Node& n : mirror.nodes)
    if (n.kind == Kind::kEmbedding) vocab = std::min(vocab, n.a);
  for (float& v : x) {
    if (i32) {
      int32_t idx = static_cast<int32_t>(in.ConsumeIntegralInRange<int64_t>(0, vocab - 1));
      if (rare(in, 63)) {
        idx = in.PickValueInArray({-1, static_cast<int32_t>(vocab), std::numeric_limits<int32_t>::min()});
        if (refused.empty()) refused = "index " + std::to_string(idx) + " out of range";
      }
      std::memcpy(&v, &idx, sizeof idx);
    } else {
      v = rare(in, 63) ? in.ConsumeFloatingPoint<float>()
                                                : static_cast<float>(in.ConsumeIntegralInRange(-100, 100)) / 50;
    }
  }
  const dpar_status wrapped =
      check(dpar_tensor_wrap_host(&h.input, i32 ? DPAR_I32 : DPAR_F32, shape.data(), ndim, x.data()),
            "tensor_wrap_host(input)");
  if (wrapped == DPAR_OK && !valid_input) finding("tensor_wrap_host accepted an input of a bad shape");
  if (wrapped != DPAR_OK) return;
  std::vector<int64_t> out_dims;
  if (refused.empty())
    for (i128 v : shapes.back()) out_dims.push_back(static_cast<int64_t>(v));
  i128 out_numel = 1;
  for (int64_t v : out_dims) out_numel = sat_mul(out_numel, v);
  const std::string what = "the graph of " + std::to_string(mirror.nodes.size()) + " nodes on input " + input;

  if (mode == kCrossEntropy || mode == kMse) {
    // The target: labels of the output's leading shape (B, ...) for cross-entropy (the classes on its last
    // dimension), the output's shape for MSE; sometimes another shape.
    const std::vector<int64_t> want =
        mode == kCrossEntropy ? (out_dims.size() >= 2 ? std::vector<int64_t>(out_dims.begin(), out_dims.end() - 1)
                                                      : std::vector<int64_t>{rows})
                              : out_dims;
    std::vector<int64_t> tshape = want;
    if (tshape.empty() || rare(in, 15))
      tshape = {rows + in.ConsumeIntegralInRange<int64_t>(0, 1), in.ConsumeIntegralInRange<int64_t>(1, 4)};
    const bool other = tshape != want;
    i128 tn = 1;
    for (int64_t v : tshape) tn = sat_mul(tn, v);
    std::vector<float> t(static_cast<size_t>(tn));
    const bool classes_known = mode == kCrossEntropy && out_dims.size() >= 2;
    const int64_t classes = classes_known ? out_dims.back() : 4;
    if (refused.empty() && other) refused = "a target of another shape";
    if (refused.empty() && mode == kCrossEntropy && !classes_known) refused = "cross-entropy on a (B) output";
    for (float& v : t) {
      if (mode == kCrossEntropy) {
        int32_t label = static_cast<int32_t>(in.ConsumeIntegralInRange<int64_t>(0, classes - 1));
        if (rare(in, 63)) {
          label = -1;
          if (refused.empty() && classes_known) refused = "label -1";
        } else if (rare(in, 15)) {
          label = DPAR_IGNORE_INDEX;  // no sample: accepted
        }
        std::memcpy(&v, &label, sizeof label);
      } else {
        v = static_cast<float>(in.ConsumeIntegralInRange(-10, 10)) / 10;
      }
    }
    const int32_t dtype = mode == kCrossEntropy ? DPAR_I32 : DPAR_F32;
    if (check(dpar_tensor_wrap_host(&h.target, dtype, tshape.data(), tshape.size(), t.data()),
              "tensor_wrap_host(target)") != DPAR_OK)
      return;
    float loss = 0;
    const dpar_status st = check(dpar_engine_train_step(&loss, h.engine, h.input, h.target), "train_step on " + what);
    if (st != DPAR_OK) return;
    if (!refused.empty()) finding("train_step accepted " + what + " that dpar.h refuses: " + refused);
    round_trip(h.engine, "train_step on " + what);
    return;
  }
  if (mode == kEval) check(dpar_engine_set_training(h.engine, 0), "set_training(0)");
  if (check(dpar_engine_forward(&h.output, h.engine, h.input), "forward on " + what) != DPAR_OK) return;
  if (!refused.empty()) finding("forward accepted " + what + " that dpar.h refuses: " + refused);
  int64_t got[DPAR_MAX_DIMS] = {};
  size_t got_ndim = 0;
  check(dpar_tensor_shape(got, &got_ndim, h.output, DPAR_MAX_DIMS), "tensor_shape(output)");
  if (std::vector<int64_t>(got, got + std::min<size_t>(got_ndim, DPAR_MAX_DIMS)) != out_dims)
    finding("forward on " + what + " gave an output of another shape than " + str(shapes.back()));
  if (mode == kEval) return;
  std::vector<float> g(static_cast<size_t>(out_numel), 0.25f);
  if (check(dpar_tensor_wrap_host(&h.grad, DPAR_F32, out_dims.data(), out_dims.size(), g.data()),
            "tensor_wrap_host(grad_output)") != DPAR_OK)
    return;
  if (check(dpar_engine_backward(h.engine, h.grad), "backward on " + what) == DPAR_OK &&
      check(dpar_engine_step(h.engine), "step on " + what) == DPAR_OK)
    round_trip(h.engine, "step on " + what);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  Handles h;
  dpar_model_options mo = DPAR_MODEL_OPTIONS_INIT;
  mo.seed = in.ConsumeIntegral<uint8_t>();
  if (check(dpar_model_create(&h.model, &mo), "model_create") != DPAR_OK) return 0;
  Builder b{in, h.model, {}};
  const std::vector<int64_t> shape = input_shape(in);
  bool valid = !shape.empty() && shape.size() <= DPAR_MAX_DIMS;
  for (int64_t v : shape) valid = valid && v >= 1;
  if (valid) b.mirror.input.assign(shape.begin(), shape.end());
  const int calls = in.ConsumeIntegralInRange(1, 32);
  for (int i = 0; i < calls && in.remaining_bytes() > 0; ++i) {
    switch (in.ConsumeIntegralInRange(0, 19)) {
      case 0:
      case 1: b.linear(); break;
      case 2:
      case 3: b.activation(); break;
      case 4: b.dropout(); break;
      case 5:
      case 6: b.conv2d(); break;
      case 7: b.pool2d(); break;
      case 8: b.adaptive(); break;
      case 9: b.batchnorm(); break;
      case 10: b.layernorm(); break;
      case 11: b.embedding(); break;
      case 12: b.join(true); break;
      case 13: b.join(false); break;
      case 14: b.flatten(); break;
      case 15: b.reshape(); break;
      case 16: b.branch_from(); break;
      case 17: b.set_node_name(); break;
      case 18: b.query(); break;
      default: b.convert_sync(); break;
    }
  }
  b.check_names();
  if (!b.mirror.nodes.empty()) run_step(in, h, b.mirror, shape);
  dpar_clear_error();
  return 0;
}
