#include "cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/check.h"
#include "core/thread_pool.h"
#include "cpu/simd.h"

namespace tiermoe {
namespace {

template <DType KV>
void attend_one(float* o, const float* q, const void* k, const void* v, int n_keys, int Hkv, int kvh, int Dh,
                float scale, std::vector<float>& scores) {
  scores.resize(n_keys);
  const size_t stride = size_t(Hkv) * Dh;
  float mx = -INFINITY;
  for (int j = 0; j < n_keys; ++j) {
    const size_t base = size_t(j) * stride + size_t(kvh) * Dh;
    __m256 acc = _mm256_setzero_ps();
    int d = 0;
    for (; d + 8 <= Dh; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8_f32<KV>(k, base + d), acc);
    float s = hsum(acc);
    for (; d < Dh; ++d) s += q[d] * load1_f32<KV>(k, base + d);
    s *= scale;
    scores[j] = s;
    mx = std::max(mx, s);
  }
  float denom = 0.f;
  for (int j = 0; j < n_keys; ++j) {
    scores[j] = std::exp(scores[j] - mx);
    denom += scores[j];
  }
  std::fill(o, o + Dh, 0.f);
  for (int j = 0; j < n_keys; ++j) {
    const size_t base = size_t(j) * stride + size_t(kvh) * Dh;
    const __m256 p = _mm256_set1_ps(scores[j] / denom);
    int d = 0;
    for (; d + 8 <= Dh; d += 8)
      _mm256_storeu_ps(o + d, _mm256_fmadd_ps(p, load8_f32<KV>(v, base + d), _mm256_loadu_ps(o + d)));
    for (; d < Dh; ++d) o[d] += scores[j] / denom * load1_f32<KV>(v, base + d);
  }
}

template <DType KV>
void attention_typed(float* out, const float* q, const void* k, const void* v, int T, int n_past, int H, int Hkv,
                     int Dh) {
  const float scale = 1.0f / std::sqrt(float(Dh));
  const int group = H / Hkv;
  parallel_for(size_t(T) * H, [&](size_t b, size_t e) {
    thread_local std::vector<float> scores;
    for (size_t i = b; i < e; ++i) {
      const int t = int(i / H), h = int(i % H);
      attend_one<KV>(out + i * Dh, q + i * Dh, k, v, n_past + t + 1, Hkv, h / group, Dh, scale, scores);
    }
  });
}

}  // namespace

void attention_causal(float* out, const float* q, const void* k, const void* v, DType kv_dtype, int T, int n_past,
                      int H, int Hkv, int Dh) {
  switch (kv_dtype) {
    case DType::F32: return attention_typed<DType::F32>(out, q, k, v, T, n_past, H, Hkv, Dh);
    case DType::BF16: return attention_typed<DType::BF16>(out, q, k, v, T, n_past, H, Hkv, Dh);
    default: CHECK_MSG(false, "attention: K/V must be F32 or BF16");
  }
}

}  // namespace tiermoe
