// A replica's CUDA stream: the Stream of backend/stream.h on a cudaStream_t of its own (or a caller's), with the
// stream's cuBLAS handle, made by its first GEMM. Its kernels are kernels/cuda.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>

#include "backend/stream.h"

namespace dpar {

// A stream of its own on `device` (a replica's).
std::unique_ptr<Stream> make_cuda_stream(Device device);
// The caller's stream (nullptr: the legacy default stream), used and never destroyed.
std::unique_ptr<Stream> wrap_cuda_stream(Device device, cudaStream_t borrowed);
// The cudaStream_t under a stream made by one of the two above.
cudaStream_t cuda_stream_handle(Stream& stream);

}  // namespace dpar
