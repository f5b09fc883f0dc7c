// The batch-1 / small-batch MoE kernels declared in kernels.h: the router (route_topk, moe_route, or
// the selection inside moe_gate_up_routed from the o projection's logit sums), the selected
// experts' gate/up projections and their down projection with the weighted sum and residual add.
#include "cuda/gemv.cuh"
#include "cuda/route.cuh"

#include <algorithm>
#include <cmath>

#include <cooperative_groups.h>

namespace tiermoe::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kDownPart = 256;   // moe_down's partial sums per block, R * K at most
constexpr int kRouteMaxCluster = 16;  // moe_route's blocks (16: a non-portable cluster size, Hopper has it)
// moe_gate_up_stream_kernel's blocks per SM (0: moe_gate_up_routed_kernel for every T), for A/B timing
// (set_moe_gate_up_stream): its launch bound, the register budget's most, by default.
int g_gate_up_stream = kStreamBlocksPerSm;
// The decode MoE's top-k by select_topk_token (past 64 experts by one warp) or always by the block
// (select_topk; TIERMOE_CUDA_WARP_TOPK=0, for A/B timing): the same ranking.
bool g_warp_topk = true;

__global__ void __launch_bounds__(kWarps * 32) route_topk_kernel(int32_t* ids, float* weights, const float* logits,
                                                                 int E, int K, bool renormalize) {
  const size_t t = blockIdx.x;
  route_token(ids + t * K, weights + t * K, logits + t * E, E, K, renormalize);
}

// One cluster of C = gridDim.x blocks (C <= kRouteMaxCluster): warp w of block b computes the logits
// of experts b * kWarps + w + i * C * kWarps straight into the first block's shared memory
// (distributed shared memory: no global round trip, no fence, no counter); every thread writes part
// of h = rmsnorm(x) * nw; after the cluster barrier the first block routes each token (route_token).
template <int TT>
__global__ void __launch_bounds__(kWarps * 32) moe_route_kernel(float* __restrict__ h, int32_t* ids, float* weights,
                                                                const float* __restrict__ x,
                                                                const float* __restrict__ nw, float eps,
                                                                const bf16* __restrict__ Wr, int T, int E, int K,
                                                                int D, bool renormalize, bool staged) {
  __shared__ float lg[TT * kRouteMaxE];  // the first block's: logits [T, E]
  __shared__ float inv_s[TT];
  cg::cluster_group cluster = cg::this_cluster();
  float* lead = cluster.map_shared_rank(lg, 0);
  // Every block of the cluster must have started before any writes another's shared memory (under
  // programmatic launch this barrier passes while the previous kernel still runs).
  cluster.sync();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, stride = int(gridDim.x) * kWarps;
  __shared__ GemvStage st;
  float inv[TT];
  for (int n0 = blockIdx.x * kWarps + warp, first = n0; n0 < E || n0 == first; n0 += stride)  // every warp once at least
    gemv_rows<TT, true>(lead, x, nw, eps, Wr, T, E, D, false, n0, lane, inv, staged ? &st : nullptr, n0 == first);
  if (threadIdx.x == 0)  // warp 0 has a row (C <= ceil(E / kWarps)): inv[] is set
#pragma unroll
    for (int t = 0; t < TT; ++t)
      if (t < T) inv_s[t] = inv[t];
  __syncthreads();
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < size_t(T) * D; i += size_t(gridDim.x) * blockDim.x)
    h[i] = x[i] * inv_s[i / D] * nw[i % D];
  cluster.sync();  // the logits are in the first block's shared memory
  if (cluster.block_rank() != 0) return;
  for (int t = 0; t < T; ++t) route_token(ids + t * K, weights + t * K, lg + t * E, E, K, renormalize);
}

// One warp's gate and up sums for output row f: rows wg and wu of D = 8 * D8 BF16 weights against
// x[D] (global memory or a shared stage), 16-byte weight loads.
__device__ __forceinline__ void gate_up_dots(const bf16* __restrict__ wg, const bf16* __restrict__ wu, const float* x,
                                             int D8, int lane, float& g, float& u) {
#pragma unroll 8
  for (int i = lane; i < D8; i += 32) {
    const uint4 a = ldg16(wg + 8 * i), b = ldg16(wu + 8 * i);
    g += dot8(a, x + 8 * i);
    u += dot8(b, x + 8 * i);
  }
}

