// Grouped MoE for decode batches (kernels.h: moe_grouped_gate_up, moe_grouped_down, moe_combine).
// Why: with B tokens each picking K experts, the per-(token, k) kernels read an expert's rows once
// per token that picked it; here one block per (expert, tile of output rows) reads its rows once
// for all of that expert's tokens, on the tensor cores (moe_grouped_mma_kernel) or, for rows that
// are not whole 16-byte loads, on the CUDA cores (moe_grouped_kernel). The block finds its tokens itself by scanning the routing table
// ids[T, K] into shared memory (no sort, no padding, no host sync) and leaves at once when the
// expert has none. The down projection writes one row per (token, k) to a scratch buffer and a
// small pass sums over k in k order: deterministic, unlike atomics into x whose sum order would
// depend on block scheduling.
#include "cuda/kernels.h"

#include "cuda/dependent_launch.cuh"
#include "cuda/device_math.cuh"

#include <algorithm>

namespace tiermoe::cuda {
namespace {

constexpr int kRowWarps = 8;     // output rows per block, one warp each
constexpr int kTokenGroup = 8;   // tokens per pass over a weight row (their sums in registers)
// 16-byte weight loads per lane (and per row) issued together, then their dot products. 1, in this
// form: ptxas gives the down kernel 48 registers (5 blocks of 256 threads per SM) where the
// interleaved loop took 56 (4 blocks); 4 loads in flight took 80 / 97 registers and was slower
// (docs/benchmarks.md, "Grouped MoE kernels: registers").
constexpr int kLoadsPerLane = 1;

// The entries tk = t * K + k of ids[TK] equal to e, into list[]; returns their number (every
// thread). The list's order varies between launches, but each entry's result is computed alone,
// so the outputs do not.
__device__ int collect_tokens(short* list, int* count, const int32_t* ids, int TK, int e) {
  if (threadIdx.x == 0) *count = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < TK; i += blockDim.x)
    if (ids[i] == e) list[atomicAdd(count, 1)] = short(i);
  __syncthreads();
  return *count;
}

// out[tk, r] = dot(W[r, 0:L], in[row(tk), 0:L]) for a group of up to kTokenGroup entries, one
// warp, with the weight row read once per group (from L1/L2 after the first group). Two weight
// rows at once (gate and up share the input): when W2 is null only the first is computed.
// row(tk) = tk / div (div = K: the token's hidden state; div = 1: the (token, k) activation).
__device__ void rows_times_tokens(float* s1, float* s2, const uint16_t* W1, const uint16_t* W2, const float* in,
                                  const short* tks, int m, int div, int L, int lane) {
  const float* x[kTokenGroup];
#pragma unroll
  for (int j = 0; j < kTokenGroup; ++j) {
    x[j] = in + size_t(tks[j < m ? j : m - 1] / div) * L;
    s1[j] = s2[j] = 0.f;
  }
  if ((L & 7) == 0) {
    const int L8 = L >> 3;
    for (int i0 = lane; i0 < L8; i0 += 32 * kLoadsPerLane) {
      uint4 a[kLoadsPerLane], b[kLoadsPerLane];
#pragma unroll
      for (int c = 0; c < kLoadsPerLane; ++c) {
        const int i = i0 + 32 * c;
        if (i < L8) {
          a[c] = ldg16(W1 + 8 * i);
          b[c] = W2 ? ldg16(W2 + 8 * i) : a[c];
        }
      }
#pragma unroll
      for (int c = 0; c < kLoadsPerLane; ++c) {  // the same order of sums as one chunk at a time
        const int i = i0 + 32 * c;
        if (i >= L8) break;
#pragma unroll
        for (int j = 0; j < kTokenGroup; ++j)
          if (j < m) {
            s1[j] += dot8(a[c], x[j] + 8 * i);
            if (W2) s2[j] += dot8(b[c], x[j] + 8 * i);
          }
      }
    }
  } else {
    for (int i = lane; i < L; i += 32) {
      const float a = bf(W1[i]), b = W2 ? bf(W2[i]) : 0.f;
#pragma unroll
      for (int j = 0; j < kTokenGroup; ++j)
        if (j < m) {
          s1[j] = fmaf(a, x[j][i], s1[j]);
          s2[j] = fmaf(b, x[j][i], s2[j]);
        }
    }
  }
#pragma unroll
  for (int j = 0; j < kTokenGroup; ++j)
    if (j < m) {
      s1[j] = warp_sum(s1[j]);
      s2[j] = warp_sum(s2[j]);
    }
}

// grid (ceil(N / kRowWarps), E), a warp per output row r of expert e, rows of length L.
// GATE_UP: act[tk, r] = silu(Wgu[e, r] . h[t]) * (Wgu[e, N + r] . h[t])   (N = F, L = D, W = Wgu)
// else:    y[tk, r] = Wd[e, r] . act[tk]                                   (N = D, L = F, W = Wd)
template <bool GATE_UP>
__global__ void __launch_bounds__(kRowWarps * 32)
    moe_grouped_kernel(float* __restrict__ out, const float* __restrict__ in, const uint16_t* __restrict__ W,
                       const int32_t* __restrict__ ids, int TK, int K, int N, int L) {
  __shared__ short list[kMoeGroupedMaxTK];
  __shared__ int count;
  pdl_wait();
  pdl_launch_dependents();
  const int e = blockIdx.y;
  const int n = collect_tokens(list, &count, ids, TK, e);
  const int lane = threadIdx.x & 31, r = blockIdx.x * kRowWarps + (threadIdx.x >> 5);
  if (n == 0 || r >= N) return;
  const uint16_t* w = W + (size_t(e) * (GATE_UP ? 2 : 1) * N + r) * L;
  for (int j0 = 0; j0 < n; j0 += kTokenGroup) {
    const int m = min(kTokenGroup, n - j0);
    float a[kTokenGroup], b[kTokenGroup];
    rows_times_tokens(a, b, w, GATE_UP ? w + size_t(N) * L : nullptr, in, list + j0, m, GATE_UP ? K : 1, L, lane);
    if (lane == 0)
#pragma unroll
      for (int j = 0; j < kTokenGroup; ++j)
        if (j < m) out[size_t(list[j0 + j]) * N + r] = GATE_UP ? silu(a[j]) * b[j] : a[j];
  }
}

// The same products on the tensor cores (L % 8 == 0): mma.sync m16n8k16 with 16 of the expert's
// rows as A and 8 of its tokens as B, up to GROUPS (1 or 2) groups of 8 tokens per pass over the
// rows. Why: the CUDA-core form reads every input value from L1 once per weight it multiplies, so
// at 4-8 tokens per expert it ran at ~1.6 TB/s (docs/benchmarks.md); here a weight fragment feeds
// one MMA per 8 tokens. A block's kMmaWarps warps take kMmaWarps / kMmaSplit tiles of 16 rows,
// kMmaSplit warps per tile splitting its columns (part p takes chunks p, p + kMmaSplit, ...:
// shorter dependent chains, more loads in flight), and sum their partial tiles through shared
// memory in part order (deterministic). Each lane loads 8 consecutive BF16 of its two rows (16
// bytes) and 8 consecutive floats of its token per 32-column chunk; k slots map to columns the
// same way for A and B (slot 2q + p -> column 8q + p, slot 8 + 2q + p -> 8q + 2 + p in the first
// k-step, + 4 in the second), so the MMA sums the right products without a shuffle. The FP32 input
// is split into BF16 hi + lo (two MMAs), and the accumulators are added to FP32 sums every
// kFoldChunks chunks, as in moe_expert_gemm_bf16: FP32-level results (the tensor cores'
// accumulation truncates).
constexpr int kMmaWarps = 8;    // warps per block: kMmaWarps / kMmaSplit row tiles of 16
// Warps per row tile: 2 was the fastest of 8 / 4 / 2 / 1 at B = 32 and 64 on both bench shapes
// (docs/benchmarks.md, "Grouped MoE on the tensor cores").
constexpr int kMmaSplit = 2;
constexpr int kFoldChunks = 4;  // a warp's chunks of 32 columns per accumulator run

// One 32-column chunk of a lane's weights: rows a and b (lane / 4 and + 8), gate (or down) and up.
struct WeightChunk { uint4 ga, gb, ua, ub; };

template <bool GATE_UP>
__device__ __forceinline__ WeightChunk load_chunk(const uint16_t* wa, const uint16_t* wb, size_t up, int c, bool in) {
  const uint4 zero = make_uint4(0, 0, 0, 0);
  return {in ? ldg16(wa + c) : zero, in ? ldg16(wb + c) : zero, GATE_UP && in ? ldg16(wa + up + c) : zero,
          GATE_UP && in ? ldg16(wb + up + c) : zero};
}

// The B fragments (hi, lo) of one k-step from 4 floats: [0] = columns 0, 1 and [1] = 2, 3.
__device__ __forceinline__ void split_fragment(uint32_t* hi, uint32_t* lo, const float4& v) {
  __nv_bfloat16 h[4], l[4];
  bf16_split(v.x, h[0], l[0]);
  bf16_split(v.y, h[1], l[1]);
  bf16_split(v.z, h[2], l[2]);
  bf16_split(v.w, h[3], l[3]);
  hi[0] = pack(h[0], h[1]), hi[1] = pack(h[2], h[3]);
  lo[0] = pack(l[0], l[1]), lo[1] = pack(l[2], l[3]);
}

// acc[g] += rows (ra, rb) of one chunk times group g's fragments (k-step s: hi[g][s], lo[g][s]).
template <int G>
__device__ __forceinline__ void mma_chunk(float (&acc)[G][4], const uint4& ra, const uint4& rb,
                                          const uint32_t (&hi)[G][2][2], const uint32_t (&lo)[G][2][2]) {
  const uint32_t a0[4] = {ra.x, rb.x, ra.y, rb.y}, a1[4] = {ra.z, rb.z, ra.w, rb.w};
#pragma unroll
  for (int g = 0; g < G; ++g) {
    mma_bf16(acc[g], a0, hi[g][0][0], hi[g][0][1]);
    mma_bf16(acc[g], a0, lo[g][0][0], lo[g][0][1]);
    mma_bf16(acc[g], a1, hi[g][1][0], hi[g][1][1]);
    mma_bf16(acc[g], a1, lo[g][1][0], lo[g][1][1]);
  }
}

// One pass: the warp's tile of 16 rows (from r0) times the tokens list[j0 .. j0 + 8 G) (those
// below n), its part of the columns. Each warp loads its next chunk's weights before this chunk's
// MMAs (two chunks in flight per lane). red: [kMmaWarps][32 lanes][2 G 4] floats of shared memory
// for the sum over a tile's parts (half without up).
template <bool GATE_UP, int G>
__device__ __forceinline__ void mma_pass(float* __restrict__ out, const float* __restrict__ in, const uint16_t* wa,
                                         const uint16_t* wb, size_t up, const short* list, int j0, int n, int div,
                                         int N, int L, int r0, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, part = warp % kMmaSplit, q = lane & 3;
  const float* x[G];  // this lane's token of each group (B column lane / 4), or null
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const int j = j0 + 8 * g + lane / 4;
    x[g] = j < n ? in + size_t(list[j] / div) * L + 8 * q : nullptr;
  }
  float s[2][G][4] = {}, a1[G][4] = {}, a2[G][4] = {};  // s: gate (or down) and up sums
  constexpr int kStride = 32 * kMmaSplit;  // columns between a warp's chunks
  WeightChunk w = load_chunk<GATE_UP>(wa, wb, up, 32 * part, 32 * part + 8 * q < L);
  for (int c = 32 * part, chunk = 1; c < L; c += kStride, ++chunk) {
    const WeightChunk next = load_chunk<GATE_UP>(wa, wb, up, c + kStride, c + kStride + 8 * q < L);
    uint32_t hi[G][2][2], lo[G][2][2];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const bool have = x[g] && c + 8 * q < L;  // L % 8 == 0: the lane's 8 columns are all in or all out
      const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
      split_fragment(hi[g][0], lo[g][0], have ? __ldg(reinterpret_cast<const float4*>(x[g] + c)) : zero);
      split_fragment(hi[g][1], lo[g][1], have ? __ldg(reinterpret_cast<const float4*>(x[g] + c + 4)) : zero);
    }
    mma_chunk<G>(a1, w.ga, w.gb, hi, lo);
    if (GATE_UP) mma_chunk<G>(a2, w.ua, w.ub, hi, lo);
    if (chunk % kFoldChunks == 0 || c + kStride >= L) {
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int i = 0; i < 4; ++i) s[0][g][i] += a1[g][i], s[1][g][i] += a2[g][i], a1[g][i] = a2[g][i] = 0.f;
    }
    w = next;
  }
  if constexpr (kMmaSplit > 1) {  // part 0 sums the tile's parts in part order
    constexpr int kPer = (GATE_UP ? 2 : 1) * G * 4;  // floats per lane: s[0] (and s[1])
    float* mine = red + (warp * 32 + lane) * kPer;
#pragma unroll
    for (int v = 0; v < kPer; ++v) mine[v] = (&s[0][0][0])[v];
    __syncthreads();
    if (part == 0)
#pragma unroll
      for (int v = 0; v < kPer; ++v)
        for (int k = 1; k < kMmaSplit; ++k) (&s[0][0][0])[v] += red[((warp + k) * 32 + lane) * kPer + v];
  }
  if (part == 0)  // the lane holds rows r0 + lane / 4 (i < 2) and + 8 (i >= 2), tokens 2 q, 2 q + 1 of each group
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = r0 + lane / 4 + (i >= 2 ? 8 : 0), j = j0 + 8 * g + 2 * q + (i & 1);
        if (r < N && j < n) out[size_t(list[j]) * N + r] = GATE_UP ? silu(s[0][g][i]) * s[1][g][i] : s[0][g][i];
      }
  if constexpr (kMmaSplit > 1) __syncthreads();  // red is free for the next pass
}

