// dpar_engine_set_gradient_reduction over several processes, through the C ABI, run under mpirun and alone
// (tests/CMakeLists.txt):
//
//   test_mpi_zero --devices N [--expect-processes P]      each process runs N CPU devices
//
// Two engines of the same model, one per reduction (DPAR_REDUCTION_ALL_REDUCE, DPAR_REDUCTION_REDUCE_SCATTER),
// train on the same batches (each process its rows of the global batch, split unevenly over the replicas) with
// small buckets, so that every bucket is reduce-scattered into blocks of uneven sizes. The checks, on every rank:
//  - without clipping (Adam, and SGD with momentum, which also switches between the reductions every other step):
//    every step's loss and, at the end, every replica's parameters have the bits of the all-reduce's;
//  - with clipping (a max_grad_norm below every step's gradient norm): the reduce-scatter's losses and parameters
//    are those of the all-reduce within 1e-5 relative (its norm is summed from the blocks, in another order);
//  - either way every replica of every process ends with the same bits as rank 0's replica 0;
//  - the reduce-scatter engine's trace shows its buckets reduce-scattered (across the processes too, where there
//    are several), and the all-reduce engines' all-reduced (so the setting reached the engine); the parameters'
//    all-gather crosses the processes under the reduce-scatter and the sharded all-reduce, not the default;
//  - an unknown reduction is refused with DPAR_ERR_INVALID_ARGUMENT, and the engine trains on.
// Every rank prints its failures as "[rank r] FAIL ..." and exits nonzero if it saw one; rank 0 prints a summary.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "dpar.h"
#include "mpi_checks.h"

namespace {

using mpi_checks::g_failures;
using mpi_checks::g_rank;
using mpi_checks::g_size;
using mpi_checks::expect;

// 30 rows a global batch: uneven over 2 x 2 replicas, and over 2 or 1 process's own.
constexpr int64_t kIn = 12, kHidden = 16, kClasses = 5, kGlobalBatch = 30, kBatches = 3, kSteps = 9;
constexpr size_t kParamElements = kIn * kHidden + kHidden + kHidden * kHidden + kHidden + kHidden * kClasses + kClasses;

dpar_model* make_model() {
  dpar_model_options mo = DPAR_MODEL_OPTIONS_INIT;
  mo.seed = 7;
  dpar_model* m = nullptr;
  CHECK_OK(dpar_model_create(&m, &mo));
  CHECK_OK(dpar_model_add_linear(m, kIn, kHidden, 1));
  CHECK_OK(dpar_model_add_activation(m, DPAR_TANH));
  CHECK_OK(dpar_model_add_linear(m, kHidden, kHidden, 1));
  CHECK_OK(dpar_model_add_activation(m, DPAR_TANH));
  CHECK_OK(dpar_model_add_linear(m, kHidden, kClasses, 1));
  return m;
}

// The global batches, the same on every rank.
struct Data {
  std::vector<std::vector<float>> x;
  std::vector<std::vector<int32_t>> y;
};
Data make_data() {
  Data d;
  std::mt19937 gen(1234);
  std::normal_distribution<float> normal;
  for (int b = 0; b < kBatches; ++b) {
    std::vector<float> x(kGlobalBatch * kIn);
    std::vector<int32_t> y(kGlobalBatch);
    for (auto& v : x) v = normal(gen);
    for (auto& v : y) v = static_cast<int32_t>(gen() % kClasses);
    d.x.push_back(std::move(x));
    d.y.push_back(std::move(y));
  }
  return d;
}

// optimizer: DPAR_ADAM or DPAR_SGD (with momentum).
dpar_engine* make_engine(size_t devices, int32_t optimizer, int32_t reduction) {
  dpar_model* model = make_model();
  dpar_optimizer_options opt = DPAR_OPTIMIZER_OPTIONS_INIT;
  opt.kind = optimizer;
  opt.lr = optimizer == DPAR_SGD ? 0.1f : 0.01f;
  if (optimizer == DPAR_SGD) opt.momentum = 0.9f;
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = devices;
  eo.processes = DPAR_PROCESSES_MPI;
  eo.timeout_seconds = 60.0;
  // Buckets of 16 to 64 gradients: several of them, whose blocks differ in size between the replicas.
  eo.first_bucket_bytes = 64;
  eo.bucket_cap_bytes = 256;
  dpar_engine* e = nullptr;
  CHECK_OK(dpar_engine_create(&e, model, &opt, &eo));
  dpar_model_free(model);
  CHECK_OK(dpar_engine_set_gradient_reduction(e, reduction));
  return e;
}

// This process's rows of a global batch: balanced, sizes differing by one at most.
std::pair<int64_t, int64_t> my_rows() {
  const int64_t base = kGlobalBatch / g_size, extra = kGlobalBatch % g_size;
  const int64_t begin = g_rank * base + std::min<int64_t>(g_rank, extra);
  return {begin, base + (g_rank < extra ? 1 : 0)};
}

// One training step on this process's rows of global batch b; the global batch's mean loss.
float train(dpar_engine* e, const Data& d, int b) {
  const auto [begin, rows] = my_rows();
  const int64_t xs[2] = {rows, kIn}, ys[1] = {rows};
  dpar_tensor *x = nullptr, *y = nullptr;
  CHECK_OK(dpar_tensor_wrap_host(&x, DPAR_F32, xs, 2, const_cast<float*>(d.x[b].data() + begin * kIn)));
  CHECK_OK(dpar_tensor_wrap_host(&y, DPAR_I32, ys, 1, const_cast<int32_t*>(d.y[b].data() + begin)));
  float loss = 0.0f;
  CHECK_OK(dpar_engine_train_step(&loss, e, x, y));
  dpar_tensor_free(x);
  dpar_tensor_free(y);
  return loss;
}

std::vector<float> params(dpar_engine* e, size_t replica) {
  std::vector<float> p(kParamElements);
  CHECK_OK(dpar_engine_get_params(p.data(), e, replica, p.size()));
  return p;
}

// The same bits on every process: rank 0's values, broadcast, against this rank's.
bool same_as_rank0(const std::vector<float>& mine) {
  dpar_comm* world = nullptr;
  CHECK_OK(dpar_comm_create_mpi(&world, nullptr));
  std::vector<float> root = mine;
  CHECK_OK(dpar_comm_broadcast(world, root.data(), root.size(), DPAR_F32, 0));
  dpar_comm_free(world);
  return std::equal(root.begin(), root.end(), mine.begin(), mine.end(),
                    [](float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; });
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

double max_relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::abs(double(a[i]) - double(b[i])) / std::max(std::abs(double(b[i])), 1e-2));
  return worst;
}

