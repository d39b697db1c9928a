// The CUDA platform layer (src/platform/cuda): the device scope over a model of the runtime's and the driver's
// per-thread state (no GPU needed), then on a GPU: what a scope, an NCCL teardown and a stream that runs no GEMM
// leave behind on the calling thread and in the process. The GPU tests skip with the reason where there is none.
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "comm/nccl_comm.h"
#include "cuda_test_util.h"
#include "platform/cuda/cuda_check.h"

namespace dpar {
namespace {

// ---- The device scope over a model of one thread's CUDA state -------------------------------------------------
// What the runtime documents: cudaSetDevice initialises the device's primary context, makes it current and sets
// the runtime's own per-thread device; cudaGetDevice says the current context's device, or the runtime's own when
// no context is current; cudaInitDevice initialises the primary context without making it current.
namespace model {

struct Context {
  int device;
};
Context primary[2] = {{0}, {1}};
Context framework_context{1};  // a context of the framework's own (cuCtxCreate) on device 1
bool active[2] = {false, false};
int runtime_device = 0;
Context* current = nullptr;
int context_switches = 0;
bool init_fails = false;

void reset() {
  active[0] = active[1] = false;
  runtime_device = 0;
  current = nullptr;
  context_switches = 0;
  init_fails = false;
}
CUcontext handle(Context* c) { return reinterpret_cast<CUcontext>(c); }

cudaError_t get_device(int* device) {
  *device = current != nullptr ? current->device : runtime_device;
  return cudaSuccess;
}
cudaError_t set_device(int device) {
  active[device] = true;
  current = &primary[device];
  runtime_device = device;
  return cudaSuccess;
}
cudaError_t init_device(int device) {
  if (init_fails) return cudaErrorDevicesUnavailable;
  active[device] = true;
  return cudaSuccess;
}
CUresult get_current(CUcontext* ctx) {
  *ctx = handle(current);
  return CUDA_SUCCESS;
}
CUresult set_current(CUcontext ctx) {
  current = reinterpret_cast<Context*>(ctx);
  ++context_switches;
  return CUDA_SUCCESS;
}
CUcontext active_primary(int device) { return active[device] ? handle(&primary[device]) : nullptr; }

cuda::ContextCalls calls() {
  cuda::ContextCalls c;
  c.get_device = get_device;
  c.set_device = set_device;
  c.init_device = init_device;
  c.get_current = get_current;
  c.set_current = set_current;
  c.active_primary = active_primary;
  return c;
}

}  // namespace model

TEST(DeviceScopeModel, AThreadWithoutAContextGetsNoneBackAndKeepsItsDevice) {
  model::reset();
  const cuda::ContextCalls calls = model::calls();
  {
    cuda::DeviceScope scope(1, calls);
    EXPECT_EQ(model::current, &model::primary[1]);
  }
  EXPECT_EQ(model::current, nullptr) << "the scope left a context current on a thread that had none";
  EXPECT_EQ(model::runtime_device, 0) << "the runtime's per-thread device stayed changed";
  EXPECT_FALSE(model::active[0]) << "a context was created on GPU 0, which the thread never used";
}

// NCCL's teardown calls cudaSetDevice inside the scope: undone where the old device's context exists, and never by
// creating one.
TEST(DeviceScopeModel, ADeviceSetInsideTheScopeIsUndoneWithoutCreatingAContext) {
  model::reset();
  const cuda::ContextCalls calls = model::calls();
  model::active[0] = true;  // the process uses GPU 0 on other threads
  {
    cuda::DeviceScope scope(1, calls);
    model::set_device(1);
  }
  EXPECT_EQ(model::current, nullptr);
  EXPECT_EQ(model::runtime_device, 0);

  model::reset();
  {
    cuda::DeviceScope scope(1, calls);
    model::set_device(1);
  }
  EXPECT_EQ(model::current, nullptr);
  EXPECT_FALSE(model::active[0]) << "restoring the runtime's device 0 created a context on GPU 0";
}

TEST(DeviceScopeModel, AFrameworksOwnContextComesBackAsItself) {
  model::reset();
  const cuda::ContextCalls calls = model::calls();
  model::active[1] = true;
  model::current = &model::framework_context;
  {
    cuda::DeviceScope scope(1, calls);
    EXPECT_EQ(model::current, &model::primary[1]) << "dpar's memory and streams live in the primary context";
  }
  EXPECT_EQ(model::current, &model::framework_context) << "a non-primary context came back as another one";
}

TEST(DeviceScopeModel, AnotherDevicesContextComesBackAndItsOwnIsLeftAlone) {
  model::reset();
  const cuda::ContextCalls calls = model::calls();
  model::set_device(0);
  {
    cuda::DeviceScope scope(1, calls);
    EXPECT_EQ(model::current, &model::primary[1]);
  }
  EXPECT_EQ(model::current, &model::primary[0]);
  EXPECT_EQ(model::runtime_device, 0);

  model::reset();
  model::set_device(1);
  {
    cuda::DeviceScope scope(1, calls);
    cuda::DeviceScope nothrow_scope(1, std::nothrow, calls);
  }
  EXPECT_EQ(model::context_switches, 0) << "the device's own context was current already";
  EXPECT_EQ(model::current, &model::primary[1]);
}

// Without the driver's entry points (no driver), the runtime's device is what there is, and what comes back.
TEST(DeviceScopeModel, WithoutTheDriversCallsTheRuntimesDeviceComesBack) {
  model::reset();
  cuda::ContextCalls calls = model::calls();
  calls.get_current = nullptr;
  calls.set_current = nullptr;
  calls.active_primary = nullptr;
  model::set_device(0);
  {
    cuda::DeviceScope scope(1, calls);
    EXPECT_EQ(model::runtime_device, 1);
  }
  EXPECT_EQ(model::runtime_device, 0);
  EXPECT_EQ(model::current, &model::primary[0]);
}

TEST(DeviceScopeModel, AScopeThatCannotEnterThrowsOrChangesNothing) {
  model::reset();
  const cuda::ContextCalls calls = model::calls();
  model::init_fails = true;
  try {
    cuda::DeviceScope scope(1, calls);
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kDevice);
    EXPECT_NE(std::string(e.what()).find("cuda:1"), std::string::npos) << e.what();
  }
  EXPECT_EQ(model::current, nullptr);
  {
    cuda::DeviceScope scope(1, std::nothrow, calls);
    EXPECT_EQ(model::current, nullptr);
  }
  EXPECT_EQ(model::current, nullptr);
  EXPECT_EQ(model::runtime_device, 0);
}

// ---- On a GPU ----------------------------------------------------------------------------------------------------

// With two GPUs the runtime's own device of a thread without a context is seen: cudaGetDevice says it there.
TEST(CudaDeviceScope, AThreadWithoutAContextKeepsItsRuntimeDevice) {
  DPAR_REQUIRE_GPU();
  const int last = cuda::cuda_device_count() - 1;
  if (last == 0) GTEST_SKIP() << "one GPU: the runtime's device 0 and the scope's are the same";
  std::thread([&] {
    ASSERT_FALSE(cuda::thread_has_context());
    {
      cuda::DeviceScope scope(last);
      DPAR_CUDA_CHECK(cudaFree(nullptr), "a call in the scope");
    }
    EXPECT_FALSE(cuda::thread_has_context());
    int device = -1;
    DPAR_CUDA_CHECK(cudaGetDevice(&device), "cudaGetDevice");
    EXPECT_EQ(device, 0) << "the scope left the runtime's per-thread device changed";
  }).join();
}

// An NCCL communicator freed on a thread that never used CUDA (a framework's, through the C API) leaves it without
// a context: NCCL's teardown runs under the communicator's device, not under cudaGetDevice()'s 0.
TEST(CudaDeviceScope, NcclTeardownLeavesTheThreadAsItWas) {
  DPAR_REQUIRE_GPU();
  const int last = cuda::cuda_device_count() - 1;
  ncclUniqueId id;
  DPAR_NCCL_CHECK(ncclGetUniqueId(&id), "ncclGetUniqueId");
  cudaStream_t stream = nullptr;
  {
    cuda::DeviceScope scope(last);
    DPAR_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  }
  std::unique_ptr<Communicator> comm =
      nccl_rank_communicator(id, 1, 0, last, stream, "rank 0", std::chrono::seconds(60), std::chrono::seconds(60));
  std::thread([&] {
    ASSERT_FALSE(cuda::thread_has_context());
    comm.reset();
    EXPECT_FALSE(cuda::thread_has_context()) << "NCCL's teardown left a context current on the thread";
    int device = -1;
    DPAR_CUDA_CHECK(cudaGetDevice(&device), "cudaGetDevice");
    EXPECT_EQ(device, 0);
  }).join();
  cuda::DeviceScope scope(last);
  DPAR_CUDA_CHECK(cudaStreamDestroy(stream), "stream");
}

bool cublas_loaded() {
  const std::string soname = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
  void* handle = dlopen(soname.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (handle != nullptr) dlclose(handle);
  return handle != nullptr;
}

// A data loader's stream copies batches and runs no GEMM: it must not load cuBLAS (about 215 MB) nor make a
// handle. The first GEMM of a stream does both.
TEST(CudaStreams, OnlyTheFirstGemmOfAStreamLoadsCublas) {
  DPAR_REQUIRE_GPU();
  if (cublas_loaded()) GTEST_SKIP() << "an earlier test of this process loaded cuBLAS: run alone (as CTest runs it)";
  const Device gpu{DeviceKind::kCuda, 0};
  Backend& backend = cuda_backend();
  std::unique_ptr<Stream> stream = backend.open_stream(gpu);
  const std::vector<float> host = {1, 2, 3, 4};
  float* x = static_cast<float*>(backend.allocate(gpu, host.size() * sizeof(float)));
  float* y = static_cast<float*>(backend.allocate(gpu, sizeof(float) * 2));
  stream->copy_from_host(x, host.data(), host.size() * sizeof(float));
  stream->fill_zero(y, sizeof(float) * 2);
  stream->synchronize();
  EXPECT_FALSE(cublas_loaded()) << "a stream that ran no GEMM loaded cuBLAS";
  // y (1,2) = x (1,2) @ w (2,2)^T, with w = x's four values
  stream->linear_forward(y, x, x, nullptr, 1, 2, 2);
  std::vector<float> out(2);
  stream->copy_to_host(out.data(), y, sizeof(float) * 2);
  EXPECT_TRUE(cublas_loaded());
  EXPECT_EQ(out, (std::vector<float>{1 * 1 + 2 * 2, 1 * 3 + 2 * 4}));
  stream.reset();
  backend.deallocate(gpu, x);
  backend.deallocate(gpu, y);
}

}  // namespace
}  // namespace dpar
