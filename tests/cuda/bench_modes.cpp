// The timing modes of tiermoe_cuda_check: bench, batchtable and profile.
#include <algorithm>
#include <string>
#include <vector>

#include <cuda_profiler_api.h>

#include "backend/backend.h"
#include "cli/bench_core.h"
#include "cuda/cuda_backend.h"

#include "check_harness.h"

namespace tiermoe::cuda_check {

// TIERMOE_BENCH_KV=fp8-all: FP8 KV pages (--kv fp8-all) in bench and profile; an environment switch,
// so that gpu_check.sh envs / detail can A/B it.
static KvDType bench_kv_dtype() {
  const char* e = std::getenv("TIERMOE_BENCH_KV");
  return e && std::strcmp(e, "fp8-all") == 0 ? KvDType::FP8 : KvDType::BF16;
}

int bench_main(int argc, char** argv) {
  std::string config, model;
  int ctx = 512, gen = 128, repeats = 3, batch = 1;
  SamplingParams sampling{0.f, 0, 1.f, 0};  // greedy unless --temperature
  CudaBackendOptions opts;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--config") config = v;
    else if (k == "--batch") batch = std::stoi(v);
    else if (k == "--model") model = v;
    else if (k == "--ctx") ctx = std::stoi(v);
    else if (k == "--gen") gen = std::stoi(v);
    else if (k == "--repeats") repeats = std::stoi(v);
    else if (k == "--temperature") sampling.temperature = std::stof(v);
    else if (k == "--top-p") sampling.top_p = std::stof(v);
    else if (k == "--top-k") sampling.top_k = std::stoi(v);
    else { std::fprintf(stderr, "unknown option %s %s\n", k.c_str(), v.c_str()); return 2; }
  }
  opts.kv_dtype = bench_kv_dtype();
  ModelConfig cfg;
  std::unique_ptr<ModelWeights> w;
  std::unique_ptr<Backend> b;
  if (!config.empty()) {
    cfg = parse_config(test::read_file(config), config);
    b = make_cuda_backend_dummy(cfg, opts);
  } else {
    w = load_weights(model);
    cfg = w->cfg;
    b = make_cuda_backend(*w, opts);
  }
  const double bw = cuda_copy_bandwidth();
  // TIERMOE_BENCH_OVERLAP=0: --no-overlap (an env switch, so gpu_check.sh envs can A/B it).
  const char* overlap_env = std::getenv("TIERMOE_BENCH_OVERLAP");
  const bool overlap = !(overlap_env && overlap_env[0] == '0');
  nlohmann::json out = batch > 1 ? bench_batch(*b, cfg, batch, ctx, gen, sampling, overlap)
                                 : bench_stream(*b, cfg, ctx, gen, repeats, sampling, overlap);
  out["device"] = cuda_device_name();
  out["kv"] = opts.kv_dtype == KvDType::FP8 ? "fp8-all" : "bf16";
  out["load_format"] = config.empty() ? "auto" : "dummy";
  out["config"] = config.empty() ? std::filesystem::path(model).filename().string()
                                 : std::filesystem::path(config).filename().string();
  if (const char* e = std::getenv("TIERMOE_CUDA_GRAPHS")) out["env"] = std::string("TIERMOE_CUDA_GRAPHS=") + e;
  if (batch == 1) add_floor(out, cfg, bw, kv_bytes_per_value(opts.kv_dtype, cfg.head_dim));
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

// The batch table in one process: every B of --batches under every variant (A/B environment
// switches, read by the backend at each pass) over the same caches: max(B) random prompts of C
// tokens prefilled once, each cut back to C tokens after a run. Per row: ms per step (every stream
// one token), median and p99 over N steps after two warm-up steps, and how many of the run's greedy
// tokens equal the first variant's (information only: the variants round differently).
//   tiermoe_cuda_check batchtable --config FILE [--ctx C] [--gen N] [--batches 1,8,32,64]
int batchtable_main(int argc, char** argv) {
  std::string config;
  int ctx = 1024, gen = 16;
  std::string only;  // --variant NAME: that variant alone
  std::vector<int> batches = {1, 8, 32, 64};
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--config") config = v;
    else if (k == "--ctx") ctx = std::stoi(v);
    else if (k == "--gen") gen = std::stoi(v);
    else if (k == "--variant") only = v;
    else if (k == "--batches") {
      batches.clear();
      for (size_t at = 0; at < v.size();) {
        const size_t comma = std::min(v.find(',', at), v.size());
        batches.push_back(std::stoi(v.substr(at, comma - at)));
        at = comma + 1;
      }
    }
    else { std::fprintf(stderr, "unknown option %s\n", k.c_str()); return 2; }
  }
  if (config.empty() || batches.empty() || *std::min_element(batches.begin(), batches.end()) < 1) {
    std::fprintf(stderr, "batchtable: needs --config FILE and --batches of positive sizes\n");
    return 2;
  }
  const ModelConfig cfg = parse_config(test::read_file(config), config);
  auto b = make_cuda_backend_dummy(cfg);
  const int max_b = *std::max_element(batches.begin(), batches.end());
  const size_t V = size_t(cfg.vocab_size);
  std::mt19937 prng(1234);
  std::vector<std::unique_ptr<KvCache>> caches;
  std::vector<float> logits(size_t(max_b) * V);
  std::vector<int32_t> first(max_b);
  std::vector<double> prefill_ms;
  for (int i = 0; i < max_b; ++i) {
    std::vector<int32_t> prompt(ctx);
    for (auto& id : prompt) id = int32_t(prng() % uint32_t(cfg.vocab_size));
    caches.push_back(b->new_cache());
    const auto t0 = std::chrono::steady_clock::now();
    b->forward(prompt, *caches.back(), 1, logits.data());
    prefill_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    first[i] = int32_t(std::max_element(logits.begin(), logits.begin() + V) - logits.begin());
  }
  struct Variant { const char *name, *moe, *min_t, *batch_attn, *batch_tc, *grouped_mma; };
  // before: per-(token, k) MoE kernels to T = 8, expert GEMMs beyond, attention per sequence;
  // grouped_from_2: the grouped MoE kernels from T = 2 (the default until 6d1688f); cuda_core_attn:
  // the default's MoE kernels, batch attention never on the tensor cores (before the batched
  // tensor-core decode); grouped_cuda_cores: the default with the grouped MoE kernels on the CUDA
  // cores (before they moved to the tensor cores); grouped_from_9: the default with the grouped
  // kernels from T = 9 only (the default until T K >= E took them from T = 2); default: grouped
  // from T = 9, and from T = 2 where T K >= E, on the tensor cores, attention on the tensor cores
  // where the batch-1 rule would take them for the longest sequence.
  const Variant variants[] = {{"before", "fused", "2", "0", "0", "1"},
                              {"grouped_from_2", "grouped", "2", "1", "0", "1"},
                              {"cuda_core_attn", "grouped", "0", "1", "0", "1"},
                              {"grouped_cuda_cores", "grouped", "0", "1", "1", "0"},
                              {"grouped_from_9", "grouped", "9", "1", "1", "1"},
                              {"default", "grouped", "0", "1", "1", "1"}};
  for (int B : batches) {
    std::vector<int32_t> tokens_first_variant;
    for (const Variant& v : variants) {
      if (!only.empty() && only != v.name) continue;
      setenv("TIERMOE_CUDA_MOE", v.moe, 1);
      setenv("TIERMOE_CUDA_MOE_GROUPED_MIN_T", v.min_t, 1);
      setenv("TIERMOE_CUDA_BATCH_ATTN", v.batch_attn, 1);
      setenv("TIERMOE_CUDA_BATCH_TC", v.batch_tc, 1);
      setenv("TIERMOE_CUDA_GROUPED_MMA", v.grouped_mma, 1);
      std::vector<int32_t> next(first.begin(), first.begin() + B), tokens;
      std::vector<Backend::SeqStep> steps(B);
      std::vector<double> step_ms;
      for (int i = 0; i < gen + 2; ++i) {
        for (int s = 0; s < B; ++s) steps[s] = {std::span(&next[s], 1), caches[s].get(), 1};
        const auto t0 = std::chrono::steady_clock::now();
        b->forward_batch(steps, logits.data());
        if (i >= 2) step_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
        for (int s = 0; s < B; ++s) {
          const float* row = logits.data() + size_t(s) * V;
          next[s] = int32_t(std::max_element(row, row + V) - row);
          tokens.push_back(next[s]);
        }
      }
      for (int s = 0; s < B; ++s) caches[s]->truncate(ctx);
      if (tokens_first_variant.empty()) tokens_first_variant = tokens;
      size_t equal = 0;
      for (size_t i = 0; i < tokens.size(); ++i) equal += tokens[i] == tokens_first_variant[i];
      nlohmann::json out = {{"config", std::filesystem::path(config).filename().string()}, {"variant", v.name},
                            {"batch", B}, {"prompt_tokens", ctx}, {"gen_tokens", gen},
                            {"ms_per_step_p50", bench_percentile(step_ms, 50)},
                            {"ms_per_step_p99", bench_percentile(step_ms, 99)},
                            {"tokens_per_s", B * 1000.0 / bench_percentile(step_ms, 50)},
                            {"tokens_equal_to_first_variant", fmt("%zu/%zu", equal, tokens.size())},
                            {"prefill_ms_p50", bench_percentile(prefill_ms, 50)}, {"device", cuda_device_name()}};
      std::printf("%s\n", out.dump().c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}

int profile_main(int argc, char** argv) {
  std::string config;
  int ctx = 16, batch = 1;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--config") config = v;
    else if (k == "--ctx") ctx = std::stoi(v);
    else if (k == "--batch") batch = std::stoi(v);
    else { std::fprintf(stderr, "unknown option %s\n", k.c_str()); return 2; }
  }
  if (config.empty() || ctx < 1 || batch < 1) {
    std::fprintf(stderr, "profile: needs --config FILE, --ctx >= 1 and --batch >= 1\n");
    return 2;
  }
  const ModelConfig cfg = parse_config(test::read_file(config), config);
  // A pool for these sequences alone: the default takes the free memory, which ncu's kernel replay needs.
  CudaBackendOptions o;
  o.kv_dtype = bench_kv_dtype();
  o.kv_cache_bytes = size_t(batch) * (ctx / cu::kKvPageRows + 2) * kv_page_bytes(cfg, o.kv_dtype == KvDType::FP8);
  auto b = make_cuda_backend_dummy(cfg, o);
  const size_t V = size_t(cfg.vocab_size);
  std::vector<std::unique_ptr<KvCache>> caches;
  std::vector<float> logits(size_t(batch) * V);
  std::vector<int32_t> next(batch);
  for (int s = 0; s < batch; ++s) {
    std::vector<int32_t> prompt(static_cast<size_t>(ctx));
    for (auto& id : prompt) id = int32_t(rng() % uint32_t(cfg.vocab_size));
    caches.push_back(b->new_cache());
    b->forward(prompt, *caches.back(), 1, logits.data());
    next[s] = argmax(std::span(logits.data(), V));
  }
  // One decode step of all sequences (forward for one, as a served batch of one runs it).
  auto step = [&] {
    if (batch == 1) {
      b->forward(std::span(&next[0], 1), *caches[0], 1, logits.data());
    } else {
      std::vector<Backend::SeqStep> steps(batch);
      for (int s = 0; s < batch; ++s) steps[s] = {std::span(&next[s], 1), caches[s].get(), 1};
      b->forward_batch(steps, logits.data());
    }
    for (int s = 0; s < batch; ++s) next[s] = argmax(std::span(logits.data() + size_t(s) * V, V));
  };
  for (int i = 0; i < 3; ++i) step();  // warm: graphs captured, caches of the GPU filled as in a long decode
  CK(cudaProfilerStart());
  step();
  CK(cudaProfilerStop());
  std::printf("profiled one decode step of %d sequence(s) at position %d\n", batch, ctx + 3);
  return 0;
}

}  // namespace tiermoe::cuda_check
