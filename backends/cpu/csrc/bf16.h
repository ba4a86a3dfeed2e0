// float32 to bfloat16 rounded to nearest even, shared by the kernels that write bf16: the upper 16 bits
// after adding 0x7FFF plus the lowest bit kept (NaN payloads are not preserved; weights and
// activations hold none).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>

// 16 floats' bf16 bits, each in the low half of its 32-bit lane
inline __m512i bf16_lanes(__m512 v) {
  __m512i b = _mm512_castps_si512(v);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
}

// 16 float32 values, or 16 bf16 values widened to float32 (exact): one kernel template reads either dtype
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const uint16_t* x) {  // 16 bf16 values as float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
}
#endif

#if defined(__AVX2__)
#include <immintrin.h>

// 8 float32 values, or 8 bf16 values widened to float32 (exact)
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const uint16_t* x) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))), 16));
}
#endif

inline uint16_t bf16_bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return static_cast<uint16_t>((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

// a float32 or bfloat16 (its bits) value as float32: lets one kernel template read either dtype
inline float as_float(float v) { return v; }
inline float as_float(uint16_t bf16) {
  uint32_t b = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
