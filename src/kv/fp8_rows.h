// FP8 rows, the KV format of `--kv fp8-all` on the CPU and the GPU: every (token, KV head) row of
// Dh values is stored as E4M3 codes [Dh] and one scale 2^e, e an int8. Why a power of two: a code
// times its scale is then exact in BF16 (E4M3's 3 mantissa bits fit BF16's 7, and e keeps it in
// range), so the CUDA kernels dequantize into the BF16 tiles their products already take, bit for
// bit the CPU twin's rows, and the format's only error is the E4M3 rounding (2^-4 relative at most).
// Why per row: a token's row is written once, on its own, as it is appended (no calibration, no
// page rewrite), and one outlier token or head cannot coarsen the others.
// Shared by host and device code: the exponent rule is integer arithmetic on amax's bits, the same
// on both; E4M3 rounding is round-to-nearest-even, saturating, on both (f32_to_fp8_e4m3 here,
// __nv_cvt_float_to_fp8 on the GPU).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TIERMOE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TIERMOE_HOST_DEVICE inline
#endif

namespace tiermoe {

constexpr int kFp8MinExp = -120, kFp8MaxExp = 118;  // 2^e, 2^-e and 2^(e + 8) stay normal floats

// The least e with amax <= 448 * 2^e (448 = 1.75 * 2^8, E4M3's largest value), clamped to
// [kFp8MinExp, kFp8MaxExp]: zero and subnormal rows take the least, non-finite ones the largest.
TIERMOE_HOST_DEVICE int fp8_row_exponent(float amax) {
  uint32_t b;
  std::memcpy(&b, &amax, 4);
  const int E = int((b >> 23) & 0xff);
  if (E == 0) return kFp8MinExp;
  if (E == 255) return kFp8MaxExp;
  // amax = 1.m * 2^(E - 127): within 448 * 2^e for e = E - 135 when 1.m <= 1.75, else one more.
  const int e = E - 135 + ((b & 0x7fffffu) > 0x600000u ? 1 : 0);
  return e < kFp8MinExp ? kFp8MinExp : (e > kFp8MaxExp ? kFp8MaxExp : e);
}

// 2^e as a float, for |e| <= 126.
TIERMOE_HOST_DEVICE float fp8_exp2(int e) {
  const uint32_t b = uint32_t(e + 127) << 23;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// The CPU twins. rows x[n, Dh] -> codes[n, Dh] and exps[n] (x / 2^e rounded to E4M3, e per row).
void fp8_quantize_rows(const float* x, size_t n, int Dh, uint8_t* codes, int8_t* exps);
// codes[n, Dh], exps[n] -> BF16 bits [n, Dh] (exact: code * 2^e).
void fp8_dequantize_rows(const uint8_t* codes, const int8_t* exps, size_t n, int Dh, uint16_t* bf16_out);

}  // namespace tiermoe
