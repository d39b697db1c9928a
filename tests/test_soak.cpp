// A soak test of the engine's error paths, through dpar.h: thousands of training steps on 3 devices with faults
// injected at random (allocation, forward and backward failures on a random replica), aborts from another thread
// in the middle of a step, and replicas that arrive late enough for the others to time out.
//
// Under mpirun with --processes P, the engine spans the P processes (2 devices each) and each process injects its
// own faults. A failure on one process breaks the engine on every process (it says it must be recreated on every
// process), but a process whose step had finished before it learned of the failure keeps a usable engine: so after
// every step the processes agree, over a communicator of their own (dpar_comm_create_mpi), whether any must
// recreate, and then all recreate together. They also check that they hold the same parameters.
// In CTest as soak_np2. It found a rank left for ever in the MPI backend's blocking transfer (MPI_Allreduce): the
// other rank had timed out, or been aborted, just as the late rank completed the fingerprint exchange with what
// it had sent. The backend now releases such a rank (see "Abandoned exchanges" in src/comm/mpi_comm.h).
//
// After every call it checks that the engine either trains on, with every replica holding the same parameters, or
// says it must be recreated (DPAR_ERR_INVALID_STATE, "must be recreated"), in which case it is freed and recreated
// from the last checkpoint. A watchdog fails the run if any call takes longer than 60 s (a stuck thread); at the
// end, the process's threads must be those it started with, and its resident memory must not have grown since the
// first third of the run.
//
//   test_soak [--seconds S] [--max-steps N] [--seed K] [--timeout T] [--processes P]
//                                          (defaults: 60 s, 20000 steps, seed 1, collective timeout 0.1 s,
//                                           0.25 s across processes)
//
// Prints what it did and exits nonzero on the first failure.
#include <dirent.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "dpar.h"

namespace {

using Clock = std::chrono::steady_clock;

// What the current step injected and how it ended, for the failure message.
std::string g_step_story = "nothing yet";

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "soak: FAIL %s (this step: %s)\n", what.c_str(), g_step_story.c_str());
  std::fflush(stderr);
  std::_Exit(1);
}

void check_ok(dpar_status s, const char* call) {
  if (s != DPAR_OK) fail(std::string(call) + ": " + dpar_status_str(s) + ": " + dpar_last_error());
}
#define CHECK_OK(call) check_ok((call), #call)

long resident_kib() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::strtol(line.c_str() + 6, nullptr, 10);
  return -1;
}

int thread_count() {
  int n = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) (void)entry, ++n;
  return n;
}

size_t g_devices = 3;     // per process: 3 alone, 2 under mpirun
int g_processes = 0;      // --processes P: the world size the engine must span (0: this process alone)
constexpr int64_t kIn = 32, kHidden = 128, kClasses = 4, kRows = 96;
constexpr size_t kParams = kIn * kHidden + kHidden + kHidden * kClasses + kClasses;
double g_timeout_seconds = 0.1;  // --timeout: longer under a sanitizer, which slows every step

// A replica told to arrive late sleeps in the forward hook, past the others' timeout.
struct Delay {
  std::atomic<int> replica{-1};
};

dpar_status delay_hook(void* payload, size_t replica, const int64_t*, size_t, const int64_t*, size_t) {
  auto* d = static_cast<Delay*>(payload);
  int expected = static_cast<int>(replica);
  if (d->replica.compare_exchange_strong(expected, -1))
    std::this_thread::sleep_for(std::chrono::duration<double>(3 * g_timeout_seconds));
  return DPAR_OK;
}

dpar_model* make_model() {
  dpar_model_options mo = DPAR_MODEL_OPTIONS_INIT;
  mo.seed = 5;
  dpar_model* m = nullptr;
  CHECK_OK(dpar_model_create(&m, &mo));
  CHECK_OK(dpar_model_add_linear(m, kIn, kHidden, 1));
  CHECK_OK(dpar_model_add_activation(m, DPAR_RELU));
  CHECK_OK(dpar_model_add_linear(m, kHidden, kClasses, 1));
  return m;
}

