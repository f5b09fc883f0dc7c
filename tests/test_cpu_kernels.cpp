// CPU kernels against plain double-precision loops, over a table of shapes (odd sizes, T=1).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

#include "core/check.h"
#include "cpu/attention.h"
#include "cpu/matmul.h"
#include "cpu/ops.h"
#include "engine/sampler.h"
#include "test_util.h"

namespace tiermoe {
namespace {

// Weights rounded to `dt`, returned both as raw bytes and as the exact float values.
std::pair<std::vector<uint16_t>, std::vector<float>> round_to(const std::vector<float>& w, DType dt) {
  std::vector<uint16_t> raw(w.size());
  std::vector<float> exact(w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    raw[i] = dt == DType::BF16 ? f32_to_bf16(w[i]) : f32_to_f16(w[i]);
    exact[i] = dt == DType::BF16 ? bf16_to_f32(raw[i]) : f16_to_f32(raw[i]);
  }
  return {raw, exact};
}

TEST(Matmul, MatchesDoubleReferenceOverShapesAndDtypes) {
  const int Ts[] = {1, 2, 3, 4, 5, 7, 13, 64};
  const int Ns[] = {1, 5, 16, 17, 33};
  const int Ks[] = {1, 7, 8, 16, 33, 200};
  uint32_t seed = 1;
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (int T : Ts)
      for (int N : Ns)
        for (int K : Ks) {
          auto x = test::randn(size_t(T) * K, seed++);
          auto w = test::randn(size_t(N) * K, seed++);
          std::vector<uint16_t> raw;
          if (dt != DType::F32) std::tie(raw, w) = round_to(w, dt);
          const void* wp = dt == DType::F32 ? static_cast<const void*>(w.data()) : raw.data();
          std::vector<float> y(size_t(T) * N, NAN), y_add(size_t(T) * N, 1.0f);
          matmul(y.data(), x.data(), wp, dt, T, N, K);
          matmul_add(y_add.data(), x.data(), wp, dt, T, N, K);
          for (int t = 0; t < T; ++t)
            for (int n = 0; n < N; ++n) {
              double ref = 0;
              for (int k = 0; k < K; ++k) ref += double(x[size_t(t) * K + k]) * w[size_t(n) * K + k];
              const double tol = 1e-5 * std::sqrt(double(K)) * 4;
              ASSERT_NEAR(y[size_t(t) * N + n], ref, tol) << dtype_name(dt) << " T=" << T << " N=" << N << " K=" << K;
              ASSERT_NEAR(y_add[size_t(t) * N + n], ref + 1.0, tol) << "matmul_add T=" << T << " N=" << N << " K=" << K;
            }
        }
}

TEST(Router, TopKMatchesSortedSoftmaxWithLowerIndexOnTies) {
  std::mt19937 rng(7);
  for (int E : {2, 3, 8, 60, 64, 128, 256})
    for (int K : {1, 2, 4, 8}) {
      if (K > E) continue;
      for (bool renorm : {false, true}) {
        std::vector<float> logits(E);
        // Few distinct values so ties are common.
        for (auto& l : logits) l = float(int(rng() % 5)) * 0.5f;
        std::vector<int32_t> ids(K);
        std::vector<float> wts(K);
        route_softmax_topk(logits.data(), E, K, renorm, ids.data(), wts.data());
        std::vector<int> order(E);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
        double denom = 0, sel = 0;
        for (float l : logits) denom += std::exp(double(l));
        for (int k = 0; k < K; ++k) sel += std::exp(double(logits[order[k]])) / denom;
        for (int k = 0; k < K; ++k) {
          ASSERT_EQ(ids[k], order[k]) << "E=" << E << " K=" << K << " k=" << k;
          double p = std::exp(double(logits[order[k]])) / denom;
          ASSERT_NEAR(wts[k], renorm ? p / sel : p, 1e-6);
        }
      }
    }
}

TEST(Rmsnorm, MatchesFormula) {
  for (int D : {1, 7, 64, 513}) {
    auto x = test::randn(size_t(3) * D, D), w = test::randn(D, D + 1);
    std::vector<float> y(x.size());
    rmsnorm(y.data(), x.data(), w.data(), 3, D, 1e-5f);
    for (int t = 0; t < 3; ++t) {
      double ss = 0;
      for (int i = 0; i < D; ++i) ss += double(x[t * D + i]) * x[t * D + i];
      const double inv = 1.0 / std::sqrt(ss / D + 1e-5);
      for (int i = 0; i < D; ++i) ASSERT_NEAR(y[t * D + i], x[t * D + i] * inv * w[i], 1e-5);
    }
  }
}

TEST(Rope, RotatesHalvesAndKeepsNorm) {
  const int Dh = 16, H = 3, T = 4;
  auto x = test::randn(size_t(T) * H * Dh, 3);
  auto y = x;
  const int32_t pos[T] = {0, 1, 17, 4095};
  rope(y.data(), pos, T, H, Dh, 10000.f);
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < Dh / 2; ++i) {
        const double ang = pos[t] * std::pow(10000.0, -2.0 * i / Dh);
        const float* a = &x[(size_t(t) * H + h) * Dh];
        const float* b = &y[(size_t(t) * H + h) * Dh];
        ASSERT_NEAR(b[i], a[i] * std::cos(ang) - a[i + Dh / 2] * std::sin(ang), 2e-3);
        ASSERT_NEAR(b[i + Dh / 2], a[i + Dh / 2] * std::cos(ang) + a[i] * std::sin(ang), 2e-3);
      }
}

TEST(Attention, CausalGqaMatchesNaive) {
  for (auto [T, n_past, H, Hkv, Dh] : std::vector<std::array<int, 5>>{
           {1, 0, 1, 1, 8}, {1, 9, 4, 2, 16}, {5, 0, 4, 1, 12}, {7, 3, 6, 3, 128}, {3, 30, 2, 2, 5}}) {
    const int n = n_past + T;
    auto q = test::randn(size_t(T) * H * Dh, 11), k = test::randn(size_t(n) * Hkv * Dh, 12), v = test::randn(size_t(n) * Hkv * Dh, 13);
    std::vector<float> out(q.size(), NAN);
    attention_causal(out.data(), q.data(), k.data(), v.data(), DType::F32, T, n_past, H, Hkv, Dh);
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < H; ++h) {
        const int kvh = h / (H / Hkv), keys = n_past + t + 1;
        std::vector<double> s(keys);
        double mx = -1e300, den = 0;
        for (int j = 0; j < keys; ++j) {
          double d = 0;
          for (int c = 0; c < Dh; ++c) d += double(q[(size_t(t) * H + h) * Dh + c]) * k[(size_t(j) * Hkv + kvh) * Dh + c];
          s[j] = d / std::sqrt(double(Dh));
          mx = std::max(mx, s[j]);
        }
        for (auto& x : s) den += x = std::exp(x - mx);
        for (int c = 0; c < Dh; ++c) {
          double ref = 0;
          for (int j = 0; j < keys; ++j) ref += s[j] / den * v[(size_t(j) * Hkv + kvh) * Dh + c];
          ASSERT_NEAR(out[(size_t(t) * H + h) * Dh + c], ref, 1e-5) << "T=" << T << " past=" << n_past << " h=" << h;
        }
      }
  }
}