// The routing at the head of moe_gate_up_routed's blocks, all threads of the block: sid[k] = token
// t's experts, selected from the logit sums acc[t] (select_topk_token); st.x = h_t * nw. Returns
// inv = 1 / rms(h_t). Only the selection stands between the wait and the weight loads (the sum of
// squares is gathered with the stage and summed after). `router_column` (a block with no rows): for
// k = 0 it computes the token's softmax weights (inv * acc) and writes them with the ids, beside the
// other blocks' loads instead of after a block's rows.
struct RouteShared {
  GemvStage st;  // h_t * nw, and the warps' shares of sum(h_t^2)
  float lg[kRouteMaxE], sw[kRouteMaxK];
  int32_t sid[kRouteMaxK];
};
__device__ float route_block(RouteShared& sh, int32_t* ids, float* weights, const float* __restrict__ h,
                             const float* __restrict__ nw, float eps, const long long* acc, int t, int k, int E,
                             int K, int D, bool renormalize, bool router_column, bool warp_topk) {
  // The logit sum's load goes out with the stage's, not one L2 round trip before them (-0.2% to -1.1%
  // per token alone, H100, 2026-12-05, docs/benchmarks.md).
  const long long a = threadIdx.x < E ? acc[(size_t(t) * E + threadIdx.x) * kRouterLogitStride] : 0;
  stage_x_rows<1, true>(sh.st, h + size_t(t) * D, nw, 1, D);
  if (threadIdx.x < E) sh.lg[threadIdx.x] = logit_of(a);
  __syncthreads();
  select_topk_token(sh.sid, sh.lg, E, K, warp_topk);
  __syncthreads();
  float ss = 0.f;
  for (int w = 0; w < kWarps; ++w) ss += sh.st.red[w][0];
  const float inv = 1.0f / sqrtf(ss / float(D) + eps);  // as rmsnorm() computes it
  if (router_column && k == 0) {
    route_token(sh.sid, sh.sw, sh.lg, E, K, renormalize, inv);
    if (threadIdx.x < K) {
      ids[t * K + threadIdx.x] = sh.sid[threadIdx.x];
      weights[t * K + threadIdx.x] = sh.sw[threadIdx.x];
    }
  }
  return inv;
}

// The router's last step and moe_gate_up in one launch (RouterLogits, kernels.h). grid (ceil(F / kWarps)
// + 1, T*K): every block routes its token (route_block), then one warp per (t, k, f) as
// moe_gate_up, scaled by inv at the end. The last column's blocks are the router columns.
__global__ void __launch_bounds__(kWarps * 32) moe_gate_up_routed_kernel(float* __restrict__ act, int32_t* ids,
                                                                         float* weights, const float* __restrict__ h,
                                                                         const float* __restrict__ nw, float eps,
                                                                         const long long* acc,
                                                                         const bf16* __restrict__ Wgu, int E, int K,
                                                                         int F, int D, bool renormalize, bool warp_topk) {
  __shared__ RouteShared sh;
  pdl_wait();  // then the next kernel: moe_down reads the o projection's results before its wait
  pdl_launch_dependents();
  const int tk = blockIdx.y, t = tk / K, k = tk % K, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool router_column = blockIdx.x == gridDim.x - 1;
  const float inv = route_block(sh, ids, weights, h, nw, eps, acc, t, k, E, K, D, renormalize, router_column, warp_topk);
  if (router_column) return;
  const int f = blockIdx.x * kWarps + warp;
  if (f < F) {
    const bf16* wg = Wgu + (size_t(sh.sid[k]) * 2 * F + f) * D;
    const bf16* wu = wg + size_t(F) * D;
    float g = 0.f, u = 0.f;
    gate_up_dots(wg, wu, sh.st.x, D >> 3, lane, g, u);
    g = warp_sum(g) * inv;
    u = warp_sum(u) * inv;
    if (lane == 0) act[size_t(tk) * F + f] = silu(g) * u;
  }
}

