#include "kernels/cpu/dnnl_ops.h"

#include <dnnl.hpp>

#include <algorithm>
#include <cstring>
#include <list>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "common/error.h"
#include "kernels/cpu/gemm.h"

namespace dpar::kernels::cpu {
namespace {

using dnnl::memory;
using tag = memory::format_tag;
using dt = memory::data_type;

// Prepared primitives kept per op: enough for a training batch, its last (smaller) batch and an evaluation batch
// or two; the oldest goes when a new shape comes past that.
constexpr size_t kMaxShapes = 8;

// The right padding that makes oneDNN's output extent PyTorch's (floor division drops what a window would need past
// it): exactly what the last window reaches beyond the input and the left padding, never negative.
memory::dim pad_right(int64_t in, int64_t out, int64_t pad, int64_t stride, int64_t extent) {
  return std::max<int64_t>(0, (out - 1) * stride + extent - in - pad);
}

// Held while an op creates its primitives for a new shape (once per shape: they are cached). oneDNN may create
// primitives from several threads, but its global primitive cache is set up lazily inside the library, where
// ThreadSanitizer cannot see its synchronisation and reports the replicas' first creations as racing; one lock
// around creation orders them visibly, at no cost once every shape is prepared.
std::mutex& creation_mutex() {
  static std::mutex m;
  return m;
}

// Runs `body`, turning oneDNN's exceptions into dpar's, naming `what`.
template <class F>
void guarded(const std::string& what, const char* call, F&& body) {
  try {
    body();
  } catch (const dnnl::error& e) {
    if (e.status == dnnl_out_of_memory) fail(Status::kOutOfMemory, what, " ", call, ": oneDNN ran out of memory");
    fail(Status::kInternal, what, " ", call, ": oneDNN failed (status ", static_cast<int>(e.status), "): ",
         e.what());
  }
}

// A primitive's scratchpad, owned by the op (scratchpad_mode::user): no memory shared with another thread's ops.
struct Scratch {
  std::vector<char> bytes;
  memory mem;
  void make(const memory::desc& md, const dnnl::engine& eng) {
    bytes.resize(std::max<size_t>(md.get_size(), 1));
    mem = memory(md, eng, bytes.data());
  }
};

dnnl::primitive_attr user_scratchpad() {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return attr;
}

// One argument of a primitive: dpar's plain memory, used as it is where the primitive takes that layout, or a buffer
// of the op's in the layout the primitive chose, with the reorders between the two (made once per shape).
struct Staging {
  memory::desc plain;
  bool direct = true;
  memory buffer;
  dnnl::reorder to_buffer, to_plain;

  void init(const memory::desc& plain_md, const memory::desc& chosen, const dnnl::engine& eng) {
    plain = plain_md;
    direct = chosen == plain_md;
    if (direct) return;
    buffer = memory(chosen, eng);
    to_buffer = dnnl::reorder(dnnl::reorder::primitive_desc(eng, plain_md, eng, chosen));
    to_plain = dnnl::reorder(dnnl::reorder::primitive_desc(eng, chosen, eng, plain_md));
  }
  // What the primitive reads: the caller's memory, or the buffer once the caller's is reordered into it.
  memory read(const void* user, const dnnl::engine& eng, dnnl::stream& strm) {
    memory u(plain, eng, const_cast<void*>(user));
    if (direct) return u;
    to_buffer.execute(strm, u, buffer);
    return buffer;
  }
  // What the primitive writes; written() then moves a buffer's result into the caller's memory.
  memory target(void* user, const dnnl::engine& eng) { return direct ? memory(plain, eng, user) : buffer; }
  void written(void* user, const dnnl::engine& eng, dnnl::stream& strm) {
    if (direct) return;
    memory u(plain, eng, user);
    to_plain.execute(strm, buffer, u);
  }
};

}  // namespace

// ---- Convolution ------------------------------------------------------------------------------------------------

struct Conv2d::Impl {
  struct Prepared {
    int64_t N, H, W;
    // dpar's plain memory: src and wei in the dtype the convolution computes in (bf16 in mixed precision), dsrc and
    // dwei (their gradients) and bias and dst (the output and its gradient) f32; in f32 src == dsrc, wei == dwei.
    memory::desc src, dsrc, wei, dwei, bias, dst;
    std::string info;  // oneDNN's implementations, as prepared
    memory::dims strides, dilates, pad_l, pad_r;
    dnnl::convolution_forward::primitive_desc fwd_pd;
    dnnl::convolution_forward fwd;
    Scratch fwd_scratch;
    Staging fwd_src, fwd_wei, fwd_dst;
    std::optional<dnnl::convolution_backward_data> bwd_data;
    Scratch bwd_data_scratch;
    Staging bd_diff_src, bd_wei, bd_diff_dst;
    std::optional<dnnl::convolution_backward_weights> bwd_weights;
    Scratch bwd_weights_scratch;
    Staging bw_src, bw_diff_wei, bw_diff_dst;
  };

