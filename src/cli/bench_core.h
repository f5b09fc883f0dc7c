// The timing loop of `tiermoe bench`, shared with tests/cuda/bench_modes.cpp (which runs the same
// benchmark on machines that lack the tokenizer's libraries). Header-only on purpose.
#pragma once
#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "engine/sampler.h"

namespace tiermoe {

inline double bench_percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, size_t(p / 100.0 * double(v.size() - 1) + 0.5));
  return v[i];
}

// Bytes a KV cache of `t` holds per value (FP8 rows: a code, and an exponent per row of head_dim).
inline double kv_bytes_per_value(KvDType t, int head_dim) { return double(kv_row_bytes(t, head_dim)) / head_dim; }

// Bytes one decode step must read at a context of n_ctx tokens: the active weights (attention,
// router, the top-k experts, shared expert, dense MLPs, LM head, norms; one embedding row) in
// BF16, plus the KV cache at kv_value_bytes a value (2: BF16).
inline double decode_bytes(const ModelConfig& c, double n_ctx, double kv_value_bytes = 2.0) {
  const double D = c.hidden_size, H = c.num_heads, Hkv = c.num_kv_heads, Dh = c.head_dim;
  double w = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    w += (H * Dh * D * 2 + Hkv * Dh * D * 2) * 2.0 + 2 * D * 4;
    if (c.layer_is_moe[l]) {
      w += double(c.num_experts) * D * 2 + double(c.top_k) * 3 * c.expert_ffn * D * 2;
      if (c.shared_expert_ffn > 0) w += 3.0 * c.shared_expert_ffn * D * 2 + D * 2;
    } else {
      w += 3.0 * c.intermediate_size * D * 2;
    }
  }
  w += double(c.vocab_size) * D * 2 + D * 2 + D * 4;
  const double kv = double(c.num_layers) * n_ctx * Hkv * Dh * 2 * kv_value_bytes;
  return w + kv;
}

// Decoding goes through Backend::forward_sample, as the scheduler does: a step returns token ids
// (sampled on the device where the backend can), greedy unless `sampling` says otherwise.
inline nlohmann::json bench_sampling_json(const SamplingParams& p) {
  return {{"temperature", p.temperature}, {"top_k", p.top_k}, {"top_p", p.top_p}};
}

// Decode steps, timed: warmup + gen_tokens steps of `steps` (one token each), each step's token
// the last one's; ms[i] is the host-clock time from step warmup + i - 1's ids reaching the host
// (from the call, for the first step) to step warmup + i's. next: the first step's tokens in, the
// last step's out. Overlapped (as a server would run; only where Backend::overlaps_steps, else
// the queue would only move work between laps): step i + 1 is queued before step i's ids are
// taken, so the device never waits for the host (Backend::queue_sample); else one forward_sample
// per step.
inline std::vector<double> bench_decode(Backend& backend, std::span<const Backend::SeqStep> steps,
                                        const std::function<std::vector<Backend::SampleRow>()>& draw_rows,
                                        std::vector<int32_t>& next, int gen_tokens, bool overlap, int warmup = 0) {
  using clock = std::chrono::steady_clock;
  std::vector<double> ms;
  std::vector<int32_t> token = next;
  std::vector<Backend::SeqStep> fed(steps.begin(), steps.end());
  for (size_t b = 0; b < fed.size(); ++b) fed[b].tokens = std::span(&token[b], 1);
  std::vector<Backend::SeqStep> chained(steps.begin(), steps.end());
  for (auto& s : chained) s.tokens = {};
  auto t = clock::now();
  auto lap = [&] {
    const auto now = clock::now();
    ms.push_back(std::chrono::duration<double, std::milli>(now - t).count());
    t = now;
  };
  if (overlap) backend.queue_sample(fed, draw_rows());
  for (int i = 0; i < warmup + gen_tokens; ++i) {
    if (!overlap) {
      token = next;
      backend.forward_sample(fed, draw_rows(), next.data());
    } else {
      if (i + 1 < warmup + gen_tokens) backend.queue_sample(chained, draw_rows());
      backend.take_sample(next.data());
    }
    lap();
  }
  ms.erase(ms.begin(), ms.begin() + warmup);
  return ms;
}

