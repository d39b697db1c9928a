// The reducer: bucket assignment (DDP's rule), bucket launches in order while gradients arrive, gradients that
// never arrive counting as zero, staging for scattered buffers, and failures that reach every participant.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "comm/threads_comm.h"
#include "common/error.h"
#include "backend/cpu/cpu_backend.h"
#include "reducer/reducer.h"

using namespace dpar;

namespace {

std::vector<std::string> names(int n) {
  std::vector<std::string> out;
  for (int r = 0; r < n; ++r) out.push_back("participant " + std::to_string(r));
  return out;
}

// Runs body(rank) on n threads and waits for all.
template <class F>
void on_threads(int n, F body) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back([&, r] { body(r); });
  for (auto& t : threads) t.join();
}

// The value participant `rank` holds in element i of gradient g.
float grad_value(int rank, size_t g, size_t i) {
  return static_cast<float>((rank + 1) * 0.25 + static_cast<double>(g) * 0.5 + static_cast<double>(i % 7) * 0.125);
}

// The reducer's own tests reduce each bucket with one all-reduce straight on the communicator (the strategies over a
// replica set have tests of their own below).
class CommAllReduce final : public BucketStrategy {
 public:
  CommAllReduce(Communicator& comm, float scale) : comm_(comm), scale_(scale) {}
  const char* name() const override { return "test all-reduce"; }
  void reduce(const GradBucket& b) override { comm_.all_reduce_sum(b.data, b.count, b.contributes, scale_ * b.scale); }

 private:
  Communicator& comm_;
  float scale_;
};

std::unique_ptr<Reducer> make_reducer(Communicator& comm, std::vector<Reducer::Grad> grads, BucketOptions options,
                                      float scale, std::atomic<int>* launches = nullptr) {
  static const std::unique_ptr<Stream> host = cpu_backend().open_stream(Device{});
  return std::make_unique<Reducer>(
      std::move(grads), options, *host, std::make_unique<CommAllReduce>(comm, scale),
      [&comm, launches](std::function<void()> op) {
        if (launches) ++*launches;
        return comm.async_run("gradient bucket", std::move(op));
      });
}

}  // namespace

TEST(AssignBuckets, ReverseOrderSmallFirstBucketThenCap) {
  // Elements per gradient, in the model's order; 4-byte elements.
  const std::vector<size_t> counts = {1000, 10, 100, 5, 300, 20};
  BucketOptions o;
  o.first_bucket_bytes = 400;  // 100 elements
  o.bucket_cap_bytes = 1600;   // 400 elements
  const auto buckets = assign_buckets(counts, 4, o);
  // Walking back: 20, 300 (320 >= 100: close) | 5, 100, 10, 1000 (reaches 400 with 1000: close).
  const std::vector<std::vector<size_t>> expected = {{5, 4}, {3, 2, 1, 0}};
  EXPECT_EQ(buckets, expected);
}

TEST(AssignBuckets, EveryGradientOnceAndLargeOnesAlone) {
  std::mt19937 rng(3);
  std::vector<size_t> counts(57);
  for (auto& c : counts) c = 1 + rng() % 5000;
  BucketOptions o;
  o.first_bucket_bytes = 1 << 12;
  o.bucket_cap_bytes = 1 << 14;
  const auto buckets = assign_buckets(counts, 4, o);
  std::vector<size_t> seen;
  for (size_t b = 0; b < buckets.size(); ++b) {
    size_t bytes = 0;
    for (size_t k = 0; k < buckets[b].size(); ++k) {
      seen.push_back(buckets[b][k]);
      bytes += counts[buckets[b][k]] * 4;
      // Within a bucket, gradients run backwards, and a bucket closes as soon as it holds its limit.
      if (k > 0) EXPECT_EQ(buckets[b][k], buckets[b][k - 1] - 1);
      const size_t limit = b == 0 ? o.first_bucket_bytes : o.bucket_cap_bytes;
      if (k + 1 < buckets[b].size()) EXPECT_LT(bytes, limit);
    }
    if (b + 1 < buckets.size()) EXPECT_GE(bytes, b == 0 ? o.first_bucket_bytes : o.bucket_cap_bytes);
  }
  std::vector<size_t> all(counts.size());
  std::iota(all.rbegin(), all.rend(), size_t{0});
  EXPECT_EQ(seen, all);
  EXPECT_TRUE(assign_buckets({}, 4, o).empty());
  // A cap of SIZE_MAX gives one bucket.
  o.first_bucket_bytes = o.bucket_cap_bytes = SIZE_MAX;
  EXPECT_EQ(assign_buckets(counts, 4, o).size(), 1u);
}

