#include "kv/kv_spec.h"

#include <functional>
#include <map>

#include "core/check.h"

namespace tiermoe {
namespace {

KvSpec tiered(const std::string& name) {
  KvSpec s;
  s.name = name;
  s.exact = false;
  return s;
}

CodecSpec kivi(int bits) {
  CodecSpec c;
  c.kind = "kivi";
  c.bits = bits;
  c.group = 32;
  return c;
}

CodecSpec hadamard(double bits) {
  CodecSpec c;
  c.rotation = "hadamard";
  c.dim = 1;
  c.stage_bits = {bits};
  c.allocate = false;
  c.query_aware = false;
  c.token_norm = true;
  c.oblivious = true;
  c.center = false;
  return c;
}

CodecSpec pca_lloyd(double bits, double anchors, bool allocate, bool query_aware) {
  CodecSpec c;
  c.rotation = "pca";
  c.anchor_frac = anchors;
  c.dim = 1;
  c.stage_bits = {bits};
  c.allocate = allocate;
  c.query_aware = query_aware;
  return c;
}

CodecSpec pca_rvq(std::vector<double> stage_bits, int dim) {
  CodecSpec c;
  c.rotation = "pca";
  c.dim = dim;
  c.stage_bits = std::move(stage_bits);
  c.allocate = false;
  c.query_aware = false;
  return c;
}

const std::map<std::string, std::function<KvSpec()>>& presets() {
  static const std::map<std::string, std::function<KvSpec()>> p = {
      {"f32", [] { KvSpec s; s.name = "f32"; return s; }},
      {"bf16", [] { KvSpec s; s.name = "bf16"; s.exact_dtype = KvDType::BF16; return s; }},
      // vLLM's fp8 KV cache: every token's K and V in E4M3, a power-of-two scale per (token, KV head)
      // (kv/fp8_rows.h); the one cache besides bf16 that the CUDA backend keeps.
      {"fp8-all", [] { KvSpec s; s.name = "fp8-all"; s.exact_dtype = KvDType::FP8; return s; }},
      {"fp8", [] { KvSpec s = tiered("fp8"); s.k.kind = s.v.kind = "fp8"; return s; }},
      {"kivi2", [] { KvSpec s = tiered("kivi2"); s.page = 32; s.k = s.v = kivi(2); return s; }},
      {"kivi4", [] { KvSpec s = tiered("kivi4"); s.page = 32; s.k = s.v = kivi(4); return s; }},
      {"hadamard2", [] { KvSpec s = tiered("hadamard2"); s.k = s.v = hadamard(2); return s; }},
      {"hadamard3", [] { KvSpec s = tiered("hadamard3"); s.k = s.v = hadamard(3); return s; }},
      // The second seed's codec: PCA, ~8% FP8 anchors, 2-bit Lloyd-Max on every other channel.
      {"oskvp", [] { KvSpec s = tiered("oskvp"); s.k = s.v = pca_lloyd(2, 0.08, false, false); return s; }},
      // The first seed's tri-tier layout: BF16 window of 128, 3.25-bit middle (4 RVQ stages of
      // 4-dim sub-vectors, 16/8/16/4 codewords), archive = the first two stages (1.75 bits).
      {"rvq-tiers", [] { KvSpec s = tiered("rvq-tiers"); s.k = s.v = pca_rvq({1.0, 0.75, 1.0, 0.5}, 4); s.archive_stages = 2; return s; }},
      // Measured best trade-off (docs/kv_codecs.md): keys coded before RoPE, PCA + scalar
      // Lloyd-Max with query-aware bit allocation; values PCA + allocated Lloyd-Max; two
      // progressive stages (middle: K 2.5 / V 1.75 bits, archive keeps the first stage:
      // K 1.75 / V 1.25 bits); calibrated online on the first 768 tokens and refitted at 1536 and
      // 3072 on every token so far, keeping the first fit's PCA bases (new codebooks only); each
      // refit re-codes the older pages from the rows it read, so one codec version is held.
      {"default", [] {
         KvSpec s = tiered("default");
         s.k = pca_lloyd(1.75, 0.0, true, true);
         s.k.stage_bits = {1.75, 0.75};
         s.k.pre_rope = true;
         s.v = pca_lloyd(1.25, 0.0, true, false);
         s.v.stage_bits = {1.25, 0.5};
         s.archive_stages = 1;
         s.calib_tokens = 768;
         s.kmeans_iters = 50;
         s.refits = 2;
         s.refit_rows = 4096;
         s.refit_basis = false;
         s.recode = true;
         return s;
       }},
  };
  return p;
}

template <class T>
T get_as(const nlohmann::json& v, const std::string& key) {
  try {
    return v.get<T>();
  } catch (const std::exception&) {
    throw InputError(key + ": wrong type (" + std::string(v.type_name()) + ")");
  }
}

void apply_codec(CodecSpec& c, const nlohmann::json& j, const std::string& where) {
  if (!j.is_object()) throw InputError(where + ": must be an object");
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string k = it.key(), key = where + "." + k;
    const auto& v = it.value();
    if (k == "kind") c.kind = get_as<std::string>(v, key);
    else if (k == "bits") c.bits = get_as<int>(v, key);
    else if (k == "group") c.group = get_as<int>(v, key);
    else if (k == "rotation") c.rotation = get_as<std::string>(v, key);
    else if (k == "anchor_frac") c.anchor_frac = get_as<double>(v, key);
    else if (k == "dim") c.dim = get_as<int>(v, key);
    else if (k == "stage_bits") c.stage_bits = get_as<std::vector<double>>(v, key);
    else if (k == "allocate") c.allocate = get_as<bool>(v, key);
    else if (k == "query_aware") c.query_aware = get_as<bool>(v, key);
    else if (k == "token_norm") c.token_norm = get_as<bool>(v, key);
    else if (k == "oblivious") c.oblivious = get_as<bool>(v, key);
    else if (k == "center") c.center = get_as<bool>(v, key);
    else if (k == "pre_rope") c.pre_rope = get_as<bool>(v, key);
    else if (k == "max_bits") c.max_bits = get_as<int>(v, key);
    else throw InputError(key + ": unknown key");
  }
  if (c.kind != "vq" && c.kind != "fp8" && c.kind != "kivi" && c.kind != "bf16")
    throw InputError(where + ".kind: '" + c.kind + "' is not one of vq, fp8, kivi, bf16");
  if (c.rotation != "none" && c.rotation != "hadamard" && c.rotation != "pca" && c.rotation != "rope_pairs")
    throw InputError(where + ".rotation: '" + c.rotation + "' is not one of none, hadamard, pca, rope_pairs");
  if (c.kind == "kivi" && (c.bits < 1 || c.bits > 8)) throw InputError(where + ".bits: must be in [1, 8]");
  if (c.kind == "kivi" && (c.group < 1 || c.group > 128)) throw InputError(where + ".group: must be in [1, 128]");
  if (c.anchor_frac < 0 || c.anchor_frac > 1) throw InputError(where + ".anchor_frac: must be in [0, 1]");
  if (c.dim < 1 || c.dim > 16) throw InputError(where + ".dim: must be in [1, 16]");
  if (c.kind == "vq" && c.stage_bits.empty()) throw InputError(where + ".stage_bits: at least one stage");
  for (double b : c.stage_bits)
    if (b < 0 || b * c.dim > 12) throw InputError(where + ".stage_bits: each stage needs 0 <= bits * dim <= 12");
  if (c.oblivious && !c.token_norm) throw InputError(where + ".oblivious: needs token_norm");
  if (c.max_bits < 0 || c.max_bits > 12) throw InputError(where + ".max_bits: must be in [0, 12] (0: no cap of its own)");
}

}  // namespace

