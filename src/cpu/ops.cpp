#include "cpu/ops.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/simd.h"

namespace tiermoe {

void rmsnorm(float* y, const float* x, const float* w, int T, int D, float eps) {
  for (int t = 0; t < T; ++t) {
    const float* xr = x + size_t(t) * D;
    float* yr = y + size_t(t) * D;
    const float inv = 1.0f / std::sqrt(dot_f32(xr, xr, D) / float(D) + eps);
    for (int i = 0; i < D; ++i) yr[i] = xr[i] * inv * w[i];
  }
}

void rope_inv_freq(float* inv_freq, int Dh, float theta) {
  for (int i = 0; i < Dh / 2; ++i) inv_freq[i] = 1.0f / std::pow(theta, float(2 * i) / float(Dh));
}

void rope_angles(const float* inv_freq, int half, int pos, float* cs, float* sn) {
  for (int i = 0; i < half; ++i) {
    const float angle = inv_freq[i] * float(pos);
    cs[i] = std::cos(angle);
    sn[i] = std::sin(angle);
  }
}

void rope_rotate(float* v, const float* cs, const float* sn, int half, float sign) {
  for (int i = 0; i < half; ++i) {
    const float s = sign * sn[i], a = v[i], b = v[i + half];
    v[i] = a * cs[i] - b * s;
    v[i + half] = b * cs[i] + a * s;
  }
}

void rope(float* x, const int32_t* pos, int T, int n_heads, int Dh, float theta) {
  const int half = Dh / 2;
  std::vector<float> inv_freq(half), cs(half), sn(half);
  rope_inv_freq(inv_freq.data(), Dh, theta);
  for (int t = 0; t < T; ++t) {
    rope_angles(inv_freq.data(), half, pos[t], cs.data(), sn.data());
    for (int h = 0; h < n_heads; ++h) rope_rotate(x + (size_t(t) * n_heads + h) * Dh, cs.data(), sn.data(), half);
  }
}

void silu_mul(float* y, const float* gate, const float* up, int T, int F) {
  const size_t n = size_t(T) * F;
  for (size_t i = 0; i < n; ++i) {
    const float g = gate[i];
    y[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void add_bias(float* x, const float* b, int T, int N) {
  for (int t = 0; t < T; ++t) axpy_f32(x + size_t(t) * N, 1.0f, b, N);
}

void clamp(float* x, int n, float c) {
  for (int i = 0; i < n; ++i) x[i] = std::min(c, std::max(-c, x[i]));
}

void route_softmax_topk(const float* logits, int E, int K, bool renormalize, int32_t* ids, float* weights) {
  float mx = logits[0];
  for (int e = 1; e < E; ++e) mx = std::max(mx, logits[e]);
  // Selection on the logits (softmax is monotonic); the strict '>' keeps the lower index on ties.
  for (int k = 0; k < K; ++k) {
    int best = -1;
    for (int e = 0; e < E; ++e) {
      bool taken = false;
      for (int j = 0; j < k; ++j) taken |= ids[j] == e;
      if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
    }
    ids[k] = best;
  }
  float denom = 0.f;
  for (int e = 0; e < E; ++e) denom += std::exp(logits[e] - mx);
  float sum = 0.f;
  for (int k = 0; k < K; ++k) {
    weights[k] = std::exp(logits[ids[k]] - mx) / denom;
    sum += weights[k];
  }
  if (renormalize)
    for (int k = 0; k < K; ++k) weights[k] /= sum;
}

}  // namespace tiermoe
