#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <utility>

#include "core/check.h"
#include "core/files.h"
#include "core/thread_pool.h"
#include "kv/kv_profile.h"
#if TIERMOE_HAVE_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace tiermoe {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

Engine::Engine(const EngineOptions& opts) : opts_(opts) {
  if (opts.threads > 0) set_num_threads(opts.threads);
  if (opts.backend != "cpu" && opts.backend != "cuda")
    throw InputError("--backend must be cpu or cuda, not '" + opts.backend + "'");
  if (opts.load_format != "auto" && opts.load_format != "dummy")
    throw InputError("--load-format must be auto or dummy, not '" + opts.load_format + "'");
  if (opts.load_format == "dummy" && opts.backend != "cuda") throw InputError("--load-format dummy needs --backend cuda");
  if (opts.gpu_kv_bytes > 0 && opts.backend != "cuda") throw InputError("--gpu-kv-gib needs --backend cuda");
  const bool config_file = opts.load_format == "dummy" && std::filesystem::is_regular_file(opts.model_dir);
  if (!config_file && !std::filesystem::is_directory(opts.model_dir))
    throw InputError(opts.model_dir + ": not a directory" +
                     (opts.load_format == "dummy" ? " or config.json" : ""));
  if (opts.load_format == "dummy") {
    config_ = config_file ? parse_config(read_file(opts.model_dir), opts.model_dir) : load_config(opts.model_dir);
  } else {
    weights_ = load_weights(opts.model_dir);
    config_ = weights_->cfg;
  }
  if (!config_file && std::filesystem::exists(std::filesystem::path(opts.model_dir) / "tokenizer.json"))
    tokenizer_.emplace(Tokenizer::load(opts.model_dir));
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
  if (opts.backend == "cuda") {
#if TIERMOE_HAVE_CUDA
    if (!kv_spec_->exact || kv_spec_->exact_dtype == KvDType::F32 || !opts.kv_profile.empty())
      throw InputError("--kv " + kv_spec_->name + ": the CUDA backend keeps its KV cache in BF16 (--kv bf16, the default "
                       "with --backend cuda) or FP8 rows (--kv fp8-all); tiered caches and profiles are CPU-only so far");
    CudaBackendOptions co;
    co.kv_dtype = kv_spec_->exact_dtype;
    co.kv_cache_bytes = opts.gpu_kv_bytes;
    backend_ = weights_ ? make_cuda_backend(*weights_, co) : make_cuda_backend_dummy(config_, co);
    weights_.reset();  // uploaded; the host copy is not needed
    return;
#else
    throw InputError("--backend cuda: this build has no CUDA backend (nvcc was not found at configure time)");
#endif
  }
  CpuBackendOptions bo;
  if (kv_spec_->exact) bo.kv_dtype = kv_spec_->exact_dtype;
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
  if (!tokenizer_) throw InputError(opts_.model_dir + ": no tokenizer.json (pass token ids instead of text)");
  return *tokenizer_;
}

void Engine::check_ids(std::span<const int32_t> ids, const char* what) const {
  check_token_ids(ids, config(), what);
  if (int(ids.size()) > config().max_position_embeddings)
    throw InputError(std::string(what) + ": " + std::to_string(ids.size()) + " tokens exceed the model's context of " +
                     std::to_string(config().max_position_embeddings));
}

Scheduler& Engine::scheduler() {
  std::call_once(scheduler_once_, [&] {
    scheduler_ = std::make_unique<Scheduler>(*backend_, config_, tokenizer_ ? &*tokenizer_ : nullptr, opts_.scheduler,
                                             opts_.observer);
  });
  return *scheduler_;
}

GenerateResult Engine::generate(const GenerateRequest& req, const std::function<void(std::string_view)>& on_text) {
  if (req.prompt.empty()) throw InputError("prompt: empty (at least one token is needed)");
  if (req.max_tokens < 0) throw InputError("max_tokens: must be >= 0, got " + std::to_string(req.max_tokens));
  check_ids(req.prompt, "prompt");
  SeqRequest s;
  s.max_tokens = std::min(req.max_tokens, config().max_position_embeddings - int(req.prompt.size()));
  GenerateResult res;
  res.finish_reason = "length";
  if (s.max_tokens <= 0) return res;
  s.prompt = req.prompt;
  s.sampling = req.sampling;
  s.stop = req.stop;
  if (req.stop_at_eos) s.stop_ids = config().eos_token_ids;

  const auto t0 = std::chrono::steady_clock::now();
  std::shared_ptr<SeqStream> out = scheduler().submit(std::move(s));
  std::optional<std::chrono::steady_clock::time_point> first;
  for (;;) {
    SeqStream::Chunk c = out->take(std::chrono::seconds(1));
    if (!first && (!c.ids.empty() || c.finished)) {
      first = std::chrono::steady_clock::now();
      res.prefill_seconds = seconds_since(t0);
    }
    res.ids.insert(res.ids.end(), c.ids.begin(), c.ids.end());
    res.text += c.text;
    if (on_text && !c.text.empty()) on_text(c.text);
    if (c.finished) {
      if (c.finish_reason == "error") throw std::runtime_error(c.error);
      if (c.finish_reason == "cancelled") throw std::runtime_error("generate: the scheduler stopped");
      res.finish_reason = c.finish_reason;
      break;
    }
  }
  res.decode_seconds = seconds_since(*first);
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
