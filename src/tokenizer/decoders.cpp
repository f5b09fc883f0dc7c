#include "tokenizer/decoders.h"

#include "tokenizer/byte_level.h"
#include "tokenizer/regex.h"
#include "tokenizer/utf8.h"

namespace tiermoe {
namespace {

std::string single_char(const JsonNode& node, const std::string& def) {
  const std::string s = node.str_or(def);
  size_t i = 0;
  if (s.empty() || (utf8_next(s, i), i != s.size())) node.fail("must be a single character");
  return s;
}

// The piece that replaces a whole list (Fuse, ByteLevel). In a streaming window that does not
// start the sequence, its left edge is inside the text.
DecodedPiece fused(const std::vector<DecodedPiece>& pieces, std::string text) {
  DecodedPiece p;
  p.text = std::move(text);
  if (!pieces.empty()) {
    p.first_token = pieces[0].first_token;
    p.open_left = !pieces[0].first_token || pieces[0].open_left;
  }
  return p;
}

class SequenceDecoder : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> parts) : parts_(std::move(parts)) {}
  void apply(std::vector<DecodedPiece>& pieces) const override {
    for (const auto& p : parts_) p->apply(pieces);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> parts_;
};

// Maps stand-in characters back to bytes (a token with any other character keeps its own UTF-8
// bytes), joins everything and repairs invalid UTF-8 with U+FFFD.
class ByteLevelDecoder : public Decoder {
 public:
  void apply(std::vector<DecodedPiece>& pieces) const override {
    const auto& tables = byte_level_tables();
    std::string bytes;
    std::string tok_bytes;
    for (const DecodedPiece& p : pieces) {
      tok_bytes.clear();
      bool all_mapped = true;
      for (size_t i = 0; i < p.text.size();) {
        const int b = tables.byte_of(utf8_next(p.text, i));
        if (b < 0) {
          all_mapped = false;
          break;
        }
        tok_bytes += char(b);
      }
      bytes += all_mapped ? tok_bytes : p.text;
    }
    DecodedPiece out = fused(pieces, utf8_lossy(bytes));
    pieces.assign(1, std::move(out));
  }
};

class FuseDecoder : public Decoder {
 public:
  void apply(std::vector<DecodedPiece>& pieces) const override {
    std::string all;
    for (const DecodedPiece& p : pieces) all += p.text;
    DecodedPiece out = fused(pieces, std::move(all));
    pieces.assign(1, std::move(out));
  }
};

// Runs of "<0xNN>" tokens become the bytes they name: one piece if they are valid UTF-8,
// otherwise one U+FFFD per byte.
class ByteFallbackDecoder : public Decoder {
 public:
  void apply(std::vector<DecodedPiece>& pieces) const override {
    std::vector<DecodedPiece> out;
    std::string run;
    DecodedPiece run_head;  // flags of the run's first token
    auto flush = [&] {
      if (run.empty()) return;
      if (utf8_is_valid(run)) {
        out.push_back({run, run_head.first_token, run_head.open_left});
      } else {
        for (size_t i = 0; i < run.size(); ++i)
          out.push_back({std::string(kReplacementChar), i == 0 && run_head.first_token, i == 0 && run_head.open_left});
      }
      run.clear();
    };
    for (DecodedPiece& p : pieces) {
      int byte = -1;
      if (p.text.size() == 6 && p.text.compare(0, 3, "<0x") == 0 && p.text[5] == '>') byte = parse_hex(p.text[3], p.text[4]);
      if (byte >= 0) {
        if (run.empty()) run_head = p;
        run += char(byte);
      } else {
        flush();
        out.push_back(std::move(p));
      }
    }
    flush();
    pieces = std::move(out);
  }

 private:
  static int hex(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  }
  static int parse_hex(char hi, char lo) {
    const int h = hex(hi), l = hex(lo);
    return h < 0 || l < 0 ? -1 : h * 16 + l;
  }
};

class MetaspaceDecoder : public Decoder {
 public:
  MetaspaceDecoder(std::string replacement, bool strip_first) : rep_(std::move(replacement)), strip_first_(strip_first) {}
  void apply(std::vector<DecodedPiece>& pieces) const override {
    for (DecodedPiece& p : pieces) {
      // HF drops every '▁' of the first token, not only a leading one.
      const std::string with = (p.first_token && strip_first_) ? std::string() : std::string(" ");
      std::string t;
      t.reserve(p.text.size());
      for (size_t pos = 0;;) {
        const size_t hit = p.text.find(rep_, pos);
        if (hit == std::string::npos) {
          t.append(p.text, pos);
          break;
        }
        t.append(p.text, pos, hit - pos);
        t += with;
        pos = hit + rep_.size();
      }
      p.text = std::move(t);
    }
  }