// grid (ceil(N / (16 kMmaWarps / kMmaSplit)), E), kMmaWarps warps; the products of
// moe_grouped_kernel<GATE_UP>, up to GROUPS groups of 8 tokens per pass.
template <bool GATE_UP, int GROUPS>
__global__ void __launch_bounds__(kMmaWarps * 32)
    moe_grouped_mma_kernel(float* __restrict__ out, const float* __restrict__ in, const uint16_t* __restrict__ W,
                           const int32_t* __restrict__ ids, int TK, int K, int N, int L) {
  __shared__ short list[kMoeGroupedMaxTK];
  __shared__ int count;
  __shared__ float red[kMmaWarps * 32 * 2 * GROUPS * 4];
  pdl_wait();
  pdl_launch_dependents();
  const int e = blockIdx.y;
  const int n = collect_tokens(list, &count, ids, TK, e);
  const int lane = threadIdx.x & 31, r0 = (blockIdx.x * (kMmaWarps / kMmaSplit) + (threadIdx.x >> 5) / kMmaSplit) * 16;
  if (n == 0) return;
  // This lane's rows r0 + lane / 4 and + 8 (rows past N read row N - 1; their results are dropped;
  // a tile wholly past N still runs, for the block's barriers).
  const size_t expert = size_t(e) * (GATE_UP ? 2 : 1) * N;
  const uint16_t* wa = W + (expert + min(r0 + lane / 4, N - 1)) * L + 8 * (lane & 3);
  const uint16_t* wb = W + (expert + min(r0 + lane / 4 + 8, N - 1)) * L + 8 * (lane & 3);
  const size_t up = GATE_UP ? size_t(N) * L : 0;  // the up rows, N rows after the gate rows
  const int div = GATE_UP ? K : 1;
  for (int j0 = 0; j0 < n; j0 += 8 * GROUPS) {  // one group when 8 tokens or fewer are left
    if (GROUPS > 1 && n - j0 > 8)
      mma_pass<GATE_UP, GROUPS>(out, in, wa, wb, up, list, j0, n, div, N, L, r0, red);
    else
      mma_pass<GATE_UP, 1>(out, in, wa, wb, up, list, j0, n, div, N, L, r0, red);
  }
}

