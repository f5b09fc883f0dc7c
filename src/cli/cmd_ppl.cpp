// Perplexity over non-overlapping windows, with the KV cache's storage accounting and,
// against a reference cache (--ref-kv), the mean KL divergence of the next-token distribution.
// The tiered cache gives decode semantics in one pass: each query sees every key as a
// decoding cache would hold it at that query's step (see tiered_kv_cache.cpp).
#include <chrono>
#include <cmath>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "kv/kv_profile.h"

#include "cli/common.h"

namespace tiermoe {

nlohmann::json kv_stats_json(const KvCache& cache, const KvGeometry& g, int ctx) {
  const KvCache::Stats s = cache.stats();
  const double values = double(ctx) * g.num_layers * g.num_kv_heads * g.head_dim;  // per K or V
  const double bf16_bytes = values * 2 * 2;
  nlohmann::json tiers = nlohmann::json::array();
  for (const auto& t : s.tiers)
    tiers.push_back({{"tier", t.tier}, {"tokens", t.tokens}, {"k_bits_per_value", t.k_bits}, {"v_bits_per_value", t.v_bits}});
  const double overall = (s.k_bits + s.v_bits) / 2;
  const double with_meta = overall + s.meta_bytes * 8 / (2 * values);
  return {{"bits_per_value", overall},
          {"bits_per_value_k", s.k_bits},
          {"bits_per_value_v", s.v_bits},
          {"tiers", tiers},
          {"kv_bytes", s.token_bytes},
          {"kv_bytes_held", s.held_bytes},
          {"bf16_bytes", bf16_bytes},
          {"kv_bytes_ratio", s.token_bytes > 0 ? bf16_bytes / s.token_bytes : 0.0},
          {"metadata_bytes", s.meta_bytes},
          {"bits_per_value_with_metadata", with_meta},
          {"kv_bytes_ratio_with_metadata", s.token_bytes > 0 ? bf16_bytes / (s.token_bytes + s.meta_bytes) : 0.0}};
}

int run_ppl(const CommonOptions& c, const std::string& file, int ctx, int windows, const std::string& ref_kv) {
  if (ctx < 2) throw InputError("--ctx: must be at least 2, got " + std::to_string(ctx));
  if (windows < 0) throw InputError("--windows: must be >= 0, got " + std::to_string(windows));
  Engine engine(engine_options(c));
  if (ctx > engine.config().max_position_embeddings)
    throw InputError("--ctx: " + std::to_string(ctx) + " exceeds the model's context of " +
                     std::to_string(engine.config().max_position_embeddings));
  std::unique_ptr<KvSpec> ref_spec;
  if (!ref_kv.empty()) ref_spec = std::make_unique<KvSpec>(kv_preset(ref_kv));
  const std::vector<int32_t> ids = engine.tokenizer().encode(read_text_file(file));
  const int available = int(ids.size()) / ctx;
  if (available == 0)
    throw InputError(file + ": " + std::to_string(ids.size()) + " tokens, fewer than one window of " + std::to_string(ctx));
  const int n = windows > 0 ? std::min(windows, available) : available;
  const int V = engine.config().vocab_size;

  ProgressBar bar("ppl", size_t(n));
  std::vector<double> window_nll;
  double sum = 0, ref_sum = 0, kl_sum = 0;
  size_t count = 0, agree = 0;
  nlohmann::json stats;
  constexpr int kChunk = 256;
  std::vector<float> logits(size_t(kChunk) * V), ref_logits(ref_spec ? size_t(kChunk) * V : 0);
  auto log_softmax = [&](const float* row, std::vector<double>& out) {
    double mx = row[0];
    for (int v = 1; v < V; ++v) mx = std::max<double>(mx, row[v]);
    double s = 0;
    for (int v = 0; v < V; ++v) s += std::exp(double(row[v]) - mx);
    const double lse = std::log(s) + mx;
    out.resize(size_t(V));
    for (int v = 0; v < V; ++v) out[size_t(v)] = double(row[v]) - lse;
  };
  std::vector<double> lp, lq;
  const auto t0 = std::chrono::steady_clock::now();
  for (int w = 0; w < n; ++w) {
    const auto win = std::span(ids).subspan(size_t(w) * ctx, size_t(ctx));
    std::unique_ptr<KvCache> cache = engine.backend().new_cache();
    std::unique_ptr<KvCache> ref = ref_spec ? make_kv_cache(engine.kv_geometry(), *ref_spec) : nullptr;
    double wsum = 0;
    for (int start = 0; start < ctx; start += kChunk) {
      const int m = std::min(kChunk, ctx - start);
      engine.backend().forward(win.subspan(size_t(start), size_t(m)), *cache, m, logits.data());
      if (ref) engine.backend().forward(win.subspan(size_t(start), size_t(m)), *ref, m, ref_logits.data());
      for (int i = 0; i < m && start + i + 1 < ctx; ++i) {
        const int32_t next = win[size_t(start + i + 1)];
        log_softmax(logits.data() + size_t(i) * V, lq);
        const double nll = -lq[size_t(next)];
        wsum += nll;
        sum += nll;
        ++count;
        if (ref) {
          log_softmax(ref_logits.data() + size_t(i) * V, lp);
          ref_sum += -lp[size_t(next)];
          double kl = 0;
          int am_p = 0, am_q = 0;
          for (int v = 0; v < V; ++v) {
            kl += std::exp(lp[size_t(v)]) * (lp[size_t(v)] - lq[size_t(v)]);
            if (lp[size_t(v)] > lp[size_t(am_p)]) am_p = v;
            if (lq[size_t(v)] > lq[size_t(am_q)]) am_q = v;
          }
          kl_sum += kl;
          agree += am_p == am_q;
        }
      }
    }
    window_nll.push_back(wsum / double(ctx - 1));
    stats = kv_stats_json(*cache, engine.kv_geometry(), ctx);
    char buf[64];
    std::snprintf(buf, sizeof buf, "ppl %.4f", std::exp(sum / double(count)));
    bar.update(size_t(w + 1), buf);
  }
  bar.finish();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double mean = sum / double(count);
  if (c.json) {
    nlohmann::json out = {{"ppl", std::exp(mean)}, {"mean_nll", mean}, {"window_nll", window_nll},
                          {"windows", n}, {"ctx", ctx}, {"tokens_scored", count},
                          {"kv", engine.kv_spec().name}, {"kv_spec", kv_spec_to_json(engine.kv_spec())},
                          {"kv_profile", c.kv_profile}, {"seconds", secs}, {"tokens_per_s", double(n) * ctx / secs}};
    out.update(stats);
    if (ref_spec) {
      out["ref_kv"] = ref_kv;
      out["ref_ppl"] = std::exp(ref_sum / double(count));
      out["kl_vs_ref"] = kl_sum / double(count);
      out["top1_agreement"] = double(agree) / double(count);
      out["ppl_increase"] = std::exp(mean) / std::exp(ref_sum / double(count)) - 1;
    }
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf("perplexity %.4f over %d windows of %d tokens (mean nll %.6f, %.1f tokens/s)\n", std::exp(mean), n, ctx,
                mean, double(n) * ctx / secs);
    std::printf("kv %s: %.3f bits/value (K %.3f, V %.3f), %.2fx fewer bytes than BF16, metadata %.0f bytes\n",
                engine.kv_spec().name.c_str(), stats["bits_per_value"].get<double>(), stats["bits_per_value_k"].get<double>(),
                stats["bits_per_value_v"].get<double>(), stats["kv_bytes_ratio"].get<double>(),
                stats["metadata_bytes"].get<double>());
    if (ref_spec)
      std::printf("vs %s: ppl %.4f, mean KL %.5f, top-1 agreement %.4f\n", ref_kv.c_str(), std::exp(ref_sum / double(count)),
                  kl_sum / double(count), double(agree) / double(count));
  }
  return 0;
}

}  // namespace tiermoe
