// The device seam: one Backend per device kind (cpu, cuda) owns everything that differs between kinds.
//
//  - memory: allocate, free, and the synchronous copies and fills that the host side needs (tensors made through
//    the C API, checkpoints): thread-safe, callable from any thread;
//  - the kernel table, reached through a Stream: a replica's ordered queue of device work, opened on the
//    replica's worker thread. Layers, losses, the optimizer and the reducer call kernels and ordered copies
//    through their replica's Stream only, never a CPU or CUDA kernel by name;
//  - the worker start (CPU: pinning and BLAS threads; CUDA: the current device);
//  - the in-process group that the replicas of an engine reduce their gradients with (CPU: the threads backend
//    over shared memory; CUDA: NCCL between GPUs, dpar's own device reduction between replicas sharing one GPU);
//  - the link between processes for a replica's memory (CPU: MPI itself; CUDA: NCCL over the processes' GPUs).
//
// Adding a device kind is adding one Backend; the engine, the layers and the reducer do not change.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/stream.h"
#include "comm/group.h"
#include "device/device.h"

namespace dpar {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual DeviceKind kind() const = 0;
  virtual const char* name() const = 0;  // "cpu", "cuda"
  // The devices of this kind that exist. Never throws: a kind with no device (no driver, no GPU) has 0, and
  // unavailable_reason() says why.
  virtual size_t device_count() const = 0;
  virtual std::string unavailable_reason() const { return {}; }
  // What runs this kind's matrix multiplies, for bug reports and benchmarks: the library, its version and the
  // kernels it chose for this machine (CPU: "oneDNN 2.6.3 (OpenMP), avx512_core f32 kernels (CPU ISA ...)").
  // Empty where the backend does not say.
  virtual std::string math_library() const { return {}; }

  // ---- Memory (thread-safe) ---------------------------------------------------------------------------------
  // Throws Error(OUT_OF_MEMORY) naming the device and the size. The memory is uninitialised.
  virtual void* allocate(Device device, size_t bytes) = 0;
  virtual void deallocate(Device device, void* ptr) noexcept = 0;
  // Synchronous: they return once the bytes have arrived, ordered after every stream's work on the device that
  // the calling thread has waited for (callers synchronise their streams first).
  virtual void copy_to_host(void* dst, const void* src, size_t bytes, Device device) = 0;
  virtual void copy_from_host(void* dst, const void* src, size_t bytes, Device device) = 0;
  virtual void fill_zero(void* dst, size_t bytes, Device device) = 0;
  // Throws Error(INVALID_ARGUMENT) naming `argument` when the `bytes` at `ptr` are known not to be memory of
  // `device` (a host pointer handed to a GPU collective would fault on the device, and such a fault ends the
  // process's CUDA context). CPU memory cannot be told apart from any other pointer: the CPU backend accepts all.
  virtual void check_memory(const void* ptr, size_t bytes, Device device, const char* argument) = 0;
  // Returns once the work queued on `device`'s legacy default stream has finished. A tensor taken from another
  // framework (DLPack) is written by that framework's work; the DLPack stream protocol lets the consumer name a
  // stream to order it on, and dpar names the legacy default stream, which its own (non-blocking) streams do not
  // wait for: waiting here, on the caller's thread, orders every later use of the memory after the producer.
  // CPU: work is done when a call returns; nothing to wait for.
  virtual void wait_for_legacy_stream(Device /*device*/) {}

  // ---- Workers ------------------------------------------------------------------------------------------------
  struct WorkerOptions {
    bool pin = true;       // CPU: bind worker w to the w-th allowed core
    int blas_threads = 1;  // CPU: GEMM threads inside each worker (set on each worker thread)
  };
  // Runs once on the calling thread before an engine starts its workers.
  virtual void prepare_workers(const WorkerOptions&) {}
  // Runs first on the worker thread `worker` that will drive `device`.
  virtual void start_worker(Device device, size_t worker, const WorkerOptions& options) = 0;
  // A new ordered queue of work on `device`, for the calling (worker) thread's replica.
  virtual std::unique_ptr<Stream> open_stream(Device device) = 0;
  // A Stream over a queue the caller owns, used and never destroyed: for a framework whose own buffers dpar
  // reduces, ordered with the framework's work. CUDA: a cudaStream_t of `device` (nullptr: the legacy default
  // stream); its operations may be called from any thread. CPU has no such queue: `native` must be nullptr.
  virtual std::unique_ptr<Stream> wrap_stream(Device device, void* native) = 0;

  // ---- The in-process group -----------------------------------------------------------------------------------
  // The group that replica r (on devices[r], with streams[r]) reduces with; names[r] names it in messages.
  virtual std::unique_ptr<Group> make_group(const std::vector<Device>& devices, const std::vector<Stream*>& streams,
                                            std::vector<std::string> names,
                                            std::chrono::duration<double> timeout) = 0;

  // ---- Across processes ---------------------------------------------------------------------------------------
  // How one replica of each process reaches the others' for the last level of a hierarchical reduction.
  struct ProcessLink {
    // Collectives over the processes on memory of the replica's device, ordered after its stream's work. Null:
    // `processes` carries them itself, on host memory (a replica elsewhere than the host stages through it).
    std::unique_ptr<Communicator> comm;
    std::string transport;  // for messages and traces: "mpi", "nccl", or what was used and why
  };
  // Made collectively: every process of `processes` calls it at the same point of its own collectives on it, with
  // its replica's device and stream (which must outlive the link). The default: `processes` itself.
  virtual ProcessLink link_processes(Device /*device*/, Stream& /*stream*/,
                                     const std::shared_ptr<Communicator>& processes,
                                     std::chrono::duration<double> /*timeout*/) {
    return {nullptr, processes->backend()};
  }
};

// The backend of a device kind. Throws Error(NOT_SUPPORTED) for a kind not built into this library.
Backend& backend_for(DeviceKind kind);
inline Backend& backend_for(Device device) { return backend_for(device.kind); }
// Whether a kind is built into this library.
bool backend_built(DeviceKind kind);

// Checks that `device` exists (its index below the kind's device count), naming `argument` if not.
void check_device_exists(Device device, const char* argument);

}  // namespace dpar
