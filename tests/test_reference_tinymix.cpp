// tinymix-code against the outputs of transformers (FP32 on CUDA) stored in reference.safetensors.
#include <gtest/gtest.h>

#include "backend/backend.h"
#include "test_util.h"

namespace tiermoe {
namespace {

using test::floats;
using test::ints;

class TinymixReference : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    weights_ = load_weights(test::tinymix_dir()).release();
    ref_ = new Checkpoint(Checkpoint::open_file(test::tinymix_dir() + "/reference.safetensors"));
  }
  static void TearDownTestSuite() {
    delete ref_;
    delete weights_;
  }
  static ModelWeights* weights_;
  static Checkpoint* ref_;
};
ModelWeights* TinymixReference::weights_ = nullptr;
Checkpoint* TinymixReference::ref_ = nullptr;

TEST_F(TinymixReference, ShortPromptLogitsAtEveryPosition) {
  const auto ids = ints(ref_->get("short_ids"));
  const auto expected = floats(ref_->get("short_logits"));
  ASSERT_EQ(expected.size(), ids.size() * size_t(weights_->cfg.vocab_size));
  auto backend = make_cpu_backend(*weights_);
  const auto err = test::logit_errors_at_every_position(*backend, weights_->cfg.vocab_size, ids, expected);
  for (size_t t = 0; t < err.size(); ++t) EXPECT_LT(err[t], 1e-4) << "position " << t;
}

TEST_F(TinymixReference, LongContextLogits) {
  const auto ids = ints(ref_->get("long_ids"));
  const auto positions = ints(ref_->get("long_positions"));
  const auto expected = floats(ref_->get("long_logits"));
  const int V = weights_->cfg.vocab_size, T = int(ids.size());
  auto backend = make_cpu_backend(*weights_);
  auto cache = backend->new_cache();
  std::vector<float> logits(size_t(T) * V);
  backend->forward(ids, *cache, T, logits.data());
  for (size_t i = 0; i < positions.size(); ++i)
    EXPECT_LT(test::rel_l2(&logits[size_t(positions[i]) * V], &expected[i * V], V), 1e-4) << "position " << positions[i];
}

// Decoding token by token through the KV cache must reproduce transformers' greedy tokens.
TEST_F(TinymixReference, Greedy32TokensExact) {
  auto ids = ints(ref_->get("short_ids"));
  const auto expected = ints(ref_->get("short_greedy_ids"));
  auto backend = make_cpu_backend(*weights_);
  const auto got = test::greedy_tokens(*backend, weights_->cfg.vocab_size, ids, expected.size());
  EXPECT_EQ(got, expected);
}

}  // namespace
}  // namespace tiermoe
