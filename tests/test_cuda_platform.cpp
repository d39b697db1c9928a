// The CUDA platform layer (src/platform/cuda): the device scope over a model of the runtime's and the driver's
// per-thread state and the NCCL loader (no GPU needed), then on a GPU: what a scope, an NCCL teardown and a stream
// that runs no GEMM leave behind on the calling thread and in the process. The GPU tests skip with the reason where there is none.
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "comm/nccl_comm.h"
#include "cuda_test_util.h"
#include "platform/cuda/cuda_check.h"
#include "platform/cuda/nccl_library.h"
#include "op_calls.h"

namespace dpar {
namespace {

// ---- The NCCL loader: no GPU needed (loading NCCL and asking its version touch no device) ----------------------

TEST(NcclLoader, LoadsOnFirstUseWithEveryFunctionAndItsVersion) {
  const cuda::NcclLibrary& lib = cuda::nccl();
  EXPECT_NE(lib.path.find("libnccl.so.2"), std::string::npos) << lib.path;
  EXPECT_GE(lib.version, cuda::kMinimumNcclVersion) << cuda::nccl_version_string(lib.version);
  int version = 0;
  ASSERT_EQ(lib.get_version(&version), ncclSuccess);
  EXPECT_EQ(version, lib.version);
  // Every member is a function pointer of the same size, between `get_version` and `path`: none may be null.
  const auto* first = reinterpret_cast<const char*>(&lib.get_version);
  const auto* end = reinterpret_cast<const char*>(&lib.path);
  size_t functions = 0;
  for (const char* p = first; p < end; p += sizeof(void*), ++functions) {
    void* fn = nullptr;
    std::memcpy(&fn, p, sizeof fn);
    EXPECT_NE(fn, nullptr) << "function " << functions << " of NcclLibrary is not resolved";
  }
  EXPECT_EQ(functions, 14u) << "NcclLibrary's functions changed: update this count";
  EXPECT_STRNE(lib.error_string(ncclInvalidUsage), "");
  EXPECT_EQ(&cuda::nccl(), &lib);  // resolved once
  std::cout << "NCCL " << cuda::nccl_version_string(lib.version) << " from " << lib.path
            << (lib.already_loaded ? " (already in the process)" : " (loaded by dpar)") << "\n";
}

TEST(NcclLoader, VersionCodesReadAsNcclWritesThem) {
  EXPECT_EQ(cuda::nccl_version_string(NCCL_VERSION(2, 28, 9)), "2.28.9");
  EXPECT_EQ(cuda::nccl_version_string(NCCL_VERSION(2, 8, 4)), "2.8.4");  // the old encoding, major * 1000
  EXPECT_EQ(cuda::nccl_version_string(cuda::kMinimumNcclVersion), "2.14.0");
}

TEST(NcclLoader, LooksInTheProcessFirstThenBySonameThenWhereItWasBuilt) {
  const std::vector<cuda::loader::NcclCandidate> c = cuda::loader::nccl_candidates();
  ASSERT_GE(c.size(), 2u);
  EXPECT_EQ(c[0].file, "libnccl.so.2");
  EXPECT_TRUE(c[0].in_process_only);
  EXPECT_EQ(c[1].file, "libnccl.so.2");
  EXPECT_FALSE(c[1].in_process_only);
  for (size_t i = 2; i < c.size(); ++i) {
    EXPECT_EQ(c[i].file.substr(c[i].file.size() - std::strlen("/libnccl.so.2")), "/libnccl.so.2") << c[i].file;
    EXPECT_FALSE(c[i].in_process_only);
  }
}

TEST(NcclLoader, AFailureIsNotSupportedAndNamesEveryPlaceTriedAndWhy) {
  try {
    cuda::loader::load_nccl({{"libdpar-no-such-nccl.so.2", true},
                             {"/nonexistent/dir/libnccl.so.2", false},
                             {"libm.so.6", false}});
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kNotSupported);
    const std::string what = e.what();
    EXPECT_NE(what.find("libdpar-no-such-nccl.so.2 (in the process): none loaded"), std::string::npos) << what;
    EXPECT_NE(what.find("/nonexistent/dir/libnccl.so.2: "), std::string::npos) << what;
    // A library that loads but is not NCCL: the functions it lacks are named.
    EXPECT_NE(what.find("libm.so.6: lacks ncclGetVersion, ncclGetErrorString"), std::string::npos) << what;
    EXPECT_NE(what.find("NCCL 2.14.0 or later"), std::string::npos) << what;
    EXPECT_NE(what.find("install NCCL"), std::string::npos) << what;
  }
}

TEST(NcclLoader, AnNcclOlderThanDparNeedsIsRefusedNamingItsVersion) {
  const cuda::NcclLibrary& found = cuda::nccl();
  const int newer = NCCL_VERSION(99, 0, 0);
  try {
    cuda::loader::load_nccl({{found.path, false}}, newer);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kNotSupported);
    const std::string what = e.what();
    EXPECT_NE(what.find(found.path + ": is NCCL " + cuda::nccl_version_string(found.version) +
                        ", older than 99.0.0, which dpar needs"),
              std::string::npos)
        << what;
  }
}

