// How many key splits a decode step's attention takes. Plain C++ (no CUDA): the CPU tests check it.
#pragma once
#include <algorithm>

namespace tiermoe::cuda {

// A decode batch's attention launch runs `blocks_per_split` blocks (sequences x KV heads) per key
// split; the GPU holds `resident` of them at once; a split of the longest sequence's `keys` walks
// ceil(keys / splits / tile_keys) tiles one after another. Its time is modelled as
//   waves x (tiles per split + 1),   waves = ceil(blocks_per_split x splits / resident),
// the 1 standing for a block's fixed cost (launch, q, the partial row, its share of the merge).
// Returns the split count in 1 .. max_splits of least cost (ties: the fewer). Why a model: with few
// sequences more splits fill the GPU, with many they only add waves, and a partial last wave costs
// a whole one. Fitted to, and checked against, the sweeps of docs/benchmarks.md ("Decode batches:
// key splits"): OLMoE (CUDA-core kernel, 792 resident) and Qwen3-L16 (tensor cores, 264) at B = 8..64
// and 1024 / 2048 / 4096 keys, where it picks the measured best or one within about 2% of it.
inline int decode_batch_splits(int keys, int tile_keys, int blocks_per_split, int resident, int max_splits) {
  max_splits = std::max(1, max_splits);
  if (keys <= 0 || tile_keys <= 0 || blocks_per_split <= 0 || resident <= 0) return max_splits;
  int best = 1;
  long long best_cost = -1;
  for (int s = 1; s <= max_splits; ++s) {
    const long long waves = (static_cast<long long>(blocks_per_split) * s + resident - 1) / resident;
    const long long tiles = (keys + static_cast<long long>(s) * tile_keys - 1) / (static_cast<long long>(s) * tile_keys);
    const long long cost = waves * (tiles + 1);
    if (best_cost < 0 || cost < best_cost) best = s, best_cost = cost;
  }
  return best;
}

// One sequence's key splits on the tensor-core decode at `keys` keys: 0 up to 1024 keys (one
// block per KV head), else `per_1k` per 1024 keys (4: the best at 4096 keys), at most `cap` (a
// block per multiprocessor on BF16 pages, two on FP8 pages: attention_prefill_decode_split_cap; 0:
// none). Why the cap: at 16k and 32k keys on Qwen3's 4 KV heads and BF16 pages, 33 splits beat 66
// and more by 1-6% per token. Why two on FP8 pages: each block stalls on dequantizing every tile,
// and a second block per SM runs its products meanwhile: 66 splits took 12-14% off the step at 32k
// keys against 33 (one H100, docs/benchmarks.md "FP8 pages at long context").
inline int tc_decode_splits(int keys, int per_1k, int cap) {
  if (keys <= 1024) return 0;
  const int splits = (keys + 1023) / 1024 * per_1k;
  return cap > 0 ? std::min(splits, cap) : splits;
}

}  // namespace tiermoe::cuda