  // The layout a primitive is asked for: dpar's own for a 1x1 kernel, else whatever oneDNN prefers (its blocked
  // layouts, reordered at the edges). Measured on an AVX-512 CPU (oneDNN 2.6), one thread, batch 32 at 16x16,
  // forward and both backwards with the reorders included, three runs on a busy machine: depthwise 3x3 of 64
  // channels 4-8 ms blocked against 30-47 ms plain (plain is oneDNN's GEMM path for every kernel); 3x3 32->64
  // 22-24 ms against 31-42; 3x3 stride 2 64->128 24-27 against 25-29; but 1x1 64->64 10-13 against 3-8.
  // `type` is the dtype the primitive takes the argument in (a bf16 convolution's f32 gradient is reordered into
  // bf16 by the Staging at its edge).
  memory::desc asked(const memory::desc& plain, dt type) const {
    const bool one_by_one = spec.kernel_h == 1 && spec.kernel_w == 1;
    if (!one_by_one) return memory::desc(plain.dims(), type, tag::any);
    return memory::desc(plain.dims(), type, plain.dims().size() == 4 ? tag::abcd : tag::abcde);  // nchw, (g)oihw
  }
  // The dtype of the products: bf16 operands in mixed precision, else f32.
  dt compute() const { return spec.dtype == DType::kBF16 ? dt::bf16 : dt::f32; }

  Conv2dSpec spec;
  std::string name;
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream strm{eng};
  std::vector<std::unique_ptr<Prepared>> cache;  // most recently prepared last
  std::vector<float> dweight_tmp, dbias_tmp;     // backward_weights' result before it is added (accumulate)

  explicit Impl(const Conv2dSpec& s) : spec(s), name(s.str() + (s.dtype == DType::kBF16 ? " in bf16" : "")) {
    DPAR_CHECK_ARG(s.dtype == DType::kF32 || s.dtype == DType::kBF16, name, ": dtype ", dtype_name(s.dtype),
                   " is not one a convolution computes in (f32, bf16)");
  }

  void forward(float* out, const void* inp, const void* weight, const float* bias, int64_t N, int64_t H, int64_t W);
  void backward_data(float* dinp, const float* dout, const void* weight, int64_t N, int64_t H, int64_t W);
  void backward_weights(float* dweight, float* dbias, const float* dout, const void* inp, int64_t N, int64_t H,
                        int64_t W, bool accumulate);

