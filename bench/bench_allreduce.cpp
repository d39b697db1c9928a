// bench_allreduce: dpar's in-process all-reduce (ThreadGroup, one pass) beside OpenMPI's in-place MPI_Allreduce
// between processes on the same machine and Gloo's ring all-reduce over TCP on loopback (gloo_anchor.cpp), and
// dpar's MPI backend (dpar_comm_all_reduce over dpar_comm_create_mpi) beside that same MPI_Allreduce in the same
// ranks, all measured in the same run and interleaved size by size and round by round, so that all see the same
// placement of the vCPUs. See bench/README.md.
//
//   bench_allreduce [--threads T] [--rounds R] [--seconds S] [--no-mpi] [--no-gloo] [--gloo-allreduce] [--verbose]
//
// For every size (bytes per participant, f32 sum): the core-to-core latency before, then R rounds of (a dpar
// block, an MPI block and a dpar-mpi block back to back, a Gloo block) -- with the order rotating between rounds,
// and MPI and dpar mpi alternating which goes first -- then the latency after. In each iteration of a block every
// participant rewrites its whole buffer (as a backward pass would), enters a barrier, and times one all-reduce;
// the iteration's time is the longest over the participants. The figure printed is the median over all the
// iterations of all rounds.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "comm/threads_comm.h"
#include "common/error.h"
#include "gloo_anchor.h"

namespace {

constexpr size_t kKiB = 1024, kMiB = 1024 * 1024;
const size_t kSizes[] = {4 * kKiB, 16 * kKiB, 64 * kKiB, 256 * kKiB, 1 * kMiB, 4 * kMiB, 16 * kMiB, 64 * kMiB};
// The sizes at which the issue asks dpar to be at least 4x faster than MPI_Allreduce.
const size_t kAimSizes[] = {64 * kKiB, 1 * kMiB, 16 * kMiB};
constexpr double kAimRatio = 4.0;
// The aim for dpar's MPI backend: its time within 5% of plain MPI_Allreduce's, from 64 KiB up (below, the
// backend's fixed cost per call, its fingerprint exchange, is a larger share, and no aim is set).
constexpr size_t kMpiAimFrom = 64 * kKiB;
constexpr double kMpiAimRatio = 1.05;

std::string size_str(size_t bytes) {
  char b[32];
  if (bytes >= kMiB)
    snprintf(b, sizeof b, "%zu MiB", bytes / kMiB);
  else
    snprintf(b, sizeof b, "%zu KiB", bytes / kKiB);
  return b;
}

struct Options {
  int threads = 2;
  int rounds = 4;
  double seconds = 2.0;  // per implementation per size, over all rounds
  bool mpi = true;
  bool gloo = true;
  // gloo::allreduce, PyTorch's call, loses a scheduler tick per call on 2 vCPUs (bench/README.md): the default is
  // the ring that does not.
  bench_gloo::Api gloo_api = bench_gloo::Api::kRing;
  bool verbose = false;
};

[[noreturn]] void usage(const char* argv0) {
  fprintf(stderr,
          "usage: %s [--threads T] [--rounds R] [--seconds S] [--no-mpi] [--no-gloo] [--gloo-allreduce] [--verbose]\n"
          "  --threads T   dpar participants (worker threads), MPI ranks and Gloo participants (default 2)\n"
          "  --rounds R    interleaved dpar/MPI/dpar mpi/Gloo rounds per size (default 4)\n"
          "  --seconds S   measuring time per implementation per size, over all rounds (default 2)\n"
          "  --no-mpi      leave out the MPI anchor and dpar's MPI backend\n"
          "  --no-gloo     leave out the Gloo anchor\n"
          "  --gloo-allreduce  measure gloo::allreduce (RING, unbound buffers: PyTorch's call) instead of\n"
          "                gloo::AllreduceRing<float>\n"
          "  --verbose     print every round's medians\n",
          argv0);
  exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) usage(argv[0]);
      return argv[++i];
    };
    if (a == "--threads")
      o.threads = atoi(next());
    else if (a == "--rounds")
      o.rounds = atoi(next());
    else if (a == "--seconds")
      o.seconds = atof(next());
    else if (a == "--no-mpi")
      o.mpi = false;
    else if (a == "--no-gloo")
      o.gloo = false;
    else if (a == "--gloo-allreduce")
      o.gloo_api = bench_gloo::Api::kAllreduce;
    else if (a == "--verbose")
      o.verbose = true;
    else
      usage(argv[0]);
  }
  if (o.threads < 1 || o.threads > 256 || o.rounds < 1 || !(o.seconds > 0)) usage(argv[0]);
  return o;
}

// ---- dpar ---------------------------------------------------------------------------------------------------

struct BlockResult {
  std::vector<double> times;  // seconds per timed iteration, longest over participants
  bool ok = true;             // the sums checked out
  double wall = 0;            // the whole block, including rewrites and barriers
};

