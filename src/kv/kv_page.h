// How one page (P tokens) of one layer's K or V is stored as it ages, and nothing more:
//   window:  BF16 rows;
//   middle:  codes only: vq: every stage's codes, bit-packed, FP8 anchors, BF16 token norms;
//            kivi: bit-packed levels and BF16 (zero, scale) per group; fp8: a byte per value;
//   archive: vq: the codes of the first stages only (a truncation, no re-encode).
// Decoding happens on demand (attention), never into storage.
// Legend: P page tokens, Hkv KV heads, Dh head dim.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kv/kv_codec.h"

namespace tiermoe {

// RoPE at one key position; pre-RoPE keys are coded with it undone (sign -1) and decoded
// with it redone (sign +1). Empty inv_freq: keys are coded as they come (post-RoPE).
struct KeyRope {
  std::vector<float> inv_freq;  // [Dh/2] (cpu/ops.h: rope_inv_freq)
  // Optional: the angles of positions [table_first, table_first + table_n) computed once, rows of
  // Dh/2 cosines then Dh/2 sines (angles_table), for decoding the same positions of many heads.
  const float* table = nullptr;
  int table_first = 0, table_n = 0;
  bool on() const { return !inv_freq.empty(); }
  void apply(float* v, int pos, int Dh, float sign) const;
  // table[n, Dh]: the angles of positions first .. first + n - 1, as apply() computes them.
  void angles_table(int first, int n, int Dh, float* table) const;
};

// The codecs of one stream (K or V) of one layer: codec h of KV head h.
struct StreamCodecs {
  const VqCodec* base = nullptr;  // Layer codecs [Hkv][2]
  int kv = 0;                     // 0: K, 1: V
  const VqCodec& operator[](int h) const { return base[size_t(h) * 2 + size_t(kv)]; }
};

struct PageStore {
  std::vector<uint16_t> exact;   // BF16 [n <= P, Hkv, Dh]; freed when the page leaves the window
  std::vector<uint8_t> codes;    // packed, per head h: vq: per slot in code order [P tokens][slot bits]
                                 // (a slot's codes together; the first stages a prefix); else [P][Dh]
  std::vector<uint8_t> anchors;  // vq: FP8 [P, Hkv, anchors]
  std::vector<uint16_t> scales;  // BF16: vq token norms [P, Hkv]; kivi (zero, scale) per group [Hkv][groups]
  int stages = 0;                // vq: stages whose codes are held (middle: all; archive: a prefix)
  int version = 0;               // the codec version (online refit) the page was coded with
  bool coded = false;

  size_t bytes() const {  // allocated
    return exact.capacity() * 2 + codes.capacity() + anchors.capacity() + scales.capacity() * 2;
  }
};

struct PageGeometry {
  int P = 0, Hkv = 0, Dh = 0;
  int first = 0;  // position of the page's first token
};

// Codes the page's BF16 rows (all P of them), keeping them until drop_exact.
void encode_page(PageStore& pg, const StreamCodecs& c, const PageGeometry& geo, const KeyRope& rope);
// Archive migration: keep the codes of the first `stages` stages (vq).
void truncate_page_stages(PageStore& pg, const StreamCodecs& c, const PageGeometry& geo, int stages);
// Decodes head h of a coded page with its first `stages` stages into out[P, Dh]; vq values
// with in_basis stay in the rotated basis (VqCodec::decode).
void decode_page(const PageStore& pg, const StreamCodecs& c, const PageGeometry& geo, int h, int stages,
                 const KeyRope& rope, float* out, bool in_basis = false);
// vq: the codes of token t of head h (the stages the page holds) into codes[], for lookup tables.
void page_codes(const PageStore& pg, const StreamCodecs& c, const PageGeometry& geo, int h, int t, uint16_t* codes);
inline const uint8_t* page_anchors(const PageStore& pg, const StreamCodecs& c, const PageGeometry& geo, int h, int t) {
  const size_t na = c[0].anchors.size();
  return pg.anchors.data() + (size_t(t) * geo.Hkv + size_t(h)) * na;
}
float page_norm(const PageStore& pg, const StreamCodecs& c, const PageGeometry& geo, int h, int t);

}  // namespace tiermoe
