// In-memory classification datasets and a seeded, shuffling batch loader.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace dpar {
class Backend;
class Stream;
}  // namespace dpar

namespace dpar::io {

class Dataset {
 public:
  // Reads an IDX image file and label file (plain or .gz); pixels become f32 in [0, 1].
  static Dataset load_idx(const std::string& images_path, const std::string& labels_path);

  size_t size() const { return labels_.size(); }
  size_t features() const { return features_; }
  size_t classes() const { return classes_; }
  const float* sample(size_t i) const { return inputs_.data() + i * features_; }
  int32_t label(size_t i) const { return labels_[i]; }
  // x = (x - mean) / std for every feature. Refused (Status::kInvalidState) while a loader of this dataset is
  // open: a loader reads the samples on a thread of its own (one batch ahead), so changing them under it would
  // race, and give a batch prepared before the change. Checked and done under the lock loaders register with.
  void normalize(float mean, float std);

  // A loader registers for its lifetime; normalize() is refused while any is registered.
  void attach_loader() const;
  void detach_loader() const;

 private:
  struct Users {
    std::mutex mutex;
    size_t loaders = 0;
  };
  std::unique_ptr<Users> users_ = std::make_unique<Users>();  // behind a pointer: a Dataset stays movable
  std::vector<float> inputs_;  // (size, features)
  std::vector<int32_t> labels_;
  size_t features_ = 0;
  size_t classes_ = 0;
};

// Batches of a dataset, in the order of a seeded permutation per epoch.
//
// Ahead of the caller (set_device): the loader yields batches in memory of a device, and prepares each one while
// the caller still uses the one before. After next() hands out batch k, a thread of the loader's gathers batch k+1
// into host memory and, for a device that is not the host, copies it there on a stream of its own and waits for
// that copy; so on a GPU the copy runs beside the caller's training step, and the next next() finds the batch
// already in place. Two slots alternate: the worker writes the one the caller does not hold. Whatever changes
// what the next batch is (start_epoch, set_shard) waits for the worker and discards what it prepared; a failure
// on the worker's side (device memory, a failed copy) is thrown by the next next().
class Loader {
 public:
  // The loader shares the dataset, which therefore lives as long as either of them.
  Loader(std::shared_ptr<const Dataset> dataset, size_t batch_size, bool shuffle, uint64_t seed, bool drop_last);
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  size_t num_batches() const;
  // The permutation of epoch e is a function of (seed, e) alone: restarting an epoch replays it.
  void start_epoch(uint64_t epoch);
  // Fills the next batch; false at the end of the epoch. The tensors stay valid until the next call.
  bool next(Tensor& inputs, Tensor& labels);
  // From the next batch on, yields only slice `shard` of `num_shards` balanced, contiguous slices of each batch;
  // a last batch with fewer rows than shards is dropped (every shard gets at least one row).
  void set_shard(size_t shard, size_t num_shards);
  // From the next batch on, yields batches in memory of `device`, prepared one batch ahead (see above).
  void set_device(Device device);
  Device device() const { return device_; }

 private:
  // Where the batch starting at `cursor` lies: its rows, the first of them in the permutation, and the cursor
  // after it. rows == 0: no batch (the end of the epoch).
  struct Plan {
    size_t rows = 0, first = 0, next_cursor = 0;
  };
  Plan plan(size_t cursor) const;
  // Copies a planned batch's samples and labels into host memory.
  void gather(const Plan& p, float* x, int32_t* y) const;

  struct Slot;
  struct Ahead;
  // Waits until the worker is idle (no batch in preparation), and throws its failure, if any.
  void settle();
  // Waits until the worker is idle and throws away what it prepared, failure included (the next batch is no
  // longer the one it holds).
  void discard();
  // Waits until the worker is idle and takes its failure; forgets the prepared batches with `discard` or a failure.
  std::exception_ptr settle_and_take_error(bool discard);
  // The worker thread: prepares the slots the caller hands it, until it is stopped.
  void work(Ahead& w, Device device, Backend& backend);
  // Gathers the batch planned from `cursor` into a slot, and copies it on `stream` to the device if there is one.
  void prepare(Slot& slot, Stream* stream, size_t cursor) const;
  // Ends the worker, after the batch it is preparing (if any).
  void stop_worker();

  std::shared_ptr<const Dataset> owner_;
  const Dataset& dataset_;
  size_t batch_size_;
  bool shuffle_, drop_last_;
  uint64_t seed_;
  std::vector<uint32_t> order_;
  size_t cursor_ = 0;
  size_t shard_ = 0, num_shards_ = 1;
  Device device_;
  Tensor inputs_, labels_;       // capacity batch_size rows on the host; next() returns views (without set_device)
  std::unique_ptr<Ahead> ahead_;  // with set_device
};

}  // namespace dpar::io
