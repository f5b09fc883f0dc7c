// Building blocks of the GEMV-style kernels (gemv.cu; moe_decode.cu's router and expert kernels):
// kWarps warps per block, weights streamed in rounds of 16-byte loads per lane, the input staged once
// per block in shared memory, and the router's fixed-point logit sums.
#pragma once
#include "cuda/dependent_launch.cuh"
#include "cuda/device_math.cuh"
#include "cuda/kernels.h"

#include <cuda_bf16.h>

namespace tiermoe::cuda {

// Whether a GEMV-style launch stages x in shared memory (the same answer for every block of the
// launch): K % 8 == 0 and T * K <= kStageFloats, unless TIERMOE_CUDA_GEMV_STAGE=0 (gemv.cu).
bool stage_fits(int T, int K);

// Up to three matrices sharing x (q, k, v): blocks [0, b0) do segment 0, [b0, b1) segment 1, ...
struct GemvSegs {
  float* y[3];
  const bf16* W[3];
  int N[3];
  int end_block[3];
  long long* zero;  // zero_n slots of the router's accumulator (RouterLogits) <- 0 by block 0 after the wait
  int zero_n;
};

// 2 .. 8 tokens on the tensor cores (gemv_tc.cu): what gemv_any and gemv3 take where
// gemv_tc_fits(T, K) (kernels.h); the same forms (norm, accumulate, router logits, argmax). Sets end_block.
cudaError_t gemv_tc(GemvSegs g, const float* x, int T, int K, bool accumulate, const float* nw, float eps,
                    RouterLogits rl, unsigned long long* best, cudaStream_t s);

namespace {

constexpr int kWarps = 8;  // warps per block in the GEMV-style kernels
// The GEMV-style kernels read weights in rounds of kLoads 16-byte loads per lane, all issued before
// any is used, so that the memory system sees them together whatever the compiler schedules
// (a 2048-wide BF16 row is 8 per lane; moe_down's warps take 2 or 4 rows of an expert at once
// for that). 16 per lane took ~130 registers and halved the blocks per SM.
constexpr int kLoads = 8;
constexpr int kGemvRows = 1;
// Blocks per SM of the stream and pipelined kernels: their two register sets take up to 128
// registers a thread (their launch bound), so an SM holds two of their blocks, and their grids are
// sized for one wave of that.
constexpr int kStreamBlocksPerSm = 2;

// The router folded into the o projection (RouterLogits, kernels.h) sums each block's share of the
// unscaled logits in fixed point, units of 2^-32, with integer atomics: the same bits in any block
// order, where float atomics would make a step's routing depend on scheduling.
__device__ __forceinline__ void add_logit(long long* acc, float v) {
  atomicAdd(reinterpret_cast<unsigned long long*>(acc), static_cast<unsigned long long>(__float2ll_rn(v * 0x1p32f)));
}
__device__ __forceinline__ float logit_of(long long a) { return float(__ll2double_rn(a) * 0x1p-32); }

// Block b's segment of a GemvSegs launch: its output, weights and rows, and b's index among the
// segment's blocks. Selected with constant indices: a run-time index into the parameter arrays
// would put them in local memory.
struct GemvSeg {
  float* y;
  const bf16* W;
  int N, block;
};
__device__ __forceinline__ GemvSeg segment_of(const GemvSegs& g, int b) {
  const int s = b < g.end_block[0] ? 0 : (b < g.end_block[1] ? 1 : 2);
  const int first = s == 0 ? 0 : (s == 1 ? g.end_block[0] : g.end_block[1]);
  return {s == 0 ? g.y[0] : (s == 1 ? g.y[1] : g.y[2]), s == 0 ? g.W[0] : (s == 1 ? g.W[1] : g.W[2]),
          s == 0 ? g.N[0] : (s == 1 ? g.N[1] : g.N[2]), b - first};
}

// After the wait, block 0 of the launch: the router accumulator's zero_n slots <- 0 (all its threads).
__device__ __forceinline__ void zero_router_slots(const GemvSegs& g) {
  if (blockIdx.x == 0)
    for (int i = threadIdx.x; i < g.zero_n; i += blockDim.x) g.zero[size_t(i) * kRouterLogitStride] = 0;
}

// A warp's run of units 0 .. units - 1 through two register sets a and b: load(v, u) issues unit
// u's loads into v, use(v, u) consumes them; unit u + 1's loads are issued before unit u is used,
// so that the memory system always has the next unit. The caller has loaded unit 0 into a (before
// its wait, typically).
template <class Buf, class Load, class Use>
__device__ __forceinline__ void stream_units(Buf& a, Buf& b, int units, Load load, Use use) {
  for (int u = 0; u < units; u += 2) {
    if (u + 1 < units) load(b, u + 1);
    use(a, u);
    if (u + 1 >= units) break;
    if (u + 2 < units) load(a, u + 2);
    use(b, u + 1);
  }
}

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

// The GEMV-style kernels' input, staged once per block in shared memory: x (times nw with a norm),
// and each token's inv = 1 / rms(x). Why: with every warp reading x (and nw) itself, a row of 4 KB
// of weights cost 8-16 KB of L1 loads, and L1 throughput, not DRAM, bounded the kernel (the folded
// attention norm alone cost 4.8 us per layer of a 1.27 ms OLMoE step). Used where T * K fits.
constexpr int kStageFloats = kGemvStageFloats;
struct alignas(16) GemvStage {  // x is read and written as float4
  float x[kStageFloats];  // [T, K]: x, or x * nw
  float inv[kGemvMaxT];
  float red[kWarps][kGemvMaxT];
};

// All threads of the block, no barrier: st.x = x (* nw), and with NORM st.red[warp][t] = each warp's
// share of sum(x_t^2) (stage_x, below, finishes the norm). Past two sweeps of the block, four sweeps'
// loads go out together: one at a time costs an L2 round trip per sweep right after the kernel's
// wait (four at the Qwen3 o projection's K = 4096; -1.4% to -2.0% per token there, H100, 2026-12-05,
// docs/benchmarks.md). Batching two sweeps cost the OLMoE shape 2%, so K = 2048 goes one by one.
template <int TT, bool NORM>
__device__ void stage_x_rows(GemvStage& st, const float* __restrict__ x, const float* __restrict__ nw, int T, int K) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, K4 = K >> 2;
#pragma unroll
  for (int t = 0; t < TT; ++t) {
    if (t >= T) break;
    float ss = 0.f;
    const float4* xt = reinterpret_cast<const float4*>(x + size_t(t) * K);
    auto put = [&](int i, float4 v, const float4& c) {
      if constexpr (NORM) {
        ss = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, ss))));
        v = make_float4(v.x * c.x, v.y * c.y, v.z * c.z, v.w * c.w);
      }
      reinterpret_cast<float4*>(st.x + t * K)[i] = v;
    };
    int i = threadIdx.x;
    if (K4 > 2 * int(blockDim.x))  // the same order of sums as one sweep at a time
      for (; i + 3 * int(blockDim.x) < K4; i += 4 * blockDim.x) {
        float4 v[4], c[4];
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          v[b] = xt[i + b * blockDim.x];
          if constexpr (NORM) c[b] = reinterpret_cast<const float4*>(nw)[i + b * blockDim.x];
        }
