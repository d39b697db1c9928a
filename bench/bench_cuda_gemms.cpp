// bench_cuda_gemms: the GEMMs of one training step of the benchmark's MLPs, in cuBLAS alone (issue 7, section 8):
// the floor under any implementation's step, for bench_cuda_train's ratio dpar / GEMMs.
//
//   bench_cuda_gemms [--only demo|wide] [--batches B1,B2,..] [--reps N] [--blocks K] [--json PATH]
//
// Per Linear layer (in -> out) at batch B, row-major as dpar's CUDA kernels (src/kernels/cuda/linear.cu) issue them:
//   forward   y (B,out) = x (B,in) W^T                   every layer
//   backward  dx (B,in) = dy (B,out) W                   every layer but the first (its input needs no gradient)
//             dW (out,in) = dy^T (out,B) x (B,in)         every layer
// backward runs from the last layer to the first, dx before dW as linear_backward does. cublasSgemm, f32, a handle
// in CUBLAS_DEFAULT_MATH (no TF32), as dpar's backend sets it. No bias, activation, loss or optimizer: GEMMs only.
//
// Two timings of the same sequence, each with CUDA events around a block of `reps` sequences, per sequence:
//   stream  the GEMMs issued one by one on a stream (as a step issues them; small GEMMs may then wait for the host)
//   graph   the sequence captured once in a CUDA graph and launched per repetition (no per-call launch cost)
// gemms_ms, the figure bench_cuda_train divides by, is the smaller of the two medians: the GEMMs' own GPU time.
// No CUDA device: says why and exits 0.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <memory>
#include <vector>

#include "bench_util.h"
#include "cuda_configs.h"

namespace {

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s (%s)\n", what, cudaGetErrorString(e), cudaGetErrorName(e));
    std::exit(1);
  }
}
void blas_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "%s: %s\n", what, cublasGetStatusString(s));
    std::exit(1);
  }
}

