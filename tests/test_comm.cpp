// The collectives of the threads backend against references computed here, over groups of 1, 2, 3, 4 and 8
// participants (one std::thread per rank): every collective x dtype x op x in/out of place, counts from 0 to
// 100003, roots other than 0, the asynchronous forms, and the failures (mismatched calls, a participant that does
// not arrive, abort, a local failure on the communication thread). Tests never assert on time.
#include <gtest/gtest.h>
#include <malloc.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "comm/threads_comm.h"
#include "common/error.h"

namespace dpar {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// Helpers

// The tests allocate and free buffers of up to 50 MB hundreds of times: keep them in the heap rather than have
// every one mapped, faulted in page by page and unmapped again (that took most of the run).
const bool kKeepHeap = [] {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // the largest it takes
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  return true;
}();

const size_t kCounts[] = {0, 1, 15, 17, 4099, 100003};
const DType kDTypes[] = {DType::kF32, DType::kF64, DType::kI32, DType::kI64};
const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMax, ReduceOp::kMin};

struct Group {
  Group(int n, std::chrono::duration<double> timeout = std::chrono::seconds(60)) : group(names(n), timeout) {
    for (int r = 0; r < n; ++r) comms.push_back(group.communicator(r));
  }
  static std::vector<std::string> names(int n) {
    std::vector<std::string> v;
    for (int r = 0; r < n; ++r) v.push_back("rank " + std::to_string(r));
    return v;
  }
  int size() const { return group.size(); }
  Communicator& operator[](int r) { return *comms[static_cast<size_t>(r)]; }
  ThreadGroup group;
  std::vector<std::unique_ptr<Communicator>> comms;
};

struct Outcome {
  Status status = Status::kOk;
  std::string message;
};

// Runs f(rank) on one thread per rank and returns how each ended.
template <class F>
std::vector<Outcome> on_ranks(int n, F&& f) {
  std::vector<Outcome> out(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        f(r);
      } catch (const Error& e) {
        out[static_cast<size_t>(r)] = {e.status(), e.what()};
      } catch (const std::exception& e) {
        out[static_cast<size_t>(r)] = {Status::kInternal, e.what()};
      }
    });
  for (auto& t : threads) t.join();
  return out;
}

std::string status_label(Status s) {
  switch (s) {
    case Status::kInvalidArgument: return "INVALID_ARGUMENT";
    case Status::kRemote: return "REMOTE";
    case Status::kTimeout: return "TIMEOUT";
    case Status::kMismatch: return "MISMATCH";
    default: return "status " + std::to_string(static_cast<int>(s));
  }
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Calls f(T{}) with the C++ type of `dtype`.
template <class F>
void with_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kF32: return f(float{});
    case DType::kF64: return f(double{});
    case DType::kI32: return f(int32_t{});
    case DType::kI64: return f(int64_t{});
  }
}

uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  return x ^ (x >> 33);
}

// Element i of rank r's input (salt tells buffers apart). Floats have full mantissas and exponents that vary, so
// the order of a sum changes its bits; integers fit their type's sum over 8 ranks.
template <class T>
T make_value(uint64_t h) {
  if constexpr (std::is_floating_point_v<T>) {
    static const double kScale[8] = {1.0 / 16, 1.0 / 4, 1.0 / 2, 1, 2, 8, 64, 1024};
    const double mant = static_cast<double>(static_cast<int64_t>(h & 0xFFFFFF) - 0x800000) / 0x800000;  // (-1, 1)
    return static_cast<T>((mant + (mant < 0 ? -0.5 : 0.5)) * kScale[(h >> 24) & 7]);
  } else {
    const int64_t v = static_cast<int64_t>((h >> 8) % 200001) - 100000;
    return static_cast<T>(sizeof(T) == 8 ? v * 1000000007LL : v);
  }
}

// Inputs are windows of one random table (longer than any buffer here), at an offset per (rank, salt): cheap to
// make, which matters with hundreds of configurations of up to 8 x 800k elements.
constexpr size_t kTableSize = size_t(1) << 21;
template <class T>
const std::vector<T>& table() {
  static const std::vector<T> t = [] {
    std::vector<T> v(kTableSize);
    for (size_t i = 0; i < kTableSize; ++i) v[i] = make_value<T>(mix(i + 1));
    return v;
  }();
  return t;
}

template <class T>
std::vector<T> values(int rank, size_t count, uint64_t salt) {
  const auto& t = table<T>();
  size_t at = mix(static_cast<uint64_t>(rank) * 1000003 + salt * 7919) % kTableSize;
  std::vector<T> v(count);
  for (size_t i = 0; i < count;) {
    const size_t len = std::min(count - i, kTableSize - at);
    std::copy(t.begin() + static_cast<ptrdiff_t>(at), t.begin() + static_cast<ptrdiff_t>(at + len),
              v.begin() + static_cast<ptrdiff_t>(i));
    i += len;
    at = 0;
  }
  return v;
}

