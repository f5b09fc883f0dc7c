// The CUDA kernels declared in kernels.h. Plain CUDA C++ for sm_90; no tensor-core code here
// (large-T matrix products go to cuBLAS).
#include "cuda/kernels.h"

#include "cuda/dependent_launch.cuh"
#include "cuda/device_math.cuh"

#include <cfloat>
#include <climits>
#include <algorithm>
#include <cmath>

#include <cuda_bf16.h>

namespace tiermoe::cuda {
namespace {

// Asks L2 for a weight row w[K] (one 128-byte line per lane and step), before a block's norm
// prologue, so that the row streams in while the norm is computed.
__device__ __forceinline__ void prefetch_row_l2(const bf16* w, int K, int lane) {
  for (int i = lane * 64; i < K; i += 32 * 64) asm volatile("prefetch.global.L2 [%0];" ::"l"(w + i));
}

constexpr int kWarps = 8;  // rows per block in the GEMV-style kernels
constexpr int kMoeMaxK = 8;  // moe_down's fast path: top-k at most this
constexpr int kNormSmemBytes = kGemvNormMaxFloats * 4;

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
__global__ void qk_norm_rope_kernel(float* q, float* k, const float* qn, const float* kn, bool full,
                                    const int32_t* pos, int H, int Hkv, int Dh, float eps, float theta) {
  pdl_wait();
  pdl_launch_dependents();
  const int seg = blockIdx.x, t = blockIdx.y, half = Dh / 2;
  const int q_segs = full ? 1 : H;
  const bool is_q = seg < q_segs;
  const int heads = full ? (is_q ? H : Hkv) : 1, len = heads * Dh;
  const float* nw = is_q ? qn : kn;
  float* v = is_q ? q + size_t(t) * H * Dh + size_t(full ? 0 : seg) * Dh
                  : k + size_t(t) * Hkv * Dh + size_t(full ? 0 : seg - q_segs) * Dh;
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
  }
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

__global__ void to_bf16_kernel(__nv_bfloat16* y, const float* x, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    y[i] = __float2bfloat16_rn(x[i]);
}

// One warp computes output row n of y[T, N] = x[T, K] W[N, K]^T; TT accumulators (T <= TT),
// the weight row read once for all T rows of x.
// xs[T, K] (shared memory) = rmsnorm(x[T, K]) * nw[K], computed as rmsnorm() does; the whole block
// on each row (x is small and in L2: one round of loads). Every thread of the block must call it.
__device__ void block_norm_to_smem(float* xs, const float* __restrict__ x, const float* __restrict__ nw, int T, int K,
                                   float eps) {
  __shared__ float part[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int t = 0; t < T; ++t) {
    float ss = 0.f;
    for (int i = threadIdx.x; i < K; i += blockDim.x) {
      const float v = x[size_t(t) * K + i];
      xs[t * K + i] = v;
      ss = fmaf(v, v, ss);
    }
    ss = warp_sum(ss);
    if (lane == 0) part[warp] = ss;
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < warps; ++w) total += part[w];
    const float inv = 1.0f / sqrtf(total / float(K) + eps);
    for (int i = threadIdx.x; i < K; i += blockDim.x) xs[t * K + i] = xs[t * K + i] * inv * nw[i];
    __syncthreads();  // xs complete; part free for the next row
  }
}

template <int TT>
__device__ __forceinline__ void gemv_row(float* __restrict__ y, const float* __restrict__ x,
                                         const bf16* __restrict__ W, int T, int N, int K, bool accumulate, int n,
                                         int lane) {
  const bf16* w = W + size_t(n) * K;
  float acc[TT];
#pragma unroll
  for (int t = 0; t < TT; ++t) acc[t] = 0.f;
  if ((K & 7) == 0) {
    const int K8 = K >> 3;
#pragma unroll 4
    for (int i = lane; i < K8; i += 32) {
      const uint4 wv = ldg16(w + 8 * i);
#pragma unroll
      for (int t = 0; t < TT; ++t)
        if (t < T) acc[t] += dot8(wv, x + size_t(t) * K + 8 * i);
    }
  } else {
    for (int i = lane; i < K; i += 32) {
      const float wv = bf(w[i]);
#pragma unroll
      for (int t = 0; t < TT; ++t)
        if (t < T) acc[t] = fmaf(wv, x[size_t(t) * K + i], acc[t]);
    }
  }
#pragma unroll
  for (int t = 0; t < TT; ++t) {
    if (t >= T) break;
    const float s = warp_sum(acc[t]);
    if (lane == 0) {
      float* dst = y + size_t(t) * N + n;
      *dst = accumulate ? *dst + s : s;
    }
  }
}

template <int TT, bool NORM>
__global__ void __launch_bounds__(kWarps * 32) gemv_kernel(float* __restrict__ y, const float* __restrict__ x,
                                                           const bf16* __restrict__ W, int T, int N, int K,
                                                           bool accumulate, const float* __restrict__ nw, float eps) {
  extern __shared__ float4 xs4[];  // NORM: rmsnorm(x), T * K floats
  float* xs = reinterpret_cast<float*>(xs4);
  const int n = blockIdx.x * kWarps + (threadIdx.x >> 5);
  // The prefetch pays only where a norm prologue delays the weight loads: without one it made a
  // 14336 x 4096 GEMV 23% slower (33.1 -> 40.8 us, tiermoe_cuda_check timing, H200).
  if (NORM && n < N) prefetch_row_l2(W + size_t(n) * K, K, threadIdx.x & 31);
  pdl_wait();
  pdl_launch_dependents();
  if constexpr (NORM) block_norm_to_smem(xs, x, nw, T, K, eps);
  if (n < N) gemv_row<TT>(y, NORM ? xs : x, W, T, N, K, accumulate, n, threadIdx.x & 31);
}

// Up to three matrices sharing x (q, k, v): blocks [0, b0) do segment 0, [b0, b1) segment 1, ...
struct GemvSegs {
  float* y[3];
  const bf16* W[3];
  int N[3];
  int end_block[3];
};

template <int TT, bool NORM>
__global__ void __launch_bounds__(kWarps * 32) gemv3_kernel(GemvSegs segs, const float* __restrict__ x, int T,
                                                            int K, const float* __restrict__ nw, float eps) {
  extern __shared__ float4 xs4[];  // NORM: rmsnorm(x), T * K floats
  float* xs = reinterpret_cast<float*>(xs4);
  const int b = blockIdx.x;
  const int s = b < segs.end_block[0] ? 0 : (b < segs.end_block[1] ? 1 : 2);
  const int first = s == 0 ? 0 : (s == 1 ? segs.end_block[0] : segs.end_block[1]);
  // Selected with constant indices: a run-time index into the parameter arrays would put them in local memory.
  float* y = s == 0 ? segs.y[0] : (s == 1 ? segs.y[1] : segs.y[2]);
  const bf16* W = s == 0 ? segs.W[0] : (s == 1 ? segs.W[1] : segs.W[2]);
  const int N = s == 0 ? segs.N[0] : (s == 1 ? segs.N[1] : segs.N[2]);
  const int n = (b - first) * kWarps + (threadIdx.x >> 5);
  if (NORM && n < N) prefetch_row_l2(W + size_t(n) * K, K, threadIdx.x & 31);
  pdl_wait();
  pdl_launch_dependents();
  if constexpr (NORM) block_norm_to_smem(xs, x, nw, T, K, eps);
  if (n < N) gemv_row<TT>(y, NORM ? xs : x, W, T, N, K, false, n, threadIdx.x & 31);
}

// One warp routes one token: l[E] -> ids[K], weights[K]. Each lane holds experts lane, lane+32, ...
// The logits are read through L2 (__ldcg): moe_route() reads logits other blocks just wrote.
__device__ void route_token(int32_t* ids, float* weights, const float* l, int E, int K, bool renormalize, int lane) {
  constexpr int J = kRouteMaxE / 32;
  float v[J];
  float mx = -INFINITY;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int e = lane + 32 * j;
    v[j] = e < E ? __ldcg(l + e) : -INFINITY;
    mx = fmaxf(mx, v[j]);
  }
  mx = warp_max(mx);
  float den = 0.f;
#pragma unroll
  for (int j = 0; j < J; ++j)
    if (lane + 32 * j < E) den += expf(v[j] - mx);
  den = warp_sum(den);
  uint32_t taken = 0;
  float sum = 0.f, w_mine = 0.f;
  int id_mine = 0;
  for (int k = 0; k < K; ++k) {
    float bv = -INFINITY;
    int bi = INT_MAX;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int e = lane + 32 * j;
      if (e < E && !(taken >> j & 1u) && (bi == INT_MAX || v[j] > bv)) {  // lanes scan ascending e
        bv = v[j];
        bi = e;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (oi != INT_MAX && (bi == INT_MAX || ov > bv || (ov == bv && oi < bi))) {
        bv = ov;
        bi = oi;
      }
    }
    if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
    const float w = expf(bv - mx) / den;
    sum += w;
    if (lane == k) {
      id_mine = bi;
      w_mine = w;
    }
  }
  if (lane < K) {
    ids[lane] = id_mine;
    weights[lane] = renormalize ? w_mine / sum : w_mine;
  }
}

