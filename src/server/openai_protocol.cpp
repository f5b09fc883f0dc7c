#include "server/openai_protocol.h"

#include <cmath>
#include <limits>

namespace tiermoe {
namespace {

using json = nlohmann::json;

const char* type_name(const json& v) {
  if (v.is_null()) return "null";
  if (v.is_boolean()) return "a boolean";
  if (v.is_number_integer()) return "an integer";
  if (v.is_number()) return "a number";
  if (v.is_string()) return "a string";
  if (v.is_array()) return "an array";
  return "an object";
}

[[noreturn]] void bad(const std::string& param, const std::string& message) {
  throw ApiError(400, param + ": " + message, param);
}

[[noreturn]] void wrong_type(const std::string& param, const char* want, const json& got) {
  bad(param, std::string("must be ") + want + ", got " + type_name(got));
}

// A field that is absent or null yields nullopt.
const json* field(const json& body, const char* key) {
  auto it = body.find(key);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<double> number(const json& body, const char* key, double lo, double hi) {
  const json* v = field(body, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) wrong_type(key, "a number", *v);
  const double d = v->get<double>();
  if (!std::isfinite(d) || d < lo || d > hi)
    bad(key, "must be in [" + json(lo).dump() + ", " + json(hi).dump() + "], got " + v->dump());
  return d;
}

std::optional<int64_t> integer(const json& body, const char* key) {
  const json* v = field(body, key);
  if (!v) return std::nullopt;
  if (v->is_number_float() && std::floor(v->get<double>()) == v->get<double>() && std::abs(v->get<double>()) < 9e15)
    return int64_t(v->get<double>());
  if (!v->is_number_integer()) wrong_type(key, "an integer", *v);
  if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
    bad(key, "is too large");
  return v->get<int64_t>();
}

std::optional<bool> boolean(const json& body, const char* key) {
  const json* v = field(body, key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) wrong_type(key, "a boolean", *v);
  return v->get<bool>();
}

std::vector<int32_t> token_ids(const json& arr, const std::string& param) {
  std::vector<int32_t> ids;
  for (size_t i = 0; i < arr.size(); ++i) {
    const json& x = arr[i];
    if (!x.is_number_integer()) wrong_type(param + "[" + std::to_string(i) + "]", "a token id (integer)", x);
    const int64_t id = x.get<int64_t>();
    if (id < 0 || id > std::numeric_limits<int32_t>::max()) bad(param, "token id " + std::to_string(id) + " is out of range");
    ids.push_back(int32_t(id));
  }
  return ids;
}

std::string message_content(const json& m, const std::string& param) {
  auto it = m.find("content");
  if (it == m.end() || it->is_null()) return {};
  if (it->is_string()) return it->get<std::string>();
  if (!it->is_array()) wrong_type(param + ".content", "a string or an array of text parts", *it);
  std::string text;
  for (size_t i = 0; i < it->size(); ++i) {
    const json& part = (*it)[i];
    const std::string p = param + ".content[" + std::to_string(i) + "]";
    if (!part.is_object()) wrong_type(p, "an object", part);
    if (part.value("type", "") != "text") bad(p + ".type", "only \"text\" parts are supported");
    auto t = part.find("text");
    if (t == part.end() || !t->is_string()) bad(p + ".text", "must be a string");
    text += t->get<std::string>();
  }
  return text;
}

}  // namespace

ApiError::ApiError(int status_, std::string message, std::string param_, std::string code_, std::string type_)
    : std::runtime_error(std::move(message)),
      status(status_),
      param(std::move(param_)),
      code(std::move(code_)),
      type(std::move(type_)) {
  if (type.empty())
    type = status == 401 ? "authentication_error"
           : status == 404 ? "not_found_error"
           : status == 429 ? "rate_limit_error"
           : status >= 500 ? "server_error"
                           : "invalid_request_error";
}

json error_body(const ApiError& e) {
  return {{"error",
           {{"message", e.what()},
            {"type", e.type},
            {"param", e.param.empty() ? json(nullptr) : json(e.param)},
            {"code", e.code.empty() ? json(nullptr) : json(e.code)}}}};
}

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

ApiRequest parse_api_request(const std::string& text, bool chat) {
  json body;
  try {
    body = json::parse(text);
  } catch (const json::exception& e) {  // a parse_error, or out_of_range for a number such as 1e309
    throw ApiError(400, std::string("the body is not valid JSON (UTF-8): ") + e.what(), "", "invalid_json");
  }
  if (!body.is_object()) throw ApiError(400, std::string("the body must be a JSON object, got ") + type_name(body));
  ApiRequest r;
  r.chat = chat;
  if (const json* m = field(body, "model")) {
    if (!m->is_string()) wrong_type("model", "a string", *m);
    r.model = m->get<std::string>();
  }
  if (chat) {
    const json* msgs = field(body, "messages");
    if (!msgs) bad("messages", "is required");
    if (!msgs->is_array()) wrong_type("messages", "an array", *msgs);
    if (msgs->empty()) bad("messages", "must not be empty");
    for (size_t i = 0; i < msgs->size(); ++i) {
      const json& m = (*msgs)[i];
      const std::string p = "messages[" + std::to_string(i) + "]";
      if (!m.is_object()) wrong_type(p, "an object", m);
      auto role = m.find("role");
      if (role == m.end() || !role->is_string()) bad(p + ".role", "must be a string");
      r.messages.push_back({role->get<std::string>(), message_content(m, p)});
    }
  } else {
    const json* p = field(body, "prompt");
    if (!p) bad("prompt", "is required");
    if (p->is_string()) {
      r.prompt = p->get<std::string>();
    } else if (p->is_array() && !p->empty() && (*p)[0].is_number()) {  // token_ids names a non-integer
      r.prompt_ids = token_ids(*p, "prompt");
    } else if (p->is_array() && p->size() == 1 && (*p)[0].is_string()) {
      r.prompt = (*p)[0].get<std::string>();
    } else if (p->is_array() && p->size() == 1 && (*p)[0].is_array()) {
      r.prompt_ids = token_ids((*p)[0], "prompt[0]");
    } else if (p->is_array() && p->size() > 1) {
      bad("prompt", "several prompts in one request are not supported; send one request per prompt");
    } else if (p->is_array() && p->empty()) {
      bad("prompt", "must not be empty");
    } else if (p->is_array()) {
      wrong_type("prompt[0]", "a string, a token id or an array of token ids", (*p)[0]);
    } else {
      wrong_type("prompt", "a string or an array of token ids", *p);
    }
    if (r.prompt.empty() && r.prompt_ids.empty()) bad("prompt", "must not be empty");
  }
  r.max_tokens = integer(body, chat && field(body, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens");
  if (r.max_tokens && *r.max_tokens < 1) bad("max_tokens", "must be at least 1, got " + std::to_string(*r.max_tokens));
  if (auto t = number(body, "temperature", 0, 2)) r.temperature = float(*t);
  if (auto t = number(body, "top_p", 0, 1)) {
    if (*t <= 0) bad("top_p", "must be greater than 0");
    r.top_p = float(*t);
  }
  if (auto k = integer(body, "top_k")) {
    if (*k < -1) bad("top_k", "must be -1 (off), 0 (off) or positive");
    r.top_k = *k <= 0 ? 0 : int(std::min<int64_t>(*k, 1 << 30));
  }
  r.seed = integer(body, "seed");
  if (auto n = integer(body, "n"); n && *n != 1) bad("n", "only n = 1 is supported");
  for (const char* pen : {"presence_penalty", "frequency_penalty"})
    if (auto v = number(body, pen, -2, 2); v && *v != 0) bad(pen, "is not supported (only 0)");
  if (const json* lp = field(body, "logprobs"); lp && !(lp->is_boolean() && !lp->get<bool>()))
    bad("logprobs", "is not supported");
  if (auto e = boolean(body, "echo"); e && *e) bad("echo", "is not supported");
  if (const json* s = field(body, "stop")) {
    if (s->is_string()) {
      r.stop.push_back(s->get<std::string>());
    } else if (s->is_array()) {
      if (s->size() > 16) bad("stop", "at most 16 stop strings");
      for (size_t i = 0; i < s->size(); ++i) {
        if (!(*s)[i].is_string()) wrong_type("stop[" + std::to_string(i) + "]", "a string", (*s)[i]);
        r.stop.push_back((*s)[i].get<std::string>());
      }
    } else {
      wrong_type("stop", "a string or an array of strings", *s);
    }
    std::erase_if(r.stop, [](const std::string& x) { return x.empty(); });
  }
  r.stream = boolean(body, "stream").value_or(false);
  r.ignore_eos = boolean(body, "ignore_eos").value_or(false);
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) wrong_type("stream_options", "an object", *so);
    r.include_usage = boolean(*so, "include_usage").value_or(false);
  }
  return r;
}

}  // namespace tiermoe
