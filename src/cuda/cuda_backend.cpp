// The CUDA forward pass: the CPU decoder's structure (cpu_backend.cpp) with device kernels.
// Shape legend: T tokens, D hidden, H/Hkv heads, Dh head dim, E experts, K top-k, F FFN width,
// V vocabulary. Weights BF16, activations FP32; T <= kGemvMaxT runs our GEMV kernels, larger T
// runs cuBLAS (BF16 inputs, FP32 accumulate and output).
//
// A decode step (one sequence, one token) makes no allocation and no host synchronization
// before its logits (or, through forward_sample, its sampled ids) are copied back: token id and
// position go to the device first, the router's top-k ids and weights stay in device memory where
// the expert kernels read them, and the whole step is captured once as a CUDA graph and replayed
// (re-captured only when the attention split count changes). The KV cache is paged: one pool for all
// sequences, allocated once, a page table per sequence (kernels.h, KvPages).
#include "cuda/cuda_backend.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <span>
#include <vector>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "core/check.h"
#include "core/dtype.h"
#include "cuda/cuda_error.h"
#include "cuda/cuda_kv_cache.h"
#include "cuda/decode_splits.h"
#include "cuda/kernels.h"
#include "cuda/sampling.h"
#include "cuda/step_timeline.h"

namespace tiermoe {
namespace {

using cuda::bf16;
using cuda::CudaKvCache;
using cuda::KvPagePool;
using cuda::PromptAttention;

#define CUBLAS_CK(expr)                                                                                  \
  do {                                                                                                   \
    const cublasStatus_t st_ = (expr);                                                                   \
    if (st_ != CUBLAS_STATUS_SUCCESS) ::tiermoe::check_failed(#expr, __FILE__, __LINE__, cublasGetStatusString(st_)); \
  } while (0)

template <class P>
P* dalloc(std::vector<void*>& owned, size_t n) {
  void* p = nullptr;
  if (n == 0) n = 1;
  const cudaError_t e = cudaMalloc(&p, n * sizeof(P));
  if (e != cudaSuccess)
    throw InputError("CUDA: cannot allocate " + std::to_string(n * sizeof(P) >> 20) + " MiB of GPU memory: " +
                     cudaGetErrorString(e));
  owned.push_back(p);
  return static_cast<P*>(p);
}

std::vector<uint16_t> to_bf16_host(const void* data, DType t, size_t n) {
  std::vector<uint16_t> out(n);
  if (t == DType::BF16) {
    std::memcpy(out.data(), data, n * 2);
  } else {
    for (size_t i = 0; i < n; ++i) out[i] = f32_to_bf16(load_f32(data, t, i));
  }
  return out;
}

struct DLinear {  // W[out, in] in BF16 on the device
  const bf16* w = nullptr;
  int out = 0, in = 0;
};

struct DLayer {
  const float *attn_norm = nullptr, *ffn_norm = nullptr;
  DLinear q, k, v, o;
  const float *q_bias = nullptr, *k_bias = nullptr, *v_bias = nullptr, *q_norm = nullptr, *k_norm = nullptr;
  bool is_moe = false;
  DLinear dense_gu, dense_down;   // [2F, D] (gate rows, then up rows), [D, F]
  DLinear router;                 // [E, D]
  const bf16* experts_gu = nullptr;    // [E, 2F, D]
  const bf16* experts_down = nullptr;  // [E, D, F]
  DLinear shared_gu, shared_down, shared_gate;
};

// ---------------------------------------------------------------------------------------------
class CudaBackend final : public Backend {
 public:
  CudaBackend(const ModelConfig& cfg, const CudaBackendOptions& opts) : cfg_(cfg), opts_(opts) {
    // A/B switches for timing and checks: graphs, split prompt activations, prompt attention kernel,
    // prompt-chunk expert GEMM kernel, prompt chunk size, programmatic launch.
    if (const char* e = std::getenv("TIERMOE_CUDA_GRAPHS"); e && e[0] == '0') opts_.use_graphs = false;
    if (const char* e = std::getenv("TIERMOE_CUDA_SPLIT"); e && e[0] == '0') opts_.split_activations = false;
    if (const char* e = std::getenv("TIERMOE_CUDA_FLASH"); e && e[0] == '0') opts_.flash_attention = false;
    if (const char* e = std::getenv("TIERMOE_CUDA_FLASH_P")) opts_.flash_split_p = std::atoi(e) != 1;  // 1: P in BF16
    if (const char* e = std::getenv("TIERMOE_CUDA_MOE_GEMM"); e && e[0] == '0') opts_.pipelined_moe_gemm = false;
    prompt_attention_ = {opts_.flash_attention, opts_.flash_split_p};
    if (const char* e = std::getenv("TIERMOE_CUDA_CHUNK")) opts_.max_chunk = std::clamp(std::atoi(e), 1, 1 << 16);
    read_switches();
    const char* pdl = std::getenv("TIERMOE_CUDA_PDL");
    cuda::set_programmatic_launch(!(pdl && pdl[0] == '0'));
    const char* stage = std::getenv("TIERMOE_CUDA_GEMV_STAGE");
    cuda::set_gemv_stage(!(stage && stage[0] == '0'));
    if (const char* e = std::getenv("TIERMOE_CUDA_ATTN_HEAD")) cuda::set_attention_decode_per_head(std::atoi(e));
    if (const char* e = std::getenv("TIERMOE_CUDA_TC_KEYS")) cuda::set_attention_decode_keys_form(e[0] != '0');
    if (const char* e = std::getenv("TIERMOE_CUDA_GEMV_TC")) cuda::set_gemv_tc(std::atoi(e));
    if (const char* e = std::getenv("TIERMOE_CUDA_MOE_TC")) cuda::set_moe_down_tc(std::clamp(std::atoi(e), 0, 2));
    if (const char* e = std::getenv("TIERMOE_CUDA_TC_SPLITS")) tc_splits_per_1k_ = std::clamp(std::atoi(e), 1, 64);
    const char* rope_early = std::getenv("TIERMOE_CUDA_ROPE_EARLY");
    cuda::set_rope_early(!(rope_early && rope_early[0] == '0'));
    if (const char* e = std::getenv("TIERMOE_CUDA_DOWN")) cuda::set_moe_down_variant(std::atoi(e));
    if (const char* e = std::getenv("TIERMOE_CUDA_GROUPED_GROUPS")) cuda::set_moe_grouped_groups(std::atoi(e));
    if (const char* e = std::getenv("TIERMOE_CUDA_GEMV3_ROWS")) cuda::set_gemv3_rows(std::atoi(e));
    if (const char* e = std::getenv("TIERMOE_CUDA_GEMV_STREAM")) cuda::set_gemv_stream(e[0] != '0');
    if (const char* e = std::getenv("TIERMOE_CUDA_GEMV_PIPE")) cuda::set_gemv_pipe(std::atoi(e));
    if (const char* e = std::getenv("TIERMOE_CUDA_GATE_UP_STREAM")) cuda::set_moe_gate_up_stream(std::atoi(e));
    if (const char* e = std::getenv("TIERMOE_CUDA_WARP_TOPK")) cuda::set_moe_warp_topk(e[0] != '0');
    if (const char* e = std::getenv("TIERMOE_CUDA_DECODE_TC")) opts_.tc_decode_keys = std::max(0, std::atoi(e));
    if (const char* e = std::getenv("TIERMOE_CUDA_DECODE_TC_MIN_G")) opts_.tc_decode_min_group = std::max(1, std::atoi(e));
    int n_dev = 0;
    if (const cudaError_t e = cudaGetDeviceCount(&n_dev); e != cudaSuccess || n_dev == 0)
      throw InputError(std::string("CUDA backend: no usable GPU (") + (e != cudaSuccess ? cudaGetErrorString(e) : "none found") + ")");
    CUDA_CK(cudaSetDevice(0));
    CUDA_CK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    CUBLAS_CK(cublasCreate(&blas_));
    CUBLAS_CK(cublasSetStream(blas_, stream_));
    if (cfg_.num_experts > cuda::kRouteMaxE) throw InputError("CUDA backend: more than 256 experts per layer");
    if (cfg_.head_dim > cuda::kAttnMaxDh) throw InputError("CUDA backend: head_dim above 256");
  }
  ~CudaBackend() override {
    for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
    for (void* p : owned_) cudaFree(p);
    cudaFreeHost(h_ids_);
    cudaFreeHost(h_pos_);
    cudaFreeHost(h_logits_);
    cudaFreeHost(h_tables_);
    cudaFreeHost(h_sample_rows_);
    cudaFreeHost(h_tokens_);
    for (cudaEvent_t e : slot_done_)
      if (e) cudaEventDestroy(e);
    cublasDestroy(blas_);
    cudaStreamDestroy(stream_);
  }

  std::string name() const override { return "cuda"; }
  int vocab_size() const override { return cfg_.vocab_size; }

  std::unique_ptr<KvCache> new_cache() const override {
    return std::make_unique<CudaKvCache>(KvGeometry{cfg_.num_layers, cfg_.num_kv_heads, cfg_.num_heads, cfg_.head_dim},
                                         pool(), max_context(), stream_, prompt_attention_);
  }
  size_t kv_capacity_bytes() const override { return size_t(pool().pages()) * page_bytes(); }
  int kv_page_tokens() const override { return cuda::kKvPageRows; }
  int pass_tokens() const override { return opts_.max_chunk; }

  void forward_batch(std::span<const SeqStep> steps, float* logits) override {
    finish_queued();  // their pinned buffers are free once they are done
    split_into_passes(steps, opts_.max_chunk, cfg_.vocab_size, logits,
                      [&](const std::vector<SeqStep>& pass, float* out) { forward_pass(pass, out); });
  }

  // The same passes, each sampled on the device from logits_ (sampling.cu): B ids come back
  // instead of [B, V] logits. TIERMOE_CUDA_SAMPLE=0 (read at every call, for A/B): the host
  // samples the copied-back logits (Backend's default).
  void forward_sample(std::span<const SeqStep> steps, std::span<const SampleRow> rows, int32_t* tokens) override {
    finish_queued();  // their pinned buffers are free once they are done
    if (!device_sampling()) return Backend::forward_sample(steps, rows, tokens);
    check_sample_rows(steps, rows);
    size_t done = 0;
    split_into_passes(steps, opts_.max_chunk, cfg_.vocab_size, nullptr, [&](const std::vector<SeqStep>& pass, float*) {
      int n = 0;
      for (const SeqStep& s : pass) n += s.n_logits;
      put_sample_rows(rows.subspan(done, size_t(n)), 0);
      timeline_.start(stream_, pass.size() == 1 && pass[0].tokens.size() == 1 && n == 1);
      launch_pass(pass, n);
      sample_pass(n, tokens + done);
      done += size_t(n);
    });
  }

  // Queued decode steps run on the device one after another while the host waits for the older
  // one's ids: the step's inputs and ids in one of the two pinned sets (io_slot_), a chained step's
  // ids read by its embed from the last step's set. Where the device cannot sample (host
  // sampling), the steps already queued are finished and this one runs as forward_sample.
  void run_queued(std::span<const SeqStep> steps, std::span<const SampleRow> rows, Queued& q) override {
    if (!device_sampling() || int(steps.size()) > io_rows_) {
      finish_queued();  // with_host_tokens reads the last step's ids on the host
      return Backend::run_queued(steps, rows, q);
    }
    // The set no queued step holds (at most one is queued here): 0 when none is, so that every
    // chain starts on the same graphs.
    q.slot = queued_.empty() || queued_.back().slot != 0 ? 0 : 1;
    const std::vector<SeqStep> resolved = with_host_tokens(steps);
    const bool on_device = resolved[0].tokens.empty();  // chained to a step whose ids are not on the host yet
    put_sample_rows(rows, q.slot);
    struct QueuedPass {  // the pass's buffers, back to the synchronous ones however it ends
      CudaBackend& b;
      ~QueuedPass() { b.io_slot_ = 0, b.chain_slot_ = -1, b.queued_pass_ = false; }
    } restore{*this};
    io_slot_ = q.slot;
    chain_slot_ = on_device ? last_queued_.slot : -1;
    queued_pass_ = true;
    launch_pass(resolved, int(rows.size()));
    sample_pass(int(rows.size()), nullptr);
  }

  bool overlaps_steps() const override { return device_sampling(); }

  void take_sample(int32_t* tokens) override {
    if (!queued_.empty()) finish(queued_.front());  // its ids to the host
    Backend::take_sample(tokens);
  }

  // TIERMOE_CUDA_SAMPLE=0 (read at every call, for A/B): the host samples copied-back logits.
  static bool device_sampling() {
    const char* e = std::getenv("TIERMOE_CUDA_SAMPLE");
    return !(e && e[0] == '0');
  }
  void put_sample_rows(std::span<const SampleRow> rows, int slot) {
    cuda::SampleRowDevice* h = h_sample_rows_ + io(slot);
    for (size_t r = 0; r < rows.size(); ++r) h[r] = {rows[r].params.temperature, rows[r].params.top_k, rows[r].params.top_p, rows[r].u};
  }
  // A queued step's ids to the host, once its device work is done.
  void finish(Queued& q) {
    if (!q.ids.empty()) return;
    CUDA_CK(cudaEventSynchronize(slot_done_[q.slot]));
    q.ids.assign(h_tokens_ + io(q.slot), h_tokens_ + io(q.slot) + q.caches.size());
    if (last_queued_.slot == q.slot && last_queued_.ids.empty()) last_queued_.ids = q.ids;
  }
  void finish_queued() {
    for (Queued& q : queued_) finish(q);
  }

  // Weights: from a checkpoint, or random (dummy).
  void upload(const ModelWeights& w);
  void init_dummy();

 private:
  struct Piece {
    CudaKvCache* cache;
    int n, n_logits, n_splits, split_len;
  };

  DLinear put_linear(const Linear& l) {
    bf16* d = dalloc<bf16>(owned_, size_t(l.out) * l.in);
    put_into(d, l);
    return {d, l.out, l.in};
  }
  void put_into(bf16* d, const Linear& l) {
    const auto h = to_bf16_host(l.w, l.dtype, size_t(l.out) * l.in);
    CUDA_CK(cudaMemcpy(d, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
  }
  DLinear put_gate_up(const Linear& g, const Linear& u) {
    bf16* d = dalloc<bf16>(owned_, size_t(2) * g.out * g.in);
    put_into(d, g);
    put_into(d + size_t(g.out) * g.in, u);
    return {d, 2 * g.out, g.in};
  }
  const float* put_vec(const std::vector<float>& v) {
    if (v.empty()) return nullptr;
    float* d = dalloc<float>(owned_, v.size());
    CUDA_CK(cudaMemcpy(d, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
    return d;
  }
  DLinear rand_linear(int out, int in, float scale = 0.f) {
    bf16* d = dalloc<bf16>(owned_, size_t(out) * in);
    CUDA_CK(cuda::fill_random_bf16(d, size_t(out) * in, ++seed_, scale > 0 ? scale : std::sqrt(3.0f / float(in)), stream_));
    return {d, out, in};
  }
  const float* const_vec(int n, float value) {
    float* d = dalloc<float>(owned_, size_t(n));
    CUDA_CK(cuda::fill_f32(d, size_t(n), value, stream_));
    return d;
  }

  void alloc_workspace();
  void read_switches();
  void forward_pass(const std::vector<SeqStep>& pieces, float* logits);
  // Queues one pass (graph replay or eager launches) without waiting; its logits rows stay in
  // logits_. Returns how many rows.
  // sample_rows: h_sample_rows_[0, sample_rows) hold the pass's sampling params (greedy_pass_).
  int launch_pass(const std::vector<SeqStep>& pieces, int sample_rows = 0);
  void sample_pass(int n, int32_t* tokens);
  void run_layers(const std::vector<Piece>& pieces, int T, int n_logits);
  void linear(float* y, const float* x, const DLinear& W, int T, bool accumulate);
  void gemm(float* y, const bf16* xb, const bf16* w, int T, int N, int K, bool accumulate);
  // gemm() on an activation given as to_bf16(hi, lo, x) made it (lo null: hi alone).
  void gemm_split(float* y, const bf16* hi, const bf16* lo, const bf16* w, int T, int N, int K, bool accumulate);
  void mlp(const DLinear& gu, const DLinear& down, int T, float* out, bool accumulate);
  // logits_in_acc: the o projection summed the router's logits into route_acc_ (router_in_oproj).
  void moe(const DLayer& L, int T, bool logits_in_acc);
  enum class MoePath { Grouped, Fused, Experts };  // the kernels moe() runs at T (moe_path)
  MoePath moe_path(int T) const;
  // The router folded into the o projection and the experts (cuda::RouterLogits): the fused path
  // with no shared expert (whose MLP reads moe_route's h). TIERMOE_CUDA_ROUTE=kernel: moe_route.
  bool router_in_oproj(const DLayer& L, int T) const {
    return route_in_oproj_ && L.is_moe && moe_path(T) == MoePath::Fused && cfg_.shared_expert_ffn == 0 &&
           cuda::router_in_oproj_fits(cfg_.hidden_size, cfg_.num_experts, cfg_.top_k) &&
           gemv_for(T, cfg_.hidden_size) && gemv_for(T, cfg_.num_heads * cfg_.head_dim);  // gemv3 zeroes its sums
  }
  // Whether a projection of T tokens over K inputs takes the GEMV-style kernels rather than cuBLAS
  // (x split to BF16 hi + lo, two GEMMs: linear()): T <= kGemvMaxT, unless T >= small_t_blas_ (> 0)
  // and the CUDA-core GEMV would re-read x through L1 for every weight row: neither the tensor-core
  // GEMV (gemv_tc_fits) nor the stage takes it. Measured (docs/benchmarks.md, "Decode batches of 2
  // .. 8"): cuBLAS beat those CUDA-core GEMVs at B = 8 (-8.6% per step, OLMoE shape), lost at B <=
  // 6; the tensor cores beat cuBLAS at B = 8 (-12% / -21%). small_t_blas_all_: from T =
  // small_t_blas_ on cuBLAS whatever the kernels (the model check's way onto this path).
  bool gemv_for(int T, int K) const {
    if (T > cuda::kGemvMaxT) return false;
    if (small_t_blas_ == 0 || T < small_t_blas_) return true;
    return !small_t_blas_all_ && (cuda::gemv_tc_fits(T, K) || cuda::gemv_stage_holds(T, K));
  }
  int small_t_blas_ = 0;             // TIERMOE_CUDA_SMALL_T_BLAS=N, or Na for small_t_blas_all_ (read_switches)
  bool small_t_blas_all_ = false;

  ModelConfig cfg_;
  CudaBackendOptions opts_;
  PromptAttention prompt_attention_;
  uint64_t seed_ = 0;
  cudaStream_t stream_ = nullptr;
  cuda::StepTimeline timeline_{[] {
    const char* e = std::getenv("TIERMOE_CUDA_STEP_TIMELINE");
    return e && e[0] == '1';
  }()};
  cublasHandle_t blas_ = nullptr;
  std::vector<void*> owned_;

  const bf16* embed_ = nullptr;
  DLinear lm_head_;
  const float* final_norm_ = nullptr;
  std::vector<DLayer> layers_;

  // Workspace, sized for max_chunk tokens at construction.
  float *x_, *h_, *q_, *k_, *v_, *att_, *gu_, *act_, *tmp_, *router_, *wts_, *sg_, *logits_, *partial_;
  int32_t *ids_, *pos_, *topk_;
  long long* route_acc_ = nullptr;  // [kGemvMaxT, E] slots: the unscaled router logits (router_in_oproj), 0 between layers
  unsigned* split_counters_;  // attention_decode's, zero between launches
  // MoE kernels by T (TIERMOE_CUDA_MOE): Grouped (default): T <= kGemvMaxT the per-(token, k) kernels,
  // then up to kMoeGroupedMaxT the grouped ones, beyond that the expert GEMMs on the tensor cores
  // (moe_prefill.cu); Fused: the per-(token, k) kernels up to T = kGemvMaxT, then the expert
  // GEMMs; Unfused: router GEMV, top-k, sort/pad and the expert GEMMs at every T (the baseline).
  enum class MoeMode { Grouped, Fused, Unfused };
  // The defaults: the configuration checked and timed on the H200 (docs/cuda.md, c4c5c71).
  static constexpr MoeMode kDefaultMoe = MoeMode::Grouped;
  static constexpr bool kDefaultBatchAttention = true;
  static constexpr int kDefaultSmallTBlas = 8;  // gemv_for: measured, docs/benchmarks.md "Decode batches of 2 .. 8"
  MoeMode moe_mode_ = kDefaultMoe;
  // Which T the grouped kernels take: above kGemvMaxT always; from T = 2 where the T K (token, k)
  // entries are at least the E experts. Below that the per-(token, k) kernels with the router in the
  // o projection took 5-23% less time per step than the grouped ones (docs/benchmarks.md, "Grouped
  // MoE at small batches"); from there an expert is picked about once per token on average,
  // so the grouped kernels read ~(1 - 1/e) of the rows the per-(token, k) ones read (Mixtral B = 4 /
  // 8: -12.5% / -38.6% per step, OLMoE B = 8: -7.9%). TIERMOE_CUDA_MOE_GROUPED_MIN_T=N: from T = N
  // instead (0: this rule).
  bool grouped_at(int T) const {
    if (grouped_min_t_ > 0) return T >= grouped_min_t_;
    return T > cuda::kGemvMaxT || (T >= 2 && T * cfg_.top_k >= cfg_.num_experts);
  }
  int grouped_min_t_ = 0;
  bool grouped_mma_ = true;  // the grouped kernels on the tensor cores (TIERMOE_CUDA_GROUPED_MMA=0: CUDA cores)
  bool route_in_oproj_ = true;  // TIERMOE_CUDA_ROUTE=kernel: false
  // The grouped kernels' routing at T <= kGemvMaxT: RMSNorm, the router GEMV and route_topk as three
  // launches, or moe_route (TIERMOE_CUDA_GROUPED_ROUTE=kernel), whose one cluster of blocks takes
  // all T tokens: 58.8 us per layer at the OLMoE shape, B = 8 (ncu), and 7.5% / 4.9% slower per
  // step there and on Mixtral at B = 8 (docs/benchmarks.md, "Grouped MoE at small batches").
  bool grouped_route_kernel_ = false;
  static constexpr int kMoeGroupedMaxT = 64;
  float* moe_y_ = nullptr;  // grouped / expert-GEMM down projection, [(t, k) rows, D]
  int32_t *moe_rows_ = nullptr, *moe_tiles_ = nullptr;  // moe_sort's output for prompt chunks
  // One attention launch for B sequences of one token each (TIERMOE_CUDA_BATCH_ATTN=0: one per
  // sequence): their page tables [B], on the device and pinned on the host; the split count of the
  // pass (0: attention per piece).
  bool batch_attention_ = kDefaultBatchAttention;
  // A decode batch's attention on the tensor cores (attention_prefill over tables_), where the
  // batch-1 rule (tc_decode) would take them for its longest sequence; TIERMOE_CUDA_BATCH_TC=0: never.
  bool batch_tc_allowed_ = true, batch_tc_ = false;
  const int32_t **tables_ = nullptr, **h_tables_ = nullptr;
  int batch_splits_ = 0;
  bool decode_attention_ = true;
  // Decode attention on the tensor cores (CudaBackendOptions::tc_decode_min_group) for a sequence
  // of `keys` keys, from `from` keys on: one sequence's (tc_decode_keys), or a decode batch's
  // longest (tc_decode_batch_keys).
  bool tc_decode_keys(int keys, int from) const {
    return from > 0 && cfg_.num_heads >= opts_.tc_decode_min_group * cfg_.num_kv_heads && keys >= from &&
           cuda::attention_prefill_supported(cfg_.num_heads, cfg_.num_kv_heads, cfg_.head_dim);
  }
  bool tc_decode(const std::vector<Piece>& pieces) const {
    return pieces.size() == 1 && pieces[0].n <= cuda::kGemvMaxT &&
           tc_decode_keys(pieces[0].cache->length() + pieces[0].n, opts_.tc_decode_keys);
  }
  // The tensor-core decode's key splits (decode_splits.h): 4 per 1024 keys from 1024 on (at 4096
  // keys 3-6% faster per token than 8 on Qwen3-30B-A3B and Mixtral, docs/benchmarks.md), at most a
  // block per multiprocessor (tc_split_cap_: from 8k keys on Qwen3's 4 KV heads, 4k on Mixtral's 8;
  // two on FP8 pages).
  // TIERMOE_CUDA_TC_SPLITS=N: N per 1024 keys instead (A/B timing; the cap still holds).
  int tc_decode_splits(int keys) const { return cuda::tc_decode_splits(keys, tc_splits_per_1k_, tc_split_cap_); }
  int tc_splits_per_1k_ = 4, tc_split_cap_ = 0;
  // A decode batch's key splits: at most batch-1's count for its longest sequence (`most`), fewer
  // where the (sequence, KV head, split) blocks would come in waves (cuda::decode_batch_splits:
  // -4% .. -13% per step on the bench shapes at B = 8..64, docs/benchmarks.md "Decode batches: key
  // splits"). The model sees the keys rounded up as `most` steps (to a power of two up to 1024, then
  // to 1024s), so that a growing batch changes its split count, and captures a graph, no more often
  // than `most` does. TIERMOE_CUDA_BATCH_SPLITS=0: `most` (the rule before); =N: min(N, most).
  int batch_splits(int most, int keys, int tile_keys, int resident, int B) const {
    if (batch_splits_pin_ >= 0) return batch_splits_pin_ == 0 ? most : std::min(batch_splits_pin_, most);
    const int stepped = keys > 1024 ? (keys + 1023) / 1024 * 1024 : int(std::bit_ceil(unsigned(std::max(1, keys))));
    return cuda::decode_batch_splits(stepped, tile_keys, B * cfg_.num_kv_heads, resident, most);
  }
  int batch_splits_pin_ = -1;  // -1: decode_batch_splits
  bool sample_single_stage_ = false;  // TIERMOE_CUDA_SAMPLE_SLICES=1 (read_switches)
  int tc_resident_blocks_ = 0, decode_resident_blocks_ = 0;  // the attention kernels' residency (alloc_workspace)
  int decode_split_cap_ = 0;  // attention_decode_split_cap (alloc_workspace): one wave of the per-head kernel
  bf16 *xb_ = nullptr, *xb_lo_ = nullptr;  // prompt-path GEMM inputs in BF16: hi, lo (split_activations)
  size_t partial_cap_ = 0;
  // A pass whose every logits row is sampled greedily (at most kGemvMaxT rows): the LM head folds the
  // argmax (each block's best from its outputs kept in shared memory) and argmax_tokens writes
  // tokens_ inside the step, so sample_pass only copies them back. Measured (docs/benchmarks.md):
  // 1.0-1.5% faster per token at V = 8192, 50,304 and 151,936.
  bool greedy_pass_ = false, greedy_fold_ = true;  // TIERMOE_CUDA_GREEDY_FOLD=0 (read_switches): sample_tokens
  unsigned long long* argmax_best_ = nullptr;      // [kGemvMaxT] slots, kRouterLogitStride apart, 0 between steps
  int32_t *h_ids_ = nullptr, *h_pos_ = nullptr;
  // A step's ids and positions read by its first kernel from the pinned buffers above (the
  // positions copied on), and a greedy step's tokens written by argmax_tokens straight into
  // h_tokens_: no copy operations around the graph (TIERMOE_CUDA_MAPPED_IO=0: the copies, read at
  // construction). The buffers' device addresses:
  bool mapped_io_ = true;
  int32_t *d_h_ids_ = nullptr, *d_h_pos_ = nullptr, *d_h_tokens_ = nullptr;
  // Queued decode steps (queue_sample): the pinned step buffers (ids, positions, page tables,
  // sampling rows, tokens) come in two sets of io_rows_ rows, used in turn, so that the host fills
  // one step's while the device runs the other's. io_slot_: the set of the pass being launched (0
  // outside queue_sample); chain_slot_: the set whose tokens are its ids (a chained step), or -1.
  int io_rows_ = 0, io_slot_ = 0, chain_slot_ = -1;
  bool queued_pass_ = false;  // launched by queue_sample: no step timeline, no wait
  cudaEvent_t slot_done_[2] = {};
  size_t io(int slot) const { return size_t(slot) * size_t(io_rows_); }
  float* h_logits_ = nullptr;
  static constexpr int kPinnedLogitRows = 8;
  // Device sampling: rows of a pass (at most max_chunk), sampled kSampleRows at a time in a
  // scratch preallocated for that many rows (about 20 * kSampleRows * V bytes).
  static constexpr int kSampleRows = 64;
  cuda::SampleRowDevice *sample_rows_ = nullptr, *h_sample_rows_ = nullptr;
  int32_t *tokens_ = nullptr, *h_tokens_ = nullptr;
  void* sample_scratch_ = nullptr;
  size_t sample_scratch_bytes_ = 0;
  static constexpr int kDecodeSplit = 64;  // keys per attention block when T <= kGemvMaxT
  mutable std::unique_ptr<KvPagePool> pool_;  // at the first use, pool()

  int max_context() const { return cfg_.max_position_embeddings > 0 ? cfg_.max_position_embeddings : 1 << 20; }
  size_t page_bytes() const {  // K and V of one page in every layer
    return KvPagePool::page_bytes(cfg_.num_layers, cfg_.num_kv_heads, cfg_.head_dim, opts_.kv_dtype == KvDType::FP8);
  }
  int pool_pages() const;
  // Allocated at the first use (a cache, or the scheduler asking the capacity): after the weights,
  // so that auto-sizing sees what they left.
  KvPagePool& pool() const {
    if (!pool_)
      pool_ = std::make_unique<KvPagePool>(cfg_.num_layers, cfg_.num_kv_heads, cfg_.head_dim, pool_pages(),
                                           opts_.kv_dtype == KvDType::FP8);
    return *pool_;
  }

  // Captured decode steps. Batch 1: one per (page table, attention split count, logits wanted), so
  // a sequence that grows through several split counts replays graphs captured before (a new cache
  // whose table reuses a freed address may replay them too: the table's entries are read at run
  // time). A batch of B sequences (one token each) reads its page tables through tables_, so its
  // key is (B, split count, logits wanted) alone.
  struct GraphKey {
    const void* table = nullptr;
    int n_splits = 0, n_logits = 0, batch = 1;
    bool tc_attention = false;  // decode attention on the tensor cores (tc_decode())
    bool greedy = false;        // the tokens' argmax in the LM head (greedy_pass_)
    int io_slot = 0, chain_slot = -1;  // the pinned buffers it reads and writes (queue_sample)
    auto operator<=>(const GraphKey&) const = default;
  };
  std::map<GraphKey, cudaGraphExec_t> graphs_;
  std::set<GraphKey> batch_keys_seen_;  // a batch step is captured the second time its key comes
};

// The A/B switches of the MoE kernels and the batched attention, read at every pass (a few
// getenv calls) so that one process can time the variants side by side (tiermoe_cuda_check
// batchtable); a change drops the captured graphs.
void CudaBackend::read_switches() {
  MoeMode mode = kDefaultMoe;
  if (const char* e = std::getenv("TIERMOE_CUDA_MOE")) {
    if (std::strcmp(e, "unfused") == 0) mode = MoeMode::Unfused;
    else if (std::strcmp(e, "grouped") == 0) mode = MoeMode::Grouped;
    else if (std::strcmp(e, "fused") == 0) mode = MoeMode::Fused;
    else throw InputError(std::string("TIERMOE_CUDA_MOE=") + e + ": expected grouped, fused or unfused");
  }
  const char* min_t = std::getenv("TIERMOE_CUDA_MOE_GROUPED_MIN_T");
  const int grouped_min_t = min_t ? std::max(0, std::atoi(min_t)) : 0;
  const char* ba = std::getenv("TIERMOE_CUDA_BATCH_ATTN");
  const bool batch_attention = ba ? ba[0] == '1' : kDefaultBatchAttention;
  const char* btc = std::getenv("TIERMOE_CUDA_BATCH_TC");
  bool in_oproj = true;
  if (const char* e = std::getenv("TIERMOE_CUDA_ROUTE")) {
    if (std::strcmp(e, "kernel") == 0) in_oproj = false;
    else if (std::strcmp(e, "oproj") != 0)
      throw InputError(std::string("TIERMOE_CUDA_ROUTE=") + e + ": expected oproj or kernel");
  }
  const char* gr = std::getenv("TIERMOE_CUDA_GROUPED_ROUTE");
  const bool grouped_route_kernel = gr && std::strcmp(gr, "kernel") == 0;
  const char* gm = std::getenv("TIERMOE_CUDA_GROUPED_MMA");  // 0: the grouped kernels on the CUDA cores
  const bool grouped_mma = !(gm && gm[0] == '0');
  const char* sb = std::getenv("TIERMOE_CUDA_SMALL_T_BLAS");
  const int small_t_blas = sb ? std::max(0, std::atoi(sb)) : kDefaultSmallTBlas;
  const bool small_t_blas_all = sb && std::strchr(sb, 'a');
  if (mode != moe_mode_ || grouped_min_t != grouped_min_t_ || in_oproj != route_in_oproj_ || grouped_mma != grouped_mma_ ||
      grouped_route_kernel != grouped_route_kernel_ || small_t_blas != small_t_blas_ ||
      small_t_blas_all != small_t_blas_all_) {
    for (auto& [key, exec] : graphs_) CUDA_CK(cudaGraphExecDestroy(exec));
    graphs_.clear();
  }
  moe_mode_ = mode;
  grouped_min_t_ = grouped_min_t;
  route_in_oproj_ = in_oproj;
  grouped_mma_ = grouped_mma;
  grouped_route_kernel_ = grouped_route_kernel;
  small_t_blas_ = small_t_blas;
  small_t_blas_all_ = small_t_blas_all;
  cuda::set_moe_grouped_mma(grouped_mma);
  batch_attention_ = batch_attention;
  batch_tc_allowed_ = !(btc && btc[0] == '0');
  const char* pin = std::getenv("TIERMOE_CUDA_BATCH_SPLITS");
  batch_splits_pin_ = pin ? std::max(0, std::atoi(pin)) : -1;
  // Sampling runs outside the graphs. 1: the form before the slices (one block per row, and the
  // sort's launches whether a row needs them or not).
  const char* slices = std::getenv("TIERMOE_CUDA_SAMPLE_SLICES");
  cuda::set_sample_max_slices(slices ? std::atoi(slices) : 0);
  sample_single_stage_ = slices && std::atoi(slices) == 1;
  const char* fold = std::getenv("TIERMOE_CUDA_GREEDY_FOLD");
  greedy_fold_ = !(fold && fold[0] == '0');
}

// The page pool's size: kv_cache_bytes when given, else the GPU memory free once the weights and
// workspace are in, less a reserve of max(4 GiB, 5%) (cuBLAS workspaces, graphs, the benchmark's
// copy-bandwidth buffers); at most 256 sequences of the full context.
int CudaBackend::pool_pages() const {
  size_t bytes = opts_.kv_cache_bytes;
  if (bytes == 0) {
    size_t free_b = 0, total_b = 0;
    CUDA_CK(cudaMemGetInfo(&free_b, &total_b));
    const size_t reserve = std::max(size_t(4) << 30, total_b / 20);
    bytes = free_b > reserve ? free_b - reserve : 0;
  }
  const size_t per_seq = (size_t(max_context()) + cuda::kKvPageRows - 1) / cuda::kKvPageRows;
  const size_t pages = std::min({bytes / page_bytes(), per_seq * 256, size_t(INT32_MAX)});
  if (pages == 0)
    throw InputError("KV cache: " +
                     (opts_.kv_cache_bytes ? std::to_string(opts_.kv_cache_bytes) + " bytes (--gpu-kv-gib) is"
                                           : std::string("the free GPU memory is")) +
                     " less than one page of " + std::to_string(cuda::kKvPageRows) + " tokens (" +
                     std::to_string(page_bytes() >> 10) + " KiB)");
  return int(pages);
}

void CudaBackend::alloc_workspace() {
  const int Tm = opts_.max_chunk, D = cfg_.hidden_size, H = cfg_.num_heads, Hkv = cfg_.num_kv_heads,
            Dh = cfg_.head_dim, E = std::max(1, cfg_.num_experts), K = std::max(1, cfg_.top_k);
  const int F = std::max({cfg_.intermediate_size, cfg_.expert_ffn, cfg_.shared_expert_ffn, 1});
  x_ = dalloc<float>(owned_, size_t(Tm) * D);
  h_ = dalloc<float>(owned_, size_t(Tm) * D);
  tmp_ = dalloc<float>(owned_, size_t(Tm) * D);
  q_ = dalloc<float>(owned_, size_t(Tm) * H * Dh);
  att_ = dalloc<float>(owned_, size_t(Tm) * H * Dh);
  k_ = dalloc<float>(owned_, size_t(Tm) * Hkv * Dh);
  v_ = dalloc<float>(owned_, size_t(Tm) * Hkv * Dh);
  // (t, k) rows of the MoE scratch: a whole chunk's for the prompt path's expert GEMMs.
  const size_t moe_rows = cfg_.num_experts > 0 ? size_t(Tm) * K : size_t(cuda::kGemvMaxT) * K;
  gu_ = dalloc<float>(owned_, std::max(size_t(Tm), moe_rows) * 2 * F);
  act_ = dalloc<float>(owned_, std::max(size_t(Tm), moe_rows) * F);
  moe_y_ = dalloc<float>(owned_, moe_rows * D);
  if (cfg_.num_experts > 0) {
    const int P = cuda::moe_sort_rows(int(moe_rows), E);
    moe_rows_ = dalloc<int32_t>(owned_, size_t(P));
    moe_tiles_ = dalloc<int32_t>(owned_, size_t(P / cuda::kMoeTileM));
  }
  router_ = dalloc<float>(owned_, size_t(Tm) * E);
  wts_ = dalloc<float>(owned_, size_t(Tm) * K);
  topk_ = dalloc<int32_t>(owned_, size_t(Tm) * K);
  const size_t acc_n = size_t(cuda::kGemvMaxT) * E * cuda::kRouterLogitStride;
  route_acc_ = dalloc<long long>(owned_, acc_n);
  CUDA_CK(cudaMemset(route_acc_, 0, acc_n * sizeof(long long)));
  const size_t best_n = size_t(cuda::kGemvMaxT) * cuda::kRouterLogitStride;
  argmax_best_ = dalloc<unsigned long long>(owned_, best_n);
  CUDA_CK(cudaMemset(argmax_best_, 0, best_n * sizeof(unsigned long long)));
  sg_ = dalloc<float>(owned_, size_t(Tm));
  logits_ = dalloc<float>(owned_, size_t(Tm) * cfg_.vocab_size);
  ids_ = dalloc<int32_t>(owned_, size_t(Tm));
  pos_ = dalloc<int32_t>(owned_, size_t(Tm));
  // BF16 GEMM inputs: a chunk's activations, or (pipelined expert GEMMs) its [(t, k), F] rows.
  const size_t xb_n = std::max(size_t(Tm) * std::max({D, H * Dh, F}),
                               cfg_.num_experts > 0 && opts_.pipelined_moe_gemm ? moe_rows * F : 0);
  xb_ = dalloc<bf16>(owned_, xb_n);
  if (opts_.split_activations) xb_lo_ = dalloc<bf16>(owned_, xb_n);
  // Attention partials: up to 32 splits for a prompt chunk, or one per kDecodeSplit keys at T <= 8.
  const int max_ctx = cfg_.max_position_embeddings > 0 ? cfg_.max_position_embeddings : 1 << 16;
  partial_cap_ = std::max(size_t(Tm) * 32, size_t(cuda::kGemvMaxT) * size_t((max_ctx + kDecodeSplit - 1) / kDecodeSplit * 2)) *
                 H * (Dh + 2);
  partial_ = dalloc<float>(owned_, partial_cap_);
  const size_t n_counters = size_t(std::max(Tm, cuda::kGemvMaxT)) * H;  // (token, block of a KV head): H at most
  split_counters_ = dalloc<unsigned>(owned_, n_counters);
  CUDA_CK(cudaMemset(split_counters_, 0, n_counters * sizeof(unsigned)));
  tables_ = dalloc<const int32_t*>(owned_, size_t(Tm));
  io_rows_ = Tm;
  CUDA_CK(cudaMallocHost(&h_tables_, io(2) * sizeof(const int32_t*)));
  for (cudaEvent_t& e : slot_done_) CUDA_CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  decode_attention_ = cuda::attention_decode_supported(H, Hkv, Dh);
  decode_resident_blocks_ = cuda::attention_decode_resident_blocks(H, Hkv, Dh);
  decode_split_cap_ = cuda::attention_decode_split_cap(H, Hkv, Dh, opts_.kv_dtype == KvDType::FP8);
  if (cuda::attention_prefill_supported(H, Hkv, Dh)) {
    tc_resident_blocks_ = cuda::attention_prefill_decode_resident_blocks(Dh, opts_.flash_split_p);
    tc_split_cap_ = cuda::attention_prefill_decode_split_cap(Hkv, opts_.kv_dtype == KvDType::FP8);
  }
  CUDA_CK(cudaMallocHost(&h_ids_, io(2) * 4));
  CUDA_CK(cudaMallocHost(&h_pos_, io(2) * 4));
  CUDA_CK(cudaMallocHost(&h_logits_, size_t(kPinnedLogitRows) * cfg_.vocab_size * 4));
  sample_rows_ = dalloc<cuda::SampleRowDevice>(owned_, size_t(Tm));
  tokens_ = dalloc<int32_t>(owned_, size_t(Tm));
  CUDA_CK(cudaMallocHost(&h_sample_rows_, io(2) * sizeof(cuda::SampleRowDevice)));
  CUDA_CK(cudaMallocHost(&h_tokens_, io(2) * 4));
  if (const char* e = std::getenv("TIERMOE_CUDA_MAPPED_IO")) mapped_io_ = e[0] != '0';
  CUDA_CK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d_h_ids_), h_ids_, 0));
  CUDA_CK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d_h_pos_), h_pos_, 0));
  CUDA_CK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&d_h_tokens_), h_tokens_, 0));
  sample_scratch_bytes_ = cuda::sample_tokens_scratch_bytes(std::min(Tm, kSampleRows), cfg_.vocab_size);
  CHECK_MSG(sample_scratch_bytes_ > 0, "sampling scratch: vocabulary too large");
  sample_scratch_ = dalloc<char>(owned_, sample_scratch_bytes_);
}