__global__ void route_topk_kernel(int32_t* ids, float* weights, const float* logits, int E, int K, bool renormalize) {
  const size_t t = blockIdx.x;
  route_token(ids + t * K, weights + t * K, logits + t * E, E, K, renormalize, threadIdx.x);
}

// grid ceil(E / kWarps): h = rmsnorm(x) (block 0 writes it), logits = h Wr^T (one warp per expert,
// all T rows), then the last block to finish routes every token (one warp per token).
template <int TT>
__global__ void __launch_bounds__(kWarps * 32) moe_route_kernel(float* __restrict__ h, float* __restrict__ logits,
                                                                int32_t* ids, float* weights, unsigned* counter,
                                                                const float* __restrict__ x,
                                                                const float* __restrict__ nw, float eps,
                                                                const bf16* __restrict__ Wr, int T, int E, int K,
                                                                int D, bool renormalize) {
  extern __shared__ float4 xs4[];  // rmsnorm(x), T * D floats
  float* xs = reinterpret_cast<float*>(xs4);
  __shared__ bool is_last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, e = blockIdx.x * kWarps + warp;
  if (e < E) prefetch_row_l2(Wr + size_t(e) * D, D, lane);
  pdl_wait();
  pdl_launch_dependents();
  block_norm_to_smem(xs, x, nw, T, D, eps);
  if (blockIdx.x == 0)
    for (int i = threadIdx.x; i < T * D; i += blockDim.x) h[i] = xs[i];
  if (e < E) gemv_row<TT>(logits, xs, Wr, T, E, D, false, e, lane);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    is_last = atomicAdd(counter, 1u) == gridDim.x - 1;
    if (is_last) *counter = 0;  // ready for the next launch
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  for (int t = warp; t < T; t += kWarps)
    route_token(ids + size_t(t) * K, weights + size_t(t) * K, logits + size_t(t) * E, E, K, renormalize, lane);
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
    const int D8 = D >> 3;
#pragma unroll 8
    for (int i = lane; i < D8; i += 32) {
      const uint4 a = ldg16(wg + 8 * i), b = ldg16(wu + 8 * i);
      g += dot8(a, x + 8 * i);
      u += dot8(b, x + 8 * i);
    }
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

// grid (ceil(D / kWarps), T): one warp per (t, d), summing over the K selected experts.
__global__ void __launch_bounds__(kWarps * 32) moe_down_kernel(float* __restrict__ x, const float* __restrict__ act,
                                                               const bf16* __restrict__ Wd,
                                                               const int32_t* __restrict__ ids,
                                                               const float* __restrict__ weights, int K, int D,
                                                               int F) {
  pdl_wait();
  pdl_launch_dependents();
  const int lane = threadIdx.x & 31;
  const int d = blockIdx.x * kWarps + (threadIdx.x >> 5);
  const int t = blockIdx.y;
  if (d >= D) return;
  float part = 0.f;  // this lane's share of sum_k w_k * dot(Wd[e_k][d], act[t, k])
  if ((F & 7) == 0 && K <= kMoeMaxK) {
    // The K experts' rows side by side, so that their loads are in flight together.
    const int F8 = F >> 3;
    const bf16* w[kMoeMaxK];
    float s[kMoeMaxK];
#pragma unroll
    for (int k = 0; k < kMoeMaxK; ++k) {
      w[k] = k < K ? Wd + (size_t(ids[t * K + k]) * D + d) * F : nullptr;
      s[k] = 0.f;
    }
    const float* a = act + size_t(t) * K * F;
#pragma unroll 2
    for (int i = lane; i < F8; i += 32) {
#pragma unroll
      for (int k = 0; k < kMoeMaxK; ++k)
        if (k < K) s[k] += dot8(ldg16(w[k] + 8 * i), a + size_t(k) * F + 8 * i);
    }
#pragma unroll
    for (int k = 0; k < kMoeMaxK; ++k)
      if (k < K) part = fmaf(weights[t * K + k], s[k], part);
  } else {
    for (int k = 0; k < K; ++k) {
      const int tk = t * K + k;
      const bf16* w = Wd + (size_t(ids[tk]) * D + d) * F;
      const float* a = act + size_t(tk) * F;
      float s = 0.f;
      for (int i = lane; i < F; i += 32) s = fmaf(bf(w[i]), a[i], s);
      part = fmaf(weights[tk], s, part);
    }
  }
  const float total = warp_sum(part);
  if (lane == 0) x[size_t(t) * D + d] += total;
}

__global__ void moe_act_masked_kernel(__nv_bfloat16* act, const float* gu, const int32_t* ids, const float* weights,
                                      int e, int T, int K, int F) {
  const size_t n = size_t(T) * F;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const size_t t = i / F, f = i % F;
    float w = 0.f;
    for (int k = 0; k < K; ++k)
      if (ids[t * K + k] == e) w = weights[t * K + k];
    act[i] = __float2bfloat16_rn(w == 0.f ? 0.f : silu(gu[t * 2 * F + f]) * gu[t * 2 * F + F + f] * w);
  }
}

