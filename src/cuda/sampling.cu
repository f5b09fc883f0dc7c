// sample_tokens(): see sampling.h. Up to four launches, all stream-ordered: mark the rows to sort,
// the argmax / top-k candidates of each slice of a row (large V), cub's segmented radix sort of the
// sort rows' (logit, id) pairs, then one block per row (which selects and sorts its own top k first
// on a select row, from its slices' candidates where there are slices).
// Shape legend: B logits rows, V vocabulary.
#include "cuda/sampling.h"

#include "cuda/device_math.cuh"

#include <algorithm>
#include <climits>
#include <cmath>

#include <cub/block/block_reduce.cuh>
#include <cuda/functional>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>

namespace tiermoe::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kSelectMax = kSampleSelectMax;  // one (key, id) pair per thread per bitonic stage
static_assert(kSelectMax == 2 * kThreads, "select_top_k's sort");
// Greedy and select rows of V >= 2 kSliceMin logits are cut into slices of at least kSliceMin, one
// block each (select_slices), so that a row is not read by one block alone: at V = 151,936 that
// block took 67 us for the argmax and 391 us for top_k 40. kSliceMin > kSelectMax: every slice has
// k candidates.
constexpr int kSliceMin = 4096, kMaxSlices = 64;
static_assert(kSliceMin >= kSelectMax, "a slice yields k candidates");
int g_max_slices = kMaxSlices;  // set_sample_max_slices
int slices_for(int V) { return std::clamp(V / kSliceMin, 1, g_max_slices); }


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

// grid (ceil(V / kThreads), B): segment bounds and ids 0 .. V-1 for the rows to sort (sampled
// rows that do not select; the others get an empty segment).
__global__ void mark_rows(int* begin, int* end, int32_t* ids, const SampleRowDevice* rows, int V) {
  const int b = blockIdx.y;
  const bool sort = sample_sort_row(rows[b], V);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    begin[b] = b * V;
    end[b] = sort ? (b + 1) * V : b * V;
  }
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (sort && i < V) ids[size_t(b) * V + i] = i;
}

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

