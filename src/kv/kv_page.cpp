#include "kv/kv_page.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "core/dtype.h"
#include "cpu/ops.h"
#include "cpu/simd.h"

namespace tiermoe {
namespace {

// Little-endian bit fields in a byte array (codes are at most 16 bits wide).
void put_bits(uint8_t* buf, size_t off, uint32_t v, int n) {
  while (n > 0) {
    const int sh = int(off & 7), take = std::min(8 - sh, n);
    buf[off >> 3] = uint8_t(buf[off >> 3] | ((v & ((1u << take) - 1)) << sh));
    v >>= take, off += size_t(take), n -= take;
  }
}
// Reads only the bytes the field touches (at most 3 for 16 bits): a code at the buffer's end is
// never read past it. Runs per code per key at every decode step, hence no loop.
uint32_t get_bits(const uint8_t* buf, size_t off, int n) {
  if (n == 0) return 0;
  const size_t i = off >> 3;
  const int sh = int(off & 7);
  uint32_t v = buf[i];
  if (sh + n > 8) v |= uint32_t(buf[i + 1]) << 8;
  if (sh + n > 16) v |= uint32_t(buf[i + 2]) << 16;
  return (v >> sh) & ((1u << n) - 1);
}

// One slot's codes for the P tokens of a page, at bit `off`, as codewords into the slot's channels
// of yt[Dh, P] (channel-major): assigned by the first stage, added by the later ones, in the order
// VqCodec::decode adds them. 16 tokens of a scalar slot of at most 4 bits (most of them) are one
// 8-byte load, shifts, and a codebook lookup by register permutes; of 5 to 8 bits, two gathers per
// 8 tokens.
void decode_slot(const std::vector<uint8_t>& codes, size_t off, int P, const VqSlot& slot, const int* rest, bool first,
                 float* yt) {
  const int b = slot.bits;
  if (slot.len == 1 && P == 16 && b <= 4 && off % 8 == 0 && off / 8 + 8 <= codes.size()) {
    // Per width b: token t's shift t * b, and the codebook lanes that exist (2^b, at most 8 here).
    alignas(32) static constexpr int32_t kShift[5][8] = {{0, 0, 0, 0, 0, 0, 0, 0},       {0, 1, 2, 3, 4, 5, 6, 7},
                                                         {0, 2, 4, 6, 8, 10, 12, 14},    {0, 3, 6, 9, 12, 15, 18, 21},
                                                         {0, 4, 8, 12, 16, 20, 24, 28}};
    alignas(32) static constexpr int32_t kInBook[5][8] = {{-1, 0, 0, 0, 0, 0, 0, 0},      {-1, -1, 0, 0, 0, 0, 0, 0},
                                                          {-1, -1, -1, -1, 0, 0, 0, 0},   {-1, -1, -1, -1, -1, -1, -1, -1},
                                                          {-1, -1, -1, -1, -1, -1, -1, -1}};
    const float* book = slot.book.data();  // lanes past its 2^b codewords are not read
    const __m256 lo = _mm256_maskload_ps(book, _mm256_load_si256(reinterpret_cast<const __m256i*>(kInBook[b]))),
                 hi = b == 4 ? _mm256_loadu_ps(book + 8) : lo;
    uint64_t w;
    std::memcpy(&w, codes.data() + off / 8, 8);
    const __m256i shift = _mm256_load_si256(reinterpret_cast<const __m256i*>(kShift[b]));
    const __m256i mask = _mm256_set1_epi32((1 << b) - 1);
    float* dst = yt + size_t(rest[slot.c0]) * 16;
    for (int half = 0; half < 2; ++half) {  // tokens 8 * half .. 8 * half + 7
      const uint32_t bits = uint32_t(w >> (8 * b * half));
      const __m256i code = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(bits)), shift), mask);
      __m256 v = _mm256_permutevar8x32_ps(lo, code);
      if (b == 4)  // codes 8..15 from the second register, chosen by the code's bit 3
        v = _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(hi, code), _mm256_castsi256_ps(_mm256_slli_epi32(code, 28)));
      float* d = dst + 8 * half;
      _mm256_storeu_ps(d, first ? v : _mm256_add_ps(_mm256_loadu_ps(d), v));
    }
    return;
  }
  if (slot.len == 1 && P == 16 && b <= 8 && off % 8 == 0 && off / 8 + size_t(2 * b + 4) <= codes.size()) {
    // Wider codes: each token's 32-bit window gathered from its first byte, its codeword gathered.
    const int* base = reinterpret_cast<const int*>(codes.data() + off / 8);
    const __m256i mask = _mm256_set1_epi32((1 << b) - 1);
    float* dst = yt + size_t(rest[slot.c0]) * 16;
    for (int half = 0; half < 2; ++half) {
      const __m256i bit = _mm256_mullo_epi32(_mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * half)),
                                             _mm256_set1_epi32(b));
      const __m256i window = _mm256_i32gather_epi32(base, _mm256_srli_epi32(bit, 3), 1);
      const __m256i code = _mm256_and_si256(_mm256_srlv_epi32(window, _mm256_and_si256(bit, _mm256_set1_epi32(7))), mask);
      const __m256 v = _mm256_i32gather_ps(slot.book.data(), code, 4);
      float* d = dst + 8 * half;
      _mm256_storeu_ps(d, first ? v : _mm256_add_ps(_mm256_loadu_ps(d), v));
    }
    return;
  }
  for (int t = 0; t < P; ++t) {
    const float* cw = slot.book.data() + size_t(get_bits(codes.data(), off + size_t(t) * size_t(b), b)) * size_t(slot.len);
    for (int l = 0; l < slot.len; ++l) {
      float& y = yt[size_t(rest[slot.c0 + l]) * P + t];
      y = first ? cw[l] : y + cw[l];
    }
  }
}

