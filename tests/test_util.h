// Shared helpers of the test suite.
#pragma once
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "io/safetensors.h"

namespace tiermoe::test {

inline std::string repo_path(const std::string& rel) { return std::string(TIERMOE_SOURCE_DIR) + "/" + rel; }
inline std::string tinymix_dir() { return repo_path("models/tinymix-code"); }

// Integer tensor (I32 or I64) as int32.
inline std::vector<int32_t> ints(const TensorView& t) {
  std::vector<int32_t> out(size_t(t.numel()));
  for (size_t i = 0; i < out.size(); ++i)
    out[i] = t.dtype == DType::I64 ? int32_t(static_cast<const int64_t*>(t.data)[i]) : static_cast<const int32_t*>(t.data)[i];
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

}  // namespace tiermoe::test
