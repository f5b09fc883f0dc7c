// Prompt attention on the tensor cores, flash-style (kernels.h: attention_prefill). Twin:
// attention_causal.
//
// Why: the split kernel (kernels.cu: attention) runs one block per (query head, key split, token),
// so each query re-reads all its keys and every product runs on the CUDA cores; a 512-token chunk
// over 4096 keys reads every K/V row T * G times. Here one block takes kRows query rows -- kRows / G
// tokens times the G query heads of one KV head -- and walks that head's keys once, in tiles of
// kTileK keys: every K/V tile read serves all kRows rows. Tiles come into shared memory by 16-byte
// cp.async one tile ahead of use (two stages). S = Q K^T and O += P V run on mma.sync m16n8k16
// (BF16 in, FP32 accumulate); the softmax is online, in FP32, in registers: warp w owns rows
// 16w .. 16w+15 (for T * G <= 16 the warps share 16 rows and split the keys: KEY_WARPS), a lane
// two of them (lane / 4 and lane / 4 + 8), the lane's quad the rest of each row (the mma
// accumulator layout), so a row max or sum is two shuffles. The S accumulators become
// P's A fragments in place (same layout), with no trip through shared memory. Keys past a block's
// last query position are never read; the causal mask is applied only in the tiles that reach past
// its first query position (the diagonal ones).
//
// Precision (measured on an H200, tests/cuda/check_attention.cpp, docs/cuda.md): Q is FP32 and enters as
// two BF16 parts hi + lo (bf16_split), two MMAs summed, so the scores are FP32-level; K and V are BF16
// in the cache (exact on the tensor cores). P, in [0, 1], enters as hi + lo as well (split_p, the
// backend's default: error against the FP32 twin <= 4.2e-6) or rounded to BF16 once (1.6e-3, the
// kernel 20-30% faster, TTFT ~2%); the row sums l add exactly the values that enter the MMA, so the
// output is a normalized average of V either way. Each tile's P V goes into fresh accumulators and
// is added to O in FP32: O kept inside the MMA accumulators across tiles drifted with the context
// (2.1e-5 at 9000 keys, 3.4e-6 at 300), at a price of 20-35% in kernel time. No atomics: two
// launches give the same bits.
#include <algorithm>
#include <cmath>

#include <cuda_bf16.h>

#include "cuda/dependent_launch.cuh"
#include "cuda/device_math.cuh"
#include "cuda/kv_fp8.cuh"
#include "cuda/kernels.h"

namespace tiermoe::cuda {
namespace {

constexpr int kWarps = 4, kThreads = kWarps * 32;
constexpr int kRows = 16 * kWarps;  // query rows (token, head) per block
constexpr int kTileK = kPrefillTileKeys;  // keys per K/V tile
// O += P V in groups of kGroupN 8-dim column tiles, each its own accumulator chain. Measured (H200,
// T = 512 over 4096 and 8192 keys): 2 and 4 within 2% of each other, 8 3-6% faster but with more
// spills and not yet run under the sanitizers; 4 was.
constexpr int kGroupN = 4;

// Shared memory of one block: K and V tiles, two stages each, rows of Dh + 8 BF16 (16 bytes of
// padding: the 8 rows an ldmatrix reads start 4 banks apart, no conflicts).
__host__ __device__ constexpr int smem_ld(int dh) { return dh + 8; }
constexpr size_t smem_bytes(int dh) { return size_t(4) * kTileK * smem_ld(dh) * sizeof(__nv_bfloat16); }

// (x, y) -> BF16 pair hi, and lo = the pair of remainders; returns hi + lo (or hi alone when !SPLIT)
// summed in FP32: what the MMA will see of x + y.
template <bool SPLIT>
__device__ __forceinline__ float split_pair(float x, float y, uint32_t& hi, uint32_t& lo) {
  __nv_bfloat16 hx, lx, hy, ly;
  bf16_split(x, hx, lx);
  bf16_split(y, hy, ly);
  hi = pack(hx, hy);
  lo = pack(lx, ly);
  const float h = __bfloat162float(hx) + __bfloat162float(hy);
  return SPLIT ? h + (__bfloat162float(lx) + __bfloat162float(ly)) : h;
}

// The kWarps warps' (max m in log2 units, sum l, unnormalized O) of a block's R rows, each over its
// share of the keys, staged in shared memory (wo [kWarps][R][DH], wml [kWarps][R][2]: the K/V tiles'
// space, free after the last tile), merged in warp order and written as attention_prefill's output
// or split partial. Every thread of the block calls it, after a barrier behind the staging.
template <int DH, int R, class RowOff>
__device__ void merge_staged_warps(const float* wo, const float* wml, RowOff row_off, float* __restrict__ out,
                                   float* __restrict__ partial, int n_splits) {
  constexpr int kPerRow = kThreads / R, kDims = DH / kPerRow;  // threads per row, dims per thread
  static_assert(kThreads % R == 0 && DH % kPerRow == 0);
  const int r = threadIdx.x / kPerRow, d0 = (threadIdx.x % kPerRow) * kDims;
  const long long off = row_off(r);
  if (off < 0) return;
  float M = -INFINITY;
  for (int w = 0; w < kWarps; ++w) M = fmaxf(M, wml[(w * R + r) * 2]);
  const float base = M == -INFINITY ? 0.f : M;  // no visible key in any share: weights 0, no NaN
  float f[kWarps], L = 0.f;
  for (int w = 0; w < kWarps; ++w) {
    f[w] = exp2f(wml[(w * R + r) * 2] - base);
    L += wml[(w * R + r) * 2 + 1] * f[w];
  }
  float* prow = n_splits > 1 ? partial + (size_t(off / DH) * n_splits + blockIdx.z) * (DH + 2) : nullptr;
  if (prow && d0 == 0) prow[0] = M * 0.69314718055994531f, prow[1] = L;  // natural-log units, as below
  for (int d = d0; d < d0 + kDims; ++d) {
    float a = 0.f;
    for (int w = 0; w < kWarps; ++w) a = fmaf(wo[(w * R + r) * DH + d], f[w], a);
    if (prow) prow[2 + d] = a;
    else out[off + d] = a / L;
  }
}

// KEY_WARPS: the warps' shares of the block's 16 rows (o in the S / O accumulator layout: rows
// lane / 4 and lane / 4 + 8) merged by merge_staged_warps through buf.
template <int DH, class RowOff>
__device__ void merge_key_warps(float* buf, const float (&o)[DH / 8][4], const float (&m)[2], const float (&l)[2],
                                RowOff row_off, float* __restrict__ out, float* __restrict__ partial, int n_splits) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, quad = lane >> 2, qi = lane & 3;
  float* wo = buf;                         // [kWarps][16][DH]
  float* wml = buf + kWarps * 16 * DH;     // [kWarps][16][2]
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = quad + 8 * i;
    if (qi == 0) wml[(warp * 16 + r) * 2] = m[i], wml[(warp * 16 + r) * 2 + 1] = l[i];
#pragma unroll
    for (int dn = 0; dn < DH / 8; ++dn)
      *reinterpret_cast<float2*>(wo + (warp * 16 + r) * DH + 8 * dn + 2 * qi) = make_float2(o[dn][2 * i], o[dn][2 * i + 1]);
  }
  __syncthreads();
  merge_staged_warps<DH, 16>(wo, wml, row_off, out, partial, n_splits);
}

