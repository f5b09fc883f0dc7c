// The tiered KV cache. Per layer it keeps every token's key/value rounded to BF16 (the exact
// tiers), and, once calibrated, the codes of every whole page (codes, FP8 anchors, norms).
//
// Tiers are a function of a query's position p and a key's page: sink (key < sink), window
// (the key's page ends less than W tokens before p), middle, archive (page ended at least M
// before p). A query therefore sees each key exactly as a decoding cache would hold it at
// step p, whatever the chunking of the prompt: this is what gives `ppl` decode semantics in
// one pass. Archive codes are a prefix of the middle's stages, so migration is truncation.
//
// Two attention paths compute the same thing:
//   - lookup tables (decode, T <= spec.lut_max_tokens): per query a table of q.codeword per
//     slot; a key's score is a sum of lookups; attention weights are accumulated per codeword
//     and multiplied by the codebook once; the exact part is merged by log-sum-exp;
//   - decoded shadows (prefill chunks): each coded key/value is also held decoded in FP32 so
//     long evaluations cost what exact attention costs. The shadow is simulation state of
//     this CPU reference, not counted as stored; a test checks both paths agree.
// Legend: T tokens, H/Hkv heads, Dh head dim, P page tokens.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "core/thread_pool.h"
#include "cpu/simd.h"
#include "kv/kv_cache.h"
#include "kv/kv_codec.h"
#include "kv/kv_profile.h"
#include "kv/kv_spec.h"

namespace tiermoe {
namespace {

inline float dot(const float* a, const float* b, int n) {
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* y, float a, const float* x, int n) {
  const __m256 av = _mm256_set1_ps(a);
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}

// RoPE of one head vector at position pos (sign -1 undoes it); inv_freq[Dh/2].
void rope1(float* v, int pos, int Dh, const std::vector<float>& inv_freq, float sign) {
  const int half = Dh / 2;
  for (int i = 0; i < half; ++i) {
    const float angle = inv_freq[size_t(i)] * float(pos);
    const float c = std::cos(angle), s = sign * std::sin(angle);
    const float a = v[i], b = v[i + half];
    v[i] = a * c - b * s;
    v[i + half] = b * c + a * s;
  }
}

struct Stream {  // K or V of one layer
  std::vector<float> exact;   // [len, Hkv, Dh] BF16-rounded
  std::vector<float> mid;     // [len, Hkv, Dh] decoded middle codes (shadow)
  std::vector<float> arch;    // [len, Hkv, Dh] decoded archive codes (when a strict prefix)
  std::vector<uint16_t> codes;  // [len, Hkv, n_codes]
  std::vector<uint8_t> anc;     // [len, Hkv, n_anchors]
  std::vector<float> norm;      // [len, Hkv]
};

struct Layer {
  int len = 0, appended = 0, encoded = 0;
  bool calibrated = false;
  Stream s[2];                      // 0: K, 1: V
  std::vector<VqCodec> codec;       // [Hkv][2]
  std::vector<double> qcov;         // [Hkv, Dh, Dh] sum of q q^T (before calibration)
  long qcount = 0;
};

class TieredKvCache final : public KvCache {
 public:
  TieredKvCache(const KvGeometry& g, const KvSpec& spec, const KvProfile* profile)
      : g_(g), spec_(spec), layers_(size_t(g.num_layers)) {
    CHECK(g.head_dim <= 256);
    const int Dh = g.head_dim;
    for (int l = 0; l < g.num_layers; ++l) {
      Layer& L = layers_[size_t(l)];
      L.codec.resize(size_t(g.num_kv_heads) * 2);
      if (profile) {
        for (int h = 0; h < g.num_kv_heads; ++h)
          for (int kv = 0; kv < 2; ++kv) L.codec[size_t(h) * 2 + kv] = profile->at(l, h, kv);
        L.calibrated = true;
      } else if (spec_.k.query_aware && spec_.k.kind == "vq") {
        L.qcov.assign(size_t(g.num_kv_heads) * Dh * Dh, 0.0);
      }
    }
    calib_pos_ = profile ? 0 : spec_.calib_tokens - 1;
    pre_rope_ = spec_.k.kind == "vq" && spec_.k.pre_rope;
    if (pre_rope_) {
      CHECK_MSG(g.rope_theta > 0, "pre-RoPE key coding needs the RoPE base");
      for (int i = 0; i < Dh / 2; ++i) inv_freq_.push_back(1.0f / std::pow(g.rope_theta, float(2 * i) / float(Dh)));
    }
    set_shapes();
  }

