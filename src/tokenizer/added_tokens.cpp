#include "tokenizer/added_tokens.h"

#include <algorithm>

#include "tokenizer/normalize.h"
#include "tokenizer/utf8.h"

namespace tiermoe {
namespace {

// Last / first character of a string (U+0000 for an empty one, which is neither \w nor \s).
uint32_t last_char(std::string_view s) {
  if (s.empty()) return 0;
  size_t i = s.size() - 1;
  while (i > 0 && (static_cast<uint8_t>(s[i]) & 0xC0) == 0x80) --i;
  return utf8_next(s, i);
}
uint32_t first_char(std::string_view s) {
  size_t i = 0;
  return s.empty() ? 0 : utf8_next(s, i);
}

}  // namespace

void AddedTokens::Matcher::add(std::string_view pattern, int32_t token) {
  if (pattern.empty()) return;
  int32_t node = 0;
  for (char c : pattern) {
    const auto b = static_cast<uint8_t>(c);
    auto& ch = nodes[size_t(node)].children;
    auto it = std::lower_bound(ch.begin(), ch.end(), std::make_pair(b, int32_t(-1)));
    if (it != ch.end() && it->first == b) {
      node = it->second;
    } else {
      const auto fresh = int32_t(nodes.size());
      ch.insert(it, {b, fresh});
      nodes.emplace_back();
      node = fresh;
    }
  }
  first_byte[static_cast<uint8_t>(pattern[0])] = true;
  if (nodes[size_t(node)].token < 0) nodes[size_t(node)].token = token;  // first of duplicates wins
}

int32_t AddedTokens::Matcher::longest_at(std::string_view text, size_t pos, size_t* len) const {
  int32_t node = 0, best = -1;
  for (size_t k = pos; k < text.size(); ++k) {
    const auto b = static_cast<uint8_t>(text[k]);
    const auto& ch = nodes[size_t(node)].children;
    auto it = std::lower_bound(ch.begin(), ch.end(), std::make_pair(b, int32_t(-1)));
    if (it == ch.end() || it->first != b) break;
    node = it->second;
    if (nodes[size_t(node)].token >= 0) {
      best = nodes[size_t(node)].token;
      *len = k + 1 - pos;
    }
  }
  return best;
}

AddedTokens::AddedTokens(const JsonNode& list, const Normalizer* normalizer) {
  if (list.is_null()) return;
  for (size_t i = 0; i < list.size(); ++i) {
    const JsonNode t = list.at(i);
    t.expect_object();
    AddedToken tok;
    tok.content = t.required("content").str();
    const JsonNode id = t.required("id");
    if (id.integer() < 0 || id.integer() >= (1 << 24)) id.fail("must be an id in [0, 16777216)");
    tok.id = int32_t(id.integer());
    tok.single_word = t.get("single_word").bool_or(false);
    tok.lstrip = t.get("lstrip").bool_or(false);
    tok.rstrip = t.get("rstrip").bool_or(false);
    tok.special = t.get("special").bool_or(false);
    tok.normalized = t.get("normalized").bool_or(!tok.special);
    tokens_.push_back(std::move(tok));
  }
  for (size_t i = 0; i < tokens_.size(); ++i) {
    const AddedToken& tok = tokens_[i];
    if (!tok.normalized) {
      raw_.add(tok.content, int32_t(i));
    } else {
      std::string pattern = tok.content;
      if (normalizer) normalizer->apply(pattern);
      normalized_.add(pattern, int32_t(i));
    }
  }
}

void AddedTokens::split(std::string_view text, bool normalized, std::vector<TextSegment>& out) const {
  split_with(normalized ? normalized_ : raw_, text, out);
}

// HF's AddedVocabulary::find_matches.
void AddedTokens::split_with(const Matcher& m, std::string_view text, std::vector<TextSegment>& out) const {
  size_t start_offset = 0;
  if (m.nodes.size() > 1) {
    for (size_t pos = 0; pos < text.size();) {
      size_t len = 0;
      const int32_t t = m.first_byte[static_cast<uint8_t>(text[pos])] ? m.longest_at(text, pos, &len) : -1;
      if (t < 0) {
        ++pos;
        continue;
      }
      const AddedToken& tok = tokens_[size_t(t)];
      size_t start = pos, stop = pos + len;
      pos = stop;  // matching resumes after the raw match, whatever strip rules do below
      if (tok.single_word) {
        const bool start_space = start == 0 || !is_word_char(last_char(text.substr(0, start)));
        const bool stop_space = stop == text.size() || !is_word_char(first_char(text.substr(stop)));
        if (!start_space || !stop_space) continue;
      }
      if (tok.lstrip) {
        size_t s = start;
        while (s > 0) {
          size_t j = s - 1;
          while (j > 0 && (static_cast<uint8_t>(text[j]) & 0xC0) == 0x80) --j;
          size_t k = j;
          if (!is_unicode_whitespace(utf8_next(text, k))) break;
          s = j;
        }
        start = std::max(s, start_offset);
      }
      if (tok.rstrip) {
        while (stop < text.size()) {
          size_t k = stop;
          if (!is_unicode_whitespace(utf8_next(text, k))) break;
          stop = k;
        }
      }
      if (start_offset < start) out.push_back({start_offset, start, -1});
      out.push_back({start, stop, tok.id});
      start_offset = stop;
    }
  }
  if (start_offset < text.size()) out.push_back({start_offset, text.size(), -1});
}

}  // namespace tiermoe
