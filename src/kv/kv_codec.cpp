#include "kv/kv_codec.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <istream>
#include <mutex>
#include <numeric>
#include <ostream>
#include <random>

#include "core/check.h"
#include "core/dtype.h"
#include "cpu/simd.h"

namespace tiermoe {
namespace {

const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> t = [] {
    std::array<float, 256> a{};
    for (int b = 0; b < 256; ++b) {
      const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
      float v = e == 0 ? float(m) / 8.f * std::ldexp(1.f, -6) : (1.f + float(m) / 8.f) * std::ldexp(1.f, e - 7);
      if (e == 15 && m == 7) v = 0.f;  // NaN code: never produced
      a[size_t(b)] = s ? -v : v;
    }
    return a;
  }();
  return t;
}

float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// Cyclic Jacobi eigen-decomposition of a symmetric matrix a[n, n] (destroyed). Returns
// eigenvectors as rows, sorted by descending eigenvalue, and the eigenvalues.
void jacobi_eigen(std::vector<double> a, int n, std::vector<float>& vecs, std::vector<double>& vals) {
  std::vector<double> v(size_t(n) * n, 0.0);
  for (int i = 0; i < n; ++i) v[size_t(i) * n + i] = 1.0;
  for (int sweep = 0; sweep < 30; ++sweep) {
    double off = 0, diag = 0;
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) (i == j ? diag : off) += a[size_t(i) * n + j] * a[size_t(i) * n + j];
    if (off <= 1e-22 * diag) break;
    for (int p = 0; p < n - 1; ++p)
      for (int q = p + 1; q < n; ++q) {
        const double apq = a[size_t(p) * n + q];
        if (std::fabs(apq) < 1e-300) continue;
        const double app = a[size_t(p) * n + p], aqq = a[size_t(q) * n + q];
        const double theta = (aqq - app) / (2 * apq);
        const double t = (theta >= 0 ? 1 : -1) / (std::fabs(theta) + std::sqrt(theta * theta + 1));
        const double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (int k = 0; k < n; ++k) {  // columns p, q
          const double akp = a[size_t(k) * n + p], akq = a[size_t(k) * n + q];
          a[size_t(k) * n + p] = c * akp - s * akq;
          a[size_t(k) * n + q] = s * akp + c * akq;
        }
        for (int k = 0; k < n; ++k) {  // rows p, q
          const double apk = a[size_t(p) * n + k], aqk = a[size_t(q) * n + k];
          a[size_t(p) * n + k] = c * apk - s * aqk;
          a[size_t(q) * n + k] = s * apk + c * aqk;
        }
        for (int k = 0; k < n; ++k) {  // eigenvector columns
          const double vkp = v[size_t(k) * n + p], vkq = v[size_t(k) * n + q];
          v[size_t(k) * n + p] = c * vkp - s * vkq;
          v[size_t(k) * n + q] = s * vkp + c * vkq;
        }
      }
  }
  std::vector<int> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return a[size_t(x) * n + x] > a[size_t(y) * n + y]; });
  vecs.assign(size_t(n) * n, 0.f);
  vals.resize(size_t(n));
  for (int r = 0; r < n; ++r) {
    vals[size_t(r)] = a[size_t(order[r]) * n + order[r]];
    for (int k = 0; k < n; ++k) vecs[size_t(r) * n + k] = float(v[size_t(k) * n + order[r]]);
  }
}

// Weighted squared distance between a[len] and b[len].
inline float dist(const float* a, const float* b, const float* w, int len) {
  float s = 0;
  for (int i = 0; i < len; ++i) s += w[i] * (a[i] - b[i]) * (a[i] - b[i]);
  return s;
}

int nearest(const VqSlot& s, const float* r, const float* w) {
  const int K = 1 << s.bits;
  if (s.len == 1) {  // books of scalar slots are sorted
    const float* b = s.book.data();
    int i = int(std::lower_bound(b, b + K, r[0]) - b);
    if (i == K) return K - 1;
    if (i > 0 && r[0] - b[i - 1] <= b[i] - r[0]) return i - 1;
    return i;
  }
  int best = 0;
  float bd = INFINITY;
  for (int c = 0; c < K; ++c) {
    const float dd = dist(r, s.book.data() + size_t(c) * s.len, w, s.len);
    if (dd < bd) bd = dd, best = c;
  }
  return best;
}

}  // namespace

