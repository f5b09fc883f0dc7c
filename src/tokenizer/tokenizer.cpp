// The tokenization pipeline of HF `tokenizers`, wired from the parts in this folder:
// added tokens are cut out of the raw text, each remaining stretch is normalized (and searched
// again for normalized added tokens), pre-tokenized into words, and each word is run through
// BPE; the post-processor's special ids go around the result. Decoding maps ids to token
// strings and runs the decoder chain. Also: tokenizer_config.json and StreamDecoder.
#include "tokenizer/tokenizer.h"

#include "core/files.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "tokenizer/added_tokens.h"
#include "tokenizer/bpe.h"
#include "tokenizer/decoders.h"
#include "tokenizer/normalize.h"
#include "tokenizer/post_process.h"
#include "tokenizer/pretokenize.h"
#include "tokenizer/utf8.h"

namespace tiermoe {

struct Tokenizer::Impl {
  std::unique_ptr<BpeModel> model;
  std::unique_ptr<Normalizer> normalizer;
  AddedTokens added;
  std::unique_ptr<PreTokenizer> pre_tokenizer;
  std::unique_ptr<Decoder> decoder;
  SpecialAffixes affixes;
  std::optional<int32_t> bos, eos;
  std::unordered_map<int32_t, const AddedToken*> added_by_id;
  TokenIdMap added_by_content;
  std::unordered_set<std::string> special_contents;
  int32_t vocab_size = 0;

  std::vector<int32_t> encode(std::string_view text, bool add_special) const;

  // The string HF's decode hands to the decoder for `id`, or nullptr where it skips the id
  // (unknown, or special while skip_special).
  const std::string* decoder_input(int32_t id, bool skip_special) const {
    const std::string* t = nullptr;
    if (auto it = added_by_id.find(id); it != added_by_id.end()) t = &it->second->content;
    else t = model->id_to_token(id);
    if (t && skip_special && special_contents.count(*t)) return nullptr;
    return t;
  }

  // continuation: the ids follow earlier ones that already went through the decoder (a
  // streaming window), so none of them is the sequence's first token.
  std::string decode(std::span<const int32_t> ids, bool skip_special, bool continuation) const {
    std::vector<DecodedPiece> pieces;
    pieces.reserve(ids.size());
    for (int32_t id : ids)
      if (const std::string* t = decoder_input(id, skip_special))
        pieces.push_back(DecodedPiece{*t, !continuation && pieces.empty(), false});
    std::string out;
    if (!decoder) {
      // HF joins with spaces when there is no decoder
      for (size_t i = 0; i < pieces.size(); ++i) out += (i || continuation ? " " : "") + pieces[i].text;
      return out;
    }
    decoder->apply(pieces);
    for (const DecodedPiece& p : pieces) out += p.text;
    return out;
  }
};

namespace {

using nlohmann::json;

// bos_token / eos_token: a string, {"content": ...} (an AddedToken), or null.
std::optional<std::string> config_token(const JsonNode& node) {
  if (node.is_null()) return std::nullopt;
  if (node.is_string()) return node.str();
  if (node.is_object()) return node.required("content").str();
  node.fail("must be a string, an object with \"content\", or null");
}

}  // namespace

std::vector<int32_t> Tokenizer::Impl::encode(std::string_view text, bool add_special) const {
  if (size_t bad = utf8_find_invalid(text); bad != std::string_view::npos)
    throw InputError("tokenizer: input text is not valid UTF-8 (byte " + std::to_string(bad) + ")");
  std::vector<int32_t> ids;
  if (add_special) ids = affixes.prefix;
  std::vector<TextSegment> raw, norm;
  std::vector<Piece> pieces;
  added.split(text, false, raw);
  for (const TextSegment& seg : raw) {
    if (seg.id >= 0) {
      ids.push_back(seg.id);
      continue;
    }
    std::string s(text.substr(seg.begin, seg.end - seg.begin));
    if (normalizer) normalizer->apply(s);
    norm.clear();
    added.split(s, true, norm);
    for (const TextSegment& n : norm) {
      if (n.id >= 0) {
        ids.push_back(n.id);
        continue;
      }
      pieces.clear();
      pieces.push_back(Piece{s.substr(n.begin, n.end - n.begin), seg.begin == 0 && n.begin == 0});
      if (pre_tokenizer) pre_tokenizer->apply(pieces);
      for (const Piece& p : pieces) model->tokenize(p.text, ids);
    }
  }
  if (add_special) ids.insert(ids.end(), affixes.suffix.begin(), affixes.suffix.end());
  return ids;
}

Tokenizer Tokenizer::load(const std::string& model_dir) {
  const std::string path = (std::filesystem::path(model_dir) / "tokenizer.json").string();
  auto impl = std::make_unique<Impl>();
  try {
    const json doc = read_json_file(path);
    const JsonNode root(doc, path);
    root.expect_object();
    impl->model = std::make_unique<BpeModel>(root.required("model"));
    impl->normalizer = parse_normalizer(root.get("normalizer"));
    impl->added = AddedTokens(root.get("added_tokens"), impl->normalizer.get());
    impl->pre_tokenizer = parse_pre_tokenizer(root.get("pre_tokenizer"));
    impl->affixes = parse_post_processor(root.get("post_processor"));
    impl->decoder = parse_decoder(root.get("decoder"));
  } catch (const json::exception& e) {  // a shape the explicit checks did not foresee
    throw InputError(path + ": " + e.what());
  }

  Impl& t = *impl;
  t.vocab_size = t.model->max_id() + 1;
  for (const AddedToken& a : t.added.tokens()) {
    t.added_by_id[a.id] = &a;
    t.added_by_content.emplace(a.content, a.id);
    if (a.special) t.special_contents.insert(a.content);
    t.vocab_size = std::max(t.vocab_size, a.id + 1);
  }
  auto lookup = [&t](std::string_view s) -> std::optional<int32_t> {
    if (auto it = t.added_by_content.find(s); it != t.added_by_content.end()) return it->second;
    return t.model->token_to_id(s);
  };
  for (int32_t id : t.affixes.prefix)
    if (id >= t.vocab_size) throw InputError(path + ": post_processor uses id " + std::to_string(id) + ", outside the vocabulary");
  for (int32_t id : t.affixes.suffix)
    if (id >= t.vocab_size) throw InputError(path + ": post_processor uses id " + std::to_string(id) + ", outside the vocabulary");

  // tokenizer_config.json (optional): names BOS/EOS; add_bos_token / add_eos_token, where
  // present, decide that side of what encode(add_special=true) adds (Llama-style).
  const std::string cfg_path = (std::filesystem::path(model_dir) / "tokenizer_config.json").string();
  bool cfg_has_bos = false;
  if (std::filesystem::exists(cfg_path)) {
    const json cfg_doc = read_json_file(cfg_path);
    const JsonNode cfg(cfg_doc, cfg_path);
    cfg.expect_object();
    try {
      auto resolve = [&](const char* key) -> std::optional<int32_t> {
        const JsonNode n = cfg.get(key);
        const std::optional<std::string> name = config_token(n);
        if (!name) return std::nullopt;
        const std::optional<int32_t> id = lookup(*name);
        if (!id) n.fail("'" + *name + "' is not in the vocabulary of " + path);
        return id;
      };
      cfg_has_bos = cfg.json().contains("bos_token");
      t.bos = resolve("bos_token");
      t.eos = resolve("eos_token");
      const JsonNode add_bos = cfg.get("add_bos_token"), add_eos = cfg.get("add_eos_token");
      if (!add_bos.is_null()) {
        t.affixes.prefix.clear();
        if (add_bos.boolean()) {
          if (!t.bos) add_bos.fail("is true but bos_token is not set");
          t.affixes.prefix.push_back(*t.bos);
        }
      }
      if (!add_eos.is_null()) {
        t.affixes.suffix.clear();
        if (add_eos.boolean()) {
          if (!t.eos) add_eos.fail("is true but eos_token is not set");
          t.affixes.suffix.push_back(*t.eos);
        }
      }
    } catch (const json::exception& e) {
      throw InputError(cfg_path + ": " + e.what());
    }
  }
  // Without a configured BOS, a template that puts one token first names it.
  if (!cfg_has_bos && !t.bos && t.affixes.prefix.size() == 1) t.bos = t.affixes.prefix[0];
  return Tokenizer(std::move(impl));
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special) const {
  return impl_->encode(text, add_special);
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  return impl_->decode(ids, skip_special, false);
}

int32_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (auto it = impl_->added_by_content.find(token); it != impl_->added_by_content.end()) return it->second;
  return impl_->model->token_to_id(token);
}

