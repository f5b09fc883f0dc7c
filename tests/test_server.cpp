// tiermoe serve end to end on the embedded model: completions and SSE streaming, bad input
// (each followed by a good request), a client hanging up mid-stream, admission by KV memory and
// 429, and 32 concurrent streaming clients whose greedy outputs must equal the same requests
// run alone, with memory back to its baseline afterwards.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <mutex>

#include "test_server_util.h"

namespace tiermoe {
namespace {

using test::json;
using namespace std::chrono_literals;

std::vector<std::string> model_args(std::vector<std::string> extra = {}) {
  std::vector<std::string> a = {"--model", test::tinymix_dir(), "--kv", "f32"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// An OpenAI error body: {"error": {"message": str, "type": str, "param": str|null, "code": str|null}}.
void expect_error_body(const test::HttpResponse& r, int status, const std::string& what) {
  EXPECT_EQ(r.status, status) << what << ": " << r.body;
  json j;
  ASSERT_NO_THROW(j = json::parse(r.body)) << what << ": " << r.body;
  ASSERT_TRUE(j.contains("error") && j["error"].is_object()) << what;
  const json& e = j["error"];
  EXPECT_TRUE(e.contains("message") && e["message"].is_string() && !e["message"].get<std::string>().empty()) << what;
  EXPECT_TRUE(e.contains("type") && e["type"].is_string()) << what;
  EXPECT_TRUE(e.contains("param") && (e["param"].is_string() || e["param"].is_null())) << what;
  EXPECT_TRUE(e.contains("code") && (e["code"].is_string() || e["code"].is_null())) << what;
}

json greedy(const std::string& prompt, int max_tokens, bool stream = false) {
  return {{"model", "tinymix-code"}, {"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}, {"stream", stream}};
}

json ignoring_eos(json req) {
  req["ignore_eos"] = true;
  return req;
}

// Reads a streamed response from a raw socket until it has carried n SSE events.
bool receive_sse_events(int fd, size_t n) {
  std::string got;
  char buf[4096];
  while (test::sse_events(got.substr(std::min(got.size(), got.find("\r\n\r\n")))).size() < n) {
    const ssize_t r = recv(fd, buf, sizeof buf, 0);
    if (r <= 0) return false;
    got.append(buf, size_t(r));
  }
  return true;
}

// Text of a streamed completion; checks the stream is well-formed (chunks, one finish, [DONE]).
std::string streamed_text(const test::HttpResponse& r, std::string* finish = nullptr) {
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.headers.count("content-type") ? r.headers.at("content-type").substr(0, 17) : "", "text/event-stream");
  const auto ev = test::sse_events(r.body);
  EXPECT_FALSE(ev.empty());
  if (ev.empty()) return {};
  EXPECT_EQ(ev.back(), "[DONE]");
  std::string text;
  int finishes = 0;
  for (size_t i = 0; i + 1 < ev.size(); ++i) {
    const json j = json::parse(ev[i]);
    EXPECT_EQ(j["object"], "text_completion");
    if (j["choices"].empty()) continue;  // the usage chunk
    text += j["choices"][0]["text"].get<std::string>();
    if (!j["choices"][0]["finish_reason"].is_null()) {
      ++finishes;
      if (finish) *finish = j["choices"][0]["finish_reason"];
    }
  }
  EXPECT_EQ(finishes, 1);
  return text;
}

TEST(Server, CompletionStreamingModelsHealthMetrics) {
  test::ServerProcess srv(model_args());
  const int port = srv.port();
  auto health = test::http(port, "GET", "/health");
  EXPECT_EQ(health.status, 200);
  auto models = json::parse(test::http(port, "GET", "/v1/models").body);
  EXPECT_EQ(models["data"][0]["id"], "tinymix-code");

  auto r = test::post(port, "/v1/completions", greedy("def fibonacci(n):", 12));
  ASSERT_EQ(r.status, 200) << r.body;
  const json j = json::parse(r.body);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["completion_tokens"], 12);
  EXPECT_GT(j["usage"]["prompt_tokens"].get<int>(), 0);
  EXPECT_EQ(j["usage"]["total_tokens"].get<int>(), j["usage"]["prompt_tokens"].get<int>() + 12);
  const std::string text = j["choices"][0]["text"];
  EXPECT_FALSE(text.empty());

  json sreq = greedy("def fibonacci(n):", 12, true);
  sreq["stream_options"] = {{"include_usage", true}};
  auto s = test::post(port, "/v1/completions", sreq);
  std::string finish;
  EXPECT_EQ(streamed_text(s, &finish), text);
  EXPECT_EQ(finish, "length");
  const auto ev = test::sse_events(s.body);
  ASSERT_GE(ev.size(), 2u);
  EXPECT_EQ(json::parse(ev[ev.size() - 2])["usage"]["completion_tokens"], 12);

  // A stop string cuts the text before it, and finish_reason says "stop".
  ASSERT_GT(text.size(), 4u);
  json stop_req = greedy("def fibonacci(n):", 12);
  stop_req["stop"] = json::array({text.substr(2, 2)});
  auto st = json::parse(test::post(port, "/v1/completions", stop_req).body);
  EXPECT_EQ(st["choices"][0]["text"], text.substr(0, text.find(text.substr(2, 2))));
  EXPECT_EQ(st["choices"][0]["finish_reason"], "stop");

  // Seeded sampling is reproducible.
  json sampled = {{"prompt", "import os\n"}, {"max_tokens", 10}, {"temperature", 0.9}, {"top_p", 0.9}, {"seed", 42}};
  EXPECT_EQ(json::parse(test::post(port, "/v1/completions", sampled).body)["choices"][0]["text"],
            json::parse(test::post(port, "/v1/completions", sampled).body)["choices"][0]["text"]);

  // The chat endpoint on a model without a chat template: a clear 400.
  auto chat = test::post(port, "/v1/chat/completions", {{"messages", {{{"role", "user"}, {"content", "hi"}}}}});
  expect_error_body(chat, 400, "chat without template");
  EXPECT_NE(chat.body.find("no chat template"), std::string::npos);

  const std::string m = test::http(port, "GET", "/metrics").body;
  for (const char* name : {"tiermoe_queue_depth", "tiermoe_running_sequences", "tiermoe_kv_bytes{tier=\"all\"}", "tiermoe_kv_bytes{tier=\"exact\"}",
                           "tiermoe_generation_tokens_per_second", "tiermoe_time_to_first_token_seconds_bucket",
                           "tiermoe_inter_token_latency_seconds_bucket", "tiermoe_requests_total{"})
    EXPECT_NE(m.find(name), std::string::npos) << name;
  const size_t budget = m.find("\ntiermoe_kv_budget_bytes ");
  ASSERT_NE(budget, std::string::npos);
  EXPECT_NEAR(std::stod(m.substr(budget + 25)), 1024.0 * (1 << 20), 100);  // the CPU's default, 1024 MB
  EXPECT_EQ(srv.stop(), 0);  // SIGTERM: a clean exit
}

// The prefix cache (on by default): a request that starts with a finished one's prompt and answer
// reports those tokens as cached (OpenAI's usage.prompt_tokens_details) and in /metrics, and
// generates what the same request generates with the cache off.
TEST(Server, PrefixCacheReportsCachedTokens) {
  const std::string prompt =
      "import numpy as np\n\n\ndef moving_average(values, window):\n    \"\"\"Mean of each window of values.\"\"\"\n";
  json first_body;
  std::string next_text;
  {
    test::ServerProcess off(model_args({"--prefix-cache-mb", "0"}));
    first_body = json::parse(test::post(off.port(), "/v1/completions", greedy(prompt, 12)).body);
    EXPECT_EQ(first_body["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    const std::string next = prompt + first_body["choices"][0]["text"].get<std::string>() + "\n\ndef main():\n";
    next_text = json::parse(test::post(off.port(), "/v1/completions", greedy(next, 16)).body)["choices"][0]["text"];
  }
  test::ServerProcess srv(model_args());
  const int port = srv.port();
  const json a = json::parse(test::post(port, "/v1/completions", greedy(prompt, 12)).body);
  EXPECT_EQ(a["choices"][0]["text"], first_body["choices"][0]["text"]);
  EXPECT_EQ(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  const std::string next = prompt + a["choices"][0]["text"].get<std::string>() + "\n\ndef main():\n";
  const json b = json::parse(test::post(port, "/v1/completions", greedy(next, 16)).body);
  EXPECT_EQ(b["choices"][0]["text"], next_text);
  // Re-tokenized, the answer's text may split at other places than the ids generated; the
  // prompt's tokens at least are the same (less one at the seam).
  const int cached = b["usage"]["prompt_tokens_details"]["cached_tokens"];
  EXPECT_GE(cached, a["usage"]["prompt_tokens"].get<int>() - 1);
  EXPECT_LT(cached, b["usage"]["prompt_tokens"].get<int>());
  EXPECT_EQ(test::metric(port, "tiermoe_prefix_cache_hit_tokens_total"), cached);
  EXPECT_EQ(test::metric(port, "tiermoe_prefix_cache_queried_tokens_total"),
            a["usage"]["prompt_tokens"].get<int>() + b["usage"]["prompt_tokens"].get<int>());
  EXPECT_GT(test::metric(port, "tiermoe_prefix_cache_bytes"), 0);
}

TEST(Server, BadInputGets4xxAndServerKeepsServing) {
  test::ServerProcess srv(model_args());
  const int port = srv.port();
  const std::string ten_mb = "{\"prompt\": \"" + std::string(10 << 20, 'a') + "\"}";
  std::vector<int> too_long(5000, 17);
  struct Case {
    std::string name, path, body;
    int status;
  };
  const std::vector<Case> cases = {
      {"malformed JSON", "/v1/completions", "{\"prompt\": \"x\",", 400},
      {"not an object", "/v1/completions", "[1, 2]", 400},
      {"prompt wrong type", "/v1/completions", R"({"prompt": 5})", 400},
      {"max_tokens wrong type", "/v1/completions", R"({"prompt": "x", "max_tokens": "10"})", 400},
      {"temperature wrong type", "/v1/completions", R"({"prompt": "x", "temperature": "hot"})", 400},
      {"temperature out of range", "/v1/completions", R"({"prompt": "x", "temperature": -1})", 400},
      {"top_p out of range", "/v1/completions", R"({"prompt": "x", "top_p": 0})", 400},
      {"stream wrong type", "/v1/completions", R"({"prompt": "x", "stream": "yes"})", 400},
      {"stop wrong type", "/v1/completions", R"({"prompt": "x", "stop": 5})", 400},
      {"seed wrong type", "/v1/completions", R"({"prompt": "x", "seed": "s"})", 400},
      {"messages wrong type", "/v1/chat/completions", R"({"messages": "hi"})", 400},
      {"message role missing", "/v1/chat/completions", R"({"messages": [{"content": "hi"}]})", 400},
      {"unknown model", "/v1/completions", R"({"model": "gpt-9", "prompt": "x"})", 404},
      {"empty prompt", "/v1/completions", R"({"prompt": ""})", 400},
      {"empty prompt list", "/v1/completions", R"({"prompt": []})", 400},
      {"missing prompt", "/v1/completions", R"({"max_tokens": 3})", 400},
      {"token id out of vocabulary", "/v1/completions", R"({"prompt": [1, 99999999]})", 400},
      {"prompt longer than the context", "/v1/completions", json({{"prompt", too_long}}).dump(), 400},
      {"max_tokens 0", "/v1/completions", R"({"prompt": "x", "max_tokens": 0})", 400},
      {"max_tokens negative", "/v1/completions", R"({"prompt": "x", "max_tokens": -5})", 400},
      {"max_tokens huge", "/v1/completions", R"({"prompt": "x", "max_tokens": 1000000000000})", 400},
      {"max_tokens past the context", "/v1/completions", R"({"prompt": "x", "max_tokens": 4096})", 400},
      {"n > 1", "/v1/completions", R"({"prompt": "x", "n": 3})", 400},
      {"invalid UTF-8", "/v1/completions", "{\"prompt\": \"ab\xff\xfe\xc3\"}", 400},
      {"10 MB body", "/v1/completions", ten_mb, 413},
      {"unknown path", "/v1/nothing", "{}", 404},
  };
  const json good = greedy("x = 1\n", 3);
  for (const auto& c : cases) {
    expect_error_body(test::http(port, "POST", c.path, c.body), c.status, c.name);
    auto ok = test::post(port, "/v1/completions", good);
    EXPECT_EQ(ok.status, 200) << "after " << c.name << ": " << ok.body;
  }
  // A Content-Length that is no byte count, or far over the limit, with no body behind it: an
  // answer at once (cpp-httplib alone waited its 30 s read timeout, then closed without one).
  for (const auto& [length, status] : std::vector<std::pair<std::string, int>>{
           {"-5", 400}, {"12abc", 400}, {"99999999999999999999", 400}, {"100000000000", 413}}) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string what = "Content-Length: " + length;
    const std::string raw = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + what +
                            "\r\nContent-Type: application/json\r\n\r\n";
    expect_error_body(test::http(port, "", "", "", raw), status, what);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5)) << what;
  }
  // Not HTTP at all.
  auto garbage = test::http(port, "", "", "", "NOT-HTTP \x01\x02\r\n\r\n");
  EXPECT_TRUE(garbage.status == 400 || garbage.status == 0) << garbage.status;
  EXPECT_EQ(test::post(port, "/v1/completions", good).status, 200);
  // Nothing left behind.
  EXPECT_EQ(test::metric(port, "tiermoe_running_sequences"), 0);
  EXPECT_EQ(test::metric(port, "tiermoe_kv_bytes"), 0);
  EXPECT_EQ(srv.stop(), 0);
}

TEST(Server, ClientHangingUpMidStreamFreesItsSequence) {
  test::ServerProcess srv(model_args());
  const int port = srv.port();
  const int fd = test::connect_to(port, 30);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(test::send_all(fd, test::request_text("POST", "/v1/completions", ignoring_eos(greedy("class Node:", 3000, true)).dump())));
  ASSERT_TRUE(receive_sse_events(fd, 3));
  EXPECT_EQ(test::metric(port, "tiermoe_running_sequences"), 1);
  EXPECT_GT(test::metric(port, "tiermoe_kv_bytes"), 0);
  close(fd);  // hang up mid-stream
  EXPECT_TRUE(test::wait_until([&] { return test::metric(port, "tiermoe_running_sequences") == 0; }, 20s));
  EXPECT_EQ(test::metric(port, "tiermoe_kv_bytes"), 0);
  EXPECT_EQ(test::metric(port, "tiermoe_kv_reserved_bytes"), 0);
  EXPECT_EQ(test::metric(port, "tiermoe_cancelled_requests_total"), 1);
  EXPECT_LT(test::metric(port, "tiermoe_generation_tokens_total"), 3000);
  EXPECT_EQ(test::post(port, "/v1/completions", greedy("x = 1\n", 3)).status, 200);

  // The same for a client waiting for a non-streamed answer.
  const int fd2 = test::connect_to(port, 30);
  ASSERT_GE(fd2, 0);
  ASSERT_TRUE(test::send_all(fd2, test::request_text("POST", "/v1/completions", ignoring_eos(greedy("class Tree:", 3000)).dump())));
  EXPECT_TRUE(test::wait_until([&] { return test::metric(port, "tiermoe_running_sequences") == 1; }, 20s));
  close(fd2);
  EXPECT_TRUE(test::wait_until([&] { return test::metric(port, "tiermoe_running_sequences") == 0; }, 20s));
  EXPECT_EQ(test::metric(port, "tiermoe_kv_bytes"), 0);
  EXPECT_EQ(test::metric(port, "tiermoe_cancelled_requests_total"), 2);
  EXPECT_EQ(test::post(port, "/v1/completions", greedy("x = 1\n", 3)).status, 200);
}

TEST(Server, KvBytesPerTierOfTheTieredCache) {
  // The default tiered cache with a small window and middle: a 700-token prompt (past the 512
  // calibration tokens set here; default's are 768) spreads over all four tiers as it decodes.
  const std::string cfg = (std::filesystem::temp_directory_path() / ("tiermoe_tiers_" + std::to_string(getpid()) + ".json")).string();
  std::ofstream(cfg) << R"({"preset": "default", "window": 32, "middle": 128, "calib_tokens": 512})";
  test::ServerProcess srv({"--model", test::tinymix_dir(), "--kv-config", cfg});
  const int port = srv.port();
  std::vector<int> prompt(700);
  for (int i = 0; i < 700; ++i) prompt[size_t(i)] = (i * 37) % 8000 + 1;
  const int fd = test::connect_to(port, 60);
  ASSERT_GE(fd, 0);
  json req = ignoring_eos(greedy("", 2000, true));
  req["prompt"] = prompt;
  ASSERT_TRUE(test::send_all(fd, test::request_text("POST", "/v1/completions", req.dump())));
  ASSERT_TRUE(receive_sse_events(fd, 3));
  // One snapshot: the sequence keeps decoding between two requests.
  std::map<std::string, double> kv;
  {
    std::istringstream in(test::http(port, "GET", "/metrics").body);
    std::string line;
    const std::string prefix = "tiermoe_kv_bytes{tier=\"";
    while (std::getline(in, line))
      if (line.rfind(prefix, 0) == 0)
        kv[line.substr(prefix.size(), line.find('"', prefix.size()) - prefix.size())] = std::atof(line.c_str() + line.rfind(' ') + 1);
  }
  auto tier = [&](const std::string& t) { return kv.count(t) ? kv.at(t) : -1; };
  const double sink = tier("sink"), window = tier("window"), middle = tier("middle"), archive = tier("archive");
  const double all = tier("all");
  // tinymix: 8 layers x 2 KV heads x 128 = 2048 values per token; exact tiers hold BF16 K and V.
  const double exact_token = 2048 * 4;
  EXPECT_EQ(sink, 4 * exact_token);  // 4 sink tokens
  EXPECT_EQ(std::fmod(window, exact_token), 0) << window;
  EXPECT_GE(window / exact_token, 32);  // the window of 32, in whole 16-token pages
  EXPECT_LT(window / exact_token, 48);
  EXPECT_GT(middle, 0);
  EXPECT_GT(archive, 0);
  // Tiers are accounted by their formats; "all" is what the cache allocated, which may round
  // up to whole pages (at most one 16-token page of exact rows).
  EXPECT_NEAR(sink + window + middle + archive, all, 16 * exact_token) << sink << " " << window << " " << middle << " " << archive;
  // At least 700 - 4 - 48 tokens are coded, at ~2-4 bits instead of 32: counted as exact they
  // would be >= 5.3 MB; coded they stay under 3 MB even after 2000 generated tokens.
  EXPECT_LT(middle + archive, 0.6 * (700 - 4 - 48) * exact_token);
  close(fd);
  EXPECT_TRUE(test::wait_until([&] { return test::metric(port, "tiermoe_running_sequences") == 0; }, 20s));
  for (const char* t : {"sink", "window", "middle", "archive", "all"})
    EXPECT_EQ(test::metric(port, std::string("tiermoe_kv_bytes{tier=\"") + t + "\"}"), 0) << t;
  std::filesystem::remove(cfg);
}

TEST(Server, KvMemoryPreemptsQueuesThen429) {
  // 8 MiB of FP32 KV is 512 tokens of tinymix: two requests of ~400 positions start together,
  // and when they outgrow it the newer one is preempted back to the queue.
  test::ServerProcess srv(model_args({"--kv-memory-mb", "8", "--max-queue", "1"}));
  const int port = srv.port();
  const int fd = test::connect_to(port, 30);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(test::send_all(fd, test::request_text("POST", "/v1/completions", ignoring_eos(greedy("def a():", 400, true)).dump())));
  std::string got;
  char buf[4096];
  while (got.find("data: ") == std::string::npos) {  // A is running once its first token came
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    ASSERT_GT(n, 0) << got;
    got.append(buf, size_t(n));
  }
  test::HttpResponse b;
  std::thread tb([&] { b = test::post(port, "/v1/completions", ignoring_eos(greedy("def b():", 400))); });
  // B runs beside A until they outgrow the memory; then it waits for KV memory, not for a batch
  // slot (before that it may be seen in the queue on its way in).
  // 60 s: under AddressSanitizer on 2 busy cores the two requests took over 20 s to outgrow the memory.
  EXPECT_TRUE(test::wait_until([&] { return test::metric(port, "tiermoe_preemptions_total") == 1; }, 60s));
  EXPECT_TRUE(test::wait_until([&] {  // the gauges follow within the step
    return test::metric(port, "tiermoe_queue_depth") == 1 && test::metric(port, "tiermoe_running_sequences") == 1;
  }, 5s));
  auto c = test::post(port, "/v1/completions", greedy("def c():", 400));
  expect_error_body(c, 429, "queue full");
  EXPECT_EQ(c.headers["retry-after"], "1");
  close(fd);  // A leaves; B is admitted and completes
  tb.join();
  EXPECT_EQ(b.status, 200) << b.body;
  EXPECT_EQ(json::parse(b.body)["usage"]["completion_tokens"], 400);
  // Preempted and prefilled again with what it had generated: the text it gets alone.
  const auto b_alone = test::post(port, "/v1/completions", ignoring_eos(greedy("def b():", 400)));
  EXPECT_EQ(json::parse(b.body)["choices"][0]["text"], json::parse(b_alone.body)["choices"][0]["text"]);
  EXPECT_EQ(test::post(port, "/v1/completions", greedy("x = 1\n", 3)).status, 200);
}

TEST(Server, ChunkedPrefillKeepsDecodesGoing) {
  // A long prompt arriving while another request decodes is prefilled 64 tokens per step, and
  // the decoding request keeps getting a token every step meanwhile.
  test::ServerProcess srv(model_args({"--step-tokens", "64"}));
  const int port = srv.port();
  const int fd = test::connect_to(port, 60);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(test::send_all(fd, test::request_text("POST", "/v1/completions", ignoring_eos(greedy("def main():", 3000, true)).dump())));
  std::vector<std::chrono::steady_clock::time_point> arrivals;
  std::mutex mu;
  std::atomic<bool> stop{false};
  std::thread reader([&] {
    char buf[4096];
    while (!stop) {
      const ssize_t n = recv(fd, buf, sizeof buf, 0);
      if (n <= 0) break;
      std::lock_guard lock(mu);
      for (ssize_t i = 0; i + 5 < n; ++i)
        if (std::memcmp(buf + i, "data:", 5) == 0) arrivals.push_back(std::chrono::steady_clock::now());
    }
  });
  EXPECT_TRUE(test::wait_until([&] { std::lock_guard lock(mu); return arrivals.size() >= 3; }, 20s));
  std::vector<int> long_prompt(1500);
  for (int i = 0; i < 1500; ++i) long_prompt[size_t(i)] = (i * 37) % 8000 + 1;
  const double steps0 = test::metric(port, "tiermoe_scheduler_steps_total");
  const auto t0 = std::chrono::steady_clock::now();
  auto r = test::post(port, "/v1/completions", {{"prompt", long_prompt}, {"max_tokens", 1}, {"temperature", 0}});
  const auto t1 = std::chrono::steady_clock::now();
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_GE(test::metric(port, "tiermoe_scheduler_steps_total") - steps0, 1500 / 64);
  size_t during = 0;
  {
    std::lock_guard lock(mu);
    for (auto t : arrivals) during += t > t0 && t < t1;
  }
  EXPECT_GE(during, 5u) << "the decoding stream stalled during the long prefill";
  stop = true;
  shutdown(fd, SHUT_RDWR);
  reader.join();
  close(fd);
}

TEST(Server, ConcurrentStreamsMatchRequestsAlone) {
  test::ServerProcess srv(model_args({"--max-batch", "64", "--step-tokens", "64"}));
  const int port = srv.port();
  // Distinct prompts of different lengths, so prefill chunks and decodes mix in the steps.
  std::vector<std::string> prompts;
  for (int i = 0; i < 32; ++i) {
    std::string p = "def f" + std::to_string(i) + "(x):\n    ";
    for (int k = 0; k < i % 7; ++k) p += "y = x * " + std::to_string(k) + "\n    ";
    if (i % 5 == 0) p += std::string(120, '#') + "\n";
    prompts.push_back(p);
  }
  const int kTokens = 10, kClients = 32, kPerClient = 3;
  ASSERT_EQ(test::post(port, "/v1/completions", greedy("warm up", 2)).status, 200);
  const long rss0 = srv.rss_kb();

  std::mutex mu;
  std::map<int, std::vector<std::string>> batched;  // prompt index -> texts
  std::atomic<int> failures{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < kClients; ++c)
    clients.emplace_back([&, c] {
      for (int k = 0; k < kPerClient; ++k) {
        const int p = (c * 7 + k * 13) % int(prompts.size());
        auto r = test::post(port, "/v1/completions", greedy(prompts[size_t(p)], kTokens, true));
        std::string finish;
        const std::string text = streamed_text(r, &finish);
        if (r.status != 200 || finish.empty()) ++failures;
        std::lock_guard lock(mu);
        batched[p].push_back(text);
      }
    });
  for (auto& t : clients) t.join();
  EXPECT_EQ(failures.load(), 0);

  // The same requests alone, one at a time.
  int compared = 0;
  for (const auto& [p, texts] : batched) {
    auto r = test::post(port, "/v1/completions", greedy(prompts[size_t(p)], kTokens));
    ASSERT_EQ(r.status, 200);
    const std::string alone = json::parse(r.body)["choices"][0]["text"];
    for (const auto& t : texts) {
      EXPECT_EQ(t, alone) << "prompt " << p;
      ++compared;
    }
  }
  EXPECT_EQ(compared, kClients * kPerClient);
  // Memory back to the baseline: no sequence, no KV, nothing queued; RSS bounded.
  EXPECT_TRUE(test::wait_until([&] { return test::metric(port, "tiermoe_running_sequences") == 0; }, 10s));
  EXPECT_EQ(test::metric(port, "tiermoe_kv_bytes"), 0);
  EXPECT_EQ(test::metric(port, "tiermoe_kv_reserved_bytes"), 0);
  EXPECT_EQ(test::metric(port, "tiermoe_queue_depth"), 0);
  const long rss1 = srv.rss_kb();
  long bound_kb = 256 * 1024;
#ifdef __SANITIZE_ADDRESS__
  bound_kb += 512 * 1024;  // ASan keeps freed memory in quarantine (256 MB by default)
#endif
  EXPECT_LT(rss1 - rss0, bound_kb) << "RSS grew from " << rss0 << " kB to " << rss1 << " kB";
  EXPECT_EQ(srv.stop(), 0);  // under ASan, LeakSanitizer at the server's exit would make this non-zero
}

TEST(Server, BadBackendFlagsEndWithExitCode2NamingTheFlag) {
  const std::string bin = std::getenv("TIERMOE_BIN") ? std::getenv("TIERMOE_BIN") : "";
  ASSERT_FALSE(bin.empty()) << "TIERMOE_BIN is not set";
  const std::string model = " --model " + test::tinymix_dir();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"serve --port 0 --backend tpu" + model, "--backend must be cpu or cuda"},
      {"generate --prompt-ids 1,2 --backend tpu" + model, "--backend must be cpu or cuda"},
      {"serve --port 0 --load-format dummy" + model, "--load-format dummy needs --backend cuda"},
      {"generate --prompt-ids 1,2 --load-format bogus" + model, "--load-format must be auto or dummy"},
      {"bench --gen 1 --backend tpu" + model, "--backend must be cpu or cuda"},
      {"bench --gen 1 --load-format dummy" + model, "--load-format dummy needs --backend cuda"},
      {"bench --gen 1 --config " + test::repo_path("configs/olmoe-1b-7b-v8192.json"),
       "bench: --config FILE needs --load-format dummy, not 'auto'"},
      {"bench --gen 1 --load-format bogus --config " + test::repo_path("configs/olmoe-1b-7b-v8192.json"),
       "bench: --config FILE needs --load-format dummy, not 'bogus'"},
      {"bench --gen 1", "bench: give --model DIR (or --config FILE --load-format dummy)"},
      {"bench --gen 1 --top-p 2" + model, "top_p must be in (0, 1]"},
      {"serve --port 99999" + model, "--port must be in 0..65535"},
      {"serve --port -1" + model, "--port must be in 0..65535"},
      {"serve --port 0 --prefix-cache-mb -1" + model, "--prefix-cache-mb must be >= 0"},
      {"serve --port 0 --kv-memory-mb -1" + model, "--kv-memory-mb must be >= 0"},
      {"serve --port 0 --step-tokens -5" + model, "--step-tokens must be >= 0"},
  };
  for (const auto& [args, message] : cases) {
    FILE* p = popen((bin + " " + args + " 2>&1").c_str(), "r");
    ASSERT_NE(p, nullptr);
    std::string out;
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
    const int st = pclose(p);
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 2) << args << ": " << out;
    EXPECT_NE(out.find(message), std::string::npos) << args << ": " << out;
  }
}

}  // namespace
}  // namespace tiermoe
