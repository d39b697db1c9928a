/**
 * @file dpar/engine.h
 * @brief The DataParallel engine: replicas, the training step, checkpoints, traces.
 * Part of dpar.h, which includes every topic's header and is the one to include; this one also compiles alone.
 */
#ifndef DPAR_ENGINE_H
#define DPAR_ENGINE_H

#include "model.h"
#include "optimizer.h"
#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------------------------------ */
/** @name The DataParallel engine
 * One worker thread per device, each holding a persistent replica of the model. A batch is split across devices
 * as torch.nn.DataParallel splits it (chunks of ceil(B/n) rows; the last may be smaller and trailing devices may
 * get none). Gradients are those of the mean loss over the whole batch, summed across devices by an all-reduce,
 * and every replica gets the same optimizer step (each worker computes it for its shard of the parameters, keeping
 * the optimizer's state for that shard alone, and writes it into every replica), so replicas stay bit-identical.
 * By default (::DPAR_REDUCTION_ALL_REDUCE) each process holds the whole state, sharded among its own replicas, and
 * only the gradients' all-reduce crosses the processes, as DDP. Under ::DPAR_REDUCTION_REDUCE_SCATTER and
 * ::DPAR_REDUCTION_ALL_REDUCE_SHARDED with mpirun, where every process has the same number of devices, the shards
 * span every replica of every process (ZeRO over the world: 1/(processes x devices) of the state each).
 *
 * Thread-safety: an engine may be called from several threads; calls are serialised by a lock inside it.
 * Callbacks (custom layers, the forward hook) run on the worker threads, concurrently across replicas; they must
 * not call their own engine's functions, which return ::DPAR_ERR_INVALID_STATE there (another engine, one created
 * in the callback for example, may be called and freed). */
/**@{*/
typedef struct dpar_engine dpar_engine; /**< An opaque DataParallel engine. */

/**
 * @brief Losses that the fused training step computes on every replica. Each takes the mean over the samples of
 * the whole batch (every replica's, every process's), never a mean of per-replica means.
 */
typedef enum dpar_loss {
  /** Softmax cross-entropy, PyTorch's nn.CrossEntropyLoss() as a GPT applies it to logits.view(-1, V) and
   *  targets.view(-1): an output (B, ..., V) with the classes on its LAST dimension (not PyTorch's (N, C, d1...)
   *  layout), every leading position one sample, against i32 targets (B, ...) of the output's leading shape. A target
   *  equal to ::DPAR_IGNORE_INDEX is no sample: no loss, no gradient, not counted in the mean. */
  DPAR_LOSS_CROSS_ENTROPY = 0,
  DPAR_LOSS_MSE = 1 /**< Mean squared error against f32 targets shaped as the output, mean over all. */
} dpar_loss;

