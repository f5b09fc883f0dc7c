// Causal grouped-query attention over contiguous K/V rows, FP32 math (softmax in FP32).
#pragma once
#include <cstdint>

#include "core/dtype.h"

namespace tiermoe {

// q[T, H, Dh]; k, v: [n_past + T, Hkv, Dh] in `kv_dtype` (F32 or BF16), where the T queries
// are the last T rows. Query t sees rows 0 .. n_past + t. out[T, H, Dh].
void attention_causal(float* out, const float* q, const void* k, const void* v, DType kv_dtype,
                      int T, int n_past, int H, int Hkv, int Dh);

// The same over FP8 rows (kv/fp8_rows.h): codes [n_past + T, Hkv, Dh], exponents [n_past + T, Hkv].
// Bit for bit attention_causal over the BF16 rows they decode to (each row's 2^e multiplies the
// row's score and its softmax weight instead of its values: a power of two rounds nothing), without
// decoding them.
struct Fp8Rows {
  const uint8_t* codes;
  const int8_t* exps;
};
void attention_causal_fp8(float* out, const float* q, Fp8Rows k, Fp8Rows v, int T, int n_past, int H, int Hkv, int Dh);

}  // namespace tiermoe
