// The timing loop of `tiermoe bench`, shared with tests/cuda/cuda_check.cpp (which runs the same
// benchmark on machines that lack the tokenizer's libraries). Header-only on purpose.
#pragma once
#include <algorithm>
#include <chrono>
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

// Bytes one decode step must read at a context of n_ctx tokens: the active weights (attention,
// router, the top-k experts, shared expert, dense MLPs, LM head, norms; one embedding row) in
// BF16, plus the BF16 KV cache.
inline double decode_bytes(const ModelConfig& c, double n_ctx) {
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
  const double kv = double(c.num_layers) * n_ctx * Hkv * Dh * 2 * 2;
  return w + kv;
}

// Decoding goes through Backend::forward_sample, as the scheduler does: a step returns token ids
// (sampled on the device where the backend can), greedy unless `sampling` says otherwise.
inline nlohmann::json bench_sampling_json(const SamplingParams& p) {
  return {{"temperature", p.temperature}, {"top_k", p.top_k}, {"top_p", p.top_p}};
}

// One stream: a random prompt of prompt_tokens, then gen_tokens decode steps, repeated (repeat 0
// warms up) on one cache emptied each time. Times on the host clock around each forward_sample
// call (which returns after the token id is on the host).
inline nlohmann::json bench_stream(Backend& backend, const ModelConfig& cfg, int prompt_tokens, int gen_tokens,
                                   int repeats, const SamplingParams& sampling = {0.f, 0, 1.f, 0}) {
  std::mt19937 rng(1234);
  std::vector<int32_t> prompt(static_cast<size_t>(prompt_tokens));
  for (auto& id : prompt) id = int32_t(rng() % uint32_t(cfg.vocab_size));
  using clock = std::chrono::steady_clock;
  auto ms_since = [](clock::time_point t0) { return std::chrono::duration<double, std::milli>(clock::now() - t0).count(); };
  std::vector<double> prefill_ms, step_ms;
  Sampler sampler(sampling);
  auto cache = backend.new_cache();  // one cache, emptied per repeat (a captured CUDA graph stays valid)
  for (int r = 0; r <= repeats; ++r) {
    cache->truncate(0);
    int32_t next = 0;
    auto step = [&](std::span<const int32_t> tokens) {
      const Backend::SeqStep s{tokens, cache.get(), 1};
      const Backend::SampleRow row{sampling, sampler.draw()};
      backend.forward_sample(std::span(&s, 1), std::span(&row, 1), &next);
    };
    auto t0 = clock::now();
    step(prompt);
    const double pf = ms_since(t0);
    std::vector<double> steps;
    for (int i = 0; i < gen_tokens; ++i) {
      const int32_t token = next;
      t0 = clock::now();
      step(std::span(&token, 1));
      steps.push_back(ms_since(t0));
    }
    if (r == 0) continue;
    prefill_ms.push_back(pf);
    step_ms.insert(step_ms.end(), steps.begin(), steps.end());
  }
  const double p50 = bench_percentile(step_ms, 50), p99 = bench_percentile(step_ms, 99),
               ttft = bench_percentile(prefill_ms, 50);
  return {{"backend", backend.name()}, {"batch", 1}, {"prompt_tokens", prompt_tokens}, {"gen_tokens", gen_tokens},
          {"repeats", repeats}, {"ttft_ms", ttft}, {"prefill_tokens_per_s", prompt_tokens / ttft * 1000.0},
          {"ms_per_token_p50", p50}, {"ms_per_token_p99", p99}, {"tokens_per_s", 1000.0 / p50},
          {"sampling", bench_sampling_json(sampling)}};
}

// B streams decoding together (continuous batching at a steady batch): each gets its own random
// prompt of prompt_tokens (prefilled one at a time), then gen_tokens steps of forward_sample with
// one new token per stream. Times each step on the host clock; ms_per_token_* is the time of one
// step (every stream gets one token per step), tokens_per_s counts all B streams.
inline nlohmann::json bench_batch(Backend& backend, const ModelConfig& cfg, int batch, int prompt_tokens,
                                  int gen_tokens, const SamplingParams& sampling = {0.f, 0, 1.f, 0}) {
  std::mt19937 rng(1234);
  using clock = std::chrono::steady_clock;
  auto ms_since = [](clock::time_point t0) { return std::chrono::duration<double, std::milli>(clock::now() - t0).count(); };
  std::vector<std::unique_ptr<KvCache>> caches;
  std::vector<Sampler> samplers;
  std::vector<int32_t> next(static_cast<size_t>(batch)), token(static_cast<size_t>(batch));
  std::vector<double> prefill_ms, step_ms;
  auto run = [&](std::span<const Backend::SeqStep> steps, int first) {  // streams first, first + 1, ...
    std::vector<Backend::SampleRow> rows;
    for (size_t i = 0; i < steps.size(); ++i) rows.push_back({sampling, samplers[size_t(first) + i].draw()});
    backend.forward_sample(steps, rows, next.data() + first);
  };
  for (int b = 0; b < batch; ++b) {
    std::vector<int32_t> prompt(static_cast<size_t>(prompt_tokens));
    for (auto& id : prompt) id = int32_t(rng() % uint32_t(cfg.vocab_size));
    caches.push_back(backend.new_cache());
    samplers.emplace_back(SamplingParams{sampling.temperature, sampling.top_k, sampling.top_p, uint64_t(b)});
    const Backend::SeqStep s{prompt, caches.back().get(), 1};
    const auto t0 = clock::now();
    run(std::span(&s, 1), b);
    prefill_ms.push_back(ms_since(t0));
  }
  std::vector<Backend::SeqStep> steps(static_cast<size_t>(batch));
  for (int i = 0; i < gen_tokens + 2; ++i) {  // two warm-up steps (graphs, first-use costs)
    token = next;
    for (int b = 0; b < batch; ++b) steps[b] = {std::span(&token[b], 1), caches[b].get(), 1};
    const auto t0 = clock::now();
    run(steps, 0);
    if (i >= 2) step_ms.push_back(ms_since(t0));
  }
  const double p50 = bench_percentile(step_ms, 50), p99 = bench_percentile(step_ms, 99);
  return {{"backend", backend.name()}, {"batch", batch}, {"prompt_tokens", prompt_tokens}, {"gen_tokens", gen_tokens},
          {"repeats", 1}, {"ttft_ms", bench_percentile(prefill_ms, 50)}, {"ms_per_token_p50", p50},
          {"ms_per_token_p99", p99}, {"tokens_per_s", batch * 1000.0 / p50}, {"sampling", bench_sampling_json(sampling)}};
}

// Adds bytes_per_token, floor_ms and fraction_of_floor (floor / measured p50; 1 = at the floor).
inline void add_floor(nlohmann::json& out, const ModelConfig& cfg, double copy_bw_bytes_per_s) {
  const int prompt = out["prompt_tokens"].get<int>(), gen = out["gen_tokens"].get<int>();
  const double bytes = decode_bytes(cfg, prompt + 0.5 * gen);
  const double floor_ms = bytes / copy_bw_bytes_per_s * 1e3;
  out["bytes_per_token"] = bytes;
  out["copy_bandwidth_GBps"] = copy_bw_bytes_per_s / 1e9;
  out["floor_ms"] = floor_ms;
  out["fraction_of_floor"] = floor_ms / out["ms_per_token_p50"].get<double>();
}

}  // namespace tiermoe
