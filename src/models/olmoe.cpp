// OlmoeForCausalLM: RMSNorm over the whole q and k projections (before the head split),
// optional clamping of q/k/v (clip_qkv); every layer MoE.
#include "models/arch.h"

namespace tiermoe {
namespace {

void read_olmoe(const ConfigReader& r, ModelConfig& cfg) {
  cfg.num_experts = r.get_int({"num_experts", "num_local_experts"});
  cfg.top_k = r.get_int({"num_experts_per_tok"});
  cfg.expert_ffn = r.get_int({"intermediate_size"});
  cfg.norm_topk_prob = r.get_bool("norm_topk_prob", false);
  cfg.qkv_bias = r.get_bool("attention_bias", false);
  cfg.qk_norm = QkNorm::Full;
  if (r.has("clip_qkv")) cfg.clip_qkv = float(r.get_float({"clip_qkv"}));
  cfg.layer_is_moe.assign(cfg.num_layers, true);
}

}  // namespace

extern const ArchSpec kOlmoe = {"OlmoeForCausalLM", "mlp", {"gate_proj", "up_proj", "down_proj"}, read_olmoe};

}  // namespace tiermoe
