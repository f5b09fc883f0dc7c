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
#include <cmath>

#include <cuda_bf16.h>

#include "cuda/kernels.h"

#include "cuda/attention_merge.cuh"
#include "cuda/dependent_launch.cuh"
#include "cuda/device_math.cuh"

namespace tiermoe::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;

__device__ __forceinline__ void unpack8(const uint4& w, float* f) {
  f[0] = __uint_as_float(w.x << 16), f[1] = __uint_as_float(w.x & 0xffff0000u);
  f[2] = __uint_as_float(w.y << 16), f[3] = __uint_as_float(w.y & 0xffff0000u);
  f[4] = __uint_as_float(w.z << 16), f[5] = __uint_as_float(w.z & 0xffff0000u);
  f[6] = __uint_as_float(w.w << 16), f[7] = __uint_as_float(w.w & 0xffff0000u);
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
constexpr int kTileElems = 8192;  // BF16 values per K (and per V) tile: 16 KB each
constexpr int kMaxTile = 128;     // keys per tile at most
__host__ __device__ constexpr int tile_keys(int dh) { return kTileElems / dh < kMaxTile ? kTileElems / dh : kMaxTile; }
constexpr int kThreads = kWarpsPerBlock * 32;

template <int GM, int Dh>
__global__ void __launch_bounds__(kThreads) attention_decode_kernel(
    float* __restrict__ out, float* __restrict__ partial, unsigned* __restrict__ counters,
    const float* __restrict__ q, bf16* kc, bf16* vc, const int32_t* table, const int32_t* const* __restrict__ tables,
    const float* __restrict__ k_new, const float* __restrict__ v_new, const int32_t* __restrict__ pos, int H, int Hkv,
    bool early) {
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
  if (per_seq) table = tables[t], k_new += size_t(t) * Hkv * Dh, v_new += size_t(t) * Hkv * Dh;
  const int first_new = per_seq ? pos[t] : pos[0], n = pos[t] + 1;
  const int split_len = ((per_seq ? pos[t] : pos[T - 1]) + 1 + n_splits - 1) / n_splits;
  const int start = s * split_len, end = min(n, start + split_len);
  const size_t row = size_t(Hkv) * Dh;

  // One array, so that the merge at the end can stage the splits' rows in both tiles' space.
  __shared__ __align__(16) uint4 kvtile[2 * kTileElems / 8];
  uint4 *ktile = kvtile, *vtile = kvtile + kTileElems / 8;
  // K/V rows [t0, t0 + nk) already in the cache (rows of earlier passes) -> the tile, by cp.async.
  auto load_cached = [&](int t0, int nk) {
    const int cached = max(0, min(nk, first_new - t0));
#pragma unroll kUnroll
    for (int i = threadIdx.x; i < cached * L; i += kThreads) {  // unrolled: the page-table reads overlap
      const size_t off = kv_row(table, t0 + i / L) * row + size_t(kvh) * Dh + (i % L) * 8;
      cp_async16(&ktile[i], kc + off, true);
      cp_async16(&vtile[i], vc + off, true);
    }
    return cached;
  };
  // Before the wait for the previous kernel (q/k norm + RoPE): the first tile's cached rows, which
  // no kernel of this pass writes (pos and the page tables were copied before the
  // pass's first kernel), so under programmatic launch they load while that kernel runs.
  const int first_cached = early && start < end ? load_cached(start, min(tile, end - start)) : -1;
  pdl_wait();
  pdl_launch_dependents();

  // This block's KV head of token t's new row goes into the cache, if its key falls in this split.
  if (hg == 0 && pos[t] >= start && pos[t] < start + split_len)
    for (int i = threadIdx.x; i < Dh; i += blockDim.x) {
      const size_t src = size_t(pos[t] - first_new) * row + size_t(kvh) * Dh + i;
      const size_t dst = kv_row(table, pos[t]) * row + size_t(kvh) * Dh + i;
      reinterpret_cast<__nv_bfloat16*>(kc)[dst] = __float2bfloat16_rn(k_new[src]);
      reinterpret_cast<__nv_bfloat16*>(vc)[dst] = __float2bfloat16_rn(v_new[src]);
    }

  const float scale = rsqrtf(float(Dh));
  float qr[GM][8];  // phase A: this lane's 8 dims of every head's query
#pragma unroll
  for (int g = 0; g < GM; ++g)
#pragma unroll
    for (int i = 0; i < 8; ++i) qr[g][i] = g < G ? q[(size_t(t) * H + h0 + g) * Dh + part * 8 + i] * scale : 0.f;

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
    for (int i = cached * L + threadIdx.x; i < nk * L; i += blockDim.x) {  // new keys, from k_new / v_new
      const size_t src = size_t(t0 + i / L - first_new) * row + size_t(kvh) * Dh + (i % L) * 8;
      const float *pk = k_new + src, *pv = v_new + src;
      uint32_t kw[4], vw[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        kw[j] = pack(__float2bfloat16_rn(pk[2 * j]), __float2bfloat16_rn(pk[2 * j + 1]));
        vw[j] = pack(__float2bfloat16_rn(pv[2 * j]), __float2bfloat16_rn(pv[2 * j + 1]));
      }
      ktile[i] = make_uint4(kw[0], kw[1], kw[2], kw[3]);
      vtile[i] = make_uint4(vw[0], vw[1], vw[2], vw[3]);
    }
    cp_async_commit();  // the whole tile in flight at once, one wait
    cp_async_wait<0>();
    __syncthreads();
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
    if (early && n_splits == 1) {  // the only split: the output directly (the merge's weight would be exactly 1)
      out[(size_t(t) * H + h0 + g) * Dh + d] = a / lrun[g];
      continue;
    }
    float* dst = partial + ((size_t(t) * H + h0 + g) * n_splits + s) * (Dh + 2);
    dst[2 + d] = a;
    if (d == 0) dst[0] = mrun[g], dst[1] = lrun[g];
  }

  if (early && n_splits == 1) return;
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

}  // namespace