// The reduction of xs[0..n) (rank order) as a double (floats) or exactly (integers), and the tolerance of a float
// sum or mean (max and min are exact).
template <class T>
struct Reference {
  double want = 0;
  double tol = 0;
};
template <class T>
Reference<T> reference(ReduceOp op, const T* xs, int n) {
  Reference<T> ref;
  if constexpr (std::is_floating_point_v<T>) {
    double sum = 0, abs_sum = 0;
    T mx = xs[0], mn = xs[0];
    for (int q = 0; q < n; ++q) {
      sum += xs[q];
      abs_sum += std::fabs(static_cast<double>(xs[q]));
      mx = std::max(mx, xs[q]);
      mn = std::min(mn, xs[q]);
    }
    const double eps = std::is_same_v<T, float> ? 1e-6 : 1e-14;
    switch (op) {
      case ReduceOp::kSum: ref = {sum, eps * abs_sum}; break;
      case ReduceOp::kMean: ref = {sum / n, eps * abs_sum / n}; break;
      case ReduceOp::kMax: ref = {static_cast<double>(mx), 0}; break;
      case ReduceOp::kMin: ref = {static_cast<double>(mn), 0}; break;
    }
  } else {
    int64_t sum = 0;
    T mx = xs[0], mn = xs[0];
    for (int q = 0; q < n; ++q) {
      sum += static_cast<int64_t>(xs[q]);
      mx = std::max(mx, xs[q]);
      mn = std::min(mn, xs[q]);
    }
    int64_t want = 0;
    switch (op) {
      case ReduceOp::kSum: want = sum; break;
      case ReduceOp::kMean: want = sum / n; break;  // truncates toward zero
      case ReduceOp::kMax: want = mx; break;
      case ReduceOp::kMin: want = mn; break;
    }
    ref.want = static_cast<double>(want);  // exact: |values| < 2^53
  }
  return ref;
}

template <class T>
bool matches(T got, const Reference<T>& ref) {
  if constexpr (std::is_floating_point_v<T>)
    return ref.tol == 0 ? static_cast<double>(got) == ref.want : std::fabs(got - ref.want) <= ref.tol;
  else
    return static_cast<double>(got) == ref.want;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// How a collective's buffers are laid out.
enum class Place {
  kOut,  // send and recv distinct
  kIn,   // in place, the MPI_IN_PLACE layout: all_reduce/reduce send == recv; all_gather send at recv + r * count;
         // reduce_scatter recv == send (the result lands at the start)
  kAlt,  // the other in-place layout: all_gather send == recv (contribution at the start); reduce_scatter
         // recv == send + r * count (NCCL)
};
const char* place_name(Place p) {
  return p == Place::kOut ? "out of place" : p == Place::kIn ? "in place" : "in place (alt)";
}

std::string describe(const char* coll, DType d, ReduceOp op, Place p, size_t count, int n, int root = -1) {
  std::ostringstream os;
  os << coll << " " << dtype_name(d) << " " << reduce_op_name(op) << " " << place_name(p) << ", count " << count
     << ", " << n << " ranks";
  if (root >= 0) os << ", root " << root;
  return os.str();
}

// The dtype of T.
template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::kF32;
  if constexpr (std::is_same_v<T, double>) return DType::kF64;
  if constexpr (std::is_same_v<T, int32_t>) return DType::kI32;
  return DType::kI64;
}

// ---------------------------------------------------------------------------------------------------------------
// The collectives, one run of each configuration. Each returns "" or the first problem found, and the result (to
// compare two runs bit for bit).

std::string first_error(const std::vector<Outcome>& out) {
  for (size_t r = 0; r < out.size(); ++r)
    if (out[r].status != Status::kOk) return "rank " + std::to_string(r) + " threw " + out[r].message;
  return "";
}

// all_reduce: every rank's recv holds the reduction, with the same bits on every rank.
template <class T>
std::string all_reduce_case(Group& g, ReduceOp op, Place place, size_t count, std::vector<T>* result) {
  const int n = g.size();
  std::vector<std::vector<T>> in(n), buf(n), send(n);
  for (int r = 0; r < n; ++r) {
    in[r] = values<T>(r, count, 1);
    if (place == Place::kIn) {
      buf[r] = in[r];
    } else {
      send[r] = in[r];
      buf[r] = values<T>(r, count, 2);  // garbage in recv
    }
  }
  auto err = first_error(on_ranks(n, [&](int r) {
    const void* s = place == Place::kIn ? static_cast<const void*>(buf[r].data()) : send[r].data();
    g[r].all_reduce(s, buf[r].data(), count, dtype_of<T>(), op);
  }));
  if (!err.empty()) return err;
  std::vector<T> xs(n);
  for (size_t i = 0; i < count; ++i) {
    for (int q = 0; q < n; ++q) xs[q] = in[q][i];
    const auto ref = reference(op, xs.data(), n);
    if (!matches(buf[0][i], ref))
      return "element " + std::to_string(i) + ": got " + std::to_string(buf[0][i]) + ", want " +
             std::to_string(ref.want);
  }
  for (int r = 1; r < n; ++r)
    if (!same_bits(buf[r], buf[0])) return "rank " + std::to_string(r) + "'s result differs from rank 0's bits";
  if (place == Place::kOut)
    for (int r = 0; r < n; ++r)
      if (!same_bits(send[r], in[r])) return "rank " + std::to_string(r) + "'s send was modified";
  *result = buf[0];
  return "";
}

