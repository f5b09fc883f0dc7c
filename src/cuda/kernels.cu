// The CUDA kernels declared in kernels.h. Plain CUDA C++ for sm_90; no tensor-core code here
// (large-T matrix products go to cuBLAS).
#include "cuda/kernels.h"

#include "cuda/attention_merge.cuh"
#include "cuda/dependent_launch.cuh"
#include "cuda/device_math.cuh"

#include <cfloat>
#include <climits>
#include <algorithm>
#include <cmath>

#include <cooperative_groups.h>
#include <cuda_bf16.h>

namespace tiermoe::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kWarps = 8;  // warps per block in the GEMV-style kernels
// The GEMV-style kernels read weights in rounds of kLoads 16-byte loads per lane, all issued before
// any is used, so that the memory system sees them together whatever the compiler schedules
// (a 2048-wide BF16 row is 8 per lane; moe_down's warps take 2 or 4 rows of an expert at once
// for that). 16 per lane took ~130 registers and halved the blocks per SM.
constexpr int kLoads = 8;
constexpr int kGemvRows = 1;
constexpr int kMaxDownRows = 4;  // moe_down's rows per warp at most (its variants below)
constexpr int kGemvBlockRows = kWarps * kGemvRows;
static_assert(kWarps * 32 >= kRouteMaxE, "route_token ranks one expert per thread");
constexpr int kRouteMaxCluster = 16;  // moe_route's blocks (16: a non-portable cluster size, Hopper has it)

// The router folded into the o projection (RouterLogits, kernels.h) sums each block's share of the
// unscaled logits in fixed point, units of 2^-32, with integer atomics: the same bits in any block
// order, where float atomics would make a step's routing depend on scheduling.
__device__ __forceinline__ void add_logit(long long* acc, float v) {
  atomicAdd(reinterpret_cast<unsigned long long*>(acc), static_cast<unsigned long long>(__float2ll_rn(v * 0x1p32f)));
}
__device__ __forceinline__ float logit_of(long long a) { return float(__ll2double_rn(a) * 0x1p-32); }

// wv[r][j] = chunk (base + lane + 32 j) of row r (rows stride apart), for rows r < nr and chunks
// < L8 (16-byte chunks per row); the others are left as they are.
template <int NR, int CH>
__device__ __forceinline__ void load_row_chunks(uint4 (&wv)[NR][CH], const bf16* __restrict__ w, size_t stride,
                                                int nr, int base, int L8) {
#pragma unroll
  for (int r = 0; r < NR; ++r)
#pragma unroll
    for (int j = 0; j < CH; ++j)
      if (r < nr && base + 32 * j < L8) wv[r][j] = ldg16(w + r * stride + 8 * size_t(base + 32 * j));
}

__global__ void embed_kernel(float* x, const bf16* table, const int32_t* ids, int D) {
  const int t = blockIdx.x;
  const bf16* row = table + size_t(ids[t]) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) x[size_t(t) * D + d] = bf(row[d]);
}

__global__ void rmsnorm_kernel(float* y, const float* x, const float* w, int D, float eps) {
  const size_t r = blockIdx.x;
  const float* xr = x + r * D;
  float ss = 0.f;
  for (int d = threadIdx.x; d < D; d += blockDim.x) ss = fmaf(xr[d], xr[d], ss);
  __shared__ float part[32];
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0.f;
    v = warp_sum(v);
    if (threadIdx.x == 0) part[0] = v;
  }
  __syncthreads();
  const float inv = 1.0f / sqrtf(part[0] / float(D) + eps);
  for (int d = threadIdx.x; d < D; d += blockDim.x) y[r * D + d] = xr[d] * inv * w[d];
}

// grid (segments, T): a segment is one head (norm per head, or no norm), or with `full` all heads
// of q or of k (norm over the whole projection, which one block must see); q's segments first.
// A thread per rotated pair where the block allows. RMSNorm over the segment, then RoPE, in place.
// With kv.table, k's segments also write their rotated keys and the values v to cache row pos[t].
__global__ void qk_norm_rope_kernel(float* q, float* k, const float* qn, const float* kn, bool full,
                                    const int32_t* pos, int H, int Hkv, int Dh, float eps, float theta, KvPages kv,
                                    const float* vin) {
  pdl_wait();
  pdl_launch_dependents();
  const int seg = blockIdx.x, t = blockIdx.y, half = Dh / 2;
  const int q_segs = full ? 1 : H;
  const bool is_q = seg < q_segs;
  const int heads = full ? (is_q ? H : Hkv) : 1, len = heads * Dh;
  const float* nw = is_q ? qn : kn;
  const size_t first = size_t(full ? 0 : (is_q ? seg : seg - q_segs)) * Dh;  // the segment in its head row
  float* v = (is_q ? q + size_t(t) * H * Dh : k + size_t(t) * Hkv * Dh) + first;
  // With the append: the segment's place in cache row pos[t].
  const bool append = !is_q && kv.table;
  const size_t cache_at = append ? kv_row(kv.table, pos[t]) * size_t(Hkv) * Dh + first : 0;
  float inv = 1.f;
  if (nw) {
    __shared__ float part[32];
    float ss = 0.f;
    for (int i = threadIdx.x; i < len; i += blockDim.x) ss = fmaf(v[i], v[i], ss);
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    __syncthreads();
    ss = 0.f;
    for (int w = 0; w < int(blockDim.x >> 5); ++w) ss += part[w];
    inv = 1.0f / sqrtf(ss / float(len) + eps);
  }
  const float p = float(pos[t]);
  for (int i = threadIdx.x; i < heads * half; i += blockDim.x) {
    const int h = i / half, j = i % half;
    const float inv_freq = 1.0f / powf(theta, float(2 * j) / float(Dh));
    float sn, cs;
    sincosf(inv_freq * p, &sn, &cs);
    float* r = v + size_t(h) * Dh;
    const int wj = full ? h * Dh + j : j;  // norm weights span the segment
    const float a = nw ? r[j] * inv * nw[wj] : r[j], b = nw ? r[j + half] * inv * nw[wj + half] : r[j + half];
    r[j] = a * cs - b * sn;
    r[j + half] = b * cs + a * sn;
    if (append) {
      const size_t at = cache_at + size_t(h) * Dh;
      reinterpret_cast<__nv_bfloat16*>(kv.k)[at + j] = __float2bfloat16_rn(r[j]);
      reinterpret_cast<__nv_bfloat16*>(kv.k)[at + j + half] = __float2bfloat16_rn(r[j + half]);
    }
  }
  if (append)  // the segment's values, as they are
    for (int i = threadIdx.x; i < len; i += blockDim.x)
      reinterpret_cast<__nv_bfloat16*>(kv.v)[cache_at + i] = __float2bfloat16_rn(vin[size_t(t) * Hkv * Dh + first + i]);
}

