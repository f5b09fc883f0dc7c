// Picks the next token from logits: greedy, or temperature with top-k and top-p, seeded.
// Sampler holds a sequence's params and seeded RNG and draws the one uniform a sample consumes;
// sample_token() (cpu/sampling.h) is the algorithm, so a backend can sample on its device.
#pragma once
#include <cstdint>
#include <random>
#include <span>

#include "cpu/sampling.h"

namespace tiermoe {

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);  // throws InputError for out-of-range values
  const SamplingParams& params() const { return p_; }
  bool greedy() const { return is_greedy(p_); }
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
