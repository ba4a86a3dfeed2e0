// Decode attention over paged caches, one (query row, key head) at a time: the eager decode step's
// attention on the CPU.
//
// torch's fused SDPA costs ~200 us per call at a few hundred keys for SmolLM2's 9 heads (mostly fixed
// cost), and a speculative verify step needs one call per row, because a masked batched call rounds
// differently from a lone row's unmasked one. Here every (row, key head) pair is computed by the same
// loops in the same order whatever else is in the call, so a row's result is bitwise the same alone, in a
// batch, or as one of a verify step's rows, and one call serves them all.
//
// Per pair: scores s_t = scale * q . k_t in float32 (one vector reduction pattern, fixed by the build), a
// float32 softmax, and out = sum_t p_t v_t accumulated in float32 in key order.
//   q [R, H, D] float32 or bf16; k_cache, v_cache [blocks, block_size, KH, D] float32 or bf16 (the same);
//   block_tables [R, W] int64 (row r's keys are positions 0..context_lens[r]-1 through its table);
//   out [R, H, D] in q's dtype.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"

#include "kernels.h"

namespace {

// A key or value row in float32 (once per key, shared by the query heads of its group).
template <typename T>
inline void row_to_float(const T* src, float* dst, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) dst[i] = as_float(src[i]);
}

// One fixed summation pattern (the compiler's vector reduction of this loop): the same for every row.
inline float dot(const float* a, const float* b, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

template <typename T>
void attend(const float* q, const T* k_cache, const T* v_cache, const int64_t* tables, const int64_t* lens,
            int64_t rows, int64_t heads, int64_t kv_heads, int64_t d, int64_t block_size, int64_t width,
            float scale, float* out) {
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, rows * kv_heads, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> scores, acc(group * d), row(d);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t r = p / kv_heads, kh = p % kv_heads, n = lens[r];
      const int64_t* table = tables + r * width;
      const float* qg = q + (r * heads + kh * group) * d;
      scores.assign(group * n, 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        row_to_float(k_cache + (slot * kv_heads + kh) * d, row.data(), d);
        for (int64_t g = 0; g < group; ++g) scores[g * n + t] = dot(qg + g * d, row.data(), d) * scale;
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * n;
        float m = -INFINITY;
        for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) {
          s[t] = std::exp(s[t] - m);
          sum += s[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < n; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        row_to_float(v_cache + (slot * kv_heads + kh) * d, row.data(), d);
        for (int64_t g = 0; g < group; ++g) {
          const float w = scores[g * n + t];
          float* a = acc.data() + g * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) a[i] += w * row[i];
        }
      }
      std::memcpy(out + (r * heads + kh * group) * d, acc.data(), group * d * sizeof(float));
    }
  });
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
  at::Tensor qf = q.to(at::kFloat).contiguous();
  at::Tensor tables = block_tables.to(at::kLong).contiguous(), lens = context_lens.to(at::kLong).contiguous();
  at::Tensor out = at::empty({rows, heads, d}, q.options().dtype(at::kFloat));
  const int64_t block_size = k_cache.size(1), width = tables.size(1);
  if (k_cache.scalar_type() == at::kFloat)
    attend(qf.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tables.data_ptr<int64_t>(),
           lens.data_ptr<int64_t>(), rows, heads, kv_heads, d, block_size, width, static_cast<float>(scale),
           out.data_ptr<float>());
  else
    attend(qf.data_ptr<float>(), reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
           reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()), tables.data_ptr<int64_t>(),
           lens.data_ptr<int64_t>(), rows, heads, kv_heads, d, block_size, width, static_cast<float>(scale),
           out.data_ptr<float>());
  return out.to(q.scalar_type());
}

}  // namespace FLAGDEPLOY_OPS_NS

TORCH_LIBRARY_FRAGMENT(FLAGDEPLOY_OPS_NS, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(FLAGDEPLOY_OPS_NS, CPU, m) {
  m.impl("paged_decode_attention", &FLAGDEPLOY_OPS_NS::paged_decode_attention);
}
