/**
 * @file dpar.h
 * @brief dpar: data-parallel training of neural networks behind a stable C ABI.
 *
 * Conventions (they hold for every declaration below):
 *  - Every fallible call returns a ::dpar_status, a fixed-width integer (int32_t) whose values are the
 *    ::dpar_status_code constants; ::DPAR_OK is 0 and every error is negative. A library newer than the caller may
 *    return a code the caller does not know: treat any negative value as an error. The message of the last failed
 *    call on the calling thread is returned by dpar_last_error(); a callback sets it with dpar_set_error().
 *  - Ownership: a handle returned through a `**out` parameter is always owned by the caller and released with its
 *    `_free` function; every `_free` function accepts NULL. A pointer returned as a function's value is borrowed
 *    from its parent, valid as long as the parent lives (and, where said, until the parent's next call); no borrowed
 *    pointer is ever returned through an output parameter.
 *  - Integers: booleans are `int32_t` (0 false, nonzero true; dpar writes 0 or 1); counts, indices, sizes, ranks
 *    and replicas are `size_t`; tensor extents (shapes) and layer widths are `int64_t`, as in DLPack; enumerated
 *    values (dtypes, kinds, ops) and device indices are `int32_t`; versions are `uint32_t`.
 *  - Every `void *payload` given to dpar comes with an optional destructor (::dpar_destroy_fn) that dpar calls exactly
 *    once, when it no longer needs the payload (sqlite3's xDestroy).
 *  - Output parameters come first, then the handle, then the other arguments.
 *  - Option structs are versioned: initialise them with their `_INIT` macro or `_init()`, then set fields. `_init()`
 *    is a macro that passes the struct's size as the caller compiled it (`_init_sized()`): a newer library fills
 *    the caller's layout, and reads it back by its `size` and `version`. A binding that cannot use C macros calls
 *    `_init_sized()` with its own size of the struct. A program built against this header needs a libdpar of at
 *    least its MAJOR.MINOR version (#DPAR_VERSION_MINOR grows with every function added).
 *  - A NULL handle, a freed one or one of another type is refused with ::DPAR_ERR_INVALID_ARGUMENT: dpar looks every
 *    handle up among the live ones before using it. (A freed handle whose address a new handle of the same type
 *    has reused cannot be told apart from it.)
 *  - Thread-safety: every function may be called from any thread. A single handle must not be used by two
 *    threads at once unless its documentation says so; the engine serialises calls on itself with a lock.
 *    Freeing is the exception: when two threads free the same handle at once, exactly one frees it and the other
 *    call does nothing.
 *  - Files (checkpoints, data sets) are untrusted input: a damaged or hostile file is refused with a status and a
 *    message, never a crash, a hang (a FIFO or device is refused without blocking on it) or an allocation beyond
 *    what the file can honestly hold.
 *  - No C++ exception ever crosses this interface.
 */
#ifndef DPAR_H
#define DPAR_H

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
/** @name Tensors
 * Contiguous, row-major arrays of up to #DPAR_MAX_DIMS dimensions on one device.
 * A tensor handle is not thread-safe: do not use one from two threads at once. */
/**@{*/
#define DPAR_MAX_DIMS 4 /**< The most dimensions a tensor has. */

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

struct DLManagedTensor; /* DLPack's (dlpack/dlpack.h, version 0.x ABI); dpar.h does not need its header. */
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
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for a NULL argument, a dtype, layout or shape dpar does not take;
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

/* ------------------------------------------------------------------------------------------------------------ */
/** @name Models
 * A model is a sequence of layers on the host: the template that an engine copies once to every device.
 * A model handle is not thread-safe. Freeing a model does not affect engines created from it. */
/**@{*/
typedef struct dpar_model dpar_model; /**< An opaque sequential model. */

/** @brief Options for dpar_model_create(). */
typedef struct dpar_model_options {
  size_t size;      /**< sizeof(dpar_model_options) as the caller compiled it. */
  uint32_t version; /**< #DPAR_MODEL_OPTIONS_VERSION. */
  uint64_t seed;    /**< Seed of parameter initialisation. Default 0. */
} dpar_model_options;
#define DPAR_MODEL_OPTIONS_VERSION 1
#define DPAR_MODEL_OPTIONS_INIT {sizeof(dpar_model_options), DPAR_MODEL_OPTIONS_VERSION, 0}
/**
 * @brief Fills @p opts with defaults: the layout of @p size bytes, sizeof(dpar_model_options) as the caller compiled
 * it, and no byte past it. ::DPAR_ERR_NOT_SUPPORTED for a layout newer than the library's. Call it as
 * dpar_model_options_init().
 */
DPAR_API dpar_status dpar_model_options_init_sized(dpar_model_options *opts, size_t size);
/**
 * @brief Fills @p opts with defaults: a macro that passes the caller's sizeof to dpar_model_options_init_sized(), so
 * that a newer libdpar writes the caller's layout. The function of this name, which programs built against dpar.h 0.4
 * and older call, writes dpar.h 0.4's layout; a table of functions (dpar_api.h) or a binding without C macros calls
 * the _sized one.
 */
DPAR_API dpar_status dpar_model_options_init(dpar_model_options *opts);
#define dpar_model_options_init(opts) dpar_model_options_init_sized((opts), sizeof(dpar_model_options))

/**
 * @brief Creates an empty sequential model.
 * @param[out] out  The model, owned by the caller (dpar_model_free()).
 * @param opts      Options, or NULL for defaults.
 */
DPAR_API dpar_status dpar_model_create(dpar_model **out, const dpar_model_options *opts);
/** @brief Frees a model (NULL is a no-op). */
DPAR_API void dpar_model_free(dpar_model *model);

/**
 * @brief Appends a fully connected layer y = x W^T + b, with W (out_features, in_features) and b (out_features),
 * initialised as PyTorch's nn.Linear does (uniform in +-1/sqrt(in_features)) from the model's seed.
 * @param has_bias  Nonzero for a bias.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for a zero size.
 */
DPAR_API dpar_status dpar_model_add_linear(dpar_model *model, int64_t in_features, int64_t out_features,
                                           int32_t has_bias);

/** @brief Elementwise activations. */
typedef enum dpar_activation {
  DPAR_RELU = 0,    /**< max(x, 0). */
  DPAR_GELU = 1,    /**< x * Phi(x), exact (erf) form, as PyTorch's default. */
  DPAR_TANH = 2,    /**< tanh(x). */
  DPAR_SIGMOID = 3  /**< 1 / (1 + exp(-x)). */
} dpar_activation;
/** @brief Appends an activation (a ::dpar_activation). */
DPAR_API dpar_status dpar_model_add_activation(dpar_model *model, int32_t activation);
/**
 * @brief Appends dropout with drop probability @p p in [0, 1). In training mode each replica draws its mask from
 * its own RNG stream (seeded from the engine seed and the replica index), which persists across steps (and is
 * saved in checkpoints, restored into an engine with as many replicas); in eval mode it is
 * the identity. Kept values are scaled by 1/(1-p), as in PyTorch.
 */
DPAR_API dpar_status dpar_model_add_dropout(dpar_model *model, float p);

/** @brief How dpar initialises a custom layer's parameter. */
typedef enum dpar_init {
  DPAR_INIT_ZEROS = 0,   /**< All zeros. */
  DPAR_INIT_UNIFORM = 1  /**< Uniform in [-bound, bound], from the model's seed. */
} dpar_init;

/** @brief Describes one parameter of a custom layer. */
typedef struct dpar_param_spec {
  const char *name;              /**< Its name within the layer, such as "weight". Copied. */
  size_t ndim;                   /**< 1 to #DPAR_MAX_DIMS. */
  int64_t shape[DPAR_MAX_DIMS];  /**< Its extents. */
  int32_t init;                  /**< A ::dpar_init. */
  float bound;                   /**< For ::DPAR_INIT_UNIFORM. */
} dpar_param_spec;

