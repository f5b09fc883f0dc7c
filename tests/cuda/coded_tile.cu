// `tiermoe_cuda_check codedtile`: a probe for decode from the tiered KV codes on the GPU (docs/cuda.md,
// "What is not built yet", item 4): how fast can a decode-attention block turn a tile of coded K/V
// rows into the BF16 stage the tensor-core attention reads, against fetching BF16 tiles as they are?
// Only the loader runs, no scores: each block walks its tiles as the decode keys form does (BF16
// tiles by cp.async straight into two stages, one tile ahead; coded tiles into two raw sets by
// cp.async, two tiles ahead, each decoded into a stage after the tile before was read), and reads
// every stage once (a checksum), the reads the attention's ldmatrix would make.
// Forms: bf16; fp8 (`--kv fp8-all`'s rows: codes [2][64][kDh], then the rows' exponents [2][64],
// 8 codes at a time by the real loader's fp8x8_to_bf16x8: a reference point); pairs: keys coded
// before RoPE in a basis that commutes with it (k.rotation "rope_pairs", docs/kv_codecs.md), so a
// key decodes to its basis coordinates and is turned by its position's angles pair by pair (the
// query is brought into the basis once); dense: the same codes without the turn, the keys
// unrotated by an mma.sync product with a Dh x Dh basis (PCA keys, `default`'s form). Values stay
// in their basis in both (summed there, unrotated once per query head). nibbles: pairs with every code
// 4 bits (one stage; no bit reader) and the byte of pair i (low nibble channel i, high i + 64) of
// 16 tokens together, FP32 levels, each pair's two values stored side by side as one word (the
// stage's channels permuted so: the query gets the same permutation once, values come back by it
// once per head): the instructions a value needs as few as the format allows. Per
// channel c and stage s: b_sc bits (allocated, 0 .. 4), a codebook of 2^b_sc BF16 levels in shared
// memory, one BF16 norm per token and K or V; the stages' levels are added, as VqCodec::decode does.
// A tile's bytes (one KV head, kTileKeys keys): K codes, stage by stage and channel by channel, each
// channel's codes of the tile together (8 b_sc bytes: token j's code at bit j b_sc), then V's, then
// the K and V norms [2][kTileKeys] BF16; padded to 16 bytes.
// Before timing, every form's stages are written out for a small case and held against a host
// decode in double precision (codes, levels, norms and the turn: what could be read wrong; FP8 bit
// for bit against fp8_dequantize_rows).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "core/dtype.h"
#include "cuda/device_math.cuh"
#include "cuda/kv_fp8.cuh"
#include "cuda/probe_step.cuh"
#include "kv/fp8_rows.h"

namespace {
namespace cu = tiermoe::cuda;
using bf16 = __nv_bfloat16;

constexpr int kDh = 128, kPairs = kDh / 2, kTileKeys = 64, kThreads = 128, kLd = kDh + 8;
// Codebook rows (codes of at most 4 bits here), stages, raw sets in flight.
constexpr int kMaxBits = 4, kLevels = 1 << kMaxBits, kMaxStages = 2, kSets = 2;
static_assert(kThreads == 2 * kPairs, "thread t: pair t % 64 (channels i, i + 64), tokens of half t / 64");
constexpr size_t kStageBytes = size_t(2) * 2 * kTileKeys * kLd * sizeof(bf16);  // K and V, two stages

// What a block needs besides its tiles: per stage and channel the codes' byte offset in a tile and
// width, the codebooks [stage][level][channel] (level-major: a warp's lanes read 32 channels of
// one bank row each), the starting angles.
struct CodedLayout {
  int stages = 1, tile_bytes = 0, norm_off = 0;
  const int* off;         // [2 (K, V)][stages][kDh] byte offsets in a tile
  const uint8_t* bits;    // [2][stages][kDh]
  const bf16* book;       // [2][stages][kLevels][kDh]
  const float2* angle0;   // [positions / 32][kPairs]: (cos, sin) of p theta_i at p = 32 m
  const float2* step;     // [kPairs]: (cos, sin) of theta_i
  const float* lut;       // nibbles: [2][kLevels][kDh], stage 0's codebooks in FP32
};

// The nibbles form's tile: K codes [4 chunks of 16 tokens][kPairs][16 bytes] (byte: low nibble channel
// i, high i + 64), then V's, then the norms [2][kTileKeys] BF16.
constexpr int kNibCodeBytes = kTileKeys * kPairs, kNibNormOff = 2 * kNibCodeBytes, kNibTileBytes = kNibNormOff + 4 * kTileKeys;

// The codes of one channel's 32 tokens (b bits each, from the 4-byte aligned p), one at a time.
struct BitReader {
  const uint32_t* p = nullptr;
  uint64_t buf = 0;
  int have = 0, b = 0;
  __device__ __forceinline__ uint32_t next() {
    if (have < b) buf |= uint64_t(*p++) << have, have += 32;
    const uint32_t c = uint32_t(buf) & ((1u << b) - 1);
    buf >>= b, have -= b;
    return c;
  }
};

// Tile `tile` (its bytes at src) into raw set `set`; one commit group.
__device__ __forceinline__ void fetch_raw(uint8_t* set, const uint8_t* src, int tile_bytes) {
  for (int o = 16 * threadIdx.x; o < tile_bytes; o += 16 * kThreads) cu::cp_async16(set + o, src + o, true);
  cu::cp_async_commit();
}

// The raw tile (codes of positions p0 .. p0 + 63) decoded into stage ks / vs: thread t the pair i = t %
// 64 (channels i, i + 64) of tokens 32 h .. 32 h + 31, h = t / 64. TURN: keys turned by their angles
// (rope_pairs); else left in the basis (the dense form unrotates them after).
// This thread's channels' code widths and byte offsets in a tile (its half's first code), read once.
struct ThreadCodes {
  int off[2][kMaxStages][2], bits[2][kMaxStages][2];  // [K, V][stage][channel i, i + 64]
  __device__ explicit ThreadCodes(const CodedLayout& L) {
    const int i = threadIdx.x % kPairs, h = threadIdx.x / kPairs;
#pragma unroll
    for (int kv = 0; kv < 2; ++kv)
#pragma unroll
      for (int s = 0; s < kMaxStages; ++s)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int idx = (kv * L.stages + s) * kDh + i + kPairs * c;
          bits[kv][s][c] = s < L.stages ? L.bits[idx] : 0;
          off[kv][s][c] = s < L.stages ? L.off[idx] + 4 * bits[kv][s][c] * h : 0;
        }
  }
};

