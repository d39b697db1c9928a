// The engine over several processes, through the C ABI, run under mpirun (tests/CMakeLists.txt):
//
//   test_mpi_engine --devices N      every check below; each process runs N devices
//   test_mpi_engine --cuda           the same on GPUs (each process's replicas on cuda:K in turn, from its rank's
//                                    first): NCCL between the processes where each has a GPU of its own, MPI
//                                    through host memory where they share one; exits 77 (skipped) without a GPU
//   test_mpi_engine --rank-exit      not a check suite: rank 1 exits before its third step, and the others print
//                                    what their engine returned (tests/mpi/check_rank_exit.sh reads it)
//
// The checks, on every rank:
//  - every launched process joined (--expect-processes P: the engine's world size is the launcher's -np);
//  - P processes x N devices train exactly as one process of P*N devices and as one device on the global batch
//    (relative 1e-5 after 20 Adam steps, and 20 plain SGD steps, which unlike Adam show a gradient of the wrong
//    scale), also with uneven local batches, the parameters moved, and every replica of every process ends with
//    the same parameters;
//  - only rank 0 writes a checkpoint, and a checkpoint that only rank 0 can read loads on every process: training
//    on from it is bit-identical to training straight; a corrupt one is refused on every process;
//  - accumulate() over micro-batches (some with fewer rows than devices, uneven between processes) and step()
//    equal one device's train_step on the global batches, with plain SGD, clipping off and on;
//  - SyncBatchNorm over every replica of every process trains as one device on the global batch (CPU);
//  - each process's trace carries its rank as the pid of every event;
//  - processes given their rows by the launcher's world (not the engine's) and an engine of default options train
//    as one process of all their devices: a job that fell apart into independent processes would not;
//  - the loader's shards of a global batch are balanced, contiguous and cover it;
//  - a call refused on one process (bad labels) is refused on every process at once, and all go on;
//  - bf16 compression: the result equals its definition (each process's f32 sum rounded once to bfloat16, to
//    nearest even, summed across processes in bfloat16), and in a job of one process it changes nothing;
//  - loss scaling: a gradient that overflows in one process's rows alone makes every process skip that step
//    (parameters and step count unchanged, the same scale everywhere), and all go on together;
//  - dpar_engine_abort on rank 0 makes the other processes' next step return REMOTE.
// Every rank prints its failures as "[rank r] FAIL ..." and exits nonzero if it saw one; rank 0 prints a summary.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "char_gpt.h"
#include "dpar.h"
#include "mpi_checks.h"
#include "require_gpu.h"

namespace {

using mpi_checks::g_failures;
using mpi_checks::g_rank;
using mpi_checks::g_size;
using mpi_checks::expect;
size_t g_gpus = 0;  // with --cuda: the GPUs this process sees (replicas go on them in turn); 0: CPU devices

constexpr int64_t kIn = 12, kHidden = 16, kClasses = 5, kGlobalBatch = 32, kBatches = 4, kSteps = 20;

dpar_model* make_model() {
  dpar_model_options mo = DPAR_MODEL_OPTIONS_INIT;
  mo.seed = 7;
  dpar_model* m = nullptr;
  CHECK_OK(dpar_model_create(&m, &mo));
  CHECK_OK(dpar_model_add_linear(m, kIn, kHidden, 1));
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

// processes: DPAR_PROCESSES_MPI or _SINGLE.
// optimizer: DPAR_ADAM (the default) or DPAR_SGD, plain: Adam normalises a gradient's scale away, SGD's step is
// proportional to it, so only SGD shows a gradient scaled by the wrong batch size.
// lr: 0 for the optimizer's usual one here. model: make_model()'s when NULL; the caller keeps its own.
dpar_engine* make_engine(size_t devices, int32_t processes, double timeout = 60.0, int32_t optimizer = DPAR_ADAM,
                         float lr = 0.0f, const dpar_model* own_model = nullptr) {
  dpar_model* model = own_model ? nullptr : make_model();
  dpar_optimizer_options opt = DPAR_OPTIMIZER_OPTIONS_INIT;
  opt.kind = optimizer;
  opt.lr = lr > 0.0f ? lr : optimizer == DPAR_SGD ? 0.1f : 0.01f;
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = devices;
  std::vector<int32_t> gpus;
  if (g_gpus > 0) {
    // A process of the job starts at its rank's GPU (a distinct one per process where there are enough); a
    // reference engine of this process alone starts at GPU 0.
    const size_t first = processes == DPAR_PROCESSES_MPI ? static_cast<size_t>(g_rank) * devices : 0;
    for (size_t r = 0; r < devices; ++r) gpus.push_back(static_cast<int32_t>((first + r) % g_gpus));
    eo.device_kind = DPAR_DEVICE_CUDA;
    eo.device_ids = gpus.data();
    eo.num_device_ids = gpus.size();
  }
  eo.processes = processes;
  eo.timeout_seconds = timeout;
  eo.first_bucket_bytes = 64;  // several buckets even for this small model: the hierarchy runs per bucket
  eo.bucket_cap_bytes = 256;
  dpar_engine* e = nullptr;
  CHECK_OK(dpar_engine_create(&e, own_model ? own_model : model, &opt, &eo));
  dpar_model_free(model);
  return e;
}

// One step on rows [begin, begin + rows) of global batch b.
dpar_status step_rows(dpar_engine* e, const Data& d, int b, int64_t begin, int64_t rows) {
  const int64_t xs[2] = {rows, kIn}, ys[1] = {rows};
  dpar_tensor *x = nullptr, *y = nullptr;
  CHECK_OK(dpar_tensor_wrap_host(&x, DPAR_F32, xs, 2, const_cast<float*>(d.x[b].data() + begin * kIn)));
  CHECK_OK(dpar_tensor_wrap_host(&y, DPAR_I32, ys, 1, const_cast<int32_t*>(d.y[b].data() + begin)));
  const dpar_status s = dpar_engine_train_step(nullptr, e, x, y);
  dpar_tensor_free(x);
  dpar_tensor_free(y);
  return s;
}

// count: the model's parameter elements (make_model()'s when 0).
std::vector<float> params(dpar_engine* e, size_t replica = 0, size_t count = 0) {
  std::vector<float> p(count ? count : kIn * kHidden + kHidden + kHidden * kClasses + kClasses);
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
  return root == mine;
}

double max_relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, std::abs(double(a[i]) - double(b[i])) / std::max(std::abs(double(b[i])), 1e-2));
  return worst;
}

// How the engines of make_engine(devices, DPAR_PROCESSES_MPI) send buckets across the processes: nothing for one
// process; MPI on CPU devices;
// on GPUs NCCL where each process's first replica has a GPU of its own, MPI through host memory (the start of a
// longer text that says why) where two share one.
std::string expected_transport(size_t devices) {
  if (g_size == 1) return "";  // a job of one process trains as a single process
  if (g_gpus == 0) return "mpi";
  std::vector<size_t> firsts;
  for (int r = 0; r < g_size; ++r) firsts.push_back(static_cast<size_t>(r) * devices % g_gpus);
  std::sort(firsts.begin(), firsts.end());
  return std::adjacent_find(firsts.begin(), firsts.end()) == firsts.end() ? "nccl" : "mpi through host memory";
}

