// dpar_engine_set_reproducible over several processes, through the C ABI, run under mpirun and alone
// (tests/CMakeLists.txt):
//
//   test_mpi_reproducible --devices N [--expect-processes P]      each process runs N CPU devices
//
// An MLP with BatchNorm and dropout, trained with Adam and clipping in the reproducible mode (micro-chunks of 5 rows)
// on global batches of 37 rows, each process feeding whole micro-chunks of them (the global micro-chunks split over
// the processes as DataParallel splits rows; the last micro-chunk has two rows). On every rank, every step's loss,
// every replica's final parameters and BatchNorm's running statistics have the bits of an engine of this process
// alone on one device
// (DPAR_PROCESSES_SINGLE) fed the whole global batches, and rank 0's bits; a job of another device count per process
// resumed half-way from the job's checkpoint goes on with the same bits. Every rank prints its failures as
// "[rank r] FAIL ..." and exits nonzero if it saw one; rank 0 prints a summary.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "dpar.h"
#include "mpi_checks.h"

namespace {

using mpi_checks::g_failures;
using mpi_checks::g_rank;
using mpi_checks::g_size;
using mpi_checks::expect;

constexpr int64_t kIn = 12, kHidden = 16, kClasses = 5, kGlobalBatch = 37, kChunkRows = 5, kSteps = 12;
constexpr size_t kParamElements =
    kIn * kHidden + kHidden + 2 * kHidden + kHidden * kHidden + kHidden + kHidden * kClasses + kClasses;

// processes: DPAR_PROCESSES_MPI or DPAR_PROCESSES_SINGLE.
dpar_engine* make_engine(size_t devices, int32_t processes) {
  dpar_model_options mo = DPAR_MODEL_OPTIONS_INIT;
  mo.seed = 7;
  dpar_model* m = nullptr;
  CHECK_OK(dpar_model_create(&m, &mo));
  CHECK_OK(dpar_model_add_linear(m, kIn, kHidden, 1));
  CHECK_OK(dpar_model_add_batchnorm1d(m, kHidden, 1e-5f, 0.1f, 1));
  CHECK_OK(dpar_model_add_activation(m, DPAR_TANH));
  CHECK_OK(dpar_model_add_dropout(m, 0.1f));
  CHECK_OK(dpar_model_add_linear(m, kHidden, kHidden, 1));
  CHECK_OK(dpar_model_add_activation(m, DPAR_TANH));
  CHECK_OK(dpar_model_add_linear(m, kHidden, kClasses, 1));
  dpar_optimizer_options opt = DPAR_OPTIMIZER_OPTIONS_INIT;
  opt.kind = DPAR_ADAM;
  opt.lr = 0.01f;
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = devices;
  eo.processes = processes;
  eo.timeout_seconds = 60.0;
  eo.seed = 3;
  dpar_engine* e = nullptr;
  CHECK_OK(dpar_engine_create(&e, m, &opt, &eo));
  dpar_model_free(m);
  CHECK_OK(dpar_engine_set_max_grad_norm(e, 1.0f));
  CHECK_OK(dpar_engine_set_reproducible(e, kChunkRows));
  return e;
}

// The global batch of step s, the same on every rank.
void make_batch(int s, std::vector<float>& x, std::vector<int32_t>& y) {
  std::mt19937 gen(1234 + static_cast<unsigned>(s));
  std::normal_distribution<float> normal;
  x.resize(kGlobalBatch * kIn);
  y.resize(kGlobalBatch);
  for (auto& v : x) v = normal(gen);
  for (auto& v : y) v = static_cast<int32_t>(gen() % kClasses);
}

// This process's rows: whole micro-chunks, the global micro-chunks split as DataParallel splits rows.
std::pair<int64_t, int64_t> my_rows() {
  const int64_t chunks = (kGlobalBatch + kChunkRows - 1) / kChunkRows;
  const int64_t per = (chunks + g_size - 1) / g_size;
  const int64_t first = std::min<int64_t>(chunks, per * g_rank), last = std::min<int64_t>(chunks, per * (g_rank + 1));
  const int64_t begin = std::min(kGlobalBatch, first * kChunkRows), end = std::min(kGlobalBatch, last * kChunkRows);
  return {begin, end - begin};
}

float train(dpar_engine* e, std::vector<float>& xs, std::vector<int32_t>& ys, int64_t begin, int64_t rows) {
  const int64_t xshape[2] = {rows, kIn}, yshape[1] = {rows};
  dpar_tensor *x = nullptr, *y = nullptr;
  CHECK_OK(dpar_tensor_wrap_host(&x, DPAR_F32, xshape, 2, xs.data() + begin * kIn));
  CHECK_OK(dpar_tensor_wrap_host(&y, DPAR_I32, yshape, 1, ys.data() + begin));
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

// BatchNorm's running mean and variance (buffers 0 and 1).
std::vector<float> running_statistics(dpar_engine* e, size_t replica) {
  std::vector<float> b(2 * kHidden);
  CHECK_OK(dpar_engine_get_buffer(b.data(), e, replica, 0, kHidden));
  CHECK_OK(dpar_engine_get_buffer(b.data() + kHidden, e, replica, 1, kHidden));
  return b;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Rank 0's values, broadcast.
std::vector<float> rank0(const std::vector<float>& mine) {
  dpar_comm* world = nullptr;
  CHECK_OK(dpar_comm_create_mpi(&world, nullptr));
  std::vector<float> root = mine;
  CHECK_OK(dpar_comm_broadcast(world, root.data(), root.size(), DPAR_F32, 0));
  dpar_comm_free(world);
  return root;
}

}  // namespace

int main(int argc, char** argv) {
  size_t devices = 2;
  int expect_processes = 0;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--devices") && i + 1 < argc) devices = static_cast<size_t>(std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--expect-processes") && i + 1 < argc) expect_processes = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: test_mpi_reproducible [--devices N] [--expect-processes P]\n");
      return 2;
    }
  }
  dpar_engine* job = make_engine(devices, DPAR_PROCESSES_MPI);
  {
    size_t rank = 0, size = 1;
    CHECK_OK(dpar_engine_processes(&rank, &size, job));
    g_rank = static_cast<int>(rank);
    g_size = static_cast<int>(size);
  }
  // Every launched process must have joined: processes that each took the job for one would pass every check.
  if (expect_processes > 0 && g_size != expect_processes) {
    std::fprintf(stderr, "[rank %d] FAIL the engine sees %d processes, but %d were launched\n", g_rank, g_size,
                 expect_processes);
    return 1;
  }
  dpar_engine* alone = make_engine(1, DPAR_PROCESSES_SINGLE);
  // Half-way, the job saves a checkpoint (rank 0 writes it, into its own directory: no shared file system needed),
  // and a job of another device count per process resumes from it (rank 0 reads it and broadcasts it).
  char dir[] = "/tmp/dpar_mpi_reproducible_XXXXXX";
  if (!mkdtemp(dir)) return 2;
  const std::string path = std::string(dir) + "/half.safetensors";
  const size_t other_devices = devices == 1 ? 2 : 1;
  dpar_engine* resumed = nullptr;
  const auto [begin, rows] = my_rows();
  std::vector<float> x, job_losses, alone_losses, resumed_losses;
  std::vector<int32_t> y;
  for (int s = 0; s < kSteps; ++s) {
    if (s == kSteps / 2) {
      CHECK_OK(dpar_engine_save(job, path.c_str()));
      resumed = make_engine(other_devices, DPAR_PROCESSES_MPI);
      CHECK_OK(dpar_engine_load(resumed, path.c_str()));
    }
    make_batch(s, x, y);
    job_losses.push_back(train(job, x, y, begin, rows));
    alone_losses.push_back(train(alone, x, y, 0, kGlobalBatch));
    if (resumed) resumed_losses.push_back(train(resumed, x, y, begin, rows));
  }
  std::remove(path.c_str());
  rmdir(dir);
  const std::string label = std::to_string(g_size) + " processes x " + std::to_string(devices) + " devices";
  expect(same_bits(job_losses, alone_losses), label + ": the losses differ from one process's on one device");
  const std::vector<float> first = params(job, 0);
  expect(same_bits(first, params(alone, 0)), label + ": the parameters differ from one process's on one device");
  for (size_t r = 1; r < devices; ++r)
    expect(same_bits(params(job, r), first), label + ": replica " + std::to_string(r) + " differs from replica 0");
  expect(same_bits(rank0(first), first), label + ": replica 0 differs from rank 0's");
  const std::vector<float> stats = running_statistics(job, 0);
  expect(same_bits(stats, running_statistics(alone, 0)),
         label + ": BatchNorm's running statistics differ from one process's on one device");
  for (size_t r = 1; r < devices; ++r)
    expect(same_bits(running_statistics(job, r), stats),
           label + ": replica " + std::to_string(r) + "'s running statistics differ from replica 0's");
  expect(same_bits(resumed_losses, std::vector<float>(job_losses.begin() + kSteps / 2, job_losses.end())),
         label + ": resumed on " + std::to_string(other_devices) + " devices per process, the losses differ");
  expect(same_bits(params(resumed, 0), first),
         label + ": resumed on " + std::to_string(other_devices) + " devices per process, the parameters differ");
  dpar_engine_free(resumed);
  dpar_engine_free(alone);
  dpar_engine_free(job);
  if (g_rank == 0) std::printf("%s\n", g_failures ? "FAILED" : "ALL PASSED");
  return g_failures ? 1 : 0;
}