std::vector<float> kmeans(const std::vector<float>& x, int N, int len, int K, const float* w, uint64_t seed, int iters,
                          bool full_scan) {
  std::vector<float> c(size_t(K) * len, 0.f);
  if (N == 0) return c;
  std::vector<int> ascending;  // scalar rows: the points in ascending order
  if (len == 1) {  // quantile initialization
    ascending.resize(size_t(N));
    std::iota(ascending.begin(), ascending.end(), 0);
    std::sort(ascending.begin(), ascending.end(), [&](int a, int b) { return x[size_t(a)] < x[size_t(b)]; });
    for (int k = 0; k < K; ++k)
      c[size_t(k)] = x[size_t(ascending[std::min<size_t>(size_t(N) - 1, size_t((k + 0.5) * N / K))])];
  } else {
    std::mt19937_64 rng(seed);
    std::vector<int> idx(static_cast<size_t>(N));
    std::iota(idx.begin(), idx.end(), 0);
    for (int k = 0; k < K; ++k) {
      const int j = k < N ? k + int(rng() % uint64_t(N - k)) : int(rng() % uint64_t(N));
      if (k < N) std::swap(idx[size_t(k)], idx[size_t(j)]);
      std::copy_n(x.data() + size_t(idx[size_t(k < N ? k : j)]) * len, len, c.data() + size_t(k) * len);
    }
  }
  std::vector<int> assign(static_cast<size_t>(N));
  std::vector<double> sum(size_t(K) * len);
  std::vector<int> cnt(static_cast<size_t>(K));
  auto nearest_centroid = [&](const float* xi) {  // the first centroid at the least distance
    int best = 0;
    float bd = INFINITY;
    for (int k = 0; k < K; ++k) {
      const float dd = dist(xi, c.data() + size_t(k) * len, w, len);
      if (dd < bd) bd = dd, best = k;
    }
    return best;
  };
  // Scalar slots: with ascending centroids a point's distances fall, then rise, along k, so its
  // nearest centroid is found by walking from the previous point's, the points in ascending order
  // (a few distances per point instead of K). The walk's answer is kept only where it is provably
  // nearest_centroid's (the centroid before it strictly farther); otherwise the full scan.
  // Stops once an iteration assigns every point as the one before did: its centroids (each the mean
  // of the same points; an empty cluster keeps its own) are then the ones it started from, and so
  // would be every later iteration's: the result of all `iters`, sooner.
  std::vector<int> before;
  for (int it = 0; it < iters; ++it) {
    if (it > 1 && assign == before) break;  // two real assignments (the first holds no earlier one)
    before = assign;
    if (len == 1 && !full_scan && std::is_sorted(c.begin(), c.end())) {
      int k = 0;
      for (int i : ascending) {
        const float* xi = x.data() + i;
        float dk = dist(xi, c.data() + k, w, 1);
        for (;;) {  // right past equal distances, to a smaller one
          int j = k + 1;
          float dj = 0;
          while (j < K && (dj = dist(xi, c.data() + j, w, 1)) == dk) ++j;
          if (j == K || !(dj < dk)) break;
          k = j, dk = dj;
        }
        if (k > 0 && !(dist(xi, c.data() + k - 1, w, 1) > dk)) k = nearest_centroid(xi);
        assign[size_t(i)] = k;
      }
    } else {
      for (int i = 0; i < N; ++i) assign[size_t(i)] = nearest_centroid(x.data() + size_t(i) * len);
    }
    std::fill(sum.begin(), sum.end(), 0.0);
    std::fill(cnt.begin(), cnt.end(), 0);
    for (int i = 0; i < N; ++i) {
      cnt[size_t(assign[size_t(i)])]++;
      for (int l = 0; l < len; ++l) sum[size_t(assign[size_t(i)]) * len + l] += x[size_t(i) * len + l];
    }
    for (int k = 0; k < K; ++k)
      if (cnt[size_t(k)] > 0)
        for (int l = 0; l < len; ++l) c[size_t(k) * len + l] = float(sum[size_t(k) * len + l] / cnt[size_t(k)]);
  }
  return c;
}

namespace {

// MSE of Gaussian Lloyd-Max quantization at b bits (unit variance).
double lloyd_distortion(int b) {
  static const double t[] = {1.0, 0.3634, 0.1175, 0.03454, 0.009497, 0.002499, 0.000642, 0.000163, 0.0000411};
  return b < 9 ? t[b] : t[8] * std::pow(4.0, -(b - 8));
}

template <class T>
void put(std::ostream& o, const T& v) { o.write(reinterpret_cast<const char*>(&v), sizeof v); }
template <class T>
void get(std::istream& i, T& v) {
  i.read(reinterpret_cast<char*>(&v), sizeof v);
  if (!i) throw InputError("KV profile: truncated");
}
template <class T>
void put_vec(std::ostream& o, const std::vector<T>& v) {
  put(o, uint64_t(v.size()));
  o.write(reinterpret_cast<const char*>(v.data()), std::streamsize(v.size() * sizeof(T)));
}
template <class T>
void get_vec(std::istream& i, std::vector<T>& v) {
  uint64_t n;
  get(i, n);
  if (n > (1u << 26)) throw InputError("KV profile: corrupt array length");
  v.resize(size_t(n));
  i.read(reinterpret_cast<char*>(v.data()), std::streamsize(n * sizeof(T)));
  if (!i) throw InputError("KV profile: truncated");
}

}  // namespace

