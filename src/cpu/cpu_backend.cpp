// The CPU forward pass: the same decoder for every architecture, with the features the config
// turns on. Shape legend: T tokens, D hidden, H/Hkv heads, Dh head dim, E experts, K top-k,
// F FFN width, V vocabulary.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/backend.h"
#include "core/check.h"
#include "core/thread_pool.h"
#include "cpu/matmul.h"
#include "cpu/ops.h"
#include "kv/kv_profile.h"
#include "kv/kv_spec.h"

namespace tiermoe {
namespace {

void linear(float* y, const float* x, const Linear& W, int T) { matmul(y, x, W.w, W.dtype, T, W.out, W.in); }

class CpuBackend final : public Backend {
 public:
  CpuBackend(const ModelWeights& w, const CpuBackendOptions& opts) : w_(w), cfg_(w.cfg), opts_(opts) {}

  std::string name() const override { return "cpu"; }

  std::unique_ptr<KvCache> new_cache() const override {
    const KvGeometry g{cfg_.num_layers, cfg_.num_kv_heads, cfg_.num_heads, cfg_.head_dim, float(cfg_.rope_theta)};
    if (opts_.kv_spec) return make_kv_cache(g, *opts_.kv_spec, opts_.kv_profile.get());
    return make_exact_kv_cache(g, opts_.kv_dtype);
  }

  int vocab_size() const override { return cfg_.vocab_size; }
  int pass_tokens() const override { return opts_.max_chunk; }
  void forward_batch(std::span<const SeqStep> steps, float* logits) override {
    split_into_passes(steps, opts_.max_chunk, cfg_.vocab_size, logits,
                      [&](const std::vector<SeqStep>& pass, float* out) { forward_pass(pass, out); });
  }

 private:
  // One pass through the layers for pieces of distinct sequences, tokens concatenated.
  void forward_pass(const std::vector<SeqStep>& pieces, float* logits) {
    const int D = cfg_.hidden_size, H = cfg_.num_heads, Hkv = cfg_.num_kv_heads, Dh = cfg_.head_dim;
    int T = 0, n_logits = 0;
    for (const SeqStep& p : pieces) {
      T += int(p.tokens.size());
      n_logits += p.n_logits;
    }
    x_.resize(size_t(T) * D);     // [T, D] residual stream
    h_.resize(size_t(T) * D);     // [T, D] normed input of a block
    q_.resize(size_t(T) * H * Dh);    // [T, H, Dh]
    k_.resize(size_t(T) * Hkv * Dh);  // [T, Hkv, Dh]
    v_.resize(size_t(T) * Hkv * Dh);  // [T, Hkv, Dh]
    att_.resize(size_t(T) * H * Dh);  // [T, H, Dh]
    pos_.resize(T);
    for (int t = 0; const SeqStep& p : pieces) {
      const int pos0 = p.cache->length();
      for (size_t i = 0; i < p.tokens.size(); ++i, ++t) {
        const int32_t id = p.tokens[i];
        CHECK(id >= 0 && id < cfg_.vocab_size);
        pos_[t] = pos0 + int(i);
        for (int d = 0; d < D; ++d) x_[size_t(t) * D + d] = load_f32(w_.embed.w, w_.embed.dtype, size_t(id) * D + d);
      }
    }

    for (int l = 0; l < cfg_.num_layers; ++l) {
      const LayerWeights& L = w_.layers[l];
      rmsnorm(h_.data(), x_.data(), L.attn_norm.data(), T, D, cfg_.rms_norm_eps);
      attention_block(L, l, T, pieces);
      matmul_add(x_.data(), att_.data(), L.o.w, L.o.dtype, T, D, H * Dh);  // x += attn @ Wo^T

      rmsnorm(h_.data(), x_.data(), L.ffn_norm.data(), T, D, cfg_.rms_norm_eps);
      if (L.is_moe)
        moe_block(L, T);
      else
        mlp_add(L.dense, h_.data(), T, x_.data());
    }

    if (n_logits > 0) {
      // The rows that need logits: the last n_logits of each piece.
      for (int t = 0, row = 0; const SeqStep& p : pieces) {
        t += int(p.tokens.size());
        for (int i = t - p.n_logits; i < t; ++i, ++row)
          std::copy_n(x_.data() + size_t(i) * D, D, h_.data() + size_t(row) * D);
      }
      rmsnorm(h_.data(), h_.data(), w_.final_norm.data(), n_logits, D, cfg_.rms_norm_eps);
      linear(logits, h_.data(), w_.lm_head, n_logits);  // [n_logits, V]
    }
  }

