// Diagnostic, CPU only (not built by CMake): does the CUDA prompt path's error
// on a fixture come from rounding activations to BF16? Runs a fixture's prompt
// through the CPU ops with BF16 weights and a BF16 KV cache (what the GPU
// holds), once with FP32 matmul inputs and once with every matmul input rounded
// to BF16 (what the GPU's cuBLAS prompt path does), writes the logits of each
// run, and prints the smallest router gap between the K-th and (K+1)-th expert
// per layer. Models without biases, clip_qkv or a shared expert (Mixtral,
// OLMoE, Qwen3-MoE fixtures).
//   g++ -std=c++20 -O2 -march=native -DTIERMOE_SOURCE_DIR='"'$PWD'"' -Isrc
//   -Itests \
//       tests/cuda/prompt_bf16_emulation.cpp build/libtiermoe_core.a -lpthread
//       -o /tmp/emu
//   /tmp/emu tests/fixtures/models/NAME fp32 /tmp/a.bin; /tmp/emu
//   tests/fixtures/models/NAME act /tmp/b.bin
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "core/dtype.h"
#include "cpu/attention.h"
#include "cpu/matmul.h"
#include "cpu/ops.h"
#include "io/safetensors.h"
#include "model/weights.h"
#include "test_util.h"
using namespace tiermoe;
int main(int argc, char **argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s MODEL_DIR fp32|act [LOGITS_OUT]\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const bool act_bf16 = argc > 2 && std::string(argv[2]) == "act";  // GPU prompt path: matmul inputs in BF16
  auto rb = [&](std::vector<float> a) {
    if (act_bf16)
      for (auto &z : a) z = bf16_to_f32(f32_to_bf16(z));
    return a;
  };
  auto w = load_weights(dir);
  const auto &c = w->cfg;
  std::vector<std::vector<uint16_t>> keep;
  auto fix = [&](Linear &l) {
    if (!l.w || l.dtype == DType::BF16)  // weights in BF16, as the GPU holds them
      return;
    std::vector<uint16_t> b(size_t(l.out) * l.in);
    for (size_t i = 0; i < b.size(); ++i) b[i] = f32_to_bf16(load_f32(l.w, l.dtype, i));
    keep.push_back(std::move(b));
    l.w = keep.back().data();
    l.dtype = DType::BF16;
  };
  fix(w->embed);
  fix(w->lm_head);
  for (auto &L : w->layers) {
    for (Linear *l : {&L.q, &L.k, &L.v, &L.o, &L.router, &L.dense.gate, &L.dense.up, &L.dense.down}) fix(*l);
    for (auto &e : L.experts)
      for (Linear *l : {&e.gate, &e.up, &e.down}) fix(*l);
  }
  Checkpoint ref = Checkpoint::open_file(dir + "/reference.safetensors");
  const auto ids = test::ints(ref.get("ids"));
  const int T = int(ids.size()), D = c.hidden_size, H = c.num_heads, Hkv = c.num_kv_heads, Dh = c.head_dim,
            E = c.num_experts, K = c.top_k;
  std::vector<float> x(size_t(T) * D), h(x.size()), q(size_t(T) * H * Dh), k(size_t(T) * Hkv * Dh), v(k.size()),
      att(q.size());
  for (int t = 0; t < T; ++t)
    for (int d = 0; d < D; ++d) x[t * D + d] = load_f32(w->embed.w, w->embed.dtype, size_t(ids[t]) * D + d);
  std::vector<int32_t> pos(T);
  for (int t = 0; t < T; ++t) pos[t] = t;
  for (int l = 0; l < c.num_layers; ++l) {
    auto &L = w->layers[l];
    rmsnorm(h.data(), x.data(), L.attn_norm.data(), T, D, c.rms_norm_eps);
    const auto hq = rb(h);
    matmul(q.data(), hq.data(), L.q.w, L.q.dtype, T, H * Dh, D);
    matmul(k.data(), hq.data(), L.k.w, L.k.dtype, T, Hkv * Dh, D);
    matmul(v.data(), hq.data(), L.v.w, L.v.dtype, T, Hkv * Dh, D);
    if (L.q_norm.size() == size_t(Dh)) {  // per head (Qwen3)
      rmsnorm(q.data(), q.data(), L.q_norm.data(), T * H, Dh, c.rms_norm_eps);
      rmsnorm(k.data(), k.data(), L.k_norm.data(), T * Hkv, Dh, c.rms_norm_eps);
    } else if (!L.q_norm.empty()) {  // whole projection (OLMoE)
      rmsnorm(q.data(), q.data(), L.q_norm.data(), T, H * Dh, c.rms_norm_eps);
      rmsnorm(k.data(), k.data(), L.k_norm.data(), T, Hkv * Dh, c.rms_norm_eps);
    }
    rope(q.data(), pos.data(), T, H, Dh, c.rope_theta);
    rope(k.data(), pos.data(), T, Hkv, Dh, c.rope_theta);
    std::vector<uint16_t> kb(k.size()), vb(v.size());
    for (size_t i = 0; i < k.size(); ++i) kb[i] = f32_to_bf16(k[i]), vb[i] = f32_to_bf16(v[i]);
    attention_causal(att.data(), q.data(), kb.data(), vb.data(), DType::BF16, T, 0, H, Hkv, Dh);
    const auto ab = rb(att);
    matmul_add(x.data(), ab.data(), L.o.w, L.o.dtype, T, D, H * Dh);
    rmsnorm(h.data(), x.data(), L.ffn_norm.data(), T, D, c.rms_norm_eps);
    h = rb(h);
    if (!L.is_moe) {
      const int F = c.intermediate_size;
      std::vector<float> g(size_t(T) * F), u(g.size());
      matmul(g.data(), h.data(), L.dense.gate.w, L.dense.gate.dtype, T, F, D);
      matmul(u.data(), h.data(), L.dense.up.w, L.dense.up.dtype, T, F, D);
      silu_mul(g.data(), g.data(), u.data(), T, F);
      g = rb(g);
      matmul_add(x.data(), g.data(), L.dense.down.w, L.dense.down.dtype, T, D, F);
      continue;
    }
    std::vector<float> lg(size_t(T) * E);
    matmul(lg.data(), h.data(), L.router.w, L.router.dtype, T, E, D);
    double worst = 1e9;
    int wt = -1;
    for (int t = 0; t < T; ++t) {
      std::vector<float> s(lg.begin() + t * E, lg.begin() + (t + 1) * E);
      std::sort(s.begin(), s.end(), std::greater<float>());
      const double gap = s[K - 1] - s[K];  // logit gap between the K-th and (K+1)-th expert
      if (gap < worst) worst = gap, wt = t;
      std::vector<int32_t> id(K);
      std::vector<float> wt_(K);
      route_softmax_topk(lg.data() + t * E, E, K, c.norm_topk_prob, id.data(), wt_.data());
      const int F = c.expert_ffn;
      std::vector<float> g(F), u(F), y(D);
      for (int kk = 0; kk < K; ++kk) {
        auto &e = L.experts[id[kk]];
        matmul(g.data(), h.data() + t * D, e.gate.w, e.gate.dtype, 1, F, D);
        matmul(u.data(), h.data() + t * D, e.up.w, e.up.dtype, 1, F, D);
        silu_mul(g.data(), g.data(), u.data(), 1, F);
        for (auto &z : g) z *= wt_[kk];
        g = rb(g);
        matmul(y.data(), g.data(), e.down.w, e.down.dtype, 1, D, F);
        for (int d = 0; d < D; ++d) x[t * D + d] += y[d];
      }
    }
    std::printf("layer %d: smallest gap %.3e at t=%d\n", l, worst, wt);
  }
  std::vector<float> hn(x.size()), logits(size_t(T) * c.vocab_size);
  rmsnorm(hn.data(), x.data(), w->final_norm.data(), T, D, c.rms_norm_eps);
  hn = rb(hn);
  matmul(logits.data(), hn.data(), w->lm_head.w, w->lm_head.dtype, T, c.vocab_size, D);
  FILE *f = std::fopen(argc > 3 ? argv[3] : "logits.bin", "wb");  // [T, V] float32
  std::fwrite(logits.data(), 4, logits.size(), f);
  std::fclose(f);
}