// A device array of floats, filled with uniform values in [-0.5, 0.5) so that no GEMM sees only zeros.
struct Buffer {
  float* p = nullptr;
  Buffer(size_t n, uint64_t seed) {
    cuda_check(cudaMalloc(reinterpret_cast<void**>(&p), n * sizeof(float)), "cudaMalloc");
    std::vector<float> h(n);
    for (auto& v : h) v = bench_uniform(&seed) - 0.5f;
    cuda_check(cudaMemcpy(p, h.data(), n * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  ~Buffer() { cudaFree(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

struct Result {
  const char* model;
  int64_t batch;
  double stream_ms, graph_ms, forward_ms, backward_ms, gflop;
};

class Step {
 public:
  Step(const bench_mlp& mlp, int64_t batch, cublasHandle_t blas) : mlp_(mlp), B_(static_cast<int>(batch)), blas_(blas) {
    uint64_t seed = 1;
    for (int l = 0; l <= mlp.nlayers; ++l)  // activations a[l] (B, sizes[l]) and their gradients
      act_.emplace_back(new Buffer(static_cast<size_t>(batch * mlp.sizes[l]), seed++));
    for (int l = 0; l <= mlp.nlayers; ++l) dact_.emplace_back(new Buffer(static_cast<size_t>(batch * mlp.sizes[l]), seed++));
    for (int l = 0; l < mlp.nlayers; ++l) {
      const size_t n = static_cast<size_t>(mlp.sizes[l] * mlp.sizes[l + 1]);
      w_.emplace_back(new Buffer(n, seed++));
      dw_.emplace_back(new Buffer(n, seed++));
    }
  }

  // The forward GEMMs, column-major as linear_forward: out^T (out,B) = W (out,in) @ x^T (in,B).
  void forward() {
    const float one = 1.0f, zero = 0.0f;
    for (int l = 0; l < mlp_.nlayers; ++l) {
      const int in = dim(l), out = dim(l + 1);
      blas_check(cublasSgemm(blas_, CUBLAS_OP_T, CUBLAS_OP_N, out, B_, in, &one, w_[l]->p, in, act_[l]->p, in, &zero,
                             act_[l + 1]->p, out),
                 "forward GEMM");
    }
  }
  // The backward GEMMs, last layer first, as linear_backward issues them: dx, then dW (beta 0: a fresh gradient).
  void backward() {
    const float one = 1.0f, zero = 0.0f;
    for (int l = mlp_.nlayers - 1; l >= 0; --l) {
      const int in = dim(l), out = dim(l + 1);
      if (l > 0)
        blas_check(cublasSgemm(blas_, CUBLAS_OP_N, CUBLAS_OP_N, in, B_, out, &one, w_[l]->p, in, dact_[l + 1]->p, out,
                               &zero, dact_[l]->p, in),
                   "backward GEMM dx");
      blas_check(cublasSgemm(blas_, CUBLAS_OP_N, CUBLAS_OP_T, in, out, B_, &one, act_[l]->p, in, dact_[l + 1]->p, out,
                             &zero, dw_[l]->p, in),
                 "backward GEMM dW");
    }
  }
  double gflop() const {
    double f = 0;
    for (int l = 0; l < mlp_.nlayers; ++l) f += 2.0 * B_ * dim(l) * dim(l + 1) * (l > 0 ? 3 : 2);
    return f * 1e-9;
  }

 private:
  int dim(int l) const { return static_cast<int>(mlp_.sizes[l]); }
  const bench_mlp& mlp_;
  int B_;
  cublasHandle_t blas_;
  std::vector<std::unique_ptr<Buffer>> act_, dact_, w_, dw_;
};

// Median over `blocks` of the time per repetition of `body`, each block `reps` repetitions between two events.
template <class F>
double time_ms(cudaStream_t stream, int reps, int blocks, F body) {
  cudaEvent_t a, b;
  cuda_check(cudaEventCreate(&a), "cudaEventCreate");
  cuda_check(cudaEventCreate(&b), "cudaEventCreate");
  for (int i = 0; i < 3; ++i) body();  // warm-up: cuBLAS's heuristics, clocks
  cuda_check(cudaStreamSynchronize(stream), "warm-up");
  std::vector<double> per(static_cast<size_t>(blocks));
  for (int k = 0; k < blocks; ++k) {
    cuda_check(cudaEventRecord(a, stream), "cudaEventRecord");
    for (int i = 0; i < reps; ++i) body();
    cuda_check(cudaEventRecord(b, stream), "cudaEventRecord");
    cuda_check(cudaEventSynchronize(b), "cudaEventSynchronize");
    float ms = 0;
    cuda_check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
    per[static_cast<size_t>(k)] = ms / reps;
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return bench_median(per.data(), per.size());
}

Result measure(const bench_mlp& mlp, int64_t batch, int reps, int blocks, cublasHandle_t blas, cudaStream_t stream) {
  Step step(mlp, batch, blas);
  Result r{mlp.name, batch, 0, 0, 0, 0, step.gflop()};
  r.forward_ms = time_ms(stream, reps, blocks, [&] { step.forward(); });
  r.backward_ms = time_ms(stream, reps, blocks, [&] { step.backward(); });
  r.stream_ms = time_ms(stream, reps, blocks, [&] {
    step.forward();
    step.backward();
  });
  // The same sequence as one graph. cuBLAS may be captured on a non-default stream (its workspace comes from the
  // handle, set up by the uncaptured calls above).
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  cuda_check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  step.forward();
  step.backward();
  cuda_check(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
  cuda_check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  r.graph_ms = time_ms(stream, reps, blocks, [&] { cuda_check(cudaGraphLaunch(exec, stream), "cudaGraphLaunch"); });
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return r;
}

void usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--only demo|wide] [--batches B1,B2,..] [--reps N] [--blocks K] [--json PATH]\n"
               "  --reps N     sequences per timed block (default: about 200 ms of GPU time per block, 5 to 1000)\n"
               "  --blocks K   timed blocks; the median is reported (default 7)\n",
               argv0);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  const char *only = nullptr, *json = nullptr;
  int64_t batches[kBenchMaxBatches];
  int nbatches = 0, reps = 0, blocks = 7;
  for (int i = 1; i < argc; ++i) {
    const bool more = i + 1 < argc;
    if (!std::strcmp(argv[i], "--only") && more) only = argv[++i];
    else if (!std::strcmp(argv[i], "--batches") && more) {
      if ((nbatches = bench_parse_batches(argv[++i], batches)) < 0) usage(argv[0]);
    } else if (!std::strcmp(argv[i], "--reps") && more) reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--blocks") && more) blocks = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--json") && more) json = argv[++i];
    else usage(argv[0]);
  }
  if ((only && std::strcmp(only, "demo") && std::strcmp(only, "wide")) || reps < 0 || blocks < 1) usage(argv[0]);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);

  std::printf("bench_cuda_gemms: the GEMMs of one training step in cuBLAS alone (cublasSgemm, f32, "
              "CUBLAS_DEFAULT_MATH)\n");
  int ngpu = 0;
  const cudaError_t e = cudaGetDeviceCount(&ngpu);
  if (e != cudaSuccess || ngpu == 0) {
    std::printf("skipped: no CUDA device (%s)\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount returned 0");
    return 0;
  }
  cuda_check(cudaSetDevice(0), "cudaSetDevice");
  cudaDeviceProp prop{};
  cuda_check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  std::printf("GPU: cuda:0, %s (%d SMs, %.1f GiB); CUDA runtime %d, driver %d\n", prop.name,
              prop.multiProcessorCount, static_cast<double>(prop.totalGlobalMem) / (1 << 30), runtime, driver);

  cudaStream_t stream;
  cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  cublasHandle_t blas;
  blas_check(cublasCreate(&blas), "cublasCreate");
  blas_check(cublasSetStream(blas, stream), "cublasSetStream");
  blas_check(cublasSetMathMode(blas, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");

  std::printf("per sequence, median of %d blocks (CUDA events around each block)\n\n", blocks);
  std::printf("  %-11s | %6s | %9s %9s | %9s %9s | %9s | %8s\n", "config", "GFLOP", "forward", "backward",
              "stream ms", "graph ms", "GEMMs ms", "TFLOP/s");
  std::vector<Result> results;
  for (const bench_mlp& mlp : kBenchMlps) {
    if (only && std::strcmp(only, mlp.name)) continue;
    const int nb = nbatches ? nbatches : mlp.nbatches;
    for (int b = 0; b < nb; ++b) {
      const int64_t batch = nbatches ? batches[b] : mlp.batches[b];
      // Default repetitions: about 200 ms of GPU time per block, judged from the FLOPs at a nominal 40 TFLOP/s.
      int n = reps;
      if (n == 0) {
        double f = 0;
        for (int l = 0; l < mlp.nlayers; ++l) f += 6.0 * batch * mlp.sizes[l] * mlp.sizes[l + 1];
        n = std::clamp(static_cast<int>(0.2 / (f / 40e12)), 5, 1000);
      }
      const Result r = measure(mlp, batch, n, blocks, blas, stream);
      results.push_back(r);
      const double best = std::min(r.stream_ms, r.graph_ms);
      char cfg[32];
      std::snprintf(cfg, sizeof cfg, "%s,%lld", r.model, static_cast<long long>(r.batch));
      std::printf("  %-11s | %6.2f | %9.3f %9.3f | %9.3f %9.3f | %9.3f | %8.1f\n", cfg, r.gflop, r.forward_ms,
                  r.backward_ms, r.stream_ms, r.graph_ms, best, r.gflop / best);
    }
  }
  std::printf("\n  GEMMs ms = the smaller of stream and graph: the GEMMs' own GPU time, what bench_cuda_train divides "
              "by\n");

  if (json) {
    FILE* f = std::fopen(json, "w");
    if (!f) {
      std::fprintf(stderr, "cannot write %s\n", json);
      return 1;
    }
    std::fprintf(f, "{\n  \"program\": \"bench_cuda_gemms\",\n  \"gpu\": \"%s\",\n  \"cuda_runtime\": %d,\n"
                 "  \"results\": [\n", prop.name, runtime);
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      std::fprintf(f,
                   "    {\"model\": \"%s\", \"batch\": %lld, \"gemms_ms\": %.6f, \"stream_ms\": %.6f, \"graph_ms\": "
                   "%.6f, \"forward_ms\": %.6f, \"backward_ms\": %.6f, \"gflop\": %.4f}%s\n",
                   r.model, static_cast<long long>(r.batch), std::min(r.stream_ms, r.graph_ms), r.stream_ms,
                   r.graph_ms, r.forward_ms, r.backward_ms, r.gflop, i + 1 < results.size() ? "," : "");
    }
    std::fprintf(f, "  ]\n}\n");
    std::fclose(f);
    std::printf("\nwrote %s\n", json);
  }
  cublasDestroy(blas);
  cudaStreamDestroy(stream);
  return 0;
}
