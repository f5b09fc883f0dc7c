#include "tokenizer/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "core/check.h"
#include "tokenizer/json_node.h"

namespace tiermoe {
namespace {

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  if (pcre2_get_error_message(code, buf, sizeof(buf)) < 0) return "error " + std::to_string(code);
  return reinterpret_cast<const char*>(buf);
}

// Per-thread match state: match data and a JIT stack bigger than PCRE2's 32 KiB default, so
// long runs of whitespace or letters cannot exhaust it.
struct MatchScratch {
  pcre2_match_data* data = pcre2_match_data_create(16, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* jit_stack = pcre2_jit_stack_create(64 * 1024, 16 * 1024 * 1024, nullptr);
  MatchScratch() {
    CHECK(data && context);
    if (jit_stack) pcre2_jit_stack_assign(context, nullptr, jit_stack);
  }
  ~MatchScratch() {
    pcre2_match_data_free(data);
    pcre2_match_context_free(context);
    if (jit_stack) pcre2_jit_stack_free(jit_stack);
  }
};

}  // namespace

Regex::Regex(std::string_view pattern, bool literal, std::string where) : where_(std::move(where)) {
  int err = 0;
  PCRE2_SIZE err_offset = 0;
  uint32_t options = PCRE2_UTF | PCRE2_UCP;
  if (literal) options = PCRE2_UTF | PCRE2_LITERAL;  // UCP is not allowed with LITERAL (and not needed)
  code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options, &err,
                        &err_offset, nullptr);
  if (!code_)
    throw InputError(where_ + ": cannot compile regex '" + std::string(pattern) + "' at offset " +
                     std::to_string(err_offset) + ": " + pcre2_message(err));
  pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // failure just means the interpreter is used
}

Regex::~Regex() {
  if (code_) pcre2_code_free(code_);
}

Regex::Regex(Regex&& o) noexcept : code_(o.code_), where_(std::move(o.where_)) { o.code_ = nullptr; }

void Regex::find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& out) const {
  thread_local MatchScratch scratch;
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  // Oniguruma's find_iter, as HF uses it: search from the end of the previous match; an empty
  // match right where the previous match ended is skipped by moving one character on.
  size_t search_from = 0;
  bool have_last = false;
  size_t last_end = 0;
  while (search_from <= text.size()) {
    const int rc = pcre2_match(code_, subject, text.size(), search_from, PCRE2_NO_UTF_CHECK,
                               scratch.data, scratch.context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) throw InputError(where_ + ": regex match failed: " + pcre2_message(rc));
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(scratch.data);
    const size_t s = ov[0], e = ov[1];
    if (s == e && have_last && last_end == e) {
      if (search_from >= text.size()) break;
      // step over one UTF-8 character
      size_t step = 1;
      while (search_from + step < text.size() &&
             (static_cast<uint8_t>(text[search_from + step]) & 0xC0) == 0x80)
        ++step;
      search_from += step;
      continue;
    }
    out.emplace_back(s, e);
    search_from = e;
    have_last = true;
    last_end = e;
  }
}

Regex parse_pattern(const JsonNode& pattern) {
  pattern.expect_object();
  const JsonNode lit = pattern.get("String"), re = pattern.get("Regex");
  const JsonNode& which = lit.is_null() ? re : lit;
  if (which.is_null()) pattern.fail("must have a \"String\" or \"Regex\" member");
  return Regex(which.str(), !lit.is_null(), which.file() + ": " + which.path());
}

}  // namespace tiermoe