/** @brief What a custom layer's callback receives. All tensors are borrowed for the duration of the call. */
typedef struct dpar_custom_call {
  size_t replica;                     /**< The replica (0 .. number of devices - 1) that calls. */
  dpar_device device;                 /**< Its device. */
  int32_t training;                   /**< 1 in training mode, 0 in eval mode. */
  const dpar_tensor *input;           /**< The layer's input, (batch, ...). */
  const dpar_tensor *output;          /**< forward: to be written; backward: the output forward wrote. */
  const dpar_tensor *grad_output;     /**< backward only: dL/d output. NULL in forward. */
  dpar_tensor *grad_input;            /**< backward only: to be written with dL/d input; NULL when not needed. */
  dpar_tensor *const *params;         /**< The layer's parameters, in spec order (read only). */
  dpar_tensor *const *grads;          /**< backward only: to be written (not added to) with dL/d param. */
  size_t num_params;                  /**< Entries in params and grads. */
} dpar_custom_call;

/**
 * @brief A custom layer's forward or backward. It runs on the replica's worker thread; replicas call it
 * concurrently, each with its own tensors. Write outputs in place through dpar_tensor_data(). On a GPU replica the
 * tensors are that GPU's memory: dpar's work on them has finished when the callback starts, and the callback's own
 * device work must have finished when it returns; reach them through dpar_tensor_to_dlpack() (a kDLCUDA tensor),
 * or dpar_tensor_copy_to_host() and dpar_tensor_copy_from_host(). Return ::DPAR_OK,
 * or an error status (best through dpar_set_error(), with a message), which fails the engine call with a message
 * naming the layer and carrying the callback's own message.
 */
typedef dpar_status (*dpar_custom_fn)(void *payload, const dpar_custom_call *call);
/**
 * @brief Gives the output shape for an input shape (the batch extent first; the output keeps it). @p out_shape
 * has room for #DPAR_MAX_DIMS extents. Returns ::DPAR_OK, or an error status (through dpar_set_error(), with a
 * message) to reject the input shape; the engine call then fails with that status and message.
 */
typedef dpar_status (*dpar_custom_shape_fn)(void *payload, int64_t *out_shape, size_t *out_ndim, const int64_t *in_shape,
                                    size_t in_ndim);

/** @brief Describes a layer whose math is the caller's. */
typedef struct dpar_custom_layer {
  size_t size;                   /**< sizeof(dpar_custom_layer) as the caller compiled it. */
  uint32_t version;              /**< #DPAR_CUSTOM_LAYER_VERSION. */
  const char *name;              /**< For messages and checkpoint names. Copied. */
  const dpar_param_spec *params; /**< Its parameters (copied); may be NULL when num_params is 0. */
  size_t num_params;             /**< Entries in @p params. */
  dpar_custom_shape_fn output_shape; /**< Required. */
  dpar_custom_fn forward;            /**< Required. */
  dpar_custom_fn backward;           /**< Required. */
  void *payload;                     /**< Passed to every callback. */
  dpar_destroy_fn destroy;           /**< Releases @p payload; may be NULL. dpar calls it once, when the last model
                                          and engine holding the layer are freed, or before dpar_model_add_custom()
                                          returns an error. */
} dpar_custom_layer;
#define DPAR_CUSTOM_LAYER_VERSION 1
#define DPAR_CUSTOM_LAYER_INIT \
  {sizeof(dpar_custom_layer), DPAR_CUSTOM_LAYER_VERSION, NULL, NULL, 0, NULL, NULL, NULL, NULL, NULL}
/**
 * @brief Fills @p layer with empty defaults: the layout of @p size bytes, sizeof(dpar_custom_layer) as the caller
 * compiled it, and no byte past it. ::DPAR_ERR_NOT_SUPPORTED for a layout newer than the library's. Call it as
 * dpar_custom_layer_init().
 */
DPAR_API dpar_status dpar_custom_layer_init_sized(dpar_custom_layer *layer, size_t size);
/**
 * @brief Fills @p layer with empty defaults: a macro that passes the caller's sizeof to
 * dpar_custom_layer_init_sized(), so that a newer libdpar writes the caller's layout. The function of this name, which
 * programs built against dpar.h 0.4 and older call, writes dpar.h 0.4's layout; a table of functions (dpar_api.h) or a
 * binding without C macros calls the _sized one.
 */
DPAR_API dpar_status dpar_custom_layer_init(dpar_custom_layer *layer);
#define dpar_custom_layer_init(layer) dpar_custom_layer_init_sized((layer), sizeof(dpar_custom_layer))
/**
 * @brief Appends a custom layer. dpar allocates its parameters and gradients on every device, synchronises the
 * gradients and applies the optimizer. The layer (and its payload) is shared by the model and every engine built
 * from it; `layer->destroy(layer->payload)` runs when the last of them is freed. A layer refused here (a bad
 * description) has its destroy called before the call returns; a NULL or dead @p model, a NULL @p layer or one
 * of an unknown version does not.
 */
DPAR_API dpar_status dpar_model_add_custom(dpar_model *model, const dpar_custom_layer *layer);

/** @brief The number of layers. */
DPAR_API dpar_status dpar_model_num_layers(size_t *out, const dpar_model *model);
/** @brief The number of parameter tensors (PyTorch's len(list(model.parameters()))). */
DPAR_API dpar_status dpar_model_num_params(size_t *out, const dpar_model *model);
/** @brief The total number of parameter elements. */
DPAR_API dpar_status dpar_model_num_param_elements(size_t *out, const dpar_model *model);
/**
 * @brief The shape of parameter @p index.
 * @param[out] out_shape Room for #DPAR_MAX_DIMS extents. May be NULL.
 * @param[out] out_ndim  May be NULL.
 */
DPAR_API dpar_status dpar_model_param_info(int64_t *out_shape, size_t *out_ndim, const dpar_model *model,
                                           size_t index);
/**
 * @brief The name of parameter @p index ("0.weight", as PyTorch's state_dict names it).
 * @return Borrowed from the model; valid until the model changes or is freed. NULL for a bad model or index, with
 *         dpar_last_error() saying why.
 */
DPAR_API const char *dpar_model_param_name(const dpar_model *model, size_t index);
/** @brief Copies parameter @p index into @p dst (@p count elements, exactly its size). */
DPAR_API dpar_status dpar_model_get_param(float *dst, const dpar_model *model, size_t index, size_t count);
/** @brief Overwrites parameter @p index from @p src (@p count elements, exactly its size). */
DPAR_API dpar_status dpar_model_set_param(dpar_model *model, size_t index, const float *src, size_t count);
/**@}*/

/* ------------------------------------------------------------------------------------------------------------ */
/** @name Optimizers */
/**@{*/
/** @brief Optimizer kinds, with PyTorch's update formulas. */
typedef enum dpar_optimizer_kind {
  DPAR_SGD = 0,   /**< torch.optim.SGD: momentum, dampening, Nesterov, weight decay. */
  DPAR_ADAM = 1,  /**< torch.optim.Adam: L2 weight decay added to the gradient. */
  DPAR_ADAMW = 2  /**< torch.optim.AdamW: decoupled weight decay. */
} dpar_optimizer_kind;

/** @brief Optimizer options; PyTorch's defaults where PyTorch has one. */
typedef struct dpar_optimizer_options {
  size_t size;         /**< sizeof(dpar_optimizer_options) as the caller compiled it. */
  uint32_t version;    /**< #DPAR_OPTIMIZER_OPTIONS_VERSION. */
  int32_t kind;        /**< A ::dpar_optimizer_kind. Default ::DPAR_SGD. */
  float lr;            /**< Learning rate. Default 0.01 (PyTorch's Adam default is 0.001: set it). */
  float momentum;      /**< SGD. Default 0. */
  float dampening;     /**< SGD. Default 0. */
  int32_t nesterov;    /**< SGD; boolean; needs momentum > 0 and dampening 0. Default 0. */
  float weight_decay;  /**< Default 0 (AdamW users usually set 0.01). */
  float beta1;         /**< Adam. Default 0.9. */
  float beta2;         /**< Adam. Default 0.999. */
  float eps;           /**< Adam. Default 1e-8. */
} dpar_optimizer_options;
#define DPAR_OPTIMIZER_OPTIONS_VERSION 1
#define DPAR_OPTIMIZER_OPTIONS_INIT \
  {sizeof(dpar_optimizer_options), DPAR_OPTIMIZER_OPTIONS_VERSION, DPAR_SGD, 0.01f, 0.0f, 0.0f, 0, 0.0f, 0.9f, 0.999f, 1e-8f}