// This rank's rows of a global batch: balanced (sizes differ by one at most), or skewed by `skew` rows toward rank 0.
std::pair<int64_t, int64_t> my_rows(int64_t skew, int64_t global = kGlobalBatch) {
  const int64_t base = global / g_size, extra = global % g_size;
  std::vector<int64_t> rows(static_cast<size_t>(g_size));
  for (int r = 0; r < g_size; ++r) rows[static_cast<size_t>(r)] = base + (r < extra ? 1 : 0);
  if (g_size > 1) {
    rows[0] += skew;
    rows[static_cast<size_t>(g_size - 1)] -= skew;
  }
  int64_t begin = 0;
  for (int r = 0; r < g_rank; ++r) begin += rows[static_cast<size_t>(r)];
  return {begin, rows[static_cast<size_t>(g_rank)]};
}

void check_equivalence(size_t devices, const Data& d, int64_t skew, int32_t optimizer = DPAR_ADAM) {
  const std::string label = std::to_string(g_size) + " processes x " + std::to_string(devices) + " devices" +
                            (optimizer == DPAR_SGD ? ", SGD" : ", Adam") + (skew ? " (uneven local batches)" : "");
  dpar_engine* multi = make_engine(devices, DPAR_PROCESSES_MPI, 60.0, optimizer);
  const std::string transport = dpar_engine_process_transport(multi), want = expected_transport(devices);
  // Staged through the host, the transport goes on to say why: "mpi through host memory (...)".
  const bool as_expected = want == "mpi through host memory" ? transport.rfind(want + " (", 0) == 0 : transport == want;
  expect(as_expected, label + ": buckets cross the processes by \"" + transport + "\", expected \"" + want + "\"");
  const auto initial = params(multi);
  const auto [begin, rows] = my_rows(skew);
  for (int s = 0; s < kSteps; ++s) CHECK_OK(step_rows(multi, d, s % kBatches, begin, rows));
  const auto got = params(multi);

  // The references, computed by every rank on its own: one process of P*N devices, and one device.
  dpar_engine* wide = make_engine(static_cast<size_t>(g_size) * devices, DPAR_PROCESSES_SINGLE, 60.0, optimizer);
  dpar_engine* one = make_engine(1, DPAR_PROCESSES_SINGLE, 60.0, optimizer);
  for (int s = 0; s < kSteps; ++s) {
    CHECK_OK(step_rows(wide, d, s % kBatches, 0, kGlobalBatch));
    CHECK_OK(step_rows(one, d, s % kBatches, 0, kGlobalBatch));
  }
  const auto ref_wide = params(wide), ref_one = params(one);
  // Equal to the references only means something if training moved the parameters.
  double moved = 0;
  for (size_t i = 0; i < got.size(); ++i) moved = std::max(moved, std::abs(double(got[i]) - double(initial[i])));
  expect(moved > 1e-2, label + ": the parameters barely moved (by " + std::to_string(moved) + " at most)");
  const double e_wide = max_relative_error(got, ref_wide), e_one = max_relative_error(got, ref_one);
  expect(e_wide < 1e-5, label + ": differs from 1 process x " + std::to_string(g_size * devices) +
                            " devices by " + std::to_string(e_wide));
  expect(e_one < 1e-5, label + ": differs from 1 device by " + std::to_string(e_one));
  for (size_t r = 1; r < devices; ++r) expect(params(multi, r) == got, label + ": replica " + std::to_string(r) + " differs");
  expect(same_as_rank0(got), label + ": this process's parameters differ from rank 0's");
  if (g_rank == 0)
    std::printf("%s: max relative difference %.2e to 1x%zu devices, %.2e to 1 device (across processes: %s)\n",
                label.c_str(), e_wide, static_cast<size_t>(g_size) * devices, e_one, transport.c_str());
  dpar_engine_free(multi);
  dpar_engine_free(wide);
  dpar_engine_free(one);
}

// SyncBatchNorm over every replica of every process (uneven local batches): P processes x N devices train as one
// device on the global batch, running statistics included, and every replica of every process holds the same
// buffers. CPU only (BatchNorm is not built for GPUs yet).
void check_sync_batchnorm(size_t devices, const Data& d) {
  const std::string label = std::to_string(g_size) + " processes x " + std::to_string(devices) + " devices, SyncBatchNorm";
  dpar_model_options mo = DPAR_MODEL_OPTIONS_INIT;
  mo.seed = 11;
  dpar_model* m = nullptr;
  CHECK_OK(dpar_model_create(&m, &mo));
  CHECK_OK(dpar_model_add_linear(m, kIn, kHidden, 0));
  CHECK_OK(dpar_model_add_batchnorm1d(m, kHidden, 1e-5f, 0.1f, 1));
  CHECK_OK(dpar_model_add_activation(m, DPAR_TANH));
  CHECK_OK(dpar_model_add_linear(m, kHidden, kClasses, 1));
  CHECK_OK(dpar_model_convert_sync_batchnorm(m));
  size_t count = 0;
  CHECK_OK(dpar_model_num_param_elements(&count, m));
  dpar_engine* multi = make_engine(devices, DPAR_PROCESSES_MPI, 60.0, DPAR_ADAM, 0.0f, m);
  dpar_engine* one = make_engine(1, DPAR_PROCESSES_SINGLE, 60.0, DPAR_ADAM, 0.0f, m);
  const auto [begin, rows] = my_rows(3);
  for (int s = 0; s < 8; ++s) {
    CHECK_OK(step_rows(multi, d, s % kBatches, begin, rows));
    CHECK_OK(step_rows(one, d, s % kBatches, 0, kGlobalBatch));
  }
  const auto got = params(multi, 0, count), want = params(one, 0, count);
  const double e = max_relative_error(got, want);
  expect(e < 1e-4, label + ": parameters differ from 1 device by " + std::to_string(e));
  std::vector<float> mean(kHidden), var(kHidden), want_mean(kHidden), want_var(kHidden);
  int64_t tracked = 0;
  CHECK_OK(dpar_engine_get_buffer(mean.data(), multi, 0, 0, mean.size()));
  CHECK_OK(dpar_engine_get_buffer(var.data(), multi, 0, 1, var.size()));
  CHECK_OK(dpar_engine_get_buffer(&tracked, multi, devices - 1, 2, 1));
  CHECK_OK(dpar_engine_get_buffer(want_mean.data(), one, 0, 0, mean.size()));
  CHECK_OK(dpar_engine_get_buffer(want_var.data(), one, 0, 1, var.size()));
  const double eb = std::max(max_relative_error(mean, want_mean), max_relative_error(var, want_var));
  expect(eb < 1e-4, label + ": running statistics differ from 1 device by " + std::to_string(eb));
  expect(tracked == 8, label + ": num_batches_tracked is " + std::to_string(tracked) + ", not 8");
  for (size_t r = 1; r < devices; ++r) {
    expect(params(multi, r, count) == got, label + ": replica " + std::to_string(r) + " differs");
    std::vector<float> other(kHidden);
    CHECK_OK(dpar_engine_get_buffer(other.data(), multi, r, 0, other.size()));
    expect(other == mean, label + ": replica " + std::to_string(r) + "'s running_mean differs");
  }
  expect(same_as_rank0(got) && same_as_rank0(mean), label + ": this process differs from rank 0");
  if (g_rank == 0) std::printf("%s: max relative difference %.2e to 1 device\n", label.c_str(), e);
  dpar_engine_free(multi);
  dpar_engine_free(one);
  dpar_model_free(m);
}

