// The merge of split-KV attention partials inside attention_decode's last block of a (token, KV
// head); the combine launch after the tensor-core kernel has its own (kernels.cu). A partial row
// is (m, l, o[Dh]) per (head, split): m the split's max score (natural-log units, -inf for a split
// with no visible key), l its sum of e^(score - m), o its unnormalized P V;
// out = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s.
//
// Why staged: the rows were just written by other blocks, so they live in L2, and a merge that
// reads them where they are waits one L2 round trip for the maxima and then one per 8 splits it
// unrolls (40 splits at 4096 keys: 6 round trips at the end of every attention). Here the rows
// come into shared memory in one round of 16-byte cp.async (L2 only: L1 is not coherent within a
// launch, and a line of these rows may have been read on this SM before the other blocks wrote it),
// and the arithmetic runs from there. Rows that do not all fit come in chunks of splits, each
// output's sums rescaled when a chunk raises its head's maximum (as an online softmax does).
#pragma once
#include <cmath>

#include "cuda/device_math.cuh"

namespace tiermoe::cuda {

// Floats of shared memory one head's rows of n splits take in merge_splits(): rounded up to 16 bytes,
// plus 4 of slack (the rows are staged with the alignment they have in global memory).
__host__ __device__ constexpr int merge_span(int n, int Dh) { return ((n * (Dh + 2) + 3) & ~3) + 4; }

// Copies n floats of p (L2 only) to dst, where dst and p agree modulo 16 bytes when p is 8-byte
// aligned (16-byte cp.async for the aligned middle, plain loads for the ends); otherwise plain loads.
__device__ inline void stage_rows(float* dst, const float* __restrict__ p, int n) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (a & 7) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = __ldcg(p + i);
    return;
  }
  const int head = (a & 15) ? 2 : 0, end = max(head, head + ((n - head) & ~3));
  for (int i = head + 4 * int(threadIdx.x); i < end; i += 4 * int(blockDim.x)) cp_async16(dst + i, p + i, true);
  if (threadIdx.x < 2 && head && threadIdx.x < n) dst[threadIdx.x] = __ldcg(p + threadIdx.x);
  if (int(threadIdx.x) < n - end) dst[end + threadIdx.x] = __ldcg(p + end + threadIdx.x);
}

// All threads of the block: heads 0 .. nh - 1 of p ([nh][n_splits][Dh + 2] floats, as written by
// the splits) -> out[nh][Dh]. buf: buf_floats of shared memory, 16-byte aligned, at least
// merge_span(1, Dh); Mh, scale: nh floats of shared memory each. MAXI: output elements
// per thread at most (nh * Dh <= MAXI * blockDim.x). When everything fits in one chunk the sums
// run in split order from zero: the bits of a single pass.
template <int MAXI>
__device__ inline void merge_splits(float* __restrict__ out, const float* __restrict__ p, int nh, int n_splits,
                                    int Dh, float* buf, int buf_floats, float* Mh, float* scale) {
  const int row = Dh + 2, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = int(blockDim.x >> 5);
  // Splits per chunk: the most whose merge_span() fits buf (at least 1: buf holds merge_span(1, Dh)).
  int per_chunk = min(n_splits, (buf_floats - 4) / row);
  if (per_chunk > 1 && merge_span(per_chunk, Dh) > buf_floats) --per_chunk;
  per_chunk = max(per_chunk, 1);
  const int span = merge_span(per_chunk, Dh);  // floats of buf per head
  const int heads = per_chunk == n_splits ? max(1, min(nh, buf_floats / span)) : 1;  // per group
  for (int g0 = 0; g0 < nh; g0 += heads) {
    const int hn = min(heads, nh - g0);
    float a[MAXI], L[MAXI];
#pragma unroll
    for (int i = 0; i < MAXI; ++i) a[i] = L[i] = 0.f;
    if (threadIdx.x < hn) Mh[threadIdx.x] = -INFINITY;
    for (int s0 = 0; s0 < n_splits; s0 += per_chunk) {
      const int ns = min(per_chunk, n_splits - s0);
      // Head g's rows s0 .. s0 + ns - 1: src(g) in p, stage(g) in buf (a 16-byte aligned base plus
      // src(g)'s offset modulo 16).
      auto src = [&](int g) { return p + (size_t(g0 + g) * n_splits + s0) * row; };
      auto stage = [&](int g) { return buf + g * span + ((reinterpret_cast<uintptr_t>(src(g)) & 15) >> 2); };
      __syncthreads();  // the previous chunk (and Mh's reset) done with
      for (int g = 0; g < hn; ++g) stage_rows(stage(g), src(g), ns * row);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
      for (int g = warp; g < hn; g += warps) {  // the head's new maximum, and what the old sums are worth now
        const float* r = stage(g);
        float M = -INFINITY;
        for (int s = lane; s < ns; s += 32) M = fmaxf(M, r[s * row]);
        M = fmaxf(warp_max(M), Mh[g]);
        __syncwarp();
        if (lane == 0) {
          scale[g] = Mh[g] == -INFINITY ? 0.f : expf(Mh[g] - M);
          Mh[g] = M;
        }
      }
      __syncthreads();
      for (int i = threadIdx.x; i < hn * ns; i += blockDim.x) {  // each split's weight once, in place of its m
        float* m = stage(i / ns) + (i % ns) * row;
        *m = *m == -INFINITY ? 0.f : expf(*m - Mh[i / ns]);
      }
      __syncthreads();
#pragma unroll
      for (int k = 0; k < MAXI; ++k) {
        const int it = threadIdx.x + k * int(blockDim.x);
        if (it >= hn * Dh) break;
        const int g = it / Dh, d = it % Dh;
        const float* r = stage(g);
        float ak = a[k] * scale[g], lk = L[k] * scale[g];
        for (int s = 0; s < ns; ++s, r += row) {
          lk = fmaf(r[1], r[0], lk);
          ak = fmaf(r[2 + d], r[0], ak);
        }
        a[k] = ak, L[k] = lk;
      }
    }
#pragma unroll
    for (int k = 0; k < MAXI; ++k) {
      const int it = threadIdx.x + k * int(blockDim.x);
      if (it >= hn * Dh) break;
      out[size_t(g0) * Dh + it] = a[k] / L[k];
    }
  }
  __syncthreads();  // buf is free again
}

}  // namespace tiermoe::cuda
