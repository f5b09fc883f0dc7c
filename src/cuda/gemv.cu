// The GEMV kernels declared in kernels.h: gemv (one projection, optionally normed and
// accumulating, optionally summing the router's logits or folding each row's argmax) and gemv3
// (three projections of one input).
#include "cuda/gemv.cuh"

#include <algorithm>

namespace tiermoe::cuda {
namespace {

constexpr int kGemvBlockRows = kWarps * kGemvRows;

// With rl.acc: thread e < rl.E then adds its expert's share of the unscaled router logits over the
// block's rows of y, rl.Wr[e, rows] . (y[t, rows] * rl.norm_w[rows]), into rl.acc[t, e] (y = h, the
// residual stream after this projection; its weights are loaded before the wait).
// With ARGMAX (best): thread t < T then folds the block's outputs for token t, kept in shared
// memory, into best[t] (argmax_key, atomicMax only when it beats the slot as read before the wait,
// so that once a large logit is in, most blocks add no atomic).
// PIPE: gemv_rows's pipelined rounds (one token, rows longer than one round).
template <int TT, bool NORM, bool ARGMAX, bool PIPE = false>
__global__ void __launch_bounds__(kWarps * 32) gemv_kernel(float* __restrict__ y, const float* __restrict__ x,
                                                           const bf16* __restrict__ W, int T, int N, int K,
                                                           bool accumulate, const float* __restrict__ nw, float eps,
                                                           bool staged, RouterLogits rl, unsigned long long* best) {
  __shared__ GemvStage st;
  __shared__ float kept[kGemvBlockRows][TT];  // with best: the block's outputs, kept on chip
  const int d0 = blockIdx.x * kGemvBlockRows, warp = threadIdx.x >> 5, n0 = d0 + warp * kGemvRows, e = threadIdx.x;
  const bool routes = rl.acc && e < rl.E;
  float wr[kGemvBlockRows];
#pragma unroll
  for (int r = 0; r < kGemvBlockRows; ++r)
    wr[r] = routes && d0 + r < N ? bf(rl.Wr[size_t(e) * N + d0 + r]) * rl.norm_w[d0 + r] : 0.f;
  // The slot as this block starts: only a filter for the atomic below (a stale value just costs an
  // atomic), read before the wait so that its round trip is off the block's tail. No kernel of this
  // step writes it before the LM head; argmax_tokens of the step before cleared it.
  unsigned long long* slot = ARGMAX && threadIdx.x < T ? best + size_t(threadIdx.x) * kRouterLogitStride : nullptr;
  const unsigned long long seen = slot ? __ldcg(slot) : 0;
  gemv_rows<TT, NORM, kGemvRows, PIPE>(y, x, nw, eps, W, T, N, K, accumulate, n0, threadIdx.x & 31, nullptr,
                                       staged ? &st : nullptr,
                      true, ARGMAX ? &kept[warp * kGemvRows][0] : nullptr);
  if (!rl.acc && !ARGMAX) return;
  __syncthreads();  // the block's rows of y are written (and kept)
  if (ARGMAX && slot) {
    const int t = threadIdx.x;
    unsigned long long key = 0;
    for (int r = 0; r < kGemvBlockRows && d0 + r < N; ++r) key = max(key, argmax_key(kept[r][t], d0 + r));
    if (key > seen) atomicMax(slot, key);
  }
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

// NR rows per warp: 2 for one token where the stream (below) does not fit (half the blocks of NR =
// 1: one wave at the OLMoE / Qwen3 shapes instead of about 1.5; 3-5% faster per token,
// docs/benchmarks.md), else 1 (T > 1 was not timed). TIERMOE_CUDA_GEMV3_ROWS=1|2 forces either
// instead of the stream (A/B timing).
template <int TT, bool NORM, int NR>
__global__ void __launch_bounds__(kWarps * 32) gemv3_kernel(GemvSegs segs, const float* __restrict__ x, int T,
                                                            int K, const float* __restrict__ nw, float eps,
                                                            bool staged) {
  __shared__ GemvStage st;
  const GemvSeg g = segment_of(segs, blockIdx.x);
  const int n0 = (g.block * kWarps + (threadIdx.x >> 5)) * NR;
  gemv_rows<TT, NORM, NR>(g.y, x, nw, eps, g.W, T, g.N, K, false, n0, threadIdx.x & 31, nullptr, staged ? &st : nullptr);
  zero_router_slots(segs);
}

// One token's GEMV as a stream (K % 2048 == 0, x staged): one wave of blocks (2 per SM) stage x
// (times nw, and inv with the norm) once, then every warp walks the rows of up to three segments
// (q/k/v for gemv3; one for the LM head), gridDim.x * kWarps apart, in units of 2048 weights (8
// 16-byte loads per lane), the next unit's loads issued before this one's dot product; the first
// unit's before the wait. Why: by rows, the q/k/v rows of the OLMoE / Qwen3 shapes take 1.5 waves
// of blocks or two rounds per warp, an LM head several waves, each round or wave a memory latency.
// The sums run in the same order as gemv_rows's: the same bits. With ARGMAX (best, T = 1) each warp
// keeps the argmax_key of its rows and the block's best goes into best[0] as gemv_kernel's does.
template <bool NORM, bool ARGMAX>
__global__ void __launch_bounds__(kWarps * 32, kStreamBlocksPerSm) gemv_stream_kernel(GemvSegs segs, const float* __restrict__ x, int K,
                                                                     const float* __restrict__ nw, float eps,
                                                                     unsigned long long* best) {
  constexpr int kUnit = 2048, kL = kUnit / 256;  // weights per unit, loads per lane per unit
  __shared__ GemvStage st;
  __shared__ unsigned long long warp_best[kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, P = K / kUnit, stride = gridDim.x * kWarps;
  const int w0 = blockIdx.x * kWarps + warp, N = segs.N[0] + segs.N[1] + segs.N[2];
  const int units = (w0 < N ? (N - 1 - w0) / stride + 1 : 0) * P;
  auto row_of = [&](int u) { return w0 + u / P * stride; };
  auto weights_of = [&](int n) {  // row n of the three segments back to back
    return n < segs.N[0] ? segs.W[0] + size_t(n) * K
                         : (n < segs.N[0] + segs.N[1] ? segs.W[1] + size_t(n - segs.N[0]) * K
                                                      : segs.W[2] + size_t(n - segs.N[0] - segs.N[1]) * K);
  };
  auto load = [&](uint4(&v)[kL], int u) {
    const bf16* w = weights_of(row_of(u)) + size_t(u % P) * kUnit + 8 * lane;
#pragma unroll
    for (int j = 0; j < kL; ++j) v[j] = ldg16(w + 256 * j);
  };
  uint4 a[kL], b[kL];
  if (units > 0) load(a, 0);
  // best[0] as this block starts: a filter for the atomic (gemv_kernel's reason), read before the wait.
  const unsigned long long seen = ARGMAX && threadIdx.x == 0 ? __ldcg(best) : 0;
  pdl_start();
  zero_router_slots(segs);
  stage_x<1, NORM>(st, x, nw, eps, 1, K);
  const float inv = NORM ? st.inv[0] : 1.f;
  float s = 0.f;
  unsigned long long key = 0;  // ARGMAX: the warp's best row so far
  auto dot = [&](const uint4(&v)[kL], int u) {
    const float* xs = st.x + (u % P) * kUnit + 8 * lane;
#pragma unroll
    for (int j = 0; j < kL; ++j) s += dot8(v[j], xs + 256 * j);
    if ((u + 1) % P) return;  // the row goes on in the next unit
    const float r = warp_sum(s) * inv;
    s = 0.f;
    const int n = row_of(u);
    if (ARGMAX) key = max(key, argmax_key(r, n));
    if (lane == 0)
      (n < segs.N[0] ? segs.y[0][n] : (n < segs.N[0] + segs.N[1] ? segs.y[1][n - segs.N[0]] : segs.y[2][n - segs.N[0] - segs.N[1]])) = r;
  };
  stream_units(a, b, units, load, dot);
  if constexpr (ARGMAX) {
    if (lane == 0) warp_best[warp] = key;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < kWarps; ++w) key = max(key, warp_best[w]);
      if (key > seen) atomicMax(best, key);
    }
  }
}

// tokens[t] = the id in best[t] (0 if none), and best[t] = 0 for the next step.
__global__ void argmax_tokens_kernel(int32_t* tokens, unsigned long long* best, int T) {
  pdl_start();
  const int t = threadIdx.x;
  if (t >= T) return;
  unsigned long long* slot = best + size_t(t) * kRouterLogitStride;
  const unsigned long long key = *slot;
  tokens[t] = key ? int32_t(~uint32_t(key)) : 0;
  *slot = 0;
}

bool g_gemv_stage = true;  // TIERMOE_CUDA_GEMV_STAGE=0: the fold (each warp reads x itself)
int g_gemv3_rows = 0;      // gemv3's rows per warp: 0 chosen per launch, else forced
bool g_gemv_stream = true;  // one token's plain / LM-head gemv as a stream (TIERMOE_CUDA_GEMV_STREAM=0: by rows)
int g_gemv_pipe = 1;  // gemv of one token, rows of several rounds pipelined: 0 never, 1 in one wave, 2 always
}  // namespace

bool stage_fits(int T, int K) { return g_gemv_stage && gemv_stage_holds(T, K); }
void set_gemv_stage(bool on) { g_gemv_stage = on; }
void set_gemv_stream(bool on) { g_gemv_stream = on; }
void set_gemv_pipe(int mode) { g_gemv_pipe = std::clamp(mode, 0, 2); }
void set_gemv3_rows(int rows) { g_gemv3_rows = rows == 1 || rows == 2 ? rows : 0; }

namespace {
cudaError_t launch_gemv_stream(const GemvSegs& g, const float* x, int K, const float* nw, float eps,
                               unsigned long long* best, cudaStream_t s) {
  const unsigned grid = unsigned(kStreamBlocksPerSm * sm_count());
  if (best)
    return nw ? launch(gemv_stream_kernel<true, true>, grid, kWarps * 32, 0, s, g, x, K, nw, eps, best)
              : launch(gemv_stream_kernel<false, true>, grid, kWarps * 32, 0, s, g, x, K, nw, eps, best);
  return nw ? launch(gemv_stream_kernel<true, false>, grid, kWarps * 32, 0, s, g, x, K, nw, eps, best)
            : launch(gemv_stream_kernel<false, false>, grid, kWarps * 32, 0, s, g, x, K, nw, eps, best);
}

template <int TT>
cudaError_t launch_gemv(float* y, const float* x, const bf16* W, int T, int N, int K, bool accumulate, const float* nw,
                        float eps, RouterLogits rl, unsigned long long* best, cudaStream_t s) {
  const unsigned grid = unsigned((N + kGemvBlockRows - 1) / kGemvBlockRows);
  const bool staged = stage_fits(T, K);
  // One token's plain or normed rows (the LM head, with or without the argmax), more of them than
  // the stream's warps: as a stream.
  if (TT == 1 && g_gemv_stream && staged && K % 2048 == 0 && !accumulate && !rl.acc &&
      N > kStreamBlocksPerSm * sm_count() * kWarps)
    return launch_gemv_stream(GemvSegs{{y, nullptr, nullptr}, {W, nullptr, nullptr}, {N, 0, 0}, {0, 0, 0}, nullptr, 0},
                              x, K, nw, eps, best, s);
  // One token's rows of more than one round of loads: the pipelined rounds, where their registers (2
  // blocks per SM) still leave one wave (no argmax form: the LM heads measured are 2048 wide).
  const bool pipe = g_gemv_pipe == 2 || (g_gemv_pipe == 1 && grid <= unsigned(kStreamBlocksPerSm * sm_count()));
  if (TT == 1 && pipe && !best && K % 8 == 0 && K / 8 > 32 * kLoads)
    return nw ? launch(gemv_kernel<1, true, false, true>, grid, kWarps * 32, 0, s, y, x, W, T, N, K, accumulate, nw, eps,
                       staged, rl, best)
              : launch(gemv_kernel<1, false, false, true>, grid, kWarps * 32, 0, s, y, x, W, T, N, K, accumulate, nw,
                       eps, staged, rl, best);
  // The argmax form only normed (the LM head): the other kernels keep their registers.
  if (best && nw)
    return launch(gemv_kernel<TT, true, true>, grid, kWarps * 32, 0, s, y, x, W, T, N, K, accumulate, nw, eps, staged,
                  rl, best);
  if (best) return cudaErrorInvalidValue;
  if (!nw)
    return launch(gemv_kernel<TT, false, false>, grid, kWarps * 32, 0, s, y, x, W, T, N, K, accumulate, nw, eps,
                  staged, rl, best);
  return launch(gemv_kernel<TT, true, false>, grid, kWarps * 32, 0, s, y, x, W, T, N, K, accumulate, nw, eps, staged,
                rl, best);
}

cudaError_t gemv_any(float* y, const float* x, const bf16* W, int T, int N, int K, bool accumulate, const float* norm_w,
                     float eps, RouterLogits rl, cudaStream_t s, unsigned long long* best = nullptr) {
  if (T <= 0 || T > kGemvMaxT) return cudaErrorInvalidValue;
  if (gemv_tc_fits(T, K))
    return gemv_tc(GemvSegs{{y, nullptr, nullptr}, {W, nullptr, nullptr}, {N, 0, 0}, {0, 0, 0}, nullptr, 0}, x, T, K,
                   accumulate, norm_w, eps, rl, best, s);
  cudaError_t e;
  if (T == 1) e = launch_gemv<1>(y, x, W, T, N, K, accumulate, norm_w, eps, rl, best, s);
  else if (T == 2) e = launch_gemv<2>(y, x, W, T, N, K, accumulate, norm_w, eps, rl, best, s);
  else if (T <= 4) e = launch_gemv<4>(y, x, W, T, N, K, accumulate, norm_w, eps, rl, best, s);
  else e = launch_gemv<8>(y, x, W, T, N, K, accumulate, norm_w, eps, rl, best, s);
  return e != cudaSuccess ? e : cudaGetLastError();
}
}  // namespace

cudaError_t gemv_argmax(float* y, const float* x, const bf16* W, int T, int N, int K, const float* norm_w, float eps,
                        unsigned long long* best, cudaStream_t s) {
  if (!best || !norm_w) return cudaErrorInvalidValue;  // the LM head's form: with its final norm
  return gemv_any(y, x, W, T, N, K, false, norm_w, eps, RouterLogits{}, s, best);
}

cudaError_t argmax_tokens(int32_t* tokens, unsigned long long* best, int T, cudaStream_t s) {
  if (T <= 0 || T > kGemvMaxT || !tokens || !best) return cudaErrorInvalidValue;
  return launch(argmax_tokens_kernel, 1, 32, 0, s, tokens, best, T);
}

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
  if (TT == 1 && g_gemv3_rows == 0 && staged && K % 2048 == 0) return launch_gemv_stream(g, x, K, nw, eps, nullptr, s);
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
  if (gemv_tc_fits(T, K)) return gemv_tc(g, x, T, K, false, norm_w, eps, RouterLogits{}, nullptr, s);
  cudaError_t e;
  if (T == 1) e = launch_gemv3<1>(g, x, T, K, norm_w, eps, s);
  else if (T == 2) e = launch_gemv3<2>(g, x, T, K, norm_w, eps, s);
  else if (T <= 4) e = launch_gemv3<4>(g, x, T, K, norm_w, eps, s);
  else e = launch_gemv3<8>(g, x, T, K, norm_w, eps, s);
  return e != cudaSuccess ? e : cudaGetLastError();
}
}  // namespace tiermoe::cuda
