#include <cstdio>

#include <nlohmann/json.hpp>

#include "core/check.h"

#include "cli/common.h"
#include "tokenizer/tokenizer.h"

namespace tiermoe {

int run_tokenize(const CommonOptions& c, const std::string& text, const std::string& file) {
  Tokenizer tok = Tokenizer::load(c.model_dir);
  const std::vector<int32_t> ids = tok.encode(file.empty() ? text : read_text_file(file));
  if (c.json) {
    std::printf("%s\n", nlohmann::json({{"ids", ids}}).dump().c_str());
  } else {
    for (size_t i = 0; i < ids.size(); ++i) std::printf("%s%d", i ? " " : "", ids[i]);
    std::printf("\n");
  }
  return 0;
}

}  // namespace tiermoe
