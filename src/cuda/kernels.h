// CUDA kernels of the forward pass. Every function takes raw DEVICE pointers, shapes as ints and
// a stream, launches asynchronously and returns the launch's cudaError_t; none allocates or
// synchronizes, so a decode step made of them can be captured as a graph. Each has a CPU twin
// (src/cpu/*.h) it is checked against in tests/cuda/check_*.cpp.
// Shape legend: T tokens, D hidden, H/Hkv heads, Dh head dim, E experts, K top-k, F FFN width.
// Weights are BF16 (raw bits as uint16_t), activations FP32, accumulation FP32.
#pragma once
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace tiermoe::cuda {

using bf16 = uint16_t;  // BF16 bits in device memory

constexpr int kGemvMaxT = 8;      // gemv() handles T <= this; larger T goes to cuBLAS
// The GEMV-style kernels stage x in shared memory where it fits (gemv_stage_holds): K % 8 == 0 and
// T * K <= kGemvStageFloats (16 KB): T = 1 up to K = 4096, T = 2 up to 2048. Past it every lane
// reads x itself, once per weight row.
constexpr int kGemvStageFloats = 4096;
constexpr bool gemv_stage_holds(int T, int K) { return K % 8 == 0 && T * K <= kGemvStageFloats; }
constexpr int kRouteMaxE = 256;   // route_topk(): experts per token at most
constexpr int kRouteMaxK = 32;    // route_topk(), moe_route(), moe_down(): top-k at most
constexpr int kAttnMaxDh = 256;   // attention(): head_dim at most

// The paged KV cache. Per layer one pool of pages for all sequences, K and V each [pages,
// kKvPageRows, Hkv, Dh] BF16; a sequence's page table maps its row pos to pool row
// table[pos / kKvPageRows] * kKvPageRows + pos % kKvPageRows. One page holds one tile of the
// attention kernels at Dh 128.
// A pool of FP8 rows (kv/fp8_rows.h) instead: K and V codes [pages, kKvPageRows, Hkv, Dh] one byte
// each, and an int8 exponent per (row, KV head), [pages, kKvPageRows, Hkv]: value offset i of the
// codes has its exponent at i / Dh. Every kernel that reads the pages dequantizes them into the
// BF16 values it reads from a BF16 pool (exactly: code * 2^e), and every kernel that writes them
// quantizes a (row, KV head) at a time; kernels that take new rows beside the cache (k_new, v_new)
// need them in the cache first with FP8 pages.
constexpr int kKvPageRows = 64;
struct KvFp8 {
  uint8_t* k = nullptr;       // the layer's K codes
  uint8_t* v = nullptr;       // its V codes
  int8_t* k_exp = nullptr;    // their exponents
  int8_t* v_exp = nullptr;
};
struct KvPages {  // one sequence in one layer's pool, or (tables) one token of each of T sequences
  bf16* k = nullptr;               // the layer's K pool (BF16 pages)
  bf16* v = nullptr;               // its V pool
  const int32_t* table = nullptr;  // the sequence's page table, DEVICE memory
  // A decode batch instead: token t is the one new token of its own sequence, whose page table is
  // tables[t] (T pointers in DEVICE memory, to the tables). Taken by qk_norm_rope, attention_prefill
  // and attention_decode_batch.
  const int32_t* const* tables = nullptr;
  KvFp8 fp8{};  // FP8 pages instead of k and v (null: BF16 pages)
  __host__ __device__ const int32_t* table_of(int t) const { return tables ? tables[t] : table; }
  __host__ __device__ bool is_fp8() const { return fp8.k != nullptr; }
};

// Programmatic dependent launch for the decode kernels (gemv, gemv3, qk_norm_rope,
// attention_decode, moe_route, moe_gate_up[_routed], moe_down): see dependent_launch.cuh. Off here by default;
// the CUDA backend turns it on (TIERMOE_CUDA_PDL=0 keeps it off).
void set_programmatic_launch(bool on);
bool programmatic_launch();
// Launches made while one lives (made with `on`) are plain: each starts once the stream's earlier
// work has finished.
class PlainLaunches {
 public:
  explicit PlainLaunches(bool on) : was_(programmatic_launch()) { set_programmatic_launch(was_ && !on); }
  ~PlainLaunches() { set_programmatic_launch(was_); }
  PlainLaunches(const PlainLaunches&) = delete;
  PlainLaunches& operator=(const PlainLaunches&) = delete;

 private:
  bool was_;
};
// The GEMV-style kernels (gemv, gemv3, moe_route) stage their input x once per block in shared
// memory where T * K <= 4096 (on by default); off: every warp reads x (and the norm weights) itself.
void set_gemv_stage(bool on);

// x[T, D] = table[ids[t], D]                                   twin: the CPU embedding copy
// With pos_out: also pos_out[t] = pos_in[t], a step's positions, so that a decode step can read its
// ids and positions from pinned host memory (mapped) and needs no copy before its first kernel.
cudaError_t embed(float* x, const bf16* table, const int32_t* ids, int T, int D, cudaStream_t s,
                  const int32_t* pos_in = nullptr, int32_t* pos_out = nullptr);

// y[rows, D] = x / sqrt(mean(x^2) + eps) * w[D]  (in place allowed)   twin: rmsnorm
cudaError_t rmsnorm(float* y, const float* x, const float* w, int rows, int D, float eps, cudaStream_t s);

// q[T, H, Dh] and k[T, Hkv, Dh] in place: RMSNorm (when q_norm/k_norm are given: per head, weights
// [Dh], or over the whole projection when `full`, weights [H*Dh] / [Hkv*Dh]), then RoPE at pos[T],
// in one launch. With append.table: also the cache's rows pos[t] <- the rotated k[t] and v[t]
// [T, Hkv, Dh] in BF16 or FP8 rows (what kv_append writes), for attention that reads only the cache.
//                                                                 twin: rmsnorm + rope (+ kv_append)
cudaError_t qk_norm_rope(float* q, float* k, const float* q_norm, const float* k_norm, bool full, const int32_t* pos,
                         int T, int H, int Hkv, int Dh, float eps, float theta, cudaStream_t s, KvPages append = {},
                         const float* v = nullptr);
// On by default: pos, the page table and the norm weights read, and the first pair's angle
// computed, before the wait for the previous kernel (none of the pass writes them). Off: after it,
// for A/B timing. The same bits either way.
void set_rope_early(bool on);

// x[T, N] += b[N]                                               twin: add_bias
cudaError_t add_bias(float* x, const float* b, int T, int N, cudaStream_t s);
// x[n] = clamp(x[n], -c, c)                                     twin: clamp
cudaError_t clamp(float* x, size_t n, float c, cudaStream_t s);

// act[T, F] = silu(gu[T, 0:F]) * gu[T, F:2F]  (gate and up rows stacked in one projection)
cudaError_t silu_mul_gu(float* act, const float* gu, int T, int F, cudaStream_t s);

// x[T, D] += sigmoid(g[T]) * y[T, D]   (Qwen2-MoE shared expert)
cudaError_t add_sigmoid_scaled(float* x, const float* y, const float* g, int T, int D, cudaStream_t s);

// hi[n] = bf16(x[n]); with lo, also lo[n] = bf16(x[n] - hi[n]), so that hi + lo carries x to about
// 2^-16 relative: two BF16 GEMMs then give FP32-level products (the prompt path's activations).
cudaError_t to_bf16(bf16* hi, bf16* lo, const float* x, size_t n, cudaStream_t s);

// y[T, N] (= or +=) x[T, K] @ W[N, K]^T for T <= kGemvMaxT: memory-bound GEMV, one warp per
// output row, 16-byte weight loads when K % 8 == 0, the first of them issued before the kernel
// waits on its predecessor (programmatic launch). With norm_w, x is used as rmsnorm(x, norm_w,
// eps), computed as inv_t * (W (x * norm_w)) with each warp gathering the sum of squares itself.
//                                                                twin: matmul / matmul_add
cudaError_t gemv(float* y, const float* x, const bf16* W, int T, int N, int K, bool accumulate, cudaStream_t s,
                 const float* norm_w = nullptr, float eps = 0.f);

// Three gemv()s sharing x[T, K] in one launch (q, k, v projections): yi[T, Ni] = x Wi^T. With zero,
// its first zero_n slots are set to 0 after the wait (the router's accumulator, RouterLogits below).
cudaError_t gemv3(float* y0, const bf16* W0, int N0, float* y1, const bf16* W1, int N1, float* y2, const bf16* W2,
                  int N2, const float* x, int T, int K, cudaStream_t s, const float* norm_w = nullptr, float eps = 0.f,
                  long long* zero = nullptr, int zero_n = 0);

// The router folded into the o projection, for the small-batch MoE (T <= kGemvMaxT): no router
// launch and no wait for one. The logits are linear in h: Wr (rmsnorm(h) * nw) = inv(h) * Wr (h * nw),
// inv = 1 / rms(h). So each block of the o projection, which writes rows of h, adds those rows'
// share of the unscaled logits Wr (h * nw) into acc[T, E] (gemv_router_logits); moe_gate_up_routed
// takes inv from h, which it stages anyway, and routes every token itself; moe_down (with acc)
// selects the same experts from the same bits before its wait, to start loading their rows.
// acc is fixed point (units of 2^-32, so |logit| < 2^31 before scaling), summed by integer atomics:
// the same bits in any block order. It must be 0 before the o projection (gemv3's zero does it).
// Top-k is ranked on the unscaled logits (inv > 0 keeps the order; the CPU twin ranks the scaled
// ones, so only ties made by rounding could differ).
//   twin: matmul_add + rmsnorm + matmul + route_softmax_topk + the CPU MoE
// acc's slots are kRouterLogitStride values (128 bytes) apart, so that the o projection's blocks'
// atomics spread over L2 slices instead of queueing at a few.
constexpr int kRouterLogitStride = 16;
struct RouterLogits {
  const bf16* Wr = nullptr;       // [E, N] router
  const float* norm_w = nullptr;  // [N] the FFN norm
  long long* acc = nullptr;       // [T, E] slots, kRouterLogitStride apart
  int E = 0;
};
// Greedy decoding inside a captured step: gemv (no accumulate) that also folds each token's argmax
// over the N outputs into best[t * kRouterLogitStride] (the largest logit, ties to the lower index:
// sample_token's greedy rule; best must hold 0 before); argmax_tokens then writes tokens[t] (0 when
// N = 0) and zeroes best for the next step. norm_w is required (the LM head's form). twin: argmax
cudaError_t gemv_argmax(float* y, const float* x, const bf16* W, int T, int N, int K, const float* norm_w, float eps,
                        unsigned long long* best, cudaStream_t s);
cudaError_t argmax_tokens(int32_t* tokens, unsigned long long* best, int T, cudaStream_t s);

bool router_in_oproj_fits(int D, int E, int K);  // D % 8 == 0, D <= 4096, E <= kRouteMaxE, K <= min(E, kRouteMaxK)
// y[T, N] += x[T, K] @ W[N, K]^T (gemv, accumulate) and acc[T, E] += Wr (y * norm_w) by row blocks.
cudaError_t gemv_router_logits(float* y, const float* x, const bf16* W, int T, int N, int K, RouterLogits rl,
                               cudaStream_t s);
// moe_gate_up with the routing done per block from acc: act as moe_gate_up for h_n = rmsnorm(h, norm_w);
// ids[T, K] and weights[T, K] as moe_route writes them.
cudaError_t moe_gate_up_routed(float* act, int32_t* ids, float* weights, const float* h, const float* norm_w, float eps,
                               const long long* acc, const bf16* Wgu, int T, int E, int K, int F, int D,
                               bool renormalize, cudaStream_t s);
// moe_gate_up_routed of one token (D % 2048 == 0) as a stream of one wave, blocks_per_sm 1 or 2 (the
// default), or 0: the kernel of one warp per row for every T. For A/B timing.
void set_moe_gate_up_stream(int blocks_per_sm);
// The decode MoE's top-k (gate/up and down of T <= 8) past 64 experts by one warp (default) or by the whole block. For A/B timing.
void set_moe_warp_topk(bool on);
bool moe_warp_topk();
// gemv() / gemv_argmax() of one token, plain or normed, not accumulating, K % 2048 == 0, more rows
// than 16 per SM (the LM head): as a stream (default) or by rows. For A/B timing.
void set_gemv_stream(bool on);
// gemv() / gemv_router_logits() of one token with rows over 8 * 256 weights (K > 2048): rounds of
// loads pipelined 0 never, 1 where the grid fits 2 blocks per SM (default), 2 always. For A/B timing.
void set_gemv_pipe(int mode);
// gemv3's rows per warp, for A/B timing: 0 (default) chosen per launch (one token: the stream where
// K % 2048 == 0 and x is staged, else 2 rows; else 1), 1 or 2 forced.
void set_gemv3_rows(int rows);

// Router: per token, softmax over logits[T, E] in FP32, top-k (ties: lower index), weights
// renormalized when asked. ids[T, K], weights[T, K], descending.   twin: route_softmax_topk
cudaError_t route_topk(int32_t* ids, float* weights, const float* logits, int T, int E, int K, bool renormalize,
                       cudaStream_t s);

// The router of a small-batch MoE layer in one launch, T <= kGemvMaxT:
// h[T, D] = rmsnorm(x, norm_w), logits = h Wr^T kept on chip (one thread-block cluster, the logits in
// its first block's shared memory), then route_topk()'s selection and weights by that block.
//   twin: rmsnorm + matmul + route_softmax_topk
cudaError_t moe_route(float* h, int32_t* ids, float* weights, const float* x, const float* norm_w, float eps,
                      const bf16* Wr, int T, int E, int K, int D, bool renormalize, cudaStream_t s);

// Small-batch MoE, reading only the selected experts (ids/weights straight from route_topk):
// act[T, K, F] = silu(Wgu[e, 0:F] h_t) * (Wgu[e, F:2F] h_t), e = ids[t, k]; Wgu[E, 2F, D].
cudaError_t moe_gate_up(float* act, const float* h, const bf16* Wgu, const int32_t* ids, int T, int K, int F, int D,
                        cudaStream_t s);
// x[T, D] += sum_k weights[t, k] * Wd[e] act[t, k]; Wd[E, D, F]. Residual add included.
// Under programmatic launch it reads ids (to start loading weights), weights and x before it waits
// for the kernel before it: they must come from an earlier kernel than that one (moe_route after
// the o projection, then moe_gate_up), or a copy. With acc[T, E] (RouterLogits) it selects the
// experts from acc instead of reading ids, and reads weights (moe_gate_up_routed's) after the wait.
cudaError_t moe_down(float* x, const float* act, const bf16* Wd, const int32_t* ids, const float* weights, int T,
                     int K, int D, int F, cudaStream_t s, const long long* acc = nullptr, int E = 0);
// moe_down with acc for 2 .. 8 tokens on the tensor cores (moe_down_tc.cu), each distinct expert's
// rows read once for all the tokens that chose it. moe_down_tc_fits(T, F): it can run (F % 256 == 0);
// moe_down runs it (acc given) where moe_down_tc_chosen: by default where 15% of the T K picks are
// expected to repeat an expert. set_moe_down_tc:
// 0 never, 1 wherever it fits (both for tests and A/B timing), 2 the default rule.
bool moe_down_tc_fits(int T, int F);
bool moe_down_tc_chosen(int T, int E, int K, int F);
void set_moe_down_tc(int mode);
cudaError_t moe_down_tc(float* x, const float* act, const bf16* Wd, const float* weights, const long long* acc, int T,
                        int E, int K, int D, int F, cudaStream_t s);
// moe_down's kernel shape, for A/B timing: 0 (default) chosen per launch, 1 / 2 pinned to 2 / 4 rows per
// warp, 3 to 4 rows with pipelined rounds.
int moe_down_variants();
void set_moe_down_variant(int v);

// Grouped MoE for decode batches (moe_grouped.cu), T * K <= kMoeGroupedMaxTK: each expert's rows
// are read once for all the tokens that picked it (one block per (expert, row tile), which finds
// its tokens in ids[T, K] itself; experts nobody picked cost an empty block). Deterministic.
//   moe_grouped_gate_up: act[T * K, F] = silu(Wgu[e, 0:F] h_t) * (Wgu[e, F:2F] h_t), e = ids[t, k]
//   moe_grouped_down:    y[T * K, D] = Wd[e] act[t * K + k]   (unweighted; Wd[E, D, F])
//   moe_combine:         x[T, D] += sum_k weights[t, k] * y[t * K + k]   (k in order)
// twin: the CPU MoE (per (t, k) expert MLP, weighted sum, residual add). ids outside [0, E) match no expert (their rows
// of act / y are left unwritten).
constexpr int kMoeGroupedMaxTK = 512;
cudaError_t moe_grouped_gate_up(float* act, const float* h, const bf16* Wgu, const int32_t* ids, int T, int K, int E,
                                int F, int D, cudaStream_t s);
cudaError_t moe_grouped_down(float* y, const float* act, const bf16* Wd, const int32_t* ids, int T, int K, int E,
                             int D, int F, cudaStream_t s);
cudaError_t moe_combine(float* x, const float* y, const float* weights, int T, int K, int D, cudaStream_t s);
// The grouped kernels' products, for A/B timing: on the tensor cores where the rows are whole
// 16-byte loads (L % 8 == 0), else the CUDA cores (on, the default); off: the CUDA cores always.
void set_moe_grouped_mma(bool on);
// Token groups of 8 per pass at most on the tensor cores, for A/B timing: 0 (default) 1 when
// T * K <= 4 E, else 2; 1 or 2 pinned.
void set_moe_grouped_groups(int groups);

// Prompt-chunk MoE on the tensor cores (moe_prefill.cu), for any number of (token, k) entries TK:
//   moe_sort:        rows[P] = the entries tk = t * K + k of ids[TK] grouped by expert, each group
//                    padded with -1 to whole tiles of kMoeTileM rows; tile_expert[P / kMoeTileM] =
//                    each tile's expert (-1 past the last). P = moe_sort_rows(TK, E). E <= 1024.
//   moe_expert_gemm: out[tk, 0:N] = in[tk / div, 0:Kd] . W[e, 0:N, 0:Kd]^T for every entry of every
//                    tile, e = its expert; W[E, N, Kd] BF16; in FP32, split into BF16 hi + lo
//                    parts (split) or rounded to BF16 once; FP32 accumulation. div = K: in is the
//                    tokens' hidden states; div = 1: in is per (token, k), like out.
//   moe_expert_gemm_bf16: the same product with the input given in BF16 as in_hi + in_lo [rows, Kd]
//                    (to_bf16 of the FP32 input: split once per GEMM, not per block; in_lo null:
//                    hi alone, one rounding), pipelined (cp.async, ldmatrix, mma.sync); Kd % 8 == 0
//                    only (else cudaErrorInvalidValue: use moe_expert_gemm). Its MMA accumulators
//                    are folded into FP32 sums every 128 of Kd (FP32-level at Kd = 14336). Deterministic.
// twin: the CPU MoE per (t, k) expert matmuls (tests/cuda/check_moe.cpp).
constexpr int kMoeTileM = 64;
int moe_sort_rows(int TK, int E);
cudaError_t moe_sort(int32_t* rows, int32_t* tile_expert, const int32_t* ids, int TK, int E, cudaStream_t s);
cudaError_t moe_expert_gemm(float* out, const float* in, int div, const bf16* W, const int32_t* rows,
                            const int32_t* tile_expert, int TK, int E, int N, int Kd, bool split, cudaStream_t s);
cudaError_t moe_expert_gemm_bf16(float* out, const bf16* in_hi, const bf16* in_lo, int div, const bf16* W,
                                 const int32_t* rows, const int32_t* tile_expert, int TK, int E, int N, int Kd,
                                 cudaStream_t s);

// KV cache row pos[t] <- k[t], v[t] [T, Hkv, Dh] in BF16, or as FP8 rows.
//                                     twin: f32_to_bf16, or fp8_quantize_rows per (token, KV head)
cudaError_t kv_append(KvPages kv, const float* k, const float* v, const int32_t* pos, int T, int Hkv, int Dh,
                      cudaStream_t s);

// A sequence's first `pages` pages copied to another's, in every layer: pool page dst_table[i] <-
// src_table[i] (the tables in DEVICE memory) in both pools k and v, pages of page_bytes bytes (a
// multiple of 16), layer l's pool at k + l * layer_stride bytes (and v). For the prefix cache
// (CudaKvCache::copy_prefix): once for the K/V pages, and for FP8 pages once more for their exponents.
//                                                       twin: the same copies on the host (cuda_check)
cudaError_t kv_copy_pages(void* k, void* v, size_t layer_stride, size_t page_bytes, int layers,
                          const int32_t* dst_table, const int32_t* src_table, int pages, cudaStream_t s);

// Causal GQA attention, split over keys: query t (head h) sees cache rows 0 .. pos[t].
// q[T, H, Dh] -> out[T, H, Dh]. Keys are cut into n_splits chunks of split_len (n_splits *
// split_len must cover max(pos) + 1); partial[T, H, n_splits, Dh + 2] is scratch.
//                                                                twin: attention_causal
cudaError_t attention(float* out, const float* q, KvPages kv, const int32_t* pos, int T, int H, int Hkv, int Dh,
                      int n_splits, int split_len, float* partial, cudaStream_t s);

// Prompt attention on the tensor cores (attention_prefill.cu), flash-style: the function of
// attention() for T queries at non-decreasing positions pos[T], query t over cache rows 0 .. pos[t]
// (written before, by kv_append), q[T, H, Dh] -> out[T, H, Dh]. One block per (tile of query
// tokens, KV head): the G = H / Hkv heads of a KV head share every K/V tile read. Q enters the
// BF16 MMAs as hi + lo parts (FP32-level scores); P (the softmax weights) as hi + lo (split_p) or
// rounded to BF16 once. With n_splits > 1 each query tile's keys are cut into n_splits shares of
// whole 64-key tiles (some maybe empty), a block per (tile, KV head, split), merged by
// attention_merge_splits through partial[T, H, n_splits, Dh + 2]: more blocks where (tile, KV head)
// blocks are few, as in batch-1 decode (one tile per KV head). A dependent launch: it reads pos,
// the page table and rows below pos[0] before waiting for the previous kernel, which may write
// only q and the rows from pos[0] on. Deterministic. Only where attention_prefill_supported(): G
// in 1 .. kPrefillMaxG, Dh in {64, 128}; elsewhere attention() is the fallback. With kv.tables (a
// decode batch: token t the newest of its own sequence, over that sequence's rows 0 .. pos[t]) one
// block per (token, KV head, split), its G query rows alone.
//                                                                 twin: attention_causal
constexpr int kPrefillMaxG = 8;
bool attention_prefill_supported(int H, int Hkv, int Dh);
cudaError_t attention_prefill(float* out, const float* q, KvPages kv, const int32_t* pos, int T, int H, int Hkv, int Dh,
                              bool split_p, cudaStream_t s, float* partial = nullptr, int n_splits = 1);
// How many blocks of a decode batch's form (G <= 16 rows per block) the GPU holds at once (0 if
// unknown), and the keys of its K/V tiles: what a decode batch's key splits are sized by.
constexpr int kPrefillTileKeys = 64;
int attention_prefill_decode_resident_blocks(int Dh, bool split_p);
// The most key splits one sequence's decode on the tensor cores takes: a block per multiprocessor
// on BF16 pages, two on FP8 pages (0 if unknown); why, at tc_decode_splits (decode_splits.h).
int attention_prefill_decode_split_cap(int Hkv, bool fp8);
// attention_prefill's blocks of one sequence's T * G <= 8 query rows in the keys form (keys as the
// MMA's rows; the default) or, off, in the row form of the blocks of up to 16 rows (A/B timing).
void set_attention_decode_keys_form(bool on);
// Whether gemv / gemv3 of T tokens over K inputs run on the tensor cores (2 <= T <= 8, K % 256 == 0;
// T = 2 only where x does not fit the CUDA-core GEMVs' stage): x read once per 16 weight rows
// instead of once per row. set_gemv_tc (TIERMOE_CUDA_GEMV_TC, A/B timing): 0 never, 1 from T = 2
// whatever the stage, 2 the default rule.
bool gemv_tc_fits(int T, int K);
void set_gemv_tc(int mode);
// out[T, H, Dh] from the splits' (max, sum, unnormalized output) in partial[T, H, n_splits, Dh + 2]
// (the max in natural-log units; -inf: a split with no visible key).  twin: the online softmax's merge
cudaError_t attention_merge_splits(float* out, const float* partial, int T, int H, int Dh, int n_splits, cudaStream_t s);

// Decode attention in one launch (attention_decode.cu), for T <= kGemvMaxT new tokens of one
// sequence at contiguous positions pos[0], pos[0]+1, ...: writes their rows k_new/v_new[T, Hkv*Dh]
// into the cache, attends over rows 0 .. pos[t] (the new rows read from k_new/v_new), cutting the
// keys into n_splits equal splits, and merges them. With k_new and v_new null the new rows are in the
// cache already (FP8 pages: qk_norm_rope's or kv_append's rows). partial[T, H, n_splits, Dh + 2] is scratch;
// counters[T * H] must be zero before the first launch and are left zero. Under programmatic
// launch the first tile of cached rows (before pos[0]) is read before the wait for the previous
// kernel: that kernel must not write them (nor pos, nor the page tables).   twin: kv_append + attention_causal
cudaError_t attention_decode(float* out, const float* q, KvPages kv, const float* k_new, const float* v_new,
                             const int32_t* pos, int T, int H, int Hkv, int Dh, int n_splits, float* partial,
                             unsigned* counters, cudaStream_t s);
// The same for B sequences with one new token each, in one launch: all in kv's pool, token b's page
// table kv.tables[b] (a DEVICE array of B device pointers), its position pos[b]; each
// sequence's keys are cut into n_splits splits (n_splits for the longest: shorter ones get shorter
// splits). partial[B, H, n_splits, Dh + 2]; counters[B * H] as above.   twin: per sequence,
// kv_append + attention_causal
cudaError_t attention_decode_batch(float* out, const float* q, KvPages kv, const float* k_new, const float* v_new,
                                   const int32_t* pos, int B, int H, int Hkv, int Dh, int n_splits, float* partial,
                                   unsigned* counters, cudaStream_t s);
// attention_decode() and attention_decode_batch() handle H / Hkv <= 8 and Dh in {16, 32, 64, 128, 256}.
// Which launches of one sequence take the kernel of one query head per block with K/V in registers
// (attention_decode.cu) instead of the tiled one: 0 none; 1 (the default) those at G = 1, and at
// G > 1 those of up to 16 key splits; 2 all.
void set_attention_decode_per_head(int mode);
// At G = 1 where the per-head kernel runs one sequence's launch: the most key splits whose blocks
// (1 token) fit the GPU at once (its FP8 form holds more blocks: fewer registers); else 0.
int attention_decode_split_cap(int H, int Hkv, int Dh, bool fp8 = false);
// How many blocks of attention_decode (all G heads of a KV head per block) the GPU holds at once (0
// if unknown), and the keys of its tiles: what a decode batch's key splits are sized by.
int attention_decode_resident_blocks(int H, int Hkv, int Dh);
int attention_decode_tile_keys(int Dh);
bool attention_decode_supported(int H, int Hkv, int Dh);

// w[n] = uniform(-scale, scale) from a counter hash of (seed, i); for dummy weights.
cudaError_t fill_random_bf16(bf16* w, size_t n, uint64_t seed, float scale, cudaStream_t s);
cudaError_t fill_f32(float* p, size_t n, float value, cudaStream_t s);

}  // namespace tiermoe::cuda
