// The one engine API that the CLI, the server and the benchmarks use: a model, its tokenizer
// and a backend; generation with sampling and stop conditions; scoring.
#pragma once
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "kv/kv_spec.h"
#include "model/weights.h"
#include "tokenizer/tokenizer.h"

namespace tiermoe {

struct EngineOptions {
  std::string model_dir;   // with load_format dummy, a config.json file will do (no tokenizer then)
  std::string kv = "f32";  // KV cache preset (kv_spec.h): f32 (exact reference), bf16, default, ...
  int threads = 0;         // 0: all cores (or TIERMOE_THREADS)
  std::string kv_config;   // JSON file of KV spec overrides (replaces `kv` when given)
  std::string kv_profile;  // offline KV calibration (tiermoe calibrate)
  std::string backend = "cpu";        // cpu | cuda (builds with nvcc; BF16 weights and KV on one GPU)
  std::string load_format = "auto";   // auto: the checkpoint | dummy: config.json's shapes, random
                                      // weights on the GPU (cuda only; for speed, not for text)
  size_t gpu_kv_bytes = 0;            // cuda: the paged KV pool's size (0: CudaBackendOptions' default)
  SchedulerOptions scheduler;         // the engine's continuous-batching loop (generate, serve)
  std::shared_ptr<SchedulerObserver> observer;  // its metrics, if anyone wants them
};

struct GenerateRequest {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  int max_tokens = 128;
  std::vector<std::string> stop;  // generation ends before the first occurrence of any
  bool stop_at_eos = true;
};

struct GenerateResult {
  std::vector<int32_t> ids;   // generated tokens only
  std::string text;           // their text, cut before a stop string
  std::string finish_reason;  // "stop" (EOS or stop string) or "length"
  double prefill_seconds = 0, decode_seconds = 0;
};

struct ScoreResult {
  std::vector<float> nll;  // nll[i] = -log p(ids[i+1] | ids[0..i]), size T-1
  double mean_nll = 0;
  std::vector<std::vector<float>> logits;  // at the requested positions, in order
};

class Engine {
 public:
  explicit Engine(const EngineOptions& opts);  // throws InputError for a bad model directory

  const ModelConfig& config() const { return config_; }
  bool has_tokenizer() const { return tokenizer_.has_value(); }
  const Tokenizer& tokenizer() const;  // throws InputError when the model has no tokenizer.json
  Backend& backend() { return *backend_; }
  const KvSpec& kv_spec() const { return *kv_spec_; }
  KvGeometry kv_geometry() const;

  // The continuous-batching loop that owns the backend from its first use on (started then).
  Scheduler& scheduler();

  // One request through the scheduler, waited for; safe to call from several threads at once
  // (their requests are batched). on_text receives each new piece of text as it becomes final
  // (whole UTF-8, stop strings held back until they cannot match).
  GenerateResult generate(const GenerateRequest& req, const std::function<void(std::string_view)>& on_text = {});

  // Runs on the backend directly: not while the scheduler has work.
  ScoreResult score(std::span<const int32_t> ids, std::span<const int> logits_at = {});

 private:
  void check_ids(std::span<const int32_t> ids, const char* what) const;

  EngineOptions opts_;
  ModelConfig config_;
  std::unique_ptr<ModelWeights> weights_;  // the CPU backend reads them in place
  std::optional<Tokenizer> tokenizer_;
  std::unique_ptr<Backend> backend_;
  std::shared_ptr<const KvSpec> kv_spec_;
  std::once_flag scheduler_once_;
  std::unique_ptr<Scheduler> scheduler_;  // last: stopped before the backend goes
};

}  // namespace tiermoe
