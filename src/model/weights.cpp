#include "model/weights.h"

#include <set>

#include "core/check.h"
#include "models/arch.h"

namespace tiermoe {
namespace {

class TensorBinder {
 public:
  explicit TensorBinder(const Checkpoint& ckpt) : ckpt_(ckpt) {}

  const TensorView& take(const std::string& name, std::vector<int64_t> shape) {
    if (!ckpt_.has(name)) throw InputError("checkpoint: missing tensor '" + name + "'");
    const TensorView& t = ckpt_.get(name);
    if (t.dtype != DType::BF16 && t.dtype != DType::F16 && t.dtype != DType::F32)
      throw InputError(where(t) + "tensor '" + name + "' has dtype " + std::string(dtype_name(t.dtype)) +
                       " (expected BF16, F16 or F32)");
    if (t.shape != shape) {
      TensorView expected;
      expected.shape = shape;
      throw InputError(where(t) + "tensor '" + name + "' has shape " + t.shape_str() + ", expected " + expected.shape_str());
    }
    used_.insert(name);
    return t;
  }
  Linear linear(const std::string& name, int out, int in) {
    const TensorView& t = take(name, {out, in});
    return Linear{t.data, t.dtype, out, in};
  }
  std::vector<float> vec(const std::string& name, int n) {
    const TensorView& t = take(name, {n});
    std::vector<float> v(n);
    for (int i = 0; i < n; ++i) v[i] = load_f32(t.data, t.dtype, i);
    return v;
  }
  Mlp mlp(const std::string& prefix, const std::array<std::string_view, 3>& proj, int d, int f) {
    return Mlp{linear(prefix + std::string(proj[0]) + ".weight", f, d),
               linear(prefix + std::string(proj[1]) + ".weight", f, d),
               linear(prefix + std::string(proj[2]) + ".weight", d, f)};
  }
  // Tensors nobody asked for mean the checkpoint is not the model the config describes.
  void reject_unused() const {
    for (auto& [name, t] : ckpt_.all()) {
      if (used_.count(name) || name.find("rotary_emb.inv_freq") != std::string::npos) continue;
      throw InputError(where(*t) + "unexpected tensor '" + name + "' (not part of the model config.json describes)");
    }
  }

 private:
  static std::string where(const TensorView& t) { return t.file ? *t.file + ": " : ""; }
  const Checkpoint& ckpt_;
  std::set<std::string> used_;
};

}  // namespace

std::unique_ptr<ModelWeights> load_weights(const ModelConfig& cfg, Checkpoint checkpoint) {
  const ArchSpec* arch = find_arch(cfg.architecture);
  CHECK(arch != nullptr);
  auto w = std::make_unique<ModelWeights>();
  w->cfg = cfg;
  w->checkpoint = std::move(checkpoint);
  TensorBinder b(w->checkpoint);
  const int D = cfg.hidden_size, Dh = cfg.head_dim, H = cfg.num_heads, Hkv = cfg.num_kv_heads;
  w->embed = b.linear("model.embed_tokens.weight", cfg.vocab_size, D);
  w->lm_head = cfg.tie_word_embeddings ? w->embed : b.linear("lm_head.weight", cfg.vocab_size, D);
  w->final_norm = b.vec("model.norm.weight", D);
  for (int i = 0; i < cfg.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    LayerWeights L;
    L.attn_norm = b.vec(p + "input_layernorm.weight", D);
    L.ffn_norm = b.vec(p + "post_attention_layernorm.weight", D);
    L.q = b.linear(p + "self_attn.q_proj.weight", H * Dh, D);
    L.k = b.linear(p + "self_attn.k_proj.weight", Hkv * Dh, D);
    L.v = b.linear(p + "self_attn.v_proj.weight", Hkv * Dh, D);
    L.o = b.linear(p + "self_attn.o_proj.weight", D, H * Dh);
    if (cfg.qkv_bias) {
      L.q_bias = b.vec(p + "self_attn.q_proj.bias", H * Dh);
      L.k_bias = b.vec(p + "self_attn.k_proj.bias", Hkv * Dh);
      L.v_bias = b.vec(p + "self_attn.v_proj.bias", Hkv * Dh);
    }
    if (cfg.qk_norm == QkNorm::PerHead) {
      L.q_norm = b.vec(p + "self_attn.q_norm.weight", Dh);
      L.k_norm = b.vec(p + "self_attn.k_norm.weight", Dh);
    } else if (cfg.qk_norm == QkNorm::Full) {
      L.q_norm = b.vec(p + "self_attn.q_norm.weight", H * Dh);
      L.k_norm = b.vec(p + "self_attn.k_norm.weight", Hkv * Dh);
    }
    L.is_moe = cfg.layer_is_moe[i];
    if (L.is_moe) {
      const std::string m = p + std::string(arch->moe_block) + ".";
      L.router = b.linear(m + "gate.weight", cfg.num_experts, D);
      for (int e = 0; e < cfg.num_experts; ++e)
        L.experts.push_back(b.mlp(m + "experts." + std::to_string(e) + ".", arch->expert_proj, D, cfg.expert_ffn));
      if (cfg.shared_expert_ffn > 0) {
        L.shared = b.mlp(m + "shared_expert.", {"gate_proj", "up_proj", "down_proj"}, D, cfg.shared_expert_ffn);
        L.shared_gate = b.linear(m + "shared_expert_gate.weight", 1, D);
      }
    } else {
      L.dense = b.mlp(p + "mlp.", {"gate_proj", "up_proj", "down_proj"}, D, cfg.intermediate_size);
    }
    w->layers.push_back(std::move(L));
  }
  b.reject_unused();
  return w;
}

std::unique_ptr<ModelWeights> load_weights(const std::string& model_dir) {
  ModelConfig cfg = load_config(model_dir);
  return load_weights(cfg, Checkpoint::open_dir(model_dir));
}

}  // namespace tiermoe
