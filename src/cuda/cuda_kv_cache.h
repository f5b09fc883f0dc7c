// The paged KV cache of the CUDA backend: one pool of BF16 or FP8 pages on the GPU for all sequences
// (KvPagePool), a page table per sequence (CudaKvCache), and the prompt-attention kernel choice its
// KvCache::attend uses (PromptAttention). The backend's kernels read the pages through
// cuda::KvPages (kernels.h); KvCache::append and attend take device pointers (cuda_backend.h).
#pragma once
#include <span>
#include <vector>

#include <cuda_runtime.h>

#include "cuda/cuda_error.h"
#include "cuda/kernels.h"
#include "kv/kv_cache.h"

namespace tiermoe::cuda {

// Prompt attention over cache rows already appended, the kernel chosen here alone: the tensor-core
// one (attention_prefill) where it applies and is on, else the split kernel, whose partial[T, H,
// n_splits, Dh + 2] scratch only it uses. (Key splits of the tensor-core kernel, 22% faster per
// launch at OLMoE's 128-block chunks, did not move TTFT: 109.6 vs 109.7 ms at 4096 tokens.)
struct PromptAttention {
  bool flash = true, split_p = true;
  void operator()(float* out, const float* q, cuda::KvPages kv, const int32_t* pos, int T, int H, int Hkv, int Dh,
                  int n_splits, int split_len, float* partial, cudaStream_t s) const {
    if (flash && cuda::attention_prefill_supported(H, Hkv, Dh))
      CUDA_CK(cuda::attention_prefill(out, q, kv, pos, T, H, Hkv, Dh, split_p, s));
    else
      CUDA_CK(cuda::attention(out, q, kv, pos, T, H, Hkv, Dh, n_splits, split_len, partial, s));
  }
};

// The KV pages of every sequence (kernels.h, KvPages): K and V [layers, pages, kKvPageRows, Hkv,
// Dh] in BF16, or FP8 codes with their exponents [layers, pages, kKvPageRows, Hkv], allocated once,
// so that captured steps keep their pointers while sequences come, grow and go; pages are handed
// out and taken back on the host.
class KvPagePool {
 public:
  // K and V of one page in every layer, in bytes.
  static size_t page_bytes(int layers, int Hkv, int Dh, bool fp8) {
    return size_t(2) * layers * cuda::kKvPageRows * Hkv * kv_row_bytes(fp8 ? KvDType::FP8 : KvDType::BF16, Dh);
  }
  KvPagePool(int layers, int Hkv, int Dh, int pages, bool fp8)
      : row_(size_t(Hkv) * Dh), hkv_(Hkv), pages_(pages), fp8_(fp8) {
    const size_t rows = size_t(layers) * pages * cuda::kKvPageRows;
    bool ok = alloc(k_, rows * row_ * value_bytes()) && alloc(v_, rows * row_ * value_bytes());
    if (fp8) ok = ok && alloc(k_exp_, rows * Hkv) && alloc(v_exp_, rows * Hkv);
    if (!ok) {
      free_all();
      cudaGetLastError();  // the failed allocation's error, not left for an unrelated call to find
      throw InputError("KV cache: cannot allocate " + std::to_string(page_bytes(layers, Hkv, int(row_ / Hkv), fp8) * pages >> 20) +
                       " MiB of GPU memory for " + std::to_string(pages) + " pages");
    }
    for (int p = pages - 1; p >= 0; --p) free_.push_back(p);
  }
  ~KvPagePool() { free_all(); }
  KvPagePool(const KvPagePool&) = delete;
  KvPagePool& operator=(const KvPagePool&) = delete;

