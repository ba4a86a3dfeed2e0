// SwiGLU of a decode step's MLP, silu(gate) * up over [gate | up] rows, in one pass.
//
// torch's form is two kernels and an intermediate (silu, then the multiply), each on one thread at a decode
// step's sizes: ~20 us a layer for 16 rows of SmolLM2's 1536, ~3% of the step. Here a row is one loop whose
// exp runs 16 values at a time (exp_nonpositive.h), and rows split over the threads past a few thousand
// values. silu(g) = g * sigmoid(g), with sigmoid from e = exp(-|g|) (1 / (1 + e), or e / (1 + e) for g < 0):
// no overflow for any g. bf16 rows round as torch's pair of kernels does: silu(g) to bf16, then the product.
//   gate_up [R, 2I] float32 or bf16 (rows contiguous) -> [R, I] in its dtype

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "bf16.h"
#include "dynamic_for.h"
#include "exp_nonpositive.h"

#include "kernels.h"

namespace {

constexpr int64_t kGrainValues = 4096;  // values per thread below which rows run on the calling thread

[[gnu::always_inline]] inline float silu(float g) {
  const float e = exp_nonpositive(-std::fabs(g));
  return g * ((g >= 0.f ? 1.f : e) / (1.f + e));
}

template <typename T>
void swiglu_row(const T* gate, const T* up, T* out, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = silu(gate[i]) * up[i];
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = bf16_bits(as_float(bf16_bits(silu(as_float(gate[i])))) * as_float(up[i]));
  }
}

}  // namespace

namespace FLAGDEPLOY_OPS_NS {

void swiglu_rows(const uint16_t* x, int64_t stride, int64_t rows, int64_t n, uint16_t* out) {
  dynamic_for(rows, std::max<int64_t>(1, kGrainValues / std::max<int64_t>(n, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) swiglu_row(x + r * stride, x + r * stride + n, out + r * n, n);
  });
}

at::Tensor swiglu(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 &&
                  (gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16),
              "swiglu: gate_up [R, 2I] float32 or bfloat16");
  const at::Tensor x = gate_up.stride(1) == 1 ? gate_up : gate_up.contiguous();
  const int64_t rows = x.size(0), n = x.size(1) / 2, stride = x.stride(0);
  at::Tensor out = at::empty({rows, n}, x.options());
  auto run = [&](const auto* px, auto* po) {
    dynamic_for(rows, std::max<int64_t>(1, kGrainValues / std::max<int64_t>(n, 1)), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) swiglu_row(px + r * stride, px + r * stride + n, po + r * n, n);
    });
  };
  if (x.scalar_type() == at::kFloat)
    run(x.data_ptr<float>(), out.data_ptr<float>());
  else
    swiglu_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), stride, rows, n,
                reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  return out;
}

}  // namespace FLAGDEPLOY_OPS_NS

TORCH_LIBRARY_FRAGMENT(FLAGDEPLOY_OPS_NS, m) {
  m.def("swiglu(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(FLAGDEPLOY_OPS_NS, CPU, m) {
  m.impl("swiglu", &FLAGDEPLOY_OPS_NS::swiglu);
}