// One block, on a select row: keys[0, k) and ids[0, k) = the row's top k (logit, id) pairs in the
// sort's order (logit descending, ties by ascending id), k = min(top_k, V) <= kSelectMax. The id of
// x[i] is id_of[i], or id_base + i without id_of; either way ids must ascend with i among equal
// logits (the ties at the threshold are taken in index order).
// A radix select of the k-th largest order_key, 8 bits per pass from the top (shared histogram of
// the keys that match the digits found so far), gives the threshold key t and how many of the
// keys equal to t are taken (need); the candidates are every key above t plus the `need`
// lowest-index keys at t (each warp walks a contiguous slice in index order and ranks its keys at
// t by ballot, after the warps before it); then a bitonic sort of the k in shared memory.
__device__ void select_top_k(float* keys, int32_t* ids, const float* x, int V, int k, const int32_t* id_of = nullptr,
                             int id_base = 0) {
  __shared__ unsigned hist[256];
  __shared__ unsigned long long cand[kSelectMax];  // (key << 32) | ~id: descending = the sort's order
  __shared__ unsigned found_prefix, found_need, found_at_t, taken;
  __shared__ unsigned warp_at_t[kThreads / 32];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  uint32_t prefix = 0, mask = 0;
  unsigned need = unsigned(k), at_t = 0;  // keys matching prefix still to take; keys equal to t
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < 256; i += kThreads) hist[i] = 0;
    __syncthreads();
    for (int i0 = 0; i0 < V; i0 += kThreads) {  // one atomic per digit per warp: logits share few top bytes
      const int i = i0 + tid;
      const uint32_t key = i < V ? order_key(x[i]) : 0;
      const unsigned digit = i < V && (key & mask) == prefix ? (key >> shift) & 255 : 256;
      const unsigned peers = __match_any_sync(0xffffffffu, digit);
      if (digit < 256 && lane == __ffs(peers) - 1) atomicAdd(&hist[digit], unsigned(__popc(peers)));
    }
    __syncthreads();
    if (warp == 0) {  // lane l holds digits 255 - 8l down to 248 - 8l; the digit where need is reached
      unsigned c[8], sum = 0;
      for (int j = 0; j < 8; ++j) sum += c[j] = hist[255 - 8 * lane - j];
      unsigned incl = sum;
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += t;
      }
      unsigned acc = incl - sum;
      if (acc < need && need <= incl)
        for (int j = 0; j < 8; ++j) {
          if (acc + c[j] >= need) {
            found_prefix = prefix | uint32_t(255 - 8 * lane - j) << shift;
            found_need = need - acc;
            found_at_t = c[j];
            break;
          }
          acc += c[j];
        }
    }
    __syncthreads();
    prefix = found_prefix;
    need = found_need;
    at_t = found_at_t;
    mask |= 255u << shift;
  }
  const uint32_t t = prefix;
  // Warp slices [lo, hi) in index order; the keys at t before each warp's slice, when not all taken.
  const int slice = (V + kThreads / 32 - 1) / (kThreads / 32), lo = min(V, warp * slice), hi = min(V, lo + slice);
  const bool all_at_t = at_t == need;
  if (tid == 0) taken = 0;
  if (!all_at_t) {
    unsigned n = 0;
    for (int i0 = lo; i0 < hi; i0 += 32) {
      const int i = i0 + lane;
      n += __popc(__ballot_sync(0xffffffffu, i < hi && order_key(x[i]) == t));
    }
    if (lane == 0) warp_at_t[warp] = n;
  }
  __syncthreads();
  unsigned rank = 0;  // keys at t before this lane's
  if (!all_at_t)
    for (int w = 0; w < warp; ++w) rank += warp_at_t[w];
  for (int i0 = lo; i0 < hi; i0 += 32) {
    const int i = i0 + lane;
    const uint32_t key = i < hi ? order_key(x[i]) : 0;
    const unsigned eq = __ballot_sync(0xffffffffu, i < hi && key == t);
    const bool take = i < hi && (key > t || (key == t && (all_at_t || rank + __popc(eq & ((1u << lane) - 1)) < need)));
    if (take) cand[atomicAdd(&taken, 1u)] = (uint64_t(key) << 32) | ~uint32_t(id_of ? id_of[i] : id_base + i);
    rank += __popc(eq);
  }
  int n = 2;  // the sort's size: a power of two >= k, padded with 0 (below every candidate)
  while (n < k) n *= 2;
  __syncthreads();
  for (int i = k + tid; i < n; i += kThreads) cand[i] = 0;
  __syncthreads();
  for (int size = 2; size <= n; size *= 2)
    for (int stride = size / 2; stride > 0; stride /= 2) {
      for (int p = tid; p < n / 2; p += kThreads) {
        const int i = 2 * p - (p & (stride - 1)), j = i + stride;
        const unsigned long long a = cand[i], c = cand[j];
        if ((a < c) == ((i & size) == 0)) {  // descending where i & size is 0 (all of it at size n)
          cand[i] = c;
          cand[j] = a;
        }
      }
      __syncthreads();
    }
  for (int i = tid; i < k; i += kThreads) {  // x may be keys: every read of x is behind the barriers above
    keys[i] = key_float(uint32_t(cand[i] >> 32));
    ids[i] = int32_t(~uint32_t(cand[i]));
  }
  __syncthreads();  // the block's writes are visible to the block after this
}

// The argmax of x[0, n) (ids id_base + i), in every thread.
template <class Reduce>
__device__ Arg block_argmax(typename Reduce::TempStorage& tmp, const float* x, int n, int id_base,
                            const int32_t* id_of = nullptr) {
  __shared__ Arg result;
  Arg best{0.f, INT_MAX};
  for (int i = threadIdx.x; i < n; i += kThreads) best = ArgMaxOp()(best, Arg{x[i], id_of ? id_of[i] : id_base + i});
  best = Reduce(tmp).Reduce(best, ArgMaxOp());
  if (threadIdx.x == 0) result = best;
  __syncthreads();
  return result;
}

// grid (S, B), S = slices_for(V) > 1: slice s = [V s / S, V (s + 1) / S) of row b. A greedy row's
// block writes its slice's argmax to keys[b, s] / ids_in[b, s]; a select row's block its slice's top
// k, sorted, to keys[b, s k ..] / ids_in[b, s k ..]. The row's block in sample_rows then reduces
// those (a top k of the row is a top k of the slices' top k's: S k <= V candidates, and those tied
// at any logit come in ascending id order, slice after slice). Sort rows: nothing.
__global__ void __launch_bounds__(kThreads) select_slices(float* keys, int32_t* ids_in, const float* logits,
                                                          const SampleRowDevice* rows, int V) {
  using ReduceA = cub::BlockReduce<Arg, kThreads>;
  __shared__ typename ReduceA::TempStorage tmp;
  const int s = blockIdx.x, S = gridDim.x, b = blockIdx.y;
  const SampleRowDevice row = rows[b];
  const int lo = int(int64_t(V) * s / S), hi = int(int64_t(V) * (s + 1) / S);
  const float* x = logits + size_t(b) * V;
  float* ko = keys + size_t(b) * V;
  int32_t* io = ids_in + size_t(b) * V;
  if (sample_argmax_row(row, V)) {
    const Arg best = block_argmax<ReduceA>(tmp, x + lo, hi - lo, lo);
    if (threadIdx.x == 0) {
      ko[s] = best.v;
      io[s] = best.i;
    }
  } else if (sample_select_row(row, V)) {
    const int k = row.top_k;  // <= kSelectMax <= kSliceMin <= hi - lo < V
    select_top_k(ko + size_t(s) * k, io + size_t(s) * k, x + lo, hi - lo, k, nullptr, lo);
  }
}

