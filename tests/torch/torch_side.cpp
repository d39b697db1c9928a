// PyTorch's side of dlopen_beside_torch.c: a few C functions over PyTorch's C++ API, so that a C host can make and
// check PyTorch tensors. check_torch_guest.sh builds it against the headers and libraries of the PyTorch that
// $DPAR_TEST_TORCH_PYTHON imports, with PyTorch's libraries as its load-time dependencies: loading it loads them
// (libtorch_cuda, and through it PyTorch's CUDA runtime, cuBLAS, cuDNN and NCCL), as a framework that hosts dpar
// has them.
#include <ATen/ATen.h>
#include <ATen/DLConvertor.h>

#include <cstdio>
#include <exception>

#define TORCH_SIDE_API extern "C" __attribute__((visibility("default")))

// Whether PyTorch sees a GPU.
TORCH_SIDE_API int torch_side_cuda_available() {
  try {
    return at::hasCUDA() ? 1 : 0;
  } catch (const std::exception&) {
    return 0;
  }
}

// arange(n) * 0.5 as float32, on the host or (cuda != 0) on GPU 0, handed over as a DLPack tensor that the caller
// owns. Its values are written when this returns (item() waits for PyTorch's stream). NULL, with a message on
// stderr, on failure.
TORCH_SIDE_API DLManagedTensor* torch_side_arange(long n, int cuda) {
  try {
    const at::TensorOptions options = at::TensorOptions().dtype(at::kFloat).device(cuda ? at::kCUDA : at::kCPU);
    at::Tensor t = at::arange(n, options) * 0.5;
    (void)t.sum().item<float>();
    return at::toDLPack(t);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torch_side_arange: %s\n", e.what());
    return nullptr;
  }
}

// Takes `managed` (PyTorch owns it from here, as torch.from_dlpack does) and checks it: float32, n elements on the
// host or GPU 0 as `cuda` says, at address `data` (when not NULL: no copy was made), equal to arange(n) * scale.
// 0 if so, else 1 with the reason on stderr.
TORCH_SIDE_API int torch_side_check(DLManagedTensor* managed, long n, double scale, const void* data, int cuda) {
  try {
    const at::Tensor t = at::fromDLPack(managed);
    const char* wrong = nullptr;
    if (t.scalar_type() != at::kFloat) wrong = "not float32";
    else if (t.numel() != n) wrong = "another element count";
    else if (t.is_cuda() != (cuda != 0)) wrong = "on another device";
    else if (data != nullptr && t.data_ptr() != data) wrong = "at another address (a copy)";
    else if (!at::equal(t.cpu(), at::arange(n, at::kFloat) * scale)) wrong = "other values";
    if (wrong == nullptr) return 0;
    std::fprintf(stderr, "torch_side_check: the tensor PyTorch got is %s\n", wrong);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torch_side_check: %s\n", e.what());
  }
  return 1;
}