__global__ void add_bias_kernel(float* x, const float* b, int T, int N) {
  const size_t n = size_t(T) * N;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    x[i] += b[i % N];
}

__global__ void clamp_kernel(float* x, size_t n, float c) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    x[i] = fminf(c, fmaxf(-c, x[i]));
}

__global__ void silu_mul_gu_kernel(float* act, const float* gu, int T, int F) {
  const size_t n = size_t(T) * F;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const size_t t = i / F, f = i % F;
    act[i] = silu(gu[t * 2 * F + f]) * gu[t * 2 * F + F + f];
  }
}

__global__ void add_sigmoid_scaled_kernel(float* x, const float* y, const float* g, int T, int D) {
  const size_t n = size_t(T) * D;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    x[i] += 1.0f / (1.0f + expf(-g[i / D])) * y[i];
}

// hi[i], lo[i] = bf16_split(x[i]) (lo optional).
__global__ void to_bf16_kernel(__nv_bfloat16* hi, __nv_bfloat16* lo, const float* x, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    __nv_bfloat16 h, l;
    bf16_split(x[i], h, l);
    hi[i] = h;
    if (lo) lo[i] = l;
  }
}

// The GEMV-style kernels' input, staged once per block in shared memory: x (times nw with a norm),
// and each token's inv = 1 / rms(x). Why: with every warp reading x (and nw) itself, a row of 4 KB
// of weights cost 8-16 KB of L1 loads, and L1 throughput, not DRAM, bounded the kernel (the folded
// attention norm alone cost 4.8 us per layer of a 1.27 ms OLMoE step). Used where T * K fits.
constexpr int kStageFloats = 4096;  // 16 KB: T = 1 up to K = 4096, T = 2 up to 2048
struct alignas(16) GemvStage {  // x is read and written as float4
  float x[kStageFloats];  // [T, K]: x, or x * nw
  float inv[kGemvMaxT];
  float red[kWarps][kGemvMaxT];
};
bool g_gemv_stage = true;  // TIERMOE_CUDA_GEMV_STAGE=0: the fold below (each warp reads x itself)

// Whether a GEMV-style launch stages x (the same answer for every block of the launch).
bool stage_fits(int T, int K) { return g_gemv_stage && K % 8 == 0 && T * K <= kStageFloats; }

// All threads of the block, no barrier: st.x = x (* nw), and with NORM st.red[warp][t] = each warp's
// share of sum(x_t^2) (stage_x, below, finishes the norm).
template <int TT, bool NORM>
__device__ void stage_x_rows(GemvStage& st, const float* __restrict__ x, const float* __restrict__ nw, int T, int K) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, K4 = K >> 2;
#pragma unroll
  for (int t = 0; t < TT; ++t) {
    if (t >= T) break;
    float ss = 0.f;
    for (int i = threadIdx.x; i < K4; i += blockDim.x) {
      float4 v = reinterpret_cast<const float4*>(x + size_t(t) * K)[i];
      if constexpr (NORM) {
        ss = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, ss))));
        const float4 c = reinterpret_cast<const float4*>(nw)[i];
        v = make_float4(v.x * c.x, v.y * c.y, v.z * c.z, v.w * c.w);
      }
      reinterpret_cast<float4*>(st.x + t * K)[i] = v;
    }
    if constexpr (NORM) {
      ss = warp_sum(ss);
      if (lane == 0) st.red[warp][t] = ss;
    }
  }
}

// All threads of the block: st.x = x (* nw), st.inv[t] = 1 / sqrt(mean(x_t^2) + eps) with NORM.
template <int TT, bool NORM>
__device__ void stage_x(GemvStage& st, const float* __restrict__ x, const float* __restrict__ nw, float eps, int T,
                        int K) {
  stage_x_rows<TT, NORM>(st, x, nw, T, K);
  __syncthreads();
  if (NORM && threadIdx.x < T) {
    float ss = 0.f;
    for (int w = 0; w < int(blockDim.x >> 5); ++w) ss += st.red[w][threadIdx.x];
    st.inv[threadIdx.x] = 1.0f / sqrtf(ss / float(K) + eps);
  }
  __syncthreads();
}

// Lane 0 loads y's rows n0 .. n0 + nr - 1 of all T tokens, to add to at the end: loaded before the
// dot products, the residual's read is off the end of the kernel's critical path.
template <int TT, int NR>
__device__ __forceinline__ void prefetch_rows(float (&old)[NR][TT], const float* y, int T, int N, int n0, int nr,
                                              int lane) {
  if (lane != 0) return;
#pragma unroll
  for (int t = 0; t < TT; ++t)
#pragma unroll
    for (int r = 0; r < NR; ++r)
      if (t < T && r < nr) old[r][t] = y[size_t(t) * N + n0 + r];
}

