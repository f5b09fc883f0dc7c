// Offline calibration results: the codecs of every (layer, KV head, K/V), for one model and
// one codec configuration. Written by `tiermoe calibrate`, read with `--kv-profile FILE`.
#pragma once
#include <string>
#include <vector>

#include "kv/kv_cache.h"
#include "kv/kv_codec.h"
#include "kv/kv_spec.h"

namespace tiermoe {

class KvProfile {
 public:
  std::string model;              // fingerprint of the model it was made for
  KvGeometry geometry;
  nlohmann::json codec_spec;      // {"k": ..., "v": ...} of the spec it was fitted with
  std::string text;               // what it was calibrated on (informational)
  int tokens = 0;                 // calibration tokens
  std::vector<VqCodec> codecs;    // [layer][kvh][2] flattened

  const VqCodec& at(int layer, int kvh, int kv) const {
    return codecs[(size_t(layer) * geometry.num_kv_heads + kvh) * 2 + kv];
  }
  void save(const std::string& path) const;
  static KvProfile load(const std::string& path);  // throws InputError naming the path
  // Throws InputError when this profile was made for another model or codec configuration.
  void check_compatible(const std::string& model_fingerprint, const KvGeometry& g, const KvSpec& spec,
                        const std::string& path) const;
};

// The codec part of a spec, compared between a profile and the spec it is used with.
nlohmann::json codec_spec_json(const KvSpec& s);

// The codecs of a calibrated tiered cache, [layer][kvh][2] flattened: version 0 (the first fit;
// a profile's), or a later online refit (empty if the cache has no such version yet).
std::vector<VqCodec> tiered_cache_codecs(const KvCache& c, int version = 0);
// For tests: codec versions held (layer 0), and head h of coded page pg of K (kv 0) or V,
// decoded with every stage it holds, [P, Dh], with the version it was coded with.
int tiered_cache_versions(const KvCache& c);
std::vector<float> tiered_cache_decoded_page(const KvCache& c, int layer, int kv, int pg, int h, int& version);

// A model's fingerprint: FNV-1a of its config.json text and its geometry.
std::string model_fingerprint(const std::string& model_dir);

}  // namespace tiermoe
