#include "engine/sampler.h"

#include <cmath>
#include <limits>
#include <string>

#include "core/check.h"

namespace tiermoe {

Sampler::Sampler(const SamplingParams& p) : p_(p), rng_(p.seed) {
  if (!(p.temperature >= 0.f) || !std::isfinite(p.temperature))
    throw InputError("temperature must be a finite number >= 0, got " + std::to_string(p.temperature));
  if (!(p.top_p > 0.f && p.top_p <= 1.f)) throw InputError("top_p must be in (0, 1], got " + std::to_string(p.top_p));
  if (p.top_k < 0) throw InputError("top_k must be >= 0, got " + std::to_string(p.top_k));
}

double Sampler::draw() {
  if (greedy()) return 0.0;
  // libstdc++'s uniform_real_distribution<double>(0, total) returns exactly
  // generate_canonical<double, 53>(rng) * total + 0: the same u, scaled in sample_token().
  return std::generate_canonical<double, std::numeric_limits<double>::digits>(rng_);
}

}  // namespace tiermoe
