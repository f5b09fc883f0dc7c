#include "engine/prefix_cache.h"

#include <algorithm>

#include "core/check.h"

namespace tiermoe {
namespace {

size_t common_prefix(std::span<const int32_t> a, std::span<const int32_t> b) {
  const size_t n = std::min(a.size(), b.size());
  return size_t(std::mismatch(a.begin(), a.begin() + ptrdiff_t(n), b.begin()).first - a.begin());
}

}  // namespace

void PrefixCache::retain(std::span<const int32_t> tokens, std::unique_ptr<KvCache> cache) {
  const int n = cache->length();
  CHECK(n >= 0 && size_t(n) <= tokens.size());
  tokens = tokens.first(size_t(n));
  const size_t bytes = cache->bytes();
  if (n == 0 || bytes > max_bytes_) return;
  for (size_t i = entries_.size(); i-- > 0;) {
    Entry& e = entries_[i];
    const size_t common = common_prefix(e.tokens, tokens);
    if (common == tokens.size()) {  // an entry already holds these tokens (and maybe more)
      if (!e.cache->can_copy_prefix(int(common))) continue;  // but cannot give them back: keep both
      e.used = ++clock_;
      return;
    }
    if (common == e.tokens.size()) {  // the new entry holds all of this one's tokens
      bytes_ -= e.bytes;
      entries_.erase(entries_.begin() + ptrdiff_t(i));
    }
  }
  entries_.push_back({std::vector<int32_t>(tokens.begin(), tokens.end()), std::move(cache), bytes, ++clock_});
  bytes_ += bytes;
  shrink_to(max_bytes_);
}

PrefixCache::Match PrefixCache::lookup(std::span<const int32_t> prompt, int max_tokens, int min_tokens) {
  prompt = prompt.first(std::min(prompt.size(), size_t(std::max(max_tokens, 0))));
  std::vector<std::pair<size_t, Entry*>> found;  // (common tokens, entry), longest first
  for (Entry& e : entries_) {
    const size_t common = common_prefix(e.tokens, prompt);
    if (common >= size_t(std::max(min_tokens, 1))) found.emplace_back(common, &e);
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (auto [common, e] : found)
    if (auto copy = e->cache->copy_prefix(int(common))) {  // null: that cache cannot stop there
      e->used = ++clock_;
      return {std::move(copy), int(common)};
    }
  return {};
}

void PrefixCache::shrink_to(size_t target) {
  while (bytes_ > target && !entries_.empty()) {
    auto oldest = std::min_element(entries_.begin(), entries_.end(),
                                   [](const Entry& a, const Entry& b) { return a.used < b.used; });
    bytes_ -= oldest->bytes;
    entries_.erase(oldest);
  }
}

}  // namespace tiermoe
