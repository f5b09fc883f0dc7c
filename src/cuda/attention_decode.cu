// Decode attention (few new tokens of one sequence) in one launch: KV append, split-KV attention
// and the combine of the splits. Declared in kernels.h; twin: kv_append + attention_causal.
//
// Why one block per (KV head, key split): the G = H / Hkv query heads of a KV head share every K/V
// row, so each row is read from memory once, not G times. A key row of Dh BF16 values is read by
// Dh / 8 lanes with 16-byte loads, so a warp works on 32 / (Dh / 8) keys at once. The new tokens'
// keys and values are taken from k_new / v_new (FP32, rounded to BF16 as the cache stores them),
// never from the cache rows this launch writes, so no block waits on another. The last block of a
// (token, KV head) to finish -- counted with an atomic, reset by that block for the next launch --
// merges the splits' partial softmax results, one warp per query head.
#include <cmath>

#include <cuda_bf16.h>

#include "cuda/kernels.h"

namespace tiermoe::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;

__device__ __forceinline__ void unpack8(const uint4& w, float* f) {
  f[0] = __uint_as_float(w.x << 16), f[1] = __uint_as_float(w.x & 0xffff0000u);
  f[2] = __uint_as_float(w.y << 16), f[3] = __uint_as_float(w.y & 0xffff0000u);
  f[4] = __uint_as_float(w.z << 16), f[5] = __uint_as_float(w.z & 0xffff0000u);
  f[6] = __uint_as_float(w.w << 16), f[7] = __uint_as_float(w.w & 0xffff0000u);
}

// Merges softmax state (m, l, acc) with another one; m = -inf means empty.
template <int GM>
__device__ __forceinline__ void merge(float& m, float& l, float* acc, float mo, float lo, const float* acco) {
  const float M = fmaxf(m, mo);
  const float a = m == -INFINITY ? 0.f : expf(m - M), b = mo == -INFINITY ? 0.f : expf(mo - M);
  l = l * a + lo * b;
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = acc[i] * a + acco[i] * b;
  m = M;
}

// grid (Hkv, n_splits, T), kWarpsPerBlock warps. GM >= G query heads per KV head. Dh = 8 * L with
// L lanes per key, L in {2, 4, 8, 16, 32}. The keys 0 .. pos[T-1] are cut into n_splits equal
// splits here (not by the caller), so one captured launch stays balanced as the sequence grows.
// Each split is read in tiles of kTileElems / Dh keys: all threads load a tile into shared memory
// at once (one memory round trip), then the warps compute from it.
constexpr int kTileElems = 8192;  // BF16 values per K (and per V) tile: 16 KB each

