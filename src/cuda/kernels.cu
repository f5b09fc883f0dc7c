// The elementwise and small CUDA kernels declared in kernels.h (embedding, norms, q/k norm + RoPE,
// the KV append, the split attention and its combine, random fill), and the programmatic-launch
// switch. Plain CUDA C++ for sm_90; the GEMVs are in gemv.cu, the decode MoE in moe_decode.cu.
#include "cuda/kernels.h"

#include "cuda/dependent_launch.cuh"
#include "cuda/device_math.cuh"
#include "cuda/kv_fp8.cuh"

#include <cfloat>
#include <climits>
#include <algorithm>
#include <cmath>

#include <cuda_bf16.h>

namespace tiermoe::cuda {
namespace {

__global__ void embed_kernel(float* x, const bf16* table, const int32_t* ids, int D, const int32_t* pos_in,
                             int32_t* pos_out) {
  const int t = blockIdx.x;
  if (pos_out && threadIdx.x == 0) pos_out[t] = pos_in[t];
  const bf16* row = table + size_t(ids[t]) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) x[size_t(t) * D + d] = bf(row[d]);
}

__global__ void rmsnorm_kernel(float* y, const float* x, const float* w, int D, float eps) {
  const size_t r = blockIdx.x;
  const float* xr = x + r * D;
  float ss = 0.f;
  for (int d = threadIdx.x; d < D; d += blockDim.x) ss = fmaf(xr[d], xr[d], ss);
  __shared__ float part[32];
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    float v = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0.f;
    v = warp_sum(v);
    if (threadIdx.x == 0) part[0] = v;
  }
  __syncthreads();
  const float inv = 1.0f / sqrtf(part[0] / float(D) + eps);
  for (int d = threadIdx.x; d < D; d += blockDim.x) y[r * D + d] = xr[d] * inv * w[d];
}

