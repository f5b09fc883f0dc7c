// Decode attention (few new tokens of one sequence, or one new token of each of B sequences) in one
// launch: KV append, split-KV attention and the combine of the splits. Declared in kernels.h;
// twin: kv_append + attention_causal (per sequence).
//
// Why one block per (KV head, key split): the G = H / Hkv query heads of a KV head share every K/V
// row, so each row is read from memory once, not G times. A key row of Dh BF16 values is read by
// Dh / 8 lanes with 16-byte loads, so a warp works on 32 / (Dh / 8) keys at once. The new tokens'
// keys and values are taken from k_new / v_new (FP32, rounded to BF16 as the cache stores them),
// never from the cache rows this launch writes, so no block waits on another. The last block of a
// (token, KV head) to finish -- counted with an atomic, reset by that block for the next launch --
// merges the splits' partial softmax results. When (KV head, split) blocks are few -- short
// contexts, few KV heads -- HG blocks share a KV head, each with G / HG of its query heads.
// FP8 pages (kv_fp8.cuh): the new rows must be in the cache already (k_new null); every row read is
// dequantized into the BF16 values the kernels work on.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include <cuda_bf16.h>

#include "cuda/kernels.h"

#include "cuda/attention_merge.cuh"
#include "cuda/dependent_launch.cuh"
#include "cuda/device_math.cuh"
#include "cuda/kv_fp8.cuh"

namespace tiermoe::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;

__device__ __forceinline__ void unpack8(const uint4& w, float* f) {
  f[0] = __uint_as_float(w.x << 16), f[1] = __uint_as_float(w.x & 0xffff0000u);
  f[2] = __uint_as_float(w.y << 16), f[3] = __uint_as_float(w.y & 0xffff0000u);
  f[4] = __uint_as_float(w.z << 16), f[5] = __uint_as_float(w.z & 0xffff0000u);
  f[6] = __uint_as_float(w.w << 16), f[7] = __uint_as_float(w.w & 0xffff0000u);
}

// 8 FP32 values rounded to BF16 as the cache stores them, packed for a 16-byte store.
__device__ __forceinline__ uint4 bf16x8(const float* p) {
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) w[j] = pack(__float2bfloat16_rn(p[2 * j]), __float2bfloat16_rn(p[2 * j + 1]));
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// KV head kvh of token t's new row, if its key (at pos_t) falls in this block's split [start, start +
// split_len): its row in the cache and in k_new / v_new (pos_t - first_new). Found before the wait:
// the page table and pos are not written in the pass.
struct NewRow {
  bool on;
  size_t dst, src;
  __device__ NewRow(bool appender, const int32_t* table, int pos_t, int first_new, int start, int split_len, size_t row,
                    int kvh, int Dh)
      : on(appender && pos_t >= start && pos_t < start + split_len),
        dst(on ? kv_row(table, pos_t) * row + size_t(kvh) * Dh : 0),
        src(on ? size_t(pos_t - first_new) * row + size_t(kvh) * Dh : 0) {}
  // All threads of the block: the row into the cache, if this block appends it.
  __device__ void append(bf16* kc, bf16* vc, const float* k_new, const float* v_new, int Dh) const {
    if (!on) return;
    for (int i = threadIdx.x; i < Dh; i += blockDim.x) {
      const float k = k_new[src + i], v = v_new[src + i];  // both loads out before either store
      reinterpret_cast<__nv_bfloat16*>(kc)[dst + i] = __float2bfloat16_rn(k);
      reinterpret_cast<__nv_bfloat16*>(vc)[dst + i] = __float2bfloat16_rn(v);
    }
  }
};

constexpr int kTileElems = 8192;  // BF16 values per K (and per V) tile: 16 KB each
constexpr int kMaxTile = 128;     // keys per tile at most
__host__ __device__ constexpr int tile_keys(int dh) { return kTileElems / dh < kMaxTile ? kTileElems / dh : kMaxTile; }
constexpr int kThreads = kWarpsPerBlock * 32;

