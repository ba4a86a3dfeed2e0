// The activations of an int-weight x int8 kernel (q4_linear.cpp, q8_linear.cpp), quantised once per call.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "ops_ns.h"

// The same values either way (round half to even, saturated); AVX-512 only where q4_linear uses it too
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define ACTIVATIONS_AVX512 1
#else
#define ACTIVATIONS_AVX512 0
#endif

namespace FLAGDEPLOY_OPS_NS {

// Activations of one call, per row: x / s ~ hi + lo / 256 with hi and lo int8 (s = block absmax / 127),
// i.e. ~15 bits per value, finer than the bf16 activations themselves, so the kernel answers as the
// w4a16 reference does (one int8 part alone would add ~4x bf16's rounding noise). Per block of 32: the
// scale s / 256 and the float sum. With `one` (q4_linear's parts = 1: llama.cpp's precision, asked for by
// serve --q8-activations) lo stays 0: every path then computes the one-part dot with no change of its own.
// Held by a caller that quantises call after call (llama_step.cpp's workspace), the vectors keep their memory.
struct Activations {
  std::vector<int8_t> hi, lo;
  std::vector<float> scale, sum;

  // room for rows x k values; lo zero with one part (the int8 kernel's int16 form reads it)
  void size(int64_t rows, int64_t k, bool one) {
    hi.resize(rows * k), scale.resize(rows * k / 32), sum.resize(rows * k / 32);
    if (one) lo.assign(rows * k, 0);
    else lo.resize(rows * k);
  }
};

}  // namespace FLAGDEPLOY_OPS_NS

namespace {

using FLAGDEPLOY_OPS_NS::Activations;
constexpr int64_t QK = 32;

// A block's sum from its 8 partial sums (lane i: x[i] + x[i + 16] + x[i + 8] + x[i + 24]) in one fixed order,
// written out (not _mm512_reduce_add_ps, whose order is the compiler's): the same float on every build
inline float sum_of_8(__m256 s) {
  const __m128 four = _mm_add_ps(_mm256_extractf128_ps(s, 1), _mm256_castps256_ps128(s));
  const __m128 two = _mm_add_ps(four, _mm_shuffle_ps(four, four, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(two) + _mm_cvtss_f32(_mm_shuffle_ps(two, two, 1));
}

#if ACTIVATIONS_AVX512

inline __m128i round_to_int8(__m512 v) { return _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)); }

template <typename T>
void quantize_into(Activations& a, const T* x, int64_t rows, int64_t k, bool one = false) {
  const int64_t blocks = k / QK;
  a.size(rows, k, one);
  const __m512 sign = _mm512_set1_ps(-0.0f), by256 = _mm512_set1_ps(256.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = r * k + b * QK;
      __m512 v[2] = {load16(x + at), load16(x + at + 16)};
      float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v[0]), _mm512_andnot_ps(sign, v[1])));
      __m512 inv = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
      for (int h = 0; h < 2; ++h) {
        __m512 t = _mm512_mul_ps(v[h], inv);
        __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(a.hi.data() + at + 16 * h), round_to_int8(whole));
        if (!one)
          _mm_storeu_si128(reinterpret_cast<__m128i*>(a.lo.data() + at + 16 * h),
                           round_to_int8(_mm512_mul_ps(_mm512_sub_ps(t, whole), by256)));
      }
      a.scale[r * blocks + b] = amax / (127.0f * 256.0f);
      const __m512 pairs = _mm512_add_ps(v[0], v[1]);  // x[i] + x[i + 16]
      const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(pairs), 1));
      a.sum[r * blocks + b] = sum_of_8(_mm256_add_ps(upper, _mm512_castps512_ps256(pairs)));
    }
  }
}

#else

// 8 values rounded (the default mode: to nearest even) and saturated to int8, as the AVX-512 form's
// vcvtps2dq + vpmovsdb: two signed saturating packs
inline void store_int8(int8_t* out, __m256 v) {
  const __m256i i = _mm256_cvtps_epi32(v);
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packs_epi16(w, w));
}

// The AVX-512 form's arithmetic 8 values at a time (the same bits): a decode step's activations are
// quantised in every linear, 2-6% of an AVX2 step as a scalar loop
template <typename T>
void quantize_into(Activations& a, const T* x, int64_t rows, int64_t k, bool one = false) {
  const int64_t blocks = k / QK;
  a.size(rows, k, one);
  const __m256 sign = _mm256_set1_ps(-0.0f), by256 = _mm256_set1_ps(256.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = r * k + b * QK;
      __m256 v[4];
      for (int h = 0; h < 4; ++h) v[h] = load8(x + at + 8 * h);
      const __m256 most = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                        _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, most);
      const float amax = *std::max_element(lanes, lanes + 8);
      const __m256 inv = _mm256_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
      for (int h = 0; h < 4; ++h) {
        const __m256 t = _mm256_mul_ps(v[h], inv);
        const __m256 whole = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        store_int8(a.hi.data() + at + 8 * h, whole);
        if (!one) store_int8(a.lo.data() + at + 8 * h, _mm256_mul_ps(_mm256_sub_ps(t, whole), by256));
      }
      a.scale[r * blocks + b] = amax / (127.0f * 256.0f);
      // the AVX-512 form's order: x[i] + x[i + 16], then lanes i and i + 8 of those
      a.sum[r * blocks + b] = sum_of_8(_mm256_add_ps(_mm256_add_ps(v[1], v[3]), _mm256_add_ps(v[0], v[2])));
    }
  }
}

#endif

// The activations of x [rows, K], float32 or bf16 (any other dtype is converted to float32 first).
inline Activations quantize(const at::Tensor& x, bool one = false) {
  at::Tensor xc = x.scalar_type() == at::kBFloat16 ? x.contiguous() : x.to(at::kFloat).contiguous();
  Activations a;
  if (xc.scalar_type() == at::kBFloat16)
    quantize_into(a, reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), xc.size(0), xc.size(1), one);
  else
    quantize_into(a, xc.data_ptr<float>(), xc.size(0), xc.size(1), one);
  return a;
}

}  // namespace
