#include "model/config.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/files.h"
#include "model/config_reader.h"
#include "models/arch.h"

namespace tiermoe {
namespace {

using json = nlohmann::json;

DType parse_model_dtype(const ConfigReader& r) {
  const json* v = r.find({"dtype", "torch_dtype"});
  if (!v) return DType::BF16;
  if (!v->is_string()) r.fail("dtype", "must be a string, got " + v->dump());
  const std::string s = v->get<std::string>();
  if (s == "bfloat16") return DType::BF16;
  if (s == "float16") return DType::F16;
  if (s == "float32") return DType::F32;
  r.fail(r.json().contains("dtype") ? "dtype" : "torch_dtype", "'" + s + "' is not supported (bfloat16, float16, float32)");
}

// Newer configs: rope_parameters {rope_theta, rope_type}; older: top-level rope_theta and an
// optional rope_scaling. Only the default (unscaled) RoPE is implemented: refuse the rest.
float parse_rope_theta(const ConfigReader& r) {
  if (const json* p = r.find({"rope_parameters"})) {
    if (!p->is_object()) r.fail("rope_parameters", "must be an object");
    ConfigReader rp(*p, r.source() + ": rope_parameters");
    if (const json* t = rp.find({"rope_type", "type"})) {
      if (!t->is_string() || t->get<std::string>() != "default")
        rp.fail("rope_type", t->dump() + " is not supported (only \"default\")");
    }
    for (auto& [k, v] : p->items())
      if (k != "rope_type" && k != "type" && k != "rope_theta" && k != "partial_rotary_factor")
        rp.fail(k, "is not supported (RoPE scaling is not implemented)");
    if (rp.has("partial_rotary_factor") && rp.get_float({"partial_rotary_factor"}) != 1.0)
      rp.fail("partial_rotary_factor", "is not supported (only 1.0)");
    return float(rp.get_float({"rope_theta"}, r.get_float({"rope_theta"}, 10000.0)));
  }
  if (const json* s = r.find({"rope_scaling"})) {
    std::string type = s->is_object() && s->contains("rope_type") ? (*s)["rope_type"].dump()
                     : s->is_object() && s->contains("type") ? (*s)["type"].dump() : s->dump();
    if (!(s->is_object() && type == "\"default\""))
      r.fail("rope_scaling", "type " + type + " is not supported (only unscaled RoPE)");
  }
  return float(r.get_float({"rope_theta"}, 10000.0));
}

}  // namespace

ModelConfig parse_config(const std::string& text, const std::string& source) {
  const json j = parse_json(text, source);
  if (!j.is_object()) throw InputError(source + ": not a JSON object");
  ConfigReader r(j, source);
  ModelConfig cfg;

  const json* archs = r.find({"architectures"});
  if (!archs || !archs->is_array() || archs->empty() || !(*archs)[0].is_string())
    r.fail("architectures", "must be a list naming the model class, e.g. [\"MixtralForCausalLM\"]");
  cfg.architecture = (*archs)[0].get<std::string>();
  const ArchSpec* arch = find_arch(cfg.architecture);
  if (!arch)
    r.fail("architectures", "'" + cfg.architecture + "' is not supported (supported: " + supported_arch_names() + ")");

  if (r.has("quantization_config")) r.fail("quantization_config", "is present: quantized checkpoints are not supported");
  if (const json* sw = r.find({"sliding_window"})) {
    bool used = r.get_bool("use_sliding_window", cfg.architecture == "MixtralForCausalLM");
    if (used) r.fail("sliding_window", "is " + sw->dump() + ": sliding-window attention is not supported");
  }
  if (r.get_bool("use_sliding_window", false)) r.fail("use_sliding_window", "is true: sliding-window attention is not supported");
  if (const json* act = r.find({"hidden_act"}))
    if (!act->is_string() || act->get<std::string>() != "silu") r.fail("hidden_act", act->dump() + " is not supported (only \"silu\")");

  cfg.dtype = parse_model_dtype(r);
  cfg.vocab_size = r.get_int({"vocab_size"});
  cfg.hidden_size = r.get_int({"hidden_size"});
  cfg.num_layers = r.get_int({"num_hidden_layers"});
  cfg.num_heads = r.get_int({"num_attention_heads"});
  cfg.num_kv_heads = r.get_int({"num_key_value_heads"}, cfg.num_heads);
  if (cfg.num_heads == 0 || cfg.hidden_size == 0 || cfg.vocab_size == 0 || cfg.num_layers == 0)
    r.fail("hidden_size", "vocab_size, hidden_size, num_hidden_layers and num_attention_heads must be positive");
  cfg.head_dim = r.get_int({"head_dim"}, cfg.hidden_size / cfg.num_heads);
  if (cfg.num_kv_heads == 0 || cfg.num_heads % cfg.num_kv_heads != 0)
    r.fail("num_key_value_heads", std::to_string(cfg.num_kv_heads) + " does not divide num_attention_heads " + std::to_string(cfg.num_heads));
  if (cfg.head_dim == 0 || cfg.head_dim % 2 != 0) r.fail("head_dim", "must be positive and even");
  cfg.rms_norm_eps = float(r.get_float({"rms_norm_eps"}, 1e-6));
  cfg.rope_theta = parse_rope_theta(r);
  cfg.max_position_embeddings = r.get_int({"max_position_embeddings"}, 4096);
  cfg.tie_word_embeddings = r.get_bool("tie_word_embeddings", false);
  if (r.has("bos_token_id")) cfg.bos_token_id = r.get_int({"bos_token_id"});
  if (const json* eos = r.find({"eos_token_id"})) {
    if (eos->is_array()) {
      for (int id : r.get_int_list("eos_token_id")) cfg.eos_token_ids.push_back(id);
    } else {
      cfg.eos_token_ids.push_back(r.get_int({"eos_token_id"}));
    }
  }

  arch->read_config(r, cfg);
  if (cfg.num_experts > 0 && (cfg.top_k == 0 || cfg.top_k > cfg.num_experts))
    r.fail("num_experts_per_tok", std::to_string(cfg.top_k) + " must be in 1.." + std::to_string(cfg.num_experts));
  return cfg;
}

ModelConfig load_config(const std::string& model_dir) {
  namespace fs = std::filesystem;
  const std::string path = (fs::path(model_dir) / "config.json").string();
  if (!fs::exists(path)) throw InputError(model_dir + ": no config.json (is this a Hugging Face model directory?)");
  ModelConfig cfg = parse_config(read_file(path), path);
  // generation_config.json's EOS ids take precedence, as in transformers' generate().
  const std::string gen_path = (fs::path(model_dir) / "generation_config.json").string();
  if (fs::exists(gen_path)) {
    const json g = read_json_file(gen_path);
    ConfigReader r(g, gen_path);
    if (const json* eos = r.find({"eos_token_id"})) {
      cfg.eos_token_ids.clear();
      if (eos->is_array())
        for (int id : r.get_int_list("eos_token_id")) cfg.eos_token_ids.push_back(id);
      else
        cfg.eos_token_ids.push_back(r.get_int({"eos_token_id"}));
    }
  }
  return cfg;
}

void check_token_ids(std::span<const int32_t> ids, const ModelConfig& cfg, const std::string& what) {
  for (int32_t id : ids)
    if (id < 0 || id >= cfg.vocab_size)
      throw InputError(what + ": token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                       std::to_string(cfg.vocab_size) + ")");
}

}  // namespace tiermoe
