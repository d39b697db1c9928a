// The CUDA attention op (kernels/cuda/attention.cu through CudaStream::make_attention) against the CPU op, its
// reference: forward (out, lse) and backward (dq, dk, dv), causal and not, with and without dropout (the same mask:
// both draw it from the position), q, k, v and their gradients as strided views of one packed (B, T, 3C) buffer.
// Skips with its reason where there is no GPU (cuda_test_util.h).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/stream.h"
#include "common/bf16.h"
#include "cuda_test_util.h"
#include "kernels/cpu/gemm.h"

namespace dpar {
namespace {

using test::DeviceBuffer;
using test::normalised_error;
using test::random_vector;
using Vec = std::vector<float>;

const Device kGpu{DeviceKind::kCuda, 0};

struct Case {
  int64_t B, T, heads, D;
  bool causal;
  float dropout_p;
  int64_t C() const { return heads * D; }
  std::string str() const {
    return "B=" + std::to_string(B) + " T=" + std::to_string(T) + " heads=" + std::to_string(heads) +
           " D=" + std::to_string(D) + (causal ? " causal" : "") + " p=" + std::to_string(dropout_p);
  }
};

// What one op computes on a case: out, lse, and the packed gradient (B, T, 3C) holding dq, dk, dv.
struct Result {
  Vec out, lse, dqkv;
};

// Runs `op` on buffers of its stream's device: `upload` places a host vector there, `download` reads one back.
template <class Upload, class Download>
Result run(AttentionOp& op, const Case& c, const Vec& qkv, const Vec& dout, Upload upload, Download download,
           Stream& stream) {
  const int64_t C = c.C();
  auto qkv_d = upload(qkv), dout_d = upload(dout), out_d = upload(Vec(dout.size())),
       lse_d = upload(Vec(static_cast<size_t>(c.B * c.heads * c.T))), dqkv_d = upload(Vec(qkv.size()));
  const TensorRef packed = TensorRef::of(qkv_d->get(), {c.B, c.T, 3 * C});
  const TensorRef dpacked = TensorRef::of(dqkv_d->get(), {c.B, c.T, 3 * C});
  const TensorRef out = TensorRef::of(out_d->get(), {c.B, c.T, C}), gout = TensorRef::of(dout_d->get(), {c.B, c.T, C});
  const TensorRef lse = TensorRef::of(lse_d->get(), {c.B, c.heads, c.T});
  const TensorRef q = packed.narrow_last(0, C), k = packed.narrow_last(C, C), v = packed.narrow_last(2 * C, C);
  op.forward(out, lse, q, k, v, c.dropout_p, 99, 12345);
  op.backward(dpacked.narrow_last(0, C), dpacked.narrow_last(C, C), dpacked.narrow_last(2 * C, C), gout, q, k, v, out,
              lse, c.dropout_p, 99, 12345);
  stream.synchronize();
  return {download(*out_d), download(*lse_d), download(*dqkv_d)};
}

// A host buffer with DeviceBuffer's get(): the CPU op's memory.
struct HostBuffer {
  Vec v;
  float* get() { return v.data(); }
};

TEST(CudaAttention, MatchesTheCpuOp) {
  DPAR_REQUIRE_GPU();
  auto cpu = cpu_backend().open_stream(Device{});
  auto gpu = cuda_backend().open_stream(kGpu);
  const std::vector<Case> cases = {{1, 1, 1, 8, true, 0.0f},   {2, 7, 2, 16, true, 0.0f},  {2, 130, 4, 32, true, 0.0f},
                                   {3, 65, 2, 64, false, 0.0f}, {2, 128, 4, 32, true, 0.2f}, {1, 257, 4, 64, true, 0.1f},
                                   {4, 33, 1, 8, false, 0.5f}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.str());
    AttentionSpec spec;
    spec.heads = c.heads;
    spec.causal = c.causal;
    const Vec qkv = random_vector(static_cast<size_t>(c.B * c.T * 3 * c.C()), 5, -2.0f, 2.0f);
    const Vec dout = random_vector(static_cast<size_t>(c.B * c.T * c.C()), 6);
    auto cpu_op = cpu->make_attention(spec);
    auto gpu_op = gpu->make_attention(spec);
    const Result want = run(
        *cpu_op, c, qkv, dout, [](const Vec& h) { return std::make_unique<HostBuffer>(HostBuffer{h}); },
        [](HostBuffer& b) { return b.v; }, *cpu);
    const Result got = run(
        *gpu_op, c, qkv, dout,
        [](const Vec& h) {
          auto b = std::make_unique<DeviceBuffer<float>>(h);
          DPAR_CUDA_CHECK(cudaDeviceSynchronize(), "upload");
          return b;
        },
        [](DeviceBuffer<float>& b) { return b.download(); }, *gpu);
    EXPECT_LT(normalised_error(got.out, want.out), 1e-5) << "out";
    EXPECT_LT(normalised_error(got.lse, want.lse), 1e-5) << "lse";
    EXPECT_LT(normalised_error(got.dqkv, want.dqkv), 1e-4) << "dq, dk, dv";
  }
}

// In bf16 (AttentionSpec::dtype): the CUDA op against the CPU's bf16 op, which computes the same roundings; they
// differ in f32's summation order, and so in the rare weight that the order moves across a bf16 rounding boundary.
TEST(CudaAttention, Bf16MatchesTheCpuBf16Op) {
  DPAR_REQUIRE_GPU();
  const char* why = "";
  if (!kernels::cpu::bf16_support(&why)) GTEST_SKIP() << "the CPU reference needs bf16 instructions: " << why;
  auto cpu = cpu_backend().open_stream(Device{});
  auto gpu = cuda_backend().open_stream(kGpu);
  ASSERT_TRUE(gpu->has_attention(DType::kBF16));
  const std::vector<Case> cases = {{2, 7, 2, 16, true, 0.0f}, {2, 130, 4, 32, true, 0.0f}, {3, 65, 2, 64, false, 0.0f},
                                   {2, 128, 4, 32, true, 0.2f}, {1, 600, 2, 64, true, 0.0f}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.str());
    AttentionSpec spec;
    spec.heads = c.heads;
    spec.causal = c.causal;
    spec.dtype = DType::kBF16;
    const int64_t C = c.C();
    const Vec wide = random_vector(static_cast<size_t>(c.B * c.T * 3 * C), 5, -2.0f, 2.0f);
    std::vector<uint16_t> qkv(wide.size());
    for (size_t i = 0; i < wide.size(); ++i) qkv[i] = to_bf16(wide[i]);
    const Vec dout = random_vector(static_cast<size_t>(c.B * c.T * C), 6);
    Result want, got;
    // One op on buffers of its stream's device: q, k, v and their gradients views of packed (B, T, 3C) buffers.
    auto run_on = [&](Stream& stream, uint16_t* qkv_p, float* dqkv, float* out, float* lse, float* gout) {
      const TensorRef packed = TensorRef::contiguous(qkv_p, DType::kBF16, {c.B, c.T, 3 * C});
      const TensorRef dpacked = TensorRef::of(dqkv, {c.B, c.T, 3 * C});
      const TensorRef o = TensorRef::of(out, {c.B, c.T, C}), l = TensorRef::of(lse, {c.B, c.heads, c.T});
      const TensorRef q = packed.narrow_last(0, C), k = packed.narrow_last(C, C), v = packed.narrow_last(2 * C, C);
      auto op = stream.make_attention(spec);
      op->forward(o, l, q, k, v, c.dropout_p, 99, 12345);
      op->backward(dpacked.narrow_last(0, C), dpacked.narrow_last(C, C), dpacked.narrow_last(2 * C, C),
                   TensorRef::of(gout, {c.B, c.T, C}), q, k, v, o, l, c.dropout_p, 99, 12345);
      stream.synchronize();
    };
    std::vector<uint16_t> qkv_host = qkv;
    Vec gout_host = dout;
    want.out.resize(dout.size());
    want.lse.resize(static_cast<size_t>(c.B * c.heads * c.T));
    want.dqkv.resize(qkv.size());
    run_on(*cpu, qkv_host.data(), want.dqkv.data(), want.out.data(), want.lse.data(), gout_host.data());
    DeviceBuffer<uint16_t> qkv_d(qkv);
    DeviceBuffer<float> dqkv_d(qkv.size()), out_d(dout.size()), lse_d(want.lse.size()), gout_d(dout);
    DPAR_CUDA_CHECK(cudaDeviceSynchronize(), "upload");
    run_on(*gpu, qkv_d.get(), dqkv_d.get(), out_d.get(), lse_d.get(), gout_d.get());
    got = {out_d.download(), lse_d.download(), dqkv_d.download()};
    EXPECT_LT(normalised_error(got.out, want.out), 2e-3) << "out";
    EXPECT_LT(normalised_error(got.lse, want.lse), 1e-5) << "lse";
    EXPECT_LT(normalised_error(got.dqkv, want.dqkv), 5e-3) << "dq, dk, dv";
  }
}

TEST(CudaAttention, RefusesNonContiguousRows) {
  DPAR_REQUIRE_GPU();
  auto gpu = cuda_backend().open_stream(kGpu);
  AttentionSpec spec;
  spec.heads = 2;
  auto op = gpu->make_attention(spec);
  DeviceBuffer<float> x(64), out(32), lse(8);
  const TensorRef q_t = TensorRef::of(x.get(), {1, 8, 4}).transposed(1, 2);  // (1, 4, 8), channels strided
  const TensorRef kv = TensorRef::of(x.get(), {1, 4, 8});
  try {
    op->forward(TensorRef::of(out.get(), {1, 4, 8}), TensorRef::of(lse.get(), {1, 2, 4}), q_t, kv, kv, 0, 0, 0);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument) << e.what();
  }
}

}  // namespace
}  // namespace dpar
