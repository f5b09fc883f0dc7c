#include "cpu/matmul.h"

#include <algorithm>
#include <vector>

#include "core/check.h"
#include "core/thread_pool.h"
#include "cpu/simd.h"

namespace tiermoe {
namespace {

constexpr int kGemvMaxT = 3;  // up to here each weight row is streamed once for all tokens
constexpr int NR = 16, MR = 6;

// Rows [n0, n1) for T <= kGemvMaxT tokens.
template <DType W, bool Add>
void gemv_rows(float* y, const float* x, const void* w, int T, int N, int K, int n0, int n1) {
  for (int n = n0; n < n1; ++n) {
    const size_t row = size_t(n) * K;
    __m256 acc[kGemvMaxT][2];
    for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16) {
      __m256 w0 = load8_f32<W>(w, row + k), w1 = load8_f32<W>(w, row + k + 8);
      for (int t = 0; t < T; ++t) {
        acc[t][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + size_t(t) * K + k), acc[t][0]);
        acc[t][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + size_t(t) * K + k + 8), acc[t][1]);
      }
    }
    for (int t = 0; t < T; ++t) {
      float s = hsum(_mm256_add_ps(acc[t][0], acc[t][1]));
      for (int kk = k; kk < K; ++kk) s += load1_f32<W>(w, row + kk) * x[size_t(t) * K + kk];
      float& out = y[size_t(t) * N + n];
      out = Add ? out + s : s;
    }
  }
}

// Packs rows [n0, n0+16) of W into panel[K][16] (FP32), zero-padding rows past N.
template <DType W>
void pack_panel(float* panel, const void* w, int N, int K, int n0) {
  for (int j = 0; j < NR; ++j) {
    const int n = n0 + j;
    if (n >= N) {
      for (int k = 0; k < K; ++k) panel[size_t(k) * NR + j] = 0.f;
      continue;
    }
    const size_t row = size_t(n) * K;
    for (int k = 0; k < K; ++k) panel[size_t(k) * NR + j] = load1_f32<W>(w, row + k);
  }
}

// y[m, n0:n0+nc] (+)= x[m, :] @ panel for m rows of x (m <= MR).
template <int M, bool Add>
void kernel_mx16(float* y, const float* x, const float* panel, int N, int K, int n0, int nc) {
  __m256 acc[M][2];
  for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int k = 0; k < K; ++k) {
    __m256 b0 = _mm256_loadu_ps(panel + size_t(k) * NR), b1 = _mm256_loadu_ps(panel + size_t(k) * NR + 8);
    for (int i = 0; i < M; ++i) {
      __m256 a = _mm256_broadcast_ss(x + size_t(i) * K + k);
      acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
    }
  }
  for (int i = 0; i < M; ++i) {
    float* out = y + size_t(i) * N + n0;
    if (nc == NR) {
      if (Add) {
        acc[i][0] = _mm256_add_ps(acc[i][0], _mm256_loadu_ps(out));
        acc[i][1] = _mm256_add_ps(acc[i][1], _mm256_loadu_ps(out + 8));
      }
      _mm256_storeu_ps(out, acc[i][0]);
      _mm256_storeu_ps(out + 8, acc[i][1]);
    } else {
      alignas(32) float tmp[NR];
      _mm256_store_ps(tmp, acc[i][0]);
      _mm256_store_ps(tmp + 8, acc[i][1]);
      for (int j = 0; j < nc; ++j) out[j] = Add ? out[j] + tmp[j] : tmp[j];
    }
  }
}

template <bool Add>
void kernel_any(int m, float* y, const float* x, const float* panel, int N, int K, int n0, int nc) {
  switch (m) {
    case 6: return kernel_mx16<6, Add>(y, x, panel, N, K, n0, nc);
    case 5: return kernel_mx16<5, Add>(y, x, panel, N, K, n0, nc);
    case 4: return kernel_mx16<4, Add>(y, x, panel, N, K, n0, nc);
    case 3: return kernel_mx16<3, Add>(y, x, panel, N, K, n0, nc);
    case 2: return kernel_mx16<2, Add>(y, x, panel, N, K, n0, nc);
    case 1: return kernel_mx16<1, Add>(y, x, panel, N, K, n0, nc);
  }
}

template <DType W, bool Add>
void matmul_typed(float* y, const float* x, const void* w, int T, int N, int K) {
  if (T <= kGemvMaxT) {
    parallel_for(size_t(N), [&](size_t b, size_t e) { gemv_rows<W, Add>(y, x, w, T, N, K, int(b), int(e)); }, 8);
    return;
  }
  const int panels = (N + NR - 1) / NR;
  parallel_for(size_t(panels), [&](size_t pb, size_t pe) {
    thread_local std::vector<float> panel;
    panel.resize(size_t(K) * NR);
    for (size_t p = pb; p < pe; ++p) {
      const int n0 = int(p) * NR, nc = std::min(NR, N - n0);
      pack_panel<W>(panel.data(), w, N, K, n0);
      for (int t = 0; t < T; t += MR)
        kernel_any<Add>(std::min(MR, T - t), y + size_t(t) * N, x + size_t(t) * K, panel.data(), N, K, n0, nc);
    }
  });
}

template <bool Add>
void matmul_dispatch(float* y, const float* x, const void* w, DType wt, int T, int N, int K) {
  switch (wt) {
    case DType::BF16: return matmul_typed<DType::BF16, Add>(y, x, w, T, N, K);
    case DType::F16: return matmul_typed<DType::F16, Add>(y, x, w, T, N, K);
    case DType::F32: return matmul_typed<DType::F32, Add>(y, x, w, T, N, K);
    default: CHECK_MSG(false, "matmul: weights must be BF16, F16 or F32");
  }
}

}  // namespace

void matmul(float* y, const float* x, const void* w, DType wt, int T, int N, int K) {
  matmul_dispatch<false>(y, x, w, wt, T, N, K);
}
void matmul_add(float* y, const float* x, const void* w, DType wt, int T, int N, int K) {
  matmul_dispatch<true>(y, x, w, wt, T, N, K);
}

}  // namespace tiermoe
