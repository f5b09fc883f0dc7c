// Every architecture and config variant against transformers (FP32 on CUDA): small random
// models made by scripts/make_fixtures.py, see tests/fixtures/README.md.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <set>

#include "backend/backend.h"
#include "test_util.h"

namespace tiermoe {
namespace {

std::vector<std::string> fixture_names() {
  std::vector<std::string> names;
  for (auto& e : std::filesystem::directory_iterator(test::repo_path("tests/fixtures/models")))
    if (e.is_directory()) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

class GoldenFixture : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    dir_ = test::repo_path("tests/fixtures/models/" + GetParam());
    weights_ = load_weights(dir_);
    ref_ = std::make_unique<Checkpoint>(Checkpoint::open_file(dir_ + "/reference.safetensors"));
  }
  std::string dir_;
  std::unique_ptr<ModelWeights> weights_;
  std::unique_ptr<Checkpoint> ref_;
};

TEST_P(GoldenFixture, LogitsAtEveryPosition) {
  const auto ids = test::ints(ref_->get("ids"));
  const auto expected = test::floats(ref_->get("logits"));
  ASSERT_EQ(expected.size(), ids.size() * size_t(weights_->cfg.vocab_size));
  auto backend = make_cpu_backend(*weights_);
  const auto err = test::logit_errors_at_every_position(*backend, weights_->cfg.vocab_size, ids, expected);
  for (size_t t = 0; t < err.size(); ++t) EXPECT_LT(err[t], 1e-4) << "position " << t;
}

TEST_P(GoldenFixture, GreedyTokensThroughKvCache) {
  auto ids = test::ints(ref_->get("ids"));
  const auto expected = test::ints(ref_->get("greedy_ids"));
  auto backend = make_cpu_backend(*weights_);
  const auto got = test::greedy_tokens(*backend, weights_->cfg.vocab_size, ids, expected.size());
  EXPECT_EQ(got, expected);
}

INSTANTIATE_TEST_SUITE_P(All, GoldenFixture, ::testing::ValuesIn(fixture_names()),
                         [](const auto& info) { return info.param; });

TEST(GoldenFixtures, EveryArchitectureIsCovered) {
  std::set<std::string> archs;
  for (const auto& name : fixture_names())
    archs.insert(load_config(test::repo_path("tests/fixtures/models/" + name)).architecture);
  for (const char* a : {"MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"})
    EXPECT_TRUE(archs.count(a)) << a;
}

}  // namespace
}  // namespace tiermoe
