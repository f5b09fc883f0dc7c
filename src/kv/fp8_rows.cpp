#include "kv/fp8_rows.h"

#include <cmath>

#include "core/dtype.h"
#include "kv/kv_codec.h"

namespace tiermoe {

void fp8_quantize_rows(const float* x, size_t n, int Dh, uint8_t* codes, int8_t* exps) {
  for (size_t r = 0; r < n; ++r) {
    const float* row = x + r * Dh;
    float amax = 0.f;
    for (int i = 0; i < Dh; ++i) amax = std::fmax(amax, std::fabs(row[i]));
    const int e = fp8_row_exponent(amax);
    const float inv = fp8_exp2(-e);
    exps[r] = int8_t(e);
    for (int i = 0; i < Dh; ++i) codes[r * Dh + i] = f32_to_fp8_e4m3(row[i] * inv);
  }
}

void fp8_dequantize_rows(const uint8_t* codes, const int8_t* exps, size_t n, int Dh, uint16_t* bf16_out) {
  for (size_t r = 0; r < n; ++r) {
    const float s = fp8_exp2(exps[r]);
    for (int i = 0; i < Dh; ++i) bf16_out[r * Dh + i] = f32_to_bf16(fp8_e4m3_to_f32(codes[r * Dh + i]) * s);
  }
}

}  // namespace tiermoe