// accumulate() on this process's rows of each micro-batch, then step(): the gradient of the mean loss over every
// process's rows of every micro-batch, as one device's train_step on the global batch. Each micro-batch's mean is
// taken over the global micro-batch (a process that scaled by its own rows would step by P times too much, which
// plain SGD shows). Clipping off and on (the norm of the summed gradient). Micro-batches with fewer rows than
// devices leave replicas without rows in some of a step's micro-batches, or in a whole step: what they held from
// earlier steps must not reach the sum.
void check_accumulation(size_t devices, const Data& d) {
  constexpr int kAccSteps = 6;
  const float kMaxNorm = 0.05f;  // below every step's gradient norm here (checked below): it clips each step
  std::vector<float> unclipped;
  for (float max_norm : {0.0f, kMaxNorm}) {
    const std::string label = std::to_string(g_size) + " processes x " + std::to_string(devices) +
                              " devices, accumulate and step, SGD, " +
                              (max_norm > 0 ? "clipping to " + std::to_string(max_norm) : std::string("no clipping"));
    dpar_engine* multi = make_engine(devices, DPAR_PROCESSES_MPI, 60.0, DPAR_SGD);
    dpar_engine* one = make_engine(1, DPAR_PROCESSES_SINGLE, 60.0, DPAR_SGD);
    CHECK_OK(dpar_engine_set_max_grad_norm(multi, max_norm));
    CHECK_OK(dpar_engine_set_max_grad_norm(one, max_norm));
    const auto initial = params(multi);
    for (int s = 0; s < kAccSteps; ++s) {
      const int b = s % kBatches;
      // Step kinds: 0, the whole global batch in one micro-batch; 1, uneven local batches in micro-batches of 1, 2
      // and the rest; 2, a global batch of 2 rows per process in micro-batches of 1 (replicas past the first get
      // none in the whole step).
      const int kind = s % 3;
      const int64_t global = kind == 2 ? 2 * g_size : kGlobalBatch;
      const auto [begin, rows] = my_rows(kind == 1 && g_size > 1 ? 3 : 0, global);
      const std::vector<int64_t> micro = kind == 0   ? std::vector<int64_t>{rows}
                                         : kind == 1 ? std::vector<int64_t>{1, 2, rows - 3}
                                                     : std::vector<int64_t>{1, 1};
      int64_t at = begin;
      for (int64_t m : micro) {
        const int64_t xs[2] = {m, kIn}, ys[1] = {m};
        dpar_tensor *x = nullptr, *y = nullptr;
        CHECK_OK(dpar_tensor_wrap_host(&x, DPAR_F32, xs, 2, const_cast<float*>(d.x[b].data() + at * kIn)));
        CHECK_OK(dpar_tensor_wrap_host(&y, DPAR_I32, ys, 1, const_cast<int32_t*>(d.y[b].data() + at)));
        CHECK_OK(dpar_engine_accumulate(nullptr, multi, x, y));
        dpar_tensor_free(x);
        dpar_tensor_free(y);
        at += m;
      }
      CHECK_OK(dpar_engine_step(multi));
      CHECK_OK(step_rows(one, d, b, 0, global));
    }
    const auto got = params(multi), want = params(one);
    double moved = 0;
    for (size_t i = 0; i < got.size(); ++i) moved = std::max(moved, std::abs(double(got[i]) - double(initial[i])));
    // Clipped to 0.05, 6 steps of lr 0.1 move a parameter by 0.03 at most.
    expect(moved > 1e-3, label + ": the parameters barely moved (by " + std::to_string(moved) + " at most)");
    const double e = max_relative_error(got, want);
    expect(e < 1e-5, label + ": differs from 1 device's train_step on the global batches by " + std::to_string(e));
    for (size_t r = 1; r < devices; ++r)
      expect(params(multi, r) == got, label + ": replica " + std::to_string(r) + " differs");
    expect(same_as_rank0(got), label + ": this process's parameters differ from rank 0's");
    if (max_norm > 0) {
      float norm = 0;
      CHECK_OK(dpar_engine_grad_norm(&norm, multi));
      expect(norm > max_norm, label + ": the last step's norm " + std::to_string(norm) + " was not clipped");
      const double change = max_relative_error(want, unclipped);
      expect(change > 1e-3, label + ": clipping changed the reference by " + std::to_string(change) + " only");
    } else {
      unclipped = want;
    }
    if (g_rank == 0) std::printf("%s: max relative difference %.2e to 1 device\n", label.c_str(), e);
    dpar_engine_free(multi);
    dpar_engine_free(one);
  }
}

// Gradients compressed to bfloat16 between the processes: every replica of every process still ends with the same
// bits, the result differs from f32's (the compression ran) by about bfloat16's precision, and a process that
// compresses while another does not makes every process's step fail with MISMATCH.
void check_compression(size_t devices, const Data& d) {
  if (g_size < 2) {
    // A job of one process has nothing to send between processes: compression changes nothing at all.
    dpar_engine* plain = make_engine(devices, DPAR_PROCESSES_MPI, 60.0, DPAR_SGD);
    dpar_engine* packed = make_engine(devices, DPAR_PROCESSES_MPI, 60.0, DPAR_SGD);
    CHECK_OK(dpar_engine_set_gradient_compression(packed, DPAR_COMPRESSION_BF16));
    for (int s = 0; s < 4; ++s) {
      CHECK_OK(step_rows(plain, d, s % kBatches, 0, kGlobalBatch));
      CHECK_OK(step_rows(packed, d, s % kBatches, 0, kGlobalBatch));
    }
    expect(params(packed) == params(plain), "bf16 in a job of one process changed the parameters");
    dpar_engine_free(plain);
    dpar_engine_free(packed);
    if (g_rank == 0) std::printf("bf16 compression: a job of one process trains to the same bits as without it\n");
    return;
  }
  // SGD: its step is linear in the gradient, so rounding the gradient to bfloat16 (a relative 2^-9) moves the
  // parameters by about as much (Adam divides by the gradient's own size and magnifies it where that is small).
  dpar_engine* plain = make_engine(devices, DPAR_PROCESSES_MPI, 60.0, DPAR_SGD);
  dpar_engine* packed = make_engine(devices, DPAR_PROCESSES_MPI, 60.0, DPAR_SGD);
  CHECK_OK(dpar_engine_set_gradient_compression(packed, DPAR_COMPRESSION_BF16));
  expect(dpar_engine_set_gradient_compression(packed, 7) == DPAR_ERR_INVALID_ARGUMENT,
         "an unknown compression was accepted");
  const auto [begin, rows] = my_rows(0);
  for (int s = 0; s < kSteps; ++s) {
    CHECK_OK(step_rows(plain, d, s % kBatches, begin, rows));
    CHECK_OK(step_rows(packed, d, s % kBatches, begin, rows));
  }
  const auto want = params(plain), got = params(packed);
  const double e = max_relative_error(got, want);
  expect(got != want, "bf16: the parameters are f32's bit for bit: the buckets were not compressed");
  expect(e < 2e-2, "bf16: differs from f32 by " + std::to_string(e));
  for (size_t r = 1; r < devices; ++r) expect(params(packed, r) == got, "bf16: replica " + std::to_string(r) + " differs");
  expect(same_as_rank0(got), "bf16: this process's parameters differ from rank 0's");
  dpar_engine_free(plain);
  dpar_engine_free(packed);

  dpar_engine* split = make_engine(devices, DPAR_PROCESSES_MPI);
  if (g_rank == 1) CHECK_OK(dpar_engine_set_gradient_compression(split, DPAR_COMPRESSION_BF16));
  const dpar_status s = step_rows(split, d, 0, begin, rows);
  const std::string msg = dpar_last_error();
  expect(s == DPAR_ERR_MISMATCH || s == DPAR_ERR_REMOTE,
         std::string("a step with compression on rank 1 alone returned ") + dpar_status_str(s) + ": " + msg);
  dpar_engine_free(split);
  if (g_rank == 0)
    std::printf("bf16 compression: max relative difference %.2e to f32; processes identical; a process that "
                "differs fails the step (%s)\n", e, dpar_status_str(s));
}

