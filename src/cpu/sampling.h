// The sampling op: picks a token from one logits row, given the uniform it consumes. The CPU
// twin of the CUDA kernel in src/cuda/sampling.cu; the seeded RNG that draws the uniform is
// the engine's (engine/sampler.h).
#pragma once
#include <cstdint>
#include <span>

namespace tiermoe {

struct SamplingParams {
  float temperature = 1.0f;  // 0 means greedy
  int top_k = 0;             // 0: all tokens
  float top_p = 1.0f;        // 1: no nucleus cut
  uint64_t seed = 0;
};

// Whether p picks the argmax (temperature 0 or top_k 1): no uniform is consumed.
inline bool is_greedy(const SamplingParams& p) { return p.temperature == 0.f || p.top_k == 1; }

// Index of the largest logit; ties go to the lower index.
int32_t argmax(std::span<const float> logits);

// Greedy (temperature 0 or top_k 1): argmax, u unused. Otherwise: candidates sorted by logit
// (ties: lower index first), cut to top_k, weights exp((logit - max) / temperature) in double,
// cut to the nucleus (the smallest prefix whose probability reaches top_p), then the candidate
// whose interval of the cumulative weights holds u * total, u in [0, 1).
int32_t sample_token(std::span<const float> logits, const SamplingParams& p, double u);

}  // namespace tiermoe
