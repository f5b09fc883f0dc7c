#include "kv/kv_page.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/check.h"
#include "core/dtype.h"
#include "cpu/ops.h"

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

// get_bits with one unaligned 8-byte load where 8 bytes remain from the field's first byte: the
// decode loop's read, per code per key at every step.
inline uint32_t read_bits(const std::vector<uint8_t>& buf, size_t off, int n) {
  const size_t i = off >> 3;
  if (i + 8 > buf.size()) return get_bits(buf.data(), off, n);
  uint64_t w;
  std::memcpy(&w, buf.data() + i, 8);
  return uint32_t(w >> (off & 7)) & ((1u << n) - 1);
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
      for (size_t k = 0; k < width.size(); ++k) put_bits(pg.codes.data(), off, codes[k], width[k]), off += size_t(width[k]);
    }
  }
  pg.coded = true;
}

void truncate_page_stages(PageStore& pg, const StreamCodecs& c, const PageGeometry& geo, int stages) {
  CHECK(pg.coded);
  if (!is_vq(c) || stages >= pg.stages) return;
  std::vector<uint8_t> kept(packed_bytes(c, geo, stages), 0);
  for (int h = 0; h < geo.Hkv; ++h) {
    const int from = record_bits(c[h], pg.stages), to = record_bits(c[h], stages);
    const size_t src = head_bit_offset(c, geo, h, pg.stages), dst = head_bit_offset(c, geo, h, stages);
    for (int t = 0; t < geo.P; ++t)  // a record's prefix is the codes of its first stages
      for (int b = 0; b < to; b += 16) {
        const int n = std::min(16, to - b);
        put_bits(kept.data(), dst + size_t(t) * to + b, get_bits(pg.codes.data(), src + size_t(t) * from + b, n), n);
      }
  }
  pg.codes = std::move(kept);
  pg.stages = stages;
}

void page_codes(const PageStore& pg, const StreamCodecs& c, const PageGeometry& geo, int h, int t, uint16_t* codes) {
  const VqCodec& cd = c[h];
  size_t off = head_bit_offset(c, geo, h, pg.stages) + size_t(t) * record_bits(cd, pg.stages);
  int k = 0;
  for (int s = 0; s < pg.stages; ++s)
    for (const VqSlot& slot : cd.stages[size_t(s)]) codes[k++] = uint16_t(get_bits(pg.codes.data(), off, slot.bits)), off += size_t(slot.bits);
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
  // The rows in the codec's basis first (into out itself when they stay there), then brought back
  // together (from_basis_rows: one pass over the rotation per 4 rows, not one per row, and the
  // channels without bits summed once).
  thread_local std::vector<float> in_rot;
  float* y = out;
  if (!in_basis) {
    in_rot.resize(size_t(P) * Dh);
    y = in_rot.data();
  }
  const int record = record_bits(cd, pg.stages);  // off: the head's first record
  for (int t = 0; t < P; ++t) {
    size_t at = off + size_t(t) * size_t(record);
    auto next_code = [&](int bits) {
      const uint32_t code = read_bits(pg.codes, at, bits);
      at += size_t(bits);
      return code;
    };
    cd.decode_with(next_code, page_anchors(pg, c, geo, h, t), page_norm(pg, c, geo, h, t), stages, y + size_t(t) * Dh, true);
  }
  if (!in_basis) {
    uint8_t constant[256];
    cd.constant_channels(stages, constant);
    cd.from_basis_rows(y, P, out, constant);
  }
  if (c.kv == 0 && rope.on())
    for (int t = 0; t < P; ++t) rope.apply(out + size_t(t) * Dh, geo.first + t, Dh, 1.f);
}

}  // namespace tiermoe
