// Reading whole input files; errors name the path.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

namespace tiermoe {

std::string read_file(const std::string& path);             // InputError "PATH: cannot be read (why)"
nlohmann::json read_json_file(const std::string& path);     // InputError "PATH: invalid JSON: ..." too
nlohmann::json parse_json(const std::string& text, const std::string& source);  // errors name `source`

}  // namespace tiermoe