// FP8 pages in the tiled kernel below: rather than each row's codes loaded into registers,
// dequantized and stored (a few rows' loads in flight per thread, then a stall), a tile's codes come
// in by 16-byte cp.async as BF16 rows do -- the whole tile in flight at once -- into the upper half
// of each BF16 tile (tile keys x Dh bytes <= 8 KB), and each row's exponent's 16-byte block
// (cp.async takes no single byte) into the lower half; dequantize_fp8_rows then reads them all into
// registers, meets a barrier and writes the BF16 rows in place. L2 only (.cg), as load_fp8_codes16.
// A thread's chunks of 16 codes: ch = threadIdx.x + m kThreads, row ch / (Dh / 16).
__host__ __device__ constexpr int fp8_chunks_per_thread(int dh) { return (tile_keys(dh) * (dh / 16) + kThreads - 1) / kThreads; }
constexpr int kFp8RawOffset = kTileElems;  // bytes: the upper half of a 16 KB BF16 tile
static_assert(kMaxTile <= kThreads && kMaxTile * 16 <= kFp8RawOffset, "a thread per row's exponent blocks, below the codes");
template <int Dh>
__device__ __forceinline__ void fetch_fp8_rows(uint4* ktile, uint4* vtile, const KvFp8& fp8, const int32_t* table,
                                               size_t row, int kvh, int t0, int from, int to) {
  constexpr int CPR = Dh / 16, M = fp8_chunks_per_thread(Dh);
  uint8_t *kb = reinterpret_cast<uint8_t*>(ktile), *vb = reinterpret_cast<uint8_t*>(vtile);
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const int ch = threadIdx.x + m * kThreads, r = ch / CPR, c = (ch % CPR) * 16;
    if (r < from || r >= to) continue;
    const size_t off = kv_row(table, t0 + r) * row + size_t(kvh) * Dh + c;
    cp_async16(kb + kFp8RawOffset + r * Dh + c, fp8.k + off, true);
    cp_async16(vb + kFp8RawOffset + r * Dh + c, fp8.v + off, true);
  }
  const int r = threadIdx.x;  // row r's exponent blocks (tile_keys <= kThreads)
  if (r >= from && r < to) {
    const size_t e = kv_row(table, t0 + r) * (row / Dh) + kvh;
    const int8_t *ke = fp8.k_exp + e, *ve = fp8.v_exp + e;
    cp_async16(kb + r * 16, fp8_exp_block(ke), true);
    cp_async16(vb + r * 16, fp8_exp_block(ve), true);
  }
}
// One tile's rows [0, nk) (K or V, exponents `exps`), fetched by fetch_fp8_rows and seen by every
// thread (after the wait and a barrier), dequantized in place, a barrier after: the reads, a
// barrier, the writes (fp8_exp_byte: no page-table read). K and V one after the other: both at
// once took the G = 1 kernel from 80 registers to 168.
template <int Dh>
__device__ __forceinline__ void dequantize_fp8_rows(uint4* tile, const int8_t* exps, int Hkv, int kvh, int t0, int nk) {
  constexpr int CPR = Dh / 16, M = fp8_chunks_per_thread(Dh), L = Dh / 8;
  const uint8_t* b = reinterpret_cast<const uint8_t*>(tile);
  uint4 codes[M];
  int e[M];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const int ch = threadIdx.x + m * kThreads, r = ch / CPR, c = (ch % CPR) * 16;
    if (r >= nk) continue;
    codes[m] = *reinterpret_cast<const uint4*>(b + kFp8RawOffset + r * Dh + c);
    e[m] = int8_t(b[r * 16 + fp8_exp_byte(exps, (t0 + r) % kKvPageRows, Hkv, kvh)]);
  }
  __syncthreads();  // every raw byte read before any BF16 row overwrites it
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const int ch = threadIdx.x + m * kThreads, r = ch / CPR, i = r * L + 2 * (ch % CPR);
    if (r >= nk) continue;
    tile[i] = fp8x8_to_bf16x8(make_uint2(codes[m].x, codes[m].y), e[m]);
    tile[i + 1] = fp8x8_to_bf16x8(make_uint2(codes[m].z, codes[m].w), e[m]);
  }
  __syncthreads();
}

// grid (Hkv * HG, n_splits, T), kWarpsPerBlock warps. GM >= G query heads per block (H / Hkv / HG). Dh = 8 * L with
// L lanes per key, L in {2, 4, 8, 16, 32}: a template argument, so that the tile's index arithmetic
// is shifts and masks (the kernel issues about one instruction per 10 cycles per warp: it is bound by
// its instruction chains, not by memory). The keys 0 .. pos[T-1] are cut into n_splits equal
// splits here (not by the caller), so one captured launch stays balanced as the sequence grows.
// Each split is read in tiles: all threads load a tile of K and V rows into shared memory at once
// (one memory round trip), then three phases with independent work for every thread: (A) the
// scores of all G heads for every key of the tile, (B) per head the tile's max, exp and sum (online
// softmax across tiles), (C) P V: a thread owns 8 dims of one head for a subset of the keys.

