#include "tokenizer/pretokenize.h"

#include <algorithm>

#include "tokenizer/byte_level.h"
#include "tokenizer/regex.h"
#include "tokenizer/utf8.h"

namespace tiermoe {
namespace {

using Matches = std::vector<std::pair<size_t, size_t>>;

// GPT-2's word regex, used by ByteLevel when use_regex is true.
const Regex& gpt2_regex() {
  static const Regex re(R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)",
                        false, "built-in GPT-2 regex");
  return re;
}

class SequencePreTokenizer : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> parts) : parts_(std::move(parts)) {}
  void apply(std::vector<Piece>& pieces) const override {
    for (const auto& p : parts_) p->apply(pieces);
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> parts_;
};

// Splits every piece at the matches of one regex.
class RegexSplitPreTokenizer : public PreTokenizer {
 public:
  RegexSplitPreTokenizer(Regex re, SplitBehavior behavior, bool invert)
      : re_(std::make_unique<Regex>(std::move(re))), behavior_(behavior), invert_(invert) {}
  void apply(std::vector<Piece>& pieces) const override {
    std::vector<Piece> out;
    Matches m;
    for (const Piece& p : pieces) {
      m.clear();
      re_->find_all(p.text, m);
      split_piece(p, m, behavior_, invert_, out);
    }
    pieces = std::move(out);
  }

 private:
  std::unique_ptr<Regex> re_;
  SplitBehavior behavior_;
  bool invert_;
};

class ByteLevelPreTokenizer : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, bool use_regex)
      : add_prefix_space_(add_prefix_space), use_regex_(use_regex) {}
  void apply(std::vector<Piece>& pieces) const override {
    std::vector<Piece> split;
    Matches m;
    for (Piece& p : pieces) {
      if (add_prefix_space_ && (p.text.empty() || p.text[0] != ' ')) p.text = " " + p.text;
      if (use_regex_) {
        m.clear();
        gpt2_regex().find_all(p.text, m);
        split_piece(p, m, SplitBehavior::Isolated, false, split);
      } else if (!p.text.empty()) {
        split.push_back(std::move(p));
      }
    }
    const auto& tables = byte_level_tables();
    for (Piece& p : split) {
      std::string mapped;
      mapped.reserve(p.text.size() * 2);
      for (char c : p.text) mapped += tables.byte_to_utf8[static_cast<uint8_t>(c)];
      p.text = std::move(mapped);
    }
    pieces = std::move(split);
  }

 private:
  bool add_prefix_space_, use_regex_;
};

enum class PrependScheme { Always, First, Never };

class MetaspacePreTokenizer : public PreTokenizer {
 public:
  MetaspacePreTokenizer(std::string replacement, PrependScheme scheme, bool split)
      : rep_(std::move(replacement)), scheme_(scheme), split_(split) {}
  void apply(std::vector<Piece>& pieces) const override {
    std::vector<Piece> out;
    Matches m;
    for (Piece& p : pieces) {
      std::string t;
      t.reserve(p.text.size() + rep_.size());
      for (char c : p.text) {
        if (c == ' ') t += rep_;
        else t += c;
      }
      const bool starts = t.compare(0, rep_.size(), rep_) == 0;
      if (!starts && (scheme_ == PrependScheme::Always || (scheme_ == PrependScheme::First && p.at_start)))
        t = rep_ + t;
      Piece q{std::move(t), p.at_start};
      if (!split_) {
        if (!q.text.empty()) out.push_back(std::move(q));
        continue;
      }
      m.clear();
      for (size_t pos = q.text.find(rep_); pos != std::string::npos; pos = q.text.find(rep_, pos + rep_.size()))
        m.emplace_back(pos, pos + rep_.size());
      split_piece(q, m, SplitBehavior::MergedWithNext, false, out);
    }
    pieces = std::move(out);
  }

 private:
  std::string rep_;
  PrependScheme scheme_;
  bool split_;
};

SplitBehavior parse_behavior(const JsonNode& node) {
  const std::string b = node.str();
  if (b == "Removed") return SplitBehavior::Removed;
  if (b == "Isolated") return SplitBehavior::Isolated;
  if (b == "MergedWithPrevious") return SplitBehavior::MergedWithPrevious;
  if (b == "MergedWithNext") return SplitBehavior::MergedWithNext;
  if (b == "Contiguous") return SplitBehavior::Contiguous;
  node.fail("'" + b + "' is not a split behavior (Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous)");
}

}  // namespace