template <bool TURN>
__device__ __forceinline__ void decode_tile(const uint8_t* raw, bf16* ks, bf16* vs, const CodedLayout& L,
                                            const ThreadCodes& tc, const bf16* sbook, int p0) {
  const int i = threadIdx.x % kPairs, h = threadIdx.x / kPairs;
  const bf16* norms = reinterpret_cast<const bf16*>(raw + L.norm_off);
  float2 a = L.angle0[(p0 + 32 * h) / 32 * kPairs + i];
  const float2 st = L.step[i];
#pragma unroll
  for (int kv = 0; kv < 2; ++kv) {
    BitReader r[kMaxStages][2];
#pragma unroll
    for (int s = 0; s < kMaxStages; ++s)
#pragma unroll
      for (int c = 0; c < 2; ++c)
        r[s][c].b = tc.bits[kv][s][c], r[s][c].p = reinterpret_cast<const uint32_t*>(raw + tc.off[kv][s][c]);
    bf16* dst = (kv ? vs : ks) + 32 * h * kLd;
#pragma unroll 4
    for (int j = 0; j < 32; ++j) {
      float y[2] = {0.f, 0.f};
#pragma unroll
      for (int s = 0; s < kMaxStages; ++s)
        if (s < L.stages) {
          const bf16* book = sbook + (kv * L.stages + s) * kLevels * kDh;
#pragma unroll
          for (int c = 0; c < 2; ++c) y[c] += __bfloat162float(book[r[s][c].next() * kDh + i + kPairs * c]);
        }
      const float n = __bfloat162float(norms[kv * kTileKeys + 32 * h + j]);
      y[0] *= n, y[1] *= n;
      if (TURN && kv == 0) {  // x' = x cos - x_(i+64) sin, x'_(i+64) = x_(i+64) cos + x sin (HF rotate_half)
        const float x0 = y[0];
        y[0] = fmaf(x0, a.x, -y[1] * a.y);
        y[1] = fmaf(y[1], a.x, x0 * a.y);
        a = make_float2(fmaf(a.x, st.x, -a.y * st.y), fmaf(a.y, st.x, a.x * st.y));
      }
      dst[j * kLd + i] = __float2bfloat16(y[0]);
      dst[j * kLd + i + kPairs] = __float2bfloat16(y[1]);
    }
  }
}

// The nibbles form's raw tile into stage ks / vs: thread t the pair i = t % 64 of tokens 32 h .. 32 h + 31,
// h = t / 64; stage column 2 i holds channel i, 2 i + 1 channel i + 64.
__device__ __forceinline__ void decode_nibbles(const uint8_t* raw, bf16* ks, bf16* vs, const CodedLayout& L,
                                               const float* lut, int p0) {
  const int i = threadIdx.x % kPairs, h = threadIdx.x / kPairs;
  const bf16* norms = reinterpret_cast<const bf16*>(raw + kNibNormOff);
  float2 a = L.angle0[(p0 + 32 * h) / 32 * kPairs + i];
  const float2 st = L.step[i];
#pragma unroll
  for (int kv = 0; kv < 2; ++kv) {
    const float* lo = lut + kv * kLevels * kDh + i;
    uint32_t* dst = reinterpret_cast<uint32_t*>((kv ? vs : ks) + 32 * h * kLd) + i;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const uint4 w = *reinterpret_cast<const uint4*>(raw + kv * kNibCodeBytes + ((2 * h + q) * kPairs + i) * 16);
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int jj = 0; jj < 16; ++jj) {
        const uint32_t byte = words[jj / 4] >> (8 * (jj % 4));
        const float n = __bfloat162float(norms[kv * kTileKeys + 32 * h + 16 * q + jj]);
        float y0 = lo[(byte & 15) * kDh] * n, y1 = lo[((byte >> 4) & 15) * kDh + kPairs] * n;
        if (kv == 0) {  // turned as decode_tile's keys
          const float x0 = y0;
          y0 = fmaf(x0, a.x, -y1 * a.y);
          y1 = fmaf(y1, a.x, x0 * a.y);
          a = make_float2(fmaf(a.x, st.x, -a.y * st.y), fmaf(a.y, st.x, a.x * st.y));
        }
        dst[(16 * q + jj) * (kLd / 2)] = cu::pack(__float2bfloat16(y0), __float2bfloat16(y1));
      }
    }
  }
}

// Keys of a stage unrotated in place by the basis: K[64, Dh] = Y[64, Dh] U (x = U^T y), on mma.sync
// m16n8k16; ut: U^T in shared memory [kDh][kLd] (row d: U[., d]). Warp w: rows 16 w .. 16 w + 15.
__device__ __forceinline__ void unrotate_keys(bf16* ks, const bf16* ut) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  bf16* rows = ks + 16 * warp * kLd;
  uint32_t a[kDh / 16][4];
