#pragma once

namespace dpar::kernels::cpu {
// Sets OpenBLAS's (process-wide) thread count.
void set_blas_threads(int threads);
}  // namespace dpar::kernels::cpu