TEST(Sampler, GreedyAndTies) {
  std::vector<float> l = {0.f, 3.f, 3.f, 1.f};
  EXPECT_EQ(argmax(l), 1);
  Sampler s({0.f, 0, 1.f, 1});
  EXPECT_EQ(s.sample(l), 1);
}

TEST(Sampler, SeedReproducesAndTopKRestricts) {
  std::vector<float> l = test::randn(100, 5);
  Sampler a({1.0f, 5, 1.0f, 42}), b({1.0f, 5, 1.0f, 42});
  std::vector<int> top(100);
  std::iota(top.begin(), top.end(), 0);
  std::sort(top.begin(), top.end(), [&](int x, int y) { return l[x] > l[y]; });
  for (int i = 0; i < 200; ++i) {
    int x = a.sample(l);
    EXPECT_EQ(x, b.sample(l));
    EXPECT_NE(std::find(top.begin(), top.begin() + 5, x), top.begin() + 5);
  }
}

// u next to 1 can leave the walk's remainder >= 0 after every candidate with weight (rounding);
// the token must still have probability > 0, never a -inf one at the end of the list.
TEST(Sampler, NeverPicksAZeroProbabilityToken) {
  const float inf = std::numeric_limits<float>::infinity();
  // Logits for which, at u = 1 - 2^-53, the sequential walk ends with a remainder >= 0.
  const std::vector<float> l = {-0.9399451613426208f, 1.7772181034088135f, -1.4494750499725342f,
                                -1.4792511463165283f, 1.3809133768081665f, -inf, -inf};
  const double u = std::nextafter(1.0, 0.0);
  EXPECT_EQ(sample_token(l, {1.0f, 0, 1.0f, 0}, u), 3);  // the last candidate with weight: the lowest finite logit
  for (double v : {0.0, 0.5, 0.999999, u}) {
    const int32_t t = sample_token(l, {1.0f, 0, 1.0f, 0}, v);
    EXPECT_TRUE(t != 5 && t != 6) << v;
  }
}