  void attention_block(const LayerWeights& L, int layer, int T, const std::vector<SeqStep>& pieces) {
    const int H = cfg_.num_heads, Hkv = cfg_.num_kv_heads, Dh = cfg_.head_dim;
    linear(q_.data(), h_.data(), L.q, T);
    linear(k_.data(), h_.data(), L.k, T);
    linear(v_.data(), h_.data(), L.v, T);
    if (cfg_.qkv_bias) {
      add_bias(q_.data(), L.q_bias.data(), T, H * Dh);
      add_bias(k_.data(), L.k_bias.data(), T, Hkv * Dh);
      add_bias(v_.data(), L.v_bias.data(), T, Hkv * Dh);
    }
    if (cfg_.clip_qkv) {
      clamp(q_.data(), T * H * Dh, *cfg_.clip_qkv);
      clamp(k_.data(), T * Hkv * Dh, *cfg_.clip_qkv);
      clamp(v_.data(), T * Hkv * Dh, *cfg_.clip_qkv);
    }
    if (cfg_.qk_norm == QkNorm::Full) {
      rmsnorm(q_.data(), q_.data(), L.q_norm.data(), T, H * Dh, cfg_.rms_norm_eps);
      rmsnorm(k_.data(), k_.data(), L.k_norm.data(), T, Hkv * Dh, cfg_.rms_norm_eps);
    } else if (cfg_.qk_norm == QkNorm::PerHead) {
      rmsnorm(q_.data(), q_.data(), L.q_norm.data(), T * H, Dh, cfg_.rms_norm_eps);
      rmsnorm(k_.data(), k_.data(), L.k_norm.data(), T * Hkv, Dh, cfg_.rms_norm_eps);
    }
    rope(q_.data(), pos_.data(), T, H, Dh, cfg_.rope_theta);  // positions per token: pieces differ
    rope(k_.data(), pos_.data(), T, Hkv, Dh, cfg_.rope_theta);
    for (size_t t = 0; const SeqStep& p : pieces) {
      const int n = int(p.tokens.size());
      p.cache->append(layer, k_.data() + t * Hkv * Dh, v_.data() + t * Hkv * Dh, n);
      p.cache->attend(layer, q_.data() + t * H * Dh, n, att_.data() + t * H * Dh);
      t += size_t(n);
    }
  }

  // out[T, D] += down(silu(gate(x)) * up(x)), scaled per row by scale[T] when given.
  void mlp_add(const Mlp& m, const float* x, int T, float* out, const float* scale = nullptr) {
    const int F = m.gate.out, D = cfg_.hidden_size;
    gate_.resize(size_t(T) * F);
    up_.resize(size_t(T) * F);
    linear(gate_.data(), x, m.gate, T);  // [T, F]
    linear(up_.data(), x, m.up, T);      // [T, F]
    silu_mul(gate_.data(), gate_.data(), up_.data(), T, F);
    if (!scale) {
      matmul_add(out, gate_.data(), m.down.w, m.down.dtype, T, D, F);
      return;
    }
    down_.resize(size_t(T) * D);
    linear(down_.data(), gate_.data(), m.down, T);  // [T, D]
    for (int t = 0; t < T; ++t)
      for (int d = 0; d < D; ++d) out[size_t(t) * D + d] += scale[t] * down_[size_t(t) * D + d];
  }

  void moe_block(const LayerWeights& L, int T) {
    const int D = cfg_.hidden_size, E = cfg_.num_experts, K = cfg_.top_k;
    router_.resize(size_t(T) * E);
    linear(router_.data(), h_.data(), L.router, T);  // [T, E]
    ids_.resize(size_t(T) * K);
    wts_.resize(size_t(T) * K);
    for (int t = 0; t < T; ++t)
      route_softmax_topk(router_.data() + size_t(t) * E, E, K, cfg_.norm_topk_prob, ids_.data() + size_t(t) * K,
                         wts_.data() + size_t(t) * K);

    // Tokens grouped per expert, in expert order: each expert's weights are read once.
    moe_out_.assign(size_t(T) * D, 0.f);
    for (int e = 0; e < E; ++e) {
      rows_.clear();
      row_w_.clear();
      for (int i = 0; i < T * K; ++i)
        if (ids_[i] == e) {
          rows_.push_back(i / K);
          row_w_.push_back(wts_[i]);
        }
      if (rows_.empty()) continue;
      const int n = int(rows_.size());
      xe_.resize(size_t(n) * D);  // [n, D] gathered inputs
      ye_.assign(size_t(n) * D, 0.f);
      for (int r = 0; r < n; ++r) std::copy_n(h_.data() + size_t(rows_[r]) * D, D, xe_.data() + size_t(r) * D);
      mlp_add(L.experts[e], xe_.data(), n, ye_.data(), row_w_.data());
      for (int r = 0; r < n; ++r) {
        float* dst = moe_out_.data() + size_t(rows_[r]) * D;
        const float* src = ye_.data() + size_t(r) * D;
        for (int d = 0; d < D; ++d) dst[d] += src[d];
      }
    }
    if (cfg_.shared_expert_ffn > 0) {
      sgate_.resize(T);
      linear(sgate_.data(), h_.data(), L.shared_gate, T);  // [T, 1]
      for (int t = 0; t < T; ++t) sgate_[t] = 1.0f / (1.0f + std::exp(-sgate_[t]));
      mlp_add(L.shared, h_.data(), T, moe_out_.data(), sgate_.data());
    }
    for (size_t i = 0; i < moe_out_.size(); ++i) x_[i] += moe_out_[i];
  }

  const ModelWeights& w_;
  const ModelConfig& cfg_;
  CpuBackendOptions opts_;
  std::vector<float> x_, h_, q_, k_, v_, att_, gate_, up_, down_, router_, wts_, moe_out_, xe_, ye_, row_w_, sgate_;
  std::vector<int32_t> pos_, ids_, rows_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(const ModelWeights& weights, const CpuBackendOptions& opts) {
  return std::make_unique<CpuBackend>(weights, opts);
}

}  // namespace tiermoe