  Prepared& prepared(int64_t N, int64_t H, int64_t W) {
    for (auto& p : cache)
      if (p->N == N && p->H == H && p->W == W) return *p;
    std::lock_guard<std::mutex> creating(creation_mutex());
    const Conv2dSpec& s = spec;
    const int64_t OH = s.out_h(H), OW = s.out_w(W);
    DPAR_CHECK_ARG(OH >= 1 && OW >= 1, name, ": input ", H, "x", W, " is smaller than the kernel's reach");
    auto p = std::make_unique<Prepared>();
    p->N = N, p->H = H, p->W = W;
    const dt c = compute();
    p->src = memory::desc({N, s.in_channels, H, W}, c, tag::nchw);
    p->dsrc = memory::desc({N, s.in_channels, H, W}, dt::f32, tag::nchw);
    p->dst = memory::desc({N, s.out_channels, OH, OW}, dt::f32, tag::nchw);
    // PyTorch's weight (C_out, C_in/groups, kh, kw) is oneDNN's goihw with the groups split off C_out: same bytes.
    const auto weight_desc = [&](dt type) {
      return s.groups == 1 ? memory::desc({s.out_channels, s.in_channels, s.kernel_h, s.kernel_w}, type, tag::oihw)
                           : memory::desc({s.groups, s.out_channels / s.groups, s.in_channels / s.groups, s.kernel_h,
                                           s.kernel_w},
                                          type, tag::goihw);
    };
    p->wei = weight_desc(c);
    p->dwei = weight_desc(dt::f32);
    p->bias = memory::desc({s.out_channels}, dt::f32, tag::x);
    p->strides = {s.stride_h, s.stride_w};
    p->dilates = {s.dilation_h - 1, s.dilation_w - 1};  // oneDNN counts the gaps: 0 is a dense kernel
    p->pad_l = {s.pad_h, s.pad_w};
    p->pad_r = {pad_right(H, OH, s.pad_h, s.stride_h, s.dilation_h * (s.kernel_h - 1) + 1),
                pad_right(W, OW, s.pad_w, s.stride_w, s.dilation_w * (s.kernel_w - 1) + 1)};
    const memory::desc src = asked(p->src, c), wei = asked(p->wei, c), dst = asked(p->dst, dt::f32);
    const auto fd = s.bias ? dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training,
                                                             dnnl::algorithm::convolution_direct, src, wei, p->bias,
                                                             dst, p->strides, p->dilates, p->pad_l, p->pad_r)
                           : dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training,
                                                             dnnl::algorithm::convolution_direct, src, wei, dst,
                                                             p->strides, p->dilates, p->pad_l, p->pad_r);
    dnnl::primitive_attr attr = user_scratchpad();
    if (s.epilogue == Epilogue::kRelu) {
      dnnl::post_ops ops;
      ops.append_eltwise(1.0f, dnnl::algorithm::eltwise_relu, 0.0f, 0.0f);
      attr.set_post_ops(ops);
    }
    p->fwd_pd = dnnl::convolution_forward::primitive_desc(fd, attr, eng);
    p->fwd = dnnl::convolution_forward(p->fwd_pd);
    p->fwd_scratch.make(p->fwd_pd.scratchpad_desc(), eng);
    p->fwd_src.init(p->src, p->fwd_pd.src_desc(), eng);
    p->fwd_wei.init(p->wei, p->fwd_pd.weights_desc(), eng);
    p->fwd_dst.init(p->dst, p->fwd_pd.dst_desc(), eng);
    p->info = std::string("forward ") + p->fwd_pd.impl_info_str();
    if (cache.size() == kMaxShapes) cache.erase(cache.begin());
    cache.push_back(std::move(p));
    return *cache.back();
  }
};

Conv2d::Conv2d(const Conv2dSpec& spec) : impl_(std::make_unique<Impl>(spec)) {}
Conv2d::~Conv2d() = default;

void Conv2d::forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int64_t H,
                     int64_t W) {
  impl_->forward(out, inp, weight, bias, N, H, W);
}
void Conv2d::forward(float* out, const uint16_t* inp, const uint16_t* weight, const float* bias, int64_t N, int64_t H,
                     int64_t W) {
  impl_->forward(out, inp, weight, bias, N, H, W);
}
void Conv2d::backward_data(float* dinp, const float* dout, const float* weight, int64_t N, int64_t H, int64_t W) {
  impl_->backward_data(dinp, dout, weight, N, H, W);
}
void Conv2d::backward_data(float* dinp, const float* dout, const uint16_t* weight, int64_t N, int64_t H, int64_t W) {
  impl_->backward_data(dinp, dout, weight, N, H, W);
}
void Conv2d::backward_weights(float* dweight, float* dbias, const float* dout, const float* inp, int64_t N,
                              int64_t H, int64_t W, bool accumulate) {
  impl_->backward_weights(dweight, dbias, dout, inp, N, H, W, accumulate);
}
void Conv2d::backward_weights(float* dweight, float* dbias, const float* dout, const uint16_t* inp, int64_t N,
                              int64_t H, int64_t W, bool accumulate) {
  impl_->backward_weights(dweight, dbias, dout, inp, N, H, W, accumulate);
}

std::string Conv2d::impl_info() const { return impl_->cache.empty() ? std::string() : impl_->cache.back()->info; }

