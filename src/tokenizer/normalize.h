// Normalizers of tokenizer.json ("normalizer" field): text rewrites applied to each stretch of
// input between added tokens, before pre-tokenization. Supported: Sequence, Prepend, Replace,
// NFC/NFD/NFKC/NFKD (ICU), Lowercase, Strip.
#pragma once
#include <memory>
#include <string>

#include "tokenizer/json_node.h"

namespace tiermoe {

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual void apply(std::string& text) const = 0;  // text is valid UTF-8 and stays so
};

// nullptr for a null normalizer. Throws InputError naming the field if unsupported.
std::unique_ptr<Normalizer> parse_normalizer(const JsonNode& node);

// Unicode properties shared with the added-token matcher (Rust's char::is_whitespace and \w).
bool is_unicode_whitespace(uint32_t cp);
bool is_word_char(uint32_t cp);

}  // namespace tiermoe
