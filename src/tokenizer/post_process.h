// Post-processors of tokenizer.json ("post_processor" field), reduced to what encoding a single
// sequence needs: the special ids put before and after it when add_special is set.
// Supported: TemplateProcessing, ByteLevel (no ids), RobertaProcessing, BertProcessing, Sequence.
#pragma once
#include <cstdint>
#include <vector>

#include "tokenizer/json_node.h"

namespace tiermoe {

struct SpecialAffixes {
  std::vector<int32_t> prefix, suffix;
};

// Empty affixes for a null post-processor. Throws InputError naming the field if unsupported.
SpecialAffixes parse_post_processor(const JsonNode& node);

}  // namespace tiermoe
