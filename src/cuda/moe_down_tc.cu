// The small-batch MoE's down projection on the tensor cores, each selected expert's rows read once
// for all the tokens that chose it (kernels.h: moe_down_tc, what moe_down with the router's logit
// sums runs for 2 .. 8 tokens).
// Why: moe_down_kernel reads each (token, expert) pair's rows on its own, so an expert two tokens
// chose is read twice (the OLMoE shape at T = 4: 32 pairs, about 26 distinct experts). Here every
// block ranks all T tokens' experts from the logit sums, which gives the distinct experts in
// ascending order, and an expert's 16 rows go against all 8 token columns as MMAs (gemv_tc.cuh),
// the tokens that did not choose it weighted by 0.
#include "cuda/gemv_tc.cuh"
#include "cuda/kernels.h"
#include "cuda/route.cuh"

#include <algorithm>
#include <cmath>

namespace tiermoe::cuda {
namespace {

constexpr int kDownChunks = 4;   // down chunks per unit: 4 x 2 rows, and the token's act
constexpr int kDownStages = 6;   // down units in flight per warp, through shared memory (24 KB a warp)
constexpr int kMaxPairs = kGemvMaxT * kRouteMaxK;  // distinct experts at most

struct TcRouteShared {
  float lg[kGemvMaxT * kRouteMaxE];      // [T, E] the logit sums
  int32_t ids[kGemvMaxT * kRouteMaxK];   // [T, K] each token's experts by rank
  int32_t experts[kMaxPairs];            // the distinct experts, ascending
  int8_t rank_of[kMaxPairs][kTcCols];    // [u][t]: the k at which token t chose expert u, or -1
  unsigned used[kWarps];                 // which experts are chosen, a word per warp of threads
  float tile[kWarps][kTcRows][kTcCols];  // each warp's partial tile
  float wt[kMaxPairs][kTcCols];          // moe_down_tc: [u][t] token t's routing weight of expert u, or 0
};

// All threads of the block, after sh.lg holds the logit sums [T, E]: every token's experts ranked
// (select_topk; past 64 experts warp t ranks token t, select_topk_warp, unless warp_topk is off),
// the distinct ones listed ascending in sh.experts with sh.rank_of; returns how many.
__device__ int list_experts(TcRouteShared& sh, int T, int E, int K, bool warp_topk) {
  static_assert(kTcCols <= kWarps, "a warp per token");
  const int w = threadIdx.x >> 5;
  if (!warp_topk || E <= 64) select_topk(sh.ids, sh.lg, E, K, T);
  else if (w < T && E <= 128) select_topk_warp<4>(sh.ids + w * K, sh.lg + w * E, E, K);
  else if (w < T) select_topk_warp<8>(sh.ids + w * K, sh.lg + w * E, E, K);
  __syncthreads();
  // Thread e: whether any token chose expert e, and its place among the chosen (ballots in warp order).
  const int e = threadIdx.x, lane = e & 31, warp = e >> 5;
  bool chosen = false;
  if (e < E)
    for (int i = 0; i < T * K; ++i) chosen |= sh.ids[i] == e;
  const unsigned ballot = __ballot_sync(0xffffffffu, chosen);
  if (lane == 0) sh.used[warp] = ballot;
  __syncthreads();
  int U = 0, before = 0;
  for (int w = 0; w < kWarps; ++w) {
    if (w == warp) before = U + __popc(ballot & ((1u << lane) - 1));
    U += __popc(sh.used[w]);
  }
  if (chosen) {
    sh.experts[before] = e;
    for (int t = 0; t < kTcCols; ++t) {
      int8_t r = -1;
      for (int k = 0; k < K && t < T; ++k)
        if (sh.ids[t * K + k] == e) r = int8_t(k);
      sh.rank_of[before][t] = r;
    }
  }
  __syncthreads();
  return U;
}

// logits: acc's fixed-point sums of T tokens into sh.lg (all threads, no barrier).
__device__ void read_logits(TcRouteShared& sh, const long long* acc, int T, int E) {
  for (int i = threadIdx.x; i < T * E; i += blockDim.x) sh.lg[i] = logit_of(acc[size_t(i) * kRouterLogitStride]);
}

// x[T, D] += sum_k weights[t, k] Wd[e] act[t, k] on the tensor cores, each distinct expert's rows
// read once. grid: min(D / 16, one wave) blocks; block b takes items (16 rows of D) b, b + G, ...,
// and for an item every distinct expert in ascending order as 16 rows x 8 token columns (the act of
// the token's slot for that expert; zeros where it did not choose it); warp w takes k in
// [w F / kWarps, (w + 1) F / kWarps). An expert's chains go into the warp's running sums weighted by
// its tokens' routing weights (no barrier per expert); the block sums its warps' tiles in warp order
// and adds the residual: the same bits on every run. The routing from acc, the first round of
// weights and the first item's residual come before the wait: acc and x are final two kernels back
// (moe_down in kernels.h); weights and act are the kernel before's.
__global__ void __launch_bounds__(kWarps * 32, 1) moe_down_tc_kernel(float* __restrict__ x, const float* act,
                                                                     const bf16* __restrict__ Wd, const float* weights,
                                                                     const long long* acc, int T, int E, int K, int D,
                                                                     int F, bool warp_topk) {
  __shared__ TcRouteShared sh;
  read_logits(sh, acc, T, E);
  __syncthreads();
  const int U = list_experts(sh, T, E, K, warp_topk);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, quad = lane >> 2, qi = lane & 3;
  const int G = gridDim.x, b = blockIdx.x, Fw = F / kWarps, k0 = warp * Fw + 8 * qi, chunks = Fw / kTcChunk;
  const int rounds = (chunks + kDownChunks - 1) / kDownChunks, per_item = U * rounds, nD = (D + kTcRows - 1) / kTcRows;
  const int units = (nD > b ? (nD - 1 - b) / G + 1 : 0) * per_item;
  // The loads and the use walk the units in order, each with a cursor (item, distinct expert, round)
  // instead of dividing the unit's index.
  struct Cursor {
    int it, ex, round;
    __device__ void next(int rounds, int U, int G) {
      if (++round < rounds) return;
      round = 0;
      if (++ex == U) ex = 0, it += G;
    }
  };
  Cursor at_load{b, 0, 0}, at_use = at_load;
  // The weights go through a ring of kDownStages units per warp in shared memory by cp.async: more
  // bytes in flight than registers hold (the register double buffer of 8 warps per SM read 19 GB/s
  // per SM). Slot j, r, lane of a stage holds what that lane loads and reads back: chunk j of row
  // quad + 8 r (rows past D: the last row's, their sums not written).
  extern __shared__ uint4 ring[];
  uint4* const mine = ring + size_t(warp) * kDownStages * kDownChunks * 2 * 32;
  auto slot = [&](int stage, int j, int r) { return mine + ((stage * kDownChunks + j) * 2 + r) * 32 + lane; };
  int issued = 0;
  auto issue = [&](int stage) {  // the next unit's weights, one commit group (empty past the last unit)
    if (issued++ < units) {
      const int d0 = at_load.it * kTcRows, c0 = at_load.round * kDownChunks;
      const bf16* w = Wd + size_t(sh.experts[at_load.ex]) * D * F + k0;
      const bf16* rw[2] = {w + size_t(min(d0 + quad, D - 1)) * F, w + size_t(min(d0 + quad + 8, D - 1)) * F};
#pragma unroll
      for (int j = 0; j < kDownChunks; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          if (c0 + j < chunks) cp_async16(slot(stage, j, r), rw[r] + kTcChunk * (c0 + j), true);
      at_load.next(rounds, U, G);
    }
    cp_async_commit();
  };
  // Token quad's act of a unit (after the wait: the kernel before's), a unit ahead in registers;
  // none where the token did not choose the expert (zeros in use).
  Cursor at_act = at_load;
  using Act = uint4[kDownChunks][2];  // act's float bits
  auto load_act = [&](Act& v) {
    const int c0 = at_act.round * kDownChunks, r = sh.rank_of[at_act.ex][quad];
    at_act.next(rounds, U, G);
    if (r < 0) return;
    const uint16_t* ak = reinterpret_cast<const uint16_t*>(act + (size_t(quad) * K + r) * F + k0);
#pragma unroll
    for (int j = 0; j < kDownChunks; ++j)  // 2 x 4 floats as 16-byte loads: 8 uint16_t apart
      if (c0 + j < chunks) v[j][0] = ldg16(ak + 2 * kTcChunk * (c0 + j)), v[j][1] = ldg16(ak + 2 * kTcChunk * (c0 + j) + 8);
  };
  for (int st = 0; st < kDownStages - 1; ++st) issue(st);
  const int ot = threadIdx.x % kTcCols, orow = threadIdx.x / kTcCols;  // thread < 128: output (row, token)
  auto residual = [&](int it) {
    const int d = it * kTcRows + orow;
    return threadIdx.x < kTcRows * kTcCols && ot < T && d < D ? x[size_t(ot) * D + d] : 0.f;
  };
  float old = residual(b);
  pdl_start();
  Act ac, an;
  if (units > 0) load_act(ac);
  for (int i = threadIdx.x; i < U * kTcCols; i += blockDim.x) {
    const int u = i / kTcCols, t = i % kTcCols, r = sh.rank_of[u][t];
    sh.wt[u][t] = r >= 0 ? weights[t * K + r] : 0.f;
  }
  __syncthreads();
  float c[4][4] = {}, run[4] = {};
  for (int u = 0; u < units; ++u) {
    cp_async_wait<kDownStages - 2>();  // unit u's group is in
    const Cursor here = at_use;
    at_use.next(rounds, U, G);
    if (u + 1 < units) load_act(an);
    const int ex = here.ex, c0 = here.round * kDownChunks, stage = u % kDownStages;
    const bool live = quad < T && sh.rank_of[ex][quad] >= 0;
#pragma unroll
    for (int j = 0; j < kDownChunks; ++j) {
      if (c0 + j >= chunks) break;
      float xv[8] = {};
      if (live) {
        const uint4 p = ac[j][0], q = ac[j][1];
        unpack8(make_float4(__uint_as_float(p.x), __uint_as_float(p.y), __uint_as_float(p.z), __uint_as_float(p.w)),
                make_float4(__uint_as_float(q.x), __uint_as_float(q.y), __uint_as_float(q.z), __uint_as_float(q.w)), xv);
      }
      uint32_t hi[2][2], lo[2][2], a[2][4];
      split_fragments(xv, hi, lo);
      a_fragments(*slot(stage, j, 0), *slot(stage, j, 1), a);
      mma_chunk(c, a, hi, lo);
    }
    issue((u + kDownStages - 1) % kDownStages);  // unit u + kDownStages - 1, into the stage read a unit ago
#pragma unroll
    for (int j = 0; j < kDownChunks; ++j) ac[j][0] = an[j][0], ac[j][1] = an[j][1];
    if (here.round != rounds - 1) continue;  // the expert goes on in the next unit
    float s4[4];
    chain_sums(c, s4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      run[i] = fmaf(sh.wt[ex][2 * qi + (i & 1)], s4[i], run[i]);
#pragma unroll
      for (int j = 0; j < 4; ++j) c[j][i] = 0.f;
    }
    if (ex != U - 1) continue;  // the item goes on with the next expert
    store_values(sh.tile[warp], run, quad, qi);
#pragma unroll
    for (int i = 0; i < 4; ++i) run[i] = 0.f;
    __syncthreads();
    const int it = here.it, d = it * kTcRows + orow;
    if (threadIdx.x < kTcRows * kTcCols) {
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) total += sh.tile[w][orow][ot];
      if (ot < T && d < D) x[size_t(ot) * D + d] = old + total;
    }
    if (it + G < nD) old = residual(it + G);
    __syncthreads();  // the tiles are the next item's
  }
}

int g_moe_down_tc = 2;  // set_moe_down_tc

// The share of the T K (token, expert) picks that repeat an expert, as expected for picks uniform
// over the E experts: 1 - E (1 - (1 - K / E)^T) / (T K). Measured (docs/benchmarks.md, "the down
// projection per distinct expert, merged"): a win at 17% (OLMoE shape B = 4) and 19% (Qwen3 B = 8),
// a loss at 12.5% (Mixtral B = 2) and below, where the 8-column MMAs, the ranking and act's re-reads
// per item cost more than the re-read weights they save.
constexpr double kMinRepeatShare = 0.15;
double repeat_share(int T, int E, int K) {
  const double distinct = E * (1.0 - std::pow(1.0 - double(K) / E, T));
  return 1.0 - distinct / (double(T) * K);
}
}  // namespace

void set_moe_down_tc(int mode) { g_moe_down_tc = mode; }

bool moe_down_tc_fits(int T, int F) {
  return g_moe_down_tc != 0 && T >= 2 && T <= kTcCols && F % (kWarps * kTcChunk) == 0;
}

bool moe_down_tc_chosen(int T, int E, int K, int F) {
  return moe_down_tc_fits(T, F) && (g_moe_down_tc == 1 || repeat_share(T, E, K) >= kMinRepeatShare);
}

cudaError_t moe_down_tc(float* x, const float* act, const bf16* Wd, const float* weights, const long long* acc, int T,
                        int E, int K, int D, int F, cudaStream_t s) {
  if (!moe_down_tc_fits(T, F) || !router_in_oproj_fits(D, E, K)) return cudaErrorInvalidValue;
  constexpr size_t smem = size_t(kWarps) * kDownStages * kDownChunks * 2 * 32 * sizeof(uint4);
  static const cudaError_t allowed =
      cudaFuncSetAttribute(moe_down_tc_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (allowed != cudaSuccess) return allowed;
  static const int per_sm = [] {  // 1 at least
    int n = 0;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, moe_down_tc_kernel, kWarps * 32, smem) == cudaSuccess
               ? std::max(n, 1)
               : 1;
  }();
  const int blocks = std::min((D + kTcRows - 1) / kTcRows, per_sm * sm_count());
  return launch(moe_down_tc_kernel, blocks, kWarps * 32, smem, s, x, act, Wd, weights, acc, T, E, K, D, F,
                moe_warp_topk());
}

}  // namespace tiermoe::cuda
