#include "tokenizer/post_process.h"

namespace tiermoe {
namespace {

// "single": [{"SpecialToken": {"id": "<s>"}}, {"Sequence": {"id": "A"}}, ...], with the ids of
// each special token listed under "special_tokens".
SpecialAffixes parse_template(const JsonNode& node) {
  const JsonNode single = node.required("single");
  const JsonNode specials = node.get("special_tokens");
  SpecialAffixes out;
  bool seen_sequence = false;
  for (size_t i = 0; i < single.size(); ++i) {
    const JsonNode piece = single.at(i);
    piece.expect_object();
    const JsonNode seq = piece.get("Sequence");
    if (!seq.is_null()) {
      const JsonNode id = seq.required("id");
      if (id.str() != "A") id.fail("'" + id.str() + "' cannot appear in a single-sequence template (only A)");
      if (seen_sequence) seq.fail("appears twice (only one $A is supported)");
      seen_sequence = true;
      continue;
    }
    const JsonNode special = piece.get("SpecialToken");
    if (special.is_null()) piece.fail("must be {\"Sequence\": ...} or {\"SpecialToken\": ...}");
    const std::string name = special.required("id").str();
    const JsonNode entry = specials.get(name);
    if (entry.is_null()) specials.fail("has no entry for '" + name + "'");
    const JsonNode ids = entry.required("ids");
    for (size_t k = 0; k < ids.size(); ++k) {
      const JsonNode id = ids.at(k);
      if (id.integer() < 0 || id.integer() > INT32_MAX) id.fail("must be a non-negative 32-bit id");
      (seen_sequence ? out.suffix : out.prefix).push_back(int32_t(id.integer()));
    }
  }
  if (!seen_sequence) single.fail("has no {\"Sequence\": {\"id\": \"A\"}} entry");
  return out;
}

// RobertaProcessing / BertProcessing: "cls": ["<s>", 0], "sep": ["</s>", 2] -> cls A sep.
int32_t token_pair_id(const JsonNode& node) {
  if (!node.is_array() || node.size() != 2) node.fail("must be a pair [token, id]");
  const JsonNode id = node.at(1);
  if (id.integer() < 0 || id.integer() > INT32_MAX) id.fail("must be a non-negative 32-bit id");
  return int32_t(id.integer());
}

}  // namespace

SpecialAffixes parse_post_processor(const JsonNode& node) {
  if (node.is_null()) return {};
  node.expect_object();
  const JsonNode type_node = node.required("type");
  const std::string type = type_node.str();
  if (type == "TemplateProcessing") return parse_template(node);
  if (type == "ByteLevel") return {};  // only trims offsets
  if (type == "RobertaProcessing" || type == "BertProcessing")
    return SpecialAffixes{{token_pair_id(node.required("cls"))}, {token_pair_id(node.required("sep"))}};
  if (type == "Sequence") {
    // Each processor wraps the output of the previous one.
    const JsonNode list = node.required("processors");
    SpecialAffixes out;
    for (size_t i = 0; i < list.size(); ++i) {
      SpecialAffixes inner = parse_post_processor(list.at(i));
      inner.prefix.insert(inner.prefix.end(), out.prefix.begin(), out.prefix.end());
      out.suffix.insert(out.suffix.end(), inner.suffix.begin(), inner.suffix.end());
      out.prefix = std::move(inner.prefix);
    }
    return out;
  }
  type_node.fail("'" + type +
                 "' is not supported (supported: TemplateProcessing, ByteLevel, RobertaProcessing, "
                 "BertProcessing, Sequence)");
}

}  // namespace tiermoe