void CudaBackend::upload(const ModelWeights& w) {
  alloc_workspace();
  lm_head_ = put_linear(w.lm_head);
  embed_ = cfg_.tie_word_embeddings ? lm_head_.w : put_linear(w.embed).w;
  final_norm_ = put_vec(w.final_norm);
  for (const LayerWeights& L : w.layers) {
    DLayer d;
    d.attn_norm = put_vec(L.attn_norm);
    d.ffn_norm = put_vec(L.ffn_norm);
    d.q = put_linear(L.q);
    d.k = put_linear(L.k);
    d.v = put_linear(L.v);
    d.o = put_linear(L.o);
    d.q_bias = put_vec(L.q_bias);
    d.k_bias = put_vec(L.k_bias);
    d.v_bias = put_vec(L.v_bias);
    d.q_norm = put_vec(L.q_norm);
    d.k_norm = put_vec(L.k_norm);
    d.is_moe = L.is_moe;
    if (L.is_moe) {
      const int E = cfg_.num_experts, F = cfg_.expert_ffn, D = cfg_.hidden_size;
      d.router = put_linear(L.router);
      bf16* gu = dalloc<bf16>(owned_, size_t(E) * 2 * F * D);
      bf16* dn = dalloc<bf16>(owned_, size_t(E) * D * F);
      for (int e = 0; e < E; ++e) {
        put_into(gu + size_t(e) * 2 * F * D, L.experts[e].gate);
        put_into(gu + size_t(e) * 2 * F * D + size_t(F) * D, L.experts[e].up);
        put_into(dn + size_t(e) * D * F, L.experts[e].down);
      }
      d.experts_gu = gu;
      d.experts_down = dn;
      if (cfg_.shared_expert_ffn > 0) {
        d.shared_gu = put_gate_up(L.shared.gate, L.shared.up);
        d.shared_down = put_linear(L.shared.down);
        d.shared_gate = put_linear(L.shared_gate);
      }
    } else {
      d.dense_gu = put_gate_up(L.dense.gate, L.dense.up);
      d.dense_down = put_linear(L.dense.down);
    }
    layers_.push_back(d);
  }
  CUDA_CK(cudaStreamSynchronize(stream_));
}

