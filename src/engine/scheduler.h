// Continuous batching, the engine's one decode loop: one thread owns the Backend and, every
// iteration, runs one forward_sample over all running sequences (one token each when decoding,
// a chunk of the prompt when prefilling), then admits waiting requests while the KV memory
// they need now fits the budget; when the running sequences outgrow it, the newest are
// preempted (back to the queue, prefilled again later). Callers (Engine::generate, the HTTP server's threads) submit
// requests and read their output through a SeqStream; what the loop does is reported to a
// SchedulerObserver (the server's metrics), so the engine does not depend on the server.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "engine/prefix_cache.h"
#include "engine/sampler.h"
#include "model/config.h"
#include "tokenizer/tokenizer.h"

namespace tiermoe {

struct SchedulerOptions {
  int max_batch = 64;    // running sequences at most
  int max_queue = 128;   // waiting requests at most (beyond: QueueFull, HTTP 429)
  // Tokens per forward_batch (decodes + prefill chunks); 0: the backend's pass size (512 on the CPU,
  // 2048 on the GPU), so that a lone request runs the same passes as Backend::forward.
  int step_tokens = 0;
  // KV memory the running sequences may hold (their tokens, in whole pages); the scheduler
  // lowers it to the backend's own KV memory (Backend::kv_capacity_bytes) where that is smaller
  // (options() shows the result). A request whose prompt + max_tokens could not fit alone is refused.
  size_t kv_budget_bytes = std::numeric_limits<size_t>::max();
  // Decode steps queued ahead where the backend runs them ahead of the host (Backend::
  // overlaps_steps): while the batch stays the same, the next step runs on the device while the
  // host streams this one's tokens. false: one step at a time.
  bool overlap = true;
  // Finished sequences' KV kept for later prompts that start with the same tokens (PrefixCache),
  // at most these bytes and within kv_budget_bytes beside the running sequences; 0: off. For caches
  // that copy their prefixes (KvCache::copy_prefix; a tiered cache only some of them).
  size_t prefix_cache_bytes = 0;
};

struct SeqRequest {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  int max_tokens = 16;
  std::vector<std::string> stop;   // stop strings (cut before)
  std::vector<int32_t> stop_ids;   // stop tokens (EOS and the chat template's end token)
};

// Output of one request: filled by the scheduler, drained by the caller's thread.
class SeqStream {
 public:
  struct Chunk {
    std::string text;           // new text since the last take()
    std::vector<int32_t> ids;   // new tokens since the last take()
    bool finished = false;
    std::string finish_reason;  // "stop" | "length" | "cancelled" | "error"
    std::string error;          // when finish_reason is "error" (the backend failed)
    int prompt_tokens = 0, completion_tokens = 0;
    int cached_tokens = 0;  // prompt tokens copied from the prefix cache, not computed
  };
  // Waits until there is something new or the request finished, at most `timeout`.
  Chunk take(std::chrono::milliseconds timeout);
  // The client went away: the scheduler drops the sequence and its KV cache at its next step.
  void cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }

 private:
  friend class Scheduler;
  void push(const std::string& text, int32_t id, int completion_tokens);
  void finish(const std::string& reason, int completion_tokens, const std::string& error = {});

  std::mutex mu_;
  std::condition_variable cv_;
  std::string pending_;
  std::vector<int32_t> pending_ids_;
  bool finished_ = false;
  std::string finish_reason_, error_;
  int prompt_tokens_ = 0, completion_tokens_ = 0, cached_tokens_ = 0;
  std::atomic<bool> cancelled_{false};
};

// KV bytes of a sequence by tier: the tiered cache's sink / window / middle / archive (tokens
// times their format's bits), "exact" for caches without tiers, and "all": KvCache::bytes(),
// what is allocated (the tiers' sum up to page rounding).
using KvTierBytes = std::map<std::string, int64_t>;
KvTierBytes kv_bytes_by_tier(const KvCache& cache, const KvGeometry& g);

