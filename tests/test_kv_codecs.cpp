// The tiered KV cache: codec round trips, lookup-table attention against the decoded path,
// progressive RVQ codes, page migration, calibration determinism, configs and profiles.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>
#include <sstream>

#include "core/check.h"
#include "core/dtype.h"
#include "cpu/ops.h"
#include "kv/kv_cache.h"
#include "kv/fp8_rows.h"
#include "kv/kv_codec.h"
#include "kv/kv_page.h"
#include "kv/kv_profile.h"
#include "kv/kv_spec.h"

namespace tiermoe {
namespace {

// Correlated Gaussian rows [N, Dh] with a few large channels, like attention keys.
std::vector<float> keys_like(int N, int Dh, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> mix(size_t(Dh) * Dh);
  for (auto& m : mix) m = nd(rng) / std::sqrt(float(Dh));
  std::vector<float> x(size_t(N) * Dh);
  for (int n = 0; n < N; ++n) {
    std::vector<float> z(static_cast<size_t>(Dh));
    for (int i = 0; i < Dh; ++i) z[size_t(i)] = nd(rng) * (i < 4 ? 6.f : 1.f / (1 + 0.05f * i));
    for (int i = 0; i < Dh; ++i) {
      float s = 0.5f;
      for (int j = 0; j < Dh; ++j) s += mix[size_t(i) * Dh + j] * z[size_t(j)];
      x[size_t(n) * Dh + i] = s;
    }
  }
  return x;
}

double rel_mse(const VqCodec& c, const std::vector<float>& x, int N, int Dh, int stages) {
  double num = 0, den = 0;
  std::vector<uint16_t> codes(size_t(c.n_codes()));
  std::vector<uint8_t> anc(c.anchors.size() + 1);
  std::vector<float> y(static_cast<size_t>(Dh));
  for (int n = 0; n < N; ++n) {
    float norm;
    c.encode(x.data() + size_t(n) * Dh, codes.data(), anc.data(), &norm);
    c.decode(codes.data(), anc.data(), norm, stages, y.data());
    for (int i = 0; i < Dh; ++i) {
      const double e = y[size_t(i)] - x[size_t(n) * Dh + i];
      num += e * e;
      den += double(x[size_t(n) * Dh + i]) * x[size_t(n) * Dh + i];
    }
  }
  return num / den;
}

TEST(KvCodec, Fp8E4m3RoundTrip) {
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7f) == 0x7f) continue;  // NaN codes are never produced
    const float f = fp8_e4m3_to_f32(uint8_t(b));
    EXPECT_EQ(fp8_e4m3_to_f32(f32_to_fp8_e4m3(f)), f) << b;
  }
  EXPECT_EQ(fp8_e4m3_to_f32(f32_to_fp8_e4m3(1e6f)), 448.f);  // saturates
  for (float x = 0.02f; x < 440; x *= 1.37f) EXPECT_LE(std::fabs(fp8_e4m3_to_f32(f32_to_fp8_e4m3(x)) - x), x / 16 + 1e-3f);
}

// Ties go to the even code, as __nv_cvt_float_to_fp8 rounds on the GPU (the FP8 rows' twin).
TEST(KvCodec, Fp8E4m3TiesToEven) {
  EXPECT_EQ(fp8_e4m3_to_f32(f32_to_fp8_e4m3(1.0625f)), 1.f);     // between 1 (even) and 1.125
  EXPECT_EQ(fp8_e4m3_to_f32(f32_to_fp8_e4m3(1.1875f)), 1.25f);   // between 1.125 and 1.25 (even)
  EXPECT_EQ(fp8_e4m3_to_f32(f32_to_fp8_e4m3(-1.1875f)), -1.25f);
  EXPECT_EQ(fp8_e4m3_to_f32(f32_to_fp8_e4m3(std::ldexp(3.f, -10))), std::ldexp(1.f, -8));  // subnormals: 1.5 -> 2
  EXPECT_EQ(fp8_e4m3_to_f32(f32_to_fp8_e4m3(std::ldexp(1.f, -10))), 0.f);                  // 0.5 -> 0
}

TEST(KvCodec, GaussianLloydMaxLevels) {
  const auto l2 = gaussian_lloyd_max(2);
  ASSERT_EQ(l2.size(), 4u);
  EXPECT_NEAR(l2[3], 1.510, 2e-3);
  EXPECT_NEAR(l2[2], 0.4528, 2e-3);
}

TEST(KvCodec, RoundTripErrorBounds) {
  const int N = 512, Dh = 64;
  const auto x = keys_like(N, Dh, 1), held = keys_like(256, Dh, 1);  // same distribution (same mixing seed)
  struct Case {
    const char* name;
    CodecSpec spec;
    double bound;
  };
  std::vector<Case> cases;
  CodecSpec pca4;
  pca4.stage_bits = {4};
  cases.push_back({"pca lloyd-max 4 bits", pca4, 0.01});
  CodecSpec pca2;
  pca2.stage_bits = {2};
  cases.push_back({"pca lloyd-max 2 bits", pca2, 0.06});
  CodecSpec had = kv_preset("hadamard2").k;
  cases.push_back({"hadamard lloyd-max 2 bits", had, 0.16});
  CodecSpec rvq = kv_preset("rvq-tiers").k;
  cases.push_back({"pca rvq 3.25 bits", rvq, 0.05});
  CodecSpec osk = kv_preset("oskvp").k;
  cases.push_back({"oskvp", osk, 0.10});
  for (const Case& c : cases) {
    VqCodec codec;
    codec.fit(c.spec, x.data(), N, Dh, {}, 7, 8);
    EXPECT_LT(rel_mse(codec, held, 256, Dh, codec.n_stages()), c.bound) << c.name;
  }
  VqCodec fp8;
  CodecSpec f;
  f.kind = "fp8";
  fp8.fit(f, x.data(), N, Dh, {}, 1, 1);
  std::vector<float> y(held.begin(), held.begin() + Dh);
  fp8.roundtrip_elementwise(y.data());
  for (int i = 0; i < Dh; ++i) EXPECT_NEAR(y[size_t(i)], held[size_t(i)], std::fabs(held[size_t(i)]) / 16 + fp8.fp8_scale * 0.02);
}