void CudaBackend::init_dummy() {
  alloc_workspace();
  seed_ = opts_.dummy_seed * 1000003ull;
  const int D = cfg_.hidden_size, H = cfg_.num_heads, Hkv = cfg_.num_kv_heads, Dh = cfg_.head_dim;
  embed_ = rand_linear(cfg_.vocab_size, D, 1.0f).w;
  lm_head_ = cfg_.tie_word_embeddings ? DLinear{embed_, cfg_.vocab_size, D} : rand_linear(cfg_.vocab_size, D);
  final_norm_ = const_vec(D, 1.f);
  for (int l = 0; l < cfg_.num_layers; ++l) {
    DLayer d;
    d.attn_norm = const_vec(D, 1.f);
    d.ffn_norm = const_vec(D, 1.f);
    d.q = rand_linear(H * Dh, D);
    d.k = rand_linear(Hkv * Dh, D);
    d.v = rand_linear(Hkv * Dh, D);
    d.o = rand_linear(D, H * Dh);
    if (cfg_.qkv_bias) {
      d.q_bias = const_vec(H * Dh, 0.f);
      d.k_bias = const_vec(Hkv * Dh, 0.f);
      d.v_bias = const_vec(Hkv * Dh, 0.f);
    }
    if (cfg_.qk_norm == QkNorm::PerHead) {
      d.q_norm = const_vec(Dh, 1.f);
      d.k_norm = const_vec(Dh, 1.f);
    } else if (cfg_.qk_norm == QkNorm::Full) {
      d.q_norm = const_vec(H * Dh, 1.f);
      d.k_norm = const_vec(Hkv * Dh, 1.f);
    }
    d.is_moe = cfg_.layer_is_moe[l];
    if (d.is_moe) {
      const int E = cfg_.num_experts, F = cfg_.expert_ffn;
      d.router = rand_linear(E, D);
      d.experts_gu = rand_linear(E * 2 * F, D).w;
      d.experts_down = rand_linear(E * D, F).w;
      if (cfg_.shared_expert_ffn > 0) {
        d.shared_gu = rand_linear(2 * cfg_.shared_expert_ffn, D);
        d.shared_down = rand_linear(D, cfg_.shared_expert_ffn);
        d.shared_gate = rand_linear(1, D);
      }
    } else {
      d.dense_gu = rand_linear(2 * cfg_.intermediate_size, D);
      d.dense_down = rand_linear(D, cfg_.intermediate_size);
    }
    layers_.push_back(d);
  }
  CUDA_CK(cudaStreamSynchronize(stream_));
}

