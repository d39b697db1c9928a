// The CPU backend: cpu:K are virtual devices, each a worker thread with a single-threaded oneDNN GEMM, all in host
// memory. Streams run every call at once on the calling thread; replicas reduce through the threads backend.
#pragma once

#include "backend/backend.h"

namespace dpar {
Backend& cpu_backend();
}  // namespace dpar