// The reduce dtype bf16 (the whole reduction in bf16, within the processes too), under both gradient reductions:
// every replica of every process ends with the same bits, the result differs from f32's by about bfloat16's
// precision, compression on top changes nothing, and the setting is refused by name for another dtype.
void check_reduce_dtype(size_t devices, const Data& d) {
  dpar_engine* plain = make_engine(devices, DPAR_PROCESSES_MPI, 60.0, DPAR_SGD);
  expect(dpar_engine_set_reduce_dtype(plain, DPAR_F16) == DPAR_ERR_INVALID_ARGUMENT &&
             std::strstr(dpar_last_error(), "reduce_dtype") != nullptr,
         "reduce_dtype f16 was not refused by name");
  const auto [begin, rows] = g_size > 1 ? my_rows(0) : std::pair<int64_t, int64_t>{0, kGlobalBatch};
  std::vector<std::vector<float>> got;
  for (int32_t reduction : {DPAR_REDUCTION_ALL_REDUCE, DPAR_REDUCTION_REDUCE_SCATTER}) {
    dpar_engine* e = make_engine(devices, DPAR_PROCESSES_MPI, 60.0, DPAR_SGD);
    CHECK_OK(dpar_engine_set_gradient_reduction(e, reduction));
    CHECK_OK(dpar_engine_set_reduce_dtype(e, DPAR_BF16));
    if (reduction == DPAR_REDUCTION_REDUCE_SCATTER) CHECK_OK(dpar_engine_set_gradient_compression(e, DPAR_COMPRESSION_BF16));
    for (int s = 0; s < kSteps; ++s) {
      CHECK_OK(step_rows(e, d, s % kBatches, begin, rows));
      if (reduction == DPAR_REDUCTION_ALL_REDUCE) CHECK_OK(step_rows(plain, d, s % kBatches, begin, rows));
    }
    got.push_back(params(e));
    for (size_t r = 1; r < devices; ++r)
      expect(params(e, r) == got.back(), "reduce dtype bf16: replica " + std::to_string(r) + " differs");
    expect(same_as_rank0(got.back()), "reduce dtype bf16: this process's parameters differ from rank 0's");
    dpar_engine_free(e);
  }
  const auto want = params(plain);
  const double err = max_relative_error(got[0], want);
  expect(got[0] != want, "reduce dtype bf16: the parameters are f32's bit for bit");
  expect(err < 2e-2, "reduce dtype bf16: differs from f32 by " + std::to_string(err));
  expect(got[0] == got[1], "reduce dtype bf16: reduce-scatter (with compression) differs from all-reduce");
  dpar_engine_free(plain);
  if (g_rank == 0)
    std::printf("reduce dtype bf16: %d processes x %zu devices identical under both reductions; max relative "
                "difference %.2e to f32\n", g_size, devices, err);
}

// x rounded to the nearest bfloat16, ties to the even one, from the definition: of the two bfloat16 values around x
// (x with its low 16 bits cleared, and the next one away from zero), the nearer; on a tie, the one whose last kept
// bit is 0. Finite values only.
float round_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t low_bits = bits & 0xffff0000u, high_bits = low_bits + 0x10000u;
  float low, high;
  std::memcpy(&low, &low_bits, sizeof low);
  std::memcpy(&high, &high_bits, sizeof high);
  const double to_low = std::abs(double(x) - double(low)), to_high = std::abs(double(high) - double(x));
  if (to_low != to_high) return to_low < to_high ? low : high;
  return (low_bits & 0x10000u) ? high : low;
}

// Every value a bf16 sum of `values` can take, whatever order the reduction adds them in (MPI chooses the order
// with more than two processes): each addition widens its two bfloat16 operands, adds them in f32 (exact for these
// values) and rounds the sum to bfloat16.
std::vector<float> bf16_sums(const std::vector<float>& values) {
  const size_t n = values.size();
  std::vector<std::vector<float>> of(size_t(1) << n);  // of[subset]: the sums of that subset
  for (size_t i = 0; i < n; ++i) of[size_t(1) << i] = {values[i]};
  for (size_t set = 1; set < of.size(); ++set) {
    if ((set & (set - 1)) == 0) continue;
    for (size_t a = (set - 1) & set; a > 0; a = (a - 1) & set) {
      for (float x : of[a])
        for (float y : of[set & ~a]) of[set].push_back(round_bf16(x + y));
    }
    std::sort(of[set].begin(), of[set].end());
    of[set].erase(std::unique(of[set].begin(), of[set].end()), of[set].end());
  }
  return of.back();
}

// The compressed sum against its definition: each process's f32 sum of its replicas' gradients is rounded once to
// bfloat16 (to nearest, ties to even), and those are summed across the processes in bfloat16. The gradients are
// chosen so that every f32 sum in the engine is exact (multiples of 2^-14 with 13 significant bits) but not a
// bfloat16: where the rounding is applied, and how, shows in the result. A linear layer 1 -> K on inputs of 1 makes
// each parameter's gradient the sum of one column of grad_output (dpar_engine_backward), and SGD with lr 1 the
// update p - g, in f32 as the test computes it.
void check_compression_against_definition(size_t devices) {
  constexpr int64_t kOut = 64;
  const int64_t local_rows = 3 * static_cast<int64_t>(devices);  // several rows on every replica
  dpar_model_options mo = DPAR_MODEL_OPTIONS_INIT;
  mo.seed = 3;
  dpar_model* model = nullptr;
  CHECK_OK(dpar_model_create(&model, &mo));
  CHECK_OK(dpar_model_add_linear(model, 1, kOut, 1));
  dpar_engine* e = make_engine(devices, DPAR_PROCESSES_MPI, 60.0, DPAR_SGD, 1.0f, model);
  dpar_model_free(model);
  CHECK_OK(dpar_engine_set_gradient_compression(e, DPAR_COMPRESSION_BF16));
  // Every process's grad_output rows, the same on every rank; process p's are rows [p * local_rows, ...).
  std::mt19937 gen(99);
  std::uniform_int_distribution<int> mantissa(-(1 << 12), 1 << 12);
  std::vector<float> g(static_cast<size_t>(g_size * local_rows * kOut));
  for (auto& v : g) v = std::ldexp(static_cast<float>(mantissa(gen)), -14);
  const std::vector<float> ones(static_cast<size_t>(local_rows), 1.0f);
  const auto before = params(e, 0, 2 * kOut);
  {
    const int64_t xs[2] = {local_rows, 1}, gs[2] = {local_rows, kOut};
    dpar_tensor *x = nullptr, *gout = nullptr, *out = nullptr;
    CHECK_OK(dpar_tensor_wrap_host(&x, DPAR_F32, xs, 2, const_cast<float*>(ones.data())));
    CHECK_OK(dpar_tensor_wrap_host(&gout, DPAR_F32, gs, 2, g.data() + g_rank * local_rows * kOut));
    CHECK_OK(dpar_engine_forward(&out, e, x));
    CHECK_OK(dpar_engine_backward(e, gout));
    CHECK_OK(dpar_engine_step(e));
    dpar_tensor_free(out);
    dpar_tensor_free(x);
    dpar_tensor_free(gout);
  }
  const auto got = params(e, 0, 2 * kOut);
  size_t wrong = 0, rounded = 0, first_wrong = got.size();
  for (int64_t j = 0; j < kOut; ++j) {
    std::vector<float> per_process;
    float exact = 0;
    for (int p = 0; p < g_size; ++p) {
      float sum = 0;  // exact: 13-bit multiples of 2^-14, a few of them
      for (int64_t r = 0; r < local_rows; ++r) sum += g[static_cast<size_t>((p * local_rows + r) * kOut + j)];
      per_process.push_back(round_bf16(sum));
      exact += sum;
    }
    const std::vector<float> sums = bf16_sums(per_process);
    // The weight (kOut x 1) and the bias (kOut) have the same gradient.
    for (size_t i : {static_cast<size_t>(j), static_cast<size_t>(kOut + j)}) {
      bool ok = false;
      for (float sum : sums) ok = ok || got[i] == before[i] - sum;
      if (!ok && wrong++ == 0) first_wrong = i;
      rounded += got[i] != before[i] - exact;
    }
  }
  expect(rounded > 0, "bf16 against its definition: no gradient was changed by rounding (the test shows nothing)");
  expect(wrong == 0, "bf16 against its definition: " + std::to_string(wrong) + " of " + std::to_string(got.size()) +
                         " parameters differ from the reference, the first parameter " + std::to_string(first_wrong));
  for (size_t r = 1; r < devices; ++r)
    expect(params(e, r, got.size()) == got, "bf16 definition: replica " + std::to_string(r) + " differs");
  dpar_engine_free(e);
  if (g_rank == 0 && wrong == 0)
    std::printf("bf16 compression: %zu of %zu gradients rounded, on rank 0 every one as the definition says\n",
                rounded, got.size());
}

