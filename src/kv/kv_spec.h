// What a tiered KV cache stores: tier boundaries and one codec for keys and one for values.
// Presets name good combinations (`--kv NAME`); a JSON file (`--kv-config FILE`) overrides
// any field of a preset.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kv/kv_cache.h"

namespace tiermoe {

// One codec, applied to every (layer, KV head) of K or of V.
//   kind "bf16": exact (BF16) everywhere;  "fp8": E4M3 with one scale per (layer, head);
//   "kivi": asymmetric uniform, `bits`, groups of `group` (K: per channel over `group`
//           tokens; V: per token over `group` channels), BF16 scale and zero per group;
//   "vq":  rotation (none | hadamard | pca | rope_pairs) -> `anchor_frac` of the highest-variance rotated
//          channels in FP8 -> residual stages; stage s cuts the remaining channels into
//          sub-vectors of `dim` and spends `stage_bits[s]` bits per value on average (bits
//          allocated across sub-vectors by variance when `allocate`, else uniform).
//          dim 1 is scalar Lloyd-Max; dim > 1 is RVQ. Codebooks are k-means on calibration
//          data, or Gaussian Lloyd-Max levels when `oblivious` (needs token_norm).
struct CodecSpec {
  std::string kind = "vq";
  int bits = 2;      // kivi
  int group = 32;    // kivi
  std::string rotation = "pca";
  double anchor_frac = 0.0;
  int dim = 1;
  std::vector<double> stage_bits = {2.0};
  bool allocate = true;      // bit allocation across sub-vectors (water-filling)
  bool query_aware = true;   // keys: weight each rotated channel's error by E[q_i^2]
  bool token_norm = false;   // one BF16 scale per token (RMS of the rotated vector)
  bool oblivious = false;    // data-oblivious codebooks (Gaussian Lloyd-Max levels)
  bool center = true;        // subtract the calibration mean (PCA only)
  bool pre_rope = false;     // keys: code them before RoPE (undone per position, redone on decode)
  int max_bits = 0;          // most bits one slot of one stage may take (0: 10, or 6 when oblivious)
};

struct KvSpec {
  std::string name = "f32";
  bool exact = true;             // one format for every token (no tiers)
  KvDType exact_dtype = KvDType::F32;  // that format when `exact`: F32, BF16 or FP8 rows
  int sink = 4;                  // first tokens kept exact
  int window = 128;              // W: tokens younger than this (in whole pages) kept exact
  int middle = 4096;             // M: pages at least this old go to the archive tier
  int page = 16;                 // tokens per page; tiers move whole pages
  int archive_stages = 0;        // archive keeps this prefix of the middle's stages (0: all)
  int calib_tokens = 512;        // online calibration: the first tokens' K/V (and queries)
  int refits = 0;                // online: fit new codecs this many times more, at calib_tokens
                                 // * 2, * 4, ... (from a sample of the tokens so far); pages
                                 // keep the codec they were coded with, new pages take the newest
  int refit_rows = 512;          // rows a refit reads (every fit_point / refit_rows-th token)
  bool refit_basis = true;       // refits fit a new rotation and mean too (else keep the first's)
  bool recode = false;           // a refit re-codes every page coded so far from the BF16 rows the
                                 // refits hold (needs every row: refit_rows >= the last fit point),
                                 // and the older versions are dropped
  int kmeans_iters = 8;
  uint64_t seed = 1;
  int lut_max_tokens = 4;        // attend through lookup tables when T <= this (decode)
  CodecSpec k, v;
};

// A preset by name: f32, bf16, fp8-all, fp8, kivi2, kivi4, hadamard2, hadamard3, oskvp, rvq-tiers,
// default, ... Throws InputError listing the names.
KvSpec kv_preset(const std::string& name);
std::vector<std::string> kv_preset_names();

// Applies a JSON object of overrides ({"preset": NAME, "window": 256, "k": {...}}); throws
// InputError naming the offending key.
KvSpec kv_spec_from_json(const nlohmann::json& j, const std::string& where);
nlohmann::json kv_spec_to_json(const KvSpec& s);

}  // namespace tiermoe