namespace {
bool g_attention_early = true;  // TIERMOE_CUDA_ATTN_EARLY=0: the first tile after the wait, the merge even for one split,
                                // all G heads of a KV head in one block

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

// The kernel for G query heads per block and head size Dh.
template <int Dh>
auto kernel_for(int G) {
  return G == 1 ? attention_decode_kernel<1, Dh>
                : (G == 2 ? attention_decode_kernel<2, Dh> : (G <= 4 ? attention_decode_kernel<4, Dh> : attention_decode_kernel<8, Dh>));
}
auto kernel_for(int G, int Dh) {
  return Dh == 16 ? kernel_for<16>(G)
                  : Dh == 32 ? kernel_for<32>(G) : Dh == 64 ? kernel_for<64>(G) : Dh == 128 ? kernel_for<128>(G) : kernel_for<256>(G);
}

cudaError_t launch_attention_decode(float* out, const float* q, bf16* kc, bf16* vc, const int32_t* table,
                                    const int32_t* const* tables, const float* k_new, const float* v_new,
                                    const int32_t* pos, int T, int H, int Hkv, int Dh, int n_splits, float* partial,
                                    unsigned* counters, cudaStream_t s) {
  if (T == 0) return cudaSuccess;
  const int HG = g_attention_early ? head_groups(H / Hkv, Hkv * n_splits * T) : 1, G = H / Hkv / HG;
  const dim3 grid(Hkv * HG, n_splits, T);
  return launch(kernel_for(G, Dh), grid, kThreads, 0, s, out, partial, counters, q, kc, vc, table, tables, k_new, v_new, pos,
                H, Hkv, g_attention_early);
}
}  // namespace

cudaError_t attention_decode(float* out, const float* q, KvPages kv, const float* k_new, const float* v_new,
                             const int32_t* pos, int T, int H, int Hkv, int Dh, int n_splits, float* partial,
                             unsigned* counters, cudaStream_t s) {
  if (!attention_decode_supported(H, Hkv, Dh) || n_splits < 1 || T > kGemvMaxT || !kv.table)
    return cudaErrorInvalidValue;
  return launch_attention_decode(out, q, kv.k, kv.v, kv.table, nullptr, k_new, v_new, pos, T, H, Hkv, Dh, n_splits,
                                 partial, counters, s);
}

cudaError_t attention_decode_batch(float* out, const float* q, bf16* k_pool, bf16* v_pool, const int32_t* const* tables,
                                   const float* k_new, const float* v_new, const int32_t* pos, int B, int H, int Hkv,
                                   int Dh, int n_splits, float* partial, unsigned* counters, cudaStream_t s) {
  if (!attention_decode_supported(H, Hkv, Dh) || n_splits < 1 || B < 0 || B > 65535 || !tables)
    return cudaErrorInvalidValue;
  return launch_attention_decode(out, q, k_pool, v_pool, nullptr, tables, k_new, v_new, pos, B, H, Hkv, Dh, n_splits,
                                 partial, counters, s);
}

void set_attention_early(bool on) { g_attention_early = on; }

int attention_decode_tile_keys(int Dh) { return Dh > 0 ? tile_keys(Dh) : 0; }

int attention_decode_resident_blocks(int H, int Hkv, int Dh) {
  int per_sm = 0;
  if (!attention_decode_supported(H, Hkv, Dh) ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel_for(H / Hkv, Dh), kThreads, 0) != cudaSuccess)
    return 0;
  return per_sm * sm_count();
}

bool attention_decode_supported(int H, int Hkv, int Dh) {
  const int G = Hkv > 0 && H % Hkv == 0 ? H / Hkv : 0;
  return G >= 1 && G <= 8 && (Dh == 16 || Dh == 32 || Dh == 64 || Dh == 128 || Dh == 256);
}

}  // namespace tiermoe::cuda
