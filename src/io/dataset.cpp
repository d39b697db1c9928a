#include "io/dataset.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "common/error.h"
#include "common/random.h"
#include "io/idx.h"

namespace dpar::io {

Dataset Dataset::load_idx(const std::string& images_path, const std::string& labels_path) {
  IdxArray images = read_idx_u8(images_path);
  IdxArray labels = read_idx_u8(labels_path);
  DPAR_ENFORCE(images.dims.size() >= 1, DPAR_ERR_CORRUPT, images_path, ": has no dimensions");
  DPAR_ENFORCE(labels.dims.size() == 1, DPAR_ERR_CORRUPT, labels_path, ": labels must be 1-D, got ",
               labels.dims.size(), " dimensions");
  DPAR_ENFORCE(images.dims[0] == labels.dims[0], DPAR_ERR_MISMATCH, images_path, " holds ", images.dims[0],
               " items but ", labels_path, " holds ", labels.dims[0]);
  Dataset d;
  const size_t n = static_cast<size_t>(images.dims[0]);
  d.features_ = n ? images.data.size() / n : 0;
  DPAR_ENFORCE(n > 0 && d.features_ > 0, DPAR_ERR_CORRUPT, images_path, ": holds no samples");
  d.inputs_.resize(images.data.size());
  for (size_t i = 0; i < images.data.size(); ++i) d.inputs_[i] = static_cast<float>(images.data[i]) / 255.0f;
  d.labels_.assign(labels.data.begin(), labels.data.end());
  d.classes_ = static_cast<size_t>(*std::max_element(d.labels_.begin(), d.labels_.end())) + 1;
  return d;
}

void Dataset::normalize(float mean, float std) {
  DPAR_CHECK_ARG(std::isfinite(mean), "mean: must be finite");
  DPAR_CHECK_ARG(std::isfinite(std) && std > 0.0f, "std: ", std, " must be positive");
  const float inv = 1.0f / std;
  for (float& x : inputs_) x = (x - mean) * inv;
}

Loader::Loader(std::shared_ptr<const Dataset> owner, size_t batch_size, bool shuffle, uint64_t seed, bool drop_last)
    : owner_(std::move(owner)), dataset_(*owner_), batch_size_(batch_size), shuffle_(shuffle), drop_last_(drop_last),
      seed_(seed) {
  const Dataset& dataset = dataset_;
  DPAR_CHECK_ARG(batch_size >= 1, "batch_size: must be at least 1");
  DPAR_CHECK_ARG(!drop_last || batch_size <= dataset.size(), "batch_size: ", batch_size,
                 " exceeds the dataset's ", dataset.size(), " samples with drop_last");
  const int64_t rows = static_cast<int64_t>(std::min(batch_size, dataset.size()));
  inputs_ = Tensor::empty(DType::kF32, Shape{rows, static_cast<int64_t>(dataset.features())}, Device{});
  labels_ = Tensor::empty(DType::kI32, Shape{rows}, Device{});
  start_epoch(0);
}

size_t Loader::num_batches() const {
  const size_t n = dataset_.size(), tail = n % batch_size_;
  return n / batch_size_ + (!drop_last_ && tail != 0 && tail >= num_shards_ ? 1 : 0);
}

void Loader::set_shard(size_t shard, size_t num_shards) {
  DPAR_CHECK_ARG(num_shards >= 1 && shard < num_shards, "shard: ", shard, " must be below num_shards (",
                 num_shards, ")");
  DPAR_CHECK_ARG(num_shards <= batch_size_, "num_shards: ", num_shards, " exceeds the batch size ", batch_size_,
                 ": some shards would get no rows");
  shard_ = shard;
  num_shards_ = num_shards;
}

void Loader::start_epoch(uint64_t epoch) {
  order_.resize(dataset_.size());
  std::iota(order_.begin(), order_.end(), 0u);
  if (shuffle_) {
    // Fisher-Yates with a stream derived from (seed, epoch).
    Rng rng(derive_seed(seed_, epoch));
    for (size_t i = order_.size(); i > 1; --i) std::swap(order_[i - 1], order_[rng.below(i)]);
  }
  cursor_ = 0;
}

bool Loader::next(Tensor& inputs, Tensor& labels) {
  const size_t left = dataset_.size() - cursor_;
  if (left == 0 || (drop_last_ && left < batch_size_)) return false;
  const size_t global_rows = std::min(batch_size_, left);
  if (global_rows < num_shards_) return false;
  // This shard's slice: sizes differ by at most one, the larger ones first.
  const size_t base = global_rows / num_shards_, extra = global_rows % num_shards_;
  const size_t first = cursor_ + shard_ * base + std::min(shard_, extra);
  const size_t rows = base + (shard_ < extra ? 1 : 0);
  const size_t f = dataset_.features();
  float* x = inputs_.f32();
  int32_t* y = labels_.i32();
  for (size_t i = 0; i < rows; ++i) {
    const uint32_t s = order_[first + i];
    std::memcpy(x + i * f, dataset_.sample(s), f * sizeof(float));
    y[i] = dataset_.label(s);
  }
  cursor_ += global_rows;
  inputs = inputs_.rows(0, static_cast<int64_t>(rows));
  labels = labels_.rows(0, static_cast<int64_t>(rows));
  return true;
}

}  // namespace dpar::io