// grid B, block kThreads: tokens[b]. Sampled rows (sorted by the sort, or by select_top_k here): thread t owns the contiguous candidates
// [t * chunk, (t + 1) * chunk) of the sorted row, so that a block scan of the threads' partial
// sums plus a walk inside each chunk finds the same first index as the CPU's sequential walk.
// Weights are recomputed (exp in double) at each pass rather than stored: no [B, V] doubles.
// With S > 1 slices, greedy and select rows start from select_slices' candidates in keys / ids_in.
__global__ void __launch_bounds__(kThreads) sample_rows(int32_t* tokens, const float* logits, float* keys, int32_t* ids,
                                                        const int32_t* ids_in, const SampleRowDevice* rows, int V,
                                                        int S, bool sorted) {
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
  float* row_keys = keys + size_t(b) * V;  // [V]
  const int32_t* row_ids_in = ids_in + size_t(b) * V;
  if (sample_argmax_row(row, V)) {
    const Arg best = S > 1 ? block_argmax<ReduceA>(tmp.ra, row_keys, S, 0, row_ids_in)
                           : block_argmax<ReduceA>(tmp.ra, logits + size_t(b) * V, V, 0);
    if (tid == 0) tokens[b] = best.i;
    return;
  }
  if (!sorted && !sample_select_row(row, V)) {  // a sort row, but the caller said there was none
    if (tid == 0) tokens[b] = -1;
    return;
  }
  const int k = row.top_k > 0 && row.top_k < V ? row.top_k : V;
  if (sample_select_row(row, V)) {
    if (S > 1) select_top_k(row_keys, ids + size_t(b) * V, row_keys, S * k, k, row_ids_in);
    else select_top_k(row_keys, ids + size_t(b) * V, logits + size_t(b) * V, V, k);
  }
  const float* sk = keys + size_t(b) * V;  // [V] sorted logits (the first k on a select row)
  const int32_t* si = ids + size_t(b) * V;  // [V] their ids
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
    cut = ReduceI(tmp.ri).Reduce(cut, ::cuda::minimum<>{});
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
  pick = ReduceI(tmp.ri).Reduce(pick, ::cuda::minimum<>{});
  __syncthreads();  // tmp is reused
  last = ReduceI(tmp.ri).Reduce(last, ::cuda::maximum<>{});
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
                          size_t scratch_bytes, cudaStream_t s, bool sort) {
  if (B < 1 || V < 1 || B > 65535 || size_t(B) * V > size_t(INT_MAX) || !tokens || !logits || !rows || !scratch)
    return cudaErrorInvalidValue;
  size_t temp = 0;
  if (const cudaError_t e = sort_temp_bytes(B, V, &temp); e != cudaSuccess) return e;
  Scratch sc = layout(scratch, B, V, temp);
  if (sc.total > scratch_bytes) return cudaErrorInvalidValue;
  const int S = slices_for(V);
  if (S > 1) select_slices<<<dim3(S, B), kThreads, 0, s>>>(sc.keys, sc.ids_in, logits, rows, V);
  if (sort) {
    mark_rows<<<dim3((V + kThreads - 1) / kThreads, B), kThreads, 0, s>>>(sc.begin, sc.end, sc.ids_in, rows, V);
    // Stable: equal logits keep their ids in ascending order, the CPU's tie rule.
    if (const cudaError_t e = cub::DeviceSegmentedRadixSort::SortPairsDescending(
            sc.temp, sc.temp_bytes, logits, sc.keys, sc.ids_in, sc.ids_out, B * V, B, sc.begin, sc.end, 0,
            int(sizeof(float) * 8), s);
        e != cudaSuccess)
      return e;
  }
  sample_rows<<<B, kThreads, 0, s>>>(tokens, logits, sc.keys, sc.ids_out, sc.ids_in, rows, V, S, sort);
  return cudaGetLastError();
}

void set_sample_max_slices(int n) { g_max_slices = n >= 1 && n <= kMaxSlices ? n : kMaxSlices; }

}  // namespace tiermoe::cuda
