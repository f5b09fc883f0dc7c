// Shared helpers of the test suite.
#pragma once
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <span>
#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/check.h"
#include "engine/sampler.h"
#include "io/safetensors.h"

namespace tiermoe::test {

inline std::string repo_path(const std::string& rel) { return std::string(TIERMOE_SOURCE_DIR) + "/" + rel; }
inline std::string tinymix_dir() { return repo_path("models/tinymix-code"); }

// Integer tensor (I32 or I64) as int32.
inline std::vector<int32_t> ints(const TensorView& t) {
  std::vector<int32_t> out(size_t(t.numel()));
  const auto* bytes = static_cast<const uint8_t*>(t.data);
  for (size_t i = 0; i < out.size(); ++i) {
    if (t.dtype == DType::I64) {
      int64_t v;
      std::memcpy(&v, bytes + 8 * i, 8);
      out[i] = int32_t(v);
    } else {
      std::memcpy(&out[i], bytes + 4 * i, 4);
    }
  }
  return out;
}

inline std::vector<float> floats(const TensorView& t) {
  std::vector<float> out(size_t(t.numel()));
  for (size_t i = 0; i < out.size(); ++i) out[i] = load_f32(t.data, t.dtype, i);
  return out;
}

// ||a - b|| / ||b||
inline double rel_l2(const float* a, const float* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1));
}

// n greedy tokens after `prompt`, decoded one at a time through a fresh KV cache.
inline std::vector<int32_t> greedy_tokens(Backend& backend, int vocab, std::span<const int32_t> prompt, size_t n) {
  auto cache = backend.new_cache();
  std::vector<float> logits(static_cast<size_t>(vocab));
  backend.forward(prompt, *cache, 1, logits.data());
  std::vector<int32_t> got;
  for (size_t i = 0; i < n; ++i) {
    const int32_t next = argmax(logits);
    got.push_back(next);
    backend.forward(std::span(&next, 1), *cache, 1, logits.data());
  }
  return got;
}

// Relative L2 error of the logits at every position of `ids` (one pass through a fresh cache)
// against expected[T, V].
inline std::vector<double> logit_errors_at_every_position(Backend& backend, int vocab, std::span<const int32_t> ids,
                                                          const std::vector<float>& expected) {
  const size_t T = ids.size(), V = static_cast<size_t>(vocab);
  CHECK(expected.size() == T * V);
  auto cache = backend.new_cache();
  std::vector<float> logits(T * V);
  backend.forward(ids, *cache, int(T), logits.data());
  std::vector<double> err(T);
  for (size_t t = 0; t < T; ++t) err[t] = rel_l2(&logits[t * V], &expected[t * V], V);
  return err;
}

// Standard-normal floats, deterministic for a seed.
inline std::vector<float> randn(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d;
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}


}  // namespace tiermoe::test

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

namespace tiermoe::test {

struct FakeTensor {
  std::string name;
  std::string dtype;  // "BF16", "F32", ...
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;  // empty: zeros of the right size
};

inline size_t fake_elem_size(const std::string& dtype) {
  return dtype == "F32" || dtype == "I32" ? 4 : dtype == "I64" || dtype == "F64" ? 8 : dtype == "U8" ? 1 : 2;
}

// Writes a well-formed safetensors file; `mutate_header` may corrupt the header JSON first.
inline void write_safetensors(const std::string& path, const std::vector<FakeTensor>& tensors,
                              const std::function<void(nlohmann::json&)>& mutate_header = {}) {
  nlohmann::json h = nlohmann::json::object();
  std::vector<uint8_t> data;
  for (const auto& t : tensors) {
    size_t n = fake_elem_size(t.dtype);
    for (int64_t d : t.shape) n *= size_t(d);
    std::vector<uint8_t> bytes = t.bytes.empty() ? std::vector<uint8_t>(n, 0) : t.bytes;
    h[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {data.size(), data.size() + bytes.size()}}};
    data.insert(data.end(), bytes.begin(), bytes.end());
  }
  if (mutate_header) mutate_header(h);
  std::string hs = h.dump();
  hs.resize((hs.size() + 7) / 8 * 8, ' ');  // as the reference writer: data 8-byte aligned
  const uint64_t len = hs.size();
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(&len), 8);
  out.write(hs.data(), std::streamsize(hs.size()));
  out.write(reinterpret_cast<const char*>(data.data()), std::streamsize(data.size()));
}

// A fresh empty directory under the system temp dir.
inline std::string temp_dir(const std::string& name) {
  auto p = std::filesystem::temp_directory_path() / ("tiermoe_test_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p.string();
}

inline void write_text(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

}  // namespace tiermoe::test

namespace tiermoe::test {

// The message of the InputError fn throws, or "(no InputError)".
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const InputError& e) {
    return e.what();
  }
  return "(no InputError)";
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
}  // namespace tiermoe::test
