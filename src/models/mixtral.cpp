// MixtralForCausalLM: every layer MoE; softmax, top-k, always renormalized.
#include "models/arch.h"

namespace tiermoe {
namespace {

void read_mixtral(const ConfigReader& r, ModelConfig& cfg) {
  cfg.num_experts = r.get_int({"num_local_experts", "num_experts"});
  cfg.top_k = r.get_int({"num_experts_per_tok"});
  cfg.expert_ffn = r.get_int({"intermediate_size"});
  cfg.norm_topk_prob = true;
  cfg.layer_is_moe.assign(cfg.num_layers, true);
}

}  // namespace

extern const ArchSpec kMixtral = {"MixtralForCausalLM", "block_sparse_moe", {"w1", "w3", "w2"}, read_mixtral};

}  // namespace tiermoe
