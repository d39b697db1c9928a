#include "common/trace.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <string>

namespace dpar {
namespace {

thread_local size_t tls_track = 0;

// Microseconds, Chrome's unit, with nanosecond digits. Spans start after the origin on a monotonic clock, so a
// negative time would be a bug: it is written as 0 rather than as invalid JSON.
void append_us(std::string& out, int64_t ns) {
  ns = std::max<int64_t>(ns, 0);
  char text[32];
  std::snprintf(text, sizeof text, "%lld.%03lld", static_cast<long long>(ns / 1000),
                static_cast<long long>(ns % 1000));
  out += text;
}

}  // namespace

Trace::Trace(std::vector<std::string> track_names, size_t max_events)
    : names_(std::move(track_names)), tracks_(std::make_unique<Track[]>(names_.size())), max_events_(max_events) {}

void Trace::start() {
  for (size_t t = 0; t < names_.size(); ++t) {
    std::lock_guard<std::mutex> lock(tracks_[t].mutex);
    tracks_[t].events.clear();
  }
  kept_.store(0);
  dropped_.store(0);
  origin_ = Clock::now();
  started_ = true;
  recording_.store(true, std::memory_order_relaxed);
}

void Trace::add(size_t track, const char* name, Clock::time_point begin, Clock::time_point end, const char* arg,
                int64_t value, bool failed) noexcept {
  const auto drop = [&] {
    kept_.fetch_sub(1, std::memory_order_relaxed);
    dropped_.fetch_add(1, std::memory_order_relaxed);
  };
  if (kept_.fetch_add(1, std::memory_order_relaxed) >= max_events_ || track >= names_.size()) return drop();
  const auto since = [&](Clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t - origin_).count();
  };
  try {
    Track& tr = tracks_[track];
    std::lock_guard<std::mutex> lock(tr.mutex);
    tr.events.push_back({name, since(begin), since(end), arg, value, failed});
  } catch (...) {  // no memory for a longer record, or a lock that failed
    drop();
  }
}

std::string Trace::chrome_json(int process) const {
  using nlohmann::json;
  std::string out = "{\"displayTimeUnit\":\"ms\",\"otherData\":";
  out += json{{"dropped_events", dropped_.load()}, {"clock", "host steady_clock, microseconds since start"}}.dump();
  out += ",\"traceEvents\":[\n";
  const std::string pid = std::to_string(process);
  out += "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" + pid + ",\"tid\":0,\"args\":" +
         json{{"name", "dpar rank " + pid}}.dump() + "}";
  for (size_t t = 0; t < names_.size(); ++t) {
    const std::string tid = std::to_string(t);
    // The tracks in their order, whatever the viewer's default (by name).
    out += ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" + pid + ",\"tid\":" + tid + ",\"args\":" +
           json{{"name", names_[t]}}.dump() + "}";
    out += ",\n{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":" + pid + ",\"tid\":" + tid +
           ",\"args\":{\"sort_index\":" + tid + "}}";
    std::vector<Event> events;
    {
      std::lock_guard<std::mutex> lock(tracks_[t].mutex);
      events = tracks_[t].events;
    }
    // Spans end in the order their scopes close (inner before outer): sorted by start, outer first on a tie, the
    // file reads as the nesting.
    std::stable_sort(events.begin(), events.end(), [](const Event& a, const Event& b) {
      return a.begin_ns != b.begin_ns ? a.begin_ns < b.begin_ns : a.end_ns > b.end_ns;
    });
    for (const Event& e : events) {
      out += ",\n{\"name\":" + json(e.name).dump() + ",\"ph\":\"X\",\"pid\":" + pid + ",\"tid\":" + tid + ",\"ts\":";
      append_us(out, e.begin_ns);
      out += ",\"dur\":";
      append_us(out, e.end_ns - e.begin_ns);
      if (e.arg || e.failed) {
        json args = json::object();
        if (e.arg) args[e.arg] = e.value;
        if (e.failed) args["failed"] = true;
        out += ",\"args\":" + args.dump();
      }
      out += "}";
    }
  }
  out += "\n]}\n";
  return out;
}

size_t Trace::current_track() { return tls_track; }

TraceTrack::TraceTrack(size_t track) : previous_(tls_track) { tls_track = track; }

TraceTrack::~TraceTrack() { tls_track = previous_; }

}  // namespace dpar