// One warp computes output rows n0 .. n0 + NR - 1 of y[T, N] = xn[T, K] W[N, K]^T for all
// T <= TT tokens, each weight row read once. xn = x, or with NORM xn = rmsnorm(x) * nw, computed as
// inv_t * (W (x * nw)). x comes from the block's stage (stage_x) where it fits; elsewhere every lane
// reads its share of x itself and gathers the sum of squares from those loads (the fold).
// The first round of weight loads is issued BEFORE pdl_wait(): no kernel writes weights, so under
// programmatic launch they stream in while the previous kernel finishes. Calls pdl_wait() /
// pdl_launch_dependents() itself; every thread of the block must call it (warps past N only
// wait). inv_out[t] gets inv_t (NORM, n0 < N). With st (stage_fits(T, K), the same for the whole
// block) x is taken from the block's stage instead, staged here after the wait if `stage` is set
// (every thread of the block must then be here: stage_x has barriers).
template <int TT, bool NORM, int NR = kGemvRows>
__device__ __forceinline__ void gemv_rows(float* __restrict__ y, const float* __restrict__ x,
                                          const float* __restrict__ nw, float eps, const bf16* __restrict__ W, int T,
                                          int N, int K, bool accumulate, int n0, int lane, float* inv_out = nullptr,
                                          GemvStage* st = nullptr, bool stage = true) {
  constexpr int CH = kLoads / NR;
  const int nr = max(0, min(NR, N - n0));
  const bf16* w = W + size_t(nr > 0 ? n0 : 0) * K;
  float acc[NR][TT], ss[TT], old[NR][TT];  // old: y's values, for accumulate (lane 0)
#pragma unroll
  for (int t = 0; t < TT; ++t) {
    ss[t] = 0.f;
#pragma unroll
    for (int r = 0; r < NR; ++r) acc[r][t] = 0.f;
  }
  if ((K & 7) == 0) {
    const int K8 = K >> 3;
    uint4 wv[NR][CH] = {};
    load_row_chunks(wv, w, K, nr, lane, K8);
    pdl_wait();
    pdl_launch_dependents();
    if (accumulate) prefetch_rows<TT, NR>(old, y, T, N, n0, nr, lane);
    if (st && stage) stage_x<TT, NORM>(*st, x, nw, eps, T, K);
    if (nr == 0) return;
    const float* xin = st ? st->x : x;
    for (int base = lane; base < K8; base += 32 * CH) {
      if (base > lane) load_row_chunks(wv, w, K, nr, base, K8);
#pragma unroll
      for (int j = 0; j < CH; ++j) {
        const int i = base + 32 * j;
        if (i >= K8) break;
#pragma unroll
        for (int t = 0; t < TT; ++t) {
          if (t >= T) break;
          const float* xi = xin + size_t(t) * K + 8 * i;
          float4 a = *reinterpret_cast<const float4*>(xi), b = *reinterpret_cast<const float4*>(xi + 4);
          if (NORM && !st) {
            const float4 c = *reinterpret_cast<const float4*>(nw + 8 * i), d = *reinterpret_cast<const float4*>(nw + 8 * i + 4);
            ss[t] = fmaf(a.x, a.x, fmaf(a.y, a.y, fmaf(a.z, a.z, fmaf(a.w, a.w, ss[t]))));
            ss[t] = fmaf(b.x, b.x, fmaf(b.y, b.y, fmaf(b.z, b.z, fmaf(b.w, b.w, ss[t]))));
            a = make_float4(a.x * c.x, a.y * c.y, a.z * c.z, a.w * c.w);
            b = make_float4(b.x * d.x, b.y * d.y, b.z * d.z, b.w * d.w);
          }
#pragma unroll
          for (int r = 0; r < NR; ++r) acc[r][t] += dot8(wv[r][j], a, b);
        }
      }
    }
  } else {
    pdl_wait();
    pdl_launch_dependents();
    if (nr == 0) return;
    if (accumulate) prefetch_rows<TT, NR>(old, y, T, N, n0, nr, lane);
    for (int i = lane; i < K; i += 32) {
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        if (t >= T) break;
        float xv = x[size_t(t) * K + i];
        if constexpr (NORM) {
          ss[t] = fmaf(xv, xv, ss[t]);
          xv *= nw[i];
        }
#pragma unroll
        for (int r = 0; r < NR; ++r)
          if (r < nr) acc[r][t] = fmaf(bf(w[size_t(r) * K + i]), xv, acc[r][t]);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < TT; ++t) {
    if (t >= T) break;
    float inv = 1.f;
    if constexpr (NORM) {
      inv = st ? st->inv[t] : 1.0f / sqrtf(warp_sum(ss[t]) / float(K) + eps);  // as rmsnorm() computes it
      if (inv_out) inv_out[t] = inv;
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const float s = warp_sum(acc[r][t]) * inv;
      if (lane == 0 && r < nr) {
        y[size_t(t) * N + n0 + r] = accumulate ? old[r][t] + s : s;
      }
    }
  }
}

// With rl.acc: thread e < rl.E then adds its expert's share of the unscaled router logits over the
// block's rows of y, rl.Wr[e, rows] . (y[t, rows] * rl.norm_w[rows]), into rl.acc[t, e] (y = h, the
// residual stream after this projection; its weights are loaded before the wait).
template <int TT, bool NORM>
__global__ void __launch_bounds__(kWarps * 32) gemv_kernel(float* __restrict__ y, const float* __restrict__ x,
                                                           const bf16* __restrict__ W, int T, int N, int K,
                                                           bool accumulate, const float* __restrict__ nw, float eps,
                                                           bool staged, RouterLogits rl) {
  __shared__ GemvStage st;
  const int d0 = blockIdx.x * kGemvBlockRows, n0 = d0 + (threadIdx.x >> 5) * kGemvRows, e = threadIdx.x;
  const bool routes = rl.acc && e < rl.E;
  float wr[kGemvBlockRows];
#pragma unroll
  for (int r = 0; r < kGemvBlockRows; ++r)
    wr[r] = routes && d0 + r < N ? bf(rl.Wr[size_t(e) * N + d0 + r]) * rl.norm_w[d0 + r] : 0.f;
  gemv_rows<TT, NORM>(y, x, nw, eps, W, T, N, K, accumulate, n0, threadIdx.x & 31, nullptr, staged ? &st : nullptr);
  if (!rl.acc) return;
  __syncthreads();  // the block's rows of y are written
  if (!routes) return;
#pragma unroll
  for (int t = 0; t < TT; ++t) {
    if (t >= T) break;
    float p = 0.f;
#pragma unroll
    for (int r = 0; r < kGemvBlockRows; ++r)
      if (d0 + r < N) p = fmaf(wr[r], y[size_t(t) * N + d0 + r], p);
    add_logit(rl.acc + (size_t(t) * rl.E + e) * kRouterLogitStride, p);
  }
}

// Up to three matrices sharing x (q, k, v): blocks [0, b0) do segment 0, [b0, b1) segment 1, ...
struct GemvSegs {
  float* y[3];
  const bf16* W[3];
  int N[3];
  int end_block[3];
  long long* zero;  // zero_n slots of the router's accumulator (RouterLogits) <- 0 by block 0 after the wait
  int zero_n;
};

// NR rows per warp: 2 for one token (half the blocks of NR = 1: one wave at the OLMoE / Qwen3
// shapes instead of about 1.5; 3-5% faster per token, docs/benchmarks.md), else 1 (T > 1 was not
// timed). TIERMOE_CUDA_GEMV3_ROWS=1|2 forces either (A/B timing).
template <int TT, bool NORM, int NR>
__global__ void __launch_bounds__(kWarps * 32) gemv3_kernel(GemvSegs segs, const float* __restrict__ x, int T,
                                                            int K, const float* __restrict__ nw, float eps,
                                                            bool staged) {
  __shared__ GemvStage st;
  const int b = blockIdx.x;
  const int s = b < segs.end_block[0] ? 0 : (b < segs.end_block[1] ? 1 : 2);
  const int first = s == 0 ? 0 : (s == 1 ? segs.end_block[0] : segs.end_block[1]);
  // Selected with constant indices: a run-time index into the parameter arrays would put them in local memory.
  float* y = s == 0 ? segs.y[0] : (s == 1 ? segs.y[1] : segs.y[2]);
  const bf16* W = s == 0 ? segs.W[0] : (s == 1 ? segs.W[1] : segs.W[2]);
  const int N = s == 0 ? segs.N[0] : (s == 1 ? segs.N[1] : segs.N[2]);
  const int n0 = ((b - first) * kWarps + (threadIdx.x >> 5)) * NR;
  gemv_rows<TT, NORM, NR>(y, x, nw, eps, W, T, N, K, false, n0, threadIdx.x & 31, nullptr, staged ? &st : nullptr);
  if (b == 0)
    for (int i = threadIdx.x; i < segs.zero_n; i += blockDim.x) segs.zero[size_t(i) * kRouterLogitStride] = 0;
}

// Router logits as NaN-proof values: NaN ranks last, so every rank gets exactly one expert.
__device__ __forceinline__ float rank_value(float v) { return v != v ? -INFINITY : v; }

// All threads of the block: ids[rank] = e for the K experts whose logits l[e] rank first, a rank
// being the count of logits that beat e's (ties to the lower index, as route_softmax_topk). P
// consecutive threads count for one expert, each a P-th of the comparisons (P: a power of two up
// to 32 with P * E <= blockDim.x), summed by shuffles. No barrier: the caller's publishes ids[].
__device__ void select_topk(int32_t* ids, const float* l, int E, int K) {
  int P = 1;
  while (P < 32 && 2 * P * E <= int(blockDim.x)) P *= 2;
  const int e = threadIdx.x / P, part = threadIdx.x % P;
  int rank = 0;
  if (e < E) {
    const float v = rank_value(l[e]);
    for (int j = part; j < E; j += P) {
      const float lj = rank_value(l[j]);
      rank += lj > v || (lj == v && j < e);
    }
  }
  for (int o = 1; o < P; o <<= 1) rank += __shfl_xor_sync(0xffffffffu, rank, o);
  if (e < E && part == 0 && rank < K) ids[rank] = e;
}

// One block of kWarps * 32 >= E threads routes one token: l[E] -> ids[K], weights[K]: top-k of l
// (select_topk), softmax over all E of scale * l (scale > 0 keeps the ranking; 1 leaves l's bits as
// they are), weights summed in k order when renormalized.
__device__ void route_token(int32_t* ids, float* weights, const float* l, int E, int K, bool renormalize,
                            float scale = 1.f) {
  __shared__ float red[kWarps], prob[kRouteMaxE];
  const int e = threadIdx.x, lane = e & 31, warp = e >> 5;
  const float v = e < E ? scale * rank_value(l[e]) : -INFINITY;
  float m = warp_max(v);
  if (lane == 0) red[warp] = m;
  __syncthreads();
  m = red[0];
  for (int w = 1; w < kWarps; ++w) m = fmaxf(m, red[w]);
  __syncthreads();
  const float p = e < E ? expf(v - m) : 0.f;
  if (e < E) prob[e] = p;
  float den = warp_sum(p);
  if (lane == 0) red[warp] = den;
  select_topk(ids, l, E, K);
  __syncthreads();
  den = 0.f;
  for (int w = 0; w < kWarps; ++w) den += red[w];
  if (e < K) {
    float sum = 0.f;
    for (int k = 0; k < K; ++k) sum += prob[ids[k]] / den;
    const float pe = prob[ids[e]] / den;
    weights[e] = renormalize ? pe / sum : pe;
  }
  __syncthreads();  // red[] and prob[] are reused by the next call
}

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

// The router's last step and moe_gate_up in one launch (RouterLogits, kernels.h). grid (ceil(F / kWarps)
// + 1, T*K): every block selects its token's experts itself from the logits acc[t] (select_topk),
// with h_t * nw staged in shared memory; then one warp per (t, k, f) as moe_gate_up, scaled by inv =
// 1 / rms(h_t) at the end. Only the selection stands between the wait and the weight loads (the sum
// of squares is gathered with the stage and summed after). The last column's blocks have no rows:
// for k = 0 it computes the token's softmax weights (inv * acc) and writes them with the ids,
// beside the others' loads instead of after a block's rows.
__global__ void __launch_bounds__(kWarps * 32) moe_gate_up_routed_kernel(float* __restrict__ act, int32_t* ids,
                                                                         float* weights, const float* __restrict__ h,
                                                                         const float* __restrict__ nw, float eps,
                                                                         const long long* acc,
                                                                         const bf16* __restrict__ Wgu, int E, int K,
                                                                         int F, int D, bool renormalize) {
  __shared__ GemvStage st;  // h_t * nw, and the warps' shares of sum(h_t^2)
  __shared__ float lg[kRouteMaxE], sw[kRouteMaxK];
  __shared__ int32_t sid[kRouteMaxK];
  pdl_wait();
  pdl_launch_dependents();
  const int tk = blockIdx.y, t = tk / K, k = tk % K, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x < E) lg[threadIdx.x] = logit_of(acc[(size_t(t) * E + threadIdx.x) * kRouterLogitStride]);
  stage_x_rows<1, true>(st, h + size_t(t) * D, nw, 1, D);
  __syncthreads();
  select_topk(sid, lg, E, K);
  __syncthreads();
  float ss = 0.f;
  for (int w = 0; w < kWarps; ++w) ss += st.red[w][0];
  const float inv = 1.0f / sqrtf(ss / float(D) + eps);  // as rmsnorm() computes it
  if (blockIdx.x == gridDim.x - 1) {  // the router column
    if (k != 0) return;
    route_token(sid, sw, lg, E, K, renormalize, inv);
    if (threadIdx.x < K) {
      ids[t * K + threadIdx.x] = sid[threadIdx.x];
      weights[t * K + threadIdx.x] = sw[threadIdx.x];
    }
    return;
  }
  const int f = blockIdx.x * kWarps + warp;
  if (f < F) {
    const bf16* wg = Wgu + (size_t(sid[k]) * 2 * F + f) * D;
    const bf16* wu = wg + size_t(F) * D;
    float g = 0.f, u = 0.f;
    gate_up_dots(wg, wu, st.x, D >> 3, lane, g, u);
    g = warp_sum(g) * inv;
    u = warp_sum(u) * inv;
    if (lane == 0) act[size_t(tk) * F + f] = silu(g) * u;
  }
}

