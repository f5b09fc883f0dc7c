// The OpenAI-compatible HTTP server (cpp-httplib): /v1/completions, /v1/chat/completions (with
// SSE streaming), /v1/models, /health, /metrics. Requests are validated here, tokenized on the
// HTTP threads, and handed to the engine's Scheduler, which owns the backend.
#pragma once
#include <functional>
#include <string>

#include "engine/engine.h"
#include "server/metrics.h"

namespace tiermoe {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                // 0: any free port (printed when listening)
  std::string model_dir;          // where tokenizer_config.json (chat template) is read
  std::string model_name;         // the id clients pass as "model"
  size_t max_body_bytes = 4 << 20;
};

// Serves until stop() is called from another thread (or a signal handler thread).
// on_listening receives the bound port once the socket is bound.
class HttpServer {
 public:
  // metrics: the observer the engine was built with (EngineOptions::observer), so that the
  // scheduler's gauges and latencies land in /metrics.
  HttpServer(Engine& engine, const ServerOptions& opts, std::shared_ptr<ServerMetrics> metrics);
  ~HttpServer();
  void run(const std::function<void(int port)>& on_listening);
  void stop();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace tiermoe