// One tile's step of a row's online softmax (log2 units): mx, the row's new running max (over its
// lanes), rescales the row's sum l by corr = 2^(m - mx) and becomes m. Returns the base the tile's
// p = 2^(s - base) take: 0 for a row with no visible key yet (its p are 0, no NaN from -inf + inf).
__device__ __forceinline__ float online_softmax_step(float mx, float& m, float& l, float& corr) {
  const float base = mx == -INFINITY ? 0.f : mx;
  corr = exp2f(m - base);
  m = mx;
  l *= corr;
  return base;
}

// The element offset of row k0 (a page's first) of KV head kvh.
template <int DH>
__device__ __forceinline__ size_t page_row0(const KvPages& kv, int Hkv, int kvh, int k0) {
  return (size_t(__ldg(kv.table + k0 / kKvPageRows)) * kKvPageRows * Hkv + kvh) * DH;
}
// A thread's share of one K/V tile (a page: kTileK == kKvPageRows): its rows r0 + j RS (j < J) and
// 8 columns from c, a fixed stride apart, an add per copy.
static_assert(kTileK == kKvPageRows, "a K/V tile is one page of the cache");
template <int DH>
struct TileShare {
  static constexpr int CH = DH / 8, RS = kThreads / CH, J = kTileK / RS;  // 16-byte chunks per row, rows per sweep
  static_assert(kThreads % CH == 0 && kTileK % RS == 0, "a thread's chunks sit in one column");
  int r0 = threadIdx.x / CH, c = (threadIdx.x % CH) * 8;
  // The element offset of this thread's chunk in row k0 (a page's first) of KV head kvh.
  __device__ size_t first(const KvPages& kv, int Hkv, int kvh, int k0) const { return page_row0<DH>(kv, Hkv, kvh, k0) + c; }
};

// FP8 pages: a tile's codes, and per row the 16-byte block holding its exponent, come into a raw
// set of shared memory by 16-byte cp.async (L2 only, as load_fp8_codes16: no stale L1 line of a row
// the kernel before may still be writing), kFp8Sets tiles ahead, and are dequantized into the tile's
// BF16 stage after the products of the tile before (store_fp8_tile). So the loads stay in flight during
// the products, as BF16 pages' cp.async do, and hold no registers. Dequantized at once, a fetch
// stalled the block on every tile (the Qwen3 16-layer shape at 4096 keys: 1.44 ms per token on FP8
// pages against 1.05 on BF16, H100, 2026-12-05); held in registers across the products, the codes
// took the keys form from 138 to 177 registers and left the row form (254) none. Why two sets, not
// one: a tile of FP8 codes is half a BF16 tile's bytes, so one tile ahead kept half BF16's bytes in
// flight; two took 1.2% off the Qwen3 16-layer shape's step at 4096 keys (1.032 -> 1.020 ms, H100,
// 2026-12-07; level at 32k keys, where the split cap's two blocks per SM are what pays).
// A raw set: K codes [kTileK][DH], V codes [kTileK][DH], then [2 kTileK][kExpBlock]: row r's K
// exponent block at r, its V's at kTileK + r. A thread dequantizes the code chunks it copied itself;
// the exponent blocks are shared by a row's threads (a barrier after the copies' wait).
constexpr int kExpBlock = 16;  // fp8_exp_block's bytes
constexpr int kFp8Sets = 2;    // raw sets: the tiles in flight while a tile's products run
template <int DH>
struct Fp8Share {  // a thread's chunks of 16 codes: rows r0 + j RS, codes c .. c + 15
  static constexpr int CH = DH / 16, RS = kThreads / CH, J = kTileK / RS;
  static_assert(kThreads % CH == 0 && kTileK % RS == 0 && kThreads == 2 * kTileK, "one exponent block per thread");
  int r0 = threadIdx.x / CH, c = (threadIdx.x % CH) * 16;
};
__host__ __device__ constexpr int fp8_set_bytes(int dh) { return 2 * kTileK * (dh + kExpBlock); }
__host__ __device__ constexpr int fp8_raw_bytes(int dh) { return kFp8Sets * fp8_set_bytes(dh); }
__host__ __device__ constexpr int fp8_set_exps(int dh) { return 2 * kTileK * dh; }  // a set's exponent blocks, from its start
// Keys [k0, k0 + kTileK) of KV head kvh's FP8 rows (those below k_end; the rest read the last valid
// row, a valid address, and are stored as zeros) into raw set `set`; one commit group.
template <int DH>
__device__ __forceinline__ void fetch_fp8_tile(uint8_t* set, const KvPages& kv, int Hkv, int kvh, int k0, int k_end) {
  const Fp8Share<DH> fs;
  const int rows = min(kTileK, k_end - k0);
  const size_t stride = size_t(Hkv) * DH;
  const size_t first = page_row0<DH>(kv, Hkv, kvh, k0);
#pragma unroll
  for (int j = 0; j < fs.J; ++j) {
    const int r = fs.r0 + j * fs.RS;
    const size_t off = first + size_t(min(r, rows - 1)) * stride + fs.c;
    cp_async16(set + r * DH + fs.c, kv.fp8.k + off, true);
    cp_async16(set + (kTileK + r) * DH + fs.c, kv.fp8.v + off, true);
  }
  const int r = threadIdx.x % kTileK;  // thread r copies row r's K exponent block, thread kTileK + r its V's
  const int8_t* e = (threadIdx.x < kTileK ? kv.fp8.k_exp : kv.fp8.v_exp) + (first + size_t(min(r, rows - 1)) * stride) / DH;
  cp_async16(set + fp8_set_exps(DH) + threadIdx.x * kExpBlock, fp8_exp_block(e), true);
  cp_async_commit();
}
// The thread's chunks of a fetched tile (its copies complete: cp_async_wait; the exponent blocks
// visible: a barrier after every thread's wait), dequantized into stage `stage` of ks / vs.
template <int DH>
__device__ __forceinline__ void store_fp8_tile(const uint8_t* set, __nv_bfloat16* ks, __nv_bfloat16* vs, int stage,
                                               const KvPages& kv, int Hkv, int kvh, int k0, int k_end) {
  constexpr int LD = smem_ld(DH);
  const Fp8Share<DH> fs;
  const int rows = min(kTileK, k_end - k0);
  const uint8_t* eb = set + fp8_set_exps(DH);
  const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int j = 0; j < fs.J; ++j) {
    const int r = fs.r0 + j * fs.RS, at = (stage * kTileK + r) * LD + fs.c;
    uint4 k[2] = {zero, zero}, v[2] = {zero, zero};
    if (r < rows) {
      const int ke = int8_t(eb[r * kExpBlock + fp8_exp_byte(kv.fp8.k_exp, r, Hkv, kvh)]);  // a tile is a page
      const int ve = int8_t(eb[(kTileK + r) * kExpBlock + fp8_exp_byte(kv.fp8.v_exp, r, Hkv, kvh)]);
      const uint4 kc = *reinterpret_cast<const uint4*>(set + r * DH + fs.c);
      const uint4 vc = *reinterpret_cast<const uint4*>(set + (kTileK + r) * DH + fs.c);
      k[0] = fp8x8_to_bf16x8(make_uint2(kc.x, kc.y), ke), k[1] = fp8x8_to_bf16x8(make_uint2(kc.z, kc.w), ke);
      v[0] = fp8x8_to_bf16x8(make_uint2(vc.x, vc.y), ve), v[1] = fp8x8_to_bf16x8(make_uint2(vc.z, vc.w), ve);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      *reinterpret_cast<uint4*>(ks + at + 8 * h) = k[h];
      *reinterpret_cast<uint4*>(vs + at + 8 * h) = v[h];
    }
  }
}

