// `tiermoe_cuda_check chain`: a synthetic batch-1 decode step, to try GEMV designs on the chain of
// dependent launches a real step is, without a model. Each of 16 layers, captured as one CUDA
// graph with programmatic launch, every layer with its own weights (2 GB in all: nothing stays in
// L2 by accident):
//   q/k/v -> small -> small -> o -> expert gate/up bytes -> expert down bytes
// "small" stands for q/k norm + RoPE and attention at a short context: every block reads the
// 8 KB vector before it (through L2) and writes its own. The GEMVs are, by variant:
//   current      today's kernels (gemv3, gemv: a warp per row or two, blocks of 8 warps, the first
//                round of loads before the wait, as many blocks as rows need)
//   stream xB    stream_gemv_kernel, B blocks per SM: each warp walks rows (gridDim.x * 8 apart),
//                the next row's loads in flight while the current one's dot product runs, x
//                staged once per block; with B = 1 a kernel holds about half of an SM's
//                registers, so the next kernel's blocks can be resident and load their first
//                rows while it runs.
//   persistent   the whole chain as one kernel (persistent_chain.cuh): a ring of weights in shared
//                memory fed by bulk copies across the steps, counters in L2 between the steps;
//                also timed with parts left out (no waits, no compute) to see where its time goes
// us per layer = replay time / layers, median of 15 replays. Before timing, every stream GEMV
// shape is checked against today's gemv (relative error, different summation order), and the
// persistent kernel's final x against the launches'.
// The run of this harness's first form (the next layer's q/k/v requested into L2 by the small
// kernels, commit 0277f97) is in docs/benchmarks.md.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "cuda/dependent_launch.cuh"
#include "cuda/device_math.cuh"
#include "cuda/gemv.cuh"
#include "cuda/kernels.h"
#include "cuda/probe_step.cuh"
#include "cuda/persistent_chain.cuh"

namespace {
namespace cu = tiermoe::cuda;
namespace probe = tiermoe::cuda::probe;
using bf16 = cu::bf16;

constexpr int kThreads = cu::kProbeThreads, kLayers = 16;

__global__ void __launch_bounds__(kThreads) small_kernel(float* y, const float* x, int n) {
  cu::pdl_wait();
  cu::pdl_launch_dependents();
  cu::probe_step(y, x, n);
}

// y[N] = W[N, K] x[K] for one token. A warp's work is a run of units of L 16-byte loads per lane
// (256 L weights): P = K / (256 L) units per row, its rows gridDim.x * 8 apart. Unit u + 1's loads
// are issued before unit u's dot product (two register buffers); the first unit's before the wait.
template <int L>
__global__ void __launch_bounds__(kThreads) stream_gemv_kernel(float* __restrict__ y, const float* __restrict__ x,
                                                              const bf16* __restrict__ W, int N, int K) {
  extern __shared__ float4 xs4[];  // x, K floats
  const float* xs = reinterpret_cast<const float*>(xs4);
  const int lane = threadIdx.x & 31, P = K / (256 * L), stride = gridDim.x * (kThreads / 32);
  const int row0 = blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5);
  const int units = row0 < N ? ((N - 1 - row0) / stride + 1) * P : 0;
  auto row_of = [&](int u) { return row0 + (u / P) * stride; };
  auto load = [&](uint4(&v)[L], int u) {
    const bf16* p = W + size_t(row_of(u)) * K + size_t(u % P) * 256 * L + 8 * lane;
#pragma unroll
    for (int j = 0; j < L; ++j) v[j] = cu::ldg16(p + 256 * j);
  };
  auto dot = [&](const uint4(&v)[L], int u) {
    const float* xp = xs + (u % P) * 256 * L + 8 * lane;
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < L; ++j) s += cu::dot8(v[j], xp + 256 * j);
    return s;
  };
  uint4 a[L], b[L];
  if (units > 0) load(a, 0);
  cu::pdl_wait();
  cu::pdl_launch_dependents();
  for (int i = threadIdx.x; i < K / 4; i += kThreads) xs4[i] = reinterpret_cast<const float4*>(x)[i];
  __syncthreads();
  float s = 0.f;
  auto finish = [&](int u) {  // after unit u's dot product: the row's sum, if u was its last unit
    if ((u + 1) % P) return;
    s = cu::warp_sum(s);
    if (lane == 0) y[row_of(u)] = s;
    s = 0.f;
  };
  cu::stream_units(a, b, units, load, [&](const uint4(&v)[L], int u) {
    s += dot(v, u);
    finish(u);
  });
}

