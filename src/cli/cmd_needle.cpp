// Retrieval: a `NAME = "value"` line planted at several depths of a long held-out context must
// be reproduced when asked for at the end (`assert NAME == "`), greedy, through the KV cache.
#include <cstdio>
#include <filesystem>
#include <algorithm>
#include <random>

#include <nlohmann/json.hpp>

#include "core/check.h"

#include "cli/common.h"

namespace tiermoe {

int run_needle(const CommonOptions& c, const std::string& file_arg, const std::vector<int>& lengths, int trials) {
  if (trials < 1) throw InputError("--trials: must be >= 1");
  Engine engine(engine_options(c));
  const std::string file = file_arg.empty() ? (std::filesystem::path(c.model_dir) / "heldout.txt").string() : file_arg;
  const std::string text = read_text_file(file);
  const Tokenizer& tok = engine.tokenizer();
  for (int L : lengths)
    if (L < 64 || L > engine.config().max_position_embeddings)
      throw InputError("--lengths: " + std::to_string(L) + " is outside [64, " +
                       std::to_string(engine.config().max_position_embeddings) + "]");
  std::mt19937_64 rng(417);
  const char* alnum = "abcdefghijklmnopqrstuvwxyz0123456789";
  nlohmann::json rows = nlohmann::json::array();
  int correct = 0, total = 0;
  ProgressBar bar("needle", lengths.size() * size_t(trials));
  for (size_t li = 0; li < lengths.size(); ++li)
    for (int t = 0; t < trials; ++t) {
      // The answer needs room: a prompt of the full context could not generate a token.
      const int L = std::min(lengths[li], engine.config().max_position_embeddings - 8);
      const std::string name = "SECRET_" + std::to_string(100 + rng() % 900);
      std::string value;
      for (int i = 0; i < 4; ++i) value += alnum[rng() % 36];
      const auto needle = tok.encode("\n" + name + " = \"" + value + "\"\n");
      const auto question = tok.encode("\nassert " + name + " == \"");
      // A different stretch of the haystack for every trial.
      const size_t off = (size_t(total) * 40000) % (text.size() > 200000 ? text.size() - 200000 : 1);
      const auto hay = tok.encode(text.substr(off, size_t(L) * 8));
      const int fill = L - int(needle.size() + question.size());
      if (fill < 8 || int(hay.size()) < fill) throw InputError(file + ": too short a haystack for length " + std::to_string(L));
      const double depth = (t + 0.5) / trials;
      const int at = int(depth * fill);
      std::vector<int32_t> prompt(hay.begin(), hay.begin() + at);
      prompt.insert(prompt.end(), needle.begin(), needle.end());
      prompt.insert(prompt.end(), hay.begin() + at, hay.begin() + fill);
      prompt.insert(prompt.end(), question.begin(), question.end());
      GenerateRequest req;
      req.prompt = prompt;
      req.sampling.temperature = 0;
      req.max_tokens = 6;
      const GenerateResult r = engine.generate(req);
      const bool ok = r.text.rfind(value + "\"", 0) == 0;
      correct += ok;
      ++total;
      rows.push_back({{"length", int(prompt.size())}, {"depth", depth}, {"distance", int(prompt.size()) - at},
                      {"name", name}, {"value", value}, {"output", r.text}, {"correct", ok}});
      bar.update(size_t(total), std::to_string(correct) + "/" + std::to_string(total));
    }
  bar.finish();
  const double acc = double(correct) / total;
  if (c.json) {
    nlohmann::json out = {{"accuracy", acc}, {"correct", correct}, {"trials", total}, {"kv", engine.kv_spec().name},
                          {"kv_profile", c.kv_profile}, {"file", file}, {"rows", rows}};
    std::printf("%s\n", out.dump().c_str());
  } else {
    for (const auto& row : rows)
      std::printf("length %5d depth %.2f distance %5d  %s = \"%s\"  -> %s  %s\n", row["length"].get<int>(),
                  row["depth"].get<double>(), row["distance"].get<int>(), row["name"].get<std::string>().c_str(),
                  row["value"].get<std::string>().c_str(), row["output"].dump().c_str(), row["correct"].get<bool>() ? "ok" : "MISS");
    std::printf("accuracy %.3f (%d/%d), kv %s\n", acc, correct, total, engine.kv_spec().name.c_str());
  }
  return 0;
}

}  // namespace tiermoe