// Every replica of engine e holds replica 0's bits, and replica 0 holds rank 0's.
void check_replicas_agree(dpar_engine* e, size_t devices, const std::string& label) {
  const std::vector<float> first = params(e, 0);
  for (size_t r = 1; r < devices; ++r)
    expect(same_bits(params(e, r), first), label + ": replica " + std::to_string(r) + " differs from replica 0");
  expect(same_as_rank0(first), label + ": replica 0 differs from rank 0's");
}

// max_norm 0: no clipping, bit-identical; else clipped on every step, within 1e-5. switching: the reduce-scatter
// engine turns to the all-reduce on every other step, and back.
void check_reductions(size_t devices, const Data& d, int32_t optimizer, float max_norm, bool switching) {
  const std::string label = std::to_string(g_size) + " processes x " + std::to_string(devices) + " devices, " +
                            (optimizer == DPAR_SGD ? "SGD" : "Adam") +
                            (max_norm > 0.0f ? ", clipped to " + std::to_string(max_norm) : ", no clipping") +
                            (switching ? ", switching every other step" : "");
  dpar_engine* all = make_engine(devices, optimizer, DPAR_REDUCTION_ALL_REDUCE);
  dpar_engine* scatter = make_engine(devices, optimizer, DPAR_REDUCTION_REDUCE_SCATTER);
  size_t buckets = 0;
  CHECK_OK(dpar_engine_num_buckets(&buckets, scatter));
  expect(buckets >= 3, label + ": " + std::to_string(buckets) + " gradient buckets, want several");
  CHECK_OK(dpar_engine_set_max_grad_norm(all, max_norm));
  CHECK_OK(dpar_engine_set_max_grad_norm(scatter, max_norm));
  const std::vector<float> initial = params(all, 0);
  std::vector<float> losses_all, losses_scatter;
  for (int s = 0; s < kSteps; ++s) {
    if (switching)
      CHECK_OK(dpar_engine_set_gradient_reduction(scatter, s % 2 ? DPAR_REDUCTION_ALL_REDUCE
                                                                 : DPAR_REDUCTION_REDUCE_SCATTER));
    losses_all.push_back(train(all, d, s % kBatches));
    losses_scatter.push_back(train(scatter, d, s % kBatches));
    if (max_norm > 0.0f) {
      // The norm before clipping: above max_norm, the step was clipped.
      float norm_all = 0.0f, norm_scatter = 0.0f;
      CHECK_OK(dpar_engine_grad_norm(&norm_all, all));
      CHECK_OK(dpar_engine_grad_norm(&norm_scatter, scatter));
      expect(norm_all > max_norm && norm_scatter > max_norm,
             label + ": step " + std::to_string(s) + " was not clipped (norms " + std::to_string(norm_all) + ", " +
                 std::to_string(norm_scatter) + ")");
      expect(std::abs(norm_all - norm_scatter) <= 1e-5 * norm_all,
             label + ": step " + std::to_string(s) + ": norm " + std::to_string(norm_scatter) +
                 " with the reduce-scatter, " + std::to_string(norm_all) + " with the all-reduce");
    }
  }
  const std::vector<float> trained = params(all, 0), sharded = params(scatter, 0);
  expect(max_relative_error(trained, initial) > 1e-3, label + ": training did not move the parameters");
  if (max_norm > 0.0f) {
    const double err = max_relative_error(sharded, trained), loss_err = max_relative_error(losses_scatter, losses_all);
    expect(err <= 1e-5, label + ": parameters differ by " + std::to_string(err) + " relative");
    expect(loss_err <= 1e-5, label + ": losses differ by " + std::to_string(loss_err) + " relative");
  } else {
    expect(same_bits(sharded, trained), label + ": the reduce-scatter's parameters are not the all-reduce's bits");
    expect(same_bits(losses_scatter, losses_all), label + ": the reduce-scatter's losses are not the all-reduce's");
  }
  check_replicas_agree(all, devices, label + ", all-reduce");
  check_replicas_agree(scatter, devices, label + ", reduce-scatter");
  expect(same_as_rank0(losses_scatter), label + ": the reduce-scatter's losses differ from rank 0's");
  dpar_engine_free(scatter);
  dpar_engine_free(all);
}