  // One layer's pool, without a page table.
  cuda::KvPages layer(int l) const {
    const size_t rows = size_t(l) * pages_ * cuda::kKvPageRows, values = rows * row_;
    if (!fp8_) return {static_cast<bf16*>(k_) + values, static_cast<bf16*>(v_) + values};
    cuda::KvPages kv;
    kv.fp8 = {static_cast<uint8_t*>(k_) + values, static_cast<uint8_t*>(v_) + values,
              static_cast<int8_t*>(k_exp_) + rows * hkv_, static_cast<int8_t*>(v_exp_) + rows * hkv_};
    return kv;
  }
  // Copies pages src[i] -> dst[i] (device tables) in every layer: the K/V values and, FP8, the exponents.
  cudaError_t copy_pages(int layers, const int32_t* dst, const int32_t* src, int n, cudaStream_t s) const {
    const size_t page_rows = cuda::kKvPageRows, layer_rows = page_rows * pages_;
    cudaError_t e = cuda::kv_copy_pages(k_, v_, layer_rows * row_ * value_bytes(), page_rows * row_ * value_bytes(),
                                        layers, dst, src, n, s);
    if (e == cudaSuccess && fp8_)
      e = cuda::kv_copy_pages(k_exp_, v_exp_, layer_rows * hkv_, page_rows * hkv_, layers, dst, src, n, s);
    return e;
  }
  bool fp8() const { return fp8_; }
  int pages() const { return pages_; }
  int free_pages() const { return int(free_.size()); }
  // n more pages, or an error naming the pool's size (and nothing taken).
  void take(int n, std::vector<int32_t>& into) {
    if (n > free_pages())
      throw InputError("KV cache: the GPU page pool is full (" + std::to_string(pages_ - free_pages()) + " of " +
                       std::to_string(pages_) + " pages of " + std::to_string(cuda::kKvPageRows) +
                       " tokens in use, " + std::to_string(n) + " more needed); finish or drop a sequence, or give " +
                       "the pool more memory (CudaBackendOptions::kv_cache_bytes)");
    for (int i = 0; i < n; ++i, free_.pop_back()) into.push_back(free_.back());
  }
  void give(std::span<const int32_t> pages) { free_.insert(free_.end(), pages.begin(), pages.end()); }

 private:
  size_t value_bytes() const { return fp8_ ? 1 : 2; }
  static bool alloc(void*& p, size_t bytes) { return cudaMalloc(&p, bytes) == cudaSuccess; }
  void free_all() {
    for (void* p : {k_, v_, k_exp_, v_exp_}) cudaFree(p);
  }
  size_t row_;
  int hkv_, pages_;
  bool fp8_;
  void *k_ = nullptr, *v_ = nullptr, *k_exp_ = nullptr, *v_exp_ = nullptr;
  std::vector<int32_t> free_;
};

// One sequence's cache: its pages in the pool, its page table on the device (sized for the model's
// context, so its address never changes while the sequence grows).
class CudaKvCache final : public KvCache {
 public:
  CudaKvCache(const KvGeometry& g, KvPagePool& pool, int max_capacity, cudaStream_t s, PromptAttention attention)
      : g_(g), max_cap_(max_capacity), pool_(pool), stream_(s),
        attention_(attention), lens_(g.num_layers, 0), appended_(g.num_layers, 0) {
    const size_t entries = size_t(max_capacity + cuda::kKvPageRows - 1) / cuda::kKvPageRows;
    CUDA_CK(cudaMalloc(&table_, entries * 4));
  }
  ~CudaKvCache() override {
    pool_.give(pages_);
    cudaFree(table_);
    cudaFree(pos_);
    cudaFree(partial_);
  }

  cuda::KvPages kv(int layer) const {
    cuda::KvPages p = pool_.layer(layer);
    p.table = table_;
    return p;
  }
  const int32_t* table() const { return table_; }

  // Pages for n rows; may copy to the device (never called inside a captured step).
  void reserve(int n) {
    if (n > max_cap_) throw InputError("KV cache: " + std::to_string(n) + " tokens exceed the context of " + std::to_string(max_cap_));
    const size_t have = pages_.size(), need = size_t(n + cuda::kKvPageRows - 1) / cuda::kKvPageRows;
    if (need <= have) return;
    pool_.take(int(need - have), pages_);
    // From pageable memory: returns once the entries are staged, so pages_ may change after.
    CUDA_CK(cudaMemcpyAsync(table_ + have, pages_.data() + have, (need - have) * 4, cudaMemcpyHostToDevice, stream_));
  }
  void advance(int T) {
    for (int l = 0; l < g_.num_layers; ++l) {
      lens_[l] += T;
      appended_[l] = T;
    }
  }