// Keys [k0, k0 + kTileK) of KV head kvh, those below k_end, into stage `stage` of ks / vs (rows of
// smem_ld(DH)), by 16-byte cp.async (zeros past k_end), one commit group. BF16 pages; FP8 pages:
// fetch_fp8_tile then store_fp8_tile. All threads of the block.
template <int DH>
__device__ __forceinline__ void load_kv_tile(__nv_bfloat16* ks, __nv_bfloat16* vs, const KvPages& kv, int Hkv,
                                             int kvh, int k0, int k_end, int stage) {
  constexpr int LD = smem_ld(DH);
  const TileShare<DH> ts;
  const int rows = min(kTileK, k_end - k0);
  const size_t stride = size_t(Hkv) * DH, first = ts.first(kv, Hkv, kvh, k0);
  __nv_bfloat16* kd = ks + (stage * kTileK + ts.r0) * LD + ts.c;
  __nv_bfloat16* vd = vs + (stage * kTileK + ts.r0) * LD + ts.c;
  if (rows == kTileK) {
#pragma unroll
    for (int j = 0; j < ts.J; ++j) {
      const size_t off = first + size_t(ts.r0 + j * ts.RS) * stride;
      cp_async16(kd + j * ts.RS * LD, kv.k + off, true);
      cp_async16(vd + j * ts.RS * LD, kv.v + off, true);
    }
  } else {  // a tile past k_end (the block's last): those rows zero-filled, from a valid address
#pragma unroll
    for (int j = 0; j < ts.J; ++j) {
      const int r = ts.r0 + j * ts.RS;
      const size_t off = first + size_t(min(r, rows - 1)) * stride;
      cp_async16(kd + j * ts.RS * LD, kv.k + off, r < rows);
      cp_async16(vd + j * ts.RS * LD, kv.v + off, r < rows);
    }
  }
  cp_async_commit();
}

// Tile `tile` of a block's keys (its first is first_tile) on its way into stage `stage`: BF16
// pages by cp.async straight into the stage; FP8 pages into raw set tile % kFp8Sets, dequantized by
// finish_tile, and past the block's keys an empty commit group, so that every FP8 tile counts one
// group and the waits' counts hold to the end. All threads.
template <int DH, bool FP8>
__device__ __forceinline__ void issue_tile(__nv_bfloat16* ks, __nv_bfloat16* vs, uint8_t* raw, const KvPages& kv,
                                           int Hkv, int kvh, int first_tile, int tile, int k_end, int stage) {
  const int k0 = (first_tile + tile) * kTileK;
  if constexpr (FP8) {
    if (k0 < k_end) fetch_fp8_tile<DH>(raw + (tile % kFp8Sets) * fp8_set_bytes(DH), kv, Hkv, kvh, k0, k_end);
    else cp_async_commit();
  } else {
    load_kv_tile<DH>(ks, vs, kv, Hkv, kvh, k0, k_end, stage);
  }
}
// The end of iteration it of the tile loop: stage it & 1 consumed (a barrier) before the next
// iteration's loads overwrite it; FP8 pages: tile it + 1 waited for (tiles up to it + kFp8Sets are
// issued, one group each), its exponent blocks seen after the barrier, and dequantized into its
// stage, which await_tile's barrier then makes visible. All threads.
template <int DH, bool FP8>
__device__ __forceinline__ void finish_tile(__nv_bfloat16* ks, __nv_bfloat16* vs, uint8_t* raw, const KvPages& kv,
                                            int Hkv, int kvh, int first_tile, int it, int n_tiles, int k_end) {
  const bool fp8_next = FP8 && it + 1 < n_tiles;
  if (fp8_next) cp_async_wait<kFp8Sets - 1>();
  __syncthreads();
  if constexpr (FP8)
    if (fp8_next)
      store_fp8_tile<DH>(raw + ((it + 1) % kFp8Sets) * fp8_set_bytes(DH), ks, vs, (it + 1) & 1, kv, Hkv, kvh,
                         (first_tile + it + 1) * kTileK, k_end);
}

