// Continuous batching: one thread owns the Backend and, every iteration, runs one
// forward_batch over all running sequences (one token each when decoding, a chunk of the prompt
// when prefilling), then admits waiting requests while their KV reservation fits the budget.
// HTTP threads submit requests and read their output through a SeqStream.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "server/metrics.h"

namespace tiermoe {

struct SchedulerOptions {
  int max_batch = 64;            // running sequences at most
  int max_queue = 128;           // waiting requests at most (beyond: QueueFull, HTTP 429)
  int step_tokens = 256;         // tokens per forward_batch (decodes + prefill chunks)
  size_t kv_budget_bytes = size_t(1) << 30;  // KV memory that admitted sequences may reserve
};

struct SeqRequest {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  int max_tokens = 16;
  std::vector<std::string> stop;   // stop strings (cut before)
  std::vector<int32_t> stop_ids;   // stop tokens (EOS and the chat template's end token)
};

// Output of one request: filled by the scheduler, drained by an HTTP thread.
class SeqStream {
 public:
  struct Chunk {
    std::string text;           // new text since the last take()
    bool finished = false;
    std::string finish_reason;  // "stop" | "length" | "cancelled" | "error"
    std::string error;          // when finish_reason is "error"
    int prompt_tokens = 0, completion_tokens = 0;
  };
  // Waits until there is new text or the request finished, at most `timeout`; returns what is new.
  Chunk take(std::chrono::milliseconds timeout);
  // The client went away: the scheduler drops the sequence and its KV cache at its next step.
  void cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }

 private:
  friend class Scheduler;
  void push(const std::string& text, int completion_tokens);
  void finish(const std::string& reason, int completion_tokens, const std::string& error = {});

  std::mutex mu_;
  std::condition_variable cv_;
  std::string pending_;
  bool finished_ = false;
  std::string finish_reason_, error_;
  int prompt_tokens_ = 0, completion_tokens_ = 0;
  std::atomic<bool> cancelled_{false};
};

struct QueueFull : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Scheduler {
 public:
  Scheduler(Engine& engine, const SchedulerOptions& opts, ServerMetrics& metrics);
  ~Scheduler();  // stops the thread; unfinished requests end with finish_reason "cancelled"

  // Throws QueueFull when the queue is full, InputError when the request can never fit.
  std::shared_ptr<SeqStream> submit(SeqRequest req);

  // KV bytes one request reserves (prompt + max_tokens positions).
  size_t reservation_bytes(size_t prompt_tokens, int max_tokens) const;
  const SchedulerOptions& options() const { return opts_; }

 private:
  struct Seq;
  void loop();
  void step(std::vector<std::unique_ptr<Seq>>& running);
  void publish_gauges(const std::vector<std::unique_ptr<Seq>>& running);

  Engine& engine_;
  SchedulerOptions opts_;
  ServerMetrics& metrics_;
  size_t bytes_per_token_ = 0;  // estimate for reservations, raised when caches report more

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Seq>> waiting_;
  bool stop_ = false;
  size_t reserved_bytes_ = 0;  // owned by the scheduler thread
  std::thread thread_;
};

}  // namespace tiermoe