// Gradients of several sizes, in separate vectors (staged) or one flat buffer (in place); each participant marks
// them in its own order; some participants leave some gradients out, one leaves all out. The result is the sum of
// what was produced (missing = 0), scaled, on every participant.
class ReducerSum : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(ReducerSum, SumsWhatWasProducedWhateverTheOrder) {
  const auto [n, flat] = GetParam();
  const std::vector<size_t> counts = {3, 1000, 17, 4096, 1, 250, 33};
  const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
  BucketOptions o;
  o.first_bucket_bytes = 64;
  o.bucket_cap_bytes = 4000;
  ThreadGroup group(names(n), std::chrono::seconds(20));
  const float scale = 0.5f;

  // Who produces what: participant r skips gradient (r + 1) % 7 when r is odd; the last participant (if more
  // than two) produces nothing at all.
  auto produces = [&](int r, size_t g) {
    if (n > 2 && r == n - 1) return false;
    return !(r % 2 == 1 && g == static_cast<size_t>(r + 1) % counts.size());
  };
  std::vector<std::vector<std::vector<float>>> results(static_cast<size_t>(n));
  for (int step = 0; step < 3; ++step) {
    on_threads(n, [&](int r) {
      auto comm = group.communicator(r);
      std::vector<std::vector<float>> separate(counts.size());
      std::vector<float> storage(total);
      std::vector<Reducer::Grad> grads;
      size_t at = 0;
      for (size_t g = 0; g < counts.size(); ++g) {
        separate[g].resize(counts[g]);
        float* p = flat ? storage.data() + at : separate[g].data();
        at += counts[g];
        grads.push_back({p, counts[g]});
      }
      auto reducer = make_reducer(*comm, grads, o, scale);
      // A bucket of one gradient is always in place; one of several is in place only in the flat layout.
      for (size_t b = 0; b < reducer->num_buckets(); ++b)
        EXPECT_EQ(reducer->in_place(b), flat || reducer->bucket(b).size() == 1) << "bucket " << b;
      reducer->prepare();
      // Backward order with a twist per participant: the order differs, the buckets' launch order cannot.
      std::vector<size_t> order(counts.size());
      std::iota(order.rbegin(), order.rend(), size_t{0});
      std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<unsigned>(r * 10 + step)));
      for (size_t g : order) {
        if (!produces(r, g)) {
          std::fill(grads[g].data, grads[g].data + grads[g].count, 1e30f);  // garbage: must be ignored
          continue;
        }
        for (size_t i = 0; i < counts[g]; ++i) grads[g].data[i] = grad_value(r, g, i);
        reducer->mark_ready(g);
      }
      reducer->finish();
      std::vector<std::vector<float>> got;
      for (auto& gr : grads) got.emplace_back(gr.data, gr.data + gr.count);
      results[static_cast<size_t>(r)] = std::move(got);
    });
    for (size_t g = 0; g < counts.size(); ++g)
      for (size_t i = 0; i < counts[g]; ++i) {
        float sum = 0;
        for (int r = 0; r < n; ++r)
          if (produces(r, g)) sum += grad_value(r, g, i);
        for (int r = 0; r < n; ++r)
          ASSERT_FLOAT_EQ(results[static_cast<size_t>(r)][g][i], sum * scale)
              << "participant " << r << " gradient " << g << " element " << i << " step " << step;
      }
  }
}

INSTANTIATE_TEST_SUITE_P(GroupsAndLayouts, ReducerSum,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4), ::testing::Bool()));

