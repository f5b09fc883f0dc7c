// The tiered KV cache. Per layer and K/V it holds what a serving cache would hold, page by
// page (kv_page.h): BF16 rows for the sink and the window; past the window a page keeps only
// its codes (middle: every stage; archive: a prefix of the stages, cut at migration).
//
// Tiers are a function of a query's position p and a key's page: sink (key < sink), window
// (the key's page ends less than W tokens before p), middle, archive (page ended at least M
// before p). A query therefore sees each key exactly as a decoding cache would hold it at
// step p, whatever the chunking of the prompt: this is what gives `ppl` decode semantics in
// one pass. To keep it, a page's BF16 rows are freed, and its codes cut to the archive's
// prefix, only after the attention of the chunk that moved it (finish_chunk): the chunk's
// earlier queries still see it as it was at their step.
//
// Two attention paths compute the same thing:
//   - lookup tables (decode, T <= spec.lut_max_tokens, post-RoPE vq keys and vq values): per
//     query a table of q.codeword per slot; a key's score is a sum of lookups; attention
//     weights are accumulated per codeword and multiplied by the codebook once; the exact
//     part is merged by log-sum-exp;
//   - decoded pages (prefill chunks, pre-RoPE keys, element-wise codecs): per KV head, the
//     coded pages the chunk needs are decoded into a scratch buffer that lives for this call
//     only (a GPU kernel would decode tiles into shared memory), then exact attention. Keys
//     coded before RoPE must take this path: RoPE depends on the key's position, so no
//     per-query table of codewords can score them.
// A test checks both paths agree.
// Legend: T tokens, H/Hkv heads, Dh head dim, P page tokens.
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "core/thread_pool.h"
#include "cpu/ops.h"
#include "cpu/simd.h"
#include "kv/kv_cache.h"
#include "kv/kv_codec.h"
#include "kv/kv_page.h"
#include "kv/kv_profile.h"
#include "kv/kv_spec.h"

