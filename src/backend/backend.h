// The seam between the engine and the hardware. A backend owns its copy of the weights in
// whatever layout its kernels want and runs the whole forward pass; the CPU backend is the
// reference every other backend is checked against.
#pragma once
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cpu/sampling.h"
#include "kv/kv_cache.h"
#include "model/weights.h"

namespace tiermoe {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual int vocab_size() const = 0;  // V: the width of a logits row

  // A fresh KV cache for one sequence of this model.
  virtual std::unique_ptr<KvCache> new_cache() const = 0;

  // The KV memory all of this backend's caches share, and the tokens it is handed out in (a
  // sequence holds whole pages): the scheduler admits within both. Default (host memory): no
  // bound of its own, 16-token pages. The CUDA backend: its page pool, 64-token pages.
  virtual size_t kv_capacity_bytes() const { return std::numeric_limits<size_t>::max(); }
  virtual int kv_page_tokens() const { return 16; }
  // Tokens per pass through the layers (forward_batch cuts longer steps into passes of this size).
  virtual int pass_tokens() const = 0;

  // One sequence's share of a batched step: its new tokens, its cache, and how many of the
  // last of those tokens need logits (1 when decoding, all when scoring, 0 mid-prompt).
  struct SeqStep {
    std::span<const int32_t> tokens;
    KvCache* cache = nullptr;
    int n_logits = 0;
  };

  // Runs every step's tokens at positions cache->length() ... and appends their keys and
  // values to the step's cache; writes logits[sum of n_logits, V], steps in order. Each cache
  // appears at most once. Steps share the weight reads: this is continuous batching.
  virtual void forward_batch(std::span<const SeqStep> steps, float* logits) = 0;

  // One logits row's sampling: its params and the uniform its Sampler drew (Sampler::draw).
  struct SampleRow {
    SamplingParams params;
    double u = 0;
  };

  // forward_batch, then tokens[sum of n_logits] = sample_token(logits row r, rows[r]): a backend
  // may sample on its device and return only the ids. This default samples host logits.
  virtual void forward_sample(std::span<const SeqStep> steps, std::span<const SampleRow> rows, int32_t* tokens);

  // Decoding with the next step queued while the host handles the last one's ids, so the device
  // does not wait for the host between steps. queue_sample takes decode steps (one token and one
  // logits row each) as forward_sample does and may return before they run; a step with no
  // tokens is chained: its token is the id its cache's previous queued step sampled, which may
  // not have reached the host yet (the previous queue_sample must have had the same caches in
  // the same order). take_sample waits for the oldest queued step and writes its ids. At most
  // kMaxQueued steps are queued. forward_batch and forward_sample first wait for the queued
  // steps (their ids stay for take_sample); take a sequence's steps before its cache's
  // truncate(). A step queued past a sequence's end is taken, and its row truncated (or its
  // cache dropped).
  // Default: queue_sample runs forward_sample at once.
  static constexpr int kMaxQueued = 2;
  // Whether queued steps really run ahead of the host (else queue_sample is forward_sample).
  virtual bool overlaps_steps() const { return false; }
  virtual void queue_sample(std::span<const SeqStep> steps, std::span<const SampleRow> rows);
  virtual void take_sample(int32_t* tokens);
  int queued_steps() const { return int(queued_.size()); }

  // One sequence: tokens[T], logits[n_logits, V] for its last n_logits tokens.
  void forward(std::span<const int32_t> tokens, KvCache& cache, int n_logits, float* logits) {
    const SeqStep step{tokens, &cache, n_logits};
    forward_batch(std::span(&step, 1), logits);
  }

 protected:
  // forward_sample's contract: one SampleRow per logits row (the steps' n_logits summed).
  static void check_sample_rows(std::span<const SeqStep> steps, std::span<const SampleRow> rows);
  // queue_sample's contract: decode steps only, at most kMaxQueued, a chain that matches the last
  // queued step's caches.
  void check_queue(std::span<const SeqStep> steps, std::span<const SampleRow> rows) const;
  // The steps with each chained step's token taken from the last queued step's ids, where those
  // are on the host (else left empty: on the device).
  std::vector<SeqStep> with_host_tokens(std::span<const SeqStep> steps) const;

  // A queued step: its caches in order (for chaining) and, once known on the host, its ids;
  // `slot` is the backend's own (CUDA: which pinned buffers hold its inputs and ids).
  struct Queued {
    std::vector<const KvCache*> caches;
    std::vector<int32_t> ids;
    int slot = -1;
  };
  // queue_sample's launch of checked steps whose caches are in q: q.ids filled now, or (a backend
  // that runs ahead) whatever lets take_sample fill them. Default: forward_sample at once.
  virtual void run_queued(std::span<const SeqStep> steps, std::span<const SampleRow> rows, Queued& q);
  std::deque<Queued> queued_;
  Queued last_queued_;  // the most recent queue_sample's step, queued or taken
};

// Cuts batched steps into passes of at most max_tokens tokens and calls run_pass on each,
// with the pointer to that pass's first logits row. A long prompt spans several passes, one
// piece per pass, so each cache sees its tokens in order. Shared by every backend.
void split_into_passes(std::span<const Backend::SeqStep> steps, int max_tokens, int vocab, float* logits,
                       const std::function<void(const std::vector<Backend::SeqStep>&, float*)>& run_pass);

struct CpuBackendOptions {
  KvDType kv_dtype = KvDType::F32;
  std::shared_ptr<const KvSpec> kv_spec;        // when set: make_kv_cache(spec), else exact kv_dtype
  std::shared_ptr<const KvProfile> kv_profile;  // offline-calibrated codecs for kv_spec
  int max_chunk = 512;  // tokens per pass through the layers (bounds activation memory)
};

std::unique_ptr<Backend> make_cpu_backend(const ModelWeights& weights, const CpuBackendOptions& opts = {});

}  // namespace tiermoe