dpar_engine* make_engine(const dpar_model* m, Delay* delay) {
  dpar_optimizer_options opt = DPAR_OPTIMIZER_OPTIONS_INIT;
  opt.lr = 0.05f;
  opt.momentum = 0.9f;
  dpar_engine_options eo = DPAR_ENGINE_OPTIONS_INIT;
  eo.num_cpu_devices = g_devices;
  eo.timeout_seconds = g_timeout_seconds;
  // The short timeout is for the faults; creation waits for processes that a loaded machine schedules late.
  eo.create_timeout_seconds = 60;
  eo.pin_workers = 0;
  eo.processes = g_processes > 0 ? DPAR_PROCESSES_MPI : DPAR_PROCESSES_SINGLE;
  dpar_engine* e = nullptr;
  CHECK_OK(dpar_engine_create(&e, m, &opt, &eo));
  CHECK_OK(dpar_engine_set_forward_hook(e, delay_hook, delay, nullptr));
  return e;
}

// Fails unless every replica holds replica 0's parameters, bit for bit, and they are finite.
void check_replicas_identical(dpar_engine* e, long step) {
  std::vector<float> first(kParams), other(kParams);
  CHECK_OK(dpar_engine_get_params(first.data(), e, 0, kParams));
  for (float v : first)
    if (!std::isfinite(v)) fail("step " + std::to_string(step) + ": a parameter is not finite");
  for (size_t r = 1; r < g_devices; ++r) {
    CHECK_OK(dpar_engine_get_params(other.data(), e, r, kParams));
    if (std::memcmp(first.data(), other.data(), kParams * sizeof(float)) != 0)
      fail("step " + std::to_string(step) + ": replica " + std::to_string(r) + " differs from replica 0");
  }
}

// The processes' own agreement channel (a dpar MPI communicator, apart from the engine's); inert alone.
struct World {
  dpar_comm* comm = nullptr;
  size_t rank = 0, size = 1;

  void open() {
    dpar_comm_options o = DPAR_COMM_OPTIONS_INIT;
    o.timeout_seconds = 60;
    CHECK_OK(dpar_comm_create_mpi(&comm, &o));
    CHECK_OK(dpar_comm_info(&rank, &size, comm));
    if (size != size_t(g_processes))
      fail("expected " + std::to_string(g_processes) + " processes, found " + std::to_string(size));
  }
  // Whether any process says yes.
  bool any(bool mine) {
    if (comm == nullptr) return mine;
    const int32_t v = mine ? 1 : 0;
    int32_t out = 0;
    CHECK_OK(dpar_comm_all_reduce(comm, &v, &out, 1, DPAR_I32, DPAR_MAX));
    return out != 0;
  }
  // Fails unless every process holds the same parameters (replica 0's, compared bit for bit through a hash).
  void check_same_parameters(dpar_engine* e, long step) {
    if (comm == nullptr) return;
    std::vector<float> p(kParams);
    CHECK_OK(dpar_engine_get_params(p.data(), e, 0, kParams));
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the bytes
    for (unsigned char c : std::string(reinterpret_cast<const char*>(p.data()), p.size() * sizeof(float)))
      h = (h ^ c) * 1099511628211ull;
    std::vector<int64_t> all(size);
    const int64_t mine = static_cast<int64_t>(h);
    CHECK_OK(dpar_comm_all_gather(comm, &mine, all.data(), 1, DPAR_I64));
    for (size_t r = 1; r < size; ++r)
      if (all[r] != all[0])
        fail("step " + std::to_string(step) + ": process " + std::to_string(r) + " holds other parameters than 0");
  }
};

}  // namespace