// moe_gate_up_routed for one token as a stream (T = 1, D % 2048 == 0): gridDim.x - 1 blocks (a few
// per SM, one wave) each route the token once (route_block), then every warp walks the K * F pairs
// p = k * F + f, gridDim.x * kWarps apart: the gate row's units, then the up row's (a unit is 2048
// weights, 8 16-byte loads per lane), the next unit's loads issued before this one's dot product.
// Why: the kernel above runs about two waves of short blocks, each routing again before its first
// load, and its warps' loads stop between rows; here the loads run on across rows and experts.
// The sums run in the same order as the kernel above: the same bits. The last block is the router column.
__global__ void __launch_bounds__(kWarps * 32, kStreamBlocksPerSm) moe_gate_up_stream_kernel(float* __restrict__ act, int32_t* ids,
                                                                            float* weights, const float* __restrict__ h,
                                                                            const float* __restrict__ nw, float eps,
                                                                            const long long* acc,
                                                                            const bf16* __restrict__ Wgu, int E, int K,
                                                                            int F, int D, bool renormalize, bool warp_topk) {
  constexpr int kUnit = 2048, kL = kUnit / 256;  // weights per unit, loads per lane per unit
  __shared__ RouteShared sh;
  pdl_wait();  // then the next kernel: moe_down reads the o projection's results before its wait
  pdl_launch_dependents();
  const bool router_column = blockIdx.x == gridDim.x - 1;
  const float inv = route_block(sh, ids, weights, h, nw, eps, acc, 0, 0, E, K, D, renormalize, router_column, warp_topk);
  if (router_column) return;
  const int lane = threadIdx.x & 31, P = D / kUnit, stride = (gridDim.x - 1) * kWarps;
  const int w0 = blockIdx.x * kWarps + (threadIdx.x >> 5), pairs = K * F;
  const int units = (w0 < pairs ? (pairs - 1 - w0) / stride + 1 : 0) * 2 * P;  // even
  auto pair_of = [&](int u) { return w0 + u / (2 * P) * stride; };
  auto load = [&](uint4(&v)[kL], int u) {
    const int p = pair_of(u), k = p / F, f = p - k * F, up = u / P & 1;
    const bf16* w = Wgu + (size_t(sh.sid[k]) * 2 * F + size_t(up) * F + f) * D + size_t(u % P) * kUnit + 8 * lane;
#pragma unroll
    for (int j = 0; j < kL; ++j) v[j] = ldg16(w + 256 * j);
  };
  float s = 0.f, g = 0.f;
  auto dot = [&](const uint4(&v)[kL], int u) {
    const float* x = sh.st.x + (u % P) * kUnit + 8 * lane;
#pragma unroll
    for (int j = 0; j < kL; ++j) s += dot8(v[j], x + 256 * j);
    if ((u + 1) % P) return;  // the row goes on in the next unit
    const float r = warp_sum(s) * inv;
    s = 0.f;
    if ((u / P & 1) == 0) g = r;
    else if (lane == 0) act[pair_of(u)] = silu(g) * r;  // act[k * F + f]
  };
  uint4 a[kL], b[kL];
  if (units > 0) load(a, 0);
  stream_units(a, b, units, load, dot);
}

// grid (ceil(F / kWarps), T*K): one warp per (t, k, f).
__global__ void __launch_bounds__(kWarps * 32) moe_gate_up_kernel(float* __restrict__ act, const float* __restrict__ h,
                                                                  const bf16* __restrict__ Wgu,
                                                                  const int32_t* __restrict__ ids, int K, int F, int D) {
  pdl_wait();  // then the next kernel: moe_down reads the o projection's results before its wait
  pdl_launch_dependents();
  const int lane = threadIdx.x & 31;
  const int f = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int tk = blockIdx.y, t = tk / K;
  if (f >= F) return;
  const bf16* wg = Wgu + (size_t(ids[tk]) * 2 * F + f) * D;
  const bf16* wu = wg + size_t(F) * D;
  const float* x = h + size_t(t) * D;
  float g = 0.f, u = 0.f;
  if ((D & 7) == 0) {
    gate_up_dots(wg, wu, x, D >> 3, lane, g, u);
  } else {
    for (int i = lane; i < D; i += 32) {
      g = fmaf(bf(wg[i]), x[i], g);
      u = fmaf(bf(wu[i]), x[i], u);
    }
  }
  g = warp_sum(g);
  u = warp_sum(u);
  if (lane == 0) act[size_t(tk) * F + f] = silu(g) * u;
}