TEST(Reducer, LaunchesABucketBeforeBackwardEnds) {
  // The overlap itself, without timing: a bucket goes to the communication thread as soon as its gradients are
  // ready, before the later gradients are; the last bucket runs in finish().
  const int n = 2;
  ThreadGroup group(names(n), std::chrono::seconds(20));
  on_threads(n, [&](int r) {
    auto comm = group.communicator(r);
    std::vector<float> flat(4 * 256, 1.0f);
    std::vector<Reducer::Grad> grads;
    for (int g = 0; g < 4; ++g) grads.push_back({flat.data() + 256 * g, 256});
    BucketOptions o;
    o.first_bucket_bytes = o.bucket_cap_bytes = 1024;  // one gradient per bucket
    std::atomic<int> launches{0};
    auto reducer = make_reducer(*comm, grads, o, 1.0f, &launches);
    ASSERT_EQ(reducer->num_buckets(), 4u);
    reducer->prepare();
    reducer->mark_ready(2);  // out of order: bucket 0 holds gradient 3, which is not ready
    EXPECT_EQ(launches.load(), 0);
    reducer->mark_ready(3);  // buckets 0 (gradient 3) and 1 (gradient 2) go
    EXPECT_EQ(launches.load(), 2);
    reducer->mark_ready(1);
    EXPECT_EQ(launches.load(), 3);
    reducer->mark_ready(0);  // the last bucket waits for finish()
    EXPECT_EQ(launches.load(), 3);
    reducer->finish();
    for (float v : flat) ASSERT_EQ(v, 2.0f);
  });
}

TEST(Reducer, RefusesBadMarksWithoutLosingTheStep) {
  ThreadGroup group(names(1), std::chrono::seconds(20));
  auto comm = group.communicator(0);
  std::vector<float> a(10, 1.0f), b(10, 2.0f);
  auto reducer = make_reducer(*comm, {{a.data(), 10}, {b.data(), 10}}, BucketOptions{}, 1.0f);
  EXPECT_THROW(reducer->mark_ready(0), Error);  // outside a step
  reducer->prepare();
  reducer->mark_ready(1);
  try {
    reducer->mark_ready(1);
    FAIL() << "a second mark of one gradient was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidState);
    EXPECT_NE(std::string(e.what()).find("gradient 1 was marked ready twice"), std::string::npos) << e.what();
  }
  try {
    reducer->mark_ready(2);
    FAIL() << "an index out of range was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::kInvalidArgument);
  }
  reducer->mark_ready(0);
  reducer->finish();
  EXPECT_EQ(a, std::vector<float>(10, 1.0f));
  EXPECT_EQ(b, std::vector<float>(10, 2.0f));
}

TEST(Reducer, AParticipantThatFailsReleasesTheOthers) {
  // Participant 1 fails in the middle of its backward (after its first bucket went out): it aborts the group and
  // drains; the others' finish() throws REMOTE instead of waiting out the timeout.
  const int n = 3;
  ThreadGroup group(names(n), std::chrono::seconds(60));
  std::vector<Status> status(n, Status::kOk);
  const auto start = std::chrono::steady_clock::now();
  on_threads(n, [&](int r) {
    auto comm = group.communicator(r);
    std::vector<float> flat(3 * 64, 1.0f);
    std::vector<Reducer::Grad> grads;
    for (int g = 0; g < 3; ++g) grads.push_back({flat.data() + 64 * g, 64});
    BucketOptions o;
    o.first_bucket_bytes = o.bucket_cap_bytes = 256;
    auto reducer = make_reducer(*comm, grads, o, 1.0f);
    reducer->prepare();
    try {
      reducer->mark_ready(2);
      if (r == 1) {
        comm->abort("participant 1 failed in backward");
        reducer->drain();
        throw Error(Status::kInternal, "participant 1 failed in backward");
      }
      reducer->mark_ready(1);
      reducer->mark_ready(0);
      reducer->finish();
    } catch (const Error& e) {
      status[static_cast<size_t>(r)] = e.status();
    }
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  EXPECT_EQ(status[1], Status::kInternal);
  EXPECT_EQ(status[0], Status::kRemote);
  EXPECT_EQ(status[2], Status::kRemote);
}
