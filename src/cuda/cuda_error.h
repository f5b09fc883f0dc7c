// CUDA_CK(expr): a failed CUDA runtime call ends in check_failed() with the call, the place and
// the runtime's message (core/check.h).
#pragma once
#include <cuda_runtime.h>

#include "core/check.h"

#define CUDA_CK(expr)                                                                                  \
  do {                                                                                                 \
    const cudaError_t err_ = (expr);                                                                   \
    if (err_ != cudaSuccess) ::tiermoe::check_failed(#expr, __FILE__, __LINE__, cudaGetErrorString(err_)); \
  } while (0)
