// The CUDA backend: the same Backend interface as the CPU one, weights in BF16 on one GPU.
// Built only when nvcc is found (TIERMOE_HAVE_CUDA); nothing here touches the GPU until one of
// these functions is called, so a CUDA build still runs every CPU command on a machine
// without a GPU.
#pragma once
#include <memory>

#include "backend/backend.h"

namespace tiermoe {

struct CudaBackendOptions {
  // Tokens per pass through the layers (TIERMOE_CUDA_CHUNK=N overrides). A prompt's expert GEMMs
  // read nearly every expert's weights once per pass, so longer passes read them fewer times: on one
  // H200 at 4096 prompt tokens, 2048 against 512 took 13-29% off the time to first token (Mixtral-
  // 8x7B 1006 -> 878 ms, Qwen3-30B-A3B 312 -> 237, OLMoE-1B-7B 107 -> 84; docs/benchmarks.md), decode
  // within 0.8%; 4096 gained 1-5% more and made decode 0.4-1.8% slower. The workspace grows with it
  // (logits and attention partials per token: 2.3 GB at Qwen3-30B-A3B's vocabulary and heads, 0.6 at 512).
  int max_chunk = 2048;
  // The paged KV cache's pool, shared by all sequences, allocated at the first new_cache(): 0 =
  // the GPU memory then free less a reserve of max(4 GiB, 5%), at most 256 full-context sequences.
  size_t kv_cache_bytes = 0;
  // The pages' format: BF16, or FP8 rows (kv/fp8_rows.h: E4M3 and a power-of-two scale per token
  // and KV head, 1 + 1/Dh bytes a value), which the kernels dequantize exactly into BF16 as they read.
  KvDType kv_dtype = KvDType::BF16;
  bool use_graphs = true;    // capture decode steps (batch 1, and batches of one token each) as CUDA graphs
  // Prompt chunks (> 8 tokens) go through BF16 tensor-core GEMMs; with split_activations each
  // activation enters as two BF16 parts (hi + lo), which keeps FP32-level products like the GEMV
  // path, at twice the GEMM work. Off: one BF16 rounding of every GEMM input.
  bool split_activations = true;
  // Prompt attention (chunks of more than 8 tokens) on the tensor cores (cuda::attention_prefill)
  // where the shape allows, else the split CUDA-core kernel; flash_split_p: the softmax weights P
  // enter the MMAs as BF16 hi + lo parts (else rounded to BF16 once).
  bool flash_attention = true;
  bool flash_split_p = true;
  // Prompt-chunk expert GEMMs by the pipelined kernel (cuda::moe_expert_gemm_bf16, input split to
  // BF16 once per GEMM) where D and the expert FFN width are multiples of 8; else the first (wmma)
  // kernel, cuda::moe_expert_gemm. TIERMOE_CUDA_MOE_GEMM=0 turns it off (A/B timing).
  bool pipelined_moe_gemm = true;
  // Batch-1 decode attention on the tensor cores (cuda::attention_prefill with key splits, the new
  // rows appended by qk_norm_rope) for models with at least tc_decode_min_group query heads per KV
  // head, from tc_decode_keys keys on (0: never); else cuda::attention_decode. On one H200 it cut a
  // Qwen3-30B-A3B step (G = 8) at 4096 keys by 18% and made the G = 1 OLMoE shape 8% slower at 4096
  // (a query row fills 1 of an MMA tile's 16 rows). Since the per-head decode kernel (`520fcf4`) it
  // loses below 2048 keys: -5% per token without it at 1024 and 1536 keys on the Qwen3 16-layer
  // shape, -0.7% on Mixtral at 1024; at 2048-4096 it still wins by 3-5% (docs/benchmarks.md).
  // tc_decode_batch_keys: the same for a decode batch's longest sequence (the per-head kernel is
  // for one sequence; 1024 as measured before it). TIERMOE_CUDA_DECODE_TC=N sets tc_decode_keys,
  // TIERMOE_CUDA_DECODE_TC_MIN_G=N tc_decode_min_group (A/B timing).
  int tc_decode_keys = 2048;
  int tc_decode_batch_keys = 1024;
  int tc_decode_min_group = 4;
  uint64_t dummy_seed = 1;   // --load-format dummy
};

// Uploads the checkpoint's weights, converted to BF16 (norms and biases stay FP32).
std::unique_ptr<Backend> make_cuda_backend(const ModelWeights& weights, const CudaBackendOptions& opts = {});

// --load-format dummy: the config's shapes with random BF16 weights generated on the GPU.
std::unique_ptr<Backend> make_cuda_backend_dummy(const ModelConfig& cfg, const CudaBackendOptions& opts = {});

// Measured device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written
// (median of several 1 GiB copies).
double cuda_copy_bandwidth();

// A human-readable name of the GPU, e.g. "NVIDIA H200".
std::string cuda_device_name();

// The KV cache a CUDA backend hands out stores BF16 rows in pages of the backend's pool on the GPU
// (a full pool is an InputError naming it), so it must not outlive the backend. Its
// KvCache::append and KvCache::attend take DEVICE pointers (k, v, q and out all in GPU memory),
// unlike the CPU cache.

}  // namespace tiermoe
