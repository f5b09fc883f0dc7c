// y[T, N] = x[T, K] @ W[N, K]^T with W in BF16, F16 or F32 (a PyTorch Linear weight) and
// x, y in FP32. Multi-threaded over N. Small T runs as a GEMV (memory-bound: each weight
// row is read once); larger T packs 16-row panels of W to FP32 and runs a 6x16 AVX2 kernel.
#pragma once
#include "core/dtype.h"

namespace tiermoe {

void matmul(float* y, const float* x, const void* w, DType w_dtype, int T, int N, int K);

// Same, y += instead of y =.
void matmul_add(float* y, const float* x, const void* w, DType w_dtype, int T, int N, int K);

}  // namespace tiermoe