// Each process writes its own trace, and names itself in it by its rank (Chrome's pid): the files of a job can be
// opened side by side. Every event of this process's file carries this rank, and the process is named after it.
void check_trace(size_t devices, const Data& d, const std::string& dir) {
  dpar_engine* e = make_engine(devices, DPAR_PROCESSES_MPI);
  const auto [begin, rows] = my_rows(0);
  CHECK_OK(dpar_engine_trace_start(e));
  CHECK_OK(step_rows(e, d, 0, begin, rows));
  const std::string path = dir + "/trace_rank" + std::to_string(g_rank) + ".json";
  CHECK_OK(dpar_engine_trace_stop(e, path.c_str()));
  dpar_engine_free(e);
  std::ifstream in(path);
  const nlohmann::json trace = nlohmann::json::parse(in, nullptr, false);
  expect(!trace.is_discarded() && trace.contains("traceEvents"), "trace: " + path + " is not a trace");
  if (trace.is_discarded() || !trace.contains("traceEvents")) return;
  size_t events = 0, other = 0;
  bool named = false;
  for (const auto& ev : trace["traceEvents"]) {
    ++events;
    if (!ev.contains("pid") || ev["pid"] != g_rank) ++other;
    if (ev.value("name", "") == "process_name")
      named = ev["args"].value("name", "") == "dpar rank " + std::to_string(g_rank);
  }
  expect(events > 0 && other == 0, "trace: " + std::to_string(other) + " of " + std::to_string(events) +
                                       " events do not carry this process's rank as their pid");
  expect(named, "trace: the process is not named \"dpar rank " + std::to_string(g_rank) + "\"");
  std::remove(path.c_str());
  if (g_rank == 0 && named && other == 0)
    std::printf("trace: rank 0's events carry its rank (each rank checks its own)\n");
}

// The README's promise, checked without the engine's own account of the job: the launcher's world (MPI_COMM_WORLD,
// not dpar_engine_processes) gives each process its rows, and an engine created with the defaults
// (DPAR_PROCESSES_AUTO) under mpirun must train P processes of N devices exactly as one process of P*N devices. An
// engine that took each process for a job of its own would train on that process's rows alone.
void check_job_is_one_training(size_t devices, const Data& d) {
  dpar_comm* world = nullptr;
  CHECK_OK(dpar_comm_create_mpi(&world, nullptr));
  size_t rank = 0, size = 1;
  CHECK_OK(dpar_comm_info(&rank, &size, world));
  dpar_comm_free(world);
  if (size < 2) return;
  const std::string label = std::to_string(size) + " launched processes x " + std::to_string(devices) +
                            " devices (DPAR_PROCESSES_AUTO)";
  dpar_engine* job = make_engine(devices, DPAR_PROCESSES_AUTO, 60.0, DPAR_SGD);
  dpar_engine* wide = make_engine(size * devices, DPAR_PROCESSES_SINGLE, 60.0, DPAR_SGD);
  const int64_t base = kGlobalBatch / static_cast<int64_t>(size), extra = kGlobalBatch % static_cast<int64_t>(size);
  const int64_t rows = base + (static_cast<int64_t>(rank) < extra ? 1 : 0);
  const int64_t begin = static_cast<int64_t>(rank) * base + std::min(static_cast<int64_t>(rank), extra);
  for (int s = 0; s < 5; ++s) {
    CHECK_OK(step_rows(job, d, s % kBatches, begin, rows));
    CHECK_OK(step_rows(wide, d, s % kBatches, 0, kGlobalBatch));
  }
  const double e = max_relative_error(params(job), params(wide));
  expect(e < 1e-5, label + ": differs from 1 process x " + std::to_string(size * devices) + " devices by " +
                       std::to_string(e));
  dpar_engine_free(job);
  dpar_engine_free(wide);
  if (g_rank == 0) std::printf("%s: max relative difference %.2e to 1 process\n", label.c_str(), e);
}

bool exists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