class DparRunner {
 public:
  DparRunner(int threads, size_t max_floats, std::vector<int> cpus) : threads_(threads), cpus_(std::move(cpus)) {
    std::vector<std::string> names;
    for (int r = 0; r < threads; ++r) names.push_back("thread " + std::to_string(r));
    group_ = std::make_unique<dpar::ThreadGroup>(names, std::chrono::seconds(60));
    for (int r = 0; r < threads; ++r) {
      comms_.push_back(group_->communicator(r));
      void* p = nullptr;
      if (posix_memalign(&p, 64, max_floats * sizeof(float)) != 0) {
        fprintf(stderr, "out of memory\n");
        exit(1);
      }
      bufs_.push_back(static_cast<float*>(p));
    }
    // First touch by the owning thread, on its CPU.
    std::vector<std::thread> ts;
    for (int r = 0; r < threads; ++r)
      ts.emplace_back([this, r, max_floats] {
        pin(r);
        std::fill(bufs_[r], bufs_[r] + max_floats, 0.0f);
      });
    for (auto& t : ts) t.join();
  }
  ~DparRunner() {
    for (float* b : bufs_) free(b);
  }
  int cpu_of(int r) const { return cpus_[static_cast<size_t>(r) % cpus_.size()]; }

  // all_reduce_sum, or the sharded gradient path (ZeRO-2): reduce_scatter_sum then all_gather_blocks, which leave
  // the same sums in every buffer.
  enum class Path { kAllReduce, kSharded };
  BlockResult run(size_t n, int warmup, int iters, Path path = Path::kAllReduce) {
    BlockResult res;
    std::vector<std::vector<double>> per(threads_, std::vector<double>(static_cast<size_t>(iters)));
    std::vector<int> ok(threads_, 1);
    std::vector<std::string> errors(threads_);
    const double w0 = bench_now();
    std::vector<std::thread> ts;
    for (int r = 0; r < threads_; ++r)
      ts.emplace_back([&, r] {
        pin(r);
        float* buf = bufs_[r];
        dpar::Communicator& comm = *comms_[r];
        int last = 0;
        try {
          for (int it = 0; it < warmup + iters; ++it) {
            // The backward pass: this thread rewrites its own gradient buffer.
            std::fill(buf, buf + n, static_cast<float>((it & 7) + r));
            comm.barrier("pre");
            const auto t0 = std::chrono::steady_clock::now();
            if (path == Path::kAllReduce) {
              comm.all_reduce_sum(buf, n, true, 1.0f);
            } else {
              comm.reduce_scatter_sum(buf, n, true, 1.0f);
              comm.all_gather_blocks(buf, n);
            }
            const auto t1 = std::chrono::steady_clock::now();
            if (it >= warmup) per[r][static_cast<size_t>(it - warmup)] = std::chrono::duration<double>(t1 - t0).count();
            last = it;
          }
        } catch (const std::exception& e) {
          errors[r] = e.what();
          ok[r] = 0;
          comm.abort(e.what());
          return;
        }
        double expected = 0;
        for (int q = 0; q < threads_; ++q) expected += (last & 7) + q;
        if (n && (buf[0] != expected || buf[n - 1] != expected || buf[n / 2] != expected)) ok[r] = 0;
      });
    for (auto& t : ts) t.join();
    res.wall = bench_now() - w0;
    for (int r = 0; r < threads_; ++r) {
      if (!errors[r].empty()) fprintf(stderr, "dpar thread %d failed: %s\n", r, errors[r].c_str());
      res.ok = res.ok && ok[r];
    }
    if (group_->aborted()) group_->reset();
    res.times.resize(static_cast<size_t>(iters));
    for (int i = 0; i < iters; ++i) {
      double m = 0;
      for (int r = 0; r < threads_; ++r) m = std::max(m, per[r][static_cast<size_t>(i)]);
      res.times[static_cast<size_t>(i)] = m;
    }
    return res;
  }

 private:
  void pin(int r) { bench_pin_self(cpu_of(r)); }

  int threads_;
  std::vector<int> cpus_;
  std::unique_ptr<dpar::ThreadGroup> group_;
  std::vector<std::unique_ptr<dpar::Communicator>> comms_;
  std::vector<float*> bufs_;
};

// ---- MPI, driven through FIFOs ------------------------------------------------------------------------------

#ifdef BENCH_HAVE_MPI
class MpiRunner {
 public:
  // What a block runs in the companion's ranks (bench_mpi_allreduce.c).
  enum class Impl : uint64_t {
    kPlain = 0,  // in-place MPI_Allreduce
    kDpar = 1,   // dpar_comm_all_reduce on dpar_comm_create_mpi's communicator (dpar's MPI backend)
  };

  ~MpiRunner() { stop(); }