// The rope_pairs basis is PCA within each RoPE pair: orthonormal, each pair decorrelated with its
// major axis first, and it commutes with RoPE (turning a key by its angles before or after the
// basis gives the same vector), which is what lets a GPU score coded keys without a dense unrotation.
TEST(KvCodec, RopePairsBasisIsPairwisePcaAndCommutesWithRope) {
  const int N = 512, Dh = 64, half = Dh / 2;
  const auto x = keys_like(N, Dh, 3);
  CodecSpec spec;
  spec.rotation = "rope_pairs";
  spec.query_aware = false;
  VqCodec c;
  c.fit(spec, x.data(), N, Dh, {}, 7, 8);
  ASSERT_EQ(c.rot.size(), size_t(Dh) * Dh);
  for (int r = 0; r < Dh; ++r)
    for (int s = 0; s < Dh; ++s) {
      double dot = 0;
      for (int i = 0; i < Dh; ++i) dot += double(c.rot[size_t(r) * Dh + i]) * c.rot[size_t(s) * Dh + i];
      EXPECT_NEAR(dot, r == s ? 1.0 : 0.0, 1e-6) << r << " " << s;
    }
  // Rotated calibration rows: per pair, variance major >= minor and no covariance left.
  std::vector<double> var(size_t(Dh), 0.0), cov(size_t(half), 0.0);
  std::vector<float> y(static_cast<size_t>(Dh));
  for (int n = 0; n < N; ++n) {
    c.rotate(x.data() + size_t(n) * Dh, y.data());
    for (int i = 0; i < Dh; ++i) var[size_t(i)] += double(y[size_t(i)]) * y[size_t(i)] / N;
    for (int i = 0; i < half; ++i) cov[size_t(i)] += double(y[size_t(i)]) * y[size_t(i + half)] / N;
  }
  for (int i = 0; i < half; ++i) {
    EXPECT_GE(var[size_t(i)], var[size_t(i + half)]) << "pair " << i;
    EXPECT_LT(std::fabs(cov[size_t(i)]), 1e-4 * (var[size_t(i)] + var[size_t(i + half)])) << "pair " << i;
  }
  // U^T (R y) == R (U^T y) for a RoPE rotation R at a few positions.
  std::vector<float> inv_freq(static_cast<size_t>(half)), cs(inv_freq.size()), sn(inv_freq.size());
  rope_inv_freq(inv_freq.data(), Dh, 10000.f);
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd;
  for (int pos : {1, 17, 4095}) {
    rope_angles(inv_freq.data(), half, pos, cs.data(), sn.data());
    std::vector<float> v(static_cast<size_t>(Dh)), a(v.size()), b(v.size()), rv(v.size());
    for (auto& e : v) e = nd(rng);
    rv = v;
    rope_rotate(rv.data(), cs.data(), sn.data(), half);
    c.from_basis(rv.data(), 0.f, a.data());  // a = U^T (R v): weight 0 leaves the mean out
    c.from_basis(v.data(), 0.f, b.data());   // b = U^T v
    rope_rotate(b.data(), cs.data(), sn.data(), half);
    for (int i = 0; i < Dh; ++i) EXPECT_NEAR(a[size_t(i)], b[size_t(i)], 1e-5) << "pos " << pos << " channel " << i;
  }
}

// max_bits caps every slot of every stage, the allocation giving the budget to the other slots; without
// the cap the same fit gives some slot more.
TEST(KvCodec, MaxBitsCapsEverySlot) {
  const int N = 512, Dh = 64;
  const auto x = keys_like(N, Dh, 3);
  CodecSpec spec;
  spec.stage_bits = {2.5, 1.0};
  spec.query_aware = false;
  auto widest = [&](int max_bits, int* total) {
    spec.max_bits = max_bits;
    VqCodec c;
    c.fit(spec, x.data(), N, Dh, {}, 7, 4);
    int most = 0;
    *total = 0;
    for (const auto& st : c.stages)
      for (const VqSlot& sl : st) most = std::max(most, sl.bits), *total += sl.bits;
    return most;
  };
  int capped = 0, free = 0;
  EXPECT_GT(widest(0, &free), 3);
  EXPECT_EQ(widest(3, &capped), 3);
  EXPECT_EQ(capped, free);  // 3.5 bits a channel fit under a cap of 3 per stage: the budget is all spent
}

// A page's rows brought back together (decode_page's path) equal them brought back one at a time,
// with and without a mean, at head sizes the blocked loop takes (64, 128) and one it leaves to the
// per-row loop (40), for row counts that do and do not fill its blocks of 4.
TEST(KvCodec, RowsFromBasisEqualOneAtATime) {
  for (int Dh : {128, 64, 40})
    for (bool center : {true, false}) {
      const auto x = keys_like(256, Dh, 11);
      CodecSpec spec = kv_preset("default").k;
      spec.center = center;
      VqCodec c;
      c.fit(spec, x.data(), 256, Dh, {}, 3, 2);
      ASSERT_FALSE(c.rot.empty());
      ASSERT_EQ(c.mean.empty(), !center);
      for (int n : {1, 4, 7, 64}) {
        std::vector<float> y(x.begin(), x.begin() + size_t(n) * Dh), rows(y.size()), one(static_cast<size_t>(Dh));
        c.from_basis_rows(y.data(), n, rows.data());
        for (int t = 0; t < n; ++t) {
          c.from_basis(y.data() + size_t(t) * Dh, 1.f, one.data());
          for (int i = 0; i < Dh; ++i) ASSERT_EQ(rows[size_t(t) * Dh + i], one[size_t(i)]) << Dh << " " << n << " " << t << " " << i;
        }
      }
    }
}

// Channels without bits decode to one value in every token and are summed once; the rows equal
// them brought back one at a time up to FP32 rounding. A per-token norm makes no channel constant.
TEST(KvCodec, ChannelsWithoutBitsAreSummedOnce) {
  const int Dh = 128, N = 512, n = 16;
  const auto x = keys_like(N, Dh, 21);
  for (bool token_norm : {false, true}) {
    CodecSpec spec = kv_preset("default").k;
    spec.token_norm = token_norm;
    VqCodec c;
    c.fit(spec, x.data(), N, Dh, {}, 5, 4);
    for (int stages : {1, 2}) {
      std::vector<uint8_t> constant(static_cast<size_t>(Dh));
      c.constant_channels(stages, constant.data());
      const long marked = std::count(constant.begin(), constant.end(), uint8_t(1));
      if (token_norm) {
        EXPECT_EQ(marked, 0);
        continue;
      }
      EXPECT_GT(marked, 8) << stages;  // water-filling leaves the weakest channels without bits
      EXPECT_LT(marked, Dh - 8) << stages;
      std::vector<float> y(size_t(n) * Dh), rows(y.size()), one(static_cast<size_t>(Dh));
      std::vector<uint16_t> codes(size_t(c.n_codes()));
      std::vector<uint8_t> anc(c.anchors.size() + 1);
      for (int t = 0; t < n; ++t) {
        float norm;
        c.encode(x.data() + size_t(t) * Dh, codes.data(), anc.data(), &norm);
        c.decode(codes.data(), anc.data(), norm, stages, y.data() + size_t(t) * Dh, true);
        for (int r = 0; r < Dh; ++r) {
          if (constant[size_t(r)]) {
            ASSERT_EQ(y[size_t(t) * Dh + r], y[size_t(r)]) << t << " " << r;
          }
        }
      }
      c.from_basis_rows(y.data(), n, rows.data(), constant.data());
      double err = 0, ref = 0;
      for (int t = 0; t < n; ++t) {
        c.from_basis(y.data() + size_t(t) * Dh, 1.f, one.data());
        for (int i = 0; i < Dh; ++i) {
          const double e = rows[size_t(t) * Dh + i] - one[size_t(i)];
          err += e * e, ref += double(one[size_t(i)]) * one[size_t(i)];
        }
      }
      EXPECT_LT(std::sqrt(err / ref), 1e-6) << stages;
    }
  }
}