  void append(int layer, const float* k, const float* v, int T) override {
    Layer& L = layers_[size_t(layer)];
    const size_t row = size_t(g_.num_kv_heads) * g_.head_dim;
    for (int kv = 0; kv < 2; ++kv) {
      auto& e = L.s[kv].exact;
      const float* src = kv == 0 ? k : v;
      e.resize(size_t(L.len + T) * row);
      for (size_t i = 0; i < size_t(T) * row; ++i) e[size_t(L.len) * row + i] = bf16_to_f32(f32_to_bf16(src[i]));
    }
    L.len += T;
    L.appended = T;
  }

  void attend(int layer, const float* q, int T, float* out) const override {
    auto* self = const_cast<TieredKvCache*>(this);  // calibration and page encoding are lazy
    Layer& L = self->layers_[size_t(layer)];
    CHECK(T <= L.appended);
    const int p0 = L.len - T;
    if (!L.calibrated) {
      self->collect_queries(L, q, T, p0);
      if (L.len >= spec_.calib_tokens) self->calibrate(layer);
    }
    if (L.calibrated) self->encode_up_to(layer, coded_end(L.len - 1));
    const bool lut = T <= spec_.lut_max_tokens && spec_.k.kind == "vq" && spec_.v.kind == "vq" && !pre_rope_;
    const int H = g_.num_heads, Dh = g_.head_dim, group = H / g_.num_kv_heads;
    parallel_for(size_t(T) * H, [&](size_t b, size_t e) {
      thread_local std::vector<float> scores;
      for (size_t i = b; i < e; ++i) {
        const int t = int(i / H), h = int(i % H);
        if (lut)
          attend_lut(L, q + i * Dh, p0 + t, h / group, out + i * Dh);
        else
          attend_shadow(L, q + i * Dh, p0 + t, h / group, out + i * Dh, scores);
      }
    });
  }

  int length() const override { return layers_.empty() ? 0 : layers_.back().len; }

  void truncate(int n) override {
    const size_t row = size_t(g_.num_kv_heads) * g_.head_dim;
    for (Layer& L : layers_) {
      CHECK(n <= L.len);
      L.len = n;
      L.appended = 0;
      L.encoded = std::min(L.encoded, n / spec_.page * spec_.page);
      for (Stream& s : L.s) {
        s.exact.resize(size_t(n) * row);
        if (s.mid.size() > size_t(L.encoded) * row) s.mid.resize(size_t(L.encoded) * row);
        if (s.arch.size() > size_t(L.encoded) * row) s.arch.resize(size_t(L.encoded) * row);
      }
    }
  }

  size_t bytes() const override { return size_t(stats().token_bytes); }

  Stats stats() const override {
    Stats st;
    const int len = length(), p = len - 1, Dh = g_.head_dim;
    const bool cal = !layers_.empty() && layers_[0].calibrated && p >= calib_pos_;
    const int ce = cal ? std::max(coded_end(p), 0) : 0, ae = cal ? std::min(archive_end(p), ce) : 0;
    const int sink = std::min(spec_.sink, len);
    const long n_arch = std::max(0, ae - sink), n_mid = std::max(0, ce - std::max(ae, sink));
    const long n_win = len - sink - n_arch - n_mid;
    auto tier_bits = [&](int kv, int stages_of_tier) {
      double b = 0;
      int n = 0;
      for (const Layer& L : layers_)
        for (int h = 0; h < g_.num_kv_heads; ++h, ++n) {
          const VqCodec& c = L.codec[size_t(h) * 2 + kv];
          b += c.token_bits(stages_of_tier < 0 ? c.n_stages() : std::min(stages_of_tier, c.n_stages()));
        }
      return n ? b / n / Dh : 0;
    };
    const int arch_stages = spec_.archive_stages > 0 ? spec_.archive_stages : 1 << 20;
    st.tiers.push_back({"sink", long(sink), 16, 16});
    st.tiers.push_back({"window", n_win, 16, 16});
    st.tiers.push_back({"middle", n_mid, cal ? tier_bits(0, -1) : 0, cal ? tier_bits(1, -1) : 0});
    st.tiers.push_back({"archive", n_arch, cal ? tier_bits(0, arch_stages) : 0, cal ? tier_bits(1, arch_stages) : 0});
    double kb = 0, vb = 0;
    for (const auto& t : st.tiers) kb += t.tokens * t.k_bits, vb += t.tokens * t.v_bits;
    st.k_bits = len ? kb / len : 0;
    st.v_bits = len ? vb / len : 0;
    const double values = double(len) * g_.num_layers * g_.num_kv_heads * Dh;
    st.token_bytes = values * (st.k_bits + st.v_bits) / 8;
    if (cal || (!layers_.empty() && layers_[0].calibrated))
      for (const Layer& L : layers_)
        for (const VqCodec& c : L.codec) st.meta_bytes += c.meta_bits() / 8;
    return st;
  }

