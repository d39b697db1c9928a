/**
 * @file dpar/dlpack.h
 * @brief Tensors exchanged with other frameworks without a copy, through DLPack.
 * Part of dpar.h, which includes every topic's header and is the one to include; this one also compiles alone.
 */
#ifndef DPAR_DLPACK_H
#define DPAR_DLPACK_H

#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------------------------------ */
/** @name DLPack
 * Tensors taken from and handed to NumPy, PyTorch, CuPy, JAX or Julia without a copy. */
/**@{*/
struct DLManagedTensor; /* DLPack's (dlpack/dlpack.h, version 0.x ABI); dpar does not need its header. */
/**
 * @brief Takes a DLPack tensor from another framework without a copy (NumPy, PyTorch, CuPy, JAX, Julia).
 * On success the new tensor owns @p managed: dpar calls `managed->deleter(managed)` (if not NULL) once, when the
 * tensor is freed. As with dpar_tensor_wrap_host(), an engine's training-mode forward keeps a view of its input
 * until backward: free the tensor after that. On failure the caller keeps @p managed.
 * Accepted: a compact row-major float32 (kDLFloat, 32 bits) or int32 (kDLInt, 32 bits) tensor of 1 to
 * #DPAR_MAX_DIMS dimensions, with lanes 1, on kDLCPU (cpu:0) or kDLCUDA (device K becomes cuda:K). Strides may be
 * NULL or the compact ones; byte_offset is honoured, and refused when data + byte_offset (or the tensor's end)
 * would pass the end of the address space, the span exceeds PTRDIFF_MAX bytes, or the first element is not
 * aligned to its 4 bytes. An unknown device type (one from a newer DLPack) is refused with
 * ::DPAR_ERR_NOT_SUPPORTED.
 *
 * Ordering with the producer (kDLCUDA): dpar runs its work on streams of its own, which do not wait for any
 * other stream. The caller must make the producer's writes to the tensor complete or ordered on the device's
 * legacy default stream (stream handle 1 in the DLPack stream protocol; `cudaStreamLegacy`) before this call:
 * dpar waits for that stream here, on the calling thread, so every later use of the memory by dpar follows the
 * producer. The Python binding asks `__dlpack__(stream=1)` of a CUDA producer, which does exactly that (PyTorch
 * and CuPy make the legacy stream wait for their current stream). Writes the producer queues after this call
 * are not ordered with dpar's reads: the producer must not write the tensor while dpar may use it.
 * kDLCPU tensors must be written when this call is made.
 * @param[out] out  The tensor, owned by the caller (dpar_tensor_free()).
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for a NULL argument, a dtype, layout or shape dpar does not take,
 *         or a kDLCUDA device id past the last GPU; ::DPAR_ERR_DEVICE for kDLCUDA where there is no GPU;
 *         ::DPAR_ERR_NOT_SUPPORTED for a device kind dpar does not have (kDLCUDA in a build without CUDA).
 */
DPAR_API dpar_status dpar_tensor_from_dlpack(dpar_tensor **out, struct DLManagedTensor *managed);
/**
 * @brief Hands a tensor to another framework without a copy, as a DLPack tensor on the tensor's device.
 * @param[out] out  Owned by the caller, released with `(*out)->deleter(*out)` (a consumer such as
 *                  torch.from_dlpack does it). It keeps the memory alive: @p tensor may be freed first (and an
 *                  engine whose custom layer's parameter it is, too); for a tensor taken from DLPack, the
 *                  producer's deleter runs only once both the tensor and every export of it are released. Writes
 *                  through either are seen by both. dpar's work on the tensor has finished when the dpar call
 *                  that queued it returns, so a consumer needs no stream to wait for (the Python binding's
 *                  `__dlpack__` accepts any `stream` and has nothing to order).
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for memory that belongs to the caller, which dpar cannot keep
 *         alive: a tensor from dpar_tensor_wrap_host(), or a view of one (a custom layer's input when the engine
 *         was given such a tensor). Export a copy instead (dpar_tensor_create(), dpar_tensor_copy_from_host()).
 */
DPAR_API dpar_status dpar_tensor_to_dlpack(struct DLManagedTensor **out, dpar_tensor *tensor);
/**@}*/

#ifdef __cplusplus
}
#endif

#endif /* DPAR_DLPACK_H */