int main(int argc, char** argv) {
  double seconds = 60;
  long max_steps = 20000;
  unsigned seed = 1;
  bool timeout_given = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--seconds")) seconds = std::atof(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--max-steps")) max_steps = std::atol(argv[i + 1]);
    else if (!std::strcmp(argv[i], "--seed")) seed = static_cast<unsigned>(std::atol(argv[i + 1]));
    else if (!std::strcmp(argv[i], "--timeout")) g_timeout_seconds = std::atof(argv[i + 1]), timeout_given = true;
    else if (!std::strcmp(argv[i], "--processes")) g_processes = std::atoi(argv[i + 1]);
    else fail(std::string("unknown argument ") + argv[i]);
  }
  World world;
  if (g_processes > 0) {
    g_devices = 2;
    // A little longer than alone: the processes' engine creation is collective within it too.
    if (!timeout_given) g_timeout_seconds = 0.25;
    world.open();  // before counting threads: MPI's own threads stay for the whole run
  }
  // The data is the same everywhere; each process injects its own faults.
  std::mt19937 rng(seed);
  std::mt19937 faults(seed + 7919u * unsigned(world.rank));
  // A sanitizer's runtime may start a thread of its own at the process's first thread creation
  // (ThreadSanitizer's background thread) and keep it: one thread is made and joined first, so that the count at
  // the start includes it. (With OpenBLAS, whose load started its pool, that creation happened before main.)
  std::thread([] {}).join();
  const int threads_at_start = thread_count();

  // The watchdog: a call that does not return within 60 s means a stuck thread.
  std::atomic<int64_t> call_started{0};  // steady-clock ticks of the call in progress, 0 between calls
  std::atomic<bool> finished{false};
  std::string current_call = "none";
  std::thread watchdog([&] {
    while (!finished.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      const int64_t started = call_started.load();
      if (started != 0 && Clock::now().time_since_epoch().count() - started >
                              std::chrono::duration_cast<Clock::duration>(std::chrono::seconds(60)).count())
        fail("a call has not returned for 60 s (a stuck thread): " + current_call);
    }
  });
  auto timed = [&](const char* what, auto&& call) {
    current_call = what;
    call_started.store(Clock::now().time_since_epoch().count());
    const dpar_status s = call();
    call_started.store(0);
    return s;
  };

  // Data: a fixed set of batches, labels a function of the inputs so that the loss falls.
  std::vector<std::vector<float>> xs;
  std::vector<std::vector<int32_t>> ys;
  std::normal_distribution<float> normal;
  for (int b = 0; b < 16; ++b) {
    std::vector<float> x(kRows * kIn);
    std::vector<int32_t> y(kRows);
    for (auto& v : x) v = normal(rng);
    for (int64_t i = 0; i < kRows; ++i) y[size_t(i)] = x[size_t(i * kIn)] > 0 ? (x[size_t(i * kIn + 1)] > 0 ? 0 : 1) : (x[size_t(i * kIn + 2)] > 0 ? 2 : 3);
    xs.push_back(std::move(x));
    ys.push_back(std::move(y));
  }
  const int64_t xshape[2] = {kRows, kIn}, yshape[1] = {kRows};
  std::vector<dpar_tensor*> bx(xs.size()), by(xs.size());
  for (size_t b = 0; b < xs.size(); ++b) {
    CHECK_OK(dpar_tensor_wrap_host(&bx[b], DPAR_F32, xshape, 2, xs[b].data()));
    CHECK_OK(dpar_tensor_wrap_host(&by[b], DPAR_I32, yshape, 1, ys[b].data()));
  }

  char dir_template[] = "/tmp/dpar_soak_XXXXXX";
  if (!mkdtemp(dir_template)) fail("mkdtemp");
  const std::string checkpoint = std::string(dir_template) + "/last.safetensors";

  Delay delay;
  dpar_model* model = make_model();
  dpar_engine* engine = make_engine(model, &delay);
  CHECK_OK(dpar_engine_save(engine, checkpoint.c_str()));

  std::map<std::string, long> events;  // what was injected, and how calls ended
  long steps = 0, good_steps = 0, recreations = 0;
  long rss_third = -1;
  float first_loss = NAN, last_loss = NAN;
  const auto start = Clock::now();
  const auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };

  auto recreate = [&](const char* why) {
    timed("dpar_engine_free", [&] {
      dpar_engine_free(engine);
      return DPAR_OK;
    });
    // The creation is collective across processes, within the engine's timeout: start it together.
    if (world.comm != nullptr) CHECK_OK(dpar_comm_barrier(world.comm));
    engine = make_engine(model, &delay);
    const dpar_status s = timed("dpar_engine_load", [&] { return dpar_engine_load(engine, checkpoint.c_str()); });
    check_ok(s, "dpar_engine_load (recreating)");
    check_replicas_identical(engine, steps);
    world.check_same_parameters(engine, steps);
    ++recreations;
    ++events[std::string("recreated after ") + why];
  };

  while (!world.any(steps >= max_steps || elapsed() >= seconds)) {
    ++steps;
    if (rss_third < 0 && elapsed() > seconds / 3) rss_third = resident_kib();
    const size_t b = size_t(steps) % xs.size();
    const unsigned dice = faults() % 1000;
    std::thread aborter;
    std::string injected = "none";
    if (dice < 30) {
      const int32_t fault = int32_t(1 + faults() % 3);  // ALLOC, FORWARD, BACKWARD
      const size_t replica = faults() % g_devices;
      CHECK_OK(dpar_engine_inject_fault(engine, replica, fault));
      injected = fault == DPAR_FAULT_ALLOC ? "fault ALLOC" : fault == DPAR_FAULT_FORWARD ? "fault FORWARD" : "fault BACKWARD";
    } else if (dice < 32) {
      delay.replica.store(int(faults() % g_devices));
      injected = "late replica";
    } else if (dice < 40) {
      // Within a step's duration (tens to hundreds of microseconds), so that most land while it runs.
      const auto after = std::chrono::microseconds(faults() % 300);
      aborter = std::thread([&, after] {
        std::this_thread::sleep_for(after);
        if (dpar_engine_abort(engine) != DPAR_OK) fail(std::string("dpar_engine_abort: ") + dpar_last_error());
      });
      injected = "abort";
    }
    if (injected != "none") ++events["injected " + injected];

    float loss = NAN;
    const dpar_status s =
        timed("dpar_engine_train_step", [&] { return dpar_engine_train_step(&loss, engine, bx[b], by[b]); });
    if (aborter.joinable()) aborter.join();
    delay.replica.store(-1);  // a delay that did not fire (the step failed before the hook) is disarmed
    ++events[std::string("step ") + dpar_status_str(s)];
    const std::string message = dpar_last_error();
    g_step_story = injected + ", then " + dpar_status_str(s) + (s == DPAR_OK ? "" : ": " + message);

    if (g_processes > 0) {
      // A failure anywhere breaks the engine everywhere it reaches; a process whose step had finished first keeps
      // a usable engine. zero_grad (local) tells which; then all recreate together if any must.
      if (s == DPAR_OK) {
        if (!std::isfinite(loss)) fail("step " + std::to_string(steps) + ": the loss is not finite");
        if (std::isnan(first_loss)) first_loss = loss;
        last_loss = loss;
      } else if (s != DPAR_ERR_INVALID_STATE && s != DPAR_ERR_OUT_OF_MEMORY && s != DPAR_ERR_DEVICE &&
                 s != DPAR_ERR_TIMEOUT && s != DPAR_ERR_REMOTE) {
        fail("step " + std::to_string(steps) + " (" + injected + "): unexpected " + dpar_status_str(s) + ": " + message);
      }
      const dpar_status usable = timed("dpar_engine_zero_grad", [&] { return dpar_engine_zero_grad(engine); });
      if (usable != DPAR_OK &&
          (usable != DPAR_ERR_INVALID_STATE || std::string(dpar_last_error()).find("must be recreated") == std::string::npos))
        fail("step " + std::to_string(steps) + ": zero_grad after the step returned " + dpar_status_str(usable) +
             " without \"must be recreated\": " + dpar_last_error());
      if (s != DPAR_OK && usable == DPAR_OK)
        fail("step " + std::to_string(steps) + ": failed across processes, yet the engine says it is usable: " +
             message);
      if (world.any(usable != DPAR_OK)) {
        recreate(usable != DPAR_OK ? injected.c_str() : "a failure on another process");
        continue;
      }
      ++good_steps;
      check_replicas_identical(engine, steps);
      world.check_same_parameters(engine, steps);
    } else if (s == DPAR_OK) {
      if (!std::isfinite(loss)) fail("step " + std::to_string(steps) + ": the loss is not finite");
      if (std::isnan(first_loss)) first_loss = loss;
      last_loss = loss;
      ++good_steps;
    } else if (s == DPAR_ERR_INVALID_STATE) {
      if (message.find("must be recreated") == std::string::npos)
        fail("step " + std::to_string(steps) + ": INVALID_STATE without \"must be recreated\": " + message);
      recreate(injected == "none" ? "an earlier failure" : injected.c_str());
      continue;
    } else if (s != DPAR_ERR_OUT_OF_MEMORY && s != DPAR_ERR_DEVICE && s != DPAR_ERR_TIMEOUT && s != DPAR_ERR_REMOTE) {
      fail("step " + std::to_string(steps) + " (" + injected + "): unexpected " + dpar_status_str(s) + ": " + message);
    } else if (injected == "none") {
      fail("step " + std::to_string(steps) + ": failed with nothing injected: " + dpar_status_str(s) + ": " + message);
    }

    // After any outcome: the engine trains on with identical replicas, or says it must be recreated.
    if (g_processes == 0) {
      size_t count = 0;
      const dpar_status probe = timed("dpar_engine_step_count", [&] { return dpar_engine_step_count(&count, engine); });
      if (probe == DPAR_ERR_INVALID_STATE && std::string(dpar_last_error()).find("must be recreated") != std::string::npos) {
        recreate(injected.c_str());
        continue;
      }
      check_ok(probe, "dpar_engine_step_count");
      // An aborted engine answers step_count, but it must be recreated (the next step says so) and its replicas may
      // have stopped apart, inside the optimizer's all-gather: only a usable engine must hold identical replicas.
      if (!(s != DPAR_OK && message.find("aborted (dpar_engine_abort) and must be recreated") != std::string::npos))
        check_replicas_identical(engine, steps);
      if (s != DPAR_OK) {
        const dpar_status next =
            timed("dpar_engine_train_step", [&] { return dpar_engine_train_step(&loss, engine, bx[b], by[b]); });
        ++events[std::string("step after a failure ") + dpar_status_str(next)];
        if (next == DPAR_OK) {
          check_replicas_identical(engine, steps);
          ++good_steps;
        } else if (next == DPAR_ERR_INVALID_STATE &&
                   std::string(dpar_last_error()).find("must be recreated") != std::string::npos) {
          recreate(injected.c_str());
          continue;
        } else {
          fail("step " + std::to_string(steps) + ": after " + injected + ", the next step returned " +
               dpar_status_str(next) + ": " + dpar_last_error());
        }
      }
    }
    if (good_steps % 200 == 0) {
      // An abort that landed after the step (step_count and get_params answer an aborted engine) shows here.
      const dpar_status saved = timed("dpar_engine_save", [&] { return dpar_engine_save(engine, checkpoint.c_str()); });
      if (saved == DPAR_ERR_INVALID_STATE && std::string(dpar_last_error()).find("must be recreated") != std::string::npos)
        recreate(injected.c_str());
      else
        check_ok(saved, "dpar_engine_save");
    }
  }

  dpar_engine_free(engine);
  dpar_model_free(model);
  for (size_t b = 0; b < xs.size(); ++b) {
    dpar_tensor_free(bx[b]);
    dpar_tensor_free(by[b]);
  }
  std::filesystem::remove_all(dir_template);
  finished.store(true);
  watchdog.join();

  const long rss_end = resident_kib();
  const int threads_at_end = thread_count();
  std::printf("soak: %ld steps (%ld trained) in %.1f s, %ld engines recreated, loss %.3f -> %.3f\n", steps,
              good_steps, elapsed(), recreations, first_loss, last_loss);
  for (const auto& [what, n] : events) std::printf("soak:   %-40s %ld\n", what.c_str(), n);
  std::printf("soak: resident %ld KiB at a third of the run, %ld KiB at the end; threads %d at start, %d at end\n",
              rss_third, rss_end, threads_at_start, threads_at_end);
  if (threads_at_end != threads_at_start)
    fail(std::to_string(threads_at_end - threads_at_start) + " threads outlived their engines");
  if (rss_third > 0 && rss_end - rss_third > 16 * 1024)
    fail("resident memory grew by " + std::to_string((rss_end - rss_third) / 1024) + " MiB after the first third");
  if (events["injected fault ALLOC"] + events["injected fault FORWARD"] + events["injected fault BACKWARD"] == 0 ||
      events["injected abort"] == 0 || events["injected late replica"] == 0)
    fail("the run was too short to inject every kind of failure");
  if (!(last_loss < first_loss)) fail("the loss did not fall");
  dpar_comm_free(world.comm);
  std::printf("soak: PASS\n");
  return 0;
}