  const std::vector<Layer>& layers() const { return layers_; }
  const KvSpec& spec() const { return spec_; }

 private:
  void set_shapes() {
    nk_[0] = nk_[1] = na_[0] = na_[1] = 0;
    if (layers_.empty() || !layers_[0].calibrated) return;
    for (int kv = 0; kv < 2; ++kv) {
      nk_[kv] = layers_[0].codec[size_t(kv)].n_codes();
      na_[kv] = int(layers_[0].codec[size_t(kv)].anchors.size());
    }
  }

  // Tokens [0, coded_end(p)) are coded for a query at p (whole pages at least W old).
  int coded_end(int p) const {
    const int x = p - spec_.window + 1;
    return x <= 0 ? 0 : x / spec_.page * spec_.page;
  }
  int archive_end(int p) const {
    const int x = p - spec_.middle + 1;
    return x <= 0 ? 0 : x / spec_.page * spec_.page;
  }
  int stages_for(int kv, bool archive, const VqCodec& c) const {
    return archive && spec_.archive_stages > 0 ? std::min(spec_.archive_stages, c.n_stages()) : c.n_stages();
  }

  void collect_queries(Layer& L, const float* q, int T, int p0) {
    if (L.qcov.empty()) return;
    const int H = g_.num_heads, Dh = g_.head_dim, group = H / g_.num_kv_heads;
    for (int t = 0; t < T && p0 + t < spec_.calib_tokens; ++t)
      for (int h = 0; h < H; ++h) {
        float x[256];
        std::copy_n(q + (size_t(t) * H + h) * Dh, Dh, x);
        if (pre_rope_) rope1(x, p0 + t, Dh, inv_freq_, -1.f);
        double* c = L.qcov.data() + size_t(h / group) * Dh * Dh;
        for (int i = 0; i < Dh; ++i)
          for (int j = 0; j < Dh; ++j) c[size_t(i) * Dh + j] += double(x[i]) * x[j];
      }
    L.qcount += T;
  }

  void calibrate(int layer) {
    Layer& L = layers_[size_t(layer)];
    const int Dh = g_.head_dim, Hkv = g_.num_kv_heads, N = spec_.calib_tokens;
    parallel_for(size_t(Hkv) * 2, [&](size_t b, size_t e) {
      std::vector<float> x(size_t(N) * Dh);
      for (size_t i = b; i < e; ++i) {
        const int h = int(i / 2), kv = int(i % 2);
        for (int n = 0; n < N; ++n) {
          std::copy_n(L.s[kv].exact.data() + (size_t(n) * Hkv + h) * Dh, Dh, x.data() + size_t(n) * Dh);
          if (kv == 0 && pre_rope_) rope1(x.data() + size_t(n) * Dh, n, Dh, inv_freq_, -1.f);
        }
        std::vector<double> qc;
        if (kv == 0 && !L.qcov.empty()) qc.assign(L.qcov.begin() + long(h) * Dh * Dh, L.qcov.begin() + long(h + 1) * Dh * Dh);
        const uint64_t seed = spec_.seed * 0x9E3779B97F4A7C15ull + uint64_t(layer) * 131 + uint64_t(h) * 7 + uint64_t(kv);
        L.codec[i].fit(kv == 0 ? spec_.k : spec_.v, x.data(), N, Dh, qc, seed, spec_.kmeans_iters);
      }
    });
    L.calibrated = true;
    L.qcov.clear();
    L.qcov.shrink_to_fit();
    set_shapes();
  }