// reduce: root's recv holds the reduction; nothing else changes. Out of place, non-roots pass a null recv.
template <class T>
std::string reduce_case(Group& g, ReduceOp op, Place place, size_t count, int root, std::vector<T>* result) {
  const int n = g.size();
  std::vector<std::vector<T>> in(n), buf(n), send(n);
  for (int r = 0; r < n; ++r) {
    in[r] = values<T>(r, count, 3);
    send[r] = in[r];
    buf[r] = place == Place::kIn ? in[r] : values<T>(r, count, 4);
  }
  const std::vector<std::vector<T>> buf_before = buf;
  auto err = first_error(on_ranks(n, [&](int r) {
    if (place == Place::kIn)
      g[r].reduce(buf[r].data(), buf[r].data(), count, dtype_of<T>(), op, root);
    else
      g[r].reduce(send[r].data(), r == root ? buf[r].data() : nullptr, count, dtype_of<T>(), op, root);
  }));
  if (!err.empty()) return err;
  std::vector<T> xs(n);
  for (size_t i = 0; i < count; ++i) {
    for (int q = 0; q < n; ++q) xs[q] = in[q][i];
    const auto ref = reference(op, xs.data(), n);
    if (!matches(buf[root][i], ref))
      return "element " + std::to_string(i) + ": got " + std::to_string(buf[root][i]) + ", want " +
             std::to_string(ref.want);
  }
  for (int r = 0; r < n; ++r) {
    if (r != root && !same_bits(buf[r], buf_before[r])) return "rank " + std::to_string(r) + "'s buffer changed";
    if (!same_bits(send[r], in[r])) return "rank " + std::to_string(r) + "'s send was modified";
  }
  *result = buf[root];
  return "";
}

// reduce_scatter: rank r's recv holds block r of the reduction of every rank's (n * count) send.
template <class T>
std::string reduce_scatter_case(Group& g, ReduceOp op, Place place, size_t count, std::vector<T>* result) {
  const int n = g.size();
  const size_t total = count * static_cast<size_t>(n);
  std::vector<std::vector<T>> in(n), send(n), recv(n);
  for (int r = 0; r < n; ++r) {
    in[r] = values<T>(r, total, 5);
    send[r] = in[r];
    if (place == Place::kOut) recv[r] = values<T>(r, count, 6);
  }
  auto err = first_error(on_ranks(n, [&](int r) {
    T* s = send[r].data();
    T* d = place == Place::kOut ? recv[r].data() : place == Place::kIn ? s : s + static_cast<size_t>(r) * count;
    g[r].reduce_scatter(s, d, count, dtype_of<T>(), op);
  }));
  if (!err.empty()) return err;
  std::vector<T> xs(n);
  result->clear();
  for (int r = 0; r < n; ++r) {
    const T* got = place == Place::kOut  ? recv[r].data()
                   : place == Place::kIn ? send[r].data()
                                         : send[r].data() + static_cast<size_t>(r) * count;
    for (size_t i = 0; i < count; ++i) {
      for (int q = 0; q < n; ++q) xs[q] = in[q][static_cast<size_t>(r) * count + i];
      const auto ref = reference(op, xs.data(), n);
      if (!matches(got[i], ref))
        return "rank " + std::to_string(r) + " element " + std::to_string(i) + ": got " + std::to_string(got[i]) +
               ", want " + std::to_string(ref.want);
    }
    result->insert(result->end(), got, got + count);
    if (place == Place::kOut && !same_bits(send[r], in[r])) return "rank " + std::to_string(r) + "'s send was modified";
  }
  // Bit-identical across ranks: each block is reduced by one rank, so compare with an all_reduce of the same
  // data instead (same op, same rank order).
  if (count) {
    std::vector<std::vector<T>> all(n);
    for (int r = 0; r < n; ++r) all[r] = in[r];
    err = first_error(
        on_ranks(n, [&](int r) { g[r].all_reduce(all[r].data(), all[r].data(), total, dtype_of<T>(), op); }));
    if (!err.empty()) return err;
    if (!same_bits(*result, all[0])) return "the blocks differ from an all_reduce's bits";
  }
  return "";
}

// broadcast: every buffer holds root's.
template <class T>
std::string broadcast_case(Group& g, size_t count, int root) {
  const int n = g.size();
  std::vector<std::vector<T>> buf(n);
  for (int r = 0; r < n; ++r) buf[r] = values<T>(r, count, 7);
  const std::vector<T> want = buf[root];
  auto err = first_error(on_ranks(n, [&](int r) { g[r].broadcast(buf[r].data(), count, dtype_of<T>(), root); }));
  if (!err.empty()) return err;
  for (int r = 0; r < n; ++r)
    if (!same_bits(buf[r], want)) return "rank " + std::to_string(r) + " does not hold root's buffer";
  return "";
}

// all_gather: every recv holds every rank's send, in rank order.
template <class T>
std::string all_gather_case(Group& g, Place place, size_t count) {
  const int n = g.size();
  const size_t total = count * static_cast<size_t>(n);
  std::vector<std::vector<T>> in(n), send(n), recv(n);
  for (int r = 0; r < n; ++r) {
    in[r] = values<T>(r, count, 8);
    send[r] = in[r];
    recv[r] = values<T>(r, total, 9);  // garbage
    if (place == Place::kIn) std::copy(in[r].begin(), in[r].end(), recv[r].begin() + static_cast<ptrdiff_t>(r * count));
    if (place == Place::kAlt) std::copy(in[r].begin(), in[r].end(), recv[r].begin());
  }
  auto err = first_error(on_ranks(n, [&](int r) {
    const T* s = place == Place::kOut  ? send[r].data()
                 : place == Place::kIn ? recv[r].data() + static_cast<size_t>(r) * count
                                       : recv[r].data();
    g[r].all_gather(s, recv[r].data(), count, dtype_of<T>());
  }));
  if (!err.empty()) return err;
  std::vector<T> want;
  for (int q = 0; q < n; ++q) want.insert(want.end(), in[q].begin(), in[q].end());
  for (int r = 0; r < n; ++r) {
    if (!same_bits(recv[r], want)) return "rank " + std::to_string(r) + "'s recv is wrong";
    if (place == Place::kOut && !same_bits(send[r], in[r])) return "rank " + std::to_string(r) + "'s send was modified";
  }
  return "";
}

