// The router and the MoE kernels against their CPU twins: top-k (ids exact), the one-launch router,
// the router folded into the o projection, the batch-1 and grouped expert kernels, the prompt-chunk
// expert GEMMs; and their timings.
#include <algorithm>
#include <numeric>
#include <vector>

#include "cpu/matmul.h"
#include "cpu/ops.h"

#include "check_harness.h"

namespace tiermoe::cuda_check {

void check_route() {
  struct C { int T, E, K; bool renorm, ties; };
  for (C c : {C{1, 8, 2, true, false}, C{5, 64, 8, true, false}, C{3, 256, 8, false, false}, C{2, 16, 4, false, false},
              C{1, 128, 8, true, false}, C{4, 60, 6, true, true}, C{2, 256, 8, false, true}, C{1, 8, 8, true, true},
              C{3, 33, 1, false, true}}) {
    auto logits = randn(size_t(c.T) * c.E, 2.f);
    if (c.ties)  // few distinct values: many exact ties, lower index must win
      for (auto& l : logits) l = std::round(l);
    std::vector<int32_t> ids(size_t(c.T) * c.K);
    std::vector<float> w(ids.size());
    for (int t = 0; t < c.T; ++t)
      route_softmax_topk(logits.data() + t * c.E, c.E, c.K, c.renorm, ids.data() + t * c.K, w.data() + t * c.K);
    Dev<float> dl(logits), dw(ids.size());
    Dev<int32_t> di(ids.size());
    CK(cu::route_topk(di.p, dw.p, dl.p, c.T, c.E, c.K, c.renorm, 0));
    const auto gi = di.get();
    int wrong = 0;
    for (size_t i = 0; i < ids.size(); ++i) wrong += gi[i] != ids[i];
    report(fmt("route_topk T=%d E=%d K=%d renorm=%d%s", c.T, c.E, c.K, int(c.renorm), c.ties ? " ties" : ""),
           rel(dw.get(), w), 1e-5, fmt("ids %s", wrong ? "DIFFER" : "exact"));
    if (wrong) ++g_fail;
  }
}

// The one-launch router: norm, router GEMV, softmax and top-k; ids exact, twice in a row. Clusters
// of 1 (E = 8), 8 and 16 blocks, several experts per warp (E = 256), K up to kRouteMaxK. "ties":
// router rows duplicated in pairs, so logits tie exactly.
void check_moe_route() {
  struct C { int T, E, K, D; bool renorm, ties; };
  for (C c : {C{1, 8, 2, 64, true, false}, C{1, 128, 8, 2048, true, false}, C{3, 256, 8, 100, false, false},
              C{8, 64, 8, 2048, false, false}, C{2, 60, 6, 48, true, true}, C{1, 256, 8, 2048, false, true},
              C{5, 33, 1, 72, false, true}, C{4, 8, 8, 512, true, false}, C{8, 128, 8, 2048, true, false},
              C{2, 256, 32, 64, true, true}, C{1, 200, 32, 96, false, false}}) {
    auto x = randn(size_t(c.T) * c.D, 2.f), nw = randn(c.D), wr = randn(size_t(c.E) * c.D, 0.05f);
    if (c.ties)
      for (int e = 1; e < c.E; e += 2) std::copy_n(wr.begin() + size_t(e - 1) * c.D, c.D, wr.begin() + size_t(e) * c.D);
    auto wb = bf16_of(wr);
    std::vector<float> h(x.size()), logits(size_t(c.T) * c.E), w(size_t(c.T) * c.K);
    std::vector<int32_t> ids(w.size());
    rmsnorm(h.data(), x.data(), nw.data(), c.T, c.D, 1e-6f);
    matmul(logits.data(), h.data(), wb.data(), DType::BF16, c.T, c.E, c.D);
    for (int t = 0; t < c.T; ++t)
      route_softmax_topk(logits.data() + size_t(t) * c.E, c.E, c.K, c.renorm, ids.data() + t * c.K, w.data() + t * c.K);
    Dev<float> dx(x), dnw(nw), dh(x.size()), dw(w.size());
    Dev<uint16_t> dwr(wb);
    Dev<int32_t> di(ids.size());
    int wrong = 0;
    double err = 0;
    for (int rep = 0; rep < 2; ++rep) {
      di.poison(), dw.poison();
      CK(cu::moe_route(dh.p, di.p, dw.p, dx.p, dnw.p, 1e-6f, dwr.p, c.T, c.E, c.K, c.D, c.renorm, 0));
      const auto gi = di.get();
      for (size_t i = 0; i < ids.size(); ++i) wrong += gi[i] != ids[i];
      err = std::max({err, rel(dw.get(), w), rel(dh.get(), h)});
    }
    report(fmt("moe_route T=%d E=%d K=%d D=%d renorm=%d%s (x2)", c.T, c.E, c.K, c.D, int(c.renorm), c.ties ? " ties" : ""),
           err, 1e-5, fmt("ids %s", wrong ? "DIFFER" : "exact"));
    if (wrong) ++g_fail;
  }
}

namespace {

// One MoE layer's inputs (routing from the CPU's top-k; with same_experts every token gets the
// same logits, so K experts hold all T tokens and the others none) and the CPU twin's output:
// per (t, k) the expert MLP with the CPU matmul, weighted sum, residual add.
struct MoeCase { int T, E, K, D, F; bool same_experts = false; };
struct MoeData {
  std::vector<float> h, x0, w, ref;
  std::vector<uint16_t> gub, dnb;
  std::vector<int32_t> ids;
};
// The CPU twin of the selected experts: m.ref[t] += sum_k w[t, k] * down(silu(gate h_t) * up h_t),
// e = ids[t, k], from m's expert weights; h[T, D] is the (normed) input.
void add_moe_reference(MoeData& m, const MoeCase& c, const float* h) {
  std::vector<float> g(c.F), u(c.F), a(c.F), y(c.D);
  for (int t = 0; t < c.T; ++t)
    for (int k = 0; k < c.K; ++k) {
      const int e = m.ids[t * c.K + k];
      const uint16_t* wg = m.gub.data() + size_t(e) * 2 * c.F * c.D;
      matmul(g.data(), h + t * c.D, wg, DType::BF16, 1, c.F, c.D);
      matmul(u.data(), h + t * c.D, wg + size_t(c.F) * c.D, DType::BF16, 1, c.F, c.D);
      silu_mul(a.data(), g.data(), u.data(), 1, c.F);
      matmul(y.data(), a.data(), m.dnb.data() + size_t(e) * c.D * c.F, DType::BF16, 1, c.D, c.F);
      for (int d = 0; d < c.D; ++d) m.ref[t * c.D + d] += m.w[t * c.K + k] * y[d];
    }
}

MoeData moe_case(const MoeCase& c) {
  MoeData m;
  m.h = randn(size_t(c.T) * c.D);
  m.gub = bf16_of(randn(size_t(c.E) * 2 * c.F * c.D, 0.05f));
  m.dnb = bf16_of(randn(size_t(c.E) * c.D * c.F, 0.05f));
  m.x0 = randn(size_t(c.T) * c.D);
  m.ids.resize(size_t(c.T) * c.K);
  m.w.resize(m.ids.size());
  const auto same = randn(c.E);
  for (int t = 0; t < c.T; ++t) {
    const auto lg = c.same_experts ? same : randn(c.E);
    route_softmax_topk(lg.data(), c.E, c.K, true, m.ids.data() + t * c.K, m.w.data() + t * c.K);
  }
  m.ref = m.x0;
  add_moe_reference(m, c, m.h.data());
  return m;
}

// Runs `layer` (x in place) twice from x0 on the same inputs: the error against the CPU twin and
// whether the two runs gave the same bits; reports the worst element.
template <class Layer>
void report_moe(const std::string& name, const MoeCase& c, const MoeData& m, Layer layer, double tol = 1e-5) {
  Dev<float> dx(m.x0), dx2(m.x0);
  layer(dx.p);
  layer(dx2.p);
  const auto got = dx.get(), got2 = dx2.get();
  const bool same = std::memcmp(got.data(), got2.data(), got.size() * 4) == 0;
  size_t worst_i = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (std::fabs(got[i] - m.ref[i]) > std::fabs(got[worst_i] - m.ref[worst_i])) worst_i = i;
  report(name, rel(got, m.ref), tol,
         fmt("rerun %s; worst at t=%zu d=%zu (%.5g vs %.5g)", same ? "bit-identical" : "DIFFERS", worst_i / c.D,
             worst_i % c.D, got[worst_i], m.ref[worst_i]));
  if (!same) ++g_fail;
}

}  // namespace

void check_moe() {
  for (MoeCase c : {MoeCase{1, 8, 2, 64, 32}, MoeCase{3, 256, 8, 48, 8}, MoeCase{1, 128, 8, 2048, 768},
                    MoeCase{2, 16, 4, 100, 36}, MoeCase{8, 64, 8, 64, 32}, MoeCase{1, 8, 2, 4096, 1024},
                    // moe_down's job split: K = 1 and 3 (several rows per block), 16 (more jobs than warps),
                    // rows longer than one round of loads (Mixtral's F)
                    MoeCase{2, 4, 1, 40, 24}, MoeCase{3, 16, 3, 72, 40}, MoeCase{1, 32, 16, 64, 24},
                    MoeCase{1, 8, 2, 128, 14336}}) {
    const MoeData m = moe_case(c);
    Dev<float> dh(m.h), dact(size_t(c.T) * c.K * c.F), dwt(m.w);
    Dev<uint16_t> dgu(m.gub), ddn(m.dnb);
    Dev<int32_t> di(m.ids);
    for (int v = 0; v < cu::moe_down_variants(); ++v) {  // every shape of moe_down
      cu::set_moe_down_variant(v);
      report_moe(fmt("moe_gate_up+moe_down T=%d E=%d K=%d D=%d F=%d down %d", c.T, c.E, c.K, c.D, c.F, v), c, m,
                 [&](float* x) {
                   dact.poison();
                   CK(cu::moe_gate_up(dact.p, dh.p, dgu.p, di.p, c.T, c.K, c.F, c.D, 0));
                   CK(cu::moe_down(x, dact.p, ddn.p, di.p, dwt.p, c.T, c.K, c.D, c.F, 0));
                 });
    }
    cu::set_moe_down_variant(0);
  }
}

// The router folded into the o projection (cu::RouterLogits): gemv_router_logits (x += a Wo^T, the
// unscaled logits summed into acc), moe_gate_up_routed (per-block routing), moe_down selecting its
// experts from acc, against the CPU twin's o projection, rmsnorm, router matmul, top-k and MoE; ids
// exact, every moe_down shape, two runs bit-identical. "ties": router rows duplicated in pairs.
void check_moe_routed() {
  struct C { int T, E, K, D, Da, F; bool renorm, ties, same = false; };  // same: every token the same
  for (C c : {C{1, 64, 8, 2048, 2048, 64, false, false}, C{1, 128, 8, 2048, 4096, 48, true, false},
              C{1, 8, 2, 4096, 4096, 112, true, false}, C{3, 60, 6, 48, 40, 24, true, true},
              C{8, 256, 8, 64, 72, 16, false, false}, C{2, 256, 32, 128, 96, 8, true, true},
              C{1, 33, 1, 24, 30, 40, false, true}, C{5, 16, 4, 104, 64, 36, true, false},
              // one token's gate/up as a stream: several (k, f) pairs per warp, rows of one and two units
              C{1, 16, 8, 2048, 2048, 1000, false, false}, C{1, 4, 3, 4096, 2048, 700, true, true},
              // the o projection on the tensor cores (2 .. 8 tokens, Da % 256 == 0): the fold over 16-row blocks
              C{4, 64, 8, 2048, 2048, 64, false, false}, C{6, 128, 8, 2040, 4096, 48, true, true},
              C{3, 256, 8, 104, 256, 16, true, false},
              // down on the tensor cores (2 .. 8 tokens, F % 256 == 0): experts shared by tokens, every
              // token the same (each expert all T tokens'), D past a 16-row tile, K up to 32, more
              // 16-row items than blocks (D = 4096), F of one and several units per warp
              C{8, 256, 8, 256, 256, 256, true, false}, C{5, 16, 4, 200, 512, 512, false, true},
              C{7, 64, 8, 256, 512, 256, true, false, true}, C{8, 256, 32, 256, 256, 256, true, false},
              C{2, 8, 2, 4096, 4096, 1024, true, false}, C{8, 8, 2, 768, 256, 768, false, false, true}}) {
    const size_t TD = size_t(c.T) * c.D;
    const MoeCase mc{c.T, c.E, c.K, c.D, c.F};
    auto x0 = randn(TD), a = randn(size_t(c.T) * c.Da), nw = randn(c.D), wr = randn(size_t(c.E) * c.D, 0.05f);
    for (int t = 1; c.same && t < c.T; ++t) {
      std::copy_n(x0.begin(), c.D, x0.begin() + size_t(t) * c.D);
      std::copy_n(a.begin(), c.Da, a.begin() + size_t(t) * c.Da);
    }
    if (c.ties)
      for (int e = 1; e < c.E; e += 2) std::copy_n(wr.begin() + size_t(e - 1) * c.D, c.D, wr.begin() + size_t(e) * c.D);
    const auto wob = bf16_of(randn(size_t(c.D) * c.Da, 0.05f)), wrb = bf16_of(wr);
    MoeData m;
    m.gub = bf16_of(randn(size_t(c.E) * 2 * c.F * c.D, 0.05f));
    m.dnb = bf16_of(randn(size_t(c.E) * c.D * c.F, 0.05f));
    // CPU twin: h = x0 + a Wo^T; routing from rmsnorm(h); the MoE of the normed h added to h.
    std::vector<float> h = x0, hn(TD), logits(size_t(c.T) * c.E);
    matmul_add(h.data(), a.data(), wob.data(), DType::BF16, c.T, c.D, c.Da);
    rmsnorm(hn.data(), h.data(), nw.data(), c.T, c.D, 1e-6f);
    matmul(logits.data(), hn.data(), wrb.data(), DType::BF16, c.T, c.E, c.D);
    m.ids.resize(size_t(c.T) * c.K);
    m.w.resize(m.ids.size());
    for (int t = 0; t < c.T; ++t)
      route_softmax_topk(logits.data() + size_t(t) * c.E, c.E, c.K, c.renorm, m.ids.data() + t * c.K, m.w.data() + t * c.K);
    m.ref = h;
    add_moe_reference(m, mc, hn.data());
    m.x0 = x0;
    Dev<float> da(a), dnw(nw), dact(size_t(c.T) * c.K * c.F), dwt(m.w.size());
    Dev<uint16_t> dwo(wob), dwr(wrb), dgu(m.gub), ddn(m.dnb);
    Dev<int32_t> di(m.ids.size());
    Dev<long long> acc(size_t(c.T) * c.E * cu::kRouterLogitStride);
    // Modes (moe_down shape, one token's gate/up stream blocks per SM or 0 by rows, down on the tensor
    // cores where they fit): every moe_down shape; for one token the stream at 1 block per SM and by
    // rows; for 2 .. 8 tokens where the tensor cores fit, down on them and by rows.
    struct Mode { int down, stream; bool tc; };
    const bool tc = cu::moe_down_tc_fits(c.T, c.F);
    std::vector<Mode> modes;
    for (int v = 0; v < (tc ? 1 : cu::moe_down_variants()); ++v) modes.push_back({v, 2, true});
    if (c.T == 1) modes.insert(modes.end(), {{0, 1, true}, {0, 0, true}});
    else if (tc)
      for (int v = 0; v < cu::moe_down_variants(); ++v) modes.push_back({v, 2, false});
    std::vector<float> act_first;  // moe_gate_up_routed's act under the first mode, to compare bits
    for (const Mode& md : modes) {
      const int v = md.down, stream = md.stream;
      cu::set_moe_down_variant(v);
      cu::set_moe_gate_up_stream(stream);
      cu::set_moe_down_tc(md.tc ? 1 : 0);
      int wrong = 0;
      double werr = 0;
      const std::string mode = c.T > 1 || !stream ? "rows" : fmt("stream x%d", stream);
      const std::string down = cu::moe_down_tc_fits(c.T, c.F) ? "tensor cores" : fmt("%d", v);
      report_moe(fmt("o-proj router + moe_gate_up_routed + moe_down T=%d E=%d K=%d D=%d F=%d%s%s down %s gate_up %s", c.T,
                     c.E, c.K, c.D, c.F, c.ties ? " ties" : "", c.same ? " same" : "", down.c_str(), mode.c_str()),
                 mc, m, [&](float* x) {
                   CK(cudaMemset(acc.p, 0, acc.n * sizeof(long long)));
                   dact.poison(), di.poison(), dwt.poison();
                   CK(cu::gemv_router_logits(x, da.p, dwo.p, c.T, c.D, c.Da, {dwr.p, dnw.p, acc.p, c.E}, 0));
                   CK(cu::moe_gate_up_routed(dact.p, di.p, dwt.p, x, dnw.p, 1e-6f, acc.p, dgu.p, c.T, c.E, c.K, c.F,
                                             c.D, c.renorm, 0));
                   CK(cu::moe_down(x, dact.p, ddn.p, di.p, dwt.p, c.T, c.K, c.D, c.F, 0, acc.p, c.E));
                   const auto gi = di.get();
                   for (size_t i = 0; i < gi.size(); ++i) wrong += gi[i] != m.ids[i];
                   werr = std::max(werr, rel(dwt.get(), m.w));
                 });
      report(fmt("  its routing ids and weights (x2)"), werr, 1e-5, fmt("ids %s", wrong ? "DIFFER" : "exact"));
      if (wrong) ++g_fail;
      const auto act = dact.get();
      if (act_first.empty()) act_first = act;
      const bool same = std::memcmp(act.data(), act_first.data(), act.size() * sizeof(float)) == 0;
      report(fmt("  moe_gate_up_routed %s: act bits as the first", mode.c_str()), same ? 0.0 : 1.0, 0.0);
    }
    cu::set_moe_down_variant(0);
    cu::set_moe_gate_up_stream(2);
    cu::set_moe_down_tc(2);
  }
}

// The grouped kernels under each variant: T up to 64, experts with many tokens (several passes of
// a token group), with none, odd D and F (the CUDA cores' scalar path).
void check_moe_grouped() {
  for (MoeCase c : {MoeCase{1, 8, 2, 64, 32}, MoeCase{2, 256, 8, 64, 40}, MoeCase{5, 16, 4, 100, 36},
                    MoeCase{8, 64, 8, 512, 256}, MoeCase{17, 8, 2, 48, 24, true}, MoeCase{32, 128, 8, 256, 192},
                    MoeCase{64, 32, 8, 1024, 512}, MoeCase{64, 8, 8, 64, 32}, MoeCase{64, 256, 8, 128, 96, true},
                    MoeCase{40, 8, 2, 4096, 1024}, MoeCase{3, 1, 1, 33, 17},
                    // the tensor cores' row tiles cut by N and chunks cut by L; a Mixtral-long down row
                    MoeCase{9, 16, 4, 200, 72}, MoeCase{12, 2, 1, 256, 14336}}) {
    const MoeData m = moe_case(c);
    Dev<float> dh(m.h), dact(size_t(c.T) * c.K * c.F), dy(size_t(c.T) * c.K * c.D), dwt(m.w);
    Dev<uint16_t> dgu(m.gub), ddn(m.dnb);
    Dev<int32_t> di(m.ids);
    // tensor cores (where L % 8 == 0) with the token groups per pass by rule, pinned to 1 and 2; CUDA cores
    struct V { bool mma; int groups; };
    for (V v : {V{true, 0}, V{true, 1}, V{true, 2}, V{false, 0}}) {
      cu::set_moe_grouped_mma(v.mma);
      cu::set_moe_grouped_groups(v.groups);
      report_moe(fmt("moe_grouped T=%d E=%d K=%d D=%d F=%d%s %s", c.T, c.E, c.K, c.D, c.F,
                     c.same_experts ? " same experts" : "",
                     !v.mma ? "CUDA cores" : v.groups ? fmt("MMA groups %d", v.groups).c_str() : "MMA"),
                 c, m, [&](float* x) {
                   dact.poison(), dy.poison();
                   CK(cu::moe_grouped_gate_up(dact.p, dh.p, dgu.p, di.p, c.T, c.K, c.E, c.F, c.D, 0));
                   CK(cu::moe_grouped_down(dy.p, dact.p, ddn.p, di.p, c.T, c.K, c.E, c.D, c.F, 0));
                   CK(cu::moe_combine(x, dy.p, dwt.p, c.T, c.K, c.D, 0));
                 });
    }
    cu::set_moe_grouped_mma(true);
    cu::set_moe_grouped_groups(0);
  }
  // Too many (token, k) entries for the shared routing list: refused, nothing launched.
  const bool refused = cu::moe_grouped_gate_up(nullptr, nullptr, nullptr, nullptr, 65, 8, 64, 32, 64, 0) ==
                           cudaErrorInvalidValue &&
                       cu::moe_grouped_down(nullptr, nullptr, nullptr, nullptr, 65, 8, 64, 64, 32, 0) ==
                           cudaErrorInvalidValue;
  report("moe_grouped T=65 K=8 refused (T*K > 512)", refused ? 0.0 : 1.0, 0.0);
}

// The prompt-chunk MoE: entries sorted by expert into padded tiles, the tensor-core expert GEMMs
// with the activations split into BF16 hi + lo (FP32-level: the MoE tolerance) and, for contrast,
// rounded to BF16 once (BF16-level tolerance); both kernels: the first (wmma, FP32 input) and the
// pipelined one (input split by to_bf16 first; Kd % 8 == 0 only). Odd D / F take the first
// kernel's unvectorized loads; "same experts" puts every token in K experts (several tiles each,
// the other experts none). The pipelined kernel's tiles are 64 x 128 with k-steps of 32: D, F or
// 2F not multiples of those, T * K not a multiple of 64, and a Mixtral-sized expert (D 4096,
// F 14336; E = 2 to keep the host's weights small) with a few tokens.
void check_moe_prefill() {
  int index = 0;
  for (MoeCase c : {MoeCase{9, 8, 2, 64, 32}, MoeCase{24, 64, 8, 128, 96}, MoeCase{100, 256, 8, 64, 40},
                    MoeCase{300, 16, 4, 100, 36}, MoeCase{65, 8, 1, 33, 17}, MoeCase{200, 8, 2, 256, 128, true},
                    MoeCase{512, 64, 8, 2048, 1024}, MoeCase{40, 8, 2, 4096, 1024}, MoeCase{333, 32, 4, 136, 200},
                    MoeCase{130, 4, 2, 264, 72, true}, MoeCase{77, 256, 8, 72, 56}, MoeCase{5, 2, 2, 4096, 14336}}) {
    if (skip_case(index)) continue;
    const MoeData m = moe_case(c);
    const int TK = c.T * c.K, P = cu::moe_sort_rows(TK, c.E);
    Dev<float> dh(m.h), dgu(size_t(TK) * 2 * c.F), dact(size_t(TK) * c.F), dy(size_t(TK) * c.D), dwt(m.w);
    Dev<uint16_t> dgw(m.gub), ddn(m.dnb), hi(size_t(TK) * std::max(c.D, c.F)), lo(hi.n);
    Dev<int32_t> di(m.ids), rows(P), tiles(P / cu::kMoeTileM);
    const bool pipelined_ok = c.D % 8 == 0 && c.F % 8 == 0;
    int variant = 0;  // TIERMOE_CHECK_VARIANT: 0 .. 3 in this order
    for (bool pipelined : {false, true})
      for (bool split : {true, false}) {
        if (skip_variant(variant++)) continue;
        if (pipelined && !pipelined_ok) continue;
        if (!split && c.T > 100) continue;
        // The first kernel at Mixtral's F: 4.91e-5 measured (H200, 2026-11-30), at the tolerance (its
        // accumulators run over all 14336 terms, see moe_prefill.cu); it is timed, not kept in the table.
        if (!pipelined && c.F > 4096) continue;
        report_moe(fmt("moe_sort+moe_expert_gemm%s T=%d E=%d K=%d D=%d F=%d%s%s", pipelined ? "_bf16" : "", c.T, c.E,
                       c.K, c.D, c.F, c.same_experts ? " same experts" : "", split ? "" : " (BF16 inputs)"),
                   c, m, [&](float* x) {
                     dgu.poison(), dact.poison(), dy.poison(), rows.poison(), hi.poison(), lo.poison();
                     CK(cu::moe_sort(rows.p, tiles.p, di.p, TK, c.E, 0));
                     if (pipelined) {
                       uint16_t* l = split ? lo.p : nullptr;
                       CK(cu::to_bf16(hi.p, l, dh.p, size_t(c.T) * c.D, 0));
                       CK(cu::moe_expert_gemm_bf16(dgu.p, hi.p, l, c.K, dgw.p, rows.p, tiles.p, TK, c.E, 2 * c.F, c.D, 0));
                       CK(cu::silu_mul_gu(dact.p, dgu.p, TK, c.F, 0));
                       CK(cu::to_bf16(hi.p, l, dact.p, size_t(TK) * c.F, 0));
                       CK(cu::moe_expert_gemm_bf16(dy.p, hi.p, l, 1, ddn.p, rows.p, tiles.p, TK, c.E, c.D, c.F, 0));
                     } else {
                       CK(cu::moe_expert_gemm(dgu.p, dh.p, c.K, dgw.p, rows.p, tiles.p, TK, c.E, 2 * c.F, c.D, split, 0));
                       CK(cu::silu_mul_gu(dact.p, dgu.p, TK, c.F, 0));
                       CK(cu::moe_expert_gemm(dy.p, dact.p, 1, ddn.p, rows.p, tiles.p, TK, c.E, c.D, c.F, split, 0));
                     }
                     CK(cu::moe_combine(x, dy.p, dwt.p, c.T, c.K, c.D, 0));
                   }, split ? 5e-5 : 2e-2);  // split: FP32-level (2.0e-5 measured at D = 4096, |x| ~ 37)
      }
  }
  // Rows of Kd not a multiple of 8 (no 16-byte chunks): refused, nothing launched.
  const bool refused = cu::moe_expert_gemm_bf16(nullptr, nullptr, nullptr, 1, nullptr, nullptr, nullptr, 64, 8, 64,
                                                100, 0) == cudaErrorInvalidValue;
  report("moe_expert_gemm_bf16 Kd=100 refused (Kd % 8 != 0)", refused ? 0.0 : 1.0, 0.0);
}

// The expert GEMMs of one Mixtral-8x7B MoE layer (E 8, K 2, D 4096, F 14336) on a 512-token chunk,
// routing random (each token two distinct experts), weights random on the device; each kernel
// pair (gate/up, then down) timed over 10 launches after 2 (events), hi + lo inputs, the to_bf16
// splits included for the pipelined kernel. TFLOP/s counts useful work (2 TK (2F D + D F)), not the
// hi and lo MMAs twice, nor the padding.
void moe_gemm_timing(int T, int E, int K, int D, int F) {
  const int TK = T * K, P = cu::moe_sort_rows(TK, E);
  std::vector<int32_t> ids(TK);
  std::uniform_int_distribution<int> pick(0, E - 1);
  for (int t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      int e;
      do e = pick(rng); while (std::find(ids.begin() + t * K, ids.begin() + t * K + k, e) != ids.begin() + t * K + k);
      ids[t * K + k] = e;
    }
  Dev<int32_t> di(ids), rows(P), tiles(P / cu::kMoeTileM);
  Dev<float> dh(randn(size_t(T) * D)), dgu(size_t(TK) * 2 * F), dact(size_t(TK) * F), dy(size_t(TK) * D);
  Dev<uint16_t> gw(size_t(E) * 2 * F * D), dw(size_t(E) * D * F), hi(size_t(TK) * std::max(D, F)), lo(hi.n);
  CK(cu::fill_random_bf16(gw.p, gw.n, 1, 0.02f, 0));
  CK(cu::fill_random_bf16(dw.p, dw.n, 2, 0.02f, 0));
  CK(cu::moe_sort(rows.p, tiles.p, di.p, TK, E, 0));
  CK(cu::fill_f32(dact.p, dact.n, 0.5f, 0));  // the down GEMM's input: finite values
  auto time_us = [&](auto launch) { return mean_us(2, 10, launch); };
  const double us_old = time_us([&] {
    CK(cu::moe_expert_gemm(dgu.p, dh.p, K, gw.p, rows.p, tiles.p, TK, E, 2 * F, D, true, 0));
    CK(cu::moe_expert_gemm(dy.p, dact.p, 1, dw.p, rows.p, tiles.p, TK, E, D, F, true, 0));
  });
  const double us_new = time_us([&] {
    CK(cu::to_bf16(hi.p, lo.p, dh.p, size_t(T) * D, 0));
    CK(cu::moe_expert_gemm_bf16(dgu.p, hi.p, lo.p, K, gw.p, rows.p, tiles.p, TK, E, 2 * F, D, 0));
    CK(cu::to_bf16(hi.p, lo.p, dact.p, size_t(TK) * F, 0));
    CK(cu::moe_expert_gemm_bf16(dy.p, hi.p, lo.p, 1, dw.p, rows.p, tiles.p, TK, E, D, F, 0));
  });
  const double flop = 2.0 * TK * (2.0 * F * D + double(D) * F);
  std::printf("expert GEMMs T=%d E=%d K=%d D=%d F=%d (hi+lo): first kernel %.1f us (%.0f TFLOP/s useful), pipelined "
              "%.1f us (%.0f TFLOP/s useful)\n",
              T, E, K, D, F, us_old, flop / us_old * 1e-6, us_new, flop / us_new * 1e-6);
}

// Batch-1 expert kernels of one layer at a model's shape (dummy weights, the token's experts rotated
// over 4 sets so that L2 holds none of them): moe_gate_up, then moe_down under each of its shapes;
// microseconds per launch (20 back to back after 3) and GB/s of the selected experts' weights.
void moe_decode_timing(const char* name, int E, int K, int D, int F) {
  Dev<uint16_t> gu(size_t(E) * 2 * F * D), dn(size_t(E) * D * F);
  CK(cu::fill_random_bf16(gu.p, gu.n, 11, 0.02f, 0));
  CK(cu::fill_random_bf16(dn.p, dn.n, 12, 0.02f, 0));
  std::vector<int32_t> idh(4 * size_t(K));
  for (int set = 0; set < 4; ++set)
    for (int k = 0; k < K; ++k) idh[size_t(set) * K + k] = (set * K + k) % E;
  Dev<int32_t> ids(idh);
  std::vector<float> wh(K, 1.f / K);
  Dev<float> h(randn(D)), act(static_cast<size_t>(K) * F), x(randn(D)), w(wh);
  int call = 0;
  auto set_ids = [&] { return ids.p + (call++ % 4) * K; };
  const double gu_us = mean_us(3, 20, [&] { CK(cu::moe_gate_up(act.p, h.p, gu.p, set_ids(), 1, K, F, D, 0)); });
  std::printf("timing moe %s gate_up: %.1f us, %.0f GB/s\n", name, gu_us, 2.0 * K * 2 * F * D / (gu_us * 1e3));
  for (int v = 0; v < cu::moe_down_variants(); ++v) {
    cu::set_moe_down_variant(v);
    const double us = mean_us(3, 20, [&] { CK(cu::moe_down(x.p, act.p, dn.p, set_ids(), w.p, 1, K, D, F, 0)); });
    std::printf("timing moe %s down_variant %d: %.1f us, %.0f GB/s\n", name, v, us, 2.0 * K * D * F / (us * 1e3));
  }
  cu::set_moe_down_variant(0);
}

}  // namespace tiermoe::cuda_check