  // Encodes whole pages until at least `end` tokens are coded.
  void encode_up_to(int layer, int end) {
    Layer& L = layers_[size_t(layer)];
    if (end <= L.encoded) return;
    const int P = spec_.page, Hkv = g_.num_kv_heads, Dh = g_.head_dim;
    const int from = L.encoded, to = (end + P - 1) / P * P;
    CHECK(to <= L.len);
    const size_t row = size_t(Hkv) * Dh;
    for (int kv = 0; kv < 2; ++kv) {
      Stream& s = L.s[kv];
      const VqCodec& c0 = L.codec[size_t(kv)];
      s.mid.resize(size_t(to) * row);
      if (c0.kind == "vq") {
        s.codes.resize(size_t(to) * Hkv * nk_[kv]);
        s.anc.resize(size_t(to) * Hkv * na_[kv]);
        s.norm.resize(size_t(to) * Hkv);
        if (stages_for(kv, true, c0) < c0.n_stages()) s.arch.resize(size_t(to) * row);
      }
      if (c0.kind == "kivi") {
        std::copy(s.exact.begin() + long(size_t(from) * row), s.exact.begin() + long(size_t(to) * row), s.mid.begin() + long(size_t(from) * row));
        parallel_for(size_t((to - from) / P) * Hkv, [&](size_t b, size_t e) {
          for (size_t i = b; i < e; ++i) {
            const int pg = int(i / Hkv), h = int(i % Hkv);
            L.codec[size_t(h) * 2 + kv].kivi_roundtrip(s.mid.data() + size_t(from + pg * P) * row + size_t(h) * Dh, P, row, kv == 0);
          }
        });
        continue;
      }
      parallel_for(size_t(to - from) * Hkv, [&](size_t b, size_t e) {
        for (size_t i = b; i < e; ++i) {
          const size_t t = size_t(from) + i / Hkv, h = i % Hkv;
          const VqCodec& c = L.codec[h * 2 + kv];
          float x[256];
          std::copy_n(s.exact.data() + t * row + h * Dh, Dh, x);
          const bool unrope = kv == 0 && pre_rope_;
          if (unrope) rope1(x, int(t), Dh, inv_freq_, -1.f);
          float* m = s.mid.data() + t * row + h * Dh;
          if (c.kind != "vq") {
            std::copy_n(x, Dh, m);
            c.roundtrip_elementwise(m);
            continue;
          }
          uint16_t* codes = s.codes.data() + (t * Hkv + h) * nk_[kv];
          uint8_t* anc = s.anc.data() + (t * Hkv + h) * na_[kv];
          float& nrm = s.norm[t * Hkv + h];
          c.encode(x, codes, anc, &nrm);
          c.decode(codes, anc, nrm, c.n_stages(), m);
          if (unrope) rope1(m, int(t), Dh, inv_freq_, 1.f);
          if (!s.arch.empty()) {
            float* a = s.arch.data() + t * row + h * Dh;
            c.decode(codes, anc, nrm, stages_for(kv, true, c), a);
            if (unrope) rope1(a, int(t), Dh, inv_freq_, 1.f);
          }
        }
      });
    }
    L.encoded = to;
  }

  // Key ranges for a query at p: [0, sink) exact, [sink, ae) archive, [.., ce) middle, rest exact.
  void ranges(const Layer& L, int p, int& sink, int& ae, int& ce) const {
    const bool cal = L.calibrated && p >= calib_pos_;
    sink = std::min(spec_.sink, p + 1);
    ce = cal ? std::max(coded_end(p), sink) : sink;
    ae = cal ? std::clamp(archive_end(p), sink, ce) : sink;
  }

