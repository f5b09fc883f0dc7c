// Server counters, gauges and latency histograms, rendered in the Prometheus text format.
#pragma once
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

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

struct ServerMetrics {
  ServerMetrics();

  // Requests answered, by endpoint and HTTP status.
  void count_request(const std::string& endpoint, int status);

  std::atomic<int64_t> queue_depth{0}, running{0};
  std::atomic<int64_t> kv_bytes{0}, kv_reserved_bytes{0}, kv_budget_bytes{0};
  std::atomic<int64_t> prompt_tokens_total{0}, generation_tokens_total{0};
  std::atomic<int64_t> cancelled_total{0}, steps_total{0};
  std::atomic<double> generation_tokens_per_second{0};  // over the last few seconds
  Histogram ttft, itl, e2e;

  std::string render() const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> requests_;
};

}  // namespace tiermoe
