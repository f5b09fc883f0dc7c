#include "engine/scheduler.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

#include "core/check.h"
#include "engine/stop_matcher.h"

namespace tiermoe {
namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

constexpr int kMinPrefillChunk = 16;  // prefill progresses even when decodes fill the step

}  // namespace

KvTierBytes kv_bytes_by_tier(const KvCache& cache, const KvGeometry& g) {
  KvTierBytes out;
  const KvCache::Stats st = cache.stats();
  // A tier's bits per value times its values: the accounting of Stats::token_bytes.
  const double values_per_token = double(g.num_layers) * g.num_kv_heads * g.head_dim;
  for (const auto& t : st.tiers) out[t.tier] += int64_t(double(t.tokens) * values_per_token * (t.k_bits + t.v_bits) / 8);
  if (st.tiers.empty()) out["exact"] = int64_t(st.held_bytes);
  out["all"] = int64_t(st.held_bytes);
  return out;
}

// ---- SeqStream ----

SeqStream::Chunk SeqStream::take(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return !pending_ids_.empty() || finished_; });
  Chunk c;
  c.text = std::exchange(pending_, {});
  c.ids = std::exchange(pending_ids_, {});
  c.finished = finished_;
  c.finish_reason = finish_reason_;
  c.error = error_;
  c.prompt_tokens = prompt_tokens_;
  c.completion_tokens = completion_tokens_;
  c.cached_tokens = cached_tokens_;
  return c;
}

