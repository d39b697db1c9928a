/**
 * @file dpar/common.h
 * @brief The ground every topic stands on: versions, statuses and error messages, devices, element types.
 * Part of dpar.h, which includes every topic's header and is the one to include; this one also compiles alone.
 */
#ifndef DPAR_COMMON_H
#define DPAR_COMMON_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define DPAR_API __declspec(dllexport)
#elif defined(__GNUC__)
#define DPAR_API __attribute__((visibility("default")))
#else
#define DPAR_API
#endif

/* ------------------------------------------------------------------------------------------------------------ */
/** @name Versions */
/**@{*/
#define DPAR_VERSION_MAJOR 0 /**< Major version: changes when the ABI breaks (it is the SONAME). */
#define DPAR_VERSION_MINOR 6 /**< Minor version: grows when functions or option fields are appended. */
#define DPAR_VERSION_PATCH 0 /**< Patch version: fixes only. */
/** The version as one integer, MAJOR*10000 + MINOR*100 + PATCH. */
#define DPAR_VERSION (DPAR_VERSION_MAJOR * 10000 + DPAR_VERSION_MINOR * 100 + DPAR_VERSION_PATCH)

/** @brief The version of the library loaded at run time, as #DPAR_VERSION computes it. Never fails. */
DPAR_API int32_t dpar_version(void);
/** @brief The version string of the loaded library, such as "0.1.0". Static storage; never NULL. */
DPAR_API const char *dpar_version_string(void);
/**
 * @brief What runs dpar's CPU matrix multiplies: the GEMM library, its version and the kernels it chose for this
 * CPU, such as "oneDNN 2.6.3 (OpenMP), avx512_core f32 kernels (CPU ISA avx512_core_amx)".
 *
 * For a bug report and a benchmark's first line. The library picks its kernels from the CPU's feature bits when
 * first asked; where they fall below what the CPU supports (AVX2, AVX-512), dpar also says so once on stderr, with
 * the remedy, when an engine starts CPU devices. Static storage, the same pointer on every call; never NULL.
 * Thread-safe. Never fails.
 */
DPAR_API const char *dpar_cpu_gemm_backend(void);
/**@}*/

/* ------------------------------------------------------------------------------------------------------------ */
/** @name Status and errors */
/**@{*/
/**
 * @brief The result of every fallible call: one of the ::dpar_status_code values, carried as a fixed-width integer
 * so that a binding meets no undefined behaviour when a newer library returns a code it does not know.
 */
typedef int32_t dpar_status;
/** @brief The values of ::dpar_status. A shipped code never changes its meaning. */
enum dpar_status_code {
  DPAR_OK = 0,                     /**< Success. */
  DPAR_ERR_INVALID_ARGUMENT = -1,  /**< An argument or handle is NULL, freed, out of range or inconsistent. */
  DPAR_ERR_OUT_OF_MEMORY = -2,     /**< An allocation failed (host or device). */
  DPAR_ERR_DEVICE = -3,            /**< A device failed, or a device kind is not built into this library. */
  DPAR_ERR_COMMUNICATION = -4,     /**< A collective failed locally. */
  DPAR_ERR_REMOTE = -5,            /**< Another participant (worker, rank) failed; this one stopped waiting. */
  DPAR_ERR_TIMEOUT = -6,           /**< A participant did not arrive within the timeout. */
  DPAR_ERR_MISMATCH = -7,          /**< Participants disagree (shapes, operation, sizes, a checkpoint's model). */
  DPAR_ERR_IO = -8,                /**< A file could not be opened, read or written. */
  DPAR_ERR_CORRUPT = -9,           /**< A file's content is malformed, truncated or fails its checksum. */
  DPAR_ERR_NOT_SUPPORTED = -10,    /**< The feature exists in the API but is not built or not available here. */
  DPAR_ERR_INVALID_STATE = -11,    /**< The call is not allowed now (e.g. the engine must be recreated). */
  DPAR_ERR_INTERNAL = -12          /**< A bug in dpar: please report the message. */
};

/**
 * @brief The message of the last failed call made on the calling thread.
 * @return A thread-local, NUL-terminated string; "" if no call failed since the last dpar_clear_error().
 *         Never NULL. Valid until the next dpar call on this thread. Reporting needs no allocation, so an
 *         out-of-memory failure is described too. Errors raised on a worker thread are copied here before the
 *         failing call returns.
 */
