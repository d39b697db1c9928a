#include "kernels/cpu/blas_threads.h"

#include <cblas.h>

namespace dpar::kernels::cpu {
void set_blas_threads(int threads) { openblas_set_num_threads(threads); }
}  // namespace dpar::kernels::cpu