  // Starts the companion under mpirun; false with a reason if it cannot.
  bool start(int np, int ncpu, std::string& why) {
    char tmpl[] = "/tmp/dpar_bench_allreduce.XXXXXX";
    if (!mkdtemp(tmpl)) {
      why = std::string("mkdtemp: ") + strerror(errno);
      return false;
    }
    dir_ = tmpl;
    for (int r = 0; r < np; ++r)
      if (mkfifo((dir_ + "/cmd" + std::to_string(r)).c_str(), 0600) != 0) {
        why = std::string("mkfifo: ") + strerror(errno);
        return false;
      }
    if (mkfifo((dir_ + "/res").c_str(), 0600) != 0) {
      why = std::string("mkfifo: ") + strerror(errno);
      return false;
    }
    res_fd_ = open((dir_ + "/res").c_str(), O_RDONLY | O_NONBLOCK);
    if (res_fd_ < 0) {
      why = std::string("open res: ") + strerror(errno);
      return false;
    }
    const std::string companion = companion_path();
    if (access(companion.c_str(), X_OK) != 0) {
      why = "the companion " + companion + " is missing";
      return false;
    }
    const std::string np_s = std::to_string(np);
    const std::string log = dir_ + "/mpirun.log";
    // More ranks than CPUs cannot each have a core of its own: allow the overload rather than fail.
    const char* bind = np > ncpu ? "core:overload-allowed" : "core";
    command_ = std::string(BENCH_MPIEXEC) + " -np " + np_s +
               " --allow-run-as-root --oversubscribe --mca pml ob1 --mca btl self,vader --bind-to " + bind + " " +
               companion;
    pid_ = fork();
    if (pid_ < 0) {
      why = std::string("fork: ") + strerror(errno);
      return false;
    }
    if (pid_ == 0) {
      setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
      setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
      int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
        close(fd);
      }
      close(res_fd_);
      execl(BENCH_MPIEXEC, BENCH_MPIEXEC, "-np", np_s.c_str(), "--allow-run-as-root", "--oversubscribe", "--mca",
            "pml", "ob1", "--mca", "btl", "self,vader", "--bind-to", bind, companion.c_str(), dir_.c_str(),
            static_cast<char*>(nullptr));
      _exit(127);
    }
    // Open the command FIFOs once every rank has opened its end (or give up after 60 s).
    const double deadline = bench_now() + 60.0;
    for (int r = 0; r < np; ++r) {
      const std::string p = dir_ + "/cmd" + std::to_string(r);
      int fd = -1;
      while ((fd = open(p.c_str(), O_WRONLY | O_NONBLOCK)) < 0) {
        if (errno != ENXIO || !alive() || bench_now() > deadline) {
          why = "mpirun did not start the ranks (" + (alive() ? std::string("timeout") : std::string("it exited")) +
                "); its output:\n" + read_log();
          return false;
        }
        usleep(10000);
      }
      fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
      cmd_fds_.push_back(fd);
    }
    uint64_t n = 0;
    if (!read_exact(&n, sizeof n, 60.0) || n != static_cast<uint64_t>(np)) {
      why = "no hello from rank 0; mpirun's output:\n" + read_log();
      return false;
    }
    masks_.resize(n);
    uint64_t dpar[2] = {0, 0};  // dpar's implementation ready; length of the text that says why not
    if (!read_exact(masks_.data(), n * sizeof(uint64_t), 10.0) || !read_exact(dpar, sizeof dpar, 10.0) ||
        dpar[1] > 4096) {
      why = "truncated hello";
      return false;
    }
    dpar_ready_ = dpar[0] != 0;
    dpar_why_.assign(dpar[1], '\0');
    if (!read_exact(dpar_why_.data(), dpar_why_.size(), 10.0)) {
      why = "truncated hello";
      return false;
    }
    return true;
  }

  const std::string& command() const { return command_; }
  const std::vector<uint64_t>& masks() const { return masks_; }
  // Whether the companion has dpar's MPI backend ready (a communicator on every rank), and if not, why.
  bool dpar_ready() const { return dpar_ready_; }
  const std::string& dpar_why() const { return dpar_why_; }
  // Whether mpirun is still running: after a failed block, whether only that implementation failed.
  bool running() { return alive(); }
  // The ranks' output so far (where a failed dpar call says why).
  std::string log() { return read_log(); }

  // Runs one block; an empty result on failure (also when the ranks report that a dpar call failed).
  BlockResult run(Impl impl, size_t bytes, int warmup, int iters, double timeout) {
    BlockResult res;
    const double w0 = bench_now();
    uint64_t cmd[4] = {bytes, static_cast<uint64_t>(warmup), static_cast<uint64_t>(iters),
                       static_cast<uint64_t>(impl)};
    for (int fd : cmd_fds_)
      if (write(fd, cmd, sizeof cmd) != sizeof cmd) {
        res.ok = false;
        return res;
      }
    uint64_t head[2];
    if (!read_exact(head, sizeof head, timeout) || head[0] != static_cast<uint64_t>(iters)) {
      res.ok = false;
      return res;
    }
    res.times.resize(static_cast<size_t>(iters));
    if (!read_exact(res.times.data(), res.times.size() * sizeof(double), 30.0)) {
      res.ok = false;
      res.times.clear();
      return res;
    }
    res.wall = bench_now() - w0;
    const auto ok = static_cast<int64_t>(head[1]);  // 1 sums right, 0 a sum wrong, -1 a call failed
    if (ok < 0) {
      res.ok = false;
      res.times.clear();
      return res;
    }
    res.ok = ok != 0;
    return res;
  }

  void stop() {
    for (int fd : cmd_fds_) close(fd);  // EOF: the ranks finalize and exit
    cmd_fds_.clear();
    if (pid_ > 0) {
      const double deadline = bench_now() + 10.0;
      int status = 0;
      while (waitpid(pid_, &status, WNOHANG) == 0) {
        if (bench_now() > deadline) {
          kill(pid_, SIGTERM);
          waitpid(pid_, &status, 0);
          break;
        }
        usleep(10000);
      }
      pid_ = -1;
    }
    if (res_fd_ >= 0) close(res_fd_);
    res_fd_ = -1;
    if (!dir_.empty()) {
      for (size_t r = 0; r < 256; ++r) unlink((dir_ + "/cmd" + std::to_string(r)).c_str());
      unlink((dir_ + "/res").c_str());
      unlink((dir_ + "/mpirun.log").c_str());
      rmdir(dir_.c_str());
      dir_.clear();
    }
  }

 private:
  static std::string companion_path() {
    char self[4096];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len <= 0) return BENCH_MPI_COMPANION;
    self[len] = 0;
    std::string s(self);
    return s.substr(0, s.rfind('/') + 1) + BENCH_MPI_COMPANION;
  }
  bool alive() { return pid_ > 0 && waitpid(pid_, nullptr, WNOHANG) == 0; }
  std::string read_log() {
    std::string out;
    FILE* f = fopen((dir_ + "/mpirun.log").c_str(), "r");
    if (!f) return "(none)";
    char line[1024];
    while (fgets(line, sizeof line, f) && out.size() < 4000) out += line;
    fclose(f);
    return out;
  }
  // Reads n bytes from the result FIFO, waiting at most `timeout` seconds in all.
  bool read_exact(void* p, size_t n, double timeout) {
    char* c = static_cast<char*>(p);
    const double deadline = bench_now() + timeout;
    while (n > 0) {
      ssize_t got = read(res_fd_, c, n);
      if (got > 0) {
        c += got;
        n -= static_cast<size_t>(got);
        continue;
      }
      if (got < 0 && errno != EAGAIN && errno != EINTR) return false;
      // got == 0: no writer yet (or any more); got < 0: no data yet.
      if (got == 0 && !alive()) return false;
      if (bench_now() > deadline) return false;
      pollfd pfd{res_fd_, POLLIN, 0};
      poll(&pfd, 1, got == 0 ? 10 : 100);
    }
    return true;
  }

  std::string dir_;
  std::string command_;
  pid_t pid_ = -1;
  int res_fd_ = -1;
  std::vector<int> cmd_fds_;
  std::vector<uint64_t> masks_;
  bool dpar_ready_ = false;
  std::string dpar_why_;
};
#endif