void check_checkpoints(size_t devices, const Data& d, const std::string& dir) {
  // Each rank names its own path: only rank 0's may appear, and loading from a path that exists only for rank 0
  // works everywhere because rank 0 reads and broadcasts.
  const std::string mine = dir + "/ckpt_rank" + std::to_string(g_rank) + ".safetensors";
  const auto [begin, rows] = my_rows(0);
  dpar_engine* straight = make_engine(devices, DPAR_PROCESSES_MPI);
  dpar_engine* saved = make_engine(devices, DPAR_PROCESSES_MPI);
  for (int s = 0; s < 10; ++s) {
    CHECK_OK(step_rows(straight, d, s % kBatches, begin, rows));
    CHECK_OK(step_rows(saved, d, s % kBatches, begin, rows));
  }
  CHECK_OK(dpar_engine_save(saved, mine.c_str()));
  expect(exists(mine) == (g_rank == 0), "after save, " + mine + (g_rank == 0 ? " is missing" : " exists"));
  dpar_engine_free(saved);

  dpar_engine* resumed = make_engine(devices, DPAR_PROCESSES_MPI);
  CHECK_OK(dpar_engine_load(resumed, mine.c_str()));
  for (int s = 10; s < 20; ++s) {
    CHECK_OK(step_rows(straight, d, s % kBatches, begin, rows));
    CHECK_OK(step_rows(resumed, d, s % kBatches, begin, rows));
  }
  expect(params(resumed) == params(straight), "resuming from rank 0's checkpoint is not bit-identical");

  // Rank 0's file damaged: every process refuses it, and keeps its parameters. Bits are flipped (writing a fixed
  // byte changes nothing where the byte already holds it).
  if (g_rank == 0) {
    std::fstream f(mine, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-3, std::ios::end);
    const int byte = f.get();
    f.seekp(-3, std::ios::end);
    f.put(static_cast<char>(byte ^ 0x5a));
    expect(f.good(), "could not damage " + mine);
  }
  const auto before = params(resumed);
  const dpar_status s = dpar_engine_load(resumed, mine.c_str());
  expect(s == DPAR_ERR_CORRUPT, std::string("a corrupt checkpoint gave ") + dpar_status_str(s));
  expect(params(resumed) == before, "a refused checkpoint changed the parameters");
  // A path rank 0 cannot read: everyone gets rank 0's IO error.
  const dpar_status missing = dpar_engine_load(resumed, (dir + "/absent.safetensors").c_str());
  expect(missing == DPAR_ERR_IO, std::string("a missing checkpoint gave ") + dpar_status_str(missing));
  dpar_engine_free(straight);
  dpar_engine_free(resumed);
  if (g_rank == 0) {
    std::remove(mine.c_str());
    std::printf("checkpoints: written by rank 0 only, loaded everywhere, corrupt and missing ones refused\n");
  }
}

// A process whose call is refused (bad labels on the last rank) does not leave the others waiting: it returns its own
// INVALID_ARGUMENT, the others REMOTE naming it, at once; nobody took the step, and every engine goes on.
void check_refused_input(size_t devices, const Data& d) {
  if (g_size < 2) return;
  dpar_engine* e = make_engine(devices, DPAR_PROCESSES_MPI, 60.0);
  const auto [begin, rows] = my_rows(0);
  const auto before = params(e);
  Data bad = d;
  if (g_rank == g_size - 1) bad.y[0][static_cast<size_t>(begin)] = kClasses;  // out of range
  const auto t0 = std::chrono::steady_clock::now();
  const dpar_status s = step_rows(e, bad, 0, begin, rows);
  const std::string msg = dpar_last_error();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (g_rank == g_size - 1) {
    expect(s == DPAR_ERR_INVALID_ARGUMENT, std::string("bad labels gave ") + dpar_status_str(s) + ": " + msg);
  } else {
    expect(s == DPAR_ERR_REMOTE, std::string("another rank's bad labels gave ") + dpar_status_str(s) + ": " + msg);
    expect(msg.find("rank " + std::to_string(g_size - 1) + " refused") != std::string::npos,
           "the error does not name the rank that refused: " + msg);
  }
  expect(seconds < 10.0, "the refusal took " + std::to_string(seconds) + " s to reach every process");
  expect(params(e) == before, "a refused step changed the parameters");
  const dpar_status again = step_rows(e, d, 0, begin, rows);
  expect(again == DPAR_OK, std::string("the engine did not go on after a refused step: ") + dpar_status_str(again));
  dpar_engine_free(e);
  if (g_rank == 0) std::printf("refused input: every process refused the step at once and went on\n");
}

// Loss scaling across processes: an inf in the last rank's rows of one batch makes the summed gradient non-finite,
// so every process skips that step, though the others' own gradients are finite; with both gradient reductions.
void check_loss_scaling(size_t devices, const Data& d) {
  for (int32_t reduction : {DPAR_REDUCTION_ALL_REDUCE, DPAR_REDUCTION_REDUCE_SCATTER}) {
    const std::string label = "loss scaling, reduction " + std::to_string(reduction) + ": ";
    dpar_engine* e = make_engine(devices, DPAR_PROCESSES_MPI, 60.0);
    CHECK_OK(dpar_engine_set_gradient_reduction(e, reduction));
    CHECK_OK(dpar_engine_set_loss_scaling(e, 1048576.0f, 2.0f, 0.5f, 2000));
    const auto [begin, rows] = my_rows(0);
    CHECK_OK(step_rows(e, d, 0, begin, rows));
    int32_t skipped = -1;
    CHECK_OK(dpar_engine_last_step_skipped(&skipped, e));
    expect(skipped == 0, label + "a clean step was skipped");
    Data bad = d;
    if (g_size > 1 && rows > 0 && g_rank == g_size - 1) bad.x[1][static_cast<size_t>(begin * kIn)] = INFINITY;
    if (g_size == 1) bad.x[1][0] = INFINITY;
    const auto before = params(e);
    CHECK_OK(step_rows(e, bad, 1, begin, rows));
    CHECK_OK(dpar_engine_last_step_skipped(&skipped, e));
    expect(skipped == 1, label + "the step with an inf in rank " + std::to_string(g_size - 1) +
                             "'s rows was not skipped on rank " + std::to_string(g_rank));
    expect(params(e) == before, label + "the skipped step changed the parameters");
    for (size_t r = 1; r < devices; ++r) expect(params(e, r) == before, label + "replica " + std::to_string(r) + " moved");
    size_t steps = 0;
    float scale = 0.0f;
    CHECK_OK(dpar_engine_step_count(&steps, e));
    CHECK_OK(dpar_engine_loss_scale(&scale, e));
    expect(steps == 1, label + "the skipped step was counted");
    expect(scale == 524288.0f, label + "the scale did not back off: " + std::to_string(scale));
    CHECK_OK(step_rows(e, d, 2, begin, rows));
    CHECK_OK(dpar_engine_last_step_skipped(&skipped, e));
    expect(skipped == 0, label + "the step after the skipped one was skipped");
    expect(params(e) != before, label + "training did not go on");
    expect(same_as_rank0(params(e)), label + "the processes' parameters differ");
    dpar_engine_free(e);
  }
  if (g_rank == 0) std::printf("loss scaling: an overflow in one process's rows skipped the step on every process\n");
}