/**
 * @brief Fills @p opts with defaults: the layout of @p size bytes, sizeof(dpar_optimizer_options) as the caller
 * compiled it, and no byte past it. ::DPAR_ERR_NOT_SUPPORTED for a layout newer than the library's. Call it as
 * dpar_optimizer_options_init().
 */
DPAR_API dpar_status dpar_optimizer_options_init_sized(dpar_optimizer_options *opts, size_t size);
/**
 * @brief Fills @p opts with defaults: a macro that passes the caller's sizeof to dpar_optimizer_options_init_sized(),
 * so that a newer libdpar writes the caller's layout. The function of this name, which programs built against dpar.h
 * 0.4 and older call, writes dpar.h 0.4's layout; a table of functions (dpar_api.h) or a binding without C macros
 * calls the _sized one.
 */
DPAR_API dpar_status dpar_optimizer_options_init(dpar_optimizer_options *opts);
#define dpar_optimizer_options_init(opts) dpar_optimizer_options_init_sized((opts), sizeof(dpar_optimizer_options))
/**@}*/

/* ------------------------------------------------------------------------------------------------------------ */
/** @name The DataParallel engine
 * One worker thread per device, each holding a persistent replica of the model. A batch is split across devices
 * as torch.nn.DataParallel splits it (chunks of ceil(B/n) rows; the last may be smaller and trailing devices may
 * get none). Gradients are those of the mean loss over the whole batch, summed across devices by an all-reduce,
 * and every replica gets the same optimizer step (each worker computes it for its shard of the parameters, keeping
 * the optimizer's state for that shard alone, and writes it into every replica), so replicas stay bit-identical.
 *
 * Thread-safety: an engine may be called from several threads; calls are serialised by a lock inside it.
 * Callbacks (custom layers, the forward hook) run on the worker threads, concurrently across replicas; they must
 * not call their own engine's functions, which return ::DPAR_ERR_INVALID_STATE there (another engine, one created
 * in the callback for example, may be called and freed). */
/**@{*/
typedef struct dpar_engine dpar_engine; /**< An opaque DataParallel engine. */

/** @brief Losses that the fused training step computes on every replica. */
typedef enum dpar_loss {
  DPAR_LOSS_CROSS_ENTROPY = 0, /**< Softmax cross-entropy over i32 class labels, mean over the batch. */
  DPAR_LOSS_MSE = 1            /**< Mean squared error against f32 targets shaped as the output, mean over all. */
} dpar_loss;

/** @brief Which processes an engine spans (dpar_engine_options.processes). */
typedef enum dpar_processes {
  DPAR_PROCESSES_AUTO = 0,   /**< Every process of the MPI job when the program was started by an MPI launcher
                                  (mpirun sets OMPI_COMM_WORLD_SIZE, PMI_SIZE or PMIX_RANK) and dpar has MPI; this
                                  process alone otherwise. */
  DPAR_PROCESSES_SINGLE = 1, /**< This process alone, even under mpirun. */
  DPAR_PROCESSES_MPI = 2     /**< Every process of MPI_COMM_WORLD (MPI is initialised if the program has not done it;
                                  a program started without mpirun is a job of one). ::DPAR_ERR_NOT_SUPPORTED
                                  without MPI. */
} dpar_processes;

/** @brief Options for dpar_engine_create(). */
typedef struct dpar_engine_options {
  size_t size;              /**< sizeof(dpar_engine_options) as the caller compiled it. */
  uint32_t version;         /**< #DPAR_ENGINE_OPTIONS_VERSION. */
  int32_t device_kind;      /**< A ::dpar_device_kind. Default ::DPAR_DEVICE_CPU. */
  size_t num_cpu_devices;   /**< How many virtual CPU devices exist (cpu:0 .. cpu:N-1). 0: dpar_device_count(). */
  const int32_t *device_ids;/**< The devices to use, in order (replica r runs on device_ids[r]). NULL: all. Copied. */
  size_t num_device_ids;    /**< Entries in @p device_ids. */
  int32_t output_device;    /**< Where forward() gathers; must be one of the devices. -1 (default): the first. */
  int32_t loss;             /**< A ::dpar_loss for the training step. Default ::DPAR_LOSS_CROSS_ENTROPY. */
  uint64_t seed;            /**< Seeds each replica's RNG stream (dropout). Default 0. */
  double timeout_seconds;   /**< How long a worker waits for the others at each synchronisation point of a
                                 collective. Default 300; INFINITY for no limit. */
  size_t blas_threads;      /**< GEMM threads inside each CPU worker (oneDNN's OpenMP team, set per worker).
                                 Default 1 (no oversubscription). A pinned worker is pinned to this many cores. */
  int32_t pin_workers;      /**< Boolean. Nonzero (default): worker r runs on the r-th CPU (mod their number) of the process's
                                 affinity mask, as `mpirun --bind-to core` binds ranks. A worker that sleeps between
                                 steps is otherwise often woken on a core that another worker is using. */
  /* Version 2: */
  size_t first_bucket_bytes;/**< The training step all-reduces gradients in buckets, last layers first, each while
                                 backward computes the layers before it. The first bucket closes once it holds this
                                 many bytes. 0: the default, 1 MiB. */
  size_t bucket_cap_bytes;  /**< Every later bucket closes once it holds this many bytes. 0: the default, 25 MiB.
                                 SIZE_MAX: a single bucket, all-reduced after backward (no overlap). */
  int32_t processes;        /**< A ::dpar_processes. Default ::DPAR_PROCESSES_AUTO. With several processes every
                                 process creates its engine (a collective call) and then calls the same functions in
                                 the same order with its own part of each batch. */
} dpar_engine_options;
#define DPAR_ENGINE_OPTIONS_VERSION 2
#define DPAR_ENGINE_OPTIONS_INIT                                                                                   \
  {sizeof(dpar_engine_options), DPAR_ENGINE_OPTIONS_VERSION, DPAR_DEVICE_CPU, 0, NULL, 0, -1, DPAR_LOSS_CROSS_ENTROPY, \
   0, 300.0, 1, 1, 0, 0, DPAR_PROCESSES_AUTO}
/**
 * @brief Fills @p opts with defaults: the layout of @p size bytes, sizeof(dpar_engine_options) as the caller compiled
 * it, and no byte past it. ::DPAR_ERR_NOT_SUPPORTED for a layout newer than the library's. Call it as
 * dpar_engine_options_init().
 */
DPAR_API dpar_status dpar_engine_options_init_sized(dpar_engine_options *opts, size_t size);
/**
 * @brief Fills @p opts with defaults: a macro that passes the caller's sizeof to dpar_engine_options_init_sized(), so
 * that a newer libdpar writes the caller's layout. The function of this name, which programs built against dpar.h 0.4
 * and older call, writes dpar.h 0.4's layout; a table of functions (dpar_api.h) or a binding without C macros calls
 * the _sized one.
 */
DPAR_API dpar_status dpar_engine_options_init(dpar_engine_options *opts);
#define dpar_engine_options_init(opts) dpar_engine_options_init_sized((opts), sizeof(dpar_engine_options))

/**
 * @brief Creates an engine: starts one worker per device and copies the model to each, once.
 * The model is copied; it may be freed or changed afterwards without affecting the engine.
 * @param[out] out   The engine, owned by the caller (dpar_engine_free()).
 * @param model      The model to replicate; it must have at least one layer.
 * @param optimizer  The optimizer; NULL for SGD with its defaults.
 * @param opts       Options, or NULL for defaults.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for an empty model or device list, a device out of range or
 *         repeated, an output device not in the list, or bad options; ::DPAR_ERR_NOT_SUPPORTED for CUDA in a build
 *         without it; ::DPAR_ERR_OUT_OF_MEMORY.
 */
