// Server counters, gauges and latency histograms, rendered in the Prometheus text format.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "engine/scheduler.h"

namespace tiermoe {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
  void observe(double v);
  void render(std::string& out, const std::string& name, const std::string& help) const;

 private:
  mutable std::mutex mu_;
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket (not cumulative); last is +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

// Fed by the engine's scheduler (as its observer) and by the HTTP handlers.
class ServerMetrics : public SchedulerObserver {
 public:
  ServerMetrics();

  // Requests answered, by endpoint and HTTP status.
  void count_request(const std::string& endpoint, int status);
  void set_kv_budget(size_t bytes) { kv_budget_bytes_ = int64_t(bytes); }

  void on_queue_depth(int64_t waiting) override { queue_depth_ = waiting; }
  void on_gauges(int64_t running, const KvTierBytes& kv, size_t kv_in_use) override;
  void on_step(int prompt_tokens, int generated_tokens) override;
  void on_first_token(double s) override { ttft_.observe(s); }
  void on_next_token(double s) override { itl_.observe(s); }
  void on_finished(double s) override { e2e_.observe(s); }
  void on_cancelled() override { ++cancelled_total_; }
  void on_preempted() override { ++preemptions_total_; }
  void on_prefix_lookup(int prompt_tokens, int hit_tokens) override {
    prefix_queried_tokens_total_ += prompt_tokens;
    prefix_hit_tokens_total_ += hit_tokens;
  }
  void on_prefix_cache_bytes(size_t bytes) override { prefix_cache_bytes_ = int64_t(bytes); }

  std::string render() const;

 private:
  std::atomic<int64_t> queue_depth_{0}, running_{0}, kv_reserved_bytes_{0}, kv_budget_bytes_{0};
  std::atomic<int64_t> prompt_tokens_total_{0}, generation_tokens_total_{0};
  std::atomic<int64_t> cancelled_total_{0}, steps_total_{0}, preemptions_total_{0};
  std::atomic<int64_t> prefix_queried_tokens_total_{0}, prefix_hit_tokens_total_{0}, prefix_cache_bytes_{0};
  Histogram ttft_, itl_, e2e_;

  mutable std::mutex mu_;  // guards what follows
  std::map<std::pair<std::string, int>, uint64_t> requests_;
  KvTierBytes kv_bytes_;
  // Generated tokens per second over windows of ~2 s; 0 while idle.
  std::chrono::steady_clock::time_point window_start_ = std::chrono::steady_clock::now();
  int64_t window_tokens_ = 0;
  double tokens_per_second_ = 0;
};

}  // namespace tiermoe