std::vector<std::string> kv_preset_names() {
  std::vector<std::string> n;
  for (auto& [k, v] : presets()) n.push_back(k);
  return n;
}

KvSpec kv_preset(const std::string& name) {
  auto it = presets().find(name);
  if (it == presets().end()) {
    std::string all;
    for (auto& n : kv_preset_names()) all += (all.empty() ? "" : ", ") + n;
    throw InputError("--kv: unknown KV cache preset '" + name + "' (presets: " + all + ")");
  }
  return it->second();
}

KvSpec kv_spec_from_json(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object()) throw InputError(where + ": must be a JSON object");
  KvSpec s = kv_preset(j.contains("preset") ? get_as<std::string>(j["preset"], where + ": preset") : "default");
  if (j.contains("name")) s.name = get_as<std::string>(j["name"], where + ": name");
  else s.name += "+config";
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string k = it.key(), key = where + ": " + k;
    const auto& v = it.value();
    if (k == "preset" || k == "name") continue;
    else if (k == "sink") s.sink = get_as<int>(v, key);
    else if (k == "window") s.window = get_as<int>(v, key);
    else if (k == "middle") s.middle = get_as<int>(v, key);
    else if (k == "page") s.page = get_as<int>(v, key);
    else if (k == "archive_stages") s.archive_stages = get_as<int>(v, key);
    else if (k == "calib_tokens") s.calib_tokens = get_as<int>(v, key);
    else if (k == "refits") s.refits = get_as<int>(v, key);
    else if (k == "refit_rows") s.refit_rows = get_as<int>(v, key);
    else if (k == "refit_basis") s.refit_basis = get_as<bool>(v, key);
    else if (k == "recode") s.recode = get_as<bool>(v, key);
    else if (k == "kmeans_iters") s.kmeans_iters = get_as<int>(v, key);
    else if (k == "seed") s.seed = get_as<uint64_t>(v, key);
    else if (k == "lut_max_tokens") s.lut_max_tokens = get_as<int>(v, key);
    else if (k == "k") apply_codec(s.k, v, where + ": k");
    else if (k == "v") apply_codec(s.v, v, where + ": v");
    else throw InputError(key + ": unknown key");
  }
  if (s.sink < 0) throw InputError(where + ": sink: must be >= 0");
  if (s.page < 1 || s.page > 4096) throw InputError(where + ": page: must be in [1, 4096]");
  if (s.window < 0) throw InputError(where + ": window: must be >= 0");
  if (s.middle < s.window) throw InputError(where + ": middle: must be >= window");
  if (s.calib_tokens < 16) throw InputError(where + ": calib_tokens: must be >= 16");
  if (s.refits < 0 || s.refits > 16) throw InputError(where + ": refits: must be in [0, 16]");
  if (s.refit_rows < 16) throw InputError(where + ": refit_rows: must be >= 16");
  if (s.recode && s.refit_rows < (int64_t(s.calib_tokens) << s.refits))
    throw InputError(where + ": recode: re-coding needs every row before the last fit, refit_rows >= " +
                     std::to_string(int64_t(s.calib_tokens) << s.refits) + " (calib_tokens << refits)");
  if (s.archive_stages < 0) throw InputError(where + ": archive_stages: must be >= 0");
  for (const CodecSpec* c : {&s.k, &s.v})
    if (c->kind == "kivi" && s.page % c->group != 0 && c == &s.k)
      throw InputError(where + ": page: must be a multiple of k.group for kivi keys");
  return s;
}