float fp8_e4m3_to_f32(uint8_t b) { return fp8_table()[b]; }

uint8_t f32_to_fp8_e4m3(float f) {
  const auto& t = fp8_table();
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const float a = std::min(std::fabs(f), 448.f);
  // Positive codes 0..126 are ascending in value.
  int lo = 0, hi = 126;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (t[size_t(mid)] < a) lo = mid + 1;
    else hi = mid;
  }
  int best = lo;
  if (lo > 0) {
    const float dlo = a - t[size_t(lo - 1)], dhi = t[size_t(lo)] - a;
    if (dlo < dhi || (dlo == dhi && ((lo - 1) & 1) == 0)) best = lo - 1;
  }
  return uint8_t(sign | best);
}

std::vector<float> gaussian_lloyd_max(int bits) {
  CHECK(bits >= 0 && bits <= 10);
  static std::vector<float> memo[11];
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (!memo[bits].empty()) return memo[bits];
  const int K = 1 << bits;
  // Lloyd iterations on a fine grid of the N(0,1) density.
  const int G = 20001;
  std::vector<double> xs(G), ps(G);
  for (int i = 0; i < G; ++i) {
    xs[size_t(i)] = -8.0 + 16.0 * i / (G - 1);
    ps[size_t(i)] = std::exp(-0.5 * xs[size_t(i)] * xs[size_t(i)]);
  }
  std::vector<double> c(static_cast<size_t>(K));
  for (int k = 0; k < K; ++k) c[size_t(k)] = -3.0 + 6.0 * (k + 0.5) / K;
  for (int it = 0; it < 300; ++it) {
    std::vector<double> num(size_t(K), 0), den(size_t(K), 0);
    for (int i = 0, k = 0; i < G; ++i) {
      while (k + 1 < K && xs[size_t(i)] > 0.5 * (c[size_t(k)] + c[size_t(k + 1)])) ++k;
      num[size_t(k)] += xs[size_t(i)] * ps[size_t(i)];
      den[size_t(k)] += ps[size_t(i)];
    }
    for (int k = 0; k < K; ++k)
      if (den[size_t(k)] > 0) c[size_t(k)] = num[size_t(k)] / den[size_t(k)];
  }
  memo[bits].assign(c.begin(), c.end());
  return memo[bits];
}

void VqCodec::rotate(const float* x, float* y) const {
  float xc[256];
  for (int i = 0; i < d; ++i) xc[i] = x[i] - (mean.empty() ? 0.f : mean[size_t(i)]);
  if (rot.empty()) {
    std::copy_n(xc, d, y);
    return;
  }
  for (int r = 0; r < d; ++r) {
    const float* u = rot.data() + size_t(r) * d;
    float s = 0;
    for (int i = 0; i < d; ++i) s += u[i] * xc[i];
    y[r] = s;
  }
}

void VqCodec::unrotate(const float* y, float* x) const {
  if (rot.empty()) {
    std::copy_n(y, d, x);
    return;
  }
  std::fill(x, x + d, 0.f);
  for (int r = 0; r < d; ++r) {
    const float* u = rot.data() + size_t(r) * d;
    const float yr = y[r];
    if (yr == 0.f) continue;
    for (int i = 0; i < d; ++i) x[i] += yr * u[i];
  }
}