// One training step of e on global batch 0, traced into dir: the trace's text.
std::string traced_step(dpar_engine* e, const Data& d, const std::string& dir, const std::string& name) {
  const std::string path = dir + "/" + name + "_rank" + std::to_string(g_rank) + ".json";
  CHECK_OK(dpar_engine_trace_start(e));
  train(e, d, 0);
  CHECK_OK(dpar_engine_trace_stop(e, path.c_str()));
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  std::remove(path.c_str());
  return text.str();
}

// The reduce-scatter engine reduce-scatters its buckets and the others all-reduce them: within one process, and
// with several hierarchically, the reduce-scatter's second level across the processes (each replica index on its
// own link), the all-reduce's through replica 0. The parameters' all-gather crosses the processes where the
// optimizer's shards span them (the reduce-scatter, the sharded all-reduce), and not under the default all-reduce,
// whose shards stay within each process: only the all-reduce crosses, as DDP.
void check_traces(size_t devices, const Data& d) {
  char dir[] = "/tmp/dpar_mpi_zero_XXXXXX";
  // Each rank makes its own directory: no shared file system needed.
  if (!mkdtemp(dir)) {
    expect(false, "trace: cannot make a temporary directory");
    return;
  }
  dpar_engine* all = make_engine(devices, DPAR_ADAM, DPAR_REDUCTION_ALL_REDUCE);
  dpar_engine* scatter = make_engine(devices, DPAR_ADAM, DPAR_REDUCTION_REDUCE_SCATTER);
  dpar_engine* sharded = make_engine(devices, DPAR_ADAM, DPAR_REDUCTION_ALL_REDUCE_SHARDED);
  const std::string trace_all = traced_step(all, d, dir, "all"), trace_scatter = traced_step(scatter, d, dir, "rs");
  const std::string trace_sharded = traced_step(sharded, d, dir, "sharded");
  const auto has = [](const std::string& text, const char* span) {
    return text.find(std::string("\"") + span + "\"") != std::string::npos;
  };
  if (g_size == 1) {
    expect(has(trace_scatter, "bucket reduce-scatter") && !has(trace_scatter, "bucket all-reduce"),
           "trace: the reduce-scatter engine's buckets were not reduce-scattered");
    expect(has(trace_all, "bucket all-reduce") && !has(trace_all, "bucket reduce-scatter"),
           "trace: the all-reduce engine's buckets were not all-reduced");
  } else {
    expect(has(trace_scatter, "bucket reduce-scatter (replicas)") &&
               has(trace_scatter, "bucket reduce-scatter (processes)") &&
               !has(trace_scatter, "bucket all-reduce (processes)"),
           "trace: the reduce-scatter engine's buckets were not reduce-scattered across the processes");
    expect(has(trace_all, "bucket all-reduce (processes)") && !has(trace_all, "bucket reduce-scatter (processes)"),
           "trace: the all-reduce engine's buckets were not all-reduced across the processes");
    expect(has(trace_scatter, "all-gather (processes)") && has(trace_sharded, "all-gather (processes)"),
           "trace: the parameters' shards were not all-gathered across the processes");
    expect(has(trace_sharded, "bucket all-reduce (processes)") && !has(trace_sharded, "bucket reduce-scatter"),
           "trace: the sharded all-reduce engine's buckets were not all-reduced across the processes");
    expect(!has(trace_all, "all-gather (processes)"),
           "trace: the default all-reduce all-gathered the parameters across the processes");
  }
  dpar_engine_free(sharded);
  dpar_engine_free(scatter);
  dpar_engine_free(all);
  rmdir(dir);
}

