// Finished sequences' KV caches, kept for the prompts that start with their tokens: an agent's
// next turn (its last prompt, the answer, a tool result), a chat's next message, requests that
// share a system prompt. A new request copies the longest prefix an entry holds instead of
// computing it again. Entries go least recently used first: past the byte bound, when admission
// needs their memory, and when a newer entry holds all of an entry's tokens and more. Owned by
// the scheduler's thread.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kv/kv_cache.h"

namespace tiermoe {

class PrefixCache {
 public:
  explicit PrefixCache(size_t max_bytes) : max_bytes_(max_bytes) {}

  // Keeps `cache`, whose tokens are tokens[0 .. cache->length()), unless an entry holds those
  // tokens already and can copy them (KvCache::can_copy_prefix).
  void retain(std::span<const int32_t> tokens, std::unique_ptr<KvCache> cache);

  // A copy of the longest prefix of prompt[0 .. max_tokens) that an entry holds and can copy
  // (KvCache::copy_prefix), if it is at least min_tokens long; else cache is null and tokens 0.
  struct Match {
    std::unique_ptr<KvCache> cache;
    int tokens = 0;
  };
  Match lookup(std::span<const int32_t> prompt, int max_tokens, int min_tokens);

  // Drops entries, least recently used first, until bytes() <= target.
  void shrink_to(size_t target);
  size_t bytes() const { return bytes_; }
  size_t entries() const { return entries_.size(); }

 private:
  struct Entry {
    std::vector<int32_t> tokens;
    std::unique_ptr<KvCache> cache;
    size_t bytes = 0;
    uint64_t used = 0;  // the clock at its retain or last match
  };
  size_t max_bytes_, bytes_ = 0;
  uint64_t clock_ = 0;
  std::vector<Entry> entries_;  // few (bounded by bytes): scanned in full
};

}  // namespace tiermoe
