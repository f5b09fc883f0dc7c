// The tensor-core GEMV's operands (gemv_tc.cu; moe_down_tc.cu): 16 weight rows as the A operand of
// m16n8k16 MMAs straight from 16-byte loads, up to 8 tokens as the columns of B, x split into BF16
// hi + lo. The k of a 32-wide chunk are permuted: lane quad qi loads 8 consecutive weights 8 qi ..
// 8 qi + 7 of its rows, which are the k the fragment layout gives that lane in two MMAs (2 qi, +1,
// +8, +9 of each 16), and its x fragment takes the same 8 k of its token.
#pragma once
#include "cuda/gemv.cuh"

namespace tiermoe::cuda {
namespace {

constexpr int kTcRows = 16;       // weight rows per block: one MMA's rows
constexpr int kTcCols = 8;        // token columns: one MMA's columns
constexpr int kTcChunk = 32;      // k per chunk: one 16-byte load per row and lane quad

// 8 consecutive k of a token column as BF16 hi + lo pairs in the MMA's B layout: [0] for the first
// MMA (k, +1 | +2, +3), [1] for the second (+4, +5 | +6, +7); hi = bf16(v), lo = bf16(v - hi)
// (bf16_split's bits, two values per conversion).
__device__ __forceinline__ void split_fragments(const float (&v)[8], uint32_t (&hi)[2][2], uint32_t (&lo)[2][2]) {
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * p], v[2 * p + 1]);
    const float2 hf = __bfloat1622float2(h);
    const __nv_bfloat162 l = __floats2bfloat162_rn(v[2 * p] - hf.x, v[2 * p + 1] - hf.y);
    hi[p >> 1][p & 1] = pack(h.x, h.y);
    lo[p >> 1][p & 1] = pack(l.x, l.y);
  }
}

__device__ __forceinline__ void unpack8(const float4& a, const float4& b, float (&v)[8]) {
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// Token column `quad`'s x at k .. k + 7 (nw applied with NORM; zeros past T) as split_fragments'
// pairs. ss += the squares of x (the norm's sum).
template <bool NORM>
__device__ __forceinline__ void x_fragments(const float* __restrict__ xk, const float* __restrict__ nwk, bool live,
                                            uint32_t (&hi)[2][2], uint32_t (&lo)[2][2], float& ss) {
  float v[8] = {};
  if (live)
    unpack8(__ldg(reinterpret_cast<const float4*>(xk)), __ldg(reinterpret_cast<const float4*>(xk + 4)), v);
  if constexpr (NORM) {
    float w[8];
    unpack8(__ldg(reinterpret_cast<const float4*>(nwk)), __ldg(reinterpret_cast<const float4*>(nwk + 4)), w);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      ss = fmaf(v[i], v[i], ss);
      v[i] *= w[i];
    }
  }
  split_fragments(v, hi, lo);
}

// A lane's A fragments of one chunk from its two 16-byte row loads (rows quad and quad + 8): [0]
// for the first MMA, [1] for the second.
__device__ __forceinline__ void a_fragments(const uint4& ra, const uint4& rb, uint32_t (&a)[2][4]) {
  a[0][0] = ra.x, a[0][1] = rb.x, a[0][2] = ra.y, a[0][3] = rb.y;
  a[1][0] = ra.z, a[1][1] = rb.z, a[1][2] = ra.w, a[1][3] = rb.w;
}

// c[0..3] += one chunk of 16 rows x 8 columns: (first, second MMA) x (hi, lo), four chains.
__device__ __forceinline__ void mma_chunk(float (&c)[4][4], const uint32_t (&a)[2][4], const uint32_t (&hi)[2][2],
                                          const uint32_t (&lo)[2][2]) {
  mma_bf16(c[0], a[0], hi[0][0], hi[0][1]);
  mma_bf16(c[1], a[0], lo[0][0], lo[0][1]);
  mma_bf16(c[2], a[1], hi[1][0], hi[1][1]);
  mma_bf16(c[3], a[1], lo[1][0], lo[1][1]);
}

// A lane's four values of a 16 x 8 result, its four chains summed (C layout: rows quad and quad + 8,
// columns 2 qi and 2 qi + 1; value i at row quad + 8 (i / 2), column 2 qi + i % 2).
__device__ __forceinline__ void chain_sums(const float (&c)[4][4], float (&v)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = (c[0][i] + c[2][i]) + (c[1][i] + c[3][i]);
}
__device__ __forceinline__ void store_values(float (&t)[kTcRows][kTcCols], const float (&v)[4], int quad, int qi) {
  t[quad][2 * qi] = v[0], t[quad][2 * qi + 1] = v[1];
  t[quad + 8][2 * qi] = v[2], t[quad + 8][2 * qi + 1] = v[3];
}
// A warp's 16 x 8 result tile, its four chains summed, into t.
__device__ __forceinline__ void store_tile(float (&t)[kTcRows][kTcCols], const float (&c)[4][4], int quad, int qi) {
  float v[4];
  chain_sums(c, v);
  store_values(t, v, quad, qi);
}

}  // namespace
}  // namespace tiermoe::cuda