// grid (segments, T): a segment is one head (norm per head, or no norm), or with `full` all heads
// of q or of k (norm over the whole projection, which one block must see); q's segments first.
// A thread per rotated pair where the block allows. RMSNorm over the segment, then RoPE, in place.
// With kv.table (or kv.tables: token t's own sequence's), k's segments also write their rotated keys
// and the values v to cache row pos[t] (FP8 pages: a warp per row, below).
// With `early`, what no kernel of the pass writes -- the position and page table (copied before
// the pass's first kernel), the norm weights -- and what follows from them (the thread's first
// pair's angle by powf / sincosf, its cache row) are taken before the wait for the q/k/v
// projection, off the chain between it and attention; the same values, the same bits. FP8: the
// pages' format (a template argument, so that the BF16 kernel is compiled as it was).
template <bool FP8>
__global__ void qk_norm_rope_kernel(float* q, float* k, const float* qn, const float* kn, bool full,
                                    const int32_t* pos, int H, int Hkv, int Dh, float eps, float theta, KvPages kv,
                                    const float* vin, bool early) {
  const int seg = blockIdx.x, t = blockIdx.y, half = Dh / 2;
  const int q_segs = full ? 1 : H;
  const bool is_q = seg < q_segs;
  const int heads = full ? (is_q ? H : Hkv) : 1, len = heads * Dh, pairs = heads * half;
  const float* nw = is_q ? qn : kn;
  const size_t first = size_t(full ? 0 : (is_q ? seg : seg - q_segs)) * Dh;  // the segment in its head row
  float* v = (is_q ? q + size_t(t) * H * Dh : k + size_t(t) * Hkv * Dh) + first;
  const bool append = !is_q && (kv.table || kv.tables);  // then the segment's place in cache row pos[t]
  float p = 0.f;
  size_t cache_at = 0;
  // Pair i's rotation (sin, cos) and norm weights (wa, wb: 1 without a norm).
  auto pair_params = [&](int i, float& sn, float& cs, float& wa, float& wb) {
    const int h = i / half, j = i % half;
    const float inv_freq = 1.0f / powf(theta, float(2 * j) / float(Dh));
    sincosf(inv_freq * p, &sn, &cs);
    const int wj = full ? h * Dh + j : j;  // norm weights span the segment
    wa = nw ? nw[wj] : 1.f;
    wb = nw ? nw[wj + half] : 1.f;
  };
  float sn0 = 0.f, cs0 = 1.f, wa0 = 1.f, wb0 = 1.f;  // the thread's first pair, i = threadIdx.x
  auto prepare = [&] {
    p = float(pos[t]);
    cache_at = append ? kv_row(kv.table_of(t), pos[t]) * size_t(Hkv) * Dh + first : 0;
    if (int(threadIdx.x) < pairs) pair_params(threadIdx.x, sn0, cs0, wa0, wb0);
  };
  if (early) prepare();
  pdl_start();
  // FP8 append: a row is quantized by one warp (its scale is the row's max). Where the block has a
  // warp for every key row and one more for every value row, the value rows, which the norm and
  // rotation do not touch, go out right after the wait, beside the norm's loads, and are quantized
  // from registers before the barrier; the rotated keys are kept in shared memory for theirs, where
  // the launch gave it (qk_norm_rope).
  constexpr int kRowRegs = kAttnMaxDh / 32;
  extern __shared__ float keys_rotated[];
  const int warp = threadIdx.x >> 5;
  const bool values_apart = FP8 && append && int(blockDim.x >> 5) >= 2 * heads;
  bool keys_staged = false;
  if constexpr (FP8) {
    uint32_t staged_bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(staged_bytes));
    keys_staged = append && size_t(len) * sizeof(float) <= staged_bytes;
  }
  float value_row[kRowRegs];
  if (values_apart && warp >= heads && warp < 2 * heads)
    load_row_lanes(vin + size_t(t) * Hkv * Dh + first + size_t(warp - heads) * Dh, Dh, value_row);
  float inv = 1.f;
  if (nw) {
    __shared__ float part[32];
    float ss = 0.f;
    for (int i = threadIdx.x; i < len; i += blockDim.x) ss = fmaf(v[i], v[i], ss);
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    __syncthreads();
    ss = 0.f;
    for (int w = 0; w < int(blockDim.x >> 5); ++w) ss += part[w];
    inv = 1.0f / sqrtf(ss / float(len) + eps);
  }
  if (!early) prepare();
  for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
    const int h = i / half, j = i % half;
    float sn = sn0, cs = cs0, wa = wa0, wb = wb0;
    if (i != int(threadIdx.x)) pair_params(i, sn, cs, wa, wb);
    float* r = v + size_t(h) * Dh;
    const float a = nw ? r[j] * inv * wa : r[j], b = nw ? r[j + half] * inv * wb : r[j + half];
    r[j] = a * cs - b * sn;
    r[j + half] = b * cs + a * sn;
    if (keys_staged) {
      keys_rotated[h * Dh + j] = r[j];
      keys_rotated[h * Dh + j + half] = r[j + half];
    }
    if (append && !FP8) {
      const size_t at = cache_at + size_t(h) * Dh;
      reinterpret_cast<__nv_bfloat16*>(kv.k)[at + j] = __float2bfloat16_rn(r[j]);
      reinterpret_cast<__nv_bfloat16*>(kv.k)[at + j + half] = __float2bfloat16_rn(r[j + half]);
    }
  }
  if (append && !FP8)  // the segment's values, as they are
    for (int i = threadIdx.x; i < len; i += blockDim.x)
      reinterpret_cast<__nv_bfloat16*>(kv.v)[cache_at + i] = __float2bfloat16_rn(vin[size_t(t) * Hkv * Dh + first + i]);
  if (FP8 && append) {
    auto store = [&](const float (&r)[kRowRegs], int h, uint8_t* codes, int8_t* exps) {
      const size_t at = cache_at + size_t(h) * Dh;  // the head's row in the pool, in values
      quantize_fp8_row(r, Dh, codes + at, exps + at / Dh);
    };
    auto quantize = [&](const float* x, int h, uint8_t* codes, int8_t* exps) {
      float r[kRowRegs];
      load_row_lanes(x + size_t(h) * Dh, Dh, r);
      store(r, h, codes, exps);
    };
    if (values_apart && warp >= heads && warp < 2 * heads) store(value_row, warp - heads, kv.fp8.v, kv.fp8.v_exp);
    __syncthreads();  // the block's rotated keys, written above, read by every warp
    const float* keys = keys_staged ? keys_rotated : v;
    for (int h = warp; h < heads; h += blockDim.x >> 5) {
      quantize(keys, h, kv.fp8.k, kv.fp8.k_exp);
      if (!values_apart) quantize(vin + size_t(t) * Hkv * Dh + first, h, kv.fp8.v, kv.fp8.v_exp);
    }
  }
}