#pragma unroll
        for (int b = 0; b < 4; ++b) put(i + b * blockDim.x, v[b], c[b]);
      }
    for (; i < K4; i += blockDim.x) {
      float4 c;
      if constexpr (NORM) c = reinterpret_cast<const float4*>(nw)[i];
      put(i, xt[i], c);
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
// The first round of weight loads is issued BEFORE the wait: no kernel writes weights, so under
// programmatic launch they stream in while the previous kernel finishes. Calls pdl_start()
// itself; every thread of the block must call it (warps past N only
// wait). inv_out[t] gets inv_t (NORM, n0 < N); kept[r * TT + t] (shared memory, optional) a copy of
// each written output. With st (stage_fits(T, K), the same for the whole
// block) x is taken from the block's stage instead, staged here after the wait if `stage` is set
// (every thread of the block must then be here: stage_x has barriers).
// PIPE: each round's loads are issued before the round before it is summed (a second set of
// registers), for rows longer than one round; the same sums in the same order.
template <int TT, bool NORM, int NR = kGemvRows, bool PIPE = false>
__device__ __forceinline__ void gemv_rows(float* __restrict__ y, const float* __restrict__ x,
                                          const float* __restrict__ nw, float eps, const bf16* __restrict__ W, int T,
                                          int N, int K, bool accumulate, int n0, int lane, float* inv_out = nullptr,
                                          GemvStage* st = nullptr, bool stage = true, float* kept = nullptr) {
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
    pdl_start();
    if (accumulate) prefetch_rows<TT, NR>(old, y, T, N, n0, nr, lane);
    if (st && stage) stage_x<TT, NORM>(*st, x, nw, eps, T, K);
    if (nr == 0) return;
    const float* xin = st ? st->x : x;
    auto round = [&](const uint4(&wr)[NR][CH], int base) {  // one round's dot products
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
          for (int r = 0; r < NR; ++r) acc[r][t] += dot8(wr[r][j], a, b);
        }
      }
    };
    constexpr int kRound = 32 * CH;  // chunks per round
    if constexpr (PIPE) {  // the next round's loads in flight during this one's dot products
      uint4 wn[NR][CH] = {};
      stream_units(
          wv, wn, lane < K8 ? (K8 - lane + kRound - 1) / kRound : 0,
          [&](uint4(&v)[NR][CH], int u) { load_row_chunks(v, w, K, nr, lane + u * kRound, K8); },
          [&](const uint4(&v)[NR][CH], int u) { round(v, lane + u * kRound); });
    } else {
      for (int base = lane; base < K8; base += kRound) {
        if (base > lane) load_row_chunks(wv, w, K, nr, base, K8);
        round(wv, base);
      }
    }
  } else {
    pdl_start();
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
        if (kept) kept[r * TT + t] = accumulate ? old[r][t] + s : s;  // [NR][TT]: the caller's copy on chip
      }
    }
  }
}

}  // namespace
}  // namespace tiermoe::cuda
