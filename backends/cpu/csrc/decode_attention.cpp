// Decode attention over paged caches, one (query row, query head) at a time: the eager decode step's
// attention on the CPU.
//
// torch's fused SDPA costs ~200 us per call at a few hundred keys for SmolLM2's 9 heads (mostly fixed
// cost), and a speculative verify step needs one call per row, because a masked batched call rounds
// differently from a lone row's unmasked one. Here every (row, query head) pair is computed by the same
// loops in the same order whatever else is in the call, so a row's result is bitwise the same alone, in a
// batch, or as one of a verify step's rows, and one call serves them all.
//
// Per (row, query head): scores s_t = scale * q . k_t in float32 (fixed_sum.h's order: the same on every
// build), a float32 softmax, and out = sum_t p_t v_t accumulated in float32 in key order. A batch of a few
// rows or more runs each key head's query heads together (attend_group): the same arithmetic per head, each
// key and value read once per group, and the heads' serial sums side by side (16 rows of SmolLM2's 9 heads
// over 3 key heads, 100-300 keys: 45 -> 37 us, 110 -> 90 us a call, bitwise equal).
//   q [R, H, D] float32 or bf16; k_cache, v_cache [blocks, block_size, KH, D] float32 or bf16 (the same);
//   block_tables [R, W] int64 (row r's keys are positions 0..context_lens[r]-1 through its table);
//   out [R, H, D] in q's dtype.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <type_traits>

#include "bf16.h"
#include "dynamic_for.h"
#include "exp_nonpositive.h"
#include "fixed_sum.h"

#include "kernels.h"

namespace {

#if defined(__AVX512F__)  // bf16.h has included immintrin.h

// The scores of `count` (at most 16) keys from their 16 partial sums each (`p`, fixed_dot's lanes: fused
// multiply-adds in element order, see dots16_heads), each fixed_dot(q, key, D) bit for bit: the keys' folds by
// halves run together, two to eight keys per vector, through shuffles that add exactly the lanes
// fixed_dot's fold adds. One key at a time, the fold was a chain of 15 dependent scalar adds per key and
// query head, the larger part of a decode step's attention.
inline void fold16(const __m512* p, int64_t count, float* out) {
  __m512 a[8], b[4], c[2];
  for (int m = 0; m < 8; ++m)  // lanes j + (j + 8): a[m] = keys 2m, 2m+1 in 8 lanes each
    a[m] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * m], p[2 * m + 1], 0x44),
                         _mm512_shuffle_f32x4(p[2 * m], p[2 * m + 1], 0xEE));
  for (int m = 0; m < 4; ++m)  // lanes j + (j + 4): b[m] = keys 4m .. 4m+3 in 4 lanes each
    b[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xDD));
  for (int m = 0; m < 2; ++m)  // lanes j + (j + 2): in 128-bit chunk k of c[m], keys 8m + k and 8m + 4 + k
    c[m] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * m], b[2 * m + 1], 0x44), _mm512_shuffle_ps(b[2 * m], b[2 * m + 1], 0xEE));
  // lanes 0 + 1: lane 4k + e holds key 4e + k
  alignas(64) float r[16];
  _mm512_store_ps(r, _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD)));
  for (int64_t t = 0; t < count; ++t) out[t] = r[4 * (t % 4) + t / 4];
}

// The scores of G query heads of one key head at once (q: their G rows of D; G = 1 for one head), each key
// read and widened once for all G; per head the same partial sums in the same order. out[g * out_stride + t].
template <typename T, int D, int G>
inline void dots16_heads(const float* q, const T* keys, int64_t stride, int64_t count, float* out, int64_t out_stride) {
  __m512 p[G][16];
  for (int t = 0; t < 16; ++t) {
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    if (t < count)
      for (int i = 0; i < D; i += 16) {
        const __m512 key = load16(keys + t * stride + i);
        for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + i), key, acc[g]);
      }
    for (int g = 0; g < G; ++g) p[g][t] = acc[g];
  }
  for (int g = 0; g < G; ++g) fold16(p[g], count, out + g * out_stride);
}

template <typename T, int D>
inline void dots16(const float* q, const T* keys, int64_t stride, int64_t count, float* out) {
  dots16_heads<T, D, 1>(q, keys, stride, count, out, 0);
}

