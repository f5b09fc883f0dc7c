// config.json of both generations; bad configs and mismatched checkpoints name the field or tensor.
#include <gtest/gtest.h>

#include "core/check.h"
#include "model/weights.h"
#include "test_util.h"

namespace tiermoe {
namespace {

using test::error_of;

nlohmann::json tiny_mixtral_config() {
  return {{"architectures", {"MixtralForCausalLM"}}, {"hidden_size", 8}, {"intermediate_size", 4},
          {"num_hidden_layers", 1}, {"num_attention_heads", 2}, {"num_key_value_heads", 1}, {"head_dim", 4},
          {"vocab_size", 16}, {"num_local_experts", 2}, {"num_experts_per_tok", 1}, {"rms_norm_eps", 1e-5},
          {"max_position_embeddings", 64}, {"rope_parameters", {{"rope_theta", 1e6}, {"rope_type", "default"}}},
          {"dtype", "bfloat16"}, {"tie_word_embeddings", false}, {"sliding_window", nullptr}};
}

std::vector<test::FakeTensor> tiny_mixtral_tensors() {
  std::vector<test::FakeTensor> t = {
      {"model.embed_tokens.weight", "BF16", {16, 8}, {}}, {"lm_head.weight", "BF16", {16, 8}, {}},
      {"model.norm.weight", "BF16", {8}, {}},
      {"model.layers.0.input_layernorm.weight", "BF16", {8}, {}},
      {"model.layers.0.post_attention_layernorm.weight", "BF16", {8}, {}},
      {"model.layers.0.self_attn.q_proj.weight", "BF16", {8, 8}, {}},
      {"model.layers.0.self_attn.k_proj.weight", "BF16", {4, 8}, {}},
      {"model.layers.0.self_attn.v_proj.weight", "BF16", {4, 8}, {}},
      {"model.layers.0.self_attn.o_proj.weight", "BF16", {8, 8}, {}},
      {"model.layers.0.block_sparse_moe.gate.weight", "BF16", {2, 8}, {}}};
  for (int e = 0; e < 2; ++e) {
    const std::string p = "model.layers.0.block_sparse_moe.experts." + std::to_string(e) + ".";
    t.push_back({p + "w1.weight", "BF16", {4, 8}, {}});
    t.push_back({p + "w3.weight", "BF16", {4, 8}, {}});
    t.push_back({p + "w2.weight", "BF16", {8, 4}, {}});
  }
  return t;
}

std::string write_model(const std::string& name, const nlohmann::json& cfg, const std::vector<test::FakeTensor>& t) {
  const std::string dir = test::temp_dir(name);
  test::write_text(dir + "/config.json", cfg.dump());
  test::write_safetensors(dir + "/model.safetensors", t);
  return dir;
}

TEST(Config, NewGeneration) {
  ModelConfig c = parse_config(tiny_mixtral_config().dump(), "config.json");
  EXPECT_EQ(c.architecture, "MixtralForCausalLM");
  EXPECT_EQ(c.rope_theta, 1e6f);
  EXPECT_EQ(c.dtype, DType::BF16);
  EXPECT_EQ(c.num_experts, 2);
  EXPECT_EQ(c.expert_ffn, 4);
}

TEST(Config, OldGenerationAndAliases) {
  nlohmann::json j = tiny_mixtral_config();
  j.erase("rope_parameters");
  j.erase("dtype");
  j.erase("num_local_experts");
  j["rope_theta"] = 500000.0;
  j["torch_dtype"] = "float16";
  j["num_experts"] = 2;
  ModelConfig c = parse_config(j.dump(), "config.json");
  EXPECT_EQ(c.rope_theta, 500000.f);
  EXPECT_EQ(c.dtype, DType::F16);
  EXPECT_EQ(c.num_experts, 2);
}

TEST(Config, QwenSparseLayers) {
  nlohmann::json j = {{"architectures", {"Qwen2MoeForCausalLM"}}, {"hidden_size", 8}, {"intermediate_size", 12},
                      {"moe_intermediate_size", 4}, {"shared_expert_intermediate_size", 6}, {"num_hidden_layers", 4},
                      {"num_attention_heads", 2}, {"vocab_size", 16}, {"num_experts", 4}, {"num_experts_per_tok", 2},
                      {"decoder_sparse_step", 2}, {"mlp_only_layers", {3}}, {"use_sliding_window", false},
                      {"sliding_window", 4096}};
  ModelConfig c = parse_config(j.dump(), "config.json");
  EXPECT_EQ(c.layer_is_moe, (std::vector<bool>{false, true, false, false}));
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_EQ(c.shared_expert_ffn, 6);
  EXPECT_EQ(c.head_dim, 4);
}

struct BadConfigCase {
  const char* name;
  std::function<void(nlohmann::json&)> mutate;
  const char* expected;
};
void PrintTo(const BadConfigCase& c, std::ostream* os) { *os << c.name; }
class BadConfig : public ::testing::TestWithParam<BadConfigCase> {};

TEST_P(BadConfig, NamesTheField) {
  nlohmann::json j = tiny_mixtral_config();
  GetParam().mutate(j);
  const std::string msg = error_of([&] { parse_config(j.dump(), "some/config.json"); });
  EXPECT_NE(msg.find("some/config.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find(GetParam().expected), std::string::npos) << msg;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, BadConfig,
    ::testing::Values(
        BadConfigCase{"unknown_arch", [](auto& j) { j["architectures"] = {"GPT2LMHeadModel"}; }, "GPT2LMHeadModel"},
        BadConfigCase{"yarn", [](auto& j) { j["rope_parameters"]["rope_type"] = "yarn"; }, "rope_type"},
        BadConfigCase{"old_rope_scaling", [](auto& j) {
                        j.erase("rope_parameters");
                        j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
                      }, "rope_scaling"},
        BadConfigCase{"sliding", [](auto& j) { j["sliding_window"] = 4096; }, "sliding_window"},
        BadConfigCase{"quantized", [](auto& j) { j["quantization_config"] = {{"quant_method", "gptq"}}; }, "quantization_config"},
        BadConfigCase{"missing_hidden", [](auto& j) { j.erase("hidden_size"); }, "hidden_size"},
        BadConfigCase{"string_layers", [](auto& j) { j["num_hidden_layers"] = "8"; }, "num_hidden_layers"},
        BadConfigCase{"bad_dtype", [](auto& j) { j["dtype"] = "int8"; }, "dtype"},
        BadConfigCase{"topk_too_big", [](auto& j) { j["num_experts_per_tok"] = 3; }, "num_experts_per_tok"},
        BadConfigCase{"kv_heads", [](auto& j) { j["num_key_value_heads"] = 3; }, "num_key_value_heads"},
        BadConfigCase{"act", [](auto& j) { j["hidden_act"] = "gelu"; }, "hidden_act"}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(Config, NotJson) {
  EXPECT_NE(error_of([] { parse_config("{nope", "x/config.json"); }).find("x/config.json"), std::string::npos);
}

TEST(Weights, TinyModelLoads) {
  const std::string dir = write_model("w_ok", tiny_mixtral_config(), tiny_mixtral_tensors());
  auto w = load_weights(dir);
  EXPECT_EQ(w->layers.size(), 1u);
  EXPECT_EQ(w->layers[0].experts.size(), 2u);
}

TEST(Weights, MissingTensorNamed) {
  auto t = tiny_mixtral_tensors();
  t.erase(t.begin() + 5);  // q_proj
  const std::string dir = write_model("w_missing", tiny_mixtral_config(), t);
  const std::string msg = error_of([&] { load_weights(dir); });
  EXPECT_NE(msg.find("missing tensor 'model.layers.0.self_attn.q_proj.weight'"), std::string::npos) << msg;
}

TEST(Weights, ExtraTensorNamed) {
  auto t = tiny_mixtral_tensors();
  t.push_back({"model.layers.0.mystery.weight", "BF16", {2}, {}});
  const std::string dir = write_model("w_extra", tiny_mixtral_config(), t);
  const std::string msg = error_of([&] { load_weights(dir); });
  EXPECT_NE(msg.find("unexpected tensor 'model.layers.0.mystery.weight'"), std::string::npos) << msg;
}

TEST(Weights, WrongShapeNamed) {
  auto t = tiny_mixtral_tensors();
  t[6].shape = {8, 8};  // k_proj should be [4, 8]
  const std::string dir = write_model("w_shape", tiny_mixtral_config(), t);
  const std::string msg = error_of([&] { load_weights(dir); });
  EXPECT_NE(msg.find("'model.layers.0.self_attn.k_proj.weight' has shape [8, 8], expected [4, 8]"), std::string::npos) << msg;
}

TEST(Weights, WrongDtypeNamed) {
  auto t = tiny_mixtral_tensors();
  t[2].dtype = "I32";  // model.norm.weight
  const std::string dir = write_model("w_dtype", tiny_mixtral_config(), t);
  const std::string msg = error_of([&] { load_weights(dir); });
  EXPECT_NE(msg.find("'model.norm.weight' has dtype I32"), std::string::npos) << msg;
}

TEST(Weights, NoCheckpointNamed) {
  const std::string dir = test::temp_dir("w_none");
  test::write_text(dir + "/config.json", tiny_mixtral_config().dump());
  const std::string msg = error_of([&] { load_weights(dir); });
  EXPECT_NE(msg.find("no model.safetensors"), std::string::npos) << msg;
}

}  // namespace
}  // namespace tiermoe
