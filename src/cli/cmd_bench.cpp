// tiermoe bench: prefill and decode speed of one stream, medians over repeats.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>

#include <nlohmann/json.hpp>

#include "core/check.h"

#include "cli/common.h"
#include "core/check.h"
#include "core/thread_pool.h"

namespace tiermoe {
namespace {

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, size_t(p / 100.0 * double(v.size() - 1) + 0.5));
  return v[i];
}

}  // namespace

int run_bench(const CommonOptions& c, int prompt_tokens, int gen_tokens, int repeats) {
  if (prompt_tokens < 1 || gen_tokens < 1 || repeats < 1)
    throw InputError("bench: --prompt-tokens, --gen and --repeats must be >= 1");
  Engine engine({c.model_dir, c.kv, c.threads});
  const ModelConfig& cfg = engine.config();
  if (prompt_tokens + gen_tokens > cfg.max_position_embeddings)
    throw InputError("bench: --prompt-tokens + --gen exceeds the model's context of " +
                     std::to_string(cfg.max_position_embeddings));
  std::mt19937 rng(1234);
  std::vector<int32_t> prompt(static_cast<size_t>(prompt_tokens));
  for (auto& id : prompt) id = int32_t(rng() % uint32_t(cfg.vocab_size));

  using clock = std::chrono::steady_clock;
  auto ms_since = [](clock::time_point t0) { return std::chrono::duration<double, std::milli>(clock::now() - t0).count(); };
  std::vector<double> prefill_ms, step_ms;
  std::vector<float> logits(size_t(cfg.vocab_size));
  for (int r = 0; r <= repeats; ++r) {  // repeat 0 warms up
    auto cache = engine.backend().new_cache();
    auto t0 = clock::now();
    engine.backend().forward(prompt, *cache, 1, logits.data());
    const double pf = ms_since(t0);
    std::vector<double> steps;
    for (int i = 0; i < gen_tokens; ++i) {
      const int32_t next = argmax(logits);
      t0 = clock::now();
      engine.backend().forward(std::span(&next, 1), *cache, 1, logits.data());
      steps.push_back(ms_since(t0));
    }
    if (r == 0) continue;
    prefill_ms.push_back(pf);
    step_ms.insert(step_ms.end(), steps.begin(), steps.end());
  }
  const double p50 = percentile(step_ms, 50), p99 = percentile(step_ms, 99), ttft = percentile(prefill_ms, 50);
  nlohmann::json out = {{"backend", engine.backend().name()}, {"threads", num_threads()}, {"kv", c.kv},
                        {"prompt_tokens", prompt_tokens}, {"gen_tokens", gen_tokens}, {"repeats", repeats},
                        {"ttft_ms", ttft}, {"prefill_tokens_per_s", prompt_tokens / ttft * 1000.0},
                        {"ms_per_token_p50", p50}, {"ms_per_token_p99", p99}, {"tokens_per_s", 1000.0 / p50}};
  if (c.json) {
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf("prefill %d tokens: %.1f ms (%.0f tokens/s)   decode: %.3f ms/token p50, %.3f p99 (%.1f tokens/s)\n",
                prompt_tokens, ttft, prompt_tokens / ttft * 1000.0, p50, p99, 1000.0 / p50);
  }
  return 0;
}

}  // namespace tiermoe