void Conv2d::Impl::forward(float* out, const void* inp, const void* weight, const float* bias, int64_t N, int64_t H,
                           int64_t W) {
  if (N == 0) return;
  Impl& m = *this;
  guarded(m.name, "forward", [&] {
    Impl::Prepared& p = m.prepared(N, H, W);
    GemmThreadsScope threads;
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, p.fwd_src.read(inp, m.eng, m.strm)},
                                         {DNNL_ARG_WEIGHTS, p.fwd_wei.read(weight, m.eng, m.strm)},
                                         {DNNL_ARG_DST, p.fwd_dst.target(out, m.eng)},
                                         {DNNL_ARG_SCRATCHPAD, p.fwd_scratch.mem}};
    if (m.spec.bias) args.emplace(DNNL_ARG_BIAS, memory(p.bias, m.eng, const_cast<float*>(bias)));
    p.fwd.execute(m.strm, args);
    p.fwd_dst.written(out, m.eng, m.strm);
    m.strm.wait();
  });
}

void Conv2d::Impl::backward_data(float* dinp, const float* dout, const void* weight, int64_t N, int64_t H,
                                 int64_t W) {
  if (N == 0) return;
  Impl& m = *this;
  guarded(m.name, "backward_data", [&] {
    Impl::Prepared& p = m.prepared(N, H, W);
    if (!p.bwd_data) {
      // In bf16 the f32 gradient of out is rounded to bf16 by its Staging's reorder into the op's buffer.
      const dt c = m.compute();
      const dnnl::convolution_backward_data::desc d(dnnl::algorithm::convolution_direct, m.asked(p.dsrc, dt::f32),
                                                    m.asked(p.wei, c), m.asked(p.dst, c), p.strides, p.dilates,
                                                    p.pad_l, p.pad_r);
      const dnnl::convolution_backward_data::primitive_desc pd(d, user_scratchpad(), m.eng, p.fwd_pd);
      p.bwd_data.emplace(pd);
      p.bwd_data_scratch.make(pd.scratchpad_desc(), m.eng);
      p.info += std::string(", backward_data ") + pd.impl_info_str();
      p.bd_diff_src.init(p.dsrc, pd.diff_src_desc(), m.eng);
      p.bd_wei.init(p.wei, pd.weights_desc(), m.eng);
      p.bd_diff_dst.init(p.dst, pd.diff_dst_desc(), m.eng);
    }
    GemmThreadsScope threads;
    p.bwd_data->execute(m.strm, {{DNNL_ARG_DIFF_SRC, p.bd_diff_src.target(dinp, m.eng)},
                                 {DNNL_ARG_WEIGHTS, p.bd_wei.read(weight, m.eng, m.strm)},
                                 {DNNL_ARG_DIFF_DST, p.bd_diff_dst.read(dout, m.eng, m.strm)},
                                 {DNNL_ARG_SCRATCHPAD, p.bwd_data_scratch.mem}});
    p.bd_diff_src.written(dinp, m.eng, m.strm);
    m.strm.wait();
  });
}

