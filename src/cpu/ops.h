// Element-wise and per-row CPU kernels of the forward pass. Raw pointers, shapes as ints;
// tensors are row-major with the shape given in the tag.
#pragma once
#include <cstdint>

namespace tiermoe {

// y[T, D] = x[T, D] / sqrt(mean(x^2) + eps) * w[D]   (in place allowed)
void rmsnorm(float* y, const float* x, const float* w, int T, int D, float eps);

// x[T, n_heads, Dh] rotated in place by RoPE (rotate-half layout, as Llama/Mixtral in HF)
// at positions pos[T]. Angles as transformers computes them: fp32 inv_freq * fp32 position.
void rope(float* x, const int32_t* pos, int T, int n_heads, int Dh, float theta);

// The primitive under rope(), also used by the KV cache to undo RoPE on keys:
// inv_freq[Dh/2] = theta^(-2i/Dh); cs/sn[Dh/2] the cos/sin of inv_freq * pos; v[Dh] rotated
// in place by those angles (sign -1: rotated back).
void rope_inv_freq(float* inv_freq, int Dh, float theta);
void rope_angles(const float* inv_freq, int half, int pos, float* cs, float* sn);
void rope_rotate(float* v, const float* cs, const float* sn, int half, float sign = 1.f);

// y[T, F] = silu(gate[T, F]) * up[T, F]
void silu_mul(float* y, const float* gate, const float* up, int T, int F);

// x[T, N] += b[N]
void add_bias(float* x, const float* b, int T, int N);

// x[n] = clamp(x[n], -c, c)
void clamp(float* x, int n, float c);

// Router: softmax over logits[E], then the top-k (ties: lower expert index wins), weights
// renormalized to sum 1 when `renormalize`. Writes ids[K] and weights[K] in descending order.
void route_softmax_topk(const float* logits, int E, int K, bool renormalize, int32_t* ids, float* weights);

}  // namespace tiermoe