// grid (ceil(D / R), T), R = NR * max(1, kWarps / K) * m output rows per block. The block's jobs
// (job j: expert k = j % K, rows d0 + NR * (j / K) + 0 .. NR - 1) go to its warps round-robin; a
// warp streams its job's NR rows together (NR * CH loads per lane in flight), so a block keeps
// enough loads in flight even at small K and no warp waits on another expert. The block then
// sums each row's K partials in k order (deterministic), weighted, into x (the residual add).
// MINB: blocks per SM the register budget must allow. PIPE: a warp's rounds of loads -- across its
// jobs -- are issued one round ahead of the dot products (a second set of registers, so MINB 2 and
// m > 1 to keep one wave); the same sums in the same order.
template <int NR, int CH, int MINB, bool PIPE>
__global__ void __launch_bounds__(kWarps * 32, MINB) moe_down_kernel(float* __restrict__ x,
                                                                  const float* __restrict__ act,
                                                                  const bf16* __restrict__ Wd,
                                                                  const int32_t* __restrict__ ids,
                                                                  const float* __restrict__ weights, int K, int D,
                                                                  int F, int R, const long long* acc, int E,
                                                                  bool warp_topk) {
  __shared__ float part[kDownPart];  // [R, K]
  const int lane = threadIdx.x & 31, t = blockIdx.y, d0 = blockIdx.x * R, jobs = K * (R / NR);
  // The first round of the warp's first job is loaded BEFORE pdl_wait(): ids come from moe_route,
  // the kernel before the previous one, which had finished before moe_gate_up (whose blocks all
  // passed their pdl_wait() before this grid could start) went on; weights no kernel writes.
  // With acc (the router folded into the o projection, two kernels back) the block selects the
  // token's experts from the logits itself, as moe_gate_up_routed did: the same ranking of the same bits.
  __shared__ float lg[kRouteMaxE];
  __shared__ int32_t sid[kRouteMaxK];
  if (acc) {
    if (threadIdx.x < E) lg[threadIdx.x] = logit_of(acc[(size_t(t) * E + threadIdx.x) * kRouterLogitStride]);
    __syncthreads();
    select_topk_token(sid, lg, E, K, warp_topk);
    __syncthreads();
  }
  auto job_rows = [&](int j) {
    const int e = acc ? sid[j % K] : ids[t * K + j % K];
    return Wd + (size_t(e) * D + d0 + NR * (j / K)) * F;
  };
  auto job_nr = [&](int j) { return max(0, min(NR, D - (d0 + NR * (j / K)))); };
  // A warp's work as units: its jobs j0, j0 + kWarps, ..., each in Q rounds of 32 * CH chunks.
  const int j0 = threadIdx.x >> 5, F8 = F >> 3, Q = (F8 + 32 * CH - 1) / (32 * CH);
  const int units = (F & 7) == 0 && j0 < jobs ? ((jobs - 1 - j0) / kWarps + 1) * Q : 0;
  auto load_unit = [&](uint4(&v)[NR][CH], int u) {
    const int j = j0 + u / Q * kWarps;
    load_row_chunks(v, job_rows(j), F, job_nr(j), lane + u % Q * 32 * CH, F8);
  };
  uint4 wv[NR][CH];
  if (units > 0) load_unit(wv, 0);
  // The routing weights (moe_route's) and the residual (written by the o projection, before
  // moe_route started) are final too: loaded now, they are off the end of the critical path.
  // With acc the weights come from moe_gate_up_routed, the kernel before: read after the wait.
  __shared__ float wk[kRouteMaxK];
  if (!acc && threadIdx.x < K) wk[threadIdx.x] = weights[t * K + threadIdx.x];
  const int r = threadIdx.x;
  const float x_old = r < R && d0 + r < D ? x[size_t(t) * D + d0 + r] : 0.f;
  pdl_start();
  if (acc && threadIdx.x < K) wk[threadIdx.x] = weights[t * K + threadIdx.x];
  float s[NR] = {};
  auto dot_unit = [&](const uint4(&v)[NR][CH], int u) {  // and the job's partials after its last round
    const int j = j0 + u / Q * kWarps, k = j % K, r0 = NR * (j / K), nr = job_nr(j), base = lane + u % Q * 32 * CH;
    const float* a = act + (size_t(t) * K + k) * F;
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      if (base + 32 * c >= F8) break;
      const float* ac = a + 8 * (base + 32 * c);
      const float4 lo = *reinterpret_cast<const float4*>(ac), hi = *reinterpret_cast<const float4*>(ac + 4);
#pragma unroll
      for (int q = 0; q < NR; ++q)
        if (q < nr) s[q] += dot8(v[q][c], lo, hi);
    }
    if (u % Q != Q - 1) return;
#pragma unroll
    for (int q = 0; q < NR; ++q) {
      const float sum = warp_sum(s[q]);
      s[q] = 0.f;
      if (lane == 0) part[(r0 + q) * K + k] = sum;
    }
  };
  if constexpr (PIPE) {
    uint4 wn[NR][CH];
    stream_units(wv, wn, units, load_unit, dot_unit);
  } else {
    for (int u = 0; u < units; ++u) {
      if (u > 0) load_unit(wv, u);
      dot_unit(wv, u);
    }
  }
  if ((F & 7) != 0)  // rows of any length: scalar loads
    for (int j = j0; j < jobs; j += kWarps) {
      const int k = j % K, r0 = NR * (j / K), nr = job_nr(j);
      const bf16* w = job_rows(j);
      const float* a = act + (size_t(t) * K + k) * F;
      for (int i = lane; i < F; i += 32)
#pragma unroll
        for (int q = 0; q < NR; ++q)
          if (q < nr) s[q] = fmaf(bf(w[size_t(q) * F + i]), a[i], s[q]);
#pragma unroll
      for (int q = 0; q < NR; ++q) {
        const float sum = warp_sum(s[q]);
        s[q] = 0.f;
        if (lane == 0) part[(r0 + q) * K + k] = sum;
      }
    }
  __syncthreads();
  if (r < R && d0 + r < D) {
    float total = 0.f;
    for (int k = 0; k < K; ++k) total = fmaf(wk[k], part[r * K + k], total);
    x[size_t(t) * D + d0 + r] = x_old + total;
  }
}

}  // namespace

