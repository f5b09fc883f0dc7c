#include "io/safetensors.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/files.h"

namespace tiermoe {
namespace {

using json = nlohmann::json;

bool parse_dtype(const std::string& s, DType* out) {
  static const std::map<std::string, DType> names = {
      {"F32", DType::F32}, {"F16", DType::F16}, {"BF16", DType::BF16},
      {"I64", DType::I64}, {"I32", DType::I32}};
  auto it = names.find(s);
  if (it == names.end()) return false;
  *out = it->second;
  return true;
}

}  // namespace

std::string TensorView::shape_str() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

SafetensorsFile::SafetensorsFile(const std::string& path) : file_(path) {
  const size_t size = file_.size();
  auto fail = [&](const std::string& what) { throw InputError(path + ": " + what); };
  if (size < 8) fail("truncated safetensors file (" + std::to_string(size) + " bytes, no header length)");
  uint64_t header_len;
  std::memcpy(&header_len, file_.data(), 8);
  if (header_len > size - 8)
    fail("header length " + std::to_string(header_len) + " runs past the end of the file (" +
         std::to_string(size) + " bytes)");
  json header;
  try {
    header = json::parse(file_.data() + 8, file_.data() + 8 + header_len);
  } catch (const json::exception& e) {
    fail(std::string("header is invalid JSON: ") + e.what());
  }
  if (!header.is_object()) fail("header is not a JSON object");

  const uint8_t* base = file_.data() + 8 + header_len;
  const uint64_t data_size = size - 8 - header_len;
  std::vector<std::pair<uint64_t, uint64_t>> extents;
  std::vector<std::string> extent_names;
  for (auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    auto tfail = [&](const std::string& what) { fail("tensor '" + name + "': " + what); };
    if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") ||
        !entry.contains("data_offsets"))
      tfail("entry needs dtype, shape and data_offsets");
    TensorView t;
    t.name = name;
    if (!entry["dtype"].is_string() || !parse_dtype(entry["dtype"].get<std::string>(), &t.dtype))
      tfail("unsupported dtype " + entry["dtype"].dump() + " (supported: F32, F16, BF16, I64, I32)");
    if (!entry["shape"].is_array()) tfail("shape is not an array");
    uint64_t numel = 1;
    for (auto& d : entry["shape"]) {
      if (!d.is_number_unsigned()) tfail("shape has a non-integer or negative dimension");
      uint64_t v = d.get<uint64_t>();
      if (v > (uint64_t(1) << 40) || (v && numel > (uint64_t(1) << 48) / v)) tfail("shape is too large");
      numel *= v;
      t.shape.push_back(int64_t(v));
    }
    auto& off = entry["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      tfail("data_offsets must be two non-negative integers");
    uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (begin > end) tfail("data_offsets begin after they end");
    if (end > data_size)
      tfail("data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
            ") run past the end of the file (data section is " + std::to_string(data_size) +
            " bytes; truncated file?)");
    if (end - begin != numel * dtype_size(t.dtype))
      tfail("data_offsets span " + std::to_string(end - begin) + " bytes but shape " + t.shape_str() +
            " of " + std::string(dtype_name(t.dtype)) + " needs " + std::to_string(numel * dtype_size(t.dtype)));
    t.data = base + begin;
    t.file = &file_.path();
    extents.push_back({begin, end});
    extent_names.push_back(name);
    tensors_.emplace(name, std::move(t));
  }
  std::vector<size_t> order(extents.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return extents[a] < extents[b]; });
  for (size_t i = 1; i < order.size(); ++i) {
    auto& prev = extents[order[i - 1]];
    auto& cur = extents[order[i]];
    if (cur.first < prev.second && cur.first != cur.second && prev.first != prev.second)
      fail("tensors '" + extent_names[order[i - 1]] + "' and '" + extent_names[order[i]] +
           "' overlap in the data section");
  }
}

Checkpoint Checkpoint::open_file(const std::string& path) {
  Checkpoint c;
  c.files_.push_back(std::make_unique<SafetensorsFile>(path));
  for (auto& [name, t] : c.files_.back()->tensors()) c.index_[name] = &t;
  return c;
}

Checkpoint Checkpoint::open_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  const fs::path single = fs::path(dir) / "model.safetensors";
  if (!fs::exists(index_path)) {
    if (!fs::exists(single))
      throw InputError(dir + ": no model.safetensors or model.safetensors.index.json");
    return open_file(single.string());
  }
  const json index = read_json_file(index_path.string());
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    throw InputError(index_path.string() + ": missing object 'weight_map'");
  Checkpoint c;
  std::map<std::string, const SafetensorsFile*> by_file;
  for (auto& [name, file] : index["weight_map"].items()) {
    if (!file.is_string())
      throw InputError(index_path.string() + ": weight_map['" + name + "'] is not a file name");
    const std::string fname = file.get<std::string>();
    if (fname.find('/') != std::string::npos || fname.find("..") != std::string::npos)
      throw InputError(index_path.string() + ": weight_map['" + name + "'] names a file outside the directory");
    if (!by_file.count(fname)) {
      c.files_.push_back(std::make_unique<SafetensorsFile>((fs::path(dir) / fname).string()));
      by_file[fname] = c.files_.back().get();
    }
    auto& tensors = by_file[fname]->tensors();
    auto it = tensors.find(name);
    if (it == tensors.end())
      throw InputError(index_path.string() + ": tensor '" + name + "' is listed in " + fname +
                       " but that file does not hold it");
    c.index_[name] = &it->second;
  }
  for (auto& f : c.files_)
    for (auto& [name, t] : f->tensors())
      if (!c.index_.count(name))
        throw InputError(f->path() + ": tensor '" + name + "' is not listed in model.safetensors.index.json");
  return c;
}

const TensorView& Checkpoint::get(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) throw InputError("checkpoint: missing tensor '" + name + "'");
  return *it->second;
}

}  // namespace tiermoe
