/**
 * @file dpar/data.h
 * @brief Datasets (IDX files) and the batch loader.
 * Part of dpar.h, which includes every topic's header and is the one to include; this one also compiles alone.
 */
#ifndef DPAR_DATA_H
#define DPAR_DATA_H

#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

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

#endif /* DPAR_DATA_H */
