// FP8 e4m3 checkpoint weights with 128x128-style block inverse scales, converted row by row in one pass
// over the data: for `flagdeploy quantize` on a host CPU, where torch's elementwise ops made several
// passes over float32 temporaries (decode, scale, absmax, divide, round, clamp, dequantise, norms).
//
// Same arithmetic as the torch path in quantize/convert.py, value for value: e4m3 decoded exactly (its
// bits shifted into a float16, times 2^8), multiplied by the block's float32 inverse scale; int8 with
// scale = max(absmax, 1e-12) / 127 per output row (or per group of input columns), q = round-half-even
// of value / scale clamped to +-127; bf16 rounded to nearest even. Also returns the sums of squares of
// the dequantised source and of the conversion's error, for the report.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "bf16.h"

#ifndef FLAGDEPLOY_OPS_NS
#define FLAGDEPLOY_OPS_NS flagdeploy_cpu  // tests build an AVX2-only copy under another name
#endif

namespace {

struct Shape {
  int64_t rows, cols, block_r, block_c, scale_cols;
};

// Per row: `f` holds the row's dequantised values; each function writes its output row and returns the
// row's sum of squared errors. The AVX-512 and the portable versions compute the same values.
#if defined(__AVX512F__) && defined(__AVX512BW__)

// 16 e4m3 values (as bytes) to float32, exactly: the bits sign-extended, shifted into a float16, x 2^8
inline __m512 e4m3_to_float(const uint8_t* p) {
  __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}

inline float decode_row(const uint8_t* row, const float* srow, const Shape& s, float* f) {
  __m512 sq = _mm512_setzero_ps();
  for (int64_t c = 0; c < s.cols; c += 16) {
    __m512 v = _mm512_mul_ps(e4m3_to_float(row + c), _mm512_set1_ps(srow[c / s.block_c]));
    _mm512_storeu_ps(f + c, v);
    sq = _mm512_fmadd_ps(v, v, sq);
  }
  return _mm512_reduce_add_ps(sq);
}

inline float group_absmax(const float* v, int64_t n) {
  __m512 m = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(v + i)));
  return _mm512_reduce_max_ps(m);
}

inline float int8_group(const float* v, int64_t n, float scale, int8_t* out) {
  const __m512 vs = _mm512_set1_ps(scale);
  __m512 e2 = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    __m512 x = _mm512_loadu_ps(v + i);
    __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(x, vs));  // round half to even
    q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(q));
    __m512 d = _mm512_sub_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q), vs), x);
    e2 = _mm512_fmadd_ps(d, d, e2);
  }
  return _mm512_reduce_add_ps(e2);
}

inline float bf16_row(const float* v, int64_t n, uint16_t* out) {
  __m512 e2 = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    __m512 x = _mm512_loadu_ps(v + i);
    __m512i b = bf16_lanes(x);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(b));
    __m512 d = _mm512_sub_ps(_mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), x);
    e2 = _mm512_fmadd_ps(d, d, e2);
  }
  return _mm512_reduce_add_ps(e2);
}

#else  // portable C++ (the compiler vectorises what it can)

struct E4M3 {  // every e4m3fn byte's value (0x7F / 0xFF, NaN, as +-480: what the bit shift gives)
  float v[256];
  E4M3() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      const float mag = e ? std::ldexp(1.0f + m / 8.0f, e - 7) : std::ldexp(m / 8.0f, -6);
      v[b] = b & 0x80 ? -mag : mag;
    }
  }
};
const E4M3 kE4M3;

inline float decode_row(const uint8_t* row, const float* srow, const Shape& s, float* f) {
  float sq = 0.0f;
  for (int64_t c = 0; c < s.cols; ++c) {
    f[c] = kE4M3.v[row[c]] * srow[c / s.block_c];
    sq += f[c] * f[c];
  }
  return sq;
}

inline float group_absmax(const float* v, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(v[i]));
  return m;
}

inline float int8_group(const float* v, int64_t n, float scale, int8_t* out) {
  float e2 = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float q = std::min(127.0f, std::max(-127.0f, std::nearbyint(v[i] / scale)));
    out[i] = static_cast<int8_t>(q);
    const float d = q * scale - v[i];
    e2 += d * d;
  }
  return e2;
}

inline float bf16_row(const float* v, int64_t n, uint16_t* out) {
  float e2 = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    out[i] = bf16_bits(v[i]);
    const uint32_t b = static_cast<uint32_t>(out[i]) << 16;
    float rounded;
    std::memcpy(&rounded, &b, 4);
    e2 += (rounded - v[i]) * (rounded - v[i]);
  }
  return e2;
}

