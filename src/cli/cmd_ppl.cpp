#include <chrono>
#include <cmath>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "core/check.h"

#include "cli/common.h"

namespace tiermoe {

int run_ppl(const CommonOptions& c, const std::string& file, int ctx, int windows) {
  if (ctx < 2) throw InputError("--ctx: must be at least 2, got " + std::to_string(ctx));
  if (windows < 0) throw InputError("--windows: must be >= 0, got " + std::to_string(windows));
  Engine engine({c.model_dir, c.kv, c.threads});
  if (ctx > engine.config().max_position_embeddings)
    throw InputError("--ctx: " + std::to_string(ctx) + " exceeds the model's context of " +
                     std::to_string(engine.config().max_position_embeddings));
  const std::vector<int32_t> ids = engine.tokenizer().encode(read_text_file(file));
  const int available = int(ids.size()) / ctx;
  if (available == 0)
    throw InputError(file + ": " + std::to_string(ids.size()) + " tokens, fewer than one window of " + std::to_string(ctx));
  const int n = windows > 0 ? std::min(windows, available) : available;

  ProgressBar bar("ppl", size_t(n));
  std::vector<double> window_nll;
  double sum = 0;
  size_t count = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int w = 0; w < n; ++w) {
    ScoreResult r = engine.score(std::span(ids).subspan(size_t(w) * ctx, size_t(ctx)));
    window_nll.push_back(r.mean_nll);
    for (float x : r.nll) sum += x;
    count += r.nll.size();
    char buf[64];
    std::snprintf(buf, sizeof buf, "ppl %.4f", std::exp(sum / double(count)));
    bar.update(size_t(w + 1), buf);
  }
  bar.finish();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double mean = sum / double(count);
  if (c.json) {
    nlohmann::json out = {{"ppl", std::exp(mean)}, {"mean_nll", mean}, {"window_nll", window_nll},
                          {"windows", n}, {"ctx", ctx}, {"tokens_scored", count}, {"kv", c.kv},
                          {"seconds", secs}, {"tokens_per_s", double(n) * ctx / secs}};
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf("perplexity %.4f over %d windows of %d tokens (mean nll %.6f, %.1f tokens/s)\n", std::exp(mean), n, ctx,
                mean, double(n) * ctx / secs);
  }
  return 0;
}

}  // namespace tiermoe
