#include "engine/process_links.h"

#include "common/error.h"

namespace dpar {

std::shared_ptr<ProcessLinks> connect_replicas(Backend& backend, const std::shared_ptr<Communicator>& processes,
                                               const std::vector<Device>& devices, const std::vector<Stream*>& streams,
                                               std::chrono::duration<double> timeout, bool same_replica_counts) {
  auto links = std::make_shared<ProcessLinks>();
  Backend::ProcessLink first = backend.link_processes(devices[0], *streams[0], processes, timeout);
  links->host = processes;
  links->device = std::move(first.comm);
  links->transport = std::move(first.transport);
  if (!same_replica_counts) return links;
  // Every process must duplicate, or none (the duplication is collective): they agree first.
  if (devices.size() > 1) {
    const int64_t mine = processes->can_duplicate() ? 1 : 0;
    int64_t all = 0;
    processes->all_reduce(&mine, &all, 1, DType::kI64, ReduceOp::kMin);
    if (all == 0) return links;
  }
  std::vector<ProcessLinks::ReplicaLink> by_replica(devices.size());
  for (size_t r = 1; r < devices.size(); ++r) {
    by_replica[r].host = processes->duplicate();
    // Each index on its own device link, where its devices have one (NCCL between the processes' GPUs of index r).
    by_replica[r].device = backend.link_processes(devices[r], *streams[r], processes, timeout).comm;
  }
  links->by_replica = std::move(by_replica);
  return links;
}

}  // namespace dpar
