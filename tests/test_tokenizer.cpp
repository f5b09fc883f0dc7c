// Tokenizer tests: the embedded tinymix-code model against the reference token ids, fixtures
// written by HF `tokenizers` (tests/fixtures/tokenizers/<name>/), small synthetic tokenizers
// for SentencePiece-style byte fallback, Metaspace, byte-level + NFC, added-token rules and
// streaming, and error messages for bad files.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "io/safetensors.h"
#include "tokenizer/pretokenize.h"
#include "tokenizer/regex.h"
#include "tokenizer/tokenizer.h"
#include "test_util.h"

namespace fs = std::filesystem;
using nlohmann::json;
using namespace tiermoe;

namespace {

const fs::path kRoot = TIERMOE_SOURCE_DIR;
const char* kSp = "\xE2\x96\x81";  // '▁'

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The first n code points of a UTF-8 string (Python's s[:n]).
std::string first_code_points(const std::string& s, size_t n) {
  size_t i = 0;
  for (size_t count = 0; i < s.size() && count < n; ++count) {
    ++i;
    while (i < s.size() && (static_cast<uint8_t>(s[i]) & 0xC0) == 0x80) ++i;
  }
  return s.substr(0, i);
}

std::string stream_decode(const Tokenizer& tok, const std::vector<int32_t>& ids, bool skip_special) {
  StreamDecoder d(tok, skip_special);
  std::string out;
  for (int32_t id : ids) out += d.push(id);
  return out + d.flush();
}

// A model directory in /tmp holding the given tokenizer.json (and tokenizer_config.json).
class TempModel {
 public:
  explicit TempModel(const std::string& tokenizer_json, const std::string& config_json = "") {
    static std::atomic<int> counter{0};
    dir_ = fs::temp_directory_path() /
           ("tiermoe_tok_" + std::to_string(getpid()) + "_" + std::to_string(counter++));
    fs::create_directories(dir_);
    if (!tokenizer_json.empty()) std::ofstream(dir_ / "tokenizer.json") << tokenizer_json;
    if (!config_json.empty()) std::ofstream(dir_ / "tokenizer_config.json") << config_json;
  }
  ~TempModel() { fs::remove_all(dir_); }
  std::string dir() const { return dir_.string(); }
  Tokenizer load() const { return Tokenizer::load(dir()); }

 private:
  fs::path dir_;
};

json added(int id, const std::string& content, bool special = true, bool lstrip = false, bool rstrip = false,
           bool single_word = false, bool normalized = false) {
  return {{"id", id},         {"content", content}, {"single_word", single_word}, {"lstrip", lstrip},
          {"rstrip", rstrip}, {"normalized", normalized}, {"special", special}};
}

std::string byte_name(int b) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "<0x%02X>", b);
  return buf;
}

// SentencePiece-style vocabulary: <unk> <s> </s>, the 256 byte tokens (ids 3..258), then
// `pieces` from id 259 on; merges are given as pairs.
json sp_model(const std::vector<std::string>& pieces, const std::vector<std::pair<std::string, std::string>>& merges,
              bool byte_fallback = true, bool fuse_unk = true) {
  json vocab = json::object();
  vocab["<unk>"] = 0;
  vocab["<s>"] = 1;
  vocab["</s>"] = 2;
  for (int b = 0; b < 256; ++b) vocab[byte_name(b)] = 3 + b;
  int id = 259;
  for (const auto& p : pieces) vocab[p] = id++;
  json m = json::array();
  for (const auto& [a, b] : merges) m.push_back(json::array({a, b}));
  return {{"type", "BPE"},         {"dropout", nullptr},      {"unk_token", "<unk>"},
          {"fuse_unk", fuse_unk},  {"byte_fallback", byte_fallback}, {"ignore_merges", false},
          {"vocab", vocab},        {"merges", m},
          {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr}};
}

json sp_added() { return json::array({added(0, "<unk>"), added(1, "<s>"), added(2, "</s>")}); }

std::string sp(const std::string& s) {  // spaces -> '▁'
  std::string out;
  for (char c : s) out += c == ' ' ? std::string(kSp) : std::string(1, c);
  return out;
}