void VqCodec::fit(const CodecSpec& spec, const float* x, int N, int Dh, const std::vector<double>& qcov, uint64_t seed,
                  int kmeans_iters, const VqCodec* basis) {
  CHECK(Dh <= 256 && N > 0);
  *this = VqCodec{};
  kind = spec.kind;
  d = Dh;
  kivi_bits = spec.bits;
  kivi_group = spec.group;
  if (kind == "fp8") {
    float mx = 0;
    for (size_t i = 0; i < size_t(N) * Dh; ++i) mx = std::max(mx, std::fabs(x[i]));
    fp8_scale = round_bf16(mx > 0 ? mx / 448.f : 1.f);
    return;
  }
  if (kind != "vq") return;
  token_norm = spec.token_norm;
  rotation = spec.rotation;
  oblivious = spec.oblivious;

  // Rotation.
  std::vector<double> m(size_t(Dh), 0.0);
  if (basis) {
    CHECK(basis->kind == "vq" && basis->d == Dh && basis->rotation == rotation);
    rot = basis->rot;
    mean = basis->mean;
    shared_basis = true;
  } else if ((spec.rotation == "pca" || spec.rotation == "rope_pairs") && spec.center) {
    for (int n = 0; n < N; ++n)
      for (int i = 0; i < Dh; ++i) m[size_t(i)] += x[size_t(n) * Dh + i];
    for (auto& v : m) v /= N;
    mean.assign(m.begin(), m.end());
  }
  if (basis) {
    // rot is the basis codec's
  } else if (spec.rotation == "pca") {
    std::vector<double> cov(size_t(Dh) * Dh, 0.0);
    for (int n = 0; n < N; ++n) {
      const float* r = x + size_t(n) * Dh;
      for (int i = 0; i < Dh; ++i) {
        const double xi = r[i] - m[size_t(i)];
        for (int j = i; j < Dh; ++j) cov[size_t(i) * Dh + j] += xi * (r[j] - m[size_t(j)]);
      }
    }
    for (int i = 0; i < Dh; ++i)
      for (int j = i; j < Dh; ++j) cov[size_t(j) * Dh + i] = cov[size_t(i) * Dh + j] /= N;
    std::vector<double> vals;
    jacobi_eigen(cov, Dh, rot, vals);
  } else if (spec.rotation == "rope_pairs") {
    // PCA within each RoPE pair (i, i + Dh/2), a 2x2 rotation per pair: it commutes with RoPE, so a
    // key coded before RoPE is scored against the query turned by the key's angles, pair by pair,
    // instead of unrotated through a dense Dh x Dh basis.
    CHECK_MSG(Dh % 2 == 0, "rope_pairs rotation needs an even head dim");
    const int half = Dh / 2;
    rot.assign(size_t(Dh) * Dh, 0.f);
    for (int i = 0; i < half; ++i) {
      const int j = i + half;
      double a = 0, b = 0, c = 0;
      for (int n = 0; n < N; ++n) {
        const double xi = x[size_t(n) * Dh + i] - m[size_t(i)], xj = x[size_t(n) * Dh + j] - m[size_t(j)];
        a += xi * xi, b += xi * xj, c += xj * xj;
      }
      const double t = 0.5 * std::atan2(2 * b, a - c);  // the major axis' angle
      const float cs = float(std::cos(t)), sn = float(std::sin(t));
      rot[size_t(i) * Dh + i] = cs, rot[size_t(i) * Dh + j] = sn;    // major axis
      rot[size_t(j) * Dh + i] = -sn, rot[size_t(j) * Dh + j] = cs;   // minor axis: det +1, a rotation
    }
  } else if (spec.rotation == "hadamard") {
    CHECK_MSG((Dh & (Dh - 1)) == 0, "hadamard rotation needs a power-of-two head dim");
    std::mt19937_64 rng(seed);
    std::vector<float> sign(static_cast<size_t>(Dh));
    for (auto& s : sign) s = (rng() & 1) ? 1.f : -1.f;
    rot.assign(size_t(Dh) * Dh, 0.f);
    const float norm = 1.f / std::sqrt(float(Dh));
    for (int r = 0; r < Dh; ++r)
      for (int c = 0; c < Dh; ++c)
        rot[size_t(r) * Dh + c] = (__builtin_popcount(unsigned(r & c)) & 1 ? -norm : norm) * sign[size_t(c)];
  }

  // Rotated calibration rows and per-channel (query-weighted) variances.
  std::vector<float> Y(size_t(N) * Dh);
  for (int n = 0; n < N; ++n) rotate(x + size_t(n) * Dh, Y.data() + size_t(n) * Dh);
  std::vector<double> var(size_t(Dh), 0.0), w(size_t(Dh), 1.0);
  for (int n = 0; n < N; ++n)
    for (int i = 0; i < Dh; ++i) var[size_t(i)] += double(Y[size_t(n) * Dh + i]) * Y[size_t(n) * Dh + i] / N;
  if (spec.query_aware && !qcov.empty()) {
    double tot = 0;
    for (int r = 0; r < Dh; ++r) {
      double s = 0;
      for (int i = 0; i < Dh; ++i) {
        const double ui = rot.empty() ? (i == r) : rot[size_t(r) * Dh + i];
        if (ui == 0) continue;
        for (int j = 0; j < Dh; ++j) {
          const double uj = rot.empty() ? (j == r) : rot[size_t(r) * Dh + j];
          s += ui * qcov[size_t(i) * Dh + j] * uj;
        }
      }
      w[size_t(r)] = std::max(s, 1e-12);
      tot += w[size_t(r)];
    }
    for (auto& v : w) v *= Dh / tot;
  }
  std::vector<int> order(static_cast<size_t>(Dh));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return var[size_t(a)] * w[size_t(a)] > var[size_t(b)] * w[size_t(b)]; });
  const int na = int(std::lround(spec.anchor_frac * Dh));
  anchors.assign(order.begin(), order.begin() + na);
  rest.assign(order.begin() + na, order.end());
  for (int a : anchors) {
    float mx = 0;
    for (int n = 0; n < N; ++n) mx = std::max(mx, std::fabs(Y[size_t(n) * Dh + a]));
    anchor_scale.push_back(round_bf16(mx > 0 ? mx / 448.f : 1.f));
  }

  // Residuals of the non-anchor channels, normalized per token when asked.
  const int nr = int(rest.size());
  std::vector<float> R(size_t(N) * nr), wr(static_cast<size_t>(nr));
  for (int i = 0; i < nr; ++i) wr[size_t(i)] = float(w[size_t(rest[size_t(i)])]);
  for (int n = 0; n < N; ++n) {
    float* r = R.data() + size_t(n) * nr;
    for (int i = 0; i < nr; ++i) r[i] = Y[size_t(n) * Dh + rest[size_t(i)]];
    if (token_norm) {
      double ss = 0;
      for (int i = 0; i < nr; ++i) ss += double(r[i]) * r[i];
      const float s = round_bf16(float(std::sqrt(ss / std::max(nr, 1))));
      for (int i = 0; i < nr; ++i) r[i] = s > 0 ? r[i] / s : 0.f;
    }
  }

  for (size_t st = 0; st < spec.stage_bits.size(); ++st) {
    std::vector<VqSlot> slots;
    for (int c0 = 0; c0 < nr; c0 += spec.dim) slots.push_back({c0, std::min(spec.dim, nr - c0), 0, {}});
    // Weighted residual variance per slot; bits by greedy water-filling or uniformly.
    std::vector<double> sv(slots.size(), 0.0);
    for (size_t s = 0; s < slots.size(); ++s)
      for (int n = 0; n < N; ++n)
        for (int l = 0; l < slots[s].len; ++l) {
          const double v = R[size_t(n) * nr + slots[s].c0 + l];
          sv[s] += wr[size_t(slots[s].c0 + l)] * v * v / N;
        }
    const int max_bits = std::min(spec.max_bits > 0 ? spec.max_bits : spec.oblivious ? 6 : 10, 8 * spec.dim);
    if (spec.allocate) {
      long budget = std::lround(spec.stage_bits[st] * nr);
      auto D = [&](size_t s, int b) {
        return slots[s].len == 1 ? lloyd_distortion(b) : std::pow(2.0, -2.0 * b / slots[s].len);
      };
      while (budget-- > 0) {
        size_t best = 0;
        double gain = -1;
        for (size_t s = 0; s < slots.size(); ++s) {
          if (slots[s].bits >= max_bits) continue;
          const double g = sv[s] * (D(s, slots[s].bits) - D(s, slots[s].bits + 1));
          if (g > gain) gain = g, best = s;
        }
        if (gain < 0) break;
        slots[best].bits++;
      }
    } else {
      for (auto& s : slots) s.bits = std::min(max_bits, int(std::lround(spec.stage_bits[st] * s.len)));
    }
    // Codebooks, then the residual for the next stage.
    std::vector<float> sub;
    for (size_t s = 0; s < slots.size(); ++s) {
      VqSlot& slot = slots[s];
      const int K = 1 << slot.bits;
      if (spec.oblivious) {
        CHECK(slot.len == 1);
        slot.book = slot.bits == 0 ? std::vector<float>{0.f} : gaussian_lloyd_max(slot.bits);
      } else {
        sub.resize(size_t(N) * slot.len);
        for (int n = 0; n < N; ++n) std::copy_n(R.data() + size_t(n) * nr + slot.c0, slot.len, sub.data() + size_t(n) * slot.len);
        slot.book = kmeans(sub, N, slot.len, K, wr.data() + slot.c0, seed * 1000003u + st * 1009u + s, kmeans_iters);
        if (slot.len == 1) std::sort(slot.book.begin(), slot.book.end());
      }
      for (int n = 0; n < N; ++n) {
        float* r = R.data() + size_t(n) * nr + slot.c0;
        const int c = nearest(slot, r, wr.data() + slot.c0);
        for (int l = 0; l < slot.len; ++l) r[l] -= slot.book[size_t(c) * slot.len + l];
      }
    }
    stages.push_back(std::move(slots));
  }
}