TEST(Sampler, TopPKeepsTheNucleus) {
  // p = [0.6, 0.3, 0.1]: top_p 0.5 keeps only the first; 0.85 keeps two.
  std::vector<float> l = {std::log(0.6f), std::log(0.3f), std::log(0.1f)};
  Sampler only_first({1.0f, 0, 0.5f, 3});
  for (int i = 0; i < 100; ++i) EXPECT_EQ(only_first.sample(l), 0);
  Sampler two({1.0f, 0, 0.85f, 3});
  int seen[3] = {0, 0, 0};
  for (int i = 0; i < 2000; ++i) ++seen[two.sample(l)];
  EXPECT_EQ(seen[2], 0);
  EXPECT_GT(seen[1], 400);
}

// The split: sample() is sample_token() with the uniform draw() returns, and draw() is the
// number uniform_real_distribution<double>(0, total) drew before the split, scaled by total.
TEST(Sampler, SampleIsSampleTokenOfTheDrawnUniform) {
  std::vector<float> l = test::randn(1000, 3);
  for (SamplingParams p : {SamplingParams{0.7f, 0, 0.9f, 5}, SamplingParams{1.5f, 50, 1.f, 6},
                           SamplingParams{1.f, 0, 0.5f, 7}, SamplingParams{0.f, 0, 1.f, 8}}) {
    Sampler a(p), b(p);
    for (int i = 0; i < 100; ++i) {
      const double u = b.draw();
      EXPECT_EQ(a.sample(l), sample_token(l, p, u));
    }
  }
  Sampler g({0.f, 0, 1.f, 9});
  EXPECT_EQ(g.draw(), 0.0);  // greedy draws nothing
  Sampler s({1.f, 0, 1.f, 11});
  std::mt19937_64 rng(11);
  for (double total : {1.0, 0.37, 12345.678, 3.0e-7}) {
    const double before = std::uniform_real_distribution<double>(0.0, total)(rng);
    EXPECT_EQ(s.draw() * total, before);
  }
}

TEST(Sampler, RejectsBadParams) {
  EXPECT_THROW(Sampler({-1.f, 0, 1.f, 0}), InputError);
  EXPECT_THROW(Sampler({1.f, 0, 0.f, 0}), InputError);
  EXPECT_THROW(Sampler({1.f, -2, 1.f, 0}), InputError);
}

}  // namespace
}  // namespace tiermoe
