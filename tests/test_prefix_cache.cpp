// The prefix cache: a copied prefix (exact cache; tiered cache where it can stop there) attends
// as the same tokens appended alone, the cache finds the longest match and drops the least
// recently used, and through the scheduler a request that starts with a finished one's tokens
// computes only the rest and generates what it generates alone.
#include <gtest/gtest.h>

#include <atomic>
#include <random>

#include "engine/engine.h"
#include "engine/prefix_cache.h"
#include "kv/kv_spec.h"
#include "test_util.h"

namespace tiermoe {
namespace {

const KvGeometry kGeom{2, 2, 4, 8};  // layers, KV heads, query heads, Dh

std::vector<float> random_rows(int tokens, int heads, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n;
  std::vector<float> x(size_t(tokens) * heads * kGeom.head_dim);
  for (float& v : x) v = n(rng);
  return x;
}

// Appends rows [from, to) of k/v (per layer: the layer's seed; to <= kRows) to the cache.
constexpr int kRows = 128;
void append_rows(KvCache& c, int from, int to) {
  ASSERT_LE(to, kRows);
  const size_t row = size_t(kGeom.num_kv_heads) * kGeom.head_dim;
  for (int l = 0; l < kGeom.num_layers; ++l) {
    const auto k = random_rows(kRows, kGeom.num_kv_heads, 100 + l), v = random_rows(kRows, kGeom.num_kv_heads, 200 + l);
    c.append(l, k.data() + from * row, v.data() + from * row, to - from);
  }
}

std::vector<float> attend_last(const KvCache& c, int layer, int T) {
  const auto q = random_rows(T, kGeom.num_heads, 7);
  std::vector<float> out(q.size());
  c.attend(layer, q.data(), T, out.data());
  return out;
}

TEST(PrefixCache, CopiedPrefixAttendsAsItsTokensAppended) {
  for (KvDType dtype : {KvDType::F32, KvDType::BF16, KvDType::FP8}) {
    auto full = make_exact_kv_cache(kGeom, dtype);
    append_rows(*full, 0, 40);
    auto copy = full->copy_prefix(25);
    ASSERT_TRUE(copy);
    EXPECT_EQ(copy->length(), 25);
    EXPECT_EQ(full->length(), 40);  // the source is left as it was
    append_rows(*copy, 25, 31);
    auto fresh = make_exact_kv_cache(kGeom, dtype);
    append_rows(*fresh, 0, 25);
    append_rows(*fresh, 25, 31);
    EXPECT_EQ(copy->bytes(), fresh->bytes());
    for (int l = 0; l < kGeom.num_layers; ++l) EXPECT_EQ(attend_last(*copy, l, 6), attend_last(*fresh, l, 6));
  }
}

// A tiered cache (the default preset's codecs, pre-RoPE keys, refits that re-code) with small
// tiers: calibration at 32 tokens, a refit at 64, a window of 16. Positions' K, V and queries
// are functions of the position (a branch: another seed), so two caches fed the same positions
// fit the same codecs.
struct TieredRun {
  static constexpr int kN = 160;
  KvGeometry g{2, 2, 4, 64, 10000.f};
  KvSpec spec = [] {
    KvSpec s = kv_preset("default");
    s.calib_tokens = 32;
    s.refits = 1;
    s.refit_rows = 64;
    s.window = 16;
    s.middle = 48;
    return s;
  }();
  std::vector<float> k[2][2], v[2][2], q[2][2];  // [branch][layer]
  TieredRun() {
    for (int b = 0; b < 2; ++b)
      for (int l = 0; l < 2; ++l) {
        k[b][l] = rows(g.num_kv_heads, 10 * b + l + 1);
        v[b][l] = rows(g.num_kv_heads, 10 * b + l + 3);
        q[b][l] = rows(g.num_heads, 10 * b + l + 5);
      }
  }
  std::vector<float> rows(int heads, uint32_t seed) const {
    std::mt19937 rng(seed);
    std::normal_distribution<float> n;
    std::vector<float> x(size_t(kN) * heads * g.head_dim);
    for (float& e : x) e = n(rng);
    return x;
  }
  // Positions [from, to) of branch b in chunks of `chunk`, every layer appended and attended;
  // returns the attention outputs.
  std::vector<float> feed(KvCache& c, int b, int from, int to, int chunk) const {
    std::vector<float> outs;
    const size_t kr = size_t(g.num_kv_heads) * g.head_dim, qr = size_t(g.num_heads) * g.head_dim;
    for (int p = from; p < to; p += chunk) {
      const int T = std::min(chunk, to - p);
      for (int l = 0; l < g.num_layers; ++l) {
        c.append(l, k[b][l].data() + p * kr, v[b][l].data() + p * kr, T);
        std::vector<float> out(T * qr);
        c.attend(l, q[b][l].data() + p * qr, T, out.data());
        outs.insert(outs.end(), out.begin(), out.end());
      }
    }
    return outs;
  }
};

TEST(PrefixCache, TieredCacheCopiesWhatItsFirstTokensAloneWouldLeave) {
  const TieredRun r;
  // Before the last fit (64): the whole cache, or nothing (its statistics hold every query).
  auto a = make_kv_cache(r.g, r.spec);
  r.feed(*a, 0, 0, 40, 24);
  r.feed(*a, 0, 40, 50, 1);
  EXPECT_FALSE(a->copy_prefix(45));
  auto whole = a->copy_prefix(50);
  ASSERT_TRUE(whole);
  EXPECT_EQ(whole->length(), 50);
  auto fresh = make_kv_cache(r.g, r.spec);
  r.feed(*fresh, 0, 0, 40, 24);
  r.feed(*fresh, 0, 40, 50, 1);
  EXPECT_EQ(r.feed(*whole, 1, 50, 90, 1), r.feed(*fresh, 1, 50, 90, 1));  // through the refit at 64

  // After it: a prefix whose pages still hold their rows (the window), not one cut into codes.
  auto b = make_kv_cache(r.g, r.spec);
  r.feed(*b, 0, 0, 100, 30);
  r.feed(*b, 0, 100, 120, 1);
  // At 119 the window starts at 96; the rows before it are freed. A prefix of 111 tokens would
  // need the page 80-95 exact (its last query's window starts at 80).
  EXPECT_FALSE(b->copy_prefix(111));
  EXPECT_FALSE(b->copy_prefix(60));
  for (int n : {112, 117, 120}) {
    auto branch = b->copy_prefix(n);
    ASSERT_TRUE(branch) << n;
    auto alone = make_kv_cache(r.g, r.spec);
    r.feed(*alone, 0, 0, 100, 30);
    r.feed(*alone, 0, 100, n, 1);
    const KvCache::Stats sb = branch->stats(), sa = alone->stats();  // (bytes() counts capacity)
    EXPECT_EQ(sb.token_bytes, sa.token_bytes) << n;
    ASSERT_EQ(sb.tiers.size(), sa.tiers.size());
    for (size_t t = 0; t < sa.tiers.size(); ++t) EXPECT_EQ(sb.tiers[t].tokens, sa.tiers[t].tokens) << n << sa.tiers[t].tier;
    EXPECT_EQ(r.feed(*branch, 1, n, 150, 1), r.feed(*alone, 1, n, 150, 1)) << n;
  }
  EXPECT_EQ(b->length(), 120);  // the source is left as it was
}

std::unique_ptr<KvCache> cache_of(int tokens) {
  auto c = make_exact_kv_cache(kGeom, KvDType::F32);
  append_rows(*c, 0, tokens);
  return c;
}

std::vector<int32_t> iota(int n, int32_t from = 0) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) ids[size_t(i)] = from + i;
  return ids;
}

