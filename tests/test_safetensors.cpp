// Corrupt or truncated safetensors files are refused with an error naming the file and tensor.
#include <gtest/gtest.h>

#include "core/check.h"
#include "io/safetensors.h"
#include "test_util.h"

namespace tiermoe {
namespace {

using test::error_of;

TEST(Safetensors, ReadsTensorsAndShapes) {
  const std::string dir = test::temp_dir("st_ok");
  std::vector<uint8_t> bytes(2 * 3 * 4);
  float vals[6] = {1, 2, 3, 4, 5, 6};
  std::memcpy(bytes.data(), vals, sizeof vals);
  test::write_safetensors(dir + "/a.safetensors", {{"w", "F32", {2, 3}, bytes}, {"b", "BF16", {4}, {}}});
  SafetensorsFile f(dir + "/a.safetensors");
  ASSERT_EQ(f.tensors().size(), 2u);
  const TensorView& w = f.tensors().at("w");
  EXPECT_EQ(w.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(load_f32(w.data, w.dtype, 5), 6.f);
}

struct BadFileCase {
  const char* name;
  std::function<void(const std::string& path)> write;
  const char* expected_in_message;
};

void PrintTo(const BadFileCase& c, std::ostream* os) { *os << c.name; }

class BadSafetensors : public ::testing::TestWithParam<BadFileCase> {};

TEST_P(BadSafetensors, RefusedWithClearError) {
  const std::string path = test::temp_dir(GetParam().name) + "/bad.safetensors";
  GetParam().write(path);
  const std::string msg = error_of([&] { SafetensorsFile f(path); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find(GetParam().expected_in_message), std::string::npos) << msg;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, BadSafetensors,
    ::testing::Values(
        BadFileCase{"tiny", [](const std::string& p) { test::write_text(p, "abc"); }, "no header length"},
        BadFileCase{"header_past_end",
                    [](const std::string& p) {
                      uint64_t len = 1000;
                      std::string s(reinterpret_cast<const char*>(&len), 8);
                      test::write_text(p, s + "{}");
                    },
                    "runs past the end"},
        BadFileCase{"not_json",
                    [](const std::string& p) {
                      uint64_t len = 5;
                      test::write_text(p, std::string(reinterpret_cast<const char*>(&len), 8) + "{oops");
                    },
                    "invalid JSON"},
        BadFileCase{"truncated_data",
                    [](const std::string& p) {
                      test::write_safetensors(p, {{"w", "F32", {4, 4}, {}}});
                      std::filesystem::resize_file(p, std::filesystem::file_size(p) - 10);
                    },
                    "tensor 'w'"},
        BadFileCase{"overlap",
                    [](const std::string& p) {
                      test::write_safetensors(p, {{"a", "F32", {4}, {}}, {"b", "F32", {4}, {}}},
                                              [](nlohmann::json& h) { h["b"]["data_offsets"] = {8, 24}; });
                    },
                    "overlap"},
        BadFileCase{"size_mismatch",
                    [](const std::string& p) {
                      test::write_safetensors(p, {{"a", "F32", {4}, {}}},
                                              [](nlohmann::json& h) { h["a"]["shape"] = {5}; });
                    },
                    "needs 20"},
        BadFileCase{"bad_dtype",
                    [](const std::string& p) { test::write_safetensors(p, {{"a", "F64", {2}, {}}}); },
                    "unsupported dtype"},
        BadFileCase{"offsets_reversed",
                    [](const std::string& p) {
                      test::write_safetensors(p, {{"a", "F32", {0}, {}}},
                                              [](nlohmann::json& h) { h["a"]["data_offsets"] = {4, 0}; });
                    },
                    "begin after"},
        BadFileCase{"negative_dim",
                    [](const std::string& p) {
                      test::write_safetensors(p, {{"a", "F32", {1}, {}}},
                                              [](nlohmann::json& h) { h["a"]["shape"] = {-1}; });
                    },
                    "negative"}),
    [](const auto& info) { return std::string(info.param.name); });

// The format pads headers to 8 bytes, but files that do not are still read correctly.
TEST(Safetensors, UnalignedDataIsReadCorrectly) {
  const std::string dir = test::temp_dir("st_unaligned");
  std::vector<uint8_t> bytes(3 * 2);
  const uint16_t vals[3] = {f32_to_bf16(1.5f), f32_to_bf16(-2.f), f32_to_bf16(3.25f)};
  std::memcpy(bytes.data(), vals, sizeof vals);
  test::write_safetensors(dir + "/u.safetensors", {{"pad", "U8", {1}, {7}}, {"w", "BF16", {3}, bytes}},
                          [](nlohmann::json& h) { h["pad"]["dtype"] = "I32"; h["pad"]["shape"] = {0}; h["pad"]["data_offsets"] = {0, 0}; h["w"]["data_offsets"] = {1, 7}; });
  SafetensorsFile f(dir + "/u.safetensors");
  const TensorView& w = f.tensors().at("w");
  EXPECT_EQ(load_f32(w.data, w.dtype, 0), 1.5f);
  EXPECT_EQ(load_f32(w.data, w.dtype, 2), 3.25f);
}

TEST(Safetensors, MissingFileNamesPath) {
  const std::string msg = error_of([] { SafetensorsFile f("/nonexistent/x.safetensors"); });
  EXPECT_NE(msg.find("/nonexistent/x.safetensors"), std::string::npos) << msg;
}

TEST(Checkpoint, IndexNamingAbsentTensorIsRefused) {
  const std::string dir = test::temp_dir("index_bad");
  test::write_safetensors(dir + "/model-1.safetensors", {{"a", "F32", {2}, {}}});
  test::write_text(dir + "/model.safetensors.index.json", R"({"weight_map": {"a": "model-1.safetensors", "b": "model-1.safetensors"}})");
  const std::string msg = error_of([&] { Checkpoint::open_dir(dir); });
  EXPECT_NE(msg.find("'b'"), std::string::npos) << msg;
}

TEST(Checkpoint, ShardTensorMissingFromIndexIsRefused) {
  const std::string dir = test::temp_dir("index_extra");
  test::write_safetensors(dir + "/model-1.safetensors", {{"a", "F32", {2}, {}}, {"z", "F32", {2}, {}}});
  test::write_text(dir + "/model.safetensors.index.json", R"({"weight_map": {"a": "model-1.safetensors"}})");
  const std::string msg = error_of([&] { Checkpoint::open_dir(dir); });
  EXPECT_NE(msg.find("'z'"), std::string::npos) << msg;
}

TEST(Checkpoint, ShardsAreJoined) {
  const std::string dir = test::temp_dir("index_ok");
  test::write_safetensors(dir + "/m1.safetensors", {{"a", "F32", {2}, {}}});
  test::write_safetensors(dir + "/m2.safetensors", {{"b", "BF16", {3}, {}}});
  test::write_text(dir + "/model.safetensors.index.json", R"({"weight_map": {"a": "m1.safetensors", "b": "m2.safetensors"}})");
  Checkpoint c = Checkpoint::open_dir(dir);
  EXPECT_TRUE(c.has("a"));
  EXPECT_EQ(c.get("b").shape, (std::vector<int64_t>{3}));
}

}  // namespace
}  // namespace tiermoe