// L for a K: 16-byte loads per lane per unit (8 = a 2048-wide row; shorter rows whole).
int stream_loads(int K) { return K <= 2048 ? K / 256 : 8; }
bool stream_fits(int K) { return K % 256 == 0 && (K <= 2048 || K % 2048 == 0) && K <= 8192; }

cudaError_t stream_gemv(float* y, const float* x, const bf16* W, int N, int K, int blocks_per_sm, cudaStream_t s) {
  if (!stream_fits(K)) return cudaErrorInvalidValue;
  const unsigned grid = unsigned(blocks_per_sm * cu::sm_count());
  const size_t smem = size_t(K) * sizeof(float);
  switch (stream_loads(K)) {
    case 3: return cu::launch(stream_gemv_kernel<3>, grid, kThreads, smem, s, y, x, W, N, K);
    case 4: return cu::launch(stream_gemv_kernel<4>, grid, kThreads, smem, s, y, x, W, N, K);
    case 8: return cu::launch(stream_gemv_kernel<8>, grid, kThreads, smem, s, y, x, W, N, K);
    default: return cudaErrorInvalidValue;
  }
}

__global__ void fill_kernel(bf16* w, size_t n, unsigned seed) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned h = unsigned(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    w[i] = __bfloat16_as_ushort(__float2bfloat16(float(int(h & 1023) - 512) * (1.f / 16384.f)));
  }
}


struct Shape {
  const char* name;
  int D, Nq, Nkv, gate_up_rows, down_rows, down_K;  // down: the top-k experts' rows, as one matrix
};

struct LayerWeights {
  bf16 *qkv, *o, *gu, *down;  // qkv: q, k, v rows back to back
};

// max |a - b| / max |b|
double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, double(std::fabs(a[i] - b[i])));
    den = std::max(den, double(std::fabs(b[i])));
  }
  return den > 0 ? num / den : num;
}

