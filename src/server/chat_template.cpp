#include "server/chat_template.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/check.h"

namespace tiermoe {
namespace {

std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A special token in tokenizer_config.json is a string or {"content": "..."}.
std::string token_text(const nlohmann::json& cfg, const char* key) {
  if (!cfg.contains(key)) return {};
  const auto& v = cfg[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return {};
}

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t\r\n");
  if (a == std::string::npos) return {};
  const size_t b = s.find_last_not_of(" \t\r\n");
  return s.substr(a, b - a + 1);
}

// Qwen-style ChatML templates insert a default system turn, written in the template as
// '<|im_start|>system\nYou are ...<|im_end|>\n' (the \n as a Jinja escape or a real newline).
std::string chatml_default_system(const std::string& t) {
  for (const std::string head : {"<|im_start|>system\\n", "<|im_start|>system\n"}) {
    const size_t a = t.find(head);
    if (a == std::string::npos) continue;
    const size_t start = a + head.size();
    const size_t end = t.find("<|im_end|>", start);
    if (end == std::string::npos) continue;
    const std::string text = t.substr(start, end - start);
    if (text.empty() || text.find_first_of("{}'\"+") != std::string::npos) continue;  // Jinja, not a literal
    return text;
  }
  return {};
}

}  // namespace

ChatTemplate ChatTemplate::load(const std::string& model_dir) {
  namespace fs = std::filesystem;
  std::string tmpl, bos, eos;
  const fs::path cfg_path = fs::path(model_dir) / "tokenizer_config.json";
  if (fs::exists(cfg_path)) {
    try {
      const auto cfg = nlohmann::json::parse(read_file(cfg_path));
      bos = token_text(cfg, "bos_token");
      eos = token_text(cfg, "eos_token");
      if (cfg.contains("chat_template")) {
        const auto& ct = cfg["chat_template"];
        if (ct.is_string()) {
          tmpl = ct.get<std::string>();
        } else if (ct.is_array()) {  // [{"name": "default", "template": "..."}, ...]
          for (const auto& e : ct)
            if (e.is_object() && e.value("name", "") == "default" && e.contains("template") && e["template"].is_string())
              tmpl = e["template"].get<std::string>();
        }
      }
    } catch (const nlohmann::json::exception& e) {
      throw InputError(cfg_path.string() + ": " + e.what());
    }
  }
  const fs::path jinja = fs::path(model_dir) / "chat_template.jinja";
  if (tmpl.empty() && fs::exists(jinja)) tmpl = read_file(jinja);
  return from_text(tmpl, bos, eos);
}

ChatTemplate ChatTemplate::from_text(const std::string& t, const std::string& bos, const std::string& eos) {
  ChatTemplate c;
  c.bos_ = bos;
  c.eos_ = eos;
  if (trim(t).empty()) c.family_ = Family::None;
  else if (t.find("<|im_start|>") != std::string::npos) c.family_ = Family::ChatML;
  else if (t.find("<|start_header_id|>") != std::string::npos) c.family_ = Family::Llama3;
  else if (t.find("<<SYS>>") != std::string::npos) c.family_ = Family::Llama2;
  else if (t.find("[INST]") != std::string::npos) c.family_ = Family::Mistral;
  else c.family_ = Family::Unknown;
  if (c.family_ == Family::ChatML) c.default_system_ = chatml_default_system(t);
  if (c.family_ == Family::Mistral) c.spaced_inst_ = t.find("[INST] ") != std::string::npos;
  if (c.bos_.empty() && c.family_ == Family::Llama3) c.bos_ = "<|begin_of_text|>";
  if (c.bos_.empty() && (c.family_ == Family::Llama2 || c.family_ == Family::Mistral)) c.bos_ = "<s>";
  if (c.eos_.empty() && (c.family_ == Family::Llama2 || c.family_ == Family::Mistral)) c.eos_ = "</s>";
  return c;
}

std::string ChatTemplate::family_name() const {
  switch (family_) {
    case Family::None: return "none";
    case Family::ChatML: return "chatml";
    case Family::Llama3: return "llama3";
    case Family::Llama2: return "llama2";
    case Family::Mistral: return "mistral";
    case Family::Unknown: return "unknown";
  }
  return "unknown";
}

std::string ChatTemplate::end_of_turn() const {
  switch (family_) {
    case Family::ChatML: return "<|im_end|>";
    case Family::Llama3: return "<|eot_id|>";
    default: return eos_;
  }
}

std::string ChatTemplate::render(const std::vector<ChatMessage>& messages) const {
  if (family_ == Family::None)
    throw InputError("this model has no chat template (tokenizer_config.json has no chat_template); "
                     "use /v1/completions with a plain prompt");
  if (family_ == Family::Unknown)
    throw InputError("this model's chat template is not one tiermoe understands "
                     "(supported: ChatML <|im_start|>, Llama-3 <|start_header_id|>, Llama-2 <<SYS>>, Mistral [INST]); "
                     "use /v1/completions");
  if (messages.empty()) throw InputError("messages: at least one message is needed");
  for (size_t i = 0; i < messages.size(); ++i) {
    const auto& r = messages[i].role;
    if (r != "system" && r != "user" && r != "assistant")
      throw InputError("messages[" + std::to_string(i) + "].role: must be system, user or assistant, got '" + r + "'");
  }
  std::string out;
  if (family_ == Family::ChatML) {
    if (messages[0].role != "system" && !default_system_.empty())
      out += "<|im_start|>system\n" + default_system_ + "<|im_end|>\n";
    for (const auto& m : messages) out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
    return out + "<|im_start|>assistant\n";
  }
  if (family_ == Family::Llama3) {
    out += bos_;
    for (const auto& m : messages)
      out += "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n" + trim(m.content) + "<|eot_id|>";
    return out + "<|start_header_id|>assistant<|end_header_id|>\n\n";
  }
  // [INST] families: an optional system turn, then user/assistant alternating, ending with user.
  size_t first = 0;
  std::string system;
  if (messages[0].role == "system") {
    system = messages[0].content;
    first = 1;
  }
  for (size_t i = first; i < messages.size(); ++i) {
    const bool user_turn = (i - first) % 2 == 0;
    if ((messages[i].role == "user") != user_turn)
      throw InputError("messages: this model's template needs user and assistant turns alternating, starting with user "
                       "(after an optional system message)");
  }
  if (messages.back().role != "user") throw InputError("messages: the last message must be from the user");
  for (size_t i = first; i < messages.size(); ++i) {
    const auto& m = messages[i];
    if (m.role == "user") {
      std::string content = m.content;
      if (family_ == Family::Llama2) {
        if (i == first && !system.empty()) content = "<<SYS>>\n" + system + "\n<</SYS>>\n\n" + content;
        out += bos_ + "[INST] " + trim(content) + " [/INST]";
      } else {
        if (i == messages.size() - 1 && !system.empty()) content = system + "\n\n" + content;
        if (i == first) out += bos_;
        out += spaced_inst_ ? "[INST] " + content + " [/INST]" : "[INST]" + content + "[/INST]";
      }
    } else {
      out += family_ == Family::Llama2 ? " " + trim(m.content) + " " + eos_ : m.content + eos_;
    }
  }
  return out;
}

}  // namespace tiermoe
