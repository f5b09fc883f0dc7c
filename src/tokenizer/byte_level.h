// GPT-2's reversible byte <-> character map used by byte-level BPE: printable bytes stand for
// themselves, the other 68 bytes become U+0100.. so that every token is printable text.
#pragma once
#include <array>
#include <cstdint>
#include <string>

#include "tokenizer/utf8.h"

namespace tiermoe {

struct ByteLevelTables {
  std::array<std::string, 256> byte_to_utf8;  // byte -> UTF-8 of its stand-in character
  std::array<int16_t, 0x144> char_to_byte;    // stand-in code point -> byte, or -1

  ByteLevelTables() {
    char_to_byte.fill(-1);
    auto printable = [](int b) { return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE); };
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const uint32_t cp = printable(b) ? uint32_t(b) : next++;
      byte_to_utf8[b] = utf8_encode(cp);
      char_to_byte[cp] = int16_t(b);
    }
  }
  // The byte a character stands for, or -1 if it is not one of the 256 stand-ins.
  int byte_of(uint32_t cp) const { return cp < char_to_byte.size() ? char_to_byte[cp] : -1; }
};

inline const ByteLevelTables& byte_level_tables() {
  static const ByteLevelTables t;
  return t;
}

}  // namespace tiermoe