  void attend_shadow(const Layer& L, const float* q, int p, int kvh, float* o, std::vector<float>& sc) const {
    const int Dh = g_.head_dim, n = p + 1;
    const size_t row = size_t(g_.num_kv_heads) * Dh, off = size_t(kvh) * Dh;
    int sink, ae, ce;
    ranges(L, p, sink, ae, ce);
    auto src = [&](int kv, int j) -> const float* {
      const Stream& s = L.s[kv];
      if (j < sink || j >= ce) return s.exact.data() + size_t(j) * row + off;
      if (j < ae && !s.arch.empty()) return s.arch.data() + size_t(j) * row + off;
      return s.mid.data() + size_t(j) * row + off;
    };
    const float scale = 1.0f / std::sqrt(float(Dh));
    sc.resize(size_t(n));
    float mx = -INFINITY;
    for (int j = 0; j < n; ++j) {
      sc[size_t(j)] = dot(q, src(0, j), Dh) * scale;
      mx = std::max(mx, sc[size_t(j)]);
    }
    float den = 0;
    for (int j = 0; j < n; ++j) den += (sc[size_t(j)] = std::exp(sc[size_t(j)] - mx));
    std::fill(o, o + Dh, 0.f);
    for (int j = 0; j < n; ++j) axpy(o, sc[size_t(j)] / den, src(1, j), Dh);
  }

