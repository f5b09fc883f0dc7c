// Small device helpers shared by the kernel files: BF16 unpacking, 16-byte weight loads, warp
// reductions, SiLU.
#pragma once
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace tiermoe::cuda {

__device__ __forceinline__ float bf(uint16_t h) { return __uint_as_float(uint32_t(h) << 16); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// 8 BF16 packed in a uint4 -> dot with 8 floats (a: the first four, b: the last four).
__device__ __forceinline__ float dot8(const uint4& w, const float4& a, const float4& b) {
  float s = __uint_as_float(w.x << 16) * a.x;
  s = fmaf(__uint_as_float(w.x & 0xffff0000u), a.y, s);
  s = fmaf(__uint_as_float(w.y << 16), a.z, s);
  s = fmaf(__uint_as_float(w.y & 0xffff0000u), a.w, s);
  s = fmaf(__uint_as_float(w.z << 16), b.x, s);
  s = fmaf(__uint_as_float(w.z & 0xffff0000u), b.y, s);
  s = fmaf(__uint_as_float(w.w << 16), b.z, s);
  s = fmaf(__uint_as_float(w.w & 0xffff0000u), b.w, s);
  return s;
}
// The same with 8 consecutive floats of x (16-byte aligned).
__device__ __forceinline__ float dot8(const uint4& w, const float* x) {
  return dot8(w, *reinterpret_cast<const float4*>(x), *reinterpret_cast<const float4*>(x + 4));
}

__device__ __forceinline__ uint4 ldg16(const uint16_t* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// x as two BF16 parts, hi = bf16(x) and lo = bf16(x - hi): hi + lo carries x to about 2^-16
// relative, so BF16 tensor-core products of both parts sum to FP32-level results.
__device__ __forceinline__ void bf16_split(float x, __nv_bfloat16& hi, __nv_bfloat16& lo) {
  hi = __float2bfloat16_rn(x);
  lo = __float2bfloat16_rn(x - __bfloat162float(hi));
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

}  // namespace tiermoe::cuda