int run_shape(const Shape& sh, cudaStream_t s, bool* first_row, int* failures) {
  const int sms = cu::sm_count(), Nqkv = sh.Nq + 2 * sh.Nkv;
  std::vector<LayerWeights> L(kLayers);
  auto alloc = [&](bf16** p, size_t n, unsigned seed) -> cudaError_t {
    cudaError_t e = cudaMalloc(p, n * sizeof(bf16));
    if (e == cudaSuccess) fill_kernel<<<4 * sms, 256, 0, s>>>(*p, n, seed);
    return e;
  };
  for (int l = 0; l < kLayers; ++l) {
    LK(alloc(&L[l].qkv, size_t(Nqkv) * sh.D, 11 * l + 1));
    LK(alloc(&L[l].o, size_t(sh.D) * sh.Nq, 11 * l + 4));
    LK(alloc(&L[l].gu, size_t(sh.gate_up_rows) * sh.D, 11 * l + 5));
    LK(alloc(&L[l].down, size_t(sh.down_rows) * sh.down_K, 11 * l + 6));
  }
  const int vec = std::max({sh.D, Nqkv, sh.gate_up_rows, sh.down_rows, sh.down_K});
  float *x, *qkv, *a, *b, *h, *gu, *dn, *ref;
  for (float** p : {&x, &qkv, &a, &b, &h, &gu, &dn, &ref}) {
    LK(cudaMalloc(p, vec * sizeof(float)));
    LK(cudaMemsetAsync(*p, 0, vec * sizeof(float), s));
  }
  std::vector<float> init(vec);
  for (int i = 0; i < vec; ++i) init[i] = float(i % 89) * 0.01f - 0.4f;
  LK(cudaMemcpy(x, init.data(), vec * sizeof(float), cudaMemcpyHostToDevice));
  LK(cudaMemcpy(h, init.data(), vec * sizeof(float), cudaMemcpyHostToDevice));
  LK(cudaMemcpy(gu, init.data(), vec * sizeof(float), cudaMemcpyHostToDevice));
  LK(cudaStreamSynchronize(s));
  const double mb = (double(Nqkv) * sh.D + double(sh.D) * sh.Nq + double(sh.gate_up_rows) * sh.D +
                     double(sh.down_rows) * sh.down_K) * 2 / 1e6;

  // Every stream GEMV of the chain against today's gemv, at 1, 2 and 3 blocks per SM.
  struct Gemv {
    const bf16* W;
    const float* in;
    int N, K;
  };
  for (const Gemv g : {Gemv{L[0].qkv, x, Nqkv, sh.D}, Gemv{L[0].o, x, sh.D, sh.Nq}, Gemv{L[0].gu, h, sh.gate_up_rows, sh.D},
                       Gemv{L[0].down, gu, sh.down_rows, sh.down_K}})
    for (const int bps : {1, 2, 3}) {
      cu::set_programmatic_launch(false);
      LK(cu::gemv(ref, g.in, g.W, 1, g.N, g.K, false, s));
      LK(stream_gemv(dn, g.in, g.W, g.N, g.K, bps, s));
      LK(cudaStreamSynchronize(s));
      std::vector<float> want(g.N), got(g.N);
      LK(cudaMemcpy(want.data(), ref, g.N * sizeof(float), cudaMemcpyDeviceToHost));
      LK(cudaMemcpy(got.data(), dn, g.N * sizeof(float), cudaMemcpyDeviceToHost));
      const double err = rel_err(got, want);
      const bool ok = err < 1e-5;
      *failures += !ok;
      std::fprintf(stderr, "%s stream_gemv %s N %d K %d x%d: rel err %.2e\n", ok ? "ok" : "FAIL", sh.name, g.N, g.K,
                   bps, err);
    }

  // Which GEMVs of the chain are stream_gemv's (bits: 1 q/k/v, 2 o, 4 gate/up, 8 down), at how many
  // blocks per SM (bps); mask -1: the chain as one persistent kernel (persistent_chain.cuh), run
  // `mode` (probe::kNoWaits | probe::kNoCompute, | kNoRouting).
  constexpr int kNoRouting = 4;  // the expert steps' weights requested without waiting for the o projection
  struct Variant {
    int mask, bps, mode = 0;
  };
  auto capture = [&](const Variant var, cudaGraphExec_t* exec) -> int {
    cu::set_programmatic_launch(true);
    auto mv = [&](int bit, float* y, const float* in, const bf16* W, int N, int K) -> cudaError_t {
      return var.mask & bit ? stream_gemv(y, in, W, N, K, var.bps, s) : cu::gemv(y, in, W, 1, N, K, false, s);
    };
    cudaGraph_t graph;
    LK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int l = 0; l < kLayers; ++l) {
      const LayerWeights& w = L[l];
      if (!(var.mask & 1))
        LK(cu::gemv3(qkv, w.qkv, sh.Nq, qkv + sh.Nq, w.qkv + size_t(sh.Nq) * sh.D, sh.Nkv, qkv + sh.Nq + sh.Nkv,
                     w.qkv + size_t(sh.Nq + sh.Nkv) * sh.D, sh.Nkv, x, 1, sh.D, s));
      else LK(mv(1, qkv, x, w.qkv, Nqkv, sh.D));
      LK(cu::launch(small_kernel, 2 * sms, kThreads, 0, s, a, qkv, sh.Nq));
      LK(cu::launch(small_kernel, 2 * sms, kThreads, 0, s, b, a, sh.Nq));
      LK(mv(2, h, b, w.o, sh.D, sh.Nq));
      LK(mv(4, gu, h, w.gu, sh.gate_up_rows, sh.D));
      LK(mv(8, dn, gu, w.down, sh.down_rows, sh.down_K));
      LK(cu::launch(small_kernel, 2 * sms, kThreads, 0, s, x, dn, sh.D));  // the residual add's stand-in
    }
    LK(cudaStreamEndCapture(s, &graph));
    LK(cudaGraphInstantiate(exec, graph, 0));
    LK(cudaGraphDestroy(graph));
    return 0;
  };
  // The persistent kernel's steps: the same chain.
  auto persistent_steps = [&](bool route_wait) {
    std::vector<probe::ChainStep> st;
    for (int l = 0; l < kLayers; ++l) {
      const LayerWeights& w = L[l];
      const int o_step = route_wait ? 7 * l + 3 : -1;
      st.push_back({w.qkv, x, qkv, Nqkv, sh.D, -1});
      st.push_back({nullptr, qkv, a, sh.Nq, 0, -1});
      st.push_back({nullptr, a, b, sh.Nq, 0, -1});
      st.push_back({w.o, b, h, sh.D, sh.Nq, -1});
      st.push_back({w.gu, h, gu, sh.gate_up_rows, sh.D, o_step});
      st.push_back({w.down, gu, dn, sh.down_rows, sh.down_K, o_step});
      st.push_back({nullptr, dn, x, sh.D, 0, -1});
    }
    return st;
  };
  const int n_steps = 7 * kLayers;
  probe::ChainStep *steps_route, *steps_free;
  unsigned* done;
  LK(cudaMalloc(&steps_route, n_steps * sizeof(probe::ChainStep)));
  LK(cudaMalloc(&steps_free, n_steps * sizeof(probe::ChainStep)));
  LK(cudaMalloc(&done, n_steps * sizeof(unsigned)));
  LK(cudaMemcpy(steps_route, persistent_steps(true).data(), n_steps * sizeof(probe::ChainStep), cudaMemcpyHostToDevice));
  LK(cudaMemcpy(steps_free, persistent_steps(false).data(), n_steps * sizeof(probe::ChainStep), cudaMemcpyHostToDevice));
  LK(cudaFuncSetAttribute(probe::persistent_chain_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          int(probe::kPersistSmem)));
  auto persistent = [&](int mode) -> int {
    LK(cudaMemsetAsync(done, 0, n_steps * sizeof(unsigned), s));
    const probe::ChainStep* steps = mode & kNoRouting ? steps_free : steps_route;
    int n = n_steps, kernel_mode = mode & ~kNoRouting;
    void* args[] = {&steps, &n, &done, &kernel_mode};
    LK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(probe::persistent_chain_kernel), dim3(sms),
                                   dim3(probe::kPersistThreads), args, probe::kPersistSmem, s));
    return 0;
  };
  // Its final x against the launches' from the same start (the sums run in other orders).
  {
    cudaGraphExec_t exec;
    if (capture({0, 0}, &exec)) return 1;
    std::vector<float> want(sh.D), got(sh.D);
    LK(cudaMemcpy(x, init.data(), vec * sizeof(float), cudaMemcpyHostToDevice));
    LK(cudaGraphLaunch(exec, s));
    LK(cudaStreamSynchronize(s));
    LK(cudaMemcpy(want.data(), x, sh.D * sizeof(float), cudaMemcpyDeviceToHost));
    for (const int mode : {0, kNoRouting, probe::kInterleave}) {
      LK(cudaMemcpy(x, init.data(), vec * sizeof(float), cudaMemcpyHostToDevice));
      if (persistent(mode)) return 1;
      LK(cudaStreamSynchronize(s));
      LK(cudaMemcpy(got.data(), x, sh.D * sizeof(float), cudaMemcpyDeviceToHost));
      const double err = rel_err(got, want);
      const bool ok = err < 1e-4;
      *failures += !ok;
      std::fprintf(stderr, "%s persistent chain %s%s%s: final x rel err %.2e\n", ok ? "ok" : "FAIL", sh.name,
                   mode & kNoRouting ? " (no routing wait)" : "", mode & probe::kInterleave ? " (interleaved chunks)" : "", err);
    }
    LK(cudaGraphExecDestroy(exec));
  }

  cudaEvent_t e0, e1;
  LK(cudaEventCreate(&e0));
  LK(cudaEventCreate(&e1));
  const Variant variants[] = {{0, 0},  {-1, 0, 0},  {-1, 0, kNoRouting}, {-1, 0, probe::kNoWaits},
                              {-1, 0, probe::kNoCompute}, {-1, 0, probe::kNoWaits | probe::kNoCompute}, {15, 2}, {15, 3},
                              {-1, 0, probe::kInterleave}, {-1, 0, probe::kInterleave | probe::kNoWaits | probe::kNoCompute}};
  for (int round = 0; round < 2; ++round)
  for (const Variant var : variants) {
    cudaGraphExec_t exec = nullptr;
    if (var.mask >= 0 && capture(var, &exec)) return 1;
    auto replay = [&]() -> int {
      if (exec) LK(cudaGraphLaunch(exec, s));
      else if (persistent(var.mode)) return 1;
      return 0;
    };
    for (int r = 0; r < 3; ++r)
      if (replay()) return 1;
    std::vector<float> us;
    for (int r = 0; r < 15; ++r) {
      LK(cudaEventRecord(e0, s));
      if (replay()) return 1;
      LK(cudaEventRecord(e1, s));
      LK(cudaEventSynchronize(e1));
      float ms = 0.f;
      LK(cudaEventElapsedTime(&ms, e0, e1));
      us.push_back(1000.f * ms / kLayers);
    }
    std::sort(us.begin(), us.end());
    char name[128];
    std::snprintf(name, sizeof name, "stream x%d for %s%s%s%s", var.bps, var.mask & 1 ? "qkv " : "", var.mask & 2 ? "o " : "",
                  var.mask & 4 ? "gate_up " : "", var.mask & 8 ? "down" : "");
    if (!var.mask) std::snprintf(name, sizeof name, "current");
    if (var.mask < 0)
      std::snprintf(name, sizeof name, "persistent%s%s%s%s", var.mode & probe::kInterleave ? ", interleaved chunks" : "",
                    var.mode & kNoRouting ? ", no routing wait" : "", var.mode & probe::kNoWaits ? ", no waits" : "",
                    var.mode & probe::kNoCompute ? ", no compute" : "");
    std::printf("%s  {\"shape\": \"%s\", \"variant\": \"%s\", \"weights_mb_per_layer\": %.1f, \"us_per_layer_p50\": %.2f, "
                "\"min\": %.2f, \"max\": %.2f}",
                *first_row ? "" : ",\n", sh.name, name, mb, us[us.size() / 2], us.front(), us.back());
    *first_row = false;
    std::fflush(stdout);
    if (exec) LK(cudaGraphExecDestroy(exec));
  }
  LK(cudaFree(steps_route));
  LK(cudaFree(steps_free));
  LK(cudaFree(done));
  cu::set_programmatic_launch(false);
  for (auto& w : L)
    for (bf16* p : {w.qkv, w.o, w.gu, w.down}) LK(cudaFree(p));
  for (float* p : {x, qkv, a, b, h, gu, dn, ref}) LK(cudaFree(p));
  return 0;
}

}  // namespace

int decode_chain_main() {
  cudaStream_t s;
  LK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::printf("{\"layers\": %d, \"results\": [\n", kLayers);
  bool first_row = true;
  int failures = 0;
  // OLMoE-1B-7B and Qwen3-30B-A3B layer shapes, the top-8 experts' bytes.
  for (const Shape& sh : {Shape{"olmoe", 2048, 2048, 2048, 2 * 8 * 1024, 8 * 2048, 1024},
                          Shape{"qwen3", 2048, 4096, 512, 2 * 8 * 768, 8 * 2048, 768}})
    if (run_shape(sh, s, &first_row, &failures)) return 1;
  std::printf("\n], \"stream_gemv_check_failures\": %d}\n", failures);
  return failures ? 1 : 0;
}
