// Reads Hugging Face safetensors checkpoints by memory-mapping them: one file, or shards
// listed in model.safetensors.index.json. Every header is validated before any tensor is used.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/mapped_file.h"

namespace tiermoe {

struct TensorView {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  const std::string* file = nullptr;  // where it came from, for error messages

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  std::string shape_str() const;
};

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);  // throws InputError naming path and field
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::string& path() const { return file_.path(); }

 private:
  MappedFile file_;
  std::map<std::string, TensorView> tensors_;
};

// All tensors of a model directory, by name.
class Checkpoint {
 public:
  static Checkpoint open_dir(const std::string& dir);
  static Checkpoint open_file(const std::string& path);

  bool has(const std::string& name) const { return index_.count(name) != 0; }
  const TensorView& get(const std::string& name) const;  // throws InputError if absent
  const std::map<std::string, const TensorView*>& all() const { return index_; }

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*> index_;
};

}  // namespace tiermoe
