#include "server/scheduler.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "core/check.h"
#include "engine/stop_matcher.h"

namespace tiermoe {
namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

constexpr int kPageTokens = 16;      // reservations round up to whole pages
constexpr int kMinPrefillChunk = 16;  // prefill progresses even when decodes fill the step


}  // namespace

// ---- SeqStream ----

SeqStream::Chunk SeqStream::take(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return !pending_.empty() || finished_; });
  Chunk c;
  c.text = std::exchange(pending_, {});
  c.finished = finished_;
  c.finish_reason = finish_reason_;
  c.error = error_;
  c.prompt_tokens = prompt_tokens_;
  c.completion_tokens = completion_tokens_;
  return c;
}

void SeqStream::push(const std::string& text, int completion_tokens) {
  {
    std::lock_guard lock(mu_);
    pending_ += text;
    completion_tokens_ = completion_tokens;
  }
  cv_.notify_all();
}

void SeqStream::finish(const std::string& reason, int completion_tokens, const std::string& error) {
  {
    std::lock_guard lock(mu_);
    finished_ = true;
    finish_reason_ = reason;
    error_ = error;
    completion_tokens_ = completion_tokens;
  }
  cv_.notify_all();
}

// ---- Scheduler ----

struct Scheduler::Seq {
  Seq(SeqRequest r, const Tokenizer& tok)
      : req(std::move(r)), sampler(req.sampling), decoder(tok), stops(req.stop) {}
  SeqRequest req;
  std::shared_ptr<SeqStream> out = std::make_shared<SeqStream>();
  std::unique_ptr<KvCache> cache;
  Sampler sampler;
  StreamDecoder decoder;
  StopMatcher stops;
  size_t reserved = 0;  // KV bytes reserved at admission
  int prefilled = 0;    // prompt tokens already in the cache
  int generated = 0;
  int32_t next = -1;    // the last sampled token, fed at the next step
  Clock::time_point arrival = Clock::now(), last_token;

  bool decoding() const { return prefilled == int(req.prompt.size()); }
};

Scheduler::Scheduler(Engine& engine, const SchedulerOptions& opts, ServerMetrics& metrics)
    : engine_(engine), opts_(opts), metrics_(metrics) {
  if (opts_.max_batch < 1) throw InputError("--max-batch must be >= 1");
  if (opts_.max_queue < 0) throw InputError("--max-queue must be >= 0");
  if (opts_.step_tokens < 1) throw InputError("--step-tokens must be >= 1");
  // What one token costs in this backend's cache: measured on a probe sequence, so that the
  // estimate follows whatever the cache stores (exact, BF16, compressed tiers).
  constexpr int kProbe = 64;
  auto probe = engine_.backend().new_cache();
  const std::vector<int32_t> ids(kProbe, engine_.config().eos_token_ids.empty() ? 0 : engine_.config().eos_token_ids[0]);
  engine_.backend().forward(ids, *probe, 0, nullptr);
  bytes_per_token_ = std::max<size_t>(1, (probe->bytes() + kProbe - 1) / kProbe);
  metrics_.kv_budget_bytes = int64_t(opts_.kv_budget_bytes);
  thread_ = std::thread([this] { loop(); });
}

Scheduler::~Scheduler() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

size_t Scheduler::reservation_bytes(size_t prompt_tokens, int max_tokens) const {
  const size_t tokens = prompt_tokens + size_t(std::max(max_tokens, 0));
  return (tokens + kPageTokens - 1) / kPageTokens * kPageTokens * bytes_per_token_;
}

std::shared_ptr<SeqStream> Scheduler::submit(SeqRequest req) {
  CHECK(!req.prompt.empty());
  auto seq = std::make_unique<Seq>(std::move(req), engine_.tokenizer());  // Sampler validates
  seq->reserved = reservation_bytes(seq->req.prompt.size(), seq->req.max_tokens);
  if (seq->reserved > opts_.kv_budget_bytes)
    throw InputError("the request needs " + std::to_string(seq->reserved) + " bytes of KV cache (prompt + max_tokens), " +
                     "more than the server's budget of " + std::to_string(opts_.kv_budget_bytes));
  seq->out->prompt_tokens_ = int(seq->req.prompt.size());
  auto out = seq->out;
  {
    std::lock_guard lock(mu_);
    if (stop_) throw QueueFull("the server is shutting down");
    if (int(waiting_.size()) >= opts_.max_queue) throw QueueFull("the request queue is full");
    waiting_.push_back(std::move(seq));
    metrics_.queue_depth = int64_t(waiting_.size());
  }
  cv_.notify_all();
  return out;
}

