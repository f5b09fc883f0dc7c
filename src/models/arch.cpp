#include "models/arch.h"

#include <algorithm>

namespace tiermoe {

extern const ArchSpec kMixtral, kQwen2Moe, kQwen3Moe, kOlmoe;

namespace {
const ArchSpec* const kArchs[] = {&kMixtral, &kQwen2Moe, &kQwen3Moe, &kOlmoe};
}

const ArchSpec* find_arch(std::string_view hf_name) {
  for (const ArchSpec* a : kArchs)
    if (a->hf_name == hf_name) return a;
  return nullptr;
}

std::string supported_arch_names() {
  std::string s;
  for (const ArchSpec* a : kArchs) s += (s.empty() ? "" : ", ") + std::string(a->hf_name);
  return s;
}

void read_sparse_layers(const ConfigReader& r, ModelConfig& cfg) {
  const int step = r.get_int({"decoder_sparse_step"}, 1);
  const std::vector<int> mlp_only = r.get_int_list("mlp_only_layers");
  for (int i : mlp_only)
    if (i < 0 || i >= cfg.num_layers) r.fail("mlp_only_layers", "names layer " + std::to_string(i) + " of " + std::to_string(cfg.num_layers));
  cfg.layer_is_moe.assign(cfg.num_layers, false);
  for (int i = 0; i < cfg.num_layers; ++i) {
    bool dense = std::find(mlp_only.begin(), mlp_only.end(), i) != mlp_only.end();
    cfg.layer_is_moe[i] = !dense && cfg.num_experts > 0 && step > 0 && (i + 1) % step == 0;
  }
}

}  // namespace tiermoe