// Cross-entropy over tokens with ignored targets (DPAR_IGNORE_INDEX), the processes holding different counts of
// them (uneven local batches, and in one step the last process's rows all ignored): the loss and the gradient are
// the mean over the global batch's counted targets, so the job trains as one device on the global batch, never as
// the mean of each process's mean.
// `gpt`: the example's GPT (examples/c/char_gpt.h: positions, causal attention, LayerNorm, GELU, residual sums, the
// tied lm_head) instead of an embedding and a linear layer.
void check_token_loss(size_t devices, bool gpt) {
  constexpr int64_t kVocab = 13, kEmbed = 6, kSeq = 4, kRows = 12, kTokenSteps = 8;
  dpar_model_options mo = DPAR_MODEL_OPTIONS_INIT;
  mo.seed = 11;
  dpar_model* model = nullptr;
  if (gpt) {
    const gpt_config config{kVocab, kSeq, 2, 2, 8, 0.0f};
    model = gpt_build(&config, 11);
  } else {
    CHECK_OK(dpar_model_create(&model, &mo));
    CHECK_OK(dpar_model_add_embedding(model, kVocab, kEmbed));
    CHECK_OK(dpar_model_add_linear(model, kEmbed, kVocab, 1));  // (B, T, E) -> (B, T, V)
  }
  size_t count = 0;
  CHECK_OK(dpar_model_num_param_elements(&count, model));
  dpar_engine* multi = make_engine(devices, DPAR_PROCESSES_MPI, 60.0, DPAR_SGD, 0.5f, model);
  dpar_engine* one = make_engine(1, DPAR_PROCESSES_SINGLE, 60.0, DPAR_SGD, 0.5f, model);
  dpar_model_free(model);
  const auto [begin, rows] = my_rows(g_size > 1 ? 3 : 0, kRows);
  std::mt19937 gen(99);
  double worst_loss = 0;
  for (int s = 0; s < kTokenSteps; ++s) {
    std::vector<int32_t> x(kRows * kSeq), y(kRows * kSeq);
    for (auto& v : x) v = static_cast<int32_t>(gen() % kVocab);
    for (auto& v : y) v = static_cast<int32_t>(gen() % kVocab);
    // Row i ignores its first i % 5 targets (all of them from 4 on): more in some processes' rows than in others'.
    for (int64_t i = 0; i < kRows; ++i)
      for (int64_t t = 0; t < std::min<int64_t>(i % 5, kSeq); ++t)
        y[static_cast<size_t>(i * kSeq + t)] = DPAR_IGNORE_INDEX;
    // In one step the last process's rows are all ignored (with one process: the last 3 rows).
    if (s == 3) {
      const int64_t last = g_size > 1 ? kRows / g_size + ((g_size - 1) < kRows % g_size ? 1 : 0) - 3 : 3;
      for (int64_t i = (kRows - last) * kSeq; i < kRows * kSeq; ++i) y[static_cast<size_t>(i)] = DPAR_IGNORE_INDEX;
    }
    float got = 0, want = 0;
    const int64_t local[2] = {rows, kSeq}, global[2] = {kRows, kSeq};
    dpar_tensor *lx = nullptr, *ly = nullptr, *gx = nullptr, *gy = nullptr;
    CHECK_OK(dpar_tensor_wrap_host(&lx, DPAR_I32, local, 2, x.data() + begin * kSeq));
    CHECK_OK(dpar_tensor_wrap_host(&ly, DPAR_I32, local, 2, y.data() + begin * kSeq));
    CHECK_OK(dpar_tensor_wrap_host(&gx, DPAR_I32, global, 2, x.data()));
    CHECK_OK(dpar_tensor_wrap_host(&gy, DPAR_I32, global, 2, y.data()));
    CHECK_OK(dpar_engine_train_step(&got, multi, lx, ly));
    CHECK_OK(dpar_engine_train_step(&want, one, gx, gy));
    worst_loss = std::max(worst_loss, std::abs(double(got) - double(want)) / std::max(std::abs(double(want)), 1e-2));
    for (dpar_tensor* t : {lx, ly, gx, gy}) dpar_tensor_free(t);
  }
  const auto got = params(multi, 0, count), want = params(one, 0, count);
  const double e = max_relative_error(got, want);
  const std::string what = gpt ? "GPT token loss" : "token loss";
  expect(e < 1e-5, what + ": " + std::to_string(g_size) + " processes x " + std::to_string(devices) +
                       " devices differ from 1 device by " + std::to_string(e));
  expect(worst_loss < 1e-5, what + ": the job's loss differs from 1 device's by " + std::to_string(worst_loss));
  expect(same_as_rank0(got), what + ": this process's parameters differ from rank 0's");
  if (g_rank == 0)
    std::printf("%s with ignored targets: max relative difference %.2e to 1 device (loss %.2e)\n", what.c_str(), e,
                worst_loss);
  dpar_engine_free(multi);
  dpar_engine_free(one);
}

// dpar_engine_abort on rank 0 tells the other processes: their next step returns REMOTE, not a timeout.
void check_abort(size_t devices, const Data& d) {
  if (g_size < 2) return;
  dpar_engine* e = make_engine(devices, DPAR_PROCESSES_MPI, 30.0);
  const auto [begin, rows] = my_rows(0);
  CHECK_OK(step_rows(e, d, 0, begin, rows));
  // Every process is out of that step before rank 0 aborts (an abort also stops a step still in flight elsewhere).
  dpar_comm* world = nullptr;
  CHECK_OK(dpar_comm_create_mpi(&world, nullptr));
  CHECK_OK(dpar_comm_barrier(world));
  dpar_comm_free(world);
  if (g_rank == 0) CHECK_OK(dpar_engine_abort(e));
  const dpar_status s = step_rows(e, d, 1, begin, rows);
  const std::string msg = dpar_last_error();
  if (g_rank == 0) {
    expect(s == DPAR_ERR_INVALID_STATE, std::string("a step after abort returned ") + dpar_status_str(s));
  } else {
    expect(s == DPAR_ERR_REMOTE, std::string("a step after rank 0's abort returned ") + dpar_status_str(s) + ": " + msg);
    expect(msg.find("rank 0 was aborted") != std::string::npos, "the error does not say rank 0 aborted: " + msg);
  }
  dpar_engine_free(e);
  if (g_rank == 0) std::printf("abort: rank 0's abort reached every process\n");
}

// Creation waits create_timeout_seconds for a process that comes late (as a loaded machine schedules one), and then
// the step's short timeout holds: the same lateness in a step is a timeout.
void check_create_timeout(size_t devices, const Data& d) {
  if (g_size < 2) return;
  constexpr double kStep = 0.3, kLate = 1.5;
  dpar_model* model = make_model();
  dpar_optimizer_options opt = DPAR_OPTIMIZER_OPTIONS_INIT;
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = devices;
  eo.processes = DPAR_PROCESSES_MPI;
  eo.timeout_seconds = kStep;
  eo.create_timeout_seconds = 60;
  {
    // Every process starts from here together, then rank 1 comes kLate s late to the creation.
    dpar_comm* world = nullptr;
    CHECK_OK(dpar_comm_create_mpi(&world, nullptr));
    CHECK_OK(dpar_comm_barrier(world));
    dpar_comm_free(world);
  }
  if (g_rank == 1) std::this_thread::sleep_for(std::chrono::duration<double>(kLate));
  dpar_engine* e = nullptr;
  const dpar_status created = dpar_engine_create(&e, model, &opt, &eo);
  expect(created == DPAR_OK, std::string("creation with a late process failed: ") + dpar_last_error());
  dpar_model_free(model);
  if (created != DPAR_OK) return;
  const auto [begin, rows] = my_rows(0);
  CHECK_OK(step_rows(e, d, 0, begin, rows));
  if (g_rank == 1) std::this_thread::sleep_for(std::chrono::duration<double>(kLate));
  const dpar_status s = step_rows(e, d, 1, begin, rows);
  const std::string msg = dpar_last_error();
  if (g_rank == 0)
    expect(s == DPAR_ERR_TIMEOUT, std::string("a step with a process ") + std::to_string(kLate) +
                                      " s late returned " + dpar_status_str(s) + " (" + msg + "), not TIMEOUT");
  else
    expect(s != DPAR_OK, "a step that another process gave up on returned OK");
  dpar_engine_free(e);
  if (g_rank == 0) std::printf("create timeout: a late process joined the creation; the step's timeout held after\n");
}

