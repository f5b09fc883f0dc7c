// What distinguishes one MoE architecture from another: its config fields and tensor names.
// Each architecture lives in one file of this folder; the forward pass is shared.
#pragma once
#include <array>
#include <string>
#include <string_view>

#include "model/config.h"
#include "model/config_reader.h"

namespace tiermoe {

struct ArchSpec {
  std::string_view hf_name;                    // config.json "architectures"[0]
  std::string_view moe_block;                  // "block_sparse_moe" (Mixtral) or "mlp"
  std::array<std::string_view, 3> expert_proj; // names of the gate, up, down projections
  // Reads the architecture's own fields; the common ones are already in cfg.
  void (*read_config)(const ConfigReader& r, ModelConfig& cfg);
};

const ArchSpec* find_arch(std::string_view hf_name);  // nullptr when unsupported
std::string supported_arch_names();                   // for error messages

// Shared by the Qwen-style architectures: which layers are MoE (decoder_sparse_step,
// mlp_only_layers), as transformers decides it.
void read_sparse_layers(const ConfigReader& r, ModelConfig& cfg);

}  // namespace tiermoe
