#include "tokenizer/bpe.h"

#include <cstdio>
#include <queue>

#include "tokenizer/utf8.h"

namespace tiermoe {
namespace {

constexpr int64_t kMaxVocabId = 1 << 24;      // far above any real vocabulary; guards allocation
constexpr size_t kMaxCachedWordBytes = 256;   // long words (whole sentences for Llama) are not cached
constexpr size_t kCacheCapacity = 1 << 18;

}  // namespace

BpeModel::BpeModel(const JsonNode& model) {
  model.expect_object();
  const JsonNode type = model.required("type");
  if (type.str() != "BPE") type.fail("'" + type.str() + "' is not supported (supported: BPE)");

  const JsonNode dropout = model.get("dropout");
  if (!dropout.is_null() && dropout.number() != 0.0)
    dropout.fail("is not supported (BPE dropout is random; it must be null)");
  for (const char* field : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const JsonNode n = model.get(field);
    if (!n.is_null() && !n.str().empty()) n.fail("'" + n.str() + "' is not supported (must be null)");
  }
  byte_fallback_ = model.get("byte_fallback").bool_or(false);
  fuse_unk_ = model.get("fuse_unk").bool_or(false);
  ignore_merges_ = model.get("ignore_merges").bool_or(false);

  const JsonNode vocab = model.required("vocab");
  vocab.expect_object();
  vocab_.reserve(vocab.json().size());
  int64_t max_id = -1;
  for (const auto& [token, id_json] : vocab.json().items()) {
    if (!id_json.is_number_integer() || id_json.get<int64_t>() < 0 || id_json.get<int64_t>() >= kMaxVocabId)
      vocab.fail("'" + token + "' must map to an id in [0, " + std::to_string(kMaxVocabId) + ")");
    const int64_t id = id_json.get<int64_t>();
    vocab_[token] = int32_t(id);
    max_id = std::max(max_id, id);
  }
  id_to_token_.assign(size_t(max_id + 1), std::string());
  id_used_.assign(size_t(max_id + 1), false);
  for (const auto& [token, id] : vocab_) {
    id_to_token_[size_t(id)] = token;
    id_used_[size_t(id)] = true;
  }

  const JsonNode unk = model.get("unk_token");
  if (!unk.is_null()) {
    auto it = vocab_.find(unk.str());
    if (it == vocab_.end()) unk.fail("'" + unk.str() + "' is not in model.vocab");
    unk_id_ = it->second;
  }

  byte_ids_.fill(-1);
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    if (auto it = vocab_.find(std::string_view(name)); it != vocab_.end()) byte_ids_[b] = it->second;
  }

  // Merges are "a b" strings (older files) or ["a", "b"] pairs; rank is the position. A repeated
  // pair keeps its last rank, as HF's HashMap collect does.
  const JsonNode merges = model.get("merges");
  if (!merges.is_null()) {
    const size_t n = merges.size();
    merges_.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      const JsonNode m = merges.at(i);
      std::string a, b;
      if (m.is_string()) {
        const std::string s = m.str();
        const size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          m.fail("'" + s + "' must be two tokens separated by one space");
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (m.is_array() && m.size() == 2) {
        a = m.at(0).str();
        b = m.at(1).str();
      } else {
        m.fail("must be a string \"a b\" or a pair [\"a\", \"b\"]");
      }
      auto id_of = [&](const std::string& t) {
        auto it = vocab_.find(t);
        if (it == vocab_.end()) m.fail("token '" + t + "' is not in model.vocab");
        return it->second;
      };
      const int32_t ia = id_of(a), ib = id_of(b), inew = id_of(a + b);
      merges_[pair_key(ia, ib)] = Merge{int32_t(i), inew};
    }
  }
}