// A block's keys: its query tokens t0 .. t0 + nt - 1 see keys 0 .. n_keys - 1, cut into gridDim.z
// splits of whole tiles (computed here, so that a captured launch stays valid while a sequence
// grows, and each query tile splits its own keys); the block takes split blockIdx.z, keys
// [first_tile * kTileK, k_end) (maybe none). Its first tile goes into stage 0 (FP8 pages: its first
// kFp8Sets tiles into the raw sets) -- before the wait for the previous kernel those that lie wholly
// below first_new, the first position whose row this pass writes (a decode step's new row, or a
// prompt chunk's first: kv_append writes the chunk's rows just before, and only the wait promises
// that its writes are seen) -- then the wait. FP8 pages: the first tile is dequantized before the
// return. All threads.
struct BlockKeys {
  int p_lo, k_end, first_tile, n_tiles;
};
template <int DH, bool FP8>
__device__ __forceinline__ BlockKeys start_block_keys(__nv_bfloat16* ks, __nv_bfloat16* vs, uint8_t* raw, const KvPages& kv,
                                                      const int32_t* __restrict__ pos, int Hkv, int kvh, int t0,
                                                      int nt, int first_new) {
  BlockKeys b;
  b.p_lo = pos[t0];
  const int n_keys = pos[t0 + nt - 1] + 1;  // positions non-decreasing
  const int n_splits = gridDim.z, split_len = ((n_keys + n_splits - 1) / n_splits + kTileK - 1) / kTileK * kTileK;
  const int k_begin = int(blockIdx.z) * split_len;
  b.k_end = min(n_keys, k_begin + split_len);
  b.first_tile = k_begin / kTileK;
  b.n_tiles = max(0, (b.k_end - k_begin + kTileK - 1) / kTileK);
  const int first_loads = FP8 ? kFp8Sets : min(1, b.n_tiles);
  auto load = [&](int tile) { issue_tile<DH, FP8>(ks, vs, raw, kv, Hkv, kvh, b.first_tile, tile, b.k_end, 0); };
  int tile = 0;
  for (; tile < first_loads && tile < b.n_tiles && (b.first_tile + tile + 1) * kTileK <= first_new; ++tile) load(tile);
  pdl_start();
  for (; tile < first_loads; ++tile) load(tile);
  if constexpr (FP8)
    if (b.n_tiles > 0) {  // n_tiles is the block's: every thread meets the barrier
      cp_async_wait<kFp8Sets - 1>();
      __syncthreads();
      store_fp8_tile<DH>(raw, ks, vs, 0, kv, Hkv, kvh, b.first_tile * kTileK, b.k_end);
    }
  return b;
}

// Iteration it of the two-stage tile ring; returns tile it's stage. BF16 pages: tile it + 1's loads
// issued (load_tile(tile, stage)), tile it's awaited by every thread. FP8 pages: tile it, dequantized
// by the iteration before (or start_block_keys), seen by every thread; then its raw set takes tile
// it + kFp8Sets. All threads.
template <bool FP8, class Load>
__device__ __forceinline__ int await_tile(Load load_tile, int it, int n_tiles) {
  if constexpr (FP8) {
    __syncthreads();
    load_tile(it + kFp8Sets, 0);
    return it & 1;
  }
  if (it + 1 < n_tiles) {
    load_tile(it + 1, (it + 1) & 1);
    cp_async_wait<1>();
  } else {
    cp_async_wait<0>();
  }
  __syncthreads();
  return it & 1;
}

// One query row (q + off; off < 0: padding, zeros): dims 16 kk + 8 half + 2 qi, +1 as BF16 pairs hi +
// lo (split_pair), [kk][half]: the pairs an MMA operand takes of it, with Q in FP32-level parts.
template <int KC>
__device__ __forceinline__ void load_q_pairs(const float* __restrict__ q, long long off, int qi, uint32_t (&hi)[KC][2],
                                             uint32_t (&lo)[KC][2]) {
#pragma unroll
  for (int kk = 0; kk < KC; ++kk)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float2 v = make_float2(0.f, 0.f);
      if (off >= 0) v = *reinterpret_cast<const float2*>(q + off + 16 * kk + 8 * half + 2 * qi);
      split_pair<true>(v.x, v.y, hi[kk][half], lo[kk][half]);
    }
}