DPAR_API dpar_status dpar_engine_create(dpar_engine **out, const dpar_model *model,
                                        const dpar_optimizer_options *optimizer, const dpar_engine_options *opts);
/**
 * @brief Stops the workers and frees the engine (NULL is a no-op). A call in flight on another thread finishes
 * first: the engine is destroyed when it returns, and new calls are refused at once. Called from one of this
 * engine's own callbacks (on one of its worker threads), it does nothing; from another engine's callback it frees.
 */
DPAR_API void dpar_engine_free(dpar_engine *engine);

/**
 * @brief Aborts in-flight work: a call in progress on this engine (on another thread) returns ::DPAR_ERR_REMOTE as
 * soon as its workers reach a synchronisation point (a worker inside a computation or a callback finishes that
 * first). The engine cannot continue after an abort: later calls return ::DPAR_ERR_INVALID_STATE, and it is
 * released with dpar_engine_free(). Unlike every other engine call, it does not wait for the engine's lock, so
 * it may be called at any time from any thread except the engine's own callbacks. With several processes the
 * others are told: their engines fail with ::DPAR_ERR_REMOTE at their next synchronisation point.
 */
DPAR_API dpar_status dpar_engine_abort(dpar_engine *engine);

/** @brief The number of replicas (devices). */
DPAR_API dpar_status dpar_engine_num_replicas(size_t *out, const dpar_engine *engine);
/**
 * @brief This process's rank among the processes the engine spans, and their number (0 and 1 for a single
 * process). Either output may be NULL. Use them to give each process its part of every batch
 * (dpar_loader_shard()), and to let rank 0 alone print.
 */
DPAR_API dpar_status dpar_engine_processes(size_t *out_rank, size_t *out_size, const dpar_engine *engine);
/**
 * @brief How gradient buckets travel between the processes: "" when the engine spans one process (a job of one
 * process included); "mpi" (CPU devices); "nccl" (GPUs, each process's first replica on a GPU of its own: that
 * replica carries its process's buckets); or "mpi through host memory (...)" where NCCL could not be used, saying
 * why (two processes' first replicas on one GPU, which NCCL does not allow; NCCL failing to connect them). Every
 * process of a job reports the same transport.
 * @return Borrowed from the engine, valid until it is freed. NULL for a bad engine, with dpar_last_error() saying
 *         why.
 */
DPAR_API const char *dpar_engine_process_transport(const dpar_engine *engine);
/** @brief The number of gradient buckets of the training step (see dpar_engine_options.first_bucket_bytes). */
DPAR_API dpar_status dpar_engine_num_buckets(size_t *out, const dpar_engine *engine);
/** @brief The device of replica @p replica. */
DPAR_API dpar_status dpar_engine_replica_device(dpar_device *out, const dpar_engine *engine, size_t replica);
/**
 * @brief How a batch of @p batch rows is split: @p out[r] receives replica r's rows (0 for unused replicas).
 * @param capacity Entries in @p out; at least the number of replicas.
 */
DPAR_API dpar_status dpar_engine_split(size_t *out, const dpar_engine *engine, size_t batch, size_t capacity);

/**
 * @brief One fused training step: scatter, forward and loss on every replica, backward, all-reduce of gradients
 * (those of the mean loss over the whole batch), and the optimizer step on every replica. No activation is
 * gathered. Equivalent to dpar_engine_accumulate() followed by dpar_engine_step(), but faster: gradients are
 * all-reduced bucket by bucket while backward is still computing (dpar_engine_options.first_bucket_bytes).
 * With several processes, @p input is this process's part of the global batch, and the gradient is that of the
 * mean loss over the global batch (every process's rows).
 * @param[out] out_loss  The mean loss over the batch (the global batch, with several processes); may be NULL.
 * @param input          (B, features...) f32 in host memory or in memory of the engine's devices' kind. A replica
 *                       whose device holds the input takes its rows as a view, without a copy; the others copy
 *                       theirs (from the host, or from the other GPU). A GPU input must be complete when the call
 *                       is made: synchronise the stream that wrote it.
 * @param target         Cross-entropy: (B) i32 labels in [0, classes). MSE: f32 shaped as the output. Where the
 *                       input may be (labels on a GPU are copied to the host for their range check).
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for NULLs, B = 0, shapes that do not fit the model or each other,
 *         labels out of range; errors from a worker (::DPAR_ERR_OUT_OF_MEMORY, a custom layer's status, ...).
 *         After a failure before the optimizer step the engine stays usable and its parameters are unchanged;
 *         otherwise it returns ::DPAR_ERR_INVALID_STATE from then on and must be recreated.
 */
DPAR_API dpar_status dpar_engine_train_step(float *out_loss, dpar_engine *engine, const dpar_tensor *input,
                                            const dpar_tensor *target);
/**
 * @brief Forward, loss and backward for one micro-batch, adding its gradient to the replicas' local gradients
 * without synchronising them (DDP's no_sync). dpar_engine_step() then all-reduces once and steps, so that several
 * micro-batches equal one batch of all their rows.
 * @param[out] out_loss  The micro-batch's mean loss; may be NULL.
 */
DPAR_API dpar_status dpar_engine_accumulate(float *out_loss, dpar_engine *engine, const dpar_tensor *input,
                                            const dpar_tensor *target);
/**
 * @brief Synchronises the accumulated gradients and applies the optimizer step on every replica; then clears
 * the gradients. After dpar_engine_accumulate(), the gradient is that of the mean loss over all accumulated rows
 * (of every process); after dpar_engine_backward(), it is the sum of what backward produced (on every process).
 * @return ::DPAR_ERR_INVALID_STATE if no gradient is pending.
 */
DPAR_API dpar_status dpar_engine_step(dpar_engine *engine);
/** @brief Discards accumulated gradients and any forward state kept for backward. */
DPAR_API dpar_status dpar_engine_zero_grad(dpar_engine *engine);

/**
 * @brief DataParallel's forward: scatter, forward on every replica, gather of the outputs in batch order.
 * In training mode each replica keeps its activations for dpar_engine_backward(), and a view of its rows of
 * @p input without a copy: the input's memory must stay valid and unchanged until backward, zero_grad or the
 * next step (a loader's batch changes on its next dpar_loader_next()).
 * @param[out] out  The (B, ...) output on the output device, owned by the caller.
 */
DPAR_API dpar_status dpar_engine_forward(dpar_tensor **out, dpar_engine *engine, const dpar_tensor *input);
/**
 * @brief DataParallel's backward: scatters @p grad_output (shaped as the last forward's output; in host memory or
 * memory of the engine's devices' kind, as the input of dpar_engine_train_step()) and runs backward on every
 * replica, adding to its local gradients. Call dpar_engine_step() to synchronise and step.
 * @return ::DPAR_ERR_INVALID_STATE without a preceding training-mode forward.
 */
DPAR_API dpar_status dpar_engine_backward(dpar_engine *engine, const dpar_tensor *grad_output);

/** @brief Training mode (nonzero: dropout active) or eval mode. Engines start in training mode. */
DPAR_API dpar_status dpar_engine_set_training(dpar_engine *engine, int32_t training);
/** @brief Changes the learning rate for the following steps (a scheduler's job). */
DPAR_API dpar_status dpar_engine_set_lr(dpar_engine *engine, float lr);
/**
 * @brief Clips the gradient of the following steps: before each step the gradient (summed over the replicas and
 * processes, as the step applies it) is scaled by min(1, max_norm / (norm + 1e-6)), norm being its L2 norm over
 * every parameter, as torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) does between backward and the
 * step. 0 turns clipping off; engines start without it. With several processes, every process sets the same
 * value before the same step (as with dpar_engine_set_lr()).
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for a negative or non-finite @p max_norm.
 */
DPAR_API dpar_status dpar_engine_set_max_grad_norm(dpar_engine *engine, float max_norm);
/**
 * @brief The gradient's L2 norm before clipping at the last step taken with clipping on (what clip_grad_norm_
 * returns, to log); NaN before any such step.
 */
