#include "io/dataset.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <numeric>
#include <thread>
#include <utility>

#include "backend/backend.h"
#include "common/error.h"
#include "common/random.h"
#include "io/idx.h"

namespace dpar::io {

Dataset Dataset::load_idx(const std::string& images_path, const std::string& labels_path) {
  IdxArray images = read_idx_u8(images_path);
  IdxArray labels = read_idx_u8(labels_path);
  DPAR_ENFORCE(images.dims.size() >= 1, Status::kCorrupt, images_path, ": has no dimensions");
  DPAR_ENFORCE(labels.dims.size() == 1, Status::kCorrupt, labels_path, ": labels must be 1-D, got ",
               labels.dims.size(), " dimensions");
  DPAR_ENFORCE(images.dims[0] == labels.dims[0], Status::kMismatch, images_path, " holds ", images.dims[0],
               " items but ", labels_path, " holds ", labels.dims[0]);
  Dataset d;
  const size_t n = static_cast<size_t>(images.dims[0]);
  d.features_ = n ? images.data.size() / n : 0;
  DPAR_ENFORCE(n > 0 && d.features_ > 0, Status::kCorrupt, images_path, ": holds no samples");
  d.inputs_.resize(images.data.size());
  for (size_t i = 0; i < images.data.size(); ++i) d.inputs_[i] = static_cast<float>(images.data[i]) / 255.0f;
  d.labels_.assign(labels.data.begin(), labels.data.end());
  d.classes_ = static_cast<size_t>(*std::max_element(d.labels_.begin(), d.labels_.end())) + 1;
  return d;
}

void Dataset::normalize(float mean, float std) {
  DPAR_CHECK_ARG(std::isfinite(mean), "mean: must be finite");
  DPAR_CHECK_ARG(std::isfinite(std) && std > 0.0f, "std: ", std, " must be positive");
  std::lock_guard<std::mutex> lock(users_->mutex);
  DPAR_ENFORCE(users_->loaders == 0, Status::kInvalidState, "dataset: ", users_->loaders,
               " loader(s) of it are open; normalise before creating a loader, or free its loaders first (a "
               "loader prepares batches ahead of the caller, and would race with the change)");
  const float inv = 1.0f / std;
  for (float& x : inputs_) x = (x - mean) * inv;
}

void Dataset::attach_loader() const {
  std::lock_guard<std::mutex> lock(users_->mutex);
  users_->loaders++;
}

void Dataset::detach_loader() const {
  std::lock_guard<std::mutex> lock(users_->mutex);
  users_->loaders--;
}

// ---- One batch ahead ---------------------------------------------------------------------------------------------
namespace {
constexpr size_t kNothingPrepared = SIZE_MAX;  // a slot's cursor while it holds no prepared batch
}  // namespace

struct Loader::Slot {
  Tensor host_x, host_y;  // where the worker gathers: the batch itself when the device is the host
  Tensor dev_x, dev_y;    // the batch on a device that is not the host
  size_t cursor = kNothingPrepared;  // the cursor the batch was planned from
  Plan plan;
};

struct Loader::Ahead {
  Slot slots[2];
  int held = -1;                    // the slot whose batch the caller holds
  std::unique_ptr<Stream> stream;   // the worker's copies (a device that is not the host)
  std::mutex mutex;
  std::condition_variable changed;
  int job = -1;  // the slot the worker is to prepare, from job_cursor
  size_t job_cursor = 0;
  bool busy = false, stop = false;
  std::exception_ptr error;  // the worker's failure, for the next next()
  std::thread thread;
};

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
  dataset.attach_loader();  // last: a constructor that throws has no destructor to detach
}

Loader::~Loader() {
  stop_worker();
  dataset_.detach_loader();
}

void Loader::stop_worker() {
  if (!ahead_) return;
  {
    std::lock_guard<std::mutex> lock(ahead_->mutex);
    ahead_->stop = true;
  }
  ahead_->changed.notify_all();
  ahead_->thread.join();
  ahead_.reset();
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
  discard();
  shard_ = shard;
  num_shards_ = num_shards;
}

void Loader::start_epoch(uint64_t epoch) {
  discard();
  order_.resize(dataset_.size());
  std::iota(order_.begin(), order_.end(), 0u);
  if (shuffle_) {
    // Fisher-Yates with a stream derived from (seed, epoch).
    Rng rng(derive_seed(seed_, epoch));
    for (size_t i = order_.size(); i > 1; --i) std::swap(order_[i - 1], order_[rng.below(i)]);
  }
  cursor_ = 0;
}

Loader::Plan Loader::plan(size_t cursor) const {
  const size_t left = dataset_.size() - cursor;
  if (left == 0 || (drop_last_ && left < batch_size_)) return {};
  const size_t global_rows = std::min(batch_size_, left);
  if (global_rows < num_shards_) return {};
  // This shard's slice: sizes differ by at most one, the larger ones first.
  const size_t base = global_rows / num_shards_, extra = global_rows % num_shards_;
  Plan p;
  p.first = cursor + shard_ * base + std::min(shard_, extra);
  p.rows = base + (shard_ < extra ? 1 : 0);
  p.next_cursor = cursor + global_rows;
  return p;
}

void Loader::gather(const Plan& p, float* x, int32_t* y) const {
  const size_t f = dataset_.features();
  for (size_t i = 0; i < p.rows; ++i) {
    const uint32_t s = order_[p.first + i];
    std::memcpy(x + i * f, dataset_.sample(s), f * sizeof(float));
    y[i] = dataset_.label(s);
  }
}