 private:
  std::string rep_;
  bool strip_first_;
};

class ReplaceDecoder : public Decoder {
 public:
  ReplaceDecoder(Regex pattern, std::string content) : pattern_(std::move(pattern)), content_(std::move(content)) {}
  void apply(std::vector<DecodedPiece>& pieces) const override {
    std::vector<std::pair<size_t, size_t>> m;
    for (DecodedPiece& p : pieces) {
      m.clear();
      pattern_.find_all(p.text, m);
      if (m.empty()) continue;
      std::string t;
      size_t prev = 0;
      for (auto [s, e] : m) {
        t.append(p.text, prev, s - prev);
        t += content_;
        prev = e;
      }
      t.append(p.text, prev);
      p.text = std::move(t);
    }
  }

 private:
  Regex pattern_;
  std::string content_;
};

// Removes up to `start` leading and `stop` trailing copies of one character from each piece.
class StripDecoder : public Decoder {
 public:
  StripDecoder(std::string content, size_t start, size_t stop) : content_(std::move(content)), start_(start), stop_(stop) {}
  void apply(std::vector<DecodedPiece>& pieces) const override {
    for (DecodedPiece& p : pieces) {
      std::vector<size_t> offs;  // byte offset of each character, plus the end
      for (size_t i = 0; i < p.text.size();) {
        offs.push_back(i);
        utf8_next(p.text, i);
      }
      const size_t n = offs.size();
      offs.push_back(p.text.size());
      auto is_content = [&](size_t k) { return p.text.compare(offs[k], offs[k + 1] - offs[k], content_) == 0; };
      size_t start_cut = 0;
      if (!p.open_left)
        for (size_t k = 0; k < std::min(start_, n) && is_content(k); ++k) start_cut = k + 1;
      size_t stop_cut = n;
      for (size_t k = 0; k < std::min(stop_, n - start_cut); ++k) {
        const size_t idx = n - k - 1;
        if (!is_content(idx)) break;
        stop_cut = idx;
      }
      p.text = p.text.substr(offs[start_cut], offs[stop_cut] - offs[start_cut]);
    }
  }

 private:
  std::string content_;
  size_t start_, stop_;
};

}  // namespace

std::unique_ptr<Decoder> parse_decoder(const JsonNode& node) {
  if (node.is_null()) return nullptr;
  node.expect_object();
  const JsonNode type_node = node.required("type");
  const std::string type = type_node.str();
  if (type == "Sequence") return std::make_unique<SequenceDecoder>(node.parse_each("decoders", parse_decoder));
  if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (type == "Fuse") return std::make_unique<FuseDecoder>();
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (type == "Metaspace") {
    bool strip_first = node.get("add_prefix_space").bool_or(true);
    const JsonNode scheme = node.get("prepend_scheme");
    if (!scheme.is_null()) {
      const std::string s = scheme.str();
      if (s != "always" && s != "first" && s != "never") scheme.fail("'" + s + "' is not one of always, first, never");
      strip_first = s != "never";
    }
    return std::make_unique<MetaspaceDecoder>(single_char(node.get("replacement"), "\xE2\x96\x81"), strip_first);
  }
  if (type == "Replace") {
    return std::make_unique<ReplaceDecoder>(parse_pattern(node.required("pattern")), node.required("content").str());
  }
  if (type == "Strip") {
    const JsonNode start = node.get("start"), stop = node.get("stop");
    if (start.int_or(0) < 0) start.fail("must not be negative");
    if (stop.int_or(0) < 0) stop.fail("must not be negative");
    return std::make_unique<StripDecoder>(single_char(node.required("content"), ""), size_t(start.int_or(0)),
                                          size_t(stop.int_or(0)));
  }
  type_node.fail("'" + type +
                 "' is not supported (supported: Sequence, ByteLevel, Metaspace, ByteFallback, Fuse, Strip, "
                 "Replace)");
}

}  // namespace tiermoe