// grid (ceil(F / kWarps), T*K): one warp per (t, k, f).
__global__ void __launch_bounds__(kWarps * 32) moe_gate_up_kernel(float* __restrict__ act, const float* __restrict__ h,
                                                                  const bf16* __restrict__ Wgu,
                                                                  const int32_t* __restrict__ ids, int K, int F, int D) {
  pdl_wait();
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

// grid (ceil(D / R), T), R = NR * max(1, kWarps / K) output rows per block. The block's jobs
// (job j: expert k = j % K, rows d0 + NR * (j / K) + 0 .. NR - 1) go to its warps round-robin; a
// warp streams its job's NR rows together (NR * CH loads per lane in flight), so a block keeps
// enough loads in flight even at small K and no warp waits on another expert. The block then
// sums each row's K partials in k order (deterministic), weighted, into x (the residual add).
// MINB: blocks per SM the register budget must allow.
template <int NR, int CH, int MINB>
__global__ void __launch_bounds__(kWarps * 32, MINB) moe_down_kernel(float* __restrict__ x,
                                                                  const float* __restrict__ act,
                                                                  const bf16* __restrict__ Wd,
                                                                  const int32_t* __restrict__ ids,
                                                                  const float* __restrict__ weights, int K, int D,
                                                                  int F, int R, const long long* acc, int E) {
  __shared__ float part[kMaxDownRows * kRouteMaxK];  // [R, K], R * K <= NR * max(kWarps, K)
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
    select_topk(sid, lg, E, K);
    __syncthreads();
  }
  auto job_rows = [&](int j) {
    const int e = acc ? sid[j % K] : ids[t * K + j % K];
    return Wd + (size_t(e) * D + d0 + NR * (j / K)) * F;
  };
  uint4 wv[NR][CH];
  const int j0 = threadIdx.x >> 5;
  if ((F & 7) == 0 && j0 < jobs) load_row_chunks(wv, job_rows(j0), F, max(0, min(NR, D - (d0 + NR * (j0 / K)))), lane, F >> 3);
  // The routing weights (moe_route's) and the residual (written by the o projection, before
  // moe_route started) are final too: loaded now, they are off the end of the critical path.
  // With acc the weights come from moe_gate_up_routed, the kernel before: read after the wait.
  __shared__ float wk[kRouteMaxK];
  if (!acc && threadIdx.x < K) wk[threadIdx.x] = weights[t * K + threadIdx.x];
  const int r = threadIdx.x;
  const float x_old = r < R && d0 + r < D ? x[size_t(t) * D + d0 + r] : 0.f;
  pdl_wait();
  pdl_launch_dependents();
  if (acc && threadIdx.x < K) wk[threadIdx.x] = weights[t * K + threadIdx.x];
  for (int j = j0; j < jobs; j += kWarps) {
    const int k = j % K, r0 = NR * (j / K), nr = max(0, min(NR, D - (d0 + r0)));
    const bf16* w = job_rows(j);
    const float* a = act + (size_t(t) * K + k) * F;
    float s[NR] = {};
    if ((F & 7) == 0) {
      const int F8 = F >> 3;
      for (int base = lane; base < F8; base += 32 * CH) {
        if (j != j0 || base != lane) load_row_chunks(wv, w, F, nr, base, F8);
#pragma unroll
        for (int c = 0; c < CH; ++c) {
          if (base + 32 * c >= F8) break;
          const float* ac = a + 8 * (base + 32 * c);
          const float4 lo = *reinterpret_cast<const float4*>(ac), hi = *reinterpret_cast<const float4*>(ac + 4);
#pragma unroll
          for (int r = 0; r < NR; ++r)
            if (r < nr) s[r] += dot8(wv[r][c], lo, hi);
        }
      }
    } else {
      for (int i = lane; i < F; i += 32)
#pragma unroll
        for (int r = 0; r < NR; ++r)
          if (r < nr) s[r] = fmaf(bf(w[size_t(r) * F + i]), a[i], s[r]);
    }
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      const float v = warp_sum(s[r]);
      if (lane == 0) part[(r0 + r) * K + k] = v;
    }
  }
  __syncthreads();
  if (r < R && d0 + r < D) {
    float total = 0.f;
    for (int k = 0; k < K; ++k) total = fmaf(wk[k], part[r * K + k], total);
    x[size_t(t) * D + d0 + r] = x_old + total;
  }
}