template <int GM, int Dh, bool FP8>
__global__ void __launch_bounds__(kThreads) attention_decode_kernel(
    float* __restrict__ out, float* __restrict__ partial, unsigned* __restrict__ counters,
    const float* __restrict__ q, bf16* kc, bf16* vc, KvFp8 fp8, const int32_t* table,
    const int32_t* const* __restrict__ tables, const float* __restrict__ k_new, const float* __restrict__ v_new,
    const int32_t* __restrict__ pos, int H, int Hkv) {
  // gridDim.x = Hkv * HG: HG blocks share a KV head, each with G of its query heads from head h0.
  const int HG = gridDim.x / Hkv, kvh = blockIdx.x / HG, hg = blockIdx.x % HG;
  const int s = blockIdx.y, t = blockIdx.z, n_splits = gridDim.y, T = gridDim.z;
  constexpr int L = Dh / 8, slots = 32 / L, tile = tile_keys(Dh);
  // The tile loops unrolled 4 times for one or two heads per block (OLMoE at 4096 keys: -1.3% per
  // token); with more heads that took registers (GM 8: 128 -> 154, one block less per SM) and time.
  constexpr int kUnroll = GM <= 2 ? 4 : 1;
  const int G = H / Hkv / HG, h0 = kvh * (H / Hkv) + hg * G;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane / L, part = lane % L;
  // With tables (one sequence per token): token t's own page table, its one new key at pos[t], its
  // keys split n_splits ways; else all T tokens are new keys of one sequence at pos[0] ...
  const bool per_seq = tables != nullptr;
  if (per_seq) table = tables[t];
  if (per_seq && k_new) k_new += size_t(t) * Hkv * Dh, v_new += size_t(t) * Hkv * Dh;
  const int first_new = per_seq ? pos[t] : pos[0], n = pos[t] + 1;
  const int split_len = ((per_seq ? pos[t] : pos[T - 1]) + 1 + n_splits - 1) / n_splits;
  const int start = s * split_len, end = min(n, start + split_len);
  const size_t row = size_t(Hkv) * Dh;

  // One array, so that the merge at the end can stage the splits' rows in both tiles' space.
  __shared__ __align__(16) uint4 kvtile[2 * kTileElems / 8];
  uint4 *ktile = kvtile, *vtile = kvtile + kTileElems / 8;
  // Cache rows [t0 + from, t0 + to) -> the tile's rows [from, to): by cp.async; FP8 pages as raw
  // codes and exponent blocks, dequantized by dequantize_fp8_rows once the whole tile is in.
  auto load_rows = [&](int t0, int from, int to) {
    if constexpr (FP8) {
      fetch_fp8_rows<Dh>(ktile, vtile, fp8, table, row, kvh, t0, from, to);
    } else {
#pragma unroll kUnroll
      for (int i = from * L + threadIdx.x; i < to * L; i += kThreads) {  // unrolled: the page-table reads overlap
        const size_t off = kv_row(table, t0 + i / L) * row + size_t(kvh) * Dh + (i % L) * 8;
        cp_async16(&ktile[i], kc + off, true);
        cp_async16(&vtile[i], vc + off, true);
      }
    }
  };
  // K/V rows [t0, t0 + nk) already in the cache before this pass (rows of earlier passes) -> the tile.
  auto load_cached = [&](int t0, int nk) {
    const int cached = max(0, min(nk, first_new - t0));
    load_rows(t0, 0, cached);
    return cached;
  };
  // Before the wait for the previous kernel (q/k norm + RoPE): the first tile's cached rows, which
  // no kernel of this pass writes (pos and the page tables were copied before the
  // pass's first kernel), so under programmatic launch they load while that kernel runs.
  const int first_cached = start < end ? load_cached(start, min(tile, end - start)) : -1;
  const NewRow new_row(k_new && hg == 0, table, pos[t], first_new, start, split_len, row, kvh, Dh);
  pdl_start();

  // q before the new row: its loads go out with the row's, not after the row's stores.
  const float scale = rsqrtf(float(Dh));
  float qr[GM][8];  // phase A: this lane's 8 dims of every head's query
#pragma unroll
  for (int g = 0; g < GM; ++g)
#pragma unroll
    for (int i = 0; i < 8; ++i) qr[g][i] = g < G ? q[(size_t(t) * H + h0 + g) * Dh + part * 8 + i] * scale : 0.f;
  new_row.append(kc, vc, k_new, v_new, Dh);

  // Phase C's work split: item it = (kp, g, c), c fastest (neighbouring lanes read neighbouring
  // 16 bytes of a V row: no bank conflicts) = head g, dims 8c..8c+7, keys kp, kp + KP, ...
  const int GL = G * L, KP = max(1, kThreads / GL), items = GL * KP;
  constexpr int NI = GM * 32 / kThreads > 0 ? (GM * 32 + kThreads - 1) / kThreads : 1;  // items per thread at most
  float acc[NI][8];
#pragma unroll
  for (int n_ = 0; n_ < NI; ++n_)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[n_][i] = 0.f;

  __shared__ float S[GM][kMaxTile];               // scores, then probabilities
  __shared__ float mrun[GM], lrun[GM], corr[GM];  // online softmax state per head
  if (threadIdx.x < GM) mrun[threadIdx.x] = -INFINITY, lrun[threadIdx.x] = 0.f;

  for (int t0 = start; t0 < end; t0 += tile) {
    const int nk = min(tile, end - t0);
    __syncthreads();  // the previous tile is consumed
    const int cached = t0 == start && first_cached >= 0 ? first_cached : load_cached(t0, nk);  // already cached
    if (k_new) {
      for (int i = cached * L + threadIdx.x; i < nk * L; i += blockDim.x) {  // new keys, from k_new / v_new
        const size_t src = size_t(t0 + i / L - first_new) * row + size_t(kvh) * Dh + (i % L) * 8;
        ktile[i] = bf16x8(k_new + src);
        vtile[i] = bf16x8(v_new + src);
      }
    } else {
      load_rows(t0, cached, nk);  // the new keys are in the cache already
    }
    cp_async_commit();  // the whole tile in flight at once, one wait
    cp_async_wait<0>();
    __syncthreads();
    if constexpr (FP8) {
      dequantize_fp8_rows<Dh>(ktile, fp8.k_exp, int(row / Dh), kvh, t0, nk);
      dequantize_fp8_rows<Dh>(vtile, fp8.v_exp, int(row / Dh), kvh, t0, nk);
    }
    // (A) scores: L lanes per key, all heads at once (independent shuffle chains; unrolled, so that
    // several keys' chains are in flight).
#pragma unroll kUnroll
    for (int base = warp * slots; base < nk; base += kWarpsPerBlock * slots) {
      const int j = base + sub;
      float kf[8] = {};
      if (j < nk) unpack8(ktile[j * L + part], kf);
      float sc[GM];
#pragma unroll
      for (int g = 0; g < GM; ++g) {
        sc[g] = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) sc[g] = fmaf(qr[g][i], kf[i], sc[g]);
      }
      for (int o = L / 2; o > 0; o >>= 1)
#pragma unroll
        for (int g = 0; g < GM; ++g) sc[g] += __shfl_xor_sync(0xffffffffu, sc[g], o);
      if (j < nk && part == 0)
#pragma unroll
        for (int g = 0; g < GM; ++g) S[g][j] = sc[g];
    }
    __syncthreads();
    // (B) per head: tile max, probabilities, sum; the correction of what came before.
    for (int g = warp; g < G; g += kWarpsPerBlock) {
      float mx = -INFINITY;
      for (int j = lane; j < nk; j += 32) mx = fmaxf(mx, S[g][j]);
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_old = mrun[g], m_new = fmaxf(m_old, mx);
      float sum = 0.f;
      for (int j = lane; j < nk; j += 32) {
        const float p = expf(S[g][j] - m_new);
        S[g][j] = p;
        sum += p;
      }
      sum = warp_sum(sum);
      __syncwarp();  // every lane has read mrun[g] before lane 0 overwrites it (racecheck)
      if (lane == 0) {
        const float c = m_old == -INFINITY ? 0.f : expf(m_old - m_new);
        corr[g] = c;
        lrun[g] = lrun[g] * c + sum;
        mrun[g] = m_new;
      }
    }
    __syncthreads();
    // (C) acc = acc * corr + sum over this thread's keys of p * V.
#pragma unroll
    for (int n_ = 0; n_ < NI; ++n_) {
      const int it = threadIdx.x + n_ * kThreads;
      if (it >= items) break;
      const int kp = it / GL, g = (it % GL) / L, c = it % L;
      const float cg = corr[g];
      float a[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) a[i] = acc[n_][i] * cg;
#pragma unroll kUnroll
      for (int j = kp; j < nk; j += KP) {
        float vf[8];
        unpack8(vtile[j * L + c], vf);
        const float p = S[g][j];
#pragma unroll
        for (int i = 0; i < 8; ++i) a[i] = fmaf(p, vf[i], a[i]);
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[n_][i] = a[i];
    }
  }
  // Sum the KP key subsets of each (g, c) through shared memory (the K tile's space), write the
  // split's (max, sum, unnormalized acc) per head.
  __syncthreads();
  float* red = reinterpret_cast<float*>(ktile);  // [items][8] floats <= kTileElems / 2 floats
#pragma unroll
  for (int n_ = 0; n_ < NI; ++n_) {
    const int it = threadIdx.x + n_ * kThreads;
    if (it >= items) break;
#pragma unroll
    for (int i = 0; i < 8; ++i) red[it * 8 + i] = acc[n_][i];
  }
  __syncthreads();
  __shared__ bool is_last;
  for (int i = threadIdx.x; i < G * Dh; i += blockDim.x) {
    const int g = i / Dh, d = i % Dh, c = d / 8;
    float a = 0.f;
    for (int kp = 0; kp < KP; ++kp) a += red[(kp * GL + g * L + c) * 8 + d % 8];
    if (n_splits == 1) {  // the only split: the output directly (the merge's weight would be exactly 1)
      out[(size_t(t) * H + h0 + g) * Dh + d] = a / lrun[g];
      continue;
    }
    float* dst = partial + ((size_t(t) * H + h0 + g) * n_splits + s) * (Dh + 2);
    dst[2 + d] = a;
    if (d == 0) dst[0] = mrun[g], dst[1] = lrun[g];
  }

  if (n_splits == 1) return;
  // The last split block of (t, kvh, hg) combines all splits.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned* c = counters + size_t(t) * gridDim.x + blockIdx.x;
    is_last = atomicAdd(c, 1u) == unsigned(n_splits - 1);
    if (is_last) *c = 0;  // ready for the next launch (kernels on one stream run in order)
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  __shared__ float Mh[GM], wscale[GM];
  // The rows into the tiles' 32 KB (merge_splits: in chunks where they do not fit).
  merge_splits<2 * GM>(out + (size_t(t) * H + h0) * Dh, partial + (size_t(t) * H + h0) * n_splits * (Dh + 2), G,
                       n_splits, Dh, reinterpret_cast<float*>(kvtile), kTileElems /* floats in 2 BF16 tiles */, Mh,
                       wscale);
}

