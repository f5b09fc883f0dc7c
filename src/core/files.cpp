#include "core/files.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/check.h"

namespace tiermoe {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path + ": cannot be read (" + std::strerror(errno) + ")");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

nlohmann::json parse_json(const std::string& text, const std::string& source) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(source + ": invalid JSON: " + e.what());
  }
}

nlohmann::json read_json_file(const std::string& path) { return parse_json(read_file(path), path); }

}  // namespace tiermoe
