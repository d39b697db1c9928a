// A timeline of an engine's work, to see where a step's time goes: spans on tracks (the calling thread, and each
// replica's worker and communication thread), written in Chrome's trace event format, which chrome://tracing and
// ui.perfetto.dev open. Recording costs a relaxed load per span when off; when on, two clock reads and an append.
//
// Times are the host's (steady_clock). On a GPU a span is the time the host spent queuing its work, and the wait
// for the device shows as a span of its own ("device sync"), so a step that the host cannot feed fast enough and
// one that waits for the GPU look different.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace dpar {

class Trace {
 public:
  using Clock = std::chrono::steady_clock;
  // Events kept in all, so that a trace left running cannot take all memory (their records take up to 48 MiB,
  // and writing them builds the file's text, some 150 MB, in memory); later ones are counted and dropped, and the
  // file says how many.
  static constexpr size_t kMaxEvents = size_t{1} << 20;

  // Track t is called track_names[t] in the file. `max_events`: the cap (kMaxEvents; tests make it small).
  explicit Trace(std::vector<std::string> track_names, size_t max_events = kMaxEvents);

  bool recording() const { return recording_.load(std::memory_order_relaxed); }
  // Forgets what was recorded and records from now. Called while no span is open (between an engine's calls).
  void start();
  void stop() { recording_.store(false, std::memory_order_relaxed); }
  // Whether start() was ever called (a stopped trace keeps its events until the next start).
  bool started() const { return started_; }

  // A span [begin, end) on `track`. `name` and `arg` are string literals, kept by pointer; `arg` (may be null)
  // names `value` in the file. `failed`: the span ended by an exception. Never throws (it runs in destructors,
  // during unwinding too): a span that cannot be kept is counted as dropped.
  void add(size_t track, const char* name, Clock::time_point begin, Clock::time_point end, const char* arg,
           int64_t value, bool failed) noexcept;

  // What was recorded, as Chrome's JSON trace: the text of a trace file. `process` is the pid in the file (the
  // process's rank) and names its process ("dpar rank 0"). Writing the file is the caller's (the engine writes it
  // atomically, io/file.h), so that this layer needs no file system of its own.
  std::string chrome_json(int process) const;

  // The track the calling thread records on, set by TraceTrack; 0 (the calling thread's track) by default.
  static size_t current_track();

 private:
  struct Event {
    const char* name;
    int64_t begin_ns, end_ns;  // since origin_
    const char* arg;
    int64_t value;
    bool failed;
  };
  struct Track {
    mutable std::mutex mutex;  // one writer at a time in practice (one thread per track); the lock keeps it so
    std::vector<Event> events;
  };

  std::vector<std::string> names_;
  std::unique_ptr<Track[]> tracks_;
  std::atomic<bool> recording_{false};
  bool started_ = false;
  size_t max_events_;
  Clock::time_point origin_;
  std::atomic<size_t> kept_{0}, dropped_{0};
};

// While it lives, the calling thread's spans go on `track` (a replica's worker or communication thread runs jobs
// for one replica at a time).
class TraceTrack {
 public:
  explicit TraceTrack(size_t track);
  ~TraceTrack();
  TraceTrack(const TraceTrack&) = delete;
  TraceTrack& operator=(const TraceTrack&) = delete;

 private:
  size_t previous_;
};

// A span from construction to destruction, when `trace` records: on the calling thread's track, or on `track`.
class TraceSpan {
 public:
  TraceSpan(Trace& trace, const char* name, const char* arg = nullptr, int64_t value = 0)
      : TraceSpan(trace, Trace::current_track(), name, arg, value) {}
  TraceSpan(Trace& trace, size_t track, const char* name, const char* arg = nullptr, int64_t value = 0)
      : TraceSpan(&trace, track, name, arg, value) {}
  // A trace that may be absent (null: no span), for code that records only when its owner traces.
  TraceSpan(Trace* trace, const char* name, const char* arg = nullptr, int64_t value = 0)
      : TraceSpan(trace, Trace::current_track(), name, arg, value) {}
  TraceSpan(Trace* trace, size_t track, const char* name, const char* arg = nullptr, int64_t value = 0)
      : trace_(trace && trace->recording() ? trace : nullptr), track_(track), name_(name), arg_(arg), value_(value) {
    if (trace_) {
      exceptions_ = std::uncaught_exceptions();
      begin_ = Trace::Clock::now();
    }
  }
  ~TraceSpan() {
    if (trace_)
      trace_->add(track_, name_, begin_, Trace::Clock::now(), arg_, value_, std::uncaught_exceptions() > exceptions_);
  }
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

 private:
  Trace* trace_;
  size_t track_;
  const char* name_;
  const char* arg_;
  int64_t value_;
  int exceptions_ = 0;
  Trace::Clock::time_point begin_;
};

}  // namespace dpar
