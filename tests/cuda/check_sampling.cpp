// Sampling on the device: sample_tokens() against sample_token().
#include <algorithm>
#include <vector>

#include "cuda/sampling.h"
#include "engine/sampler.h"

#include "check_harness.h"

namespace tiermoe::cuda_check {

Match classify(std::span<const float> l, const SamplingParams& p, double u, int32_t got) {
  if (got == sample_token(l, p, u)) return Match::Exact;
  // u moved by 1e-9: any candidate from the one sample_token picks at u - 1e-9 to the one at
  // u + 1e-9, in candidate order (logit desc, lower id first). Next to u = 1 the remaining weight
  // is below the sums' rounding, so which tail candidate the walk reaches is rounding alone.
  const int32_t lo = sample_token(l, p, std::max(0.0, u - 1e-9));
  const int32_t hi = sample_token(l, p, std::min(u + 1e-9, std::nextafter(1.0, 0.0)));
  auto before = [&](int32_t a, int32_t b) { return l[size_t(a)] > l[size_t(b)] || (l[size_t(a)] == l[size_t(b)] && a < b); };
  if (got < 0 || size_t(got) >= l.size()) return Match::Wrong;
  if (!before(got, lo) && !before(hi, got)) return Match::Boundary;
  if (u + 1e-9 >= 1.0 && std::isfinite(l[size_t(got)]) && !before(got, lo)) {  // any later candidate with weight
    const int k = p.top_k > 0 ? std::min<int>(p.top_k, int(l.size())) : int(l.size());
    int rank = 0;
    for (size_t j = 0; j < l.size(); ++j) rank += before(int32_t(j), got);
    if (rank < k) return Match::Boundary;
  }
  for (float tp : {std::nextafter(p.top_p, 0.f), std::min(1.f, std::nextafter(p.top_p, 2.f))}) {
    SamplingParams q = p;
    q.top_p = tp;
    if (got == sample_token(l, q, u)) return Match::Boundary;
  }
  return Match::Wrong;
}

cu::SampleRowDevice device_row(const SamplingParams& p, double u) { return {p.temperature, p.top_k, p.top_p, u}; }

namespace {

// Launches sample_tokens twice (scratch and output poisoned in between), the sort skipped when no
// row needs it, as the backend does; false when the two runs differ. tokens: the first run's.
bool run_sampling(const Dev<float>& logits, const std::vector<cu::SampleRowDevice>& rows, int B, int V,
                  std::vector<int32_t>& tokens) {
  Dev<cu::SampleRowDevice> dr(rows);
  Dev<int32_t> dt{size_t(B)};
  const size_t bytes = cu::sample_tokens_scratch_bytes(B, V);
  Dev<char> scratch(bytes);
  const bool sort = cu::sample_any_sort_row(rows.data(), B, V);
  CK(cu::sample_tokens(dt.p, logits.p, dr.p, B, V, scratch.p, bytes, 0, sort));
  tokens = dt.get();
  dt.poison();
  scratch.poison();
  CK(cu::sample_tokens(dt.p, logits.p, dr.p, B, V, scratch.p, bytes, 0, sort));
  return dt.get() == tokens;
}

}  // namespace

void check_sampling() {
  // Rows cycle through these params and uniforms; greedy rows, select rows (0 < top_k <= 1024,
  // top_k > V included when V is small) and sort rows (top_k 0 or 1025) mix in one launch.
  auto params_for = [](int V) {
    return std::vector<SamplingParams>{{0.f, 0, 1.f, 0},       {1.f, 1, 1.f, 0},     {1.f, 50, 1.f, 0},
                                       {1.f, V, 1.f, 0},       {1.f, 0, 0.9f, 0},    {1.f, 0, 0.5f, 0},
                                       {0.7f, 0, 1.f, 0},      {1.5f, 40, 0.95f, 0}, {0.7f, 0, 0.9f, 0},
                                       {1.f, 2, 1.f, 0},       {0.8f, 40, 0.95f, 0}, {1.f, 1000, 1.f, 0},
                                       {1.f, 1024, 0.9f, 0},   {1.f, 1025, 1.f, 0},  {2.f, 40, 1.f, 0}};
  };
  std::uniform_real_distribution<double> unif(0.0, 1.0);
  // 1 - 2^-53: the walk can end with a remainder >= 0 by rounding (the last candidate with weight).
  const std::vector<double> fixed_u = {0.0, 1e-12, 0.5, 0.999999, std::nextafter(1.0, 0.0)};
  // Logits: "randn" (N(0, 3)), "ties" (N(0, 3) rounded to quarters: many equal logits, -0 and +0
  // among them), "few" (N(0, 1) rounded to integers: the k-th logit is tied across many ids),
  // "zeros" (1 at 1%, +0 or -0 at 60%, -1 otherwise: the k-th logit is 0 of either sign),
  // "inf" (-inf at 50%, else N(0, 3)), "sparse" (-inf at 99%: the k-th logit is -inf), "equal" (all 0),
  // "masked" (N(0, 3) with every other logit -inf: zero-probability candidates end the sorted list).
  // TIERMOE_CHECK_SAMPLE_BATCHED=1, for racecheck, under which every launch costs seconds: a B = 1
  // case's 90 (params, u) rows go into one launch of 90 rows instead of 90 launches of one (each row
  // has a block of its own either way, so the same code runs on the same rows).
  const bool batched = std::getenv("TIERMOE_CHECK_SAMPLE_BATCHED") != nullptr;
  int index = 0;
  for (const char* kind : {"randn", "ties", "few", "zeros", "inf", "sparse", "equal", "masked"})
    for (int V : {7, 1000, 8192, 151936})
      for (int B : {1, 8, 64}) {
        const bool masked = std::strcmp(kind, "masked") == 0;
        if (std::strcmp(kind, "randn") != 0 && V == 151936 && (B == 64 || (masked && B > 1))) continue;  // CPU time
        if (skip_case(index)) continue;
        const auto params = params_for(V);
        // B = 1: every (params, u) in its own launch (or, batched, as the rows of one); B > 1: row b
        // takes params b % params.size().
        const int combos = int(params.size() * (fixed_u.size() + 1));
        const bool one_per_launch = B == 1 && !batched;
        const int launches = one_per_launch ? combos : 1, rows_per_launch = B == 1 && batched ? combos : B;
        int wrong = 0, boundary = 0, rows_checked = 0;
        bool same = true;
        std::string first_wrong;
        for (int launch = 0; launch < launches; ++launch) {
          std::vector<float> l = randn(size_t(rows_per_launch) * V, 3.f);
          const std::string k = kind;
          for (float& x : l) {
            const double q = unif(rng);
            if (k == "ties") x = std::round(x * 4.f) / 4.f;
            if (k == "few") x = std::round(x / 3.f);
            if (k == "zeros") x = q < 0.01 ? 1.f : q < 0.31 ? 0.f : q < 0.61 ? -0.f : -1.f;
            if ((k == "inf" && q < 0.5) || (k == "sparse" && q < 0.99)) x = -INFINITY;
            if (k == "equal") x = 0.f;
          }
          if (masked)
            for (size_t i = 1; i < l.size(); i += 2) l[i] = -INFINITY;
          std::vector<cu::SampleRowDevice> rows(rows_per_launch);
          std::vector<SamplingParams> ps(rows_per_launch);
          std::vector<double> us(rows_per_launch);
          for (int b = 0; b < rows_per_launch; ++b) {
            const int i = one_per_launch ? launch : b;
            ps[b] = params[size_t(i) % params.size()];
            const size_t ui = size_t(i) / params.size() % (fixed_u.size() + 1);
            us[b] = ui < fixed_u.size() ? fixed_u[ui] : unif(rng);
            rows[b] = device_row(ps[b], us[b]);
          }
          Dev<float> dl(l);
          std::vector<int32_t> got;
          same = run_sampling(dl, rows, rows_per_launch, V, got) && same;
          for (int b = 0; b < rows_per_launch; ++b) {
            const std::span<const float> row(l.data() + size_t(b) * V, size_t(V));
            const Match m = classify(row, ps[b], us[b], got[b]);
            ++rows_checked;
            if (m == Match::Boundary) ++boundary;
            if (m == Match::Wrong && wrong++ == 0)
              first_wrong = fmt(" first wrong: T=%.2f top_k=%d top_p=%.2f u=%.3g got %d, CPU %d", ps[b].temperature,
                                ps[b].top_k, ps[b].top_p, us[b], got[b], sample_token(row, ps[b], us[b]));
          }
        }
        report(fmt("sample_tokens %-6s V=%d B=%d (%d rows%s), wrong tokens", kind, V, B, rows_checked,
                   B == 1 && batched ? " in one launch" : ""),
               wrong, 0,
               fmt("boundary rows %d, two runs %s%s", boundary, same ? "identical" : "DIFFER", first_wrong.c_str()));
        if (!same) ++g_fail;
      }
  {  // greedy ties: equal maxima go to the lower index; an all -inf row to index 0
    const int V = 7;
    const float inf = INFINITY;
    std::vector<float> l = {1, 3, 3, 0, 3, -1, 2, /**/ 5, 5, 5, 5, 5, 5, 5, /**/ -inf, -inf, -inf, -inf, -inf, -inf, -inf,
                            /**/ -2, -1, -0.f, 0.f, -3, 0.f, -1};
    const std::vector<int32_t> expect = {1, 0, 0, 2};
    std::vector<cu::SampleRowDevice> rows = {device_row({0.f, 0, 1.f, 0}, 0.5), device_row({1.f, 1, 1.f, 0}, 0.9),
                                             device_row({0.f, 5, 0.5f, 0}, 0.0), device_row({0.f, 0, 1.f, 0}, 0.1)};
    Dev<float> dl(l);
    std::vector<int32_t> got;
    const bool same = run_sampling(dl, rows, 4, V, got);
    int wrong = 0;
    for (int b = 0; b < 4; ++b) wrong += got[b] != expect[b] || got[b] != argmax(std::span(l.data() + b * V, V));
    report("sample_tokens greedy ties V=7 B=4 (argmax, ties to the lower index)", wrong, 0,
           same ? "two runs identical" : "two runs DIFFER");
    if (!same) ++g_fail;
  }
  {  // V = 1: every row picks token 0 (sampled rows too)
    Dev<float> dl(std::vector<float>{0.3f, -2.f});
    std::vector<int32_t> got;
    const bool same = run_sampling(dl, {device_row({1.f, 0, 0.5f, 0}, 0.7), device_row({0.f, 0, 1.f, 0}, 0.0)}, 2, 1, got);
    report("sample_tokens V=1 B=2 (one sampled row, one greedy)", (got[0] != 0) + (got[1] != 0), 0,
           same ? "two runs identical" : "two runs DIFFER");
    if (!same) ++g_fail;
  }
  {  // sort = false with a sort row among them: that row gets -1, the others their tokens
    const int V = 9000;  // 2 slices
    std::vector<float> l = randn(size_t(3) * V, 3.f);
    const std::vector<cu::SampleRowDevice> rows = {device_row({0.f, 0, 1.f, 0}, 0.5), device_row({1.f, 0, 0.9f, 0}, 0.5),
                                                   device_row({1.f, 40, 1.f, 0}, 0.5)};
    Dev<float> dl(l);
    Dev<cu::SampleRowDevice> dr(rows);
    Dev<int32_t> dt{size_t(3)};
    const size_t bytes = cu::sample_tokens_scratch_bytes(3, V);
    Dev<char> scratch(bytes);
    CK(cu::sample_tokens(dt.p, dl.p, dr.p, 3, V, scratch.p, bytes, 0, false));
    const auto got = dt.get();
    int wrong = got[1] != -1;
    for (int b : {0, 2})
      wrong += classify(std::span<const float>(l.data() + size_t(b) * V, size_t(V)),
                        b == 0 ? SamplingParams{0.f, 0, 1.f, 0} : SamplingParams{1.f, 40, 1.f, 0}, 0.5,
                        got[size_t(b)]) == Match::Wrong;
    report("sample_tokens without the sort: a sort row gets -1, greedy and select rows their tokens", wrong, 0);
  }
  // Timing, not a case: one launch, microseconds, V = 151936 (Qwen3's vocabulary) and 8192 (the bench
  // shapes'); greedy and select rows also with one block per row and the sort's launches
  // (set_sample_max_slices(1), sort = true: the form before). Left out when a case range or the
  // batched cases alone are asked for: under racecheck its launches outlast a device call.
  const bool timing = !batched && !std::getenv("TIERMOE_CHECK_SKIP");
  for (auto [V, B] : {std::pair{151936, 1}, std::pair{151936, 8}, std::pair{8192, 1}}) {
    if (!timing) break;
    Dev<float> dl(randn(size_t(B) * V, 3.f));
    Dev<int32_t> dt{size_t(B)};
    const size_t bytes = cu::sample_tokens_scratch_bytes(B, V);
    Dev<char> scratch(bytes);
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    std::string line;
    for (const SamplingParams& p : {SamplingParams{0.f, 0, 1.f, 0}, SamplingParams{0.8f, 40, 0.95f, 0},
                                    SamplingParams{0.8f, 1024, 0.95f, 0}, SamplingParams{0.8f, 0, 0.95f, 0}})
      for (int slices : {1, 0}) {
        if (slices == 1 && p.temperature != 0.f && p.top_k == 0) continue;  // the sort has no slices
        cu::set_sample_max_slices(slices);
        // slices = 1: the sort's launches too, as before the slices; else only where a row needs them
        const cu::SampleRowDevice row = device_row(p, 0.5);
        const bool sort = slices == 1 || cu::sample_sort_row(row, V);
        Dev<cu::SampleRowDevice> dr(std::vector<cu::SampleRowDevice>(size_t(B), row));
        const int iters = 20;
        CK(cu::sample_tokens(dt.p, dl.p, dr.p, B, V, scratch.p, bytes, 0, sort));
        CK(cudaEventRecord(e0));
        for (int i = 0; i < iters; ++i) CK(cu::sample_tokens(dt.p, dl.p, dr.p, B, V, scratch.p, bytes, 0, sort));
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        const std::string what =
            p.temperature == 0.f ? "greedy" : p.top_k ? fmt("top_k %d", p.top_k) : std::string("top_k 0 (sort)");
        line += fmt("  %s%s %.1f us", what.c_str(), slices == 1 ? " (1 block/row)" : "", ms * 1e3 / iters);
      }
    cu::set_sample_max_slices(0);
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    std::printf("timing sample_tokens V=%d B=%d per launch:%s\n", V, B, line.c_str());
  }
  {  // bad arguments: an error code, no launch
    Dev<float> dl(size_t(8) * 100);
    Dev<cu::SampleRowDevice> dr{size_t(8)};
    Dev<int32_t> dt{size_t(8)};
    const size_t bytes = cu::sample_tokens_scratch_bytes(8, 100);
    Dev<char> scratch(bytes);
    int bad = 0;
    bad += cu::sample_tokens(dt.p, dl.p, dr.p, 8, 100, scratch.p, bytes - 1, 0) != cudaErrorInvalidValue;
    bad += cu::sample_tokens(dt.p, dl.p, dr.p, 0, 100, scratch.p, bytes, 0) != cudaErrorInvalidValue;
    bad += cu::sample_tokens(dt.p, dl.p, dr.p, 8, 0, scratch.p, bytes, 0) != cudaErrorInvalidValue;
    bad += cu::sample_tokens(dt.p, dl.p, dr.p, 8, 100, nullptr, bytes, 0) != cudaErrorInvalidValue;
    bad += cu::sample_tokens_scratch_bytes(1 << 16, 1 << 16) != 0;
    report("sample_tokens bad arguments (small scratch, B=0, V=0, null, B*V too large) refused", bad, 0);
  }
}

}  // namespace tiermoe::cuda_check
