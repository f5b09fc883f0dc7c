// Causal grouped-query attention over contiguous K/V rows, FP32 math (softmax in FP32).
#pragma once
#include <cstdint>

#include "core/dtype.h"

namespace tiermoe {

// q[T, H, Dh]; k, v: [n_past + T, Hkv, Dh] in `kv_dtype` (F32 or BF16), where the T queries
// are the last T rows. Query t sees rows 0 .. n_past + t. out[T, H, Dh].
void attention_causal(float* out, const float* q, const void* k, const void* v, DType kv_dtype,
                      int T, int n_past, int H, int Hkv, int Dh);

}  // namespace tiermoe