std::optional<int32_t> BpeModel::token_to_id(std::string_view token) const {
  auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::id_to_token(int32_t id) const {
  if (id < 0 || size_t(id) >= id_used_.size() || !id_used_[size_t(id)]) return nullptr;
  return &id_to_token_[size_t(id)];
}

void BpeModel::tokenize(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    if (auto it = vocab_.find(word); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const bool cacheable = word.size() <= kMaxCachedWordBytes;
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (auto it = cache_.find(word); it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out.size();
  merge_word(word, out);
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    if (cache_.size() < kCacheCapacity) cache_.emplace(word, std::vector<int32_t>(out.begin() + first, out.end()));
  }
}

// HF's BPE::merge_word followed by Word::merge_all.
void BpeModel::merge_word(std::string_view word, std::vector<int32_t>& out) const {
  struct Symbol {
    int32_t id, prev, next, len;  // len 0 marks a symbol merged into its left neighbour
  };
  std::vector<Symbol> syms;
  syms.reserve(word.size());
  auto add = [&](int32_t id, int32_t len) {
    const auto n = int32_t(syms.size());
    if (n) syms.back().next = n;
    syms.push_back({id, n - 1, -1, len});
  };

  // Initial symbols: one per character, else its bytes' <0xNN> tokens, else unk (fused or not).
  bool have_unk = false;
  int32_t unk_len = 0;
  for (size_t i = 0; i < word.size();) {
    size_t next = i;
    utf8_next(word, next);
    const std::string_view ch = word.substr(i, next - i);
    const auto len = int32_t(ch.size());
    i = next;
    if (auto it = vocab_.find(ch); it != vocab_.end()) {
      if (have_unk) {
        add(unk_id_, unk_len);
        have_unk = false;
      }
      add(it->second, len);
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (char c : ch) all = all && byte_ids_[static_cast<uint8_t>(c)] >= 0;
      if (all) {
        // HF adds the byte tokens without flushing a pending unk first; so do we.
        for (char c : ch) add(byte_ids_[static_cast<uint8_t>(c)], 1);
        continue;
      }
    }
    if (unk_id_ >= 0) {
      if (have_unk && fuse_unk_) {
        unk_len += len;
      } else {
        if (have_unk) add(unk_id_, unk_len);
        have_unk = true;
        unk_len = len;
      }
    }
    // no unk token and no fallback: the character is dropped, as in HF
  }
  if (have_unk) add(unk_id_, unk_len);

  struct Candidate {
    int32_t rank, pos, new_id;
  };
  auto later = [](const Candidate& a, const Candidate& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  };
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(later)> queue(later);
  auto find_merge = [&](int32_t a, int32_t b) -> const Merge* {
    auto it = merges_.find(pair_key(a, b));
    return it == merges_.end() ? nullptr : &it->second;
  };
  for (size_t i = 0; i + 1 < syms.size(); ++i)
    if (const Merge* m = find_merge(syms[i].id, syms[i + 1].id)) queue.push({m->rank, int32_t(i), m->new_id});

  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& cur = syms[size_t(top.pos)];
    if (cur.len == 0 || cur.next == -1) continue;
    const Symbol right = syms[size_t(cur.next)];
    // Stale entry: the pair at this position changed since it was queued.
    const Merge* m = find_merge(cur.id, right.id);
    if (!m || m->new_id != top.new_id) continue;

    syms[size_t(cur.next)].len = 0;
    cur.id = top.new_id;
    cur.len += right.len;
    cur.next = right.next;
    if (right.next >= 0) syms[size_t(right.next)].prev = top.pos;

    if (cur.prev >= 0) {
      if (const Merge* pm = find_merge(syms[size_t(cur.prev)].id, cur.id))
        queue.push({pm->rank, cur.prev, pm->new_id});
    }
    if (cur.next >= 0) {
      if (const Merge* nm = find_merge(cur.id, syms[size_t(cur.next)].id))
        queue.push({nm->rank, top.pos, nm->new_id});
    }
  }
  for (const Symbol& s : syms)
    if (s.len != 0) out.push_back(s.id);
}

}  // namespace tiermoe