namespace tiermoe {
namespace {

// Row types: FP32 (decoded scratch) or BF16 (stored exact rows); same arithmetic order for both.
template <class Row>
inline __m256 load8(const Row* p) {
  if constexpr (std::is_same_v<Row, float>) return _mm256_loadu_ps(p);
  else return load8_f32<DType::BF16>(p, 0);
}
template <class Row>
inline float load1(const Row* p) {
  if constexpr (std::is_same_v<Row, float>) return *p;
  else return bf16_to_f32(*p);
}

template <class Row>
inline float dot(const float* a, const Row* b, int n) {
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc);
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * load1(b + i);
  return s;
}

template <class Row>
inline void axpy(float* y, float a, const Row* x, int n) {
  const __m256 av = _mm256_set1_ps(a);
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, load8(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * load1(x + i);
}

struct Stream {                  // K or V of one layer
  std::vector<uint16_t> sink;    // BF16 [sink, Hkv, Dh], moved here when their page leaves the window
  std::vector<PageStore> pages;  // page i: tokens [iP, (i+1)P)
};

constexpr int kMaxVersions = 17;  // 1 + KvSpec::refits at most

struct Layer {
  int len = 0, appended = 0;
  int coded = 0;       // pages [0, coded) have codes
  int exact_from = 0;  // pages [0, exact_from) hold no BF16 rows (the sink's rows are in Stream::sink)
  int full_from = 0;   // pages [0, full_from) hold only the archive's prefix of the stages
  bool calibrated = false;          // codec.size() >= 1
  Stream s[2];                      // 0: K, 1: V
  std::vector<std::vector<VqCodec>> codec;  // [version][Hkv][2]; version v fitted at fit_point(v)
  std::vector<double> qcov;         // [Hkv, Dh, Dh] sum of q q^T of queries [0, q_next) (while fits remain)
  int q_next = 0;
  // Refit sample (while refits remain): BF16 rows [n, Hkv, Dh] of K and V of the tokens at
  // sample_pos[n], the positions a later fit reads (kept as they arrive: the pages' own rows
  // are freed as they leave the window).
  std::vector<uint16_t> sample[2];
  std::vector<int> sample_pos;
};

// The decoded scratch of one KV head for one attention call: pages [lo, hi) of one version.
// vq values stay in their codec's rotated basis: attention sums them there and unrotates the
// sum once per query (Dh^2 per query instead of per key).
struct Decoded {
  int lo = 0, hi = 0;
  std::vector<float> rows[2];  // K, V: [(hi - lo) P, Dh] in use (scratch: never shrunk)
};

class TieredKvCache final : public KvCache {
 public:
  TieredKvCache(const KvGeometry& g, const KvSpec& spec, const KvProfile* profile)
      : g_(g), spec_(spec), layers_(size_t(g.num_layers)) {
    CHECK(g.head_dim <= 256);
    for (int l = 0; l < g.num_layers; ++l) {
      Layer& L = layers_[size_t(l)];
      if (profile) {
        L.codec.emplace_back(size_t(g.num_kv_heads) * 2);
        for (int h = 0; h < g.num_kv_heads; ++h)
          for (int kv = 0; kv < 2; ++kv) L.codec[0][size_t(h) * 2 + kv] = profile->at(l, h, kv);
        L.calibrated = true;
      } else {
        init_qcov(L);
      }
    }
    from_profile_ = profile != nullptr;
    calib_pos_ = profile ? 0 : spec_.calib_tokens - 1;
    n_fits_ = profile ? 1 : 1 + spec_.refits;
    if (spec_.k.kind == "vq" && spec_.k.pre_rope) {
      CHECK_MSG(g.rope_theta > 0, "pre-RoPE key coding needs the RoPE base");
      rope_.inv_freq.resize(size_t(g.head_dim / 2));
      rope_inv_freq(rope_.inv_freq.data(), g.head_dim, g.rope_theta);
    }
  }

  void append(int layer, const float* k, const float* v, int T) override {
    Layer& L = layers_[size_t(layer)];
    const size_t row = size_t(g_.num_kv_heads) * g_.head_dim;
    const int P = spec_.page;
    for (int kv = 0; kv < 2; ++kv) {
      const float* src = kv == 0 ? k : v;
      auto& pages = L.s[kv].pages;
      for (int t = 0; t < T; ++t) {
        const int pos = L.len + t;
        if (size_t(pos / P) >= pages.size()) pages.emplace_back().exact.reserve(size_t(P) * row);
        auto& e = pages[size_t(pos / P)].exact;
        for (size_t i = 0; i < row; ++i) e.push_back(f32_to_bf16(src[size_t(t) * row + i]));
        if (kv == 0 && sampled(pos)) L.sample_pos.push_back(pos);
        if (sampled(pos)) L.sample[kv].insert(L.sample[kv].end(), e.end() - long(row), e.end());
      }
    }
    L.len += T;
    L.appended = T;
  }

  void attend(int layer, const float* q, int T, float* out) const override {
    auto* self = const_cast<TieredKvCache*>(this);  // calibration, coding and migration are lazy
    Layer& L = self->layers_[size_t(layer)];
    CHECK(T <= L.appended);
    const int p0 = L.len - T;
    const size_t qrow = size_t(g_.num_heads) * g_.head_dim;
    // The chunk in runs of queries that see the same fits: fit v is seen from the query at
    // fit_point(v) - 1 on, and is made from the queries and rows before fit_point(v) only.
    for (int a = p0; a < L.len;) {
      int fits = int(L.codec.size());
      for (; fits < n_fits_ && a >= fit_point(fits) - 1; ++fits) {
        self->collect_queries(L, q, T, p0, fit_point(fits));
        self->fit(layer);
      }
      const int b = fits < n_fits_ ? std::min(L.len, fit_point(fits) - 1) : L.len;
      if (L.calibrated) self->encode_up_to(L, coded_end(b - 1));
      attend_run(L, q + size_t(a - p0) * qrow, a, b - a, out + size_t(a - p0) * qrow);
      a = b;
    }
    if (int(L.codec.size()) < n_fits_) self->collect_queries(L, q, T, p0, L.len);
    self->finish_chunk(L);
  }

  int length() const override { return layers_.empty() ? 0 : layers_.back().len; }

  void truncate(int n) override {
    const int P = spec_.page;
    const size_t row = size_t(g_.num_kv_heads) * g_.head_dim;
    for (Layer& L : layers_) {
      CHECK(n <= L.len);
      CHECK_MSG(n == 0 || n >= L.q_next || int(L.codec.size()) == n_fits_,
                "tiered KV cache: truncating before tokens the online calibration has already read");
      if (n == 0 && !from_profile_) {  // start over: the codecs were fitted on what is dropped
        L.codec.clear();
        L.calibrated = false;
        L.q_next = 0;
        for (auto& v : L.sample) std::vector<uint16_t>().swap(v);
        std::vector<int>().swap(L.sample_pos);
        init_qcov(L);
      }
      CHECK_MSG(rows_held_to(L, n), "tiered KV cache: truncating into pages that hold only codes (their exact rows are freed)");
      L.len = n;
      L.appended = 0;
      const size_t keep = size_t((n + P - 1) / P);
      L.coded = std::min(L.coded, n / P);
      L.exact_from = std::min(L.exact_from, int(keep));
      L.full_from = std::min(L.full_from, int(keep));
      for (Stream& s : L.s) {
        s.pages.resize(keep);
        if (n % P) s.pages.back().exact.resize(size_t(n % P) * row);
        if (L.exact_from == 0) std::vector<uint16_t>().swap(s.sink);
      }
    }
  }

  // Exact where the first n tokens alone would have left the same state: all of them, none, or
  // a prefix after the last fit (no codec fitted on what follows it) whose tokens that must be
  // exact again still have their rows (truncate's condition). Not elsewhere: before its last fit
  // a cache holds query statistics and codecs of every token it has seen.
  bool can_copy_prefix(int n) const override {
    if (n < 0 || n > length()) return false;
    if (n > 0 && n < length())
      for (const Layer& L : layers_)
        if ((!from_profile_ && (int(L.codec.size()) < n_fits_ || n < fit_point(n_fits_ - 1))) || !rows_held_to(L, n))
          return false;
    return true;
  }
  std::unique_ptr<KvCache> copy_prefix(int n) const override {
    CHECK(n >= 0 && n <= length());
    if (!can_copy_prefix(n)) return nullptr;
    auto copy = std::make_unique<TieredKvCache>(*this);
    if (n < length()) copy->truncate(n);
    return copy;
  }

  // Whether L cut to n tokens is whole: the tokens that must be exact again still have their rows,
  // and no page is cut short of the archive's stages.
  bool rows_held_to(const Layer& L, int n) const {
    if (n == 0) return true;
    int sink, ae, ce;
    ranges(L, n - 1, sink, ae, ce);
    return ce >= L.exact_from * spec_.page && ae >= L.full_from * spec_.page;
  }

  // Bytes allocated for tokens: BF16 rows, codes, anchors, norms and scales of every page.
  size_t bytes() const override {
    size_t b = 0;
    for (const Layer& L : layers_)
      for (const Stream& s : L.s) {
        b += s.sink.capacity() * 2;
        for (const PageStore& pg : s.pages) b += pg.bytes();
      }
    return b;
  }

  Stats stats() const override {
    Stats st;
    const int len = length(), p = len - 1, Dh = g_.head_dim;
    const bool cal = !layers_.empty() && layers_[0].calibrated && p >= calib_pos_;
    const int ce = cal ? std::max(coded_end(p), 0) : 0, ae = cal ? std::min(archive_end(p), ce) : 0;
    const int sink = std::min(spec_.sink, len);
    const long n_arch = std::max(0, ae - sink), n_mid = std::max(0, ce - std::max(ae, sink));
    const long n_win = len - sink - n_arch - n_mid;
    // Mean over layers, heads and the tier's tokens [a, b) of the bits of each page's codec
    // version (an empty tier: the newest version's).
    const int P = spec_.page;
    auto tier_bits = [&](int kv, int stages_of_tier, int a, int b) {
      double bits = 0, n = 0;
      for (const Layer& L : layers_)
        for (int pg = a / P; pg < (b + P - 1) / P || (a >= b && pg == a / P); ++pg) {
          const int tokens = a >= b ? 1 : std::min(b, (pg + 1) * P) - std::max(a, pg * P);
          const auto& codec = a >= b ? L.codec.back() : L.codec[size_t(L.s[kv].pages[size_t(pg)].version)];
          for (int h = 0; h < g_.num_kv_heads; ++h, n += tokens) {
            const VqCodec& c = codec[size_t(h) * 2 + kv];
            bits += tokens * c.token_bits(stages_of_tier < 0 ? c.n_stages() : std::min(stages_of_tier, c.n_stages()));
          }
        }
      return n ? bits / n / Dh : 0;
    };
    const int arch_stages = spec_.archive_stages > 0 ? spec_.archive_stages : 1 << 20;
    st.tiers.push_back({"sink", long(sink), 16, 16});
    st.tiers.push_back({"window", n_win, 16, 16});
    const int mid0 = std::max(ae, sink), arch0 = sink;
    st.tiers.push_back({"middle", n_mid, cal ? tier_bits(0, -1, mid0, ce) : 0, cal ? tier_bits(1, -1, mid0, ce) : 0});
    st.tiers.push_back({"archive", n_arch, cal ? tier_bits(0, arch_stages, arch0, ae) : 0,
                        cal ? tier_bits(1, arch_stages, arch0, ae) : 0});
    double kb = 0, vb = 0;
    for (const auto& t : st.tiers) kb += t.tokens * t.k_bits, vb += t.tokens * t.v_bits;
    st.k_bits = len ? kb / len : 0;
    st.v_bits = len ? vb / len : 0;
    const double values = double(len) * g_.num_layers * g_.num_kv_heads * Dh;
    st.token_bytes = values * (st.k_bits + st.v_bits) / 8;
    st.held_bytes = double(bytes());
    // Per sequence: every codec version held, and while fits remain, what they will read.
    for (const Layer& L : layers_) {
      for (const auto& version : L.codec)
        for (const VqCodec& c : version) st.meta_bytes += c.meta_bits() / 8;  // a shared basis counts once
      st.meta_bytes += double(L.sample[0].capacity() + L.sample[1].capacity()) * 2 +
                       double(L.sample_pos.capacity()) * 4 + double(L.qcov.capacity()) * 8;
    }
    return st;
  }

  const std::vector<Layer>& layers() const { return layers_; }
  std::vector<float> decoded_page(int layer, int kv, int pg, int h, int& version) const {
    const Layer& L = layers_[size_t(layer)];
    const PageStore& page = L.s[kv].pages[size_t(pg)];
    CHECK(page.coded);
    version = page.version;
    std::vector<float> out(size_t(spec_.page) * g_.head_dim);
    decode_page(page, codecs(L, kv, page.version), page_geo(pg), h, page.stages, rope_, out.data());
    return out;
  }
  const KvSpec& spec() const { return spec_; }

 private:
  // Tokens [0, coded_end(p)) are coded for a query at p (whole pages at least W old).
  int coded_end(int p) const {
    const int x = p - spec_.window + 1;
    return x <= 0 ? 0 : x / spec_.page * spec_.page;
  }
  int archive_end(int p) const {
    const int x = p - spec_.middle + 1;
    return x <= 0 ? 0 : x / spec_.page * spec_.page;
  }
  int stages_for(bool archive, const VqCodec& c) const {
    return archive && spec_.archive_stages > 0 ? std::min(spec_.archive_stages, c.n_stages()) : c.n_stages();
  }
  StreamCodecs codecs(const Layer& L, int kv, int version) const { return {L.codec[size_t(version)].data(), kv}; }
  PageGeometry page_geo(int page) const { return {spec_.page, g_.num_kv_heads, g_.head_dim, page * spec_.page}; }

  // The BF16 row [Hkv, Dh] of token j (sink, or a page still in the window).
  const uint16_t* exact_row(const Layer& L, int kv, int j) const {
    const size_t row = size_t(g_.num_kv_heads) * g_.head_dim;
    const PageStore& pg = L.s[kv].pages[size_t(j / spec_.page)];
    if (!pg.exact.empty()) return pg.exact.data() + size_t(j % spec_.page) * row;
    CHECK(j < spec_.sink);
    return L.s[kv].sink.data() + size_t(j) * row;
  }

  // Online fits: version v from the tokens [0, fit_point(v)): version 0 from all of them,
  // refit v from every fit_stride(v)-th (about spec.refit_rows rows).
  int fit_point(int v) const { return spec_.calib_tokens << v; }
  int fit_stride(int v) const { return v == 0 ? 1 : std::max(1, fit_point(v) / spec_.refit_rows); }
  // Whether a refit after version v reads the row of the token at pos.
  bool read_after(int pos, int v) const {
    for (int u = std::max(v + 1, 1); u < n_fits_; ++u)
      if (pos < fit_point(u) && pos % fit_stride(u) == 0) return true;
    return false;
  }
  bool sampled(int pos) const { return !from_profile_ && read_after(pos, 0); }
  // The sampled BF16 row [Hkv, Dh] of the token at pos (it must be in the sample).
  const uint16_t* sample_row(const Layer& L, int kv, int pos) const {
    const auto it = std::lower_bound(L.sample_pos.begin(), L.sample_pos.end(), pos);
    CHECK(it != L.sample_pos.end() && *it == pos);
    return L.sample[kv].data() + size_t(it - L.sample_pos.begin()) * g_.num_kv_heads * g_.head_dim;
  }
  void init_qcov(Layer& L) const {
    if (spec_.k.query_aware && spec_.k.kind == "vq")
      L.qcov.assign(size_t(g_.num_kv_heads) * g_.head_dim * g_.head_dim, 0.0);
  }

  // Adds the queries at positions [L.q_next, upto) of this chunk (p0 .. p0 + T) to qcov.
  void collect_queries(Layer& L, const float* q, int T, int p0, int upto) {
    const int from = std::max(L.q_next, p0), to = std::min(upto, p0 + T);
    if (to <= from) return;
    L.q_next = to;
    if (L.qcov.empty()) return;
    const int H = g_.num_heads, Dh = g_.head_dim, group = H / g_.num_kv_heads;
    for (int p = from; p < to; ++p)
      for (int h = 0; h < H; ++h) {
        float x[256];
        std::copy_n(q + (size_t(p - p0) * H + h) * Dh, Dh, x);
        if (rope_.on()) rope_.apply(x, p, Dh, -1.f);
        double* c = L.qcov.data() + size_t(h / group) * Dh * Dh;
        for (int i = 0; i < Dh; ++i)
          for (int j = 0; j < Dh; ++j) c[size_t(i) * Dh + j] += double(x[i]) * x[j];
      }
  }

  // Fits the next codec version of `layer` from its rows before fit_point(v) (version 0: the
  // exact rows, all still held; refits: the sample) and the queries collected so far.
  void fit(int layer) {
    Layer& L = layers_[size_t(layer)];
    const int Dh = g_.head_dim, Hkv = g_.num_kv_heads, v = int(L.codec.size());
    const int stride = fit_stride(v), end = fit_point(v);
    CHECK(L.q_next == end);
    std::vector<int> pos;
    for (int p = 0; p < end; p += stride) pos.push_back(p);
    const int N = int(pos.size());
    std::vector<const uint16_t*> rows[2];  // [N] rows [Hkv, Dh] of K and V
    const size_t row = size_t(Hkv) * Dh;
    for (int kv = 0; kv < 2; ++kv)
      for (int p : pos) rows[kv].push_back(v == 0 ? exact_row(L, kv, p) : sample_row(L, kv, p));
    std::vector<VqCodec>& codec = L.codec.emplace_back(size_t(Hkv) * 2);
    parallel_for(size_t(Hkv) * 2, [&](size_t b, size_t e) {
      std::vector<float> x(size_t(N) * Dh);
      for (size_t i = b; i < e; ++i) {
        const int h = int(i / 2), kv = int(i % 2);
        for (int n = 0; n < N; ++n) {
          const uint16_t* r = rows[kv][size_t(n)] + size_t(h) * Dh;
          for (int d = 0; d < Dh; ++d) x[size_t(n) * Dh + d] = bf16_to_f32(r[d]);
          if (kv == 0 && rope_.on()) rope_.apply(x.data() + size_t(n) * Dh, pos[size_t(n)], Dh, -1.f);
        }
        std::vector<double> qc;
        if (kv == 0 && !L.qcov.empty()) qc.assign(L.qcov.begin() + long(h) * Dh * Dh, L.qcov.begin() + long(h + 1) * Dh * Dh);
        // Version 0 keeps the seed of the single-fit cache (same codecs as before refits existed).
        const uint64_t seed = spec_.seed * 0x9E3779B97F4A7C15ull + uint64_t(layer) * 131 + uint64_t(h) * 7 + uint64_t(kv) +
                              uint64_t(v) * 0xD1B54A32D192ED03ull;
        codec[i].fit(kv == 0 ? spec_.k : spec_.v, x.data(), N, Dh, qc, seed, spec_.kmeans_iters,
                     v > 0 && !spec_.refit_basis ? &L.codec[size_t(v - 1)][i] : nullptr);
      }
    });
    L.calibrated = true;
    if (spec_.recode) recode(L, v);
    if (v + 1 == n_fits_) {  // no fit left: free what only the fits needed
      std::vector<double>().swap(L.qcov);
      for (auto& smp : L.sample) std::vector<uint16_t>().swap(smp);
      std::vector<int>().swap(L.sample_pos);
      return;
    }
    // Keep only the sampled rows the next fits read.
    size_t keep = 0;
    for (size_t n = 0; n < L.sample_pos.size(); ++n) {
      const int p = L.sample_pos[n];
      if (read_after(p, v)) {
        for (auto& smp : L.sample) std::copy_n(smp.begin() + long(n * row), row, smp.begin() + long(keep * row));
        L.sample_pos[keep++] = p;
      }
    }
    L.sample_pos.resize(keep);
    for (auto& smp : L.sample) smp.resize(keep * row);
  }

  // Re-codes pages [0, coded) with version v from their BF16 rows (the page's own while it is
  // in the window, else the refit sample's, which holds every row before the last fit), then
  // drops the older versions: every query from now on reads every page through version v.
  void recode(Layer& L, int v) {
    const int P = spec_.page;
    const size_t row = size_t(g_.num_kv_heads) * g_.head_dim;
    parallel_for(size_t(L.coded) * 2, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) {
        const int pg = int(i / 2), kv = int(i % 2);
        PageStore& page = L.s[kv].pages[size_t(pg)];
        PageStore fresh;
        if (page.exact.empty()) {  // the page's P rows, consecutive in the sample (every row is sampled)
          const uint16_t* rows = sample_row(L, kv, pg * P);
          CHECK(sample_row(L, kv, pg * P + P - 1) == rows + size_t(P - 1) * row);
          fresh.exact.assign(rows, rows + size_t(P) * row);
        } else {
          fresh.exact = page.exact;
        }
        fresh.version = v;
        encode_page(fresh, codecs(L, kv, v), page_geo(pg), rope_);
        fresh.exact = std::move(page.exact);  // the page's own rows, or none
        if (pg < L.full_from)
          truncate_page_stages(fresh, codecs(L, kv, v), page_geo(pg), stages_for(true, L.codec[size_t(v)][size_t(kv)]));
        page = std::move(fresh);
      }
    });
    for (int u = 0; u < v; ++u) std::vector<VqCodec>().swap(L.codec[size_t(u)]);
    for (VqCodec& c : L.codec[size_t(v)]) c.shared_basis = false;  // now its basis's only holder
  }
  // Versions still held (with recode only the newest).
  int live_versions(const Layer& L) const {
    return int(std::count_if(L.codec.begin(), L.codec.end(), [](const auto& c) { return !c.empty(); }));
  }

