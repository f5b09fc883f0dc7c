// The engine and the command line on the embedded model: held-out NLL against transformers,
// the exact JSON forms other tools rely on, and clear errors for bad input.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <sys/wait.h>

#include "core/check.h"
#include "engine/engine.h"
#include "test_util.h"

namespace tiermoe {
namespace {

struct CmdResult {
  int status;
  std::string out;  // stdout and stderr together, or stdout alone
};

CmdResult run_cli(const std::string& args, bool with_stderr = true) {
  // ctest sets TIERMOE_BIN; run by hand, the CLI is next to the test binary.
  const char* bin = std::getenv("TIERMOE_BIN");
  const std::string exe = bin ? bin : (std::filesystem::read_symlink("/proc/self/exe").parent_path() / "tiermoe").string();
  const std::string cmd = exe + " " + args + (with_stderr ? " 2>&1" : " 2>/dev/null");
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

std::string model_flag() { return "--model " + test::tinymix_dir(); }

EngineOptions tinymix_options() {
  EngineOptions o;
  o.model_dir = test::tinymix_dir();
  return o;
}

TEST(Engine, HeldoutWindowNllMatchesTransformers) {
  Engine engine(tinymix_options());
  Checkpoint ref = Checkpoint::open_file(test::tinymix_dir() + "/reference.safetensors");
  const auto expected = test::floats(ref.get("heldout_window_nll"));
  // The text is ASCII-heavy; 60k characters give more than 4 windows of 2048 tokens, and BPE
  // is local, so cutting the text far past the last window cannot change those tokens.
  std::string text = test::read_file(test::tinymix_dir() + "/heldout.txt").substr(0, 60000);
  const auto ids = engine.tokenizer().encode(text);
  ASSERT_GE(ids.size(), expected.size() * 2048 + 100);
  for (size_t w = 0; w < expected.size(); ++w) {
    ScoreResult r = engine.score(std::span(ids).subspan(w * 2048, 2048));
    EXPECT_NEAR(r.mean_nll, expected[w], 1e-4) << "window " << w;
  }
}

TEST(Engine, StopStringEndsGenerationAndIsNotEmitted) {
  Engine engine(tinymix_options());
  GenerateRequest req;
  req.prompt = engine.tokenizer().encode("import numpy as np\n\ndef softmax(x, axis=-1):\n    ");
  req.sampling.temperature = 0;
  req.max_tokens = 32;
  GenerateResult full = engine.generate(req);
  ASSERT_GE(full.text.size(), 8u);
  req.stop = {full.text.substr(4, 3)};
  std::string streamed;
  GenerateResult cut = engine.generate(req, [&](std::string_view s) { streamed += s; });
  EXPECT_EQ(cut.finish_reason, "stop");
  EXPECT_EQ(cut.text, full.text.substr(0, full.text.find(req.stop[0])));
  EXPECT_EQ(streamed, cut.text);
}

TEST(Engine, BadRequestsAreInputErrors) {
  Engine engine(tinymix_options());
  GenerateRequest req;
  EXPECT_THROW(engine.generate(req), InputError);  // empty prompt
  req.prompt = {1, 2, 999999};
  EXPECT_THROW(engine.generate(req), InputError);
  req.prompt = {1, 2};
  req.max_tokens = -1;
  EXPECT_THROW(engine.generate(req), InputError);
  std::vector<int32_t> too_long(size_t(engine.config().max_position_embeddings) + 1, 5);
  EXPECT_THROW(engine.score(too_long), InputError);
}

TEST(Cli, GenerateGreedyJsonMatchesReference) {
  Checkpoint ref = Checkpoint::open_file(test::tinymix_dir() + "/reference.safetensors");
  const auto prompt = test::ints(ref.get("short_ids"));
  const auto expected = test::ints(ref.get("short_greedy_ids"));
  std::string ids;
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (i) ids += ',';
    ids += std::to_string(prompt[i]);
  }
  CmdResult r = run_cli("generate " + model_flag() + " --prompt-ids " + ids + " --greedy --json --max-tokens " +
                        std::to_string(expected.size()));
  ASSERT_EQ(r.status, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["ids"].get<std::vector<int32_t>>(), expected);
  EXPECT_TRUE(j["text"].is_string());
}

TEST(Cli, TokenizeAndScoreJson) {
  CmdResult t = run_cli("tokenize " + model_flag() + " --text 'def f(x):\n    return x' --json");
  ASSERT_EQ(t.status, 0) << t.out;
  auto ids = nlohmann::json::parse(t.out)["ids"].get<std::vector<int>>();
  ASSERT_GT(ids.size(), 3u);
  std::string list;
  for (size_t i = 0; i < ids.size(); ++i) list += (i ? "," : "") + std::to_string(ids[i]);
  CmdResult s = run_cli("score " + model_flag() + " --ids " + list + " --logits-at 0," + std::to_string(ids.size() - 1) + " --json");
  ASSERT_EQ(s.status, 0) << s.out;
  auto j = nlohmann::json::parse(s.out);
  ASSERT_EQ(j["nll"].size(), ids.size() - 1);
  double mean = 0;
  for (auto& x : j["nll"]) mean += x.get<double>();
  EXPECT_NEAR(j["mean_nll"].get<double>(), mean / double(ids.size() - 1), 1e-5);
  EXPECT_EQ(j["logits"]["0"].size(), 8192u);
  EXPECT_EQ(j["logits"][std::to_string(ids.size() - 1)].size(), 8192u);
  // One token: its logits, but no next token to score, so no mean (not a mean of 0, perplexity 1).
  CmdResult one = run_cli("score " + model_flag() + " --ids 5 --logits-at 0 --json");
  ASSERT_EQ(one.status, 0) << one.out;
  auto j1 = nlohmann::json::parse(one.out);
  EXPECT_TRUE(j1["nll"].empty());
  EXPECT_TRUE(j1["mean_nll"].is_null()) << one.out;
  EXPECT_EQ(j1["logits"]["0"].size(), 8192u);
  CmdResult text = run_cli("score " + model_flag() + " --ids 5");
  EXPECT_NE(text.out.find("no next token to score"), std::string::npos) << text.out;
}

TEST(Cli, PplJson) {
  CmdResult r = run_cli("ppl " + model_flag() + " --file " + test::tinymix_dir() + "/heldout.txt --ctx 128 --windows 2 --json");
  ASSERT_EQ(r.status, 0) << r.out;
  auto j = nlohmann::json::parse(r.out.substr(r.out.find('{')));
  EXPECT_EQ(j["windows"], 2);
  EXPECT_GT(j["ppl"].get<double>(), 1.0);
  EXPECT_NEAR(std::log(j["ppl"].get<double>()), j["mean_nll"].get<double>(), 1e-9);
}

struct BadCli {
  const char* args;
  const char* expected;
};

TEST(Cli, BadInputGivesClearErrorAndExitCode2) {
  const std::string m = model_flag();
  const BadCli cases[] = {
      {"score --model /nonexistent/model --ids 1,2", "/nonexistent/model"},
      {"score MODEL --ids 1,x,3", "'x' is not an integer"},
      {"score MODEL --ids 1,2,99999", "outside the vocabulary"},
      {"score MODEL --ids 1,2 --logits-at 5", "logits-at"},
      {"generate MODEL -p hi --temperature -1", "temperature"},
      {"ppl MODEL --file /nonexistent/text.txt", "/nonexistent/text.txt"},
      {"ppl MODEL --file MODELDIR/README.md --ctx 100000", "--ctx"},
      {"tokenize --model /nonexistent/model --text hi", "/nonexistent/model"},
      {"generate MODEL -p hi --threads -3", "--threads"},
      {"generate MODEL -p hi --max-tokenz 3", "--max-tokenz"},
      {"generate MODEL -p hi --gpu-kv-gib 2", "--gpu-kv-gib needs --backend cuda"},
      {"generate MODEL -p hi --gpu-kv-gib -1", "--gpu-kv-gib"},
  };
  for (const BadCli& c : cases) {
    std::string args = c.args;
    if (auto p = args.find("MODELDIR"); p != std::string::npos) args.replace(p, 8, test::tinymix_dir());
    if (auto p = args.find("MODEL "); p != std::string::npos) args.replace(p, 5, m);
    CmdResult r = run_cli(args);
    EXPECT_EQ(r.status, 2) << args << "\n" << r.out;
    EXPECT_NE(r.out.find(c.expected), std::string::npos) << args << "\n" << r.out;
    EXPECT_EQ(r.out.find("internal error"), std::string::npos) << r.out;
  }
  // An output path that cannot be written: refused before the calibration runs, not after it.
  const CmdResult cal = run_cli("calibrate " + m + " --kv default --file " + test::tinymix_dir() +
                                "/README.md --tokens 256 -o /nonexistent/dir/profile.bin");
  EXPECT_EQ(cal.status, 2) << cal.out;
  EXPECT_NE(cal.out.find("/nonexistent/dir/profile.bin: its directory does not exist"), std::string::npos) << cal.out;
  EXPECT_EQ(cal.out.find("calibrate ["), std::string::npos) << "calibrated first:\n" << cal.out;
  // A bad sampling flag: the error alone, nothing on stdout (the prompt was echoed before it).
  const CmdResult r = run_cli("generate " + m + " -p 'def f(' --top-k -3", false);
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_EQ(r.out, "");
}

}  // namespace
}  // namespace tiermoe
