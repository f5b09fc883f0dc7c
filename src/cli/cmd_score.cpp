#include <cstdio>

#include <nlohmann/json.hpp>

#include "core/check.h"

#include "cli/common.h"

namespace tiermoe {

int run_score(const CommonOptions& c, const std::string& ids_text, const std::string& ids_file,
              const std::string& logits_at_text) {
  const std::vector<int32_t> ids = ids_file.empty() ? parse_id_list(ids_text, "--ids")
                                                    : parse_id_list(read_text_file(ids_file), ids_file);
  const std::vector<int> logits_at = parse_int_list(logits_at_text, "--logits-at");
  Engine engine(engine_options(c));
  ScoreResult r = engine.score(ids, logits_at);
  nlohmann::json logits = nlohmann::json::object();
  for (size_t i = 0; i < logits_at.size(); ++i) logits[std::to_string(logits_at[i])] = r.logits[i];
  // One token has no next token to score: no mean (null), rather than a mean of 0.
  const bool scored = !r.nll.empty();
  nlohmann::json out = {{"nll", r.nll},
                         {"mean_nll", scored ? nlohmann::json(r.mean_nll) : nlohmann::json()},
                         {"logits", logits}};
  if (c.json) {
    std::printf("%s\n", out.dump().c_str());
  } else if (scored) {
    std::printf("tokens %zu  mean nll %.6f  perplexity %.4f\n", ids.size(), r.mean_nll, std::exp(r.mean_nll));
  } else {
    std::printf("tokens %zu  (no next token to score)\n", ids.size());
  }
  return 0;
}

}  // namespace tiermoe