void check_loader_shards() {
  // 10 samples of 3 features, global batch 4: shards of a batch are contiguous slices of it.
  char dir[] = "/tmp/dpar_shard_XXXXXX";
  if (!mkdtemp(dir)) std::exit(2);
  const std::string images = std::string(dir) + "/images", labels = std::string(dir) + "/labels";
  {
    std::ofstream fi(images, std::ios::binary), fl(labels, std::ios::binary);
    const unsigned char ih[] = {0, 0, 8, 3, 0, 0, 0, 10, 0, 0, 0, 1, 0, 0, 0, 3};
    const unsigned char lh[] = {0, 0, 8, 1, 0, 0, 0, 10};
    fi.write(reinterpret_cast<const char*>(ih), sizeof ih);
    fl.write(reinterpret_cast<const char*>(lh), sizeof lh);
    for (int i = 0; i < 10; ++i) {
      for (int f = 0; f < 3; ++f) fi.put(static_cast<char>(i));
      fl.put(static_cast<char>(i % 10));
    }
  }
  dpar_dataset* ds = nullptr;
  CHECK_OK(dpar_dataset_load_idx(&ds, images.c_str(), labels.c_str()));
  const size_t shards = 3;
  std::vector<int> seen;
  size_t batches = 0;
  for (size_t shard = 0; shard < shards; ++shard) {
    dpar_loader* l = nullptr;
    CHECK_OK(dpar_loader_create(&l, ds, 4, 0, 0, 0));
    CHECK_OK(dpar_loader_shard(l, shard, shards));
    CHECK_OK(dpar_loader_num_batches(&batches, l));
    for (int b = 0;; ++b) {
      int32_t more = 0;
      CHECK_OK(dpar_loader_next(&more, l));
      if (!more) break;
      const dpar_tensor* y = dpar_loader_labels(l);
      int64_t shape[4];
      size_t nd = 0;
      CHECK_OK(dpar_tensor_shape(shape, &nd, y, 4));
      std::vector<int32_t> labels_of_batch(static_cast<size_t>(shape[0]));
      CHECK_OK(dpar_tensor_copy_to_host(labels_of_batch.data(), y, labels_of_batch.size() * sizeof(int32_t)));
      seen.insert(seen.end(), labels_of_batch.begin(), labels_of_batch.end());
      const int64_t want = b < 2 ? (shard == 0 ? 2 : 1) : 0;  // batches of 4: 2,1,1; the last (2 rows) dropped
      expect(shape[0] == want, "loader shard " + std::to_string(shard) + " batch " + std::to_string(b) + ": " +
                                   std::to_string(shape[0]) + " rows, expected " + std::to_string(want));
    }
    dpar_loader_free(l);
  }
  std::sort(seen.begin(), seen.end());
  expect(seen == std::vector<int>({0, 1, 2, 3, 4, 5, 6, 7}), "the shards do not cover the first two batches");
  expect(batches == 2, "num_batches with 3 shards: " + std::to_string(batches) + ", expected 2");
  expect(dpar_loader_shard(nullptr, 0, 1) == DPAR_ERR_INVALID_ARGUMENT, "a NULL loader was accepted");
  dpar_dataset_free(ds);
  std::remove(images.c_str());
  std::remove(labels.c_str());
  rmdir(dir);
}

// Rank 1 exits before its third step; the others must get an error naming it within the timeout.
int rank_exit() {
  const Data d = make_data();
  dpar_engine* e = make_engine(1, DPAR_PROCESSES_MPI, 2.0);
  const auto [begin, rows] = my_rows(0);
  for (int s = 0; s < 5; ++s) {
    if (g_rank == 1 && s == 2) {
      std::fflush(stdout);
      _exit(3);
    }
    const dpar_status st = step_rows(e, d, s % kBatches, begin, rows);
    if (st != DPAR_OK) {
      const std::string msg = dpar_last_error();
      const bool ok = (st == DPAR_ERR_TIMEOUT || st == DPAR_ERR_COMMUNICATION || st == DPAR_ERR_REMOTE) && s == 2;
      std::printf("rank %d: step %d returned %s: %s\n", g_rank, s, dpar_status_str(st), msg.c_str());
      if (ok) std::printf("rank %d: SURVIVOR OK\n", g_rank);
      // The engine is unusable now, on this side too.
      const dpar_status again = step_rows(e, d, 0, begin, rows);
      std::printf("rank %d: the next step returned %s\n", g_rank, dpar_status_str(again));
      std::fflush(stdout);
      _exit(ok && again == DPAR_ERR_INVALID_STATE ? 0 : 1);
    }
  }
  std::printf("rank %d: no error although rank 1 exited\n", g_rank);
  std::fflush(stdout);
  _exit(1);
}

}  // namespace

int main(int argc, char** argv) {
  size_t devices = 2;
  bool exit_mode = false, cuda = false;
  int expect_processes = 0;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--devices") && i + 1 < argc) devices = static_cast<size_t>(std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--expect-processes") && i + 1 < argc) expect_processes = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--rank-exit")) exit_mode = true;
    else if (!std::strcmp(argv[i], "--cuda")) cuda = true;
    else {
      std::fprintf(stderr, "usage: test_mpi_engine [--devices N] [--expect-processes P] [--rank-exit] [--cuda]\n");
      return 2;
    }
  }
  if (cuda) {
    // Every process sees the same machine's answer: all skip, or none.
    const dpar_status s = dpar_device_count(&g_gpus, DPAR_DEVICE_CUDA);
    if (s != DPAR_OK || g_gpus == 0) {
      const char* why = s != DPAR_OK ? dpar_last_error() : "this machine has none";
      if (dpar::test::gpu_required()) {
        std::printf("FAIL: DPAR_TEST_REQUIRE_GPU is set, but dpar finds no CUDA device (%s)\n", why);
        return 1;
      }
      std::printf("SKIP: no CUDA device (%s)\n", why);
      return 77;
    }
  }
  {
    dpar_engine* probe = make_engine(1, DPAR_PROCESSES_MPI);
    size_t rank = 0, size = 1;
    CHECK_OK(dpar_engine_processes(&rank, &size, probe));
    g_rank = static_cast<int>(rank);
    g_size = static_cast<int>(size);
    dpar_engine_free(probe);
  }
  // Every launched process must have joined: an engine that took the job for one process would pass every
  // equivalence check below, each rank alone as rank 0 of 1.
  if (expect_processes > 0 && g_size != expect_processes) {
    std::fprintf(stderr, "[rank %d] FAIL the engine sees %d processes, but %d were launched\n", g_rank, g_size,
                 expect_processes);
    return 1;
  }
  if (exit_mode) return rank_exit();

  const Data d = make_data();
  check_equivalence(devices, d, 0);
  check_equivalence(devices, d, 0, DPAR_SGD);
  if (g_size > 1) {
    check_equivalence(devices, d, 3);
    check_equivalence(devices, d, 3, DPAR_SGD);
  }
  char dir[] = "/tmp/dpar_mpi_engine_XXXXXX";
  // Each rank makes its own directory: the checkpoint test needs no shared file system.
  if (!mkdtemp(dir)) return 2;
  check_checkpoints(devices, d, dir);
  check_accumulation(devices, d);
  if (g_gpus == 0) check_sync_batchnorm(devices, d);
  check_trace(devices, d, dir);
  rmdir(dir);
  check_job_is_one_training(devices, d);
  check_loader_shards();
  check_refused_input(devices, d);
  check_loss_scaling(devices, d);
  check_token_loss(devices, false);
  check_token_loss(devices, true);
  check_compression(devices, d);
  if (g_size > 1) check_compression_against_definition(devices);
  check_reduce_dtype(devices, d);
  check_abort(devices, d);
  check_create_timeout(devices, d);
  if (g_rank == 0) std::printf("%s\n", g_failures ? "FAILED" : "ALL PASSED");
  return g_failures ? 1 : 0;
}