void split_piece(const Piece& piece, const Matches& matches, SplitBehavior behavior, bool invert,
                 std::vector<Piece>& out) {
  struct Seg {
    size_t begin, end;
    bool match;
  };
  const std::string& s = piece.text;
  // HF's Pattern::find_matches: matches and the gaps between them, covering all of s.
  std::vector<Seg> segs;
  if (s.empty()) {
    segs.push_back({0, 0, false});
  } else {
    size_t prev = 0;
    for (auto [b, e] : matches) {
      if (prev != b) segs.push_back({prev, b, false});
      segs.push_back({b, e, true});
      prev = e;
    }
    if (prev != s.size()) segs.push_back({prev, s.size(), false});
  }
  if (invert)
    for (Seg& g : segs) g.match = !g.match;

  // SplitDelimiterBehavior: which segments stay, and which are glued to a neighbour.
  std::vector<Seg> keep;  // `match` now means "remove"
  bool prev_match = false;
  switch (behavior) {
    case SplitBehavior::Isolated:
      for (const Seg& g : segs) keep.push_back({g.begin, g.end, false});
      break;
    case SplitBehavior::Removed:
      keep = segs;
      break;
    case SplitBehavior::Contiguous:
      for (const Seg& g : segs) {
        if (g.match == prev_match && !keep.empty()) keep.back().end = g.end;
        else keep.push_back({g.begin, g.end, false});
        prev_match = g.match;
      }
      break;
    case SplitBehavior::MergedWithPrevious:
      for (const Seg& g : segs) {
        if (g.match && !prev_match && !keep.empty()) keep.back().end = g.end;
        else keep.push_back({g.begin, g.end, false});
        prev_match = g.match;
      }
      break;
    case SplitBehavior::MergedWithNext:
      for (auto it = segs.rbegin(); it != segs.rend(); ++it) {
        if (it->match && !prev_match && !keep.empty()) keep.back().begin = it->begin;
        else keep.push_back({it->begin, it->end, false});
        prev_match = it->match;
      }
      std::reverse(keep.begin(), keep.end());
      break;
  }
  for (const Seg& g : keep)
    if (!g.match && g.end > g.begin) out.push_back(Piece{s.substr(g.begin, g.end - g.begin), piece.at_start && g.begin == 0});
}

std::unique_ptr<PreTokenizer> parse_pre_tokenizer(const JsonNode& node) {
  if (node.is_null()) return nullptr;
  node.expect_object();
  const JsonNode type_node = node.required("type");
  const std::string type = type_node.str();
  if (type == "Sequence")
    return std::make_unique<SequencePreTokenizer>(node.parse_each("pretokenizers", parse_pre_tokenizer));
  if (type == "ByteLevel")
    return std::make_unique<ByteLevelPreTokenizer>(node.get("add_prefix_space").bool_or(true),
                                                   node.get("use_regex").bool_or(true));
  if (type == "Split") {
    return std::make_unique<RegexSplitPreTokenizer>(parse_pattern(node.required("pattern")),
                                                    parse_behavior(node.required("behavior")),
                                                    node.get("invert").bool_or(false));
  }
  if (type == "Metaspace") {
    const JsonNode rep_node = node.get("replacement");
    const std::string rep = rep_node.str_or("\xE2\x96\x81");  // U+2581 '▁'
    size_t i = 0;
    if (rep.empty() || (utf8_next(rep, i), i != rep.size())) rep_node.fail("must be a single character");
    PrependScheme scheme = PrependScheme::Always;
    const JsonNode scheme_node = node.get("prepend_scheme");
    if (!scheme_node.is_null()) {
      const std::string s = scheme_node.str();
      if (s == "always") scheme = PrependScheme::Always;
      else if (s == "first") scheme = PrependScheme::First;
      else if (s == "never") scheme = PrependScheme::Never;
      else scheme_node.fail("'" + s + "' is not one of always, first, never");
    } else if (!node.get("add_prefix_space").bool_or(true)) {
      scheme = PrependScheme::Never;  // files written before prepend_scheme existed
    }
    return std::make_unique<MetaspacePreTokenizer>(rep, scheme, node.get("split").bool_or(true));
  }
  if (type == "Digits")
    return std::make_unique<RegexSplitPreTokenizer>(
        Regex(node.get("individual_digits").bool_or(false) ? R"(\p{N})" : R"(\p{N}+)", false, "Digits"),
        SplitBehavior::Isolated, false);
  if (type == "Whitespace")
    return std::make_unique<RegexSplitPreTokenizer>(Regex(R"(\w+|[^\w\s]+)", false, "Whitespace"),
                                                    SplitBehavior::Removed, true);
  if (type == "WhitespaceSplit")
    return std::make_unique<RegexSplitPreTokenizer>(Regex(R"(\s+)", false, "WhitespaceSplit"),
                                                    SplitBehavior::Removed, false);
  type_node.fail("'" + type +
                 "' is not supported (supported: Sequence, ByteLevel, Split, Metaspace, Digits, "
                 "Whitespace, WhitespaceSplit)");
}

}  // namespace tiermoe