// One sequence, one query head per block (grid (H, n_splits, T)): the same attention with no
// shared-memory tiles and no barrier per tile. Why: at G = 1 (OLMoE) the tiled kernel's phases
// (scores, softmax, P V, each after a barrier) leave one instruction per ~10 cycles per warp at
// 4096 keys -- its chains, not memory, bound it. Here L = Dh / V lanes share a key (one 16-byte load
// each of its K and V rows into registers: V = 8 BF16 values or 16 FP8 codes), each lane group keeps
// its own online softmax over R keys at a time (their scores independent shuffle chains, one rescale
// per round), and the warps' and groups' states are merged once at the end. The first round's cached
// rows are loaded before the wait. At G > 1 every query head reads its KV head's rows itself (G times
// the K/V bytes).
constexpr int kRound = 8;           // keys per lane group per round on BF16 pages (4 on FP8: below)
constexpr int kMergeFloats = 4352;  // the merge's stage: 33 splits of Dh = 128 in one chunk
// A lane's V values of one key's K or V row, in registers: BF16 bits, or (FP8 pages) the codes and
// the row's scale 2^e, which multiplies the lane's partial score and the key's p instead of every
// value -- the same bits as the dequantized values' arithmetic while p 2^e and the sums stay normal
// floats (a power of two rounds nothing), with fewer instructions and registers.
// Why 16 codes a lane on FP8 pages, with half the keys per round: a round then holds the same 64
// keys and the same bytes in flight as BF16's, with half the loads and lanes per key (and one
// shuffle step fewer per score). With 8 codes a lane (as BF16's 8 values; until 2026-12-07) the FP8
// form was no faster than BF16 at 4096 keys, its instructions the bound: 4 loads per key row a lane,
// two of them the row's exponent byte (docs/benchmarks.md, "FP8 per-head decode attention").
template <bool FP8>
struct KvLane {
  static constexpr int kValues = 8, kRoundKeys = kRound;
  uint4 w;
  __device__ void zero() { w = make_uint4(0, 0, 0, 0); }
  __device__ float dot(const float* q) const { return dot8(w, q); }  // q: 16-byte aligned
  __device__ float scale() const { return 1.f; }
  __device__ void values(float* f) const { unpack8(w, f); }
};
template <>
struct KvLane<true> {
  static constexpr int kValues = 16, kRoundKeys = kRound / 2;
  uint4 c;
  float s;
  __device__ void load(const uint8_t* codes, const int8_t* exps, size_t off, int Dh) {
    c = load_fp8_codes16(codes, off);
    s = fp8_exp2(load_fp8_exp(exps, off, Dh));
  }
  __device__ void zero() { c = make_uint4(0, 0, 0, 0), s = 1.f; }
  __device__ float dot(const float* q) const {
    float f[16];
    values(f);
    float d = f[0] * q[0];
#pragma unroll
    for (int i = 1; i < 16; ++i) d = fmaf(f[i], q[i], d);
    return d * s;
  }
  __device__ float scale() const { return s; }
  __device__ void values(float* f) const {
    fp8x8_to_float(make_uint2(c.x, c.y), f), fp8x8_to_float(make_uint2(c.z, c.w), f + 8);
  }
};
template <int Dh, bool FP8>
__global__ void __launch_bounds__(kThreads) attention_decode_head_kernel(
    float* __restrict__ out, float* __restrict__ partial, unsigned* __restrict__ counters,
    const float* __restrict__ q, bf16* kc, bf16* vc, KvFp8 fp8, const int32_t* table, const float* __restrict__ k_new,
    const float* __restrict__ v_new, const int32_t* __restrict__ pos, int Hkv) {
  constexpr int R = KvLane<FP8>::kRoundKeys, V = KvLane<FP8>::kValues, L = Dh / V, slots = 32 / L;
  constexpr int per_round = kWarpsPerBlock * slots * R;
  const int h = blockIdx.x, H = gridDim.x, G = H / Hkv, kvh = h / G;
  const int s = blockIdx.y, t = blockIdx.z, n_splits = gridDim.y, T = gridDim.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane / L, part = lane % L;
  const int first_new = pos[0], n = pos[t] + 1;
  const int split_len = (pos[T - 1] + 1 + n_splits - 1) / n_splits;
  const int start = s * split_len, end = min(n, start + split_len);
  const size_t row = size_t(Hkv) * Dh;
  // Round r's key u of this lane group: keys of a round are consecutive over (u, warp, group).
  auto key_of = [&](int r0, int u) { return r0 + (u * kWarpsPerBlock + warp) * slots + sub; };
  KvLane<FP8> kw[R], vw[R];
  auto load_row = [&](int j, int u) {  // key j's V values of this lane, from the cache
    const size_t off = kv_row(table, j) * row + size_t(kvh) * Dh + part * V;
    if constexpr (FP8)
      kw[u].load(fp8.k, fp8.k_exp, off, Dh), vw[u].load(fp8.v, fp8.v_exp, off, Dh);
    else
      kw[u].w = ldg16(kc + off), vw[u].w = ldg16(vc + off);
  };
  auto load_cached = [&](int r0) {
#pragma unroll
    for (int u = 0; u < R; ++u) {
      const int j = key_of(r0, u);
      if (j < end && j < first_new) {
        load_row(j, u);
      } else {
        kw[u].zero(), vw[u].zero();  // past the split: its p is 0, and 0 * V must not be NaN
      }
    }
  };
  if (start < end) load_cached(start);  // no kernel of this pass writes the cached rows
  const NewRow new_row(k_new && h % G == 0, table, pos[t], first_new, start, split_len, row, kvh, Dh);
  pdl_start();
  // q before the new row: its loads go out with the row's, not after the row's stores.
  const float scale = rsqrtf(float(Dh));
  const float* qh = q + (size_t(t) * H + h) * Dh + part * V;
  alignas(16) float qs[V];  // dot8 reads it as float4s
#pragma unroll
  for (int i = 0; i < V; ++i) qs[i] = qh[i] * scale;
  new_row.append(kc, vc, k_new, v_new, Dh);
  float m = -INFINITY, l = 0.f, acc[V] = {};
  for (int r0 = start; r0 < end; r0 += per_round) {
    if (r0 != start) load_cached(r0);
#pragma unroll
    for (int u = 0; u < R; ++u) {  // this pass's new keys: from k_new / v_new, rounded as the cache stores them
      const int j = key_of(r0, u);
      if (j < end && j >= first_new) {
        if (FP8 || !k_new) {  // in the cache already
          load_row(j, u);
          continue;
        }
        if constexpr (!FP8) {
          const size_t src = size_t(j - first_new) * row + size_t(kvh) * Dh + part * 8;
          kw[u].w = bf16x8(k_new + src), vw[u].w = bf16x8(v_new + src);
        }
      }
    }
    float sc[R];
#pragma unroll
    for (int u = 0; u < R; ++u) sc[u] = kw[u].dot(qs);
#pragma unroll
    for (int o = L / 2; o > 0; o >>= 1)
#pragma unroll
      for (int u = 0; u < R; ++u) sc[u] += __shfl_xor_sync(0xffffffffu, sc[u], o);
    float mx = m;
#pragma unroll
    for (int u = 0; u < R; ++u) {
      if (key_of(r0, u) >= end) sc[u] = -INFINITY;
      mx = fmaxf(mx, sc[u]);
    }
    if (mx == -INFINITY) continue;  // no key of this group in the round
    const float c = expf(m - mx);   // 0 while m is -inf
    l *= c;
#pragma unroll
    for (int i = 0; i < V; ++i) acc[i] *= c;
#pragma unroll
    for (int u = 0; u < R; ++u) {
      const float p = expf(sc[u] - mx), pv = p * vw[u].scale();  // 0 for masked keys
      l += p;
      float vf[V];
      vw[u].values(vf);
#pragma unroll
      for (int i = 0; i < V; ++i) acc[i] = fmaf(pv, vf[i], acc[i]);
    }
    m = mx;
  }
  // The lane groups' states merged within the warp (lanes L apart hold the same dims), then the warps'.
  auto merge = [](float& m, float& l, float* acc, float m2, float l2, const float* acc2) {
    const float M = fmaxf(m, m2);
    const float ca = M == -INFINITY ? 0.f : expf(m - M), cb = M == -INFINITY ? 0.f : expf(m2 - M);
    l = l * ca + l2 * cb;
#pragma unroll
    for (int i = 0; i < V; ++i) acc[i] = acc[i] * ca + acc2[i] * cb;
    m = M;
  };
#pragma unroll
  for (int o = L; o < 32; o <<= 1) {
    float acc2[V];
#pragma unroll
    for (int i = 0; i < V; ++i) acc2[i] = __shfl_xor_sync(0xffffffffu, acc[i], o);
    merge(m, l, acc, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, l, o), acc2);
  }
  __shared__ __align__(16) float wst[kWarpsPerBlock][Dh + 2];  // per warp: m, l, acc[Dh]
  if (lane < L) {
#pragma unroll
    for (int i = 0; i < V; ++i) wst[warp][2 + part * V + i] = acc[i];
    if (lane == 0) wst[warp][0] = m, wst[warp][1] = l;
  }
  __syncthreads();
  for (int d = threadIdx.x; d < Dh; d += blockDim.x) {
    float M = -INFINITY;
    for (int w = 0; w < kWarpsPerBlock; ++w) M = fmaxf(M, wst[w][0]);
    float a = 0.f, sum = 0.f;
    for (int w = 0; w < kWarpsPerBlock; ++w) {
      const float cw = wst[w][0] == -INFINITY ? 0.f : expf(wst[w][0] - M);
      a = fmaf(wst[w][2 + d], cw, a);
      sum = fmaf(wst[w][1], cw, sum);
    }
    if (n_splits == 1) {
      out[(size_t(t) * H + h) * Dh + d] = a / sum;
      continue;
    }
    float* dst = partial + ((size_t(t) * H + h) * n_splits + s) * (Dh + 2);
    dst[2 + d] = a;
    if (d == 0) dst[0] = M, dst[1] = sum;
  }
  if (n_splits == 1) return;
  __shared__ bool is_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned* c = counters + size_t(t) * gridDim.x + blockIdx.x;
    is_last = atomicAdd(c, 1u) == unsigned(n_splits - 1);
    if (is_last) *c = 0;  // ready for the next launch
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  __shared__ __align__(16) float buf[kMergeFloats];
  __shared__ float Mh[1], wscale[1];
  merge_splits<(Dh + kThreads - 1) / kThreads>(out + (size_t(t) * H + h) * Dh,
                                               partial + (size_t(t) * H + h) * n_splits * (Dh + 2), 1, n_splits, Dh,
                                               buf, kMergeFloats, Mh, wscale);
}

}  // namespace