int VqCodec::n_codes(int n) const {
  int c = 0;
  for (int s = 0; s < n && s < int(stages.size()); ++s) c += int(stages[size_t(s)].size());
  return c;
}
int VqCodec::n_codes() const { return n_codes(int(stages.size())); }

double VqCodec::token_bits(int n) const {
  if (kind == "bf16") return 16.0 * d;
  if (kind == "fp8") return 8.0 * d;
  if (kind == "kivi") return double(kivi_bits) * d + 32.0 * d / kivi_group;  // BF16 scale + zero per group
  double b = 8.0 * double(anchors.size()) + (token_norm ? 16.0 : 0.0);
  for (int s = 0; s < n && s < int(stages.size()); ++s)
    for (const VqSlot& slot : stages[size_t(s)]) b += slot.bits;
  return b;
}

double VqCodec::meta_bits() const {
  if (kind == "fp8") return 16;
  if (kind != "vq") return 0;
  // A PCA basis is d*d numbers, a RoPE-pair basis one angle per pair; a Hadamard rotation only its
  // d random signs (d bits).
  const double basis = rotation == "pca"          ? double(rot.size())
                       : rotation == "rope_pairs" ? d / 2.0
                       : rotation == "hadamard"   ? d / 16.0
                                                  : 0.0;
  double n = shared_basis ? 0.0 : basis + double(mean.size());
  n += double(anchor_scale.size());
  for (const auto& st : stages)
    for (const VqSlot& s : st)
      if (!oblivious) n += double(s.book.size());  // Gaussian levels are constants of the code
  return 16.0 * n;
}