DPAR_API const char *dpar_last_error(void);
/** @brief Clears the calling thread's last error message. Bindings call it right after reading the message. */
DPAR_API void dpar_clear_error(void);
/** @brief The static name of a status, such as "DPAR_ERR_TIMEOUT"; "DPAR_ERR_UNKNOWN" for an unknown code. */
DPAR_API const char *dpar_status_str(dpar_status status);
/**
 * @brief Sets the calling thread's last error to @p message and returns @p status, so that a callback (a custom
 * layer, the forward hook) fails with its own message: `return dpar_set_error(DPAR_ERR_INVALID_ARGUMENT, "...");`.
 * dpar clears the message before it calls a callback and, when the callback returns an error, puts the message in
 * the error of the call that failed. Not variadic, so that every language can call it; format the text first.
 * @param status   The status to return (any value; callbacks return a negative one).
 * @param message  Copied (truncated to 2047 bytes); NULL sets "".
 * @return @p status.
 */
DPAR_API dpar_status dpar_set_error(dpar_status status, const char *message);
/**
 * @brief Releases a payload that was handed to dpar with it (a custom layer's, the forward hook's). dpar calls it
 * exactly once, on whichever thread drops the last reference, when no callback can run any more.
 */
typedef void (*dpar_destroy_fn)(void *payload);
/**@}*/

/* ------------------------------------------------------------------------------------------------------------ */
/** @name Devices */
/**@{*/
/** @brief Kinds of devices. */
typedef enum dpar_device_kind {
  DPAR_DEVICE_CPU = 0,  /**< A virtual CPU device: one worker thread with single-threaded BLAS. */
  DPAR_DEVICE_CUDA = 1  /**< A CUDA GPU. Returns ::DPAR_ERR_NOT_SUPPORTED in a build without CUDA. */
} dpar_device_kind;

/** @brief A device: a kind and an index, such as cpu:3. A plain value; no handle. */
typedef struct dpar_device {
  int32_t kind;  /**< A ::dpar_device_kind. */
  int32_t index; /**< The device's index within its kind, from 0. */
} dpar_device;

/**
 * @brief The number of devices of a kind that an engine can use by default.
 * For ::DPAR_DEVICE_CPU it is the environment variable DPAR_CPU_DEVICES if set to a positive integer, else the
 * number of cores this process may run on (its CPU affinity: one core per rank under `mpirun --bind-to core`). Engines may be asked for more CPU devices than cores (dpar_engine_options.num_cpu_devices).
 * @param[out] out  The count.
 * @param kind      A ::dpar_device_kind.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for a NULL @p out or unknown kind;
 *         ::DPAR_ERR_NOT_SUPPORTED for a kind not built into this library.
 */
DPAR_API dpar_status dpar_device_count(size_t *out, int32_t kind);

/**
 * @brief Parses "cpu:3", "cpu" (index 0) or "cuda:1" into a device.
 * @return ::DPAR_OK or ::DPAR_ERR_INVALID_ARGUMENT naming the malformed text.
 */
DPAR_API dpar_status dpar_device_parse(dpar_device *out, const char *text);
/**@}*/

/* ------------------------------------------------------------------------------------------------------------ */
/** @name Element types */
/**@{*/
/** @brief Element types. Tensors hold f32 (data) and i32 (labels); collectives move f32, f64, i32 and i64. */
typedef enum dpar_dtype {
  DPAR_F32 = 0,  /**< 32-bit IEEE float. */
  DPAR_I32 = 1,  /**< 32-bit signed integer (class labels). */
  DPAR_BF16 = 2, /**< Reserved: ::DPAR_ERR_NOT_SUPPORTED today. */
  DPAR_F16 = 3,  /**< Reserved: ::DPAR_ERR_NOT_SUPPORTED today. */
  DPAR_U8 = 4,   /**< Reserved: ::DPAR_ERR_NOT_SUPPORTED today. */
  DPAR_F64 = 5,  /**< 64-bit IEEE float: collectives only. */
  DPAR_I64 = 6   /**< 64-bit signed integer: collectives only. */
} dpar_dtype;
/**@}*/

/**
 * @brief How gradient buckets cross the processes: an engine's (dpar_engine_set_gradient_compression()) and a
 * reducer's (dpar_reducer_options.compression).
 */
typedef enum dpar_gradient_compression {
  DPAR_COMPRESSION_NONE = 0, /**< f32, as summed. */
  /**
   * Each process's sum, rounded to bfloat16 (to nearest, ties to even), is summed across the processes in bfloat16
   * and widened back to f32: half the bytes between processes, f32's range, about 3 significant digits (as
   * PyTorch DDP's bf16_compress_hook and Horovod's compression).
   */
  DPAR_COMPRESSION_BF16 = 1
} dpar_gradient_compression;

#ifdef __cplusplus
}
#endif

#endif /* DPAR_COMMON_H */
