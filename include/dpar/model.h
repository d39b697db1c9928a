/**
 * @file dpar/model.h
 * @brief Models: the sequence of layers that an engine copies to every device.
 * Part of dpar.h, which includes every topic's header and is the one to include; this one also compiles alone.
 */
#ifndef DPAR_MODEL_H
#define DPAR_MODEL_H

#include "common.h"

#ifdef __cplusplus
extern "C" {
#endif

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

/**
 * @brief Appends BatchNorm1d over the channels C = @p num_features of a (B, C) or (B, C, L) input, as
 * torch.nn.BatchNorm1d. Training mode normalises with the batch's mean and biased variance per channel and moves the
 * buffers running_mean and running_var toward the mean and the unbiased variance by @p momentum (and counts
 * num_batches_tracked); eval mode (dpar_engine_set_training()) normalises with running_mean and running_var.
 * With @p affine, a weight (ones) and a bias (zeros) per channel follow. On several devices each replica normalises
 * over its own chunk of the batch (as DataParallel and DistributedDataParallel); after every training-mode call every
 * replica's buffers are those of replica 0 of rank 0. Only CPU devices run it: on a GPU the step fails with
 * ::DPAR_ERR_NOT_SUPPORTED.
 * @param eps       Added to the variance; positive (PyTorch's default 1e-5).
 * @param momentum  In [0, 1] (PyTorch's default 0.1; its momentum=None is not supported).
 * @param affine    Nonzero for the weight and bias.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for a bad size, eps or momentum.
 */
DPAR_API dpar_status dpar_model_add_batchnorm1d(dpar_model *model, int64_t num_features, float eps, float momentum,
                                                int32_t affine);
/** @brief Appends BatchNorm2d over the channels of a (B, C, H, W) input, as torch.nn.BatchNorm2d; otherwise as
 * dpar_model_add_batchnorm1d(). */
DPAR_API dpar_status dpar_model_add_batchnorm2d(dpar_model *model, int64_t num_features, float eps, float momentum,
                                                int32_t affine);
/**
 * @brief Appends SyncBatchNorm over the channels of a (B, C), (B, C, L) or (B, C, H, W) input, as
 * torch.nn.SyncBatchNorm: in training mode the per-channel statistics (and, in backward, the sums the input's
 * gradient needs) are summed over every replica of every process of the engine, so that N devices train as one
 * device on the whole batch, also with uneven chunks or replicas given no rows. Outside an engine it is BatchNorm.
 * Arguments as dpar_model_add_batchnorm1d().
 */
DPAR_API dpar_status dpar_model_add_sync_batchnorm(dpar_model *model, int64_t num_features, float eps,
                                                   float momentum, int32_t affine);
/** @brief Turns every BatchNorm1d/2d layer of the model into SyncBatchNorm, keeping its parameters and buffers (as
 * torch.nn.SyncBatchNorm.convert_sync_batchnorm). */
DPAR_API dpar_status dpar_model_convert_sync_batchnorm(dpar_model *model);

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

/**
 * @brief The number of buffers: state of a layer that is not a parameter (BatchNorm's running_mean, running_var,
 * num_batches_tracked), never trained, reduced or counted among the parameters; saved in checkpoints.
 */
DPAR_API dpar_status dpar_model_num_buffers(size_t *out, const dpar_model *model);
/**
 * @brief The name of buffer @p index ("1.running_mean", as PyTorch's state_dict names it).
 * @return Borrowed from the model; valid until the model changes or is freed. NULL for a bad model or index, with
 *         dpar_last_error() saying why.
 */
DPAR_API const char *dpar_model_buffer_name(const dpar_model *model, size_t index);
/**
 * @brief The element type and shape of buffer @p index.
 * @param[out] out_dtype ::DPAR_F32 or ::DPAR_I64 (num_batches_tracked). May be NULL.
 * @param[out] out_shape Room for #DPAR_MAX_DIMS extents. May be NULL.
 * @param[out] out_ndim  0 for a scalar (one element), as PyTorch's num_batches_tracked. May be NULL.
 */
DPAR_API dpar_status dpar_model_buffer_info(int32_t *out_dtype, int64_t *out_shape, size_t *out_ndim,
                                            const dpar_model *model, size_t index);
/** @brief Copies buffer @p index into @p dst: @p count elements (exactly its size) of its dtype (float or int64_t). */
DPAR_API dpar_status dpar_model_get_buffer(void *dst, const dpar_model *model, size_t index, size_t count);
/** @brief Overwrites buffer @p index from @p src: @p count elements (exactly its size) of its dtype. */
DPAR_API dpar_status dpar_model_set_buffer(dpar_model *model, size_t index, const void *src, size_t count);
/**@}*/

#ifdef __cplusplus
}
#endif

#endif /* DPAR_MODEL_H */
