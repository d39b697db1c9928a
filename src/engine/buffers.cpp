// The engine's buffers (state that is not a parameter, as BatchNorm's running statistics): kept equal to replica
// 0's on every replica, and read per replica.
#include <cstring>

#include "collectives/replica_set.h"
#include "common/error.h"
#include "engine/engine.h"

namespace dpar {

void Engine::sync_buffers(Replica& rep) {
  if (model_.buffers().empty()) return;
  ReplicaModel& m = *rep.model;
  // Replica 0 of process 0 alone contributes; x + 0 is x, so the sum is its buffers bit for bit.
  const bool root = rep.ctx.replica == 0 && process_rank() == 0;
  if (const int64_t n = m.num_buffer_f32(); n > 0) {
    if (!root) rep.stream->fill_zero(m.buffer_f32(), static_cast<size_t>(n) * sizeof(float));
    rep.set->sum(m.buffer_f32(), static_cast<size_t>(n), CommDType::kF32);
  }
  if (const int64_t n = m.num_buffer_i64(); n > 0) {
    // The replica set sums floating point: counters travel as doubles, exact up to 2^53.
    const size_t count = static_cast<size_t>(n);
    std::vector<int64_t> values(count, 0);
    std::vector<double> wide(count, 0.0);
    if (root) {
      rep.stream->copy_to_host(values.data(), m.buffer_i64(), count * sizeof(int64_t));
      for (size_t i = 0; i < count; ++i) wide[i] = static_cast<double>(values[i]);
    }
    if (!rep.buffer_stage.defined() || rep.buffer_stage.numel() < 2 * n)
      rep.buffer_stage = rep.ctx.alloc(DType::kF32, Shape{2 * n});
    auto* stage = reinterpret_cast<double*>(rep.buffer_stage.f32());
    rep.stream->copy_from_host(stage, wide.data(), count * sizeof(double));
    rep.set->sum(stage, count, CommDType::kF64);
    rep.stream->copy_to_host(wide.data(), stage, count * sizeof(double));
    for (size_t i = 0; i < count; ++i) values[i] = static_cast<int64_t>(wide[i]);
    rep.stream->copy_from_host(m.buffer_i64(), values.data(), count * sizeof(int64_t));
  }
}

void Engine::read_buffer(void* dst, size_t replica, size_t index) const {
  DPAR_CHECK_ARG(replica < replicas_.size(), "replica: ", replica, " is out of range (", replicas_.size(),
                 " replicas)");
  DPAR_CHECK_ARG(index < model_.buffers().size(), "index: ", index, " is out of range (the model has ",
                 model_.buffers().size(), " buffers)");
  const BufferInfo& b = model_.buffers()[index];
  const Replica& rep = *replicas_[replica];
  const size_t n = static_cast<size_t>(buffer_numel(b.shape));
  if (b.dtype == BufferDType::kF32)
    backend_.copy_to_host(dst, rep.model->buffer_f32() + b.offset, n * sizeof(float), rep.ctx.device);
  else
    backend_.copy_to_host(dst, rep.model->buffer_i64() + b.offset, n * sizeof(int64_t), rep.ctx.device);
}

}  // namespace dpar