TEST(PrefixCache, LongestMatchLeastRecentlyUsedFirstOut) {
  const size_t per_token = cache_of(1)->bytes();
  PrefixCache pc(100 * per_token);
  pc.retain(iota(30), cache_of(30));  // tokens 0..29
  auto branch = iota(20);
  branch.push_back(500);
  pc.retain(branch, cache_of(21));  // tokens 0..19, 500
  EXPECT_EQ(pc.entries(), 2u);
  EXPECT_EQ(pc.bytes(), 51 * per_token);

  auto prompt = iota(25);
  PrefixCache::Match m = pc.lookup(prompt, 24, 16);
  EXPECT_EQ(m.tokens, 24);  // capped by max_tokens
  ASSERT_TRUE(m.cache);
  EXPECT_EQ(m.cache->length(), 24);
  prompt = iota(20);
  prompt.push_back(500);
  prompt.push_back(501);
  EXPECT_EQ(pc.lookup(prompt, 21, 16).tokens, 21);  // the branch
  EXPECT_EQ(pc.lookup(iota(10), 9, 16).tokens, 0);  // shorter than min_tokens
  EXPECT_FALSE(pc.lookup(iota(10, 1), 9, 1).cache);  // nothing in common

  // An entry whose tokens a newer one extends is dropped; one that holds the new tokens already
  // is kept (and the new cache not).
  pc.retain(iota(40), cache_of(40));
  EXPECT_EQ(pc.entries(), 2u);
  EXPECT_EQ(pc.bytes(), 61 * per_token);
  pc.retain(iota(35), cache_of(35));
  EXPECT_EQ(pc.entries(), 2u);
  // A cache holds fewer tokens than it is retained with: only those count.
  pc.retain(iota(90, 1000), cache_of(10));
  EXPECT_EQ(pc.entries(), 3u);
  EXPECT_EQ(pc.lookup(iota(90, 1000), 89, 1).tokens, 10);

  // Over the bound, the least recently used go: the branch (last matched before iota(40) came).
  pc.retain(iota(45, 2000), cache_of(45));
  EXPECT_EQ(pc.bytes(), 95 * per_token);
  EXPECT_EQ(pc.entries(), 3u);
  EXPECT_EQ(pc.lookup(branch, 21, 1).tokens, 20);  // now from iota(40)
  pc.shrink_to(50 * per_token);
  EXPECT_EQ(pc.entries(), 1u);  // iota(40) was just used: it stays
  EXPECT_EQ(pc.lookup(iota(40), 39, 1).tokens, 39);
  pc.retain(iota(64, 3000), cache_of(64));  // 104 tokens in all: iota(40), the older, goes
  EXPECT_EQ(pc.entries(), 1u);
  EXPECT_EQ(pc.bytes(), 64 * per_token);
  pc.retain(iota(101, 4000), cache_of(101));  // more than the bound alone: not kept
  EXPECT_EQ(pc.entries(), 1u);
  EXPECT_EQ(pc.lookup(iota(64, 3000), 63, 1).tokens, 63);
  pc.shrink_to(0);
  EXPECT_EQ(pc.entries(), 0u);
  EXPECT_EQ(pc.bytes(), 0u);
}

