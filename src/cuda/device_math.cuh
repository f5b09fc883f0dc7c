// Small device helpers shared by the kernel files: BF16 unpacking, order-preserving float keys,
// 16-byte weight loads, warp reductions, SiLU; cp.async, ldmatrix and mma.sync m16n8k16 wrappers for the tensor-core kernels;
// paged KV row addressing.
#pragma once
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/kernels.h"

namespace tiermoe::cuda {

__device__ __forceinline__ float bf(uint16_t h) { return __uint_as_float(uint32_t(h) << 16); }

// The float as an unsigned integer of the same order (-inf lowest); -0 maps to +0's key, so that
// they tie as in the sort (and on the CPU). key_float inverts it (-0 comes back as +0).
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t bits = __float_as_uint(f) & 0x7fffffffu ? __float_as_uint(f) : 0u;
  return bits & 0x80000000u ? ~bits : bits | 0x80000000u;
}
__device__ __forceinline__ float key_float(uint32_t key) {
  return __uint_as_float(key & 0x80000000u ? key & 0x7fffffffu : ~key);
}
// A (logit, id) pair as one integer whose order is the argmax's: the larger logit, ties to the
// lower id; never 0, so that 0 can mean "none yet".
__device__ __forceinline__ unsigned long long argmax_key(float v, int id) {
  return (static_cast<unsigned long long>(order_key(v)) << 32) | ~static_cast<uint32_t>(id);
}

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

// 16 bytes of weights, read once: not kept in L1 (L1::no_allocate), which then holds what the
// kernel does reuse (moe_down's act rows, gate_up's h), and a 256-byte L2 fetch per miss.
__device__ __forceinline__ uint4 ldg16(const uint16_t* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// x as two BF16 parts, hi = bf16(x) and lo = bf16(x - hi): hi + lo carries x to about 2^-16
// relative, so BF16 tensor-core products of both parts sum to FP32-level results.
__device__ __forceinline__ void bf16_split(float x, __nv_bfloat16& hi, __nv_bfloat16& lo) {
  hi = __float2bfloat16_rn(x);
  lo = __float2bfloat16_rn(x - __bfloat162float(hi));
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

// Tensor-core building blocks (sm_80+), shared by attention_prefill.cu and moe_prefill.cu.
// 16 bytes global -> shared by cp.async (L2 only), or 16 zero bytes when !fill (rows past the end:
// zeros, never stale data or NaN, since 0 * NaN would poison a product).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool fill) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(gmem), "r"(fill ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Four 8x8 BF16 matrices from shared memory; lane i gives the address of row i % 8 of matrix i / 8.
// Without .trans lane l receives row l / 4, columns 2 (l % 4) .. +1 of each; with .trans, column
// l / 4, rows 2 (l % 4) .. +1.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const __nv_bfloat16* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const __nv_bfloat16* p) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// An 8x8 BF16 matrix held as one pair per lane (lane l: row l / 4, columns 2 (l % 4) .. +1, the
// mma accumulator's layout packed) -> its transpose in the same layout.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// d[16x8] += a[16x16] b[16x8], BF16 in, FP32 accumulate. Lane l holds: a {(r, c), (r + 8, c),
// (r, c + 8), (r + 8, c + 8)} as BF16 pairs, r = l / 4, c = 2 (l % 4); b {(c, n), (c + 8, n)}, n = l / 4;
// d {(r, c), (r, c + 1), (r + 8, c), (r + 8, c + 1)} with c = 2 (l % 4) as the column.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack(__nv_bfloat16 lo_half, __nv_bfloat16 hi_half) {
  return uint32_t(__bfloat16_as_ushort(lo_half)) | uint32_t(__bfloat16_as_ushort(hi_half)) << 16;
}

// Row pos of a paged KV cache (kernels.h, KvPages): its row index in the layer's pool.
__device__ __forceinline__ size_t kv_row(const int32_t* table, int pos) {
  return size_t(__ldg(table + pos / kKvPageRows)) * kKvPageRows + pos % kKvPageRows;
}

}  // namespace tiermoe::cuda
