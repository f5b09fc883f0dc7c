// sample_tokens(): see sampling.h. Three launches, all stream-ordered: mark the rows to sort,
// cub's segmented radix sort of the sampled rows' (logit, id) pairs, then one block per row.
// Shape legend: B logits rows, V vocabulary.
#include "cuda/sampling.h"

#include <climits>
#include <cmath>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>

namespace tiermoe::cuda {
namespace {

constexpr int kThreads = 512;

// Rows that take the argmax and need no sort: greedy ones, and V = 1 (cub leaves a one-element
// segment unwritten).
__device__ bool argmax_row(const SampleRowDevice& r, int V) { return r.temperature == 0.f || r.top_k == 1 || V == 1; }

// The scratch, carved in 256-byte aligned pieces.
struct Scratch {
  float* keys;       // [B, V] logits sorted descending
  int32_t* ids_in;   // [B, V] 0 .. V-1 on each sampled row
  int32_t* ids_out;  // [B, V] the ids in sorted order
  int* begin;        // [B] segment of row b: [b * V, b * V + V), empty when greedy
  int* end;          // [B]
  void* temp;        // the sort's temporary storage
  size_t temp_bytes, total;
};

size_t aligned(size_t n) { return (n + 255) / 256 * 256; }

cudaError_t sort_temp_bytes(int B, int V, size_t* bytes) {
  *bytes = 0;
  return cub::DeviceSegmentedRadixSort::SortPairsDescending(
      nullptr, *bytes, static_cast<const float*>(nullptr), static_cast<float*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), B * V, B, static_cast<const int*>(nullptr),
      static_cast<const int*>(nullptr));
}

Scratch layout(void* base, int B, int V, size_t temp_bytes) {
  const size_t n = size_t(B) * V;
  char* p = static_cast<char*>(base);
  Scratch s{};
  size_t off = 0;
  auto take = [&](size_t bytes) {
    void* q = p ? p + off : nullptr;
    off += aligned(bytes);
    return q;
  };
  s.keys = static_cast<float*>(take(n * 4));
  s.ids_in = static_cast<int32_t*>(take(n * 4));
  s.ids_out = static_cast<int32_t*>(take(n * 4));
  s.begin = static_cast<int*>(take(size_t(B) * 4));
  s.end = static_cast<int*>(take(size_t(B) * 4));
  s.temp = take(temp_bytes);
  s.temp_bytes = temp_bytes;
  s.total = off;
  return s;
}

// grid (ceil(V / kThreads), B): segment bounds and ids 0 .. V-1 for the rows to sort.
__global__ void mark_rows(int* begin, int* end, int32_t* ids, const SampleRowDevice* rows, int V) {
  const int b = blockIdx.y;
  const bool greedy = argmax_row(rows[b], V);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    begin[b] = b * V;
    end[b] = greedy ? b * V : (b + 1) * V;
  }
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (!greedy && i < V) ids[size_t(b) * V + i] = i;
}

struct MinOp {
  __device__ int operator()(int a, int b) const { return a < b ? a : b; }
};
struct MaxOp {
  __device__ int operator()(int a, int b) const { return a > b ? a : b; }
};
struct Arg {
  float v;
  int i;  // INT_MAX: none
};
struct ArgMaxOp {  // the larger value; ties (and -inf rows) to the lower index, like argmax()
  __device__ Arg operator()(const Arg& a, const Arg& b) const {
    if (a.i == INT_MAX) return b;
    if (b.i == INT_MAX) return a;
    return a.v > b.v || (a.v == b.v && a.i < b.i) ? a : b;
  }
};