nlohmann::json kv_spec_to_json(const KvSpec& s) {
  auto codec = [](const CodecSpec& c) {
    return nlohmann::json{{"kind", c.kind}, {"bits", c.bits}, {"group", c.group}, {"rotation", c.rotation},
                          {"anchor_frac", c.anchor_frac}, {"dim", c.dim}, {"stage_bits", c.stage_bits},
                          {"allocate", c.allocate}, {"query_aware", c.query_aware}, {"token_norm", c.token_norm},
                          {"oblivious", c.oblivious}, {"center", c.center},
                          {"pre_rope", c.pre_rope}, {"max_bits", c.max_bits}};
  };
  if (s.exact)
    return {{"name", s.name},
            {"exact", s.exact_dtype == KvDType::F32 ? "f32" : s.exact_dtype == KvDType::BF16 ? "bf16" : "fp8"}};
  return {{"name", s.name}, {"sink", s.sink}, {"window", s.window}, {"middle", s.middle}, {"page", s.page},
          {"archive_stages", s.archive_stages}, {"calib_tokens", s.calib_tokens}, {"refits", s.refits}, {"refit_rows", s.refit_rows}, {"refit_basis", s.refit_basis}, {"recode", s.recode}, {"seed", s.seed},
          {"k", codec(s.k)}, {"v", codec(s.v)}};
}

}  // namespace tiermoe