void CudaBackend::gemm(float* y, const bf16* xb, const bf16* w, int T, int N, int K, bool accumulate) {
  const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
  // Column-major view: y^T[N, T] = W[N, K] (row-major, i.e. op T of a K x N matrix) x^T[K, T].
  CUBLAS_CK(cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, N, T, K, &alpha, w, CUDA_R_16BF, K, xb, CUDA_R_16BF, K,
                         &beta, y, CUDA_R_32F, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void CudaBackend::gemm_split(float* y, const bf16* hi, const bf16* lo, const bf16* w, int T, int N, int K,
                             bool accumulate) {
  gemm(y, hi, w, T, N, K, accumulate);
  if (lo) gemm(y, lo, w, T, N, K, true);
}

void CudaBackend::linear(float* y, const float* x, const DLinear& W, int T, bool accumulate) {
  if (gemv_for(T, W.in)) {
    CUDA_CK(cuda::gemv(y, x, W.w, T, W.out, W.in, accumulate, stream_));
  } else {
    CUDA_CK(cuda::to_bf16(xb_, xb_lo_, x, size_t(T) * W.in, stream_));
    gemm_split(y, xb_, xb_lo_, W.w, T, W.out, W.in, accumulate);
  }
}

void CudaBackend::mlp(const DLinear& gu, const DLinear& down, int T, float* out, bool accumulate) {
  const int F = gu.out / 2;
  linear(gu_, h_, gu, T, false);                        // [T, 2F]
  CUDA_CK(cuda::silu_mul_gu(act_, gu_, T, F, stream_));  // [T, F]
  linear(out, act_, down, T, accumulate);               // [T, D]
}

CudaBackend::MoePath CudaBackend::moe_path(int T) const {
  if (moe_mode_ == MoeMode::Grouped && grouped_at(T) && T <= kMoeGroupedMaxT &&
      T * cfg_.top_k <= cuda::kMoeGroupedMaxTK)
    return MoePath::Grouped;
  return T <= cuda::kGemvMaxT && moe_mode_ != MoeMode::Unfused ? MoePath::Fused : MoePath::Experts;
}

void CudaBackend::moe(const DLayer& L, int T, bool logits_in_acc) {
  const int D = cfg_.hidden_size, E = cfg_.num_experts, K = cfg_.top_k, F = cfg_.expert_ffn;
  const MoePath path = moe_path(T);
  const bool grouped = path == MoePath::Grouped, fused = path == MoePath::Fused;
  if (logits_in_acc) {
    CUDA_CK(cuda::moe_gate_up_routed(act_, topk_, wts_, x_, L.ffn_norm, cfg_.rms_norm_eps, route_acc_, L.experts_gu,
                                     T, E, K, F, D, cfg_.norm_topk_prob, stream_));                 // [T, K, F]
    CUDA_CK(cuda::moe_down(x_, act_, L.experts_down, topk_, wts_, T, K, D, F, stream_, route_acc_, E));  // x += ...
    return;
  }
  if ((fused || (grouped && grouped_route_kernel_)) && T <= cuda::kGemvMaxT) {
    // norm, router, top-k in one launch, the logits on chip
    CUDA_CK(cuda::moe_route(h_, topk_, wts_, x_, L.ffn_norm, cfg_.rms_norm_eps, L.router.w, T, E, K, D,
                            cfg_.norm_topk_prob, stream_));
  } else {
    CUDA_CK(cuda::rmsnorm(h_, x_, L.ffn_norm, T, D, cfg_.rms_norm_eps, stream_));
    linear(router_, h_, L.router, T, false);                                                 // [T, E]
    CUDA_CK(cuda::route_topk(topk_, wts_, router_, T, E, K, cfg_.norm_topk_prob, stream_));  // [T, K]
  }
  if (grouped) {  // each selected expert's rows read once for all its tokens
    CUDA_CK(cuda::moe_grouped_gate_up(act_, h_, L.experts_gu, topk_, T, K, E, F, D, stream_));   // [T * K, F]
    CUDA_CK(cuda::moe_grouped_down(moe_y_, act_, L.experts_down, topk_, T, K, E, D, F, stream_));  // [T * K, D]
    CUDA_CK(cuda::moe_combine(x_, moe_y_, wts_, T, K, D, stream_));                                // x += ...
  } else if (fused) {
    CUDA_CK(cuda::moe_gate_up(act_, h_, L.experts_gu, topk_, T, K, F, D, stream_));          // [T, K, F]
    CUDA_CK(cuda::moe_down(x_, act_, L.experts_down, topk_, wts_, T, K, D, F, stream_));      // x += ...
  } else {
    // Prompt chunks, and every T when unfused (router kernel, sort/pad, grouped GEMM): the
    // (token, k) entries grouped by expert on the device, then each expert's tokens only through
    // its weights on the tensor cores; no host sync.
    const int TK = T * K;
    CUDA_CK(cuda::moe_sort(moe_rows_, moe_tiles_, topk_, TK, E, stream_));
    if (opts_.pipelined_moe_gemm && D % 8 == 0 && F % 8 == 0) {  // inputs split to BF16 once per GEMM
      CUDA_CK(cuda::to_bf16(xb_, xb_lo_, h_, size_t(T) * D, stream_));  // [T, D] hi, lo
      CUDA_CK(cuda::moe_expert_gemm_bf16(gu_, xb_, xb_lo_, K, L.experts_gu, moe_rows_, moe_tiles_, TK, E, 2 * F, D,
                                         stream_));                  // [TK, 2F]
      CUDA_CK(cuda::silu_mul_gu(act_, gu_, TK, F, stream_));         // [TK, F]
      CUDA_CK(cuda::to_bf16(xb_, xb_lo_, act_, size_t(TK) * F, stream_));
      CUDA_CK(cuda::moe_expert_gemm_bf16(moe_y_, xb_, xb_lo_, 1, L.experts_down, moe_rows_, moe_tiles_, TK, E, D, F,
                                         stream_));                  // [TK, D]
    } else {  // the first kernel: FP32 input split inside every k-step
      CUDA_CK(cuda::moe_expert_gemm(gu_, h_, K, L.experts_gu, moe_rows_, moe_tiles_, TK, E, 2 * F, D,
                                    opts_.split_activations, stream_));  // [TK, 2F]
      CUDA_CK(cuda::silu_mul_gu(act_, gu_, TK, F, stream_));          // [TK, F]
      CUDA_CK(cuda::moe_expert_gemm(moe_y_, act_, 1, L.experts_down, moe_rows_, moe_tiles_, TK, E, D, F,
                                    opts_.split_activations, stream_));  // [TK, D]
    }
    CUDA_CK(cuda::moe_combine(x_, moe_y_, wts_, T, K, D, stream_));  // x += ...
  }
  if (cfg_.shared_expert_ffn > 0) {
    mlp(L.shared_gu, L.shared_down, T, tmp_, false);
    linear(sg_, h_, L.shared_gate, T, false);  // [T, 1]
    CUDA_CK(cuda::add_sigmoid_scaled(x_, tmp_, sg_, T, D, stream_));
  }
}

void CudaBackend::run_layers(const std::vector<Piece>& pieces, int T, int n_logits) {
  const int D = cfg_.hidden_size, H = cfg_.num_heads, Hkv = cfg_.num_kv_heads, Dh = cfg_.head_dim;
  const float eps = cfg_.rms_norm_eps;
  // A chained step's ids are the tokens the previous step wrote (mapped: its pinned set; else tokens_).
  const int32_t* chained_ids = chain_slot_ < 0 ? nullptr : mapped_io_ ? d_h_tokens_ + io(chain_slot_) : tokens_;
  if (mapped_io_)
    CUDA_CK(cuda::embed(x_, embed_, chained_ids ? chained_ids : d_h_ids_ + io(io_slot_), T, D, stream_,
                        d_h_pos_ + io(io_slot_), pos_));
  else
    CUDA_CK(cuda::embed(x_, embed_, chained_ids ? chained_ids : ids_, T, D, stream_));
  // Decode attention on the tensor cores (one sequence, or a batch through tables_): qk_norm_rope
  // appends the new rows first.
  const bool tc = tc_decode(pieces), fp8 = pool().fp8();
  for (int l = 0; l < cfg_.num_layers; ++l) {
    const DLayer& L = layers_[l];
    const bool route_in_oproj = router_in_oproj(L, T);
    if (gemv_for(T, D)) {  // the attention norm folded into the q/k/v GEMV
      // Layer 0's first kernel as a plain launch: it starts once embed has finished, so the
      // positions embed copies are in place for the kernels after it, which read them before
      // their waits (dependent_launch.cuh).
      const cuda::PlainLaunches plain(l == 0);
      CUDA_CK(cuda::gemv3(q_, L.q.w, L.q.out, k_, L.k.w, L.k.out, v_, L.v.w, L.v.out, x_, T, D, stream_, L.attn_norm,
                          eps, route_in_oproj ? route_acc_ : nullptr, route_in_oproj ? T * cfg_.num_experts : 0));
    } else {  // rmsnorm, the first kernel on this path, is a plain launch already
      CUDA_CK(cuda::rmsnorm(h_, x_, L.attn_norm, T, D, eps, stream_));
      linear(q_, h_, L.q, T, false);
      linear(k_, h_, L.k, T, false);
      linear(v_, h_, L.v, T, false);
    }
    if (cfg_.qkv_bias) {
      CUDA_CK(cuda::add_bias(q_, L.q_bias, T, H * Dh, stream_));
      CUDA_CK(cuda::add_bias(k_, L.k_bias, T, Hkv * Dh, stream_));
      CUDA_CK(cuda::add_bias(v_, L.v_bias, T, Hkv * Dh, stream_));
    }
    if (cfg_.clip_qkv) {
      CUDA_CK(cuda::clamp(q_, size_t(T) * H * Dh, *cfg_.clip_qkv, stream_));
      CUDA_CK(cuda::clamp(k_, size_t(T) * Hkv * Dh, *cfg_.clip_qkv, stream_));
      CUDA_CK(cuda::clamp(v_, size_t(T) * Hkv * Dh, *cfg_.clip_qkv, stream_));
    }
    cuda::KvPages batch_kv = pool().layer(l);
    batch_kv.tables = tables_;
    // Who writes the new rows: qk_norm_rope for the tensor-core decode paths; with FP8 pages (which
    // must be in the cache before attention reads them) also for a decode batch and for one piece of
    // at most kGemvMaxT tokens; else each piece's attention_decode (BF16) or kv_append. Not for a
    // prompt chunk: attention_prefill loads a query tile's rows below its first position before its
    // wait, and qk_norm_rope (a programmatic launch) may then still be writing them; kv_append is a
    // plain launch, done before attention starts.
    const bool batch_append = batch_tc_ || (fp8 && batch_splits_ > 0);
    const bool piece_append =
        tc || (fp8 && !batch_append && pieces.size() == 1 && pieces[0].n <= cuda::kGemvMaxT);
    const cuda::KvPages append = piece_append ? pieces[0].cache->kv(l) : (batch_append ? batch_kv : cuda::KvPages{});
    CUDA_CK(cuda::qk_norm_rope(q_, k_, L.q_norm, L.k_norm, cfg_.qk_norm == QkNorm::Full, pos_, T, H, Hkv, Dh, eps,
                               cfg_.rope_theta, stream_, append, v_));
    const size_t B = pieces.size();
    const float *k_new = fp8 ? nullptr : k_, *v_new = fp8 ? nullptr : v_;  // FP8: the rows are in the cache
    if (tc || batch_tc_) {
      CUDA_CK(cuda::attention_prefill(att_, q_, append, pos_, T, H, Hkv, Dh, true, stream_, partial_,
                                      tc ? pieces[0].n_splits : batch_splits_));
    } else if (batch_splits_ > 0) {  // B sequences, one token each: one launch
      CUDA_CK(cuda::attention_decode_batch(att_, q_, batch_kv, k_new, v_new, pos_, int(B), H, Hkv, Dh, batch_splits_,
                                           partial_, split_counters_, stream_));
    } else for (size_t t = 0; const Piece& p : pieces) {
      const bool one_launch = p.n <= cuda::kGemvMaxT && decode_attention_;  // (append +) attention + combine
      if (fp8 && !piece_append)
        CUDA_CK(cuda::kv_append(p.cache->kv(l), k_ + t * Hkv * Dh, v_ + t * Hkv * Dh, pos_ + t, p.n, Hkv, Dh, stream_));
      if (one_launch) {
        CUDA_CK(cuda::attention_decode(att_ + t * H * Dh, q_ + t * H * Dh, p.cache->kv(l),
                                       k_new ? k_new + t * Hkv * Dh : nullptr, v_new ? v_new + t * Hkv * Dh : nullptr,
                                       pos_ + t, p.n, H, Hkv, Dh, p.n_splits, partial_, split_counters_, stream_));
        t += size_t(p.n);
        continue;
      }
      if (!fp8)
        CUDA_CK(cuda::kv_append(p.cache->kv(l), k_ + t * Hkv * Dh, v_ + t * Hkv * Dh, pos_ + t, p.n, Hkv, Dh, stream_));
      prompt_attention_(att_ + t * H * Dh, q_ + t * H * Dh, p.cache->kv(l), pos_ + t, p.n, H, Hkv, Dh,
                        p.n_splits, p.split_len, partial_, stream_);
      t += size_t(p.n);
    }
    if (route_in_oproj)  // x += attn @ Wo^T, and the router's logits of x
      CUDA_CK(cuda::gemv_router_logits(x_, att_, L.o.w, T, L.o.out, L.o.in,
                                       {L.router.w, L.ffn_norm, route_acc_, cfg_.num_experts}, stream_));
    else
      linear(x_, att_, L.o, T, true);  // x += attn @ Wo^T
    if (L.is_moe) {
      moe(L, T, route_in_oproj);  // the FFN norm inside
    } else {
      CUDA_CK(cuda::rmsnorm(h_, x_, L.ffn_norm, T, D, eps, stream_));
      mlp(L.dense_gu, L.dense_down, T, x_, true);
    }
  }
  if (n_logits > 0) {
    for (int t = 0, row = 0; const Piece& p : pieces) {  // the last n_logits rows of each piece
      t += p.n;
      if (p.n_logits > 0)
        CUDA_CK(cudaMemcpyAsync(h_ + size_t(row) * D, x_ + size_t(t - p.n_logits) * D, size_t(p.n_logits) * D * 4,
                                cudaMemcpyDeviceToDevice, stream_));
      row += p.n_logits;
    }
    if (greedy_pass_) {  // the final norm and the argmax folded into the LM head (gemv_for: launch_pass)
      CUDA_CK(cuda::gemv_argmax(logits_, h_, lm_head_.w, n_logits, lm_head_.out, lm_head_.in, final_norm_, eps,
                                argmax_best_, stream_));
      CUDA_CK(cuda::argmax_tokens(mapped_io_ ? d_h_tokens_ + io(io_slot_) : tokens_, argmax_best_, n_logits, stream_));
    } else if (gemv_for(n_logits, D)) {  // the final norm folded into the LM head
      CUDA_CK(cuda::gemv(logits_, h_, lm_head_.w, n_logits, lm_head_.out, lm_head_.in, false, stream_, final_norm_, eps));
    } else {
      CUDA_CK(cuda::rmsnorm(h_, h_, final_norm_, n_logits, D, eps, stream_));
      linear(logits_, h_, lm_head_, n_logits, false);  // [n_logits, V]
    }
  }
}

void CudaBackend::forward_pass(const std::vector<SeqStep>& steps, float* logits) {
  const int n_logits = launch_pass(steps);
  const size_t bytes = size_t(n_logits) * cfg_.vocab_size * 4;
  if (logits && n_logits > 0 && n_logits <= kPinnedLogitRows) {
    CUDA_CK(cudaMemcpyAsync(h_logits_, logits_, bytes, cudaMemcpyDeviceToHost, stream_));
    CUDA_CK(cudaStreamSynchronize(stream_));
    std::memcpy(logits, h_logits_, bytes);
  } else if (logits && n_logits > 0) {
    CUDA_CK(cudaMemcpyAsync(logits, logits_, bytes, cudaMemcpyDeviceToHost, stream_));
    CUDA_CK(cudaStreamSynchronize(stream_));
  } else {
    CUDA_CK(cudaStreamSynchronize(stream_));
  }
}

// After the graph replay, outside it: the rows' params and u change at every step. A greedy pass's
// tokens are already in tokens_ (greedy_pass_). Queued (tokens null): returns once the step's
// tokens are on their way to h_tokens_'s set io_slot_, with slot_done_[io_slot_] after them.
void CudaBackend::sample_pass(int n, int32_t* tokens) {
  const int V = cfg_.vocab_size;
  const cuda::SampleRowDevice* h_rows = h_sample_rows_ + io(io_slot_);
  int32_t* h_tokens = h_tokens_ + io(io_slot_);
  if (n > 0 && !greedy_pass_) {
    CUDA_CK(cudaMemcpyAsync(sample_rows_, h_rows, size_t(n) * sizeof(cuda::SampleRowDevice),
                            cudaMemcpyHostToDevice, stream_));
    for (int r = 0; r < n; r += kSampleRows) {
      const int m = std::min(kSampleRows, n - r);
      const bool sort = sample_single_stage_ || cuda::sample_any_sort_row(h_rows + r, m, V);
      CUDA_CK(cuda::sample_tokens(tokens_ + r, logits_ + size_t(r) * V, sample_rows_ + r, m, V, sample_scratch_,
                                  sample_scratch_bytes_, stream_, sort));
    }
  }
  if (n > 0 && !(greedy_pass_ && mapped_io_))  // else argmax_tokens wrote them to h_tokens_
    CUDA_CK(cudaMemcpyAsync(h_tokens, tokens_, size_t(n) * 4, cudaMemcpyDeviceToHost, stream_));
  if (queued_pass_) {
    CUDA_CK(cudaEventRecord(slot_done_[io_slot_], stream_));
    return;
  }
  timeline_.mark(cuda::StepTimeline::kToken, stream_);
  CUDA_CK(cudaStreamSynchronize(stream_));  // also: the pinned inputs are free for the next pass
  timeline_.close_step();
  if (n > 0) std::memcpy(tokens, h_tokens, size_t(n) * 4);
}

int CudaBackend::launch_pass(const std::vector<SeqStep>& steps, int sample_rows) {
  read_switches();
  int T = 0, n_logits = 0;
  std::vector<Piece> pieces;
  for (const SeqStep& s : steps) {
    auto* cache = dynamic_cast<CudaKvCache*>(s.cache);
    CHECK_MSG(cache != nullptr, "the CUDA backend needs caches from its own new_cache()");
    // A chained step (chain_slot_ >= 0) has one token, read on the device from the last step's.
    const int n = chain_slot_ >= 0 ? 1 : int(s.tokens.size()), len = cache->length();
    cache->reserve(len + n);
    for (int i = 0; i < n; ++i) {
      if (chain_slot_ < 0) {
        CHECK(s.tokens[i] >= 0 && s.tokens[i] < cfg_.vocab_size);
        h_ids_[io(io_slot_) + size_t(T + i)] = s.tokens[i];
      }
      h_pos_[io(io_slot_) + size_t(T + i)] = len + i;
    }
    Piece p{cache, n, s.n_logits, 0, kDecodeSplit};
    const int keys = len + n, max_splits = (max_context() + kDecodeSplit - 1) / kDecodeSplit;
    if (n <= cuda::kGemvMaxT && decode_attention_) {
      // attention_decode() balances the keys over n_splits itself, so a captured step stays valid
      // while n_splits does: a power of two up to 1024 keys (splits of 32-64 keys), then 8 more
      // splits per 1024 keys (64-128 keys each; 4 and 16 were no better at 4096 keys). The
      // tensor-core decode (below) takes 4 per 1024 keys.
      p.n_splits = 1;
      if (keys <= 1024)
        while (p.n_splits * kDecodeSplit < keys) p.n_splits *= 2;
      else
        p.n_splits = (keys + 1023) / 1024 * 8;
      // The per-head kernel: no more splits than one wave holds (a second wave cost what the
      // splits won: OLMoE at 4097+ keys, 40 splits, 640 blocks for 528 places).
      if (decode_split_cap_ > 0) p.n_splits = std::min(p.n_splits, std::max(1, decode_split_cap_ / n));
    } else if (n <= cuda::kGemvMaxT) {
      p.n_splits = 1;  // a power of two, so that a captured decode step stays valid for many steps
      while (p.n_splits * kDecodeSplit < keys) p.n_splits *= 2;
      p.n_splits = std::min(p.n_splits, max_splits);
    } else {
      p.n_splits = std::min(32, (keys + 255) / 256);
      p.split_len = (keys + p.n_splits - 1) / p.n_splits;
    }
    CHECK(size_t(n) * cfg_.num_heads * p.n_splits * (cfg_.head_dim + 2) <= partial_cap_);
    pieces.push_back(p);
    T += n;
    n_logits += s.n_logits;
  }
  if (tc_decode(pieces))
    if (const int splits = tc_decode_splits(pieces[0].cache->length() + pieces[0].n)) pieces[0].n_splits = splits;
  if (!mapped_io_) {
    if (chain_slot_ < 0) CUDA_CK(cudaMemcpyAsync(ids_, h_ids_ + io(io_slot_), size_t(T) * 4, cudaMemcpyHostToDevice, stream_));
    CUDA_CK(cudaMemcpyAsync(pos_, h_pos_ + io(io_slot_), size_t(T) * 4, cudaMemcpyHostToDevice, stream_));
  }
  const cuda::SampleRowDevice* h_rows = h_sample_rows_ + io(io_slot_);
  greedy_pass_ = greedy_fold_ && !sample_single_stage_ && sample_rows == n_logits && n_logits > 0 &&
                 gemv_for(n_logits, cfg_.hidden_size) &&
                 std::all_of(h_rows, h_rows + n_logits, [V = cfg_.vocab_size](const auto& row) {
                   return cuda::sample_argmax_row(row, V);
                 });
  batch_splits_ = 0;
  batch_tc_ = false;
  const int B = int(pieces.size());
  if (B > 1 && T == B && decode_attention_ && batch_attention_) {  // one token per sequence
    int splits = 0, longest = 0;
    for (const Piece& p : pieces) splits = std::max(splits, p.n_splits), longest = std::max(longest, p.cache->length() + 1);
    batch_tc_ = batch_tc_allowed_ && tc_decode_keys(longest, opts_.tc_decode_batch_keys);
    if (batch_tc_)
      splits = batch_splits(std::max(1, tc_decode_splits(longest)), longest, cuda::kPrefillTileKeys, tc_resident_blocks_, B);
    else
      splits = batch_splits(splits, longest, cuda::attention_decode_tile_keys(cfg_.head_dim), decode_resident_blocks_, B);
    if (size_t(B) * cfg_.num_heads * splits * (cfg_.head_dim + 2) > partial_cap_) {
      batch_tc_ = false;
    } else {
      batch_splits_ = splits;
      const int32_t** h_tables = h_tables_ + io(io_slot_);
      for (int b = 0; b < B; ++b) h_tables[b] = pieces[b].cache->table();
      CUDA_CK(cudaMemcpyAsync(tables_, h_tables, size_t(B) * sizeof(const int32_t*),
                              cudaMemcpyHostToDevice, stream_));
    }
  }

  // Batch 1 and decode batches (B sequences, one token and one logits row each, one attention
  // launch) run as captured graphs; a batch key is captured only once it has been seen before,
  // so one-off batch sizes stay eager (and cuBLAS has run eagerly before any capture).
  const bool decode_batch = B > 1 && batch_splits_ > 0 && n_logits == B;
  GraphKey key{nullptr, batch_splits_, n_logits, B, batch_tc_, greedy_pass_, io_slot_, chain_slot_};
  if (B == 1)
    key = {pieces[0].cache->table(), pieces[0].n_splits, n_logits, 1, tc_decode(pieces), greedy_pass_, io_slot_, chain_slot_};
  bool graph = opts_.use_graphs && ((B == 1 && T == 1) || decode_batch);
  if (!queued_pass_) timeline_.mark(cuda::StepTimeline::kInputs, stream_);
  if (graph && decode_batch && !graphs_.contains(key)) graph = !batch_keys_seen_.insert(key).second;
  if (graph) {
    auto it = graphs_.find(key);
    if (it == graphs_.end()) {
      if (graphs_.size() >= 64) {  // bounded: caches come and go
        for (auto& [k, exec] : graphs_) CUDA_CK(cudaGraphExecDestroy(exec));
        graphs_.clear();
        batch_keys_seen_.clear();
      }
      cudaGraph_t g = nullptr;
      cudaGraphExec_t exec = nullptr;
      CUDA_CK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
      run_layers(pieces, T, n_logits);
      CUDA_CK(cudaStreamEndCapture(stream_, &g));
      CUDA_CK(cudaGraphInstantiate(&exec, g, 0));
      CUDA_CK(cudaGraphDestroy(g));
      it = graphs_.emplace(key, exec).first;
    }
    CUDA_CK(cudaGraphLaunch(it->second, stream_));
  } else {
    run_layers(pieces, T, n_logits);
  }
  if (!queued_pass_) timeline_.mark(cuda::StepTimeline::kLayers, stream_);
  for (const Piece& p : pieces) p.cache->advance(p.n);
  return n_logits;
}

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const ModelWeights& weights, const CudaBackendOptions& opts) {
  auto b = std::make_unique<CudaBackend>(weights.cfg, opts);
  b->upload(weights);
  return b;
}

std::unique_ptr<Backend> make_cuda_backend_dummy(const ModelConfig& cfg, const CudaBackendOptions& opts) {
  auto b = std::make_unique<CudaBackend>(cfg, opts);
  b->init_dummy();
  return b;
}

double cuda_copy_bandwidth() {
  const size_t n = size_t(1) << 30;
  void *a = nullptr, *b = nullptr;
  CUDA_CK(cudaMalloc(&a, n));
  CUDA_CK(cudaMalloc(&b, n));
  CUDA_CK(cudaMemset(a, 1, n));
  cudaEvent_t e0, e1;
  CUDA_CK(cudaEventCreate(&e0));
  CUDA_CK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int i = 0; i < 12; ++i) {
    CUDA_CK(cudaEventRecord(e0));
    CUDA_CK(cudaMemcpyAsync(i % 2 ? a : b, i % 2 ? b : a, n, cudaMemcpyDeviceToDevice));
    CUDA_CK(cudaEventRecord(e1));
    CUDA_CK(cudaEventSynchronize(e1));
    float t = 0;
    CUDA_CK(cudaEventElapsedTime(&t, e0, e1));
    if (i >= 2) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(a);
  cudaFree(b);
  return 2.0 * double(n) / (double(ms[ms.size() / 2]) * 1e-3);
}

std::string cuda_device_name() {
  cudaDeviceProp p{};
  CUDA_CK(cudaGetDeviceProperties(&p, 0));
  return p.name;
}

}  // namespace tiermoe
