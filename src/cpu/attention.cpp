#include "cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/check.h"
#include "core/thread_pool.h"
#include "cpu/simd.h"
#include "kv/fp8_rows.h"

namespace tiermoe {
namespace {

// K or V rows of one dtype: value i as FP32, 8 at a time; every row's scale 1.
template <DType KV>
struct PlainRows {
  const void* p;
  __m256 load8(size_t i) const { return load8_f32<KV>(p, i); }
  float load1(size_t i) const { return load1_f32<KV>(p, i); }
  static constexpr bool kScaled = false;
  float row_scale(size_t) const { return 1.f; }
};
// FP8 rows: a code c read as the half-precision number with c's bits shifted into place, c * 2^-8
// exactly (E4M3 and FP16 differ by 8 in exponent bias, subnormals included), so the row's scale is
// 2^(e + 8). The sign bit goes to bit 15, the rest lands 7 bits up.
struct Fp8RowsReader {
  Fp8Rows r;
  int Dh;
  static __m128i half_bits(__m128i c16) {
    return _mm_or_si128(_mm_slli_epi16(_mm_and_si128(c16, _mm_set1_epi16(0x80)), 8),
                        _mm_slli_epi16(_mm_and_si128(c16, _mm_set1_epi16(0x7f)), 7));
  }
  __m256 load8(size_t i) const {
    return _mm256_cvtph_ps(half_bits(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r.codes + i)))));
  }
  float load1(size_t i) const { return _cvtsh_ss(uint16_t(_mm_extract_epi16(half_bits(_mm_cvtsi32_si128(r.codes[i])), 0))); }
  static constexpr bool kScaled = true;
  float row_scale(size_t i) const { return fp8_exp2(r.exps[i / Dh] + 8); }
};

// With a row's scale s: its score is s times the dot with its loaded values, its weight p s (a test
// holds FP8 rows bit-equal to their BF16 decodings, Dh % 8 tails included). Not inlined into
// attention_rows's loop: inlined, BF16 prompts took 5-10% longer to their first token (tinymix-code,
// 2000 tokens, this machine).
template <class Rows>
[[gnu::noinline]] void attend_one(float* o, const float* q, Rows k, Rows v, int n_keys, int Hkv, int kvh, int Dh, float scale,
                std::vector<float>& scores) {
  scores.resize(n_keys);
  const size_t stride = size_t(Hkv) * Dh;
  float mx = -INFINITY;
  for (int j = 0; j < n_keys; ++j) {
    const size_t base = size_t(j) * stride + size_t(kvh) * Dh;
    __m256 acc = _mm256_setzero_ps();
    int d = 0;
    for (; d + 8 <= Dh; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), k.load8(base + d), acc);
    float s = hsum(acc);
    for (; d < Dh; ++d) s += q[d] * k.load1(base + d);
    if constexpr (Rows::kScaled) s *= k.row_scale(base);
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
    float w = scores[j] / denom;
    if constexpr (Rows::kScaled) w *= v.row_scale(base);
    const __m256 p = _mm256_set1_ps(w);
    int d = 0;
    for (; d + 8 <= Dh; d += 8) _mm256_storeu_ps(o + d, _mm256_fmadd_ps(p, v.load8(base + d), _mm256_loadu_ps(o + d)));
    for (; d < Dh; ++d) o[d] += w * v.load1(base + d);
  }
}

template <class Rows>
void attention_rows(float* out, const float* q, Rows k, Rows v, int T, int n_past, int H, int Hkv, int Dh) {
  const float scale = 1.0f / std::sqrt(float(Dh));
  const int group = H / Hkv;
  parallel_for(size_t(T) * H, [&](size_t b, size_t e) {
    thread_local std::vector<float> scores;
    for (size_t i = b; i < e; ++i) {
      const int t = int(i / H), h = int(i % H);
      attend_one(out + i * Dh, q + i * Dh, k, v, n_past + t + 1, Hkv, h / group, Dh, scale, scores);
    }
  });
}

template <DType KV>
void attention_typed(float* out, const float* q, const void* k, const void* v, int T, int n_past, int H, int Hkv,
                     int Dh) {
  attention_rows(out, q, PlainRows<KV>{k}, PlainRows<KV>{v}, T, n_past, H, Hkv, Dh);
}

}  // namespace

void attention_causal_fp8(float* out, const float* q, Fp8Rows k, Fp8Rows v, int T, int n_past, int H, int Hkv, int Dh) {
  attention_rows(out, q, Fp8RowsReader{k, Dh}, Fp8RowsReader{v, Dh}, T, n_past, H, Hkv, Dh);
}

void attention_causal(float* out, const float* q, const void* k, const void* v, DType kv_dtype, int T, int n_past,
                      int H, int Hkv, int Dh) {
  switch (kv_dtype) {
    case DType::F32: return attention_typed<DType::F32>(out, q, k, v, T, n_past, H, Hkv, Dh);
    case DType::BF16: return attention_typed<DType::BF16>(out, q, k, v, T, n_past, H, Hkv, Dh);
    default: CHECK_MSG(false, "attention: K/V must be F32 or BF16");
  }
}

}  // namespace tiermoe
