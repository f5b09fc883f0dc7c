// The synthetic decode chain (decode_chain.cu) as ONE persistent kernel, to measure what the
// launches cost against a design that never drains the GPU between steps. One block per SM, all
// resident (cooperative launch). A step's input is handed over through counters in global memory:
// each block counts itself done with a step (fence, atomicAdd), the next step's block spins on the
// count (ld.acquire) before reading the input through L2. The weights do not wait for the steps:
// warp 8, the producer, streams the block's share of every GEMV, step after step and layer after
// layer, into a ring of shared-memory slots as they free (one bulk copy, cp.async.bulk, per chunk
// of up to 16 row groups, an mbarrier per slot), so the next GEMV's weights (the next layer's q/k/v
// during this layer's experts, the o projection during the small steps) come in while a dependency
// resolves. Warps 0-7 take a chunk's groups in turn. The exception models routing: an expert
// step's weights are requested only once the o projection of its layer is done everywhere
// (`route_after`), as the experts' addresses come from the router. Forms measured and dropped
// (docs/benchmarks.md): warps streaming their own units by cp.async or into registers, smaller or
// larger slots, L2 prefetches past the ring, polled barriers, a copy per group, two issuing lanes.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

#include "cuda/device_math.cuh"
#include "cuda/kernels.h"
#include "cuda/probe_step.cuh"

namespace tiermoe::cuda::probe {

constexpr int kConsumers = 8, kPersistThreads = (kConsumers + 1) * 32;
static_assert((kConsumers & (kConsumers - 1)) == 0, "a chunk's groups are dealt to the consumer warps by a mask");
constexpr int kSlotBytes = 32768, kSlots = 6, kMaxK = 4096, kUnit = 2048;  // kUnit: weights per unit
constexpr size_t kPersistSmem = size_t(kSlots) * kSlotBytes + kMaxK * sizeof(float);
// What a run leaves out, to see where its time goes (the results are then wrong):
constexpr int kNoWaits = 1;    // no step waits for the one before it (nor the experts for routing)
constexpr int kNoCompute = 2;  // the ring is filled and emptied, nothing computed from it
// A form, not a knockout: a step's chunks dealt to the blocks in turn (chunk c to block c % B), so
// that at any moment the SMs read neighbouring chunks, as the launches' register rounds do (warp w
// of the stream kernels reads row w), instead of each SM its own contiguous share, 132 regions
// ~1 MB apart. On an H100 (2026-12-06) the ring alone streamed the same either way (~2.98 TB/s,
// its copy bandwidth): locality is not what holds it back; the whole chain ran 0.6-3.5% faster.
constexpr int kInterleave = 8;

// One step of the chain. A GEMV (W set): y[N] = W[N, K] x[K], K % 256 == 0, K <= 2048 or K == 4096.
// A small step (W null): every block reads all of x[N] and writes its slice of y (probe_step).
struct ChainStep {
  const bf16* W;
  const float* x;
  float* y;
  int N, K;
  int route_after;  // >= 0: this step's weights are requested once step route_after is done
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t* b, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* b, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, unsigned parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done)
                 : "r"(smem_addr(b)), "r"(parity)
                 : "memory");
}
// A bulk copy global -> shared memory completing on `bar`, its lines first to go from L2 (read once:
// 1% faster than without the policy).
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy)
      : "memory");
}
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kConsumers * 32) : "memory"); }
struct ConsumersSync {
  __device__ void operator()() const { consumers_sync(); }
};

// A GEMV step's share for block b of B: groups of R rows (K <= 2048: R = 2048 / K rows, one unit
// of at most 2048 weights; K = 4096: one row, 2 units), in chunks of per_chunk groups (what a slot
// holds, at most 16): chunk i of the block starts at group first(i) and holds count(i) groups, for
// i < chunks. Contiguous: groups [g0, g1) of W; interleaved (kInterleave): the step's chunks b,
// b + B, b + 2B, ...
struct Share {
  int R, units, group_elems, per_chunk, g0, g1, chunks, stride;
  __device__ Share(const ChainStep& s, int b, int B, bool interleave) {
    R = s.K <= kUnit ? kUnit / s.K : 1;
    units = s.K <= kUnit ? 1 : s.K / kUnit;
    group_elems = R * s.K;
    per_chunk = min(16, kSlotBytes / (2 * group_elems));
    const int groups = s.N / R;
    if (interleave) {
      const int all = (groups + per_chunk - 1) / per_chunk;
      g0 = b * per_chunk, g1 = groups, chunks = b < all ? (all - 1 - b) / B + 1 : 0, stride = B * per_chunk;
    } else {
      g0 = int(static_cast<long long>(groups) * b / B);
      g1 = int(static_cast<long long>(groups) * (b + 1) / B);
      chunks = (g1 - g0 + per_chunk - 1) / per_chunk, stride = per_chunk;
    }
  }
  __device__ int first(int i) const { return g0 + i * stride; }
  __device__ int count(int i) const { return min(per_chunk, g1 - first(i)); }
  __device__ int loads() const { return min(8, group_elems / 256); }  // 16-byte loads per lane per unit
};

// x[K] of a GEMV step as one lane multiplies it, for K <= 2048: the 8-float pieces of its loads j
// (kept in registers: read from shared memory per chunk they made the consumers 1.6x slower).
struct LaneX {
  float4 lo[8], hi[8];
  __device__ void load(const float* xs, int K, int lane) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int e = 256 * j, c = (e >= K ? e - K : e) + 8 * lane;
      if (c < K) lo[j] = *reinterpret_cast<const float4*>(xs + c), hi[j] = *reinterpret_cast<const float4*>(xs + c + 4);
    }
  }
};