// All G query heads of row r's key head kh at once (the grouped-query heads that read the same keys and
// values): per head the arithmetic of `attend`'s unit, in its order, so the same bits; each key and value is
// read and widened once for the group instead of once per head. s: G rows of `most` floats.
template <typename T, int D, int G>
void attend_group(const float* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t n, int64_t kh,
                  int64_t kv_heads, int64_t block_size, float scale, float* s, int64_t most, float* out) {
  const int64_t stride = kv_heads * D;
  float m[G];
  for (int g = 0; g < G; ++g) m[g] = -INFINITY;
  for (int64_t t0 = 0, b = 0; t0 < n; t0 += block_size, ++b) {
    const T* keys = k_cache + (table[b] * block_size * kv_heads + kh) * D;
    const int64_t end = std::min(block_size, n - t0);
    for (int64_t j = 0; j < end; j += 16)
      dots16_heads<T, D, G>(q, keys + j * stride, stride, std::min<int64_t>(16, end - j), s + t0 + j, most);
    for (int64_t j = 0; j < end; ++j)  // the heads' running maxima and (below) sums side by side: G
      for (int g = 0; g < G; ++g) m[g] = std::max(m[g], s[g * most + t0 + j] *= scale);  // independent chains
  }
  for (int g = 0; g < G; ++g) {
    float* sg = s + g * most;
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) sg[t] = exp_nonpositive(sg[t] - m[g]);
  }
  float sum[G] = {}, inv[G];
  for (int64_t t = 0; t < n; ++t)
    for (int g = 0; g < G; ++g) sum[g] += s[g * most + t];
  for (int g = 0; g < G; ++g) inv[g] = 1.f / sum[g];
  __m512 a[G][D / 16];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < D / 16; ++i) a[g][i] = _mm512_setzero_ps();
  for (int64_t t0 = 0, b = 0; t0 < n; t0 += block_size, ++b) {
    const T* values = v_cache + (table[b] * block_size * kv_heads + kh) * D;
    for (int64_t j = 0, end = std::min(block_size, n - t0); j < end; ++j) {
      __m512 v[D / 16];
      for (int i = 0; i < D / 16; ++i) v[i] = load16(values + j * stride + 16 * i);
      for (int g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(s[g * most + t0 + j] * inv[g]);
        for (int i = 0; i < D / 16; ++i) a[g][i] = _mm512_fmadd_ps(w, v[i], a[g][i]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < D / 16; ++i) _mm512_storeu_ps(out + g * D + 16 * i, a[g][i]);
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const uint16_t* x) {  // 8 bf16 values as float32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))), 16));
}

// The AVX2 form of fold16: the scores of `count` (at most 8) keys from their partial sums, lanes j and j + 8
// of fixed_dot already added (p[t], 8 lanes), each fixed_dot(q, key, D) bit for bit: the keys' remaining
// folds (j + 4, j + 2, j + 1) run together through shuffles that add exactly the lanes fixed_dot's fold adds,
// where one key at a time it was a chain of dependent scalar adds per key and query head: one thread, SmolLM2's
// 9 heads over 256 bf16 keys, 41 -> 31 us a row, 5 rows 195 -> 139 us (the AVX-512 build: 24, 71), bitwise equal.
inline void fold8(const __m256* p, int64_t count, float* out) {
  __m256 a[4], b[2];
  for (int m = 0; m < 4; ++m)  // lanes j + (j + 4): a[m] = key 2m in its low 128 bits, key 2m + 1 in its high
    a[m] = _mm256_add_ps(_mm256_permute2f128_ps(p[2 * m], p[2 * m + 1], 0x20),
                         _mm256_permute2f128_ps(p[2 * m], p[2 * m + 1], 0x31));
  for (int m = 0; m < 2; ++m)  // lanes j + (j + 2): low 128 bits keys 4m, 4m + 2; high keys 4m + 1, 4m + 3
    b[m] = _mm256_add_ps(_mm256_shuffle_ps(a[2 * m], a[2 * m + 1], 0x44), _mm256_shuffle_ps(a[2 * m], a[2 * m + 1], 0xEE));
  // lanes 0 + 1: lane (t % 2) * 4 + t / 2 holds key t
  alignas(32) float r[8];
  _mm256_store_ps(r, _mm256_add_ps(_mm256_shuffle_ps(b[0], b[1], 0x88), _mm256_shuffle_ps(b[0], b[1], 0xDD)));
  for (int64_t t = 0; t < count; ++t) out[t] = r[(t % 2) * 4 + t / 2];
}

// fixed_dot(q, key, D) of up to 8 keys: per key its 16 partial sums as two vectors, fused multiply-adds in
// element order (element i into lane i % 16), then fold8
template <typename T, int D>
inline void dots8(const float* q, const T* keys, int64_t stride, int64_t count, float* out) {
  __m256 p[8];
  for (int t = 0; t < 8; ++t) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    if (t < count)
      for (int i = 0; i < D; i += 16) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(keys + t * stride + i), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), load8(keys + t * stride + i + 8), hi);
      }
    p[t] = _mm256_add_ps(lo, hi);  // fixed_dot's first fold: lanes j + (j + 8)
  }
  fold8(p, count, out);
}
#endif

