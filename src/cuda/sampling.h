// Token sampling on the GPU, so that a decode step returns B token ids instead of B logits rows.
// The semantics are sample_token()'s (src/cpu/sampling.h, its CPU twin). Like kernels.h: raw
// DEVICE pointers, shapes as ints, a stream; no allocation, no host synchronization.
// Shape legend: B logits rows, V vocabulary.
#pragma once
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace tiermoe::cuda {

// One row's sampling, in device memory: SamplingParams without the seed, and the uniform the
// row's Sampler drew (Sampler::draw(); 0 and unused when greedy).
struct SampleRowDevice {
  float temperature;  // 0: greedy
  int top_k;          // 0: all tokens; 1: greedy
  float top_p;        // 1: no nucleus cut
  double u;           // [0, 1)
};

// How sample_tokens() takes a row (the host and the device decide alike): greedy rows (temperature
// 0 or top_k 1, or V = 1: cub leaves a one-element segment unwritten) take the argmax; select rows
// (0 < top_k <= kSampleSelectMax) a radix select of their top k, in their own block; the others
// (top_k 0 or larger) the segmented sort.
constexpr int kSampleSelectMax = 1024;
__host__ __device__ inline bool sample_argmax_row(const SampleRowDevice& r, int V) {
  return r.temperature == 0.f || r.top_k == 1 || V == 1;
}
__host__ __device__ inline bool sample_select_row(const SampleRowDevice& r, int V) {
  return !sample_argmax_row(r, V) && r.top_k > 0 && r.top_k <= kSampleSelectMax;
}
__host__ __device__ inline bool sample_sort_row(const SampleRowDevice& r, int V) {
  return !sample_argmax_row(r, V) && !sample_select_row(r, V);
}
// Whether any of rows[0, B) takes the sort: sample_tokens()'s `sort`.
inline bool sample_any_sort_row(const SampleRowDevice* rows, int B, int V) {
  for (int b = 0; b < B; ++b)
    if (sample_sort_row(rows[b], V)) return true;
  return false;
}

// Bytes of scratch sample_tokens() needs for B rows of V logits: the rows' sorted (logit, id)
// pairs and the sort's temporary storage, about 20 * B * V bytes. 0 when B * V is too large.
size_t sample_tokens_scratch_bytes(int B, int V);

// tokens[B] = sample_token(logits[b, V], rows[b]) for each row b.                twin: sample_token
// Greedy rows (temperature 0 or top_k 1): the argmax, ties to the lower index.
// Rows with 0 < top_k <= 1024 (select rows): a block finds the k-th largest logit by a
// radix select, keeps the logits above it plus the lowest-index ones equal to it (k in all, k =
// min(top_k, V)) and sorts those k in shared memory. Other rows (top_k 0 or > 1024): a stable
// segmented radix sort of (logit, id) pairs. Both give the same order: logit descending, ties
// to the lower index first, -0 == +0 as on the CPU. Then, in the same block per row: weights in
// double, the nucleus cut and the walk to u * total.
// Not bit-exact with the CPU: the device's exp() and the block's summation order differ from
// glibc's exp and a sequential sum by a few ulps, so a row whose u * total (or whose nucleus sum
// against top_p) lies within ~1e-15 relative of a boundary between two candidates may pick the
// neighbour. tests/cuda/check_sampling.cpp accepts another token only when it is what sample_token
// gives with u moved by 1e-9 (u * total within 1e-9 of total from the boundary) or with top_p
// moved to a neighbouring float (the nucleus cut; top_p is a float), and reports those rows apart.
// sort: whether any row is a sort row (sample_sort_row), as the caller knows from the params it
// copied to the device. false skips the sort's launches (about 30 us even with every segment
// empty); a sort row then gets token -1.
// cudaErrorInvalidValue: B or V < 1, a null pointer, or scratch_bytes too small.
cudaError_t sample_tokens(int32_t* tokens, const float* logits, const SampleRowDevice* rows, int B, int V, void* scratch,
                          size_t scratch_bytes, cudaStream_t s, bool sort = true);

// Greedy and select rows of V >= 8192 logits are first reduced by up to 64 blocks per row, each over
// a slice of at least 4096 logits. n caps the slices: 1 is one block per row, the single-stage
// form; out of range, the default. For A/B timing (TIERMOE_CUDA_SAMPLE_SLICES, read by the backend).
void set_sample_max_slices(int n);

}  // namespace tiermoe::cuda
