// Overlapped decode (Backend::queue_sample / take_sample) against step-by-step forward_sample, on
// one backend: shared by the CPU tests (the default queue) and tiermoe_cuda_check (the CUDA
// backend's, which runs the queued steps on the device ahead of the host).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "engine/sampler.h"

namespace tiermoe::test {

// B sequences (one per prompt) decode `steps` tokens twice from the same prompts and the same
// uniforms: one forward_sample per step, and overlapped (each step queued, chained, before the
// last one's ids are taken). The overlapped run then does what a server does at a stop: it has
// one step queued past the end, takes it, truncates that row and decodes `after` more steps with
// forward_sample. Returns how many of the B * (steps + after) tokens differ between the runs (-1
// if a cache's length is wrong at the end).
inline int queued_decode_mismatches(Backend& be, const std::vector<std::vector<int32_t>>& prompts, int steps,
                                    int after, const SamplingParams& p) {
  const size_t B = prompts.size();
  const int total = steps + after;
  std::vector<std::vector<double>> u(B);  // u[b][s]: step s's uniform (s = 0: the prompt's)
  for (size_t b = 0; b < B; ++b) {
    Sampler s(SamplingParams{p.temperature, p.top_k, p.top_p, p.seed + b});
    for (int i = 0; i <= total + 1; ++i) u[b].push_back(s.draw());
  }
  auto rows_at = [&](int s) {
    std::vector<Backend::SampleRow> rows;
    for (size_t b = 0; b < B; ++b) rows.push_back({p, u[b][size_t(s)]});
    return rows;
  };
  // Prefill of every sequence; returns the first tokens.
  auto prefill = [&](std::vector<std::unique_ptr<KvCache>>& caches) {
    std::vector<int32_t> first(B);
    for (size_t b = 0; b < B; ++b) {
      caches.push_back(be.new_cache());
      const Backend::SeqStep s{prompts[b], caches[b].get(), 1};
      const Backend::SampleRow r{p, u[b][0]};
      be.forward_sample(std::span(&s, 1), std::span(&r, 1), &first[b]);
    }
    return first;
  };
  auto steps_of = [&](std::vector<std::unique_ptr<KvCache>>& caches, std::vector<int32_t>& in) {
    std::vector<Backend::SeqStep> v;
    for (size_t b = 0; b < B; ++b) v.push_back({in.empty() ? std::span<const int32_t>() : std::span(&in[b], 1), caches[b].get(), 1});
    return v;
  };

  std::vector<std::unique_ptr<KvCache>> ref_caches, q_caches;
  std::vector<int32_t> next = prefill(ref_caches);
  std::vector<std::vector<int32_t>> want;  // [step][b]
  for (int s = 1; s <= total; ++s) {
    std::vector<int32_t> in = next;
    be.forward_sample(steps_of(ref_caches, in), rows_at(s), next.data());
    want.push_back(next);
  }

  std::vector<int32_t> first = prefill(q_caches), none;
  std::vector<std::vector<int32_t>> got;
  be.queue_sample(steps_of(q_caches, first), rows_at(1));
  for (int s = 1; s <= steps; ++s) {
    be.queue_sample(steps_of(q_caches, none), rows_at(s + 1));  // the last one: past the end
    got.emplace_back(B);
    be.take_sample(got.back().data());
  }
  std::vector<int32_t> past(B);
  be.take_sample(past.data());
  for (auto& c : q_caches) c->truncate(c->length() - 1);
  next = got.back();
  for (int s = steps + 1; s <= total; ++s) {
    std::vector<int32_t> in = next;
    be.forward_sample(steps_of(q_caches, in), rows_at(s), next.data());
    got.push_back(next);
  }

  int differ = 0;
  for (size_t s = 0; s < want.size(); ++s)
    for (size_t b = 0; b < B; ++b) differ += want[s][b] != got[s][b];
  for (size_t b = 0; b < B; ++b)
    if (q_caches[b]->length() != ref_caches[b]->length() || be.queued_steps() != 0) return -1;
  return differ;
}

}  // namespace tiermoe::test