// x[t, d] += sum over k, in k order, of weights[t, k] * y[t * K + k, d].
__global__ void moe_combine_kernel(float* __restrict__ x, const float* __restrict__ y,
                                   const float* __restrict__ weights, int T, int K, int D) {
  pdl_wait();
  pdl_launch_dependents();
  const size_t n = size_t(T) * D;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const size_t t = i / D, d = i % D;
    float acc = x[i];
    for (int k = 0; k < K; ++k) acc = fmaf(weights[t * K + k], y[(t * K + k) * D + d], acc);
    x[i] = acc;
  }
}

bool grouped_shape_ok(int T, int K, int E) { return T >= 0 && K >= 1 && T * K <= kMoeGroupedMaxTK && E >= 1 && E <= 65535; }

bool g_grouped_mma = true;
int g_groups = 0;  // token groups per pass at most: 0 = by the rule in grouped_launch, else pinned (A/B)

template <bool GATE_UP, int GROUPS>
cudaError_t mma_launch(float* out, const float* in, const bf16* W, const int32_t* ids, int T, int K, int E, int N,
                       int L, cudaStream_t s) {
  constexpr int rows = 16 * kMmaWarps / kMmaSplit;
  return launch(moe_grouped_mma_kernel<GATE_UP, GROUPS>, dim3((N + rows - 1) / rows, E), kMmaWarps * 32, 0, s, out,
                in, W, ids, T * K, K, N, L);
}