namespace {
// set_attention_decode_per_head (TIERMOE_CUDA_ATTN_HEAD=0|1|2); 1, measured faster than the tiled kernel
// at G = 1 and at G = 8 up to 512 keys (docs/benchmarks.md, "Decode attention: one query head per block").
int g_attention_per_head = 1;

// How many blocks share a KV head (each with G / HG of its query heads): the most, in powers of
// two dividing G, that keep the grid within two blocks per multiprocessor. Few (KV head, split)
// blocks -- short contexts, few KV heads (Qwen3-30B-A3B: 4) -- otherwise leave most of the GPU
// idle while each block works through G heads; the K/V rows are then read HG times, which at
// those lengths is little.
int head_groups(int G, int blocks) {
  int hg = 1;
  while (G % (2 * hg) == 0 && blocks * 2 * hg <= 2 * sm_count()) hg *= 2;
  return hg;
}

// Whether one sequence's launch takes attention_decode_head_kernel: mode 1 at
// G = 1, and at G > 1 up to kHeadMaxSplits splits (the backend's rule gives those up to 2048 keys),
// where reading the K/V rows once per query head costs little; mode 2 always.
constexpr int kHeadMaxSplits = 16;
bool per_head_kernel(int H, int Hkv, const int32_t* const* tables, int n_splits) {
  if (tables) return false;
  return g_attention_per_head == 2 || (g_attention_per_head == 1 && (H == Hkv || n_splits <= kHeadMaxSplits));
}
// f(std::integral_constant<int, Dh>) for the head sizes the decode kernels are built for
// (attention_decode_supported): the one place that turns Dh into a template argument.
template <class F>
auto with_head_size(int Dh, F f) {
  return Dh == 16    ? f(std::integral_constant<int, 16>{})
         : Dh == 32  ? f(std::integral_constant<int, 32>{})
         : Dh == 64  ? f(std::integral_constant<int, 64>{})
         : Dh == 128 ? f(std::integral_constant<int, 128>{})
                     : f(std::integral_constant<int, 256>{});
}
auto head_kernel_for(int Dh, bool fp8) {
  return with_head_size(Dh, [fp8](auto dh) {
    return fp8 ? attention_decode_head_kernel<decltype(dh)::value, true> : attention_decode_head_kernel<decltype(dh)::value, false>;
  });
}

// The kernel for G query heads per block, head size Dh and the pages' format.
template <int Dh, bool FP8>
auto kernel_for(int G) {
  return G == 1   ? attention_decode_kernel<1, Dh, FP8>
         : G == 2 ? attention_decode_kernel<2, Dh, FP8>
         : G <= 4 ? attention_decode_kernel<4, Dh, FP8>
                  : attention_decode_kernel<8, Dh, FP8>;
}
auto kernel_for(int G, int Dh, bool fp8) {
  return with_head_size(Dh, [G, fp8](auto dh) {
    return fp8 ? kernel_for<decltype(dh)::value, true>(G) : kernel_for<decltype(dh)::value, false>(G);
  });
}

// kv: one sequence (kv.table) or a batch (kv.tables); k_new and v_new both given, or both null.
cudaError_t launch_attention_decode(float* out, const float* q, const KvPages& kv, const float* k_new, const float* v_new,
                                    const int32_t* pos, int T, int H, int Hkv, int Dh, int n_splits, float* partial,
                                    unsigned* counters, cudaStream_t s) {
  if ((k_new == nullptr) != (v_new == nullptr) || (kv.is_fp8() && k_new)) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  if (per_head_kernel(H, Hkv, kv.tables, n_splits)) {
    const auto kernel = head_kernel_for(Dh, kv.is_fp8());
    return launch(kernel, dim3(H, n_splits, T), kThreads, 0, s, out, partial, counters, q, kv.k, kv.v, kv.fp8, kv.table,
                  k_new, v_new, pos, Hkv);
  }
  const int HG = head_groups(H / Hkv, Hkv * n_splits * T), G = H / Hkv / HG;
  const dim3 grid(Hkv * HG, n_splits, T);
  return launch(kernel_for(G, Dh, kv.is_fp8()), grid, kThreads, 0, s, out, partial, counters, q, kv.k, kv.v, kv.fp8, kv.table,
                kv.tables, k_new, v_new, pos, H, Hkv);
}
}  // namespace

