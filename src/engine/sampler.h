// Picks the next token from logits: greedy, or temperature with top-k and top-p, seeded.
// Split in two so that a backend can sample on its device: Sampler holds a sequence's params and
// seeded RNG and draws the one uniform a sample consumes; sample_token() is the pure algorithm
// (the reference the CUDA kernel in src/cuda/sampling.cu is checked against).
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

// Greedy (temperature 0 or top_k 1): argmax, u unused. Otherwise: candidates sorted by logit
// (ties: lower index first), cut to top_k, weights exp((logit - max) / temperature) in double,
// cut to the nucleus (the smallest prefix whose probability reaches top_p), then the candidate
// whose interval of the cumulative weights holds u * total, u in [0, 1).
int32_t sample_token(std::span<const float> logits, const SamplingParams& p, double u);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);  // throws InputError for out-of-range values
  const SamplingParams& params() const { return p_; }
  bool greedy() const { return p_.temperature == 0.f || p_.top_k == 1; }
  // The uniform in [0, 1) the next sample consumes: one draw from the RNG, or none (0) when
  // greedy. Drawn as std::uniform_real_distribution<double> drew it before the split, so
  // seeded outputs are unchanged.
  double draw();
  int32_t sample(std::span<const float> logits) { return sample_token(logits, p_, draw()); }

 private:
  SamplingParams p_;
  std::mt19937_64 rng_;
};

}  // namespace tiermoe
