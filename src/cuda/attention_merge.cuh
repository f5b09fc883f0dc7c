// The merge of split-KV attention partials, shared by attention_decode's last block and the
// combine launch after the tensor-core kernel. A partial row is (m, l, o[Dh]) per (head, split): m
// the split's max score (natural-log units, -inf for a split with no visible key), l its sum of
// e^(score - m), o its unnormalized P V; out = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s.
//
// Why staged: the rows were just written by other blocks, so they live in L2, and a merge that
// reads them where they are waits one L2 round trip for the maxima and then one per 8 splits it
// unrolls (40 splits at 4096 keys: 6 round trips at the end of every attention). Here all the rows
// come into shared memory in one round of 16-byte cp.async (L2 only: L1 is not coherent within a
// launch, and a line of these rows may have been read on this SM before the other blocks wrote it),
// and the arithmetic runs from there.
#pragma once
#include <cmath>

#include "cuda/device_math.cuh"

namespace tiermoe::cuda {

// Floats of shared memory merge_staged() needs for nh heads of n_splits rows (2 of slack: the
// rows are 8-byte aligned, the copies 16-byte).
__host__ __device__ constexpr int merge_stage_floats(int nh, int n_splits, int Dh) { return nh * n_splits * (Dh + 2) + 2; }

// All threads of the block: heads 0 .. nh - 1 of p ([nh][n_splits][Dh + 2] floats, Dh even, as
// written by the splits) -> out[nh][Dh]. buf: merge_stage_floats() floats of shared memory, 16-byte
// aligned; Mh: nh floats of shared memory.
__device__ inline void merge_staged(float* __restrict__ out, const float* __restrict__ p, int nh, int n_splits, int Dh,
                                    float* buf, float* Mh) {
  const int n = merge_stage_floats(nh, n_splits, Dh) - 2, row = Dh + 2;
  // p is 8-byte aligned (rows of an even number of floats): its first 2 floats and last 2 may lie
  // outside the 16-byte copies; they are read by plain L2 loads.
  const int head = (reinterpret_cast<uintptr_t>(p) & 15) ? 2 : 0, end = head + ((n - head) & ~3);
  float* stage = buf + head;  // stage[i] holds p[i]; stage + i is 16-byte aligned where p + i is
  for (int i = head + 4 * int(threadIdx.x); i < end; i += 4 * int(blockDim.x)) cp_async16(stage + i, p + i, true);
  if (threadIdx.x < 2 && head) stage[threadIdx.x] = __ldcg(p + threadIdx.x);
  if (threadIdx.x < 2 && end < n) stage[end + threadIdx.x] = __ldcg(p + end + threadIdx.x);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = int(blockDim.x >> 5);
  for (int g = warp; g < nh; g += warps) {
    float M = -INFINITY;
    for (int s = lane; s < n_splits; s += 32) M = fmaxf(M, stage[(g * n_splits + s) * row]);
    M = warp_max(M);
    if (lane == 0) Mh[g] = M;
  }
  __syncthreads();
  // Each split's weight once, in place of its m.
  for (int i = threadIdx.x; i < nh * n_splits; i += blockDim.x) {
    const float m = stage[i * row];
    stage[i * row] = m == -INFINITY ? 0.f : expf(m - Mh[i / n_splits]);
  }
  __syncthreads();
  for (int it = threadIdx.x; it < nh * Dh; it += blockDim.x) {
    const int g = it / Dh, d = it % Dh;
    const float* r = stage + g * n_splits * row;
    float a = 0.f, L = 0.f;
    for (int s = 0; s < n_splits; ++s, r += row) {
      L = fmaf(r[1], r[0], L);
      a = fmaf(r[2 + d], r[0], a);
    }
    out[size_t(g) * Dh + d] = a / L;
  }
}

}  // namespace tiermoe::cuda
