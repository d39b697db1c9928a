// DLPack through the C ABI: tensors taken from and handed to another framework without a copy.
#include <gtest/gtest.h>

#include <dlpack/dlpack.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "dpar.h"
#include "require_gpu.h"

namespace {

#define ASSERT_OK(call) ASSERT_EQ((call), DPAR_OK) << #call << ": " << dpar_last_error()

// A DLPack tensor as a producer (NumPy, PyTorch) makes one: its own storage, shape and deleter.
struct Producer {
  std::vector<float> data;
  int64_t shape[2];
  int64_t strides[2];
  DLManagedTensor managed{};
  int deleted = 0;
  Producer(int64_t rows, int64_t cols) : data(static_cast<size_t>(rows * cols)), shape{rows, cols}, strides{cols, 1} {
    for (size_t i = 0; i < data.size(); ++i) data[i] = 0.5f * float(i);
    managed.dl_tensor = DLTensor{data.data(), DLDevice{kDLCPU, 0}, 2, DLDataType{kDLFloat, 32, 1}, shape, nullptr, 0};
    managed.manager_ctx = this;
    managed.deleter = [](DLManagedTensor* m) { static_cast<Producer*>(m->manager_ctx)->deleted++; };
  }
};

TEST(Dlpack, FromDlpackSharesTheMemoryAndCallsTheDeleterOnceOnFree) {
  Producer p(3, 4);
  p.managed.dl_tensor.strides = p.strides;  // compact strides given explicitly
  dpar_tensor* t = nullptr;
  ASSERT_OK(dpar_tensor_from_dlpack(&t, &p.managed));
  void* data = nullptr;
  ASSERT_OK(dpar_tensor_data(&data, t));
  EXPECT_EQ(data, p.data.data()) << "a copy was made";
  int64_t shape[DPAR_MAX_DIMS];
  size_t ndim = 0;
  ASSERT_OK(dpar_tensor_shape(shape, &ndim, t, DPAR_MAX_DIMS));
  EXPECT_EQ(std::vector<int64_t>(shape, shape + ndim), (std::vector<int64_t>{3, 4}));
  int32_t dtype = -1;
  dpar_device device{-1, -1};
  ASSERT_OK(dpar_tensor_info(&dtype, nullptr, &device, t));
  EXPECT_EQ(dtype, DPAR_F32);
  EXPECT_EQ(device.kind, DPAR_DEVICE_CPU);
  EXPECT_EQ(p.deleted, 0);
  dpar_tensor_free(t);
  EXPECT_EQ(p.deleted, 1);
}

TEST(Dlpack, ByteOffsetAndInt32AreHonoured) {
  std::vector<int32_t> labels{9, 9, 1, 2, 3};
  int64_t shape[1] = {3};
  DLManagedTensor m{};
  m.dl_tensor = DLTensor{labels.data(), DLDevice{kDLCPU, 0}, 1, DLDataType{kDLInt, 32, 1}, shape, nullptr,
                         2 * sizeof(int32_t)};
  dpar_tensor* t = nullptr;
  ASSERT_OK(dpar_tensor_from_dlpack(&t, &m));  // no deleter: nothing to call
  int32_t out[3] = {};
  ASSERT_OK(dpar_tensor_copy_to_host(out, t, sizeof out));
  EXPECT_EQ(std::vector<int32_t>(out, out + 3), (std::vector<int32_t>{1, 2, 3}));
  int32_t dtype = -1;
  ASSERT_OK(dpar_tensor_info(&dtype, nullptr, nullptr, t));
  EXPECT_EQ(dtype, DPAR_I32);
  dpar_tensor_free(t);
}

TEST(Dlpack, RefusalsLeaveTheTensorWithTheCaller) {
  dpar_tensor* t = reinterpret_cast<dpar_tensor*>(&t);
  EXPECT_EQ(dpar_tensor_from_dlpack(&t, nullptr), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(t, nullptr);
  Producer p(2, 3);
  p.managed.dl_tensor.dtype = DLDataType{kDLFloat, 64, 1};
  EXPECT_EQ(dpar_tensor_from_dlpack(&t, &p.managed), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dpar_last_error()).find("dtype"), std::string::npos) << dpar_last_error();
  p.managed.dl_tensor.dtype = DLDataType{kDLFloat, 32, 1};
  int64_t transposed[2] = {1, 2};  // a column-major view
  p.managed.dl_tensor.strides = transposed;
  EXPECT_EQ(dpar_tensor_from_dlpack(&t, &p.managed), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(dpar_last_error()).find("strides"), std::string::npos) << dpar_last_error();
  p.managed.dl_tensor.strides = nullptr;
  p.managed.dl_tensor.device = DLDevice{kDLMetal, 0};
  EXPECT_EQ(dpar_tensor_from_dlpack(&t, &p.managed), DPAR_ERR_NOT_SUPPORTED);
  p.managed.dl_tensor.device = DLDevice{kDLCPU, 0};
  p.managed.dl_tensor.ndim = 5;
  EXPECT_EQ(dpar_tensor_from_dlpack(&t, &p.managed), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(p.deleted, 0);
  EXPECT_EQ(dpar_tensor_to_dlpack(nullptr, nullptr), DPAR_ERR_INVALID_ARGUMENT);
}

// dpar reads an imported tensor as compact row-major memory: every stride must be the product of the extents after
// it, not only the innermost (a padded or broadcast outer dimension would be read as if compact, silently taking
// the wrong elements). An extent of 1 may carry any stride. Each refusal names the stride and leaves the tensor with
// its producer.
TEST(Dlpack, EveryStrideMustBeCompactNotOnlyTheInnermost) {
  std::vector<float> data(2 * 4 * 5, 1.0f);
  int64_t shape[3] = {2, 3, 4};
  auto import = [&](const int64_t* strides, const int64_t* dims, int32_t ndim) {
    DLManagedTensor m{};
    m.dl_tensor = DLTensor{data.data(), DLDevice{kDLCPU, 0}, ndim, DLDataType{kDLFloat, 32, 1},
                           const_cast<int64_t*>(dims), const_cast<int64_t*>(strides), 0};
    int deleted = 0;
    m.manager_ctx = &deleted;
    m.deleter = [](DLManagedTensor* t) { ++*static_cast<int*>(t->manager_ctx); };
    dpar_tensor* t = nullptr;
    const dpar_status status = dpar_tensor_from_dlpack(&t, &m);
    const std::string message = dpar_last_error();
    if (status == DPAR_OK) {
      dpar_tensor_free(t);
      EXPECT_EQ(deleted, 1);
    } else {
      EXPECT_EQ(t, nullptr);
      EXPECT_EQ(deleted, 0) << "a refused tensor stays its producer's";
    }
    return std::make_pair(status, message);
  };
  const int64_t compact[3] = {12, 4, 1};
  EXPECT_EQ(import(compact, shape, 3).first, DPAR_OK);
  const int64_t padded_outer[3] = {20, 4, 1};  // rows of a larger (2, 5, 4) buffer: innermost and middle compact
  const int64_t padded_middle[3] = {12, 5, 1};
  const int64_t broadcast_outer[3] = {0, 4, 1};
  const int64_t swapped_outer[3] = {4, 8, 1};
  for (const int64_t* strides : {padded_outer, padded_middle, broadcast_outer, swapped_outer}) {
    const auto [status, message] = import(strides, shape, 3);
    EXPECT_EQ(status, DPAR_ERR_INVALID_ARGUMENT) << strides[0] << "," << strides[1] << "," << strides[2];
    EXPECT_NE(message.find("strides["), std::string::npos) << message;
  }
  int64_t ones[3] = {2, 1, 4};  // an extent of 1 may carry any stride
  const int64_t any_for_one[3] = {4, 999, 1};
  EXPECT_EQ(import(any_for_one, ones, 3).first, DPAR_OK);
}

// The shape is checked before any memory is read: every extent at least 1, the element count bounded (a product
// that would overflow is refused, not wrapped), and a shape given at all.
TEST(Dlpack, ShapesAreCheckedBeforeAnythingIsRead) {
  float one = 1.0f;
  auto import = [&](int64_t* dims, int32_t ndim) {
    DLManagedTensor m{};
    m.dl_tensor = DLTensor{&one, DLDevice{kDLCPU, 0}, ndim, DLDataType{kDLFloat, 32, 1}, dims, nullptr, 0};
    dpar_tensor* t = nullptr;
    const dpar_status status = dpar_tensor_from_dlpack(&t, &m);
    if (t != nullptr) dpar_tensor_free(t);
    return std::make_pair(status, std::string(dpar_last_error()));
  };
  int64_t fine[1] = {1};
  EXPECT_EQ(import(fine, 1).first, DPAR_OK);
  int64_t negative[2] = {3, -4}, zero[2] = {0, 4};
  int64_t overflowing[3] = {int64_t{1} << 31, int64_t{1} << 31, int64_t{1} << 31};  // 2^93 elements
  int64_t too_many[2] = {int64_t{1} << 30, int64_t{1} << 20};                       // 2^50: beyond dpar's 2^40
  for (int64_t* dims : {negative, zero, too_many}) {
    const auto [status, message] = import(dims, 2);
    EXPECT_EQ(status, DPAR_ERR_INVALID_ARGUMENT) << dims[0] << " x " << dims[1];
    EXPECT_NE(message.find("shape"), std::string::npos) << message;
  }
  EXPECT_EQ(import(overflowing, 3).first, DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(import(nullptr, 2).first, DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(import(fine, 0).first, DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(import(fine, -1).first, DPAR_ERR_INVALID_ARGUMENT);
}

TEST(Dlpack, CudaTensorsMapToCudaDevicesOrAreRefused) {
  size_t gpus = 0;
  const dpar_status cuda = dpar_device_count(&gpus, DPAR_DEVICE_CUDA);
  dpar_tensor* t = nullptr;
  if (cuda == DPAR_ERR_NOT_SUPPORTED) {
    // This build has no CUDA: refused, the producer's tensor untouched.
    Producer p(2, 2);
    p.managed.dl_tensor.device = DLDevice{kDLCUDA, 0};
    EXPECT_EQ(dpar_tensor_from_dlpack(&t, &p.managed), DPAR_ERR_NOT_SUPPORTED);
    EXPECT_NE(std::string(dpar_last_error()).find("CUDA"), std::string::npos) << dpar_last_error();
    EXPECT_EQ(t, nullptr);
    EXPECT_EQ(p.deleted, 0);
    return;
  }
  ASSERT_OK(cuda);
  {
    // A GPU this machine does not have (the one past the last): refused naming it, the producer's tensor untouched.
    // With no GPU at all that is a device error; past the last of several GPUs, an index out of range (as for
    // every device argument: dpar_tensor_create, the engine's device ids).
    Producer p(2, 2);
    p.managed.dl_tensor.device = DLDevice{kDLCUDA, static_cast<int32_t>(gpus)};
    EXPECT_EQ(dpar_tensor_from_dlpack(&t, &p.managed), gpus == 0 ? DPAR_ERR_DEVICE : DPAR_ERR_INVALID_ARGUMENT);
    const std::string named = "cuda:" + std::to_string(gpus);
    EXPECT_NE(std::string(dpar_last_error()).find(named), std::string::npos) << dpar_last_error();
    EXPECT_EQ(t, nullptr);
    EXPECT_EQ(p.deleted, 0);
  }
  if (gpus == 0) {
    if (dpar::test::gpu_required()) FAIL() << "DPAR_TEST_REQUIRE_GPU is set, but dpar finds no CUDA device";
    GTEST_SKIP() << "no CUDA device: the mapping of a kDLCUDA tensor onto cuda:K needs one";
  }
  // Host memory labelled as the last GPU is never dereferenced by from_dlpack: the mapping alone is checked.
  Producer p(2, 2);
  const int32_t last = static_cast<int32_t>(gpus) - 1;
  p.managed.dl_tensor.device = DLDevice{kDLCUDA, last};
  ASSERT_OK(dpar_tensor_from_dlpack(&t, &p.managed));
  dpar_device device{-1, -1};
  ASSERT_OK(dpar_tensor_info(nullptr, nullptr, &device, t));
  EXPECT_EQ(device.kind, DPAR_DEVICE_CUDA);
  EXPECT_EQ(device.index, last);
  dpar_tensor_free(t);
  EXPECT_EQ(p.deleted, 1);
}

TEST(Dlpack, ToDlpackOutlivesTheTensorAndRoundTrips) {
  const int64_t shape[3] = {2, 3, 2};
  dpar_tensor* t = nullptr;
  ASSERT_OK(dpar_tensor_create(&t, DPAR_F32, shape, 3, dpar_device{DPAR_DEVICE_CPU, 2}));
  std::vector<float> values(12);
  for (size_t i = 0; i < values.size(); ++i) values[i] = float(i) - 3.0f;
  ASSERT_OK(dpar_tensor_copy_from_host(t, values.data(), values.size() * sizeof(float)));
  void* data = nullptr;
  ASSERT_OK(dpar_tensor_data(&data, t));
  DLManagedTensor* m = nullptr;
  ASSERT_OK(dpar_tensor_to_dlpack(&m, t));
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->dl_tensor.data, data);
  EXPECT_EQ(m->dl_tensor.device.device_type, kDLCPU);
  EXPECT_EQ(m->dl_tensor.ndim, 3);
  EXPECT_EQ(std::vector<int64_t>(m->dl_tensor.shape, m->dl_tensor.shape + 3), std::vector<int64_t>(shape, shape + 3));
  EXPECT_EQ(m->dl_tensor.dtype.code, kDLFloat);
  EXPECT_EQ(m->dl_tensor.dtype.bits, 32);
  dpar_tensor_free(t);  // the DLPack tensor keeps the storage
  const float* f = static_cast<const float*>(m->dl_tensor.data);
  EXPECT_EQ(std::vector<float>(f, f + 12), values);
  // And back: a consumer may hand it to dpar again, which then owns it.
  dpar_tensor* back = nullptr;
  ASSERT_OK(dpar_tensor_from_dlpack(&back, m));
  std::vector<float> read(12);
  ASSERT_OK(dpar_tensor_copy_to_host(read.data(), back, read.size() * sizeof(float)));
  EXPECT_EQ(read, values);
  dpar_tensor_free(back);  // calls m's deleter, which frees the storage
}

// A producer whose deleter frees the memory, as NumPy's and PyTorch's do: reading it after the deleter ran is a
// use after free (which AddressSanitizer reports), and `deleted` says when that happened.
struct FreeingProducer {
  float* data;
  int64_t shape[1] = {5};
  DLManagedTensor managed{};
  int deleted = 0;
  FreeingProducer() : data(new float[5]{1, 2, 3, 4, 5}) {
    managed.dl_tensor = DLTensor{data, DLDevice{kDLCPU, 0}, 1, DLDataType{kDLFloat, 32, 1}, shape, nullptr, 0};
    managed.manager_ctx = this;
    managed.deleter = [](DLManagedTensor* m) {
      auto* self = static_cast<FreeingProducer*>(m->manager_ctx);
      delete[] self->data;
      self->data = nullptr;
      self->deleted++;
    };
  }
  ~FreeingProducer() { delete[] data; }
};

TEST(Dlpack, ExportOfAnImportedTensorKeepsTheProducersMemoryAlive) {
  FreeingProducer p;
  dpar_tensor* t = nullptr;
  ASSERT_OK(dpar_tensor_from_dlpack(&t, &p.managed));
  DLManagedTensor* m = nullptr;
  ASSERT_OK(dpar_tensor_to_dlpack(&m, t));
  dpar_tensor_free(t);
  // The export still points into the producer's memory: its deleter must wait for the export's.
  EXPECT_EQ(p.deleted, 0) << "the producer's memory was released while an export still points into it";
  if (p.deleted == 0) {
    const float* f = static_cast<const float*>(m->dl_tensor.data);
    EXPECT_EQ(std::vector<float>(f, f + 5), (std::vector<float>{1, 2, 3, 4, 5}));
  }
  m->deleter(m);
  EXPECT_EQ(p.deleted, 1);
}

TEST(Dlpack, ExportOfACallersBufferIsRefused) {
  // dpar cannot keep a caller's buffer alive, so an export could outlive it: refused, with the reason.
  std::vector<float> buffer(6, 1.0f);
  const int64_t shape[2] = {2, 3};
  dpar_tensor* t = nullptr;
  ASSERT_OK(dpar_tensor_wrap_host(&t, DPAR_F32, shape, 2, buffer.data()));
  DLManagedTensor* m = reinterpret_cast<DLManagedTensor*>(&m);
  EXPECT_EQ(dpar_tensor_to_dlpack(&m, t), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(m, nullptr);
  EXPECT_NE(std::string(dpar_last_error()).find("dpar_tensor_wrap_host"), std::string::npos) << dpar_last_error();
  dpar_tensor_free(t);
}

TEST(Dlpack, ByteOffsetThatWrapsOverflowsOrMisalignsIsRefused) {
  alignas(16) int32_t labels[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  int64_t shape[1] = {2};
  DLManagedTensor m{};
  m.dl_tensor = DLTensor{labels + 4, DLDevice{kDLCPU, 0}, 1, DLDataType{kDLInt, 32, 1}, shape, nullptr, 0};
  dpar_tensor* t = nullptr;
  // 2^64 - 8 wraps to 8 bytes before data, 2^63 overflows the pointer, 2 gives int32 reads at an odd address.
  for (uint64_t offset : {~uint64_t{0} - 7, uint64_t{1} << 63, uint64_t{2}, ~uint64_t{0}}) {
    m.dl_tensor.byte_offset = offset;
    EXPECT_EQ(dpar_tensor_from_dlpack(&t, &m), DPAR_ERR_INVALID_ARGUMENT) << "byte_offset " << offset;
    EXPECT_EQ(t, nullptr);
    EXPECT_NE(std::string(dpar_last_error()).find("byte_offset"), std::string::npos) << dpar_last_error();
    if (t) dpar_tensor_free(t);
    t = nullptr;
  }
  // A data pointer near the end of the address space whose tensor would run past it.
  m.dl_tensor.data = reinterpret_cast<void*>(~uintptr_t{0} - 3);  // never read: refused first
  m.dl_tensor.byte_offset = 0;
  EXPECT_EQ(dpar_tensor_from_dlpack(&t, &m), DPAR_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(t, nullptr);
  // An aligned offset is still honoured.
  m.dl_tensor.data = labels + 4;
  m.dl_tensor.byte_offset = 2 * sizeof(int32_t);
  ASSERT_OK(dpar_tensor_from_dlpack(&t, &m));
  int32_t out[2] = {};
  ASSERT_OK(dpar_tensor_copy_to_host(out, t, sizeof out));
  EXPECT_EQ(out[0], 7);
  EXPECT_EQ(out[1], 8);
  dpar_tensor_free(t);
}

TEST(Dlpack, UnknownDeviceTypeIsRefusedBeforeItIsAnEnum) {
  // A newer DLPack's device type (and any integer a careless producer sends): refused, without being loaded as
  // a DLDeviceType (UndefinedBehaviorSanitizer's enum check aborts on that).
  Producer p(2, 2);
  for (int32_t type : {0, 5, 99, 1000, -1, INT32_MAX}) {
    std::memcpy(&p.managed.dl_tensor.device.device_type, &type, sizeof type);
    dpar_tensor* t = nullptr;
    EXPECT_EQ(dpar_tensor_from_dlpack(&t, &p.managed), DPAR_ERR_NOT_SUPPORTED) << type;
    EXPECT_EQ(t, nullptr);
    EXPECT_NE(std::string(dpar_last_error()).find(std::to_string(type)), std::string::npos) << dpar_last_error();
  }
  EXPECT_EQ(p.deleted, 0);
}

}  // namespace