// out[P, Dh] = yt[Dh, P] transposed, by 8 x 8 blocks in registers where both are multiples of 8.
void transpose_page(const float* yt, int Dh, int P, float* out) {
  if (Dh % 8 != 0 || P % 8 != 0) {
    for (int r = 0; r < Dh; ++r)
      for (int t = 0; t < P; ++t) out[size_t(t) * Dh + r] = yt[size_t(r) * P + t];
    return;
  }
  for (int r0 = 0; r0 < Dh; r0 += 8)
    for (int t0 = 0; t0 < P; t0 += 8) {
      __m256 a[8], b[8];
      for (int i = 0; i < 8; ++i) a[i] = _mm256_loadu_ps(yt + size_t(r0 + i) * P + t0);
      for (int i = 0; i < 8; i += 2) {
        b[i] = _mm256_unpacklo_ps(a[i], a[i + 1]);
        b[i + 1] = _mm256_unpackhi_ps(a[i], a[i + 1]);
      }
      for (int i = 0; i < 8; i += 4)
        for (int j = 0; j < 2; ++j) {
          a[i + j] = _mm256_shuffle_ps(b[i + j], b[i + j + 2], _MM_SHUFFLE(1, 0, 1, 0));
          a[i + j + 2] = _mm256_shuffle_ps(b[i + j], b[i + j + 2], _MM_SHUFFLE(3, 2, 3, 2));
        }
      // a[0]: tokens 0, 4 of rows 0-3 / 4-7 in lanes; a[2]: 1, 5; a[1]: 2, 6; a[3]: 3, 7 (and a[4..7])
      const int order[4] = {0, 2, 1, 3};
      for (int k = 0; k < 4; ++k) {
        const __m256 lo = a[order[k]], hi = a[4 + order[k]];
        _mm256_storeu_ps(out + size_t(t0 + k) * Dh + r0, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps(out + size_t(t0 + k + 4) * Dh + r0, _mm256_permute2f128_ps(lo, hi, 0x31));
      }
    }
}

bool is_vq(const StreamCodecs& c) { return c[0].kind == "vq"; }

// Bits of one token's record of head h: vq codes of the first `stages` stages, or Dh
// elements (kivi levels, fp8 bytes, bf16 halves).
int record_bits(const VqCodec& c, int stages) {
  if (c.kind == "kivi") return c.kivi_bits * c.d;
  if (c.kind == "fp8") return 8 * c.d;
  if (c.kind == "bf16") return 16 * c.d;
  int b = 0;
  for (int s = 0; s < stages && s < c.n_stages(); ++s)
    for (const VqSlot& slot : c.stages[size_t(s)]) b += slot.bits;
  return b;
}
size_t head_bit_offset(const StreamCodecs& c, const PageGeometry& geo, int h, int stages) {
  size_t off = 0;
  for (int i = 0; i < h; ++i) off += size_t(geo.P) * size_t(record_bits(c[i], stages));
  return off;
}
size_t packed_bytes(const StreamCodecs& c, const PageGeometry& geo, int stages) {
  return (head_bit_offset(c, geo, geo.Hkv, stages) + 7) / 8;
}
// Slot widths of the codes of the first `stages` stages, in code order.
void code_widths(const VqCodec& c, int stages, std::vector<int>& w) {
  w.clear();
  for (int s = 0; s < stages && s < c.n_stages(); ++s)
    for (const VqSlot& slot : c.stages[size_t(s)]) w.push_back(slot.bits);
}

}  // namespace

