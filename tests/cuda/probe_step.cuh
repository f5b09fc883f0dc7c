// The small dependent step of the latency probes (sync_latency.cu, decode_chain.cu): what a decode
// layer's small kernels do between the weight-streaming ones, reduced to its data movement.
#pragma once
#include <cstdio>

#include "cuda/device_math.cuh"

// In a probe's int-returning host function: on a CUDA error, name the call and return 1.
#define LK(x)                                                                                  \
  do {                                                                                         \
    const cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      return 1;                                                                                \
    }                                                                                          \
  } while (0)

namespace tiermoe::cuda {

// Blocks of kProbeThreads threads: every block sums all of x[n] (through L2) and writes its slice of
// y = x / 2 + sum * 1e-6.
constexpr int kProbeThreads = 256;
__device__ inline void probe_step(float* y, const float* x, int n) {
  __shared__ float red[kProbeThreads / 32];
  float s = 0.f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += __ldcg(x + i);
  s = warp_sum(s);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = s;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < kProbeThreads / 32; ++w) total += red[w];
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    y[i] = __ldcg(x + i) * 0.5f + total * 1e-6f;
  __syncthreads();  // red[] is reused by the next step
}

}  // namespace tiermoe::cuda
