// Greedy decoding's choice: the index of each row's largest logit, as torch's max(-1).indices gives it (the
// first of equal maxima; the first NaN where a row has one).
//
// torch's max-with-indices reduction runs ~2 ns a value on one thread: 0.4-0.7 ms for a 16-row step over a
// 49k vocabulary, a few percent of the step. Here a row is two vectorised passes (its largest value, then
// where it first occurs) and rows run in parallel. An index is exact, so any build computes the same answer.
//   x [R, V] float32 or bf16 -> [R] int64

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "bf16.h"
#include "dynamic_for.h"

#include "kernels.h"

namespace {

// pass 1: the row's largest value, and whether any is NaN (then the answer is the first NaN); pass 2: where
// it first occurs (-0 and +0 are equal, as torch compares them)
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 vm[4];
  for (auto& v : vm) v = _mm512_set1_ps(m);
  __mmask16 unordered = 0;
  for (; i + 64 <= n; i += 64)
    for (int j = 0; j < 4; ++j) {
      const __m512 v = load16(x + i + 16 * j);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      vm[j] = _mm512_max_ps(v, vm[j]);  // a NaN in v keeps vm
    }
  m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(vm[0], vm[1]), _mm512_max_ps(vm[2], vm[3])));
  nan = unordered != 0;
#elif defined(__AVX2__)
  // as on AVX-512, 8 lanes a vector: one stream's greedy pick over SmolLM2's 49152 logits took ~180 us as the
  // scalar loop below (a chain of dependent compares), torch's own 71 us, on a 2-core AVX2 EPYC
  __m256 vm[4], unordered = _mm256_setzero_ps();
  for (auto& v : vm) v = _mm256_set1_ps(m);
  for (; i + 32 <= n; i += 32)
    for (int j = 0; j < 4; ++j) {
      const __m256 v = load8(x + i + 8 * j);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      vm[j] = _mm256_max_ps(v, vm[j]);  // a NaN in v keeps vm
    }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(vm[0], vm[1]), _mm256_max_ps(vm[2], vm[3])));
  for (const float v : lanes) m = v > m ? v : m;
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < n; ++i) {
    const float v = as_float(x[i]);
    nan = nan || v != v;
    m = v > m ? v : m;
  }
  i = 0;
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load16(x + i);
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
#elif defined(__AVX2__)
  const __m256 target = _mm256_set1_ps(m);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(x + i);
    const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, target, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < n; ++i) {
    const float v = as_float(x[i]);
    if (nan ? v != v : v == m) return i;
  }
  return 0;  // an empty row
}

}  // namespace

namespace FLAGDEPLOY_OPS_NS {

at::Tensor argmax_rows(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "argmax_rows: x [R, V] float32 or bfloat16");
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* po = out.data_ptr<int64_t>();
  auto run = [&](const auto* px) {
    dynamic_for(rows, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) po[r] = argmax_row(px + r * n, n);
    });
  };
  if (x.scalar_type() == at::kFloat)
    run(x.data_ptr<float>());
  else
    run(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()));
  return out;
}

}  // namespace FLAGDEPLOY_OPS_NS

TORCH_LIBRARY_FRAGMENT(FLAGDEPLOY_OPS_NS, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(FLAGDEPLOY_OPS_NS, CPU, m) {
  m.impl("argmax_rows", &FLAGDEPLOY_OPS_NS::argmax_rows);
}
