// The engine's continuous-batching scheduler (shared by Engine::generate and tiermoe serve):
// generate calls from several threads are batched and still equal to the same calls alone,
// the observer sees what the loop does, bad requests are InputErrors, and KV bytes by tier.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <thread>

#include "core/check.h"
#include "engine/engine.h"
#include "test_util.h"

namespace tiermoe {
namespace {

EngineOptions tinymix() {
  EngineOptions o;
  o.model_dir = test::tinymix_dir();  // the library's default KV cache: exact f32
  return o;
}

struct CountingObserver : SchedulerObserver {
  std::atomic<int64_t> max_running{0}, steps{0}, generated{0}, finished{0};
  void on_gauges(int64_t running, const KvTierBytes&, size_t) override {
    int64_t m = max_running.load();
    while (running > m && !max_running.compare_exchange_weak(m, running)) {}
  }
  void on_step(int, int g) override {
    ++steps;
    generated += g;
  }
  void on_finished(double) override { ++finished; }
};

TEST(Scheduler, GenerateFromSeveralThreadsIsBatchedAndEqualsAlone) {
  EngineOptions opts = tinymix();
  auto obs = std::make_shared<CountingObserver>();
  opts.observer = obs;
  Engine engine(opts);
  const std::vector<std::string> prompts = {"def add(a, b):\n", "import os\n\n", "class Stack:\n    def ", "for i in range("};
  constexpr int kTokens = 48;
  auto request = [&](const std::string& p) {
    GenerateRequest r;
    r.prompt = engine.tokenizer().encode(p);
    r.sampling.temperature = 0;
    r.max_tokens = kTokens;
    r.stop_at_eos = false;
    return r;
  };
  std::vector<GenerateResult> alone;
  for (const auto& p : prompts) alone.push_back(engine.generate(request(p)));
  const int64_t steps_alone = obs->steps.load();
  EXPECT_EQ(obs->max_running.load(), 1);
  EXPECT_EQ(obs->generated.load(), int64_t(prompts.size()) * kTokens);

  std::vector<GenerateResult> together(prompts.size());
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (size_t i = 0; i < prompts.size(); ++i)
    threads.emplace_back([&, i] {
      ++ready;
      while (ready.load() < int(prompts.size())) std::this_thread::yield();
      together[i] = engine.generate(request(prompts[i]));
    });
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(together[i].ids, alone[i].ids) << prompts[i];
    EXPECT_EQ(together[i].text, alone[i].text) << prompts[i];
    EXPECT_EQ(together[i].finish_reason, "length");
  }
  EXPECT_GE(obs->max_running.load(), 2);  // the threads' requests shared steps
  EXPECT_LT(obs->steps.load() - steps_alone, steps_alone);
  EXPECT_EQ(obs->finished.load(), 2 * int64_t(prompts.size()));
}

TEST(Scheduler, BadRequestsAreInputErrors) {
  Engine engine(tinymix());
  Scheduler& s = engine.scheduler();
  SeqRequest r;
  EXPECT_THROW(s.submit(r), InputError);  // empty prompt
  r.prompt = {1, 2, 8192};
  EXPECT_THROW(s.submit(r), InputError);  // outside the vocabulary
  r.prompt = {1, 2};
  r.max_tokens = 0;
  EXPECT_THROW(s.submit(r), InputError);
  r.max_tokens = 4;
  r.sampling.temperature = -1;
  EXPECT_THROW(s.submit(r), InputError);
  r.sampling.temperature = 0;
  r.prompt.assign(size_t(engine.config().max_position_embeddings), 5);
  EXPECT_THROW(s.submit(r), InputError);  // no room left to generate
  r.prompt = {1, 2};
  auto out = s.submit(r);
  SeqStream::Chunk c;
  std::vector<int32_t> ids;
  while (!c.finished) {
    c = out->take(std::chrono::seconds(10));
    ids.insert(ids.end(), c.ids.begin(), c.ids.end());
  }
  EXPECT_LE(ids.size(), 4u);
  EXPECT_EQ(int(ids.size()), c.completion_tokens);
}

TEST(Scheduler, KvBytesByTierOfAnExactCache) {
  Engine engine(tinymix());
  auto cache = engine.backend().new_cache();
  const std::vector<int32_t> ids(40, 7);
  engine.backend().forward(ids, *cache, 0, nullptr);
  const KvTierBytes b = kv_bytes_by_tier(*cache, engine.kv_geometry());
  // 40 tokens x 8 layers x 2 KV heads x 128 x (K and V) x 4 bytes.
  EXPECT_EQ(b.at("all"), 40 * 8 * 2 * 128 * 2 * 4);
  EXPECT_EQ(b.at("exact"), b.at("all"));
  EXPECT_EQ(b.size(), 2u);
}

// A backend whose caches share KV memory of their own (as the CUDA backend's page pool): the
// CPU backend with a capacity of 2 pages of 64 tokens. The scheduler's budget must shrink to it,
// reservations round up to its pages, a request needing more is an InputError naming the budget,
// and one that fits runs.
struct BoundedBackend final : Backend {
  Backend& inner;
  size_t capacity;
  BoundedBackend(Backend& b, size_t cap) : inner(b), capacity(cap) {}
  std::string name() const override { return inner.name(); }
  int vocab_size() const override { return inner.vocab_size(); }
  int pass_tokens() const override { return inner.pass_tokens(); }
  std::unique_ptr<KvCache> new_cache() const override { return inner.new_cache(); }
  void forward_batch(std::span<const SeqStep> steps, float* logits) override { inner.forward_batch(steps, logits); }
  size_t kv_capacity_bytes() const override { return capacity; }
  int kv_page_tokens() const override { return 64; }
};

TEST(Scheduler, BudgetIsBoundedByTheBackendsKvMemory) {
  Engine engine(tinymix());
  const size_t per_token = 8 * 2 * 128 * 2 * 4;  // exact f32 cache: layers x KV heads x Dh x (K, V) x 4 bytes
  BoundedBackend bounded(engine.backend(), 2 * 64 * per_token);
  SchedulerOptions o;
  o.kv_budget_bytes = size_t(1) << 40;
  Scheduler sched(bounded, engine.config(), nullptr, o);
  EXPECT_EQ(sched.options().kv_budget_bytes, 2 * 64 * per_token);
  EXPECT_EQ(sched.options().step_tokens, engine.backend().pass_tokens());  // the default: the backend's passes
  EXPECT_EQ(sched.reservation_bytes(65, 0), 2 * 64 * per_token);  // two whole pages
  SeqRequest r;
  r.prompt = {1, 2, 3};
  r.max_tokens = 126;  // 129 tokens: three pages
  try {
    sched.submit(r);
    ADD_FAILURE() << "a request needing 3 pages of a 2-page backend was admitted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("budget"), std::string::npos) << e.what();
  }
  r.max_tokens = 4;
  auto out = sched.submit(r);
  SeqStream::Chunk c;
  while (!c.finished) c = out->take(std::chrono::seconds(10));
  EXPECT_NE(c.finish_reason, "error") << c.error;
}

// Admission reserves at least what a sequence holds, metadata included: the tiered `default`
// cache keeps its refit sample (BF16 rows and query statistics) until 3072 tokens, so short
// sequences cost more per token than the codes say.
TEST(Scheduler, ReservationCoversWhatTheDefaultCacheHolds) {
  EngineOptions o = tinymix();
  o.kv = "default";
  Engine engine(o);
  Scheduler sched(engine.backend(), engine.config(), nullptr, SchedulerOptions{});
  for (int n : {64, 512, 1536}) {
    auto cache = engine.backend().new_cache();
    std::vector<int32_t> ids(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) ids[size_t(i)] = int32_t((i * 7919) % engine.config().vocab_size);
    engine.backend().forward(ids, *cache, 0, nullptr);
    const KvCache::Stats st = cache->stats();
    EXPECT_GE(double(sched.reservation_bytes(size_t(n), 0)), st.held_bytes + st.meta_bytes) << n << " tokens";
  }
}

// A backend that says its queued steps run ahead of the host (the default queue, which runs them
// at once, underneath), so that the scheduler takes its overlapped path on the CPU; it counts
// the chained steps it is given.
struct OverlappingBackend final : Backend {
  Backend& inner;
  int chained = 0, queued_at_once = 0;
  bool in_queue = false;
  explicit OverlappingBackend(Backend& b) : inner(b) {}
  std::string name() const override { return inner.name(); }
  int vocab_size() const override { return inner.vocab_size(); }
  int pass_tokens() const override { return inner.pass_tokens(); }
  std::unique_ptr<KvCache> new_cache() const override { return inner.new_cache(); }
  void forward_batch(std::span<const SeqStep> steps, float* logits) override {
    if (!in_queue) {
      EXPECT_EQ(queued_steps(), 0) << "a step ran with steps queued";
    }
    inner.forward_batch(steps, logits);
  }
  bool overlaps_steps() const override { return true; }
  void queue_sample(std::span<const SeqStep> steps, std::span<const SampleRow> rows) override {
    chained += steps[0].tokens.empty();
    in_queue = true;
    Backend::queue_sample(steps, rows);
    in_queue = false;
    queued_at_once = std::max(queued_at_once, queued_steps());
  }
};

// Overlapped decode steps (the next one queued before this one's tokens are handed out) give
// every request the tokens of one step at a time, with requests finishing at different steps
// (each finish ends a chain whose next step is already queued), a stop id and stop strings.
TEST(Scheduler, OverlappedStepsEqualOneStepAtATime) {
  Engine engine(tinymix());
  const std::vector<std::string> prompts = {"def add(a, b):\n", "import os\n\n", "class Stack:\n    def ", "for i in range("};
  const int max_tokens[] = {3, 11, 24, 40};
  std::string stop_string;  // a piece of request 2's text, and request 3's eighth token: set below
  int32_t stop_id = -1;
  auto run = [&](bool overlap, OverlappingBackend& backend) {
    SchedulerOptions o;
    o.overlap = overlap;
    Scheduler sched(backend, engine.config(), &engine.tokenizer(), o);
    std::vector<std::shared_ptr<SeqStream>> outs;
    for (size_t i = 0; i < prompts.size(); ++i) {
      SeqRequest r;
      r.prompt = engine.tokenizer().encode(prompts[i]);
      r.sampling.temperature = 0;
      r.max_tokens = max_tokens[i];
      if (i == 2 && !stop_string.empty()) r.stop = {stop_string};
      if (i == 3 && stop_id >= 0) r.stop_ids = {stop_id};
      outs.push_back(sched.submit(r));
    }
    std::vector<std::pair<std::vector<int32_t>, std::string>> got;
    for (auto& out : outs) {
      std::vector<int32_t> ids;
      std::string text, reason;
      for (bool done = false; !done;) {
        const SeqStream::Chunk c = out->take(std::chrono::seconds(30));
        ids.insert(ids.end(), c.ids.begin(), c.ids.end());
        text += c.text;
        done = c.finished;
        reason = c.finish_reason;
      }
      got.push_back({ids, text + "|" + reason});
    }
    return got;
  };
  OverlappingBackend plain(engine.backend()), one_at_a_time(engine.backend()), overlapped(engine.backend());
  const auto no_stops = run(false, plain);
  stop_string = no_stops[2].second.substr(12, 4);
  stop_id = no_stops[3].first[7];
  const auto want = run(false, one_at_a_time), got = run(true, overlapped);
  EXPECT_EQ(one_at_a_time.chained, 0);
  EXPECT_GE(overlapped.chained, 5);
  EXPECT_EQ(overlapped.queued_at_once, 2);
  EXPECT_TRUE(want[2].second.ends_with("|stop") && want[3].second.ends_with("|stop")) << want[2].second << want[3].second;
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(got[i].first, want[i].first) << prompts[i];
    EXPECT_EQ(got[i].second, want[i].second) << prompts[i];
  }
  EXPECT_EQ(overlapped.queued_steps(), 0);
}

