// Qwen2MoeForCausalLM: q/k/v bias; experts plus a shared expert scaled by sigmoid(gate(x));
// dense MLP layers where decoder_sparse_step / mlp_only_layers say so.
#include "models/arch.h"

namespace tiermoe {
namespace {

void read_qwen2_moe(const ConfigReader& r, ModelConfig& cfg) {
  cfg.num_experts = r.get_int({"num_experts", "num_local_experts"});
  cfg.top_k = r.get_int({"num_experts_per_tok"});
  cfg.expert_ffn = r.get_int({"moe_intermediate_size"});
  cfg.shared_expert_ffn = r.get_int({"shared_expert_intermediate_size"});
  cfg.intermediate_size = r.get_int({"intermediate_size"});
  cfg.norm_topk_prob = r.get_bool("norm_topk_prob", false);
  cfg.qkv_bias = r.get_bool("qkv_bias", true);
  read_sparse_layers(r, cfg);
}

}  // namespace

extern const ArchSpec kQwen2Moe = {"Qwen2MoeForCausalLM", "mlp", {"gate_proj", "up_proj", "down_proj"}, read_qwen2_moe};

}  // namespace tiermoe
