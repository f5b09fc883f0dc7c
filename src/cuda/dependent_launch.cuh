// Programmatic dependent launch (Hopper): a kernel launched this way may start while the kernel
// before it in the stream is still running. Why: a decode layer is ~7 dependent kernels, and
// without it each one waits for the previous grid to drain before its blocks start; with it the
// next kernel's blocks start early, load their first weights (which no kernel writes) and wait
// for the previous kernel's results. Off unless set_programmatic_launch(true).
// Every kernel launched with launch() must wait (pdl_start() or pdl_wait()) before it reads or
// writes memory that another kernel of the stream touches. pdl_start() lets the next kernel start
// before it waits itself, so a chain of grids can be resident and loading weights at once (-0.6%
// to -3.6% per token against waiting first, H200, docs/benchmarks.md "Deeper look-ahead"). What
// that asks of every kernel: before its wait it stores nothing to global memory and reads only
// what no kernel of the pass writes (weights, K/V rows of earlier passes, and the positions and
// page tables, which are in place before the first layer's q/k/v projection, a plain launch,
// starts), since any earlier kernel may still run. The one kernel that reads more is the expert
// down projection (the experts and residual of the o projection, two kernels back), so the gate/up
// kernels before it call pdl_wait() and then pdl_launch_dependents() (as do the grouped MoE
// kernels of decode batches).
#pragma once
#include <utility>

#include <cuda_runtime.h>

namespace tiermoe::cuda {

bool programmatic_launch();  // kernels.cu

// The device's multiprocessor count, for launch shapes that fill one wave (0 if unreadable).
inline int sm_count() {
  static const int n = [] {
    int dev = 0, v = 0;
    return cudaGetDevice(&dev) == cudaSuccess && cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess ? v : 0;
  }();
  return n;
}

// Lets the stream's next kernel start (its blocks run up to their wait).
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
// Waits until the previous kernel of the stream has finished and its writes are visible; returns
// at once for a kernel launched without the attribute.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
// The next kernel's start, then the wait (the header's rule).
__device__ __forceinline__ void pdl_start() {
  pdl_launch_dependents();
  pdl_wait();
}

// A launch of clusters of `cluster` blocks along x (gridDim.x a multiple of it), programmatic when on.
template <class... Params, class... Args>
cudaError_t launch_clusters(unsigned cluster, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                            cudaStream_t s, Args&&... args) {
  cudaLaunchAttribute attr[2]{};
  unsigned n = 0;
  if (programmatic_launch()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n++].val.clusterDim = {cluster, 1, 1};
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

template <class... Params, class... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, Args&&... args) {
  return launch_clusters(1, kernel, grid, block, smem, s, std::forward<Args>(args)...);
}

}  // namespace tiermoe::cuda