void Conv2d::Impl::backward_weights(float* dweight, float* dbias, const float* dout, const void* inp, int64_t N,
                                    int64_t H, int64_t W, bool accumulate) {
  Impl& m = *this;
  const Conv2dSpec& s = m.spec;
  const size_t wn = static_cast<size_t>(s.out_channels * (s.in_channels / s.groups) * s.kernel_h * s.kernel_w);
  const size_t bn = static_cast<size_t>(s.out_channels);
  if (!s.bias) dbias = nullptr;
  if (N == 0) {  // no rows: a zero gradient
    if (!accumulate && dweight) std::memset(dweight, 0, wn * sizeof(float));
    if (!accumulate && dbias) std::memset(dbias, 0, bn * sizeof(float));
    return;
  }
  if (!dweight && !dbias) return;
  guarded(m.name, "backward_weights", [&] {
    Impl::Prepared& p = m.prepared(N, H, W);
    if (!p.bwd_weights) {
      const dt c = m.compute();
      const memory::desc src = m.asked(p.src, c), wei = m.asked(p.dwei, dt::f32), dst = m.asked(p.dst, c);
      const auto d = s.bias ? dnnl::convolution_backward_weights::desc(dnnl::algorithm::convolution_direct, src, wei,
                                                                       p.bias, dst, p.strides, p.dilates, p.pad_l,
                                                                       p.pad_r)
                            : dnnl::convolution_backward_weights::desc(dnnl::algorithm::convolution_direct, src, wei,
                                                                       dst, p.strides, p.dilates, p.pad_l, p.pad_r);
      const dnnl::convolution_backward_weights::primitive_desc pd(d, user_scratchpad(), m.eng, p.fwd_pd);
      p.bwd_weights.emplace(pd);
      p.bwd_weights_scratch.make(pd.scratchpad_desc(), m.eng);
      p.info += std::string(", backward_weights ") + pd.impl_info_str();
      p.bw_src.init(p.src, pd.src_desc(), m.eng);
      p.bw_diff_wei.init(p.dwei, pd.diff_weights_desc(), m.eng);
      p.bw_diff_dst.init(p.dst, pd.diff_dst_desc(), m.eng);
    }
    // oneDNN overwrites its results: they go to scratch first where they are to be added, or are not wanted.
    const bool weight_direct = dweight && !accumulate, bias_direct = dbias && !accumulate;
    if (!weight_direct) m.dweight_tmp.resize(wn);
    if (s.bias && !bias_direct) m.dbias_tmp.resize(bn);
    float* wdst = weight_direct ? dweight : m.dweight_tmp.data();
    float* bdst = bias_direct ? dbias : m.dbias_tmp.data();
    GemmThreadsScope threads;
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, p.bw_src.read(inp, m.eng, m.strm)},
                                         {DNNL_ARG_DIFF_DST, p.bw_diff_dst.read(dout, m.eng, m.strm)},
                                         {DNNL_ARG_DIFF_WEIGHTS, p.bw_diff_wei.target(wdst, m.eng)},
                                         {DNNL_ARG_SCRATCHPAD, p.bwd_weights_scratch.mem}};
    if (s.bias) args.emplace(DNNL_ARG_DIFF_BIAS, memory(p.bias, m.eng, bdst));
    p.bwd_weights->execute(m.strm, args);
    p.bw_diff_wei.written(wdst, m.eng, m.strm);
    m.strm.wait();
    if (dweight && accumulate)
      for (size_t i = 0; i < wn; ++i) dweight[i] += m.dweight_tmp[i];
    if (dbias && accumulate)
      for (size_t i = 0; i < bn; ++i) dbias[i] += m.dbias_tmp[i];
  });
}

// ---- Pooling ----------------------------------------------------------------------------------------------------

struct Pool2d::Impl {
  struct Prepared {
    int64_t N, C, H, W;
    memory::desc src, dst;
    dnnl::pooling_forward::primitive_desc fwd_pd;
    dnnl::pooling_forward fwd;
    Scratch fwd_scratch;
    Scratch workspace;  // a max pool's argmax of the last forward
    bool has_forward = false;
    std::optional<dnnl::pooling_backward> bwd;
    Scratch bwd_scratch;
  };

  Pool2dSpec spec;
  std::string name;
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream strm{eng};
  std::vector<std::unique_ptr<Prepared>> cache;

  explicit Impl(const Pool2dSpec& s) : spec(s), name(s.str()) {}

  dnnl::algorithm algorithm() const {
    return spec.kind == PoolKind::kMax ? dnnl::algorithm::pooling_max : dnnl::algorithm::pooling_avg_include_padding;
  }
  // kernel, strides, left and right padding for input H x W.
  void geometry(int64_t H, int64_t W, memory::dims& kernel, memory::dims& strides, memory::dims& pad_l,
                memory::dims& pad_r) const {
    if (spec.global) {
      kernel = {H, W}, strides = {1, 1}, pad_l = {0, 0}, pad_r = {0, 0};
      return;
    }
    kernel = {spec.kernel_h, spec.kernel_w};
    strides = {spec.stride_h, spec.stride_w};
    pad_l = {spec.pad_h, spec.pad_w};
    pad_r = {pad_right(H, spec.out_h(H), spec.pad_h, spec.stride_h, spec.kernel_h),
             pad_right(W, spec.out_w(W), spec.pad_w, spec.stride_w, spec.kernel_w)};
  }

  Prepared* find(int64_t N, int64_t C, int64_t H, int64_t W) {
    for (auto& p : cache)
      if (p->N == N && p->C == C && p->H == H && p->W == W) return p.get();
    return nullptr;
  }

