// GPU correctness in one program (needs a CUDA GPU; not part of the CPU suite):
//  1. every CUDA kernel against its CPU twin on a table of cases (odd sizes, T=1, up to 256
//     experts, top-k up to 8, ties), scored by ||gpu - cpu|| / ||cpu||; top-k ids exact;
//  2. end to end: tinymix-code and every golden fixture, CUDA backend vs CPU backend (logits
//     at every prompt position, then 32 greedy steps through each backend's own KV cache),
//     and tinymix's long-context logits vs the transformers reference;
//  3. a GEMV bandwidth figure and prompt-attention kernel times.
// Prints one line per case and a summary; exit status 1 when any case fails.
// Usage: tiermoe_cuda_check [--kernels-only [NAME] | --models-only [NAME]]   (NAME: only the kernel checks,
//   or model checks, whose name contains it, e.g. attention_prefill or FP8, and no timing; `timing`: the timing alone;
//   TIERMOE_CHECK_SKIP=N[:M] runs only cases N .. M-1 of the longest groups, below)
//        tiermoe_cuda_check bench (--config FILE | --model DIR) [--ctx C] [--gen N] [--repeats R] [--batch B]
//   the same measurement and JSON as `tiermoe bench --backend cuda [--load-format dummy]`, for
//   machines without the CLI's tokenizer libraries.
//        tiermoe_cuda_check batchtable --config FILE [--ctx C] [--gen N] [--batches 1,8,32,64]
//   decode steps of B streams under the A/B variants (before / grouped MoE / + batched attention)
//   over the same prefilled caches, one JSON line per (B, variant).
//        tiermoe_cuda_check codedtile
//   a probe: coded K/V tiles decoded into the attention's BF16 stage against BF16 tiles (coded_tile.cu).
//        tiermoe_cuda_check profile --config FILE [--ctx C]
//   one decode step after a C-token prompt inside cudaProfilerStart/Stop, for
//   `ncu --profile-from-start off` (the per-kernel time breakdown of a step).

#include <cstdio>
#include <cstring>

#include "check_harness.h"
#include "cuda/cuda_backend.h"

int sync_latency_main();  // sync_latency.cu
int decode_chain_main();  // decode_chain.cu
int coded_tile_main();    // coded_tile.cu

namespace tiermoe::cuda_check {

int check_main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "latency") == 0) return sync_latency_main();
  if (argc > 1 && std::strcmp(argv[1], "chain") == 0) return decode_chain_main();
  if (argc > 1 && std::strcmp(argv[1], "codedtile") == 0) return coded_tile_main();
  if (argc > 1 && std::strcmp(argv[1], "bench") == 0) return bench_main(argc, argv);
  if (argc > 1 && std::strcmp(argv[1], "profile") == 0) return profile_main(argc, argv);
  if (argc > 1 && std::strcmp(argv[1], "batchtable") == 0) return batchtable_main(argc, argv);
  const bool kernels_only = argc > 1 && std::strcmp(argv[1], "--kernels-only") == 0;
  // --kernels-only NAME: only the checks whose name contains NAME (e.g. under a sanitizer).
  const char* only = kernels_only && argc > 2 ? argv[2] : nullptr;
  auto want = [&](const char* name) { return !only || std::strstr(name, only) != nullptr; };
  const bool models_only = argc > 1 && std::strcmp(argv[1], "--models-only") == 0;
  if (models_only && argc > 2) g_only_model = argv[2];
  std::printf("device: %s\n", cuda_device_name().c_str());
  if (!models_only) {
    std::printf("== kernels vs CPU twins ==\n");
    const std::pair<const char*, void (*)()> checks[] = {
        {"gemv", check_gemv}, {"gemv_argmax", check_gemv_argmax}, {"gemv3", check_gemv3}, {"gemv_tc", check_gemv_tc}, {"gemv3_rows", check_gemv3_rows}, {"gemv_unstaged", check_gemv_unstaged},
        {"rmsnorm_rope_misc", check_rmsnorm_rope_misc},
        {"route", check_route}, {"moe_route", check_moe_route}, {"moe_routed", check_moe_routed}, {"moe", check_moe}, {"moe_grouped", check_moe_grouped},
        {"moe_prefill", check_moe_prefill}, {"kv_copy_pages", check_kv_copy_pages}, {"attention", check_attention},
        {"attention_prefill", check_attention_prefill},
        {"attention_prefill_decode", check_attention_prefill_decode},
        {"attention_prefill_decode_rows", check_attention_prefill_decode_rows}, {"attention_decode", check_attention_decode},
        {"attention_decode_batch", check_attention_decode_batch},
        {"attention_decode_per_head", check_attention_decode_per_head},
        {"kv_fp8_writes", check_kv_fp8_writes}, {"attention_fp8", check_attention_fp8}, {"sample_tokens", check_sampling}};
    for (const auto& [name, check] : checks)
      if (want(name)) check();
  }
  if (!kernels_only) check_models();
  if (!g_only_model && (!only || std::strcmp(only, "timing") == 0)) {  // --kernels-only timing: the timing alone
    std::printf("== timing ==\n");
    gemv_bandwidth(14336, 4096);
    gemv_bandwidth(4096, 14336);
    gemv_bandwidth(2048, 2048);
    attention_timing(3584, 16, 16, 128);  // OLMoE-1B-7B: the last chunk of a 4096-token prompt
    attention_timing(3584, 32, 4, 128);   // Qwen3-30B-A3B
    attention_timing(7680, 32, 8, 128);   // Mixtral-8x7B, the last chunk of 8192
    moe_gemm_timing(512, 8, 2, 4096, 14336);  // Mixtral-8x7B's experts, a 512-token chunk
    moe_gemm_timing(512, 128, 8, 2048, 768);  // Qwen3-30B-A3B's
    moe_decode_timing("mixtral", 8, 2, 4096, 14336);
    moe_decode_timing("qwen3-30b-a3b", 128, 8, 2048, 768);
    moe_decode_timing("olmoe", 64, 8, 2048, 1024);
  }
  if (g_only_model && g_cases == 0) {
    std::printf("FAIL   no model check matches '%s'\n", g_only_model);
    ++g_fail;
  }
  if (g_skipped) std::printf("== %d cases skipped (TIERMOE_CHECK_SKIP, TIERMOE_CHECK_SAMPLE_BATCHED) ==\n", g_skipped);
  std::printf("== %d cases, %d failed ==\n", g_cases, g_fail);
  return g_fail ? 1 : 0;
}

}  // namespace tiermoe::cuda_check

// A request the device cannot serve (a config whose weights do not fit its memory, a bad flag) ends
// with its message and status 2, not an uncaught exception.
int main(int argc, char** argv) {
  try {
    return tiermoe::cuda_check::check_main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tiermoe_cuda_check: %s\n", e.what());
    return 2;
  }
}