std::optional<int32_t> Tokenizer::bos_id() const { return impl_->bos; }
std::optional<int32_t> Tokenizer::eos_id() const { return impl_->eos; }

bool Tokenizer::is_special(int32_t id) const {
  auto it = impl_->added_by_id.find(id);
  return it != impl_->added_by_id.end() && it->second->special;
}

// Each step decodes the window (context + new ids) and returns what lies beyond the text
// already returned. A trailing U+FFFD may be half a character still arriving, so it is held
// back. Once everything is returned, the ids of this step become the next step's context.
StreamDecoder::StreamDecoder(const Tokenizer& tok, bool skip_special) : tok_(tok), skip_special_(skip_special) {}

std::string StreamDecoder::push(int32_t id) {
  const Tokenizer::Impl& impl = *tok_.impl_;
  ids_.push_back(id);
  const std::string text = impl.decode(ids_, skip_special_, continuation_);
  size_t stable = text.size();
  while (stable >= kReplacementChar.size() &&
         std::string_view(text).substr(stable - kReplacementChar.size(), kReplacementChar.size()) == kReplacementChar)
    stable -= kReplacementChar.size();
  if (stable <= emitted_) return {};
  std::string out = text.substr(emitted_, stable - emitted_);
  if (stable < text.size()) {
    emitted_ = stable;
    return out;
  }
  for (size_t i = 0; i < context_; ++i)
    continuation_ = continuation_ || impl.decoder_input(ids_[i], skip_special_) != nullptr;
  ids_.erase(ids_.begin(), ids_.begin() + std::ptrdiff_t(context_));
  context_ = ids_.size();
  emitted_ = impl.decode(ids_, skip_special_, continuation_).size();
  return out;
}

std::string StreamDecoder::flush() {
  const Tokenizer::Impl& impl = *tok_.impl_;
  const std::string text = impl.decode(ids_, skip_special_, continuation_);
  std::string out = text.size() > emitted_ ? text.substr(emitted_) : std::string();
  for (int32_t id : ids_) continuation_ = continuation_ || impl.decoder_input(id, skip_special_) != nullptr;
  ids_.clear();
  context_ = 0;
  emitted_ = 0;
  return out;
}

}  // namespace tiermoe