__global__ void add_bias_kernel(float* x, const float* b, int T, int N) {
  const size_t n = size_t(T) * N;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    x[i] += b[i % N];
}

__global__ void clamp_kernel(float* x, size_t n, float c) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    x[i] = fminf(c, fmaxf(-c, x[i]));
}

__global__ void silu_mul_gu_kernel(float* act, const float* gu, int T, int F) {
  const size_t n = size_t(T) * F;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const size_t t = i / F, f = i % F;
    act[i] = silu(gu[t * 2 * F + f]) * gu[t * 2 * F + F + f];
  }
}

__global__ void add_sigmoid_scaled_kernel(float* x, const float* y, const float* g, int T, int D) {
  const size_t n = size_t(T) * D;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    x[i] += 1.0f / (1.0f + expf(-g[i / D])) * y[i];
}

// hi[i], lo[i] = bf16_split(x[i]) (lo optional).
__global__ void to_bf16_kernel(__nv_bfloat16* hi, __nv_bfloat16* lo, const float* x, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    __nv_bfloat16 h, l;
    bf16_split(x[i], h, l);
    hi[i] = h;
    if (lo) lo[i] = l;
  }
}

__global__ void kv_append_kernel(KvPages kv, const float* k, const float* v, const int32_t* pos, int row) {
  const int t = blockIdx.x;
  const size_t dst = kv_row(kv.table, pos[t]) * row, src = size_t(t) * row;
  for (int i = threadIdx.x; i < row; i += blockDim.x) {
    reinterpret_cast<__nv_bfloat16*>(kv.k)[dst + i] = __float2bfloat16_rn(k[src + i]);
    reinterpret_cast<__nv_bfloat16*>(kv.v)[dst + i] = __float2bfloat16_rn(v[src + i]);
  }
}

// FP8 pages: grid (T, ceil(Hkv / 8)), 8 warps, a warp per (token, KV head) row.
__global__ void kv_append_fp8_kernel(KvFp8 kv, const int32_t* table, const float* k, const float* v,
                                     const int32_t* pos, int Hkv, int Dh) {
  const int t = blockIdx.x, kvh = blockIdx.y * 8 + (threadIdx.x >> 5);
  if (kvh >= Hkv) return;
  const size_t dst = (kv_row(table, pos[t]) * Hkv + kvh) * Dh, src = (size_t(t) * Hkv + kvh) * Dh;
  float kr[kAttnMaxDh / 32], vr[kAttnMaxDh / 32];  // both rows' loads out at once
  load_row_lanes(k + src, Dh, kr);
  load_row_lanes(v + src, Dh, vr);
  quantize_fp8_row(kr, Dh, kv.k + dst, kv.k_exp + dst / Dh);
  quantize_fp8_row(vr, Dh, kv.v + dst, kv.v_exp + dst / Dh);
}

// grid (pages, layers): one block copies one page of K and of V, 16 bytes per load (page_bytes a
// multiple of 16, pages at multiples of it in the pool).
__global__ void kv_copy_pages_kernel(uint8_t* k, uint8_t* v, size_t layer_stride, const int32_t* dst_table,
                                     const int32_t* src_table, size_t page_bytes) {
  const size_t layer = size_t(blockIdx.y) * layer_stride, n16 = page_bytes / 16;
  const size_t from = layer + size_t(src_table[blockIdx.x]) * page_bytes, to = layer + size_t(dst_table[blockIdx.x]) * page_bytes;
  const uint4 *sk = reinterpret_cast<const uint4*>(k + from), *sv = reinterpret_cast<const uint4*>(v + from);
  uint4 *dk = reinterpret_cast<uint4*>(k + to), *dv = reinterpret_cast<uint4*>(v + to);
  for (size_t i = threadIdx.x; i < n16; i += blockDim.x) {
    dk[i] = sk[i];
    dv[i] = sv[i];
  }
}

