/**
 * @file dpar/comm.h
 * @brief Collectives on a framework's own buffers: communicators, groups, asynchronous work.
 * Part of dpar.h, which includes every topic's header and is the one to include; this one also compiles alone.
 */
#ifndef DPAR_COMM_H
#define DPAR_COMM_H

#include "common.h"

#ifdef __cplusplus
extern "C" {
#endif

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
/**@}*/

#ifdef __cplusplus
}
#endif

#endif /* DPAR_COMM_H */
