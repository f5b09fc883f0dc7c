// UTF-8 helpers for the tokenizer. Validity rules are Unicode's (no overlongs, no surrogates,
// nothing above U+10FFFF), and invalid input is replaced the way Rust's String::from_utf8_lossy
// does it, because the Hugging Face decoders we reproduce are written in Rust.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace tiermoe {

inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

// Length of the well-formed character starting at s[i], or 0 if it is ill-formed or cut off.
// In that case *bad (if given) gets the length of the "maximal subpart" (>= 1), which Unicode
// (and Rust) replace with a single U+FFFD.
inline size_t utf8_char_len(std::string_view s, size_t i, size_t* bad = nullptr) {
  const uint8_t b0 = static_cast<uint8_t>(s[i]);
  if (b0 < 0x80) return 1;
  size_t need;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 3;
    if (b0 == 0xE0) lo = 0xA0;       // overlong
    else if (b0 == 0xED) hi = 0x9F;  // surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 4;
    if (b0 == 0xF0) lo = 0x90;       // overlong
    else if (b0 == 0xF4) hi = 0x8F;  // above U+10FFFF
  } else {
    if (bad) *bad = 1;
    return 0;
  }
  size_t k = 1;
  for (; k < need && i + k < s.size(); ++k) {
    const uint8_t b = static_cast<uint8_t>(s[i + k]);
    if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) break;
  }
  if (k == need) return need;
  if (bad) *bad = k;
  return 0;
}

// Byte offset of the first ill-formed sequence, or npos if `s` is valid UTF-8.
inline size_t utf8_find_invalid(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    if (static_cast<uint8_t>(s[i]) < 0x80) { ++i; continue; }
    const size_t n = utf8_char_len(s, i);
    if (n == 0) return i;
    i += n;
  }
  return std::string_view::npos;
}

inline bool utf8_is_valid(std::string_view s) { return utf8_find_invalid(s) == std::string_view::npos; }

// Decodes the character at s[i] and advances i. Ill-formed bytes decode as U+FFFD, one subpart
// at a time, so this never loops forever or reads past the end.
inline uint32_t utf8_next(std::string_view s, size_t& i) {
  size_t bad = 1;
  const size_t n = utf8_char_len(s, i, &bad);
  const auto* p = reinterpret_cast<const uint8_t*>(s.data()) + i;
  switch (n) {
    case 1: i += 1; return p[0];
    case 2: i += 2; return (uint32_t(p[0] & 0x1F) << 6) | (p[1] & 0x3F);
    case 3: i += 3; return (uint32_t(p[0] & 0x0F) << 12) | (uint32_t(p[1] & 0x3F) << 6) | (p[2] & 0x3F);
    case 4:
      i += 4;
      return (uint32_t(p[0] & 0x07) << 18) | (uint32_t(p[1] & 0x3F) << 12) |
             (uint32_t(p[2] & 0x3F) << 6) | (p[3] & 0x3F);
    default: i += bad; return 0xFFFD;
  }
}

inline void utf8_append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

inline std::string utf8_encode(uint32_t cp) {
  std::string s;
  utf8_append(s, cp);
  return s;
}

// Rust's String::from_utf8_lossy: each maximal ill-formed subpart becomes one U+FFFD.
inline std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    size_t bad = 1;
    const size_t n = utf8_char_len(s, i, &bad);
    if (n) {
      out.append(s.substr(i, n));
      i += n;
    } else {
      out.append(kReplacementChar);
      i += bad;
    }
  }
  return out;
}

}  // namespace tiermoe
