// Prompt-chunk MoE on the tensor cores (kernels.h: moe_sort, moe_expert_gemm). Why: a chunk of
// hundreds of tokens picks nearly every expert, but each expert only for its own tokens; running
// every expert over every token (the masked path) does E / K times the needed work. Here the
// (token, k) entries are grouped by expert on the device -- each group padded to whole tiles of
// kMoeTileM rows, so that a GEMM block never mixes experts -- and one launch multiplies every
// tile by its expert's weights. No host sync: the grid covers the most tiles the padding can
// produce, and the tiles past the end leave at once.
#include "cuda/kernels.h"

#include "cuda/device_math.cuh"

#include <mma.h>

#include <cuda_bf16.h>

namespace tiermoe::cuda {
namespace {

constexpr int kTileN = 64, kTileK = 32, kLd = kTileK + 8;  // +8 BF16: rows 16 bytes apart in banks
constexpr int kGemmThreads = 128;                           // 4 warps, 32 x 32 outputs each

// One block, E <= 1024 experts: count, scan, scatter. Entry order inside an expert's group follows
// the atomics (it varies between launches), but a row's product does not depend on its place.
__global__ void moe_sort_kernel(int32_t* rows, int32_t* tile_expert, const int32_t* ids, int TK, int E, int P) {
  extern __shared__ int sh[];  // count[E], start[E]
  int *count = sh, *start = sh + E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
  for (int r = threadIdx.x; r < P; r += blockDim.x) rows[r] = -1;
  for (int t = threadIdx.x; t < P / kMoeTileM; t += blockDim.x) tile_expert[t] = -1;
  __syncthreads();
  for (int i = threadIdx.x; i < TK; i += blockDim.x)
    if (ids[i] >= 0 && ids[i] < E) atomicAdd(&count[ids[i]], 1);
  __syncthreads();
  if (threadIdx.x == 0) {  // E is small: a serial scan costs less than a barrier tree
    int at = 0;
    for (int e = 0; e < E; ++e) {
      start[e] = at;
      at += (count[e] + kMoeTileM - 1) / kMoeTileM * kMoeTileM;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    for (int t = start[e] / kMoeTileM; t < (start[e] + count[e] + kMoeTileM - 1) / kMoeTileM; ++t) tile_expert[t] = e;
  for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < TK; i += blockDim.x)
    if (ids[i] >= 0 && ids[i] < E) rows[start[ids[i]] + atomicAdd(&count[ids[i]], 1)] = i;
}

// grid (P / kMoeTileM, ceil(N / kTileN)), kGemmThreads. Tile rows r -> entry rows[r] (-1:
// padding): out[entry, n] = in[entry / div, :] . W[e, n, :], e = the tile's expert. The FP32
// input is split into BF16 hi + lo parts in shared memory (split) or rounded once (not split);
// BF16 weights; FP32 accumulators (wmma 16x16x16).
__global__ void __launch_bounds__(kGemmThreads)
    moe_expert_gemm_kernel(float* __restrict__ out, const float* __restrict__ in, int div,
                           const __nv_bfloat16* __restrict__ W, const int32_t* __restrict__ rows,
                           const int32_t* __restrict__ tile_expert, int N, int Kd, bool split) {
  using namespace nvcuda;
  const int e = tile_expert[blockIdx.x];
  if (e < 0) return;  // past the last tile
  const int m0 = blockIdx.x * kMoeTileM, n0 = blockIdx.y * kTileN;
  __shared__ __align__(32) __nv_bfloat16 a_hi[kMoeTileM * kLd], a_lo[kMoeTileM * kLd], b_s[kTileN * kLd];
  __shared__ __align__(32) float c_s[kMoeTileM * (kTileN + 4)];
  __shared__ int src[kMoeTileM];
  for (int m = threadIdx.x; m < kMoeTileM; m += blockDim.x) src[m] = rows[m0 + m] < 0 ? -1 : rows[m0 + m] / div;
  const __nv_bfloat16* We = W + size_t(e) * N * Kd;
  const int warp = threadIdx.x >> 5, wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.f);
  __syncthreads();
  for (int k0 = 0; k0 < Kd; k0 += kTileK) {
    // A: kMoeTileM x kTileK FP32 (gathered rows, zeros for padding and past Kd) -> hi / lo, 4 at a time.
    for (int i = threadIdx.x; i < kMoeTileM * kTileK / 4; i += blockDim.x) {
      const int m = i / (kTileK / 4), k = (i % (kTileK / 4)) * 4;
      float v[4] = {0.f, 0.f, 0.f, 0.f};
      if (src[m] >= 0) {
        const float* p = in + size_t(src[m]) * Kd + k0 + k;
        if ((Kd & 3) == 0 && k0 + k + 3 < Kd) {
          const float4 f = *reinterpret_cast<const float4*>(p);
          v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
        } else {
          for (int j = 0; j < 4; ++j) v[j] = k0 + k + j < Kd ? p[j] : 0.f;
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        __nv_bfloat16 h, l;
        bf16_split(v[j], h, l);
        a_hi[m * kLd + k + j] = h;
        a_lo[m * kLd + k + j] = l;  // unused unless split
      }
    }
    // B: kTileN rows of W (n) x kTileK (k), zeros past N and Kd, 8 BF16 (16 bytes) at a time.
    for (int i = threadIdx.x; i < kTileN * kTileK / 8; i += blockDim.x) {
      const int n = i / (kTileK / 8), k = (i % (kTileK / 8)) * 8;
      __nv_bfloat16* dst = b_s + n * kLd + k;
      const __nv_bfloat16* p = We + size_t(n0 + n) * Kd + k0 + k;
      if (n0 + n < N && (Kd & 7) == 0 && k0 + k + 7 < Kd) {
        *reinterpret_cast<uint4*>(dst) = __ldg(reinterpret_cast<const uint4*>(p));
      } else {
        for (int j = 0; j < 8; ++j) dst[j] = n0 + n < N && k0 + k + j < Kd ? p[j] : __float2bfloat16_rn(0.f);
      }
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTileK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> ah[2], al[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        wmma::load_matrix_sync(ah[i], a_hi + (wm + 16 * i) * kLd + kk, kLd);
        wmma::load_matrix_sync(al[i], a_lo + (wm + 16 * i) * kLd + kk, kLd);
        wmma::load_matrix_sync(b[i], b_s + (wn + 16 * i) * kLd + kk, kLd);  // B(k, n) = W[n, k]
      }
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          wmma::mma_sync(acc[i][j], ah[i], b[j], acc[i][j]);
          if (split) wmma::mma_sync(acc[i][j], al[i], b[j], acc[i][j]);
        }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j)
      wmma::store_matrix_sync(c_s + (wm + 16 * i) * (kTileN + 4) + wn + 16 * j, acc[i][j], kTileN + 4,
                              wmma::mem_row_major);
  __syncthreads();
  for (int i = threadIdx.x; i < kMoeTileM * kTileN; i += blockDim.x) {
    const int m = i / kTileN, n = i % kTileN, entry = rows[m0 + m];
    if (entry >= 0 && n0 + n < N) out[size_t(entry) * N + n0 + n] = c_s[m * (kTileN + 4) + n];
  }
}

}  // namespace

int moe_sort_rows(int TK, int E) { return (TK + E * (kMoeTileM - 1) + kMoeTileM - 1) / kMoeTileM * kMoeTileM; }

cudaError_t moe_sort(int32_t* rows, int32_t* tile_expert, const int32_t* ids, int TK, int E, cudaStream_t s) {
  if (TK < 0 || E < 1 || E > 1024) return cudaErrorInvalidValue;
  moe_sort_kernel<<<1, 1024, 2 * E * sizeof(int), s>>>(rows, tile_expert, ids, TK, E, moe_sort_rows(TK, E));
  return cudaGetLastError();
}

cudaError_t moe_expert_gemm(float* out, const float* in, int div, const bf16* W, const int32_t* rows,
                            const int32_t* tile_expert, int TK, int E, int N, int Kd, bool split, cudaStream_t s) {
  if (div < 1 || N < 1 || Kd < 1 || E < 1) return cudaErrorInvalidValue;
  if (TK == 0) return cudaSuccess;
  const dim3 grid(moe_sort_rows(TK, E) / kMoeTileM, (N + kTileN - 1) / kTileN);
  moe_expert_gemm_kernel<<<grid, kGemmThreads, 0, s>>>(out, in, div, reinterpret_cast<const __nv_bfloat16*>(W), rows,
                                                       tile_expert, N, Kd, split);
  return cudaGetLastError();
}

}  // namespace tiermoe::cuda
