// Offline KV calibration: runs the model over a calibration text with the --kv preset's cache,
// which fits its codecs (rotations, anchors, codebooks) on all of that text's keys, values and
// queries at once, and writes them as a profile that --kv-profile loads.
#include <algorithm>
#include <cstdio>
#include <filesystem>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "kv/kv_profile.h"

#include "cli/common.h"

namespace tiermoe {

int run_calibrate(const CommonOptions& c, const std::string& file, const std::string& out, int tokens, int offset) {
  Engine engine(engine_options(c));
  KvSpec spec = engine.kv_spec();
  if (spec.exact) throw InputError("--kv: " + spec.name + " is an exact cache; calibrate a tiered preset");
  if (!c.kv_profile.empty()) throw InputError("--kv-profile: calibrate writes a profile; do not pass one");
  if (tokens < 16 || tokens > engine.config().max_position_embeddings)
    throw InputError("--tokens: must be in [16, " + std::to_string(engine.config().max_position_embeddings) + "]");
  if (offset < 0) throw InputError("--offset: must be >= 0");
  // Where the profile goes is checked before the calibration's minutes, not after them.
  const std::filesystem::path out_path(out), out_dir = out_path.has_parent_path() ? out_path.parent_path() : ".";
  if (!std::filesystem::is_directory(out_dir)) throw InputError(out + ": its directory does not exist");
  if (access(out_dir.c_str(), W_OK) != 0 || (std::filesystem::exists(out_path) && access(out.c_str(), W_OK) != 0))
    throw InputError(out + ": cannot write");
  const auto ids = engine.tokenizer().encode(read_text_file(file));
  if (int(ids.size()) < offset + tokens)
    throw InputError(file + ": " + std::to_string(ids.size()) + " tokens, fewer than --offset + --tokens");
  spec.calib_tokens = tokens;
  spec.refits = 0;  // a profile holds one codec per stream
  std::unique_ptr<KvCache> cache = make_kv_cache(engine.kv_geometry(), spec);
  ProgressBar bar("calibrate", size_t(tokens));
  for (int s = 0; s < tokens; s += 256) {
    const int n = std::min(256, tokens - s);
    engine.backend().forward(std::span(ids).subspan(size_t(offset + s), size_t(n)), *cache, 0, nullptr);
    bar.update(size_t(s + n));
  }
  bar.finish();
  KvProfile p;
  p.model = model_fingerprint(c.model_dir);
  p.geometry = engine.kv_geometry();
  p.codec_spec = codec_spec_json(spec);
  p.text = file;
  p.tokens = tokens;
  p.codecs = tiered_cache_codecs(*cache);
  CHECK(!p.codecs.empty());
  p.save(out);
  double meta = 0;
  for (const auto& cd : p.codecs) meta += cd.meta_bits() / 8;
  if (c.json)
    std::printf("%s\n", nlohmann::json({{"profile", out}, {"kv", spec.name}, {"tokens", tokens}, {"metadata_bytes", meta}}).dump().c_str());
  else
    std::printf("wrote %s: kv %s fitted on %d tokens of %s (%.0f bytes of codecs)\n", out.c_str(), spec.name.c_str(),
                tokens, file.c_str(), meta);
  return 0;
}

}  // namespace tiermoe
