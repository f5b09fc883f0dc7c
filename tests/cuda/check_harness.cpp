#include "check_harness.h"

namespace tiermoe::cuda_check {

int g_fail = 0, g_cases = 0, g_skipped = 0;
std::mt19937 rng(20261129);

bool skip_case(int& index) {
  static const std::pair<int, int> range = [] {
    const char* e = std::getenv("TIERMOE_CHECK_SKIP");
    if (!e) return std::pair{0, INT_MAX};
    const char* colon = std::strchr(e, ':');
    return std::pair{std::max(0, std::atoi(e)), colon ? std::atoi(colon + 1) : INT_MAX};
  }();
  const int i = index++;
  if (i >= range.first && i < range.second) return false;
  ++g_skipped;
  return true;
}

bool skip_variant(int variant) {
  static const int only = [] {
    const char* e = std::getenv("TIERMOE_CHECK_VARIANT");
    return e ? std::atoi(e) : -1;
  }();
  return only >= 0 && variant != only;
}

void report(const std::string& name, double err, double tol, const std::string& extra) {
  const bool ok = err <= tol && !std::isnan(err);
  ++g_cases;
  if (!ok) ++g_fail;
  std::printf("%-6s %-58s err %.3e (tol %.0e) %s\n", ok ? "ok" : "FAIL", name.c_str(), err, tol, extra.c_str());
  std::fflush(stdout);
}

std::vector<float> randn(size_t n, float scale) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}
std::vector<uint16_t> bf16_of(const std::vector<float>& v) {
  std::vector<uint16_t> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = f32_to_bf16(v[i]);
  return o;
}

size_t kv_page_bytes(const ModelConfig& c, bool fp8) {
  return size_t(2) * c.num_layers * cu::kKvPageRows * c.num_kv_heads * (fp8 ? c.head_dim + 1 : 2 * c.head_dim);
}

double rel(const std::vector<float>& a, const std::vector<float>& b) { return test::rel_l2(a.data(), b.data(), b.size()); }

}  // namespace tiermoe::cuda_check