/** The cross-entropy target that is ignored: PyTorch's default ignore_index (padding, prompt tokens). */
#define DPAR_IGNORE_INDEX (-100)

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
  /* Version 3: */
  double create_timeout_seconds; /**< How long creation waits for every process to create its engine (processes
                                 start at different times; a machine under load is slow to get there): the
                                 connection between the processes and their first exchanges. Then timeout_seconds
                                 holds. 0 (default): timeout_seconds. INFINITY for no limit. */
} dpar_engine_options;
#define DPAR_ENGINE_OPTIONS_VERSION 3
#define DPAR_ENGINE_OPTIONS_INIT                                                                                   \
  {sizeof(dpar_engine_options), DPAR_ENGINE_OPTIONS_VERSION, DPAR_DEVICE_CPU, 0, NULL, 0, -1, DPAR_LOSS_CROSS_ENTROPY, \
   0, 300.0, 1, 1, 0, 0, DPAR_PROCESSES_AUTO, 0.0}
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
 * @param[out] out_loss  The mean loss over the batch's samples (the global batch, with several processes); may be
 *                       NULL. NaN for a batch without samples (every target ::DPAR_IGNORE_INDEX), as PyTorch's 0/0;
 *                       its gradient is zero (PyTorch's is NaN), so the optimizer steps without poisoning the
 *                       weights (a momentum or weight decay still moves them, as any step does).
 * @param input          (B, features...) f32 (i32 indices (B) or (B, T) for a model whose input an Embedding reads:
 *                       each is checked on the host before the step) in host memory or in memory of the engine's
 *                       devices' kind. A replica whose device holds the input takes its rows as a view, without a
 *                       copy; the others copy theirs (from the host, or from the other GPU). A GPU input must be
 *                       complete when the call is made: synchronise the stream that wrote it.
 * @param target         Cross-entropy: i32 labels (B, ...) of the output's (B, ..., classes) leading shape, each
 *                       in [0, classes) or ::DPAR_IGNORE_INDEX; the mean divides by the targets that are not
 *                       ignored over the whole global batch. MSE: f32 shaped as the output. Where the input may be
 *                       (labels on a GPU are copied to the host for their range check).
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for NULLs, B = 0, shapes that do not fit the model or each other,
 *         labels or embedding indices out of range (naming the index and its position); errors from a worker
 *         (::DPAR_ERR_OUT_OF_MEMORY, a custom layer's status, ...).
 *         A batch that a replica's layers would refuse (a chunk of one row for a BatchNorm taking statistics) is
 *         refused before any replica changes. After a failure before the optimizer step the engine stays usable
 *         and nothing changed: its parameters, buffers (running statistics) and RNG streams are as before the call;
 *         otherwise it returns ::DPAR_ERR_INVALID_STATE from then on and must be recreated.
 */
DPAR_API dpar_status dpar_engine_train_step(float *out_loss, dpar_engine *engine, const dpar_tensor *input,
                                            const dpar_tensor *target);
/**
 * @brief Forward, loss and backward for one micro-batch, adding its gradient to the replicas' local gradients
 * without synchronising them (DDP's no_sync). dpar_engine_step() then all-reduces once and steps, so that several
 * micro-batches equal one batch of all their rows for a model whose rows are independent. A model with BatchNorm is
 * the exception, as in PyTorch: each micro-batch is normalised with its own statistics (and moves the running
 * statistics once), so its gradient is not that of one batch of all their rows.
 * @param[out] out_loss  The micro-batch's mean loss over its samples (NaN without any); may be NULL.
 */
DPAR_API dpar_status dpar_engine_accumulate(float *out_loss, dpar_engine *engine, const dpar_tensor *input,
                                            const dpar_tensor *target);
/**
 * @brief Synchronises the accumulated gradients and applies the optimizer step on every replica; then clears
 * the gradients. After dpar_engine_accumulate(), the gradient is that of the mean loss over all accumulated samples
 * (rows; cross-entropy's targets that are not ignored) of every process (zero without any); after dpar_engine_backward(), it is the sum of what backward produced (on every process).
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

/**
 * @brief Compresses gradient buckets on their way between processes, from the next step on. Within a process
 * they are always summed in f32 (threads share memory; there is nothing to save), so with one process this changes
 * nothing. Every process sets the same, before the same step: a process that differs makes that step fail with
 * ::DPAR_ERR_MISMATCH on every process (their collectives compare element types), and the engine must be recreated.
 * Engines start with ::DPAR_COMPRESSION_NONE. With the reduce dtype ::DPAR_BF16 (dpar_engine_set_reduce_dtype())
 * the whole reduction is bf16, across processes too, and this setting changes nothing until the reduce dtype is
 * ::DPAR_F32 again (it is kept).
 * @param compression A ::dpar_gradient_compression.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for an unknown @p compression.
 */
DPAR_API dpar_status dpar_engine_set_gradient_compression(dpar_engine *engine, int32_t compression);
/**
 * @brief The dtype gradient buckets are reduced in, from the next step on: PyTorch FSDP's
 * MixedPrecisionPolicy(reduce_dtype=...), DDP's bf16_compress_hook extended to the replicas of a process.
 *
 * ::DPAR_F32 (engines start with it): each bucket is summed in f32 within a process and crosses the processes as
 * dpar_engine_set_gradient_compression() says (f32, or the process's sum rounded to bf16 and summed in bf16).
 *
 * ::DPAR_BF16: the reduction is carried in bf16 throughout, whatever the compression setting says:
 *  1. each replica's local gradient bucket (the sum of its rows' gradients, times the loss scale) is rounded to
 *     bf16, to nearest even;
 *  2. the process's replicas sum them: on CPU devices (threads over shared memory) the bf16 values are added in f32
 *     in replica order (0, 1, ...) and the sum rounded to bf16 once, which is what a bf16 ring approximates (it
 *     rounds each partial sum) and moves the same bytes as f32 through shared memory; on GPUs NCCL's bf16
 *     all-reduce (reduce-scatter under ::DPAR_REDUCTION_REDUCE_SCATTER) carries it, half the bytes of f32;
 *  3. with several processes, the processes' bf16 sums are summed in bf16 across them (as the compression does:
 *     MPI adds in float and rounds each sum to bf16; NCCL natively);
 *  4. the result is widened to f32 (exactly) and multiplied in f32 by the engine's 1 / (the global batch's
 *     samples), once: clipping's norm, loss scaling's check and the optimizer read that f32 gradient.
 * Every replica of every process ends with the same bits, independent of thread timing, under every gradient
 * reduction (under ::DPAR_REDUCTION_REDUCE_SCATTER each replica's block holds the bits the all-reduce would). With
 * one device and one process, step 2 and 3 have nothing to add: the gradient is still rounded to bf16.
 *
 * Every process sets the same, before the same step. Changing it keeps the optimizer's state.
 * @param dtype ::DPAR_F32 or ::DPAR_BF16.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for another dtype (the message names it);
 * ::DPAR_ERR_NOT_SUPPORTED for ::DPAR_BF16 where the processes' link does not move bf16; the engine unchanged.
 */
DPAR_API dpar_status dpar_engine_set_reduce_dtype(dpar_engine *engine, int32_t dtype);
/** @brief The reduce dtype dpar_engine_set_reduce_dtype() set: ::DPAR_F32 or ::DPAR_BF16. */
DPAR_API dpar_status dpar_engine_reduce_dtype(int32_t *out, const dpar_engine *engine);

/**
 * @brief The reproducible mode: the same seed and the same global batches give bitwise-identical parameters and
 * losses on 1, 2, 3, 8 or any number of CPU devices, and under mpirun with any number of processes (each feeding
 * a whole number of micro-chunks, but the last), at some cost in speed (one forward and backward per micro-chunk).
 *
 * With @p micro_chunk_rows > 0, dpar_engine_train_step() (and dpar_engine_accumulate() followed by
 * dpar_engine_step()):
 *  1. cuts each process's batch into micro-chunks of @p micro_chunk_rows rows (the last one may be shorter),
 *     numbered across the processes in rank order; the micro-chunks do not depend on the device count;
 *  2. gives every device whole micro-chunks: DataParallel's split applied to the micro-chunk count (chunks of
 *     ceil(micro-chunks / devices), the last devices fewer or none), instead of the default split of the rows;
 *  3. runs forward, loss and backward once per micro-chunk, so a micro-chunk meets the same kernels on the same
 *     shapes whatever device holds it (the GEMM's threads are opts.blas_threads per device, whatever the count:
 *     keep it the same between runs); dropout draws from a stream keyed to the micro-chunk's global index and
 *     the step count, not to the device;
 *  4. sums the micro-chunks' gradients exactly: the devices agree on each parameter's largest exponent (a max
 *     all-reduce of one integer per parameter tensor), every micro-chunk's f32 gradient is converted to int64
 *     fixed point on that parameter's grid (2^(E - 51 + ceil(log2 micro-chunks)), rounded to nearest), the
 *     integers are summed over micro-chunks, devices and processes (exact, hence independent of the order), and
 *     the sum is scaled by the grid step over the global batch's samples (in double) and rounded to f32; the loss
 *     likewise from each micro-chunk's loss sum, added in micro-chunk order (in double);
 *  5. clips (over the whole reduced gradient, which every device holds) and steps the optimizer, whose
 *     elementwise arithmetic gives an element the same bits wherever the device's shard begins.
 * dpar_engine_accumulate() keeps its micro-chunks' gradients and numbers its micro-chunks on from the step's
 * earlier calls; dpar_engine_step() sums them all: batches accumulated in parts that are whole micro-chunks give the
 * bits of one dpar_engine_train_step() on the whole (the kept gradients take micro-chunks x parameters floats per
 * device until the step). The reduce dtype and the gradient compression do not apply while the mode is on
 * (nothing is summed in floating point). dpar_engine_backward() answers ::DPAR_ERR_NOT_SUPPORTED while it is on,
 * as does a step under another reduction than ::DPAR_REDUCTION_ALL_REDUCE; dpar_engine_forward() splits rows as always (its dropout
 * draws in training mode follow the device). BatchNorm normalises over each micro-chunk's rows (ghost batch
 * normalisation: a micro-chunk needs two rows or more), and its running statistics and counter move by every
 * micro-chunk's statistics in micro-chunk order on every device, as micro-batches run one after another on one
 * device would move them. SyncBatchNorm is refused (its sums over the devices follow the device count). Every
 * process sets the same. With several processes fed by dpar_loader_shard() (whose permutation is a function of the
 * seed and the epoch alone, so the global batches do not depend on the job), each process's balanced slice is a
 * whole number of micro-chunks when the batch size is a multiple of num_shards x @p micro_chunk_rows: choose one
 * that is for every process count to be compared (and drop_last, or a last batch that is too).
 * @param micro_chunk_rows Rows per micro-chunk; 0 turns the mode off (engines start with it off).
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for a negative count (the message names it);
 * ::DPAR_ERR_INVALID_STATE while gradients are pending (dpar_engine_accumulate(), dpar_engine_backward());
 * ::DPAR_ERR_NOT_SUPPORTED on GPU devices and for a model with SyncBatchNorm (the message names the node); the
 * engine unchanged.
 */
DPAR_API dpar_status dpar_engine_set_reproducible(dpar_engine *engine, int64_t micro_chunk_rows);
/** @brief The rows per micro-chunk dpar_engine_set_reproducible() set; 0 when the mode is off. */
DPAR_API dpar_status dpar_engine_reproducible(int64_t *out, const dpar_engine *engine);

/** @brief How each bucket of summed gradients reaches the replicas (dpar_engine_set_gradient_reduction()). */
typedef enum dpar_gradient_reduction {
  /**
   * Every replica receives the whole summed bucket (an all-reduce, as DDP). Each process holds the whole optimizer
   * state, sharded among its own replicas, so that between processes only the all-reduce moves: DDP's bytes.
   * Clipping's norm is computed over the whole gradient on every replica.
   */
  DPAR_REDUCTION_ALL_REDUCE = 0,
  /**
   * Each replica receives only its block of every bucket (a reduce-scatter: ZeRO stage 2, as Megatron-LM's
   * distributed optimizer shards buckets), which is all its optimizer steps: less data moved and written. Under
   * mpirun, where every process has the same device count, the optimizer's shards span every process (1/(processes
   * x devices) of the state each) and the reduce-scatter and the parameters' all-gather are hierarchical: among a
   * process's replicas, then across the processes between the replicas of one index, each on its own link; the
   * bytes between processes are the all-reduce's. Clipping's norm is summed from the blocks. Where the shards stay
   * within each process (different device counts), a bucket is summed whole across the processes.
   */
  DPAR_REDUCTION_REDUCE_SCATTER = 1,
  /**
   * The all-reduce, with the optimizer's shards spanning every process as under ::DPAR_REDUCTION_REDUCE_SCATTER
   * (ZeRO stage 1 over every process): each replica steps its block and the parameters' all-gather crosses the
   * processes. It saves the optimizer memory ZeRO-2 saves, but moves about 1.5x the bytes between processes (the
   * all-reduce's plus the all-gather's); ::DPAR_REDUCTION_REDUCE_SCATTER gives the same memory at the all-reduce's
   * bytes. With one process, or where the shards cannot span the processes, it is ::DPAR_REDUCTION_ALL_REDUCE.
   */
  DPAR_REDUCTION_ALL_REDUCE_SHARDED = 2
} dpar_gradient_reduction;
/**
 * @brief Chooses how gradient buckets are reduced, from the next step on. Each way each replica's optimizer steps
 * its block of every bucket and an all-gather puts the blocks together, so the replicas stay bit-identical:
 * switching between steps is allowed, and without clipping all give the same bits (across more than two processes,
 * where MPI adds the processes' sums in the same order for all). Where the new reduction's optimizer shards lie
 * otherwise across the processes (::DPAR_REDUCTION_ALL_REDUCE against the other two, under mpirun), the optimizer's
 * state is gathered and cut along the new shards: a collective, which every process calls at the same point with
 * the same @p reduction. Engines start with ::DPAR_REDUCTION_ALL_REDUCE.
 * @param reduction A ::dpar_gradient_reduction.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for an unknown @p reduction; ::DPAR_ERR_INVALID_STATE where the
 * shards would move while gradients are pending (call dpar_engine_step() or dpar_engine_zero_grad() first).
 */
DPAR_API dpar_status dpar_engine_set_gradient_reduction(dpar_engine *engine, int32_t reduction);
/**
 * @brief Excludes biases and normalisation layers' weights and biases from weight decay, from the next step on:
 * the parameters for which dpar_model_param_decays() gives 0 are stepped with weight_decay 0 and all others with
 * the optimizer's, as two PyTorch parameter groups would (SGD's and Adam's L2 term, AdamW's decoupled decay alike).
 * Engines start with it off: every parameter decays, as one parameter group. The optimizer's state is unchanged,
 * and so are checkpoints: they do not record the setting, and loading one keeps the engine's. Every process sets
 * the same.
 * @param exclude_biases_and_norms 1: exclude them; 0: decay every parameter.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for a value other than 0 or 1 or a bad @p engine.
 */
DPAR_API dpar_status dpar_engine_set_weight_decay_exclusion(dpar_engine *engine, int32_t exclude_biases_and_norms);
/**
 * @brief Mixed precision, as torch.autocast's policy: from the next call on, linear layers, convolutions and
 * attention compute on @p compute_dtype operands and write f32. ::DPAR_BF16: each layer rounds its input to bf16 and reads
 * the step's bf16 copy of its weights (made from the f32 masters at the first forward after they change, not once
 * per use), its products are exact and accumulated in f32, and its bias, epilogue and gradients are f32. Its output
 * is f32, except where only linear layers read it (a hidden layer of an MLP, after a ReLU or none): there it is
 * kept in bf16, the f32 result rounded once, as autocast keeps it (half the bytes held for backward; the reader
 * would round it alike; on the CPU, not yet on CUDA). A GELU after a linear layer runs, as under autocast, on the
 * linear's output rounded to bf16 and writes its own output rounded, both kept in bf16 (on the CPU; on CUDA, f32),
 * and a LayerNorm whose output only linear layers read writes it rounded (computed in f32: the bits they would
 * round it to). Scaled dot-product attention reads q, k and v rounded to bf16 (kept so for backward; a packed
 * q|k|v projection that only attention reads is written in bf16), rounds its softmax weights to bf16 before their
 * product with v and keeps the softmax, its output and the gradients f32 (on the CPU and on CUDA). Elsewhere autocast rounds the output to bf16 and dpar keeps it f32, within bf16's rounding of
 * autocast's. Everything else stays f32:
 * master parameters, gradients and their reduction, the optimizer and its state, checkpoints (f32, loadable under
 * any precision), normalisation, activation functions, losses. ::DPAR_F16 is the same policy in IEEE half
 * (torch.autocast's float16; attention stays f32 under it): operands rounded to f16 (to nearest even), products exact and accumulated in f32,
 * results f32. f16 keeps three more significant bits than bf16 but overflows above 65504: a gradient rounded to
 * f16 becomes infinite unless the loss is scaled into range, so train f16 with dpar_engine_set_loss_scaling(),
 * which skips the steps whose gradients overflowed and backs the scale off (bf16 has f32's range and needs none).
 * ::DPAR_F32 (the default) computes everything in f32. Every process sets the same.
 * @param compute_dtype ::DPAR_F32, ::DPAR_BF16 or ::DPAR_F16.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for another dtype; ::DPAR_ERR_NOT_SUPPORTED where a device lacks a
 * kernel in that dtype, the engine unchanged. The message names the node, the kernel and why: bf16 on a CPU
 * without AVX512-BF16 or AMX (it names the CPU's instruction set); f16 on any CPU, since the oneDNN that dpar's
 * CPU backend is built on (2.6) has no f16 GEMM or convolution for CPUs (f16 runs on CUDA devices).
 */
DPAR_API dpar_status dpar_engine_set_precision(dpar_engine *engine, int32_t compute_dtype);
/** @brief The compute dtype dpar_engine_set_precision() set: ::DPAR_F32, ::DPAR_BF16 or ::DPAR_F16. */
DPAR_API dpar_status dpar_engine_precision(int32_t *out, const dpar_engine *engine);
/**
 * @brief Lets f32 GEMMs and convolutions round their operands to TF32 (10-bit mantissa, f32 accumulation) on
 * devices that have it, as torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32; off by
 * default (strict f32). CPU devices have no TF32 and compute in f32 either way.
 * @param allow 1: allow; 0: strict f32.
 * @param has_tf32 Optional (may be NULL): receives 1 where every replica's device has TF32, else 0.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for a value other than 0 or 1.
 */
DPAR_API dpar_status dpar_engine_set_allow_tf32(dpar_engine *engine, int32_t allow, int32_t *has_tf32);
/** @brief The number of optimizer steps taken (a step skipped by loss scaling is not one). */
DPAR_API dpar_status dpar_engine_step_count(size_t *out, const dpar_engine *engine);

/**
 * @brief Dynamic loss scaling from the next step on, as torch.amp.GradScaler(init_scale, growth_factor,
 * backoff_factor, growth_interval): for f16 (or any narrow) gradients. The loss's gradient in
 * dpar_engine_train_step() and dpar_engine_accumulate(), and the grad_output of dpar_engine_backward(), are
 * multiplied by the scale (the losses returned are not). Once the gradient is reduced, the step checks it for inf
 * and NaN over every replica of every process, so that all take the same decision. One found: the step is skipped
 * (no optimizer step: parameters, optimizer state and dpar_engine_step_count() stay as they were, the gradient is
 * dropped), dpar_engine_last_step_skipped() says so, and the scale is multiplied by @p backoff_factor. Otherwise the
 * gradient is unscaled (exactly, for a power-of-two scale: training is then bit for bit that without scaling)
 * before clipping and the step, and after @p growth_interval such steps in a row the scale is multiplied by
 * @p growth_factor. Setting it starts over from @p init_scale. Checkpoints saved with it on hold the scaler's state
 * and settings, and loading one restores them (turning scaling on); loading one saved without it keeps the
 * engine's scaler. Engines start with it off. Every process sets the same, before the same step.
 * @param init_scale The first scale (PyTorch's default: 65536); 0 turns loss scaling off.
 * @param growth_factor > 1 (PyTorch's default: 2).
 * @param backoff_factor In (0, 1) (PyTorch's default: 0.5).
 * @param growth_interval >= 1 (PyTorch's default: 2000).
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT naming the value for a negative or non-finite @p init_scale, a
 * @p growth_factor <= 1 or non-finite, a @p backoff_factor outside (0, 1), a @p growth_interval < 1 (nothing
 * changes); ::DPAR_ERR_INVALID_STATE while accumulated gradients are pending (they were scaled by the old scale).
 */
DPAR_API dpar_status dpar_engine_set_loss_scaling(dpar_engine *engine, float init_scale, float growth_factor,
                                                  float backoff_factor, int64_t growth_interval);
/** @brief The current loss scale; 1 with loss scaling off (as GradScaler.get_scale() of a disabled scaler). */
DPAR_API dpar_status dpar_engine_loss_scale(float *out, const dpar_engine *engine);
/**
 * @brief 1 if the last step taken with loss scaling on was skipped because its gradient held inf or NaN, else 0
 * (also before any such step).
 */
DPAR_API dpar_status dpar_engine_last_step_skipped(int32_t *out, const dpar_engine *engine);

/**
 * @brief Each replica's mean loss over its own chunk's samples (its targets that are not ignored) in the last
 * training step or accumulate, as torch.nn.DataParallel returns one loss per device; NaN for replicas that got no
 * rows or no samples.
 * @param capacity Entries in @p out; at least the number of replicas.
 */
DPAR_API dpar_status dpar_engine_replica_losses(float *out, const dpar_engine *engine, size_t capacity);

/**
 * @brief A replica's parameters, flattened in dpar_model_param_info() order, into @p dst.
 * @param count  Exactly the model's number of parameter elements.
 */
DPAR_API dpar_status dpar_engine_get_params(float *dst, dpar_engine *engine, size_t replica, size_t count);
/**
 * @brief A replica's buffer @p index (dpar_model_buffer_info() order and dtype) into @p dst. After every
 * training-mode call every replica holds replica 0's (of rank 0).
 * @param count  Exactly the buffer's number of elements (of its dtype: float or int64_t).
 */
DPAR_API dpar_status dpar_engine_get_buffer(void *dst, dpar_engine *engine, size_t replica, size_t index,
                                            size_t count);

/**
 * @brief The bytes replica @p replica's device holds now, and the most it held at once (torch.cuda's
 * memory_allocated and max_memory_allocated, for CPU and CUDA devices alike).
 * What is counted is dpar's own tensors on that device: parameters, gradients, the optimizer's state, activations
 * kept for backward, and scratch buffers; not the workspaces oneDNN, cuBLAS, cuDNN or NCCL allocate for
 * themselves, not memory the caller lends (dpar_tensor_wrap_host(), dpar_tensor_from_dlpack()), and not the pinned
 * host buffers a GPU's copies go through. The count is the device's, not the engine's: replicas or engines that
 * share a device (two engines on cpu:0, two replicas on one GPU) count together, with any tensor the caller made
 * there (dpar_tensor_create()); each replica of a CPU engine has a virtual device of its own (cpu:0, cpu:1, ...),
 * counted apart. The peak runs from the process's start or the device's last dpar_engine_reset_peak_memory(), as
 * torch's does: creating an engine resets no peak (that would reset other engines' on the device), so reset it
 * before the stretch to measure. With several processes, @p replica is one of this process's replicas. Like every
 * engine call it waits for a call in flight on the same engine; read while another engine on the device runs, the
 * figures are a moment's.
 * @param allocated_bytes Receives the bytes held now; may be NULL.
 * @param peak_bytes Receives the peak; may be NULL. Not both NULL.
 * @param replica Below dpar_engine_num_replicas().
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for both pointers NULL or @p replica out of range (the message
 * names it and the number of replicas), nothing written.
 */
DPAR_API dpar_status dpar_engine_memory_stats(int64_t *allocated_bytes, int64_t *peak_bytes,
                                              const dpar_engine *engine, size_t replica);
/**
 * @brief Starts the peak of replica @p replica's device again from what it holds now (torch.cuda's
 * reset_peak_memory_stats): for every replica and engine sharing that device.
 * @return ::DPAR_OK; ::DPAR_ERR_INVALID_ARGUMENT for @p replica out of range, nothing reset.
 */
DPAR_API dpar_status dpar_engine_reset_peak_memory(dpar_engine *engine, size_t replica);

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

#ifdef __cplusplus
}
#endif

#endif /* DPAR_ENGINE_H */
