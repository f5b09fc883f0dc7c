// Prompt-chunk MoE on the tensor cores (kernels.h: moe_sort, moe_expert_gemm). Why: a chunk of
// hundreds of tokens picks nearly every expert, but each expert only for its own tokens; running
// every expert over every token (the masked path) does E / K times the needed work. Here the
// (token, k) entries are grouped by expert on the device -- each group padded to whole tiles of
// kMoeTileM rows, so that a GEMM block never mixes experts -- and one launch multiplies every
// tile by its expert's weights. No host sync: the grid covers the most tiles the padding can
// produce, and the tiles past the end leave at once.
//
// Two GEMM kernels. moe_expert_gemm_bf16 (the default): the input already split into BF16 hi + lo
// once per GEMM (to_bf16), blocks of kMoeTileM x kPipeN outputs, A (the tile's gathered rows, hi
// and lo) and B (the expert's weight rows) brought into shared memory by 16-byte cp.async
// kStages - 1 k-steps ahead of use, fragments by ldmatrix, mma.sync m16n8k16 (hi and lo: two MMAs
// into the same accumulators). Needs Kd % 8 == 0 (16-byte rows). moe_expert_gemm (the first
// version, kept for Kd % 8 != 0 and for A/B timing, TIERMOE_CUDA_MOE_GEMM=0): wmma on 64 x 64 tiles,
// synchronous loads, the FP32 input split inside every k-step.
//
// Precision (H200, tests/cuda/check_moe.cpp, docs/cuda.md): the tensor cores' FP32 accumulation
// loses accuracy as a long sum grows (error about linear in Kd: both kernels 4.9e-5 against the
// FP32 twin at Mixtral's F = 14336, at the table's tolerance, 2.0e-5 at D = 4096). The pipelined
// kernel restarts its MMA accumulators every kFoldSteps k-steps and adds them to FP32 sums
// (round to nearest): 4.4e-6 at F = 14336, 4.3e-6 at D = 4096, for ~13% more kernel time.
// Deterministic: no atomics, a fixed order over k for every row.
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

// ---- Pipelined kernel -------------------------------------------------------------------------
// Block tile kMoeTileM (64) rows x kPipeN (128) columns, k-steps of kPipeK (32); 4 warps in 2 x 2,
// each 32 rows x 64 columns (2 x 8 MMA tiles of 16 x 8: 64 FP32 accumulators per lane, and 64 for
// the folded sums: ~204 registers, so two blocks per SM). Four stages of 20 KB: 80 KB a block, two
// in the H200's 227 KB. (Measured: three stages ran 2% slower; unfolded, 130 registers and three
// blocks per SM of three stages, 11% faster, at the precision above.)
constexpr int kPipeN = 128, kPipeK = 32, kStages = 4, kPipeThreads = 128;
// Every kFoldSteps k-steps (128 of Kd) the MMA accumulators are added to FP32 sums and restarted.
constexpr int kFoldSteps = 4;
// Shared rows of kPipeK + 8 BF16 (80 bytes): the 8 rows an ldmatrix reads start 20 banks apart
// mod 32 (0, 20, 8, 28, 16, 4, 24, 12), four banks each: no conflicts.
constexpr int kPipeLd = kPipeK + 8;
constexpr int kStageElems = (2 * kMoeTileM + kPipeN) * kPipeLd;  // A hi, A lo, B
constexpr size_t kPipeSmem = size_t(kStages) * kStageElems * sizeof(__nv_bfloat16);
// 16-byte chunks per stage, per thread: A rows (each of hi and lo), B rows.
constexpr int kChunksA = kMoeTileM * kPipeK / 8 / kPipeThreads, kChunksB = kPipeN * kPipeK / 8 / kPipeThreads;
static_assert(kChunksA * kPipeThreads * 8 == kMoeTileM * kPipeK && kChunksB * kPipeThreads * 8 == kPipeN * kPipeK);

