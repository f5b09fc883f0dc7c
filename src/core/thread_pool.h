// A fixed pool of worker threads for data-parallel loops (one pool per process).
#pragma once
#include <cstddef>
#include <functional>

namespace tiermoe {

// Runs fn(begin, end) over [0, n) split into contiguous chunks, one per thread, and waits.
// Chunks are multiples of `grain` (except the last) so SIMD tiles stay whole.
void parallel_for(size_t n, const std::function<void(size_t, size_t)>& fn, size_t grain = 1);

// Threads used by parallel_for; defaults to the hardware concurrency, or TIERMOE_THREADS.
int num_threads();
void set_num_threads(int n);

}  // namespace tiermoe
