#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <utility>

#include "core/check.h"
#include "core/thread_pool.h"
#include "engine/stop_matcher.h"
#include "kv/kv_profile.h"

namespace tiermoe {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

Engine::Engine(const EngineOptions& opts) : model_dir_(opts.model_dir) {
  if (opts.threads > 0) set_num_threads(opts.threads);
  if (!std::filesystem::is_directory(opts.model_dir)) throw InputError(opts.model_dir + ": not a directory");
  weights_ = load_weights(opts.model_dir);
  if (std::filesystem::exists(std::filesystem::path(opts.model_dir) / "tokenizer.json"))
    tokenizer_.emplace(Tokenizer::load(opts.model_dir));
  CpuBackendOptions bo;
  if (!opts.kv_config.empty()) {
    std::ifstream in(opts.kv_config);
    if (!in) throw InputError(opts.kv_config + ": cannot open --kv-config");
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(in);
    } catch (const std::exception& e) {
      throw InputError(opts.kv_config + ": not JSON (" + e.what() + ")");
    }
    kv_spec_ = std::make_shared<KvSpec>(kv_spec_from_json(j, opts.kv_config));
  } else {
    kv_spec_ = std::make_shared<KvSpec>(kv_preset(opts.kv));
  }
  if (kv_spec_->exact) bo.kv_dtype = kv_spec_->exact_f32 ? KvDType::F32 : KvDType::BF16;
  else bo.kv_spec = kv_spec_;
  if (!opts.kv_profile.empty()) {
    auto prof = std::make_shared<KvProfile>(KvProfile::load(opts.kv_profile));
    prof->check_compatible(model_fingerprint(opts.model_dir), kv_geometry(), *kv_spec_, opts.kv_profile);
    bo.kv_profile = prof;
  }
  backend_ = make_cpu_backend(*weights_, bo);
}

KvGeometry Engine::kv_geometry() const {
  const ModelConfig& c = config();
  return {c.num_layers, c.num_kv_heads, c.num_heads, c.head_dim, float(c.rope_theta)};
}

const Tokenizer& Engine::tokenizer() const {
  if (!tokenizer_) throw InputError(model_dir_ + ": no tokenizer.json (pass token ids instead of text)");
  return *tokenizer_;
}

void Engine::check_ids(std::span<const int32_t> ids, const char* what) const {
  for (int32_t id : ids)
    if (id < 0 || id >= config().vocab_size)
      throw InputError(std::string(what) + ": token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                       std::to_string(config().vocab_size) + ")");
  if (int(ids.size()) > config().max_position_embeddings)
    throw InputError(std::string(what) + ": " + std::to_string(ids.size()) + " tokens exceed the model's context of " +
                     std::to_string(config().max_position_embeddings));
}

GenerateResult Engine::generate(const GenerateRequest& req, const std::function<void(std::string_view)>& on_text) {
  if (req.prompt.empty()) throw InputError("prompt: empty (at least one token is needed)");
  if (req.max_tokens < 0) throw InputError("max_tokens: must be >= 0, got " + std::to_string(req.max_tokens));
  check_ids(req.prompt, "prompt");
  Sampler sampler(req.sampling);
  GenerateResult res;
  res.finish_reason = "length";
  const int V = config().vocab_size;
  const int budget = std::min(req.max_tokens, config().max_position_embeddings - int(req.prompt.size()));
  if (budget <= 0) return res;

  std::unique_ptr<KvCache> cache = backend_->new_cache();
  std::vector<float> logits(V);
  std::optional<StreamDecoder> decoder;
  if (tokenizer_) decoder.emplace(*tokenizer_);
  StopMatcher stops(req.stop);
  auto emit = [&](const std::string& s) {
    res.text += s;
    if (on_text && !s.empty()) on_text(s);
  };

  auto t0 = std::chrono::steady_clock::now();
  backend_->forward(req.prompt, *cache, 1, logits.data());
  res.prefill_seconds = seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  bool stopped = false;
  for (int step = 0; step < budget && !stopped; ++step) {
    const int32_t next = sampler.sample(logits);
    const auto& eos = config().eos_token_ids;
    if (req.stop_at_eos && std::find(eos.begin(), eos.end(), next) != eos.end()) {
      res.finish_reason = "stop";
      break;
    }
    res.ids.push_back(next);
    if (decoder) {
      emit(stops.push(decoder->push(next), &stopped));
      if (stopped) res.finish_reason = "stop";
    }
    if (step + 1 < budget && !stopped) backend_->forward(std::span(&next, 1), *cache, 1, logits.data());
  }
  if (decoder && !stopped) {
    emit(stops.push(decoder->flush(), &stopped));
    if (stopped) res.finish_reason = "stop";
    else emit(stops.flush());
  }
  res.decode_seconds = seconds_since(t0);
  return res;
}

ScoreResult Engine::score(std::span<const int32_t> ids, std::span<const int> logits_at) {
  check_ids(ids, "ids");
  const int T = int(ids.size()), V = config().vocab_size;
  for (int p : logits_at)
    if (p < 0 || p >= T) throw InputError("logits-at: position " + std::to_string(p) + " is outside [0, " + std::to_string(T) + ")");
  ScoreResult res;
  res.logits.resize(logits_at.size());
  std::unique_ptr<KvCache> cache = backend_->new_cache();
  constexpr int kChunk = 256;  // bounds the logits buffer to [kChunk, V]
  std::vector<float> logits(size_t(kChunk) * V);
  double total = 0;
  for (int start = 0; start < T; start += kChunk) {
    const int n = std::min(kChunk, T - start);
    backend_->forward(ids.subspan(start, n), *cache, n, logits.data());
    for (int i = 0; i < n; ++i) {
      const int pos = start + i;
      const float* row = logits.data() + size_t(i) * V;
      for (size_t j = 0; j < logits_at.size(); ++j)
        if (logits_at[j] == pos) res.logits[j].assign(row, row + V);
      if (pos + 1 >= T) continue;
      double mx = row[0];
      for (int v = 1; v < V; ++v) mx = std::max<double>(mx, row[v]);
      double sum = 0;
      for (int v = 0; v < V; ++v) sum += std::exp(double(row[v]) - mx);
      const float nll = float(std::log(sum) + mx - row[ids[pos + 1]]);
      res.nll.push_back(nll);
      total += nll;
    }
  }
  res.mean_nll = res.nll.empty() ? 0 : total / double(res.nll.size());
  return res;
}

}  // namespace tiermoe