// Llama-2 style: Prepend + Replace normalizer, no pre-tokenizer, byte fallback, BOS template,
// Replace/ByteFallback/Fuse/Strip decoder.
json llama_like(bool byte_fallback = true, bool fuse_unk = true) {
  const std::vector<std::string> pieces = {sp(" "), "H", "e", "l", "o", "w", "r", "d", sp(" H"), "ll", "ell",
                                           sp(" Hell"), sp(" Hello"), sp(" w"), "or", sp(" wor"), sp(" worl"),
                                           sp(" world")};
  const std::vector<std::pair<std::string, std::string>> merges = {
      {sp(" "), "H"},        {"l", "l"},         {"e", "ll"},          {sp(" H"), "ell"},      {sp(" Hell"), "o"},
      {sp(" "), "w"},        {"o", "r"},         {sp(" w"), "or"},     {sp(" wor"), "l"},      {sp(" worl"), "d"}};
  return {
      {"version", "1.0"},
      {"added_tokens", sp_added()},
      {"normalizer",
       {{"type", "Sequence"},
        {"normalizers",
         {{{"type", "Prepend"}, {"prepend", kSp}},
          {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", kSp}}}}}},
      {"pre_tokenizer", nullptr},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
        {"pair", json::array()},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}}},
      {"decoder",
       {{"type", "Sequence"},
        {"decoders",
         {{{"type", "Replace"}, {"pattern", {{"String", kSp}}}, {"content", " "}},
          {{"type", "ByteFallback"}},
          {{"type", "Fuse"}},
          {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
      {"model", sp_model(pieces, merges, byte_fallback, fuse_unk)}};
}

// Mistral style: Metaspace pre-tokenizer (prepend_scheme "first"), byte fallback.
json metaspace_like() {
  const std::vector<std::string> pieces = {sp(" "), "H", "e", "y", "f", "r", "i", "n", "d", "!", sp(" H"), sp(" He"),
                                           sp(" Hey"), sp(" f"), "ri", sp(" fri"), "en", sp(" frien"), sp(" friend")};
  const std::vector<std::pair<std::string, std::string>> merges = {
      {sp(" "), "H"}, {sp(" H"), "e"}, {sp(" He"), "y"},  {sp(" "), "f"},       {"r", "i"},
      {sp(" f"), "ri"}, {"e", "n"},    {sp(" fri"), "en"}, {sp(" frien"), "d"}};
  const json metaspace = {{"type", "Metaspace"}, {"replacement", kSp}, {"prepend_scheme", "first"}, {"split", true}};
  return {{"version", "1.0"},
          {"added_tokens", sp_added()},
          {"normalizer", nullptr},
          {"pre_tokenizer", metaspace},
          {"post_processor", nullptr},
          {"decoder", {{"type", "Sequence"}, {"decoders", {{{"type", "ByteFallback"}}, metaspace}}}},
          {"model", sp_model(pieces, merges)}};
}

// GPT-2's byte -> stand-in character map, written out independently of the implementation.
std::string byte_char(int b) {
  std::vector<int> bs;
  for (int i = 0; i < 256; ++i)
    if ((i >= 0x21 && i <= 0x7E) || (i >= 0xA1 && i <= 0xAC) || i >= 0xAE) bs.push_back(i);
  int cp = b, n = 0;
  if (std::find(bs.begin(), bs.end(), b) == bs.end()) {
    for (int i = 0; i < b; ++i)
      if (std::find(bs.begin(), bs.end(), i) == bs.end()) ++n;
    cp = 256 + n;
  }
  std::string s;
  if (cp < 0x80) s += char(cp);
  else {
    s += char(0xC0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3F));
  }
  return s;
}

const char* kQwenRegex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Qwen2 style: NFC, Split with the Qwen2 regex, ByteLevel without regex; byte b has id b, then
// "hi" 256, "Ġhi" 257, "Ã©" (é) 258; <|im_start|> 300, <|im_end|> 301.
json qwen_like(json extra_added = json::array()) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  vocab["hi"] = 256;
  vocab[byte_char(' ') + "hi"] = 257;
  vocab[byte_char(0xC3) + byte_char(0xA9)] = 258;
  json merges = json::array({json::array({"h", "i"}), json::array({byte_char(' '), "hi"}),
                             json::array({byte_char(0xC3), byte_char(0xA9)})});
  json add = json::array({added(300, "<|im_start|>"), added(301, "<|im_end|>")});
  for (auto& a : extra_added) add.push_back(a);
  const json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
  return {{"version", "1.0"},
          {"added_tokens", add},
          {"normalizer", {{"type", "NFC"}}},
          {"pre_tokenizer",
           {{"type", "Sequence"},
            {"pretokenizers",
             {{{"type", "Split"}, {"pattern", {{"Regex", kQwenRegex}}}, {"behavior", "Isolated"}, {"invert", false}},
              byte_level}}}},
          {"post_processor", byte_level},
          {"decoder", byte_level},
          {"model",
           {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", ""},
            {"end_of_word_suffix", ""}, {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
            {"vocab", vocab}, {"merges", merges}}}};
}

std::vector<int32_t> bytes_ids(const std::string& s) {
  std::vector<int32_t> ids;
  for (char c : s) ids.push_back(static_cast<uint8_t>(c));
  return ids;
}

// Splits `text` with `regex` (Isolated) and returns the pieces.
std::vector<std::string> regex_pieces(const char* regex, const std::string& text) {
  Regex re(regex, false, "test");
  std::vector<std::pair<size_t, size_t>> m;
  re.find_all(text, m);
  std::vector<Piece> out;
  split_piece(Piece{text, true}, m, SplitBehavior::Isolated, false, out);
  std::vector<std::string> s;
  for (auto& p : out) s.push_back(p.text);
  return s;
}

using tiermoe::test::error_of;

}  // namespace

// ---------------------------------------------------------------- tinymix-code (byte-level BPE)

TEST(TokenizerTinymix, HeldoutPrefixMatchesReference) {
  const fs::path dir = kRoot / "models/tinymix-code";
  ASSERT_TRUE(fs::exists(dir / "heldout.txt")) << "models/tinymix-code/heldout.txt is missing: run scripts/unpack_model.sh";
  const Tokenizer tok = Tokenizer::load(dir.string());
  EXPECT_EQ(tok.vocab_size(), 8192);
  EXPECT_EQ(tok.eos_id(), std::optional<int32_t>(0));
  EXPECT_EQ(tok.bos_id(), std::nullopt);
  EXPECT_TRUE(tok.is_special(0));
  EXPECT_FALSE(tok.is_special(1));
  EXPECT_EQ(tok.token_to_id("<|endoftext|>"), std::optional<int32_t>(0));

  // heldout.txt is not pure ASCII: Python's text[:20000] counts code points.
  const std::string text = first_code_points(read_text(dir / "heldout.txt"), 20000);
  ASSERT_GT(text.size(), 20000u);

  const Checkpoint ref = Checkpoint::open_file((dir / "reference.safetensors").string());
  const TensorView& t = ref.get("heldout_prefix_ids");
  ASSERT_TRUE(t.dtype == DType::I32 || t.dtype == DType::I64) << "unexpected dtype " << dtype_name(t.dtype);
  std::vector<int32_t> expected(size_t(t.numel()));
  for (size_t i = 0; i < expected.size(); ++i)
    expected[i] = t.dtype == DType::I32 ? static_cast<const int32_t*>(t.data)[i]
                                        : int32_t(static_cast<const int64_t*>(t.data)[i]);

  const std::vector<int32_t> ids = tok.encode(text);
  ASSERT_EQ(ids.size(), expected.size());
  for (size_t i = 0; i < ids.size(); ++i) ASSERT_EQ(ids[i], expected[i]) << "first difference at token " << i;
  EXPECT_EQ(tok.encode(text, true), ids);  // no post-processor: nothing added

  EXPECT_EQ(tok.decode(ids), text);
  EXPECT_EQ(stream_decode(tok, ids, false), text);
}

TEST(TokenizerTinymix, FullHeldoutSpeedAndRoundTrip) {
  const fs::path dir = kRoot / "models/tinymix-code";
  ASSERT_TRUE(fs::exists(dir / "heldout.txt")) << "models/tinymix-code/heldout.txt is missing: run scripts/unpack_model.sh";
  const Tokenizer tok = Tokenizer::load(dir.string());
  const std::string text = read_text(dir / "heldout.txt");
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<int32_t> ids = tok.encode(text);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[          ] encoded %zu bytes into %zu tokens in %.3f s (%.1f MB/s)\n", text.size(), ids.size(),
              secs, text.size() / secs / 1e6);
  EXPECT_LT(secs, 30.0);  // generous: sanitizer builds are slow; the optimized build takes well under 1 s
  EXPECT_EQ(tok.decode(ids), text);
  // <|endoftext|> separates files in heldout.txt and must come out as id 0.
  EXPECT_NE(std::find(ids.begin(), ids.end(), 0), ids.end());
  // skip_special removes exactly the separators
  std::string no_eot = text;
  for (size_t p; (p = no_eot.find("<|endoftext|>")) != std::string::npos;) no_eot.erase(p, 13);
  EXPECT_EQ(tok.decode(ids, true), no_eot);
}

// ---------------------------------------------------------------- fixtures from HF tokenizers

TEST(TokenizerFixtures, MatchHuggingFace) {
  const fs::path root = kRoot / "tests/fixtures/tokenizers";
  if (!fs::exists(root)) GTEST_SKIP() << root << " does not exist yet (fixtures not generated)";
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(root))
    if (e.is_directory()) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  for (const char* expected : {"llama_style", "metaspace_style", "qwen_style"})
    EXPECT_NE(std::find(names.begin(), names.end(), expected), names.end()) << "fixture " << expected << " is missing";

  for (const std::string& name : names) {
    SCOPED_TRACE("fixture " + name);
    const fs::path dir = root / name;
    ASSERT_TRUE(fs::exists(dir / "cases.json")) << dir << " has no cases.json";
    const Tokenizer tok = Tokenizer::load(dir.string());
    const json cases = json::parse(read_text(dir / "cases.json"));
    ASSERT_TRUE(cases.contains("cases") && !cases["cases"].empty()) << dir << "/cases.json has no cases";
    size_t i = 0;
    for (const json& c : cases["cases"]) {
      const std::string text = c["text"];
      SCOPED_TRACE("case " + std::to_string(i++) + ": " + json(text).dump());
      const auto ids = c["ids"].get<std::vector<int32_t>>();
      EXPECT_EQ(tok.encode(text, false), ids);
      EXPECT_EQ(tok.encode(text, true), c["ids_with_special"].get<std::vector<int32_t>>());
      const std::string decoded = c["decoded"];
      EXPECT_EQ(tok.decode(ids, false), decoded);
      // Streaming reproduces the full decode whenever that is valid text (no U+FFFD).
      if (decoded.find("\xEF\xBF\xBD") == std::string::npos) {
        EXPECT_EQ(stream_decode(tok, ids, false), decoded);
        EXPECT_EQ(stream_decode(tok, ids, true), tok.decode(ids, true));
      }
    }
  }
}

// ---------------------------------------------------------------- SentencePiece style (Llama)

TEST(TokenizerSentencePiece, EncodeDecodeAndBos) {
  TempModel m(llama_like().dump());
  const Tokenizer tok = m.load();
  const int32_t hello = *tok.token_to_id(sp(" Hello")), world = *tok.token_to_id(sp(" world"));
  EXPECT_EQ(tok.encode("Hello world"), (std::vector<int32_t>{hello, world}));
  EXPECT_EQ(tok.encode("Hello world", true), (std::vector<int32_t>{1, hello, world}));
  EXPECT_EQ(tok.encode("", true), (std::vector<int32_t>{1}));
  EXPECT_EQ(tok.encode(""), (std::vector<int32_t>{}));
  EXPECT_EQ(tok.bos_id(), std::optional<int32_t>(1));  // from the template
  EXPECT_TRUE(tok.is_special(1));
  EXPECT_EQ(tok.vocab_size(), 259 + 18);

  EXPECT_EQ(tok.decode(std::vector<int32_t>{hello, world}), "Hello world");
  // HF keeps the space after a special token: Strip only removes a leading one.
  EXPECT_EQ(tok.decode(std::vector<int32_t>{1, hello, world}), "<s> Hello world");
  EXPECT_EQ(tok.decode(std::vector<int32_t>{1, hello, world}, true), "Hello world");
  // Text after an added token is normalized on its own, so it gets its own '▁'.
  EXPECT_EQ(tok.encode("Hello</s>world"), (std::vector<int32_t>{hello, 2, world}));
}

TEST(TokenizerSentencePiece, ByteFallbackAndStreaming) {
  TempModel m(llama_like().dump());
  const Tokenizer tok = m.load();
  const int32_t space = *tok.token_to_id(kSp);
  const std::string emoji = "\xF0\x9F\x98\x80";  // U+1F600, not in the vocabulary
  const std::vector<int32_t> ids = tok.encode(emoji);
  EXPECT_EQ(ids, (std::vector<int32_t>{space, 3 + 0xF0, 3 + 0x9F, 3 + 0x98, 3 + 0x80}));
  EXPECT_EQ(tok.decode(ids), emoji);

  StreamDecoder d(tok);
  EXPECT_EQ(d.push(ids[0]), "");  // the leading space of the sequence is stripped
  EXPECT_EQ(d.push(ids[1]), "");  // 1/4 of the character
  EXPECT_EQ(d.push(ids[2]), "");
  EXPECT_EQ(d.push(ids[3]), "");
  EXPECT_EQ(d.push(ids[4]), emoji);
  EXPECT_EQ(d.flush(), "");

  const std::string text = "Hello " + emoji + " world" + emoji + emoji + "Hello";
  const std::vector<int32_t> all = tok.encode(text, true);
  EXPECT_EQ(tok.decode(all, true), text);
  EXPECT_EQ(stream_decode(tok, all, true), text);
  EXPECT_EQ(stream_decode(tok, all, false), tok.decode(all, false));

  // Piece by piece: the space between words appears as soon as the next word does.
  StreamDecoder w(tok);
  const int32_t hello = *tok.token_to_id(sp(" Hello")), world = *tok.token_to_id(sp(" world"));
  EXPECT_EQ(w.push(1), "");
  EXPECT_EQ(w.push(hello), "Hello");
  EXPECT_EQ(w.push(space), " ");
  EXPECT_EQ(w.push(world), " world");
  EXPECT_EQ(w.flush(), "");

  // An unfinished character is flushed as U+FFFD.
  StreamDecoder cut(tok);
  EXPECT_EQ(cut.push(hello), "Hello");
  EXPECT_EQ(cut.push(3 + 0xF0), "");
  EXPECT_EQ(cut.flush(), "\xEF\xBF\xBD");
}

TEST(TokenizerSentencePiece, UnknownCharacters) {
  const std::string emoji = "\xF0\x9F\x98\x80";
  TempModel fused(llama_like(false, true).dump());
  const Tokenizer a = fused.load();
  const int32_t h = *a.token_to_id(sp(" H"));
  EXPECT_EQ(a.encode("H" + emoji + emoji), (std::vector<int32_t>{h, 0}));
  TempModel unfused(llama_like(false, false).dump());
  EXPECT_EQ(unfused.load().encode("H" + emoji + emoji), (std::vector<int32_t>{h, 0, 0}));
}

TEST(TokenizerSentencePiece, ConfigDecidesBosAndEos) {
  const std::string cfg = R"({"bos_token": {"content": "<s>", "__type": "AddedToken"}, "eos_token": "</s>",
                             "add_bos_token": false, "add_eos_token": true})";
  TempModel m(llama_like().dump(), cfg);
  const Tokenizer tok = m.load();
  const int32_t hello = *tok.token_to_id(sp(" Hello"));
  EXPECT_EQ(tok.bos_id(), std::optional<int32_t>(1));
  EXPECT_EQ(tok.eos_id(), std::optional<int32_t>(2));
  EXPECT_EQ(tok.encode("Hello", true), (std::vector<int32_t>{hello, 2}));

  TempModel only_eos(llama_like().dump(), R"({"eos_token": "</s>", "add_eos_token": true})");
  EXPECT_EQ(only_eos.load().encode("Hello", true), (std::vector<int32_t>{1, hello, 2}));  // BOS still from template
}

// ---------------------------------------------------------------- Metaspace pre-tokenizer

TEST(TokenizerMetaspace, PrependFirstAndSplit) {
  TempModel m(metaspace_like().dump());
  const Tokenizer tok = m.load();
  const int32_t hey = *tok.token_to_id(sp(" Hey")), friend_ = *tok.token_to_id(sp(" friend"));
  const int32_t space = *tok.token_to_id(kSp);
  EXPECT_EQ(tok.encode("Hey friend"), (std::vector<int32_t>{hey, friend_}));
  EXPECT_EQ(tok.encode("Hey  friend"), (std::vector<int32_t>{hey, space, friend_}));
  // prepend_scheme "first": text after a special token gets no '▁'.
  const int32_t H = *tok.token_to_id("H"), e = *tok.token_to_id("e"), y = *tok.token_to_id("y");
  EXPECT_EQ(tok.encode("<s>Hey"), (std::vector<int32_t>{1, H, e, y}));
  EXPECT_EQ(tok.encode("<s> Hey"), (std::vector<int32_t>{1, hey}));

  EXPECT_EQ(tok.decode(std::vector<int32_t>{hey, friend_}), "Hey friend");
  EXPECT_EQ(tok.decode(std::vector<int32_t>{1, hey}), "<s> Hey");
  EXPECT_EQ(tok.decode(std::vector<int32_t>{1, hey}, true), "Hey");

  const std::string text = "Hey \xF0\x9F\x98\x80 friend!";
  const std::vector<int32_t> ids = tok.encode(text);
  EXPECT_EQ(tok.decode(ids), text);
  EXPECT_EQ(stream_decode(tok, ids, false), text);
  StreamDecoder d(tok);
  EXPECT_EQ(d.push(hey), "Hey");
  EXPECT_EQ(d.push(friend_), " friend");
}

// ---------------------------------------------------------------- byte-level + NFC (Qwen)

TEST(TokenizerByteLevel, SpecialTokensNfcAndStreaming) {
  TempModel m(qwen_like().dump());
  const Tokenizer tok = m.load();
  EXPECT_EQ(tok.encode("<|im_start|>hi hi<|im_end|>"), (std::vector<int32_t>{300, 256, 257, 301}));
  EXPECT_EQ(tok.decode(std::vector<int32_t>{300, 256, 257, 301}), "<|im_start|>hi hi<|im_end|>");
  EXPECT_EQ(tok.decode(std::vector<int32_t>{300, 256, 257, 301}, true), "hi hi");
  // NFC composes e + U+0301 into é before the bytes are mapped.
  EXPECT_EQ(tok.encode("e\xCC\x81"), (std::vector<int32_t>{258}));
  EXPECT_EQ(tok.encode("\xC3\xA9"), (std::vector<int32_t>{258}));

  const std::string emoji = "\xF0\x9F\x98\x80";
  EXPECT_EQ(tok.encode(emoji), bytes_ids(emoji));
  StreamDecoder d(tok);
  EXPECT_EQ(d.push(0xF0), "");
  EXPECT_EQ(d.push(0x9F), "");
  EXPECT_EQ(d.push(0x98), "");
  EXPECT_EQ(d.push(0x80), emoji);

  const std::string text = "<|im_start|>user\nhi \xC3\xA9t\xC3\xA9 " + emoji + "!<|im_end|>\n";
  const std::vector<int32_t> ids = tok.encode(text);
  EXPECT_EQ(tok.decode(ids), text);
  EXPECT_EQ(stream_decode(tok, ids, false), text);
  EXPECT_THROW(tok.encode("bad \xC3"), InputError);  // not UTF-8
}

TEST(TokenizerByteLevel, AddedTokenStripAndSingleWord) {
  json extra = json::array({added(302, "<mask>", true, /*lstrip=*/true, /*rstrip=*/true),
                            added(303, "hi!", false, false, false, /*single_word=*/true, /*normalized=*/true)});
  TempModel m(qwen_like(extra).dump());
  const Tokenizer tok = m.load();
  const std::vector<int32_t> a = bytes_ids("a"), b = bytes_ids("b");
  EXPECT_EQ(tok.encode("a  <mask>  b"), (std::vector<int32_t>{a[0], 302, b[0]}));
  // single_word: "hi!" inside a word stays text.
  EXPECT_EQ(tok.encode("hi! xhi!"), (std::vector<int32_t>{303, 32, 'x', 256, '!'}));
  EXPECT_FALSE(tok.is_special(303));
  EXPECT_EQ(tok.decode(std::vector<int32_t>{303, 302}, true), "hi!");
}

TEST(TokenizerRegex, Qwen2AndGpt2Patterns) {
  const std::string text = "Hello world's 123  \n\n  foo\xF0\x9F\x98\x80!! I'M";
  EXPECT_EQ(regex_pieces(kQwenRegex, text),
            (std::vector<std::string>{"Hello", " world", "'s", " ", "1", "2", "3", "  \n\n", " ", " foo",
                                      "\xF0\x9F\x98\x80!!", " I", "'M"}));
  const char* gpt2 = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
  EXPECT_EQ(regex_pieces(gpt2, text), (std::vector<std::string>{"Hello", " world", "'s", " 123", "  \n\n ", " foo",
                                                               "\xF0\x9F\x98\x80!!", " I", "'", "M"}));
}

TEST(TokenizerSplit, Behaviors) {
  // The examples of HF's SplitDelimiterBehavior documentation.
  auto run = [](SplitBehavior b, bool invert = false) {
    Regex re("-", true, "test");
    std::vector<std::pair<size_t, size_t>> m;
    re.find_all("the-final--countdown", m);
    std::vector<Piece> out;
    split_piece(Piece{"the-final--countdown", true}, m, b, invert, out);
    std::vector<std::string> s;
    for (auto& p : out) s.push_back(p.text);
    return s;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(run(SplitBehavior::Removed), (V{"the", "final", "countdown"}));
  EXPECT_EQ(run(SplitBehavior::Isolated), (V{"the", "-", "final", "-", "-", "countdown"}));
  EXPECT_EQ(run(SplitBehavior::MergedWithPrevious), (V{"the-", "final-", "-", "countdown"}));
  EXPECT_EQ(run(SplitBehavior::MergedWithNext), (V{"the", "-final", "-", "-countdown"}));
  EXPECT_EQ(run(SplitBehavior::Contiguous), (V{"the", "-", "final", "--", "countdown"}));
  EXPECT_EQ(run(SplitBehavior::Removed, true), (V{"-", "-", "-"}));  // each match is its own piece
}

// ---------------------------------------------------------------- bad input

TEST(TokenizerErrors, NameFileAndField) {
  auto load_error = [](const std::string& tokenizer_json, const std::string& config = "") {
    TempModel m(tokenizer_json, config);
    return error_of([&] { m.load(); });
  };
  auto has = [](const std::string& msg, std::initializer_list<const char*> parts) {
    for (const char* p : parts)
      if (msg.find(p) == std::string::npos) return ::testing::AssertionFailure() << "'" << p << "' not in: " << msg;
    return ::testing::AssertionSuccess();
  };

  EXPECT_TRUE(has(error_of([] { Tokenizer::load("/nonexistent/tiermoe-model"); }), {"tokenizer.json", "cannot be read"}));
  EXPECT_TRUE(has(load_error("{\"model\": [1, 2"), {"tokenizer.json", "invalid JSON"}));
  EXPECT_TRUE(has(load_error("[]"), {"tokenizer.json", "must be a JSON object"}));
  EXPECT_TRUE(has(load_error("{}"), {"tokenizer.json", "model is missing"}));

  json j = llama_like();
  j["model"]["type"] = "Unigram";
  EXPECT_TRUE(has(load_error(j.dump()), {"tokenizer.json: model.type 'Unigram' is not supported (supported: BPE)"}));

  j = metaspace_like();
  j["pre_tokenizer"] = {{"type", "BertPreTokenizer"}};
  EXPECT_TRUE(has(load_error(j.dump()), {"tokenizer.json: pre_tokenizer.type 'BertPreTokenizer' is not supported"}));
  j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", {{{"type", "Digits"}}, {{"type", "UnicodeScripts"}}}}};
  EXPECT_TRUE(has(load_error(j.dump()), {"pre_tokenizer.pretokenizers[1].type 'UnicodeScripts'"}));
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}};
  EXPECT_TRUE(has(load_error(j.dump()), {"pre_tokenizer.pattern.Regex", "cannot compile"}));
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "x"}}}, {"behavior", "Sideways"}};
  EXPECT_TRUE(has(load_error(j.dump()), {"pre_tokenizer.behavior 'Sideways'"}));
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Glob", "x"}}}, {"behavior", "Isolated"}};
  EXPECT_TRUE(has(load_error(j.dump()), {"pre_tokenizer.pattern", "must have a \"String\" or \"Regex\" member"}));

  j = llama_like();
  j["normalizer"] = {{"type", "Precompiled"}};
  EXPECT_TRUE(has(load_error(j.dump()), {"normalizer.type 'Precompiled' is not supported"}));
  j = llama_like();
  j["decoder"] = {{"type", "WordPiece"}};
  EXPECT_TRUE(has(load_error(j.dump()), {"decoder.type 'WordPiece' is not supported"}));
  j["decoder"] = {{"type", "Replace"}, {"pattern", {{"Regex", "(unclosed"}}}, {"content", " "}};
  EXPECT_TRUE(has(load_error(j.dump()), {"decoder.pattern.Regex", "cannot compile"}));
  j = llama_like();
  j["normalizer"] = {{"type", "Replace"}, {"pattern", "x"}, {"content", " "}};
  EXPECT_TRUE(has(load_error(j.dump()), {"normalizer.pattern"}));
  j = llama_like();
  j["post_processor"] = {{"type", "Nope"}};
  EXPECT_TRUE(has(load_error(j.dump()), {"post_processor.type 'Nope' is not supported"}));
  j = llama_like();
  j["model"]["merges"] = json::array({json::array({"zz", "q"})});
  EXPECT_TRUE(has(load_error(j.dump()), {"model.merges[0]", "'zz' is not in model.vocab"}));
  j = llama_like();
  j["model"]["vocab"]["bad"] = "seven";
  EXPECT_TRUE(has(load_error(j.dump()), {"model.vocab", "'bad'"}));
  j = llama_like();
  j["model"]["continuing_subword_prefix"] = "##";
  EXPECT_TRUE(has(load_error(j.dump()), {"model.continuing_subword_prefix '##' is not supported"}));
  j = llama_like();
  j["model"]["dropout"] = 0.1;
  EXPECT_TRUE(has(load_error(j.dump()), {"model.dropout"}));
  j = llama_like();
  j["added_tokens"][0].erase("content");
  EXPECT_TRUE(has(load_error(j.dump()), {"added_tokens[0].content is missing"}));

  EXPECT_TRUE(has(load_error(llama_like().dump(), "{not json"), {"tokenizer_config.json", "invalid JSON"}));
  EXPECT_TRUE(has(load_error(llama_like().dump(), R"({"bos_token": "<nope>"})"),
                  {"tokenizer_config.json: bos_token '<nope>' is not in the vocabulary"}));
  EXPECT_TRUE(has(load_error(llama_like().dump(), R"({"add_bos_token": true, "bos_token": null})"),
                  {"tokenizer_config.json: add_bos_token is true but bos_token is not set"}));
}
