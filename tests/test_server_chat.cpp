// Chat templates (each family rendered as its Jinja template would), the OpenAI request parser,
// and /v1/chat/completions against tinymix with a ChatML template added in a temp model dir.
#include <gtest/gtest.h>

#include <filesystem>

#include "core/check.h"
#include "server/chat_template.h"
#include "server/openai_protocol.h"
#include "test_server_util.h"
#include "tokenizer/tokenizer.h"

namespace tiermoe {
namespace {

using test::json;
namespace fs = std::filesystem;

const std::vector<ChatMessage> kConversation = {
    {"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello!"}, {"user", "2+2?"}};

TEST(ChatTemplate, ChatMLFromQwenStyleFixture) {
  const auto t = ChatTemplate::load(test::repo_path("tests/fixtures/tokenizers/qwen_style"));
  ASSERT_EQ(t.family(), ChatTemplate::Family::ChatML);
  EXPECT_EQ(t.render(kConversation),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(t.end_of_turn(), "<|im_end|>");
}

TEST(ChatTemplate, QwenDefaultSystemPrompt) {
  // Qwen2's template (abridged): a system turn is inserted when the conversation has none.
  const std::string qwen2 =
      "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
      "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
      "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
      "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
  const auto t = ChatTemplate::from_text(qwen2, "", "<|im_end|>");
  EXPECT_EQ(t.render({{"user", "Hi"}}),
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(t.render({{"system", "S"}, {"user", "Hi"}}),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

TEST(ChatTemplate, Llama3) {
  const auto t = ChatTemplate::from_text(
      "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
      "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}",
      "<|begin_of_text|>", "<|eot_id|>");
  ASSERT_EQ(t.family(), ChatTemplate::Family::Llama3);
  EXPECT_EQ(t.render({{"system", "S "}, {"user", "Hi"}}),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
}

TEST(ChatTemplate, Llama2AndMistral) {
  const auto l2 = ChatTemplate::from_text("... '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' ... '[INST] ' ...",
                                          "<s>", "</s>");
  ASSERT_EQ(l2.family(), ChatTemplate::Family::Llama2);
  EXPECT_EQ(l2.render(kConversation),
            "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] 2+2? [/INST]");
  const auto mi = ChatTemplate::from_text("{{ bos_token }}... '[INST] ' + message['content'] + ' [/INST]' ...", "<s>", "</s>");
  ASSERT_EQ(mi.family(), ChatTemplate::Family::Mistral);
  EXPECT_EQ(mi.render(kConversation), "<s>[INST] Hi [/INST]Hello!</s>[INST] Be brief.\n\n2+2? [/INST]");
  EXPECT_THROW(mi.render({{"user", "a"}, {"user", "b"}}), InputError);       // must alternate
  EXPECT_THROW(mi.render({{"user", "a"}, {"assistant", "b"}}), InputError);  // must end with user
}

TEST(ChatTemplate, NoneAndUnknownAreRefused) {
  const auto none = ChatTemplate::load(test::tinymix_dir());
  EXPECT_EQ(none.family(), ChatTemplate::Family::None);
  EXPECT_THROW(none.render({{"user", "hi"}}), InputError);
  const auto odd = ChatTemplate::from_text("{% for m in messages %}<<{{ m.content }}>>{% endfor %}", "", "");
  EXPECT_EQ(odd.family(), ChatTemplate::Family::Unknown);
  EXPECT_THROW(odd.render({{"user", "hi"}}), InputError);
  const auto chatml = ChatTemplate::from_text("<|im_start|>", "", "");
  EXPECT_THROW(chatml.render({{"tool", "x"}}), InputError);
}

TEST(OpenAIProtocol, FieldsAreValidatedByName) {
  auto param_of = [](const std::string& body, bool chat = false) {
    try {
      parse_api_request(body, chat);
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status, 400);
      return e.param;
    }
    return std::string("(accepted)");
  };
  EXPECT_EQ(param_of(R"({"prompt": "x", "max_tokens": 1.5})"), "max_tokens");
  EXPECT_EQ(param_of(R"({"prompt": "x", "top_p": 1.5})"), "top_p");
  EXPECT_EQ(param_of(R"({"prompt": "x", "stop": ["a", 3]})"), "stop[1]");
  EXPECT_EQ(param_of(R"({"prompt": ["a", "b"]})"), "prompt");
  EXPECT_EQ(param_of(R"({"prompt": [1.5]})"), "prompt[0]");  // a token id that is no integer
  EXPECT_EQ(param_of(R"({"prompt": [2, 1.5]})"), "prompt[1]");
  EXPECT_EQ(param_of(R"({"prompt": [null]})"), "prompt[0]");
  EXPECT_EQ(param_of(R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})", true),
            "messages[0].content[0].type");
  EXPECT_EQ(param_of(R"({"prompt": "x", "presence_penalty": 0.5})"), "presence_penalty");
  // A number JSON cannot hold (the parser's out_of_range, not a parse_error) is a bad body too.
  for (const char* body : {R"({"prompt": "x", "max_tokens": 1e309})", R"({"prompt": "x", "temperature": -1e400})"}) {
    try {
      parse_api_request(body, false);
      ADD_FAILURE() << body << " was accepted";
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status, 400) << body;
      EXPECT_EQ(e.code, "invalid_json") << body;
    }
  }
  const auto r = parse_api_request(
      R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
          "max_completion_tokens": 7, "stop": "END", "seed": -3, "stream": true,
          "stream_options": {"include_usage": true}})",
      true);
  EXPECT_EQ(r.messages[0].content, "ab");
  EXPECT_EQ(*r.max_tokens, 7);
  EXPECT_EQ(r.stop, std::vector<std::string>{"END"});
  EXPECT_TRUE(r.stream && r.include_usage);
  EXPECT_EQ(*r.seed, -3);
}

// tinymix with a ChatML template: its byte-level vocabulary has no <|im_start|> token, so the
// markers are tokenized as text (the model was not trained on chat; the protocol is what is tested).
std::string chatml_model_dir() {
  const std::string dir = test::temp_dir("chatml_model");
  for (const auto& e : fs::directory_iterator(test::tinymix_dir())) {
    const std::string name = e.path().filename().string();
    if (name == "tokenizer_config.json" || name.ends_with(".xz")) continue;
    fs::create_symlink(e.path(), fs::path(dir) / name);
  }
  json cfg = json::parse(test::read_file(test::tinymix_dir() + "/tokenizer_config.json"));
  cfg["chat_template"] = json::parse(test::read_file(test::repo_path("tests/fixtures/tokenizers/qwen_style/tokenizer_config.json")))["chat_template"];
  test::write_text(dir + "/tokenizer_config.json", cfg.dump(2));
  return dir;
}

TEST(ServerChat, ChatCompletionsWithChatMLTemplate) {
  const std::string dir = chatml_model_dir();
  test::ServerProcess srv({"--model", dir, "--served-model-name", "tiny-chat"});
  const int port = srv.port();
  const json req = {{"model", "tiny-chat"},
                    {"messages", {{{"role", "system"}, {"content", "You write Python."}}, {{"role", "user"}, {"content", "def add(a, b):"}}}},
                    {"max_tokens", 10},
                    {"temperature", 0}};
  auto r = test::post(port, "/v1/chat/completions", req);
  ASSERT_EQ(r.status, 200) << r.body;
  const json j = json::parse(r.body);
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  const std::string content = j["choices"][0]["message"]["content"];
  // The prompt is the rendered template, tokenized.
  const Tokenizer tok = Tokenizer::load(dir);
  const std::string rendered = "<|im_start|>system\nYou write Python.<|im_end|>\n<|im_start|>user\ndef add(a, b):<|im_end|>\n<|im_start|>assistant\n";
  EXPECT_EQ(j["usage"]["prompt_tokens"].get<size_t>(), tok.encode(rendered).size());

  json sreq = req;
  sreq["stream"] = true;
  auto s = test::post(port, "/v1/chat/completions", sreq);
  ASSERT_EQ(s.status, 200);
  const auto ev = test::sse_events(s.body);
  ASSERT_GE(ev.size(), 3u);
  EXPECT_EQ(ev.back(), "[DONE]");
  EXPECT_EQ(json::parse(ev[0])["choices"][0]["delta"]["role"], "assistant");
  std::string streamed;
  for (size_t i = 0; i + 1 < ev.size(); ++i) {
    const json c = json::parse(ev[i]);
    EXPECT_EQ(c["object"], "chat.completion.chunk");
    if (c["choices"][0]["delta"].contains("content")) streamed += c["choices"][0]["delta"]["content"].get<std::string>();
  }
  EXPECT_EQ(streamed, content);
  EXPECT_EQ(srv.stop(), 0);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace tiermoe