// A framework that loaded NCCL first (PyTorch's libtorch_cuda needs its own libnccl.so.2, from its own directory):
// dpar uses that one, and never loads a second NCCL beside it, not even where that one is too old.
TEST(NcclLoader, TheNcclAlreadyInTheProcessIsTheOneUsed) {
  void* earlier = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
  if (earlier != nullptr) {
    dlclose(earlier);
    GTEST_SKIP() << "an earlier test of this process loaded NCCL: run alone (as CTest runs it)";
  }
  // The framework's NCCL, by a path (as a framework's run path names its own): the build's, where it is a file.
  std::string file;
  for (const cuda::loader::NcclCandidate& c : cuda::loader::nccl_candidates())
    if (file.empty() && c.file.find('/') != std::string::npos && access(c.file.c_str(), R_OK) == 0) file = c.file;
  if (file.empty()) GTEST_SKIP() << "no libnccl.so.2 at a known path (the toolkit's or the build's directory)";
  void* framework = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(framework, nullptr) << dlerror();
  const cuda::NcclLibrary lib = cuda::loader::load_nccl(cuda::loader::nccl_candidates());
  EXPECT_TRUE(lib.already_loaded);
  EXPECT_EQ(lib.path, file);
  EXPECT_EQ(reinterpret_cast<void*>(lib.get_version), dlsym(framework, "ncclGetVersion"));
  try {
    cuda::loader::load_nccl({{"libnccl.so.2", true}, {"/nonexistent/other/libnccl.so.2", false}},
                            NCCL_VERSION(99, 0, 0));
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kNotSupported);
    const std::string what = e.what();
    EXPECT_NE(what.find("the libnccl.so.2 already in the process (" + file + ") is NCCL "), std::string::npos) << what;
    EXPECT_NE(what.find("does not load a second one"), std::string::npos) << what;
    EXPECT_EQ(what.find("/nonexistent/other"), std::string::npos) << "the search went on: " << what;
  }
  dlclose(framework);
}

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
  const ncclUniqueId id = nccl_unique_id();
  cudaStream_t stream = nullptr;
  {
    cuda::DeviceScope scope(last);
    DPAR_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  }
  std::unique_ptr<Communicator> comm =
      nccl_rank_communicator(id, 1, 0, last, stream, "rank 0", std::chrono::seconds(60), std::chrono::seconds(60));
  std::cout << "NCCL " << cuda::nccl_version_string(cuda::nccl().version) << " from " << cuda::nccl().path << "\n";
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
  test::linear_forward(*stream, y, x, x, nullptr, 1, 2, 2);
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
