// parallel_for visits every index exactly once, for loops of every size back to back.
#include <gtest/gtest.h>

#include <atomic>
#include <vector>

#include "core/thread_pool.h"

namespace tiermoe {
namespace {

TEST(ThreadPool, EveryIndexExactlyOnceAcrossManyLoops) {
  std::vector<std::atomic<int>> hits(257);
  for (int round = 0; round < 3000; ++round) {
    const size_t n = size_t(round % 257) + 1, grain = size_t(round % 5) + 1;
    for (size_t i = 0; i < n; ++i) hits[i].store(0);
    parallel_for(n, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) hits[i].fetch_add(1);
    }, grain);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "round " << round << " index " << i;
  }
}

TEST(ThreadPool, NestedLoopsRunInline) {
  std::atomic<int> total{0};
  parallel_for(8, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) parallel_for(10, [&](size_t b2, size_t e2) { total += int(e2 - b2); });
  });
  EXPECT_EQ(total.load(), 80);
}

}  // namespace
}  // namespace tiermoe