DPAR_API dpar_status dpar_engine_grad_norm(float *out, const dpar_engine *engine);

/** @brief How gradient buckets cross the processes (dpar_engine_set_gradient_compression()). */
typedef enum dpar_gradient_compression {
  DPAR_COMPRESSION_NONE = 0, /**< f32, as summed. */
  /**
   * Each process's sum, rounded to bfloat16 (to nearest, ties to even), is summed across the processes in bfloat16
   * and widened back to f32: half the bytes between processes, f32's range, about 3 significant digits (as
   * PyTorch DDP's bf16_compress_hook and Horovod's compression).
   */
  DPAR_COMPRESSION_BF16 = 1
} dpar_gradient_compression;
/**
 * @brief Compresses gradient buckets on their way between processes, from the next step on. Within a process
 * they are always summed in f32 (threads share memory; there is nothing to save), so with one process this changes
 * nothing. Every process sets the same, before the same step: a process that differs makes that step fail with
 * ::DPAR_ERR_MISMATCH on every process (their collectives compare element types), and the engine must be recreated.
 * Engines start with ::DPAR_COMPRESSION_NONE.
 * @param compression A ::dpar_gradient_compression.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for an unknown @p compression.
 */
DPAR_API dpar_status dpar_engine_set_gradient_compression(dpar_engine *engine, int32_t compression);
/** @brief The number of optimizer steps taken. */
DPAR_API dpar_status dpar_engine_step_count(size_t *out, const dpar_engine *engine);

/**
 * @brief Each replica's mean loss over its own chunk in the last training step or accumulate, as
 * torch.nn.DataParallel returns one loss per device; NaN for replicas that got no rows.
 * @param capacity Entries in @p out; at least the number of replicas.
 */
DPAR_API dpar_status dpar_engine_replica_losses(float *out, const dpar_engine *engine, size_t capacity);

/**
 * @brief A replica's parameters, flattened in dpar_model_param_info() order, into @p dst.
 * @param count  Exactly the model's number of parameter elements.
 */
DPAR_API dpar_status dpar_engine_get_params(float *dst, dpar_engine *engine, size_t replica, size_t count);

/**
 * @brief Called by each replica, on its worker thread, after its forward: its chunk's input and output shapes.
 * Returns ::DPAR_OK, or an error status (through dpar_set_error(), with a message) that fails the engine call.
 */
typedef dpar_status (*dpar_forward_hook)(void *payload, size_t replica, const int64_t *input_shape,
                                         size_t input_ndim, const int64_t *output_shape, size_t output_ndim);
/**
 * @brief Installs (or with a NULL @p hook removes) the forward hook. Replicas call it concurrently.
 * @param destroy  Releases @p payload (may be NULL): called once, when the hook is replaced or removed, or the
 *                 engine is freed; also when this call fails for any reason but a NULL or dead @p engine (a
 *                 call from inside the engine's own callbacks, refused with ::DPAR_ERR_INVALID_STATE, included).
 */
DPAR_API dpar_status dpar_engine_set_forward_hook(dpar_engine *engine, dpar_forward_hook hook, void *payload,
                                                  dpar_destroy_fn destroy);

/**
 * @brief Saves parameters, optimizer state, step count and RNG streams as a safetensors file, atomically
 * (a temporary file, fsync, rename): a crash leaves the old file or the new one, never half of one.
 * The temporary file, beside @p path, has a name of its own per save (hidden, at most about 100 bytes whatever
 * the length of @p path's name): concurrent saves to one path (two engines, or a trace) each succeed, and the
 * last renamed is the file left, complete. A @p path that exists and is not a regular file (a device such as
 * /dev/null, a FIFO, a socket, a directory, or a symbolic link to one) is refused and left as it was; a link to
 * a regular file is replaced by the new file, the file it named is not written.
 * With several processes every process calls it: rank 0 alone writes @p path (the others' @p path is not
 * touched), and every process returns rank 0's outcome.
 * @return ::DPAR_OK or ::DPAR_ERR_IO.
 */
DPAR_API dpar_status dpar_engine_save(dpar_engine *engine, const char *path);
/**
 * @brief Loads a checkpoint written by dpar_engine_save() into every replica.
 * With several processes every process calls it: rank 0 reads its @p path and broadcasts the file, which every
 * process checks and loads alike (the others' @p path is not opened: no shared file system is needed).
 * @return ::DPAR_OK; ::DPAR_ERR_IO, also for a path that is not a regular file (a FIFO is refused at once);
 *         ::DPAR_ERR_CORRUPT for a truncated or damaged file, a header nested too deep, or metadata (step count,
 *         replica count, RNG offsets) out of range, naming the field (all checked before anything changes);
 *         ::DPAR_ERR_MISMATCH for a checkpoint of another model or optimizer.
 */
DPAR_API dpar_status dpar_engine_load(dpar_engine *engine, const char *path);

/**
 * @brief Starts recording a timeline of the engine's calls: what each replica's worker thread and communication
 * thread did, span by span (forward, loss, backward, each gradient bucket's collectives, the optimizer, the
 * parameters' all-gather, the wait for the device), and the calls themselves on the calling thread. Recording
 * forgets a timeline recorded before. Off, it costs nothing measurable; on, two clock reads per span.
 * Times are the host's: on a GPU a span is the time spent queuing its work, and the wait for the device is the
 * span "device sync". At most 2^20 spans are kept; the file says how many more were dropped.
 * @return ::DPAR_OK.
 */
DPAR_API dpar_status dpar_engine_trace_start(dpar_engine *engine);
/**
 * @brief Stops recording and writes the timeline to @p path in Chrome's trace event format (JSON, opened by
 * ui.perfetto.dev and chrome://tracing), atomically; one track per thread, the process's rank as its pid. NULL
 * only stops. The timeline stays until the next dpar_engine_trace_start(), so a write that failed may be tried
 * again with another path. Each process of an engine records and writes its own: give each its own path.
 * The file is written as dpar_engine_save() writes its own (the same temporary names and refusals).
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_STATE if no trace was started; ::DPAR_ERR_IO naming the path.
 */
DPAR_API dpar_status dpar_engine_trace_stop(dpar_engine *engine, const char *path);

/** @brief Points at which dpar_engine_inject_fault() makes a worker fail, to test error paths. */
typedef enum dpar_fault {
  DPAR_FAULT_NONE = 0,     /**< Clears an armed fault. */
  DPAR_FAULT_ALLOC = 1,    /**< The replica's next activation allocation fails (out of memory). */
  DPAR_FAULT_FORWARD = 2,  /**< The replica's next forward fails (device error). */
  DPAR_FAULT_BACKWARD = 3  /**< The replica's next backward fails (device error), after the others began theirs. */
} dpar_fault;
/**
 * @brief Arms a one-shot fault on one replica, for tests of error handling (as sqlite3_test_control is).
 */
DPAR_API dpar_status dpar_engine_inject_fault(dpar_engine *engine, size_t replica, int32_t fault);
/**@}*/

/* ------------------------------------------------------------------------------------------------------------ */
/** @name Collectives
 * dpar's collectives on a framework's own buffers, for a program that brings its own tensors and autograd and uses
 * dpar to synchronise (as Horovod and NCCL are used). A communicator is one participant's view of a group:
 * the threads of one process (::dpar_comm_group, shared memory) or the processes of an MPI job.
 *
 * Every collective checks, before it moves data, that all participants called the same operation with the same
 * count, dtype, op and root; if not, each returns ::DPAR_ERR_MISMATCH naming the operation and the participant. A
 * participant that does not arrive within the timeout makes the others return ::DPAR_ERR_TIMEOUT naming it.
 *
 * Thread-safety: a communicator belongs to one participant; its calls must not overlap, except that asynchronous
 * operations run on its own communication thread. Buffers are host memory, except in a group made on GPUs by
 * dpar_comm_group_create_on_devices(): there they are memory of the participant's GPU, ordered on its stream. */
