// In-memory classification datasets and a seeded, shuffling batch loader.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tensor/tensor.h"

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
  void normalize(float mean, float std);

 private:
  std::vector<float> inputs_;  // (size, features)
  std::vector<int32_t> labels_;
  size_t features_ = 0;
  size_t classes_ = 0;
};

class Loader {
 public:
  // The loader shares the dataset, which therefore lives as long as either of them.
  Loader(std::shared_ptr<const Dataset> dataset, size_t batch_size, bool shuffle, uint64_t seed, bool drop_last);

  size_t num_batches() const;
  // The permutation of epoch e is a function of (seed, e) alone: restarting an epoch replays it.
  void start_epoch(uint64_t epoch);
  // Fills the next batch; false at the end of the epoch. The tensors stay valid until the next call.
  bool next(Tensor& inputs, Tensor& labels);
  // From the next batch on, yields only slice `shard` of `num_shards` balanced, contiguous slices of each batch;
  // a last batch with fewer rows than shards is dropped (every shard gets at least one row).
  void set_shard(size_t shard, size_t num_shards);

 private:
  std::shared_ptr<const Dataset> owner_;
  const Dataset& dataset_;
  size_t batch_size_;
  bool shuffle_, drop_last_;
  uint64_t seed_;
  std::vector<uint32_t> order_;
  size_t cursor_ = 0;
  size_t shard_ = 0, num_shards_ = 1;
  Tensor inputs_, labels_;  // capacity batch_size rows; next() returns views
};

}  // namespace dpar::io
