#include "kv/kv_profile.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/check.h"

namespace tiermoe {
namespace {
constexpr char kMagic[8] = {'T', 'M', 'K', 'V', 'P', 'R', 'F', '1'};
}

nlohmann::json codec_spec_json(const KvSpec& s) {
  nlohmann::json j = kv_spec_to_json(s);
  return {{"k", j.value("k", nlohmann::json())}, {"v", j.value("v", nlohmann::json())}, {"seed", s.seed}};
}

std::string model_fingerprint(const std::string& model_dir) {
  std::ifstream in(std::filesystem::path(model_dir) / "config.json", std::ios::binary);
  if (!in) throw InputError(model_dir + ": no config.json");
  std::stringstream ss;
  ss << in.rdbuf();
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : ss.str()) h = (h ^ c) * 1099511628211ull;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%016llx", (unsigned long long)h);
  return buf;
}

void KvProfile::save(const std::string& path) const {
  std::ofstream out(path, std::ios::binary);
  if (!out) throw InputError(path + ": cannot write");
  const nlohmann::json header = {{"model", model},
                                 {"geometry", {geometry.num_layers, geometry.num_kv_heads, geometry.num_heads, geometry.head_dim}},
                                 {"codec_spec", codec_spec},
                                 {"text", text},
                                 {"tokens", tokens}};
  const std::string h = header.dump();
  out.write(kMagic, 8);
  const uint64_t n = h.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out.write(h.data(), std::streamsize(n));
  for (const VqCodec& c : codecs) c.save(out);
  if (!out) throw InputError(path + ": write failed");
}

KvProfile KvProfile::load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path + ": cannot open KV profile");
  char magic[8];
  in.read(magic, 8);
  if (!in || std::string(magic, 8) != std::string(kMagic, 8)) throw InputError(path + ": not a tiermoe KV profile");
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  if (!in || n > (1u << 24)) throw InputError(path + ": corrupt KV profile header");
  std::string h(size_t(n), '\0');
  in.read(h.data(), std::streamsize(n));
  KvProfile p;
  try {
    const auto j = nlohmann::json::parse(h);
    p.model = j.at("model").get<std::string>();
    const auto g = j.at("geometry").get<std::vector<int>>();
    if (g.size() != 4) throw std::runtime_error("geometry");
    p.geometry = {g[0], g[1], g[2], g[3]};
    p.codec_spec = j.at("codec_spec");
    p.text = j.value("text", "");
    p.tokens = j.value("tokens", 0);
  } catch (const std::exception& e) {
    throw InputError(path + ": corrupt KV profile header (" + e.what() + ")");
  }
  if (p.geometry.num_layers <= 0 || p.geometry.num_kv_heads <= 0 || p.geometry.num_layers * p.geometry.num_kv_heads > 1 << 16)
    throw InputError(path + ": corrupt KV profile geometry");
  p.codecs.resize(size_t(p.geometry.num_layers) * p.geometry.num_kv_heads * 2);
  try {
    for (VqCodec& c : p.codecs) c.load(in);
  } catch (const InputError& e) {
    throw InputError(path + ": " + e.what());
  }
  return p;
}

void KvProfile::check_compatible(const std::string& fp, const KvGeometry& g, const KvSpec& spec,
                                 const std::string& path) const {
  if (fp != model || g.num_layers != geometry.num_layers || g.num_kv_heads != geometry.num_kv_heads ||
      g.head_dim != geometry.head_dim)
    throw InputError(path + ": KV profile was made for another model (fingerprint " + model + ", this model " + fp + ")");
  if (codec_spec != codec_spec_json(spec))
    throw InputError(path + ": KV profile was made for another codec configuration (" + codec_spec.dump() +
                     "); use the --kv preset it was calibrated with");
  if (spec.exact) throw InputError(path + ": a KV profile needs a tiered --kv preset, not an exact cache");
}

}  // namespace tiermoe
