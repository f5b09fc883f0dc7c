// Where a sampled step's wall time goes on the GPU's clock (TIERMOE_CUDA_STEP_TIMELINE=1, for
// measurement only): events on the backend's stream at the step's start (as the host issues it),
// after its inputs are on the device, after the graph (or the eager layers) and after its token is
// on the host. Why: a step's host-clock time also holds what the GPU waits for between steps -- the
// host's turn from the last token to the next step -- which no kernel timing shows.
// Printed at destruction as medians over the decode steps (one token, one logits row).
#pragma once
#include <algorithm>
#include <cstdio>
#include <vector>

#include <cuda_runtime.h>

namespace tiermoe::cuda {

class StepTimeline {
 public:
  enum Mark { kStart, kInputs, kLayers, kToken, kMarks };

  explicit StepTimeline(bool on) : on_(on) {
    for (int i = 0; on_ && i < 2 * kMarks; ++i)
      if (cudaEventCreate(&ev_[i]) != cudaSuccess) on_ = false;
  }
  ~StepTimeline() {
    report();
    for (cudaEvent_t e : ev_)
      if (e) cudaEventDestroy(e);
  }
  StepTimeline(const StepTimeline&) = delete;
  StepTimeline& operator=(const StepTimeline&) = delete;

  // A step begins (`decode`: one token, one logits row); its later marks follow in order.
  void start(cudaStream_t s, bool decode) {
    decode_ = decode;
    mark(kStart, s);
  }
  void mark(Mark m, cudaStream_t s) {
    if (on_) cudaEventRecord(ev_[cur_ * kMarks + m], s);
  }
  // After the step's synchronization: its intervals, and the GPU's idle time since the last step.
  void close_step() {
    if (!on_) return;
    cudaEvent_t* now = ev_ + cur_ * kMarks;
    cudaEvent_t* before = ev_ + (1 - cur_) * kMarks;
    if (decode_) {
      for (int m = 0; m + 1 < kMarks; ++m) span_[m].push_back(ms(now[m], now[m + 1]));
      if (last_was_decode_) idle_.push_back(ms(before[kToken], now[kStart]));
    }
    last_was_decode_ = decode_;
    cur_ = 1 - cur_;
  }

 private:
  static float ms(cudaEvent_t a, cudaEvent_t b) {
    float t = 0.f;
    return cudaEventElapsedTime(&t, a, b) == cudaSuccess ? t : 0.f;
  }
  static float median(std::vector<float> v) {
    if (v.empty()) return 0.f;
    std::nth_element(v.begin(), v.begin() + long(v.size() / 2), v.end());
    return v[v.size() / 2];
  }
  void report() const {
    if (!on_ || span_[0].empty()) return;
    std::fprintf(stderr,
                 "step timeline, %zu decode steps, us (medians): inputs %.1f, layers %.1f, token %.1f, "
                 "GPU idle before a step %.1f\n",
                 span_[0].size(), 1e3f * median(span_[0]), 1e3f * median(span_[1]), 1e3f * median(span_[2]),
                 1e3f * median(idle_));
  }

  bool on_;
  cudaEvent_t ev_[2 * kMarks] = {};
  int cur_ = 0;
  bool decode_ = false, last_was_decode_ = false;
  std::vector<float> span_[kMarks - 1], idle_;
};

}  // namespace tiermoe::cuda