  void attend_lut(const Layer& L, const float* q, int p, int kvh, float* o) const {
    const int Dh = g_.head_dim, n = p + 1;
    const size_t row = size_t(g_.num_kv_heads) * Dh, off = size_t(kvh) * Dh;
    int sink, ae, ce;
    ranges(L, p, sink, ae, ce);
    const float scale = 1.0f / std::sqrt(float(Dh));

    // Exact part: sink and window keys.
    float me = -INFINITY, le = 0;
    std::vector<float> oe(size_t(Dh), 0.f), se;
    auto exact_keys = [&](auto fn) {
      for (int j = 0; j < sink; ++j) fn(j);
      for (int j = ce; j < n; ++j) fn(j);
    };
    exact_keys([&](int j) { se.push_back(dot(q, L.s[0].exact.data() + size_t(j) * row + off, Dh) * scale); me = std::max(me, se.back()); });
    size_t idx = 0;
    exact_keys([&](int j) {
      const float w = std::exp(se[idx++] - me);
      le += w;
      axpy(oe.data(), w, L.s[1].exact.data() + size_t(j) * row + off, Dh);
    });
    if (ce <= sink) {
      for (int d = 0; d < Dh; ++d) o[d] = oe[size_t(d)] / le;
      return;
    }

    // Coded part: per-query lookup tables over the key codebooks.
    const VqCodec& kc = L.codec[size_t(kvh) * 2];
    const VqCodec& vc = L.codec[size_t(kvh) * 2 + 1];
    float qr[256];  // the query in the key codec's rotated basis, rotated once
    if (kc.rot.empty()) std::copy_n(q, Dh, qr);
    else
      for (int r = 0; r < Dh; ++r) qr[r] = dot(kc.rot.data() + size_t(r) * Dh, q, Dh);
    const float qmean = kc.mean.empty() ? 0.f : dot(q, kc.mean.data(), Dh);
    std::vector<float> lut;            // concatenated tables of every slot of every stage
    std::vector<int> lut_off;
    for (const auto& st : kc.stages)
      for (const VqSlot& s : st) {
        lut_off.push_back(int(lut.size()));
        for (int c = 0; c < (1 << s.bits); ++c) {
          float acc = 0;
          for (int l = 0; l < s.len; ++l) acc += qr[kc.rest[size_t(s.c0 + l)]] * s.book[size_t(c) * s.len + l];
          lut.push_back(acc);
        }
      }
    std::vector<float> qa(kc.anchors.size());
    for (size_t a = 0; a < kc.anchors.size(); ++a) qa[a] = qr[kc.anchors[a]] * kc.anchor_scale[a];
    const int nstk_mid = kc.n_stages(), nstk_arch = stages_for(0, true, kc);
    const int nstv_mid = vc.n_stages(), nstv_arch = stages_for(1, true, vc);

    std::vector<float> sc(size_t(ce - sink));
    float mc = -INFINITY;
    for (int j = sink; j < ce; ++j) {
      const uint16_t* codes = L.s[0].codes.data() + (size_t(j) * g_.num_kv_heads + kvh) * nk_[0];
      const uint8_t* anc = L.s[0].anc.data() + (size_t(j) * g_.num_kv_heads + kvh) * na_[0];
      const int ncodes = kc.n_codes(j < ae ? nstk_arch : nstk_mid);
      float s = 0;
      for (int c = 0; c < ncodes; ++c) s += lut[size_t(lut_off[size_t(c)] + codes[c])];
      s *= L.s[0].norm[size_t(j) * g_.num_kv_heads + kvh];
      for (size_t a = 0; a < qa.size(); ++a) s += qa[a] * fp8_e4m3_to_f32(anc[a]);
      s = (s + qmean) * scale;
      sc[size_t(j - sink)] = s;
      mc = std::max(mc, s);
    }
    // Values: attention weight accumulated per codeword, then one pass over the codebooks.
    std::vector<int> vlut_off;
    int vtot = 0;
    for (const auto& st : vc.stages)
      for (const VqSlot& s : st) vlut_off.push_back(vtot), vtot += 1 << s.bits;
    std::vector<float> wacc(size_t(vtot), 0.f), aacc(vc.anchors.size(), 0.f);
    float lc = 0;
    for (int j = sink; j < ce; ++j) {
      const float w = std::exp(sc[size_t(j - sink)] - mc);
      lc += w;
      const uint16_t* codes = L.s[1].codes.data() + (size_t(j) * g_.num_kv_heads + kvh) * nk_[1];
      const uint8_t* anc = L.s[1].anc.data() + (size_t(j) * g_.num_kv_heads + kvh) * na_[1];
      const float wn = w * L.s[1].norm[size_t(j) * g_.num_kv_heads + kvh];
      const int ncodes = vc.n_codes(j < ae ? nstv_arch : nstv_mid);
      for (int c = 0; c < ncodes; ++c) wacc[size_t(vlut_off[size_t(c)] + codes[c])] += wn;
      for (size_t a = 0; a < aacc.size(); ++a) aacc[a] += w * fp8_e4m3_to_f32(anc[a]);
    }
    float y[256] = {}, r[256] = {};
    int ci = 0;
    for (const auto& st : vc.stages)
      for (const VqSlot& s : st) {
        const float* wa = wacc.data() + vlut_off[size_t(ci++)];
        for (int c = 0; c < (1 << s.bits); ++c)
          if (wa[c] != 0.f)
            for (int l = 0; l < s.len; ++l) r[s.c0 + l] += wa[c] * s.book[size_t(c) * s.len + l];
      }
    for (size_t i = 0; i < vc.rest.size(); ++i) y[vc.rest[i]] = r[i];
    for (size_t a = 0; a < vc.anchors.size(); ++a) y[vc.anchors[a]] = aacc[a] * vc.anchor_scale[a];
    float oc[256];
    vc.unrotate(y, oc);
    if (!vc.mean.empty())
      for (int d = 0; d < Dh; ++d) oc[d] += lc * vc.mean[size_t(d)];

    // Log-sum-exp merge of the exact and coded parts.
    const float m = std::max(me, mc);
    const float fe = le > 0 ? std::exp(me - m) : 0.f, fc = std::exp(mc - m);
    const float den = le * fe + lc * fc;
    for (int d = 0; d < Dh; ++d) o[d] = (oe[size_t(d)] * fe + oc[d] * fc) / den;
  }

  KvGeometry g_;
  KvSpec spec_;
  std::vector<Layer> layers_;
  int calib_pos_ = 0;
  bool pre_rope_ = false;
  std::vector<float> inv_freq_;
  int nk_[2] = {0, 0}, na_[2] = {0, 0};
};

}  // namespace

std::unique_ptr<KvCache> make_kv_cache(const KvGeometry& g, const KvSpec& spec, const KvProfile* profile) {
  if (spec.exact) return make_exact_kv_cache(g, spec.exact_f32 ? KvDType::F32 : KvDType::BF16);
  return std::make_unique<TieredKvCache>(g, spec, profile);
}

std::vector<VqCodec> tiered_cache_codecs(const KvCache& c) {
  const auto* t = dynamic_cast<const TieredKvCache*>(&c);
  std::vector<VqCodec> out;
  if (!t) return out;
  for (const Layer& L : t->layers()) {
    if (!L.calibrated) return {};
    out.insert(out.end(), L.codec.begin(), L.codec.end());
  }
  return out;
}

}  // namespace tiermoe
