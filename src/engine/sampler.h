// Picks the next token from logits: greedy, or temperature with top-k and top-p, seeded.
#pragma once
#include <cstdint>
#include <random>
#include <span>

namespace tiermoe {

struct SamplingParams {
  float temperature = 1.0f;  // 0 means greedy
  int top_k = 0;             // 0: all tokens
  float top_p = 1.0f;        // 1: no nucleus cut
  uint64_t seed = 0;
};

// Index of the largest logit; ties go to the lower index.
int32_t argmax(std::span<const float> logits);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);  // throws InputError for out-of-range values
  int32_t sample(std::span<const float> logits);

 private:
  SamplingParams p_;
  std::mt19937_64 rng_;
};

}  // namespace tiermoe