__global__ void kv_append_kernel(__nv_bfloat16* kc, __nv_bfloat16* vc, const float* k, const float* v,
                                 const int32_t* pos, int row) {
  const int t = blockIdx.x;
  const size_t dst = size_t(pos[t]) * row, src = size_t(t) * row;
  for (int i = threadIdx.x; i < row; i += blockDim.x) {
    kc[dst + i] = __float2bfloat16_rn(k[src + i]);
    vc[dst + i] = __float2bfloat16_rn(v[src + i]);
  }
}

constexpr int kAttnWarps = 4;
constexpr int kAttnJ = kAttnMaxDh / 32;

// grid (H, n_splits, T), kAttnWarps warps. Warp w takes keys start+w, start+w+4, ... with an
// online softmax; lane holds dims lane, lane+32, ...; the warps merge in shared memory and the
// block writes (max, sum, unnormalized acc[Dh]) for its split.
__global__ void __launch_bounds__(kAttnWarps * 32) attention_split_kernel(
    float* __restrict__ partial, const float* __restrict__ q, const bf16* __restrict__ kc,
    const bf16* __restrict__ vc, const int32_t* __restrict__ pos, int H, int Hkv, int Dh, int split_len) {
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
    const bf16* kp = kc + size_t(key) * stride + size_t(kvh) * Dh;
    const bf16* vp = vc + size_t(key) * stride + size_t(kvh) * Dh;
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

// grid T*H: merges the splits of one (t, h).
__global__ void attention_combine_kernel(float* out, const float* partial, int n_splits, int Dh) {
  const size_t th = blockIdx.x;
  const float* p = partial + th * n_splits * (Dh + 2);
  float M = -INFINITY;
  for (int s = 0; s < n_splits; ++s) M = fmaxf(M, p[size_t(s) * (Dh + 2)]);
  float L = 0.f;
  for (int s = 0; s < n_splits; ++s) {
    const float ms = p[size_t(s) * (Dh + 2)];
    if (ms != -INFINITY) L += p[size_t(s) * (Dh + 2) + 1] * expf(ms - M);
  }
  for (int d = threadIdx.x; d < Dh; d += blockDim.x) {
    float a = 0.f;
    for (int s = 0; s < n_splits; ++s) {
      const float ms = p[size_t(s) * (Dh + 2)];
      if (ms != -INFINITY) a += p[size_t(s) * (Dh + 2) + 2 + d] * expf(ms - M);
    }
    out[th * Dh + d] = a / L;
  }
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

}  // namespace

bool programmatic_launch() { return g_programmatic_launch; }
void set_programmatic_launch(bool on) { g_programmatic_launch = on; }

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
                         int T, int H, int Hkv, int Dh, float eps, float theta, cudaStream_t s) {
  if ((q_norm == nullptr) != (k_norm == nullptr) || Dh % 2 != 0) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  full = full && q_norm;
  const int segs = full ? 2 : H + Hkv, pairs = (full ? H : 1) * Dh / 2;
  const int threads = std::min(1024, std::max(32, (pairs + 31) / 32 * 32));
  return launch(qk_norm_rope_kernel, dim3(segs, T), threads, 0, s, q, k, q_norm, k_norm, full, pos, H, Hkv, Dh, eps, theta);
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

cudaError_t to_bf16(bf16* y, const float* x, size_t n, cudaStream_t s) {
  to_bf16_kernel<<<grid_for(n), 256, 0, s>>>(reinterpret_cast<__nv_bfloat16*>(y), x, n);
  return cudaGetLastError();
}

// Kernels that stage rmsnorm(x) in dynamic shared memory may take up to kNormSmemBytes of it (set
// per kernel; a host call, not a stream operation, so allowed while a graph is captured).
template <class Kernel>
cudaError_t allow_norm_smem(Kernel* k) {
  return cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kNormSmemBytes);
}

