#include "tokenizer/normalize.h"

#include <vector>

#include <unicode/uchar.h>
#include <unicode/unorm2.h>
#include <unicode/ustring.h>

#include "tokenizer/regex.h"
#include "tokenizer/utf8.h"

namespace tiermoe {
namespace {

bool is_ascii(std::string_view s) {
  for (char c : s)
    if (static_cast<uint8_t>(c) >= 0x80) return false;
  return true;
}

std::u16string to_utf16(std::string_view s) {
  UErrorCode err = U_ZERO_ERROR;
  int32_t len = 0;
  u_strFromUTF8(nullptr, 0, &len, s.data(), int32_t(s.size()), &err);
  std::u16string out(size_t(len), u'\0');
  err = U_ZERO_ERROR;
  u_strFromUTF8(reinterpret_cast<UChar*>(out.data()), len, &len, s.data(), int32_t(s.size()), &err);
  CHECK(U_SUCCESS(err));
  return out;
}

std::string to_utf8(const std::u16string& s) {
  UErrorCode err = U_ZERO_ERROR;
  int32_t len = 0;
  const auto* src = reinterpret_cast<const UChar*>(s.data());
  u_strToUTF8(nullptr, 0, &len, src, int32_t(s.size()), &err);
  std::string out(size_t(len), '\0');
  err = U_ZERO_ERROR;
  u_strToUTF8(out.data(), len, &len, src, int32_t(s.size()), &err);
  CHECK(U_SUCCESS(err));
  return out;
}

class SequenceNormalizer : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> parts) : parts_(std::move(parts)) {}
  void apply(std::string& text) const override {
    for (const auto& p : parts_) p->apply(text);
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> parts_;
};

class PrependNormalizer : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prefix) : prefix_(std::move(prefix)) {}
  void apply(std::string& text) const override {
    if (!text.empty()) text = prefix_ + text;  // HF leaves empty text alone
  }

 private:
  std::string prefix_;
};

class ReplaceNormalizer : public Normalizer {
 public:
  ReplaceNormalizer(Regex pattern, std::string content) : pattern_(std::move(pattern)), content_(std::move(content)) {}
  void apply(std::string& text) const override {
    std::vector<std::pair<size_t, size_t>> m;
    pattern_.find_all(text, m);
    if (m.empty()) return;
    std::string out;
    size_t prev = 0;
    for (auto [s, e] : m) {
      out.append(text, prev, s - prev);
      out += content_;  // inserted as-is: HF does not expand $1
      prev = e;
    }
    out.append(text, prev);
    text = std::move(out);
  }

 private:
  Regex pattern_;
  std::string content_;
};

class UnicodeNormalizer : public Normalizer {
 public:
  explicit UnicodeNormalizer(const UNormalizer2* n) : n_(n) {}
  void apply(std::string& text) const override {
    if (is_ascii(text)) return;  // ASCII is invariant under all four forms
    const std::u16string src = to_utf16(text);
    UErrorCode err = U_ZERO_ERROR;
    const auto* s = reinterpret_cast<const UChar*>(src.data());
    if (unorm2_isNormalized(n_, s, int32_t(src.size()), &err) && U_SUCCESS(err)) return;
    err = U_ZERO_ERROR;
    const int32_t len = unorm2_normalize(n_, s, int32_t(src.size()), nullptr, 0, &err);
    std::u16string dst(size_t(len), u'\0');
    err = U_ZERO_ERROR;
    unorm2_normalize(n_, s, int32_t(src.size()), reinterpret_cast<UChar*>(dst.data()), len, &err);
    CHECK(U_SUCCESS(err));
    text = to_utf8(dst);
  }

 private:
  const UNormalizer2* n_;
};

