// Engine checkpoints in the safetensors layout: parameters and buffers under their state_dict names ("0.weight",
// "1.running_mean", "1.num_batches_tracked" as I64), optimizer
// state as "optimizer.<state>.<name>", and the rest (step count, optimizer, RNG streams, and the loss scaler's
// state where loss scaling is on) as metadata, whose keys no tensor name can collide with. Every
// replica holds the same parameters, so replica 0's are saved and loaded into all; the optimizer's state is held in
// shards, one per replica (of every process, where the shards span the processes: world_block), gathered for
// saving and cut along the loading engine's shards, whatever its processes, devices and reduction. With several
// processes rank 0 alone writes (the shards of every process gathered to it), and rank 0 alone reads and
// broadcasts the file's bytes, which every process then checks and loads alike; every process returns rank 0's
// outcome.
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <optional>

#include "common/error.h"
#include "engine/engine.h"
#include "io/safetensors.h"

namespace dpar {
namespace {
constexpr const char* kFormat = "dpar-checkpoint-1";

// The key of a parameter's optimizer state: under kOptimizerKeys, which no node's name may begin with.
std::string optimizer_key(const std::string& state, const std::string& param) {
  return std::string(kOptimizerKeys) + "." + state + "." + param;
}

// Step counts and replica counts beyond these are not from a real run: refused as damage rather than loaded (a
// step count near 2^63 would overflow the optimizer's signed counter a few steps later).
constexpr uint64_t kMaxSteps = uint64_t{1} << 62;
constexpr uint64_t kMaxReplicas = uint64_t{1} << 20;

// A metadata value as a decimal integer in [min, max]; anything else is Status::kCorrupt naming the key.
uint64_t parse_u64(const std::map<std::string, std::string>& meta, const std::string& key, const std::string& path,
                   uint64_t min = 0, uint64_t max = std::numeric_limits<uint64_t>::max()) {
  auto it = meta.find(key);
  DPAR_ENFORCE(it != meta.end(), Status::kCorrupt, path, ": metadata lacks \"", key, "\"");
  const std::string& s = it->second;
  DPAR_ENFORCE(!s.empty() && s.find_first_not_of("0123456789") == std::string::npos, Status::kCorrupt, path,
               ": metadata \"", key, "\" is not an unsigned integer: \"", s.substr(0, 40), "\"");
  uint64_t value = 0;
  for (char c : s) {
    const bool overflow = __builtin_mul_overflow(value, uint64_t{10}, &value) ||
                          __builtin_add_overflow(value, static_cast<uint64_t>(c - '0'), &value);
    DPAR_ENFORCE(!overflow, Status::kCorrupt, path, ": metadata \"", key, "\" is out of range: ", s.substr(0, 40),
                 " exceeds 2^64 - 1");
  }
  DPAR_ENFORCE(value >= min && value <= max, Status::kCorrupt, path, ": metadata \"", key, "\" is out of range: ",
               value, " is not in [", min, ", ", max, "]");
  return value;
}

// The loss scaler's state (GradScaler.state_dict()'s five entries) as metadata, written where loss scaling is on.
constexpr const char* kScaleKey = "dpar.loss_scaler.scale";
constexpr const char* kGrowthTrackerKey = "dpar.loss_scaler.growth_tracker";
constexpr const char* kInitScaleKey = "dpar.loss_scaler.init_scale";
constexpr const char* kGrowthFactorKey = "dpar.loss_scaler.growth_factor";
constexpr const char* kBackoffFactorKey = "dpar.loss_scaler.backoff_factor";
constexpr const char* kGrowthIntervalKey = "dpar.loss_scaler.growth_interval";

// Nine significant digits: strtof reads back the same float.
std::string float_text(float value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.9g", static_cast<double>(value));
  return text;
}

float parse_float(const std::map<std::string, std::string>& meta, const std::string& key, const std::string& path) {
  auto it = meta.find(key);
  DPAR_ENFORCE(it != meta.end(), Status::kCorrupt, path, ": metadata lacks \"", key, "\"");
  const std::string& s = it->second;
  char* end = nullptr;
  errno = 0;
  const float value = s.empty() ? 0.0f : std::strtof(s.c_str(), &end);
  DPAR_ENFORCE(!s.empty() && end == s.c_str() + s.size() && errno == 0, Status::kCorrupt, path, ": metadata \"",
               key, "\" is not a float: \"", s.substr(0, 40), "\"");
  return value;
}

// The checkpoint's loss scaler, checked; nothing where it holds none (saved without loss scaling).
std::optional<LossScaler> read_loss_scaler(const std::map<std::string, std::string>& meta, const std::string& path) {
  if (meta.find(kScaleKey) == meta.end()) return std::nullopt;
  LossScaling settings;
  settings.init_scale = parse_float(meta, kInitScaleKey, path);
  settings.growth_factor = parse_float(meta, kGrowthFactorKey, path);
  settings.backoff_factor = parse_float(meta, kBackoffFactorKey, path);
  settings.growth_interval = static_cast<int64_t>(parse_u64(meta, kGrowthIntervalKey, path, 1, kMaxSteps));
  const float scale = parse_float(meta, kScaleKey, path);
  const auto tracker = static_cast<int64_t>(parse_u64(meta, kGrowthTrackerKey, path, 0, kMaxSteps));
  LossScaler scaler;
  scaler.restore(settings, scale, tracker, (path + ": loss scaler").c_str());
  return scaler;
}
}  // namespace

void Engine::share_outcome(const char* operation, std::exception_ptr error) const {
  if (!processes_) {
    if (error) std::rethrow_exception(error);
    return;
  }
  // A status and a message, as words of one broadcast.
  constexpr size_t kMessageWords = 128;
  std::vector<int32_t> words(1 + kMessageWords, 0);
  const bool root = processes_->rank() == 0;
  if (root && error) {
    std::string what;
    try {
      std::rethrow_exception(error);
    } catch (const Error& e) {
      words[0] = static_cast<int32_t>(e.status());
      what = e.what();
    } catch (const std::bad_alloc&) {
      words[0] = static_cast<int32_t>(Status::kOutOfMemory);
      what = "out of memory";
    } catch (const std::exception& e) {
      words[0] = static_cast<int32_t>(Status::kInternal);
      what = e.what();
    }
    std::memcpy(words.data() + 1, what.data(), std::min(what.size(), kMessageWords * sizeof(int32_t) - 1));
  }
  processes_->broadcast(words.data(), words.size(), DType::kI32, 0);
  if (root) {
    if (error) std::rethrow_exception(error);
    return;
  }
  if (static_cast<Status>(words[0]) != Status::kOk)
    fail(static_cast<Status>(words[0]), operation, ": on rank 0: ", reinterpret_cast<const char*>(words.data() + 1));
}

void Engine::save(const std::string& path) const {
  check_usable("save");
  DPAR_CHECK_ARG(!path.empty(), "path: empty");
  const TraceSpan span(*trace_, kCallTrack, "save");
  // Every process takes part in the gather; rank 0 alone writes.
  const std::vector<std::vector<float>> optimizer_state = gather_optimizer_state();
  std::exception_ptr error;
  if (process_rank() == 0) {
    try {
      write_checkpoint(path, optimizer_state);
    } catch (...) {
      error = std::current_exception();
    }
  }
  share_outcome("save", error);
}

std::vector<std::vector<float>> Engine::gather_optimizer_state() const {
  const size_t elements = static_cast<size_t>(model_.num_param_elements());
  const size_t states = Optimizer::state_names(replicas_[0]->optimizer->config()).size();
  std::vector<std::vector<float>> gathered(states, std::vector<float>(elements));
  // This process's replicas' shards.
  for (size_t s = 0; s < states; ++s) {
    for (const auto& owner : replicas_) {
      const Optimizer& opt = *owner->optimizer;
      const float* state = opt.num_elements() > 0 ? opt.state()[s].second.f32() : nullptr;
      for (const ElementRange& r : opt.ranges()) {
        if (r.size() == 0) continue;
        backend_.copy_to_host(gathered[s].data() + r.begin, state, static_cast<size_t>(r.size()) * sizeof(float),
                              owner->ctx.device);
        state += r.size();
      }
    }
  }
  const ReplicaSet& set = *replicas_[0]->set;
  const int processes = set.shard_processes();
  if (processes <= 1 || states == 0) return gathered;  // every process holds every shard
  // The other processes' shards: process p's elements are its replicas' world blocks of every bucket (the same
  // buckets and replica count on every process), which every process computes alike. Each sends its own, packed in
  // that order and padded to the longest; an all-gather moves them as they are, bit for bit.
  const Reducer& reducer = *replicas_[0]->reducer;
  const float* grads = replicas_[0]->model->grads();
  const auto owned_by = [&](int p) {
    std::vector<ElementRange> ranges;
    for (size_t b = 0; b < reducer.num_buckets(); ++b) {
      const int64_t offset = reducer.bucket_data(b) - grads;
      for (size_t r = 0; r < replicas_.size(); ++r) {
        const auto [begin, end] = world_block(reducer.bucket_count(b), replicas_.size(), r, processes, p);
        if (end > begin) ranges.push_back({offset + static_cast<int64_t>(begin), offset + static_cast<int64_t>(end)});
      }
    }
    return ranges;
  };
  std::vector<std::vector<ElementRange>> owned;
  size_t most = 0;
  for (int p = 0; p < processes; ++p) {
    owned.push_back(owned_by(p));
    size_t n = 0;
    for (const ElementRange& r : owned.back()) n += static_cast<size_t>(r.size());
    most = std::max(most, n);
  }
  const size_t words = most * states;
  std::vector<float> mine(words, 0.0f), all(words * static_cast<size_t>(processes));
  const int me = set.shard_process();
  size_t at = 0;
  for (size_t s = 0; s < states; ++s)
    for (const ElementRange& r : owned[static_cast<size_t>(me)])
      for (int64_t i = r.begin; i < r.end; ++i) mine[at++] = gathered[s][static_cast<size_t>(i)];
  processes_->all_gather(mine.data(), all.data(), words, DType::kF32);
  for (int p = 0; p < processes; ++p) {
    if (p == me) continue;
    const float* from = all.data() + static_cast<size_t>(p) * words;
    for (size_t s = 0; s < states; ++s)
      for (const ElementRange& r : owned[static_cast<size_t>(p)])
        for (int64_t i = r.begin; i < r.end; ++i) gathered[s][static_cast<size_t>(i)] = *from++;
  }
  return gathered;
}

void Engine::load_optimizer_shard(Replica& rep,
                                  const std::function<const uint8_t*(size_t, const ParamInfo&)>& values) {
  // The replica's optimizer state is its shard's: the part of each parameter's state that falls in it.
  const Optimizer& opt = *rep.optimizer;
  const std::vector<std::pair<std::string, Tensor>> states = opt.state();
  for (size_t s = 0; s < states.size(); ++s) {
    const Tensor& buffer = states[s].second;
    int64_t state = 0;  // where the range's state starts in the buffer
    for (const ElementRange& r : opt.ranges()) {
      for (const ParamInfo& p : model_.params()) {
        const int64_t from = std::max(r.begin, p.offset), to = std::min(r.end, p.offset + p.shape.numel());
        if (from >= to) continue;
        rep.stream->copy_from_host(buffer.f32() + state + (from - r.begin),
                                   values(s, p) + static_cast<size_t>(from - p.offset) * sizeof(float),
                                   static_cast<size_t>(to - from) * sizeof(float));
      }
      state += r.size();
    }
  }
}

void Engine::write_checkpoint(const std::string& path, const std::vector<std::vector<float>>& gathered) const {
  const Replica& rep = *replicas_[0];
  const size_t elements = static_cast<size_t>(model_.num_param_elements());
  std::vector<float> params(elements);
  backend_.copy_to_host(params.data(), rep.model->params(), elements * sizeof(float), rep.ctx.device);
  std::vector<io::TensorView> views;
  // A tied parameter under its own key and each alias's, as PyTorch's state_dict holds both
  // "transformer.wte.weight" and "lm_head.weight".
  for (const ParamInfo& p : model_.params()) {
    const std::vector<int64_t> shape(p.shape.data(), p.shape.data() + p.shape.ndim());
    const size_t bytes = static_cast<size_t>(p.shape.numel()) * sizeof(float);
    views.push_back({p.name, "F32", shape, params.data() + p.offset, bytes});
    for (const ParamAlias& a : p.aliases) views.push_back({a.name, "F32", shape, params.data() + p.offset, bytes});
  }
  // Buffers under their state_dict names and dtypes (num_batches_tracked: an I64 scalar), replica 0's (every
  // replica holds the same after a training step).
  std::vector<std::vector<uint8_t>> buffers;
  for (size_t i = 0; i < model_.buffers().size(); ++i) {
    const BufferInfo& b = model_.buffers()[i];
    const bool f32 = b.dtype == DType::kF32;
    buffers.emplace_back(static_cast<size_t>(buffer_numel(b.shape)) * (f32 ? sizeof(float) : sizeof(int64_t)));
    read_buffer(buffers.back().data(), 0, i);
  }
  for (size_t i = 0; i < model_.buffers().size(); ++i) {
    const BufferInfo& b = model_.buffers()[i];
    views.push_back({b.name, b.dtype == DType::kF32 ? "F32" : "I64",
                     std::vector<int64_t>(b.shape.data(), b.shape.data() + b.shape.ndim()), buffers[i].data(),
                     buffers[i].size()});
  }
  // Each replica holds the optimizer's state for its own shard (finish_and_step): `gathered` holds the shards put
  // together (gather_optimizer_state).
  const std::vector<std::string> state_names = Optimizer::state_names(rep.optimizer->config());
  for (size_t s = 0; s < state_names.size(); ++s)
    for (const ParamInfo& p : model_.params())
      views.push_back({optimizer_key(state_names[s], p.name), "F32",
                       std::vector<int64_t>(p.shape.data(), p.shape.data() + p.shape.ndim()),
                       gathered[s].data() + p.offset, static_cast<size_t>(p.shape.numel()) * sizeof(float)});
  std::map<std::string, std::string> meta{
      {"format", kFormat},
      {"dpar.optimizer", rep.optimizer->config().name()},
      {"dpar.step", std::to_string(rep.optimizer->steps())},
      {"dpar.replicas", std::to_string(replicas_.size())},
  };
  for (size_t r = 0; r < replicas_.size(); ++r)
    meta["dpar.rng_offset." + std::to_string(r)] = std::to_string(replicas_[r]->rng_offset);
  if (scaler_.enabled()) {
    const LossScaling& s = scaler_.settings();
    meta[kScaleKey] = float_text(scaler_.scale());
    meta[kGrowthTrackerKey] = std::to_string(scaler_.growth_tracker());
    meta[kInitScaleKey] = float_text(s.init_scale);
    meta[kGrowthFactorKey] = float_text(s.growth_factor);
    meta[kBackoffFactorKey] = float_text(s.backoff_factor);
    meta[kGrowthIntervalKey] = std::to_string(s.growth_interval);
  }
  io::write_safetensors(path, views, meta);
}

void Engine::load(const std::string& path) {
  check_usable("load");
  DPAR_CHECK_ARG(!path.empty(), "path: empty");
  const TraceSpan span(*trace_, kCallTrack, "load");
  // Read and check everything before touching a replica: a refused file changes nothing.
  std::vector<uint8_t> bytes;
  std::exception_ptr error;
  if (process_rank() == 0) {
    try {
      bytes = io::SafetensorsFile::read_bytes(path);
    } catch (...) {
      error = std::current_exception();
    }
  }
  share_outcome("load", error);
  if (processes_) {
    int64_t size = static_cast<int64_t>(bytes.size());
    processes_->broadcast(&size, 1, DType::kI64, 0);
    // Moved as 8-byte words: the buffer is padded to a whole word and trimmed after.
    bytes.resize((static_cast<size_t>(size) + 7) / 8 * 8);
    processes_->broadcast(bytes.data(), bytes.size() / 8, DType::kI64, 0);
    bytes.resize(static_cast<size_t>(size));
  }
  const io::SafetensorsFile file = io::SafetensorsFile::parse(path, std::move(bytes));
  const auto& meta = file.metadata();
  auto fmt = meta.find("format");
  DPAR_ENFORCE(fmt != meta.end() && fmt->second == kFormat, Status::kMismatch, path,
               ": not a dpar checkpoint (metadata \"format\" is not \"", kFormat, "\")");
  Optimizer& opt0 = *replicas_[0]->optimizer;
  auto opt = meta.find("dpar.optimizer");
  DPAR_ENFORCE(opt != meta.end() && opt->second == opt0.config().name(), Status::kMismatch, path,
               ": checkpoint optimizer \"", opt == meta.end() ? "?" : opt->second, "\" differs from the engine's \"",
               opt0.config().name(), "\"");
  const int64_t steps = static_cast<int64_t>(parse_u64(meta, "dpar.step", path, 0, kMaxSteps));
  const uint64_t saved_replicas = parse_u64(meta, "dpar.replicas", path, 1, kMaxReplicas);
  const std::optional<LossScaler> scaler = read_loss_scaler(meta, path);

  auto check_entry = [&](const std::string& name, const ParamInfo& p) {
    DPAR_ENFORCE(file.has(name), Status::kMismatch, path, ": tensor \"", name, "\" of the model is missing");
    const auto& e = file.entry(name);
    std::vector<int64_t> want(p.shape.data(), p.shape.data() + p.shape.ndim());
    DPAR_ENFORCE(e.dtype == "F32" && e.shape == want, Status::kMismatch, path, ": tensor \"", name,
                 "\" has another dtype or shape than the model's ", p.shape.str());
  };
  size_t expected = 0;
  for (const ParamInfo& p : model_.params()) check_entry(p.name, p), ++expected;
  // A tied parameter is read from its own key. Its aliases' copies, where the file holds them, must be that same
  // tensor (a file whose two keys differ was saved from an untied model); one the file lacks is no loss, as
  // safetensors files from PyTorch (save_model, Hugging Face's save_pretrained) keep one name of tensors that share
  // memory.
  for (const ParamInfo& p : model_.params())
    for (const ParamAlias& a : p.aliases) {
      if (!file.has(a.name)) continue;
      check_entry(a.name, p);
      DPAR_ENFORCE(std::memcmp(file.data(a.name), file.data(p.name), file.entry(p.name).bytes) == 0,
                   Status::kMismatch, path, ": tensor \"", a.name, "\" differs from \"", p.name,
                   "\", the parameter it is tied to (the model reads one tensor for both keys)");
      ++expected;
    }
  for (const std::string& state_name : Optimizer::state_names(opt0.config()))
    for (const ParamInfo& p : model_.params()) check_entry(optimizer_key(state_name, p.name), p), ++expected;
  for (const BufferInfo& b : model_.buffers()) {
    DPAR_ENFORCE(file.has(b.name), Status::kMismatch, path, ": buffer \"", b.name, "\" of the model is missing");
    const auto& e = file.entry(b.name);
    const char* dtype = b.dtype == DType::kF32 ? "F32" : "I64";
    DPAR_ENFORCE(e.dtype == dtype && e.shape == std::vector<int64_t>(b.shape.data(), b.shape.data() + b.shape.ndim()),
                 Status::kMismatch, path, ": buffer \"", b.name, "\" has another dtype or shape than the model's ",
                 dtype, " ", b.shape.str());
    ++expected;
  }
  DPAR_ENFORCE(file.names().size() == expected, Status::kMismatch, path, ": holds ", file.names().size(),
               " tensors, the model and optimizer have ", expected);
  std::vector<uint64_t> rng(replicas_.size());
  const bool same_replicas = saved_replicas == replicas_.size();
  if (same_replicas)
    for (size_t r = 0; r < replicas_.size(); ++r) rng[r] = parse_u64(meta, "dpar.rng_offset." + std::to_string(r), path);

  const std::vector<std::string> state_names = Optimizer::state_names(opt0.config());
  // Each replica copies from the file on its own worker.
  run("load", [&](Replica& rep, size_t r) {
    for (const ParamInfo& p : model_.params())
      rep.stream->copy_from_host(rep.model->params_for_writing() + p.offset, file.data(p.name),
                                 file.entry(p.name).bytes);
    load_optimizer_shard(rep, [&](size_t s, const ParamInfo& p) {
      return file.data(optimizer_key(state_names[s], p.name));
    });
    for (const BufferInfo& b : model_.buffers()) {
      if (b.dtype == DType::kF32)
        rep.stream->copy_from_host(rep.model->buffer_f32() + b.offset, file.data(b.name), file.entry(b.name).bytes);
      else
        rep.stream->copy_from_host(rep.model->buffer_i64() + b.offset, file.data(b.name), file.entry(b.name).bytes);
    }
    rep.optimizer->set_steps(steps);
    // RNG streams continue where they were only when the replica layout is the same.
    if (same_replicas) rep.rng_offset = rng[r];
    rep.has_grad = false;
    rep.model->clear_forward_state();
  });
  // A checkpoint saved with loss scaling resumes it as it was (its settings too, as GradScaler.load_state_dict);
  // one saved without leaves the engine's scaler as it is.
  if (scaler) scaler_ = *scaler;
  pending_ = Pending::kNone;
  pending_samples_ = 0;
  forward_split_.clear();
}

}  // namespace dpar
