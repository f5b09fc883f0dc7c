// The model's tensors, checked against the config and pointing into the mapped checkpoint.
// Projection matrices stay in their checkpoint dtype; small vectors (norms, biases) are FP32.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "model/config.h"

namespace tiermoe {

struct Linear {  // y[T, out] = x[T, in] @ W[out, in]^T
  const void* w = nullptr;
  DType dtype = DType::BF16;
  int out = 0, in = 0;
};

struct Mlp {  // down(silu(gate(x)) * up(x))
  Linear gate, up, down;
};

struct LayerWeights {
  std::vector<float> attn_norm, ffn_norm;  // [D]
  Linear q, k, v, o;                       // [H*Dh, D], [Hkv*Dh, D], [Hkv*Dh, D], [D, H*Dh]
  std::vector<float> q_bias, k_bias, v_bias;  // empty unless qkv_bias
  std::vector<float> q_norm, k_norm;          // [Dh] per head, or [H*Dh] / [Hkv*Dh] full
  bool is_moe = false;
  Mlp dense;                    // when !is_moe
  Linear router;                // [E, D]
  std::vector<Mlp> experts;     // [E]
  Mlp shared;                   // when shared_expert_ffn > 0
  Linear shared_gate;           // [1, D]
};

struct ModelWeights {
  ModelConfig cfg;
  Checkpoint checkpoint;        // owns the mappings the Linear pointers refer to
  Linear embed;                 // [V, D]
  Linear lm_head;               // [V, D] (== embed when tied)
  std::vector<float> final_norm;
  std::vector<LayerWeights> layers;
};

// Loads config.json and the safetensors of a model directory. Throws InputError naming the
// tensor for a missing or unexpected tensor, a wrong shape or an unsupported dtype.
std::unique_ptr<ModelWeights> load_weights(const std::string& model_dir);
std::unique_ptr<ModelWeights> load_weights(const ModelConfig& cfg, Checkpoint checkpoint);

}  // namespace tiermoe
