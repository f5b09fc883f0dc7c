// The bandwidth floor `bench` reports: the bytes a decode step reads, against the peers' count in
// ../shared/bench (active parameters x 2 bytes) and the KV cache's format.
#include <gtest/gtest.h>

#include "cli/bench_core.h"
#include "model/config.h"
#include "test_util.h"

namespace tiermoe {
namespace {

ModelConfig bench_shape(const char* name) {
  const std::string path = test::repo_path(std::string("configs/") + name);
  return parse_config(test::read_file(path), path);
}

// ../shared/bench/README.md (whose shapes configs/ copies): OLMoE's bench shape has 1.09B active
// parameters, Qwen3's 16-layer shape 0.93B; at context 0 a step reads them in BF16 (2 bytes each),
// norms aside.
TEST(BenchFloor, WeightBytesAreTheActiveParameters) {
  EXPECT_NEAR(decode_bytes(bench_shape("olmoe-1b-7b-v8192.json"), 0), 2 * 1.09e9, 2 * 0.01e9);
  EXPECT_NEAR(decode_bytes(bench_shape("qwen3-30b-a3b-L16-v8192.json"), 0), 2 * 0.93e9, 2 * 0.01e9);
}

// K and V of every layer, KV head and position: 2 bytes a value in BF16, 1 + 1/Dh in FP8 rows.
TEST(BenchFloor, KvBytesFollowTheCacheFormat) {
  const ModelConfig c = bench_shape("olmoe-1b-7b-v8192.json");  // 16 layers, 16 KV heads of 128
  const double values = 16.0 * 4096 * 16 * 128 * 2;
  EXPECT_DOUBLE_EQ(decode_bytes(c, 4096) - decode_bytes(c, 0), values * 2);
  const double fp8 = kv_bytes_per_value(KvDType::FP8, c.head_dim);
  EXPECT_DOUBLE_EQ(fp8, 1.0 + 1.0 / 128);
  EXPECT_DOUBLE_EQ(decode_bytes(c, 4096, fp8) - decode_bytes(c, 0, fp8), values * (1.0 + 1.0 / 128));
  EXPECT_DOUBLE_EQ(kv_bytes_per_value(KvDType::BF16, 128), 2.0);
}

}  // namespace
}  // namespace tiermoe