#pragma unroll
  for (int kk = 0; kk < kDh / 16; ++kk) cu::ldmatrix_x4(a[kk], rows + (lane & 15) * kLd + 16 * kk + 8 * (lane >> 4));
  __syncwarp();  // every lane's rows read before any is overwritten
#pragma unroll
  for (int n = 0; n < kDh / 8; ++n) {
    float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int kk = 0; kk < kDh / 16; kk += 2) {
      uint32_t b[4];  // columns 8 n .. 8 n + 7 (rows of U^T), k 16 kk .. 16 kk + 31
      cu::ldmatrix_x4(b, ut + (8 * n + (lane & 7)) * kLd + 16 * kk + 8 * (lane >> 3));
      cu::mma_bf16(d, a[kk], b[0], b[1]);
      cu::mma_bf16(d, a[kk + 1], b[2], b[3]);
    }
    const int r = lane >> 2, c = 8 * n + 2 * (lane & 3);
    *reinterpret_cast<uint32_t*>(rows + r * kLd + c) = cu::pack(__float2bfloat16(d[0]), __float2bfloat16(d[1]));
    *reinterpret_cast<uint32_t*>(rows + (r + 8) * kLd + c) = cu::pack(__float2bfloat16(d[2]), __float2bfloat16(d[3]));
  }
}

enum class Form { bf16, fp8, pairs, dense, nibbles };
constexpr int kFp8TileBytes = 2 * kTileKeys * kDh + 2 * kTileKeys;  // codes, then exponents (a multiple of 16)
// A form's codebooks in shared memory, after the stages: the allocated codes' BF16 levels (pairs,
// dense), the nibbles' FP32 levels, or none.
__host__ __device__ constexpr size_t book_bytes(Form f) {
  return f == Form::pairs || f == Form::dense ? size_t(2) * kMaxStages * kLevels * kDh * sizeof(bf16)
         : f == Form::nibbles                 ? size_t(2) * kLevels * kDh * sizeof(float)
                                              : 0;
}

// An FP8 tile (codes [2][64][kDh], exponents [2][64]) into stage ks / vs: 8 codes a conversion.
__device__ __forceinline__ void decode_fp8_tile(const uint8_t* raw, bf16* ks, bf16* vs) {
  const int8_t* exps = reinterpret_cast<const int8_t*>(raw + 2 * kTileKeys * kDh);
  for (int o = threadIdx.x; o < 2 * kTileKeys * (kDh / 8); o += kThreads) {
    const int kv = o / (kTileKeys * kDh / 8), r = o / (kDh / 8) % kTileKeys, c = 8 * (o % (kDh / 8));
    const uint2 codes = *reinterpret_cast<const uint2*>(raw + (kv * kTileKeys + r) * kDh + c);
    *reinterpret_cast<uint4*>((kv ? vs : ks) + r * kLd + c) = cu::fp8x8_to_bf16x8(codes, exps[kv * kTileKeys + r]);
  }
}