// An unknown reduction is refused on every process alike (each checks its own argument), and the engine keeps its
// reduction and trains on.
void check_unknown_reduction(size_t devices, const Data& d) {
  dpar_engine* e = make_engine(devices, DPAR_ADAM, DPAR_REDUCTION_REDUCE_SCATTER);
  for (int32_t bad : {3, -1}) {
    const dpar_status s = dpar_engine_set_gradient_reduction(e, bad);
    expect(s == DPAR_ERR_INVALID_ARGUMENT && std::strstr(dpar_last_error(), "reduction"),
           "reduction " + std::to_string(bad) + ": " + dpar_status_str(s) + " (" + dpar_last_error() +
               "), want INVALID_ARGUMENT naming the reduction");
  }
  expect(dpar_engine_set_gradient_reduction(nullptr, DPAR_REDUCTION_ALL_REDUCE) == DPAR_ERR_INVALID_ARGUMENT,
         "a NULL engine is not refused");
  const float loss = train(e, d, 0);
  expect(std::isfinite(loss), "after a refused reduction the engine does not train");
  check_replicas_agree(e, devices, "after a refused reduction");
  dpar_engine_free(e);
}

}  // namespace

int main(int argc, char** argv) {
  size_t devices = 2;
  int expect_processes = 0;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--devices") && i + 1 < argc) devices = static_cast<size_t>(std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--expect-processes") && i + 1 < argc) expect_processes = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: test_mpi_zero [--devices N] [--expect-processes P]\n");
      return 2;
    }
  }
  {
    dpar_engine* probe = make_engine(1, DPAR_ADAM, DPAR_REDUCTION_ALL_REDUCE);
    size_t rank = 0, size = 1;
    CHECK_OK(dpar_engine_processes(&rank, &size, probe));
    g_rank = static_cast<int>(rank);
    g_size = static_cast<int>(size);
    dpar_engine_free(probe);
  }
  // Every launched process must have joined: processes that each took the job for one would pass every check.
  if (expect_processes > 0 && g_size != expect_processes) {
    std::fprintf(stderr, "[rank %d] FAIL the engine sees %d processes, but %d were launched\n", g_rank, g_size,
                 expect_processes);
    return 1;
  }
  const Data d = make_data();
  check_reductions(devices, d, DPAR_ADAM, 0.0f, false);
  check_reductions(devices, d, DPAR_SGD, 0.0f, true);
  // Below every step's norm (0.15 to 0.5 for this model and data): every step is clipped, which the checks see.
  check_reductions(devices, d, DPAR_ADAM, 0.05f, false);
  check_reductions(devices, d, DPAR_SGD, 0.05f, true);
  check_traces(devices, d);
  check_unknown_reduction(devices, d);
  if (g_rank == 0) std::printf("%s\n", g_failures ? "FAILED" : "ALL PASSED");
  return g_failures ? 1 : 0;
}
