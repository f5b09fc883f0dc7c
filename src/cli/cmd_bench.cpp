// tiermoe bench: prefill and decode speed of one stream, medians over repeats. On the CUDA
// backend also the bandwidth floor: bytes a decode step must read (active weights + KV cache)
// over the device-to-device copy bandwidth measured in the same run.
#include <cstdio>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "cli/bench_core.h"
#include "cli/common.h"
#include "core/check.h"
#include "core/thread_pool.h"
#if TIERMOE_HAVE_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace tiermoe {

int run_bench(const CommonOptions& c, const BenchOptions& b) {
  const int prompt_tokens = b.prompt_tokens, gen_tokens = b.gen_tokens, repeats = b.repeats;
  if (prompt_tokens < 1 || gen_tokens < 1 || repeats < 1)
    throw InputError("bench: --ctx/--prompt-tokens, --gen and --repeats must be >= 1");
  if (b.batch < 1) throw InputError("bench: --batch must be >= 1");
  const SamplingParams sampling{b.temperature, b.top_k, b.top_p, 0};
  Sampler{sampling};  // refuses out-of-range values, naming them
  EngineOptions o = engine_options(c);  // --backend, --load-format, --kv... checked as by every command
  if (!b.config_file.empty()) {
    if (c.load_format != "dummy")
      throw InputError("bench: --config FILE needs --load-format dummy, not '" + c.load_format + "'");
    if (!c.model_dir.empty()) throw InputError("bench: give --model DIR or --config FILE, not both");
    o.model_dir = b.config_file;
  } else if (c.model_dir.empty()) {
    throw InputError("bench: give --model DIR (or --config FILE --load-format dummy)");
  }
  Engine engine(o);
  Backend& backend = engine.backend();
  const ModelConfig& cfg = engine.config();
  double copy_bw = 0;
  std::string device = "cpu";
  if (c.backend == "cuda") {
#if TIERMOE_HAVE_CUDA  // the engine has refused --backend cuda otherwise
    copy_bw = cuda_copy_bandwidth();
    device = cuda_device_name();
#endif
  }
  if (prompt_tokens + gen_tokens > cfg.max_position_embeddings)
    throw InputError("bench: --ctx + --gen exceeds the model's context of " +
                     std::to_string(cfg.max_position_embeddings));
  nlohmann::json out = b.batch > 1 ? bench_batch(backend, cfg, b.batch, prompt_tokens, gen_tokens, sampling, b.overlap)
                                   : bench_stream(backend, cfg, prompt_tokens, gen_tokens, repeats, sampling, b.overlap);
  out["device"] = device;
  out["kv"] = c.kv;
  const double p50 = out["ms_per_token_p50"], p99 = out["ms_per_token_p99"], ttft = out["ttft_ms"];
  if (c.backend == "cpu") out["threads"] = num_threads();
  if (!b.config_file.empty()) out["config"] = std::filesystem::path(b.config_file).filename().string();
  out["load_format"] = c.load_format;
  if (copy_bw > 0 && b.batch == 1)  // the floor counts one stream's bytes
    add_floor(out, cfg, copy_bw, kv_bytes_per_value(engine.kv_spec().exact_dtype, cfg.head_dim));
  if (c.json) {
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf("prefill %d tokens: %.1f ms (%.0f tokens/s)   decode: %.3f ms/token p50, %.3f p99 (%.1f tokens/s)\n",
                prompt_tokens, ttft, prompt_tokens / ttft * 1000.0, p50, p99, 1000.0 / p50);
    if (out.contains("floor_ms"))
      std::printf("floor %.3f ms/token (%.2f GB at %.0f GB/s copy bandwidth): %.0f%% of the floor\n",
                  out["floor_ms"].get<double>(), out["bytes_per_token"].get<double>() / 1e9, copy_bw / 1e9,
                  100.0 * out["fraction_of_floor"].get<double>());
  }
  return 0;
}

}  // namespace tiermoe
