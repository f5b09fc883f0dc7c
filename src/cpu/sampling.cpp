#include "cpu/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/check.h"

namespace tiermoe {

int32_t argmax(std::span<const float> logits) {
  int32_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[best]) best = int32_t(i);
  return best;
}

int32_t sample_token(std::span<const float> logits, const SamplingParams& p, double u) {
  CHECK(!logits.empty());
  if (is_greedy(p)) return argmax(logits);
  const int V = int(logits.size());
  std::vector<int32_t> idx(V);
  std::iota(idx.begin(), idx.end(), 0);
  // Candidates sorted by logit (ties: lower index first), cut to top-k.
  const int k = p.top_k > 0 ? std::min(p.top_k, V) : V;
  auto by_logit = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), by_logit);
  idx.resize(k);
  std::vector<double> prob(k);
  const double mx = logits[idx[0]];
  double sum = 0;
  for (int i = 0; i < k; ++i) sum += prob[i] = std::exp((logits[idx[i]] - mx) / p.temperature);
  // Nucleus: the smallest prefix whose probability reaches top_p (at least one token).
  int keep = k;
  if (p.top_p < 1.f) {
    double acc = 0;
    for (int i = 0; i < k; ++i) {
      acc += prob[i] / sum;
      if (acc >= p.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  double r = u * std::accumulate(prob.begin(), prob.begin() + keep, 0.0);
  for (int i = 0; i < keep; ++i) {
    r -= prob[i];
    if (r < 0) return idx[i];
  }
  // Past the end by rounding (u next to 1): the last candidate that has any weight, never one
  // whose probability is 0 (a -inf logit, or one exp() underflows).
  int last = 0;
  for (int i = 0; i < keep; ++i)
    if (prob[i] > 0) last = i;
  return idx[last];
}

}  // namespace tiermoe