  Prepared& prepared(int64_t N, int64_t C, int64_t H, int64_t W) {
    if (Prepared* p = find(N, C, H, W)) return *p;
    std::lock_guard<std::mutex> creating(creation_mutex());
    const int64_t OH = spec.out_h(H), OW = spec.out_w(W);
    DPAR_CHECK_ARG(OH >= 1 && OW >= 1, name, ": input ", H, "x", W, " is smaller than the window");
    auto p = std::make_unique<Prepared>();
    p->N = N, p->C = C, p->H = H, p->W = W;
    p->src = memory::desc({N, C, H, W}, dt::f32, tag::nchw);
    p->dst = memory::desc({N, C, OH, OW}, dt::f32, tag::nchw);
    memory::dims kernel, strides, pad_l, pad_r;
    geometry(H, W, kernel, strides, pad_l, pad_r);
    const dnnl::pooling_forward::desc d(dnnl::prop_kind::forward_training, algorithm(), p->src, p->dst, strides,
                                        kernel, pad_l, pad_r);
    p->fwd_pd = dnnl::pooling_forward::primitive_desc(d, user_scratchpad(), eng);
    p->fwd = dnnl::pooling_forward(p->fwd_pd);
    p->fwd_scratch.make(p->fwd_pd.scratchpad_desc(), eng);
    if (spec.kind == PoolKind::kMax) p->workspace.make(p->fwd_pd.workspace_desc(), eng);
    if (cache.size() == kMaxShapes) cache.erase(cache.begin());
    cache.push_back(std::move(p));
    return *cache.back();
  }

  void run(dnnl::primitive& prim, std::unordered_map<int, memory> args) {
    GemmThreadsScope threads;
    prim.execute(strm, args);
    strm.wait();
  }
};

Pool2d::Pool2d(const Pool2dSpec& spec) : impl_(std::make_unique<Impl>(spec)) {}
Pool2d::~Pool2d() = default;

void Pool2d::forward(float* out, const float* inp, int64_t N, int64_t C, int64_t H, int64_t W) {
  if (N == 0) return;
  Impl& m = *impl_;
  guarded(m.name, "forward", [&] {
    Impl::Prepared& p = m.prepared(N, C, H, W);
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, memory(p.src, m.eng, const_cast<float*>(inp))},
                                         {DNNL_ARG_DST, memory(p.dst, m.eng, out)},
                                         {DNNL_ARG_SCRATCHPAD, p.fwd_scratch.mem}};
    if (m.spec.kind == PoolKind::kMax) args.emplace(DNNL_ARG_WORKSPACE, p.workspace.mem);
    m.run(p.fwd, std::move(args));
    p.has_forward = true;
  });
}

void Pool2d::backward(float* dinp, const float* dout, int64_t N, int64_t C, int64_t H, int64_t W) {
  if (N == 0) return;
  Impl& m = *impl_;
  guarded(m.name, "backward", [&] {
    Impl::Prepared* found = m.find(N, C, H, W);
    // The workspace is the forward's: a max pool's backward without it would route gradients nowhere.
    DPAR_ENFORCE(m.spec.kind != PoolKind::kMax || (found && found->has_forward), Status::kInvalidState, m.name,
                 ": backward of input (", N, ", ", C, ", ", H, ", ", W, ") without its forward");
    Impl::Prepared& p = found ? *found : m.prepared(N, C, H, W);
    if (!p.bwd) {
      memory::dims kernel, strides, pad_l, pad_r;
      m.geometry(H, W, kernel, strides, pad_l, pad_r);
      const dnnl::pooling_backward::desc d(m.algorithm(), p.src, p.dst, strides, kernel, pad_l, pad_r);
      const dnnl::pooling_backward::primitive_desc pd(d, user_scratchpad(), m.eng, p.fwd_pd);
      p.bwd.emplace(pd);
      p.bwd_scratch.make(pd.scratchpad_desc(), m.eng);
    }
    std::unordered_map<int, memory> args{{DNNL_ARG_DIFF_SRC, memory(p.src, m.eng, dinp)},
                                         {DNNL_ARG_DIFF_DST, memory(p.dst, m.eng, const_cast<float*>(dout))},
                                         {DNNL_ARG_SCRATCHPAD, p.bwd_scratch.mem}};
    if (m.spec.kind == PoolKind::kMax) args.emplace(DNNL_ARG_WORKSPACE, p.workspace.mem);
    m.run(*p.bwd, std::move(args));
  });
}

// ---- bf16 GEMM --------------------------------------------------------------------------------------------------

namespace {
// Primitives kept per Bf16Gemm: a linear layer uses three shapes (forward, the two backward GEMMs; accumulation is
// a fourth), for its training batch, last batch and evaluation batch; 64 covers a dozen layers' worth.
constexpr size_t kMaxGemms = 64;
}  // namespace

