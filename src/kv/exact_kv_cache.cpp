// The exact KV cache: one growing buffer of rows [pos, Hkv, Dh] per layer for K and for V, in FP32,
// BF16 or FP8 rows (with one int8 exponent per (pos, KV head) beside them).
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "cpu/attention.h"
#include "kv/fp8_rows.h"
#include "kv/kv_cache.h"

namespace tiermoe {
namespace {

class ExactKvCache final : public KvCache {
 public:
  ExactKvCache(const KvGeometry& g, KvDType dtype)
      : g_(g), dtype_(dtype), elem_(dtype == KvDType::F32 ? 4 : dtype == KvDType::BF16 ? 2 : 1), k_(g.num_layers),
        v_(g.num_layers), k_exp_(g.num_layers), v_exp_(g.num_layers), len_(g.num_layers, 0),
        appended_(g.num_layers, 0) {}

  void append(int layer, const float* k, const float* v, int T) override {
    const size_t row = size_t(g_.num_kv_heads) * g_.head_dim;
    const size_t old = size_t(len_[layer]) * row * elem_;
    k_[layer].resize(old + size_t(T) * row * elem_);
    v_[layer].resize(old + size_t(T) * row * elem_);
    store(layer, k_[layer].data() + old, k_exp_[layer], k, T);
    store(layer, v_[layer].data() + old, v_exp_[layer], v, T);
    len_[layer] += T;
    appended_[layer] = T;
  }

  // FP8 rows, the same bits either way: read as codes where each row is read by few queries (decode:
  // 10x faster per token at 3000 tokens of tinymix-code), decoded to BF16 once where by many (a
  // prompt chunk: converting codes per query head made it 30% slower to its first token).
  static constexpr int kFp8DecodeQueries = 4;  // T x (query heads per KV head) from which rows are decoded once
  void attend(int layer, const float* q, int T, float* out) const override {
    CHECK(T <= appended_[layer]);
    const void *k = k_[layer].data(), *v = v_[layer].data();
    if (dtype_ == KvDType::FP8 && T * (g_.num_heads / g_.num_kv_heads) < kFp8DecodeQueries)
      return attention_causal_fp8(out, q, {k_[layer].data(), k_exp_[layer].data()},
                                  {v_[layer].data(), v_exp_[layer].data()}, T, len_[layer] - T, g_.num_heads,
                                  g_.num_kv_heads, g_.head_dim);
    if (dtype_ == KvDType::FP8) {
      thread_local std::vector<uint16_t> kb, vb;
      const size_t rows = size_t(len_[layer]) * g_.num_kv_heads;
      kb.resize(rows * g_.head_dim);
      vb.resize(rows * g_.head_dim);
      fp8_dequantize_rows(k_[layer].data(), k_exp_[layer].data(), rows, g_.head_dim, kb.data());
      fp8_dequantize_rows(v_[layer].data(), v_exp_[layer].data(), rows, g_.head_dim, vb.data());
      k = kb.data(), v = vb.data();
    }
    attention_causal(out, q, k, v, dtype_ == KvDType::F32 ? DType::F32 : DType::BF16, T, len_[layer] - T,
                     g_.num_heads, g_.num_kv_heads, g_.head_dim);
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
      if (dtype_ == KvDType::FP8) {
        k_exp_[l].resize(size_t(n) * g_.num_kv_heads);
        v_exp_[l].resize(size_t(n) * g_.num_kv_heads);
      }
    }
  }

  bool can_copy_prefix(int n) const override { return n >= 0 && n <= length(); }
  std::unique_ptr<KvCache> copy_prefix(int n) const override {
    CHECK(can_copy_prefix(n));
    auto copy = std::make_unique<ExactKvCache>(g_, dtype_);
    const size_t bytes = size_t(n) * g_.num_kv_heads * g_.head_dim * elem_;
    const size_t exps = dtype_ == KvDType::FP8 ? size_t(n) * g_.num_kv_heads : 0;
    for (int l = 0; l < g_.num_layers; ++l) {
      copy->k_[l].assign(k_[l].begin(), k_[l].begin() + ptrdiff_t(bytes));
      copy->v_[l].assign(v_[l].begin(), v_[l].begin() + ptrdiff_t(bytes));
      copy->k_exp_[l].assign(k_exp_[l].begin(), k_exp_[l].begin() + ptrdiff_t(exps));
      copy->v_exp_[l].assign(v_exp_[l].begin(), v_exp_[l].begin() + ptrdiff_t(exps));
      copy->len_[l] = n;
    }
    return copy;
  }

  Stats stats() const override {
    Stats s;
    const double bits = 8.0 * double(kv_row_bytes(dtype_, g_.head_dim)) / g_.head_dim;
    s.tiers.push_back({"exact", long(length()), bits, bits});
    s.k_bits = s.v_bits = bits;
    s.token_bytes = s.held_bytes = double(bytes());
    return s;
  }

  size_t bytes() const override {
    size_t b = 0;
    for (int l = 0; l < g_.num_layers; ++l) b += k_[l].size() + v_[l].size() + k_exp_[l].size() + v_exp_[l].size();
    return b;
  }

 private:
  void store(int layer, uint8_t* dst, std::vector<int8_t>& exps, const float* src, int T) {
    const size_t n = size_t(T) * g_.num_kv_heads * g_.head_dim;
    if (dtype_ == KvDType::F32) {
      std::memcpy(dst, src, n * 4);
    } else if (dtype_ == KvDType::BF16) {
      auto* d = reinterpret_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
    } else {
      const size_t rows = size_t(T) * g_.num_kv_heads, old = size_t(len_[layer]) * g_.num_kv_heads;
      exps.resize(old + rows);
      fp8_quantize_rows(src, rows, g_.head_dim, dst, exps.data() + old);
    }
  }

  KvGeometry g_;
  KvDType dtype_;
  size_t elem_;
  std::vector<std::vector<uint8_t>> k_, v_;  // [layer] -> bytes of [len, Hkv, Dh]
  std::vector<std::vector<int8_t>> k_exp_, v_exp_;  // FP8: [layer] -> [len, Hkv] exponents
  std::vector<int> len_, appended_;
};

}  // namespace

std::unique_ptr<KvCache> make_exact_kv_cache(const KvGeometry& g, KvDType dtype) {
  return std::make_unique<ExactKvCache>(g, dtype);
}

}  // namespace tiermoe