// Reads a stage as the attention would (16-byte rows), into a checksum; DUMP: writes it out instead.
template <bool DUMP>
__device__ __forceinline__ uint32_t consume(const bf16* ks, const bf16* vs, uint4* dump) {
  uint32_t x = 0;
  for (int o = threadIdx.x; o < 2 * kTileKeys * (kDh / 8); o += kThreads) {
    const int kv = o / (kTileKeys * kDh / 8), r = o / (kDh / 8) % kTileKeys, c = 8 * (o % (kDh / 8));
    const uint4 v = *reinterpret_cast<const uint4*>((kv ? vs : ks) + r * kLd + c);
    if (DUMP) dump[o] = v;
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  return x;
}

// Block b: KV head b / per_head's keys [(b % per_head) n_tiles 64, + n_tiles 64), tiles at
// src + (b n_tiles + t) tile_bytes. dump (DUMP): [blocks][n_tiles][2][64][kDh] BF16.
template <Form F, bool DUMP>
__global__ void __launch_bounds__(kThreads) loader_kernel(const uint8_t* __restrict__ src, CodedLayout L, int n_tiles,
                                                          int per_head, const bf16* __restrict__ ut_g, uint32_t* sum,
                                                          uint4* dump) {
  extern __shared__ uint4 smem4[];
  bf16* ks = reinterpret_cast<bf16*>(smem4);
  bf16* vs = ks + 2 * kTileKeys * kLd;
  bf16* sbook = vs + 2 * kTileKeys * kLd;  // coded: [2][stages][kLevels][kDh], as L.book
  constexpr bool kBooks = F == Form::pairs || F == Form::dense;
  float* slut = reinterpret_cast<float*>(sbook);  // nibbles: [2][kLevels][kDh], as L.lut
  uint8_t* raw = reinterpret_cast<uint8_t*>(sbook) + book_bytes(F);
  bf16* ut = reinterpret_cast<bf16*>(raw + (F == Form::bf16 ? 0 : kSets * L.tile_bytes));  // dense: U^T
  const int p_first = (blockIdx.x % per_head) * n_tiles * kTileKeys;
  const uint8_t* tiles = src + size_t(blockIdx.x) * n_tiles * L.tile_bytes;
  uint4* out = DUMP ? dump + size_t(blockIdx.x) * n_tiles * (2 * kTileKeys * kDh / 8) : nullptr;
  uint32_t x = 0;
  if constexpr (F == Form::bf16) {
    auto load = [&](int t) {
      const bf16* k = reinterpret_cast<const bf16*>(tiles + size_t(t) * L.tile_bytes), *v = k + kTileKeys * kDh;
      for (int o = threadIdx.x; o < kTileKeys * kDh / 8; o += kThreads) {
        const int r = o / (kDh / 8), c = 8 * (o % (kDh / 8)), st = (t & 1) * kTileKeys * kLd;
        cu::cp_async16(ks + st + r * kLd + c, k + r * kDh + c, true);
        cu::cp_async16(vs + st + r * kLd + c, v + r * kDh + c, true);
      }
      cu::cp_async_commit();
    };
    load(0);
    for (int t = 0; t < n_tiles; ++t) {
      if (t + 1 < n_tiles) load(t + 1), cu::cp_async_wait<1>();
      else cu::cp_async_wait<0>();
      __syncthreads();
      x ^= consume<DUMP>(ks + (t & 1) * kTileKeys * kLd, vs + (t & 1) * kTileKeys * kLd,
                         DUMP ? out + size_t(t) * (2 * kTileKeys * kDh / 8) : nullptr);
      __syncthreads();
    }
  } else {
    if constexpr (kBooks)
      for (int o = threadIdx.x; o < 2 * L.stages * kLevels * kDh / 8; o += kThreads) cu::cp_async16(sbook + 8 * o, L.book + 8 * o, true);
    if constexpr (F == Form::nibbles)
      for (int o = threadIdx.x; o < 2 * kLevels * kDh / 4; o += kThreads) cu::cp_async16(slut + 4 * o, L.lut + 4 * o, true);
    if constexpr (F == Form::dense)
      for (int o = threadIdx.x; o < kDh * kDh / 8; o += kThreads)
        cu::cp_async16(ut + (o / (kDh / 8)) * kLd + 8 * (o % (kDh / 8)), ut_g + 8 * o, true);
    cu::cp_async_commit();
    for (int t = 0; t < kSets; ++t)
      if (t < n_tiles) fetch_raw(raw + t * L.tile_bytes, tiles + size_t(t) * L.tile_bytes, L.tile_bytes);
      else cu::cp_async_commit();
    cu::cp_async_wait<kSets - 1>();
    __syncthreads();
    const ThreadCodes tc(L);
    auto decode = [&](int t) {  // tile t (its raw set complete and seen) into stage t & 1
      bf16 *k = ks + (t & 1) * kTileKeys * kLd, *v = vs + (t & 1) * kTileKeys * kLd;
      if constexpr (F == Form::fp8) decode_fp8_tile(raw + (t % kSets) * L.tile_bytes, k, v);
      else if constexpr (F == Form::nibbles) decode_nibbles(raw + (t % kSets) * L.tile_bytes, k, v, L, slut, p_first + t * kTileKeys);
      else decode_tile<F == Form::pairs>(raw + (t % kSets) * L.tile_bytes, k, v, L, tc, sbook, p_first + t * kTileKeys);
      if constexpr (F == Form::dense) {
        __syncthreads();
        unrotate_keys(k, ut);
      }
    };
    if (n_tiles > 0) decode(0);
    for (int t = 0; t < n_tiles; ++t) {
      __syncthreads();  // stage t written; raw set t % kSets read
      if (t + kSets < n_tiles) fetch_raw(raw + (t % kSets) * L.tile_bytes, tiles + size_t(t + kSets) * L.tile_bytes, L.tile_bytes);
      else cu::cp_async_commit();
      x ^= consume<DUMP>(ks + (t & 1) * kTileKeys * kLd, vs + (t & 1) * kTileKeys * kLd,
                         DUMP ? out + size_t(t) * (2 * kTileKeys * kDh / 8) : nullptr);
      if (t + 1 < n_tiles) {
        cu::cp_async_wait<kSets - 1>();
        __syncthreads();
        decode(t + 1);
      }
    }
  }
  if (x == 0x9e3779b9u) atomicAdd(sum, 1u);  // keeps the reads; almost never true
}

size_t smem_of(Form f, int tile_bytes) {
  if (f == Form::bf16) return kStageBytes;
  return kStageBytes + book_bytes(f) + size_t(kSets) * tile_bytes + (f == Form::dense ? size_t(kDh) * kLd * sizeof(bf16) : 0);
}

template <Form F, bool DUMP>
cudaError_t launch(int blocks, const uint8_t* src, const CodedLayout& L, int n_tiles, int per_head, const bf16* ut,
                   uint32_t* sum, uint4* dump, cudaStream_t s) {
  static const cudaError_t opt_in = [] {  // once, to the device's most (a launch's own size sets its occupancy)
    int most = 0;
    cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0);
    return cudaFuncSetAttribute(loader_kernel<F, DUMP>, cudaFuncAttributeMaxDynamicSharedMemorySize, most);
  }();
  if (opt_in != cudaSuccess) return opt_in;
  const size_t smem = smem_of(F, L.tile_bytes);
  loader_kernel<F, DUMP><<<blocks, kThreads, smem, s>>>(src, L, n_tiles, per_head, ut, sum, dump);
  return cudaGetLastError();
}

// fn(std::integral_constant<Form, f>{}): the runtime form as the kernel template's argument.
template <class Fn>
auto with_form(Form f, Fn&& fn) {
  switch (f) {
    case Form::bf16: return fn(std::integral_constant<Form, Form::bf16>{});
    case Form::fp8: return fn(std::integral_constant<Form, Form::fp8>{});
    case Form::pairs: return fn(std::integral_constant<Form, Form::pairs>{});
    case Form::dense: return fn(std::integral_constant<Form, Form::dense>{});
    case Form::nibbles: break;
  }
  return fn(std::integral_constant<Form, Form::nibbles>{});
}