TEST(PrefixCache, KeepsAShorterEntryALongerOneCannotGiveBack) {
  // A tiered cache before its last fit copies only whole: a finished sequence whose tokens are a
  // prefix of its tokens is kept beside it, and found.
  const TieredRun r;
  auto longer = make_kv_cache(r.g, r.spec), shorter = make_kv_cache(r.g, r.spec);
  r.feed(*longer, 0, 0, 50, 25);
  r.feed(*shorter, 0, 0, 40, 20);
  ASSERT_FALSE(longer->can_copy_prefix(40));
  PrefixCache pc(size_t(1) << 30);
  pc.retain(iota(50), std::move(longer));
  pc.retain(iota(40), std::move(shorter));
  EXPECT_EQ(pc.entries(), 2u);
  const PrefixCache::Match m = pc.lookup(iota(45), 44, 1);
  EXPECT_EQ(m.tokens, 40);
  ASSERT_TRUE(m.cache);
  EXPECT_EQ(m.cache->length(), 40);
  // An exact cache gives any prefix back: its prefix is not kept again.
  pc.retain(iota(30, 100), cache_of(30));
  pc.retain(iota(20, 100), cache_of(20));
  EXPECT_EQ(pc.entries(), 3u);
}

// ---- through the scheduler (tinymix-code, the exact f32 cache) ----