template <int TT>
cudaError_t launch_gemv(float* y, const float* x, const bf16* W, int T, int N, int K, bool accumulate, const float* nw,
                        float eps, cudaStream_t s) {
  const unsigned grid = unsigned((N + kWarps - 1) / kWarps);
  if (!nw) return launch(gemv_kernel<TT, false>, grid, kWarps * 32, 0, s, y, x, W, T, N, K, accumulate, nw, eps);
  if (const cudaError_t e = allow_norm_smem(gemv_kernel<TT, true>); e != cudaSuccess) return e;
  return launch(gemv_kernel<TT, true>, grid, kWarps * 32, size_t(T) * K * 4, s, y, x, W, T, N, K, accumulate, nw, eps);
}

cudaError_t gemv(float* y, const float* x, const bf16* W, int T, int N, int K, bool accumulate, cudaStream_t s,
                 const float* norm_w, float eps) {
  if (T <= 0 || T > kGemvMaxT || (norm_w && !gemv_norm_fits(T, K))) return cudaErrorInvalidValue;
  cudaError_t e;
  if (T == 1) e = launch_gemv<1>(y, x, W, T, N, K, accumulate, norm_w, eps, s);
  else if (T == 2) e = launch_gemv<2>(y, x, W, T, N, K, accumulate, norm_w, eps, s);
  else if (T <= 4) e = launch_gemv<4>(y, x, W, T, N, K, accumulate, norm_w, eps, s);
  else e = launch_gemv<8>(y, x, W, T, N, K, accumulate, norm_w, eps, s);
  return e != cudaSuccess ? e : cudaGetLastError();
}