#endif

void check(const at::Tensor& w, const at::Tensor& scale_inv, int64_t block_r, int64_t block_c) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "fp8 weight: contiguous [R, C] bytes");
  TORCH_CHECK(scale_inv.scalar_type() == at::kFloat && scale_inv.is_contiguous(), "scale_inv: contiguous float32");
  TORCH_CHECK(w.size(1) % 16 == 0 && block_c % 16 == 0, "columns and column blocks must be multiples of 16");
  TORCH_CHECK(scale_inv.size(0) == (w.size(0) + block_r - 1) / block_r &&
                  scale_inv.size(1) == (w.size(1) + block_c - 1) / block_c,
              "scale_inv does not cover the weight in its blocks");
}

// Runs `row_fn(r, f)` (returns the row's squared error) over the rows, `f` the dequantised row; returns
// the sums of squares of the source and of the error, float64 [2].
template <typename F>
at::Tensor over_rows(const at::Tensor& w, const at::Tensor& scale_inv, const Shape& s, F row_fn) {
  std::vector<double> norm(s.rows), err(s.rows);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scale_inv.data_ptr<float>();
  at::parallel_for(0, s.rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> f(s.cols);
    for (int64_t r = r0; r < r1; ++r) {
      norm[r] = decode_row(wp + r * s.cols, sp + (r / s.block_r) * s.scale_cols, s, f.data());
      err[r] = row_fn(r, f.data());
    }
  });
  double n = 0, e = 0;
  for (int64_t r = 0; r < s.rows; ++r) n += norm[r], e += err[r];
  return at::tensor({n, e}, at::kDouble);
}

// (q int8 [R, C], scales float32 [R, C / group], sums of squares float64 [2]: source, error)
std::tuple<at::Tensor, at::Tensor, at::Tensor> fp8_to_int8(const at::Tensor& w, const at::Tensor& scale_inv,
                                                           int64_t block_r, int64_t block_c, int64_t group) {
  check(w, scale_inv, block_r, block_c);
  const Shape s{w.size(0), w.size(1), block_r, block_c, scale_inv.size(1)};
  const int64_t g = group ? group : s.cols;
  TORCH_CHECK(g % 16 == 0 && s.cols % g == 0, "the group size must divide the columns and be a multiple of 16");
  at::Tensor q = at::empty({s.rows, s.cols}, w.options().dtype(at::kChar));
  at::Tensor scales = at::empty({s.rows, s.cols / g}, w.options().dtype(at::kFloat));
  int8_t* qp = q.data_ptr<int8_t>();
  float* scp = scales.data_ptr<float>();
  at::Tensor sums = over_rows(w, scale_inv, s, [&](int64_t r, const float* f) {
    float e2 = 0.0f;
    for (int64_t c0 = 0; c0 < s.cols; c0 += g) {
      const float scale = std::max(group_absmax(f + c0, g), 1e-12f) / 127.0f;
      scp[r * (s.cols / g) + c0 / g] = scale;
      e2 += int8_group(f + c0, g, scale, qp + r * s.cols + c0);
    }
    return e2;
  });
  return {q, scales, sums};
}

// (bf16 [R, C], sums of squares float64 [2]: source, error)
std::tuple<at::Tensor, at::Tensor> fp8_to_bf16(const at::Tensor& w, const at::Tensor& scale_inv, int64_t block_r,
                                               int64_t block_c) {
  check(w, scale_inv, block_r, block_c);
  const Shape s{w.size(0), w.size(1), block_r, block_c, scale_inv.size(1)};
  at::Tensor out = at::empty({s.rows, s.cols}, w.options().dtype(at::kBFloat16));
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::Tensor sums = over_rows(w, scale_inv, s,
                              [&](int64_t r, const float* f) { return bf16_row(f, s.cols, op + r * s.cols); });
  return {out, sums};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(FLAGDEPLOY_OPS_NS, m) {
  m.def("fp8_to_int8(Tensor w, Tensor scale_inv, int block_r, int block_c, int group) -> (Tensor, Tensor, Tensor)");
  m.def("fp8_to_bf16(Tensor w, Tensor scale_inv, int block_r, int block_c) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(FLAGDEPLOY_OPS_NS, CPU, m) {
  m.impl("fp8_to_int8", &fp8_to_int8);
  m.impl("fp8_to_bf16", &fp8_to_bf16);
}
