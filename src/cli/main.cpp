// tiermoe command line: generate, tokenize, score, ppl, bench, serve.
#include <cstdio>
#include <exception>

#include <CLI/CLI.hpp>

#include "cli/common.h"
#include "core/check.h"

using namespace tiermoe;

namespace {

void add_common(CLI::App* cmd, CommonOptions& c, bool json_flag = true) {
  cmd->add_option("--model", c.model_dir, "Hugging Face model directory")->required();
  cmd->add_option("--kv", c.kv, "KV cache preset: f32 (exact reference), bf16, fp8-all (every token in FP8), fp8, "
                  "kivi2, kivi4, hadamard2, hadamard3, oskvp, rvq-tiers, default; with --backend cuda: bf16 or "
                  "fp8-all")->capture_default_str();
  cmd->add_option("--kv-config", c.kv_config, "JSON file of KV cache settings (overrides --kv; see docs/kv_codecs.md)");
  cmd->add_option("--kv-profile", c.kv_profile, "Offline KV calibration written by `tiermoe calibrate`");
  cmd->add_option("--threads", c.threads, "CPU threads (default: all cores)")->check(CLI::Range(0, 1024));
  if (json_flag) cmd->add_flag("--json", c.json, "Machine-readable output");
}

void add_backend(CLI::App* cmd, CommonOptions& c) {
  cmd->add_option("--backend", c.backend, "cpu or cuda (KV cache in BF16)")->capture_default_str();
  cmd->add_option("--load-format", c.load_format, "auto (checkpoint) or dummy (config.json's shapes, random weights "
                  "on the GPU)")->capture_default_str();
  cmd->add_option("--gpu-kv-gib", c.gpu_kv_gib, "--backend cuda: GiB of GPU memory for the paged KV cache "
                  "(default: what the weights leave, less a reserve)")->check(CLI::PositiveNumber);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tiermoe: Mixture-of-Experts inference engine"};
  app.require_subcommand(1);
  CommonOptions c;

  auto* gen = app.add_subcommand("generate", "Generate text from a prompt, streamed to stdout");
  add_common(gen, c);
  add_backend(gen, c);
  std::string prompt, prompt_ids;
  int max_tokens = 128, top_k = 40;
  float temperature = 0.8f, top_p = 0.95f;
  long long seed = -1;
  bool greedy = false;
  std::vector<std::string> stop;
  auto* p_opt = gen->add_option("-p,--prompt", prompt, "Prompt text");
  auto* ids_opt = gen->add_option("--prompt-ids", prompt_ids, "Prompt as token ids: 1,2,3");
  p_opt->excludes(ids_opt);
  gen->add_option("--max-tokens", max_tokens, "Tokens to generate at most")->capture_default_str();
  gen->add_option("--temperature", temperature, "Sampling temperature (0: greedy)")->capture_default_str();
  gen->add_option("--top-p", top_p, "Nucleus sampling mass")->capture_default_str();
  gen->add_option("--top-k", top_k, "Sample among the k most likely tokens (0: all)")->capture_default_str();
  gen->add_option("--seed", seed, "Random seed (default: from the clock)");
  gen->add_flag("--greedy", greedy, "Greedy decoding (same as --temperature 0)");
  gen->add_option("--stop", stop, "Stop before this string (repeatable)");

  auto* tok = app.add_subcommand("tokenize", "Print the token ids of a text");
  tok->add_option("--model", c.model_dir, "Hugging Face model directory")->required();
  tok->add_flag("--json", c.json, "Machine-readable output");
  std::string text, file;
  auto* t_opt = tok->add_option("--text", text, "Text to tokenize");
  auto* f_opt = tok->add_option("--file", file, "File to tokenize");
  t_opt->excludes(f_opt);

  auto* score = app.add_subcommand("score", "Negative log-likelihood of each token given the ones before it");
  add_common(score, c);
  std::string ids, ids_file, logits_at;
  auto* i_opt = score->add_option("--ids", ids, "Token ids: 1,2,3");
  auto* if_opt = score->add_option("--ids-file", ids_file, "File of token ids (comma/space separated or a JSON list)");
  i_opt->excludes(if_opt);
  score->add_option("--logits-at", logits_at, "Positions whose logits to print: 0,255");

  auto* ppl = app.add_subcommand("ppl", "Perplexity of a text file over non-overlapping windows");
  add_common(ppl, c);
  int ctx = 2048, windows = 0;
  ppl->add_option("--file", file, "Text file")->required();
  ppl->add_option("--ctx", ctx, "Tokens per window")->capture_default_str();
  ppl->add_option("--windows", windows, "Windows to evaluate (default: all)");
  std::string ref_kv;
  ppl->add_option("--ref-kv", ref_kv, "Also run this KV preset (e.g. bf16) and report the mean KL divergence against it");

  auto* needle = app.add_subcommand("needle", "Retrieval: a value planted early in a long context, asked for late");
  add_common(needle, c);
  std::string needle_file, needle_lengths = "1024,2048,3072,4096";
  int needle_trials = 9;
  needle->add_option("--file", needle_file, "Haystack text (default: the model's heldout.txt)");
  needle->add_option("--lengths", needle_lengths, "Context lengths in tokens")->capture_default_str();
  needle->add_option("--trials", needle_trials, "Depths per length")->capture_default_str();

  auto* calib = app.add_subcommand("calibrate", "Offline KV calibration: fit the --kv preset's codecs on a text");
  add_common(calib, c);
  std::string calib_file, calib_out;
  int calib_tokens = 4096, calib_offset = 0;
  calib->add_option("--file", calib_file, "Calibration text")->required();
  calib->add_option("-o,--output", calib_out, "Profile to write")->required();
  calib->add_option("--tokens", calib_tokens, "Calibration tokens (at most the model's context)")->capture_default_str();
  calib->add_option("--offset", calib_offset, "Skip this many tokens of the text first")->capture_default_str();

  auto* bench = app.add_subcommand("bench", "Prefill and decode speed of one stream (medians over repeats)");
  add_common(bench, c);
  BenchOptions bo;
  bench->get_option("--model")->required(false);
  auto* pt_opt = bench->add_option("--prompt-tokens", bo.prompt_tokens, "Prompt length (random ids)")->capture_default_str();
  bench->add_option("--ctx", bo.prompt_tokens, "Same as --prompt-tokens: context before decoding")->excludes(pt_opt);
  bench->add_option("--gen", bo.gen_tokens, "Tokens decoded per repeat")->capture_default_str();
  bench->add_option("--repeats", bo.repeats, "Timed repeats (after one warm-up)")->capture_default_str();
  add_backend(bench, c);
  bench->add_option("--config", bo.config_file, "config.json instead of --model, for --load-format dummy");
  bench->add_option("--batch", bo.batch, "Concurrent sequences, one token each per step")->capture_default_str();
  bench->add_option("--temperature", bo.temperature, "Sample decode steps at this temperature (0: greedy)")->capture_default_str();
  bench->add_option("--top-p", bo.top_p, "Nucleus mass when sampling")->capture_default_str();
  bench->add_option("--top-k", bo.top_k, "Top-k when sampling (0: all)")->capture_default_str();
  bench->add_flag("--no-overlap{false}", bo.overlap,
                  "Run each decode step after the last one's tokens reach the host (default: the next step is "
                  "queued first)");

  auto* serve = app.add_subcommand("serve", "OpenAI-compatible HTTP server with continuous batching");
  add_common(serve, c, false);
  add_backend(serve, c);
  ServeOptions so;
  serve->add_option("--host", so.host, "Address to listen on")->capture_default_str();
  serve->add_option("--port", so.port, "Port (0: any free port, printed at start)")->capture_default_str();
  serve->add_option("--served-model-name", so.model_name, "Model id for clients (default: the directory's name)");
  serve->add_option("--max-batch", so.max_batch, "Sequences decoded together at most")->capture_default_str();
  serve->add_option("--max-queue", so.max_queue, "Waiting requests at most (beyond: 429)")->capture_default_str();
  serve->add_option("--step-tokens", so.step_tokens,
                    "Tokens per batched step (decodes + prefill chunks); 0: 256, or 2048 with --backend cuda")
      ->capture_default_str();
  serve->add_option("--kv-memory-mb", so.kv_memory_mb,
                    "KV cache memory admission may reserve; 0: 1024, or the GPU's KV pool with --backend cuda")
      ->capture_default_str();
  serve->add_option("--prefix-cache-mb", so.prefix_cache_mb,
                    "Finished requests' KV kept for prompts that start with the same tokens, within --kv-memory-mb (0: off)")
      ->capture_default_str();
  serve->add_flag("--no-overlap{false}", so.overlap,
                  "Run each decode step after the last one's tokens are handed out (default: the next step is "
                  "queued first)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);  // prints help, or the error with a hint
    return code == 0 ? 0 : 2;      // a bad flag is bad input, as everywhere else
  }

  // The CUDA backend's cache is BF16; the CLI's default (the CPU's tiered cache) does not apply.
  for (auto* cmd : {gen, serve, bench})
    if (*cmd && c.backend == "cuda" && cmd->count("--kv") == 0) c.kv = "bf16";

  try {
    if (*gen) {
      if (prompt.empty() && prompt_ids.empty()) throw InputError("generate: give -p TEXT or --prompt-ids IDS");
      return run_generate(c, prompt, prompt_ids, max_tokens, temperature, top_p, top_k, seed, greedy, stop);
    }
    if (*tok) {
      if (!*t_opt && file.empty()) throw InputError("tokenize: give --text TEXT or --file FILE");
      return run_tokenize(c, text, file);
    }
    if (*score) {
      if (ids.empty() && ids_file.empty()) throw InputError("score: give --ids IDS or --ids-file FILE");
      return run_score(c, ids, ids_file, logits_at);
    }
    if (*ppl) return run_ppl(c, file, ctx, windows, ref_kv);
    if (*needle) return run_needle(c, needle_file, parse_int_list(needle_lengths, "--lengths"), needle_trials);
    if (*calib) return run_calibrate(c, calib_file, calib_out, calib_tokens, calib_offset);
    if (*bench) return run_bench(c, bo);
    if (*serve) return run_serve(c, so);
  } catch (const InputError& e) {
    std::fprintf(stderr, "tiermoe: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tiermoe: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
