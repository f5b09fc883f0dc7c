// Added tokens of tokenizer.json ("added_tokens"): special and user tokens that are cut out of
// the input before normalization and pre-tokenization, as HF's AddedVocabulary does: leftmost-
// longest matching, with the single_word / lstrip / rstrip rules. Tokens flagged "normalized"
// are matched in the normalized text, against their own normalized form.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/json_node.h"

namespace tiermoe {

class Normalizer;

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool single_word = false, lstrip = false, rstrip = false, normalized = false, special = false;
};

// A stretch of text: either plain text (id < 0) or one matched added token.
struct TextSegment {
  size_t begin, end;  // byte range in the text that was split
  int32_t id;
};

class AddedTokens {
 public:
  AddedTokens() = default;
  // Parses "added_tokens" and builds the matchers; normalized tokens are matched against their
  // content as `normalizer` rewrites it (HF does the same).
  AddedTokens(const JsonNode& list, const Normalizer* normalizer);

  // Splits `text` on the raw (normalized=false) or the normalized (normalized=true) tokens.
  // Segments cover the text in order; empty plain segments are omitted.
  void split(std::string_view text, bool normalized, std::vector<TextSegment>& out) const;

  const std::vector<AddedToken>& tokens() const { return tokens_; }

 private:
  // A byte trie over token contents; children are few, so a sorted list beats a 256-array.
  struct Node {
    std::vector<std::pair<uint8_t, int32_t>> children;
    int32_t token = -1;  // index into tokens_ of the token ending here
  };
  struct Matcher {
    std::vector<Node> nodes{Node{}};
    bool first_byte[256] = {};
    void add(std::string_view pattern, int32_t token);
    // Longest pattern starting at text[pos]: token index and length, or -1.
    int32_t longest_at(std::string_view text, size_t pos, size_t* len) const;
  };
  void split_with(const Matcher& m, std::string_view text, std::vector<TextSegment>& out) const;

  std::vector<AddedToken> tokens_;
  Matcher raw_, normalized_;
};

}  // namespace tiermoe
