// The engine's buffers (state that is not a parameter, as BatchNorm's running statistics): kept equal to replica
// 0's on every replica, and read per replica.
#include "collectives/replica_set.h"
#include "common/error.h"
#include "engine/engine.h"

namespace dpar {

void Engine::sync_buffers(Replica& rep) {
  if (model_.buffers().empty()) return;
  ReplicaModel& m = *rep.model;
  // Replica 0 of process 0's buffers, bit for bit; the int64 counters as int64 (no count loses a digit).
  if (const int64_t n = m.num_buffer_f32(); n > 0)
    rep.set->broadcast_from_first(m.buffer_f32(), static_cast<size_t>(n), DType::kF32);
  if (const int64_t n = m.num_buffer_i64(); n > 0)
    rep.set->broadcast_from_first(m.buffer_i64(), static_cast<size_t>(n), DType::kI64);
}

void Engine::read_buffer(void* dst, size_t replica, size_t index) const {
  DPAR_CHECK_ARG(replica < replicas_.size(), "replica: ", replica, " is out of range (", replicas_.size(),
                 " replicas)");
  DPAR_CHECK_ARG(index < model_.buffers().size(), "index: ", index, " is out of range (the model has ",
                 model_.buffers().size(), " buffers)");
  const BufferInfo& b = model_.buffers()[index];
  const Replica& rep = *replicas_[replica];
  const size_t n = static_cast<size_t>(buffer_numel(b.shape));
  if (b.dtype == DType::kF32)
    backend_.copy_to_host(dst, rep.model->buffer_f32() + b.offset, n * sizeof(float), rep.ctx.device);
  else
    backend_.copy_to_host(dst, rep.model->buffer_i64() + b.offset, n * sizeof(int64_t), rep.ctx.device);
}

}  // namespace dpar
