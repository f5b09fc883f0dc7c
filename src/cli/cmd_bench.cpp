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

int run_bench(const CommonOptions& c, int prompt_tokens, int gen_tokens, int repeats) {
  BenchOptions b;
  b.prompt_tokens = prompt_tokens;
  b.gen_tokens = gen_tokens;
  b.repeats = repeats;
  return run_bench(c, b);
}

int run_bench(const CommonOptions& c, const BenchOptions& b) {
  const int prompt_tokens = b.prompt_tokens, gen_tokens = b.gen_tokens, repeats = b.repeats;
  if (prompt_tokens < 1 || gen_tokens < 1 || repeats < 1)
    throw InputError("bench: --ctx/--prompt-tokens, --gen and --repeats must be >= 1");
  if (b.batch < 1) throw InputError("bench: --batch must be >= 1");
  if (b.load_format != "auto" && b.load_format != "dummy")
    throw InputError("bench: --load-format must be auto or dummy, not '" + b.load_format + "'");
  if (b.backend != "cpu" && b.backend != "cuda")
    throw InputError("bench: --backend must be cpu or cuda, not '" + b.backend + "'");

  std::unique_ptr<Engine> engine;  // CPU path: the engine, as every other command
  std::unique_ptr<ModelWeights> weights;
  std::unique_ptr<Backend> own_backend;
  ModelConfig cfg;
  double copy_bw = 0;
  std::string device = "cpu";
  if (b.backend == "cpu") {
    if (b.load_format == "dummy") throw InputError("bench: --load-format dummy needs --backend cuda");
    if (c.model_dir.empty()) throw InputError("bench: give --model DIR");
    engine = std::make_unique<Engine>(engine_options(c));  // --kv, --kv-config, --kv-profile as every command
    cfg = engine->config();
  } else {
#if TIERMOE_HAVE_CUDA
    if (b.load_format == "dummy") {
      if (b.config_file.empty()) throw InputError("bench: --load-format dummy needs --config FILE");
      cfg = parse_config(read_text_file(b.config_file), b.config_file);
      own_backend = make_cuda_backend_dummy(cfg);
    } else {
      if (c.model_dir.empty()) throw InputError("bench: give --model DIR (or --config FILE --load-format dummy)");
      weights = load_weights(c.model_dir);
      cfg = weights->cfg;
      own_backend = make_cuda_backend(*weights);
    }
    copy_bw = cuda_copy_bandwidth();
    device = cuda_device_name();
#else
    throw InputError("bench: this build has no CUDA backend (nvcc was not found at configure time)");
#endif
  }
  Backend& backend = engine ? engine->backend() : *own_backend;
  if (prompt_tokens + gen_tokens > cfg.max_position_embeddings)
    throw InputError("bench: --ctx + --gen exceeds the model's context of " +
                     std::to_string(cfg.max_position_embeddings));
  nlohmann::json out = b.batch > 1 ? bench_batch(backend, cfg, b.batch, prompt_tokens, gen_tokens)
                                   : bench_stream(backend, cfg, prompt_tokens, gen_tokens, repeats);
  out["device"] = device;
  out["kv"] = engine ? c.kv : "bf16";
  const double p50 = out["ms_per_token_p50"], p99 = out["ms_per_token_p99"], ttft = out["ttft_ms"];
  if (engine) out["threads"] = num_threads();
  if (!b.config_file.empty()) out["config"] = std::filesystem::path(b.config_file).filename().string();
  out["load_format"] = b.load_format;
  if (copy_bw > 0 && b.batch == 1) add_floor(out, cfg, copy_bw);  // the floor counts one stream's bytes
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