struct PromptCounter : SchedulerObserver {
  std::atomic<int64_t> prefilled{0}, queried{0}, hits{0}, cache_bytes{0};
  std::atomic<bool> emptied{false};  // the cache held bytes, then none
  void on_step(int p, int) override { prefilled += p; }
  void on_prefix_lookup(int q, int h) override {
    queried += q;
    hits += h;
  }
  void on_prefix_cache_bytes(size_t b) override {
    if (b == 0 && cache_bytes.load() > 0) emptied = true;
    cache_bytes = int64_t(b);
  }
};

struct Output {
  std::vector<int32_t> ids;
  int cached = 0;
};

Output run(Scheduler& s, std::vector<int32_t> prompt, int max_tokens) {
  SeqRequest r;
  r.prompt = std::move(prompt);
  r.sampling.temperature = 0;
  r.max_tokens = max_tokens;
  auto out = s.submit(r);
  Output res;
  for (SeqStream::Chunk c; !c.finished;) {
    c = out->take(std::chrono::seconds(30));
    res.ids.insert(res.ids.end(), c.ids.begin(), c.ids.end());
    EXPECT_NE(c.finish_reason, "error") << c.error;
    res.cached = c.cached_tokens;
  }
  return res;
}

std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

TEST(PrefixCache, SchedulerReusesAFinishedRequestsTokensAndGeneratesTheSame) {
  EngineOptions eo;
  eo.model_dir = test::tinymix_dir();
  Engine engine(eo);
  const Tokenizer& tok = engine.tokenizer();
  const auto first = tok.encode("import numpy as np\n\n\ndef moving_average(values, window):\n    \"\"\"Mean of each window.\"\"\"\n");
  const auto turn = tok.encode("\n\ndef main():\n    data = [1, 2, 3, 4, 5]\n");
  const auto other = tok.encode("\n\nclass Queue:\n");

  // Alone, no prefix cache: what each prompt generates.
  SchedulerOptions off;
  Output a_alone, b_alone, c_alone;
  std::vector<int32_t> b_prompt, c_prompt;
  {
    Scheduler s(engine.backend(), engine.config(), nullptr, off);
    a_alone = run(s, first, 12);
    b_prompt = concat(concat(first, a_alone.ids), turn);  // the next turn: prompt, answer, more
    c_prompt = concat(std::vector<int32_t>(first.begin(), first.begin() + 20), other);  // shares 20 tokens
    b_alone = run(s, b_prompt, 24);
    c_alone = run(s, c_prompt, 16);
    EXPECT_EQ(b_alone.cached, 0);
  }

  SchedulerOptions on;
  on.prefix_cache_bytes = size_t(64) << 20;
  auto counter = std::make_shared<PromptCounter>();
  Scheduler s(engine.backend(), engine.config(), nullptr, on, counter);
  const Output a = run(s, first, 12);
  EXPECT_EQ(a.ids, a_alone.ids);
  EXPECT_EQ(a.cached, 0);
  EXPECT_GT(counter->cache_bytes.load(), 0);
  const int64_t prefilled_a = counter->prefilled.load();
  EXPECT_EQ(prefilled_a, int64_t(first.size()));

  // B starts with A's prompt and answer: A's cache holds the prompt and the first 11 answer
  // tokens (the 12th was never fed).
  const Output b = run(s, b_prompt, 24);
  const int expect_cached = int(first.size()) + 11;
  EXPECT_EQ(b.cached, expect_cached);
  EXPECT_EQ(b.ids, b_alone.ids);
  EXPECT_EQ(counter->prefilled.load() - prefilled_a, int64_t(b_prompt.size()) - expect_cached);

  const Output c = run(s, c_prompt, 16);  // a branch off the 20th token
  EXPECT_EQ(c.cached, 20);
  EXPECT_EQ(c.ids, c_alone.ids);
  EXPECT_EQ(counter->queried.load(), int64_t(first.size() + b_prompt.size() + c_prompt.size()));
  EXPECT_EQ(counter->hits.load(), int64_t(expect_cached + 20));

  // The same prompt again: all but its last token come from the cache.
  EXPECT_EQ(run(s, b_prompt, 24).cached, int(b_prompt.size()) - 1);
}

