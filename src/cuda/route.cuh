// The router's selection on chip, shared by moe_decode.cu's kernels and moe_down_tc.cu's: top-k
// by ranks (select_topk) and the softmax weights (route_token), all threads of a block.
#pragma once
#include "cuda/gemv.cuh"

#include <cmath>

namespace tiermoe::cuda {
namespace {

static_assert(kWarps * 32 >= kRouteMaxE, "route_token ranks one expert per thread");

// Router logits as NaN-proof values: NaN ranks last, so every rank gets exactly one expert.
__device__ __forceinline__ float rank_value(float v) { return v != v ? -INFINITY : v; }

// All threads of the block, for T tokens: ids[t * K + rank] = e for the K experts whose logits
// l[t * E + e] rank first, a rank being the count of the token's logits that beat e's (ties to the
// lower index, as route_softmax_topk). P consecutive threads count for one (t, e), each a P-th of the
// comparisons (P: a power of two up to 32 with P * T * E <= blockDim.x), summed by shuffles. No
// barrier: the caller's publishes ids[].
__device__ void select_topk(int32_t* ids, const float* l, int E, int K, int T = 1) {
  int P = 1;
  while (P < 32 && 2 * P * T * E <= int(blockDim.x)) P *= 2;
  const int part = threadIdx.x % P, pairs = T * E;
  for (int base = 0; base < pairs * P; base += blockDim.x) {  // the same trip count in every thread
    const int i = (base + int(threadIdx.x)) / P, t = i / E, e = i - t * E;
    const float* lt = l + t * E;
    int rank = 0;
    if (i < pairs) {
      const float v = rank_value(lt[e]);
      for (int j = part; j < E; j += P) {
        const float lj = rank_value(lt[j]);
        rank += lj > v || (lj == v && j < e);
      }
    }
    for (int o = 1; o < P; o <<= 1) rank += __shfl_xor_sync(0xffffffffu, rank, o);
    if (i < pairs && part == 0 && rank < K) ids[t * K + rank] = e;
  }
}

// One warp, one token: ids[0 .. K) = the K experts select_topk ranks first, in rank order, for
// E <= 32 * PER. Lane l holds experts l, l + 32, ... as order keys, NaN as -inf (rank_value); each
// of K rounds takes the warp's largest key (__reduce_max_sync), the lowest expert index among its
// holders (__reduce_min_sync), and removes it. Why: select_topk's E * E comparisons over the block
// took about 1 us at E = 128, on the critical path of the decode MoE's routing; this is K rounds of
// two warp reductions.
template <int PER>
__device__ void select_topk_warp(int32_t* ids, const float* l, int E, int K) {
  const int lane = threadIdx.x & 31;
  uint32_t key[PER];  // 0: no expert (order_key(-inf) is above 0)
#pragma unroll
  for (int i = 0; i < PER; ++i) key[i] = 32 * i + lane < E ? order_key(rank_value(l[32 * i + lane])) : 0u;
  for (int k = 0; k < K; ++k) {
    uint32_t best = 0, at = 0;  // the lane's largest key, at its lowest index
#pragma unroll
    for (int i = PER - 1; i >= 0; --i)
      if (key[i] >= best) best = key[i], at = i;
    const uint32_t top = __reduce_max_sync(0xffffffffu, best);
    const uint32_t e = __reduce_min_sync(0xffffffffu, best == top ? 32 * at + lane : 0xffffffffu);
    if (lane == 0) ids[k] = int32_t(e);
    if (int(e & 31) == lane)
#pragma unroll
      for (int i = 0; i < PER; ++i)
        if (i == int(e >> 5)) key[i] = 0;
  }
}
// All threads of the block, one token: the top-k of l[E] into ids[K] as select_topk ranks them. Up
// to 64 experts by the block's comparisons (16 per thread at E = 64), beyond that by the first warp
// (select_topk_warp). Measured on one H200 (docs/benchmarks.md, "The decode MoE's top-k by one
// warp"): the warp's at E = 128 took 3.0-4.3% off a Qwen3 step; at E = 64 it cost 0.5%.
// warp = false: the block's at every E (A/B timing).
__device__ void select_topk_token(int32_t* ids, const float* l, int E, int K, bool warp = true) {
  static_assert(kRouteMaxE <= 256, "select_topk_warp's keys");
  if (!warp || E <= 64) select_topk(ids, l, E, K);
  else if (threadIdx.x < 32 && E <= 128) select_topk_warp<4>(ids, l, E, K);
  else if (threadIdx.x < 32) select_topk_warp<8>(ids, l, E, K);
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

}  // namespace
}  // namespace tiermoe::cuda
