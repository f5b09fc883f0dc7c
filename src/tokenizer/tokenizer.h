// Tokenizer read from a Hugging Face tokenizer.json (+ tokenizer_config.json):
// byte-level BPE (GPT-2 / Qwen / OLMoE style, regex pre-tokenizer) and SentencePiece-style
// BPE (Llama / Mistral: metaspace, byte fallback), with special (added) tokens.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tiermoe {

class Tokenizer {
 public:
  // Reads <dir>/tokenizer.json and, if present, <dir>/tokenizer_config.json.
  // Throws InputError naming the file and field on anything unsupported or malformed.
  static Tokenizer load(const std::string& model_dir);
  ~Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;

  // Special tokens in `text` are matched as single ids. add_special applies the
  // post-processor (e.g. a BOS token for Llama-style tokenizers), as HF's add_special_tokens.
  std::vector<int32_t> encode(std::string_view text, bool add_special = false) const;
  // skip_special drops special tokens from the text, as HF's skip_special_tokens.
  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;

  int32_t vocab_size() const;
  std::optional<int32_t> token_to_id(std::string_view token) const;
  std::optional<int32_t> bos_id() const;
  std::optional<int32_t> eos_id() const;
  bool is_special(int32_t id) const;

  struct Impl;

 private:
  friend class StreamDecoder;  // decodes windows of ids through Impl
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Turns a stream of ids into text pieces that are always whole UTF-8: bytes of a character
// split across tokens are held back until the character is complete.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok, bool skip_special = true);
  std::string push(int32_t id);  // the new complete text, possibly empty
  std::string flush();           // what is left at the end (invalid bytes as U+FFFD)

 private:
  const Tokenizer& tok_;
  bool skip_special_;
  std::vector<int32_t> ids_;
  size_t emitted_ = 0;  // bytes of decode(ids_) already returned
  // ids_ is a window: its first context_ ids were fully returned in an earlier step and are kept
  // only so that the decoder sees their effect on what follows (joins, stripped spaces).
  size_t context_ = 0;
  bool continuation_ = false;  // ids before the window gave the decoder input
};

}  // namespace tiermoe