  // KvCache interface: k, v, q and out are DEVICE pointers (see cuda_backend.h).
  void append(int layer, const float* k, const float* v, int T) override {
    reserve(lens_[layer] + T);
    upload_positions(lens_[layer], T);
    CUDA_CK(cuda::kv_append(kv(layer), k, v, pos_, T, g_.num_kv_heads, g_.head_dim, stream_));
    lens_[layer] += T;
    appended_[layer] = T;
  }
  void attend(int layer, const float* q, int T, float* out) const override {
    CHECK(T <= appended_[layer]);
    const int n = lens_[layer], split = 256, n_splits = (n + split - 1) / split;
    const_cast<CudaKvCache*>(this)->upload_positions(n - T, T);
    const size_t need = size_t(T) * g_.num_heads * n_splits * (g_.head_dim + 2);
    if (need > partial_n_) {
      cudaFree(partial_);
      CUDA_CK(cudaMalloc(&partial_, need * sizeof(float)));
      partial_n_ = need;
    }
    attention_(out, q, kv(layer), pos_, T, g_.num_heads, g_.num_kv_heads, g_.head_dim, n_splits, split, partial_,
               stream_);
    CUDA_CK(cudaStreamSynchronize(stream_));
  }
  int length() const override { return lens_.empty() ? 0 : lens_.back(); }
  // A new sequence holding the first n rows: pages from the pool, this one's copied on the device
  // (whole pages; rows past n in the last are overwritten by the copy's appends).
  bool can_copy_prefix(int n) const override { return n >= 0 && n <= length(); }
  std::unique_ptr<KvCache> copy_prefix(int n) const override {
    CHECK(can_copy_prefix(n));
    auto copy = std::make_unique<CudaKvCache>(g_, pool_, max_cap_, stream_, attention_);
    copy->reserve(n);
    CUDA_CK(pool_.copy_pages(g_.num_layers, copy->table_, table_, int(copy->pages_.size()), stream_));
    for (int l = 0; l < g_.num_layers; ++l) copy->lens_[l] = n;
    return copy;
  }
  // Pages past n go back to the pool (the device table's stale entries past n are never read).
  void truncate(int n) override {
    for (int l = 0; l < g_.num_layers; ++l) {
      CHECK(n <= lens_[l]);
      lens_[l] = n;
      appended_[l] = 0;
    }
    const size_t keep = size_t(n + cuda::kKvPageRows - 1) / cuda::kKvPageRows;
    if (keep < pages_.size()) {
      pool_.give(std::span(pages_).subspan(keep));
      pages_.resize(keep);
    }
  }
  // The pages held (whole pages: what the pool has handed out, as the scheduler counts them).
  size_t bytes() const override {
    return pages_.size() * KvPagePool::page_bytes(g_.num_layers, g_.num_kv_heads, g_.head_dim, pool_.fp8());
  }

 private:
  void upload_positions(int first, int T) {
    if (T > pos_n_) {
      cudaFree(pos_);
      CUDA_CK(cudaMalloc(&pos_, size_t(T) * 4));
      pos_n_ = T;
    }
    std::vector<int32_t> p(T);
    for (int i = 0; i < T; ++i) p[i] = first + i;
    CUDA_CK(cudaMemcpyAsync(pos_, p.data(), size_t(T) * 4, cudaMemcpyHostToDevice, stream_));
    CUDA_CK(cudaStreamSynchronize(stream_));
  }

  KvGeometry g_;
  int max_cap_;
  KvPagePool& pool_;
  cudaStream_t stream_;
  PromptAttention attention_;
  std::vector<int32_t> pages_;  // the page of rows [i * kKvPageRows, (i + 1) * kKvPageRows)
  int32_t* table_ = nullptr;    // pages_ on the device
  std::vector<int> lens_, appended_;
  int32_t* pos_ = nullptr;  // for the interface's append/attend only
  int pos_n_ = 0;
  mutable float* partial_ = nullptr;
  mutable size_t partial_n_ = 0;
};

}  // namespace tiermoe::cuda
