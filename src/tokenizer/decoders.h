// Decoders of tokenizer.json ("decoder" field): turn token strings back into text, as HF's
// decode_chain does. Supported: ByteLevel, Metaspace, ByteFallback, Fuse, Strip, Replace,
// Sequence.
//
// Streaming decodes a window of recent tokens, not the whole sequence, so each piece carries
// two flags that stand in for what the window cannot see: whether it holds the very first token
// (Metaspace drops that token's leading '▁'), and whether its left edge continues text from
// before the window (a fused piece then must not lose its leading space to Strip).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "tokenizer/json_node.h"

namespace tiermoe {

struct DecodedPiece {
  std::string text;
  bool first_token = false;  // is (or begins with) the first token of the whole sequence
  bool open_left = false;    // left edge is inside the sequence, not at a token boundary of it
};

class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual void apply(std::vector<DecodedPiece>& pieces) const = 0;
};

// nullptr for a null decoder. Throws InputError naming the field if unsupported.
std::unique_ptr<Decoder> parse_decoder(const JsonNode& node);

}  // namespace tiermoe
