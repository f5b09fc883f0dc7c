// Chat templates. tiermoe does not run Jinja: it recognises the common families from the text
// of tokenizer_config.json's `chat_template` (or chat_template.jinja) and renders them in C++:
//   ChatML (Qwen, OLMoE-Instruct, ...)  <|im_start|>role\ncontent<|im_end|>\n
//   Llama-3                              <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>
//   Llama-2                              <s>[INST] <<SYS>>\nsys\n<</SYS>>\n\nuser [/INST] answer </s>
//   Mistral                              <s>[INST] user [/INST] answer</s> (system joined to the first user turn)
// Anything else is refused with a message that names the families understood.
#pragma once
#include <string>
#include <vector>

namespace tiermoe {

struct ChatMessage {
  std::string role;  // system | user | assistant
  std::string content;
};

class ChatTemplate {
 public:
  enum class Family { None, ChatML, Llama3, Llama2, Mistral, Unknown };

  // Reads <dir>/tokenizer_config.json (chat_template, bos_token, eos_token) and, when present,
  // <dir>/chat_template.jinja. Never throws for a missing template: family() is None.
  static ChatTemplate load(const std::string& model_dir);
  static ChatTemplate from_text(const std::string& tmpl, const std::string& bos, const std::string& eos);

  Family family() const { return family_; }
  std::string family_name() const;

  // The prompt text for `messages`, ending with the assistant header. Throws InputError when
  // the model has no usable template or the messages do not fit the template's rules.
  std::string render(const std::vector<ChatMessage>& messages) const;
  // Text that ends an assistant turn (generation stops there).
  std::string end_of_turn() const;

 private:
  Family family_ = Family::None;
  std::string bos_, eos_;
  std::string default_system_;  // ChatML templates that insert a system turn when none is given
  bool spaced_inst_ = true;     // Mistral: "[INST] x [/INST]" (v1) vs "[INST]x[/INST]" (tekken)
};

}  // namespace tiermoe
