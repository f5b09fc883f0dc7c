// The GEMV kernels against their CPU twins: one token and 2 .. 8 on the tensor cores, gemv3, the
// LM head with its argmax, the unstaged and row-count variants; and a GEMV bandwidth figure.
#include <algorithm>
#include <vector>

#include "cpu/matmul.h"
#include "cpu/ops.h"

#include "check_harness.h"

namespace tiermoe::cuda_check {

void check_gemv() {
  struct C { int T, N, K; bool acc; };
  for (C c : {C{1, 1, 8, false}, C{1, 37, 64, false}, C{1, 129, 100, false}, C{3, 64, 2048, false}, C{8, 300, 512, true},
              C{5, 17, 33, true}, C{2, 1000, 4096, false}, C{1, 513, 14336, true},
              // one token, rows of 2 rounds and 1 chunk, 3 rounds (pipelined rounds, an odd count)
              C{1, 300, 2056, false}, C{1, 64, 6144, true}}) {
    auto x = randn(size_t(c.T) * c.K), w = randn(size_t(c.N) * c.K, 0.05f), y0 = randn(size_t(c.T) * c.N);
    auto wb = bf16_of(w);
    std::vector<float> ref = y0;
    if (c.acc) matmul_add(ref.data(), x.data(), wb.data(), DType::BF16, c.T, c.N, c.K);
    else matmul(ref.data(), x.data(), wb.data(), DType::BF16, c.T, c.N, c.K);
    Dev<float> dx(x), dy(y0), dy2(y0);
    Dev<uint16_t> dw(wb);
    if (!c.acc) dy.poison(), dy2.poison();
    cu::set_gemv_pipe(2);
    CK(cu::gemv(dy.p, dx.p, dw.p, c.T, c.N, c.K, c.acc, 0));
    cu::set_gemv_pipe(0);  // the same sums without the pipelined rounds: the same bits
    CK(cu::gemv(dy2.p, dx.p, dw.p, c.T, c.N, c.K, c.acc, 0));
    cu::set_gemv_pipe(1);
    const auto got = dy.get();
    const bool same = got == dy2.get();
    report(fmt("gemv T=%d N=%d K=%d%s", c.T, c.N, c.K, c.acc ? " +=" : ""), same ? rel(got, ref) : 1.0, 1e-5,
           same ? "rounds pipelined or not: same bits" : "rounds pipelined or not: bits DIFFER");
  }
  // The input norm folded in, against the CPU's rmsnorm + matmul.
  for (C c : {C{1, 37, 64, false}, C{3, 64, 2048, false}, C{8, 300, 512, true}, C{5, 17, 33, false}, C{1, 513, 4096, true}}) {
    auto x = randn(size_t(c.T) * c.K, 3.f), nw = randn(c.K), w = randn(size_t(c.N) * c.K, 0.05f), y0 = randn(size_t(c.T) * c.N);
    auto wb = bf16_of(w);
    std::vector<float> h(x.size()), ref = y0;
    rmsnorm(h.data(), x.data(), nw.data(), c.T, c.K, 1e-5f);
    if (c.acc) matmul_add(ref.data(), h.data(), wb.data(), DType::BF16, c.T, c.N, c.K);
    else matmul(ref.data(), h.data(), wb.data(), DType::BF16, c.T, c.N, c.K);
    Dev<float> dx(x), dnw(nw), dy(y0), dh(x.size()), dy2(y0);
    Dev<uint16_t> dw(wb);
    if (!c.acc) dy.poison(), dy2.poison();
    CK(cu::gemv(dy.p, dx.p, dw.p, c.T, c.N, c.K, c.acc, 0, dnw.p, 1e-5f));
    CK(cu::rmsnorm(dh.p, dx.p, dnw.p, c.T, c.K, 1e-5f, 0));
    CK(cu::gemv(dy2.p, dh.p, dw.p, c.T, c.N, c.K, c.acc, 0));
    const auto got = dy.get(), two = dy2.get();
    report(fmt("gemv+norm T=%d N=%d K=%d%s", c.T, c.N, c.K, c.acc ? " +=" : ""), rel(got, ref), 1e-5,
           fmt("(vs the GPU's rmsnorm+gemv: %.1e)", rel(got, two)));
  }
}

// The LM head with the greedy argmax folded in: each token's index must be argmax() of the GPU's own
// outputs (exact: largest logit, ties to the lower index), the outputs those of gemv with the norm,
// and argmax_tokens must leave best at 0 (a second launch gives the same). Ties: rows of W repeated
// (the same row's dot products are the same bits), across blocks and within one; a row of -inf-free
// equal logits (W zero).
void check_gemv_argmax() {
  struct C { int T, N, K; const char* kind; };
  for (C c : {C{1, 1, 8, "random"}, C{1, 8192, 2048, "random"}, C{3, 1000, 64, "random"}, C{8, 37, 512, "random"},
              C{1, 151936, 64, "random"}, C{2, 5000, 128, "ties"}, C{8, 300, 64, "ties"}, C{4, 100, 32, "zeros"},
              // one token as a stream: ties within and across warps, rows of two units, zeros
              C{1, 8192, 2048, "ties"}, C{1, 5000, 4096, "ties"}, C{1, 4500, 2048, "zeros"},
              // 2 .. 8 tokens on the tensor cores (16 rows a block): ties within and across blocks, zeros
              C{4, 8192, 2048, "ties"}, C{8, 5001, 256, "random"}, C{2, 1000, 512, "zeros"}, C{7, 333, 768, "ties"}}) {
    auto x = randn(size_t(c.T) * c.K, 3.f), nw = randn(c.K), w = randn(size_t(c.N) * c.K, 0.05f);
    const std::string kind = c.kind;
    if (kind == "ties")  // rows 3, 7, 11, ... repeat row 0 (8 rows per block: within and across blocks)
      for (int n = 3; n < c.N; n += 4) std::copy_n(w.begin(), c.K, w.begin() + size_t(n) * c.K);
    if (kind == "zeros") std::fill(w.begin(), w.end(), 0.f);
    auto wb = bf16_of(w);
    Dev<float> dx(x), dnw(nw), dy(size_t(c.T) * c.N), dy2(size_t(c.T) * c.N);
    Dev<uint16_t> dw(wb);
    Dev<unsigned long long> best(std::vector<unsigned long long>(size_t(cu::kGemvMaxT) * cu::kRouterLogitStride, 0));
    Dev<int32_t> tokens{size_t(c.T)};
    std::vector<int32_t> first;
    int wrong = 0;
    for (int run = 0; run < 2; ++run) {
      dy.poison(), tokens.poison();
      CK(cu::gemv_argmax(dy.p, dx.p, dw.p, c.T, c.N, c.K, dnw.p, 1e-5f, best.p, 0));
      CK(cu::argmax_tokens(tokens.p, best.p, c.T, 0));
      const auto y = dy.get();
      const auto got = tokens.get();
      for (int t = 0; t < c.T; ++t) wrong += got[t] != argmax(std::span(y.data() + size_t(t) * c.N, size_t(c.N)));
      if (run == 0) first = got;
      else wrong += got != first;
    }
    for (unsigned long long v : best.get()) wrong += v != 0;
    cu::set_gemv_stream(false);  // gemv by rows: the same sums, the same bits
    CK(cu::gemv(dy2.p, dx.p, dw.p, c.T, c.N, c.K, false, 0, dnw.p, 1e-5f));
    cu::set_gemv_stream(true);
    const bool same_y = dy.get() == dy2.get();
    report(fmt("gemv_argmax T=%d N=%d K=%d %s: tokens vs argmax of its outputs, best reset", c.T, c.N, c.K, c.kind),
           wrong, 0, same_y ? "outputs = gemv's, bit for bit" : "outputs DIFFER from gemv's");
    if (!same_y) ++g_fail;
  }
  Dev<int32_t> tokens{size_t(1)};
  const bool refused = cu::argmax_tokens(tokens.p, nullptr, 1, 0) == cudaErrorInvalidValue &&
                       cu::argmax_tokens(tokens.p, reinterpret_cast<unsigned long long*>(tokens.p), 9, 0) ==
                           cudaErrorInvalidValue &&
                       cu::gemv_argmax(nullptr, nullptr, nullptr, 1, 1, 8, nullptr, 0.f, nullptr, 0) == cudaErrorInvalidValue;
  report("gemv_argmax / argmax_tokens refuse a null best and T > 8", refused ? 0.0 : 1.0, 0.0);
}

// gemv3 of random q/k/v weights [Nq | Nk | Nk, K] on T tokens against the CPU, the attention norm
// folded in or not: the largest relative error of the three outputs (poisoned before the run).
double gemv3_error(int T, int Nq, int Nk, int K, bool norm) {
  auto x = randn(size_t(T) * K), nw = randn(K);
  std::vector<float> h = x;
  if (norm) rmsnorm(h.data(), x.data(), nw.data(), T, K, 1e-6f);
  const int Ns[3] = {Nq, Nk, Nk};
  std::vector<std::vector<uint16_t>> wb(3);
  std::vector<std::vector<float>> ref(3);
  for (int i = 0; i < 3; ++i) {
    wb[i] = bf16_of(randn(size_t(Ns[i]) * K, 0.05f));
    ref[i].resize(size_t(T) * Ns[i]);
    matmul(ref[i].data(), h.data(), wb[i].data(), DType::BF16, T, Ns[i], K);
  }
  Dev<float> dx(x), dnw(nw), y0(ref[0].size()), y1(ref[1].size()), y2(ref[2].size());
  Dev<uint16_t> w0(wb[0]), w1(wb[1]), w2(wb[2]);
  y0.poison(), y1.poison(), y2.poison();
  CK(cu::gemv3(y0.p, w0.p, Ns[0], y1.p, w1.p, Ns[1], y2.p, w2.p, Ns[2], dx.p, T, K, 0, norm ? dnw.p : nullptr, 1e-6f));
  return std::max({rel(y0.get(), ref[0]), rel(y1.get(), ref[1]), rel(y2.get(), ref[2])});
}

void check_gemv3() {
  struct C { int T, Nq, Nk, K; };
  // one token: the stream (rows of one and of two units, several rows per warp) unless forced by rows
  for (C c : {C{1, 4096, 512, 2048}, C{3, 64, 32, 64}, C{8, 96, 40, 48}, C{2, 24, 8, 20}, C{1, 520, 72, 4096},
              C{1, 2048, 2048, 2048}})
    for (bool norm : {false, true})
      report(fmt("gemv3%s (q,k,v) T=%d N=%d,%d,%d K=%d", norm ? "+norm" : "", c.T, c.Nq, c.Nk, c.Nk, c.K),
             gemv3_error(c.T, c.Nq, c.Nk, c.K, norm), 1e-5);
}

// 2 .. 8 tokens on the tensor cores (gemv_tc: K % 256 == 0), against the CPU: plain, accumulating,
// normed, and gemv3's three segments; N cut inside a 16-row block, one chunk per warp (K = 256)
// up to several rounds (K = 6144); two runs bit-identical. The CUDA-core GEMV of the same case
// (set_gemv_tc(0)) is scored too, for comparison. T = 2 only where x does not fit the stage.
void check_gemv_tc() {
  struct C { int T, N, K; bool acc, norm; };
  for (C c : {C{2, 37, 4096, false, false}, C{3, 64, 2048, true, false}, C{3, 37, 256, false, false},
              C{4, 2048, 2048, false, true},
              C{5, 17, 512, true, true}, C{6, 1000, 4096, false, false}, C{7, 301, 6144, true, false},
              C{8, 2048, 4096, true, false}, C{8, 6144, 2048, false, true}, C{2, 16, 2304, false, true}}) {
    auto x = randn(size_t(c.T) * c.K, 3.f), nw = randn(c.K), w = randn(size_t(c.N) * c.K, 0.05f);
    auto y0 = randn(size_t(c.T) * c.N);
    auto wb = bf16_of(w);
    std::vector<float> h = x, ref = y0;
    if (c.norm) rmsnorm(h.data(), x.data(), nw.data(), c.T, c.K, 1e-5f);
    if (c.acc) matmul_add(ref.data(), h.data(), wb.data(), DType::BF16, c.T, c.N, c.K);
    else matmul(ref.data(), h.data(), wb.data(), DType::BF16, c.T, c.N, c.K);
    Dev<float> dx(x), dnw(nw);
    Dev<uint16_t> dw(wb);
    auto run = [&]() {
      Dev<float> dy(y0);
      if (!c.acc) dy.poison();
      CK(cu::gemv(dy.p, dx.p, dw.p, c.T, c.N, c.K, c.acc, 0, c.norm ? dnw.p : nullptr, 1e-5f));
      return dy.get();
    };
    const bool tc = cu::gemv_tc_fits(c.T, c.K);
    const auto got = run(), again = run();
    cu::set_gemv_tc(0);
    const auto cores = run();
    cu::set_gemv_tc(2);
    report(fmt("gemv on the tensor cores T=%d N=%d K=%d%s%s", c.T, c.N, c.K, c.acc ? " +=" : "", c.norm ? " +norm" : ""),
           tc && got == again ? rel(got, ref) : 1.0, 1e-5,
           fmt("%s; CUDA cores %.1e", !tc ? "NOT on the tensor cores" : got == again ? "rerun bit-identical" : "rerun DIFFERS",
               rel(cores, ref)));
  }
  struct C3 { int T, Nq, Nk, K; };
  for (C3 c : {C3{4, 2048, 512, 2048}, C3{8, 4096, 512, 2048}, C3{3, 40, 24, 256}})
    report(fmt("gemv3+norm on the tensor cores T=%d N=%d,%d,%d K=%d", c.T, c.Nq, c.Nk, c.Nk, c.K),
           cu::gemv_tc_fits(c.T, c.K) ? gemv3_error(c.T, c.Nq, c.Nk, c.K, true) : 1.0, 1e-5);
}

// The GEMV-style kernels again with x read by every warp (set_gemv_stage(false)): the fold that
// the shared-memory stage replaces where T * K fits, and the path of every larger T * K.
void check_gemv_unstaged() {
  std::printf("-- gemv, gemv3, moe_route without the shared-memory stage --\n");
  cu::set_gemv_stage(false);
  check_gemv();
  check_gemv3();
  check_moe_route();
  cu::set_gemv_stage(true);
}

// gemv3 again with 1 and with 2 rows per warp forced (the default takes the stream at T = 1 where
// K % 2048 == 0, else 2 rows at T = 1, else 1).
void check_gemv3_rows() {
  for (int rows : {1, 2}) {
    std::printf("-- gemv3, %d row(s) per warp --\n", rows);
    cu::set_gemv3_rows(rows);
    check_gemv3();
  }
  cu::set_gemv3_rows(0);
}

double gemv_bandwidth(int N, int K) {
  const int sets = 8;  // rotate weight sets (more than the 50 MB L2)
  std::vector<Dev<uint16_t>*> ws;
  for (int i = 0; i < sets; ++i) {
    ws.push_back(new Dev<uint16_t>(size_t(N) * K));
    CK(cu::fill_random_bf16(ws.back()->p, size_t(N) * K, i + 1, 0.05f, 0));
  }
  auto xh = randn(K);
  Dev<float> x(xh), y(N);
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 20; ++i) CK(cu::gemv(y.p, x.p, ws[i % sets]->p, 1, N, K, false, 0));
  const int iters = 200;
  CK(cudaEventRecord(a));
  for (int i = 0; i < iters; ++i) CK(cu::gemv(y.p, x.p, ws[i % sets]->p, 1, N, K, false, 0));
  CK(cudaEventRecord(b));
  CK(cudaEventSynchronize(b));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, a, b));
  for (auto* w : ws) delete w;
  const double us = ms * 1e3 / iters;
  std::printf("gemv N=%d K=%d T=1: %.1f us per call (launches back to back), %.0f GB/s of weights\n", N, K, us,
              double(N) * K * 2 / (us * 1e-6) / 1e9);
  return us;
}

}  // namespace tiermoe::cuda_check