// Retained KV counts in the budget: admission takes it back when a reservation needs it.
TEST(PrefixCache, AdmissionEvictsWhatTheBudgetNeeds) {
  EngineOptions eo;
  eo.model_dir = test::tinymix_dir();
  Engine engine(eo);
  const auto prompt = engine.tokenizer().encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return ");
  const size_t per_token = 8 * 2 * 128 * 2 * 4;  // layers x KV heads x Dh x (K, V) x f32
  SchedulerOptions o;
  o.prefix_cache_bytes = size_t(64) << 20;
  {  // room for the next reservation and the kept tokens: reused
    Scheduler probe(engine.backend(), engine.config(), nullptr, SchedulerOptions{});
    o.kv_budget_bytes = probe.reservation_bytes(prompt.size(), 8) + (prompt.size() + 7) * per_token;
  }
  {
    Scheduler s(engine.backend(), engine.config(), nullptr, o);
    run(s, prompt, 8);
    EXPECT_EQ(run(s, prompt, 8).cached, int(prompt.size()) - 1);
  }
  o.kv_budget_bytes -= per_token;  // one token short: the entry goes
  auto counter = std::make_shared<PromptCounter>();
  {
    Scheduler s(engine.backend(), engine.config(), nullptr, o, counter);
    run(s, prompt, 8);
    EXPECT_EQ(run(s, prompt, 8).cached, 0);
    EXPECT_EQ(counter->hits.load(), 0);
  }
  // A running sequence that grows into the entry's memory takes it too (before any preemption).
  const auto other = engine.tokenizer().encode("class Matrix:\n    def __init__(self, rows, cols):\n");
  {
    Scheduler probe(engine.backend(), engine.config(), nullptr, SchedulerOptions{});
    o.kv_budget_bytes = probe.reservation_bytes(other.size(), 64);
  }
  auto gauge = std::make_shared<PromptCounter>();
  Scheduler s(engine.backend(), engine.config(), nullptr, o, gauge);
  run(s, prompt, 8);
  EXPECT_GT(gauge->cache_bytes.load(), 0);
  run(s, other, 64);
  EXPECT_TRUE(gauge->emptied.load());
}

// With the tiered `default` cache (tinymix's 768-token calibration not reached) a finished
// sequence is reused whole, not cut short: before its fits a prefix would bring statistics of
// the tokens after it.
TEST(PrefixCache, SchedulerReusesWholeTieredSequences) {
  EngineOptions eo;
  eo.model_dir = test::tinymix_dir();
  eo.kv = "default";
  Engine engine(eo);
  const Tokenizer& tok = engine.tokenizer();
  const auto first = tok.encode("import numpy as np\n\n\ndef moving_average(values, window):\n    \"\"\"Mean of each window.\"\"\"\n");
  const auto more = tok.encode("\n\ndef main():\n    data = [1, 2, 3, 4, 5]\n");
  Output b_alone;
  std::vector<int32_t> b_prompt, c_prompt;
  {
    Scheduler s(engine.backend(), engine.config(), nullptr, SchedulerOptions{});
    const Output a = run(s, first, 12);
    b_prompt = concat(concat(first, a.ids), more);
    c_prompt = concat(std::vector<int32_t>(first.begin(), first.begin() + 20), more);
    b_alone = run(s, b_prompt, 16);
  }
  SchedulerOptions on;
  on.prefix_cache_bytes = size_t(64) << 20;
  Scheduler s(engine.backend(), engine.config(), nullptr, on);
  run(s, first, 12);
  const Output b = run(s, b_prompt, 16);
  EXPECT_EQ(b.cached, int(first.size()) + 11);
  EXPECT_EQ(b.ids, b_alone.ids);
  EXPECT_EQ(run(s, c_prompt, 4).cached, 0);  // shares 20 tokens: not a whole sequence
}

}  // namespace
}  // namespace tiermoe
