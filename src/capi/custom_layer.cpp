// A layer whose forward and backward are a C caller's callbacks. Each replica's copy owns the dpar_tensor
// handles it passes to the callbacks, registered once, so a call costs no allocation.
#include <string>

#include "capi/api.h"

namespace dpar::capi {
namespace {

struct CustomDesc {
  std::string name;
  std::vector<ParamSpec> specs;
  dpar_custom_shape_fn output_shape;
  dpar_custom_fn forward;
  dpar_custom_fn backward;
  void* payload;
  dpar_destroy_fn destroy;
  // The model and every engine built from it share the description: the last one to let go releases the payload.
  ~CustomDesc() {
    if (destroy) destroy(payload);
  }
};

// A handle that dpar owns and the callback borrows.
struct BorrowedTensor {
  BorrowedTensor() {
    handle.owned_by_parent = true;
    register_handle(&handle, HandleKind::kTensor);
  }
  ~BorrowedTensor() { unregister_handle(&handle); }
  BorrowedTensor(const BorrowedTensor&) = delete;
  BorrowedTensor& operator=(const BorrowedTensor&) = delete;
  dpar_tensor* set(const Tensor& t) {
    handle.tensor = t;
    return t.defined() ? &handle : nullptr;
  }
  dpar_tensor handle;
};

class CustomLayer final : public Layer {
 public:
  explicit CustomLayer(std::shared_ptr<const CustomDesc> desc) : desc_(std::move(desc)) {}

  std::string describe() const override { return "custom \"" + desc_->name + "\""; }
  std::vector<ParamSpec> param_specs() const override { return desc_->specs; }
  std::unique_ptr<Layer> clone() const override { return std::make_unique<CustomLayer>(desc_); }

  Shape output_shape(const Shape& in) const override {
    int64_t dims[DPAR_MAX_DIMS] = {0, 0, 0, 0};
    size_t ndim = 0;
    dpar_clear_error();
    const dpar_status rc = desc_->output_shape(desc_->payload, dims, &ndim, in.data(), in.ndim());
    if (rc != DPAR_OK) {
      const std::string detail = dpar_last_error();
      fail(from_c_error(rc), describe(), " rejects input ", in.str(), " (output_shape returned ", dpar_status_str(rc),
           detail.empty() ? ")" : "): ", detail);
    }
    Shape out = Shape::checked(dims, ndim, "custom layer output_shape");
    DPAR_CHECK_ARG(out[0] == in[0], describe(), " must keep the batch extent ", in[0], ", gives ", out.str());
    return out;
  }

  void forward(const ReplicaContext& ctx, const Tensor& in, const Tensor& out) override {
    bind_handles();
    dpar_custom_call call = base_call(ctx);
    call.input = in_.set(in);
    call.output = out_.set(out);
    ctx.stream->synchronize();  // the callback reads what the replica's queued work writes (on a GPU)
    invoke(desc_->forward, call, "forward");
  }

  void backward(const ReplicaContext& ctx, const Tensor& in, const Tensor& out, const Tensor& dout, const Tensor& din,
                bool accumulate) override {
    bind_handles();
    dpar_custom_call call = base_call(ctx);
    call.input = in_.set(in);
    call.output = out_.set(out);
    call.grad_output = dout_.set(dout);
    call.grad_input = din_.set(din);
    // The callback writes its gradients. When gradients are being accumulated it writes into scratch buffers
    // that dpar then adds, so callbacks never need to know about accumulation.
    if (accumulate) {
      if (scratch_.empty())
        for (const ParamSpec& s : desc_->specs) scratch_.push_back(ctx.alloc(DType::kF32, s.shape));
      for (size_t i = 0; i < scratch_.size(); ++i) grad_ptrs_[i] = grad_views_[i].set(scratch_[i]);
    } else {
      for (size_t i = 0; i < bound_grads_.size(); ++i) grad_ptrs_[i] = grad_views_[i].set(bound_grads_[i]);
    }
    call.grads = grad_ptrs_.data();
    ctx.stream->synchronize();
    invoke(desc_->backward, call, "backward");
    if (accumulate)
      for (size_t i = 0; i < scratch_.size(); ++i) ctx.stream->run(call::Axpy{grads_[i], scratch_[i].ref()});
  }

