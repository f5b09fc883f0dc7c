// The GEMV of 2 .. 8 tokens on the tensor cores (gemv.cuh: gemv_tc), what gemv and gemv3 run there.
// Why: the CUDA-core GEMV reads x once per weight row, T times the weight bytes from L1 or shared
// memory (Qwen3's o projection at T = 8: 56 us under ncu for 4 us of weight bytes); here an MMA
// takes 16 weight rows against all 8 token columns, so x is read once per 16 rows.
//
// y[T, N] = x[T, K] W[N, K]^T as m16n8k16 MMAs (gemv_tc.cuh): the 16 rows of a block as the A
// operand, the tokens as the 8 columns of B, x as BF16 hi + lo parts (two MMAs each, FP32-level
// products, as the cuBLAS path's two GEMMs).
#include "cuda/gemv_tc.cuh"

namespace tiermoe::cuda {
namespace {

constexpr int kTcRound = 8;  // chunks per round of loads (16 loads of 16 bytes per lane)
constexpr int kTcMinK = kWarps * kTcChunk;  // K a multiple of this: every warp takes whole chunks

// grid: a block per 16 rows of each segment (end_block), kWarps warps; warp w takes k in [w K / kWarps,
// (w + 1) K / kWarps) of the block's rows for all tokens, in rounds of kTcRound chunks (the first
// round's loads before the wait), and the block sums its warps' tiles in warp order (the same bits
// on every run). Then, as gemv_kernel: with rl.acc thread e < E adds its expert's share of the
// router logits over the block's rows (segment 0 only: gemv's one projection); with ARGMAX thread
// t < T folds the block's outputs for token t into best[t].
template <bool NORM, bool ARGMAX>
__global__ void __launch_bounds__(kWarps * 32) gemv_tc_kernel(GemvSegs segs, const float* __restrict__ x, int T, int K,
                                                              bool accumulate, const float* __restrict__ nw, float eps,
                                                              RouterLogits rl, unsigned long long* best) {
  __shared__ float tile[kWarps][kTcRows][kTcCols];  // each warp's partial sums
  __shared__ float ssw[kWarps][kTcCols];            // NORM: each warp's share of sum(x_t^2)
  __shared__ float out[kTcRows][kTcCols];           // the block's outputs, for the folds
  const GemvSeg seg = segment_of(segs, blockIdx.x);
  float* y = seg.y;
  const bf16* W = seg.W;
  const int N = seg.N, n0 = seg.block * kTcRows;
  const bool seg0 = blockIdx.x < unsigned(segs.end_block[0]);  // the router fold: gemv's one projection
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, quad = lane >> 2, qi = lane & 3;
  const int Kw = K / kWarps, k0 = warp * Kw + 8 * qi, chunks = Kw / kTcChunk;
  // Rows quad and quad + 8 of the block (past N: the last row's weights, their sums not written).
  const bf16* wa = W + size_t(min(n0 + quad, N - 1)) * K + k0;
  const bf16* wb = W + size_t(min(n0 + quad + 8, N - 1)) * K + k0;
  uint4 wv[kTcRound][2];
  auto load_round = [&](int c0) {
#pragma unroll
    for (int j = 0; j < kTcRound; ++j)
      if (c0 + j < chunks) wv[j][0] = ldg16(wa + kTcChunk * (c0 + j)), wv[j][1] = ldg16(wb + kTcChunk * (c0 + j));
  };
  load_round(0);
  const int e = threadIdx.x;
  const bool routes = rl.acc && seg0 && e < rl.E;
  float wr[kTcRows];  // router row e over the block's rows, times the FFN norm
#pragma unroll
  for (int r = 0; r < kTcRows; ++r)
    wr[r] = routes && n0 + r < N ? bf(rl.Wr[size_t(e) * N + n0 + r]) * rl.norm_w[n0 + r] : 0.f;
  // As gemv_kernel: the slot as this block starts filters the atomic below, read before the wait.
  unsigned long long* slot = ARGMAX && threadIdx.x < T ? best + size_t(threadIdx.x) * kRouterLogitStride : nullptr;
  const unsigned long long seen = slot ? __ldcg(slot) : 0;
  pdl_start();
  zero_router_slots(segs);
  // Thread i's output (row i / 8, token i % 8): y's old value for accumulate, read early.
  const int orow = threadIdx.x / kTcCols, ot = threadIdx.x % kTcCols;
  const bool owns = threadIdx.x < kTcRows * kTcCols && ot < T && n0 + orow < N;
  const float old = owns && accumulate ? y[size_t(ot) * N + n0 + orow] : 0.f;

  const bool live = quad < T;
  const float* xk = x + size_t(live ? quad : 0) * K + k0;
  const float* nwk = NORM ? nw + k0 : nullptr;
  float c[4][4] = {}, ss = 0.f;  // four accumulator chains: (first, second MMA) x (hi, lo)
  for (int c0 = 0; c0 < chunks; c0 += kTcRound) {
    if (c0 > 0) load_round(c0);
#pragma unroll
    for (int j = 0; j < kTcRound; ++j) {
      if (c0 + j >= chunks) break;
      const int off = kTcChunk * (c0 + j);
      uint32_t hi[2][2], lo[2][2];
      x_fragments<NORM>(xk + off, NORM ? nwk + off : nullptr, live, hi, lo, ss);
      uint32_t a[2][4];
      a_fragments(wv[j][0], wv[j][1], a);
      mma_chunk(c, a, hi, lo);
    }
  }
  store_tile(tile[warp], c, quad, qi);
  if constexpr (NORM) {  // token quad's squares: the warp's 4 lanes of it
    ss += __shfl_xor_sync(0xffffffffu, ss, 1);
    ss += __shfl_xor_sync(0xffffffffu, ss, 2);
    if (qi == 0) ssw[warp][quad] = ss;
  }
  __syncthreads();
  if (threadIdx.x < kTcRows * kTcCols) {
    float v = 0.f, sq = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      v += tile[w][orow][ot];
      if (NORM) sq += ssw[w][ot];
    }
    if (NORM) v *= 1.0f / sqrtf(sq / float(K) + eps);  // as rmsnorm() computes it
    v = accumulate ? old + v : v;
    if (owns) y[size_t(ot) * N + n0 + orow] = v;
    out[orow][ot] = v;
  }
  if (!(rl.acc && seg0) && !ARGMAX) return;  // the block as a whole: a barrier follows
  __syncthreads();
  if (ARGMAX && slot) {
    const int t = threadIdx.x;
    unsigned long long key = 0;
    for (int r = 0; r < kTcRows && n0 + r < N; ++r) key = max(key, argmax_key(out[r][t], n0 + r));
    if (key > seen) atomicMax(slot, key);
  }
  if (!routes) return;
  for (int t = 0; t < T; ++t) {
    float p = 0.f;
#pragma unroll
    for (int r = 0; r < kTcRows; ++r) p = fmaf(wr[r], out[r][t], p);  // wr is 0 past N
    add_logit(rl.acc + (size_t(t) * rl.E + e) * kRouterLogitStride, p);
  }
}

int g_gemv_tc = 2;  // set_gemv_tc
}  // namespace