// KV memory is counted as sequences grow, not reserved for max_tokens up front: three requests
// that each fit the budget alone but not together all start; when they outgrow it the newest are
// preempted (caches freed, back to the queue's head) and later prefilled again with what they
// had generated. Every request ends with the tokens and text it gets alone, one step at a time
// and with overlapped steps (which must not queue a step past the budget).
TEST(Scheduler, PreemptedSequencesResumeWithTheTokensTheyGetAlone) {
  Engine engine(tinymix());
  const std::vector<std::string> prompts = {"def add(a, b):\n", "import os\n\n", "class Stack:\n    def "};
  constexpr int kTokens = 120;
  struct Counter : CountingObserver {
    std::atomic<int64_t> preempted{0};
    void on_preempted() override { ++preempted; }
  };
  auto run = [&](Backend& backend, const SchedulerOptions& o, const std::shared_ptr<Counter>& obs) {
    Scheduler sched(backend, engine.config(), &engine.tokenizer(), o, obs);
    std::vector<std::shared_ptr<SeqStream>> outs;
    for (const auto& p : prompts) {
      SeqRequest r;
      r.prompt = engine.tokenizer().encode(p);
      r.sampling.temperature = 0;
      r.max_tokens = kTokens;
      outs.push_back(sched.submit(r));
    }
    std::vector<std::string> got;
    for (auto& out : outs) {
      std::string ids, text, reason;
      for (bool done = false; !done;) {
        const SeqStream::Chunk c = out->take(std::chrono::seconds(60));
        for (int32_t id : c.ids) ids += std::to_string(id) + " ";
        text += c.text;
        done = c.finished;
        reason = c.finish_reason + " " + std::to_string(c.completion_tokens);
      }
      got.push_back(ids + "|" + text + "|" + reason);
    }
    return got;
  };
  std::vector<std::string> alone;
  {
    SchedulerOptions o;
    o.max_batch = 1;
    alone = run(engine.backend(), o, std::make_shared<Counter>());
  }
  const size_t per_token = 8 * 2 * 128 * 2 * 4;  // exact f32 cache: layers x KV heads x Dh x (K, V) x 4 bytes
  for (bool overlap : {false, true}) {
    OverlappingBackend backend(engine.backend());
    SchedulerOptions o;
    o.kv_budget_bytes = 160 * per_token;  // 10 pages: one request's 125 tokens, not three
    o.overlap = overlap;
    auto obs = std::make_shared<Counter>();
    const auto got = run(backend, o, obs);
    for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(got[i], alone[i]) << prompts[i] << " overlap " << overlap;
    EXPECT_GE(obs->preempted.load(), 1) << overlap;
    EXPECT_GE(obs->max_running.load(), 2) << overlap;
    if (overlap) {
      EXPECT_GE(backend.chained, 5);
    }
  }
}

}  // namespace
}  // namespace tiermoe
