// The key-split rules (src/cuda/decode_splits.h; plain C++, so they are checked here without a GPU):
// a decode batch's, cost = waves x (tiles per split + 1), least cost, ties to the fewer splits; one
// sequence's on the tensor cores, 4 per 1024 keys up to a cap.
#include <gtest/gtest.h>

#include "cuda/decode_splits.h"

namespace tiermoe::cuda {
namespace {

// The cost the rule minimizes, written out again for the checks below.
long long cost(int keys, int tile, int per_split, int resident, int s) {
  const long long waves = (static_cast<long long>(per_split) * s + resident - 1) / resident;
  const long long tiles = (keys + static_cast<long long>(s) * tile - 1) / (static_cast<long long>(s) * tile);
  return waves * (tiles + 1);
}

TEST(DecodeSplits, LeastCostWithinBoundsTiesToFewer) {
  for (int keys : {1, 63, 64, 65, 1025, 2058, 4106, 9000})
    for (int per_split : {4, 16, 32, 128, 256, 512, 1024, 2048})
      for (int resident : {264, 528, 792})
        for (int most : {1, 4, 16, 40, 72}) {
          const int s = decode_batch_splits(keys, 64, per_split, resident, most);
          ASSERT_GE(s, 1);
          ASSERT_LE(s, most);
          for (int other = 1; other <= most; ++other) {
            const long long c = cost(keys, 64, per_split, resident, s), o = cost(keys, 64, per_split, resident, other);
            ASSERT_TRUE(c < o || (c == o && s <= other) || other == s)
                << "keys " << keys << " per_split " << per_split << " resident " << resident << ": " << s << " vs " << other;
          }
        }
}

// Worked by hand: the tensor-core kernel holds 264 blocks (2 per SM on 132 SMs), 4 KV heads, 4106
// keys (65 tiles of 64), at most 68 splits. One wave holds 264 / (4 B) splits; a second wave costs
// more than the tiles it saves, so the rule takes exactly one wave's worth.
TEST(DecodeSplits, OneFullWaveWhenTilesAreMany) {
  EXPECT_EQ(decode_batch_splits(4106, 64, 4 * 64, 264, 68), 1);   // 1 x 66 against 2 x 34 at 2 splits
  EXPECT_EQ(decode_batch_splits(4106, 64, 4 * 32, 264, 68), 2);   // 1 x 34 against 2 x 23 at 3
  EXPECT_EQ(decode_batch_splits(4106, 64, 4 * 16, 264, 68), 4);   // 1 x 18 against 2 x 14 at 5
  EXPECT_EQ(decode_batch_splits(4106, 64, 4 * 8, 264, 68), 8);    // 1 x 10 against 2 x 9 at 9
}

// Few blocks: every split count up to `most` fits in one wave, so the most splits win (fewest
// tiles each), except where ceil() leaves the tile count unchanged (then the fewer).
TEST(DecodeSplits, FewBlocksTakeTheMostSplits) {
  EXPECT_EQ(decode_batch_splits(4096, 64, 16, 792, 32), 32);  // 32 splits of 2 tiles, 512 blocks
  EXPECT_EQ(decode_batch_splits(4096, 64, 16, 792, 40), 32);  // 33..40 splits still take 2 tiles each
}

TEST(DecodeSplits, UnknownResidencyKeepsTheMost) {
  EXPECT_EQ(decode_batch_splits(4096, 64, 16, 0, 40), 40);
  EXPECT_EQ(decode_batch_splits(0, 64, 16, 792, 40), 40);
  EXPECT_EQ(decode_batch_splits(4096, 64, 16, 792, 0), 1);
}

// One sequence on the tensor cores: 4 per 1024 keys, stopped at the cap (33: 132 SMs, 4 KV heads).
TEST(DecodeSplits, OneSequenceStopsAtTheCap) {
  EXPECT_EQ(tc_decode_splits(1024, 4, 33), 0);        // one block per KV head
  EXPECT_EQ(tc_decode_splits(1025, 4, 33), 8);
  EXPECT_EQ(tc_decode_splits(4128, 4, 33), 20);       // under the cap: as before it
  EXPECT_EQ(tc_decode_splits(8192, 4, 33), 32);
  EXPECT_EQ(tc_decode_splits(8193, 4, 33), 33);       // 36 capped
  EXPECT_EQ(tc_decode_splits(32800, 4, 33), 33);      // 132 capped
  EXPECT_EQ(tc_decode_splits(32800, 4, 0), 132);      // no cap known
  EXPECT_EQ(tc_decode_splits(4128, 4, 16), 16);       // 8 KV heads (Mixtral)
  EXPECT_EQ(tc_decode_splits(32800, 1, 33), 33);      // TIERMOE_CUDA_TC_SPLITS=1
}

}  // namespace
}  // namespace tiermoe::cuda