void set_gemv_tc(int mode) { g_gemv_tc = mode < 0 || mode > 2 ? 2 : mode; }

bool gemv_tc_fits(int T, int K) {
  return g_gemv_tc > 0 && T >= 2 && T <= kTcCols && K > 0 && K % kTcMinK == 0 &&
         (g_gemv_tc == 1 || T > 2 || !stage_fits(T, K));
}

cudaError_t gemv_tc(GemvSegs g, const float* x, int T, int K, bool accumulate, const float* nw, float eps,
                    RouterLogits rl, unsigned long long* best, cudaStream_t s) {
  if (!gemv_tc_fits(T, K) || (best && (!nw || accumulate))) return cudaErrorInvalidValue;
  int end = 0;
  for (int i = 0; i < 3; ++i) {
    end += (g.N[i] + kTcRows - 1) / kTcRows;
    g.end_block[i] = end;
  }
  if (end == 0) return cudaSuccess;
  if (best) return launch(gemv_tc_kernel<true, true>, end, kWarps * 32, 0, s, g, x, T, K, false, nw, eps, rl, best);
  return nw ? launch(gemv_tc_kernel<true, false>, end, kWarps * 32, 0, s, g, x, T, K, accumulate, nw, eps, rl, best)
            : launch(gemv_tc_kernel<false, false>, end, kWarps * 32, 0, s, g, x, T, K, accumulate, nw, eps, rl, best);
}

}  // namespace tiermoe::cuda
