#include "core/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>
#include <immintrin.h>

namespace tiermoe {
namespace {

// Workers spin briefly before sleeping: a decode step issues dozens of short loops, and a
// condition-variable wake-up per loop would cost more than the loop itself.
// Chunks are claimed, not assigned: the calling thread and every worker take the next unclaimed
// chunk until none is left. A worker that has lost its core (an oversubscribed machine: server
// threads, parallel builds) then delays nothing; the others run its chunk. The loop's state is
// one atomic word, (generation, chunk count, chunks claimed), so a worker that wakes late can
// never claim a chunk of a later loop with an earlier loop's parameters.
class ThreadPool {
  static constexpr int kSpins = 20000;  // ~1 ms of pausing, then as long again of yielding
  static constexpr uint64_t kCountBits = 12, kCountMask = (1u << kCountBits) - 1;

 public:
  explicit ThreadPool(int n) : n_threads_(std::clamp(n, 1, int(kCountMask))) {
    for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this] { worker(); });
  }
  ~ThreadPool() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
      state_.fetch_add(uint64_t(1) << (2 * kCountBits));  // a new generation wakes everyone
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  int size() const { return n_threads_; }

  void run(size_t n, const std::function<void(size_t, size_t)>& fn, size_t grain) {
    size_t grains = (n + grain - 1) / grain;
    uint64_t chunks = std::min<uint64_t>(grains, uint64_t(n_threads_));
    if (chunks <= 1) {
      fn(0, n);
      return;
    }
    std::lock_guard run_lock(run_mu_);  // one loop at a time; nested loops run inline
    fn_ = &fn;
    n_ = n;
    per_chunk_ = (grains + chunks - 1) / chunks * grain;
    done_.store(0, std::memory_order_relaxed);
    uint64_t generation = (state_.load(std::memory_order_relaxed) >> (2 * kCountBits)) + 1;
    {
      std::lock_guard lock(mu_);
      state_.store(generation << (2 * kCountBits) | chunks << kCountBits, std::memory_order_release);
    }
    cv_.notify_all();
    while (claim_and_run()) {
    }
    // Yield once spinning has gone on long enough that a worker has probably lost its core.
    for (int spin = 0; done_.load(std::memory_order_acquire) != chunks; ++spin) {
      if (spin < kSpins / 2) _mm_pause(); else std::this_thread::yield();
    }
  }

 private:
  // Claims the current loop's next chunk and runs it; false when none is left.
  bool claim_and_run() {
    uint64_t s = state_.load(std::memory_order_acquire);
    for (;;) {
      uint64_t claimed = s & kCountMask, chunks = (s >> kCountBits) & kCountMask;
      if (claimed >= chunks) return false;
      // Success means the loop is still running (it waits for this chunk), so its parameters,
      // published before state_, stay valid until done_ is bumped.
      if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        size_t begin = std::min(n_, claimed * per_chunk_), end = std::min(n_, (claimed + 1) * per_chunk_);
        if (begin < end) (*fn_)(begin, end);
        done_.fetch_add(1, std::memory_order_release);
        return true;
      }
    }
  }

  void worker() {
    uint64_t seen = 0;  // the generation this worker last took part in
    for (;;) {
      auto generation = [&] { return state_.load(std::memory_order_acquire) >> (2 * kCountBits); };
      uint64_t g = generation();
      for (int spin = 0; g == seen && spin < kSpins; ++spin) {
        if (spin < kSpins / 2) _mm_pause(); else std::this_thread::yield();
        g = generation();
      }
      if (g == seen) {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return generation() != seen; });
        g = generation();
      }
      seen = g;
      if (stop_) return;
      while (claim_and_run()) {
      }
    }
  }

  int n_threads_;
  std::vector<std::thread> workers_;
  std::mutex mu_, run_mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> state_{0};  // generation << 24 | chunks << 12 | chunks claimed
  std::atomic<uint64_t> done_{0};   // chunks of the current loop finished
  std::atomic<bool> stop_{false};
  const std::function<void(size_t, size_t)>* fn_ = nullptr;
  size_t n_ = 0, per_chunk_ = 1;
};

}  // namespace

namespace {

int default_threads() {
  if (const char* env = std::getenv("TIERMOE_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return n;
  }
  return int(std::max(1u, std::thread::hardware_concurrency()));
}

int g_requested = 0;
ThreadPool& pool() {
  static ThreadPool p(g_requested > 0 ? g_requested : default_threads());
  return p;
}

thread_local bool t_inside_loop = false;

}  // namespace

void parallel_for(size_t n, const std::function<void(size_t, size_t)>& fn, size_t grain) {
  if (n == 0) return;
  if (t_inside_loop) {
    fn(0, n);
    return;
  }
  t_inside_loop = true;
  pool().run(n, [&](size_t b, size_t e) {
    bool outer = t_inside_loop;
    t_inside_loop = true;
    fn(b, e);
    t_inside_loop = outer;
  }, std::max<size_t>(1, grain));
  t_inside_loop = false;
}

int num_threads() { return pool().size(); }

// Takes effect only before the first parallel loop.
void set_num_threads(int n) { g_requested = n; }

}  // namespace tiermoe
