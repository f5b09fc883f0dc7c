// Qwen3MoeForCausalLM: RMSNorm on each q and k head before RoPE; no shared expert.
#include "models/arch.h"

namespace tiermoe {
namespace {

void read_qwen3_moe(const ConfigReader& r, ModelConfig& cfg) {
  cfg.num_experts = r.get_int({"num_experts", "num_local_experts"});
  cfg.top_k = r.get_int({"num_experts_per_tok"});
  cfg.expert_ffn = r.get_int({"moe_intermediate_size"});
  cfg.intermediate_size = r.get_int({"intermediate_size"});
  cfg.norm_topk_prob = r.get_bool("norm_topk_prob", false);
  cfg.qkv_bias = r.get_bool("attention_bias", false);
  cfg.qk_norm = QkNorm::PerHead;
  read_sparse_layers(r, cfg);
}

}  // namespace

extern const ArchSpec kQwen3Moe = {"Qwen3MoeForCausalLM", "mlp", {"gate_proj", "up_proj", "down_proj"}, read_qwen3_moe};

}  // namespace tiermoe