int blocks_per_sm(Form f, int tile_bytes) {  // resident blocks per SM at this form's shared memory
  return with_form(f, [&](auto form) {
    int n = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, loader_kernel<decltype(form)::value, false>, kThreads, smem_of(f, tile_bytes));
    return n;
  });
}

cudaError_t launch_form(Form f, bool dump, int blocks, const uint8_t* src, const CodedLayout& L, int n_tiles, int per_head,
                        const bf16* ut, uint32_t* sum, uint4* out, cudaStream_t s) {
  return with_form(f, [&](auto form) {
    constexpr Form F = decltype(form)::value;
    return dump ? launch<F, true>(blocks, src, L, n_tiles, per_head, ut, sum, out, s)
                : launch<F, false>(blocks, src, L, n_tiles, per_head, ut, sum, out, s);
  });
}


// The host's side of one coded format: widths, offsets, codebooks, angles, and the tiles.
struct HostCoded {
  int stages, tile_bytes, norm_off;
  std::vector<int> off;
  std::vector<uint8_t> bits;
  std::vector<uint16_t> book;          // [2][stages][kLevels][kDh] BF16
  std::vector<float> theta;            // [kPairs]
  std::vector<uint16_t> ut;            // dense: U^T [kDh][kDh] BF16, U orthonormal
  std::vector<uint8_t> tiles;          // [n][tile_bytes]

  // Widths averaging about k_bits / v_bits per value over the stages (the first stage the larger
  // share), each channel's in 0 .. kMaxBits, some 0 (channels with no bits), seeded.
  HostCoded(int stages_, double k_bits, double v_bits, std::mt19937& g) : stages(stages_) {
    off.resize(size_t(2) * stages * kDh);
    bits.resize(off.size());
    int o = 0;
    for (int kv = 0; kv < 2; ++kv)
      for (int s = 0; s < stages; ++s) {
        const double mean = (kv ? v_bits : k_bits) * (stages == 1 ? 1.0 : s == 0 ? 0.7 : 0.3);
        for (int c = 0; c < kDh; ++c) {  // descending with the channel (variance order), 0 .. kMaxBits
          const double w = mean * 2.0 * (1.0 - double(c) / kDh) + std::uniform_real_distribution<double>(-0.5, 0.5)(g);
          const int b = std::clamp(int(std::lround(w)), 0, kMaxBits);
          bits[size_t((kv * stages + s) * kDh + c)] = uint8_t(b);
          off[size_t((kv * stages + s) * kDh + c)] = o;
          o += 8 * b;
        }
      }
    norm_off = o;
    tile_bytes = (o + 2 * kTileKeys * 2 + 15) / 16 * 16;
    book.resize(size_t(2) * stages * kLevels * kDh);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (auto& v : book) v = tiermoe::f32_to_bf16(nd(g));
    theta.resize(kPairs);
    for (int i = 0; i < kPairs; ++i) theta[size_t(i)] = float(std::pow(1.0e4, -2.0 * i / kDh));
    // U: a random orthonormal basis (Gram-Schmidt on Gaussian rows), as BF16.
    std::vector<double> U(size_t(kDh) * kDh);
    for (auto& v : U) v = nd(g);
    for (int r = 0; r < kDh; ++r) {
      for (int q = 0; q < r; ++q) {
        double d = 0;
        for (int c = 0; c < kDh; ++c) d += U[size_t(r) * kDh + c] * U[size_t(q) * kDh + c];
        for (int c = 0; c < kDh; ++c) U[size_t(r) * kDh + c] -= d * U[size_t(q) * kDh + c];
      }
      double n = 0;
      for (int c = 0; c < kDh; ++c) n += U[size_t(r) * kDh + c] * U[size_t(r) * kDh + c];
      for (int c = 0; c < kDh; ++c) U[size_t(r) * kDh + c] /= std::sqrt(n);
    }
    ut.resize(size_t(kDh) * kDh);
    for (int d = 0; d < kDh; ++d)
      for (int r = 0; r < kDh; ++r) ut[size_t(d) * kDh + r] = tiermoe::f32_to_bf16(float(U[size_t(r) * kDh + d]));
  }
  void fill_tiles(size_t n, std::mt19937& g) {
    tiles.assign(n * tile_bytes, 0);
    std::uniform_int_distribution<int> byte(0, 255);
    std::uniform_real_distribution<float> nrm(0.25f, 2.f);
    for (size_t t = 0; t < n; ++t) {
      uint8_t* p = tiles.data() + t * tile_bytes;
      for (int o = 0; o < norm_off; ++o) p[o] = uint8_t(byte(g));  // any code is a valid level
      for (int k = 0; k < 2 * kTileKeys; ++k) {
        const uint16_t b = tiermoe::f32_to_bf16(nrm(g));
        std::memcpy(p + norm_off + 2 * k, &b, 2);
      }
    }
  }
  // Token j's code of channel c, stage s, K (kv 0) or V in the tile at p.
  uint32_t code(const uint8_t* p, int kv, int s, int c, int j) const {
    const int idx = (kv * stages + s) * kDh + c, b = bits[size_t(idx)];
    uint32_t v = 0;
    for (int k = 0; k < b; ++k) {
      const int bit = off[size_t(idx)] * 8 + j * b + k;
      v |= uint32_t((p[bit >> 3] >> (bit & 7)) & 1) << k;
    }
    return v;
  }
  // The tile's decoded rows in double: out[2][64][kDh]; turn: keys turned by position p0 + j; dense:
  // keys unrotated by U (the BF16 U^T's values).
  void decode(const uint8_t* p, int p0, bool turn, bool dense, std::vector<double>& out) const {
    out.assign(size_t(2) * kTileKeys * kDh, 0.0);
    for (int kv = 0; kv < 2; ++kv)
      for (int j = 0; j < kTileKeys; ++j) {
        uint16_t nb;
        std::memcpy(&nb, p + norm_off + 2 * (kv * kTileKeys + j), 2);
        double y[kDh];
        for (int c = 0; c < kDh; ++c) {
          double v = 0;
          for (int s = 0; s < stages; ++s)
            v += tiermoe::bf16_to_f32(book[size_t(((kv * stages + s) * kLevels + code(p, kv, s, c, j)) * kDh + c)]);
          y[c] = v * tiermoe::bf16_to_f32(nb);
        }
        double* o = out.data() + (size_t(kv) * kTileKeys + j) * kDh;
        if (kv == 0 && turn) {
          for (int i = 0; i < kPairs; ++i) {
            const double a = double(p0 + j) * theta[size_t(i)], cs = std::cos(a), sn = std::sin(a);
            o[i] = y[i] * cs - y[i + kPairs] * sn;
            o[i + kPairs] = y[i + kPairs] * cs + y[i] * sn;
          }
        } else if (kv == 0 && dense) {
          // The device rounds y to BF16 before the product: so does this reference.
          for (int c = 0; c < kDh; ++c) y[c] = tiermoe::bf16_to_f32(tiermoe::f32_to_bf16(float(y[c])));
          for (int d = 0; d < kDh; ++d) {
            double x = 0;
            for (int r = 0; r < kDh; ++r) x += y[r] * tiermoe::bf16_to_f32(ut[size_t(d) * kDh + r]);
            o[d] = x;
          }
        } else {
          std::copy(y, y + kDh, o);
        }
      }
  }
};