// What the loop does, for metrics. Called from the scheduler's thread (on_queue_depth also
// from submitting threads); implementations must be thread-safe and quick.
class SchedulerObserver {
 public:
  virtual ~SchedulerObserver() = default;
  virtual void on_queue_depth(int64_t waiting) {}
  // kv_in_use: the KV bytes the running sequences hold after their next step (whole pages).
  virtual void on_gauges(int64_t running, const KvTierBytes& kv, size_t kv_in_use) {}
  virtual void on_step(int prompt_tokens, int generated_tokens) {}
  virtual void on_first_token(double seconds_since_arrival) {}
  virtual void on_next_token(double seconds_since_previous) {}
  virtual void on_finished(double seconds_since_arrival) {}
  virtual void on_cancelled() {}
  virtual void on_preempted() {}
  // The prefix cache: at each admission, the prompt's tokens and how many came from the cache;
  // after every change, the bytes it holds.
  virtual void on_prefix_lookup(int prompt_tokens, int hit_tokens) {}
  virtual void on_prefix_cache_bytes(size_t bytes) {}
};

struct QueueFull : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Scheduler {
 public:
  // tokenizer: for streamed text and stop strings (nullptr: ids only). The observer, when
  // given, must outlive the scheduler.
  Scheduler(Backend& backend, const ModelConfig& cfg, const Tokenizer* tokenizer, const SchedulerOptions& opts,
            std::shared_ptr<SchedulerObserver> observer = nullptr);
  ~Scheduler();  // stops the thread; unfinished requests end with finish_reason "cancelled"

  // Throws QueueFull when the queue is full, InputError when the request can never fit.
  std::shared_ptr<SeqStream> submit(SeqRequest req);

  // KV bytes of prompt + max_tokens positions (whole pages, the cache's metadata included): what
  // a sequence of that many tokens is counted as holding.
  size_t reservation_bytes(size_t prompt_tokens, int max_tokens) const;
  const SchedulerOptions& options() const { return opts_; }

 private:
  struct Seq;
  void loop();
  struct Finished {
    std::shared_ptr<SeqStream> out;
    std::string reason;
    int generated;
  };
  void step(std::vector<std::unique_ptr<Seq>>& running);
  void step_ahead(std::vector<std::unique_ptr<Seq>>& running);
  void deliver(const std::vector<Seq*>& seqs, const std::vector<int32_t>& ids, std::vector<Finished>& finished,
               int& n_generated);
  void admit(Seq& s);
  void preempt(std::vector<std::unique_ptr<Seq>>& running);
  size_t kv_in_use(const std::vector<std::unique_ptr<Seq>>& running) const;
  bool make_room(size_t need);
  void retire(std::vector<std::unique_ptr<Seq>>& running, size_t i);
  void retire_finished(std::vector<std::unique_ptr<Seq>>& running, const std::vector<Finished>& finished);
  std::vector<Backend::SampleRow> draw_rows(const std::vector<Seq*>& seqs);
  void drain_ahead();
  void publish_gauges(const std::vector<std::unique_ptr<Seq>>& running);

  Backend& backend_;
  const ModelConfig& cfg_;
  const Tokenizer* tokenizer_;
  SchedulerOptions opts_;
  std::shared_ptr<SchedulerObserver> observer_;  // never null (a no-op one when none is given)
  size_t bytes_per_token_ = 0;  // estimate for reservations
  int page_tokens_ = 16;        // reservations round up to the backend's KV pages
  std::optional<PrefixCache> prefix_;  // when on and the backend's caches copy prefixes; owned by the thread

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Seq>> waiting_;
  bool stop_ = false;
  std::vector<Seq*> ahead_;    // the sequences of the step queued ahead (overlap), in order; owned by the thread
  std::thread thread_;
};

}  // namespace tiermoe