// One stream: a random prompt of prompt_tokens, then gen_tokens decode steps (bench_decode),
// repeated (repeat 0 warms up) on one cache emptied each time.
inline nlohmann::json bench_stream(Backend& backend, const ModelConfig& cfg, int prompt_tokens, int gen_tokens,
                                   int repeats, const SamplingParams& sampling = {0.f, 0, 1.f, 0},
                                   bool overlap = true) {
  overlap = overlap && backend.overlaps_steps();
  std::mt19937 rng(1234);
  std::vector<int32_t> prompt(static_cast<size_t>(prompt_tokens));
  for (auto& id : prompt) id = int32_t(rng() % uint32_t(cfg.vocab_size));
  using clock = std::chrono::steady_clock;
  auto ms_since = [](clock::time_point t0) { return std::chrono::duration<double, std::milli>(clock::now() - t0).count(); };
  std::vector<double> prefill_ms, step_ms;
  Sampler sampler(sampling);
  auto cache = backend.new_cache();  // one cache, emptied per repeat (a captured CUDA graph stays valid)
  auto draw_rows = [&] { return std::vector<Backend::SampleRow>{{sampling, sampler.draw()}}; };
  for (int r = 0; r <= repeats; ++r) {
    cache->truncate(0);
    std::vector<int32_t> next(1);
    const Backend::SeqStep s{prompt, cache.get(), 1};
    const auto t0 = clock::now();
    backend.forward_sample(std::span(&s, 1), draw_rows(), next.data());
    const double pf = ms_since(t0);
    const std::vector<double> steps = bench_decode(backend, std::span(&s, 1), draw_rows, next, gen_tokens, overlap);
    if (r == 0) continue;
    prefill_ms.push_back(pf);
    step_ms.insert(step_ms.end(), steps.begin(), steps.end());
  }
  const double p50 = bench_percentile(step_ms, 50), p99 = bench_percentile(step_ms, 99),
               ttft = bench_percentile(prefill_ms, 50);
  return {{"backend", backend.name()}, {"batch", 1}, {"prompt_tokens", prompt_tokens}, {"gen_tokens", gen_tokens},
          {"repeats", repeats}, {"ttft_ms", ttft}, {"prefill_tokens_per_s", prompt_tokens / ttft * 1000.0},
          {"ms_per_token_p50", p50}, {"ms_per_token_p99", p99}, {"tokens_per_s", 1000.0 / p50},
          {"sampling", bench_sampling_json(sampling)}, {"overlapped_steps", overlap}};
}

// B streams decoding together (continuous batching at a steady batch): each gets its own random
// prompt of prompt_tokens (prefilled one at a time), then gen_tokens steps with one new token per
// stream (bench_decode, after warm-up steps). ms_per_token_* is the time of one step (every stream
// gets one token per step), tokens_per_s counts all B streams.
inline nlohmann::json bench_batch(Backend& backend, const ModelConfig& cfg, int batch, int prompt_tokens,
                                  int gen_tokens, const SamplingParams& sampling = {0.f, 0, 1.f, 0},
                                  bool overlap = true) {
  overlap = overlap && backend.overlaps_steps();
  std::mt19937 rng(1234);
  using clock = std::chrono::steady_clock;
  auto ms_since = [](clock::time_point t0) { return std::chrono::duration<double, std::milli>(clock::now() - t0).count(); };
  std::vector<std::unique_ptr<KvCache>> caches;
  std::vector<Sampler> samplers;
  std::vector<int32_t> next(static_cast<size_t>(batch));
  std::vector<double> prefill_ms;
  auto draw_rows = [&](size_t first, size_t n) {  // streams first, first + 1, ...
    std::vector<Backend::SampleRow> rows;
    for (size_t i = 0; i < n; ++i) rows.push_back({sampling, samplers[first + i].draw()});
    return rows;
  };
  for (int b = 0; b < batch; ++b) {
    std::vector<int32_t> prompt(static_cast<size_t>(prompt_tokens));
    for (auto& id : prompt) id = int32_t(rng() % uint32_t(cfg.vocab_size));
    caches.push_back(backend.new_cache());
    samplers.emplace_back(SamplingParams{sampling.temperature, sampling.top_k, sampling.top_p, uint64_t(b)});
    const Backend::SeqStep s{prompt, caches.back().get(), 1};
    const auto t0 = clock::now();
    backend.forward_sample(std::span(&s, 1), draw_rows(size_t(b), 1), next.data() + b);
    prefill_ms.push_back(ms_since(t0));
  }
  std::vector<Backend::SeqStep> steps;
  for (auto& c : caches) steps.push_back({{}, c.get(), 1});
  // Warm-up steps first: a batch step's graph is captured the second time its key comes, and
  // overlapped steps use three keys (the first step's inputs, then two alternating sets).
  auto all_rows = [&] { return draw_rows(0, size_t(batch)); };
  const std::vector<double> step_ms = bench_decode(backend, steps, all_rows, next, gen_tokens, overlap, overlap ? 6 : 2);
  const double p50 = bench_percentile(step_ms, 50), p99 = bench_percentile(step_ms, 99);
  return {{"backend", backend.name()}, {"batch", batch}, {"prompt_tokens", prompt_tokens}, {"gen_tokens", gen_tokens},
          {"repeats", 1}, {"ttft_ms", bench_percentile(prefill_ms, 50)}, {"ms_per_token_p50", p50},
          {"ms_per_token_p99", p99}, {"tokens_per_s", batch * 1000.0 / p50}, {"sampling", bench_sampling_json(sampling)},
          {"overlapped_steps", overlap}};
}

// Adds bytes_per_token, floor_ms and fraction_of_floor (floor / measured p50; 1 = at the floor).
inline void add_floor(nlohmann::json& out, const ModelConfig& cfg, double copy_bw_bytes_per_s,
                      double kv_value_bytes = 2.0) {
  const int prompt = out["prompt_tokens"].get<int>(), gen = out["gen_tokens"].get<int>();
  const double bytes = decode_bytes(cfg, prompt + 0.5 * gen, kv_value_bytes);
  const double floor_ms = bytes / copy_bw_bytes_per_s * 1e3;
  out["bytes_per_token"] = bytes;
  out["copy_bandwidth_GBps"] = copy_bw_bytes_per_s / 1e9;
  out["floor_ms"] = floor_ms;
  out["fraction_of_floor"] = floor_ms / out["ms_per_token_p50"].get<double>();
}

}  // namespace tiermoe