constexpr int kAttnWarps = 4;
constexpr int kAttnJ = kAttnMaxDh / 32;

// grid (H, n_splits, T), kAttnWarps warps. Warp w takes keys start+w, start+w+4, ... with an
// online softmax; lane holds dims lane, lane+32, ...; the warps merge in shared memory and the
// block writes (max, sum, unnormalized acc[Dh]) for its split. FP8: the pages are FP8 rows.
template <bool FP8>
__global__ void __launch_bounds__(kAttnWarps * 32) attention_split_kernel(
    float* __restrict__ partial, const float* __restrict__ q, KvPages kv, const int32_t* __restrict__ pos, int H,
    int Hkv, int Dh, int split_len) {
  const int h = blockIdx.x, s = blockIdx.y, t = blockIdx.z, n_splits = gridDim.y;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const int n = pos[t] + 1, kvh = h / (H / Hkv);
  const int start = s * split_len, end = min(n, start + split_len);
  const float scale = rsqrtf(float(Dh));
  const size_t stride = size_t(Hkv) * Dh;
  float qr[kAttnJ], acc[kAttnJ];
  const float* qh = q + (size_t(t) * H + h) * Dh;
#pragma unroll
  for (int j = 0; j < kAttnJ; ++j) {
    const int d = lane + 32 * j;
    qr[j] = d < Dh ? qh[d] * scale : 0.f;
    acc[j] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  for (int key = start + w; key < end; key += kAttnWarps) {
    const size_t off = kv_row(kv.table, key) * stride + size_t(kvh) * Dh;
    const int ke = FP8 ? kv.fp8.k_exp[off / Dh] : 0, ve = FP8 ? kv.fp8.v_exp[off / Dh] : 0;
    auto k_at = [&](int d) { return FP8 ? fp8_to_float(kv.fp8.k[off + d], ke) : bf(kv.k[off + d]); };
    auto v_at = [&](int d) { return FP8 ? fp8_to_float(kv.fp8.v[off + d], ve) : bf(kv.v[off + d]); };
    float sc = 0.f;
#pragma unroll
    for (int j = 0; j < kAttnJ; ++j) {
      const int d = lane + 32 * j;
      if (d < Dh) sc = fmaf(qr[j], k_at(d), sc);
    }
    sc = warp_sum(sc);
    const float m_new = fmaxf(m, sc);
    const float corr = expf(m - m_new), p = expf(sc - m_new);
    l = l * corr + p;
#pragma unroll
    for (int j = 0; j < kAttnJ; ++j) {
      const int d = lane + 32 * j;
      if (d < Dh) acc[j] = acc[j] * corr + p * v_at(d);
    }
    m = m_new;
  }
  __shared__ float sm[kAttnWarps], sl[kAttnWarps], sacc[kAttnWarps][kAttnMaxDh];
  if (lane == 0) {
    sm[w] = m;
    sl[w] = l;
  }
#pragma unroll
  for (int j = 0; j < kAttnJ; ++j) {
    const int d = lane + 32 * j;
    if (d < Dh) sacc[w][d] = acc[j];
  }
  __syncthreads();
  float M = -INFINITY;
#pragma unroll
  for (int i = 0; i < kAttnWarps; ++i) M = fmaxf(M, sm[i]);
  float* out = partial + ((size_t(t) * H + h) * n_splits + s) * (Dh + 2);
  for (int d = threadIdx.x; d < Dh; d += blockDim.x) {
    float a = 0.f;
    for (int i = 0; i < kAttnWarps; ++i)
      if (sm[i] != -INFINITY) a += sacc[i][d] * expf(sm[i] - M);
    out[2 + d] = a;
  }
  if (threadIdx.x == 0) {
    float L = 0.f;
    for (int i = 0; i < kAttnWarps; ++i)
      if (sm[i] != -INFINITY) L += sl[i] * expf(sm[i] - M);
    out[0] = M;
    out[1] = L;
  }
}

// grid T*H, kCombineWarps warps: the n_splits partial rows of one (t, h) merged into out[t, h].
// Warp w takes splits w, w + kCombineWarps, ... in that order, kCombineRows rows' loads in flight at
// once (L2 only: written by the kernel before), a lane dims lane, lane + 32, ..., and keeps an online
// softmax state of its own; the warps' states then meet in shared memory in warp order, so the bits
// do not depend on timing. Why not merge_splits (the rows staged block-wide, then a thread per
// output walking every split in turn): at 128 splits (Qwen3 at 32k keys) that took two chunks and a
// serial walk of 128 rows per thread, and added 9.2 us a layer to the captured step. With this
// kernel the same step was 3.3% faster at 128 splits and 2% at 4096 keys' 16-20 (one H100,
// docs/benchmarks.md "Long contexts").
constexpr int kCombineWarps = 8, kCombineRows = 4;
template <int DIMS>  // ceil(Dh / 32)
__global__ void __launch_bounds__(kCombineWarps * 32) attention_combine_kernel(float* __restrict__ out,
                                                                               const float* __restrict__ partial,
                                                                               int n_splits, int Dh) {
  __shared__ float s_acc[kCombineWarps][DIMS * 32], s_ml[kCombineWarps][2];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, row = Dh + 2;
  const float* p = partial + size_t(blockIdx.x) * n_splits * row;
  pdl_start();
  float M = -INFINITY, L = 0.f, acc[DIMS] = {};
  for (int s0 = warp; s0 < n_splits; s0 += kCombineWarps * kCombineRows) {
    float m[kCombineRows], l[kCombineRows], o[kCombineRows][DIMS];
#pragma unroll
    for (int r = 0; r < kCombineRows; ++r) {
      const int s = s0 + r * kCombineWarps;
      const float* pr = p + size_t(min(s, n_splits - 1)) * row;
      m[r] = s < n_splits ? __ldcg(pr) : -INFINITY;
      l[r] = s < n_splits ? __ldcg(pr + 1) : 0.f;
#pragma unroll
      for (int i = 0; i < DIMS; ++i) o[r][i] = s < n_splits && lane + 32 * i < Dh ? __ldcg(pr + 2 + lane + 32 * i) : 0.f;
    }
#pragma unroll
    for (int r = 0; r < kCombineRows; ++r) {  // -inf: no visible key yet (weights 0, no NaN)
      const float Mn = fmaxf(M, m[r]), base = Mn == -INFINITY ? 0.f : Mn;
      const float corr = expf(M - base), w = expf(m[r] - base);
      L = fmaf(l[r], w, L * corr);
#pragma unroll
      for (int i = 0; i < DIMS; ++i) acc[i] = fmaf(o[r][i], w, acc[i] * corr);
      M = Mn;
    }
  }
  if (lane == 0) s_ml[warp][0] = M, s_ml[warp][1] = L;
#pragma unroll
  for (int i = 0; i < DIMS; ++i) s_acc[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  float Mx = -INFINITY;
#pragma unroll
  for (int w = 0; w < kCombineWarps; ++w) Mx = fmaxf(Mx, s_ml[w][0]);
  const float base = Mx == -INFINITY ? 0.f : Mx;
  float f[kCombineWarps], Lt = 0.f;
#pragma unroll
  for (int w = 0; w < kCombineWarps; ++w) {
    f[w] = expf(s_ml[w][0] - base);
    Lt = fmaf(s_ml[w][1], f[w], Lt);
  }
  for (int d = threadIdx.x; d < Dh; d += blockDim.x) {
    float a = 0.f;
#pragma unroll
    for (int w = 0; w < kCombineWarps; ++w) a = fmaf(s_acc[w][d], f[w], a);
    out[size_t(blockIdx.x) * Dh + d] = a / Lt;
  }
}

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__global__ void fill_random_bf16_kernel(__nv_bfloat16* w, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint64_t r = mix64(seed * 0x9e3779b97f4a7c15ull + i);
    const float u = float(r >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    w[i] = __float2bfloat16_rn((2.f * u - 1.f) * scale);
  }
}

__global__ void fill_f32_kernel(float* p, size_t n, float value) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = value;
}

unsigned grid_for(size_t n, int threads = 256) {
  const size_t b = (n + threads - 1) / threads;
  return unsigned(b < 4096 ? (b > 0 ? b : 1) : 4096);
}

bool g_programmatic_launch = false;
bool g_rope_early = true;  // TIERMOE_CUDA_ROPE_EARLY=0: qk_norm_rope takes everything after the wait
}  // namespace

