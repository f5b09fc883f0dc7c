// The model's geometry and features, read from a Hugging Face config.json of either
// generation (top-level rope_theta/torch_dtype, or rope_parameters/dtype).
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace tiermoe {

enum class Router : uint8_t {
  SoftmaxTopK,  // softmax over all experts, top-k, renormalize iff norm_topk_prob
};

// How q/k RMSNorm applies, if at all.
enum class QkNorm : uint8_t { None, PerHead /* Qwen3: over Dh */, Full /* OLMoE: over H*Dh */ };

struct ModelConfig {
  std::string architecture;  // e.g. "MixtralForCausalLM"
  DType dtype = DType::BF16;
  int vocab_size = 0;
  int hidden_size = 0;         // D
  int num_layers = 0;
  int num_heads = 0;           // H
  int num_kv_heads = 0;        // Hkv
  int head_dim = 0;            // Dh
  int intermediate_size = 0;   // F of dense MLP layers
  int num_experts = 0;         // E
  int top_k = 0;               // K
  int expert_ffn = 0;          // F of each expert
  int shared_expert_ffn = 0;   // 0: no shared expert
  bool norm_topk_prob = true;
  std::vector<bool> layer_is_moe;  // [num_layers]
  float rms_norm_eps = 1e-6f;
  float rope_theta = 10000.f;
  int max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;
  QkNorm qk_norm = QkNorm::None;
  std::optional<float> clip_qkv;
  std::optional<int32_t> bos_token_id;
  std::vector<int32_t> eos_token_ids;
};

// Reads <dir>/config.json (and generation_config.json for EOS ids, when present).
// Throws InputError naming the file and field for anything missing, malformed or unsupported.
ModelConfig load_config(const std::string& model_dir);
ModelConfig parse_config(const std::string& json_text, const std::string& source_name);

// Throws InputError naming `what` when a token id is outside [0, vocab_size).
void check_token_ids(std::span<const int32_t> ids, const ModelConfig& cfg, const std::string& what);

}  // namespace tiermoe
