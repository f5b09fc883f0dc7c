// The codecs of the tiered KV cache, for one (layer, KV head, K or V) stream of Dh-vectors.
//   vq:   y = U (x - mu); anchors y[a] in FP8 with a per-channel scale; the other channels
//         (in variance order) are cut into sub-vectors ("slots") and coded by residual stages:
//         each stage picks one codeword per slot, the next codes what is left. Dropping the
//         last stages of a code is the same as having encoded with fewer (progressive codes).
//   fp8:  E4M3 with one scale.   kivi: asymmetric uniform per group (see kv_spec.h).
// Legend: Dh head dim, N calibration vectors, P page tokens.
#pragma once
#include <algorithm>
#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "kv/kv_spec.h"

namespace tiermoe {

float fp8_e4m3_to_f32(uint8_t b);
uint8_t f32_to_fp8_e4m3(float f);  // round to nearest even, saturating at +-448

// Gaussian Lloyd-Max levels for N(0, 1) with 2^bits levels, ascending.
std::vector<float> gaussian_lloyd_max(int bits);

// k-means of rows x[N, len] into K centroids (distance weighted by w[len] per dimension), `iters`
// Lloyd iterations, deterministic for a seed (scalar rows start from quantiles). Each point goes
// to the first centroid at the least distance; scalar rows find it by a walk over ascending
// centroids with the same answer as the scan of all K (full_scan: always the scan, for tests).
std::vector<float> kmeans(const std::vector<float>& x, int N, int len, int K, const float* w, uint64_t seed, int iters,
                          bool full_scan = false);

struct VqSlot {
  int c0 = 0, len = 1, bits = 0;  // channels rest[c0 .. c0+len) of the rotated vector
  std::vector<float> book;         // [2^bits, len]
};

struct VqCodec {
  std::string kind = "vq";  // vq | fp8 | kivi | bf16
  int d = 0;                // Dh
  std::vector<float> rot;   // [Dh, Dh], rows are the basis (empty: identity)
  std::vector<float> mean;  // [Dh] (empty: zero)
  std::vector<int> anchors; // rotated channels kept in FP8
  std::vector<float> anchor_scale;
  std::vector<int> rest;    // the other rotated channels, in slot order
  std::vector<std::vector<VqSlot>> stages;
  bool token_norm = false;
  bool oblivious = false;
  std::string rotation = "none";
  bool shared_basis = false;  // rot and mean are another codec's (fit with a basis)
  float fp8_scale = 1.f;
  int kivi_bits = 2, kivi_group = 32;

  // Fits the codec to calibration rows x[N, Dh]. qcov[Dh, Dh] (may be empty): second moment
  // of the queries that will meet these keys, for query-aware weighting.
  // With `basis` (fitted to the same spec), its rotation and mean are kept (shared, not counted
  // again in meta_bits) and only channel order, anchors, allocation and codebooks are fitted.
  void fit(const CodecSpec& spec, const float* x, int N, int Dh, const std::vector<double>& qcov, uint64_t seed,
           int kmeans_iters, const VqCodec* basis = nullptr);

  int n_codes() const;                   // slots over all stages
  int n_codes(int n_stages) const;       // slots of the first n stages
  int n_stages() const { return int(stages.size()); }
  // Bits stored per token with the first n stages (codes, anchors, norm, kivi scales).
  double token_bits(int n_stages) const;
  // Bits of per-sequence metadata (rotation, mean, scales, codebooks) at 16 bits per number.
  double meta_bits() const;

  // vq: x[Dh] -> codes[n_codes()], anchors[anchors.size()], norm (BF16-rounded).
  void encode(const float* x, uint16_t* codes, uint8_t* anc, float* norm) const;
  // vq: the vector the first n stages of a code stand for; with in_basis, its coordinates y in
  // the rotated basis, before unrotation and the mean (x = from_basis(y)).
  void decode(const uint16_t* codes, const uint8_t* anc, float norm, int n_stages, float* x, bool in_basis = false) const;
  // x = U^T y + weight * mean: a weighted sum of vectors kept in the basis (weights summing to
  // `weight`) brought back with one unrotation instead of one per vector.
  void from_basis(const float* y, float weight, float* x) const;
  // The same for n rows y[n, d] -> x[n, d] (weight 1 each; x must not alias y): a page's keys
  // brought back together, each row of U read once per 4 rows; bit-identical to n calls.
  // constant[d] (optional) marks channels whose value is the same in every row (no bits, see
  // constant_channels): summed once, not once per row (then equal to n calls up to rounding).
  // channel_major: y is [d, n] (a page decoded slot by slot) instead of [n, d].
  void from_basis_rows(const float* y, int n, float* x, const uint8_t* constant = nullptr,
                       bool channel_major = false) const;
  // Marks in constant[d] the channels that decode to the same value in every token coded with
  // the first n stages: no bits in any of them, not an anchor, no per-token norm.
  void constant_channels(int n, uint8_t* constant) const;
  // fp8 / bf16: one token. kivi: a page of P tokens x[P, stride] (keys per channel over the
  // page's groups of tokens, values per token over groups of channels), decoded in place.
  void roundtrip_elementwise(float* x) const;
  void kivi_roundtrip(float* x, int P, size_t stride, bool is_key) const;
  // kivi, stored form: levels[P, Dh] (kivi_bits each) and kivi_groups() BF16 (zero, scale) pairs.
  int kivi_groups(int P, bool is_key) const;
  void kivi_encode(const float* x, int P, size_t stride, bool is_key, uint8_t* levels, uint16_t* zs) const;
  void kivi_decode(const uint8_t* levels, const uint16_t* zs, int P, bool is_key, float* x, size_t stride) const;

  // y = U (x - mu), and x = U^T y (without mu).
  void rotate(const float* x, float* y) const;
  void unrotate(const float* y, float* x) const;

  void save(std::ostream& out) const;
  void load(std::istream& in);  // throws InputError on a corrupt codec (check_layout)
  // Throws InputError unless the fields describe a codec decode can run on: known kind, head dim
  // <= 256, sizes that match it, every channel an anchor or a residual channel exactly once, and
  // each stage's slots cutting the residual channels in order.
  void check_layout() const;
};

}  // namespace tiermoe