// A page decoded slot by slot (decode_page: the layout, the 16-token register path, the channels
// summed once) against its tokens coded and decoded one at a time by VqCodec, over codecs
// (scalar and 4-dim RVQ slots, anchors, per-token norms, pre-RoPE keys), page sizes (16 takes
// the register path, 8 and 12 the per-token one), stages (all, the archive's first) and the
// second head's offsets; the archive cut (truncate_page_stages) decodes as its first stages did.
TEST(KvPage, DecodedPagesEqualTokensDecodedOneAtATime) {
  const int Dh = 64, Hkv = 2, N = 512;
  CodecSpec norm_spec = kv_preset("hadamard2").k;
  norm_spec.token_norm = true;
  norm_spec.stage_bits = {1.5, 1.0};
  struct Case {
    const char* name;
    CodecSpec spec;
  };
  const std::vector<Case> cases = {{"default K", kv_preset("default").k},  {"default V", kv_preset("default").v},
                                   {"rvq-tiers", kv_preset("rvq-tiers").k}, {"oskvp", kv_preset("oskvp").k},
                                   {"token norm", norm_spec}};
  KeyRope rope;
  rope.inv_freq.resize(Dh / 2);
  rope_inv_freq(rope.inv_freq.data(), Dh, 10000.f);
  for (const Case& cs : cases)
    for (int kv : {0, 1}) {
      VqCodec codec[Hkv * 2];
      for (int h = 0; h < Hkv; ++h) {
        const auto x = keys_like(N, Dh, 30 + uint64_t(h));
        codec[h * 2 + kv].fit(cs.spec, x.data(), N, Dh, {}, 3 + uint64_t(h), 4);
      }
      const StreamCodecs sc{codec, kv};
      const bool pre_rope = kv == 0 && cs.spec.pre_rope;
      for (int P : {16, 8, 12}) {
        const PageGeometry geo{P, Hkv, Dh, 3 * P};
        const auto rows = keys_like(P * Hkv, Dh, 40 + uint64_t(P));
        PageStore pg;
        pg.exact.resize(size_t(P) * Hkv * Dh);
        for (size_t i = 0; i < pg.exact.size(); ++i) pg.exact[i] = f32_to_bf16(rows[i]);
        encode_page(pg, sc, geo, pre_rope ? rope : KeyRope{});
        const int ns = codec[kv].n_stages();
        for (int h = 0; h < Hkv; ++h)
          for (int stages : {ns, 1})
            for (bool in_basis : {false, true}) {
              if (in_basis && kv == 0) continue;
              std::vector<float> got(size_t(P) * Dh), want(size_t(P) * Dh);
              decode_page(pg, sc, geo, h, stages, pre_rope ? rope : KeyRope{}, got.data(), in_basis);
              const VqCodec& c = codec[h * 2 + kv];
              std::vector<uint16_t> codes(size_t(c.n_codes())), stored(size_t(c.n_codes()));
              std::vector<uint8_t> anc(c.anchors.size() + 1);
              for (int t = 0; t < P; ++t) {
                float x[Dh], norm;
                for (int i = 0; i < Dh; ++i) x[i] = bf16_to_f32(pg.exact[(size_t(t) * Hkv + h) * Dh + i]);
                if (pre_rope) rope.apply(x, geo.first + t, Dh, -1.f);
                c.encode(x, codes.data(), anc.data(), &norm);
                page_codes(pg, sc, geo, h, t, stored.data());
                ASSERT_EQ(codes, stored) << cs.name << " P " << P << " h " << h << " t " << t;
                c.decode(codes.data(), anc.data(), norm, stages, want.data() + size_t(t) * Dh, in_basis);
                if (pre_rope) rope.apply(want.data() + size_t(t) * Dh, geo.first + t, Dh, 1.f);
              }
              const std::string where = std::string(cs.name) + (kv ? " V" : " K") + " P " + std::to_string(P) +
                                        " h " + std::to_string(h) + " stages " + std::to_string(stages);
              if (in_basis) {
                EXPECT_EQ(got, want) << where;  // the same additions in the same order
                continue;
              }
              double err = 0, ref = 0;
              for (size_t i = 0; i < got.size(); ++i)
                err += (got[i] - want[i]) * (got[i] - want[i]), ref += double(want[i]) * want[i];
              EXPECT_LT(std::sqrt(err / ref), 1e-6) << where;
            }
        if (ns > 1) {
          std::vector<float> before(size_t(P) * Dh), after(size_t(P) * Dh);
          decode_page(pg, sc, geo, 1, 1, pre_rope ? rope : KeyRope{}, before.data());
          truncate_page_stages(pg, sc, geo, 1);
          decode_page(pg, sc, geo, 1, 1, pre_rope ? rope : KeyRope{}, after.data());
          EXPECT_EQ(before, after) << cs.name << " P " << P;
        }
      }
    }
}

// Scalar k-means finds each point's centroid by a walk; it must give the full scan's centroids
// bit for bit: Gaussian data, repeated values (equal quantiles, so equal centroids and empty
// clusters), a far outlier (distances that round equal), a narrow cluster, K from 1 to 256.
TEST(KvCodec, ScalarKmeansWalkEqualsFullScan) {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd;
  for (int data = 0; data < 4; ++data)
    for (int K : {1, 2, 4, 16, 64, 256}) {
      const int N = 3000;
      std::vector<float> x(static_cast<size_t>(N));
      for (int i = 0; i < N; ++i) {
        const float g = nd(rng);
        x[size_t(i)] = data == 0   ? g
                       : data == 1 ? std::round(g * 2) / 2                        // 13 or so distinct values
                       : data == 2 ? (i == 7 ? 3e7f : g)                           // one far outlier
                                   : (i % 3 ? 1.f + 1e-6f * float(i % 50) : g);  // a narrow cluster
      }
      const float w = 0.37f;
      const auto walk = kmeans(x, N, 1, K, &w, 3, 30), scan = kmeans(x, N, 1, K, &w, 3, 30, true);
      ASSERT_EQ(walk, scan) << "data " << data << " K " << K;
    }
}