bool Loader::next(Tensor& inputs, Tensor& labels) {
  if (!ahead_) {
    const Plan p = plan(cursor_);
    if (p.rows == 0) return false;
    gather(p, inputs_.f32(), labels_.i32());
    cursor_ = p.next_cursor;
    inputs = inputs_.rows(0, static_cast<int64_t>(p.rows));
    labels = labels_.rows(0, static_cast<int64_t>(p.rows));
    return true;
  }
  Ahead& a = *ahead_;
  const int s = a.held < 0 ? 0 : a.held ^ 1;
  // Hands a slot to the worker (idle: settled) and returns at once.
  auto launch = [&](int slot, size_t cursor) {
    {
      std::lock_guard<std::mutex> lock(a.mutex);
      a.job = slot;
      a.job_cursor = cursor;
      a.busy = true;
    }
    a.changed.notify_all();
  };
  settle();
  if (a.slots[s].cursor != cursor_) {  // not prepared ahead (the first batch, or after a change): now
    launch(s, cursor_);
    settle();
  }
  Slot& slot = a.slots[s];
  if (slot.plan.rows == 0) return false;
  cursor_ = slot.plan.next_cursor;
  a.held = s;
  const auto rows = static_cast<int64_t>(slot.plan.rows);
  const bool host = device_.is_host();
  inputs = (host ? slot.host_x : slot.dev_x).rows(0, rows);
  labels = (host ? slot.host_y : slot.dev_y).rows(0, rows);
  launch(s ^ 1, cursor_);  // the next batch, while the caller uses this one
  return true;
}

std::exception_ptr Loader::settle_and_take_error(bool discard) {
  Ahead& a = *ahead_;
  std::unique_lock<std::mutex> lock(a.mutex);
  a.changed.wait(lock, [&] { return !a.busy; });
  std::exception_ptr error = std::exchange(a.error, nullptr);
  if (discard || error)
    for (auto& slot : a.slots) slot.cursor = kNothingPrepared;
  return error;
}

void Loader::settle() {
  if (!ahead_) return;
  if (std::exception_ptr error = settle_and_take_error(false)) std::rethrow_exception(error);
}

void Loader::discard() {
  // What the worker prepared, or failed to prepare, is no longer the next batch: its failure goes with it.
  if (ahead_) (void)settle_and_take_error(true);
}

void Loader::set_device(Device device) {
  check_device_exists(device, "device");
  // Everything that can fail for want of memory comes first, so that a failure leaves the loader as it was.
  auto a = std::make_unique<Ahead>();
  const auto rows = inputs_.rows(), features = static_cast<int64_t>(dataset_.features());
  for (auto& slot : a->slots) {
    slot.host_x = Tensor::empty(DType::kF32, Shape{rows, features}, Device{});
    slot.host_y = Tensor::empty(DType::kI32, Shape{rows}, Device{});
    if (!device.is_host()) {
      slot.dev_x = Tensor::empty(DType::kF32, Shape{rows, features}, device);
      slot.dev_y = Tensor::empty(DType::kI32, Shape{rows}, device);
    }
  }
  Backend& backend = backend_for(device);
  if (!device.is_host()) a->stream = backend.open_stream(device);
  // A batch in preparation finishes first; a failure it had no longer matters.
  stop_worker();
  device_ = Device{};
  Ahead* ahead = a.get();
  a->thread = std::thread([this, ahead, device, &backend] { work(*ahead, device, backend); });
  ahead_ = std::move(a);
  device_ = device;
}

void Loader::work(Ahead& w, Device device, Backend& backend) {
  std::exception_ptr start_error;
  try {
    Backend::WorkerOptions options;
    options.pin = false;  // the caller's cores are its own
    backend.start_worker(device, 0, options);
  } catch (...) {
    start_error = std::current_exception();
  }
  std::unique_lock<std::mutex> lock(w.mutex);
  for (;;) {
    w.changed.wait(lock, [&] { return w.stop || w.job >= 0; });
    if (w.stop) return;
    Slot& slot = w.slots[w.job];
    const size_t cursor = w.job_cursor;
    w.job = -1;
    lock.unlock();
    std::exception_ptr error = start_error;
    if (!error) {
      try {
        prepare(slot, w.stream.get(), cursor);
      } catch (...) {
        error = std::current_exception();
      }
    }
    lock.lock();
    if (error) {
      slot.cursor = kNothingPrepared;
      w.error = error;
    }
    w.busy = false;
    w.changed.notify_all();
  }
}

void Loader::prepare(Slot& slot, Stream* stream, size_t cursor) const {
  // Reads the permutation and the shard, which the caller changes only while the worker is idle.
  slot.plan = plan(cursor);
  if (slot.plan.rows != 0) {
    gather(slot.plan, slot.host_x.f32(), slot.host_y.i32());
    if (stream) {
      const size_t rows = slot.plan.rows;
      stream->copy_from_host(slot.dev_x.raw(), slot.host_x.raw(), rows * dataset_.features() * sizeof(float));
      stream->copy_from_host(slot.dev_y.raw(), slot.host_y.raw(), rows * sizeof(int32_t));
      stream->synchronize();
    }
  }
  slot.cursor = cursor;
}

}  // namespace dpar::io