// Rust's char::to_lowercase, one character at a time (no context, so no final-sigma rule),
// which is what HF's NormalizedString::lowercase does.
class LowercaseNormalizer : public Normalizer {
 public:
  void apply(std::string& text) const override {
    std::string out;
    out.reserve(text.size());
    for (size_t i = 0; i < text.size();) {
      const auto c = static_cast<uint8_t>(text[i]);
      if (c < 0x80) {
        out += (c >= 'A' && c <= 'Z') ? char(c + 32) : char(c);
        ++i;
        continue;
      }
      const uint32_t cp = utf8_next(text, i);
      UChar src[2];
      int32_t n = 0;
      U16_APPEND_UNSAFE(src, n, cp);
      UChar dst[8];
      UErrorCode err = U_ZERO_ERROR;
      const int32_t len = u_strToLower(dst, 8, src, n, "", &err);
      if (U_FAILURE(err) || len > 8) {
        utf8_append(out, cp);
        continue;
      }
      for (int32_t k = 0; k < len;) {
        UChar32 c32;
        U16_NEXT(dst, k, len, c32);
        utf8_append(out, uint32_t(c32));
      }
    }
    text = std::move(out);
  }
};

class StripNormalizer : public Normalizer {
 public:
  StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
  void apply(std::string& text) const override {
    size_t begin = 0, end = text.size();
    if (left_) {
      while (begin < end) {
        size_t j = begin;
        if (!is_unicode_whitespace(utf8_next(text, j))) break;
        begin = j;
      }
    }
    if (right_) {
      while (end > begin) {
        size_t j = end - 1;
        while (j > begin && (static_cast<uint8_t>(text[j]) & 0xC0) == 0x80) --j;
        size_t k = j;
        if (!is_unicode_whitespace(utf8_next(text, k))) break;
        end = j;
      }
    }
    text = text.substr(begin, end - begin);
  }

 private:
  bool left_, right_;
};

const UNormalizer2* icu_instance(const std::string& type, const JsonNode& node) {
  UErrorCode err = U_ZERO_ERROR;
  const UNormalizer2* n = nullptr;
  if (type == "NFC") n = unorm2_getNFCInstance(&err);
  else if (type == "NFD") n = unorm2_getNFDInstance(&err);
  else if (type == "NFKC") n = unorm2_getNFKCInstance(&err);
  else n = unorm2_getNFKDInstance(&err);
  if (U_FAILURE(err) || !n) node.fail("'" + type + "': ICU has no data for it (" + u_errorName(err) + ")");
  return n;
}

}  // namespace

bool is_unicode_whitespace(uint32_t cp) { return u_isUWhiteSpace(UChar32(cp)); }

bool is_word_char(uint32_t cp) {
  // Rust regex's Unicode \w: Alphabetic, marks, decimal digits, connector punctuation, joiners.
  const auto c = UChar32(cp);
  return u_hasBinaryProperty(c, UCHAR_ALPHABETIC) ||
         (U_GET_GC_MASK(c) & (U_GC_M_MASK | U_GC_ND_MASK | U_GC_PC_MASK)) != 0 ||
         u_hasBinaryProperty(c, UCHAR_JOIN_CONTROL);
}

std::unique_ptr<Normalizer> parse_normalizer(const JsonNode& node) {
  if (node.is_null()) return nullptr;
  node.expect_object();
  const JsonNode type_node = node.required("type");
  const std::string type = type_node.str();
  if (type == "Sequence") return std::make_unique<SequenceNormalizer>(node.parse_each("normalizers", parse_normalizer));
  if (type == "Prepend") return std::make_unique<PrependNormalizer>(node.required("prepend").str());
  if (type == "Replace") {
    return std::make_unique<ReplaceNormalizer>(parse_pattern(node.required("pattern")), node.required("content").str());
  }
  if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD")
    return std::make_unique<UnicodeNormalizer>(icu_instance(type, type_node));
  if (type == "Lowercase") return std::make_unique<LowercaseNormalizer>();
  if (type == "Strip")
    return std::make_unique<StripNormalizer>(node.get("strip_left").bool_or(true),
                                             node.get("strip_right").bool_or(true));
  type_node.fail("'" + type +
                 "' is not supported (supported: Sequence, Prepend, Replace, NFC, NFD, NFKC, NFKD, "
                 "Lowercase, Strip)");
}

}  // namespace tiermoe
