// `tiermoe_cuda_check latency`: what one dependency between two steps of a decode layer costs on
// this GPU, by mechanism. A batch-1 layer is 7 dependent launches and the knockout timing puts
// about 4 us on each (docs/benchmarks.md); the plan (docs/cuda.md) asks whether hand-offs through
// counters in L2, or grid barriers inside one persistent kernel, would cost less. Each variant runs
// kSteps dependent steps (7 launches x 16 layers); every step reads the whole 8 KB vector the step
// before wrote (through L2, as a layer's small kernels read the last one's output) and writes its
// own. Variants:
//   plain    one launch per step, stream order (no programmatic launch)
//   pdl      one launch per step, programmatic dependent launch, griddepcontrol.wait
//   flag     one launch per step, programmatic launch, but each kernel spins on its predecessor's
//            count of finished blocks (ld.acquire) instead of griddepcontrol.wait
//   barrier  one kernel, a grid barrier (count + generation in L2) between steps
// Each captured as a CUDA graph and replayed; us per step = replay time / kSteps. The four must end
// with the same bits (a hand-off that let a step read stale data would not).
#include <cstdio>
#include <cstring>
#include <vector>

#include <cuda_runtime.h>

#include "cuda/dependent_launch.cuh"
#include "cuda/device_math.cuh"
#include "cuda/kernels.h"
#include "cuda/probe_step.cuh"

namespace {
namespace cu = tiermoe::cuda;

constexpr int kThreads = cu::kProbeThreads, kVec = 2048, kSteps = 112;

__device__ void step(float* y, const float* x) { cu::probe_step(y, x, kVec); }

__global__ void __launch_bounds__(kThreads) step_kernel(float* y, const float* x) {
  cu::pdl_wait();
  cu::pdl_launch_dependents();
  step(y, x);
}

// Waits for `need` blocks of the previous step to have counted themselves in prev, then lets the
// next kernel start (all of this one's blocks are resident by then: no deadlock with it), steps,
// and counts itself in own.
__global__ void __launch_bounds__(kThreads) flag_step_kernel(float* y, const float* x, const unsigned* prev,
                                                             unsigned* own, unsigned need) {
  if (threadIdx.x == 0) cu::spin_until(prev, need);
  __syncthreads();
  cu::pdl_launch_dependents();
  step(y, x);
  if (threadIdx.x == 0) cu::publish_count(own);
}

// bar[0]: arrivals, bar[1]: generation. All gridDim.x blocks must be resident.
__device__ void grid_barrier(unsigned* bar) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned gen = cu::ld_acquire(bar + 1);
    __threadfence();
    if (atomicAdd(bar, 1u) == gridDim.x - 1) {
      bar[0] = 0;
      __threadfence();
      atomicAdd(bar + 1, 1u);
    } else {
      while (cu::ld_acquire(bar + 1) == gen) {
      }
    }
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads) barrier_steps_kernel(float* buf, unsigned* bar, int steps) {
  for (int s = 0; s < steps; ++s) {
    step(buf + size_t((s + 1) % 2) * kVec, buf + size_t(s % 2) * kVec);
    if (s + 1 < steps) grid_barrier(bar);
  }
}


}  // namespace

int sync_latency_main() {
  const int sms = cu::sm_count();
  cudaStream_t s;
  LK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  float *buf, *init_d;
  unsigned* cnt;
  LK(cudaMalloc(&buf, 2 * kVec * sizeof(float)));
  LK(cudaMalloc(&init_d, kVec * sizeof(float)));
  LK(cudaMalloc(&cnt, (kSteps + 3) * sizeof(unsigned)));
  std::vector<float> init(kVec);
  for (int i = 0; i < kVec; ++i) init[i] = float(i % 97) * 0.01f;
  LK(cudaMemcpy(init_d, init.data(), kVec * sizeof(float), cudaMemcpyHostToDevice));
  cudaEvent_t e0, e1;
  LK(cudaEventCreate(&e0));
  LK(cudaEventCreate(&e1));
  std::printf("{\"steps\": %d, \"sms\": %d, \"results\": [\n", kSteps, sms);
  bool first_row = true;
  for (const int per_sm : {1, 2}) {
    const int G = sms * per_sm;
    std::vector<float> reference;
    for (const char* variant : {"plain", "pdl", "flag", "barrier"}) {
      const bool barrier = std::strcmp(variant, "barrier") == 0;
      cu::set_programmatic_launch(std::strcmp(variant, "plain") != 0);
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      LK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      // Each replay starts from the same vector and zero counts (a few us, against kSteps steps).
      LK(cudaMemcpyAsync(buf, init_d, kVec * sizeof(float), cudaMemcpyDeviceToDevice, s));
      LK(cudaMemsetAsync(cnt, 0, (kSteps + 3) * sizeof(unsigned), s));
      if (barrier) {
        barrier_steps_kernel<<<G, kThreads, 0, s>>>(buf, cnt + kSteps + 1, kSteps);
        LK(cudaGetLastError());
      } else {
        for (int i = 0; i < kSteps; ++i) {
          float* y = buf + size_t((i + 1) % 2) * kVec;
          const float* x = buf + size_t(i % 2) * kVec;
          if (std::strcmp(variant, "flag") == 0)
            LK(cu::launch(flag_step_kernel, G, kThreads, 0, s, y, x, cnt + i, cnt + i + 1, unsigned(i == 0 ? 0 : G)));
          else
            LK(cu::launch(step_kernel, G, kThreads, 0, s, y, x));
        }
      }
      LK(cudaStreamEndCapture(s, &graph));
      LK(cudaGraphInstantiate(&exec, graph, 0));
      for (int w = 0; w < 3; ++w) LK(cudaGraphLaunch(exec, s));
      constexpr int kReplays = 20;
      LK(cudaEventRecord(e0, s));
      for (int r = 0; r < kReplays; ++r) LK(cudaGraphLaunch(exec, s));
      LK(cudaEventRecord(e1, s));
      LK(cudaEventSynchronize(e1));
      float ms = 0.f;
      LK(cudaEventElapsedTime(&ms, e0, e1));
      std::vector<float> out(kVec);
      LK(cudaMemcpy(out.data(), buf + size_t(kSteps % 2) * kVec, kVec * sizeof(float), cudaMemcpyDeviceToHost));
      if (reference.empty()) reference = out;
      const bool same = std::memcmp(out.data(), reference.data(), kVec * sizeof(float)) == 0;
      std::printf("%s  {\"variant\": \"%s\", \"blocks\": %d, \"us_per_step\": %.3f, \"result_equal_to_plain\": %s}", first_row ? "" : ",\n",
                  variant, G, 1000.0 * ms / (kReplays * kSteps), same ? "true" : "false");
      first_row = false;
      LK(cudaGraphExecDestroy(exec));
      LK(cudaGraphDestroy(graph));
    }
  }
  std::printf("\n]}\n");
  cu::set_programmatic_launch(false);
  LK(cudaFree(buf));
  LK(cudaFree(init_d));
  LK(cudaFree(cnt));
  return 0;
}