template <int GM>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) attention_decode_kernel(
    float* __restrict__ out, float* __restrict__ partial, unsigned* __restrict__ counters,
    const float* __restrict__ q, bf16* __restrict__ kc, bf16* __restrict__ vc, const float* __restrict__ k_new,
    const float* __restrict__ v_new, const int32_t* __restrict__ pos, int H, int Hkv, int Dh) {
  const int kvh = blockIdx.x, s = blockIdx.y, t = blockIdx.z, n_splits = gridDim.y, T = gridDim.z;
  const int G = H / Hkv, L = Dh / 8, slots = 32 / L, tile = kTileElems / Dh;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane / L, part = lane % L;
  const int first_new = pos[0], n = pos[t] + 1;
  const int split_len = (pos[T - 1] + 1 + n_splits - 1) / n_splits;
  const int start = s * split_len, end = min(n, start + split_len);
  const size_t row = size_t(Hkv) * Dh;

  // This block's KV head of token t's new row goes into the cache, if its key falls in this split.
  if (pos[t] >= start && pos[t] < start + split_len)
    for (int i = threadIdx.x; i < Dh; i += blockDim.x) {
      const size_t src = size_t(t) * row + size_t(kvh) * Dh + i, dst = size_t(pos[t]) * row + size_t(kvh) * Dh + i;
      reinterpret_cast<__nv_bfloat16*>(kc)[dst] = __float2bfloat16_rn(k_new[src]);
      reinterpret_cast<__nv_bfloat16*>(vc)[dst] = __float2bfloat16_rn(v_new[src]);
    }

  const float scale = rsqrtf(float(Dh));
  float qr[GM][8], acc[GM][8], m[GM], l[GM];
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      qr[g][i] = g < G ? q[(size_t(t) * H + kvh * G + g) * Dh + part * 8 + i] * scale : 0.f;
      acc[g][i] = 0.f;
    }
  }
  // Shared memory: the K and V tiles during the key loop, then the warps' results (sacc).
  constexpr int kSmemWords = 2 * kTileElems / 2 > kWarpsPerBlock * GM * kAttnMaxDh ? 2 * kTileElems / 2
                                                                                   : kWarpsPerBlock * GM * kAttnMaxDh;
  __shared__ __align__(16) float smem[kSmemWords];
  uint4* ktile = reinterpret_cast<uint4*>(smem);
  uint4* vtile = ktile + kTileElems / 8;
  for (int t0 = start; t0 < end; t0 += tile) {
    const int nk = min(tile, end - t0);
    __syncthreads();  // the previous tile is consumed
    for (int i = threadIdx.x; i < nk * L; i += blockDim.x) {
      const int key = t0 + i / L;
      const size_t off = size_t(kvh) * Dh + (i % L) * 8;
      if (key >= first_new) {
        const float* pk = k_new + size_t(key - first_new) * row + off;
        const float* pv = v_new + size_t(key - first_new) * row + off;
        uint32_t kw[4], vw[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          kw[j] = uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(pk[2 * j]))) |
                  uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(pk[2 * j + 1]))) << 16;
          vw[j] = uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(pv[2 * j]))) |
                  uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(pv[2 * j + 1]))) << 16;
        }
        ktile[i] = make_uint4(kw[0], kw[1], kw[2], kw[3]);
        vtile[i] = make_uint4(vw[0], vw[1], vw[2], vw[3]);
      } else {
        ktile[i] = __ldg(reinterpret_cast<const uint4*>(kc + size_t(key) * row + off));
        vtile[i] = __ldg(reinterpret_cast<const uint4*>(vc + size_t(key) * row + off));
      }
    }
    __syncthreads();
    // The loop bound is the same for the whole warp (the shuffles need every lane); a slot past
    // the tile's end computes nothing.
    for (int base = warp * slots; base < nk; base += kWarpsPerBlock * slots) {
      const int j = base + sub;
      const bool valid = j < nk;
      float kf[8] = {}, vf[8] = {};
      if (valid) {
        unpack8(ktile[j * L + part], kf);
        unpack8(vtile[j * L + part], vf);
      }
#pragma unroll
      for (int g = 0; g < GM; ++g) {
        if (g >= G) break;
        float sc = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) sc = fmaf(qr[g][i], kf[i], sc);
        for (int o = L / 2; o > 0; o >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, o);
        if (!valid) continue;
        const float m_new = fmaxf(m[g], sc);
        const float corr = m[g] == -INFINITY ? 0.f : expf(m[g] - m_new), p = expf(sc - m_new);
        l[g] = l[g] * corr + p;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = fmaf(p, vf[i], acc[g][i] * corr);
        m[g] = m_new;
      }
    }
  }
  // Merge the key slots of a warp (lanes with the same `part`), then the warps in shared memory.
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    if (g >= G) break;
    for (int o = L; o < 32; o <<= 1) {
      float acco[8];
      const float mo = __shfl_xor_sync(0xffffffffu, m[g], o), lo = __shfl_xor_sync(0xffffffffu, l[g], o);
#pragma unroll
      for (int i = 0; i < 8; ++i) acco[i] = __shfl_xor_sync(0xffffffffu, acc[g][i], o);
      merge<GM>(m[g], l[g], acc[g], mo, lo, acco);
    }
  }
  __shared__ float sm[kWarpsPerBlock][GM], sl[kWarpsPerBlock][GM];
  __shared__ bool is_last;
  auto sacc = reinterpret_cast<float (*)[GM][kAttnMaxDh]>(smem);
  __syncthreads();  // the tiles are consumed
  if (sub == 0) {
#pragma unroll
    for (int g = 0; g < GM; ++g) {
      if (g >= G) break;
      if (part == 0) sm[warp][g] = m[g], sl[warp][g] = l[g];
#pragma unroll
      for (int i = 0; i < 8; ++i) sacc[warp][g][part * 8 + i] = acc[g][i];
    }
  }
  __syncthreads();
  for (int g = 0; g < G; ++g) {
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarpsPerBlock; ++w) M = fmaxf(M, sm[w][g]);
    float* dst = partial + ((size_t(t) * H + kvh * G + g) * n_splits + s) * (Dh + 2);
    for (int d = threadIdx.x; d < Dh; d += blockDim.x) {
      float a = 0.f;
#pragma unroll
      for (int w = 0; w < kWarpsPerBlock; ++w)
        if (sm[w][g] != -INFINITY) a += sacc[w][g][d] * expf(sm[w][g] - M);
      dst[2 + d] = a;
    }
    if (threadIdx.x == 0) {
      float Ls = 0.f;
#pragma unroll
      for (int w = 0; w < kWarpsPerBlock; ++w)
        if (sm[w][g] != -INFINITY) Ls += sl[w][g] * expf(sm[w][g] - M);
      dst[0] = M;
      dst[1] = Ls;
    }
  }

  // The last split block of (t, kvh) combines all splits.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned* c = counters + size_t(t) * Hkv + kvh;
    is_last = atomicAdd(c, 1u) == unsigned(n_splits - 1);
    if (is_last) *c = 0;  // ready for the next launch (kernels on one stream run in order)
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  // One warp per query head; lane c holds dims 2c, 2c+1 (and 2c+64, ... for Dh > 64), loads
  // of all splits issued back to back (8 at a time) to hide the L2 latency.
  for (int g = warp; g < G; g += kWarpsPerBlock) {
    const float* p = partial + (size_t(t) * H + kvh * G + g) * n_splits * (Dh + 2);
    float M = -INFINITY;
    for (int i = lane; i < n_splits; i += 32) M = fmaxf(M, __ldcg(p + size_t(i) * (Dh + 2)));
    for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    for (int c0 = 0; c0 < Dh / 2; c0 += 32) {
      const int c = c0 + lane;
      if (c >= Dh / 2) break;
      float2 a = make_float2(0.f, 0.f);
      float Lsum = 0.f;
#pragma unroll 8
      for (int i = 0; i < n_splits; ++i) {
        const float* pi = p + size_t(i) * (Dh + 2);
        const float ms = __ldcg(pi), ls = __ldcg(pi + 1);
        const float2 v = __ldcg(reinterpret_cast<const float2*>(pi + 2) + c);
        const float w = ms == -INFINITY ? 0.f : expf(ms - M);
        Lsum = fmaf(ls, w, Lsum);
        a.x = fmaf(v.x, w, a.x);
        a.y = fmaf(v.y, w, a.y);
      }
      float* o = out + (size_t(t) * H + kvh * G + g) * Dh + 2 * c;
      o[0] = a.x / Lsum;
      o[1] = a.y / Lsum;
    }
  }
}

}  // namespace