__global__ void kv_append_kernel(KvPages kv, const float* k, const float* v, const int32_t* pos, int row) {
  const int t = blockIdx.x;
  const size_t dst = kv_row(kv.table, pos[t]) * row, src = size_t(t) * row;
  for (int i = threadIdx.x; i < row; i += blockDim.x) {
    reinterpret_cast<__nv_bfloat16*>(kv.k)[dst + i] = __float2bfloat16_rn(k[src + i]);
    reinterpret_cast<__nv_bfloat16*>(kv.v)[dst + i] = __float2bfloat16_rn(v[src + i]);
  }
}

constexpr int kAttnWarps = 4;
constexpr int kAttnJ = kAttnMaxDh / 32;

// grid (H, n_splits, T), kAttnWarps warps. Warp w takes keys start+w, start+w+4, ... with an
// online softmax; lane holds dims lane, lane+32, ...; the warps merge in shared memory and the
// block writes (max, sum, unnormalized acc[Dh]) for its split.
__global__ void __launch_bounds__(kAttnWarps * 32) attention_split_kernel(
    float* __restrict__ partial, const float* __restrict__ q, KvPages kv, const int32_t* __restrict__ pos, int H,
    int Hkv, int Dh, int split_len) {
  const int h = blockIdx.x, s = blockIdx.y, t = blockIdx.z, n_splits = gridDim.y;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int n = pos[t] + 1, kvh = h / (H / Hkv);
  const int start = s * split_len, end = min(n, start + split_len);
  const float scale = rsqrtf(float(Dh));
  const size_t stride = size_t(Hkv) * Dh;
  float qr[kAttnJ], acc[kAttnJ];
  const float* qh = q + (size_t(t) * H + h) * Dh;
#pragma unroll
  for (int j = 0; j < kAttnJ; ++j) {
    const int d = lane + 32 * j;
    qr[j] = d < Dh ? qh[d] * scale : 0.f;
    acc[j] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  for (int key = start + w; key < end; key += kAttnWarps) {
    const size_t off = kv_row(kv.table, key) * stride + size_t(kvh) * Dh;
    const bf16 *kp = kv.k + off, *vp = kv.v + off;
    float sc = 0.f;
#pragma unroll
    for (int j = 0; j < kAttnJ; ++j) {
      const int d = lane + 32 * j;
      if (d < Dh) sc = fmaf(qr[j], bf(kp[d]), sc);
    }
    sc = warp_sum(sc);
    const float m_new = fmaxf(m, sc);
    const float corr = expf(m - m_new), p = expf(sc - m_new);
    l = l * corr + p;
#pragma unroll
    for (int j = 0; j < kAttnJ; ++j) {
      const int d = lane + 32 * j;
      if (d < Dh) acc[j] = acc[j] * corr + p * bf(vp[d]);
    }
    m = m_new;
  }
  __shared__ float sm[kAttnWarps], sl[kAttnWarps], sacc[kAttnWarps][kAttnMaxDh];
  if (lane == 0) {
    sm[w] = m;
    sl[w] = l;
  }
#pragma unroll
  for (int j = 0; j < kAttnJ; ++j) {
    const int d = lane + 32 * j;
    if (d < Dh) sacc[w][d] = acc[j];
  }
  __syncthreads();
  float M = -INFINITY;
#pragma unroll
  for (int i = 0; i < kAttnWarps; ++i) M = fmaxf(M, sm[i]);
  float* out = partial + ((size_t(t) * H + h) * n_splits + s) * (Dh + 2);
  for (int d = threadIdx.x; d < Dh; d += blockDim.x) {
    float a = 0.f;
    for (int i = 0; i < kAttnWarps; ++i)
      if (sm[i] != -INFINITY) a += sacc[i][d] * expf(sm[i] - M);
    out[2 + d] = a;
  }
  if (threadIdx.x == 0) {
    float L = 0.f;
    for (int i = 0; i < kAttnWarps; ++i)
      if (sm[i] != -INFINITY) L += sl[i] * expf(sm[i] - M);
    out[0] = M;
    out[1] = L;
  }
}

// grid T*H: merges the splits of one (t, h) (merge_splits: one L2 round trip where the rows fit in
// buf_floats of shared memory -- up to 94 splits at Dh 128 in 48 KB --, else in chunks of splits;
// ncu, H200, 40 splits: 9.8 us when it read them in place).
__global__ void attention_combine_kernel(float* out, const float* partial, int n_splits, int Dh, int buf_floats) {
  extern __shared__ __align__(16) float buf[];
  __shared__ float Mh[1], scale[1];
  pdl_wait();
  pdl_launch_dependents();
  const size_t th = blockIdx.x;
  merge_splits<4>(out + th * Dh, partial + th * n_splits * (Dh + 2), 1, n_splits, Dh, buf, buf_floats, Mh, scale);
}

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__global__ void fill_random_bf16_kernel(__nv_bfloat16* w, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint64_t r = mix64(seed * 0x9e3779b97f4a7c15ull + i);
    const float u = float(r >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    w[i] = __float2bfloat16_rn((2.f * u - 1.f) * scale);
  }
}

__global__ void fill_f32_kernel(float* p, size_t n, float value) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = value;
}