cudaError_t route_topk(int32_t* ids, float* weights, const float* logits, int T, int E, int K, bool renormalize,
                       cudaStream_t s) {
  if (E > kRouteMaxE || K > kRouteMaxK || K > E) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  route_topk_kernel<<<T, kWarps * 32, 0, s>>>(ids, weights, logits, E, K, renormalize);
  return cudaGetLastError();
}

cudaError_t moe_route(float* h, int32_t* ids, float* weights, const float* x, const float* norm_w, float eps,
                      const bf16* Wr, int T, int E, int K, int D, bool renormalize, cudaStream_t s) {
  if (E > kRouteMaxE || K > kRouteMaxK || K > E || T > kGemvMaxT) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  const unsigned cluster = unsigned(std::min((E + kWarps - 1) / kWarps, kRouteMaxCluster));
  cudaError_t e;
#define TIERMOE_MOE_ROUTE(TT)                                                                                         \
  {                                                                                                                   \
    static const cudaError_t allowed =                                                                                \
        cudaFuncSetAttribute(moe_route_kernel<TT>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);        \
    e = allowed != cudaSuccess ? allowed                                                                              \
                               : launch_clusters(cluster, moe_route_kernel<TT>, cluster, kWarps * 32, 0, s, h, \
                                                 ids, weights, x, norm_w, eps, Wr, T, E, K, D, renormalize, \
                                                 stage_fits(T, D));          \
  }
  if (T == 1) TIERMOE_MOE_ROUTE(1)
  else if (T == 2) TIERMOE_MOE_ROUTE(2)
  else if (T <= 4) TIERMOE_MOE_ROUTE(4)
  else TIERMOE_MOE_ROUTE(8)
#undef TIERMOE_MOE_ROUTE
  return e != cudaSuccess ? e : cudaGetLastError();
}

cudaError_t moe_gate_up(float* act, const float* h, const bf16* Wgu, const int32_t* ids, int T, int K, int F, int D,
                        cudaStream_t s) {
  if (T == 0) return cudaSuccess;
  return launch(moe_gate_up_kernel, dim3((F + kWarps - 1) / kWarps, T * K), kWarps * 32, 0, s, act, h, Wgu, ids, K, F, D);
}

cudaError_t moe_gate_up_routed(float* act, int32_t* ids, float* weights, const float* h, const float* norm_w, float eps,
                               const long long* acc, const bf16* Wgu, int T, int E, int K, int F, int D,
                               bool renormalize, cudaStream_t s) {
  if (!router_in_oproj_fits(D, E, K) || T > kGemvMaxT) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  if (T == 1 && D % 2048 == 0 && g_gate_up_stream > 0)
    return launch(moe_gate_up_stream_kernel, g_gate_up_stream * sm_count() + 1, kWarps * 32, 0, s, act, ids, weights,
                  h, norm_w, eps, acc, Wgu, E, K, F, D, renormalize, g_warp_topk);
  return launch(moe_gate_up_routed_kernel, dim3((F + kWarps - 1) / kWarps + 1, T * K), kWarps * 32, 0, s, act, ids,
                weights, h, norm_w, eps, acc, Wgu, E, K, F, D, renormalize, g_warp_topk);
}