void KeyRope::apply(float* v, int pos, int Dh, float sign) const {
  if (table && pos >= table_first && pos < table_first + table_n) {
    const float* row = table + size_t(pos - table_first) * size_t(Dh);
    rope_rotate(v, row, row + Dh / 2, Dh / 2, sign);
    return;
  }
  float cs[128], sn[128];
  rope_angles(inv_freq.data(), Dh / 2, pos, cs, sn);
  rope_rotate(v, cs, sn, Dh / 2, sign);
}

void KeyRope::angles_table(int first, int n, int Dh, float* out) const {
  for (int i = 0; i < n; ++i) {
    float* row = out + size_t(i) * size_t(Dh);
    rope_angles(inv_freq.data(), Dh / 2, first + i, row, row + Dh / 2);
  }
}

void encode_page(PageStore& pg, const StreamCodecs& c, const PageGeometry& geo, const KeyRope& rope) {
  const int P = geo.P, Hkv = geo.Hkv, Dh = geo.Dh;
  CHECK(pg.exact.size() == size_t(P) * Hkv * Dh && !pg.coded);
  const bool vq = is_vq(c), unrope = c.kv == 0 && rope.on() && vq;
  pg.stages = vq ? c[0].n_stages() : 0;
  pg.codes.assign(packed_bytes(c, geo, pg.stages), 0);
  const size_t na = vq ? c[0].anchors.size() : 0;
  pg.anchors.assign(size_t(P) * Hkv * na, 0);
  pg.scales.clear();
  if (vq && c[0].token_norm) pg.scales.resize(size_t(P) * Hkv);
  if (c[0].kind == "kivi") pg.scales.resize(size_t(Hkv) * c[0].kivi_groups(P, c.kv == 0) * 2);
  std::vector<float> x(size_t(P) * Dh);
  std::vector<uint16_t> codes;
  std::vector<int> width;
  for (int h = 0; h < Hkv; ++h) {
    const VqCodec& cd = c[h];
    for (int t = 0; t < P; ++t)
      for (int i = 0; i < Dh; ++i) x[size_t(t) * Dh + i] = bf16_to_f32(pg.exact[(size_t(t) * Hkv + h) * Dh + i]);
    size_t off = head_bit_offset(c, geo, h, pg.stages);
    if (cd.kind == "kivi") {
      std::vector<uint8_t> levels(size_t(P) * Dh);
      cd.kivi_encode(x.data(), P, size_t(Dh), c.kv == 0, levels.data(),
                     pg.scales.data() + size_t(h) * cd.kivi_groups(P, c.kv == 0) * 2);
      for (uint8_t l : levels) put_bits(pg.codes.data(), off, l, cd.kivi_bits), off += size_t(cd.kivi_bits);
      continue;
    }
    if (!vq) {  // fp8 / bf16: one element code per value
      for (float v : x) {
        const uint32_t code = cd.kind == "fp8" ? f32_to_fp8_e4m3(v / cd.fp8_scale) : f32_to_bf16(v);
        const int n = cd.kind == "fp8" ? 8 : 16;
        put_bits(pg.codes.data(), off, code, n), off += size_t(n);
      }
      continue;
    }
    codes.resize(size_t(cd.n_codes()));
    code_widths(cd, pg.stages, width);
    for (int t = 0; t < P; ++t) {
      float* xt = x.data() + size_t(t) * Dh;
      if (unrope) rope.apply(xt, geo.first + t, Dh, -1.f);
      float norm;
      cd.encode(xt, codes.data(), pg.anchors.data() + (size_t(t) * Hkv + h) * na, &norm);
      if (!pg.scales.empty()) pg.scales[size_t(t) * Hkv + h] = f32_to_bf16(norm);  // BF16-rounded by encode
      size_t slot_off = off;  // slot k's P codes follow the P codes of every slot before it
      for (size_t k = 0; k < width.size(); ++k) {
        put_bits(pg.codes.data(), slot_off + size_t(t) * size_t(width[k]), codes[k], width[k]);
        slot_off += size_t(P) * size_t(width[k]);
      }
    }
  }
  pg.coded = true;
}

