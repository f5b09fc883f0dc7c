// The BPE model of tokenizer.json ("model" field): turns one pre-tokenized word into ids by
// applying merges lowest rank first, as HF's Word::merge_all does (a heap of candidate pairs
// over a linked list of symbols), with byte fallback and unk handling. Words seen before are
// answered from a cache, which is what makes encoding large files fast.
#pragma once
#include <array>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tokenizer/json_node.h"

namespace tiermoe {

struct StringViewHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using TokenIdMap = std::unordered_map<std::string, int32_t, StringViewHash, std::equal_to<>>;

class BpeModel {
 public:
  // Parses the "model" object. Throws InputError naming the field on anything unsupported.
  explicit BpeModel(const JsonNode& model);

  // Appends the ids of `word` (valid UTF-8) to `out`. Thread-safe.
  void tokenize(std::string_view word, std::vector<int32_t>& out) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  const std::string* id_to_token(int32_t id) const;  // nullptr if no token has this id
  int32_t max_id() const { return int32_t(id_to_token_.size()) - 1; }

 private:
  struct Merge {
    int32_t rank;
    int32_t new_id;
  };
  static uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }
  void merge_word(std::string_view word, std::vector<int32_t>& out) const;

  TokenIdMap vocab_;
  std::vector<std::string> id_to_token_;
  std::vector<bool> id_used_;
  std::unordered_map<uint64_t, Merge> merges_;
  std::array<int32_t, 256> byte_ids_;  // id of "<0xNN>", or -1
  int32_t unk_id_ = -1;
  bool byte_fallback_ = false;
  bool fuse_unk_ = false;
  bool ignore_merges_ = false;

  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringViewHash, std::equal_to<>> cache_;
};

}  // namespace tiermoe