struct Bf16Gemm::Impl {
  struct Key {
    bool trans_a, trans_b, accumulate;
    int64_t M, N, K, lda, ldb, ldc;
    int threads;
    // run_rounded's: C bf16, a bias row added, a ReLU after it.
    bool rounded = false, bias = false, relu = false;
    bool operator==(const Key& o) const {
      return trans_a == o.trans_a && trans_b == o.trans_b && accumulate == o.accumulate && M == o.M && N == o.N &&
             K == o.K && lda == o.lda && ldb == o.ldb && ldc == o.ldc && threads == o.threads &&
             rounded == o.rounded && bias == o.bias && relu == o.relu;
    }
  };
  struct KeyHash {
    size_t operator()(const Key& k) const {
      size_t h = static_cast<size_t>(k.trans_a) | static_cast<size_t>(k.trans_b) << 1 |
                 static_cast<size_t>(k.accumulate) << 2 | static_cast<size_t>(k.rounded) << 3 |
                 static_cast<size_t>(k.bias) << 4 | static_cast<size_t>(k.relu) << 5;
      for (int64_t v : {k.M, k.N, k.K, k.lda, k.ldb, k.ldc, static_cast<int64_t>(k.threads)})
        h = h * 0x9e3779b97f4a7c15ull + static_cast<size_t>(v);
      return h;
    }
  };
  struct Entry {
    Key key;
    memory::desc a, b, c, bias, scratch;
    dnnl::matmul prim;
    std::string impl;
  };

  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream strm{eng};
  std::list<Entry> lru;  // most recently used first
  std::unordered_map<Key, std::list<Entry>::iterator, KeyHash> index;
  std::vector<char> scratch;  // shared by the primitives: one runs at a time
  std::string last;

  // Created on the calling thread's GEMM thread count (inside the caller's GemmThreadsScope): oneDNN splits a
  // primitive's work for the count it sees at creation.
  Entry& entry(const Key& k) {
    if (auto it = index.find(k); it != index.end()) {
      lru.splice(lru.begin(), lru, it->second);
      return lru.front();
    }
    std::lock_guard<std::mutex> creating(creation_mutex());
    Entry e;
    e.key = k;
    // op(X) = X^T is X's memory read with swapped strides.
    e.a = memory::desc({k.M, k.K}, dt::bf16, k.trans_a ? memory::dims{1, k.lda} : memory::dims{k.lda, 1});
    e.b = memory::desc({k.K, k.N}, dt::bf16, k.trans_b ? memory::dims{1, k.ldb} : memory::dims{k.ldb, 1});
    e.c = memory::desc({k.M, k.N}, k.rounded ? dt::bf16 : dt::f32, memory::dims{k.ldc, 1});
    dnnl::primitive_attr attr = user_scratchpad();
    dnnl::post_ops ops;
    if (k.accumulate) ops.append_sum(1.0f);
    // ReLU on the f32 sum (bias included), before the one rounding to bf16: alpha 0 keeps a NaN a NaN (0 * NaN).
    if (k.relu) ops.append_eltwise(1.0f, dnnl::algorithm::eltwise_relu, 0.0f, 0.0f);
    if (ops.len() > 0) attr.set_post_ops(ops);
    if (k.bias) e.bias = memory::desc({1, k.N}, dt::f32, memory::dims{k.N, 1});
    const dnnl::matmul::primitive_desc pd(
        k.bias ? dnnl::matmul::desc(e.a, e.b, e.bias, e.c) : dnnl::matmul::desc(e.a, e.b, e.c), attr, eng);
    e.prim = dnnl::matmul(pd);
    e.scratch = pd.scratchpad_desc();
    e.impl = pd.impl_info_str();
    if (scratch.size() < std::max<size_t>(e.scratch.get_size(), 1)) scratch.resize(std::max<size_t>(e.scratch.get_size(), 1));
    if (lru.size() == kMaxGemms) {
      index.erase(lru.back().key);
      lru.pop_back();
    }
    lru.push_front(std::move(e));
    index.emplace(k, lru.begin());
    return lru.front();
  }
};

Bf16Gemm::Bf16Gemm() : impl_(std::make_unique<Impl>()) {}
Bf16Gemm::~Bf16Gemm() = default;