/**@{*/
typedef struct dpar_comm dpar_comm;             /**< One participant of a group. */
typedef struct dpar_comm_group dpar_comm_group; /**< The participants of one process (threads backend). */
typedef struct dpar_work dpar_work;             /**< An asynchronous collective in flight. */

/**
 * @brief Reductions, with one meaning in the host-memory backends (threads, and MPI whether the data rides in a
 * fused message or goes through MPI_Allreduce): integer sums wrap (two's complement, never undefined); max and
 * min propagate a NaN from any participant, as PyTorch's do, and between equal values (-0 and +0) keep the one
 * combined first. A group on GPUs reduces with NCCL's operations (ncclMax, ncclMin), whose NaN handling is NCCL's.
 */
typedef enum dpar_reduce_op {
  DPAR_SUM = 0,  /**< Sum (integers wrap on overflow). */
  DPAR_MEAN = 1, /**< Sum divided by the number of participants (integers: truncated toward zero). */
  DPAR_MAX = 2,  /**< Maximum; NaN if any participant's element is NaN. */
  DPAR_MIN = 3   /**< Minimum; NaN if any participant's element is NaN. */
} dpar_reduce_op;

/** @brief Options of a communicator or group. */
typedef struct dpar_comm_options {
  size_t size;            /**< sizeof(dpar_comm_options) as the caller compiled it. */
  uint32_t version;       /**< #DPAR_COMM_OPTIONS_VERSION. */
  double timeout_seconds; /**< How long a participant waits for the others at each synchronisation point.
                               Default 300; INFINITY for no limit. */
} dpar_comm_options;
#define DPAR_COMM_OPTIONS_VERSION 1
#define DPAR_COMM_OPTIONS_INIT {sizeof(dpar_comm_options), DPAR_COMM_OPTIONS_VERSION, 300.0}
/**
 * @brief Fills @p opts with defaults: the layout of @p size bytes, sizeof(dpar_comm_options) as the caller compiled
 * it, and no byte past it. ::DPAR_ERR_NOT_SUPPORTED for a layout newer than the library's. Call it as
 * dpar_comm_options_init().
 */
DPAR_API dpar_status dpar_comm_options_init_sized(dpar_comm_options *opts, size_t size);
/**
 * @brief Fills @p opts with defaults: a macro that passes the caller's sizeof to dpar_comm_options_init_sized(), so
 * that a newer libdpar writes the caller's layout. The function of this name, which programs built against dpar.h 0.4
 * and older call, writes dpar.h 0.4's layout; a table of functions (dpar_api.h) or a binding without C macros calls
 * the _sized one.
 */
DPAR_API dpar_status dpar_comm_options_init(dpar_comm_options *opts);
#define dpar_comm_options_init(opts) dpar_comm_options_init_sized((opts), sizeof(dpar_comm_options))

/**
 * @brief Creates a group of @p size participants inside this process (one thread each, shared memory).
 * @param[out] out  The group, owned by the caller. Its members keep it alive: free it and them in any order.
 */
DPAR_API dpar_status dpar_comm_group_create(dpar_comm_group **out, size_t size, const dpar_comm_options *opts);
/** @brief Releases the caller's reference to a group (NULL is a no-op). */
DPAR_API void dpar_comm_group_free(dpar_comm_group *group);
/**
 * @brief Participant @p rank's communicator of a group. Each participant (thread) uses its own.
 * @param[out] out  Owned by the caller (dpar_comm_free()).
 */
DPAR_API dpar_status dpar_comm_group_member(dpar_comm **out, dpar_comm_group *group, size_t rank);
/**
 * @brief Creates a group of @p size participants inside this process whose buffers are memory of their devices:
 * participant r's on @p devices[r], all of one kind. For a framework that keeps its tensors on the GPU and uses
 * dpar to synchronise them (and dpar_reducer_create() for its gradients).
 *
 * Over CPU devices it is dpar_comm_group_create()'s group: host memory, no streams. Over CUDA devices the buffers
 * are device memory: NCCL moves them between distinct GPUs (ncclCommInitAll), and dpar's own reduction in device
 * memory serves a GPU named more than once (NCCL refuses two ranks on one GPU). That reduction does all_reduce
 * (f32 sum), broadcast, all_gather and barrier; reduce, reduce_scatter and the other all_reduce types and
 * operations return ::DPAR_ERR_NOT_SUPPORTED.
 *
 * A GPU named more than once next to other GPUs needs peer access between them (enabled here; where the GPUs
 * cannot reach each other the group is refused with ::DPAR_ERR_NOT_SUPPORTED).
 *
 * Streams: participant r's collectives are ordered on @p streams[r], a cudaStream_t of devices[r] (a NULL entry,
 * or a NULL @p streams, is the legacy default stream, even in a program built with a per-thread default stream;
 * cudaStreamPerThread is refused: it names each thread's own stream). A collective reads its inputs after the
 * work queued on that stream before the call, and work queued on it after the call sees its result. A call may
 * return before the result is in memory (the device reduction returns once its work is queued): synchronise the
 * stream before the host reads it. An asynchronous collective is ordered on the stream when the communicator's
 * thread starts it: queue the work that writes its inputs before the call, and the work that reads its result
 * after dpar_work_wait(). The streams must outlive the members and the reducers over them. Each call makes the
 * participant's device current for its span and then restores the calling thread's.
 * @param[out] out  The group, owned by the caller. Its members keep it alive: free it and them in any order.
 * @param streams   NULL, or @p size cudaStream_t values (NULL for every CPU device).
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for NULL @p devices, a @p size not in 1 to 256, devices of two
 *         kinds, a GPU index past the last GPU, or a stream given for a CPU device; ::DPAR_ERR_DEVICE where there
 *         is no GPU; ::DPAR_ERR_NOT_SUPPORTED for CUDA in a build without it, or GPUs without the peer access the
 *         group needs; NCCL's failure to initialise.
 */
DPAR_API dpar_status dpar_comm_group_create_on_devices(dpar_comm_group **out, const dpar_device *devices,
                                                      void *const *streams, size_t size,
                                                      const dpar_comm_options *opts);
/**
 * @brief This process's communicator over MPI_COMM_WORLD (a duplicate of it). Initialises MPI
 * (MPI_THREAD_MULTIPLE) if the program has not; without mpirun the process is rank 0 of 1.
 * @return ::DPAR_OK; ::DPAR_ERR_COMMUNICATION if MPI cannot start.
 */
DPAR_API dpar_status dpar_comm_create_mpi(dpar_comm **out, const dpar_comm_options *opts);
/** @brief Frees a communicator (NULL is a no-op), after its asynchronous operations finish. */
DPAR_API void dpar_comm_free(dpar_comm *comm);
/** @brief This participant's rank, and the group's size. Either output may be NULL. */
DPAR_API dpar_status dpar_comm_info(size_t *out_rank, size_t *out_size, const dpar_comm *comm);
/**
 * @brief The device whose memory the communicator's buffers are: the participant's device in a group made by
 * dpar_comm_group_create_on_devices(), cpu:0 (host memory) for every other communicator.
 */
DPAR_API dpar_status dpar_comm_device(dpar_device *out, const dpar_comm *comm);
/**
 * @brief Aborts the group from this participant (NCCL's ncclCommAbort): every participant waiting in a collective
 * now, or calling one later, returns ::DPAR_ERR_REMOTE naming this one and the reason (this participant included),
 * and asynchronous work not yet finished fails alike. Over MPI the other processes are told with a message. The
 * communicator stays a valid handle, to be freed with dpar_comm_free(); it cannot run collectives any more.
 * Unlike every other call on a communicator it may be called from any thread, at any time, even while another
 * thread is inside a collective on it.
 * @param reason  Put in the others' messages; may be NULL.
 */
