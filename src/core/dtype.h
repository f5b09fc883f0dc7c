// Element types of checkpoint tensors and their conversion to FP32.
#pragma once
#include <cstdint>
#include <cstring>
#include <string_view>
#include <immintrin.h>

namespace tiermoe {

enum class DType : uint8_t { F32, F16, BF16, I64, I32 };

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: return 2;
    case DType::I64: return 8;
  }
  return 0;
}

inline std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::I64: return "I64";
    case DType::I32: return "I32";
  }
  return "?";
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, as PyTorch does.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }
inline uint16_t f32_to_f16(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }

// Reads element i of a float tensor of any supported dtype as FP32. memcpy, because
// safetensors data need not be aligned to the element size (compiles to a plain load).
inline float load_f32(const void* data, DType t, size_t i) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  switch (t) {
    case DType::F32: {
      float f;
      std::memcpy(&f, bytes + 4 * i, 4);
      return f;
    }
    case DType::BF16:
    case DType::F16: {
      uint16_t h;
      std::memcpy(&h, bytes + 2 * i, 2);
      return t == DType::BF16 ? bf16_to_f32(h) : f16_to_f32(h);
    }
    default: return 0.f;
  }
}

}  // namespace tiermoe