// grid (P / kMoeTileM, ceil(N / kPipeN)), kPipeThreads threads, kPipeSmem dynamic shared memory.
// Tile row r -> entry rows[m0 + r] (-1: padding, zeros in, nothing out); out[entry, n] =
// (hi + lo)[entry / div, :] . W[e, n, :]. A row's sum runs over k in the same order whatever its
// tile or place in it (the MMA's rows are independent), so results do not depend on the sort.
template <bool SPLIT>
__global__ void __launch_bounds__(kPipeThreads)
    moe_expert_gemm_pipe_kernel(float* __restrict__ out, const __nv_bfloat16* __restrict__ in_hi,
                                const __nv_bfloat16* __restrict__ in_lo, int div, const __nv_bfloat16* __restrict__ W,
                                const int32_t* __restrict__ rows, const int32_t* __restrict__ tile_expert, int N,
                                int Kd) {
  const int e = tile_expert[blockIdx.x];
  if (e < 0) return;  // past the last tile
  extern __shared__ __align__(16) __nv_bfloat16 pipe_smem[];  // [kStages][A hi | A lo | B]
  __shared__ int entry[kMoeTileM];
  const int m0 = blockIdx.x * kMoeTileM, n0 = blockIdx.y * kPipeN;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = (warp >> 1) * 32, wn = (warp & 1) * 64;
  if (tid < kMoeTileM) entry[tid] = rows[m0 + tid];
  const __nv_bfloat16* We = W + size_t(e) * N * Kd;

  // This thread's chunks: A row tid / 4 + 32 j and B row tid / 4 + 32 j, columns 8 (tid % 4) .. +7
  // of each k-step. Source offsets fixed for the whole k loop; -1: a padding row or n >= N (zeros).
  const int cc = (tid & 3) * 8;
  long long a_src[kChunksA], b_src[kChunksB];
#pragma unroll
  for (int j = 0; j < kChunksA; ++j) {
    const int r = rows[m0 + tid / 4 + 32 * j];
    a_src[j] = r < 0 ? -1 : (long long)(r / div) * Kd + cc;
  }
#pragma unroll
  for (int j = 0; j < kChunksB; ++j) {
    const int n = n0 + tid / 4 + 32 * j;
    b_src[j] = n < N ? (long long)n * Kd + cc : -1;
  }
  const int n_k = (Kd + kPipeK - 1) / kPipeK;
  auto load_stage = [&](int kt, int stage) {
    __nv_bfloat16* a = pipe_smem + stage * kStageElems;
    __nv_bfloat16* b = a + 2 * kMoeTileM * kPipeLd;
    const int k0 = kt * kPipeK;
    const bool k_in = k0 + cc < Kd;  // Kd % 8 == 0: a chunk is wholly inside or outside
#pragma unroll
    for (int j = 0; j < kChunksA; ++j) {
      const int r = tid / 4 + 32 * j;
      const bool fill = k_in && a_src[j] >= 0;
      const size_t off = fill ? size_t(a_src[j] + k0) : 0;
      cp_async16(a + r * kPipeLd + cc, in_hi + off, fill);
      if (SPLIT) cp_async16(a + (kMoeTileM + r) * kPipeLd + cc, in_lo + off, fill);
    }
#pragma unroll
    for (int j = 0; j < kChunksB; ++j) {
      const bool fill = k_in && b_src[j] >= 0;
      cp_async16(b + (tid / 4 + 32 * j) * kPipeLd + cc, We + (fill ? size_t(b_src[j] + k0) : 0), fill);
    }
  };

  float acc[2][8][4] = {}, sum[2][8][4] = {};  // acc: the MMAs' since the last fold; sum: FP32
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_k) load_stage(s, s);
    cp_async_commit();  // possibly empty: the group count stays in step with the k loop
  }
  for (int kt = 0; kt < n_k; ++kt) {
    cp_async_wait<kStages - 2>();  // k-step kt has landed (this thread's part) ...
    __syncthreads();               // ... everyone's; and step kt - 1's stage is free again
    if (kt + kStages - 1 < n_k) load_stage(kt + kStages - 1, (kt + kStages - 1) % kStages);
    cp_async_commit();
    const __nv_bfloat16* a = pipe_smem + (kt % kStages) * kStageElems;
    const __nv_bfloat16* b = a + 2 * kMoeTileM * kPipeLd;
#pragma unroll
    for (int kk = 0; kk < kPipeK; kk += 16) {
      uint32_t ah[2][4], al[2][4], bf[4][4];
#pragma unroll
      for (int i = 0; i < 2; ++i) {  // A: rows wm + 16 i + (lane % 16), columns kk + 8 (lane / 16)
        const int off = (wm + 16 * i + (lane & 15)) * kPipeLd + kk + 8 * (lane >> 4);
        ldmatrix_x4(ah[i], a + off);
        if (SPLIT) ldmatrix_x4(al[i], a + kMoeTileM * kPipeLd + off);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j)  // B: n rows wn + 16 j + (lane % 8) + 8 (lane / 16), k kk + 8 ((lane / 8) % 2)
        ldmatrix_x4(bf[j], b + (wn + 16 * j + (lane & 7) + 8 * (lane >> 4)) * kPipeLd + kk + 8 * ((lane >> 3) & 1));
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          mma_bf16(acc[i][j], ah[i], bf[j / 2][2 * (j & 1)], bf[j / 2][2 * (j & 1) + 1]);
          if (SPLIT) mma_bf16(acc[i][j], al[i], bf[j / 2][2 * (j & 1)], bf[j / 2][2 * (j & 1) + 1]);
        }
    }
    if ((kt + 1) % kFoldSteps == 0 || kt + 1 == n_k) {
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int q = 0; q < 4; ++q) sum[i][j][q] += acc[i][j][q], acc[i][j][q] = 0.f;
    }
  }
  cp_async_wait<0>();  // no copy left in flight at exit (only empty groups remain)

  // Accumulator (i, j): rows wm + 16 i + lane / 4 (+ 8), columns wn + 8 j + 2 (lane % 4) (+ 1).
  const bool pairs = (N & 1) == 0;  // out rows 8-byte aligned
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int ent = entry[wm + 16 * i + (lane >> 2) + 8 * h];
      if (ent < 0) continue;
      float* orow = out + size_t(ent) * N;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int n = n0 + wn + 8 * j + 2 * (lane & 3);
        if (pairs && n + 1 < N) {
          *reinterpret_cast<float2*>(orow + n) = make_float2(sum[i][j][2 * h], sum[i][j][2 * h + 1]);
        } else {
          if (n < N) orow[n] = sum[i][j][2 * h];
          if (n + 1 < N) orow[n + 1] = sum[i][j][2 * h + 1];
        }
      }
    }
}

