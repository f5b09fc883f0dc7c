// The OpenAI wire format: request bodies parsed and validated field by field (errors name the
// field), and error bodies {"error": {"message", "type", "param", "code"}}.
#pragma once
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "server/chat_template.h"

namespace tiermoe {

// A request the server refuses; status is the HTTP status (4xx, or 5xx for our own failures).
struct ApiError : std::runtime_error {
  ApiError(int status, std::string message, std::string param = {}, std::string code = {}, std::string type = {});
  int status;
  std::string param, code, type;
};

nlohmann::json error_body(const ApiError& e);
// JSON text; invalid UTF-8 (which requests cannot carry, but error messages might) as U+FFFD.
std::string dump(const nlohmann::json& j);

struct ApiRequest {
  bool chat = false;
  std::string model;                      // empty: not given
  std::string prompt;                     // completions with a text prompt
  std::vector<int32_t> prompt_ids;        // completions with a token-id prompt
  std::vector<ChatMessage> messages;      // chat
  std::optional<int64_t> max_tokens;      // not given: the endpoint's default
  float temperature = 1.0f, top_p = 1.0f;
  int top_k = 0;
  std::optional<int64_t> seed;
  std::vector<std::string> stop;
  bool stream = false, include_usage = false;
  bool ignore_eos = false;  // vLLM's extension: generate max_tokens tokens (benchmarks)
};

// Parses an HTTP body for /v1/completions (chat = false) or /v1/chat/completions.
ApiRequest parse_api_request(const std::string& body, bool chat);

}  // namespace tiermoe