// One unit of a group, its `loads` 16-byte pieces per lane in v, against x: the sums of the group's
// row 0 and row 1 (R = 2). K > 2048: x from shared memory at the unit's columns.
__device__ __forceinline__ void unit_dot(const uint4 (&v)[8], int loads, const LaneX& X, const float* xs_unit, int K,
                                         int lane, float& acc0, float& acc1) {
  if (K <= kUnit) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < loads) {
        const float d = dot8(v[j], X.lo[j], X.hi[j]);
        if (256 * j >= K) acc1 += d;
        else acc0 += d;
      }
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) acc0 += dot8(v[j], xs_unit + 256 * j + 8 * lane);
  }
}

__global__ void __launch_bounds__(kPersistThreads, 1)
    persistent_chain_kernel(const ChainStep* __restrict__ steps, int n_steps, unsigned* done, int mode) {
  extern __shared__ __align__(128) unsigned char smem[];
  float* xs = reinterpret_cast<float*>(smem + size_t(kSlots) * kSlotBytes);
  __shared__ __align__(8) uint64_t full[kSlots], empty[kSlots];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, B = gridDim.x, b = blockIdx.x;
  if (threadIdx.x == 0) {
    for (int i = 0; i < kSlots; ++i) mbar_init(&full[i], 1), mbar_init(&empty[i], kConsumers);
    asm volatile("fence.mbarrier_init.release.cluster;\n fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();

  if (warp == kConsumers) {  // the producer: one lane requests every chunk in ring order
    if (lane != 0) return;
    unsigned n = 0;  // chunks requested so far
    for (int i = 0; i < n_steps; ++i) {
      const ChainStep s = steps[i];
      if (!s.W) continue;
      if (s.route_after >= 0 && !(mode & kNoWaits)) spin_until(done + s.route_after, unsigned(B));
      const Share sh(s, b, B, mode & kInterleave);
      for (int c = 0; c < sh.chunks; ++c, ++n) {
        const int slot = int(n % kSlots), use = int(n / kSlots);
        if (use > 0) mbar_wait(&empty[slot], (use - 1) & 1);
        const unsigned bytes = unsigned(sh.count(c) * sh.group_elems * 2);
        mbar_expect_tx(&full[slot], bytes);
        bulk_copy(smem + size_t(slot) * kSlotBytes, s.W + size_t(sh.first(c)) * sh.group_elems, bytes, &full[slot]);
      }
    }
    return;
  }

  // The consumers: warps 0-7, in step order. Every warp waits for every chunk and counts itself out
  // of its slot (the empty barrier's count is all of them: no warp may run a ring ahead), as soon as
  // its loads from the slot are in registers; group k of the share goes to warp k % kConsumers.
  unsigned n = 0;  // chunks consumed so far (the same count as the producer's)
  LaneX X;
  for (int i = 0; i < n_steps; ++i) {
    const ChainStep s = steps[i];
    if (i > 0 && !(mode & kNoWaits)) {
      if (threadIdx.x == 0) spin_until(done + i - 1, unsigned(B));
      consumers_sync();
    }
    const int t = threadIdx.x;
    if (!s.W) {  // a small step
      probe_step<kConsumers * 32>(s.y, s.x, s.N, ConsumersSync{});
    } else {
      for (int j = 4 * t; j < s.K; j += 4 * kConsumers * 32)
        *reinterpret_cast<float4*>(xs + j) = __ldcg(reinterpret_cast<const float4*>(s.x + j));
      consumers_sync();
      if (s.K <= kUnit) X.load(xs, s.K, lane);
      const Share sh(s, b, B, mode & kInterleave);
      const int loads = sh.loads();
      for (int c = 0, before = 0; c < sh.chunks; before += sh.count(c), ++c, ++n) {  // before: the step's groups so far
        const int slot = int(n % kSlots), first = sh.first(c), count = sh.count(c);
        mbar_wait(&full[slot], (n / kSlots) & 1);
        const uint4* chunk = reinterpret_cast<const uint4*>(smem + size_t(slot) * kSlotBytes);
        bool freed = false;
        for (int k = (warp - before) & (kConsumers - 1); k < count && !(mode & kNoCompute); k += kConsumers) {
          float acc0 = 0.f, acc1 = 0.f;
          for (int u = 0; u < sh.units; ++u) {
            uint4 v[8];
            const uint4* w = chunk + (size_t(k) * sh.group_elems + u * kUnit) / 8;
#pragma unroll
            for (int j = 0; j < 8; ++j)
              if (j < loads) v[j] = w[32 * j + lane];
            if (u + 1 == sh.units && k + kConsumers >= count) {  // this warp's last read of the slot
              __syncwarp();
              if (lane == 0) mbar_arrive(&empty[slot]);
              freed = true;
            }
            unit_dot(v, loads, X, xs + u * kUnit, s.K, lane, acc0, acc1);
          }
          acc0 = warp_sum(acc0);
          if (sh.R > 1) acc1 = warp_sum(acc1);
          if (lane == 0) {
            s.y[size_t(first + k) * sh.R] = acc0;
            if (sh.R > 1) s.y[size_t(first + k) * sh.R + 1] = acc1;
          }
        }
        if (!freed) {
          __syncwarp();
          if (lane == 0) mbar_arrive(&empty[slot]);
        }
      }
    }
    consumers_sync();  // every consumer's writes of this step are done (and xs is free)
    if (threadIdx.x == 0) publish_count(done + i);
  }
}

}  // namespace tiermoe::cuda::probe