unsigned grid_for(size_t n, int threads = 256) {
  const size_t b = (n + threads - 1) / threads;
  return unsigned(b < 4096 ? (b > 0 ? b : 1) : 4096);
}

bool g_programmatic_launch = false;
int g_gemv3_rows = 0;  // gemv3's rows per warp: 0 chosen per launch, else forced
}  // namespace

bool programmatic_launch() { return g_programmatic_launch; }
void set_programmatic_launch(bool on) { g_programmatic_launch = on; }
void set_gemv_stage(bool on) { g_gemv_stage = on; }
void set_gemv3_rows(int rows) { g_gemv3_rows = rows == 1 || rows == 2 ? rows : 0; }

cudaError_t embed(float* x, const bf16* table, const int32_t* ids, int T, int D, cudaStream_t s) {
  if (T == 0) return cudaSuccess;
  embed_kernel<<<T, 256, 0, s>>>(x, table, ids, D);
  return cudaGetLastError();
}

cudaError_t rmsnorm(float* y, const float* x, const float* w, int rows, int D, float eps, cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  const int threads = D >= 1024 ? 1024 : (D >= 256 ? 256 : 64);
  rmsnorm_kernel<<<rows, threads, 0, s>>>(y, x, w, D, eps);
  return cudaGetLastError();
}

