// For check_kv_fp8.cpp: kv_fp8.cuh's fp8x8_to_bf16x8 over rows of codes, so that its bits can be
// held against the CPU twin fp8_dequantize_rows (the attention kernels' checks have tolerances, and
// a code read wrong in a low bit, or a subnormal one, could hide inside them).
#include <cstdint>

#include <cuda_runtime.h>

#include "cuda/kv_fp8.cuh"

namespace tiermoe::cuda_check {

namespace {
// Thread i: codes 8 i .. 8 i + 7, of row i / per_row.
__global__ void fp8_dequantize_kernel(uint4* out, const uint2* codes, const int8_t* exps, int per_row, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = cuda::fp8x8_to_bf16x8(codes[i], exps[i / per_row]);
}
}  // namespace

// codes[rows, Dh] (device), exps[rows] (device) -> out[rows, Dh] BF16 bits (device); Dh a multiple of 8.
cudaError_t fp8_dequantize_on_device(uint16_t* out, const uint8_t* codes, const int8_t* exps, int rows, int Dh) {
  if (Dh % 8 != 0 || rows < 0) return cudaErrorInvalidValue;
  const int n = rows * (Dh / 8);
  if (n == 0) return cudaSuccess;
  fp8_dequantize_kernel<<<(n + 255) / 256, 256>>>(reinterpret_cast<uint4*>(out), reinterpret_cast<const uint2*>(codes),
                                                   exps, Dh / 8, n);
  return cudaGetLastError();
}

}  // namespace tiermoe::cuda_check
