#include "server/metrics.h"

#include <cstdio>

namespace tiermoe {
namespace {

std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

void gauge(std::string& out, const char* name, const char* type, const char* help, double v) {
  out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n" + name + " " + num(v) + "\n";
}

std::vector<double> latency_buckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60};
}

}  // namespace

void Histogram::observe(double v) {
  std::lock_guard lock(mu_);
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += v;
  ++count_;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& help) const {
  std::lock_guard lock(mu_);
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " histogram\n";
  uint64_t cum = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    out += name + "_bucket{le=\"" + num(bounds_[i]) + "\"} " + std::to_string(cum) + "\n";
  }
  cum += counts_.back();
  out += name + "_bucket{le=\"+Inf\"} " + std::to_string(cum) + "\n";
  out += name + "_sum " + num(sum_) + "\n" + name + "_count " + std::to_string(count_) + "\n";
}

ServerMetrics::ServerMetrics() : ttft_(latency_buckets()), itl_(latency_buckets()), e2e_(latency_buckets()) {}

void ServerMetrics::on_gauges(int64_t running, const KvTierBytes& kv, size_t kv_in_use) {
  running_ = running;
  kv_reserved_bytes_ = int64_t(kv_in_use);
  std::lock_guard lock(mu_);
  for (auto& [tier, bytes] : kv_bytes_) bytes = 0;  // a tier seen once stays, at 0 when empty
  for (const auto& [tier, bytes] : kv) kv_bytes_[tier] = bytes;
  if (running == 0) tokens_per_second_ = 0;
}

void ServerMetrics::on_step(int prompt_tokens, int generated_tokens) {
  prompt_tokens_total_ += prompt_tokens;
  generation_tokens_total_ += generated_tokens;
  ++steps_total_;
  std::lock_guard lock(mu_);
  window_tokens_ += generated_tokens;
  const auto now = std::chrono::steady_clock::now();
  const double s = std::chrono::duration<double>(now - window_start_).count();
  if (s > 2) {
    tokens_per_second_ = double(window_tokens_) / s;
    window_start_ = now;
    window_tokens_ = 0;
  }
}

void ServerMetrics::count_request(const std::string& endpoint, int status) {
  std::lock_guard lock(mu_);
  ++requests_[{endpoint, status}];
}

std::string ServerMetrics::render() const {
  std::string out;
  gauge(out, "tiermoe_queue_depth", "gauge", "Requests waiting for admission", double(queue_depth_.load()));
  gauge(out, "tiermoe_running_sequences", "gauge", "Sequences in the running batch", double(running_.load()));
  gauge(out, "tiermoe_kv_reserved_bytes", "gauge",
        "KV bytes the running sequences hold after their next step (whole pages), counted against the budget",
        double(kv_reserved_bytes_.load()));
  gauge(out, "tiermoe_kv_budget_bytes", "gauge", "KV bytes admission may reserve", double(kv_budget_bytes_.load()));
  gauge(out, "tiermoe_prompt_tokens_total", "counter", "Prompt tokens prefilled", double(prompt_tokens_total_.load()));
  gauge(out, "tiermoe_generation_tokens_total", "counter", "Tokens generated", double(generation_tokens_total_.load()));
  gauge(out, "tiermoe_cancelled_requests_total", "counter", "Requests dropped because the client went away",
        double(cancelled_total_.load()));
  gauge(out, "tiermoe_preemptions_total", "counter",
        "Running sequences sent back to the queue for KV memory (their caches freed, prefilled again later)",
        double(preemptions_total_.load()));
  gauge(out, "tiermoe_scheduler_steps_total", "counter", "Batched forward steps", double(steps_total_.load()));
  gauge(out, "tiermoe_prefix_cache_queried_tokens_total", "counter", "Prompt tokens of requests admitted with the prefix cache on",
        double(prefix_queried_tokens_total_.load()));
  gauge(out, "tiermoe_prefix_cache_hit_tokens_total", "counter", "Prompt tokens copied from the prefix cache instead of computed",
        double(prefix_hit_tokens_total_.load()));
  gauge(out, "tiermoe_prefix_cache_bytes", "gauge", "KV bytes the prefix cache holds (finished sequences kept for reuse)",
        double(prefix_cache_bytes_.load()));
  {
    std::lock_guard lock(mu_);
    gauge(out, "tiermoe_generation_tokens_per_second", "gauge", "Generated tokens per second, recent", tokens_per_second_);
    out += "# HELP tiermoe_kv_bytes KV cache bytes held by running sequences, per tier "
           "(sink/window/middle/archive of the tiered cache by their formats, exact otherwise; all: as allocated)\n"
           "# TYPE tiermoe_kv_bytes gauge\n";
    out += "tiermoe_kv_bytes{tier=\"all\"} " + num(double(kv_bytes_.count("all") ? kv_bytes_.at("all") : 0)) + "\n";
    for (const auto& [tier, bytes] : kv_bytes_)
      if (tier != "all") out += "tiermoe_kv_bytes{tier=\"" + tier + "\"} " + num(double(bytes)) + "\n";
    out += "# HELP tiermoe_requests_total HTTP requests answered\n# TYPE tiermoe_requests_total counter\n";
    for (const auto& [key, n] : requests_)
      out += "tiermoe_requests_total{endpoint=\"" + key.first + "\",status=\"" + std::to_string(key.second) + "\"} " +
             std::to_string(n) + "\n";
  }
  ttft_.render(out, "tiermoe_time_to_first_token_seconds", "Time from arrival to the first generated token");
  itl_.render(out, "tiermoe_inter_token_latency_seconds", "Time between consecutive generated tokens of a request");
  e2e_.render(out, "tiermoe_request_latency_seconds", "Time from arrival to the last token");
  return out;
}

}  // namespace tiermoe
