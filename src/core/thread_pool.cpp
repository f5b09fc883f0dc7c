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
// Each worker has its own start signal, raised only when it takes part in a loop: a worker
// left out of one loop can then never pick up the parameters of the next one half-written.
class ThreadPool {
  static constexpr int kSpins = 20000;  // ~1 ms of pausing, then as long again of yielding

 public:
  explicit ThreadPool(int n) : n_threads_(std::max(1, n)), go_(new std::atomic<uint64_t>[size_t(n_threads_)]) {
    for (int i = 0; i < n_threads_; ++i) go_[i].store(0);
    for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { worker(i); });
  }
  ~ThreadPool() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
      for (int i = 1; i < n_threads_; ++i) go_[i].fetch_add(1);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  int size() const { return n_threads_; }

  void run(size_t n, const std::function<void(size_t, size_t)>& fn, size_t grain) {
    size_t chunks = (n + grain - 1) / grain;
    int used = int(std::min<size_t>(chunks, size_t(n_threads_)));
    if (used <= 1) {
      fn(0, n);
      return;
    }
    std::lock_guard run_lock(run_mu_);  // one loop at a time; nested loops run inline
    fn_ = &fn;
    n_ = n;
    grain_ = grain;
    used_ = used;
    pending_.store(used - 1);
    {
      std::lock_guard lock(mu_);
      for (int i = 1; i < used; ++i) go_[i].fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    run_chunk(0);
    // Yield once spinning has gone on long enough that a worker has probably lost its core.
    for (int spin = 0; pending_.load(std::memory_order_acquire) != 0; ++spin) {
      if (spin < kSpins / 2) _mm_pause(); else std::this_thread::yield();
    }
  }

 private:
  void run_chunk(int i) {
    size_t chunks = (n_ + grain_ - 1) / grain_;
    size_t per = (chunks + size_t(used_) - 1) / size_t(used_);
    size_t begin = std::min(n_, size_t(i) * per * grain_);
    size_t end = std::min(n_, size_t(i + 1) * per * grain_);
    if (begin < end) (*fn_)(begin, end);
  }

  void worker(int i) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t g = go_[i].load(std::memory_order_acquire);
      for (int spin = 0; g == seen && spin < kSpins; ++spin) {
        if (spin < kSpins / 2) _mm_pause(); else std::this_thread::yield();
        g = go_[i].load(std::memory_order_acquire);
      }
      if (g == seen) {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return go_[i].load() != seen; });
        g = go_[i].load();
      }
      seen = g;
      if (stop_) return;
      run_chunk(i);
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  int n_threads_;
  std::unique_ptr<std::atomic<uint64_t>[]> go_;  // [n_threads]: bumped to start worker i
  std::vector<std::thread> workers_;
  std::mutex mu_, run_mu_;
  std::condition_variable cv_;
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  const std::function<void(size_t, size_t)>* fn_ = nullptr;
  size_t n_ = 0, grain_ = 1;
  int used_ = 0;
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