// The products of one grouped launch: on the tensor cores where rows are whole 16-byte loads
// (L % 8 == 0) unless set_moe_grouped_mma(false) pins the CUDA cores. One group of 8 tokens per
// pass when an expert has 4 tokens or fewer on average (T K <= 4 E): fewer registers (gate/up 80
// against 112, 3 blocks per SM instead of 2), and a second pass is rare; two groups above. Measured both ways at B = 32
// and 64 on both bench shapes, the rule picks the faster in each (docs/benchmarks.md).
template <bool GATE_UP>
cudaError_t grouped_launch(float* out, const float* in, const bf16* W, const int32_t* ids, int T, int K, int E, int N,
                           int L, cudaStream_t s) {
  if (!grouped_shape_ok(T, K, E)) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  if (g_grouped_mma && L % 8 == 0) {
    const int groups = g_groups ? g_groups : T * K <= 4 * E ? 1 : 2;
    return groups == 1 ? mma_launch<GATE_UP, 1>(out, in, W, ids, T, K, E, N, L, s)
                       : mma_launch<GATE_UP, 2>(out, in, W, ids, T, K, E, N, L, s);
  }
  return launch(moe_grouped_kernel<GATE_UP>, dim3((N + kRowWarps - 1) / kRowWarps, E), kRowWarps * 32, 0, s, out,
                in, W, ids, T * K, K, N, L);
}

}  // namespace

void set_moe_grouped_mma(bool on) { g_grouped_mma = on; }
void set_moe_grouped_groups(int groups) { g_groups = groups == 1 || groups == 2 ? groups : 0; }

cudaError_t moe_grouped_gate_up(float* act, const float* h, const bf16* Wgu, const int32_t* ids, int T, int K, int E,
                                int F, int D, cudaStream_t s) {
  return grouped_launch<true>(act, h, Wgu, ids, T, K, E, F, D, s);
}

cudaError_t moe_grouped_down(float* y, const float* act, const bf16* Wd, const int32_t* ids, int T, int K, int E,
                             int D, int F, cudaStream_t s) {
  return grouped_launch<false>(y, act, Wd, ids, T, K, E, D, F, s);
}

cudaError_t moe_combine(float* x, const float* y, const float* weights, int T, int K, int D, cudaStream_t s) {
  if (T == 0) return cudaSuccess;
  const unsigned blocks = unsigned(std::min<size_t>((size_t(T) * D + 255) / 256, 4096));
  return launch(moe_combine_kernel, blocks, 256, 0, s, x, y, weights, T, K, D);
}

}  // namespace tiermoe::cuda
