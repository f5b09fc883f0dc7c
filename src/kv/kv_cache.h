// The KV cache of one sequence, for every layer. Attention runs inside the cache because a
// compressed cache attends straight from its codes; the model only hands it q, k and v.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace tiermoe {

struct KvGeometry {
  int num_layers = 0;
  int num_kv_heads = 0;  // Hkv
  int num_heads = 0;     // H (query heads; H / Hkv share one KV head)
  int head_dim = 0;      // Dh
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
  // Bytes held for KV data (not counting spare capacity).
  virtual size_t bytes() const = 0;
};

enum class KvDType : uint8_t { F32, BF16 };

// Exact cache: keys and values stored as FP32 (bit-exact reference) or BF16.
std::unique_ptr<KvCache> make_exact_kv_cache(const KvGeometry& g, KvDType dtype);

// "f32" | "bf16"; throws InputError naming the value otherwise.
KvDType parse_kv_dtype(const std::string& name);

}  // namespace tiermoe
