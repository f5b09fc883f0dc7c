// `tiermoe_cuda_check l2keep`: can the next layer's q/k/v weights be requested into L2 while a
// decode layer's small kernels (q/k norm + RoPE, attention) leave HBM idle, and still be there
// when that layer's gemv3 reads them -- after the MoE has streamed ~100 MB through L2?
// Each layer of a synthetic batch-1 step, captured as a CUDA graph with programmatic launch:
//   gemv3 (q/k/v) -> small -> small -> gemv (o) -> gemv (expert gate/up bytes) -> gemv (down bytes)
// every layer with its own weights (2 GB in all: nothing stays in L2 by accident). Variants of
// the first small kernel:
//   base         nothing more
//   normal       prefetch.global.L2 of the next layer's q/k/v lines
//   last         prefetch.global.L2::evict_last
//   last+aside   the same with the persisting set-aside of L2 at its maximum
//   last+aside+demote   and the lines of this layer's q/k/v (read by now) put back to
//                evict_normal first (applypriority), so the set-aside holds one layer at a time
//   no-qkv       base without the gemv3 launches (what the q/k/v projection costs in the chain)
// us per layer = replay time / layers, medians of replays. Output bits are compared with base's.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/dependent_launch.cuh"
#include "cuda/device_math.cuh"
#include "cuda/kernels.h"

namespace {
namespace cu = tiermoe::cuda;
using bf16 = cu::bf16;

constexpr int kThreads = 256, kLayers = 16, kSeg = 3;

struct Lines {  // up to kSeg weight ranges, as 128-byte lines
  const char* p[kSeg];
  size_t lines[kSeg];
};

enum Mode : int { kNone = 0, kNormal = 1, kLast = 2, kLastDemote = 3 };

__global__ void __launch_bounds__(kThreads) small_kernel(float* y, const float* x, int n, Lines next, Lines done,
                                                        int mode) {
  cu::pdl_wait();
  cu::pdl_launch_dependents();
  // The step's own work: every block reads x (through L2), writes its slice of y.
  __shared__ float red[kThreads / 32];
  float s = 0.f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += __ldcg(x + i);
  s = cu::warp_sum(s);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = s;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < kThreads / 32; ++w) total += red[w];
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x, nt = size_t(gridDim.x) * blockDim.x;
  for (size_t i = tid; i < size_t(n); i += nt) y[i] = __ldcg(x + i) * 0.5f + total * 1e-6f;
  if (mode == kNone) return;
  if (mode == kLastDemote)
    for (int g = 0; g < kSeg; ++g)
      for (size_t i = tid; i < done.lines[g]; i += nt)
        asm volatile("applypriority.global.L2::evict_normal [%0], 128;" ::"l"(done.p[g] + 128 * i) : "memory");
  for (int g = 0; g < kSeg; ++g)
    for (size_t i = tid; i < next.lines[g]; i += nt) {
      const char* a = next.p[g] + 128 * i;
      if (mode == kNormal) asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
      else asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(a));
    }
}

__global__ void fill_kernel(bf16* w, size_t n, unsigned seed) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned h = unsigned(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    w[i] = __bfloat16_as_ushort(__float2bfloat16(float(int(h & 1023) - 512) * (1.f / 16384.f)));
  }
}

#define LK(x)                                                                                  \
  do {                                                                                         \
    const cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      return 1;                                                                                \
    }                                                                                          \
  } while (0)

struct Shape {
  const char* name;
  int D, Nq, Nkv, gate_up_rows, down_rows, down_K;
};

struct LayerWeights {
  bf16 *q, *k, *v, *o, *gu, *down;
};

