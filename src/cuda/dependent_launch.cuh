// Programmatic dependent launch (Hopper): a kernel launched this way may start while the kernel
// before it in the stream is still running. Why: a decode layer is ~7 dependent kernels, and
// without it each one waits for the previous grid to drain before its blocks start; with it the
// next kernel's blocks start early, load their first weights (which no kernel writes) and wait at
// pdl_wait() for the previous kernel's results. Off unless set_programmatic_launch(true).
// Every kernel launched with launch() must call pdl_wait() before it reads or writes memory that
// another kernel of the stream touches, and calls pdl_launch_dependents() right after it: the
// next kernel then starts only once this one's predecessor is done, one kernel of look-ahead
// (not a pile of waiting grids all prefetching into L2 at once).
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

// Lets the stream's next kernel start (its blocks run up to their pdl_wait()).
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
// Waits until the previous kernel of the stream has finished and its writes are visible; returns
// at once for a kernel launched without the attribute.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

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