void SeqStream::push(const std::string& text, int32_t id, int completion_tokens) {
  {
    std::lock_guard lock(mu_);
    pending_ += text;
    pending_ids_.push_back(id);
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
  Seq(SeqRequest r, const Tokenizer* tok) : req(std::move(r)), context(req.prompt), sampler(req.sampling), stops(req.stop) {
    if (tok) decoder.emplace(*tok);
  }
  SeqRequest req;
  // What the cache must hold before the next token is sampled: the prompt; after a preemption,
  // the prompt and every token generated (the last one's logits give the next).
  std::vector<int32_t> context;
  std::shared_ptr<SeqStream> out = std::make_shared<SeqStream>();
  std::unique_ptr<KvCache> cache;
  Sampler sampler;
  std::optional<StreamDecoder> decoder;  // none: ids only, no text
  StopMatcher stops;
  int prefilled = 0;    // context tokens already in the cache
  int generated = 0;
  std::vector<int32_t> ids;  // tokens delivered: the cache holds the prompt, then these as they are fed
  int32_t next = -1;    // the last sampled token, fed at the next step
  Clock::time_point arrival = Clock::now(), last_token;

  bool decoding() const { return prefilled == int(context.size()); }
  // The prompt, then every token delivered.
  std::vector<int32_t> history() const {
    std::vector<int32_t> t = req.prompt;
    t.insert(t.end(), ids.begin(), ids.end());
    return t;
  }
  // Tokens its cache holds after the next step: a decode's one more, a prompt's all of it.
  size_t next_tokens() const { return decoding() ? size_t(cache->length()) + 1 : context.size(); }
};

Scheduler::Scheduler(Backend& backend, const ModelConfig& cfg, const Tokenizer* tokenizer, const SchedulerOptions& opts,
                     std::shared_ptr<SchedulerObserver> observer)
    : backend_(backend), cfg_(cfg), tokenizer_(tokenizer), opts_(opts),
      observer_(observer ? std::move(observer) : std::make_shared<SchedulerObserver>()) {
  if (opts_.max_batch < 1) throw InputError("--max-batch must be >= 1");
  if (opts_.max_queue < 0) throw InputError("--max-queue must be >= 0");
  if (opts_.step_tokens < 0) throw InputError("--step-tokens must be >= 0 (0: the backend's pass size)");
  if (opts_.step_tokens == 0) opts_.step_tokens = backend.pass_tokens();
  // A backend with KV memory of its own (the CUDA page pool) bounds the budget: admission then
  // never starts more sequences than it can hold.
  opts_.kv_budget_bytes = std::min(opts_.kv_budget_bytes, backend.kv_capacity_bytes());
  page_tokens_ = std::max(1, backend.kv_page_tokens());
  // What one token costs in this backend's cache: measured on a short probe sequence, so that
  // the estimate follows whatever the cache stores (exact, BF16, compressed tiers). Per-sequence
  // metadata counts too: a tiered cache holds its codec-fitting sample (BF16 rows, query
  // statistics) until its last refit, which makes a short sequence the costliest per token, so
  // the estimate over-counts long ones rather than under-count short ones.
  const int probe_tokens = std::min(64, cfg_.max_position_embeddings);
  auto probe = backend_.new_cache();
  const std::vector<int32_t> ids(size_t(probe_tokens), cfg_.eos_token_ids.empty() ? 0 : cfg_.eos_token_ids[0]);
  backend_.forward(ids, *probe, 0, nullptr);
  const KvCache::Stats st = probe->stats();
  bytes_per_token_ = std::max<size_t>(1, size_t(std::ceil((st.held_bytes + st.meta_bytes) / probe_tokens)));
  if (opts_.prefix_cache_bytes > 0 && probe->copy_prefix(probe->length())) prefix_.emplace(opts_.prefix_cache_bytes);
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
  return (tokens + page_tokens_ - 1) / page_tokens_ * page_tokens_ * bytes_per_token_;
}

size_t Scheduler::kv_in_use(const std::vector<std::unique_ptr<Seq>>& running) const {
  size_t bytes = 0;
  for (const auto& s : running) bytes += reservation_bytes(s->next_tokens(), 0);
  return bytes;
}

// Whether `need` bytes fit the budget, once the prefix cache has given up what they need (its
// entries hold the same memory: the CUDA pool's pages).
bool Scheduler::make_room(size_t need) {
  if (prefix_) prefix_->shrink_to(need <= opts_.kv_budget_bytes ? opts_.kv_budget_bytes - need : 0);
  return need <= opts_.kv_budget_bytes;
}

std::shared_ptr<SeqStream> Scheduler::submit(SeqRequest req) {
  if (req.prompt.empty()) throw InputError("prompt: empty (at least one token is needed)");
  if (req.max_tokens < 1) throw InputError("max_tokens: must be >= 1, got " + std::to_string(req.max_tokens));
  check_token_ids(req.prompt, cfg_, "prompt");
  if (int(req.prompt.size()) >= cfg_.max_position_embeddings)
    throw InputError("prompt: " + std::to_string(req.prompt.size()) + " tokens leave no room to generate in the model's context of " +
                     std::to_string(cfg_.max_position_embeddings));
  auto seq = std::make_unique<Seq>(std::move(req), tokenizer_);  // Sampler validates
  const size_t most = reservation_bytes(seq->req.prompt.size(), seq->req.max_tokens);
  if (most > opts_.kv_budget_bytes)
    throw InputError("the request needs " + std::to_string(most) + " bytes of KV cache (prompt + max_tokens), " +
                     "more than the budget of " + std::to_string(opts_.kv_budget_bytes) +
                     " (--kv-memory-mb, at most the backend's own KV memory)");
  seq->out->prompt_tokens_ = int(seq->req.prompt.size());
  auto out = seq->out;
  {
    std::lock_guard lock(mu_);
    if (stop_) throw QueueFull("the scheduler is shutting down");
    if (int(waiting_.size()) >= opts_.max_queue) throw QueueFull("the request queue is full");
    waiting_.push_back(std::move(seq));
    observer_->on_queue_depth(int64_t(waiting_.size()));
  }
  cv_.notify_all();
  return out;
}

void Scheduler::loop() {
  std::vector<std::unique_ptr<Seq>> running;
  for (;;) {
    std::vector<Seq*> admitted;
    {
      std::unique_lock lock(mu_);
      if (running.empty()) cv_.wait(lock, [&] { return stop_ || !waiting_.empty(); });
      if (stop_) break;
      for (auto it = waiting_.begin(); it != waiting_.end();) {
        if ((*it)->out->cancelled()) {
          (*it)->out->finish("cancelled", (*it)->generated);  // generated: a preempted one's
          observer_->on_cancelled();
          it = waiting_.erase(it);
        } else {
          ++it;
        }
      }
      // Admission, first come first served: the head waits until the running sequences' next
      // step and its whole context, with a token to spare, fit the budget (an empty batch always
      // takes it, so a large request cannot wait forever). The prefix cache gives up what they need.
      while (!waiting_.empty() && int(running.size()) < opts_.max_batch) {
        const size_t need = kv_in_use(running) + reservation_bytes(waiting_.front()->context.size() + 1, 0);
        if (!running.empty() && need > opts_.kv_budget_bytes) break;
        make_room(need);
        admitted.push_back(waiting_.front().get());
        running.push_back(std::move(waiting_.front()));
        waiting_.pop_front();
      }
      observer_->on_queue_depth(int64_t(waiting_.size()));
    }
    for (Seq* s : admitted) admit(*s);
    if (!running.empty()) {
      try {
        step(running);
      } catch (const std::exception& e) {
        // The backend failed (e.g. out of memory): end every running request with the reason,
        // free their caches, and keep serving.
        drain_ahead();
        std::vector<std::pair<std::shared_ptr<SeqStream>, int>> failed;
        for (auto& s : running) failed.emplace_back(s->out, s->generated);
        running.clear();
        publish_gauges(running);
        for (auto& [out, generated] : failed) out->finish("error", generated, e.what());
      }
    }
    publish_gauges(running);
  }
  drain_ahead();
  for (auto& s : running) s->out->finish("cancelled", s->generated);
  std::lock_guard lock(mu_);
  for (auto& s : waiting_) s->out->finish("cancelled", 0);
  waiting_.clear();
}

// The steps queued ahead taken and dropped (their sequences are ending): the backend takes
// other work only with nothing queued.
void Scheduler::drain_ahead() {
  ahead_.clear();
  std::vector<int32_t> ids(size_t(opts_.max_batch));
  try {
    while (backend_.queued_steps() > 0) backend_.take_sample(ids.data());
  } catch (const std::exception&) {  // the backend failed again: its queue is what it is
  }
}

void Scheduler::publish_gauges(const std::vector<std::unique_ptr<Seq>>& running) {
  const KvGeometry g{cfg_.num_layers, cfg_.num_kv_heads, cfg_.num_heads, cfg_.head_dim};
  KvTierBytes kv{{"all", 0}};
  for (const auto& s : running)
    for (const auto& [tier, bytes] : kv_bytes_by_tier(*s->cache, g)) kv[tier] += bytes;
  observer_->on_gauges(int64_t(running.size()), kv, kv_in_use(running));
  if (prefix_) observer_->on_prefix_cache_bytes(prefix_->bytes());
}

// Hands each sequence its token: streams the text, applies stop ids, stop strings and the length
// limit. A finished sequence gets next = -1 and a Finished entry; its step's tokens count in
// n_generated.
void Scheduler::deliver(const std::vector<Seq*>& seqs, const std::vector<int32_t>& ids, std::vector<Finished>& finished,
                        int& n_generated) {
  const auto now = Clock::now();
  const int ctx = cfg_.max_position_embeddings;
  for (size_t r = 0; r < seqs.size(); ++r) {
    Seq& s = *seqs[r];
    const int32_t id = ids[r];
    if (s.generated == 0) observer_->on_first_token(seconds(now - s.arrival));
    else observer_->on_next_token(seconds(now - s.last_token));
    s.last_token = now;
    std::string reason;
    if (std::find(s.req.stop_ids.begin(), s.req.stop_ids.end(), id) != s.req.stop_ids.end()) {
      reason = "stop";
    } else {
      ++s.generated;
      ++n_generated;
      bool stopped = false;
      std::string text = s.decoder ? s.stops.push(s.decoder->push(id), &stopped) : std::string();
      if (stopped) {
        reason = "stop";
      } else if (s.generated >= s.req.max_tokens || int(s.req.prompt.size()) + s.generated >= ctx) {
        if (s.decoder) {
          text += s.stops.push(s.decoder->flush(), &stopped);
          if (!stopped) text += s.stops.flush();
        }
        reason = stopped ? "stop" : "length";
      }
      s.out->push(text, id, s.generated);
      s.ids.push_back(id);
      s.next = id;
    }
    if (!reason.empty()) {
      finished.push_back({s.out, reason, s.generated});
      observer_->on_finished(seconds(now - s.arrival));
      s.next = -1;  // marks it for retirement
    }
  }
}

// A new sequence's cache: a copy of the longest prefix of its prompt the prefix cache holds (at
// least a page; the last prompt token is always computed, for its logits), else an empty one.
void Scheduler::admit(Seq& s) {
  if (prefix_) {
    const int n = int(s.context.size());
    PrefixCache::Match hit = prefix_->lookup(s.context, n - 1, page_tokens_);
    observer_->on_prefix_lookup(n, hit.tokens);
    if (hit.cache) {
      s.cache = std::move(hit.cache);
      s.prefilled = hit.tokens;
      std::lock_guard lock(s.out->mu_);
      s.out->cached_tokens_ = hit.tokens;
    }
  }
  if (!s.cache) s.cache = backend_.new_cache();
}

void Scheduler::retire(std::vector<std::unique_ptr<Seq>>& running, size_t i) {
  Seq& s = *running[i];
  if (prefix_) {  // its cache holds the first tokens of the prompt and the ids generated (fed ones)
    const std::vector<int32_t> tokens = s.history();
    if (size_t(s.cache->length()) <= tokens.size()) prefix_->retain(tokens, std::move(s.cache));
  }
  running.erase(running.begin() + ptrdiff_t(i));  // frees the KV cache now (or the prefix cache keeps it)
}

// Retires the finished decoding sequences (next = -1), then tells their callers: only once their KV
// is freed and the gauges say so.
void Scheduler::retire_finished(std::vector<std::unique_ptr<Seq>>& running, const std::vector<Finished>& finished) {
  for (size_t i = running.size(); i-- > 0;)
    if (running[i]->decoding() && running[i]->next < 0) retire(running, i);
  publish_gauges(running);
  for (const auto& f : finished) f.out->finish(f.reason, f.generated);
}

std::vector<Backend::SampleRow> Scheduler::draw_rows(const std::vector<Seq*>& seqs) {
  std::vector<Backend::SampleRow> rows;
  for (Seq* s : seqs) rows.push_back({s->sampler.params(), s->sampler.draw()});
  return rows;
}

// The step queued ahead (overlap): while the batch stays the same -- the same decoding sequences in
// the same order, none cancelled, nothing admitted -- the next step is queued (its tokens the
// queued step's, on the device) before this one's ids are taken, so the device does not wait for
// the host's part: detokenizing, stop strings, streaming. A sequence that finishes here has its
// place in the next queued step too: that step is taken at once, the others' tokens delivered and
// the finished one's discarded (its cache is freed with it). Otherwise the queued step is taken
// and the next call plans afresh.
void Scheduler::step_ahead(std::vector<std::unique_ptr<Seq>>& running) {
  // (A step past the budget is not chained: the next plain step preempts first.)
  bool chain = running.size() == ahead_.size() && make_room(kv_in_use(running));
  for (size_t i = 0; chain && i < running.size(); ++i)
    chain = running[i].get() == ahead_[i] && running[i]->decoding() && !running[i]->out->cancelled();
  if (chain) {
    std::vector<Backend::SeqStep> steps;
    for (Seq* s : ahead_) steps.push_back({{}, s->cache.get(), 1});
    backend_.queue_sample(steps, draw_rows(ahead_));
  }
  std::vector<Finished> finished;
  int n_generated = 0;
  std::vector<int32_t> ids(ahead_.size());
  backend_.take_sample(ids.data());
  deliver(ahead_, ids, finished, n_generated);
  observer_->on_step(0, n_generated);
  if (chain && !finished.empty()) {
    backend_.take_sample(ids.data());
    std::vector<Seq*> live;
    std::vector<int32_t> live_ids;
    for (size_t r = 0; r < ahead_.size(); ++r)
      if (ahead_[r]->next >= 0) live.push_back(ahead_[r]), live_ids.push_back(ids[r]);
    n_generated = 0;
    deliver(live, live_ids, finished, n_generated);
    observer_->on_step(0, n_generated);
    chain = false;
  }
  if (!chain) ahead_.clear();
  retire_finished(running, finished);
}

void Scheduler::preempt(std::vector<std::unique_ptr<Seq>>& running) {
  std::unique_ptr<Seq> s = std::move(running.back());
  running.pop_back();
  s->context = s->history();
  s->prefilled = 0;
  s->cache.reset();
  std::lock_guard lock(mu_);
  waiting_.push_front(std::move(s));
  observer_->on_queue_depth(int64_t(waiting_.size()));
  observer_->on_preempted();
}

void Scheduler::step(std::vector<std::unique_ptr<Seq>>& running) {
  if (!ahead_.empty()) return step_ahead(running);
  for (size_t i = running.size(); i-- > 0;)
    if (running[i]->out->cancelled()) {
      auto out = running[i]->out;
      const int generated = running[i]->generated;
      observer_->on_cancelled();
      retire(running, i);
      publish_gauges(running);
      out->finish("cancelled", generated);
    }
  if (running.empty()) return;
  // Out of KV memory for this step: the prefix cache gives up its entries, then the newest
  // sequences go back to the queue's head, their caches freed, to be prefilled again (their
  // context now includes what they generated).
  while (!make_room(kv_in_use(running)) && running.size() > 1) preempt(running);

  // Decodes first (one token each), then prompt chunks in arrival order with what is left.
  std::vector<Backend::SeqStep> steps;
  std::vector<Seq*> with_logits;
  int n_decode = 0, n_prompt = 0;
  for (auto& s : running)
    if (s->decoding()) {
      steps.push_back({std::span(&s->next, 1), s->cache.get(), 1});
      with_logits.push_back(s.get());
      ++n_decode;
    }
  int budget = std::max(opts_.step_tokens - n_decode, kMinPrefillChunk);
  for (auto& s : running) {
    if (s->decoding() || budget <= 0) continue;
    const int n = std::min(budget, int(s->context.size()) - s->prefilled);
    const bool last = s->prefilled + n == int(s->context.size());
    steps.push_back({std::span(s->context.data() + s->prefilled, size_t(n)), s->cache.get(), last ? 1 : 0});
    if (last) with_logits.push_back(s.get());
    s->prefilled += n;
    budget -= n;
    n_prompt += n;
  }
  // Logits rows come in step order; with_logits follows the same order. Each row's uniform is
  // drawn here, so the backend may sample on its device and return only the ids.
  const std::vector<Backend::SampleRow> rows = draw_rows(with_logits);
  if (n_prompt == 0 && opts_.overlap && backend_.overlaps_steps()) {  // every sequence decoding: step_ahead next
    backend_.queue_sample(steps, rows);
    ahead_ = with_logits;
    return;
  }
  std::vector<int32_t> ids(with_logits.size());
  backend_.forward_sample(steps, rows, ids.data());
  std::vector<Finished> finished;
  int n_generated = 0;
  deliver(with_logits, ids, finished, n_generated);
  observer_->on_step(n_prompt, n_generated);
  retire_finished(running, finished);
}

}  // namespace tiermoe