// Roots to try: 0, the last, and one in the middle.
std::vector<int> roots(int n) {
  std::set<int> s{0, n - 1, n / 2};
  return {s.begin(), s.end()};
}

class Collectives : public ::testing::TestWithParam<int> {};

INSTANTIATE_TEST_SUITE_P(GroupSizes, Collectives, ::testing::Values(1, 2, 3, 4, 8),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::to_string(info.param) + "ranks";
                         });

TEST_P(Collectives, AllReduceEveryDTypeOpAndLayout) {
  Group g(GetParam());
  for (DType d : kDTypes)
    for (ReduceOp op : kOps)
      for (Place place : {Place::kOut, Place::kIn})
        for (size_t count : kCounts)
          with_type(d, [&](auto tag) {
            using T = decltype(tag);
            std::vector<T> first, second;
            const auto what = describe("all_reduce", d, op, place, count, g.size());
            ASSERT_EQ(all_reduce_case<T>(g, op, place, count, &first), "") << what;
            ASSERT_EQ(all_reduce_case<T>(g, op, place, count, &second), "") << what;
            ASSERT_TRUE(same_bits(first, second)) << what << ": two runs gave different bits";
          });
}

TEST_P(Collectives, ReduceEveryDTypeOpLayoutAndRoot) {
  Group g(GetParam());
  for (int root : roots(g.size()))
    for (DType d : kDTypes)
      for (ReduceOp op : kOps)
        for (Place place : {Place::kOut, Place::kIn})
          for (size_t count : kCounts)
            with_type(d, [&](auto tag) {
              using T = decltype(tag);
              std::vector<T> first, second;
              const auto what = describe("reduce", d, op, place, count, g.size(), root);
              ASSERT_EQ(reduce_case<T>(g, op, place, count, root, &first), "") << what;
              ASSERT_EQ(reduce_case<T>(g, op, place, count, root, &second), "") << what;
              ASSERT_TRUE(same_bits(first, second)) << what << ": two runs gave different bits";
            });
}

TEST_P(Collectives, ReduceScatterEveryDTypeOpAndLayout) {
  Group g(GetParam());
  for (DType d : kDTypes)
    for (ReduceOp op : kOps)
      for (Place place : {Place::kOut, Place::kIn, Place::kAlt})
        for (size_t count : kCounts)
          with_type(d, [&](auto tag) {
            using T = decltype(tag);
            std::vector<T> first, second;
            const auto what = describe("reduce_scatter", d, op, place, count, g.size());
            ASSERT_EQ(reduce_scatter_case<T>(g, op, place, count, &first), "") << what;
            ASSERT_EQ(reduce_scatter_case<T>(g, op, place, count, &second), "") << what;
            ASSERT_TRUE(same_bits(first, second)) << what << ": two runs gave different bits";
          });
}

TEST_P(Collectives, BroadcastEveryDTypeAndRoot) {
  Group g(GetParam());
  for (int root : roots(g.size()))
    for (DType d : kDTypes)
      for (size_t count : kCounts)
        with_type(d, [&](auto tag) {
          using T = decltype(tag);
          ASSERT_EQ(broadcast_case<T>(g, count, root), "")
              << describe("broadcast", d, ReduceOp::kSum, Place::kIn, count, g.size(), root);
        });
}

TEST_P(Collectives, AllGatherEveryDTypeAndLayout) {
  Group g(GetParam());
  for (DType d : kDTypes)
    for (Place place : {Place::kOut, Place::kIn, Place::kAlt})
      for (size_t count : kCounts)
        with_type(d, [&](auto tag) {
          using T = decltype(tag);
          ASSERT_EQ(all_gather_case<T>(g, place, count), "")
              << describe("all_gather", d, ReduceOp::kSum, place, count, g.size());
        });
}