  // The codec version of page pg: the newest fitted by the step that first reads the page's
  // codes (the first query whose window it left, or the first fit if that came later); with
  // recode always the newest.
  int page_version(const Layer& L, int pg) const {
    if (spec_.recode) return int(L.codec.size()) - 1;
    const int p = std::max((pg + 1) * spec_.page + spec_.window - 1, calib_pos_);
    int v = 0;
    while (v + 1 < n_fits_ && fit_point(v + 1) - 1 <= p) ++v;
    CHECK(v < int(L.codec.size()));
    return v;
  }

  // Codes whole pages until at least `end` tokens are coded (their BF16 rows stay until finish_chunk).
  void encode_up_to(Layer& L, int end) {
    const int to = (end + spec_.page - 1) / spec_.page;
    if (to <= L.coded) return;
    CHECK(to * spec_.page <= L.len);
    const int from = L.coded;
    parallel_for(size_t(to - from) * 2, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) {
        const int pg = from + int(i / 2), kv = int(i % 2);
        PageStore& page = L.s[kv].pages[size_t(pg)];
        page.version = page_version(L, pg);
        encode_page(page, codecs(L, kv, page.version), page_geo(pg), rope_);
      }
    });
    L.coded = to;
  }

  // After a chunk's attention: pages now past the window drop their BF16 rows (the sink's rows
  // move to Stream::sink), pages now in the archive keep only the archive's stages.
  void finish_chunk(Layer& L) {
    const int p = L.len - 1, P = spec_.page;
    if (!L.calibrated || p < calib_pos_) return;
    const int ce = coded_end(p), ae = std::min(archive_end(p), ce);
    const size_t row = size_t(g_.num_kv_heads) * g_.head_dim;
    for (; L.exact_from < ce / P; ++L.exact_from)
      for (Stream& s : L.s) {
        auto& e = s.pages[size_t(L.exact_from)].exact;
        const int first = L.exact_from * P, n_sink = std::clamp(spec_.sink - first, 0, P);
        if (s.sink.empty()) s.sink.reserve(size_t(spec_.sink) * row);
        s.sink.insert(s.sink.end(), e.begin(), e.begin() + long(size_t(n_sink) * row));
        std::vector<uint16_t>().swap(e);
      }
    for (; L.full_from < ae / P; ++L.full_from)
      for (int kv = 0; kv < 2; ++kv)
      {
        PageStore& page = L.s[kv].pages[size_t(L.full_from)];
        truncate_page_stages(page, codecs(L, kv, page.version), page_geo(L.full_from),
                             stages_for(true, L.codec[size_t(page.version)][size_t(kv)]));
      }
  }

  // Key ranges for a query at p: [0, sink) exact, [sink, ae) archive, [.., ce) middle, rest exact.
  void ranges(const Layer& L, int p, int& sink, int& ae, int& ce) const {
    const bool cal = L.calibrated && p >= calib_pos_;
    sink = std::min(spec_.sink, p + 1);
    ce = cal ? std::max(coded_end(p), sink) : sink;
    ae = cal ? std::clamp(archive_end(p), sink, ce) : sink;
  }
  bool archive_differs(const Layer& L, int kv) const {
    const VqCodec& c = L.codec.back()[size_t(kv)];  // every version has the spec's stages
    return stages_for(true, c) < c.n_stages();
  }

  // Decodes, for KV head kvh, the coded pages that queries p0..p1 read: `mid` all stages,
  // `arch` the archive's prefix (only where it differs from the middle).
  void decode_for_chunk(const Layer& L, int kvh, int p0, int p1, const KeyRope& rope, Decoded& mid, Decoded& arch) const {
    const int P = spec_.page, Dh = g_.head_dim;
    int s0, ae0, ce0, s1, ae1, ce1;
    ranges(L, p0, s0, ae0, ce0);
    ranges(L, p1, s1, ae1, ce1);
    mid.lo = mid.hi = arch.lo = arch.hi = 0;  // none, unless set below (the rows are reused scratch)
    if (ce1 <= s1) return;
    const bool differs = archive_differs(L, 0) || archive_differs(L, 1);
    mid.lo = differs ? ae0 / P : 0;
    mid.hi = ce1 / P;
    arch.lo = 0;
    arch.hi = differs ? ae1 / P : 0;
    for (Decoded* d : {&mid, &arch})
      for (auto& r : d->rows) r.resize(std::max(r.size(), size_t(d->hi - d->lo) * P * Dh));
    const int n_mid = mid.hi - mid.lo, n_all = n_mid + arch.hi - arch.lo;
    parallel_for(size_t(n_all) * 2, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) {
        const int j = int(i / 2), kv = int(i % 2);
        Decoded& d = j < n_mid ? mid : arch;
        const int pg = d.lo + (j < n_mid ? j : j - n_mid);
        const PageStore& page = L.s[kv].pages[size_t(pg)];
        const VqCodec& c = L.codec[size_t(page.version)][size_t(kvh) * 2 + size_t(kv)];
        decode_page(page, codecs(L, kv, page.version), page_geo(pg), kvh, stages_for(&d == &arch, c), rope,
                    d.rows[kv].data() + size_t(pg - d.lo) * P * Dh, kv == 1 && values_in_basis());
      }
    });
  }

  void attend_decoded(const Layer& L, const Decoded& mid, const Decoded& arch, const float* q, int p, int kvh, float* o,
                      std::vector<float>& sc) const {
    const int Dh = g_.head_dim, n = p + 1, P = spec_.page;
    const size_t off = size_t(kvh) * Dh;
    int sink, ae, ce;
    ranges(L, p, sink, ae, ce);
    // fn(row) on the row of key j as the query at p sees it: FP32 decoded or BF16 exact.
    auto visit = [&](int kv, int j, auto fn) {
      if (j < sink || j >= ce) return fn(exact_row(L, kv, j) + off);
      const Decoded& d = j < ae && arch.hi > arch.lo ? arch : mid;
      return fn(static_cast<const float*>(d.rows[kv].data() + (size_t(j) - size_t(d.lo) * P) * Dh));
    };
    const float scale = 1.0f / std::sqrt(float(Dh));
    sc.resize(size_t(n));
    float mx = -INFINITY;
    for (int j = 0; j < n; ++j) {
      sc[size_t(j)] = visit(0, j, [&](const auto* k) { return dot(q, k, Dh); }) * scale;
      mx = std::max(mx, sc[size_t(j)]);
    }
    float den = 0;
    for (int j = 0; j < n; ++j) den += (sc[size_t(j)] = std::exp(sc[size_t(j)] - mx));
    std::fill(o, o + Dh, 0.f);
    if (!values_in_basis() || ce <= sink) {
      for (int j = 0; j < n; ++j) visit(1, j, [&](const auto* v) { axpy(o, sc[size_t(j)] / den, v, Dh); });
      return;
    }
    // Exact rows straight into o; coded rows summed in their version's basis, then one
    // unrotation per version.
    const int nv = int(L.codec.size());
    CHECK(nv <= kMaxVersions);
    float y[kMaxVersions][256], x[256], w_coded[kMaxVersions] = {};
    for (int v = 0; v < nv; ++v) std::fill_n(y[v], Dh, 0.f);
    for (int j = 0; j < n; ++j) {
      const float w = sc[size_t(j)] / den;
      const bool coded = j >= sink && j < ce;
      const int v = coded ? L.s[1].pages[size_t(j / P)].version : 0;
      if (coded) w_coded[v] += w;
      visit(1, j, [&](const auto* row) { axpy(coded ? y[v] : o, w, row, Dh); });
    }
    for (int v = 0; v < nv; ++v) {
      if ((w_coded[v] == 0.f && v > 0) || L.codec[size_t(v)].empty()) continue;
      L.codec[size_t(v)][size_t(kvh) * 2 + 1].from_basis(y[v], w_coded[v], x);
      for (int i = 0; i < Dh; ++i) o[i] += x[i];
    }
  }

  bool values_in_basis() const { return spec_.v.kind == "vq"; }

  // Attention of T queries at positions p0 .. p0 + T - 1, all seeing the same codec versions.
  void attend_run(const Layer& L, const float* q, int p0, int T, float* out) const {
    // Lookup tables hold one codec's codebooks; pages of several versions go the decoded way.
    const bool lut = T <= spec_.lut_max_tokens && spec_.k.kind == "vq" && spec_.v.kind == "vq" && !rope_.on() &&
                     live_versions(L) == 1;
    const int H = g_.num_heads, Dh = g_.head_dim, group = H / g_.num_kv_heads;
    if (lut) {
      parallel_for(size_t(T) * H, [&](size_t b, size_t e) {
        for (size_t i = b; i < e; ++i) attend_lut(L, q + i * Dh, p0 + int(i / H), int(i % H) / group, out + i * Dh);
      });
      return;
    }
    // Pre-RoPE keys: the angles of the coded positions these queries read (below ce). A position's
    // angles never change, so this thread's table keeps them across KV heads, layers, steps and
    // sequences of the same RoPE, and only positions not seen yet are computed.
    KeyRope rope = rope_;
    thread_local std::vector<float> angles, angles_freq;
    if (rope_.on()) {
      int sink, ae, ce;
      ranges(L, p0 + T - 1, sink, ae, ce);
      if (angles_freq != rope_.inv_freq) angles_freq = rope_.inv_freq, angles.clear();
      const size_t have = angles.size() / size_t(Dh);
      if (size_t(ce) > have) {
        angles.resize(size_t(ce) * Dh);
        float* table = angles.data();  // this thread's buffer (a worker naming `angles` gets its own)
        parallel_for(size_t(ce) - have, [&](size_t b, size_t e) {
          rope_.angles_table(int(have + b), int(e - b), Dh, table + (have + b) * Dh);
        }, 64);
      }
      rope.table = angles.data(), rope.table_first = 0, rope.table_n = ce;
    }
    // Decoded pages in this thread's scratch, reused: a fresh buffer per layer and head costs
    // its allocation and page faults at every step. (Named through references: a worker naming
    // the thread_local itself would get its own.)
    thread_local Decoded scratch[2];
    Decoded &mid = scratch[0], &arch = scratch[1];
    for (int kvh = 0; kvh < g_.num_kv_heads; ++kvh) {
      decode_for_chunk(L, kvh, p0, p0 + T - 1, rope, mid, arch);
      parallel_for(size_t(T) * group, [&](size_t b, size_t e) {
        thread_local std::vector<float> scores;
        for (size_t i = b; i < e; ++i) {
          const size_t qi = (i / group) * H + size_t(kvh) * group + i % group;  // (token, head) of query i
          attend_decoded(L, mid, arch, q + qi * Dh, p0 + int(i / group), kvh, out + qi * Dh, scores);
        }
      });
    }
  }

  void attend_lut(const Layer& L, const float* q, int p, int kvh, float* o) const {
    const int Dh = g_.head_dim, n = p + 1, P = spec_.page;
    const size_t off = size_t(kvh) * Dh;
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
    exact_keys([&](int j) { se.push_back(dot(q, exact_row(L, 0, j) + off, Dh) * scale); me = std::max(me, se.back()); });
    size_t idx = 0;
    exact_keys([&](int j) {
      const float w = std::exp(se[idx++] - me);
      le += w;
      axpy(oe.data(), w, exact_row(L, 1, j) + off, Dh);
    });
    if (ce <= sink) {
      for (int d = 0; d < Dh; ++d) o[d] = oe[size_t(d)] / le;
      return;
    }

    // Coded part: per-query lookup tables over the key codebooks.
    const int ver = int(L.codec.size()) - 1;  // the one version held (see attend_run)
    const VqCodec& kc = L.codec[size_t(ver)][size_t(kvh) * 2];
    const VqCodec& vc = L.codec[size_t(ver)][size_t(kvh) * 2 + 1];
    const StreamCodecs kcs = codecs(L, 0, ver), vcs = codecs(L, 1, ver);
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
    const int nstk_mid = kc.n_stages(), nstk_arch = stages_for(true, kc);
    const int nstv_mid = vc.n_stages(), nstv_arch = stages_for(true, vc);

    uint16_t codes[1024];
    CHECK(kc.n_codes() <= 1024 && vc.n_codes() <= 1024);
    std::vector<float> sc(size_t(ce - sink));
    float mc = -INFINITY;
    for (int j = sink; j < ce; ++j) {
      const PageStore& pg = L.s[0].pages[size_t(j / P)];
      const PageGeometry geo = page_geo(j / P);
      page_codes(pg, kcs, geo, kvh, j % P, codes);
      const uint8_t* anc = page_anchors(pg, kcs, geo, kvh, j % P);
      const int ncodes = kc.n_codes(j < ae ? nstk_arch : nstk_mid);
      float s = 0;
      for (int c = 0; c < ncodes; ++c) s += lut[size_t(lut_off[size_t(c)] + codes[c])];
      s *= page_norm(pg, kcs, geo, kvh, j % P);
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
      const PageStore& pg = L.s[1].pages[size_t(j / P)];
      const PageGeometry geo = page_geo(j / P);
      page_codes(pg, vcs, geo, kvh, j % P, codes);
      const uint8_t* anc = page_anchors(pg, vcs, geo, kvh, j % P);
      const float wn = w * page_norm(pg, vcs, geo, kvh, j % P);
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
  int n_fits_ = 1;             // codec versions a sequence will have (1 + refits online)
  bool from_profile_ = false;
  KeyRope rope_;  // pre-RoPE key coding when on
};

}  // namespace