// KEY_WARPS (T * G <= 16: a decode step, or a few tokens): the block's 16 rows are shared by its
// warps, which take a quarter of every key tile each, and merge their (max, sum, O) at the end in
// shared memory; else each warp owns 16 rows and walks all keys (3 of 4 warps would hold only
// padding rows at T = 1, G = 8). RW rows per block.
//
// grid (ceil(T / (RW / G)), Hkv, n_splits), kThreads threads, smem_bytes(DH) dynamic shared
// memory. Block row r = token t0 + r / G, head kvh * G + r % G (rows past the block's tokens:
// padding). With key splits (gridDim.z = n_splits > 1) block z takes keys [z * len, (z + 1) * len),
// len = its keys (0 .. its last query's position) / n_splits rounded up to whole tiles -- computed
// here, so a captured launch stays valid while a sequence grows, and each query tile splits its own
// keys -- and writes its rows' (max, sum, unnormalized output) to partial[T, H, n_splits, Dh + 2]
// (attention_merge_splits's layout: the max in natural-log units) instead of out.
template <int DH, bool SPLIT_P, bool KEY_WARPS, bool FP8>
__global__ void __launch_bounds__(kThreads) attention_prefill_kernel(
    float* __restrict__ out, float* __restrict__ partial, const float* __restrict__ q, KvPages kv,
    const int32_t* __restrict__ pos, int T, int H, int Hkv, int G, float scale_log2) {
  constexpr int LD = smem_ld(DH), KC = DH / 16, DT = DH / 8, NG = kGroupN;
  static_assert(DT % NG == 0 && NG % 2 == 0);
  extern __shared__ __align__(16) __nv_bfloat16 smem[];
  __nv_bfloat16* ks = smem;                      // [2][kTileK][LD]
  __nv_bfloat16* vs = smem + 2 * kTileK * LD;    // [2][kTileK][LD]
  constexpr int RW = KEY_WARPS ? 16 : kRows;            // query rows per block
  constexpr int KW = KEY_WARPS ? kTileK / kWarps : kTileK;  // keys of a tile per warp
  constexpr int NTW = KW / 8;                               // S column tiles per warp
  const int TQ = RW / G, kvh = blockIdx.y;
  // A decode batch (kv.tables): block x takes token x alone, the newest of its own sequence. Else
  // a tile of TQ tokens of one sequence, the longest query tiles first.
  const bool per_seq = kv.tables != nullptr;
  const int t0 = per_seq ? int(blockIdx.x) : (gridDim.x - 1 - blockIdx.x) * TQ;
  const int nt = per_seq ? 1 : min(TQ, T - t0);
  if (per_seq) kv.table = kv.tables[t0];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, quad = lane >> 2, qi = lane & 3;

  // Block row r's offset of its [Dh] in q and out, or -1 for padding (every key masked, nothing
  // written). This lane's rows i = 0, 1: block row warp_row0 + lane / 4 + 8 i.
  auto row_off = [&](int r) -> long long {
    const int t = r / G;
    return r < TQ * G && t < nt ? (long long)((size_t(t0 + t) * H + size_t(kvh) * G + r % G) * DH) : -1;
  };
  const int warp_row0 = KEY_WARPS ? 0 : warp * 16, kw0 = KEY_WARPS ? warp * KW : 0;  // the warp's rows, keys
  auto row_offset = [&](int i) { return row_off(warp_row0 + quad + 8 * i); };
  uint8_t* raw = reinterpret_cast<uint8_t*>(smem + 4 * kTileK * LD);  // FP8 pages: fetch_fp8_tile's area
  const BlockKeys keys = start_block_keys<DH, FP8>(ks, vs, raw, kv, pos, Hkv, kvh, t0, nt, pos[per_seq ? t0 : 0]);
  const int p_lo = keys.p_lo, k_end = keys.k_end, first_tile = keys.first_tile, n_tiles = keys.n_tiles;
  const int n_splits = gridDim.z;
  auto load_tile = [&](int tile, int stage) { issue_tile<DH, FP8>(ks, vs, raw, kv, Hkv, kvh, first_tile, tile, k_end, stage); };

  int rpos[2];  // the rows' query positions (-1: padding)
  uint32_t qh[KC][4], ql[KC][4];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const long long off = row_offset(i);
    rpos[i] = off >= 0 ? pos[t0 + (warp_row0 + quad + 8 * i) / G] : -1;
    uint32_t h[KC][2], lo[KC][2];
    load_q_pairs(q, off, qi, h, lo);
#pragma unroll
    for (int kk = 0; kk < KC; ++kk)
#pragma unroll
      for (int half = 0; half < 2; ++half) qh[kk][2 * half + i] = h[kk][half], ql[kk][2 * half + i] = lo[kk][half];
  }

  float o[DT][4] = {};                          // O rows (lane/4, lane/4 + 8), unnormalized
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // running max (log2 units), this lane's part of the sum
  for (int it = 0; it < n_tiles; ++it) {
    const int stage = await_tile<FP8>(load_tile, it, n_tiles);
    const __nv_bfloat16* kt = ks + stage * kTileK * LD;
    const __nv_bfloat16* vt = vs + stage * kTileK * LD;

    // S[16 rows, KW keys] = Q K^T, Q as hi + lo. One ldmatrix: keys kw0 + 8j .. +7, dims of two k-chunks.
    float s[NTW][4] = {};
#pragma unroll
    for (int kk = 0; kk < KC; kk += 2)
#pragma unroll
      for (int j = 0; j < NTW; ++j) {
        uint32_t b[4];
        ldmatrix_x4(b, kt + (kw0 + 8 * j + (lane & 7)) * LD + 16 * kk + 8 * (lane >> 3));
        mma_bf16(s[j], qh[kk], b[0], b[1]);
        mma_bf16(s[j], ql[kk], b[0], b[1]);
        mma_bf16(s[j], qh[kk + 1], b[2], b[3]);
        mma_bf16(s[j], ql[kk + 1], b[2], b[3]);
      }

    // Online softmax in log2 units; the mask only where the tile reaches past the first query or
    // past the block's keys.
    const int k0 = (first_tile + it) * kTileK;
    const bool diagonal = k0 + kTileK - 1 > p_lo || k0 + kTileK > k_end;
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int j = 0; j < NTW; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = e >> 1, key = k0 + kw0 + 8 * j + 2 * qi + (e & 1);
        float x = s[j][e] * scale_log2;
        if (diagonal && (key > rpos[i] || key >= k_end)) x = -INFINITY;
        s[j][e] = x;
        mx[i] = fmaxf(mx[i], x);
      }
    float base[2], corr[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
      base[i] = online_softmax_step(mx[i], m[i], l[i], corr[i]);
    }

    // P as the A fragments of the tile's 16-key chunks, straight from S: chunk c = S tiles 2c, 2c+1.
    uint32_t ph[KW / 16][4], pl[KW / 16][4];
#pragma unroll
    for (int c = 0; c < KW / 16; ++c)
#pragma unroll
      for (int f = 0; f < 4; ++f) {  // fragment register f: row i = f & 1 of S tile 2c + f / 2
        const int i = f & 1;
        const float* sv = s[2 * c + (f >> 1)] + 2 * i;
        l[i] += split_pair<SPLIT_P>(exp2f(sv[0] - base[i]), exp2f(sv[1] - base[i]), ph[c][f], pl[c][f]);
      }
    // O = O * corr + P V, 8 + 8 dims at a time: the tile's P V in fresh accumulators, added to O in
    // FP32 (see Precision above).