// kmeans stops once its assignment settles; a plain Lloyd loop that runs every iteration (the same
// initialization, nearest centroid by a full scan, sums in point order) gives the same bits, for
// iteration counts below and past the point where it settles, scalar and 4-dim rows.
TEST(KvCodec, KmeansStoppingEarlyEqualsEveryIteration) {
  auto lloyd = [](const std::vector<float>& x, int N, int len, int K, const float* w, uint64_t seed, int iters) {
    std::vector<float> c(size_t(K) * len);
    if (len == 1) {
      std::vector<int> a(static_cast<size_t>(N));
      std::iota(a.begin(), a.end(), 0);
      std::sort(a.begin(), a.end(), [&](int p, int q) { return x[size_t(p)] < x[size_t(q)]; });
      for (int k = 0; k < K; ++k) c[size_t(k)] = x[size_t(a[std::min<size_t>(size_t(N) - 1, size_t((k + 0.5) * N / K))])];
    } else {  // K distinct random rows (a partial Fisher-Yates shuffle)
      std::mt19937_64 rng(seed);
      std::vector<int> idx(static_cast<size_t>(N));
      std::iota(idx.begin(), idx.end(), 0);
      for (int k = 0; k < K; ++k) {
        std::swap(idx[size_t(k)], idx[size_t(k + int(rng() % uint64_t(N - k)))]);
        std::copy_n(x.data() + size_t(idx[size_t(k)]) * len, len, c.data() + size_t(k) * len);
      }
    }
    for (int it = 0; it < iters; ++it) {
      std::vector<double> sum(c.size(), 0.0);
      std::vector<int> cnt(static_cast<size_t>(K), 0);
      for (int i = 0; i < N; ++i) {
        int best = 0;
        float bd = INFINITY;
        for (int k = 0; k < K; ++k) {
          float d = 0;
          for (int l = 0; l < len; ++l) {
            const float e = x[size_t(i) * len + l] - c[size_t(k) * len + l];
            d += w[l] * e * e;
          }
          if (d < bd) bd = d, best = k;
        }
        cnt[size_t(best)]++;
        for (int l = 0; l < len; ++l) sum[size_t(best) * len + l] += x[size_t(i) * len + l];
      }
      for (int k = 0; k < K; ++k)
        if (cnt[size_t(k)] > 0)
          for (int l = 0; l < len; ++l) c[size_t(k) * len + l] = float(sum[size_t(k) * len + l] / cnt[size_t(k)]);
    }
    return c;
  };
  std::mt19937_64 rng(9);
  std::normal_distribution<float> nd;
  const float w[4] = {0.37f, 1.f, 2.5f, 0.8f};
  for (int len : {1, 4})
    for (int K : {2, 4, 16, 64}) {
      const int N = 1500;
      std::vector<float> x(size_t(N) * len);
      for (auto& v : x) v = nd(rng);
      for (int iters : {1, 2, 3, 10, 60})
        ASSERT_EQ(kmeans(x, N, len, K, w, 3, iters, /*full_scan=*/true), lloyd(x, N, len, K, w, 3, iters))
            << "len " << len << " K " << K << " iters " << iters;
    }
}

TEST(KvCodec, KiviRoundTripWithinHalfAStep) {
  const int P = 32, Dh = 64;
  auto x = keys_like(P, Dh, 3);
  VqCodec c;
  CodecSpec s = kv_preset("kivi2").k;
  c.fit(s, x.data(), P, Dh, {}, 1, 1);
  for (bool key : {true, false}) {
    auto y = x;
    c.kivi_roundtrip(y.data(), P, Dh, key);
    for (int t = 0; t < P; ++t)
      for (int i = 0; i < Dh; ++i) {
        float lo = INFINITY, hi = -INFINITY;  // the group this element belongs to
        for (int j = 0; j < 32; ++j) {
          const float v = key ? x[size_t(j) * Dh + i] : x[size_t(t) * Dh + (i / 32) * 32 + j];
          lo = std::min(lo, v), hi = std::max(hi, v);
        }
        EXPECT_LE(std::fabs(y[size_t(t) * Dh + i] - x[size_t(t) * Dh + i]), (hi - lo) / 3 * 0.51 + 0.02 * std::fabs(hi - lo) + 1e-2);
      }
  }
}

TEST(KvCodec, TruncatedRvqEqualsFewerStages) {
  const int N = 512, Dh = 64;
  const auto x = keys_like(N, Dh, 5);
  CodecSpec s;
  s.dim = 4;
  s.stage_bits = {1.0, 0.75, 1.0};
  s.allocate = false;
  VqCodec full;
  full.fit(s, x.data(), N, Dh, {}, 9, 6);
  s.stage_bits = {1.0, 0.75};
  VqCodec two;
  two.fit(s, x.data(), N, Dh, {}, 9, 6);
  ASSERT_EQ(two.n_stages(), 2);
  // The first two stages are fitted identically; encoding with them is a prefix of the full code.
  std::vector<uint16_t> cf(size_t(full.n_codes())), c2(size_t(two.n_codes()));
  std::vector<uint8_t> a(1);
  std::vector<float> yf(static_cast<size_t>(Dh)), y2(static_cast<size_t>(Dh));
  for (int n = 0; n < 64; ++n) {
    float nf, n2;
    full.encode(x.data() + size_t(n) * Dh, cf.data(), a.data(), &nf);
    two.encode(x.data() + size_t(n) * Dh, c2.data(), a.data(), &n2);
    for (int i = 0; i < two.n_codes(); ++i) ASSERT_EQ(cf[size_t(i)], c2[size_t(i)]);
    full.decode(cf.data(), a.data(), nf, 2, yf.data());
    two.decode(c2.data(), a.data(), n2, 2, y2.data());
    for (int i = 0; i < Dh; ++i) EXPECT_EQ(yf[size_t(i)], y2[size_t(i)]);
  }
  EXPECT_LT(rel_mse(full, x, N, Dh, 3), rel_mse(full, x, N, Dh, 2));
  EXPECT_LT(rel_mse(full, x, N, Dh, 2), rel_mse(full, x, N, Dh, 1));
}

KvSpec small_spec(const std::string& preset) {
  KvSpec s = kv_preset(preset);
  s.sink = 4;
  s.window = 16;
  s.middle = 48;
  s.page = preset.rfind("kivi", 0) == 0 ? 32 : 8;
  s.calib_tokens = 64;
  return s;
}

