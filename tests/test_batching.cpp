// A batched step (several sequences, prompts and decodes mixed, split into passes) must give
// each sequence the logits it gets alone.
#include <gtest/gtest.h>

#include "backend/backend.h"
#include "queued_decode.h"
#include "test_util.h"

namespace tiermoe {
namespace {

std::vector<int32_t> some_ids(int n, int salt) {
  std::vector<int32_t> v(n);
  for (int i = 0; i < n; ++i) v[i] = (i * 131 + salt * 977 + 7) % 8000 + 1;
  return v;
}

TEST(Batching, MixedBatchEqualsSequencesAlone) {
  auto w = load_weights(test::tinymix_dir());
  const int V = w->cfg.vocab_size;
  for (int max_chunk : {512, 5}) {
    CpuBackendOptions opts;
    opts.max_chunk = max_chunk;
    auto backend = make_cpu_backend(*w, opts);
    // Three sequences: A has a 9-token history and decodes 1; B prefills 13 (all logits);
    // C prefills 4 (last logit).
    auto hist = some_ids(9, 1), a_next = some_ids(1, 2), b = some_ids(13, 3), c = some_ids(4, 4);
    auto a_cache = backend->new_cache(), b_cache = backend->new_cache(), c_cache = backend->new_cache();
    backend->forward(hist, *a_cache, 0, nullptr);
    const Backend::SeqStep steps[] = {{a_next, a_cache.get(), 1}, {b, b_cache.get(), 13}, {c, c_cache.get(), 1}};
    std::vector<float> batched(size_t(15) * V);
    backend->forward_batch(steps, batched.data());

    auto solo = make_cpu_backend(*w);
    std::vector<float> ref_a(V), ref_b(size_t(13) * V), ref_c(V);
    auto a2 = solo->new_cache(), b2 = solo->new_cache(), c2 = solo->new_cache();
    solo->forward(hist, *a2, 0, nullptr);
    solo->forward(a_next, *a2, 1, ref_a.data());
    solo->forward(b, *b2, 13, ref_b.data());
    solo->forward(c, *c2, 1, ref_c.data());
    EXPECT_LT(test::rel_l2(batched.data(), ref_a.data(), V), 1e-5) << "max_chunk " << max_chunk;
    for (int t = 0; t < 13; ++t)
      EXPECT_LT(test::rel_l2(&batched[size_t(1 + t) * V], &ref_b[size_t(t) * V], V), 1e-5) << "B row " << t;
    EXPECT_LT(test::rel_l2(&batched[size_t(14) * V], ref_c.data(), V), 1e-5);
    EXPECT_EQ(a_cache->length(), 10);
    EXPECT_EQ(b_cache->length(), 13);
    EXPECT_EQ(c_cache->length(), 4);
  }
}

// The default forward_sample: row r of the step's logits sampled with rows[r], over several passes.
TEST(Batching, ForwardSampleSamplesEachLogitsRowInOrder) {
  auto w = load_weights(test::tinymix_dir());
  const int V = w->cfg.vocab_size;
  CpuBackendOptions opts;
  opts.max_chunk = 5;
  auto sampling = make_cpu_backend(*w, opts), plain = make_cpu_backend(*w, opts);
  const auto a = some_ids(3, 5), b = some_ids(7, 6), c = some_ids(4, 7);
  auto as = sampling->new_cache(), bs = sampling->new_cache(), cs = sampling->new_cache();
  auto ap = plain->new_cache(), bp = plain->new_cache(), cp = plain->new_cache();
  const Backend::SeqStep s_steps[] = {{a, as.get(), 1}, {b, bs.get(), 7}, {c, cs.get(), 2}};
  const Backend::SeqStep p_steps[] = {{a, ap.get(), 1}, {b, bp.get(), 7}, {c, cp.get(), 2}};
  std::vector<Backend::SampleRow> rows;
  for (int r = 0; r < 10; ++r) rows.push_back({{r % 3 == 0 ? 0.f : 1.5f, 0, r % 2 ? 0.9f : 1.f, 0}, 0.1 * r + 0.05});
  std::vector<int32_t> tokens(10, -1);
  sampling->forward_sample(s_steps, rows, tokens.data());
  std::vector<float> logits(size_t(10) * V);
  plain->forward_batch(p_steps, logits.data());
  for (int r = 0; r < 10; ++r)
    EXPECT_EQ(tokens[r], sample_token(std::span<const float>(&logits[size_t(r) * V], V), rows[r].params, rows[r].u))
        << "row " << r;
}

// Overlapped decode through the default queue (forward_sample at queue time): chained steps take
// the last step's ids, and the step queued past a stop is truncated away.
TEST(Batching, QueuedDecodeEqualsForwardSample) {
  auto w = load_weights(test::tinymix_dir());
  auto backend = make_cpu_backend(*w);
  const std::vector<std::vector<int32_t>> prompts{some_ids(5, 8), some_ids(3, 9)};
  EXPECT_EQ(test::queued_decode_mismatches(*backend, prompts, 5, 2, {0.f, 0, 1.f, 0}), 0);
  EXPECT_EQ(test::queued_decode_mismatches(*backend, prompts, 5, 2, {0.9f, 0, 0.95f, 3}), 0);
}

}  // namespace
}  // namespace tiermoe