cudaError_t attention_decode(float* out, const float* q, bf16* kc, bf16* vc, const float* k_new, const float* v_new,
                             const int32_t* pos, int T, int H, int Hkv, int Dh, int n_splits, float* partial,
                             unsigned* counters, cudaStream_t s) {
  if (!attention_decode_supported(H, Hkv, Dh) || n_splits < 1 || T > kGemvMaxT) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  const dim3 grid(Hkv, n_splits, T);
  const int G = H / Hkv, threads = kWarpsPerBlock * 32;
  if (G == 1)
    attention_decode_kernel<1><<<grid, threads, 0, s>>>(out, partial, counters, q, kc, vc, k_new, v_new, pos, H, Hkv, Dh);
  else if (G == 2)
    attention_decode_kernel<2><<<grid, threads, 0, s>>>(out, partial, counters, q, kc, vc, k_new, v_new, pos, H, Hkv, Dh);
  else if (G <= 4)
    attention_decode_kernel<4><<<grid, threads, 0, s>>>(out, partial, counters, q, kc, vc, k_new, v_new, pos, H, Hkv, Dh);
  else
    attention_decode_kernel<8><<<grid, threads, 0, s>>>(out, partial, counters, q, kc, vc, k_new, v_new, pos, H, Hkv, Dh);
  return cudaGetLastError();
}

bool attention_decode_supported(int H, int Hkv, int Dh) {
  const int G = Hkv > 0 && H % Hkv == 0 ? H / Hkv : 0;
  return G >= 1 && G <= 8 && (Dh == 16 || Dh == 32 || Dh == 64 || Dh == 128 || Dh == 256);
}

}  // namespace tiermoe::cuda
