/**
 * @file dpar/tensor.h
 * @brief Tensors: contiguous arrays on one device.
 * Part of dpar.h, which includes every topic's header and is the one to include; this one also compiles alone.
 */
#ifndef DPAR_TENSOR_H
#define DPAR_TENSOR_H

#include "common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------------------------------ */
/** @name Tensors
 * Contiguous, row-major arrays of up to #DPAR_MAX_DIMS dimensions on one device.
 * A tensor handle is not thread-safe: do not use one from two threads at once. */
/**@{*/
#define DPAR_MAX_DIMS 4 /**< The most dimensions a tensor has. */

typedef struct dpar_tensor dpar_tensor; /**< An opaque tensor. */

/**
 * @brief Creates a zero-filled tensor on a device.
 * @param[out] out  The new tensor, owned by the caller (dpar_tensor_free()).
 * @param dtype     A ::dpar_dtype (f32 or i32).
 * @param shape     @p ndim extents, each at least 1.
 * @param ndim      1 to #DPAR_MAX_DIMS.
 * @param device    Where the storage lives.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT; ::DPAR_ERR_NOT_SUPPORTED for a reserved dtype or a device
 *         kind not built in; ::DPAR_ERR_OUT_OF_MEMORY.
 */
DPAR_API dpar_status dpar_tensor_create(dpar_tensor **out, int32_t dtype, const int64_t *shape, size_t ndim,
                                        dpar_device device);
/**
 * @brief Wraps caller-owned host memory as a cpu:0 tensor, without a copy.
 * The memory must stay valid, and hold shape's product of elements, until the tensor is freed.
 * @return as dpar_tensor_create().
 */
DPAR_API dpar_status dpar_tensor_wrap_host(dpar_tensor **out, int32_t dtype, const int64_t *shape, size_t ndim,
                                           void *data);
/** @brief Frees a tensor (NULL is a no-op). A wrapped buffer is not freed. */
DPAR_API void dpar_tensor_free(dpar_tensor *tensor);
/**
 * @brief Copies @p bytes from host memory into the tensor. @p bytes must equal the tensor's size in bytes.
 * @return ::DPAR_OK or ::DPAR_ERR_INVALID_ARGUMENT.
 */
DPAR_API dpar_status dpar_tensor_copy_from_host(dpar_tensor *tensor, const void *src, size_t bytes);
/** @brief Copies the tensor into host memory; @p bytes must equal the tensor's size in bytes. */
DPAR_API dpar_status dpar_tensor_copy_to_host(void *dst, const dpar_tensor *tensor, size_t bytes);
/**
 * @brief The tensor's shape.
 * @param[out] out_shape  Receives ndim extents; may be NULL to ask only for @p out_ndim.
 * @param[out] out_ndim   Receives the number of dimensions.
 * @param capacity        The room in @p out_shape; #DPAR_MAX_DIMS always suffices.
 */
DPAR_API dpar_status dpar_tensor_shape(int64_t *out_shape, size_t *out_ndim, const dpar_tensor *tensor,
                                       size_t capacity);
/** @brief The tensor's ::dpar_dtype, element count and device. Any output may be NULL. */
DPAR_API dpar_status dpar_tensor_info(int32_t *out_dtype, size_t *out_numel, dpar_device *out_device,
                                      const dpar_tensor *tensor);
/**
 * @brief The address of a host tensor's first element, for reading and writing in place.
 * @return ::DPAR_ERR_INVALID_ARGUMENT if the tensor is not in host memory (a CUDA tensor).
 */
DPAR_API dpar_status dpar_tensor_data(void **out, dpar_tensor *tensor);
/**@}*/

#ifdef __cplusplus
}
#endif

#endif /* DPAR_TENSOR_H */
