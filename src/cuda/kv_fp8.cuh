// FP8 rows of the paged KV cache on the device (kernels.h KvFp8; the format: kv/fp8_rows.h):
// reading 8 values dequantized into the BF16 bits a BF16 page would hold there (exact), and writing
// one (row, KV head) by one warp. Twins: fp8_dequantize_rows / fp8_quantize_rows.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "cuda/device_math.cuh"
#include "kv/fp8_rows.h"

namespace tiermoe::cuda {

// 8 codes (one 8-byte word, first code lowest) as floats, unscaled. Exact (E4M3 -> half -> float).
__device__ __forceinline__ void fp8x8_to_float(uint2 codes, float* f) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t word = j < 2 ? codes.x : codes.y;
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t((word >> (16 * (j & 1))) & 0xffffu), __NV_E4M3);
    const float2 p = __half22float2(__half2(h));
    f[2 * j] = p.x, f[2 * j + 1] = p.y;
  }
}

// 8 codes times 2^e, as 8 BF16 values packed like a 16-byte load of a BF16 row. Exact: * 2^e and
// the BF16 rounding of a code times a power of two round nothing.
__device__ __forceinline__ uint4 fp8x8_to_bf16x8(uint2 codes, int e) {
  const float s = fp8_exp2(e);
  float f[8];
  fp8x8_to_float(codes, f);
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) w[j] = pack(__float2bfloat16_rn(f[2 * j] * s), __float2bfloat16_rn(f[2 * j + 1] * s));
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// One code times 2^e as a float.
__device__ __forceinline__ float fp8_to_float(uint8_t code, int e) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(code), __NV_E4M3))) * fp8_exp2(e);
}

// The 16 codes at value offset off (a multiple of 16) of an FP8 pool, and their row's exponent. From
// L2 (ld.global.cg), never L1: a kernel's early loads (before its programmatic wait) can bring in the
// line of a row the kernel before is still writing (an exponent line holds 128 / Hkv rows), and a
// read of that row after the wait must not hit the stale copy.
__device__ __forceinline__ uint4 load_fp8_codes16(const uint8_t* codes, size_t off) {
  return __ldcg(reinterpret_cast<const uint4*>(codes + off));
}
__device__ __forceinline__ int load_fp8_exp(const int8_t* exps, size_t off, int Dh) { return __ldcg(exps + off / Dh); }

// cp.async moves 16 bytes, not one: a row's exponent is fetched as the aligned 16-byte block that
// holds it (fp8_exp_block), and read there at fp8_exp_byte. A page's exponents start 16-byte aligned
// from the pool's base (64 Hkv bytes a page), so the byte follows from the row's place in its page.
__device__ __forceinline__ const int8_t* fp8_exp_block(const int8_t* e) {
  return e - (reinterpret_cast<uintptr_t>(e) & 15);
}
__device__ __forceinline__ int fp8_exp_byte(const int8_t* exps, int row_in_page, int Hkv, int kvh) {
  return int((reinterpret_cast<uintptr_t>(exps) + row_in_page * Hkv + kvh) & 15);
}

// Lane l's share of a row x[Dh]: r[i] = x[l + 32 i], 0 past Dh; the loads go out together.
template <int N>
__device__ __forceinline__ void load_row_lanes(const float* x, int Dh, float (&r)[N]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < N; ++i) r[i] = lane + 32 * i < Dh ? x[lane + 32 * i] : 0.f;
}

// One warp, each lane holding its share of a row (load_row_lanes): the row's codes[Dh] and *exp
// (fp8_quantize_rows of one row). All lanes.
template <int N>
__device__ __forceinline__ void quantize_fp8_row(const float (&r)[N], int Dh, uint8_t* codes, int8_t* exp) {
  const int lane = threadIdx.x & 31;
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) amax = fmaxf(amax, fabsf(r[i]));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const int e = fp8_row_exponent(amax);
  const float inv = fp8_exp2(-e);
#pragma unroll
  for (int i = 0; i < N; ++i)
    if (lane + 32 * i < Dh) codes[lane + 32 * i] = __nv_cvt_float_to_fp8(r[i] * inv, __NV_SATFINITE, __NV_E4M3);
  if (lane == 0) *exp = int8_t(e);
}

}  // namespace tiermoe::cuda
