#include "backend/backend.h"

#include <algorithm>

#include "core/check.h"

namespace tiermoe {

void Backend::check_sample_rows(std::span<const SeqStep> steps, std::span<const SampleRow> rows) {
  size_t n_rows = 0;
  for (const SeqStep& s : steps) n_rows += size_t(s.n_logits);
  CHECK_MSG(rows.size() == n_rows, "forward_sample: one SampleRow per logits row");
}

void Backend::forward_sample(std::span<const SeqStep> steps, std::span<const SampleRow> rows, int32_t* tokens) {
  check_sample_rows(steps, rows);
  const size_t V = size_t(vocab_size());
  std::vector<float> logits(rows.size() * V);  // [rows, V]
  forward_batch(steps, logits.data());
  for (size_t r = 0; r < rows.size(); ++r)
    tokens[r] = sample_token(std::span<const float>(logits.data() + r * V, V), rows[r].params, rows[r].u);
}

void Backend::check_queue(std::span<const SeqStep> steps, std::span<const SampleRow> rows) const {
  check_sample_rows(steps, rows);
  CHECK_MSG(int(queued_.size()) < kMaxQueued, "queue_sample: at most kMaxQueued steps queued; take_sample first");
  CHECK_MSG(!steps.empty(), "queue_sample: no steps");
  const bool chained = steps[0].tokens.empty();
  for (const SeqStep& s : steps) {
    CHECK_MSG(s.cache != nullptr && s.n_logits == 1 && s.tokens.size() == (chained ? 0u : 1u),
              "queue_sample: decode steps only (one token, or none when chained, and one logits row each)");
  }
  if (chained) {
    CHECK_MSG(last_queued_.caches.size() == steps.size(), "queue_sample: a chained step needs the last queued step's caches");
    for (size_t i = 0; i < steps.size(); ++i)
      CHECK_MSG(last_queued_.caches[i] == steps[i].cache, "queue_sample: a chained step needs the last queued step's caches, in order");
  }
}

std::vector<Backend::SeqStep> Backend::with_host_tokens(std::span<const SeqStep> steps) const {
  std::vector<SeqStep> out(steps.begin(), steps.end());
  if (!out.empty() && out[0].tokens.empty() && !last_queued_.ids.empty())
    for (size_t i = 0; i < out.size(); ++i) out[i].tokens = std::span(&last_queued_.ids[i], 1);
  return out;
}

void Backend::queue_sample(std::span<const SeqStep> steps, std::span<const SampleRow> rows) {
  check_queue(steps, rows);
  Queued q;
  for (const SeqStep& s : steps) q.caches.push_back(s.cache);
  run_queued(steps, rows, q);
  last_queued_ = q;
  queued_.push_back(std::move(q));
}

void Backend::run_queued(std::span<const SeqStep> steps, std::span<const SampleRow> rows, Queued& q) {
  q.ids.resize(steps.size());
  forward_sample(with_host_tokens(steps), rows, q.ids.data());
}

void Backend::take_sample(int32_t* tokens) {
  CHECK_MSG(!queued_.empty(), "take_sample: nothing queued");
  std::copy(queued_.front().ids.begin(), queued_.front().ids.end(), tokens);
  queued_.pop_front();
}

void split_into_passes(std::span<const Backend::SeqStep> steps, int max_tokens, int vocab, float* logits,
                       const std::function<void(const std::vector<Backend::SeqStep>&, float*)>& run_pass) {
  std::vector<Backend::SeqStep> pass;
  int pass_tokens = 0;
  size_t logit_rows = 0;
  auto flush = [&] {
    if (pass.empty()) return;
    run_pass(pass, logits ? logits + logit_rows * size_t(vocab) : nullptr);
    for (const Backend::SeqStep& p : pass) logit_rows += size_t(p.n_logits);
    pass.clear();
    pass_tokens = 0;
  };
  for (const Backend::SeqStep& s : steps) {
    const int n = int(s.tokens.size());
    CHECK(s.cache != nullptr && s.n_logits >= 0 && s.n_logits <= n);
    for (int start = 0; start < n;) {
      if (pass_tokens == max_tokens) flush();
      const int take = std::min(n - start, max_tokens - pass_tokens);
      const int first_logit = n - s.n_logits;  // index of this step's first token needing logits
      const int piece_logits = std::max(0, start + take - std::max(first_logit, start));
      pass.push_back({s.tokens.subspan(start, take), s.cache, piece_logits});
      pass_tokens += take;
      start += take;
      if (start < n) flush();  // the rest of this sequence must see this piece's KV
    }
  }
  flush();
}

}  // namespace tiermoe
