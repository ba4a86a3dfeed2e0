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

// The same values either way (round half to even, saturated); AVX-512 only where q4_linear uses it too
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define ACTIVATIONS_AVX512 1
#else
#define ACTIVATIONS_AVX512 0
#endif

namespace {

constexpr int64_t QK = 32;

// Activations of one call, per row: x / s ~ hi + lo / 256 with hi and lo int8 (s = block absmax / 127),
// i.e. ~15 bits per value, finer than the bf16 activations themselves, so the kernel answers as the
// w4a16 reference does (one int8 part alone would add ~4x bf16's rounding noise). Per block of 32: the
// scale s / 256 and the float sum.
struct Activations {
  std::vector<int8_t> hi, lo;
  std::vector<float> scale, sum;
};

#if ACTIVATIONS_AVX512

inline __m128i round_to_int8(__m512 v) { return _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)); }

template <typename T>
Activations quantize(const T* x, int64_t rows, int64_t k) {
  const int64_t blocks = k / QK;
  Activations a{std::vector<int8_t>(rows * k), std::vector<int8_t>(rows * k), std::vector<float>(rows * blocks),
                std::vector<float>(rows * blocks)};
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
        _mm_storeu_si128(reinterpret_cast<__m128i*>(a.lo.data() + at + 16 * h),
                         round_to_int8(_mm512_mul_ps(_mm512_sub_ps(t, whole), by256)));
      }
      a.scale[r * blocks + b] = amax / (127.0f * 256.0f);
      a.sum[r * blocks + b] = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
    }
  }
  return a;
}

#else

inline int8_t saturate_int8(float v) { return static_cast<int8_t>(std::min(127.0f, std::max(-128.0f, v))); }

// The same values as the AVX-512 version: round half to even (the default rounding mode), saturated.
template <typename T>
Activations quantize(const T* x, int64_t rows, int64_t k) {
  const int64_t blocks = k / QK;
  Activations a{std::vector<int8_t>(rows * k), std::vector<int8_t>(rows * k), std::vector<float>(rows * blocks),
                std::vector<float>(rows * blocks)};
  float v[QK];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = r * k + b * QK;
      float amax = 0.0f, sum = 0.0f;
      for (int i = 0; i < QK; ++i) {
        v[i] = as_float(x[at + i]);
        amax = std::max(amax, std::fabs(v[i]));
        sum += v[i];
      }
      const float inv = amax > 0 ? 127.0f / amax : 0.0f;
      for (int i = 0; i < QK; ++i) {
        const float t = v[i] * inv, whole = std::nearbyint(t);
        a.hi[at + i] = saturate_int8(whole);
        a.lo[at + i] = saturate_int8(std::nearbyint((t - whole) * 256.0f));
      }
      a.scale[r * blocks + b] = amax / (127.0f * 256.0f);
      a.sum[r * blocks + b] = sum;
    }
  }
  return a;
}

#endif

// The activations of x [rows, K], float32 or bf16 (any other dtype is converted to float32 first).
inline Activations quantize(const at::Tensor& x) {
  at::Tensor xc = x.scalar_type() == at::kBFloat16 ? x.contiguous() : x.to(at::kFloat).contiguous();
  return xc.scalar_type() == at::kBFloat16
      ? quantize(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), xc.size(0), xc.size(1))
      : quantize(xc.data_ptr<float>(), xc.size(0), xc.size(1));
}

}  // namespace
