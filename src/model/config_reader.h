// Typed access to config.json fields; every error names the file and the field.
#pragma once
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/check.h"

namespace tiermoe {

class ConfigReader {
 public:
  ConfigReader(const nlohmann::json& j, std::string source) : j_(j), source_(std::move(source)) {}

  // The first of `keys` present and not null (aliases: num_experts / num_local_experts).
  const nlohmann::json* find(std::initializer_list<const char*> keys) const {
    for (const char* k : keys)
      if (j_.contains(k) && !j_[k].is_null()) return &j_[k];
    return nullptr;
  }
  bool has(const char* key) const { return find({key}) != nullptr; }

  int get_int(std::initializer_list<const char*> keys, std::optional<int> fallback = {}) const {
    const nlohmann::json* v = find(keys);
    if (!v) return require(fallback, keys);
    if (!v->is_number_integer() || v->get<int64_t>() < 0 || v->get<int64_t>() > (1 << 30))
      fail(*keys.begin(), "must be a non-negative integer, got " + v->dump());
    return v->get<int>();
  }
  double get_float(std::initializer_list<const char*> keys, std::optional<double> fallback = {}) const {
    const nlohmann::json* v = find(keys);
    if (!v) return require(fallback, keys);
    if (!v->is_number()) fail(*keys.begin(), "must be a number, got " + v->dump());
    return v->get<double>();
  }
  bool get_bool(const char* key, bool fallback) const {
    const nlohmann::json* v = find({key});
    if (!v) return fallback;
    if (!v->is_boolean()) fail(key, "must be true or false, got " + v->dump());
    return v->get<bool>();
  }
  std::vector<int> get_int_list(const char* key) const {
    std::vector<int> out;
    const nlohmann::json* v = find({key});
    if (!v) return out;
    if (!v->is_array()) fail(key, "must be a list of integers, got " + v->dump());
    for (auto& e : *v) {
      if (!e.is_number_integer()) fail(key, "must be a list of integers, got " + v->dump());
      out.push_back(e.get<int>());
    }
    return out;
  }

  [[noreturn]] void fail(const std::string& field, const std::string& what) const {
    throw InputError(source_ + ": field '" + field + "' " + what);
  }
  const nlohmann::json& json() const { return j_; }
  const std::string& source() const { return source_; }

 private:
  template <class T>
  T require(const std::optional<T>& fallback, std::initializer_list<const char*> keys) const {
    if (fallback) return *fallback;
    fail(*keys.begin(), "is missing");
  }
  const nlohmann::json& j_;
  std::string source_;
};

}  // namespace tiermoe