void Bf16Gemm::run(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda,
                   const uint16_t* B, int64_t ldb, bool accumulate, float* C, int64_t ldc) {
  DPAR_CHECK_ARG(M >= 1 && N >= 1 && K >= 1, "bf16 GEMM: extents must be >= 1, got M=", M, ", N=", N, ", K=", K);
  Impl& m = *impl_;
  guarded("bf16 GEMM", "matmul", [&] {
    GemmThreadsScope threads;
    Impl::Entry& e = m.entry({trans_a, trans_b, accumulate, M, N, K, lda, ldb, ldc, gemm_threads()});
    e.prim.execute(m.strm, {{DNNL_ARG_SRC, memory(e.a, m.eng, const_cast<uint16_t*>(A))},
                            {DNNL_ARG_WEIGHTS, memory(e.b, m.eng, const_cast<uint16_t*>(B))},
                            {DNNL_ARG_DST, memory(e.c, m.eng, C)},
                            {DNNL_ARG_SCRATCHPAD, memory(e.scratch, m.eng, m.scratch.data())}});
    m.strm.wait();
    m.last = e.impl;
  });
}

void Bf16Gemm::run_rounded(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, const uint16_t* B,
                           int64_t ldb, const float* bias, bool relu, uint16_t* C, int64_t ldc) {
  DPAR_CHECK_ARG(M >= 1 && N >= 1 && K >= 1, "bf16 GEMM: extents must be >= 1, got M=", M, ", N=", N, ", K=", K);
  Impl& m = *impl_;
  guarded("bf16 GEMM (bf16 result)", "matmul", [&] {
    GemmThreadsScope threads;
    Impl::Key key{false, true, false, M, N, K, lda, ldb, ldc, gemm_threads()};
    key.rounded = true;
    key.bias = bias != nullptr;
    key.relu = relu;
    Impl::Entry& e = m.entry(key);
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, memory(e.a, m.eng, const_cast<uint16_t*>(A))},
                                         {DNNL_ARG_WEIGHTS, memory(e.b, m.eng, const_cast<uint16_t*>(B))},
                                         {DNNL_ARG_DST, memory(e.c, m.eng, C)},
                                         {DNNL_ARG_SCRATCHPAD, memory(e.scratch, m.eng, m.scratch.data())}};
    if (bias != nullptr) args.emplace(DNNL_ARG_BIAS, memory(e.bias, m.eng, const_cast<float*>(bias)));
    e.prim.execute(m.strm, args);
    m.strm.wait();
    m.last = e.impl;
  });
}

std::string Bf16Gemm::last_impl() const { return impl_->last; }
size_t Bf16Gemm::cached() const { return impl_->lru.size(); }

// ---- f16 ----------------------------------------------------------------------------------------------------------

namespace {
// Whether oneDNN creates the primitive `make` builds: "" if it does, else its status in words.
template <class Make>
std::string refusal(Make make) {
  try {
    make();
    return "";
  } catch (const dnnl::error& e) {
    return e.status == dnnl_unimplemented ? "unimplemented" : std::string(e.what());
  }
}
}  // namespace

const char* f16_unsupported_why() {
  static const std::string why = [] {
    const dnnl::engine eng{dnnl::engine::kind::cpu, 0};
    const std::string matmul = refusal([&] {
      const memory::desc a({64, 32}, dt::f16, tag::ab), b({32, 48}, dt::f16, tag::ab), c({64, 48}, dt::f32, tag::ab);
      dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, b, c), eng);
    });
    const std::string conv = refusal([&] {
      const memory::desc x({2, 8, 16, 16}, dt::f16, tag::any), w({16, 8, 3, 3}, dt::f16, tag::any),
          y({2, 16, 16, 16}, dt::f32, tag::any);
      dnnl::convolution_forward::primitive_desc(
          dnnl::convolution_forward::desc(dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, x,
                                          w, y, {1, 1}, {1, 1}, {1, 1}),
          eng);
    });
    const std::string here = std::string(" here (") + gemm_backend() + ")";
    if (!matmul.empty())
      return "oneDNN creates no f16 matmul (f16 x f16 -> f32)" + here + ": " + matmul +
             (conv.empty() ? "" : "; nor an f16 convolution: " + conv) +
             " (oneDNN 2.6 has no f16 GEMM or convolution kernels for CPUs, whatever their ISA)";
    return "oneDNN creates f16 matmuls" + here + ", but this build's CPU backend has no f16 kernels yet";
  }();
  return why.c_str();
}

}  // namespace dpar::kernels::cpu
