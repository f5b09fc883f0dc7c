// The KV cache of one sequence, for every layer. Attention runs inside the cache because a
// compressed cache attends straight from its codes; the model only hands it q, k and v.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace tiermoe {

struct KvGeometry {
  int num_layers = 0;
  int num_kv_heads = 0;  // Hkv
  int num_heads = 0;     // H (query heads; H / Hkv share one KV head)
  int head_dim = 0;      // Dh
  float rope_theta = 0;  // RoPE base (0: unknown); lets a cache code keys before RoPE
};

class KvCache {
 public:
  virtual ~KvCache() = default;

  // Appends T tokens' k[T, Hkv, Dh] and v[T, Hkv, Dh] (post-RoPE) to `layer`.
  virtual void append(int layer, const float* k, const float* v, int T) = 0;

  // Causal attention for the T most recently appended tokens of `layer`: query t attends to
  // every cached token up to and including itself. q[T, H, Dh] -> out[T, H, Dh].
  virtual void attend(int layer, const float* q, int T, float* out) const = 0;

  // Tokens stored (the same in every layer once a forward pass completes).
  virtual int length() const = 0;
  // Drops tokens past n (n <= length()).
  virtual void truncate(int n) = 0;
  // Bytes allocated for tokens' KV data (not counting spare capacity or per-sequence metadata).
  virtual size_t bytes() const = 0;

  // A new cache holding this one's first n tokens (n <= length()) as if only they had been
  // appended, for a prompt that starts with them (the scheduler's prefix cache); nullptr where
  // that state cannot be had from this one (a tiered cache fits codecs on the tokens it sees:
  // only some n qualify) and by default.
  virtual std::unique_ptr<KvCache> copy_prefix(int n) const { return nullptr; }
  // Whether copy_prefix(n) would give a cache, without copying.
  virtual bool can_copy_prefix(int n) const { return false; }

  // What is stored per tier at the current length, as bits per value (one value = one of
  // the Dh numbers of one token's key or value in one KV head), everything stored per token
  // counted; per-sequence metadata (rotations, codebooks) separately, in bytes.
  struct TierStats {
    std::string tier;   // sink | window | middle | archive | exact
    long tokens = 0;    // per layer
    double k_bits = 0, v_bits = 0;
  };
  struct Stats {
    std::vector<TierStats> tiers;
    double k_bits = 0, v_bits = 0;  // over every stored token
    double token_bytes = 0;         // all layers, as accounted by the tiers' formats
    double held_bytes = 0;          // all layers, as allocated (bytes()): codes pack into pages
    double meta_bytes = 0;          // all layers, per sequence
  };
  // Default (caches that do not report tiers): bytes only.
  virtual Stats stats() const {
    Stats s;
    s.token_bytes = s.held_bytes = double(bytes());
    return s;
  }
};

// FP8: E4M3 with a power-of-two scale per (token, KV head) row (kv/fp8_rows.h), every token.
enum class KvDType : uint8_t { F32, BF16, FP8 };

// Bytes one (token, KV head) row of head_dim values takes in `t` (FP8: its codes and its exponent).
inline size_t kv_row_bytes(KvDType t, int head_dim) {
  return t == KvDType::F32 ? 4 * size_t(head_dim) : t == KvDType::BF16 ? 2 * size_t(head_dim) : size_t(head_dim) + 1;
}

// One cache of every token in one format: keys and values stored as FP32 (bit-exact reference),
// BF16 or FP8 rows (attended as the BF16 values they decode to exactly).
std::unique_ptr<KvCache> make_exact_kv_cache(const KvGeometry& g, KvDType dtype);

struct KvSpec;
class KvProfile;
// The cache a spec describes: exact (f32/bf16) or tiered. With a profile (offline
// calibration) the codecs come from it; otherwise they are fitted online from the first
// spec.calib_tokens tokens.
std::unique_ptr<KvCache> make_kv_cache(const KvGeometry& g, const KvSpec& spec, const KvProfile* profile = nullptr);

}  // namespace tiermoe