bool programmatic_launch() { return g_programmatic_launch; }
void set_programmatic_launch(bool on) { g_programmatic_launch = on; }
void set_rope_early(bool on) { g_rope_early = on; }

cudaError_t embed(float* x, const bf16* table, const int32_t* ids, int T, int D, cudaStream_t s,
                  const int32_t* pos_in, int32_t* pos_out) {
  if (T == 0) return cudaSuccess;
  if ((pos_in == nullptr) != (pos_out == nullptr)) return cudaErrorInvalidValue;
  embed_kernel<<<T, 256, 0, s>>>(x, table, ids, D, pos_in, pos_out);
  return cudaGetLastError();
}

cudaError_t rmsnorm(float* y, const float* x, const float* w, int rows, int D, float eps, cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  const int threads = D >= 1024 ? 1024 : (D >= 256 ? 256 : 64);
  rmsnorm_kernel<<<rows, threads, 0, s>>>(y, x, w, D, eps);
  return cudaGetLastError();
}

cudaError_t qk_norm_rope(float* q, float* k, const float* q_norm, const float* k_norm, bool full, const int32_t* pos,
                         int T, int H, int Hkv, int Dh, float eps, float theta, cudaStream_t s, KvPages append,
                         const float* v) {
  if ((q_norm == nullptr) != (k_norm == nullptr) || Dh % 2 != 0 || ((append.table || append.tables) && !v))
    return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  full = full && q_norm;
  const int segs = full ? 2 : H + Hkv, pairs = (full ? H : 1) * Dh / 2;
  // A thread per rotated pair (up to 1024): each pair is a chain of dependent steps (load, norm,
  // powf + sincosf, store), and fewer threads lengthen it -- 256 per block cost 4-5% per token at
  // OLMoE's shape (docs/benchmarks.md).
  const int threads = std::min(1024, std::max(32, (pairs + 31) / 32 * 32));
  // FP8 appends stage a k segment's rotated keys in shared memory where they fit the default 48 KB.
  const size_t key_bytes = size_t(full ? Hkv : 1) * Dh * sizeof(float);
  const size_t staged = append.is_fp8() && key_bytes <= 48 * 1024 ? key_bytes : 0;
  return launch(append.is_fp8() ? qk_norm_rope_kernel<true> : qk_norm_rope_kernel<false>, dim3(segs, T), threads, staged, s, q,
                k, q_norm, k_norm, full, pos, H, Hkv, Dh, eps, theta, append, v, g_rope_early);
}