// ---- reporting ----------------------------------------------------------------------------------------------

double busbw_gbs(size_t bytes, double seconds, int participants) {
  if (seconds <= 0) return 0;
  return static_cast<double>(bytes) / seconds * 2.0 * (participants - 1) / participants / 1e9;
}

struct Series {
  std::vector<double> all;           // every timed iteration
  std::vector<double> round_median;  // one per round
  bool ok = true;
  bool failed = false;
  void add(BlockResult& b) {
    ok = ok && b.ok;
    if (b.times.empty()) {
      failed = true;
      return;
    }
    all.insert(all.end(), b.times.begin(), b.times.end());
    std::vector<double> t = b.times;
    round_median.push_back(bench_median(t.data(), t.size()));
  }
  double median() {
    std::vector<double> t = all;
    return bench_median(t.data(), t.size());
  }
  // Spread of the rounds' medians around the overall median, in percent.
  double spread() {
    if (round_median.size() < 2) return 0;
    auto [lo, hi] = std::minmax_element(round_median.begin(), round_median.end());
    double m = median();
    return m > 0 ? 100.0 * (*hi - *lo) / m : 0;
  }
};

// A series' columns (median time, busbw, spread) and its ratios to a base series (dpar's threads; for dpar's MPI
// backend, plain MPI): of the medians, and the median over rounds of the ratio of the round's medians (both at one
// placement). Dashes where a series was not measured.
struct AnchorCols {
  std::string cols, ratio;
  double time = 0, ratio_of_medians = 0, paired = 0;
};
AnchorCols anchor_cols(Series& a, Series& base, size_t bytes, int participants, int decimals = 2) {
  AnchorCols c;
  char cols[64], ratio[48];
  std::vector<double> paired;
  for (size_t i = 0; i < std::min(base.round_median.size(), a.round_median.size()); ++i)
    paired.push_back(a.round_median[i] / base.round_median[i]);
  c.paired = paired.empty() ? 0 : bench_median(paired.data(), paired.size());
  c.time = a.all.empty() ? 0 : a.median();
  const double base_time = base.all.empty() ? 0 : base.median();
  if (c.time > 0)
    snprintf(cols, sizeof cols, "%9.2f %7.2f %5.0f", c.time * 1e6, busbw_gbs(bytes, c.time, participants),
             a.spread());
  else
    snprintf(cols, sizeof cols, "%9s %7s %5s", "-", "-", "");
  if (c.time > 0 && base_time > 0 && c.paired > 0) {
    // Ratios of 1000 and more lose their decimals, so that the column keeps its width.
    c.ratio_of_medians = c.time / base_time;
    const double r = c.ratio_of_medians;
    snprintf(ratio, sizeof ratio, "%7.*fx %7.*fx", r >= 1000 ? 0 : decimals, r, c.paired >= 1000 ? 0 : decimals,
             c.paired);
  } else {
    snprintf(ratio, sizeof ratio, "%8s %8s", "-", "-");
  }
  c.cols = cols;
  c.ratio = ratio;
  return c;
}