void truncate_page_stages(PageStore& pg, const StreamCodecs& c, const PageGeometry& geo, int stages) {
  CHECK(pg.coded);
  if (!is_vq(c) || stages >= pg.stages) return;
  std::vector<uint8_t> kept(packed_bytes(c, geo, stages), 0);
  for (int h = 0; h < geo.Hkv; ++h) {
    const int to = record_bits(c[h], stages);
    const size_t src = head_bit_offset(c, geo, h, pg.stages), dst = head_bit_offset(c, geo, h, stages);
    const size_t bits = size_t(geo.P) * size_t(to);  // the head's codes of its first stages are a prefix
    for (size_t b = 0; b < bits; b += 16) {
      const int n = int(std::min<size_t>(16, bits - b));
      put_bits(kept.data(), dst + b, get_bits(pg.codes.data(), src + b, n), n);
    }
  }
  pg.codes = std::move(kept);
  pg.stages = stages;
}

void page_codes(const PageStore& pg, const StreamCodecs& c, const PageGeometry& geo, int h, int t, uint16_t* codes) {
  const VqCodec& cd = c[h];
  size_t off = head_bit_offset(c, geo, h, pg.stages);
  int k = 0;
  for (int s = 0; s < pg.stages; ++s)
    for (const VqSlot& slot : cd.stages[size_t(s)]) {
      codes[k++] = uint16_t(get_bits(pg.codes.data(), off + size_t(t) * size_t(slot.bits), slot.bits));
      off += size_t(geo.P) * size_t(slot.bits);
    }
}

float page_norm(const PageStore& pg, const StreamCodecs& c, const PageGeometry& geo, int h, int t) {
  (void)c;
  return pg.scales.empty() ? 1.f : bf16_to_f32(pg.scales[size_t(t) * geo.Hkv + h]);
}

void decode_page(const PageStore& pg, const StreamCodecs& c, const PageGeometry& geo, int h, int stages,
                 const KeyRope& rope, float* out, bool in_basis) {
  CHECK(pg.coded);
  CHECK(!in_basis || (c.kv == 1 && is_vq(c)));
  const int P = geo.P, Dh = geo.Dh;
  const VqCodec& cd = c[h];
  size_t off = head_bit_offset(c, geo, h, pg.stages);
  if (cd.kind == "kivi") {
    std::vector<uint8_t> levels(size_t(P) * Dh);
    for (auto& l : levels) l = uint8_t(get_bits(pg.codes.data(), off, cd.kivi_bits)), off += size_t(cd.kivi_bits);
    cd.kivi_decode(levels.data(), pg.scales.data() + size_t(h) * cd.kivi_groups(P, c.kv == 0) * 2, P, c.kv == 0, out, size_t(Dh));
    return;
  }
  if (!is_vq(c)) {
    for (int i = 0; i < P * Dh; ++i)
      out[i] = cd.kind == "fp8" ? fp8_e4m3_to_f32(uint8_t(get_bits(pg.codes.data(), off + size_t(i) * 8, 8))) * cd.fp8_scale
                                : bf16_to_f32(uint16_t(get_bits(pg.codes.data(), off + size_t(i) * 16, 16)));
    return;
  }
  CHECK(stages <= pg.stages);
  // Slot by slot into yt[Dh, P], channel-major like the codes; then into out[P, Dh], transposed
  // (in_basis) or brought back to the model's basis together (from_basis_rows: each row of the
  // rotation read once per 4 tokens, the channels without bits summed once).
  thread_local std::vector<float> yt_buf;
  yt_buf.resize(size_t(Dh) * P);
  float* yt = yt_buf.data();
  if (stages == 0)
    for (int r : cd.rest) std::fill_n(yt + size_t(r) * P, P, 0.f);
  for (int s = 0; s < stages; ++s)
    for (const VqSlot& slot : cd.stages[size_t(s)]) {
      decode_slot(pg.codes, off, P, slot, cd.rest.data(), s == 0, yt);
      off += size_t(P) * size_t(slot.bits);
    }
  for (size_t a = 0; a < cd.anchors.size(); ++a)
    for (int t = 0; t < P; ++t)
      yt[size_t(cd.anchors[a]) * P + t] = fp8_e4m3_to_f32(page_anchors(pg, c, geo, h, t)[a]) * cd.anchor_scale[a];
  if (cd.token_norm)
    for (int t = 0; t < P; ++t) {
      const float norm = page_norm(pg, c, geo, h, t);
      for (int r : cd.rest) yt[size_t(r) * P + t] *= norm;
    }
  if (in_basis) {
    transpose_page(yt, Dh, P, out);
  } else {
    uint8_t constant[256];
    cd.constant_channels(stages, constant);
    cd.from_basis_rows(yt, P, out, constant, /*channel_major=*/true);
  }
  if (c.kv == 0 && rope.on())
    for (int t = 0; t < P; ++t) rope.apply(out + size_t(t) * Dh, geo.first + t, Dh, 1.f);
}

}  // namespace tiermoe
