// Attention and the paged KV cache against their CPU twins: page copies, prompt attention (split
// and tensor-core), its decode forms, the one-launch decode attention for one sequence and a batch,
// and the variants kept for A/B timing; prompt-attention timings.
#include <algorithm>
#include <vector>

#include "cpu/attention.h"
#include "cpu/ops.h"

#include "check_harness.h"

namespace tiermoe::cuda_check {

namespace {

// One prompt-attention case: random q[T, H, Dh], k, v (kb, vb: as BF16); the CPU twin's output ref;
// on the GPU a paged pool (2 spare pages) holding the first `past` rows and the T new rows appended
// by kv_append, as the backend does. Then run(host, out, q, kv, pos) with device pointers.
struct PromptAttnHost {
  const std::vector<float>& q;
  const std::vector<uint16_t>&kb, &vb;
  const std::vector<float>& ref;
};
template <class Run>
void prompt_attention_case(int T, int past, int H, int Hkv, int Dh, Run run) {
  const int n = past + T, row = Hkv * Dh;
  auto q = randn(size_t(T) * H * Dh), k = randn(size_t(n) * row), v = randn(size_t(n) * row);
  auto kb = bf16_of(k), vb = bf16_of(v);
  std::vector<float> ref(q.size());
  attention_causal(ref.data(), q.data(), kb.data(), vb.data(), DType::BF16, T, past, H, Hkv, Dh);
  std::vector<float> knew(k.begin() + size_t(past) * row, k.end()), vnew(v.begin() + size_t(past) * row, v.end());
  PagedKv pool(row, PagedKv::pages_for(n) + 2);
  const auto table = pool.table(n);
  pool.put(table, 0, past, kb.data(), vb.data());
  std::vector<int32_t> pos(T);
  for (int t = 0; t < T; ++t) pos[t] = past + t;
  Dev<float> dq(q), dk(knew), dv(vnew), dout(q.size());
  Dev<uint16_t> dkc(pool.k), dvc(pool.v);
  Dev<int32_t> dp(pos), dt(table);
  const cu::KvPages kv{dkc.p, dvc.p, dt.p};
  CK(cu::kv_append(kv, dk.p, dv.p, dp.p, T, Hkv, Dh, 0));
  pool.put(table, past, T, kb.data() + size_t(past) * row, vb.data() + size_t(past) * row);
  const bool pool_exact = dkc.get() == pool.k && dvc.get() == pool.v;
  report(fmt("kv_append T=%d past=%d row=%d: the pool exact", T, past, row), pool_exact ? 0.0 : 1.0, 0.0);
  run(PromptAttnHost{q, kb, vb, ref}, dout, dq.p, kv, dp.p);
}

}  // namespace

// kv_copy_pages against its twin, the same page copies on the host: a pool of random BF16 values
// over `layers` layers; a source sequence's `pages` pages (scattered) copied to a destination's
// (other free pages); every value of the pool must come out as the twin's, bit for bit (the
// pages not copied to left as they were).
void check_kv_copy_pages() {
  struct C { int layers, pool, pages, row; };
  for (C c : {C{1, 2, 1, 32}, C{3, 10, 4, 4 * 128}, C{2, 9, 3, 8 * 64}, C{4, 33, 16, 2 * 128}, C{1, 64, 32, 4 * 96}}) {
    const size_t layer = size_t(c.pool) * cu::kKvPageRows * c.row;
    std::vector<uint16_t> k = bf16_of(randn(layer * c.layers)), v = bf16_of(randn(layer * c.layers));
    std::vector<int32_t> ids(static_cast<size_t>(c.pool));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    const std::vector<int32_t> src(ids.begin(), ids.begin() + c.pages), dst(ids.begin() + c.pages, ids.begin() + 2 * c.pages);
    Dev<uint16_t> dk(k), dv(v);
    Dev<int32_t> ds(src), dd(dst);
    const size_t page = size_t(cu::kKvPageRows) * c.row;
    CK(cu::kv_copy_pages(dk.p, dv.p, layer * 2, page * 2, c.layers, dd.p, ds.p, c.pages, 0));
    for (int l = 0; l < c.layers; ++l)
      for (int i = 0; i < c.pages; ++i) {
        std::copy_n(k.begin() + ptrdiff_t(l * layer + src[size_t(i)] * page), page, k.begin() + ptrdiff_t(l * layer + dst[size_t(i)] * page));
        std::copy_n(v.begin() + ptrdiff_t(l * layer + src[size_t(i)] * page), page, v.begin() + ptrdiff_t(l * layer + dst[size_t(i)] * page));
      }
    report(fmt("kv_copy_pages layers=%d pool=%d pages=%d row=%d: the pool exact", c.layers, c.pool, c.pages, c.row),
           dk.get() == k && dv.get() == v ? 0.0 : 1.0, 0.0);
  }
}

void check_attention() {
  struct C { int T, past, H, Hkv, Dh, split; };
  for (C c : {C{1, 0, 4, 2, 16, 256}, C{1, 1000, 32, 4, 128, 256}, C{7, 33, 4, 2, 16, 8}, C{40, 300, 8, 8, 64, 64},
              C{1, 4095, 16, 16, 128, 256}, C{3, 17, 6, 3, 96, 5}, C{1, 5, 2, 1, 256, 256}}) {
    const int n_splits = (c.past + c.T + c.split - 1) / c.split;
    prompt_attention_case(c.T, c.past, c.H, c.Hkv, c.Dh, [&](const auto& h, auto& dout, auto q, auto kv, auto pos) {
      Dev<float> part(size_t(c.T) * c.H * n_splits * (c.Dh + 2));
      CK(cu::attention(dout.p, q, kv, pos, c.T, c.H, c.Hkv, c.Dh, n_splits, c.split, part.p, 0));
      report(fmt("kv_append+attention T=%d past=%d H=%d Hkv=%d Dh=%d splits=%d", c.T, c.past, c.H, c.Hkv, c.Dh,
                 n_splits),
             rel(dout.get(), h.ref), 1e-5);
    });
  }
}

namespace {

// Relative L2 errors of `got` and of the FP32 twin `ref` against a double-precision attention, on the
// rows of query tokens 0, T / 2 and T - 1: how much of a kernel's distance to the twin is the twin's.
std::pair<double, double> attention_vs_f64(const PromptAttnHost& h, const std::vector<float>& got, int T, int past,
                                           int H, int Hkv, int Dh) {
  double eg = 0, er = 0, norm = 0;
  for (int t : {0, T / 2, T - 1})
    for (int hd = 0; hd < H; ++hd) {
      const size_t qi = (size_t(t) * H + hd) * Dh;
      const int n = past + t + 1, kvh = hd / (H / Hkv);
      std::vector<double> sc(n), o(Dh, 0.0);
      double mx = -INFINITY, sum = 0;
      for (int j = 0; j < n; ++j) {
        double d = 0;
        for (int i = 0; i < Dh; ++i) d += double(h.q[qi + i]) * bf16_to_f32(h.kb[(size_t(j) * Hkv + kvh) * Dh + i]);
        sc[j] = d / std::sqrt(double(Dh));
        mx = std::max(mx, sc[j]);
      }
      for (int j = 0; j < n; ++j) {
        const double p = std::exp(sc[j] - mx);
        sum += p;
        for (int i = 0; i < Dh; ++i) o[i] += p * bf16_to_f32(h.vb[(size_t(j) * Hkv + kvh) * Dh + i]);
      }
      for (int i = 0; i < Dh; ++i) {
        const double x = o[i] / sum;
        eg += (got[qi + i] - x) * (got[qi + i] - x);
        er += (h.ref[qi + i] - x) * (h.ref[qi + i] - x);
        norm += x * x;
      }
    }
  return {std::sqrt(eg / norm), std::sqrt(er / norm)};
}

}  // namespace

namespace {

// The tensor-core prompt attention against attention_causal, with P as BF16 hi + lo parts (the
// default) and rounded to BF16 once; the hi + lo launch twice (same bits). Query tiles of 64 / G
// tokens: T around and off multiples of the tile, G not dividing 64 (padding rows), the last chunk
// of an 8192-token context.
struct PrefillCase { int T, past, H, Hkv, Dh; };

void attention_prefill_cases(std::initializer_list<PrefillCase> cases) {
  int index = 0;
  for (PrefillCase c : cases) {
    if (skip_case(index)) continue;
    prompt_attention_case(c.T, c.past, c.H, c.Hkv, c.Dh, [&](const auto& h, auto& dout, auto q, auto kv, auto pos) {
      const std::string name =
          fmt("attention_prefill T=%d past=%d G=%d Hkv=%d Dh=%d", c.T, c.past, c.H / c.Hkv, c.Hkv, c.Dh);
      if (!skip_variant(0)) {
        CK(cu::attention_prefill(dout.p, q, kv, pos, c.T, c.H, c.Hkv, c.Dh, true, 0));
        const auto got = dout.get();
        dout.poison();
        CK(cu::attention_prefill(dout.p, q, kv, pos, c.T, c.H, c.Hkv, c.Dh, true, 0));
        const bool same = std::memcmp(got.data(), dout.get().data(), got.size() * 4) == 0;
        const auto [e64, twin64] = attention_vs_f64(h, got, c.T, c.past, c.H, c.Hkv, c.Dh);
        // 1e-5: measured <= 4.2e-6 (at 9000 keys), with the twin itself up to 2.4e-6 off a double reference.
        report(name + " P hi+lo", rel(got, h.ref), 1e-5,
               fmt("rerun %s; vs f64 %.1e (twin %.1e)", same ? "bit-identical" : "DIFFERS", e64, twin64));
        if (!same) ++g_fail;
      }
      if (!skip_variant(1)) {
        dout.poison();
        CK(cu::attention_prefill(dout.p, q, kv, pos, c.T, c.H, c.Hkv, c.Dh, false, 0));
        report(name + " P bf16", rel(dout.get(), h.ref), 5e-3);  // one BF16 rounding of P: measured <= 1.6e-3
      }
      // Key splits (merged by attention_merge_splits): 2, 3, and 40 (more shares than a short
      // context has tiles: empty splits, -inf partials), and 200 (seven rounds of the combine's 32
      // rows in flight, the last one partial) where T * H is small, twice (same bits). Variants 2 .. 5.
      int variant = 2;
      for (int splits : {2, 3, 40, 200}) {
        if (skip_variant(variant++) || (splits == 200 && c.T * c.H > 1024)) continue;
        Dev<float> part(size_t(c.T) * c.H * splits * (c.Dh + 2));
        dout.poison();
        CK(cu::attention_prefill(dout.p, q, kv, pos, c.T, c.H, c.Hkv, c.Dh, true, 0, part.p, splits));
        const auto split_out = dout.get();
        dout.poison();
        CK(cu::attention_prefill(dout.p, q, kv, pos, c.T, c.H, c.Hkv, c.Dh, true, 0, part.p, splits));
        const bool again = std::memcmp(split_out.data(), dout.get().data(), split_out.size() * 4) == 0;
        report(name + fmt(" P hi+lo, %d key splits", splits), rel(split_out, h.ref), 1e-5,
               again ? "rerun bit-identical" : "rerun DIFFERS");
        if (!again) ++g_fail;
      }
    });
  }
}

}  // namespace

void check_attention_prefill() {
  using C = PrefillCase;
  attention_prefill_cases({C{9, 0, 8, 8, 64}, C{16, 1, 8, 4, 128}, C{63, 300, 16, 4, 128}, C{64, 0, 32, 4, 128},
                           C{65, 4095, 8, 1, 64}, C{200, 9000, 4, 2, 128}, C{512, 0, 16, 16, 128},
                           C{512, 7680, 32, 4, 128}, C{200, 1, 12, 4, 64}, C{65, 300, 10, 2, 128},
                           C{37, 4095, 14, 2, 64}, C{100, 1, 6, 1, 128}, C{9, 9000, 32, 8, 128}, C{63, 0, 4, 4, 64},
                           C{16, 4095, 64, 8, 64}, C{512, 300, 16, 4, 64}});
  // Shapes it does not take (the backend falls back to attention()): refused, not miscomputed.
  bool refused = true;
  for (C c : {C{16, 0, 8, 8, 96}, C{16, 0, 8, 8, 256}, C{16, 0, 8, 8, 16}, C{16, 0, 32, 2, 128}})
    refused = refused && !cu::attention_prefill_supported(c.H, c.Hkv, c.Dh) &&
              cu::attention_prefill(nullptr, nullptr, cu::KvPages{}, nullptr, c.T, c.H, c.Hkv, c.Dh, true, 0) ==
                  cudaErrorInvalidValue;
  // Key splits without scratch, or none: refused.
  for (int splits : {2, 0})
    refused = refused && cu::attention_prefill(nullptr, nullptr, cu::KvPages{}, nullptr, 16, 8, 8, 64, true, 0, nullptr,
                                               splits) == cudaErrorInvalidValue;
  report("attention_prefill refuses Dh 96, 256, 16, G=16, and bad key splits", refused ? 0.0 : 1.0, 0.0);
}

// T * G <= 16 (decode steps on the tensor cores): the block's warps split every key tile; T * G <= 8
// in the keys form (keys as the MMA's rows), 9 .. 16 (and decode batches) in the row form. A group of its own, so that
// a sanitizer can take just these. Keys form: G = 8, 4 (T = 2: 8 columns), 7, 6, 2 (T = 3), 1
// (T = 7), positions on and off the tile boundaries.
void check_attention_prefill_decode() {
  using C = PrefillCase;
  attention_prefill_cases({C{1, 4095, 32, 4, 128}, C{2, 300, 16, 2, 64}, C{1, 9000, 8, 8, 128}, C{3, 63, 20, 4, 128},
                           C{1, 0, 6, 1, 64}, C{16, 100, 4, 4, 64}, C{2, 500, 16, 4, 128}, C{1, 63, 8, 1, 128},
                           C{1, 4096, 28, 4, 128}, C{3, 1000, 6, 3, 64}, C{7, 130, 2, 2, 64}, C{1, 64, 32, 8, 128}});
}

// The decode cases again with the keys form off: blocks of up to 8 rows in the row form
// (set_attention_decode_keys_form(false), for A/B timing).
void check_attention_prefill_decode_rows() {
  std::printf("-- attention_prefill decode: the row form for every block --\n");
  cu::set_attention_decode_keys_form(false);
  check_attention_prefill_decode();
  cu::set_attention_decode_keys_form(true);
}

// Prompt attention of a last 512-token chunk (keys 0 .. past + 511), each kernel timed over 20
// launches after 3 warm-ups (events): the split kernel, the tensor-core one with P hi + lo, with P
// in one BF16 part.
void attention_timing(int past, int H, int Hkv, int Dh) {
  const int T = 512, n = past + T, row = Hkv * Dh, n_splits = std::min(32, (n + 255) / 256);
  Dev<float> q(randn(size_t(T) * H * Dh)), out(size_t(T) * H * Dh), part(size_t(T) * H * n_splits * (Dh + 2));
  const int n_pages = PagedKv::pages_for(n);
  Dev<uint16_t> kc(bf16_of(randn(size_t(n_pages) * cu::kKvPageRows * row))), vc(kc.get());
  std::vector<int32_t> pages(n_pages);
  for (int p = 0; p < n_pages; ++p) pages[p] = p;  // in order, like a fresh pool
  Dev<int32_t> table(pages);
  const cu::KvPages kv{kc.p, vc.p, table.p};
  std::vector<int32_t> ph(T);
  for (int t = 0; t < T; ++t) ph[t] = past + t;
  Dev<int32_t> pos(ph);
  auto time_us = [&](auto launch) { return mean_us(3, 20, [&] { CK(launch()); }); };
  const double us_old = time_us([&] {
    return cu::attention(out.p, q.p, kv, pos.p, T, H, Hkv, Dh, n_splits, (n + n_splits - 1) / n_splits, part.p, 0);
  });
  auto flash = [&](bool split_p) {
    return time_us([&] { return cu::attention_prefill(out.p, q.p, kv, pos.p, T, H, Hkv, Dh, split_p, 0); });
  };
  const double us_split = flash(true), us_one = flash(false);
  const double us_keys2 = time_us([&] {  // two key splits, as the backend takes when blocks are few
    return cu::attention_prefill(out.p, q.p, kv, pos.p, T, H, Hkv, Dh, true, 0, part.p, 2);
  });
  const double flop = 4.0 * T * H * Dh * (past + (T + 1) / 2.0);  // QK^T and PV, causal
  std::printf("prompt attention T=%d past=%d H=%d Hkv=%d Dh=%d: split kernel %.1f us, tensor cores P hi+lo %.1f us "
              "(%.0f TFLOP/s useful), P bf16 %.1f us, P hi+lo in 2 key splits %.1f us\n",
              T, past, H, Hkv, Dh, us_old, us_split, flop / us_split * 1e-6, us_one, us_keys2);
}

// The one-launch decode attention: its cache writes and its output against kv_append +
// attention_causal; a second launch on the same inputs must give the same bits (the split counters
// are reset by the launch itself).
void check_attention_decode() {
  struct C { int T, past, H, Hkv, Dh, split; };
  // split: keys per split asked for (the kernel balances n_splits splits over the keys itself).
  for (C c : {C{1, 0, 4, 4, 16, 64}, C{1, 1000, 32, 4, 128, 64}, C{7, 33, 4, 2, 16, 8}, C{8, 300, 8, 8, 64, 64},
              C{1, 4095, 16, 16, 128, 64}, C{3, 17, 12, 2, 32, 5}, C{1, 5, 2, 1, 256, 256}, C{2, 9000, 8, 1, 64, 8},
              C{5, 200, 24, 4, 128, 1}, C{1, 63, 8, 2, 128, 64}, C{4, 4093, 32, 4, 128, 1000}, C{1, 3000, 4, 2, 256, 3000},
              C{1, 700, 16, 16, 128, 512}, C{6, 29, 16, 16, 128, 256},
              // OLMoE's decode at 4096 keys: 40 splits, merged from shared memory in one chunk (merge_splits)
              C{1, 4095, 16, 16, 128, 103},
              // G = 1: OLMoE's 32 splits at 4096 keys; 70 splits (the register kernel's merge in chunks);
              // rounds partly past the split; several new tokens
              C{1, 4095, 16, 16, 128, 128}, C{1, 8999, 4, 4, 128, 128}, C{1, 100, 3, 3, 64, 37}, C{4, 61, 2, 2, 256, 16},
              C{3, 0, 5, 5, 32, 2}}) {
    const int n = c.past + c.T, row = c.Hkv * c.Dh;
    auto q = randn(size_t(c.T) * c.H * c.Dh), k = randn(size_t(n) * row), v = randn(size_t(n) * row);
    auto kb = bf16_of(k), vb = bf16_of(v);
    std::vector<float> ref(q.size());
    attention_causal(ref.data(), q.data(), kb.data(), vb.data(), DType::BF16, c.T, c.past, c.H, c.Hkv, c.Dh);
    std::vector<float> knew(k.begin() + size_t(c.past) * row, k.end()), vnew(v.begin() + size_t(c.past) * row, v.end());
    PagedKv pool(row, PagedKv::pages_for(n) + 3);  // shuffled pages, spare ones poisoned
    const auto table = pool.table(n);
    pool.put(table, 0, c.past, kb.data(), vb.data());
    std::vector<int32_t> pos(c.T);
    for (int t = 0; t < c.T; ++t) pos[t] = c.past + t;
    const int n_splits = (n + c.split - 1) / c.split;
    Dev<float> dq(q), dk(knew), dv(vnew), dout(q.size()), part(size_t(c.T) * c.H * n_splits * (c.Dh + 2));
    Dev<uint16_t> dkc(pool.k), dvc(pool.v);
    Dev<int32_t> dp(pos), dt(table);
    Dev<unsigned> cnt(size_t(c.T) * c.H);
    CK(cudaMemset(cnt.p, 0, cnt.n * sizeof(unsigned)));
    const cu::KvPages kv{dkc.p, dvc.p, dt.p};
    CK(cu::attention_decode(dout.p, dq.p, kv, dk.p, dv.p, dp.p, c.T, c.H, c.Hkv, c.Dh, n_splits, part.p, cnt.p, 0));
    const auto got = dout.get();
    dout.poison();
    CK(cu::attention_decode(dout.p, dq.p, kv, dk.p, dv.p, dp.p, c.T, c.H, c.Hkv, c.Dh, n_splits, part.p, cnt.p, 0));
    const auto got2 = dout.get();
    const bool same = std::memcmp(got.data(), got2.data(), got.size() * 4) == 0;
    // The pool must hold exactly the BF16 rows of all n keys where the table puts them, and nothing else.
    pool.put(table, c.past, c.T, kb.data() + size_t(c.past) * row, vb.data() + size_t(c.past) * row);
    const bool cache_exact = dkc.get() == pool.k && dvc.get() == pool.v;
    const int G = c.H / c.Hkv;
    report(fmt("attention_decode T=%d past=%d G=%d Hkv=%d Dh=%d splits=%d", c.T, c.past, G, c.Hkv, c.Dh, n_splits),
           rel(got, ref), 1e-5, fmt("rerun %s, cache %s", same ? "bit-identical" : "DIFFERS", cache_exact ? "exact" : "WRONG"));
    if (!same || !cache_exact) ++g_fail;
  }
}

// B sequences of different lengths, one new token each, in one launch; per sequence the CPU twin
// and its cache rows exact.
void check_attention_decode_batch() {
  struct C { std::vector<int> pasts; int H, Hkv, Dh, n_splits; };
  std::vector<int> many(64);
  for (int b = 0; b < 64; ++b) many[b] = int(rng() % 1100);  // OLMoE-like B = 64 at ~ctx 1024
  many[5] = 0;
  for (const C& c : {C{{0, 1000, 63}, 32, 4, 128, 16}, C{{4095, 17, 300, 2, 900, 64, 1, 2047}, 8, 4, 64, 32},
                     C{many, 16, 4, 128, 32}, C{{5, 9000}, 8, 1, 256, 72}, C{{33, 7, 100}, 12, 2, 16, 3}}) {
    const int B = int(c.pasts.size()), row = c.Hkv * c.Dh;
    auto q = randn(size_t(B) * c.H * c.Dh), knew = randn(size_t(B) * row), vnew = randn(size_t(B) * row);
    const auto knb = bf16_of(knew), vnb = bf16_of(vnew);
    std::vector<float> ref(q.size());
    int pages = 3;  // spare, poisoned
    for (int p : c.pasts) pages += PagedKv::pages_for(p + 1);
    PagedKv pool(row, pages);  // all B sequences in one pool, their pages interleaved
    std::vector<std::vector<int32_t>> tables(B);
    std::vector<Dev<int32_t>*> dtables;
    std::vector<const int32_t*> table_ptrs;
    std::vector<int32_t> pos(B);
    for (int b = 0; b < B; ++b) {
      const int n = c.pasts[b] + 1;
      auto k = bf16_of(randn(size_t(n) * row)), v = bf16_of(randn(size_t(n) * row));
      std::copy_n(knb.begin() + size_t(b) * row, row, k.begin() + size_t(c.pasts[b]) * row);
      std::copy_n(vnb.begin() + size_t(b) * row, row, v.begin() + size_t(c.pasts[b]) * row);
      attention_causal(ref.data() + size_t(b) * c.H * c.Dh, q.data() + size_t(b) * c.H * c.Dh, k.data(), v.data(),
                       DType::BF16, 1, c.pasts[b], c.H, c.Hkv, c.Dh);
      tables[b] = pool.table(n);
      pool.put(tables[b], 0, c.pasts[b], k.data(), v.data());  // the new row not yet there
      dtables.push_back(new Dev<int32_t>(tables[b]));
      table_ptrs.push_back(dtables.back()->p);
      pos[b] = c.pasts[b];
    }
    Dev<uint16_t> dkc(pool.k), dvc(pool.v);
    for (int b = 0; b < B; ++b)  // the expected pool: every sequence's new row in place
      pool.put(tables[b], c.pasts[b], 1, knb.data() + size_t(b) * row, vnb.data() + size_t(b) * row);
    Dev<const int32_t*> dtp(table_ptrs);
    Dev<float> dq(q), dk(knew), dv(vnew), dout(q.size()), part(size_t(B) * c.H * c.n_splits * (c.Dh + 2));
    Dev<int32_t> dp(pos);
    Dev<unsigned> cnt(size_t(B) * c.H);
    CK(cudaMemset(cnt.p, 0, cnt.n * sizeof(unsigned)));
    CK(cu::attention_decode_batch(dout.p, dq.p, cu::KvPages{dkc.p, dvc.p, nullptr, dtp.p}, dk.p, dv.p, dp.p, B, c.H,
                                  c.Hkv, c.Dh, c.n_splits, part.p, cnt.p, 0));
    const auto got = dout.get();
    dout.poison();
    CK(cu::attention_decode_batch(dout.p, dq.p, cu::KvPages{dkc.p, dvc.p, nullptr, dtp.p}, dk.p, dv.p, dp.p, B, c.H,
                                  c.Hkv, c.Dh, c.n_splits, part.p, cnt.p, 0));
    const bool same = std::memcmp(got.data(), dout.get().data(), got.size() * 4) == 0;
    const bool cache_exact = dkc.get() == pool.k && dvc.get() == pool.v;
    int longest = 0;
    for (int p : c.pasts) longest = std::max(longest, p);
    report(fmt("attention_decode_batch B=%d longest=%d G=%d Hkv=%d Dh=%d splits=%d", B, longest, c.H / c.Hkv, c.Hkv,
               c.Dh, c.n_splits),
           rel(got, ref), 1e-5, fmt("rerun %s, caches %s", same ? "bit-identical" : "DIFFERS", cache_exact ? "exact" : "WRONG"));
    if (!same || !cache_exact) ++g_fail;
    // The same batch on the tensor cores (attention_prefill over the tables, a block per token),
    // the new rows already in the pool as qk_norm_rope's append leaves them: 1 split, the case's
    // splits and 4 (splits of whole 64-key tiles; short sequences get empty ones).
    if (cu::attention_prefill_supported(c.H, c.Hkv, c.Dh))
      for (int splits : {1, c.n_splits, 4}) {
        Dev<float> tpart(size_t(B) * c.H * splits * (c.Dh + 2));
        const cu::KvPages kv{dkc.p, dvc.p, nullptr, dtp.p};
        dout.poison();
        CK(cu::attention_prefill(dout.p, dq.p, kv, dp.p, B, c.H, c.Hkv, c.Dh, true, 0, tpart.p, splits));
        const auto tc = dout.get();
        dout.poison();
        CK(cu::attention_prefill(dout.p, dq.p, kv, dp.p, B, c.H, c.Hkv, c.Dh, true, 0, tpart.p, splits));
        const bool tc_same = std::memcmp(tc.data(), dout.get().data(), tc.size() * 4) == 0;
        report(fmt("attention_prefill decode batch (tables) B=%d longest=%d G=%d Hkv=%d Dh=%d splits=%d", B, longest,
                   c.H / c.Hkv, c.Hkv, c.Dh, splits),
               rel(tc, ref), 1e-5, fmt("rerun %s", tc_same ? "bit-identical" : "DIFFERS"));
        if (!tc_same) ++g_fail;
      }
    // qk_norm_rope's append through the tables (one launch) against one launch per sequence with
    // its own table: the same q, k and pools, bit for bit.
    {
      Dev<uint16_t> ka(pool.k.size()), va(pool.v.size()), kb(pool.k.size()), vb(pool.v.size());
      for (auto* d : {&ka, &va, &kb, &vb}) CK(cudaMemset(d->p, 0, d->n * 2));
      Dev<float> qa(q), kna(knew), qb(q), knb2(knew);
      CK(cu::qk_norm_rope(qa.p, kna.p, nullptr, nullptr, false, dp.p, B, c.H, c.Hkv, c.Dh, 1e-6f, 10000.f, 0,
                          cu::KvPages{ka.p, va.p, nullptr, dtp.p}, dv.p));
      for (int b = 0; b < B; ++b)
        CK(cu::qk_norm_rope(qb.p + size_t(b) * c.H * c.Dh, knb2.p + size_t(b) * row, nullptr, nullptr, false, dp.p + b, 1,
                            c.H, c.Hkv, c.Dh, 1e-6f, 10000.f, 0, cu::KvPages{kb.p, vb.p, dtables[b]->p},
                            dv.p + size_t(b) * row));
      const bool equal = qa.get() == qb.get() && kna.get() == knb2.get() && ka.get() == kb.get() && va.get() == vb.get();
      report(fmt("qk_norm_rope append through tables B=%d G=%d Dh=%d (= per-sequence appends)", B, c.H / c.Hkv, c.Dh),
             equal ? 0.0 : 1.0, 0.0);
    }
    for (auto* d : dtables) delete d;
  }
}

// Decode attention again on the tiled kernel only (set_attention_decode_per_head(0)), and with the
// per-head kernel at every G (2); the default (check_attention_decode) takes it at G = 1 and for
// G > 1 up to 16 splits.
void check_attention_decode_per_head() {
  for (int mode : {0, 2}) {
    std::printf("-- attention_decode: per-head kernel mode %d --\n", mode);
    cu::set_attention_decode_per_head(mode);
    check_attention_decode();
  }
  cu::set_attention_decode_per_head(1);
}

}  // namespace tiermoe::cuda_check
