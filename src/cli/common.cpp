#include "cli/common.h"

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "core/check.h"

namespace tiermoe {

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path + ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<int> parse_int_list(const std::string& text, const std::string& what) {
  std::vector<int> out;
  std::string s = text;
  size_t first = s.find_first_not_of(" \t\r\n");
  if (first != std::string::npos && s[first] == '[') {
    try {
      for (auto& v : nlohmann::json::parse(s)) out.push_back(v.get<int>());
    } catch (const std::exception& e) {
      throw InputError(what + ": not a JSON list of integers: " + e.what());
    }
    return out;
  }
  for (char& ch : s)
    if (ch == ',' || ch == '\n' || ch == '\t' || ch == '\r') ch = ' ';
  std::istringstream in(s);
  std::string tok;
  while (in >> tok) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(tok, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != tok.size() || v < INT32_MIN || v > INT32_MAX)
      throw InputError(what + ": '" + tok + "' is not an integer");
    out.push_back(int(v));
  }
  return out;
}

std::vector<int32_t> parse_id_list(const std::string& text, const std::string& what) {
  std::vector<int> v = parse_int_list(text, what);
  if (v.empty()) throw InputError(what + ": no token ids given");
  return std::vector<int32_t>(v.begin(), v.end());
}

ProgressBar::ProgressBar(std::string label, size_t total)
    : label_(std::move(label)), total_(total), tty_(isatty(STDERR_FILENO)) {}

void ProgressBar::update(size_t done, const std::string& suffix) {
  using clock = std::chrono::steady_clock;
  const double now = std::chrono::duration<double>(clock::now().time_since_epoch()).count();
  if (done < total_ && now - last_draw_ < (tty_ ? 0.1 : 5.0)) return;
  last_draw_ = now;
  const int width = 30;
  const int filled = total_ ? int(width * double(done) / double(total_)) : width;
  std::string bar(size_t(filled), '#');
  bar.resize(width, '.');
  std::fprintf(stderr, "%s%s [%s] %zu/%zu %s%s", tty_ ? "\r" : "", label_.c_str(), bar.c_str(), done, total_,
               suffix.c_str(), tty_ ? "\033[K" : "\n");
  std::fflush(stderr);
}

void ProgressBar::finish() {
  if (tty_) std::fputc('\n', stderr);
}

}  // namespace tiermoe
