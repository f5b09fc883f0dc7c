// FP8 KV pages (kv_fp8.cuh) against their twins fp8_quantize_rows / fp8_dequantize_rows: the cache
// writes, and every attention kernel that reads them.
#include <algorithm>
#include <vector>

#include "cpu/attention.h"
#include "cpu/ops.h"
#include "kv/fp8_rows.h"

#include "check_harness.h"

namespace tiermoe::cuda_check {

namespace {

// An FP8 pool on the host (kernels.h KvFp8) in the shuffled-page layout of PagedKv: codes and
// exponents; rows no sequence holds stay poisoned (code 0xff is NaN, exponent 127), so a kernel
// that reads one gives NaN and one that writes one differs from `want`.
struct PagedFp8 {
  int Hkv, Dh;
  PagedKv pages;  // its free list and table(); its k, v unused
  std::vector<uint8_t> k, v;
  std::vector<int8_t> ke, ve;
  PagedFp8(int Hkv_, int Dh_, int n_pages)
      : Hkv(Hkv_), Dh(Dh_), pages(Hkv_ * Dh_, 0), k(size_t(n_pages) * cu::kKvPageRows * Hkv_ * Dh_, 0xff), v(k),
        ke(size_t(n_pages) * cu::kKvPageRows * Hkv_, int8_t(127)), ve(ke) {
    for (int p = 0; p < n_pages; ++p) pages.free_pages.push_back(p);
    std::shuffle(pages.free_pages.begin(), pages.free_pages.end(), rng);
  }
  std::vector<int32_t> table(int rows) { return pages.table(rows); }
  // Rows [first, first + n) <- the quantized rows of xk, xv [n, Hkv, Dh].
  void put(const std::vector<int32_t>& t, int first, int n, const float* xk, const float* xv) {
    const size_t row = size_t(Hkv) * Dh;
    std::vector<uint8_t> ck(n * row), cv(n * row);
    std::vector<int8_t> ek(size_t(n) * Hkv), ev(ek.size());
    fp8_quantize_rows(xk, size_t(n) * Hkv, Dh, ck.data(), ek.data());
    fp8_quantize_rows(xv, size_t(n) * Hkv, Dh, cv.data(), ev.data());
    for (int r = 0; r < n; ++r) {
      const size_t at = size_t(t[(first + r) / cu::kKvPageRows]) * cu::kKvPageRows + (first + r) % cu::kKvPageRows;
      std::copy_n(ck.begin() + r * row, row, k.begin() + at * row);
      std::copy_n(cv.begin() + r * row, row, v.begin() + at * row);
      std::copy_n(ek.begin() + size_t(r) * Hkv, Hkv, ke.begin() + at * Hkv);
      std::copy_n(ev.begin() + size_t(r) * Hkv, Hkv, ve.begin() + at * Hkv);
    }
  }
};
// The pool on the device.
struct DevFp8 {
  Dev<uint8_t> k, v;
  Dev<int8_t> ke, ve;
  explicit DevFp8(const PagedFp8& h) : k(h.k), v(h.v), ke(h.ke), ve(h.ve) {}
  cu::KvPages pages(const int32_t* table, const int32_t* const* tables = nullptr) const {
    cu::KvPages p;
    p.table = table, p.tables = tables, p.fp8 = {k.p, v.p, ke.p, ve.p};
    return p;
  }
  bool equals(const PagedFp8& h) const { return k.get() == h.k && v.get() == h.v && ke.get() == h.ke && ve.get() == h.ve; }
};

// K/V rows as a model makes them, and worse: magnitudes over 2^-spread .. 2^spread by row, an
// outlier channel (4 * spread times the others), and whole zero rows.
std::vector<float> kv_rows(int n, int Hkv, int Dh, int spread = 8) {
  auto x = randn(size_t(n) * Hkv * Dh);
  for (size_t r = 0; r < size_t(n) * Hkv; ++r)
    for (int i = 0; i < Dh; ++i) {
      float& e = x[r * Dh + i];
      e = r % 11 == 5 ? 0.f : e * std::ldexp(1.f, int(r % (2 * spread + 1)) - spread) * (i == 3 ? 4.f * spread : 1.f);
    }
  return x;
}

// The BF16 rows an FP8 pool holds for x [n, Hkv, Dh] (what attention over it must match).
std::vector<uint16_t> fp8_as_bf16(const std::vector<float>& x, int Dh) {
  const size_t rows = x.size() / Dh;
  std::vector<uint8_t> c(x.size());
  std::vector<int8_t> e(rows);
  std::vector<uint16_t> b(x.size());
  fp8_quantize_rows(x.data(), rows, Dh, c.data(), e.data());
  fp8_dequantize_rows(c.data(), e.data(), rows, Dh, b.data());
  return b;
}

}  // namespace

cudaError_t fp8_dequantize_on_device(uint16_t* out, const uint8_t* codes, const int8_t* exps, int rows, int Dh);  // fp8_dequantize.cu

// kv_append and qk_norm_rope's append into FP8 pages: every code and exponent as the twin's, bit for
// bit, nothing else written; kv_copy_pages of the exponents' pages (Hkv bytes a row).
void check_kv_fp8_writes() {
  {  // the attention kernels' dequantize: every code (subnormals, both zeros, 448) at the format's least
     // and largest exponents and between, bit for bit as fp8_dequantize_rows
    const std::vector<int8_t> exps{-120, -119, -112, -9, -7, -1, 0, 1, 7, 100, 118};
    const int rows = int(exps.size()), Dh = 256;
    std::vector<uint8_t> codes(size_t(rows) * Dh);
    for (size_t i = 0; i < codes.size(); ++i) codes[i] = uint8_t(i % Dh == 0x7f || i % Dh == 0xff ? 0x7e : i % Dh);  // 0x7f, 0xff: NaN, never written
    std::vector<uint16_t> want(codes.size());
    fp8_dequantize_rows(codes.data(), exps.data(), size_t(rows), Dh, want.data());
    Dev<uint8_t> dc(codes);
    Dev<int8_t> de(exps);
    Dev<uint16_t> out(codes.size());
    CK(fp8_dequantize_on_device(out.p, dc.p, de.p, rows, Dh));
    const auto got = out.get();
    const auto bad = std::mismatch(got.begin(), got.end(), want.begin()).first - got.begin();
    report(fmt("fp8x8_to_bf16x8: 254 codes x %d exponents, bits exact", rows), got == want ? 0.0 : 1.0, 0.0,
           got == want ? "" : fmt("first differs at code 0x%02x exponent %d", codes[bad], exps[bad / Dh]));
  }
  struct C { int T, past, Hkv, Dh; };
  for (C c : {C{1, 0, 1, 16}, C{7, 33, 2, 64}, C{40, 300, 8, 128}, C{3, 17, 3, 96}, C{1, 4095, 16, 128}, C{5, 0, 4, 256}}) {
    const int n = c.past + c.T;
    PagedFp8 pool(c.Hkv, c.Dh, PagedKv::pages_for(n) + 2);
    const auto table = pool.table(n);
    auto k = kv_rows(c.T, c.Hkv, c.Dh), v = kv_rows(c.T, c.Hkv, c.Dh);
    std::vector<int32_t> pos(c.T);
    for (int t = 0; t < c.T; ++t) pos[t] = c.past + t;
    DevFp8 dpool(pool);
    Dev<float> dk(k), dv(v);
    Dev<int32_t> dp(pos), dt(table);
    CK(cu::kv_append(dpool.pages(dt.p), dk.p, dv.p, dp.p, c.T, c.Hkv, c.Dh, 0));
    pool.put(table, c.past, c.T, k.data(), v.data());
    report(fmt("kv_append FP8 T=%d past=%d Hkv=%d Dh=%d: codes and exponents exact", c.T, c.past, c.Hkv, c.Dh),
           dpool.equals(pool) ? 0.0 : 1.0, 0.0);
  }
  // qk_norm_rope's append: the rotated keys it leaves in k (and v as given) quantized by the twin.
  struct R { int T, H, Hkv, Dh; bool norm, full; };
  for (R c : {R{1, 16, 16, 128, true, true}, R{3, 8, 2, 64, true, false}, R{2, 4, 4, 128, false, false},
              R{5, 32, 4, 128, true, false}, R{1, 6, 3, 256, true, true}}) {
    const int past = 70, n = past + c.T;
    PagedFp8 pool(c.Hkv, c.Dh, PagedKv::pages_for(n) + 2);
    const auto table = pool.table(n);
    auto q = randn(size_t(c.T) * c.H * c.Dh), k = kv_rows(c.T, c.Hkv, c.Dh), v = kv_rows(c.T, c.Hkv, c.Dh);
    const auto qn = randn(size_t(c.full ? c.H : 1) * c.Dh), kn = randn(size_t(c.full ? c.Hkv : 1) * c.Dh);
    std::vector<int32_t> pos(c.T);
    for (int t = 0; t < c.T; ++t) pos[t] = past + t;
    DevFp8 dpool(pool);
    Dev<float> dq(q), dk(k), dv(v), dqn(qn), dkn(kn), dq2(q), dk2(k);
    Dev<int32_t> dp(pos), dt(table);
    const float *qnp = c.norm ? dqn.p : nullptr, *knp = c.norm ? dkn.p : nullptr;
    CK(cu::qk_norm_rope(dq.p, dk.p, qnp, knp, c.full, dp.p, c.T, c.H, c.Hkv, c.Dh, 1e-6f, 1e6f, 0, dpool.pages(dt.p), dv.p));
    CK(cu::qk_norm_rope(dq2.p, dk2.p, qnp, knp, c.full, dp.p, c.T, c.H, c.Hkv, c.Dh, 1e-6f, 1e6f, 0));
    const auto rotated = dk2.get();
    pool.put(table, past, c.T, rotated.data(), v.data());
    const bool same_qk = dq.get() == dq2.get() && dk.get() == rotated;
    report(fmt("qk_norm_rope append FP8 T=%d G=%d Hkv=%d Dh=%d norm=%s: codes and exponents exact", c.T, c.H / c.Hkv,
               c.Hkv, c.Dh, c.norm ? (c.full ? "full" : "per head") : "none"),
           dpool.equals(pool) && same_qk ? 0.0 : 1.0, 0.0, same_qk ? "" : "q/k unlike the launch without append");
  }
  {  // the exponents' pages: 64 * Hkv bytes each (Hkv = 3: not a multiple of 16 rows' worth per row)
    const int layers = 2, n_pages = 7, Hkv = 3;
    const size_t page = size_t(cu::kKvPageRows) * Hkv, layer = page * n_pages;
    std::vector<uint8_t> a(layer * layers), b(a.size());
    for (auto& x : a) x = uint8_t(rng());
    for (auto& x : b) x = uint8_t(rng());
    const std::vector<int32_t> src{4, 0, 6}, dst{1, 5, 2};
    Dev<uint8_t> da(a), db(b);
    Dev<int32_t> ds(src), dd(dst);
    CK(cu::kv_copy_pages(da.p, db.p, layer, page, layers, dd.p, ds.p, 3, 0));
    for (int l = 0; l < layers; ++l)
      for (int i = 0; i < 3; ++i) {
        std::copy_n(a.begin() + ptrdiff_t(l * layer + src[i] * page), page, a.begin() + ptrdiff_t(l * layer + dst[i] * page));
        std::copy_n(b.begin() + ptrdiff_t(l * layer + src[i] * page), page, b.begin() + ptrdiff_t(l * layer + dst[i] * page));
      }
    const bool refused = cu::kv_copy_pages(da.p, db.p, layer, 24, layers, dd.p, ds.p, 3, 0) == cudaErrorInvalidValue;
    report("kv_copy_pages of FP8 exponent pages (192 bytes), exact; pages not of 16-byte multiples refused",
           da.get() == a && db.get() == b && refused ? 0.0 : 1.0, 0.0);
  }
}

// Attention over FP8 pages, every kernel that reads them, against attention_causal over the BF16 rows
// the codes decode to (exactly), with the pool left as it was: the split kernel, the tensor-core
// prompt kernel (and its decode forms), the one-launch decode kernel in both its forms (the new rows
// already in the pool: k_new null), the decode batch through page tables on both kernels. Rows
// over 2^-2 .. 2^2 and queries of 1/8 keep the scores near the BF16 cases' (the tensor-core
// kernel's error grows with them: its Q in BF16 hi + lo is 2^-17 relative).
void check_attention_fp8() {
  struct C { int T, past, H, Hkv, Dh; };
  // Tolerance 2e-5, not the BF16 cases' 1e-5: measured up to 1.2e-5 (H100, 2026-12-05: the keys form
  // at G = 8, Dh 64 over 2000), FP32 sums of as many terms. The decode case over 3000 rows of 2^-8 ..
  // 2^8 gets 5e-5: there a row's score error moves its softmax weight by as much, relative, and the
  // CPU's FP32 result alone is up to 1.7e-5 from a double one (median 3.5e-6, 40 draws of that
  // case, 2026-12-06); the kernel's, summed in another order, measured 2.5e-5 from the CPU's on one
  // draw (H100, the default and the look-ahead builds alike), 2.6e-6 and 6.5e-6 on two others.
  auto one = [&](C c, auto run, int spread = 2, double tol = 2e-5) {  // queries scaled down as the rows grow: scores alike
    const int n = c.past + c.T;
    auto q = randn(size_t(c.T) * c.H * c.Dh, std::ldexp(0.125f, 2 - spread)), k = kv_rows(n, c.Hkv, c.Dh, spread),
         v = kv_rows(n, c.Hkv, c.Dh, spread);
    const auto kb = fp8_as_bf16(k, c.Dh), vb = fp8_as_bf16(v, c.Dh);
    std::vector<float> ref(q.size());
    attention_causal(ref.data(), q.data(), kb.data(), vb.data(), DType::BF16, c.T, c.past, c.H, c.Hkv, c.Dh);
    PagedFp8 pool(c.Hkv, c.Dh, PagedKv::pages_for(n) + 2);
    const auto table = pool.table(n);
    pool.put(table, 0, n, k.data(), v.data());
    std::vector<int32_t> pos(c.T);
    for (int t = 0; t < c.T; ++t) pos[t] = c.past + t;
    DevFp8 dpool(pool);
    Dev<float> dq(q), dout(q.size());
    Dev<int32_t> dp(pos), dt(table);
    const std::string name = run(dout, dq.p, dpool.pages(dt.p), dp.p);
    report(name + fmt(" FP8 T=%d past=%d G=%d Hkv=%d Dh=%d", c.T, c.past, c.H / c.Hkv, c.Hkv, c.Dh), rel(dout.get(), ref),
           tol, dpool.equals(pool) ? "" : "POOL CHANGED");
    if (!dpool.equals(pool)) ++g_fail;
  };
  for (C c : {C{1, 0, 4, 2, 16}, C{7, 33, 4, 2, 96}, C{40, 300, 8, 8, 64}, C{1, 4095, 16, 16, 128}, C{2, 5, 2, 1, 256}})
    one(c, [&](auto& out, auto q, auto kv, auto pos) {
      const int split = 64, n_splits = (c.past + c.T + split - 1) / split;
      Dev<float> part(size_t(c.T) * c.H * n_splits * (c.Dh + 2));
      CK(cu::attention(out.p, q, kv, pos, c.T, c.H, c.Hkv, c.Dh, n_splits, split, part.p, 0));
      return std::string("attention (split)");
    });
  for (C c : {C{65, 300, 16, 4, 128}, C{200, 1, 12, 4, 64}, C{512, 700, 16, 16, 128}, C{1, 4095, 32, 4, 128},
              C{2, 300, 16, 2, 64}, C{3, 63, 20, 4, 128}, C{16, 100, 4, 4, 64}, C{1, 2000, 32, 4, 64},
              C{700, 0, 4, 2, 128}, C{1, 700, 4, 2, 128},  // these two: tinymix-code's heads
              C{1, 1000, 3, 3, 128}, C{5, 130, 8, 1, 64}})  // a row's exponent at any byte of its 16-byte block
    for (int splits : {1, 3})
      for (bool split_p : {true, false}) {
        if (!split_p && splits > 1) continue;
        one(c, [&](auto& out, auto q, auto kv, auto pos) {
          Dev<float> part(size_t(c.T) * c.H * splits * (c.Dh + 2));
          CK(cu::attention_prefill(out.p, q, kv, pos, c.T, c.H, c.Hkv, c.Dh, split_p, 0, part.p, splits));
          return fmt("attention_prefill, P %s, %d key splits,", split_p ? "hi+lo" : "bf16", splits);
        }, 2, split_p ? 2e-5 : 5e-3);  // one BF16 rounding of P, as for BF16 pages: measured <= 1.6e-3
      }
  for (int mode : {1, 0, 2}) {  // the per-head kernel where the default takes it, never, always
    cu::set_attention_decode_per_head(mode);
    // The last case with rows over 2^-8 .. 2^8 (exponents over a wider range; queries scaled down).
    for (C c : {C{1, 4095, 16, 16, 128}, C{1, 1000, 32, 4, 128}, C{3, 17, 12, 2, 32}, C{1, 5, 2, 1, 256},
                C{8, 300, 8, 8, 64}, C{1, 63, 8, 2, 128}, C{2, 9000, 8, 1, 64}, C{1, 700, 4, 4, 16}, C{1, 3000, 16, 16, 128}})
      one(c, [&](auto& out, auto q, auto kv, auto pos) {
        const int n_splits = (c.past + c.T + 127) / 128;
        Dev<float> part(size_t(c.T) * c.H * n_splits * (c.Dh + 2));
        Dev<unsigned> cnt(size_t(c.T) * c.H);
        CK(cudaMemset(cnt.p, 0, cnt.n * sizeof(unsigned)));
        CK(cu::attention_decode(out.p, q, kv, nullptr, nullptr, pos, c.T, c.H, c.Hkv, c.Dh, n_splits, part.p, cnt.p, 0));
        return fmt("attention_decode (per-head mode %d, %d splits)", mode, n_splits);
      }, c.past == 3000 ? 8 : 2, c.past == 3000 ? 5e-5 : 2e-5);
  }
  cu::set_attention_decode_per_head(1);
  {  // new rows given beside FP8 pages: refused (they must be quantized into the pool first)
    cu::KvPages kv;
    kv.table = reinterpret_cast<const int32_t*>(16);
    kv.fp8.k = reinterpret_cast<uint8_t*>(16);
    const float* some = reinterpret_cast<const float*>(16);
    report("attention_decode refuses k_new with FP8 pages",
           cu::attention_decode(nullptr, nullptr, kv, some, some, nullptr, 1, 8, 8, 64, 1, nullptr, nullptr, 0) ==
                   cudaErrorInvalidValue ? 0.0 : 1.0, 0.0);
  }
  // A decode batch: B sequences, one new token each (its row in the pool), through page tables.
  struct Bc { std::vector<int> pasts; int H, Hkv, Dh, n_splits; };
  for (const Bc& c : {Bc{{0, 1000, 63}, 32, 4, 128, 16}, Bc{{4095, 17, 300, 2, 900, 64, 1, 2047}, 8, 4, 64, 32},
                      Bc{{5, 9000}, 16, 16, 128, 72}}) {
    const int B = int(c.pasts.size());
    auto q = randn(size_t(B) * c.H * c.Dh, 0.125f);
    std::vector<float> ref(q.size());
    int n_pages = 2;
    for (int p : c.pasts) n_pages += PagedKv::pages_for(p + 1);
    PagedFp8 pool(c.Hkv, c.Dh, n_pages);
    std::vector<std::unique_ptr<Dev<int32_t>>> dtables;
    std::vector<const int32_t*> table_ptrs;
    std::vector<int32_t> pos(B);
    for (int b = 0; b < B; ++b) {
      const int n = c.pasts[b] + 1;
      const auto k = kv_rows(n, c.Hkv, c.Dh, 2), v = kv_rows(n, c.Hkv, c.Dh, 2);
      const auto kb = fp8_as_bf16(k, c.Dh), vb = fp8_as_bf16(v, c.Dh);
      attention_causal(ref.data() + size_t(b) * c.H * c.Dh, q.data() + size_t(b) * c.H * c.Dh, kb.data(), vb.data(),
                       DType::BF16, 1, c.pasts[b], c.H, c.Hkv, c.Dh);
      const auto t = pool.table(n);
      pool.put(t, 0, n, k.data(), v.data());
      dtables.push_back(std::make_unique<Dev<int32_t>>(t));
      table_ptrs.push_back(dtables.back()->p);
      pos[b] = c.pasts[b];
    }
    DevFp8 dpool(pool);
    Dev<const int32_t*> dtp(table_ptrs);
    Dev<float> dq(q), dout(q.size()), part(size_t(B) * c.H * c.n_splits * (c.Dh + 2));
    Dev<int32_t> dp(pos);
    Dev<unsigned> cnt(size_t(B) * c.H);
    CK(cudaMemset(cnt.p, 0, cnt.n * sizeof(unsigned)));
    const cu::KvPages kv = dpool.pages(nullptr, dtp.p);
    CK(cu::attention_decode_batch(dout.p, dq.p, kv, nullptr, nullptr, dp.p, B, c.H, c.Hkv, c.Dh, c.n_splits, part.p,
                                  cnt.p, 0));
    const std::string shape = fmt("B=%d G=%d Hkv=%d Dh=%d splits=%d", B, c.H / c.Hkv, c.Hkv, c.Dh, c.n_splits);
    report("attention_decode_batch FP8 " + shape, rel(dout.get(), ref), 1e-5, dpool.equals(pool) ? "" : "POOL CHANGED");
    if (cu::attention_prefill_supported(c.H, c.Hkv, c.Dh)) {
      dout.poison();
      CK(cu::attention_prefill(dout.p, dq.p, kv, dp.p, B, c.H, c.Hkv, c.Dh, true, 0, part.p, c.n_splits));
      report("attention_prefill decode batch (tables) FP8 " + shape, rel(dout.get(), ref), 1e-5);
    }
    if (!dpool.equals(pool)) ++g_fail;
  }
}

}  // namespace tiermoe::cuda_check
