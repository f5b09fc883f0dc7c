// Pre-tokenizers of tokenizer.json ("pre_tokenizer" field): they cut normalized text into the
// words that BPE sees, and may rewrite them (ByteLevel maps bytes to stand-in characters,
// Metaspace turns spaces into '▁'). Supported: Sequence, ByteLevel, Split, Metaspace, Digits,
// Whitespace, WhitespaceSplit.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tokenizer/json_node.h"

namespace tiermoe {

struct Piece {
  std::string text;
  // Starts at offset 0 of the caller's input: Metaspace's prepend_scheme "first" only prefixes
  // that piece (HF tests offsets_original().0 == 0).
  bool at_start = false;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Replaces `pieces` with their splits, dropping empty ones as HF does.
  virtual void apply(std::vector<Piece>& pieces) const = 0;
};

// nullptr for a null pre-tokenizer. Throws InputError naming the field if unsupported.
std::unique_ptr<PreTokenizer> parse_pre_tokenizer(const JsonNode& node);

// HF's SplitDelimiterBehavior.
enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

// Splits `piece` at `matches` (sorted, non-overlapping byte ranges) the way HF's
// NormalizedString::split does, appending the non-empty results to `out`.
void split_piece(const Piece& piece, const std::vector<std::pair<size_t, size_t>>& matches,
                 SplitBehavior behavior, bool invert, std::vector<Piece>& out);

}  // namespace tiermoe
