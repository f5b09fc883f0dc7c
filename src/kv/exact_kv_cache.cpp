// The exact KV cache: one growing buffer of rows [pos, Hkv, Dh] per layer for K and for V.
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "cpu/attention.h"
#include "kv/kv_cache.h"

namespace tiermoe {
namespace {

class ExactKvCache final : public KvCache {
 public:
  ExactKvCache(const KvGeometry& g, DType dtype)
      : g_(g), dtype_(dtype), elem_(dtype_size(dtype_)), k_(g.num_layers), v_(g.num_layers), len_(g.num_layers, 0),
        appended_(g.num_layers, 0) {}

  void append(int layer, const float* k, const float* v, int T) override {
    const size_t row = size_t(g_.num_kv_heads) * g_.head_dim;
    const size_t old = size_t(len_[layer]) * row * elem_;
    k_[layer].resize(old + size_t(T) * row * elem_);
    v_[layer].resize(old + size_t(T) * row * elem_);
    store(k_[layer].data() + old, k, size_t(T) * row);
    store(v_[layer].data() + old, v, size_t(T) * row);
    len_[layer] += T;
    appended_[layer] = T;
  }

  void attend(int layer, const float* q, int T, float* out) const override {
    CHECK(T <= appended_[layer]);
    attention_causal(out, q, k_[layer].data(), v_[layer].data(), dtype_, T, len_[layer] - T, g_.num_heads,
                     g_.num_kv_heads, g_.head_dim);
  }

  int length() const override { return len_.empty() ? 0 : len_.back(); }

  void truncate(int n) override {
    const size_t row = size_t(g_.num_kv_heads) * g_.head_dim * elem_;
    for (int l = 0; l < g_.num_layers; ++l) {
      CHECK(n <= len_[l]);
      len_[l] = n;
      appended_[l] = 0;
      k_[l].resize(size_t(n) * row);
      v_[l].resize(size_t(n) * row);
    }
  }

  bool can_copy_prefix(int n) const override { return n >= 0 && n <= length(); }
  std::unique_ptr<KvCache> copy_prefix(int n) const override {
    CHECK(can_copy_prefix(n));
    auto copy = std::make_unique<ExactKvCache>(g_, dtype_);
    const size_t bytes = size_t(n) * g_.num_kv_heads * g_.head_dim * elem_;
    for (int l = 0; l < g_.num_layers; ++l) {
      copy->k_[l].assign(k_[l].begin(), k_[l].begin() + ptrdiff_t(bytes));
      copy->v_[l].assign(v_[l].begin(), v_[l].begin() + ptrdiff_t(bytes));
      copy->len_[l] = n;
    }
    return copy;
  }

  Stats stats() const override {
    Stats s;
    const double bits = dtype_ == DType::F32 ? 32 : 16;
    s.tiers.push_back({"exact", long(length()), bits, bits});
    s.k_bits = s.v_bits = bits;
    s.token_bytes = s.held_bytes = double(bytes());
    return s;
  }

  size_t bytes() const override {
    size_t b = 0;
    for (int l = 0; l < g_.num_layers; ++l) b += k_[l].size() + v_[l].size();
    return b;
  }

 private:
  void store(uint8_t* dst, const float* src, size_t n) {
    if (dtype_ == DType::F32) {
      std::memcpy(dst, src, n * 4);
    } else {
      auto* d = reinterpret_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
    }
  }

  KvGeometry g_;
  DType dtype_;
  size_t elem_;
  std::vector<std::vector<uint8_t>> k_, v_;  // [layer] -> bytes of [len, Hkv, Dh]
  std::vector<int> len_, appended_;
};

}  // namespace

std::unique_ptr<KvCache> make_exact_kv_cache(const KvGeometry& g, KvDType dtype) {
  return std::make_unique<ExactKvCache>(g, dtype == KvDType::F32 ? DType::F32 : DType::BF16);
}

KvDType parse_kv_dtype(const std::string& name) {
  if (name == "f32") return KvDType::F32;
  if (name == "bf16") return KvDType::BF16;
  throw InputError("--kv: unknown KV cache type '" + name + "' (supported: f32, bf16)");
}

}  // namespace tiermoe