cudaError_t add_bias(float* x, const float* b, int T, int N, cudaStream_t s) {
  add_bias_kernel<<<grid_for(size_t(T) * N), 256, 0, s>>>(x, b, T, N);
  return cudaGetLastError();
}

cudaError_t clamp(float* x, size_t n, float c, cudaStream_t s) {
  clamp_kernel<<<grid_for(n), 256, 0, s>>>(x, n, c);
  return cudaGetLastError();
}

cudaError_t silu_mul_gu(float* act, const float* gu, int T, int F, cudaStream_t s) {
  silu_mul_gu_kernel<<<grid_for(size_t(T) * F), 256, 0, s>>>(act, gu, T, F);
  return cudaGetLastError();
}

cudaError_t add_sigmoid_scaled(float* x, const float* y, const float* g, int T, int D, cudaStream_t s) {
  add_sigmoid_scaled_kernel<<<grid_for(size_t(T) * D), 256, 0, s>>>(x, y, g, T, D);
  return cudaGetLastError();
}

cudaError_t to_bf16(bf16* hi, bf16* lo, const float* x, size_t n, cudaStream_t s) {
  to_bf16_kernel<<<grid_for(n), 256, 0, s>>>(reinterpret_cast<__nv_bfloat16*>(hi), reinterpret_cast<__nv_bfloat16*>(lo),
                                             x, n);
  return cudaGetLastError();
}