template <bool SPLIT>
cudaError_t launch_pipe(float* out, const bf16* hi, const bf16* lo, int div, const bf16* W, const int32_t* rows,
                        const int32_t* tile_expert, int TK, int E, int N, int Kd, cudaStream_t s) {
  // Above 48 KB of dynamic shared memory a kernel must opt in; once per process.
  static const cudaError_t opt_in = cudaFuncSetAttribute(moe_expert_gemm_pipe_kernel<SPLIT>,
                                                         cudaFuncAttributeMaxDynamicSharedMemorySize, int(kPipeSmem));
  if (opt_in != cudaSuccess) return opt_in;
  const dim3 grid(moe_sort_rows(TK, E) / kMoeTileM, (N + kPipeN - 1) / kPipeN);
  moe_expert_gemm_pipe_kernel<SPLIT><<<grid, kPipeThreads, kPipeSmem, s>>>(
      out, reinterpret_cast<const __nv_bfloat16*>(hi), reinterpret_cast<const __nv_bfloat16*>(lo), div,
      reinterpret_cast<const __nv_bfloat16*>(W), rows, tile_expert, N, Kd);
  return cudaGetLastError();
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

cudaError_t moe_expert_gemm_bf16(float* out, const bf16* in_hi, const bf16* in_lo, int div, const bf16* W,
                                 const int32_t* rows, const int32_t* tile_expert, int TK, int E, int N, int Kd,
                                 cudaStream_t s) {
  if (div < 1 || N < 1 || Kd < 1 || Kd % 8 != 0 || E < 1) return cudaErrorInvalidValue;
  if (TK == 0) return cudaSuccess;
  return in_lo ? launch_pipe<true>(out, in_hi, in_lo, div, W, rows, tile_expert, TK, E, N, Kd, s)
               : launch_pipe<false>(out, in_hi, nullptr, div, W, rows, tile_expert, TK, E, N, Kd, s);
}

}  // namespace tiermoe::cuda
