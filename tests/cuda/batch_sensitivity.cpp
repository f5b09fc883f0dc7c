// Diagnostic, CPU only (not built by CMake): how far a BF16-sized perturbation moves the CPU's
// own logits in the scenario of cuda_check's "batch B=N" model check (B prefixes of the fixture's
// prompt prefilled, then 8 steps of forward_batch, tokens chosen by the reference). Reference: the
// CPU with a BF16 KV cache and, with PERTURB_WEIGHTS, weights rounded to BF16 (what the GPU holds
// and what cuda_check compares against). Perturbed: the same with an F32 KV cache, or with
// PERTURB_WEIGHTS the weights as stored (F16/F32 fixtures). When this error is as large as the
// GPU's, the GPU's error says nothing about a GPU bug (a top-k routing choice flips).
//   g++ -std=c++20 -O2 -march=native -DTIERMOE_SOURCE_DIR='"'$PWD'"' -Isrc -Itests \
//       tests/cuda/batch_sensitivity.cpp build/libtiermoe_core.a -lpthread -o /tmp/sens
//   /tmp/sens tests/fixtures/models/NAME B;  PERTURB_WEIGHTS=1 /tmp/sens tests/fixtures/models/NAME B
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "backend/backend.h"
#include "core/dtype.h"
#include "io/safetensors.h"
#include "test_util.h"
using namespace tiermoe;

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s FIXTURE_DIR B\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const int B = std::atoi(argv[2]);
  const bool perturb_weights = std::getenv("PERTURB_WEIGHTS") != nullptr;
  auto w = load_weights(dir), w_stored = load_weights(dir);
  std::vector<std::vector<uint16_t>> keep;
  auto to_bf16 = [&](Linear& l) {
    if (!l.w || l.dtype == DType::BF16) return;
    std::vector<uint16_t> v(size_t(l.out) * l.in);
    for (size_t i = 0; i < v.size(); ++i) v[i] = f32_to_bf16(load_f32(l.w, l.dtype, i));
    keep.push_back(std::move(v));
    l.w = keep.back().data();
    l.dtype = DType::BF16;
  };
  if (perturb_weights) {
    to_bf16(w->embed);
    to_bf16(w->lm_head);
    for (auto& L : w->layers) {
      for (Linear* l : {&L.q, &L.k, &L.v, &L.o, &L.router, &L.dense.gate, &L.dense.up, &L.dense.down, &L.shared.gate,
                        &L.shared.up, &L.shared.down, &L.shared_gate})
        to_bf16(*l);
      for (auto& e : L.experts)
        for (Linear* l : {&e.gate, &e.up, &e.down}) to_bf16(*l);
    }
  }
  CpuBackendOptions ref_opts, pert_opts;
  ref_opts.kv_dtype = KvDType::BF16;
  pert_opts.kv_dtype = perturb_weights ? KvDType::BF16 : KvDType::F32;
  auto ref = make_cpu_backend(*w, ref_opts), pert = make_cpu_backend(perturb_weights ? *w_stored : *w, pert_opts);
  const auto prompt = test::ints(Checkpoint::open_file(dir + "/reference.safetensors").get("ids"));
  const int V = w->cfg.vocab_size, T = int(prompt.size());
  std::vector<std::unique_ptr<KvCache>> cr, cp;
  std::vector<float> lr(size_t(B) * V), lp(size_t(B) * V);
  for (int b = 0; b < B; ++b) {
    const std::vector<int32_t> p(prompt.begin(), prompt.begin() + std::max(1, T - b % T));
    cr.push_back(ref->new_cache()), cp.push_back(pert->new_cache());
    ref->forward(p, *cr.back(), 1, lr.data() + size_t(b) * V);
    pert->forward(p, *cp.back(), 1, lp.data() + size_t(b) * V);
  }
  std::vector<int32_t> next(B);
  std::vector<Backend::SeqStep> sr(B), sp(B);
  double worst = 0;
  int worst_b = -1, worst_step = -1;
  for (int step = 0; step < 8; ++step) {
    for (int b = 0; b < B; ++b) {
      next[b] = int32_t(std::max_element(lr.begin() + size_t(b) * V, lr.begin() + size_t(b + 1) * V) -
                        (lr.begin() + size_t(b) * V));
      sr[b] = {std::span(&next[b], 1), cr[b].get(), 1};
      sp[b] = {std::span(&next[b], 1), cp[b].get(), 1};
    }
    ref->forward_batch(sr, lr.data());
    pert->forward_batch(sp, lp.data());
    for (int b = 0; b < B; ++b) {
      const double e = test::rel_l2(lp.data() + size_t(b) * V, lr.data() + size_t(b) * V, V);
      if (e > worst) worst = e, worst_b = b, worst_step = step;
    }
  }
  std::printf("%s B=%d perturbation %s: worst logits error %.3e (sequence %d, step %d)\n", dir.c_str(), B,
              perturb_weights ? "weights as stored vs BF16" : "KV F32 vs BF16", worst, worst_b, worst_step);
}