void set_moe_gate_up_stream(int blocks_per_sm) { g_gate_up_stream = std::clamp(blocks_per_sm, 0, kStreamBlocksPerSm); }
void set_moe_warp_topk(bool on) { g_warp_topk = on; }
bool moe_warp_topk() { return g_warp_topk; }

namespace {
// moe_down's shapes: rows per warp NR (4 or 2; 16-byte loads per row per round 8 / NR), 4 blocks per
// SM. The launch takes the one whose grid is the largest that fits one wave (4 blocks per SM),
// else the smallest: measured end to end on the H200 (docs/benchmarks.md), the grid that fills one
// wave won both ways -- NR 2 (512 blocks) at Mixtral's D = 4096, K = 2 (7.99 against 8.09 ms per
// token), NR 4 (512 blocks) at OLMoE's / Qwen3-30B-A3B's D = 2048, K = 8 by 2-3%.
// The pipelined shapes (PIPE, 2 blocks per SM) take m times the rows per block, for one wave of
// their own. For one token the launch takes the pipelined NR 4 where a job's rows are not exactly two
// rounds: measured (docs/benchmarks.md), it won at Qwen3-30B-A3B's F = 768 (rounds of 64 and 32
// chunks; -2.4 to -2.7% per token) and Mixtral's F = 14336 (28 rounds; -0.9%), and lost at
// OLMoE's F = 1024 (two full rounds; +1.5 to +1.7%). Three shapes, not a model of why.
// The pipelined NR 2 lost to the pipelined NR 4 on every shape measured, so it is not built.
// TIERMOE_CUDA_DOWN=1 / 2 pins NR 2 / 4, 3 the pipelined NR 4 (A/B; set_moe_down_variant).
using DownKernel = void (*)(float*, const float*, const bf16*, const int32_t*, const float*, int, int, int, int,
                           const long long*, int, bool);
constexpr DownKernel kDown2 = moe_down_kernel<2, 4, 4, false>, kDown4 = moe_down_kernel<4, 2, 4, false>;
constexpr DownKernel kDownPipe4 = moe_down_kernel<4, 2, kStreamBlocksPerSm, true>;
int g_moe_down_variant = 0;
}  // namespace

int moe_down_variants() { return 4; }
void set_moe_down_variant(int v) { g_moe_down_variant = v >= 0 && v < moe_down_variants() ? v : 0; }

cudaError_t moe_down(float* x, const float* act, const bf16* Wd, const int32_t* ids, const float* weights, int T,
                     int K, int D, int F, cudaStream_t s, const long long* acc, int E) {
  if (T == 0) return cudaSuccess;
  if (K < 1 || K > kRouteMaxK || (acc && (E < K || E > kRouteMaxE))) return cudaErrorInvalidValue;
  if (acc && moe_down_tc_chosen(T, E, K, F)) return moe_down_tc(x, act, Wd, weights, acc, T, E, K, D, F, s);
  const int groups = std::max(1, kWarps / K);  // groups of NR rows per block (K jobs each): R = NR * groups
  const int chunks = F / 8, round4 = 32 * 2;  // a row's 16-byte chunks; NR 4's chunks per round
  const bool pipe = T == 1 && F % 8 == 0 && chunks != 2 * round4;
  const int v = g_moe_down_variant ? g_moe_down_variant : (pipe ? 3 : 0);
  if (v == 3) {  // pipelined: rows per block R = 4 * groups * m, the smallest m with one wave at 2 blocks per SM
    const int base = 4 * groups;
    int R = base;
    while ((D + R - 1) / R * T > kStreamBlocksPerSm * sm_count() && (R + base) * K <= kDownPart && R + base <= kWarps * 32) R += base;
    if (R * K <= kDownPart)
      return launch(kDownPipe4, dim3((D + R - 1) / R, T), kWarps * 32, 0, s, x, act, Wd, ids,
                    weights, K, D, F, R, acc, E, g_warp_topk);
  }
  const int blocks_of_two = (D + 2 * groups - 1) / (2 * groups) * T;
  const bool two = v == 1 || (v != 2 && blocks_of_two <= 4 * sm_count());
  const int R = (two ? 2 : 4) * groups;
  return launch(two ? kDown2 : kDown4, dim3((D + R - 1) / R, T), kWarps * 32, 0, s, x, act, Wd, ids, weights, K, D, F,
                R, acc, E, g_warp_topk);
}
}  // namespace tiermoe::cuda