int run_shape(const Shape& sh, cudaStream_t s, bool* first_row) {
  const int sms = cu::sm_count();
  std::vector<LayerWeights> L(kLayers + 1);  // +1: the prefetch target after the last layer
  auto alloc = [&](bf16** p, size_t n, unsigned seed) -> cudaError_t {
    cudaError_t e = cudaMalloc(p, n * sizeof(bf16));
    if (e == cudaSuccess) fill_kernel<<<4 * sms, 256, 0, s>>>(*p, n, seed);
    return e;
  };
  for (int l = 0; l <= kLayers; ++l) {
    LK(alloc(&L[l].q, size_t(sh.Nq) * sh.D, 11 * l + 1));
    LK(alloc(&L[l].k, size_t(sh.Nkv) * sh.D, 11 * l + 2));
    LK(alloc(&L[l].v, size_t(sh.Nkv) * sh.D, 11 * l + 3));
    LK(alloc(&L[l].o, size_t(sh.D) * sh.Nq, 11 * l + 4));
    LK(alloc(&L[l].gu, size_t(sh.gate_up_rows) * sh.D, 11 * l + 5));
    LK(alloc(&L[l].down, size_t(sh.down_rows) * sh.down_K, 11 * l + 6));
  }
  const int vec = std::max({sh.D, sh.Nq, sh.gate_up_rows, sh.down_rows, sh.down_K});
  float *x, *qo, *ko, *vo, *a, *b, *h, *gu;
  for (float** p : {&x, &qo, &ko, &vo, &a, &b, &h, &gu}) {
    LK(cudaMalloc(p, vec * sizeof(float)));
    LK(cudaMemsetAsync(*p, 0, vec * sizeof(float), s));
  }
  std::vector<float> init(vec);
  for (int i = 0; i < vec; ++i) init[i] = float(i % 89) * 0.01f - 0.4f;
  LK(cudaMemcpy(x, init.data(), vec * sizeof(float), cudaMemcpyHostToDevice));
  LK(cudaStreamSynchronize(s));
  auto lines = [&](int l) {
    Lines r{};
    if (l > kLayers) return r;
    r.p[0] = reinterpret_cast<const char*>(L[l].q);
    r.p[1] = reinterpret_cast<const char*>(L[l].k);
    r.p[2] = reinterpret_cast<const char*>(L[l].v);
    r.lines[0] = size_t(sh.Nq) * sh.D * sizeof(bf16) / 128;
    r.lines[1] = r.lines[2] = size_t(sh.Nkv) * sh.D * sizeof(bf16) / 128;
    return r;
  };
  cudaDeviceProp prop{};
  LK(cudaGetDeviceProperties(&prop, 0));
  const size_t aside = std::min(size_t(prop.l2CacheSize) * 3 / 4, size_t(prop.persistingL2CacheMaxSize));
  const double qkv_mb = double(sh.Nq + 2 * sh.Nkv) * sh.D * 2 / 1e6;
  cudaEvent_t e0, e1;
  LK(cudaEventCreate(&e0));
  LK(cudaEventCreate(&e1));
  std::vector<float> reference;
  struct Variant {
    const char* name;
    int mode;
    bool aside, qkv;
  };
  for (const Variant var : {Variant{"base", kNone, false, true}, Variant{"normal", kNormal, false, true},
                            Variant{"last", kLast, false, true}, Variant{"last+aside", kLast, true, true},
                            Variant{"last+aside+demote", kLastDemote, true, true}, Variant{"no-qkv", kNone, false, false},
                            Variant{"base", kNone, false, true}}) {
    LK(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, var.aside ? aside : 0));
    LK(cudaCtxResetPersistingL2Cache());
    cu::set_programmatic_launch(true);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    LK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int l = 0; l < kLayers; ++l) {
      const LayerWeights& w = L[l];
      if (var.qkv) LK(cu::gemv3(qo, w.q, sh.Nq, ko, w.k, sh.Nkv, vo, w.v, sh.Nkv, x, 1, sh.D, s));
      LK(cu::launch(small_kernel, 2 * sms, kThreads, 0, s, a, qo, sh.D, lines(l + 1), lines(l), var.mode));
      LK(cu::launch(small_kernel, 2 * sms, kThreads, 0, s, b, a, sh.D, Lines{}, Lines{}, int(kNone)));
      LK(cu::gemv(h, b, w.o, 1, sh.D, sh.Nq, false, s));
      LK(cu::gemv(gu, h, w.gu, 1, sh.gate_up_rows, sh.D, false, s));
      LK(cu::gemv(x, gu, w.down, 1, sh.D, sh.down_rows * sh.down_K / sh.D, true, s));  // x += down . gu
    }
    LK(cudaStreamEndCapture(s, &graph));
    LK(cudaGraphInstantiate(&exec, graph, 0));
    for (int r = 0; r < 3; ++r) LK(cudaGraphLaunch(exec, s));
    std::vector<float> us;
    for (int r = 0; r < 15; ++r) {
      LK(cudaEventRecord(e0, s));
      LK(cudaGraphLaunch(exec, s));
      LK(cudaEventRecord(e1, s));
      LK(cudaEventSynchronize(e1));
      float ms = 0.f;
      LK(cudaEventElapsedTime(&ms, e0, e1));
      us.push_back(1000.f * ms / kLayers);
    }
    std::sort(us.begin(), us.end());
    std::vector<float> out(sh.D);
    LK(cudaMemcpy(out.data(), qo, sh.D * sizeof(float), cudaMemcpyDeviceToHost));
    const bool same = reference.empty() || !var.qkv || std::memcmp(out.data(), reference.data(), sh.D * sizeof(float)) == 0;
    if (reference.empty()) reference = out;
    std::printf("%s  {\"shape\": \"%s\", \"variant\": \"%s\", \"qkv_mb\": %.1f, \"aside_mb\": %.1f, \"us_per_layer_p50\": %.2f, "
                "\"min\": %.2f, \"max\": %.2f, \"qkv_bits_equal_to_base\": %s}",
                *first_row ? "" : ",\n", sh.name, var.name, qkv_mb, var.aside ? aside / 1e6 : 0.0, us[us.size() / 2],
                us.front(), us.back(), same ? "true" : "false");
    *first_row = false;
    std::fflush(stdout);
    LK(cudaGraphExecDestroy(exec));
    LK(cudaGraphDestroy(graph));
  }
  LK(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, 0));
  LK(cudaCtxResetPersistingL2Cache());
  cu::set_programmatic_launch(false);
  for (auto& w : L)
    for (bf16* p : {w.q, w.k, w.v, w.o, w.gu, w.down}) LK(cudaFree(p));
  for (float* p : {x, qo, ko, vo, a, b, h, gu}) LK(cudaFree(p));
  return 0;
}

}  // namespace

int l2_residency_main() {
  cudaStream_t s;
  LK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaDeviceProp prop{};
  LK(cudaGetDeviceProperties(&prop, 0));
  std::printf("{\"l2_mb\": %.1f, \"persisting_max_mb\": %.1f, \"layers\": %d, \"results\": [\n", prop.l2CacheSize / 1e6,
              prop.persistingL2CacheMaxSize / 1e6, kLayers);
  bool first_row = true;
  // OLMoE-1B-7B and Qwen3-30B-A3B layer shapes, top-8 experts' bytes.
  for (const Shape& sh : {Shape{"olmoe", 2048, 2048, 2048, 2 * 8 * 1024, 8 * 2048, 1024},
                          Shape{"qwen3", 2048, 4096, 512, 2 * 8 * 768, 8 * 2048, 768}})
    if (run_shape(sh, s, &first_row)) return 1;
  std::printf("\n]}\n");
  return 0;
}
