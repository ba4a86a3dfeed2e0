// RMS norm, alone and after a residual add (a bf16 sublayer output into a float32 residual stream, too), in one
// pass over each row.
//
// A decode step of a small model calls these ~60 times per token on rows of a few hundred values, where
// torch's composite RMSNorm costs 35-50 us a call (cast, square, mean, rsqrt, two multiplies, each its
// own kernel and allocation); here a row costs about a microsecond. The arithmetic is the fused
// override's (flagdeploy/ops/fused.py): the mean of squares in float32, and for bfloat16 rows the
// normalised value rounded to bfloat16 before the weight multiplies it (also rounded), so that a 16-bit
// step gives what it gave before; float32 rows are x * rsqrt(mean + eps) * w. Rows run in parallel only
// when there are enough of them to pay for waking the other threads.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>

#include "bf16.h"
#include "dynamic_for.h"
#include "fixed_sum.h"

#include "kernels.h"

namespace {

constexpr int64_t kGrainValues = 1 << 15;  // values per thread below which rows run on the calling thread

inline uint16_t to_bf16(float v) { return bf16_bits(v); }

// the mean of squares' sum: fixed_sum.h's order, the same whatever vector width the compiler picks
template <typename T>
inline float sum_squares(const T* x, int64_t n) { return fixed_dot(x, x, n); }

template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  const float ss = sum_squares(x, n);
  const float scale = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  if constexpr (std::is_same_v<T, float>) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = x[i] * scale * w[i];
  } else {
    for (int64_t i = 0; i < n; ++i) {
      float y = as_float(to_bf16(as_float(x[i]) * scale));
      out[i] = to_bf16(as_float(w[i]) * y);
    }
  }
}

// h = x + r in r's dtype; a bf16 x into a float32 r widened exactly and added in float32, as torch's
// type-promoting add does (one rounding: the same bits)
template <typename X, typename T>
void add_row(const X* x, const T* r, T* h, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) h[i] = as_float(x[i]) + r[i];
  } else {
    for (int64_t i = 0; i < n; ++i) h[i] = to_bf16(as_float(x[i]) + as_float(r[i]));
  }
}

void check(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "rms_norm: float32 or bfloat16 rows");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.dim() == 1 && w.size(0) == x.size(-1),
              "rms_norm: the weight must be one row of the input's width and dtype");
}

template <typename F>
void over_rows(int64_t rows, int64_t n, F body) {
  dynamic_for(rows, std::max<int64_t>(1, kGrainValues / std::max<int64_t>(n, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) body(r);
  });
}

}  // namespace

namespace FLAGDEPLOY_OPS_NS {

void rms_norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t n, float eps) {
  over_rows(rows, n, [&](int64_t r) { norm_row(x + r * n, w, out + r * n, n, eps); });
}

void rms_norm_rows(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t rows, int64_t n, float eps) {
  over_rows(rows, n, [&](int64_t r) { norm_row(x + r * n, w, out + r * n, n, eps); });
}

namespace {
template <typename X, typename T>
void add_norm(const X* x, const T* r, const T* w, T* h, T* out, int64_t rows, int64_t n, float eps) {
  over_rows(rows, n, [&](int64_t i) {
    add_row(x + i * n, r + i * n, h + i * n, n);
    norm_row(h + i * n, w, out + i * n, n, eps);
  });
}
}  // namespace

void add_rms_norm_rows(const uint16_t* x, const float* r, const float* w, float* h, float* out, int64_t rows, int64_t n,
                       float eps) {
  add_norm(x, r, w, h, out, rows, n, eps);
}

void add_rms_norm_rows(const uint16_t* x, const uint16_t* r, const uint16_t* w, uint16_t* h, uint16_t* out, int64_t rows,
                       int64_t n, float eps) {
  add_norm(x, r, w, h, out, rows, n, eps);
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  check(x_in, w_in);
  at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  at::Tensor out = at::empty_like(x);
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), rows, n, e);
  } else {
    auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
    rms_norm_rows(bits(x), bits(w), bits(out), rows, n, e);
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, const at::Tensor& r_in, const at::Tensor& w_in,
                                                double eps) {
  check(r_in, w_in);
  const bool widen = x_in.scalar_type() == at::kBFloat16 && r_in.scalar_type() == at::kFloat;
  TORCH_CHECK((r_in.scalar_type() == x_in.scalar_type() || widen) && r_in.sizes() == x_in.sizes(),
              "add_rms_norm: the residual must have the input's shape, and its dtype or float32 for bf16 input");
  at::Tensor x = x_in.contiguous(), res = r_in.contiguous(), w = w_in.contiguous();
  at::Tensor h = at::empty_like(res), out = at::empty_like(res);
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  const float e = static_cast<float>(eps);
  auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
  if (res.scalar_type() == at::kBFloat16)
    add_rms_norm_rows(bits(x), bits(res), bits(w), bits(h), bits(out), rows, n, e);
  else if (widen)
    add_rms_norm_rows(bits(x), res.data_ptr<float>(), w.data_ptr<float>(), h.data_ptr<float>(), out.data_ptr<float>(),
                      rows, n, e);
  else
    add_norm(x.data_ptr<float>(), res.data_ptr<float>(), w.data_ptr<float>(), h.data_ptr<float>(), out.data_ptr<float>(),
             rows, n, e);
  return {out, h};
}

}  // namespace FLAGDEPLOY_OPS_NS

TORCH_LIBRARY_FRAGMENT(FLAGDEPLOY_OPS_NS, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(FLAGDEPLOY_OPS_NS, CPU, m) {
  m.impl("rms_norm", &FLAGDEPLOY_OPS_NS::rms_norm);
  m.impl("add_rms_norm", &FLAGDEPLOY_OPS_NS::add_rms_norm);
}