// A small all_gather has one barrier (threads_comm.h): a participant returns while the others may still read what
// it staged, and stages its next call at once. Back to back, in place and not, with other collectives between,
// every call must still see its own round's contributions. Counts on both sides of the staging limit; with more
// ranks than cores, participants are descheduled in the middle of their copies.
TEST_P(Collectives, BackToBackAllGathersSeeTheirOwnRound) {
  Group g(GetParam());
  const int n = g.size();
  const size_t limit = g.group.stage_limit() / sizeof(int32_t);
  ASSERT_GE(g.group.stage_limit(), size_t{1} << 10);
  ASSERT_LE(g.group.stage_limit(), ThreadGroup::kStageBytes);
  const size_t counts[] = {1, limit, limit + 1, 17};
  std::vector<std::string> wrong(n);  // what a rank found wrong; it then aborts, so the others stop waiting
  auto out = on_ranks(n, [&](int r) {
    std::vector<int32_t> send, recv;
    float one = 1.0f;
    for (int i = 0; i < 200; ++i) {
      const size_t count = counts[i % 4];
      recv.assign(count * static_cast<size_t>(n), -1);
      send.assign(count, r * 100000 + i);
      int32_t* s = send.data();
      if ((i / 4) % 2 == 1) {  // in place
        s = recv.data() + count * static_cast<size_t>(r);
        std::copy(send.begin(), send.end(), s);
      }
      g[r].all_gather(s, recv.data(), count, DType::kI32);
      for (int q = 0; q < n; ++q)
        for (size_t j = 0; j < count; ++j)
          if (recv[q * count + j] != q * 100000 + i) {
            wrong[r] = "call " + std::to_string(i) + " (count " + std::to_string(count) + "): block " +
                       std::to_string(q) + " holds " + std::to_string(recv[q * count + j]);
            g[r].abort(wrong[r]);
            return;
          }
      if (i % 5 == 0) g[r].barrier("between");
      if (i % 7 == 0) g[r].all_reduce_sum(&one, 1, true, 1.0f / static_cast<float>(n));
    }
    if (one != 1.0f) wrong[r] = "the all_reduce_sum between gave " + std::to_string(one);
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(wrong[r], "") << "rank " << r;
  EXPECT_EQ(first_error(out), "");
}

TEST_P(Collectives, AllReduceSumWithAndWithoutContributors) {
  Group g(GetParam());
  const int n = g.size();
  for (size_t count : kCounts)
    for (int skip : {1, 0, -1}) {  // -1: nobody contributes
      std::vector<std::vector<float>> buf(n);
      for (int r = 0; r < n; ++r) buf[r] = values<float>(r, count, 10);
      const auto in = buf;
      auto contributes = [&](int r) { return skip >= 0 && r != skip; };
      ASSERT_EQ(
          first_error(on_ranks(n, [&](int r) { g[r].all_reduce_sum(buf[r].data(), count, contributes(r), 0.5f); })),
          "");
      for (size_t i = 0; i < count; ++i) {
        float want = 0;  // the same order as the backend: rank order, then the scale
        for (int q = 0; q < n; ++q)
          if (contributes(q)) want = q == (skip == 0 ? 1 : 0) ? in[q][i] : want + in[q][i];
        want *= 0.5f;
        for (int r = 0; r < n; ++r) ASSERT_EQ(buf[r][i], want) << "count " << count << " rank " << r << " i " << i;
      }
    }
}

TEST_P(Collectives, ReduceSumLandsAtTheRootOnly) {
  // all_reduce_sum's sum, into one participant: the first half of the engine's hierarchical reduction.
  Group g(GetParam());
  const int n = g.size();
  for (size_t count : {size_t{0}, size_t{1}, size_t{1000}, size_t{100003}})
    for (int root : {0, n - 1})
      for (int skip : {1, 0, -1}) {  // -1: nobody contributes
        std::vector<std::vector<float>> buf(n);
        for (int r = 0; r < n; ++r) buf[r] = values<float>(r, count, 10);
        const auto in = buf;
        auto contributes = [&](int r) { return skip >= 0 && r != skip; };
        ASSERT_EQ(first_error(on_ranks(
                      n, [&](int r) { g[r].reduce_sum(buf[r].data(), count, contributes(r), 0.5f, root); })),
                  "");
        for (size_t i = 0; i < count; ++i) {
          float want = 0;
          for (int q = 0; q < n; ++q)
            if (contributes(q)) want = q == (skip == 0 ? 1 : 0) ? in[q][i] : want + in[q][i];
          ASSERT_EQ(buf[root][i], want * 0.5f) << "count " << count << " root " << root << " i " << i;
        }
      }
  // A root outside the group is refused on the participant that names it, and releases the others.
  EXPECT_NE(first_error(on_ranks(n, [&](int r) {
              float x = 1;
              g[r].reduce_sum(&x, 1, true, 1.0f, r == 0 ? n : 0);
            })),
            "");
}

TEST_P(Collectives, FloatMaxAndMinPropagateNaN) {
  Group g(GetParam());
  const int n = g.size();
  for (ReduceOp op : {ReduceOp::kMax, ReduceOp::kMin}) {
    std::vector<std::vector<float>> buf(n, std::vector<float>(40, 1.0f));
    buf[n - 1][3] = std::numeric_limits<float>::quiet_NaN();
    buf[0][5] = std::numeric_limits<float>::quiet_NaN();
    buf[0][7] = 2.0f;
    ASSERT_EQ(first_error(
                  on_ranks(n, [&](int r) { g[r].all_reduce(buf[r].data(), buf[r].data(), 40, DType::kF32, op); })),
              "");
    for (int r = 0; r < n; ++r) {
      EXPECT_TRUE(std::isnan(buf[r][3])) << reduce_op_name(op);
      EXPECT_TRUE(std::isnan(buf[r][5])) << reduce_op_name(op);
      EXPECT_EQ(buf[r][7], op == ReduceOp::kMax || n == 1 ? 2.0f : 1.0f);
      EXPECT_EQ(buf[r][8], 1.0f);
    }
  }
}

// Integer sums wrap (two's complement), the rule every backend shares (comm/reduce_kernels.h; the MPI backend's
// test checks it across processes).
TEST_P(Collectives, IntegerSumsWrap) {
  Group g(GetParam());
  const int n = g.size();
  std::vector<std::vector<int32_t>> a(n, std::vector<int32_t>(40, std::numeric_limits<int32_t>::max()));
  std::vector<std::vector<int64_t>> b(n, std::vector<int64_t>(40, std::numeric_limits<int64_t>::max()));
  ASSERT_EQ(first_error(on_ranks(n, [&](int r) {
              g[r].all_reduce(a[r].data(), a[r].data(), 40, DType::kI32, ReduceOp::kSum);
              g[r].all_reduce(b[r].data(), b[r].data(), 40, DType::kI64, ReduceOp::kSum);
            })),
            "");
  const auto want32 = static_cast<int32_t>(static_cast<uint32_t>(INT32_MAX) * static_cast<uint32_t>(n));
  const auto want64 = static_cast<int64_t>(static_cast<uint64_t>(INT64_MAX) * static_cast<uint64_t>(n));
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(a[r], std::vector<int32_t>(40, want32));
    EXPECT_EQ(b[r], std::vector<int64_t>(40, want64));
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Asynchronous forms

TEST_P(Collectives, AsyncOperationsInFlightEqualBlocking) {
  Group g(GetParam());
  const int n = g.size();
  for (size_t count : {size_t(0), size_t(17), size_t(4099), size_t(100003)}) {
    const int root = n - 1;
    // Inputs, per rank: an f32 sum all_reduce (in place), an i64 max all_reduce (out of place), a broadcast, an
    // f64 all_gather, an i32 min reduce_scatter and an f32 mean reduce to `root`.
    struct Bufs {
      std::vector<float> ar;
      std::vector<int64_t> ar_send, ar_recv;
      std::vector<double> bc, ag_send, ag_recv;
      std::vector<int32_t> rs_send, rs_recv;
      std::vector<float> rd_send, rd_recv;
    };
    auto fresh = [&](int r) {
      Bufs b;
      b.ar = values<float>(r, count, 11);
      b.ar_send = values<int64_t>(r, count, 12);
      b.ar_recv.assign(count, 0);
      b.bc = values<double>(r, count, 13);
      b.ag_send = values<double>(r, count, 14);
      b.ag_recv.assign(count * n, 0);
      b.rs_send = values<int32_t>(r, count * n, 15);
      b.rs_recv.assign(count, 0);
      b.rd_send = values<float>(r, count, 16);
      b.rd_recv.assign(count, 0);
      return b;
    };
    std::vector<Bufs> async(n), blocking(n);
    for (int r = 0; r < n; ++r) async[r] = fresh(r), blocking[r] = fresh(r);

    ASSERT_EQ(first_error(on_ranks(
                  n,
                  [&](int r) {
                    Bufs& b = blocking[r];
                    Communicator& c = g[r];
                    c.all_reduce(b.ar.data(), b.ar.data(), count, DType::kF32, ReduceOp::kSum);
                    c.all_reduce(b.ar_send.data(), b.ar_recv.data(), count, DType::kI64, ReduceOp::kMax);
                    c.broadcast(b.bc.data(), count, DType::kF64, root);
                    c.all_gather(b.ag_send.data(), b.ag_recv.data(), count, DType::kF64);
                    c.reduce_scatter(b.rs_send.data(), b.rs_recv.data(), count, DType::kI32, ReduceOp::kMin);
                    c.reduce(b.rd_send.data(), b.rd_recv.data(), count, DType::kF32, ReduceOp::kMean, root);
                  })),
              "");
    ASSERT_EQ(
        first_error(on_ranks(
            n,
            [&](int r) {
              Bufs& b = async[r];
              Communicator& c = g[r];
              std::vector<std::shared_ptr<Work>> works;
              works.push_back(c.async_all_reduce(b.ar.data(), b.ar.data(), count, DType::kF32, ReduceOp::kSum));
              works.push_back(
                  c.async_all_reduce(b.ar_send.data(), b.ar_recv.data(), count, DType::kI64, ReduceOp::kMax));
              works.push_back(c.async_broadcast(b.bc.data(), count, DType::kF64, root));
              works.push_back(c.async_all_gather(b.ag_send.data(), b.ag_recv.data(), count, DType::kF64));
              works.push_back(
                  c.async_reduce_scatter(b.rs_send.data(), b.rs_recv.data(), count, DType::kI32, ReduceOp::kMin));
              works.push_back(
                  c.async_reduce(b.rd_send.data(), b.rd_recv.data(), count, DType::kF32, ReduceOp::kMean, root));
              for (auto& w : works) (void)w->test();  // never blocks; may be true or false
              for (auto& w : works) {
                w->wait();
                if (!w->test()) throw Error(Status::kInternal, "test() is false after wait()");
              }
            })),
        "");
    for (int r = 0; r < n; ++r) {
      const Bufs &a = async[r], &b = blocking[r];
      EXPECT_TRUE(same_bits(a.ar, b.ar)) << "rank " << r << " count " << count;
      EXPECT_TRUE(same_bits(a.ar_recv, b.ar_recv)) << "rank " << r << " count " << count;
      EXPECT_TRUE(same_bits(a.bc, b.bc)) << "rank " << r << " count " << count;
      EXPECT_TRUE(same_bits(a.ag_recv, b.ag_recv)) << "rank " << r << " count " << count;
      EXPECT_TRUE(same_bits(a.rs_recv, b.rs_recv)) << "rank " << r << " count " << count;
      EXPECT_TRUE(same_bits(a.rd_recv, b.rd_recv)) << "rank " << r << " count " << count;
    }
    // And the blocking results are right (spot checks; the typed tests above cover every element).
    if (count) {
      float sum = 0;
      for (int q = 0; q < n; ++q) sum += values<float>(q, 1, 11)[0];
      EXPECT_NEAR(blocking[0].ar[0], sum, 1e-5 * n * 64);
      EXPECT_EQ(blocking[0].bc, values<double>(root, count, 13));
    }
  }
}

TEST_P(Collectives, DestroyingACommunicatorRunsItsQueuedWork) {
  Group g(GetParam());
  const int n = g.size();
  std::vector<std::vector<float>> buf(n);
  std::vector<std::shared_ptr<Work>> first(n), second(n);
  for (int r = 0; r < n; ++r) buf[r] = values<float>(r, 1000, 17);
  ASSERT_EQ(first_error(on_ranks(
                n,
                [&](int r) {
                  first[r] = g[r].async_all_reduce(buf[r].data(), buf[r].data(), 1000, DType::kF32, ReduceOp::kMax);
                  second[r] = g[r].async_broadcast(buf[r].data(), 1000, DType::kF32, 0);
                  g.comms[r].reset();  // without waiting: the destructor lets the queued work run, then joins
                })),
            "");
  for (int r = 0; r < n; ++r) {
    EXPECT_TRUE(first[r]->test());
    EXPECT_TRUE(second[r]->test());
    first[r]->wait();
    second[r]->wait();
    EXPECT_EQ(buf[r], buf[0]);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Failures

TEST_P(Collectives, DifferentCountsMismatchOnEveryParticipant) {
  const int n = GetParam();
  if (n < 2) GTEST_SKIP() << "needs two participants";
  Group g(n, std::chrono::seconds(60));
  std::vector<std::vector<float>> buf(n, std::vector<float>(200, 1.0f));
  auto out = on_ranks(n, [&](int r) {
    g[r].all_reduce(buf[r].data(), buf[r].data(), r == 1 ? 200 : 100, DType::kF32, ReduceOp::kSum);
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(out[r].status, Status::kMismatch) << out[r].message;
    EXPECT_TRUE(contains(out[r].message,
                         "all_reduce: participant 1 called all_reduce of 200 f32 (sum) but "
                         "participant 0 called all_reduce of 100 f32 (sum); nothing was moved"))
        << out[r].message;
    EXPECT_EQ(buf[r], std::vector<float>(200, 1.0f)) << "no data moved";
  }
  // The group goes on (every participant saw the same mismatch), and after a reset too.
  for (int pass = 0; pass < 2; ++pass) {
    ASSERT_EQ(
        first_error(on_ranks(
            n, [&](int r) { g[r].all_reduce(buf[r].data(), buf[r].data(), 200, DType::kF32, ReduceOp::kSum); })),
        "");
    for (int r = 0; r < n; ++r) EXPECT_EQ(buf[r][199], pass == 0 ? float(n) : float(n * n));
    g.group.reset();
  }
}

TEST_P(Collectives, DifferentOperationsMismatchOnEveryParticipant) {
  const int n = GetParam();
  if (n < 2) GTEST_SKIP() << "needs two participants";
  Group g(n);
  std::vector<std::vector<int64_t>> buf(n, std::vector<int64_t>(64, 3));
  auto out = on_ranks(n, [&](int r) {
    if (r == n - 1)
      g[r].broadcast(buf[r].data(), 64, DType::kI64, 0);
    else
      g[r].all_reduce(buf[r].data(), buf[r].data(), 64, DType::kI64, ReduceOp::kMax);
  });
  const std::string differs = "participant " + std::to_string(n - 1) + " called broadcast of 64 i64 from root 0";
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(out[r].status, Status::kMismatch) << out[r].message;
    EXPECT_TRUE(contains(out[r].message, r == n - 1 ? "broadcast: " : "all_reduce: ")) << out[r].message;
    EXPECT_TRUE(contains(out[r].message, differs)) << out[r].message;
    EXPECT_TRUE(contains(out[r].message, "participant 0 called all_reduce of 64 i64 (max)")) << out[r].message;
  }
  // A barrier against an all_gather, then a reduce with another root.
  out = on_ranks(n, [&](int r) {
    if (r == 1)
      g[r].barrier("sync");
    else
      g[r].all_gather(buf[r].data(), buf[r].data(), 0, DType::kI64);
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(out[r].status, Status::kMismatch) << out[r].message;
    EXPECT_TRUE(contains(out[r].message,
                         "participant 1 called barrier but participant 0 called "
                         "all_gather of 0 i64"))
        << out[r].message;
  }
  out = on_ranks(n, [&](int r) {
    g[r].reduce(buf[r].data(), buf[r].data(), 64, DType::kI64, ReduceOp::kSum, r == 1 ? 1 : 0);
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(out[r].status, Status::kMismatch) << out[r].message;
    EXPECT_TRUE(contains(out[r].message,
                         "called reduce of 64 i64 (sum) to root 1 but participant 0 "
                         "called reduce of 64 i64 (sum) to root 0"))
        << out[r].message;
  }
}

TEST_P(Collectives, AsyncMismatchReachesEveryParticipant) {
  const int n = GetParam();
  if (n < 2) GTEST_SKIP() << "needs two participants";
  Group g(n);
  std::vector<std::vector<float>> buf(n, std::vector<float>(300, 1.0f));
  auto out = on_ranks(n, [&](int r) {
    auto w = g[r].async_all_reduce(buf[r].data(), buf[r].data(), r == 1 ? 300 : 100, DType::kF32, ReduceOp::kMean);
    w->wait();
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(out[r].status, Status::kMismatch) << out[r].message;
    EXPECT_TRUE(contains(out[r].message, "participant 1 called all_reduce of 300 f32 (mean)"))
        << out[r].message;
  }
}

TEST_P(Collectives, MissingParticipantTimesOutAndIsNamed) {
  const int n = GetParam();
  if (n < 2) GTEST_SKIP() << "needs two participants";
  Group g(n, std::chrono::milliseconds(200));
  const std::string missing = "rank " + std::to_string(n - 1);
  std::vector<std::vector<double>> buf(n, std::vector<double>(100, 1.0));
  auto out = on_ranks(n, [&](int r) {
    if (r != n - 1) g[r].all_reduce(buf[r].data(), buf[r].data(), 100, DType::kF64, ReduceOp::kSum);
  });
  bool timed_out = false;
  for (int r = 0; r < n - 1; ++r) {
    EXPECT_TRUE(out[r].status == Status::kTimeout || out[r].status == Status::kRemote) << out[r].message;
    EXPECT_TRUE(contains(out[r].message, missing)) << out[r].message;
    timed_out = timed_out || out[r].status == Status::kTimeout;
  }
  EXPECT_TRUE(timed_out);
  // The group is aborted until reset; then it works again.
  EXPECT_TRUE(g.group.aborted());
  g.group.reset();
  ASSERT_EQ(
      first_error(on_ranks(
          n, [&](int r) { g[r].all_reduce(buf[r].data(), buf[r].data(), 100, DType::kF64, ReduceOp::kSum); })),
      "");
  for (int r = 0; r < n; ++r) EXPECT_EQ(buf[r][99], double(n));
}

TEST_P(Collectives, AbortReleasesEveryoneAndResetRestores) {
  const int n = GetParam();
  if (n < 2) GTEST_SKIP() << "needs two participants";
  Group g(n);  // a long timeout: only the abort can release them
  std::vector<std::vector<int32_t>> buf(n, std::vector<int32_t>(1000, 2));
  auto out = on_ranks(n, [&](int r) {
    if (r == 0)
      g[r].abort("rank 0 gave up");
    else
      g[r].broadcast(buf[r].data(), 1000, DType::kI32, 1);
  });
  for (int r = 1; r < n; ++r) {
    EXPECT_EQ(out[r].status, Status::kRemote) << out[r].message;
    EXPECT_TRUE(contains(out[r].message, "rank 0 gave up")) << out[r].message;
  }
  g.group.reset();
  buf[1].assign(1000, 7);
  ASSERT_EQ(first_error(on_ranks(n, [&](int r) { g[r].broadcast(buf[r].data(), 1000, DType::kI32, 1); })), "");
  for (int r = 0; r < n; ++r) EXPECT_EQ(buf[r], std::vector<int32_t>(1000, 7));
}

TEST_P(Collectives, LocalFailureOnTheCommThreadReleasesTheOthers) {
  const int n = GetParam();
  if (n < 2) GTEST_SKIP() << "needs two participants";
  Group g(n);  // a long timeout: only the abort can release them
  std::vector<std::vector<float>> buf(n, std::vector<float>(50, 1.0f));
  auto out = on_ranks(n, [&](int r) {
    // Rank 1 names a root that does not exist: its broadcast fails before it arrives.
    auto a = g[r].async_broadcast(buf[r].data(), 50, DType::kF32, r == 1 ? n : 0);
    auto b = g[r].async_all_reduce(buf[r].data(), buf[r].data(), 50, DType::kF32, ReduceOp::kSum);
    std::string errors;
    for (auto* w : {&a, &b}) try {
        (*w)->wait();
      } catch (const Error& e) {
        errors += status_label(e.status()) + ": " + e.what() + "\n";
      }
    throw Error(Status::kInternal, errors);
  });
  for (int r = 0; r < n; ++r) {
    const std::string& m = out[r].message;
    if (r == 1)
      EXPECT_TRUE(contains(m, "INVALID_ARGUMENT: broadcast: root " + std::to_string(n))) << m;
    else
      EXPECT_TRUE(contains(m, "REMOTE: broadcast: rank " + std::to_string(r) + " stopped waiting because")) << m;
    EXPECT_TRUE(contains(m, "REMOTE: all_reduce")) << m;  // the group stays aborted until reset
  }
  g.group.reset();
  ASSERT_EQ(first_error(on_ranks(
                n,
                [&](int r) {
                  g[r].async_all_reduce(buf[r].data(), buf[r].data(), 50, DType::kF32, ReduceOp::kSum)->wait();
                })),
            "");
  EXPECT_EQ(buf[n - 1][0], float(n));
}

TEST(Comm, NamesAndSizes) {
  EXPECT_EQ(dtype_size(DType::kF32), 4u);
  EXPECT_EQ(dtype_size(DType::kF64), 8u);
  EXPECT_EQ(dtype_size(DType::kI32), 4u);
  EXPECT_EQ(dtype_size(DType::kI64), 8u);
  EXPECT_STREQ(dtype_name(DType::kI64), "i64");
  EXPECT_STREQ(reduce_op_name(ReduceOp::kMean), "mean");
  Group g(1);
  EXPECT_STREQ(g[0].backend(), "threads");
  EXPECT_EQ(g[0].size(), 1);
  EXPECT_EQ(g[0].rank(), 0);
}

TEST(Comm, BadArgumentsAreRefusedAndReleaseTheGroup) {
  Group g(1);
  float x = 1;
  try {
    g[0].reduce(&x, &x, 1, DType::kF32, ReduceOp::kSum, 3);
    ADD_FAILURE() << "root 3 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument);
  }
  EXPECT_TRUE(g.group.aborted());
  g.group.reset();
  float v[4] = {1, 2, 3, 4};
  try {
    g[0].all_reduce(v, v + 1, 2, DType::kF32, ReduceOp::kSum);
    ADD_FAILURE() << "a partial overlap accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument);
  }
  g.group.reset();
  try {
    g[0].all_reduce(nullptr, v, 2, static_cast<DType>(9), ReduceOp::kSum);
    ADD_FAILURE() << "dtype 9 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument);
  }
  g.group.reset();
  try {  // bf16 crosses processes only (MPI, NCCL): threads share memory
    g[0].all_reduce(v, v, 2, DType::kBF16, ReduceOp::kSum);
    ADD_FAILURE() << "bf16 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kNotSupported) << e.what();
  }
  g.group.reset();
  g[0].all_reduce(nullptr, nullptr, 0, DType::kF32, ReduceOp::kSum);  // count 0 needs no buffers
}

}  // namespace
}  // namespace dpar