#pragma unroll
    for (int dn = 0; dn < DT; dn += NG) {
      float pv[NG][4] = {};  // NG independent accumulator chains: consecutive MMAs do not wait on each other
#pragma unroll
      for (int c = 0; c < KW / 16; ++c) {
        uint32_t b[NG / 2][4];  // V rows kw0 + 16c .. +15, dims 8 dn .. 8 (dn + NG) - 1 (ldmatrix.trans: B fragments)
#pragma unroll
        for (int g = 0; g < NG / 2; ++g)
          ldmatrix_x4_trans(b[g], vt + (kw0 + 16 * c + (lane & 7) + 8 * ((lane >> 3) & 1)) * LD +
                                      8 * (dn + 2 * g + (lane >> 4)));
#pragma unroll
        for (int g = 0; g < NG; ++g) mma_bf16(pv[g], ph[c], b[g / 2][2 * (g & 1)], b[g / 2][2 * (g & 1) + 1]);
        if (SPLIT_P)
#pragma unroll
          for (int g = 0; g < NG; ++g) mma_bf16(pv[g], pl[c], b[g / 2][2 * (g & 1)], b[g / 2][2 * (g & 1) + 1]);
      }
#pragma unroll
      for (int g = 0; g < NG; ++g)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[dn + g][e] = fmaf(o[dn + g][e], corr[e >> 1], pv[g][e]);
    }
    finish_tile<DH, FP8>(ks, vs, raw, kv, Hkv, kvh, first_tile, it, n_tiles, k_end);
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
  if constexpr (KEY_WARPS) {
    merge_key_warps<DH>(reinterpret_cast<float*>(smem), o, m, l, row_off, out, partial, n_splits);
  } else {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const long long off = row_offset(i);
      if (off < 0) continue;
      if (n_splits > 1) {  // (max in natural-log units, sum, unnormalized output) of this split
        float* prow = partial + (size_t(off / DH) * n_splits + blockIdx.z) * (DH + 2);
        if (qi == 0) prow[0] = m[i] * 0.69314718055994531f, prow[1] = l[i];  // -inf stays -inf: no visible key
#pragma unroll
        for (int dn = 0; dn < DT; ++dn)
          *reinterpret_cast<float2*>(prow + 2 + 8 * dn + 2 * qi) = make_float2(o[dn][2 * i], o[dn][2 * i + 1]);
        continue;
      }
      float* orow = out + off + 2 * qi;
#pragma unroll
      for (int dn = 0; dn < DT; ++dn)
        *reinterpret_cast<float2*>(orow + 8 * dn) = make_float2(o[dn][2 * i] / l[i], o[dn][2 * i + 1] / l[i]);
    }
  }
}

// The decode form with the keys as the MMA's rows (T * G <= 8 query rows per block: one sequence's
// decode step at G <= 8; decode batches keep the row form, form_of): S^T = K Q^T and O^T += V^T P^T, the K/V tile as the A operand
// (ldmatrix, .trans for V) and the block's 8 query rows as the n = 8 columns. Why: the row form
// pads G = 8 query rows to 16 (half of every MMA's rows, and of Q's and O's registers, are
// padding) and chains 16 MMAs per score tile; here Q^T is 32 registers, O^T 32, each 16-key score
// block two chains of KC MMAs (Q's hi and lo parts), and P^T reaches the P V MMAs' B operand by
// movmatrix (a transpose of each 8x8 BF16 block in registers). Otherwise as the KEY_WARPS form:
// warp w takes keys 16w .. 16w + 15 of every 64-key tile, tiles two stages deep by cp.async, the
// splits of attention_prefill, the warps merged at the end (merge_staged_warps). Column c = token
// c / G, head kvh * G + c % G; lane l holds columns 2 (l % 4), +1 of S^T and O^T, keys (dims)
// l / 4 and l / 4 + 8.
template <int DH, bool SPLIT_P, bool FP8>
__global__ void __launch_bounds__(kThreads) attention_decode_keys_kernel(
    float* __restrict__ out, float* __restrict__ partial, const float* __restrict__ q, KvPages kv,
    const int32_t* __restrict__ pos, int T, int H, int Hkv, int G, float scale_log2) {
  constexpr int LD = smem_ld(DH), KC = DH / 16, kCols = 8, KW = kTileK / kWarps;
  static_assert(KW == 16, "a warp's keys of a tile are one 16-row A operand");
  extern __shared__ __align__(16) __nv_bfloat16 smem[];
  __nv_bfloat16* ks = smem;                    // [2][kTileK][LD]
  __nv_bfloat16* vs = smem + 2 * kTileK * LD;  // [2][kTileK][LD]
  const int kvh = blockIdx.y, cols = T * G;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, quad = lane >> 2, qi = lane & 3;
  const int kw0 = warp * KW;
  auto col_off = [&](int c) -> long long {
    return c < cols ? (long long)((size_t(c / G) * H + size_t(kvh) * G + c % G) * DH) : -1;
  };
  uint8_t* raw = reinterpret_cast<uint8_t*>(smem + 4 * kTileK * LD);  // FP8 pages: fetch_fp8_tile's area
  const BlockKeys keys = start_block_keys<DH, FP8>(ks, vs, raw, kv, pos, Hkv, kvh, 0, T, pos[0]);
  const int p_lo = keys.p_lo, k_end = keys.k_end, first_tile = keys.first_tile, n_tiles = keys.n_tiles;
  const int n_splits = gridDim.z;
  auto load_tile = [&](int tile, int stage) { issue_tile<DH, FP8>(ks, vs, raw, kv, Hkv, kvh, first_tile, tile, k_end, stage); };

  // Q^T as the B operand: column quad, dims 16 kk + 2 qi, +1 (b0) and + 8 (b1), as hi + lo.
  uint32_t qh[KC][2], ql[KC][2];
  load_q_pairs(q, col_off(quad), qi, qh, ql);
  int cpos[2];  // this lane's columns' query positions (-1: padding, every key masked)
#pragma unroll
  for (int c = 0; c < 2; ++c) cpos[c] = 2 * qi + c < cols ? pos[(2 * qi + c) / G] : -1;

  float o[KC][4] = {};  // O^T: dims 16 dt + quad (+ 8), columns 2 qi, +1; unnormalized
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // per column: running max (log2), this lane's sum
  for (int it = 0; it < n_tiles; ++it) {
    const int stage = await_tile<FP8>(load_tile, it, n_tiles);
    const __nv_bfloat16* kt = ks + stage * kTileK * LD;
    const __nv_bfloat16* vt = vs + stage * kTileK * LD;

    // S^T[16 keys, 8 columns]: Q's hi and lo parts in two accumulator chains.
    float sh[4] = {}, sl[4] = {};
#pragma unroll
    for (int kk = 0; kk < KC; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(a, kt + (kw0 + (lane & 15)) * LD + 16 * kk + 8 * (lane >> 4));
      mma_bf16(sh, a, qh[kk][0], qh[kk][1]);
      mma_bf16(sl, a, ql[kk][0], ql[kk][1]);
    }
    const int k0 = (first_tile + it) * kTileK;
    const bool diagonal = k0 + kTileK - 1 > p_lo || k0 + kTileK > k_end;
    float sv[4], mx[2] = {m[0], m[1]};
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // e: key quad + 8 (e >> 1), column 2 qi + (e & 1)
      const int key = k0 + kw0 + quad + 8 * (e >> 1), c = e & 1;
      float x = (sh[e] + sl[e]) * scale_log2;
      if (diagonal && (key > cpos[c] || key >= k_end)) x = -INFINITY;
      sv[e] = x;
      mx[c] = fmaxf(mx[c], x);
    }
    float base[2], corr[2];
#pragma unroll
    for (int c = 0; c < 2; ++c) {  // the column's max over the warp's 16 keys: the lanes of one qi
      mx[c] = fmaxf(mx[c], __shfl_xor_sync(0xffffffffu, mx[c], 4));
      mx[c] = fmaxf(mx[c], __shfl_xor_sync(0xffffffffu, mx[c], 8));
      mx[c] = fmaxf(mx[c], __shfl_xor_sync(0xffffffffu, mx[c], 16));
      base[c] = online_softmax_step(mx[c], m[c], l[c], corr[c]);
    }
    // P as BF16 pairs in the accumulator layout (keys quad, quad + 8), then transposed by movmatrix
    // into P^T's B fragments: keys 2 qi, +1 (b0) and 2 qi + 8, +9 (b1) of column quad.
    uint32_t pb[2][2];  // [hi, lo][b0, b1]
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      __nv_bfloat16 h[2], lo[2];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float p = exp2f(sv[2 * half + c] - base[c]);
        bf16_split(p, h[c], lo[c]);
        if (!SPLIT_P) lo[c] = __float2bfloat16_rn(0.f);
        l[c] += __bfloat162float(h[c]) + __bfloat162float(lo[c]);  // exactly what enters the MMAs
      }
      pb[0][half] = movmatrix_trans(pack(h[0], h[1]));
      pb[1][half] = movmatrix_trans(pack(lo[0], lo[1]));
    }
    // O^T = O^T * corr + V^T P^T, 16 dims at a time, each its own fresh accumulator.
