// Grouped MoE for decode batches (kernels.h: moe_grouped_gate_up, moe_grouped_down, moe_combine).
// Why: with B tokens each picking K experts, the per-(token, k) kernels read an expert's rows once
// per token that picked it; here one block per (expert, tile of output rows) reads its rows once
// for all of that expert's tokens. The block finds its tokens itself by scanning the routing table
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

}  // namespace

cudaError_t moe_grouped_gate_up(float* act, const float* h, const bf16* Wgu, const int32_t* ids, int T, int K, int E,
                                int F, int D, cudaStream_t s) {
  if (!grouped_shape_ok(T, K, E)) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  return launch(moe_grouped_kernel<true>,
                dim3((F + kRowWarps - 1) / kRowWarps, E), kRowWarps * 32, 0, s, act, h, Wgu, ids, T * K, K, F, D);
}

cudaError_t moe_grouped_down(float* y, const float* act, const bf16* Wd, const int32_t* ids, int T, int K, int E,
                             int D, int F, cudaStream_t s) {
  if (!grouped_shape_ok(T, K, E)) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  return launch(moe_grouped_kernel<false>,
                dim3((D + kRowWarps - 1) / kRowWarps, E), kRowWarps * 32, 0, s, y, act, Wd, ids, T * K, K, D, F);
}

cudaError_t moe_combine(float* x, const float* y, const float* weights, int T, int K, int D, cudaStream_t s) {
  if (T == 0) return cudaSuccess;
  const unsigned blocks = unsigned(std::min<size_t>((size_t(T) * D + 255) / 256, 4096));
  return launch(moe_combine_kernel, blocks, 256, 0, s, x, y, weights, T, K, D);
}

}  // namespace tiermoe::cuda
