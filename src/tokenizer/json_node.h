// A cursor into a parsed JSON document that remembers where it is ("model.vocab",
// "pre_tokenizer.pretokenizers[1].type"), so that every complaint about a tokenizer file names
// the file and the field. Absent and null members read the same: HF treats them alike.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/check.h"

namespace tiermoe {

class JsonNode {
 public:
  JsonNode(const nlohmann::json& j, std::string file, std::string path = "")
      : j_(&j), file_(std::move(file)), path_(std::move(path)) {}

  const nlohmann::json& json() const { return *j_; }
  const std::string& file() const { return file_; }
  const std::string& path() const { return path_; }
  bool is_null() const { return j_->is_null(); }
  bool is_string() const { return j_->is_string(); }
  bool is_array() const { return j_->is_array(); }
  bool is_object() const { return j_->is_object(); }

  [[noreturn]] void fail(const std::string& what) const {
    throw InputError(file_ + ": " + (path_.empty() ? std::string() : path_ + " ") + what);
  }

  // Member `key`; a null node if it is absent (or if this is not an object: callers that
  // need an object say so with expect_object()).
  JsonNode get(std::string_view key) const {
    const std::string p = path_.empty() ? std::string(key) : path_ + "." + std::string(key);
    if (j_->is_object()) {
      auto it = j_->find(key);
      if (it != j_->end()) return JsonNode(*it, file_, p);
    }
    return JsonNode(null_json(), file_, p);
  }
  JsonNode required(std::string_view key) const {
    JsonNode n = get(key);
    if (n.is_null()) n.fail("is missing");
    return n;
  }
  size_t size() const {
    expect_array();
    return j_->size();
  }
  JsonNode at(size_t i) const {
    expect_array();
    return JsonNode((*j_)[i], file_, path_ + "[" + std::to_string(i) + "]");
  }
  // parse(element) for each element of the array member `key`, null results left out: the parts
  // of a tokenizer.json "Sequence" component (normalizers, pre-tokenizers, decoders).
  template <class Parse>
  auto parse_each(std::string_view key, Parse parse) const {
    const JsonNode list = required(key);
    std::vector<decltype(parse(list))> parts;
    for (size_t i = 0; i < list.size(); ++i)
      if (auto part = parse(list.at(i))) parts.push_back(std::move(part));
    return parts;
  }

  void expect_object() const {
    if (!j_->is_object()) fail("must be a JSON object (found " + type_name() + ")");
  }
  void expect_array() const {
    if (!j_->is_array()) fail("must be a JSON array (found " + type_name() + ")");
  }
  std::string str() const {
    if (!j_->is_string()) fail("must be a string (found " + type_name() + ")");
    return j_->get<std::string>();
  }
  bool boolean() const {
    if (!j_->is_boolean()) fail("must be true or false (found " + type_name() + ")");
    return j_->get<bool>();
  }
  int64_t integer() const {
    if (!j_->is_number_integer()) fail("must be an integer (found " + type_name() + ")");
    return j_->get<int64_t>();
  }
  double number() const {
    if (!j_->is_number()) fail("must be a number (found " + type_name() + ")");
    return j_->get<double>();
  }
  std::string str_or(std::string def) const { return is_null() ? def : str(); }
  bool bool_or(bool def) const { return is_null() ? def : boolean(); }
  int64_t int_or(int64_t def) const { return is_null() ? def : integer(); }

  std::string type_name() const { return j_->type_name(); }

 private:
  static const nlohmann::json& null_json() {
    static const nlohmann::json n;
    return n;
  }
  const nlohmann::json* j_;
  std::string file_;
  std::string path_;
};

}  // namespace tiermoe