DPAR_API dpar_status dpar_comm_abort(dpar_comm *comm, const char *reason);
/**
 * @brief Asks whether the communicator has failed without a call seeing it yet (NCCL's ncclCommGetAsyncError):
 * an abort here or by another participant, a participant that gave up after its timeout, a failed asynchronous
 * operation, a transport error. Never blocks; it may be called from any thread, at any time. Over MPI it also
 * reads notices that other processes sent, when no collective is running on this communicator.
 * @param[out] out  ::DPAR_OK while the communicator is usable, else the status its next collective returns; the
 *                  reason is then dpar_last_error() (set by this call, which itself returns ::DPAR_OK).
 */
DPAR_API dpar_status dpar_comm_get_async_error(dpar_status *out, dpar_comm *comm);

/**
 * @brief Reduces @p count elements of every participant's @p send into every participant's @p recv.
 * @p send may equal @p recv (in place).
 * @param dtype  ::DPAR_F32, ::DPAR_F64, ::DPAR_I32 or ::DPAR_I64.
 * @param op     A ::dpar_reduce_op.
 */
DPAR_API dpar_status dpar_comm_all_reduce(dpar_comm *comm, const void *send, void *recv, size_t count,
                                          int32_t dtype, int32_t op);
/** @brief Copies @p root's @p buffer into every participant's. */
DPAR_API dpar_status dpar_comm_broadcast(dpar_comm *comm, void *buffer, size_t count, int32_t dtype, size_t root);
/** @brief Reduces into @p root's @p recv (ignored, and may be NULL, elsewhere). */
DPAR_API dpar_status dpar_comm_reduce(dpar_comm *comm, const void *send, void *recv, size_t count, int32_t dtype,
                                      int32_t op, size_t root);
/** @brief Every participant's @p send (@p count elements) into every @p recv (size x count), in rank order. */
DPAR_API dpar_status dpar_comm_all_gather(dpar_comm *comm, const void *send, void *recv, size_t count,
                                          int32_t dtype);
/** @brief Reduces @p send (size x count) element-wise; participant r receives block r (@p count) in @p recv. */
DPAR_API dpar_status dpar_comm_reduce_scatter(dpar_comm *comm, const void *send, void *recv, size_t count,
                                              int32_t dtype, int32_t op);
/** @brief Returns once every participant has entered it. */
DPAR_API dpar_status dpar_comm_barrier(dpar_comm *comm);

/**
 * @brief dpar_comm_all_reduce() on the communicator's own thread; returns at once. Operations started on one
 * communicator run in the order they were started; a blocking collective called after them runs after them, on
 * that thread (never beside one of them). The buffers must stay valid and untouched until the work completes.
 * @param[out] out  The work, owned by the caller (dpar_work_free()).
 */
DPAR_API dpar_status dpar_comm_all_reduce_async(dpar_work **out, dpar_comm *comm, const void *send, void *recv,
                                                size_t count, int32_t dtype, int32_t op);
/** @brief Asynchronous dpar_comm_broadcast(). */
DPAR_API dpar_status dpar_comm_broadcast_async(dpar_work **out, dpar_comm *comm, void *buffer, size_t count,
                                               int32_t dtype, size_t root);
/** @brief Asynchronous dpar_comm_all_gather(). */
DPAR_API dpar_status dpar_comm_all_gather_async(dpar_work **out, dpar_comm *comm, const void *send, void *recv,
                                                size_t count, int32_t dtype);
/** @brief Asynchronous dpar_comm_reduce_scatter(). */
DPAR_API dpar_status dpar_comm_reduce_scatter_async(dpar_work **out, dpar_comm *comm, const void *send, void *recv,
                                                    size_t count, int32_t dtype, int32_t op);
/** @brief Sets @p *out to 1 if the work has finished (successfully or not), else 0. Never blocks. */
DPAR_API dpar_status dpar_work_test(int32_t *out, dpar_work *work);
/** @brief Waits for the work; returns the collective's own status and message. */
DPAR_API dpar_status dpar_work_wait(dpar_work *work);
/** @brief Frees a work handle (NULL is a no-op), waiting for the operation first if it is still running. */
DPAR_API void dpar_work_free(dpar_work *work);

/*
 * The gradient reducer: DDP's reducer for a framework with its own autograd: register the gradient buffers once, call
 * dpar_reducer_grad_ready() from the backward hook of each as soon as it holds its gradient, and
 * dpar_reducer_wait() before the optimizer step. Gradients are grouped in buckets in reverse order of registration
 * (register them in forward order: backward produces the last ones first), and each bucket is all-reduced on the
 * communicator's communication thread as soon as all its gradients are ready, while backward goes on. A gradient
 * never marked ready in a step counts as zero (a parameter that got no gradient needs no flag), and its buffer
 * receives the reduced value like the others. Every participant must register the same sizes in the same order.
 *
 * Between a step's first dpar_reducer_grad_ready() and its dpar_reducer_wait(), a ready buffer must not be written
 * and the communicator must not be used for other collectives. The functions of one reducer may be called from
 * several threads (they are serialised).
 */
typedef struct dpar_reducer dpar_reducer; /**< An opaque gradient reducer over one communicator. */

/** @brief Options of a reducer. */
typedef struct dpar_reducer_options {
  size_t size;               /**< sizeof(dpar_reducer_options) as the caller compiled it. */
  uint32_t version;          /**< #DPAR_REDUCER_OPTIONS_VERSION. */
  size_t first_bucket_bytes; /**< The first bucket (the last gradients) closes at this many bytes. 0: 1 MiB. */
  size_t bucket_cap_bytes;   /**< Later buckets close at this many bytes. 0: 25 MiB. SIZE_MAX: one bucket. */
  int32_t op;                /**< ::DPAR_SUM or ::DPAR_MEAN (default: the average over the participants, as DDP). */
  /**
   * Version 2: a communicator over the processes (dpar_comm_create_mpi()), or NULL (the default: the reducer sums
   * among its own communicator's participants). With one, the reducers of a group's members in several processes
   * sum over every member of every process, hierarchically: among the process's members (shared memory; on GPUs
   * NCCL or dpar's device reduction), then across the processes by member 0 (through host memory), then back to the
   * other members. Every member of every process passes the same processes' communicator of its own process; it is
   * shared, not owned (the reducer keeps it alive), and must not be used for other collectives during a step.
   */
  dpar_comm *processes;
  /** Version 2: how buckets cross the processes: a ::dpar_gradient_compression (default ::DPAR_COMPRESSION_NONE). */
  int32_t compression;
} dpar_reducer_options;
#define DPAR_REDUCER_OPTIONS_VERSION 2
#define DPAR_REDUCER_OPTIONS_INIT                                                                                  \
  {sizeof(dpar_reducer_options), DPAR_REDUCER_OPTIONS_VERSION, 0, 0, DPAR_MEAN, NULL, DPAR_COMPRESSION_NONE}
/**
 * @brief Fills @p opts with defaults: the layout of @p size bytes, sizeof(dpar_reducer_options) as the caller compiled
 * it, and no byte past it. ::DPAR_ERR_NOT_SUPPORTED for a layout newer than the library's. Call it as
 * dpar_reducer_options_init().
 */
DPAR_API dpar_status dpar_reducer_options_init_sized(dpar_reducer_options *opts, size_t size);
/**
 * @brief Fills @p opts with defaults: a macro that passes the caller's sizeof to dpar_reducer_options_init_sized(), so
 * that a newer libdpar writes the caller's layout. The function of this name, which programs built against dpar.h 0.4
 * and older call, writes dpar.h 0.4's layout; a table of functions (dpar_api.h) or a binding without C macros calls
 * the _sized one.
 */
DPAR_API dpar_status dpar_reducer_options_init(dpar_reducer_options *opts);
#define dpar_reducer_options_init(opts) dpar_reducer_options_init_sized((opts), sizeof(dpar_reducer_options))

