// The regular expressions of tokenizer.json (written for Oniguruma, which HF uses) run on PCRE2
// in UTF + Unicode-property mode, JIT-compiled where available. find_all() walks matches exactly
// as HF's Oniguruma iterator does, empty matches included, because split boundaries depend on it.
#pragma once
#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

struct pcre2_real_code_8;

namespace tiermoe {

class JsonNode;

class Regex {
 public:
  // `where` names the field for error messages ("tokenizer.json: pre_tokenizer.pattern.Regex").
  // literal=true matches `pattern` as plain text (HF's {"String": ...} patterns).
  // Throws InputError if the pattern does not compile.
  Regex(std::string_view pattern, bool literal, std::string where);
  ~Regex();
  Regex(Regex&& o) noexcept;
  Regex& operator=(Regex&&) = delete;
  Regex(const Regex&) = delete;

  // Byte ranges [start, end) of all non-overlapping matches in `text` (valid UTF-8), left to
  // right. Thread-safe.
  void find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& out) const;

 private:
  pcre2_real_code_8* code_ = nullptr;
  std::string where_;
};

// The regex of a tokenizer.json `pattern` member ({"String": text}, matched literally, or
// {"Regex": pattern}), shared by the Replace normalizer and decoder and the Split pre-tokenizer.
Regex parse_pattern(const JsonNode& pattern);

}  // namespace tiermoe
