#include <chrono>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "core/check.h"

#include "cli/common.h"

namespace tiermoe {

int run_generate(const CommonOptions& c, const std::string& prompt, const std::string& prompt_ids, int max_tokens,
                 float temperature, float top_p, int top_k, long long seed, bool greedy,
                 const std::vector<std::string>& stop) {
  Engine engine(engine_options(c));
  GenerateRequest req;
  req.prompt = prompt_ids.empty() ? engine.tokenizer().encode(prompt, true) : parse_id_list(prompt_ids, "--prompt-ids");
  req.max_tokens = max_tokens;
  req.stop = stop;
  req.sampling.temperature = greedy ? 0.f : temperature;
  req.sampling.top_p = top_p;
  req.sampling.top_k = top_k;
  req.sampling.seed = seed >= 0 ? uint64_t(seed) : uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());

  if (c.json) {
    GenerateResult r = engine.generate(req);
    nlohmann::json out = {{"ids", r.ids}, {"text", r.text}, {"finish_reason", r.finish_reason}};
    std::printf("%s\n", out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    return 0;
  }
  // The prompt is echoed once generate() has accepted the request, so that a bad flag's error
  // is all that is printed.
  bool echoed = prompt.empty();
  auto echo = [&] {
    if (!echoed) std::fputs(prompt.c_str(), stdout);
    echoed = true;
  };
  GenerateResult r = engine.generate(req, [&](std::string_view s) {
    echo();
    std::fwrite(s.data(), 1, s.size(), stdout);
    std::fflush(stdout);
  });
  echo();
  std::fputc('\n', stdout);
  std::fflush(stdout);
  const double tps = r.decode_seconds > 0 ? double(r.ids.size()) / r.decode_seconds : 0;
  std::fprintf(stderr, "[%zu prompt tokens in %.3f s, %zu generated at %.1f tokens/s, finish: %s]\n", req.prompt.size(),
               r.prefill_seconds, r.ids.size(), tps, r.finish_reason.c_str());
  return 0;
}

}  // namespace tiermoe
