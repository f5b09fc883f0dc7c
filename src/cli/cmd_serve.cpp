// tiermoe serve: the OpenAI-compatible HTTP server. SIGINT/SIGTERM stop it cleanly: a signal
// thread (the only one that receives them) stops the listener; the scheduler then drains.
#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <pthread.h>
#include <thread>

#include "cli/common.h"
#include "core/check.h"
#include "server/http_server.h"

namespace tiermoe {

int run_serve(const CommonOptions& c, const ServeOptions& s) {
  // Block the stop signals in every thread created from here on; one thread waits for them.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);  // a client that left must not kill the server

  // The engine's thread pool spins between loops; leave a core to the HTTP threads (parsing,
  // tokenizing, streaming) unless the user chose. On 2 cores this measured ~4x faster decode.
  int threads = c.threads;
  if (threads <= 0 && !std::getenv("TIERMOE_THREADS"))
    threads = std::max(1, int(std::thread::hardware_concurrency()) - 1);
  if (s.port < 0 || s.port > 65535)
    throw InputError("--port must be in 0..65535 (0: any free port), got " + std::to_string(s.port));
  if (s.max_batch < 1) throw InputError("--max-batch must be >= 1");
  if (s.kv_memory_mb < 0) throw InputError("--kv-memory-mb must be >= 0 (0: the backend's default), got " + std::to_string(s.kv_memory_mb));
  if (s.step_tokens < 0) throw InputError("--step-tokens must be >= 0 (0: the backend's default), got " + std::to_string(s.step_tokens));
  if (s.prefix_cache_mb < 0) throw InputError("--prefix-cache-mb must be >= 0 (0: off), got " + std::to_string(s.prefix_cache_mb));
  EngineOptions eo = engine_options(c);  // --kv, --kv-config, --kv-profile, --backend as every command
  eo.threads = threads;
  eo.scheduler.max_batch = s.max_batch;
  eo.scheduler.max_queue = s.max_queue;
  // The defaults by backend. The GPU's: its whole KV pool (the scheduler lowers the budget to the
  // backend's KV memory; 1 GB would hold ~11k tokens of Qwen3-30B-A3B on a 141 GB GPU), and steps of
  // its prompt pass size (among 4 decoding streams a 4,153-token prompt's first token in 92 ms
  // against 164 at 256, the streams' longest gap about the same; docs/server.md "On the GPU").
  const bool gpu = c.backend == "cuda";
  eo.scheduler.step_tokens = s.step_tokens > 0 ? s.step_tokens : gpu ? 0 : 256;  // 0: the backend's passes
  eo.scheduler.overlap = s.overlap;
  eo.scheduler.kv_budget_bytes = s.kv_memory_mb > 0 ? size_t(s.kv_memory_mb) << 20
                                 : gpu                ? std::numeric_limits<size_t>::max()
                                                      : size_t(1024) << 20;
  eo.scheduler.prefix_cache_bytes = size_t(s.prefix_cache_mb) << 20;
  auto metrics = std::make_shared<ServerMetrics>();
  eo.observer = metrics;
  Engine engine(eo);
  ServerOptions opts;
  opts.host = s.host;
  opts.port = s.port;
  opts.model_dir = c.model_dir;
  opts.model_name = s.model_name.empty() ? std::filesystem::path(c.model_dir).lexically_normal().filename().string()
                                         : s.model_name;
  if (opts.model_name.empty()) opts.model_name = std::filesystem::path(c.model_dir).parent_path().filename().string();
  HttpServer server(engine, opts, metrics);

  std::thread signals([&] {
    int sig = 0;
    sigwait(&stop_signals, &sig);
    std::fprintf(stderr, "tiermoe serve: signal %d, stopping\n", sig);
    server.stop();
  });
  try {
    server.run([&](int port) {
      std::printf("tiermoe serve: model '%s' listening on http://%s:%d\n", opts.model_name.c_str(), opts.host.c_str(), port);
      std::fflush(stdout);
    });
  } catch (...) {
    pthread_kill(signals.native_handle(), SIGTERM);
    signals.join();
    throw;
  }
  // The listener stopped (by a signal, or it failed): make sure the signal thread ends too.
  pthread_kill(signals.native_handle(), SIGTERM);
  signals.join();
  return 0;
}

}  // namespace tiermoe