cudaError_t attention_decode(float* out, const float* q, KvPages kv, const float* k_new, const float* v_new,
                             const int32_t* pos, int T, int H, int Hkv, int Dh, int n_splits, float* partial,
                             unsigned* counters, cudaStream_t s) {
  if (!attention_decode_supported(H, Hkv, Dh) || n_splits < 1 || T > kGemvMaxT || !kv.table || kv.tables)
    return cudaErrorInvalidValue;
  return launch_attention_decode(out, q, kv, k_new, v_new, pos, T, H, Hkv, Dh, n_splits, partial, counters, s);
}

cudaError_t attention_decode_batch(float* out, const float* q, KvPages kv, const float* k_new, const float* v_new,
                                   const int32_t* pos, int B, int H, int Hkv, int Dh, int n_splits, float* partial,
                                   unsigned* counters, cudaStream_t s) {
  if (!attention_decode_supported(H, Hkv, Dh) || n_splits < 1 || B < 0 || B > 65535 || !kv.tables)
    return cudaErrorInvalidValue;
  return launch_attention_decode(out, q, kv, k_new, v_new, pos, B, H, Hkv, Dh, n_splits, partial, counters, s);
}

void set_attention_decode_per_head(int mode) { g_attention_per_head = mode == 1 || mode == 2 ? mode : 0; }

int attention_decode_split_cap(int H, int Hkv, int Dh, bool fp8) {
  int per_sm = 0;
  if (!attention_decode_supported(H, Hkv, Dh) || H != Hkv || !per_head_kernel(H, Hkv, nullptr, kHeadMaxSplits + 1) ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, head_kernel_for(Dh, fp8), kThreads, 0) != cudaSuccess)
    return 0;
  return std::max(1, per_sm * sm_count() / H);
}

int attention_decode_tile_keys(int Dh) { return Dh > 0 ? tile_keys(Dh) : 0; }

int attention_decode_resident_blocks(int H, int Hkv, int Dh) {
  int per_sm = 0;
  if (!attention_decode_supported(H, Hkv, Dh) ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel_for(H / Hkv, Dh, false), kThreads, 0) != cudaSuccess)
    return 0;
  return per_sm * sm_count();
}

bool attention_decode_supported(int H, int Hkv, int Dh) {
  const int G = Hkv > 0 && H % Hkv == 0 ? H / Hkv : 0;
  return G >= 1 && G <= 8 && (Dh == 16 || Dh == 32 || Dh == 64 || Dh == 128 || Dh == 256);
}

}  // namespace tiermoe::cuda
