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

// A count another block publishes (publish_count), read with acquire: what follows sees its writes.
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// One thread: spins until *count >= need.
__device__ __forceinline__ void spin_until(const unsigned* count, unsigned need) {
  while (ld_acquire(count) < need) {
  }
}
// One thread, once its block's writes are done (after a barrier): makes them visible, then counts the
// block in.
__device__ __forceinline__ void publish_count(unsigned* count) {
  __threadfence();
  atomicAdd(count, 1u);
}

// Blocks of kProbeThreads threads: every block sums all of x[n] (through L2) and writes its slice of
// y = x / 2 + sum * 1e-6. kThreads, sync: the block's threads that take part (the first ones) and
// their barrier, for a block that has others. The loops stride by the constant kThreads: strided by
// blockDim.x, a thread's loads of x went one after another, about 1.2 us per step (docs/benchmarks.md,
// "What one dependency costs").
constexpr int kProbeThreads = 256;
struct BlockSync {
  __device__ void operator()() const { __syncthreads(); }
};
template <int kThreads = kProbeThreads, class Sync = BlockSync>
__device__ inline void probe_step(float* y, const float* x, int n, Sync sync = {}) {
  __shared__ float red[kThreads / 32];
  float s = 0.f;
  for (int i = threadIdx.x; i < n; i += kThreads) s += __ldcg(x + i);
  s = warp_sum(s);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = s;
  sync();
  float total = 0.f;
  for (int w = 0; w < kThreads / 32; ++w) total += red[w];
  for (int i = blockIdx.x * kThreads + threadIdx.x; i < n; i += gridDim.x * kThreads)
    y[i] = __ldcg(x + i) * 0.5f + total * 1e-6f;
  sync();  // red[] is reused by the next step
}

}  // namespace tiermoe::cuda
