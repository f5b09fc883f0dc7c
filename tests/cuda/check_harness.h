// The harness the check files of tiermoe_cuda_check share: case counting and reporting, the random
// inputs, device buffers poisoned before use, a paged KV pool on the host, launch timing; and the
// check groups each file defines (cuda_check.cpp runs them).
#pragma once
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include "core/dtype.h"
#include "cpu/sampling.h"
#include "cuda/kernels.h"
#include "model/config.h"
#include "test_util.h"

namespace tiermoe::cuda_check {
namespace cu = tiermoe::cuda;

extern int g_fail, g_cases;
extern std::mt19937 rng;

#define CK(expr)                                                                                  \
  do {                                                                                            \
    cudaError_t e_ = (expr);                                                                      \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(2);                                                                               \
    }                                                                                             \
  } while (0)

// TIERMOE_CHECK_SKIP=N or N:M: in each group that counts its cases -- prompt attention (per
// shape), sampling (per logits kind, V, B) and the prompt-chunk expert GEMMs (per shape), the
// longest under racecheck -- only cases N .. M-1 run, so that sanitizer runs cut off by their time
// limit can go on where they stopped, or share a group between processes. The summary line says
// how many were skipped.
extern int g_skipped;
bool skip_case(int& index);
// TIERMOE_CHECK_VARIANT=V: in the prompt-attention and prompt-chunk expert GEMM groups, only the V-th
// variant of each case runs (counted from 0 in the order the case runs them), so that one case's
// launches can go to several sanitizer processes. Unset: all.
bool skip_variant(int variant);

// One case's line: ok when err <= tol (and not NaN); counted in g_cases / g_fail.
void report(const std::string& name, double err, double tol, const std::string& extra = "");
std::vector<float> randn(size_t n, float scale = 1.f);
std::vector<uint16_t> bf16_of(const std::vector<float>& v);
double rel(const std::vector<float>& a, const std::vector<float>& b);

std::string fmt(const char* f, auto... a) {
  char buf[256];
  std::snprintf(buf, sizeof buf, f, a...);
  return buf;
}

// A device buffer poisoned with NaN before each use, so unwritten outputs show.
template <class T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t n_) : n(n_) { CK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T))); poison(); }
  Dev(const std::vector<T>& h) : Dev(h.size()) { CK(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice)); }
  ~Dev() { cudaFree(p); }
  void poison() { CK(cudaMemset(p, 0xff, std::max<size_t>(n, 1) * sizeof(T))); }
  std::vector<T> get() const {
    std::vector<T> h(n);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

// One page of the CUDA backend's KV pool: K and V, every layer, kKvPageRows rows of BF16 (or FP8 rows).
// One page of the CUDA backend's KV pool: K and V, every layer, kKvPageRows rows of BF16 (or FP8 rows).
size_t kv_page_bytes(const ModelConfig& c, bool fp8 = false);

// A paged KV pool (kernels.h, KvPages) for the cache-writing and attention cases: sequences get pages in a shuffled
// order (a kernel that reads row pos at pos * row, ignoring its page table, reads another
// sequence's or a poisoned row), and every pool row no sequence holds stays poisoned (0xffff), so
// comparing the whole pool with `want` also catches writes outside a sequence's rows.
struct PagedKv {
  int row;
  std::vector<int32_t> free_pages;
  std::vector<uint16_t> k, v;  // the pool as it should be: [pages, kKvPageRows, row]
  PagedKv(int row_, int pages) : row(row_), k(size_t(pages) * cu::kKvPageRows * row_, 0xffff), v(k) {
    for (int p = 0; p < pages; ++p) free_pages.push_back(p);
    std::shuffle(free_pages.begin(), free_pages.end(), rng);
  }
  static int pages_for(int rows) { return (rows + cu::kKvPageRows - 1) / cu::kKvPageRows; }
  // A page table for `rows` rows (none written).
  std::vector<int32_t> table(int rows) {
    std::vector<int32_t> t(free_pages.end() - pages_for(rows), free_pages.end());
    free_pages.resize(free_pages.size() - t.size());
    return t;
  }
  // Rows [first, first + n) of a sequence <- kb, vb [n, row].
  void put(const std::vector<int32_t>& t, int first, int n, const uint16_t* kb, const uint16_t* vb) {
    for (int r = first; r < first + n; ++r) {
      const size_t at = (size_t(t[r / cu::kKvPageRows]) * cu::kKvPageRows + r % cu::kKvPageRows) * row;
      std::copy_n(kb + size_t(r - first) * row, row, k.begin() + at);
      std::copy_n(vb + size_t(r - first) * row, row, v.begin() + at);
    }
  }
};

// Mean time of one launch() in microseconds (CUDA events on the default stream), after `warm`
// untimed calls.
template <class Launch>
double mean_us(int warm, int reps, Launch launch) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < warm; ++i) launch();
  CK(cudaEventRecord(a));
  for (int i = 0; i < reps; ++i) launch();
  CK(cudaEventRecord(b));
  CK(cudaEventSynchronize(b));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, a, b));
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return ms * 1e3 / reps;
}

// --models-only NAME: only the model checks whose name contains NAME (check_models.cpp).
extern const char* g_only_model;

// How a GPU token compares with sample_token(): Exact; Boundary when it is what sample_token gives
// with u moved by 1e-9 (u * total within 1e-9 of total from the boundary between the two
// candidates' intervals) or top_p moved to a neighbouring float (the nucleus sum within ~6e-8 of
// top_p): the device's exp() and block sums differ from glibc's exp and sequential sums by ulps,
// so only such rows may part; Wrong otherwise (check_sampling.cpp).
enum class Match { Exact, Boundary, Wrong };
Match classify(std::span<const float> l, const SamplingParams& p, double u, int32_t got);

// The check groups, one file each (named in cuda_check.cpp's table), and the timings.
void check_gemv();
void check_gemv_argmax();
void check_gemv3();
void check_gemv_tc();
void check_gemv3_rows();
void check_gemv_unstaged();
double gemv_bandwidth(int N, int K);
void check_rmsnorm_rope_misc();
void check_route();
void check_moe_route();
void check_moe_routed();
void check_moe();
void check_moe_grouped();
void check_moe_prefill();
void moe_gemm_timing(int T, int E, int K, int D, int F);
void moe_decode_timing(const char* name, int E, int K, int D, int F);
void check_kv_copy_pages();
void check_attention();
void check_attention_prefill();
void check_attention_prefill_decode();
void check_attention_prefill_decode_rows();
void check_attention_decode();
void check_attention_decode_batch();
void check_attention_decode_per_head();
void attention_timing(int past, int H, int Hkv, int Dh);
void check_kv_fp8_writes();
void check_attention_fp8();
void check_sampling();
void check_models();
int bench_main(int argc, char** argv);
int batchtable_main(int argc, char** argv);
int profile_main(int argc, char** argv);

}  // namespace tiermoe::cuda_check