BlockResult from_gloo(bench_gloo::Block b) { return BlockResult{std::move(b.times), b.ok, b.wall}; }

int iterations_for(double budget, double per_iter) {
  double n = budget / std::max(per_iter, 1e-7);
  return static_cast<int>(std::clamp(n, 5.0, 50000.0));
}

#ifdef BENCH_HAVE_MPI
std::string mask_str(uint64_t m) {
  std::string s = "{";
  for (int c = 0; c < 64; ++c) {
    if (!(m >> c & 1)) continue;
    if (s.size() > 1) s += ',';
    s += std::to_string(c);
  }
  s += '}';
  return s;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  Options opt = parse(argc, argv);
  setvbuf(stdout, nullptr, _IOLBF, 0);
  int cpus[1024];
  const int ncpu = bench_allowed_cpus(cpus, 1024);
  std::vector<int> cpu_list(cpus, cpus + ncpu);
  const int T = opt.threads;
  const int probe_a = cpus[0], probe_b = ncpu > 1 ? cpus[1] : cpus[0];

  printf("bench_allreduce: f32 sum all-reduce, S bytes per participant, %d participants\n", T);
  printf("  dpar: ThreadGroup::all_reduce_sum (one pass, in place) over %d threads of one process, thread r pinned "
         "to CPU r mod %d;\n", T, ncpu);
  printf("        before each iteration every thread rewrites its whole buffer (as a backward pass), then a "
         "barrier;\n        time = the longest of the threads' all_reduce_sum calls\n");
  bench_cpu_usage usage0;
  bench_cpu_usage_now(&usage0);
  bench_print_machine(stdout);

  // have_mpi: the companion runs (plain MPI_Allreduce); have_dpar_mpi: dpar's MPI backend runs in it too.
  // mpi_started: the companion started at all, so that the across-process table is printed.
  [[maybe_unused]] bool have_mpi = false, have_dpar_mpi = false, mpi_started = false;
#ifdef BENCH_HAVE_MPI
  MpiRunner mpi;
  if (opt.mpi) {
    std::string why;
    have_mpi = mpi_started = mpi.start(T, ncpu, why);
    if (have_mpi) {
      printf("  MPI:  %s (OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)\n", mpi.command().c_str());
      printf("        ranks bound to CPUs");
      for (uint64_t m : mpi.masks()) printf(" %s", mask_str(m).c_str());
      printf("; in-place MPI_Allreduce(MPI_FLOAT, MPI_SUM), each rank rewrites its buffer, then MPI_Barrier;\n"
             "        time = the longest over the ranks\n");
      have_dpar_mpi = mpi.dpar_ready();
      if (have_dpar_mpi)
        printf("  dpar mpi: dpar's MPI backend in the same ranks, through the C API: dpar_comm_all_reduce(comm, buf, "
               "buf, n,\n        DPAR_F32, DPAR_SUM) on the communicator of dpar_comm_create_mpi (made once, after "
               "the ranks' own\n        MPI_Init); the same buffer, rewrite, MPI_Barrier, iteration counts and "
               "clock as the MPI block\n");
      else
        printf("  dpar mpi: not measured: %s\n", mpi.dpar_why().c_str());
    } else {
      printf("  MPI:  not measured: %s\n", why.c_str());
      printf("  dpar mpi: not measured (no MPI companion)\n");
      mpi.stop();
    }
  } else {
    printf("  MPI:  not measured (--no-mpi)\n");
    printf("  dpar mpi: not measured (--no-mpi)\n");
  }
#else
  printf("  MPI:  not measured: this build found no MPI (CMake's find_package(MPI COMPONENTS C) failed)\n");
  printf("  dpar mpi: not measured (no MPI)\n");
#endif
  const size_t max_bytes = kSizes[sizeof kSizes / sizeof kSizes[0] - 1];
  std::unique_ptr<bench_gloo::Anchor> gloo;
  if (opt.gloo) {
    std::string why;
    gloo = bench_gloo::start(opt.gloo_api, T, max_bytes / sizeof(float), cpu_list, why);
    if (gloo)
      printf("  Gloo: %s\n", gloo->describe().c_str());
    else
      printf("  Gloo: not measured: %s\n", why.c_str());
  } else {
    printf("  Gloo: not measured (--no-gloo)\n");
  }
  printf("  %d interleaved rounds per size (a dpar block, MPI and dpar mpi blocks back to back, a Gloo block; the "
         "order\n  rotates, and MPI and dpar mpi alternate which goes first), ~%.1f s per implementation per size;\n"
         "  figures are medians over all timed iterations; +-%% = spread of the rounds' medians\n",
         opt.rounds, opt.seconds);
  printf("  MPI/dpar, Gloo/dpar, dpar mpi/MPI = ratio of the medians (time of the one / time of the other); paired "
         "=\n  median over rounds of the ratio of the round's medians (both at one placement)\n");
  printf("  placement: one class, or each round's class (mix: it changed during the round)\n");
  printf("  others = CPU share that other processes took while the size was measured\n");
  printf("  busbw = S / time * 2(n-1)/n (nccl-tests); placement = one-way latency CPU %d <-> CPU %d before/after "
         "the size\n  (~15 ns SMT siblings, 35-45 ns shared L3, 180-230 ns far; compare only at equal placement)\n\n",
         probe_a, probe_b);

  DparRunner dpar_runner(T, max_bytes / sizeof(float), cpu_list);

  printf("in one process: dpar's threads (ThreadGroup) against OpenMPI's processes and Gloo's participants\n");
  printf("%8s | %9s %7s %5s | %9s %7s %5s | %9s %7s %5s | %17s | %17s | %6s | %s\n", "size", "dpar us", "busbw",
         "+-%", "MPI us", "busbw", "+-%", "Gloo us", "busbw", "+-%", "MPI/dpar  paired", "Gloo/dpar paired",
         "others", "latency ns before/after, placement");
  printf("%8s | %9s %7s %5s | %9s %7s %5s | %9s %7s %5s | %17s | %17s | %6s |\n", "", "", "GB/s", "", "", "GB/s",
         "", "", "GB/s", "", "", "", "");
  printf("---------+-------------------------+-------------------------+-------------------------+-------------------+"
         "-------------------+--------+----------------------------------\n");

  struct Row {
    size_t bytes;
    double dpar, mpi, paired;
    std::string placement;
    double others;
    // Across processes: plain MPI and dpar's MPI backend, and the ratio dpar mpi / MPI.
    std::string mpi_cols, dpar_mpi_cols, dpar_mpi_ratio;
    double dpar_mpi_ratio_of_medians = 0, dpar_mpi_paired = 0;
    bool dpar_mpi_ok = true;
  };
  std::vector<Row> rows;
  bool all_ok = true;
  const double per_block = opt.seconds / opt.rounds;

  for (size_t bytes : kSizes) {
    const size_t n = bytes / sizeof(float);
    // Probes of the placement: before the size, between rounds, after the size.
    std::vector<double> probes{bench_core_latency_ns(probe_a, probe_b)};
    bench_cpu_usage size_u0, size_u1;
    bench_cpu_usage_now(&size_u0);

    // Calibration (also the warm-up of the sizes' buffers): a short block of each.
    const int calib = static_cast<int>(std::clamp<size_t>(64 * kMiB / bytes, 2, 2000));
    BlockResult c = dpar_runner.run(n, 1, calib);
    const int dpar_iters = iterations_for(per_block, c.wall / (calib + 1));
    int mpi_iters = 0;
#ifdef BENCH_HAVE_MPI
    // A failed dpar mpi block drops its column; if mpirun is gone too, the MPI column goes with it.
    auto dpar_mpi_failed = [&] {
      printf("dpar's MPI backend failed at %s; dropping the dpar mpi column. The ranks' output:\n%s",
             size_str(bytes).c_str(), mpi.log().c_str());
      have_dpar_mpi = false;
      if (!mpi.running()) {
        printf("MPI failed at %s; dropping the MPI column\n", size_str(bytes).c_str());
        have_mpi = false;
        mpi.stop();
      }
    };
    if (have_mpi) {
      BlockResult m = mpi.run(MpiRunner::Impl::kPlain, bytes, 1, calib, 120.0);
      if (m.times.empty()) {
        printf("MPI failed at %s; dropping the MPI column\n", size_str(bytes).c_str());
        have_mpi = have_dpar_mpi = false;
        mpi.stop();
      } else {
        mpi_iters = iterations_for(per_block, m.wall / (calib + 1));
      }
    }
    // dpar mpi takes plain MPI's iteration counts; this block only warms it up.
    if (have_dpar_mpi && mpi.run(MpiRunner::Impl::kDpar, bytes, 1, calib, 120.0).times.empty()) dpar_mpi_failed();
#endif
    int gloo_iters = 0;
    if (gloo) {
      BlockResult g = from_gloo(gloo->run(n, 1, calib));
      if (g.times.empty()) {
        printf("Gloo failed at %s; dropping the Gloo column\n", size_str(bytes).c_str());
        gloo.reset();
      } else {
        gloo_iters = iterations_for(per_block, g.wall / (calib + 1));
      }
    }
    Series d, m, x, g;  // x: dpar mpi
    for (int round = 0; round < opt.rounds; ++round) {
      const int dpar_warm = std::max(1, dpar_iters / 20);
      auto run_dpar = [&] {
        BlockResult b = dpar_runner.run(n, dpar_warm, dpar_iters);
        d.add(b);
      };
      // Plain MPI and dpar's MPI backend, back to back in the same ranks (so that each round's ratio is taken at
      // one placement), with the same warm-up and iteration counts; which goes first alternates between rounds.
      auto run_mpi_pair = [&] {
#ifdef BENCH_HAVE_MPI
        const double expect = per_block * 20 + 60;
        auto run_plain = [&] {
          if (!have_mpi) return;
          BlockResult b = mpi.run(MpiRunner::Impl::kPlain, bytes, std::max(1, mpi_iters / 20), mpi_iters, expect);
          if (b.times.empty()) {
            printf("MPI failed at %s; dropping the MPI column\n", size_str(bytes).c_str());
            have_mpi = have_dpar_mpi = false;
            mpi.stop();
            return;
          }
          m.add(b);
        };
        auto run_dpar_mpi = [&] {
          if (!have_mpi || !have_dpar_mpi) return;
          BlockResult b = mpi.run(MpiRunner::Impl::kDpar, bytes, std::max(1, mpi_iters / 20), mpi_iters, expect);
          if (b.times.empty()) {
            dpar_mpi_failed();
            return;
          }
          x.add(b);
        };
        if (round % 2 == 0) {
          run_plain();
          run_dpar_mpi();
        } else {
          run_dpar_mpi();
          run_plain();
        }
#endif
      };
      auto run_gloo = [&] {
        if (!gloo) return;
        BlockResult b = from_gloo(gloo->run(n, std::max(1, gloo_iters / 20), gloo_iters));
        if (b.times.empty()) {
          printf("Gloo failed at %s; dropping the Gloo column\n", size_str(bytes).c_str());
          gloo.reset();
          return;
        }
        g.add(b);
      };
      // Each implementation takes each place in the order in turn.
      const std::function<void()> blocks[] = {run_dpar, run_mpi_pair, run_gloo};
      for (int k = 0; k < 3; ++k) blocks[(round + k) % 3]();
      probes.push_back(bench_core_latency_ns(probe_a, probe_b));
      if (opt.verbose) {
        printf("    round %d: dpar %.3f us (%d it)", round, d.round_median.empty() ? 0 : d.round_median.back() * 1e6,
               dpar_iters);
        if (!m.round_median.empty())
          printf(", MPI %.3f us (%d it)", m.round_median.back() * 1e6, mpi_iters);
        if (!x.round_median.empty())
          printf(", dpar mpi %.3f us (%d it)", x.round_median.back() * 1e6, mpi_iters);
        if (!g.round_median.empty())
          printf(", Gloo %.3f us (%d it)", g.round_median.back() * 1e6, gloo_iters);
        printf("\n");
      }
    }
    bench_cpu_usage_now(&size_u1);
    const double others = bench_others_share(&size_u0, &size_u1, ncpu);
    const double lat_before = probes.front(), lat_after = probes.back();
    // Each round's placement: the class of the probes on both sides of it, or "mix" if they differ.
    std::vector<std::string> tags;
    bool moved = false;
    for (size_t i = 0; i + 1 < probes.size(); ++i) {
      const char* a = bench_placement_tag(probes[i]);
      const char* b = bench_placement_tag(probes[i + 1]);
      tags.push_back(strcmp(a, b) == 0 ? a : "mix");
      moved = moved || tags.back() != tags.front();
    }
    const double dt = d.median();
    const AnchorCols mc = anchor_cols(m, d, bytes, T), gc = anchor_cols(g, d, bytes, T);
    // dpar's MPI backend against plain MPI: ratios to the 5% aim want a third decimal.
    const AnchorCols xc = anchor_cols(x, m, bytes, T, 3);
    all_ok = all_ok && d.ok && m.ok && x.ok && g.ok;
    std::string placement;
    if (!moved) {
      placement = tags.front() == "mix" ? "moving" : bench_placement_class(lat_before);
    } else {
      placement = "rounds:";
      for (const auto& t : tags) placement += " " + t;
    }
    printf("%8s | %9.2f %7.2f %5.0f | %s | %s | %s | %s | %5.0f%% | %4.0f / %4.0f  %s%s%s\n", size_str(bytes).c_str(),
           dt * 1e6, busbw_gbs(bytes, dt, T), d.spread(), mc.cols.c_str(), gc.cols.c_str(), mc.ratio.c_str(),
           gc.ratio.c_str(), 100 * others, lat_before, lat_after, placement.c_str(),
           others >= 0.10 ? "; disturbed by other processes" : "", d.ok && m.ok && g.ok ? "" : "  WRONG SUMS");
    rows.push_back({bytes, dt, mc.time, mc.paired, placement, others, mc.cols, xc.cols, xc.ratio,
                    xc.ratio_of_medians, xc.paired, m.ok && x.ok});
  }

  // Whether dpar's MPI backend meets the aim at a size: "-" below the sizes it covers or without figures.
  auto dpar_mpi_aim = [](const Row& r) -> const char* {
    if (r.bytes < kMpiAimFrom || r.dpar_mpi_ratio_of_medians <= 0) return "-";
    return std::max(r.dpar_mpi_ratio_of_medians, r.dpar_mpi_paired) <= kMpiAimRatio ? "met" : "NOT met";
  };
  if (mpi_started) {
    // The same sizes and rounds, from the same run: the measurements of the MPI column above, now as the base.
    printf("\nacross processes: dpar's MPI backend (dpar_comm_all_reduce) against plain MPI_Allreduce in the same "
           "%d ranks\n", T);
    char aim_head[16];
    snprintf(aim_head, sizeof aim_head, "<=%.2fx", kMpiAimRatio);
    printf("%8s | %9s %7s %5s | %9s %7s %5s | %19s | %-7s | %6s | %s\n", "size", "MPI us", "busbw", "+-%",
           "dpar mpi", "busbw", "+-%", "dpar mpi/MPI paired", aim_head, "others", "placement");
    printf("%8s | %9s %7s %5s | %9s %7s %5s | %19s | %-7s | %6s |\n", "", "", "GB/s", "", "us", "GB/s", "", "",
           "aim", "");
    printf("---------+-------------------------+-------------------------+---------------------+---------+--------+"
           "----------------------------------\n");
    for (const Row& r : rows)
      printf("%8s | %s | %s | %19s | %-7s | %5.0f%% | %s%s%s\n", size_str(r.bytes).c_str(), r.mpi_cols.c_str(),
             r.dpar_mpi_cols.c_str(), r.dpar_mpi_ratio.c_str(), dpar_mpi_aim(r), 100 * r.others,
             r.placement.c_str(), r.others >= 0.10 ? "; disturbed by other processes" : "",
             r.dpar_mpi_ok ? "" : "  WRONG SUMS");
  }

  // The sharded gradient path beside all_reduce_sum, in alternating blocks at the aim's sizes.
  printf("\nsharded gradient path (ZeRO-2): reduce_scatter_sum + all_gather_blocks against all_reduce_sum, %d "
         "threads\n", T);
  printf("%8s | %12s | %12s | %12s | %s\n", "size", "all_reduce us", "rs+ag us", "rs+ag/ar", "sums");
  for (size_t bytes : kAimSizes) {
    const size_t n = bytes / sizeof(float);
    const int calib = static_cast<int>(std::clamp<size_t>(64 * kMiB / bytes, 2, 2000));
    BlockResult c = dpar_runner.run(n, 1, calib);
    const int iters = iterations_for(per_block, c.times.empty() ? 1e-3 : bench_median(c.times.data(), c.times.size()));
    std::vector<double> ar, sharded;
    bool ok = c.ok;
    for (int round = 0; round < opt.rounds; ++round) {
      BlockResult a = dpar_runner.run(n, 1, iters);
      BlockResult b = dpar_runner.run(n, 1, iters, DparRunner::Path::kSharded);
      ok = ok && a.ok && b.ok;
      ar.insert(ar.end(), a.times.begin(), a.times.end());
      sharded.insert(sharded.end(), b.times.begin(), b.times.end());
    }
    const double ta = bench_median(ar.data(), ar.size()), tb = bench_median(sharded.data(), sharded.size());
    all_ok = all_ok && ok;
    printf("%8s | %12.2f | %12.2f | %11.2fx | %s\n", size_str(bytes).c_str(), ta * 1e6, tb * 1e6, tb / ta,
           ok ? "correct" : "WRONG SUMS");
  }

#ifdef BENCH_HAVE_MPI
  mpi.stop();
#endif
  bench_cpu_usage usage1;
  bench_cpu_usage_now(&usage1);

  printf("\naim (issue): dpar at least %.0fx faster than MPI_Allreduce at 64 KiB, 1 MiB and 16 MiB\n", kAimRatio);
  for (const Row& r : rows) {
    if (std::find(std::begin(kAimSizes), std::end(kAimSizes), r.bytes) == std::end(kAimSizes)) continue;
    if (r.mpi > 0)
      printf("  %-7s MPI/dpar = %6.2fx (paired by round: %.2fx)  %s  (%s%s)\n", size_str(r.bytes).c_str(),
             r.mpi / r.dpar, r.paired, std::min(r.mpi / r.dpar, r.paired) >= kAimRatio ? "met" : "NOT met",
             r.placement.c_str(),
             r.others >= 0.10 ? "; disturbed by other processes" : "");
    else
      printf("  %-7s no MPI figure\n", size_str(r.bytes).c_str());
  }
  printf("aim (issue): dpar's MPI backend within %.0f%% of plain MPI_Allreduce (dpar mpi/MPI <= %.2fx) from %s up\n",
         (kMpiAimRatio - 1) * 100, kMpiAimRatio, size_str(kMpiAimFrom).c_str());
  for (const Row& r : rows) {
    if (r.bytes < kMpiAimFrom) continue;
    if (r.dpar_mpi_ratio_of_medians > 0)
      printf("  %-7s dpar mpi/MPI = %6.3fx (paired by round: %.3fx)  %s  (%s%s)\n", size_str(r.bytes).c_str(),
             r.dpar_mpi_ratio_of_medians, r.dpar_mpi_paired, dpar_mpi_aim(r), r.placement.c_str(),
             r.others >= 0.10 ? "; disturbed by other processes" : "");
    else
      printf("  %-7s no dpar mpi figure\n", size_str(r.bytes).c_str());
  }
  printf("results checked: %s\n", all_ok ? "every sum correct" : "SOME SUMS WRONG");
  bench_print_cpu_usage(stdout, &usage0, &usage1, ncpu);
  return all_ok ? 0 : 1;
}