cudaError_t kv_copy_pages(void* k, void* v, size_t layer_stride, size_t page_bytes, int layers,
                          const int32_t* dst_table, const int32_t* src_table, int pages, cudaStream_t s) {
  if (page_bytes % 16 != 0 || layer_stride % 16 != 0) return cudaErrorInvalidValue;
  if (pages <= 0 || layers <= 0) return cudaSuccess;
  kv_copy_pages_kernel<<<dim3(pages, layers), 256, 0, s>>>(static_cast<uint8_t*>(k), static_cast<uint8_t*>(v),
                                                           layer_stride, dst_table, src_table, page_bytes);
  return cudaGetLastError();
}

cudaError_t kv_append(KvPages kv, const float* k, const float* v, const int32_t* pos, int T, int Hkv, int Dh,
                      cudaStream_t s) {
  if (T == 0) return cudaSuccess;
  if (kv.is_fp8())
    kv_append_fp8_kernel<<<dim3(T, (Hkv + 7) / 8), 256, 0, s>>>(kv.fp8, kv.table, k, v, pos, Hkv, Dh);
  else
    kv_append_kernel<<<T, 256, 0, s>>>(kv, k, v, pos, Hkv * Dh);
  return cudaGetLastError();
}

cudaError_t attention(float* out, const float* q, KvPages kv, const int32_t* pos, int T, int H, int Hkv, int Dh,
                      int n_splits, int split_len, float* partial, cudaStream_t s) {
  if (Dh > kAttnMaxDh || H % Hkv != 0 || n_splits < 1) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  const dim3 grid(H, n_splits, T);
  if (kv.is_fp8())
    attention_split_kernel<true><<<grid, kAttnWarps * 32, 0, s>>>(partial, q, kv, pos, H, Hkv, Dh, split_len);
  else
    attention_split_kernel<false><<<grid, kAttnWarps * 32, 0, s>>>(partial, q, kv, pos, H, Hkv, Dh, split_len);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  return attention_merge_splits(out, partial, T, H, Dh, n_splits, s);
}

cudaError_t attention_merge_splits(float* out, const float* partial, int T, int H, int Dh, int n_splits, cudaStream_t s) {
  if (T == 0) return cudaSuccess;
  if (n_splits < 1 || Dh < 1 || Dh > kAttnMaxDh) return cudaErrorInvalidValue;
  const unsigned grid = unsigned(T * H), threads = kCombineWarps * 32;
  if (Dh <= 32) return launch(attention_combine_kernel<1>, grid, threads, 0, s, out, partial, n_splits, Dh);
  if (Dh <= 64) return launch(attention_combine_kernel<2>, grid, threads, 0, s, out, partial, n_splits, Dh);
  if (Dh <= 128) return launch(attention_combine_kernel<4>, grid, threads, 0, s, out, partial, n_splits, Dh);
  return launch(attention_combine_kernel<8>, grid, threads, 0, s, out, partial, n_splits, Dh);
}

cudaError_t fill_random_bf16(bf16* w, size_t n, uint64_t seed, float scale, cudaStream_t s) {
  fill_random_bf16_kernel<<<grid_for(n), 256, 0, s>>>(reinterpret_cast<__nv_bfloat16*>(w), n, seed, scale);
  return cudaGetLastError();
}

cudaError_t fill_f32(float* p, size_t n, float value, cudaStream_t s) {
  fill_f32_kernel<<<grid_for(n), 256, 0, s>>>(p, n, value);
  return cudaGetLastError();
}

}  // namespace tiermoe::cuda