// A nibbles tile's decoded rows in double, in the stage's permuted columns: out[2][64][kDh], column
// 2 i channel i, 2 i + 1 channel i + 64 (keys turned by position p0 + j); levels from h's stage 0.
void decode_nibbles_host(const HostCoded& h, const uint8_t* p, int p0, std::vector<double>& out) {
  out.assign(size_t(2) * kTileKeys * kDh, 0.0);
  for (int kv = 0; kv < 2; ++kv)
    for (int j = 0; j < kTileKeys; ++j) {
      uint16_t nb;
      std::memcpy(&nb, p + kNibNormOff + 2 * (kv * kTileKeys + j), 2);
      for (int i = 0; i < kPairs; ++i) {
        const uint8_t byte = p[kv * kNibCodeBytes + ((j / 16) * kPairs + i) * 16 + j % 16];
        double y[2];
        for (int c = 0; c < 2; ++c)
          y[c] = tiermoe::bf16_to_f32(h.book[size_t((kv * h.stages * kLevels + (c ? byte >> 4 : byte & 15)) * kDh + i + kPairs * c)]) *
                 tiermoe::bf16_to_f32(nb);
        double* o = out.data() + (size_t(kv) * kTileKeys + j) * kDh + 2 * i;
        if (kv == 0) {
          const double a = double(p0 + j) * h.theta[size_t(i)], cs = std::cos(a), sn = std::sin(a);
          o[0] = y[0] * cs - y[1] * sn, o[1] = y[1] * cs + y[0] * sn;
        } else {
          o[0] = y[0], o[1] = y[1];
        }
      }
    }
}

