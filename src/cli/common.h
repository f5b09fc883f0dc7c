// Small helpers shared by the CLI commands.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace tiermoe {

struct CommonOptions {
  std::string model_dir;
  std::string kv = "default";  // KV cache preset; the library default (EngineOptions) stays exact f32
  int threads = 0;
  bool json = false;
  std::string kv_config, kv_profile;
  std::string backend = "cpu", load_format = "auto";  // generate, serve, bench
  double gpu_kv_gib = 0;                                // 0: the backend's default
};

std::string read_text_file(const std::string& path);  // throws InputError naming the path

inline EngineOptions engine_options(const CommonOptions& c) {
  EngineOptions o;
  o.model_dir = c.model_dir;
  o.kv = c.kv;
  o.threads = c.threads;
  o.kv_config = c.kv_config;
  o.kv_profile = c.kv_profile;
  o.backend = c.backend;
  o.load_format = c.load_format;
  o.gpu_kv_bytes = size_t(c.gpu_kv_gib * double(size_t(1) << 30));
  return o;
}

// "1,2,3", "1 2 3", or a JSON list; `what` names the flag in errors.
std::vector<int32_t> parse_id_list(const std::string& text, const std::string& what);
std::vector<int> parse_int_list(const std::string& text, const std::string& what);

// A one-line progress bar on stderr, redrawn at most a few times a second.
class ProgressBar {
 public:
  ProgressBar(std::string label, size_t total);
  void update(size_t done, const std::string& suffix = "");
  void finish();

 private:
  std::string label_;
  size_t total_;
  double last_draw_ = -1;
  bool tty_;
};

struct ServeOptions {
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string model_name;  // default: the model directory's name
  int max_batch = 64, max_queue = 128;
  // 0: by backend (cmd_serve.cpp): 256 tokens and 1024 MB on the CPU; with --backend cuda 2048
  // tokens (its prompt passes) and the GPU's KV page pool.
  int step_tokens = 0, kv_memory_mb = 0;
  int prefix_cache_mb = 256;  // SchedulerOptions::prefix_cache_bytes; 0: off
  bool overlap = true;  // decode steps queued ahead (SchedulerOptions::overlap); --no-overlap: one at a time
};

int run_generate(const CommonOptions& c, const std::string& prompt, const std::string& prompt_ids, int max_tokens,
                 float temperature, float top_p, int top_k, long long seed, bool greedy,
                 const std::vector<std::string>& stop);
int run_tokenize(const CommonOptions& c, const std::string& text, const std::string& file);
int run_score(const CommonOptions& c, const std::string& ids, const std::string& ids_file, const std::string& logits_at);
int run_ppl(const CommonOptions& c, const std::string& file, int ctx, int windows, const std::string& ref_kv = "");
int run_needle(const CommonOptions& c, const std::string& file, const std::vector<int>& lengths, int trials);
int run_calibrate(const CommonOptions& c, const std::string& file, const std::string& out, int tokens, int offset);

struct BenchOptions {
  int prompt_tokens = 512, gen_tokens = 128, repeats = 5, batch = 1;
  std::string config_file;  // config.json instead of --model, for --load-format dummy
  float temperature = 0.f, top_p = 1.f;  // decode steps sample like this (default: greedy)
  int top_k = 0;
  bool overlap = true;  // decode steps queued ahead (Backend::queue_sample); --no-overlap: one at a time
};
int run_bench(const CommonOptions& c, const BenchOptions& b);
int run_serve(const CommonOptions& c, const ServeOptions& s);

}  // namespace tiermoe
