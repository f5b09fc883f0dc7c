// The seam between the engine and the hardware. A backend owns its copy of the weights in
// whatever layout its kernels want and runs the whole forward pass; the CPU backend is the
// reference every other backend is checked against.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "kv/kv_cache.h"
#include "model/weights.h"

namespace tiermoe {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;

  // A fresh KV cache for one sequence of this model.
  virtual std::unique_ptr<KvCache> new_cache() const = 0;

  // Runs tokens[T] at positions cache.length() ... cache.length()+T-1, appending their keys
  // and values to `cache`, and writes logits[n_logits, V] for the last n_logits tokens.
  virtual void forward(std::span<const int32_t> tokens, KvCache& cache, int n_logits, float* logits) = 0;
};

struct CpuBackendOptions {
  KvDType kv_dtype = KvDType::F32;
  int max_chunk = 512;  // prompt tokens per forward step (bounds activation memory)
};

std::unique_ptr<Backend> make_cpu_backend(const ModelWeights& weights, const CpuBackendOptions& opts = {});

}  // namespace tiermoe
