/**
 * @file dpar/optimizer.h
 * @brief Optimizers and their options.
 * Part of dpar.h, which includes every topic's header and is the one to include; this one also compiles alone.
 */
#ifndef DPAR_OPTIMIZER_H
#define DPAR_OPTIMIZER_H

#include "common.h"

#ifdef __cplusplus
extern "C" {
#endif

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

#ifdef __cplusplus
}
#endif

#endif /* DPAR_OPTIMIZER_H */