template <int TT>
cudaError_t launch_gemv3(const GemvSegs& g, int blocks, const float* x, int T, int K, const float* nw, float eps,
                         cudaStream_t s) {
  if (!nw) return launch(gemv3_kernel<TT, false>, blocks, kWarps * 32, 0, s, g, x, T, K, nw, eps);
  if (const cudaError_t e = allow_norm_smem(gemv3_kernel<TT, true>); e != cudaSuccess) return e;
  return launch(gemv3_kernel<TT, true>, blocks, kWarps * 32, size_t(T) * K * 4, s, g, x, T, K, nw, eps);
}

cudaError_t gemv3(float* y0, const bf16* W0, int N0, float* y1, const bf16* W1, int N1, float* y2, const bf16* W2,
                  int N2, const float* x, int T, int K, cudaStream_t s, const float* norm_w, float eps) {
  if (T <= 0 || T > kGemvMaxT || (norm_w && !gemv_norm_fits(T, K))) return cudaErrorInvalidValue;
  GemvSegs g{{y0, y1, y2}, {W0, W1, W2}, {N0, N1, N2}, {0, 0, 0}};
  int end = 0;
  for (int i = 0; i < 3; ++i) {
    end += (g.N[i] + kWarps - 1) / kWarps;
    g.end_block[i] = end;
  }
  cudaError_t e;
  if (T == 1) e = launch_gemv3<1>(g, end, x, T, K, norm_w, eps, s);
  else if (T == 2) e = launch_gemv3<2>(g, end, x, T, K, norm_w, eps, s);
  else if (T <= 4) e = launch_gemv3<4>(g, end, x, T, K, norm_w, eps, s);
  else e = launch_gemv3<8>(g, end, x, T, K, norm_w, eps, s);
  return e != cudaSuccess ? e : cudaGetLastError();
}