cudaError_t qk_norm_rope(float* q, float* k, const float* q_norm, const float* k_norm, bool full, const int32_t* pos,
                         int T, int H, int Hkv, int Dh, float eps, float theta, cudaStream_t s, KvPages append,
                         const float* v) {
  if ((q_norm == nullptr) != (k_norm == nullptr) || Dh % 2 != 0 || (append.table && !v)) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  full = full && q_norm;
  const int segs = full ? 2 : H + Hkv, pairs = (full ? H : 1) * Dh / 2;
  // A thread per rotated pair (up to 1024): each pair is a chain of dependent steps (load, norm,
  // powf + sincosf, store), and fewer threads lengthen it -- 256 per block cost 4-5% per token at
  // OLMoE's shape (docs/benchmarks.md).
  const int threads = std::min(1024, std::max(32, (pairs + 31) / 32 * 32));
  return launch(qk_norm_rope_kernel, dim3(segs, T), threads, 0, s, q, k, q_norm, k_norm, full, pos, H, Hkv, Dh, eps, theta,
                append, v);
}

cudaError_t add_bias(float* x, const float* b, int T, int N, cudaStream_t s) {
  add_bias_kernel<<<grid_for(size_t(T) * N), 256, 0, s>>>(x, b, T, N);
  return cudaGetLastError();
}

cudaError_t clamp(float* x, size_t n, float c, cudaStream_t s) {
  clamp_kernel<<<grid_for(n), 256, 0, s>>>(x, n, c);
  return cudaGetLastError();
}

cudaError_t silu_mul_gu(float* act, const float* gu, int T, int F, cudaStream_t s) {
  silu_mul_gu_kernel<<<grid_for(size_t(T) * F), 256, 0, s>>>(act, gu, T, F);
  return cudaGetLastError();
}

cudaError_t add_sigmoid_scaled(float* x, const float* y, const float* g, int T, int D, cudaStream_t s) {
  add_sigmoid_scaled_kernel<<<grid_for(size_t(T) * D), 256, 0, s>>>(x, y, g, T, D);
  return cudaGetLastError();
}

cudaError_t to_bf16(bf16* hi, bf16* lo, const float* x, size_t n, cudaStream_t s) {
  to_bf16_kernel<<<grid_for(n), 256, 0, s>>>(reinterpret_cast<__nv_bfloat16*>(hi), reinterpret_cast<__nv_bfloat16*>(lo),
                                             x, n);
  return cudaGetLastError();
}

namespace {
template <int TT>
cudaError_t launch_gemv(float* y, const float* x, const bf16* W, int T, int N, int K, bool accumulate, const float* nw,
                        float eps, RouterLogits rl, cudaStream_t s) {
  const unsigned grid = unsigned((N + kGemvBlockRows - 1) / kGemvBlockRows);
  const bool staged = stage_fits(T, K);
  if (!nw)
    return launch(gemv_kernel<TT, false>, grid, kWarps * 32, 0, s, y, x, W, T, N, K, accumulate, nw, eps, staged, rl);
  return launch(gemv_kernel<TT, true>, grid, kWarps * 32, 0, s, y, x, W, T, N, K, accumulate, nw, eps, staged, rl);
}

cudaError_t gemv_any(float* y, const float* x, const bf16* W, int T, int N, int K, bool accumulate, const float* norm_w,
                     float eps, RouterLogits rl, cudaStream_t s) {
  if (T <= 0 || T > kGemvMaxT) return cudaErrorInvalidValue;
  cudaError_t e;
  if (T == 1) e = launch_gemv<1>(y, x, W, T, N, K, accumulate, norm_w, eps, rl, s);
  else if (T == 2) e = launch_gemv<2>(y, x, W, T, N, K, accumulate, norm_w, eps, rl, s);
  else if (T <= 4) e = launch_gemv<4>(y, x, W, T, N, K, accumulate, norm_w, eps, rl, s);
  else e = launch_gemv<8>(y, x, W, T, N, K, accumulate, norm_w, eps, rl, s);
  return e != cudaSuccess ? e : cudaGetLastError();
}
}  // namespace

cudaError_t gemv(float* y, const float* x, const bf16* W, int T, int N, int K, bool accumulate, cudaStream_t s,
                 const float* norm_w, float eps) {
  return gemv_any(y, x, W, T, N, K, accumulate, norm_w, eps, RouterLogits{}, s);
}

bool router_in_oproj_fits(int D, int E, int K) {
  return D % 8 == 0 && D <= kStageFloats && E >= 1 && E <= kRouteMaxE && K >= 1 && K <= kRouteMaxK && K <= E;
}

cudaError_t gemv_router_logits(float* y, const float* x, const bf16* W, int T, int N, int K, RouterLogits rl,
                               cudaStream_t s) {
  if (!rl.acc || !router_in_oproj_fits(N, rl.E, 1)) return cudaErrorInvalidValue;
  return gemv_any(y, x, W, T, N, K, true, nullptr, 0.f, rl, s);
}

template <int TT>
cudaError_t launch_gemv3(GemvSegs g, const float* x, int T, int K, const float* nw, float eps, cudaStream_t s) {
  const bool staged = stage_fits(T, K);
  const int rows = g_gemv3_rows ? g_gemv3_rows : (T == 1 ? 2 : 1), block_rows = kWarps * rows;
  int end = 0;
  for (int i = 0; i < 3; ++i) {
    end += (g.N[i] + block_rows - 1) / block_rows;
    g.end_block[i] = end;
  }
  if (rows == 2)
    return nw ? launch(gemv3_kernel<TT, true, 2>, end, kWarps * 32, 0, s, g, x, T, K, nw, eps, staged)
              : launch(gemv3_kernel<TT, false, 2>, end, kWarps * 32, 0, s, g, x, T, K, nw, eps, staged);
  return nw ? launch(gemv3_kernel<TT, true, 1>, end, kWarps * 32, 0, s, g, x, T, K, nw, eps, staged)
            : launch(gemv3_kernel<TT, false, 1>, end, kWarps * 32, 0, s, g, x, T, K, nw, eps, staged);
}

