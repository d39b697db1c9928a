/**
 * @file dpar/reducer.h
 * @brief The gradient reducer: bucketed all-reduce of a framework's gradients, overlapped with its backward.
 * Part of dpar.h, which includes every topic's header and is the one to include; this one also compiles alone.
 */
#ifndef DPAR_REDUCER_H
#define DPAR_REDUCER_H

#include "comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------------------------------ */
/** @name The gradient reducer
 * DDP's reducer for a framework with its own autograd: register the gradient buffers once, call
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
/**@{*/
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
 * reduced gradient (sum or mean over the participants, and over every process's with @p opts->processes); on a
 * GPU, for the work queued on the communicator's stream after this call (the optimizer step). A step with no gradient marked is allowed (a participant with no data this
 * step): it contributes zeros.
 * @return ::DPAR_OK, or a collective's error (::DPAR_ERR_TIMEOUT, ::DPAR_ERR_MISMATCH, ::DPAR_ERR_REMOTE, ...),
 *         after which the buffers' content is unspecified; the next step starts afresh.
 */
DPAR_API dpar_status dpar_reducer_wait(dpar_reducer *reducer);
/**@}*/

#ifdef __cplusplus
}
#endif

#endif /* DPAR_REDUCER_H */