void VqCodec::encode(const float* x, uint16_t* codes, uint8_t* anc, float* norm) const {
  float y[256];
  rotate(x, y);
  for (size_t a = 0; a < anchors.size(); ++a) anc[a] = f32_to_fp8_e4m3(y[anchors[a]] / anchor_scale[a]);
  const int nr = int(rest.size());
  float r[256], w1[256];
  for (int i = 0; i < nr; ++i) r[i] = y[rest[size_t(i)]], w1[i] = 1.f;
  float s = 1.f;
  if (token_norm) {
    double ss = 0;
    for (int i = 0; i < nr; ++i) ss += double(r[i]) * r[i];
    s = round_bf16(float(std::sqrt(ss / std::max(nr, 1))));
    for (int i = 0; i < nr; ++i) r[i] = s > 0 ? r[i] / s : 0.f;
  }
  *norm = s;
  int ci = 0;
  for (const auto& st : stages)
    for (const VqSlot& slot : st) {
      const int c = nearest(slot, r + slot.c0, w1);
      codes[ci++] = uint16_t(c);
      for (int l = 0; l < slot.len; ++l) r[slot.c0 + l] -= slot.book[size_t(c) * slot.len + l];
    }
}

void VqCodec::decode(const uint16_t* codes, const uint8_t* anc, float norm, int n_stages, float* x, bool in_basis) const {
  float y[256], r[256];
  std::fill_n(y, d, 0.f);
  std::fill_n(r, rest.size(), 0.f);
  for (size_t a = 0; a < anchors.size(); ++a) y[anchors[a]] = fp8_e4m3_to_f32(anc[a]) * anchor_scale[a];
  int ci = 0;
  for (int s = 0; s < n_stages && s < int(stages.size()); ++s)
    for (const VqSlot& slot : stages[size_t(s)]) {
      const float* c = slot.book.data() + size_t(codes[ci++]) * slot.len;
      for (int l = 0; l < slot.len; ++l) r[slot.c0 + l] += c[l];
    }
  for (size_t i = 0; i < rest.size(); ++i) y[rest[i]] = norm * r[i];
  if (in_basis) {
    std::copy_n(y, d, x);
    return;
  }
  from_basis(y, 1.f, x);
}

void VqCodec::from_basis(const float* y, float weight, float* x) const {
  unrotate(y, x);
  if (!mean.empty())
    for (int i = 0; i < d; ++i) x[i] += weight * mean[size_t(i)];
}

namespace {
// x[R rows, 16 columns from c0] = start + sum over the listed rows r of U of y(i, r) U[r, c0 ..]
// (+ mean), in the order of `rows`, with y(i, r) = y[i * row_stride + r * channel_stride]: R rows
// by two 8-lane vectors in registers, each piece of U loaded once for R rows.
template <int R>
void unrotate_block(const float* y, size_t row_stride, size_t channel_stride, int d, const float* U, const int* rows,
                    int nrows, const float* start, const float* mean, float* x) {
  for (int c0 = 0; c0 < d; c0 += 16) {
    __m256 acc[R][2];
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < 2; ++v) acc[i][v] = _mm256_loadu_ps(start + c0 + 8 * v);
    for (int k = 0; k < nrows; ++k) {
      const float* u = U + size_t(rows[k]) * d + c0;
      const __m256 u0 = _mm256_loadu_ps(u), u1 = _mm256_loadu_ps(u + 8);
      for (int i = 0; i < R; ++i) {
        const __m256 b = _mm256_broadcast_ss(y + size_t(i) * row_stride + size_t(rows[k]) * channel_stride);
        acc[i][0] = _mm256_fmadd_ps(b, u0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(b, u1, acc[i][1]);
      }
    }
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < 2; ++v) {
        const __m256 a = acc[i][v];
        _mm256_storeu_ps(x + size_t(i) * d + c0 + 8 * v, mean ? _mm256_add_ps(a, _mm256_loadu_ps(mean + c0 + 8 * v)) : a);
      }
  }
}
}  // namespace