cudaError_t gemv3(float* y0, const bf16* W0, int N0, float* y1, const bf16* W1, int N1, float* y2, const bf16* W2,
                  int N2, const float* x, int T, int K, cudaStream_t s, const float* norm_w, float eps,
                  long long* zero, int zero_n) {
  if (T <= 0 || T > kGemvMaxT || zero_n < 0 || (zero_n > 0 && !zero)) return cudaErrorInvalidValue;
  const GemvSegs g{{y0, y1, y2}, {W0, W1, W2}, {N0, N1, N2}, {0, 0, 0}, zero, zero_n};
  cudaError_t e;
  if (T == 1) e = launch_gemv3<1>(g, x, T, K, norm_w, eps, s);
  else if (T == 2) e = launch_gemv3<2>(g, x, T, K, norm_w, eps, s);
  else if (T <= 4) e = launch_gemv3<4>(g, x, T, K, norm_w, eps, s);
  else e = launch_gemv3<8>(g, x, T, K, norm_w, eps, s);
  return e != cudaSuccess ? e : cudaGetLastError();
}

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
  return launch(moe_gate_up_routed_kernel, dim3((F + kWarps - 1) / kWarps + 1, T * K), kWarps * 32, 0, s, act, ids,
                weights, h, norm_w, eps, acc, Wgu, E, K, F, D, renormalize);
}

namespace {
// moe_down's shapes: rows per warp NR (4 or 2; 16-byte loads per row per round 8 / NR), 4 blocks per
// SM. The launch takes the one whose grid is the largest that fits one wave (4 blocks per SM),
// else the smallest: measured end to end on the H200 (docs/benchmarks.md), the grid that fills one
// wave won both ways -- NR 2 (512 blocks) at Mixtral's D = 4096, K = 2 (7.99 against 8.09 ms per
// token), NR 4 (512 blocks) at OLMoE's / Qwen3-30B-A3B's D = 2048, K = 8 by 2-3%.
// TIERMOE_CUDA_DOWN=1 / 2 pins NR 2 / 4 (A/B; set_moe_down_variant).
using DownKernel = void (*)(float*, const float*, const bf16*, const int32_t*, const float*, int, int, int, int,
                           const long long*, int);
constexpr DownKernel kDown2 = moe_down_kernel<2, 4, 4>, kDown4 = moe_down_kernel<4, 2, 4>;
int g_moe_down_variant = 0;
}  // namespace

int moe_down_variants() { return 3; }
void set_moe_down_variant(int v) { g_moe_down_variant = v >= 0 && v < moe_down_variants() ? v : 0; }

cudaError_t moe_down(float* x, const float* act, const bf16* Wd, const int32_t* ids, const float* weights, int T,
                     int K, int D, int F, cudaStream_t s, const long long* acc, int E) {
  if (T == 0) return cudaSuccess;
  if (K < 1 || K > kRouteMaxK || (acc && (E < K || E > kRouteMaxE))) return cudaErrorInvalidValue;
  const int groups = std::max(1, kWarps / K);  // groups of NR rows per block (K jobs each): R = NR * groups
  const int blocks_of_two = (D + 2 * groups - 1) / (2 * groups) * T;
  const bool two = g_moe_down_variant == 1 || (g_moe_down_variant == 0 && blocks_of_two <= 4 * sm_count());
  const int R = (two ? 2 : 4) * groups;
  return launch(two ? kDown2 : kDown4, dim3((D + R - 1) / R, T), kWarps * 32, 0, s, x, act, Wd, ids, weights, K, D, F,
                R, acc, E);
}

cudaError_t kv_append(KvPages kv, const float* k, const float* v, const int32_t* pos, int T, int row, cudaStream_t s) {
  if (T == 0) return cudaSuccess;
  kv_append_kernel<<<T, 256, 0, s>>>(kv, k, v, pos, row);
  return cudaGetLastError();
}

cudaError_t attention(float* out, const float* q, KvPages kv, const int32_t* pos, int T, int H, int Hkv, int Dh,
                      int n_splits, int split_len, float* partial, cudaStream_t s) {
  if (Dh > kAttnMaxDh || H % Hkv != 0 || n_splits < 1) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  attention_split_kernel<<<dim3(H, n_splits, T), kAttnWarps * 32, 0, s>>>(partial, q, kv, pos, H, Hkv, Dh, split_len);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  return attention_merge_splits(out, partial, T, H, Dh, n_splits, s);
}

cudaError_t attention_merge_splits(float* out, const float* partial, int T, int H, int Dh, int n_splits, cudaStream_t s) {
  if (T == 0) return cudaSuccess;
  if (n_splits < 1 || Dh < 1 || Dh > kAttnMaxDh) return cudaErrorInvalidValue;
  // 48 KB in all without an opt-in: the kernel's static Mh and scale take their share.
  const int buf_floats = std::min(merge_stage_floats(1, n_splits, Dh), (48 * 1024 - 64) / int(sizeof(float)));
  return launch(attention_combine_kernel, T * H, Dh < 128 ? 32 : 128, size_t(buf_floats) * sizeof(float), s, out,
                partial, n_splits, Dh, buf_floats);
}

cudaError_t fill_random_bf16(bf16* w, size_t n, uint64_t seed, float scale, cudaStream_t s) {
  fill_random_bf16_kernel<<<grid_for(n), 256, 0, s>>>(reinterpret_cast<__nv_bfloat16*>(w), n, seed, scale);
  return cudaGetLastError();
}

cudaError_t fill_f32(float* p, size_t n, float value, cudaStream_t s) {
  fill_f32_kernel<<<grid_for(n), 256, 0, s>>>(p, n, value);
  return cudaGetLastError();
}

}  // namespace tiermoe::cuda