// Each (row, query head) on its own: the units split over the threads evenly however few rows there are
// (a lone row's 9 heads, not its 3 key heads), and a unit's loops are the same wherever it runs. D is the
// head width where it is one the build knows (the partial sums then stay in registers), else 0: d at run
// time, the same arithmetic.
template <typename T, int D>
void attend(const float* q, const T* k_cache, const T* v_cache, const int64_t* tables, const int64_t* lens,
            int64_t rows, int64_t heads, int64_t kv_heads, int64_t d, int64_t block_size, int64_t width,
            float scale, float* out) {
  if constexpr (D > 0) d = D;
  const int64_t group = heads / kv_heads, stride = kv_heads * d;  // stride: one slot's row to the next's
  const int64_t most = rows ? *std::max_element(lens, lens + rows) : 0;
#if defined(__AVX512F__)
  // With rows enough that units of a whole head group still split evenly over the threads, a unit is a
  // (row, key head) and its query heads go together (attend_group), where the group's accumulators fit in
  // registers. The same bits either way.
  if constexpr (D > 0 && D % 16 == 0) {
    if (rows * kv_heads >= 4 * at::get_num_threads() && group * D <= 256) {
      auto grouped = [&](auto g_const) {
        constexpr int G = decltype(g_const)::value;
        dynamic_for(rows * kv_heads, 1, [&](int64_t u0, int64_t u1) {
          std::vector<float> s(G * most);
          for (int64_t u = u0; u < u1; ++u) {
            const int64_t r = u / kv_heads, kh = u % kv_heads, first = r * heads + kh * G;
            attend_group<T, D, G>(q + first * D, k_cache, v_cache, tables + r * width, lens[r], kh, kv_heads,
                                  block_size, scale, s.data(), most, out + first * D);
          }
        });
      };
      switch (group) {
        case 2: return grouped(std::integral_constant<int, 2>{});
        case 3: return grouped(std::integral_constant<int, 3>{});
        case 4: return grouped(std::integral_constant<int, 4>{});
        default: break;
      }
    }
  }
#endif
  dynamic_for(rows * heads, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> s(most), acc(D > 0 ? 0 : d);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t r = p / heads, kh = p % heads / group, n = lens[r];
      const int64_t* table = tables + r * width;
      const float* qh = q + p * d;
      // keys by the blocks of the row's table: block b holds keys [b * block_size, (b + 1) * block_size)
      float m = -INFINITY;
      for (int64_t t0 = 0, b = 0; t0 < n; t0 += block_size, ++b) {
        const T* keys = k_cache + (table[b] * block_size * kv_heads + kh) * d;
        const int64_t end = std::min(block_size, n - t0);
#if defined(__AVX512F__)
        if constexpr (D > 0 && D % 16 == 0) {
          for (int64_t j = 0; j < end; j += 16) dots16<T, D>(qh, keys + j * stride, stride, std::min<int64_t>(16, end - j), &s[t0 + j]);
          for (int64_t j = 0; j < end; ++j) m = std::max(m, s[t0 + j] *= scale);
          continue;
        }
#elif defined(__AVX2__) && defined(__FMA__)
        if constexpr (D > 0 && D % 16 == 0) {
          for (int64_t j = 0; j < end; j += 8) dots8<T, D>(qh, keys + j * stride, stride, std::min<int64_t>(8, end - j), &s[t0 + j]);
          for (int64_t j = 0; j < end; ++j) m = std::max(m, s[t0 + j] *= scale);
          continue;
        }
#endif
        for (int64_t j = 0; j < end; ++j) {
          const float x = fixed_dot(qh, keys + j * stride, d) * scale;
          s[t0 + j] = x;
          m = std::max(m, x);
        }
      }
#pragma omp simd
      for (int64_t t = 0; t < n; ++t) s[t] = exp_nonpositive(s[t] - m);
      float sum = 0.f;
      for (int64_t t = 0; t < n; ++t) sum += s[t];
      const float inv = 1.f / sum;
      // out = sum_t p_t v_t, each value summed in key order from 0, in a local array (registers when D > 0)
      float fixed[D > 0 ? D : 1] = {};
      float* a = D > 0 ? fixed : acc.data();
      if constexpr (D == 0) std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0, b = 0; t0 < n; t0 += block_size, ++b) {
        const T* values = v_cache + (table[b] * block_size * kv_heads + kh) * d;
        for (int64_t j = 0, end = std::min(block_size, n - t0); j < end; ++j) {
          const float w = s[t0 + j] * inv;
          const T* v = values + j * stride;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) a[i] += w * as_float(v[i]);
        }
      }
      std::copy(a, a + d, out + p * d);
    }
  });
}

