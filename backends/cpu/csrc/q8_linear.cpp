// int8 weights x activations quantised to ~15 bits, on AVX2: the few-row (decode) linear of an int8 weight
// with per-channel scales, what a quantized model's LM head is (a GGUF's Q8_0 token embedding, tied).
//
// torch's _weight_int8pack_mm converts every weight to float for one multiply-add, and reaches ~7 GB/s of
// weight on a 2-core AVX2 EPYC where the cores read ~26 GB/s. Here each activation block of 32 is
// quantised once per call (activations.h: x / s ~ hi + lo / 256), and hi * 256 + lo is one int16
// (|.| <= 32640), so vpmaddwd multiplies two sign-extended int16 weights of each of 8 output rows by the
// same two activations, broadcast, into exact int32 sums: 8 lanes, 8 rows, no horizontal sum. A block's
// int32 dot (|.| < 2^27) becomes float once, times the block's scale; the row's scale d multiplies the
// finished sum. The arithmetic is AVX2's alone, so an AVX-512 CPU computes the same bits.
//
// Layout (written by `pack_q8` in native.py), N a multiple of 8 and K of 32, tiles of 8 output rows:
//   w8 [N/8, K/32, 16, 8, 2] int8: for tile t and block b, 16 pairs of columns; in pair c, row j's values
//       2c and 2c + 1.
//   d [N] float32: the rows' scales, w = d * q.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "activations.h"
#include "bf16.h"
#include "dynamic_for.h"

#if !(defined(__AVX2__) && defined(__FMA__))
#error "q8_linear needs AVX2 with FMA (native.py builds it only on such CPUs)"
#endif

#include "kernels.h"

namespace {

constexpr int64_t kTile = 8;

// Tile t of 8 output rows for activation rows [r0, r0 + R): each 32 bytes of weight are widened once
// and used for R rows.
template <int R>
void tile(const int8_t* w8, const float* d, const int16_t* x16, const float* scale, int64_t k, int64_t r0,
          int64_t t, uint16_t* y, int64_t n_out) {
  const int64_t blocks = k / QK;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int8_t* w = w8 + (t * blocks + b) * (kTile * QK);
    __m256i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
    for (int c = 0; c < QK / 4; ++c) {  // two column pairs per 32 bytes
      __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c));
      __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(raw));
      __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(raw, 1));
      for (int r = 0; r < R; ++r) {
        const int32_t* xr = reinterpret_cast<const int32_t*>(x16 + (r0 + r) * k + b * QK + 4 * c);
        dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(w0, _mm256_set1_epi32(xr[0])));
        dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(w1, _mm256_set1_epi32(xr[1])));
      }
    }
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), _mm256_set1_ps(scale[(r0 + r) * blocks + b]), acc[r]);
  }
  const __m256 rows_d = _mm256_loadu_ps(d + kTile * t);
  for (int r = 0; r < R; ++r) {
    float out[kTile];
    _mm256_storeu_ps(out, _mm256_mul_ps(acc[r], rows_d));
    for (int j = 0; j < kTile; ++j) y[(r0 + r) * n_out + kTile * t + j] = bf16_bits(out[j]);
  }
}

}  // namespace

namespace FLAGDEPLOY_OPS_NS {

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& w8, const at::Tensor& d) {
  TORCH_CHECK(x.dim() == 2 && w8.dim() == 5 && d.dim() == 1,
              "q8_linear: x [M, K], w8 [N/8, K/32, 16, 8, 2], d [N]");
  const int64_t rows_n = x.size(0), k = x.size(1), n_tiles = w8.size(0), n_out = kTile * n_tiles;
  TORCH_CHECK(k % QK == 0 && w8.size(1) == k / QK && d.size(0) == n_out,
              "q8_linear: x's width or the scales' count does not match the packed weight's (K a multiple of 32)");
  TORCH_CHECK(w8.scalar_type() == at::kChar && d.scalar_type() == at::kFloat && w8.is_contiguous() && d.is_contiguous(),
              "q8_linear: w8 must be contiguous int8, d contiguous float32");
  Activations a = quantize(x);
  std::vector<int16_t> x16(rows_n * k);
  for (int64_t i = 0; i < rows_n * k; ++i) x16[i] = static_cast<int16_t>(a.hi[i] * 256 + a.lo[i]);
  at::Tensor y = at::empty({rows_n, n_out}, x.options().dtype(at::kBFloat16));
  const int8_t* w = w8.data_ptr<int8_t>();
  const float* ds = d.data_ptr<float>();
  uint16_t* out = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  // every row group over a tile before the next tile: the tile's K x 8 bytes stay in L1 for the others
  dynamic_for(n_tiles, std::max<int64_t>(16, n_tiles / (8 * at::get_num_threads())), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t r = 0;
      for (; r + 4 <= rows_n; r += 4) tile<4>(w, ds, x16.data(), a.scale.data(), k, r, t, out, n_out);
      for (; r < rows_n; ++r) tile<1>(w, ds, x16.data(), a.scale.data(), k, r, t, out, n_out);
    }
  });
  return y;
}

}  // namespace FLAGDEPLOY_OPS_NS

TORCH_LIBRARY_FRAGMENT(FLAGDEPLOY_OPS_NS, m) {
  m.def("q8_linear(Tensor x, Tensor w8, Tensor d) -> Tensor");
}

TORCH_LIBRARY_IMPL(FLAGDEPLOY_OPS_NS, CPU, m) {
  m.impl("q8_linear", &FLAGDEPLOY_OPS_NS::q8_linear);
}