void VqCodec::from_basis_rows(const float* y, int n, float* x, const uint8_t* constant, bool channel_major) const {
  const size_t row_stride = channel_major ? 1 : size_t(d), channel_stride = channel_major ? size_t(n) : 1;
  if (rot.empty() || d % 16 != 0 || d > 256) {
    float row[256];
    for (int t = 0; t < n; ++t) {
      for (int r = 0; r < d; ++r) row[r] = y[size_t(t) * row_stride + size_t(r) * channel_stride];
      from_basis(row, 1.f, x + size_t(t) * d);
    }
    return;
  }
  // Channels with the same value in every row are summed once, into every row's start; the
  // others in basis order, as unrotate sums them (without constant channels the bits are its).
  alignas(32) float start[256];
  int rows[256], nrows = 0;
  std::fill_n(start, d, 0.f);
  for (int r = 0; r < d; ++r) {
    if (!constant || !constant[r]) {
      rows[nrows++] = r;
      continue;
    }
    const float yr = y[size_t(r) * channel_stride];
    const float* u = rot.data() + size_t(r) * d;
    for (int i = 0; i < d; ++i) start[i] += yr * u[i];
  }
  const float* mu = mean.empty() ? nullptr : mean.data();
  int t = 0;
  for (; t + 4 <= n; t += 4)
    unrotate_block<4>(y + size_t(t) * row_stride, row_stride, channel_stride, d, rot.data(), rows, nrows, start, mu, x + size_t(t) * d);
  for (; t < n; ++t)
    unrotate_block<1>(y + size_t(t) * row_stride, row_stride, channel_stride, d, rot.data(), rows, nrows, start, mu, x + size_t(t) * d);
}

void VqCodec::constant_channels(int n, uint8_t* constant) const {
  std::fill_n(constant, d, uint8_t(0));
  if (kind != "vq" || token_norm) return;
  int bits[256] = {};  // per residual channel (rest.size() <= d <= 256); runs per decoded page
  for (int s = 0; s < n && s < n_stages(); ++s)
    for (const VqSlot& slot : stages[size_t(s)])
      for (int l = 0; l < slot.len; ++l) bits[size_t(slot.c0 + l)] += slot.bits;
  for (size_t i = 0; i < rest.size(); ++i) constant[rest[i]] = bits[i] == 0;
}

void VqCodec::roundtrip_elementwise(float* x) const {
  if (kind == "bf16")
    for (int i = 0; i < d; ++i) x[i] = round_bf16(x[i]);
  else if (kind == "fp8")
    for (int i = 0; i < d; ++i) x[i] = fp8_e4m3_to_f32(f32_to_fp8_e4m3(x[i] / fp8_scale)) * fp8_scale;
}

int VqCodec::kivi_groups(int P, bool is_key) const {
  const int G = kivi_group;
  return is_key ? (P + G - 1) / G * d : P * ((d + G - 1) / G);
}

// Groups: keys per channel over G tokens, values per token over G channels. Each group keeps
// BF16 (zero, scale) at zs[2g], zs[2g + 1]; an element is zero + level * scale.
template <class Fn>
static void kivi_for_groups(int P, int d, int G, bool is_key, Fn fn) {  // fn(group, n, index of element i)
  int g = 0;
  if (is_key) {
    for (int t0 = 0; t0 < P; t0 += G)
      for (int c = 0; c < d; ++c, ++g) fn(g, std::min(G, P - t0), [=](int i) { return (t0 + i) * d + c; });
  } else {
    for (int t = 0; t < P; ++t)
      for (int c0 = 0; c0 < d; c0 += G, ++g) fn(g, std::min(G, d - c0), [=](int i) { return t * d + c0 + i; });
  }
}

void VqCodec::kivi_encode(const float* x, int P, size_t stride, bool is_key, uint8_t* levels, uint16_t* zs) const {
  const int top = (1 << kivi_bits) - 1;
  auto at = [&](int e) { return x[size_t(e / d) * stride + size_t(e % d)]; };
  kivi_for_groups(P, d, kivi_group, is_key, [&](int g, int n, auto idx) {
    float lo = INFINITY, hi = -INFINITY;  // asymmetric min/max
    for (int i = 0; i < n; ++i) lo = std::min(lo, at(idx(i))), hi = std::max(hi, at(idx(i)));
    const float zero = round_bf16(lo), scale = round_bf16((hi - lo) / top);
    zs[2 * g] = f32_to_bf16(zero);
    zs[2 * g + 1] = f32_to_bf16(scale);
    for (int i = 0; i < n; ++i)
      levels[idx(i)] = uint8_t(scale > 0 ? std::clamp(std::nearbyint((at(idx(i)) - zero) / scale), 0.f, float(top)) : 0.f);
  });
}