void Scheduler::loop() {
  std::vector<std::unique_ptr<Seq>> running;
  Clock::time_point window_start = Clock::now();
  int64_t window_tokens0 = 0;
  for (;;) {
    {
      std::unique_lock lock(mu_);
      if (running.empty()) {
        metrics_.generation_tokens_per_second = 0;
        cv_.wait(lock, [&] { return stop_ || !waiting_.empty(); });
      }
      if (stop_) break;
      for (auto it = waiting_.begin(); it != waiting_.end();) {
        if ((*it)->out->cancelled()) {
          (*it)->out->finish("cancelled", 0);
          ++metrics_.cancelled_total;
          it = waiting_.erase(it);
        } else {
          ++it;
        }
      }
      // Admission, first come first served: the head waits until its reservation fits (an
      // empty batch always takes it, so a large request cannot wait forever).
      while (!waiting_.empty() && int(running.size()) < opts_.max_batch &&
             (running.empty() || reserved_bytes_ + waiting_.front()->reserved <= opts_.kv_budget_bytes)) {
        auto& s = waiting_.front();
        reserved_bytes_ += s->reserved;
        s->cache = engine_.backend().new_cache();
        running.push_back(std::move(s));
        waiting_.pop_front();
      }
      metrics_.queue_depth = int64_t(waiting_.size());
    }
    if (!running.empty()) step(running);
    publish_gauges(running);
    const auto now = Clock::now();
    if (now - window_start > std::chrono::seconds(2)) {
      const int64_t total = metrics_.generation_tokens_total.load();
      metrics_.generation_tokens_per_second = double(total - window_tokens0) / seconds(now - window_start);
      window_start = now;
      window_tokens0 = total;
    }
  }
  for (auto& s : running) s->out->finish("cancelled", s->generated);
  std::lock_guard lock(mu_);
  for (auto& s : waiting_) s->out->finish("cancelled", 0);
  waiting_.clear();
}

void Scheduler::publish_gauges(const std::vector<std::unique_ptr<Seq>>& running) {
  size_t kv = 0;
  for (const auto& s : running) kv += s->cache->bytes();
  metrics_.kv_bytes = int64_t(kv);
  metrics_.kv_reserved_bytes = int64_t(reserved_bytes_);
  metrics_.running = int64_t(running.size());
}

void Scheduler::step(std::vector<std::unique_ptr<Seq>>& running) {
  auto retire = [&](size_t i) {
    reserved_bytes_ -= running[i]->reserved;
    running.erase(running.begin() + ptrdiff_t(i));  // frees the KV cache now
  };
  for (size_t i = running.size(); i-- > 0;)
    if (running[i]->out->cancelled()) {
      auto out = running[i]->out;
      const int generated = running[i]->generated;
      ++metrics_.cancelled_total;
      retire(i);
      publish_gauges(running);
      out->finish("cancelled", generated);
    }
  if (running.empty()) return;

  // Decodes first (one token each), then prompt chunks in arrival order with what is left.
  std::vector<Backend::SeqStep> steps;
  std::vector<Seq*> with_logits;
  int n_decode = 0;
  for (auto& s : running)
    if (s->decoding()) {
      steps.push_back({std::span(&s->next, 1), s->cache.get(), 1});
      with_logits.push_back(s.get());
      ++n_decode;
    }
  int budget = std::max(opts_.step_tokens - n_decode, kMinPrefillChunk);
  for (auto& s : running) {
    if (s->decoding() || budget <= 0) continue;
    const int n = std::min(budget, int(s->req.prompt.size()) - s->prefilled);
    const bool last = s->prefilled + n == int(s->req.prompt.size());
    steps.push_back({std::span(s->req.prompt.data() + s->prefilled, size_t(n)), s->cache.get(), last ? 1 : 0});
    if (last) with_logits.push_back(s.get());
    s->prefilled += n;
    budget -= n;
    metrics_.prompt_tokens_total += n;
  }
  // forward_batch writes logits in step order; with_logits follows the same order.
  const int V = engine_.config().vocab_size;
  std::vector<float> logits(with_logits.size() * size_t(V));
  engine_.backend().forward_batch(steps, logits.data());
  ++metrics_.steps_total;

  const auto now = Clock::now();
  const int ctx = engine_.config().max_position_embeddings;
  struct Finished {
    std::shared_ptr<SeqStream> out;
    std::string reason;
    int generated;
  };
  std::vector<Finished> finished;
  for (size_t r = 0; r < with_logits.size(); ++r) {
    Seq& s = *with_logits[r];
    const int32_t id = s.sampler.sample(std::span(logits.data() + r * size_t(V), size_t(V)));
    if (s.generated == 0) metrics_.ttft.observe(seconds(now - s.arrival));
    else metrics_.itl.observe(seconds(now - s.last_token));
    s.last_token = now;
    std::string reason;
    if (std::find(s.req.stop_ids.begin(), s.req.stop_ids.end(), id) != s.req.stop_ids.end()) {
      reason = "stop";
    } else {
      ++s.generated;
      ++metrics_.generation_tokens_total;
      bool stopped = false;
      std::string text = s.stops.push(s.decoder.push(id), &stopped);
      if (stopped) {
        reason = "stop";
      } else if (s.generated >= s.req.max_tokens || int(s.req.prompt.size()) + s.generated >= ctx) {
        text += s.stops.push(s.decoder.flush(), &stopped);
        if (!stopped) text += s.stops.flush();
        reason = stopped ? "stop" : "length";
      }
      if (!text.empty()) s.out->push(text, s.generated);
      s.next = id;
    }
    if (!reason.empty()) {
      finished.push_back({s.out, reason, s.generated});
      metrics_.e2e.observe(seconds(now - s.arrival));
      s.next = -1;  // marks it for retirement below
    }
  }
  for (size_t i = running.size(); i-- > 0;)
    if (running[i]->decoding() && running[i]->next < 0) retire(i);
  // Clients hear that they are done only once their KV is freed and the gauges say so.
  publish_gauges(running);
  for (auto& f : finished) f.out->finish(f.reason, f.generated);
}

}  // namespace tiermoe
