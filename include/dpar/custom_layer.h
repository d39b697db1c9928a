/**
 * @file dpar/custom_layer.h
 * @brief Custom layers: layers whose forward and backward are the caller's callbacks.
 * Part of dpar.h, which includes every topic's header and is the one to include; this one also compiles alone.
 */
#ifndef DPAR_CUSTOM_LAYER_H
#define DPAR_CUSTOM_LAYER_H

#include "model.h"
#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------------------------------ */
/** @name Custom layers
 * Layers whose math is the caller's, appended to a model with dpar_model_add_custom(). */
/**@{*/
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
/**@}*/

#ifdef __cplusplus
}
#endif

#endif /* DPAR_CUSTOM_LAYER_H */
