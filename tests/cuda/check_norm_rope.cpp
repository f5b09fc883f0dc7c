// RMSNorm, RoPE, q/k norm + RoPE with its cache appends, embeddings and the small kernels against
// their CPU twins.
#include <algorithm>
#include <vector>

#include "cpu/ops.h"

#include "check_harness.h"

namespace tiermoe::cuda_check {

void check_rmsnorm_rope_misc() {
  for (auto [rows, D] : {std::pair{1, 64}, {7, 2048}, {3, 100}, {64, 16}}) {
    auto x = randn(size_t(rows) * D, 3.f), w = randn(D);
    std::vector<float> ref(x.size());
    rmsnorm(ref.data(), x.data(), w.data(), rows, D, 1e-6f);
    Dev<float> dx(x), dw(w), dy(x.size());
    CK(cu::rmsnorm(dy.p, dx.p, dw.p, rows, D, 1e-6f, 0));
    report(fmt("rmsnorm rows=%d D=%d", rows, D), rel(dy.get(), ref), 1e-5);
  }
  // q/k norm (none, per head, over the whole projection) and RoPE in one launch.
  struct R { int T, H, Hkv, Dh, norm; float theta; int maxpos; };
  for (R r : {R{1, 4, 4, 16, 0, 1e4f, 10}, R{5, 32, 4, 128, 1, 1e6f, 40000}, R{9, 3, 3, 64, 2, 5e5f, 4096},
              R{4, 8, 2, 64, 0, 1e6f, 3000}, R{2, 16, 16, 128, 2, 1e4f, 8192}, R{3, 6, 2, 96, 1, 1e6f, 100},
              // more pairs than threads: 40 x 32 over 1024 threads, so some threads take two
              R{2, 40, 8, 64, 2, 1e6f, 5000}}) {
    auto q = randn(size_t(r.T) * r.H * r.Dh, 2.f), k = randn(size_t(r.T) * r.Hkv * r.Dh, 2.f);
    auto qn = randn(r.norm == 2 ? r.H * r.Dh : r.Dh), kn = randn(r.norm == 2 ? r.Hkv * r.Dh : r.Dh);
    std::vector<int32_t> pos(r.T);
    for (int t = 0; t < r.T; ++t)  // distinct (each is also a cache row below)
      do pos[t] = int(rng() % uint32_t(r.maxpos));
      while (std::find(pos.begin(), pos.begin() + t, pos[t]) != pos.begin() + t);
    std::vector<float> rq = q, rk = k;
    if (r.norm == 1) {
      rmsnorm(rq.data(), rq.data(), qn.data(), r.T * r.H, r.Dh, 1e-6f);
      rmsnorm(rk.data(), rk.data(), kn.data(), r.T * r.Hkv, r.Dh, 1e-6f);
    } else if (r.norm == 2) {
      rmsnorm(rq.data(), rq.data(), qn.data(), r.T, r.H * r.Dh, 1e-6f);
      rmsnorm(rk.data(), rk.data(), kn.data(), r.T, r.Hkv * r.Dh, 1e-6f);
    }
    rope(rq.data(), pos.data(), r.T, r.H, r.Dh, r.theta);
    rope(rk.data(), pos.data(), r.T, r.Hkv, r.Dh, r.theta);
    Dev<float> dq(q), dk(k), dqn(qn), dkn(kn);
    Dev<int32_t> dp(pos);
    CK(cu::qk_norm_rope(dq.p, dk.p, r.norm ? dqn.p : nullptr, r.norm ? dkn.p : nullptr, r.norm == 2, dp.p, r.T, r.H,
                        r.Hkv, r.Dh, 1e-6f, r.theta, 0));
    // The same with everything taken after the wait (set_rope_early(false)): the same bits.
    Dev<float> dq_late(q), dk_late(k);
    cu::set_rope_early(false);
    CK(cu::qk_norm_rope(dq_late.p, dk_late.p, r.norm ? dqn.p : nullptr, r.norm ? dkn.p : nullptr, r.norm == 2, dp.p,
                        r.T, r.H, r.Hkv, r.Dh, 1e-6f, r.theta, 0));
    cu::set_rope_early(true);
    const bool late_same = dq_late.get() == dq.get() && dk_late.get() == dk.get();
    // FP32 sin/cos of angles up to ~4e4 rad: CUDA's sincosf and glibc differ by a few ulp of the angle.
    report(fmt("qk_norm_rope T=%d H=%d Hkv=%d Dh=%d norm=%s theta=%.0e pos<%d", r.T, r.H, r.Hkv, r.Dh,
               r.norm == 0 ? "none" : (r.norm == 1 ? "head" : "full"), r.theta, r.maxpos),
           std::max(rel(dq.get(), rq), rel(dk.get(), rk)), 5e-5,
           late_same ? "taken after the wait: same bits" : "taken after the wait: DIFFERS");
    if (!late_same) ++g_fail;
    // Again with the cache append (the tensor-core decode path): q and k as before, and the pool
    // holding exactly bf16(rotated k) and bf16(v) at rows pos[t] (shuffled pages), nothing else.
    const int row = r.Hkv * r.Dh;
    PagedKv pool(row, PagedKv::pages_for(r.maxpos) + 2);
    const auto table = pool.table(r.maxpos);
    auto v = randn(size_t(r.T) * row);
    Dev<float> dq2(q), dk2(k), dv(v);
    Dev<uint16_t> dkc(pool.k), dvc(pool.v);
    Dev<int32_t> dt(table);
    CK(cu::qk_norm_rope(dq2.p, dk2.p, r.norm ? dqn.p : nullptr, r.norm ? dkn.p : nullptr, r.norm == 2, dp.p, r.T, r.H,
                        r.Hkv, r.Dh, 1e-6f, r.theta, 0, cu::KvPages{dkc.p, dvc.p, dt.p}, dv.p));
    const std::vector<float> k_out = dk2.get();
    const std::vector<uint16_t> vb = bf16_of(v), kb = bf16_of(k_out);
    for (int t = 0; t < r.T; ++t)
      pool.put(table, pos[t], 1, kb.data() + size_t(t) * row, vb.data() + size_t(t) * row);
    const bool same_qk = dq2.get() == dq.get() && k_out == dk.get();
    const bool cache_exact = dkc.get() == pool.k && dvc.get() == pool.v;
    report(fmt("qk_norm_rope+append T=%d H=%d Hkv=%d Dh=%d", r.T, r.H, r.Hkv, r.Dh), same_qk && cache_exact ? 0.0 : 1.0,
           0.0, fmt("q, k %s; cache %s", same_qk ? "as without" : "DIFFER", cache_exact ? "exact" : "WRONG"));
  }
  {
    const int T = 3, F = 37;
    auto gu = randn(size_t(T) * 2 * F, 2.f);
    std::vector<float> g(T * F), u(T * F), ref(T * F);
    for (int t = 0; t < T; ++t)
      for (int f = 0; f < F; ++f) g[t * F + f] = gu[t * 2 * F + f], u[t * F + f] = gu[t * 2 * F + F + f];
    silu_mul(ref.data(), g.data(), u.data(), T, F);
    Dev<float> dgu(gu), da(size_t(T) * F);
    CK(cu::silu_mul_gu(da.p, dgu.p, T, F, 0));
    report("silu_mul_gu T=3 F=37", rel(da.get(), ref), 1e-6);
  }
  {  // the prompt path's activations: hi = bf16(x), lo = bf16(x - hi), against the CPU's rounding
    auto x = randn(1000, 3.f);
    x[0] = 0.f, x[1] = 1e-30f, x[2] = -65504.f;
    std::vector<uint16_t> hi(x.size()), lo(x.size());
    std::vector<float> sum(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      hi[i] = f32_to_bf16(x[i]);
      lo[i] = f32_to_bf16(x[i] - bf16_to_f32(hi[i]));
      sum[i] = bf16_to_f32(hi[i]) + bf16_to_f32(lo[i]);
    }
    Dev<float> dx(x);
    Dev<uint16_t> dhi(x.size()), dlo(x.size());
    CK(cu::to_bf16(dhi.p, dlo.p, dx.p, x.size(), 0));
    const bool exact = dhi.get() == hi && dlo.get() == lo;
    report("to_bf16 hi + lo n=1000 (hi + lo vs x)", rel(sum, x), 2e-5, exact ? "parts equal the CPU's" : "parts DIFFER");
    if (!exact) ++g_fail;
  }
  {
    const int T = 4, V = 50, D = 24;
    auto table = randn(size_t(V) * D);
    auto tb = bf16_of(table);
    std::vector<int32_t> ids = {3, 49, 0, 3};
    std::vector<float> ref(T * D);
    for (int t = 0; t < T; ++t)
      for (int d = 0; d < D; ++d) ref[t * D + d] = bf16_to_f32(tb[ids[t] * D + d]);
    Dev<uint16_t> dt(tb);
    Dev<int32_t> di(ids);
    Dev<float> dx(size_t(T) * D);
    CK(cu::embed(dx.p, dt.p, di.p, T, D, 0));
    report("embed T=4 V=50 D=24", rel(dx.get(), ref), 0);
    // The decode step's form: ids and positions read from pinned host memory, the positions copied.
    int32_t *h_ids = nullptr, *h_pos = nullptr;
    CK(cudaMallocHost(&h_ids, T * 4));
    CK(cudaMallocHost(&h_pos, T * 4));
    const std::vector<int32_t> pos = {7, 8, 4095, 0};
    std::copy(ids.begin(), ids.end(), h_ids);
    std::copy(pos.begin(), pos.end(), h_pos);
    Dev<int32_t> dpos(T);
    dx.poison();
    CK(cu::embed(dx.p, dt.p, h_ids, T, D, 0, h_pos, dpos.p));
    const bool copied = dpos.get() == pos;
    report("embed T=4 V=50 D=24, ids and positions in pinned host memory", rel(dx.get(), ref), 0,
           copied ? "positions copied" : "positions DIFFER");
    if (!copied) ++g_fail;
    const bool refused = cu::embed(dx.p, dt.p, h_ids, T, D, 0, h_pos, nullptr) == cudaErrorInvalidValue;
    report("embed refuses pos_in without pos_out", refused ? 0.0 : 1.0, 0.0);
    cudaFreeHost(h_ids);
    cudaFreeHost(h_pos);
  }
}

}  // namespace tiermoe::cuda_check