#pragma unroll
    for (int dt = 0; dt < KC; ++dt) {
      uint32_t a[4];  // V^T dims 16 dt .. +15, keys kw0 .. +15 (ldmatrix.trans of V's rows)
      ldmatrix_x4_trans(a, vt + (kw0 + (lane & 7) + 8 * (lane >> 4)) * LD + 16 * dt + 8 * ((lane >> 3) & 1));
      float pv[4] = {};
      mma_bf16(pv, a, pb[0][0], pb[0][1]);
      if (SPLIT_P) mma_bf16(pv, a, pb[1][0], pb[1][1]);
#pragma unroll
      for (int e = 0; e < 4; ++e) o[dt][e] = fmaf(o[dt][e], corr[e & 1], pv[e]);
    }
    finish_tile<DH, FP8>(ks, vs, raw, kv, Hkv, kvh, first_tile, it, n_tiles, k_end);
  }

#pragma unroll
  for (int c = 0; c < 2; ++c) {  // the column's sum over the warp's keys
    l[c] += __shfl_xor_sync(0xffffffffu, l[c], 4);
    l[c] += __shfl_xor_sync(0xffffffffu, l[c], 8);
    l[c] += __shfl_xor_sync(0xffffffffu, l[c], 16);
  }
  float* wo = reinterpret_cast<float*>(smem);  // [kWarps][kCols][DH]
  float* wml = wo + kWarps * kCols * DH;       // [kWarps][kCols][2]
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int c = 2 * qi + (e & 1);
#pragma unroll
    for (int dt = 0; dt < KC; ++dt) wo[(warp * kCols + c) * DH + 16 * dt + quad + 8 * (e >> 1)] = o[dt][e];
  }
  if (quad == 0)
#pragma unroll
    for (int c = 0; c < 2; ++c) wml[(warp * kCols + 2 * qi + c) * 2] = m[c], wml[(warp * kCols + 2 * qi + c) * 2 + 1] = l[c];
  __syncthreads();
  merge_staged_warps<DH, kCols>(wo, wml, col_off, out, partial, n_splits);
}

// The decode forms: blocks of T * G <= 16 query rows (key_warps); of one sequence's T * G <= 8 in
// the keys form, unless set_attention_decode_keys_form(false). Decode batches (kv.tables) keep the
// row form: the keys form measured 2-4% slower per step there (Qwen3 16-layer shape, B = 8 and 64,
// docs/benchmarks.md), though level under ncu.
bool g_decode_keys_form = true;
enum class Form { rows, key_warps, keys };
template <int DH, bool SPLIT_P, Form F, bool FP8 = false>
constexpr auto kernel_of() {
  if constexpr (F == Form::keys) return attention_decode_keys_kernel<DH, SPLIT_P, FP8>;
  else return attention_prefill_kernel<DH, SPLIT_P, F == Form::key_warps, FP8>;
}
// The keys form's blocks ask for more shared memory than their tiles take, so that an SM holds at
// most two of them (as the row form's registers allow): with three (135 registers, 68 KB each)
// Mixtral-8x7B's step took 7.95 ms against 7.12 under programmatic launch, level without it (the
// cause is not measured); the Qwen3 shapes are the same either way.
// FP8 pages add fetch_fp8_tile's raw area after the tiles.
template <int DH, Form F, bool FP8>
constexpr size_t launch_smem() {
  const size_t bytes = smem_bytes(DH) + (FP8 ? fp8_raw_bytes(DH) : 0);
  return F == Form::keys ? std::max(bytes, size_t(80) * 1024) : bytes;
}