void VqCodec::kivi_decode(const uint8_t* levels, const uint16_t* zs, int P, bool is_key, float* x, size_t stride) const {
  kivi_for_groups(P, d, kivi_group, is_key, [&](int g, int n, auto idx) {
    const float zero = bf16_to_f32(zs[2 * g]), scale = bf16_to_f32(zs[2 * g + 1]);
    for (int i = 0; i < n; ++i) x[size_t(idx(i) / d) * stride + size_t(idx(i) % d)] = zero + float(levels[idx(i)]) * scale;
  });
}

void VqCodec::kivi_roundtrip(float* x, int P, size_t stride, bool is_key) const {
  std::vector<uint8_t> levels(size_t(P) * d);
  std::vector<uint16_t> zs(size_t(kivi_groups(P, is_key)) * 2);
  kivi_encode(x, P, stride, is_key, levels.data(), zs.data());
  kivi_decode(levels.data(), zs.data(), P, is_key, x, stride);
}

void VqCodec::save(std::ostream& o) const {
  put_vec(o, std::vector<char>(kind.begin(), kind.end()));
  put(o, d);
  put_vec(o, rot);
  put_vec(o, mean);
  put_vec(o, anchors);
  put_vec(o, anchor_scale);
  put_vec(o, rest);
  put(o, uint8_t(token_norm));
  put(o, uint8_t(oblivious));
  put_vec(o, std::vector<char>(rotation.begin(), rotation.end()));
  put(o, fp8_scale);
  put(o, kivi_bits);
  put(o, kivi_group);
  put(o, uint64_t(stages.size()));
  for (const auto& st : stages) {
    put(o, uint64_t(st.size()));
    for (const VqSlot& s : st) {
      put(o, s.c0);
      put(o, s.len);
      put(o, s.bits);
      put_vec(o, s.book);
    }
  }
}

void VqCodec::load(std::istream& in) {
  std::vector<char> k;
  get_vec(in, k);
  kind.assign(k.begin(), k.end());
  get(in, d);
  get_vec(in, rot);
  get_vec(in, mean);
  get_vec(in, anchors);
  get_vec(in, anchor_scale);
  get_vec(in, rest);
  uint8_t tn;
  get(in, tn);
  token_norm = tn;
  get(in, tn);
  oblivious = tn;
  get_vec(in, k);
  rotation.assign(k.begin(), k.end());
  get(in, fp8_scale);
  get(in, kivi_bits);
  get(in, kivi_group);
  uint64_t ns;
  get(in, ns);
  if (ns > 64) throw InputError("KV profile: corrupt stage count");
  stages.assign(size_t(ns), {});
  for (auto& st : stages) {
    uint64_t n;
    get(in, n);
    if (n > 4096) throw InputError("KV profile: corrupt slot count");
    st.resize(size_t(n));
    for (VqSlot& s : st) {
      get(in, s.c0);
      get(in, s.len);
      get(in, s.bits);
      get_vec(in, s.book);
      if (s.bits < 0 || s.bits > 16 || s.book.size() != (size_t(1) << s.bits) * size_t(s.len))
        throw InputError("KV profile: corrupt codebook");
    }
  }
  check_layout();
}

void VqCodec::check_layout() const {
  auto fail = [](const std::string& what) { throw InputError("KV profile: corrupt codec (" + what + ")"); };
  if (kind != "vq" && kind != "fp8" && kind != "kivi" && kind != "bf16") fail("kind '" + kind + "'");
  if (d < 1 || d > 256) fail("head dim " + std::to_string(d));
  if (kind == "kivi" && (kivi_bits < 1 || kivi_bits > 8 || kivi_group < 1)) fail("kivi bits or group");
  if (kind != "vq") return;
  if (!rot.empty() && rot.size() != size_t(d) * d) fail("rotation size");
  if (!mean.empty() && mean.size() != size_t(d)) fail("mean size");
  if (anchor_scale.size() != anchors.size()) fail("anchor scales");
  // Anchors and residual channels are every channel once (decoding writes each exactly once).
  std::vector<int> seen(size_t(d), 0);
  for (const auto* list : {&anchors, &rest})
    for (int ch : *list) {
      if (ch < 0 || ch >= d || seen[size_t(ch)]++) fail("channel " + std::to_string(ch));
    }
  if (anchors.size() + rest.size() != size_t(d)) fail("channels do not cover the head");
  // Each stage's slots cut the residual channels in order (the first stage assigns every one).
  for (const auto& st : stages) {
    int next = 0;
    for (const VqSlot& s : st) {
      if (s.c0 != next || s.len < 1) fail("slot layout");
      next += s.len;
    }
    if (next != int(rest.size())) fail("slots do not cover the residual channels");
  }
}

}  // namespace tiermoe