 private:
  // Wraps the bound parameter and gradient views once (bind() runs after construction).
  void bind_handles() {
    if (!param_handles_.empty() || desc_->specs.empty()) return;
    const size_t n = desc_->specs.size();
    param_handles_ = std::vector<BorrowedTensor>(n);
    grad_views_ = std::vector<BorrowedTensor>(n);
    // The views that share the replica's storage, not wraps of its raw pointers: a callback may export one
    // through DLPack, and the export must keep the memory alive after the engine is freed.
    for (size_t i = 0; i < n; ++i) {
      param_ptrs_.push_back(param_handles_[i].set(bound_params_[i]));
      grad_ptrs_.push_back(nullptr);
    }
  }

  dpar_custom_call base_call(const ReplicaContext& ctx) {
    dpar_custom_call call{};
    call.replica = ctx.replica;
    call.device = to_c(ctx.device);
    call.training = ctx.training ? 1 : 0;
    call.params = param_ptrs_.empty() ? nullptr : param_ptrs_.data();
    call.num_params = param_ptrs_.size();
    return call;
  }

  void invoke(dpar_custom_fn fn, const dpar_custom_call& call, const char* what) {
    dpar_clear_error();
    dpar_status rc = fn(desc_->payload, &call);
    if (rc != DPAR_OK) {
      std::string detail = dpar_last_error();
      fail(from_c_error(rc), describe(), " ", what, " returned ",
           dpar_status_str(rc), detail.empty() ? "" : ": ", detail);
    }
  }

  std::shared_ptr<const CustomDesc> desc_;
  BorrowedTensor in_, out_, dout_, din_;
  std::vector<BorrowedTensor> param_handles_, grad_views_;
  std::vector<dpar_tensor*> param_ptrs_, grad_ptrs_;
  std::vector<Tensor> scratch_;
};

}  // namespace

std::unique_ptr<Layer> make_custom_layer(const dpar_custom_layer& d) {
  // The description owns the payload from here on: a layer refused below releases it on the way out.
  auto desc = std::make_shared<CustomDesc>();
  desc->payload = d.payload;
  desc->destroy = d.destroy;
  DPAR_CHECK_ARG(d.name != nullptr && d.name[0] != '\0', "layer.name: is NULL or empty");
  DPAR_CHECK_ARG(d.output_shape != nullptr, "layer.output_shape: is NULL");
  DPAR_CHECK_ARG(d.forward != nullptr, "layer.forward: is NULL");
  DPAR_CHECK_ARG(d.backward != nullptr, "layer.backward: is NULL");
  DPAR_CHECK_ARG(d.num_params == 0 || d.params != nullptr, "layer.params: is NULL but num_params is ", d.num_params);
  DPAR_CHECK_ARG(d.num_params <= 64, "layer.num_params: ", d.num_params, " is more than 64");
  desc->name = d.name;
  for (size_t i = 0; i < d.num_params; ++i) {
    const dpar_param_spec& p = d.params[i];
    const std::string arg = "layer.params[" + std::to_string(i) + "]";
    DPAR_CHECK_ARG(p.name != nullptr && p.name[0] != '\0', arg, ".name: is NULL or empty");
    for (const ParamSpec& earlier : desc->specs)
      DPAR_CHECK_ARG(earlier.name != p.name, arg, ".name: \"", p.name, "\" is used twice");
    DPAR_CHECK_ARG(p.init == DPAR_INIT_ZEROS || p.init == DPAR_INIT_UNIFORM, arg, ".init: unknown kind ", p.init);
    DPAR_CHECK_ARG(p.init != DPAR_INIT_UNIFORM || (p.bound >= 0.0f && p.bound < 1e30f), arg, ".bound: ", p.bound,
                   " must be finite and >= 0");
    ParamSpec spec{p.name, Shape::checked(p.shape, p.ndim, (arg + ".shape").c_str()),
                   p.init == DPAR_INIT_UNIFORM ? InitKind::kUniform : InitKind::kZeros, p.bound};
    desc->specs.push_back(std::move(spec));
  }
  desc->output_shape = d.output_shape;
  desc->forward = d.forward;
  desc->backward = d.backward;
  return std::make_unique<CustomLayer>(desc);
}

}  // namespace dpar::capi