template <class T>
struct Dev {
  T* p = nullptr;
  ~Dev() { cudaFree(p); }
  cudaError_t up(const std::vector<T>& v) {
    if (cudaError_t e = cudaMalloc(&p, std::max<size_t>(v.size(), 1) * sizeof(T)); e != cudaSuccess) return e;
    return v.empty() ? cudaSuccess : cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
};

// Device copies of a HostCoded's tables (not its tiles).
struct DevCoded {
  Dev<int> off;
  Dev<uint8_t> bits;
  Dev<bf16> book;
  Dev<float2> angle0, step;
  Dev<bf16> ut;
  Dev<float> lut;
  CodedLayout L;
  cudaError_t up(const HostCoded& h, int positions) {
    std::vector<float2> a0(size_t((positions + 31) / 32) * kPairs), st(kPairs);
    for (size_t m = 0; m < a0.size() / kPairs; ++m)
      for (int i = 0; i < kPairs; ++i) {
        const double a = double(32 * m) * h.theta[size_t(i)];
        a0[m * kPairs + size_t(i)] = make_float2(float(std::cos(a)), float(std::sin(a)));
      }
    for (int i = 0; i < kPairs; ++i) st[size_t(i)] = make_float2(std::cos(h.theta[size_t(i)]), std::sin(h.theta[size_t(i)]));
    std::vector<bf16> ub(h.ut.size()), bb(h.book.size());
    std::memcpy(ub.data(), h.ut.data(), h.ut.size() * 2);
    std::memcpy(bb.data(), h.book.data(), h.book.size() * 2);
    cudaError_t e = off.up(h.off);
    if (e == cudaSuccess) e = bits.up(h.bits);
    if (e == cudaSuccess) e = book.up(bb);
    if (e == cudaSuccess) e = angle0.up(a0);
    if (e == cudaSuccess) e = step.up(st);
    if (e == cudaSuccess) e = ut.up(ub);
    std::vector<float> lf(size_t(2) * kLevels * kDh);  // stage 0's levels of K and V
    for (int kv = 0; kv < 2; ++kv)
      for (int l = 0; l < kLevels * kDh; ++l)
        lf[size_t(kv * kLevels * kDh + l)] = tiermoe::bf16_to_f32(h.book[size_t(kv * h.stages * kLevels * kDh + l)]);
    if (e == cudaSuccess) e = lut.up(lf);
    L = {h.stages, h.tile_bytes, h.norm_off, off.p, bits.p, book.p, angle0.p, step.p, lut.p};
    return e;
  }
};

// Forms with one stage of codes at most (the stages loop runs the others at 1 and 2).
bool one_stage(Form f) { return f == Form::bf16 || f == Form::fp8 || f == Form::nibbles; }

// h's tile size (and norms' offset) for form f, where f's tiles are not the allocated codes'.
void set_tile_layout(HostCoded& h, Form f) {
  if (f == Form::bf16) h.tile_bytes = 2 * kTileKeys * kDh * 2;
  if (f == Form::fp8) h.tile_bytes = kFp8TileBytes;
  if (f == Form::nibbles) h.norm_off = kNibNormOff, h.tile_bytes = kNibTileBytes;
}

const char* form_name(Form f) {
  return f == Form::bf16 ? "bf16" : f == Form::fp8 ? "fp8" : f == Form::pairs ? "pairs" : f == Form::dense ? "dense" : "nibbles";
}

// n FP8 tiles of random rows (fp8_quantize_rows: valid codes and exponents); want (optional): their
// values [n][2][64][kDh] as fp8_dequantize_rows gives them.
std::vector<uint8_t> fp8_tiles(size_t n, std::mt19937& g, std::vector<double>* want) {
  std::vector<uint8_t> tiles(n * kFp8TileBytes);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(size_t(2) * kTileKeys * kDh);
  std::vector<uint16_t> bits(x.size());
  if (want) want->resize(n * x.size());
  for (size_t t = 0; t < n; ++t) {
    for (auto& v : x) v = nd(g) * std::ldexp(1.f, int(g() % 9) - 4);
    uint8_t* p = tiles.data() + t * kFp8TileBytes;
    int8_t* e = reinterpret_cast<int8_t*>(p + x.size());
    tiermoe::fp8_quantize_rows(x.data(), 2 * kTileKeys, kDh, p, e);
    if (!want) continue;
    tiermoe::fp8_dequantize_rows(p, e, 2 * kTileKeys, kDh, bits.data());
    for (size_t i = 0; i < x.size(); ++i) (*want)[t * x.size() + i] = tiermoe::bf16_to_f32(bits[i]);
  }
  return tiles;
}

// Every form's stages for a small case against the host: worst |device - host| over max(|host|, 1),
// which BF16 rounding keeps near 2^-9 (and the turn's running angles near 1e-6).
int check_forms(int* failures) {
  std::mt19937 g(7);
  const int per_head = 3, heads = 2, n_tiles = 3, blocks = heads * per_head, positions = per_head * n_tiles * kTileKeys;
  const size_t n = size_t(blocks) * n_tiles, tile_values = size_t(2) * kTileKeys * kDh;
  for (int stages = 1; stages <= kMaxStages; ++stages)
    for (Form f : {Form::bf16, Form::fp8, Form::pairs, Form::dense, Form::nibbles}) {
      if (one_stage(f) && stages > 1) continue;
      HostCoded h(stages, 3.0, 2.0, g);
      set_tile_layout(h, f);
      std::vector<double> want_all;  // bf16, fp8: every tile's values, [n][2][64][kDh]
      if (f == Form::bf16) {
        std::normal_distribution<float> nd(0.f, 1.f);
        std::vector<uint16_t> bf(n * tile_values);
        for (auto& v : bf) v = tiermoe::f32_to_bf16(nd(g));
        h.tiles.resize(bf.size() * 2);
        std::memcpy(h.tiles.data(), bf.data(), h.tiles.size());
        for (uint16_t v : bf) want_all.push_back(tiermoe::bf16_to_f32(v));
      } else if (f == Form::fp8) {
        h.tiles = fp8_tiles(n, g, &want_all);
      } else {
        h.fill_tiles(n, g);
      }
      DevCoded d;
      Dev<uint8_t> src;
      Dev<uint4> dump;
      Dev<uint32_t> sum;
      LK(d.up(h, positions));
      LK(src.up(h.tiles));
      LK(sum.up(std::vector<uint32_t>(1, 0)));
      LK(cudaMalloc(&dump.p, n * tile_values * 2));
      LK(launch_form(f, true, blocks, src.p, d.L, n_tiles, per_head, d.ut.p, sum.p, dump.p, 0));
      LK(cudaDeviceSynchronize());
      std::vector<uint16_t> got(n * tile_values);
      LK(cudaMemcpy(got.data(), dump.p, got.size() * 2, cudaMemcpyDeviceToHost));
      double worst = 0;
      std::vector<double> want;
      for (int b = 0; b < blocks; ++b)
        for (int t = 0; t < n_tiles; ++t) {
          const size_t tile = size_t(b) * n_tiles + t;
          if (f == Form::nibbles)
            decode_nibbles_host(h, h.tiles.data() + tile * h.tile_bytes, (b % per_head) * n_tiles * kTileKeys + t * kTileKeys, want);
          else if (want_all.empty())
            h.decode(h.tiles.data() + tile * h.tile_bytes, (b % per_head) * n_tiles * kTileKeys + t * kTileKeys,
                     f == Form::pairs, f == Form::dense, want);
          else
            want.assign(want_all.begin() + long(tile * tile_values), want_all.begin() + long((tile + 1) * tile_values));
          for (size_t e = 0; e < tile_values; ++e)
            worst = std::max(worst, std::fabs(tiermoe::bf16_to_f32(got[tile * tile_values + e]) - want[e]) / std::max(std::fabs(want[e]), 1.0));
        }
      // bf16, fp8: bit for bit; coded: BF16 rounding (2^-9) and the turn's running angles; dense: the
      // product's FP32 sums of BF16 inputs, rounded to BF16.
      const bool ok = worst <= (f == Form::bf16 || f == Form::fp8 ? 0.0 : f == Form::dense ? 2e-2 : 8e-3);
      std::printf("%s codedtile check %s stages %d: worst %.2e\n", ok ? "ok  " : "FAIL", form_name(f), stages, worst);
      *failures += !ok;
    }
  return 0;
}

}  // namespace