/**
 * @brief Creates a reducer over @p comm for @p num_grads f32 gradient buffers in the memory of the communicator's
 * device (dpar_comm_device(): host memory, or a GPU's for a group made by dpar_comm_group_create_on_devices()).
 * On a GPU the reducer's copies and collectives are ordered on the communicator's stream: mark a gradient ready
 * once the work that computes it is queued there. The reducer keeps the communicator alive: either may be freed
 * first.
 * @param grads   The buffers, in the model's (forward) order; they must not overlap, and must stay valid until the
 *                reducer is freed.
 * @param counts  Elements of each buffer, each at least 1.
 * @param opts    Options, or NULL for defaults. With @p opts->processes and ::DPAR_MEAN, the creation of member
 *                0's reducer is a collective among the processes (it counts the members of every process): every
 *                process creates its reducers at the same point.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for NULLs, no buffer, an empty or overlapping buffer or bad options
 *         (a @p opts->processes that is not a valid communicator over host memory, an unknown compression).
 */
DPAR_API dpar_status dpar_reducer_create(dpar_reducer **out, dpar_comm *comm, float *const *grads,
                                         const size_t *counts, size_t num_grads, const dpar_reducer_options *opts);
/** @brief Frees a reducer (NULL is a no-op), after its buckets in flight finish. */
DPAR_API void dpar_reducer_free(dpar_reducer *reducer);
/** @brief The number of buckets. */
DPAR_API dpar_status dpar_reducer_num_buckets(size_t *out, const dpar_reducer *reducer);
/**
 * @brief Gradient @p index holds this step's value (the first call of a step starts it). Launches the buckets
 * this completes, in bucket order.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for an index out of range; ::DPAR_ERR_INVALID_STATE for a
 *         gradient already marked in this step. Neither changes the step.
 */
DPAR_API dpar_status dpar_reducer_grad_ready(dpar_reducer *reducer, size_t index);
/**
 * @brief Ends the step: reduces what is left and waits for every bucket. Every registered buffer then holds the
 * reduced gradient (sum or mean over the participants, and over every process's with @p opts->processes); on a GPU, for the work queued on the communicator's stream
 * after this call (the optimizer step). A step with no gradient marked is allowed (a participant with no data this
 * step): it contributes zeros.
 * @return ::DPAR_OK, or a collective's error (::DPAR_ERR_TIMEOUT, ::DPAR_ERR_MISMATCH, ::DPAR_ERR_REMOTE, ...),
 *         after which the buffers' content is unspecified; the next step starts afresh.
 */
DPAR_API dpar_status dpar_reducer_wait(dpar_reducer *reducer);
/**@}*/

/* ------------------------------------------------------------------------------------------------------------ */
/** @name Datasets
 * IDX files (MNIST, Fashion-MNIST), plain or gzip-compressed, and a seeded, shuffling batch loader. */
/**@{*/
typedef struct dpar_dataset dpar_dataset; /**< An opaque in-memory dataset of (f32 sample, i32 label). */
typedef struct dpar_loader dpar_loader;   /**< An opaque batch loader over a dataset. */

/**
 * @brief Reads an IDX image file and an IDX label file (each plain or .gz). Pixels become f32 in [0, 1].
 * A header claiming more data than the file can hold (its size, or 1032 times it for a .gz, deflate's largest
 * ratio) is refused before anything is allocated; the data is read into one buffer, never copied to grow.
 * @return ::DPAR_OK; ::DPAR_ERR_IO, also for a path that is not a regular file (a FIFO is refused at once);
 *         ::DPAR_ERR_CORRUPT for a bad magic, size or truncation; ::DPAR_ERR_MISMATCH when the two files hold
 *         different numbers of items.
 */
DPAR_API dpar_status dpar_dataset_load_idx(dpar_dataset **out, const char *images_path, const char *labels_path);
/** @brief Frees a dataset (NULL is a no-op). Loaders share its data, so they may be freed before or after it. */
DPAR_API void dpar_dataset_free(dpar_dataset *dataset);
/** @brief Number of samples, features per sample, and number of classes (max label + 1). Outputs may be NULL. */
DPAR_API dpar_status dpar_dataset_info(size_t *out_samples, size_t *out_features, size_t *out_classes,
                                       const dpar_dataset *dataset);
/**
 * @brief Standardises every feature: x = (x - mean) / std.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for a mean that is not finite or a std that is not positive;
 *         ::DPAR_ERR_INVALID_STATE while a loader of @p dataset is open (a loader on a device prepares the next
 *         batch on a thread of its own, so the change would race with it and yield a batch from before it):
 *         normalise before creating loaders, or free them first. The dataset is unchanged on every error.
 */
DPAR_API dpar_status dpar_dataset_normalize(dpar_dataset *dataset, float mean, float std);

/**
 * @brief Creates a loader that yields batches of @p batch_size (the last may be smaller unless @p drop_last).
 * @param shuffle   Boolean: draw a new permutation each epoch from @p seed and the epoch number.
 * @param drop_last Boolean: drop a last batch smaller than @p batch_size.
 */
DPAR_API dpar_status dpar_loader_create(dpar_loader **out, const dpar_dataset *dataset, size_t batch_size,
                                        int32_t shuffle, uint64_t seed, int32_t drop_last);
/** @brief Frees a loader (NULL is a no-op). */
DPAR_API void dpar_loader_free(dpar_loader *loader);
/** @brief Starts epoch @p epoch: the permutation is a function of (seed, epoch) alone. */
DPAR_API dpar_status dpar_loader_start_epoch(dpar_loader *loader, uint64_t epoch);
/** @brief Number of batches per epoch. */
DPAR_API dpar_status dpar_loader_num_batches(size_t *out, const dpar_loader *loader);
/**
 * @brief Makes the loader yield only part @p shard of @p num_shards of each batch: batch_size stays the global
 * batch, and shard s gets the s-th of num_shards contiguous, balanced slices of its rows (sizes differ by at most
 * one). Every process of a multi-process engine creates the same loader (same seed) and picks its own shard
 * (dpar_engine_processes()), as PyTorch's DistributedSampler does. A last batch with fewer rows than shards is
 * dropped. Takes effect from the next batch.
 * @return ::DPAR_ERR_INVALID_ARGUMENT unless shard < num_shards, or when num_shards exceeds the batch size.
 */
DPAR_API dpar_status dpar_loader_shard(dpar_loader *loader, size_t shard, size_t num_shards);
/**
 * @brief From the next batch on, yields batches in memory of @p device (for an engine's replica there: it takes
 * its rows as a view), each prepared while the caller still uses the one before: after dpar_loader_next() hands
 * out a batch, a thread of the loader's gathers the next one and, on a GPU, copies it there on a stream of its own,
 * beside the caller's training step. A CPU device gets host batches gathered ahead alike. The batches are those
 * the loader yields without it, bit for bit. A failure of that thread (device memory, a failed copy) is returned by
 * the next dpar_loader_next(). The batch before is rewritten as soon as dpar_loader_next() returns: work that reads
 * a batch on a stream of its own must be finished before the next dpar_loader_next() (an engine's calls return
 * with their work done).
 * @return ::DPAR_OK; ::DPAR_ERR_DEVICE where there is no GPU; ::DPAR_ERR_INVALID_ARGUMENT for a GPU index past the
 *         last GPU; ::DPAR_ERR_NOT_SUPPORTED for CUDA in a build without it; ::DPAR_ERR_OUT_OF_MEMORY. On failure
 *         the loader is unchanged.
 */
DPAR_API dpar_status dpar_loader_to_device(dpar_loader *loader, dpar_device device);
/**
 * @brief Moves to the next batch of the epoch: sets @p *out to 1, or to 0 at the end of the epoch. The batch is
 * then read with dpar_loader_inputs() and dpar_loader_labels().
 */
DPAR_API dpar_status dpar_loader_next(int32_t *out, dpar_loader *loader);
/**
 * @brief The current batch's (b, features) f32 inputs: borrowed from the loader, valid until its next call (the
 * same handle holds the next batch). NULL before the first batch, at the end of the epoch, or for a bad @p loader
 * (dpar_last_error() says which).
 */
DPAR_API const dpar_tensor *dpar_loader_inputs(const dpar_loader *loader);
/** @brief The current batch's (b) i32 labels, borrowed as dpar_loader_inputs() is. */
DPAR_API const dpar_tensor *dpar_loader_labels(const dpar_loader *loader);
/**@}*/

#ifdef __cplusplus
}
#endif

#endif /* DPAR_H */