// Above 48 KB of dynamic shared memory (Dh 128: 68 KB) a kernel must opt in; once per process.
template <int DH, bool SPLIT_P, Form F, bool FP8 = false>
cudaError_t opt_in_smem() {
  static const cudaError_t e = cudaFuncSetAttribute(kernel_of<DH, SPLIT_P, F, FP8>(),
                                                    cudaFuncAttributeMaxDynamicSharedMemorySize, int(launch_smem<DH, F, FP8>()));
  return e;
}

template <int DH, bool SPLIT_P, Form F, bool FP8>
cudaError_t launch_prefill_as(float* out, float* partial, const float* q, KvPages kv, const int32_t* pos, int T, int H,
                              int Hkv, int n_splits, cudaStream_t s) {
  static_assert(size_t(kWarps) * 16 * (DH + 2) * sizeof(float) <= smem_bytes(DH), "merge_key_warps's buffer");
  if (F == Form::keys && kv.tables) return cudaErrorInvalidValue;  // one sequence's keys only
  if (const cudaError_t e = opt_in_smem<DH, SPLIT_P, F, FP8>(); e != cudaSuccess) return e;
  const int G = H / Hkv, TQ = (F == Form::rows ? kRows : F == Form::key_warps ? 16 : 8) / G;
  const float scale_log2 = float(1.4426950408889634 / std::sqrt(double(DH)));  // log2(e) / sqrt(Dh)
  const int tiles = kv.tables ? T : (T + TQ - 1) / TQ;  // a decode batch: a block per token
  const cudaError_t e = launch(kernel_of<DH, SPLIT_P, F, FP8>(), dim3(tiles, Hkv, n_splits), kThreads, launch_smem<DH, F, FP8>(), s,
                               out, partial, q, kv, pos, T, H, Hkv, G, scale_log2);
  if (e != cudaSuccess || n_splits == 1) return e;
  return attention_merge_splits(out, partial, T, H, DH, n_splits, s);
}

// The form for T * G rows a block (a decode batch: G rows).
Form form_of(int rows, bool batch) {
  return rows <= 8 && !batch && g_decode_keys_form ? Form::keys : rows <= 16 ? Form::key_warps : Form::rows;
}

// The pages' format as a template argument (FP8: each tile dequantized as it is loaded): the BF16
// kernels are compiled as they were, without the FP8 loader's code beside theirs.
template <int DH, bool SPLIT_P, bool FP8>
cudaError_t launch_prefill(float* out, float* partial, const float* q, KvPages kv, const int32_t* pos, int T, int H,
                           int Hkv, int n_splits, Form form, cudaStream_t s) {
  switch (form) {
    case Form::keys: return launch_prefill_as<DH, SPLIT_P, Form::keys, FP8>(out, partial, q, kv, pos, T, H, Hkv, n_splits, s);
    case Form::key_warps:
      return launch_prefill_as<DH, SPLIT_P, Form::key_warps, FP8>(out, partial, q, kv, pos, T, H, Hkv, n_splits, s);
    default: return launch_prefill_as<DH, SPLIT_P, Form::rows, FP8>(out, partial, q, kv, pos, T, H, Hkv, n_splits, s);
  }
}
template <int DH, bool SPLIT_P>
cudaError_t launch_prefill(float* out, float* partial, const float* q, KvPages kv, const int32_t* pos, int T, int H,
                           int Hkv, int n_splits, Form form, cudaStream_t s) {
  return kv.is_fp8() ? launch_prefill<DH, SPLIT_P, true>(out, partial, q, kv, pos, T, H, Hkv, n_splits, form, s)
                     : launch_prefill<DH, SPLIT_P, false>(out, partial, q, kv, pos, T, H, Hkv, n_splits, form, s);
}

// Blocks of the decode batches' form (key_warps) the GPU holds at once; 0 if not known.
template <int DH, bool SPLIT_P>
int decode_resident_blocks() {
  int per_sm = 0;
  if (opt_in_smem<DH, SPLIT_P, Form::key_warps>() != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel_of<DH, SPLIT_P, Form::key_warps>(), kThreads,
                                                    smem_bytes(DH)) != cudaSuccess)
    return 0;
  return per_sm * sm_count();
}

}  // namespace

void set_attention_decode_keys_form(bool on) { g_decode_keys_form = on; }

int attention_prefill_decode_resident_blocks(int Dh, bool split_p) {
  if (Dh == 64) return split_p ? decode_resident_blocks<64, true>() : decode_resident_blocks<64, false>();
  return split_p ? decode_resident_blocks<128, true>() : decode_resident_blocks<128, false>();
}

int attention_prefill_decode_split_cap(int Hkv, bool fp8) {
  return Hkv > 0 && sm_count() > 0 ? std::max(1, sm_count() * (fp8 ? 2 : 1) / Hkv) : 0;
}

bool attention_prefill_supported(int H, int Hkv, int Dh) {
  return Hkv > 0 && H % Hkv == 0 && H / Hkv <= kPrefillMaxG && (Dh == 64 || Dh == 128);
}

cudaError_t attention_prefill(float* out, const float* q, KvPages kv, const int32_t* pos, int T, int H, int Hkv, int Dh,
                              bool split_p, cudaStream_t s, float* partial, int n_splits) {
  if (!attention_prefill_supported(H, Hkv, Dh) || T < 0 || n_splits < 1 || n_splits > 65535 || (n_splits > 1 && !partial))
    return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  const Form form = form_of((kv.tables ? 1 : T) * (H / Hkv), kv.tables != nullptr);
  if (Dh == 64)
    return split_p ? launch_prefill<64, true>(out, partial, q, kv, pos, T, H, Hkv, n_splits, form, s)
                   : launch_prefill<64, false>(out, partial, q, kv, pos, T, H, Hkv, n_splits, form, s);
  return split_p ? launch_prefill<128, true>(out, partial, q, kv, pos, T, H, Hkv, n_splits, form, s)
                 : launch_prefill<128, false>(out, partial, q, kv, pos, T, H, Hkv, n_splits, form, s);
}

}  // namespace tiermoe::cuda
