// The CPU backend: cpu:K are virtual devices, each a worker thread with single-threaded OpenBLAS, all in host
// memory. Streams run every call at once on the calling thread; replicas reduce through the threads backend.
#pragma once

#include "backend/backend.h"

namespace dpar {
Backend& cpu_backend();
}  // namespace dpar