// Timing: for each shape (KV heads, keys, and 256 keys a block as 4 splits per 1024 keys, or 1024 as
// the cap of a block per SM gives at 32k keys: the batch-1 decode's grids)
// and form, the loader kernel over copies of the tiles enough to leave L2 behind, median of 7
// rounds of 20 launches; JSON lines.
int coded_tile_main() {
  int failures = 0;
  if (check_forms(&failures)) return 1;
  struct Shape {
    const char* name;
    int heads, keys, n_tiles;  // n_tiles 64-key tiles a block: 4 as 4 splits per 1024 keys, 16 as the split cap at 32k
  };
  std::mt19937 g(11);
  cudaStream_t s;
  LK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  LK(cudaEventCreate(&e0));
  LK(cudaEventCreate(&e1));
  // K / V bits per value: `default`'s middle tier with rope_pairs keys at the bits that match its KL
  // (docs/kv_codecs.md: stage_bits [2.75, 1.25] keys, [1.25, 0.5] values), and one stage of each.
  for (const Shape& sh : {Shape{"qwen3-4096", 4, 4096, 4}, Shape{"olmoe-4096", 16, 4096, 4}, Shape{"qwen3-32768", 4, 32768, 4},
                          Shape{"olmoe-32768", 16, 32768, 4}, Shape{"qwen3-32768-1k", 4, 32768, 16},
                          Shape{"olmoe-32768-1k", 16, 32768, 16}})
    for (int stages = 1; stages <= kMaxStages; ++stages)
      for (Form f : {Form::bf16, Form::fp8, Form::pairs, Form::dense, Form::nibbles}) {
        if (one_stage(f) && stages > 1) continue;
        const int n_tiles = sh.n_tiles, per_head = sh.keys / (n_tiles * kTileKeys), blocks = sh.heads * per_head;
        HostCoded h(stages, 4.0, 1.75, g);
        set_tile_layout(h, f);
        const size_t set_bytes = size_t(blocks) * n_tiles * h.tile_bytes;
        const int copies = int(std::max<size_t>(1, (size_t(256) << 20) / set_bytes));
        if (f == Form::fp8) h.tiles = fp8_tiles(size_t(blocks) * n_tiles, g, nullptr);
        else h.fill_tiles(size_t(blocks) * n_tiles, g);  // bf16: any bytes are values to copy
        DevCoded d;
        Dev<uint8_t> src;
        Dev<uint32_t> sum;
        LK(d.up(h, sh.keys));
        LK(sum.up(std::vector<uint32_t>(1, 0)));
        LK(cudaMalloc(&src.p, set_bytes * copies));
        for (int c = 0; c < copies; ++c) LK(cudaMemcpy(src.p + set_bytes * c, h.tiles.data(), set_bytes, cudaMemcpyHostToDevice));
        // 20 launches over the copies in turn, captured once: replays time the kernels, not the host.
        LK(launch_form(f, false, blocks, src.p, d.L, n_tiles, per_head, d.ut.p, sum.p, nullptr, s));  // the attribute set
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        LK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < 20; ++i)
          LK(launch_form(f, false, blocks, src.p + set_bytes * (i % copies), d.L, n_tiles, per_head, d.ut.p, sum.p, nullptr, s));
        LK(cudaStreamEndCapture(s, &graph));
        LK(cudaGraphInstantiate(&exec, graph, 0));
        std::vector<float> per_launch;
        for (int round = 0; round < 8; ++round) {
          LK(cudaEventRecord(e0, s));
          LK(cudaGraphLaunch(exec, s));
          LK(cudaEventRecord(e1, s));
          LK(cudaEventSynchronize(e1));
          float ms = 0;
          LK(cudaEventElapsedTime(&ms, e0, e1));
          if (round > 0) per_launch.push_back(ms * 1000.f / 20.f);  // round 0: warm-up
        }
        LK(cudaGraphExecDestroy(exec));
        LK(cudaGraphDestroy(graph));
        std::sort(per_launch.begin(), per_launch.end());
        const float us = per_launch[per_launch.size() / 2];
        std::printf("{\"probe\": \"codedtile\", \"shape\": \"%s\", \"form\": \"%s\", \"stages\": %d, \"blocks\": %d, \"keys_per_block\": %d, "
                    "\"blocks_per_sm\": %d, \"tile_bytes\": %d, \"us_per_launch\": %.2f, \"bytes_gb_per_s\": %.0f, "
                    "\"keys_per_us_per_head\": %.0f}\n",
                    sh.name, form_name(f), f == Form::bf16 || f == Form::fp8 ? 0 : stages, blocks, n_tiles * kTileKeys,
                    blocks_per_sm(f, h.tile_bytes), h.tile_bytes, us, double(set_bytes) / us / 1e3, double(sh.keys) / us);
      }
  std::printf("codedtile: %d check failures\n", failures);
  return failures ? 1 : 0;
}