std::vector<float> rnd(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// Appends `lens` chunks of random K/V/Q to a one-layer cache and returns the last attention.
std::vector<float> run_cache(KvCache& c, const KvGeometry& g, const std::vector<int>& lens, uint64_t seed) {
  std::vector<float> out;
  int pos = 0;
  for (int T : lens) {
    const auto k = rnd(size_t(T) * g.num_kv_heads * g.head_dim, seed + pos * 3);
    const auto v = rnd(size_t(T) * g.num_kv_heads * g.head_dim, seed + pos * 3 + 1);
    const auto q = rnd(size_t(T) * g.num_heads * g.head_dim, seed + pos * 3 + 2);
    for (int l = 0; l < g.num_layers; ++l) {
      c.append(l, k.data(), v.data(), T);
      out.assign(size_t(T) * g.num_heads * g.head_dim, 0.f);
      c.attend(l, q.data(), T, out.data());
    }
    pos += T;
  }
  return out;
}

// The exponent of an FP8 row is the least e with amax <= 448 * 2^e, checked in double around every
// boundary 448 * 2^k and on random magnitudes.
TEST(Fp8Rows, ExponentIsTheLeastThatFits) {
  std::vector<float> amaxes = {1.f, 0.001f, 3e-30f, 1e30f, 447.9f};
  for (int k = -100; k <= 100; k += 7)
    for (float f : {std::ldexp(448.f, k), std::nextafter(std::ldexp(448.f, k), 0.f), std::nextafter(std::ldexp(448.f, k), 1e38f)})
      amaxes.push_back(f);
  std::mt19937_64 rng(3);
  for (int i = 0; i < 1000; ++i) amaxes.push_back(std::ldexp(std::uniform_real_distribution<float>(1.f, 2.f)(rng), int(rng() % 120) - 60));
  for (float a : amaxes) {
    const int e = fp8_row_exponent(a);
    EXPECT_LE(double(a), std::ldexp(448.0, e)) << a;
    EXPECT_GT(double(a), std::ldexp(448.0, e - 1)) << a;
  }
  EXPECT_EQ(fp8_row_exponent(0.f), kFp8MinExp);
  EXPECT_EQ(fp8_row_exponent(INFINITY), kFp8MaxExp);
  for (int e : {-120, -1, 0, 1, 120}) EXPECT_EQ(double(fp8_exp2(e)), std::ldexp(1.0, e));
}

// Every value comes back within half an E4M3 step of its row's scale (2^-4 relative, or 2^(e-10)
// in E4M3's subnormal range), each row's largest value in the top binade, and the decoded values
// are BF16 exactly (a code times a power of two). Zero rows stay zero.
TEST(Fp8Rows, RoundTripWithinHalfAStepAndExactInBf16) {
  const int Dh = 64, n = 50;
  std::vector<float> x = rnd(size_t(n) * Dh, 9);
  for (int r = 0; r < n; ++r)
    for (int i = 0; i < Dh; ++i) x[size_t(r) * Dh + i] *= std::ldexp(1.f, r - 25) * (i == 5 ? 40.f : 1.f);  // outlier channel
  std::fill_n(x.begin(), Dh, 0.f);  // row 0 all zero
  std::vector<uint8_t> codes(x.size());
  std::vector<int8_t> exps(n);
  std::vector<uint16_t> back(x.size());
  fp8_quantize_rows(x.data(), n, Dh, codes.data(), exps.data());
  fp8_dequantize_rows(codes.data(), exps.data(), n, Dh, back.data());
  for (int r = 0; r < n; ++r) {
    float amax = 0, top = 0;
    for (int i = 0; i < Dh; ++i) {
      const size_t j = size_t(r) * Dh + i;
      const float got = bf16_to_f32(back[j]), want = x[j];
      EXPECT_EQ(got, fp8_e4m3_to_f32(codes[j]) * std::ldexp(1.f, exps[r])) << r << " " << i;  // exact in BF16
      EXPECT_LE(std::fabs(got - want), std::max(std::fabs(want) / 16, std::ldexp(1.f, exps[r] - 10))) << r << " " << i;
      amax = std::max(amax, std::fabs(want));
      top = std::max(top, std::fabs(fp8_e4m3_to_f32(codes[j])));
    }
    if (r == 0) EXPECT_EQ(top, 0.f);
    else EXPECT_GE(top, 224.f) << r;  // the scale is the least that fits: the largest code is in the top binade
  }
}

// The fp8-all cache attends as a BF16 cache of the rows its codes decode to, bit for bit (it reads the
// codes without decoding them), holds 1 + 1/Dh bytes a value, and truncates like the others. Dh 20:
// two 8-value blocks and a tail.
TEST(Fp8Rows, CacheAttendsAsItsDecodedRows) {
  for (const KvGeometry g : {KvGeometry{2, 2, 4, 32, 10000.f}, KvGeometry{1, 3, 6, 20, 10000.f}}) {
    auto fp8 = make_kv_cache(g, kv_preset("fp8-all"));
    auto bf16 = make_exact_kv_cache(g, KvDType::BF16);
    const int T = 37;
    const size_t n = size_t(T) * g.num_kv_heads;
    const auto k = rnd(n * g.head_dim, 1), v = rnd(n * g.head_dim, 2), q = rnd(size_t(T) * g.num_heads * g.head_dim, 3);
    std::vector<uint8_t> codes(n * g.head_dim);
    std::vector<int8_t> exps(n);
    std::vector<uint16_t> kb(codes.size()), vb(codes.size());
    fp8_quantize_rows(k.data(), n, g.head_dim, codes.data(), exps.data());
    fp8_dequantize_rows(codes.data(), exps.data(), n, g.head_dim, kb.data());
    fp8_quantize_rows(v.data(), n, g.head_dim, codes.data(), exps.data());
    fp8_dequantize_rows(codes.data(), exps.data(), n, g.head_dim, vb.data());
    std::vector<float> kd(kb.size()), vd(vb.size());
    for (size_t i = 0; i < kb.size(); ++i) kd[i] = bf16_to_f32(kb[i]), vd[i] = bf16_to_f32(vb[i]);
    std::vector<float> got(q.size()), want(q.size());
    for (int l = 0; l < g.num_layers; ++l) {
      fp8->append(l, k.data(), v.data(), T);
      bf16->append(l, kd.data(), vd.data(), T);  // exact in BF16
      fp8->attend(l, q.data(), T, got.data());
      bf16->attend(l, q.data(), T, want.data());
      EXPECT_EQ(got, want);
    }
    EXPECT_EQ(fp8->bytes(), size_t(g.num_layers) * 2 * n * (g.head_dim + 1));
    EXPECT_NEAR(fp8->stats().k_bits, 8 + 8.0 / g.head_dim, 1e-12);
    fp8->truncate(20);
    EXPECT_EQ(fp8->bytes(), size_t(g.num_layers) * 2 * 20 * g.num_kv_heads * (g.head_dim + 1));
  }
}

TEST(TieredKvCache, LookupTablesMatchDecodedAttention) {
  const KvGeometry g{1, 2, 4, 32, 10000.f};
  for (const char* preset : {"default", "rvq-tiers", "oskvp", "hadamard2"}) {
    KvSpec a = small_spec(preset);
    a.k.pre_rope = false;  // pre-RoPE keys are decoded per key (RoPE differs per position): no tables
    KvSpec b = a;
    a.lut_max_tokens = 1;  // the single-token steps below go through lookup tables
    b.lut_max_tokens = 0;  // always the decoded shadow
    a.archive_stages = b.archive_stages = a.k.stage_bits.size() > 1 ? 2 : 0;
    auto ca = make_kv_cache(g, a), cb = make_kv_cache(g, b);
    std::vector<int> lens = {70, 30};
    for (int i = 0; i < 9; ++i) lens.push_back(1);  // decode steps cross page boundaries
    const auto oa = run_cache(*ca, g, lens, 11), ob = run_cache(*cb, g, lens, 11);
    double num = 0, den = 0;
    for (size_t i = 0; i < oa.size(); ++i) num += (oa[i] - ob[i]) * (oa[i] - ob[i]), den += ob[i] * ob[i];
    EXPECT_LT(std::sqrt(num / den), 2e-6) << preset;
  }
}

TEST(TieredKvCache, PagesMigrateAndEveryTokenIsInOneTier) {
  const KvGeometry g{2, 1, 2, 16, 10000.f};
  KvSpec s = small_spec("rvq-tiers");
  s.archive_stages = 2;
  auto c = make_kv_cache(g, s);
  std::mt19937 rng(3);
  int len = 0, last_archive = 0;
  for (int step = 0; step < 60; ++step) {
    const int T = step < 3 ? 20 + int(rng() % 30) : 1 + int(rng() % 5);
    run_cache(*c, g, {T}, uint64_t(step));
    len += T;
    const auto st = c->stats();
    long total = 0;
    for (const auto& t : st.tiers) total += t.tokens;
    ASSERT_EQ(total, len) << "step " << step;
    ASSERT_EQ(st.tiers[0].tier, "sink");
    EXPECT_EQ(st.tiers[0].tokens, std::min(len, 4));
    if (len >= s.calib_tokens) {
      // The exact tail holds less than W plus one page; older tokens sit in whole pages.
      EXPECT_LT(st.tiers[1].tokens, s.window + s.page);
      EXPECT_GE(st.tiers[1].tokens + st.tiers[0].tokens, std::min(len, s.window));
      EXPECT_GE(st.tiers[3].tokens, last_archive);  // the archive only grows
      last_archive = int(st.tiers[3].tokens);
      EXPECT_EQ((st.tiers[3].tokens + 4) % s.page, 0);
      EXPECT_LT(st.tiers[3].k_bits, st.tiers[2].k_bits);  // archive keeps a prefix of the stages
    }
  }
  EXPECT_GT(last_archive, 0);
}

// Past the window a page keeps only its codes: the bytes the cache allocates for tokens match
// what it accounts (stats().token_bytes), up to the per-page overhead: the partial last page's
// reserved BF16 rows, a byte of padding per packed page, the sink's codes in the first page.
TEST(TieredKvCache, HoldsWhatItAccountsFor) {
  const KvGeometry g{2, 2, 4, 32, 10000.f};
  const double row_bytes = g.num_kv_heads * g.head_dim * 2.0;  // one BF16 row of K or V
  for (const char* preset : {"default", "rvq-tiers", "hadamard2", "oskvp", "kivi2", "fp8"}) {
    KvSpec s = small_spec(preset);
    s.archive_stages = s.k.stage_bits.size() > 1 ? 1 : 0;
    auto c = make_kv_cache(g, s);
    std::vector<int> lens = {40, 40, 33};
    for (int i = 0; i < 120; ++i) lens.push_back(1 + i % 3);
    int len = 0;
    for (int T : lens) {
      run_cache(*c, g, {T}, uint64_t(len) + 7);
      len += T;
      const auto st = c->stats();
      const double pages = (len + s.page - 1) / s.page;
      const double slack = g.num_layers * 2 * (s.page * row_bytes + pages + s.sink * row_bytes);
      ASSERT_GE(st.held_bytes, st.token_bytes) << preset << " at " << len;
      ASSERT_LE(st.held_bytes, st.token_bytes + slack) << preset << " at " << len;
      // Until its last refit, `default` keeps every token's BF16 row for the refits: metadata.
      if (std::string(preset) == "default" && len < s.calib_tokens << s.refits) {
        ASSERT_GE(st.meta_bytes, len * g.num_layers * 2 * row_bytes) << len;
      }
    }
    // The point of it: most tokens are coded, so even fp8 (8 bits) holds far less than BF16.
    const double bf16 = double(len) * g.num_layers * 2 * row_bytes;
    EXPECT_LT(c->stats().held_bytes, 0.6 * bf16) << preset;
    if (std::string(preset) == "default") {
      EXPECT_EQ(tiered_cache_versions(*c), 3);
    }
  }
}

// truncate(0) empties every page and the sink: the same run again gives the same attention.
TEST(TieredKvCache, TruncateToZeroStartsOver) {
  const KvGeometry g{1, 2, 4, 32, 10000.f};
  KvSpec s = small_spec("default");
  s.archive_stages = 1;
  auto c = make_kv_cache(g, s);
  const std::vector<int> lens = {70, 30, 1, 1, 1};
  const auto first = run_cache(*c, g, lens, 5);
  c->truncate(0);
  EXPECT_EQ(c->length(), 0);
  EXPECT_EQ(c->bytes(), 0u);
  EXPECT_EQ(run_cache(*c, g, lens, 5), first);
}

TEST(TieredKvCache, CalibrationIsDeterministicForASeed) {
  const KvGeometry g{1, 2, 4, 32, 10000.f};
  auto codecs = [&](uint64_t seed) {
    KvSpec s = small_spec("rvq-tiers");
    s.seed = seed;
    auto c = make_kv_cache(g, s);
    run_cache(*c, g, {80}, 5);
    std::ostringstream o;
    for (const auto& cd : tiered_cache_codecs(*c)) cd.save(o);
    return o.str();
  };
  const std::string a = codecs(1);
  EXPECT_FALSE(a.empty());
  EXPECT_EQ(a, codecs(1));
  EXPECT_NE(a, codecs(2));
}

// A sequence of n tokens' K, V (post-RoPE) and queries, fed to a cache in chunks of `lens`;
// returns every query's attention output, [n, H, Dh].
struct Tokens {
  std::vector<float> k, v, q;
};
Tokens random_tokens(const KvGeometry& g, int n, uint64_t seed) {
  return {rnd(size_t(n) * g.num_kv_heads * g.head_dim, seed), rnd(size_t(n) * g.num_kv_heads * g.head_dim, seed + 1),
          rnd(size_t(n) * g.num_heads * g.head_dim, seed + 2)};
}
std::vector<float> attend_all(KvCache& c, const KvGeometry& g, const Tokens& x, const std::vector<int>& lens) {
  const size_t kvr = size_t(g.num_kv_heads) * g.head_dim, qr = size_t(g.num_heads) * g.head_dim;
  std::vector<float> out;
  int pos = 0;
  for (int T : lens) {
    std::vector<float> o(size_t(T) * qr);
    for (int l = 0; l < g.num_layers; ++l) {
      c.append(l, x.k.data() + pos * kvr, x.v.data() + pos * kvr, T);
      c.attend(l, x.q.data() + pos * qr, T, o.data());
    }
    out.insert(out.end(), o.begin(), o.end());
    pos += T;
  }
  return out;
}

// `default` refits online (small_spec: fits at 64, 128 and 256 tokens); here keeping every
// version (without recode), so each can be compared.
TEST(TieredKvCache, RefitsAreDeterministicAndMakeNewVersions) {
  const KvGeometry g{1, 2, 4, 32, 10000.f};
  KvSpec s = small_spec("default");
  s.recode = false;
  ASSERT_EQ(s.refits, 2);
  const Tokens x = random_tokens(g, 300, 21);
  auto saved = [&](const std::vector<int>& lens, int version) {
    auto c = make_kv_cache(g, s);
    attend_all(*c, g, x, lens);
    EXPECT_EQ(tiered_cache_versions(*c), 3);
    std::ostringstream o;
    for (const auto& cd : tiered_cache_codecs(*c, version)) cd.save(o);
    return o.str();
  };
  for (int v = 0; v < 3; ++v) {
    const std::string a = saved({300}, v);
    EXPECT_FALSE(a.empty());
    EXPECT_EQ(a, saved({300}, v)) << v;
    EXPECT_EQ(a, saved({50, 70, 1, 1, 100, 78}, v)) << v;  // whatever the chunking
    if (v > 0) {
      EXPECT_NE(a, saved({300}, v - 1)) << v;
    }
  }
}

// Without recode a page keeps the codec version it was coded with: a refit changes no code
// of an older page.
TEST(TieredKvCache, PagesCodedBeforeARefitDecodeTheSameAfterIt) {
  const KvGeometry g{1, 2, 4, 32, 10000.f};
  KvSpec s = small_spec("default");
  s.recode = false;
  s.middle = 4096;  // no archive cut in this run: a page's codes stay whole
  const Tokens x = random_tokens(g, 300, 5);
  auto c = make_kv_cache(g, s);
  attend_all(*c, g, x, {100, 20});  // 120 tokens: version 0 only, pages 0..12 coded
  ASSERT_EQ(tiered_cache_versions(*c), 1);
  std::vector<std::vector<float>> before;
  for (int kv = 0; kv < 2; ++kv)
    for (int pg = 1; pg < 12; ++pg) {
      int ver = -1;
      before.push_back(tiered_cache_decoded_page(*c, 0, kv, pg, 1, ver));
      EXPECT_EQ(ver, 0);
    }
  Tokens rest = x;
  for (auto* v : {&rest.k, &rest.v, &rest.q}) v->erase(v->begin(), v->begin() + long(v->size() / 300 * 120));
  attend_all(*c, g, rest, {80, 1, 1, 98});  // to 300: refits at 128 and 256
  ASSERT_EQ(tiered_cache_versions(*c), 3);
  size_t i = 0;
  for (int kv = 0; kv < 2; ++kv)
    for (int pg = 1; pg < 12; ++pg) {
      int ver = -1;
      EXPECT_EQ(tiered_cache_decoded_page(*c, 0, kv, pg, 1, ver), before[i++]) << kv << " " << pg;
      EXPECT_EQ(ver, 0);
    }
  int ver = -1;
  tiered_cache_decoded_page(*c, 0, 0, 270 / s.page, 0, ver);  // coded after the refit at 256
  EXPECT_EQ(ver, 2);
}

// No query sees a codec fitted on tokens after it: two sequences equal up to 140 tokens (past
// the refit at 128) give the same attention for their first 140 queries, in one chunk each;
// with and without re-coding the older pages at each refit.
TEST(TieredKvCache, RefitsAreCausal) {
  const KvGeometry g{1, 2, 4, 32, 10000.f};
  for (bool recode : {false, true}) {
    KvSpec s = small_spec("default");
    s.recode = recode;
    const Tokens a = random_tokens(g, 300, 8);
    Tokens b = random_tokens(g, 300, 9);
    const size_t kvr = size_t(g.num_kv_heads) * g.head_dim, qr = size_t(g.num_heads) * g.head_dim;
    std::copy_n(a.k.begin(), 140 * kvr, b.k.begin());
    std::copy_n(a.v.begin(), 140 * kvr, b.v.begin());
    std::copy_n(a.q.begin(), 140 * qr, b.q.begin());
    auto ca = make_kv_cache(g, s), cb = make_kv_cache(g, s);
    const auto oa = attend_all(*ca, g, a, {300}), ob = attend_all(*cb, g, b, {300});
    ASSERT_EQ(tiered_cache_versions(*ca), 3);
    EXPECT_TRUE(std::equal(oa.begin(), oa.begin() + long(140 * qr), ob.begin())) << recode;
    EXPECT_FALSE(std::equal(oa.begin() + long(140 * qr), oa.end(), ob.begin() + long(140 * qr))) << recode;
    // And decode semantics: the same outputs whatever the chunking.
    auto cc = make_kv_cache(g, s);
    EXPECT_EQ(attend_all(*cc, g, a, {63, 2, 60, 1, 1, 1, 100, 72}), oa) << recode;
  }
}

// With recode, a refit codes every page again with the new codec, from the rows the refits
// hold: after the last refit every coded page decodes as its own rows coded by the newest
// codec, and only that codec is held (less metadata than keeping every version).
TEST(TieredKvCache, RecodeCodesEveryPageWithTheNewestFit) {
  const KvGeometry g{1, 2, 4, 32, 10000.f};
  KvSpec s = small_spec("default");
  s.middle = 4096;  // every coded page keeps all its stages
  ASSERT_TRUE(s.recode);
  KvSpec keep = s;
  keep.recode = false;
  const Tokens x = random_tokens(g, 300, 13);
  auto c = make_kv_cache(g, s), c_keep = make_kv_cache(g, keep);
  attend_all(*c, g, x, {100, 1, 1, 60, 138});  // fits at 64, 128 and 256
  attend_all(*c_keep, g, x, {300});
  ASSERT_EQ(tiered_cache_versions(*c), 3);
  EXPECT_TRUE(tiered_cache_codecs(*c, 0).empty());
  EXPECT_TRUE(tiered_cache_codecs(*c, 1).empty());
  const auto codecs = tiered_cache_codecs(*c, 2);  // [Hkv][K, V]
  ASSERT_EQ(codecs.size(), 4u);
  const size_t kvr = size_t(g.num_kv_heads) * g.head_dim;
  int pages = 0;
  for (int pg = 1; (pg + 1) * s.page + s.window <= 300; ++pg, ++pages)
    for (int h = 0; h < g.num_kv_heads; ++h) {
      int ver = -1;
      const auto got = tiered_cache_decoded_page(*c, 0, 1, pg, h, ver);  // values: no RoPE
      EXPECT_EQ(ver, 2) << pg;
      const VqCodec& vc = codecs[size_t(h) * 2 + 1];
      std::vector<uint16_t> codes(size_t(vc.n_codes()));
      std::vector<uint8_t> anc(vc.anchors.size() + 1);
      for (int t = 0; t < s.page; ++t) {
        float row[32], want[32], norm;
        for (int d = 0; d < g.head_dim; ++d) row[d] = bf16_to_f32(f32_to_bf16(x.v[size_t(pg * s.page + t) * kvr + size_t(h) * g.head_dim + d]));
        vc.encode(row, codes.data(), anc.data(), &norm);
        vc.decode(codes.data(), anc.data(), norm, vc.n_stages(), want);
        for (int d = 0; d < g.head_dim; ++d)
          ASSERT_NEAR(got[size_t(t) * g.head_dim + d], want[d], 1e-5f) << "page " << pg << " token " << t;
      }
    }
  EXPECT_GT(pages, 20);  // pages coded before the refits at 128 and 256 among them
  EXPECT_LT(c->stats().meta_bytes, c_keep->stats().meta_bytes);
}

TEST(KvSpecConfig, BadKeysAreNamed) {
  auto err = [](const char* text) {
    try {
      kv_spec_from_json(nlohmann::json::parse(text), "cfg.json");
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(err(R"({"windw": 128})").find("windw"), std::string::npos);
  EXPECT_NE(err(R"({"k": {"bitz": 2}})").find("k.bitz"), std::string::npos);
  EXPECT_NE(err(R"({"v": {"rotation": "dct"}})").find("v.rotation"), std::string::npos);
  EXPECT_NE(err(R"({"window": "big"})").find("window"), std::string::npos);
  EXPECT_NE(err(R"({"preset": "nope"})").find("nope"), std::string::npos);
  EXPECT_NE(err(R"({"middle": 8, "window": 64})").find("middle"), std::string::npos);
  EXPECT_NE(err(R"({"recode": true, "refit_rows": 1024})").find("recode"), std::string::npos);
  EXPECT_NE(err(R"({"k": {"max_bits": 13}})").find("k.max_bits"), std::string::npos);
  EXPECT_EQ(err(R"({"preset": "rvq-tiers", "middle": 1024, "k": {"stage_bits": [1, 1]}})"), "no error");
  EXPECT_THROW(kv_preset("kivi3"), InputError);
  for (const auto& n : kv_preset_names()) EXPECT_NO_THROW(kv_spec_from_json({{"preset", n}}, "x")) << n;
}

TEST(KvProfile, SavedLoadedAndRefusedForAnotherModel) {
  const KvGeometry g{1, 2, 4, 32, 10000.f};
  KvSpec s = small_spec("default");
  auto c = make_kv_cache(g, s);
  const auto out_online = run_cache(*c, g, {100, 1}, 21);
  KvProfile p;
  p.model = "model-a";
  p.geometry = g;
  p.codec_spec = codec_spec_json(s);
  p.codecs = tiered_cache_codecs(*c);
  const std::string path = ::testing::TempDir() + "/kv_test.prof";
  p.save(path);
  KvProfile q = KvProfile::load(path);
  EXPECT_NO_THROW(q.check_compatible("model-a", g, s, path));
  try {
    q.check_compatible("model-b", g, s, path);
    ADD_FAILURE() << "accepted a profile of another model";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("another model"), std::string::npos) << e.what();
  }
  EXPECT_THROW(q.check_compatible("model-a", g, kv_preset("oskvp"), path), InputError);
  // A cache built from the loaded profile codes from the first token on.
  auto d = make_kv_cache(g, s, &q);
  run_cache(*d, g, {40}, 21);
  EXPECT_GT(d->stats().tiers[2].tokens, 0);
  EXPECT_THROW(KvProfile::load(path + ".missing"), InputError);
  // A codec whose layout would send decoding out of bounds is refused at load, named.
  const std::vector<std::function<void(VqCodec&)>> corruptions = {
      [](VqCodec& v) { v.rest[0] = 999; },                  // channel outside the head
      [](VqCodec& v) { v.rest[1] = v.rest[0]; },            // a channel twice
      [](VqCodec& v) { v.rest.pop_back(); },                // a channel missing
      [](VqCodec& v) { v.stages[0][1].c0 += 1; },           // slots out of order
      [](VqCodec& v) { v.rot.resize(v.rot.size() - 1); },  // rotation of the wrong size
  };
  for (size_t i = 0; i < corruptions.size(); ++i) {
    KvProfile bad = p;
    corruptions[i](bad.codecs[1]);
    const std::string bad_path = path + ".bad" + std::to_string(i);
    bad.save(bad_path);
    try {
      KvProfile::load(bad_path);
      ADD_FAILURE() << "accepted corruption " << i;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(bad_path), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("corrupt codec"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace tiermoe

// The command line: ppl's accounting keys, a bad --kv-config, needle's JSON.
#include <array>
#include <cstdio>
#include <fstream>
#include <sys/wait.h>

#include "test_util.h"

namespace tiermoe {
namespace {

std::pair<int, std::string> kv_cli(const std::string& args) {
  const char* bin = std::getenv("TIERMOE_BIN");
  FILE* p = popen((std::string(bin ? bin : "tiermoe") + " " + args + " 2>&1").c_str(), "r");
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  const int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

TEST(KvCli, PplReportsBitsBytesAndKl) {
  const std::string cfg = ::testing::TempDir() + "/kv_small.json";
  std::ofstream(cfg) << R"({"preset": "default", "calib_tokens": 64, "window": 32, "middle": 128})";
  const std::string m = test::tinymix_dir();
  auto [st, out] = kv_cli("ppl --model " + m + " --file " + m + "/heldout.txt --ctx 256 --windows 1 --kv-config " + cfg +
                          " --ref-kv bf16 --json");
  ASSERT_EQ(st, 0) << out;
  auto j = nlohmann::json::parse(out.substr(out.find('{')));
  for (const char* key : {"ppl", "bits_per_value", "kv_bytes_ratio", "kl_vs_ref", "tiers", "metadata_bytes"})
    EXPECT_TRUE(j.contains(key)) << key;
  EXPECT_GT(j["kv_bytes_ratio"].get<double>(), 1.5);
  EXPECT_GE(j["kl_vs_ref"].get<double>(), 0.0);
  EXPECT_LT(j["bits_per_value"].get<double>(), 16.0);
  long tokens = 0;
  for (auto& t : j["tiers"]) tokens += t["tokens"].get<long>();
  EXPECT_EQ(tokens, 256);

  std::ofstream(cfg) << R"({"preset": "default", "k": {"stage_bitz": [2]}})";
  auto [st2, out2] = kv_cli("ppl --model " + m + " --file " + m + "/heldout.txt --ctx 256 --windows 1 --kv-config " + cfg);
  EXPECT_EQ(st2, 2) << out2;
  EXPECT_NE(out2.find("k.stage_bitz"), std::string::npos) << out2;
  auto [st3, out3] = kv_cli("ppl --model " + m + " --file " + m + "/heldout.txt --kv nope");
  EXPECT_EQ(st3, 2);
  EXPECT_NE(out3.find("nope"), std::string::npos) << out3;
}

TEST(KvCli, NeedleJson) {
  const std::string m = test::tinymix_dir();
  auto [st, out] = kv_cli("needle --model " + m + " --kv bf16 --lengths 256 --trials 1 --json");
  ASSERT_EQ(st, 0) << out;
  auto j = nlohmann::json::parse(out.substr(out.find('{')));
  EXPECT_EQ(j["rows"].size(), 1u);
  EXPECT_GE(j["accuracy"].get<double>(), 0.0);
  EXPECT_LE(j["accuracy"].get<double>(), 1.0);
}

}  // namespace
}  // namespace tiermoe