std::unique_ptr<KvCache> make_kv_cache(const KvGeometry& g, const KvSpec& spec, const KvProfile* profile) {
  if (spec.exact) return make_exact_kv_cache(g, spec.exact_dtype);
  return std::make_unique<TieredKvCache>(g, spec, profile);
}

std::vector<VqCodec> tiered_cache_codecs(const KvCache& c, int version) {
  const auto* t = dynamic_cast<const TieredKvCache*>(&c);
  std::vector<VqCodec> out;
  if (!t) return out;
  for (const Layer& L : t->layers()) {
    if (int(L.codec.size()) <= version || L.codec[size_t(version)].empty()) return {};
    out.insert(out.end(), L.codec[size_t(version)].begin(), L.codec[size_t(version)].end());
  }
  return out;
}

int tiered_cache_versions(const KvCache& c) {
  const auto* t = dynamic_cast<const TieredKvCache*>(&c);
  return t && !t->layers().empty() ? int(t->layers()[0].codec.size()) : 0;
}

std::vector<float> tiered_cache_decoded_page(const KvCache& c, int layer, int kv, int pg, int h, int& version) {
  const auto* t = dynamic_cast<const TieredKvCache*>(&c);
  CHECK(t);
  return t->decoded_page(layer, kv, pg, h, version);
}

}  // namespace tiermoe