template <typename T>
void attend_any(const float* q, const T* k_cache, const T* v_cache, const int64_t* tables, const int64_t* lens,
                int64_t rows, int64_t heads, int64_t kv_heads, int64_t d, int64_t block_size, int64_t width,
                float scale, float* out) {
  switch (d) {
    case 64: return attend<T, 64>(q, k_cache, v_cache, tables, lens, rows, heads, kv_heads, d, block_size, width, scale, out);
    case 128: return attend<T, 128>(q, k_cache, v_cache, tables, lens, rows, heads, kv_heads, d, block_size, width, scale, out);
    default: return attend<T, 0>(q, k_cache, v_cache, tables, lens, rows, heads, kv_heads, d, block_size, width, scale, out);
  }
}

}  // namespace

namespace FLAGDEPLOY_OPS_NS {

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && block_tables.dim() == 2,
              "paged_decode_attention: q [R, H, D], caches [blocks, block_size, KH, D], block_tables [R, W]");
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && heads % kv_heads == 0 && block_tables.size(0) == rows &&
                  context_lens.numel() == rows,
              "paged_decode_attention: head width, head groups or row counts disagree");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16),
              "paged_decode_attention: caches must both be float32 or both bfloat16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode_attention: contiguous caches");
  at::Tensor tables = block_tables.to(at::kLong).contiguous(), lens = context_lens.to(at::kLong).contiguous();
  const int64_t block_size = k_cache.size(1), width = tables.size(1), values = rows * heads * d;
  // float32 q and sums; a bf16 q widened and its output rounded here, in plain loops (as ops, two dispatched
  // conversions and allocations a layer)
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  at::Tensor qc = bf16 ? q.contiguous() : q.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({rows, heads, d}, q.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  std::vector<float> q32, out32;
  const float* qf = nullptr;
  float* of = nullptr;
  if (bf16) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(qc.data_ptr<at::BFloat16>());
    q32.resize(values);
    out32.resize(values);
    for (int64_t i = 0; i < values; ++i) q32[i] = as_float(src[i]);
    qf = q32.data(), of = out32.data();
  } else {
    qf = qc.data_ptr<float>(), of = out.data_ptr<float>();
  }
  if (k_cache.scalar_type() == at::kFloat)
    attend_any(qf, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tables.data_ptr<int64_t>(),
               lens.data_ptr<int64_t>(), rows, heads, kv_heads, d, block_size, width, static_cast<float>(scale), of);
  else
    attend_any(qf, reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
               reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()), tables.data_ptr<int64_t>(),
               lens.data_ptr<int64_t>(), rows, heads, kv_heads, d, block_size, width, static_cast<float>(scale), of);
  if (bf16) {
    uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    for (int64_t i = 0; i < values; ++i) dst[i] = bf16_bits(out32[i]);
  }
  return bf16 || q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

}  // namespace FLAGDEPLOY_OPS_NS

TORCH_LIBRARY_FRAGMENT(FLAGDEPLOY_OPS_NS, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(FLAGDEPLOY_OPS_NS, CPU, m) {
  m.impl("paged_decode_attention", &FLAGDEPLOY_OPS_NS::paged_decode_attention);
}