cudaError_t route_topk(int32_t* ids, float* weights, const float* logits, int T, int E, int K, bool renormalize,
                       cudaStream_t s) {
  if (E > kRouteMaxE || K > 32 || K > E) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  route_topk_kernel<<<T, 32, 0, s>>>(ids, weights, logits, E, K, renormalize);
  return cudaGetLastError();
}

cudaError_t moe_route(float* h, float* logits, int32_t* ids, float* weights, unsigned* counter, const float* x,
                      const float* norm_w, float eps, const bf16* Wr, int T, int E, int K, int D, bool renormalize,
                      cudaStream_t s) {
  if (E > kRouteMaxE || K > 32 || K > E || T > kGemvMaxT || !gemv_norm_fits(T, D)) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  const unsigned grid = unsigned((E + kWarps - 1) / kWarps);
  const int th = kWarps * 32;
  const size_t smem = size_t(T) * D * 4;
  cudaError_t e;
#define TIERMOE_MOE_ROUTE(TT)                                                                                      \
  if ((e = allow_norm_smem(moe_route_kernel<TT>)) == cudaSuccess)                                                  \
    e = launch(moe_route_kernel<TT>, grid, th, smem, s, h, logits, ids, weights, counter, x, norm_w, eps, Wr, T, E, K, \
               D, renormalize);
  if (T == 1) { TIERMOE_MOE_ROUTE(1) }
  else if (T == 2) { TIERMOE_MOE_ROUTE(2) }
  else if (T <= 4) { TIERMOE_MOE_ROUTE(4) }
  else { TIERMOE_MOE_ROUTE(8) }
#undef TIERMOE_MOE_ROUTE
  return e != cudaSuccess ? e : cudaGetLastError();
}

cudaError_t moe_gate_up(float* act, const float* h, const bf16* Wgu, const int32_t* ids, int T, int K, int F, int D,
                        cudaStream_t s) {
  if (T == 0) return cudaSuccess;
  return launch(moe_gate_up_kernel, dim3((F + kWarps - 1) / kWarps, T * K), kWarps * 32, 0, s, act, h, Wgu, ids, K, F, D);
}

cudaError_t moe_down(float* x, const float* act, const bf16* Wd, const int32_t* ids, const float* weights, int T,
                     int K, int D, int F, cudaStream_t s) {
  if (T == 0) return cudaSuccess;
  return launch(moe_down_kernel, dim3((D + kWarps - 1) / kWarps, T), kWarps * 32, 0, s, x, act, Wd, ids, weights, K, D,
                F);
}

cudaError_t moe_act_masked(bf16* act, const float* gu, const int32_t* ids, const float* weights, int e, int T, int K,
                           int F, cudaStream_t s) {
  moe_act_masked_kernel<<<grid_for(size_t(T) * F), 256, 0, s>>>(reinterpret_cast<__nv_bfloat16*>(act), gu, ids,
                                                                 weights, e, T, K, F);
  return cudaGetLastError();
}

cudaError_t kv_append(bf16* kc, bf16* vc, const float* k, const float* v, const int32_t* pos, int T, int row,
                      cudaStream_t s) {
  if (T == 0) return cudaSuccess;
  kv_append_kernel<<<T, 256, 0, s>>>(reinterpret_cast<__nv_bfloat16*>(kc), reinterpret_cast<__nv_bfloat16*>(vc), k,
                                     v, pos, row);
  return cudaGetLastError();
}

cudaError_t attention(float* out, const float* q, const bf16* kc, const bf16* vc, const int32_t* pos, int T, int H,
                      int Hkv, int Dh, int n_splits, int split_len, float* partial, cudaStream_t s) {
  if (Dh > kAttnMaxDh || H % Hkv != 0 || n_splits < 1) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  attention_split_kernel<<<dim3(H, n_splits, T), kAttnWarps * 32, 0, s>>>(partial, q, kc, vc, pos, H, Hkv, Dh,
                                                                          split_len);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  attention_combine_kernel<<<T * H, Dh < 128 ? 32 : 128, 0, s>>>(out, partial, n_splits, Dh);
  return cudaGetLastError();
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