// grid B, block kThreads: tokens[b]. Sampled rows: thread t owns the contiguous candidates
// [t * chunk, (t + 1) * chunk) of the sorted row, so that a block scan of the threads' partial
// sums plus a walk inside each chunk finds the same first index as the CPU's sequential walk.
// Weights are recomputed (exp in double) at each pass rather than stored: no [B, V] doubles.
__global__ void __launch_bounds__(kThreads) sample_rows(int32_t* tokens, const float* logits, const float* keys,
                                                        const int32_t* ids, const SampleRowDevice* rows, int V) {
  using ReduceD = cub::BlockReduce<double, kThreads>;
  using ScanD = cub::BlockScan<double, kThreads>;
  using ReduceI = cub::BlockReduce<int, kThreads>;
  using ReduceA = cub::BlockReduce<Arg, kThreads>;
  __shared__ union {
    typename ReduceD::TempStorage rd;
    typename ScanD::TempStorage sd;
    typename ReduceI::TempStorage ri;
    typename ReduceA::TempStorage ra;
  } tmp;
  __shared__ double shared_d;
  __shared__ int shared_i;
  const int b = blockIdx.x, tid = threadIdx.x;
  const SampleRowDevice row = rows[b];
  if (argmax_row(row, V)) {
    const float* x = logits + size_t(b) * V;  // [V]
    Arg best{0.f, INT_MAX};
    for (int i = tid; i < V; i += kThreads) best = ArgMaxOp()(best, Arg{x[i], i});
    best = ReduceA(tmp.ra).Reduce(best, ArgMaxOp());
    if (tid == 0) tokens[b] = best.i;
    return;
  }
  const float* sk = keys + size_t(b) * V;  // [V] sorted logits
  const int32_t* si = ids + size_t(b) * V;  // [V] their ids
  const int k = row.top_k > 0 && row.top_k < V ? row.top_k : V;
  const double mx = sk[0], temperature = row.temperature;
  auto weight = [&](int i) { return exp((double(sk[i]) - mx) / temperature); };  // the CPU's expression
  const int chunk = (k + kThreads - 1) / kThreads, lo = min(k, tid * chunk), hi = min(k, lo + chunk);

  double part = 0;
  for (int i = lo; i < hi; ++i) part += weight(i);
  const double sum = ReduceD(tmp.rd).Sum(part);
  if (tid == 0) shared_d = sum;
  __syncthreads();
  const double row_sum = shared_d;

  int keep = k;  // nucleus: the first i whose cumulative probability reaches top_p
  if (row.top_p < 1.f) {
    part = 0;
    for (int i = lo; i < hi; ++i) part += weight(i) / row_sum;
    double acc;
    ScanD(tmp.sd).ExclusiveSum(part, acc);
    int cut = INT_MAX;
    for (int i = lo; i < hi; ++i) {
      acc += weight(i) / row_sum;
      if (acc >= double(row.top_p)) {
        cut = i;
        break;
      }
    }
    __syncthreads();  // tmp is reused
    cut = ReduceI(tmp.ri).Reduce(cut, MinOp());
    if (tid == 0) shared_i = cut;
    __syncthreads();
    if (shared_i != INT_MAX) keep = shared_i + 1;
  }

  const int klo = min(lo, keep), khi = min(hi, keep);
  part = 0;
  for (int i = klo; i < khi; ++i) part += weight(i);
  double before, total;
  __syncthreads();
  ScanD(tmp.sd).ExclusiveSum(part, before, total);  // total: the block's sum, in every thread
  double r = row.u * total - before;                // what is left of u * total at this chunk
  int pick = INT_MAX;
  for (int i = klo; i < khi; ++i) {
    const double w = weight(i);
    r -= w;
    if (r < 0 && w > 0) {  // never a candidate without weight (a chunk can start below 0 by rounding)
      pick = i;
      break;
    }
  }
  int last = -1;  // past the end by rounding: the last candidate with any weight (sample_token's rule)
  for (int i = klo; i < khi; ++i)
    if (weight(i) > 0) last = i;
  __syncthreads();
  pick = ReduceI(tmp.ri).Reduce(pick, MinOp());
  __syncthreads();  // tmp is reused
  last = ReduceI(tmp.ri).Reduce(last, MaxOp());
  if (tid == 0) tokens[b] = si[pick != INT_MAX ? pick : max(last, 0)];
}

}  // namespace

size_t sample_tokens_scratch_bytes(int B, int V) {
  if (B < 1 || V < 1 || size_t(B) * V > size_t(INT_MAX)) return 0;
  size_t temp = 0;
  if (sort_temp_bytes(B, V, &temp) != cudaSuccess) return 0;
  return layout(nullptr, B, V, temp).total;
}

cudaError_t sample_tokens(int32_t* tokens, const float* logits, const SampleRowDevice* rows, int B, int V, void* scratch,
                          size_t scratch_bytes, cudaStream_t s) {
  if (B < 1 || V < 1 || B > 65535 || size_t(B) * V > size_t(INT_MAX) || !tokens || !logits || !rows || !scratch)
    return cudaErrorInvalidValue;
  size_t temp = 0;
  if (const cudaError_t e = sort_temp_bytes(B, V, &temp); e != cudaSuccess) return e;
  Scratch sc = layout(scratch, B, V, temp);
  if (sc.total > scratch_bytes) return cudaErrorInvalidValue;
  mark_rows<<<dim3((V + kThreads - 1) / kThreads, B), kThreads, 0, s>>>(sc.begin, sc.end, sc.ids_in, rows, V);
  // Stable: equal logits keep their ids in ascending order, the CPU's tie rule.
  if (const cudaError_t e = cub::DeviceSegmentedRadixSort::SortPairsDescending(
          sc.temp, sc.temp_bytes, logits, sc.keys, sc.ids_in, sc.ids_out, B * V, B, sc.begin, sc.end, 0,
          int(sizeof(float) * 8), s);
      e != cudaSuccess)
    return e;
  sample_rows<<<B, kThreads, 0, s>>>(tokens, logits, sc.keys, sc.ids_out, rows, V);
  return cudaGetLastError();
}

}  // namespace tiermoe::cuda
