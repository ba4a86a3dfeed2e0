// Sampled decoding on the CPU: each row's next-token distribution (temperature, min_p, top_k, top_p) and a
// token drawn from a distribution at a given uniform, rows in parallel.
//
// A sampled request is what chat clients send (any temperature). In numpy or torch on the engine's thread a
// row took 0.16-0.29 ms over a 49k vocabulary (temperature alone / with top_p and top_k): ~4 ms of a 16-row
// decode step of ~20 ms, during which the kernels' other threads had nothing to do. Here a row is a few
// vectorised passes (the exp of exp_nonpositive.h), top_k and top_p select among the few entries above a
// bound from block maxima instead of sorting the vocabulary, and rows run on the kernels' threads.
// The semantics are the reference's (flagdeploy/ops/reference.py `sample_probs`, `draw`); sums run in
// fixed orders, so any build computes the same bits.
//   sample_probs: logits [R, V] float32 or bf16, temperature [R] float32, top_k [R] int64 (0: off),
//     top_p [R] float32 (1: off), min_p [R] float32 (0: off) -> probs [R, V] float32 (NaN: nothing to draw from)
//   draw: probs [R, V] float32 (non-negative), u [R] float64 in [0, 1) -> [R] int64 (-1: nothing to draw from)

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "bf16.h"
#include "dynamic_for.h"
#include "exp_nonpositive.h"
#include "fixed_sum.h"

#include "kernels.h"

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int64_t kDrawBlock = 256;  // entries a block of `draw_row` spans

// the largest of x[0, n) (no NaN), 16 lanes at a time
float max_of(const float* x, int64_t n) {
  float lane[kLanes];
  std::fill(lane, lane + kLanes, -kInf);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) lane[j] = x[i + j] > lane[j] ? x[i + j] : lane[j];
  }
  float m = *std::max_element(lane, lane + kLanes);
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// the indices i of x[0, n) with x[i] >= bound, and x[i] > 0 where `positive`, in index order: few of them,
// so 16 entries are tested at a time and only a hit is looked at one by one
void select_at_least(const float* x, int64_t n, float bound, bool positive, std::vector<int64_t>& out) {
  out.clear();
  const float at_least = positive ? std::max(bound, std::numeric_limits<float>::denorm_min()) : bound;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int j = 0; j < kLanes; ++j) hit |= x[i + j] >= at_least;
    if (hit)
      for (int j = 0; j < kLanes; ++j)
        if (x[i + j] >= at_least) out.push_back(i + j);
  }
  for (; i < n; ++i)
    if (x[i] >= at_least) out.push_back(i);
}

// A value at most the k-th largest of x[0, n) (at least k entries are >= it), cheaply: the k-th largest of the
// maxima of ~4k blocks, k of which are k distinct entries. The k-th largest itself where blocks would be
// single entries.
float floor_of_top(const float* x, int64_t n, int64_t k, std::vector<float>& scratch) {
  if (4 * k >= n) {
    scratch.assign(x, x + n);
  } else {
    const int64_t width = (n + 4 * k - 1) / (4 * k);
    scratch.clear();
    for (int64_t b = 0; b < n; b += width) scratch.push_back(max_of(x + b, std::min(width, n - b)));
  }
  const int64_t at = static_cast<int64_t>(scratch.size()) - k;
  std::nth_element(scratch.begin(), scratch.begin() + at, scratch.end());
  return scratch[at];
}

struct Scratch {
  std::vector<float> values;
  std::vector<int64_t> order;
  std::vector<float> kept;
};

// the k-th largest of x[0, n) (1 <= k <= n), selecting only among the entries at or above floor_of_top
float kth_largest(const float* x, int64_t n, int64_t k, Scratch& s) {
  select_at_least(x, n, floor_of_top(x, n, k, s.values), false, s.order);
  s.values.clear();
  for (int64_t i : s.order) s.values.push_back(x[i]);
  const int64_t at = static_cast<int64_t>(s.values.size()) - k;
  std::nth_element(s.values.begin(), s.values.begin() + at, s.values.end());
  return s.values[at];
}

// top_p over p (normalised): the likeliest tokens in descending order (ties by index) while the mass before
// each is below top_p; the rest set to 0. Only the likeliest are sorted: every entry at least a bound on the
// 64th (then 512th, ...) largest, a run of the descending order that holds the token crossing top_p as soon
// as some entry of it is left out.
void keep_top_p(float* p, int64_t n, float top_p, Scratch& s) {
  for (int64_t likeliest = 64;; likeliest *= 8) {
    const int64_t k = std::min(likeliest, n);
    const float bound = floor_of_top(p, n, k, s.values);
    select_at_least(p, n, bound, true, s.order);
    std::sort(s.order.begin(), s.order.end(),
              [p](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    size_t kept = 0;
    double before = 0;
    for (; kept < s.order.size() && before < top_p; ++kept) before += p[s.order[kept]];
    if (kept < s.order.size() || !(bound > 0) || k >= n) {
      s.kept.resize(kept);
      for (size_t j = 0; j < kept; ++j) s.kept[j] = p[s.order[j]];
      std::fill(p, p + n, 0.f);
      for (size_t j = 0; j < kept; ++j) p[s.order[j]] = s.kept[j];
      return;
    }
  }
}

template <typename T>
void probs_row(const T* x, int64_t n, float temperature, int64_t top_k, float top_p, float min_p, float* p,
               Scratch& s) {
  int nan = 0;
#pragma omp simd reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    p[i] = as_float(x[i]) / temperature;
    nan |= p[i] != p[i];
  }
  const float m = nan ? 0.f : max_of(p, n);
  if (nan || !std::isfinite(m)) {  // NaN logits, every token masked (-inf), or an infinite one: nothing to draw
    std::fill(p, p + n, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  // entries below `cut` are masked: min_p relative to the likeliest token, then top_k (ties with the k-th stay)
  float cut = -kInf;
  if (min_p > 0) cut = m + static_cast<float>(std::log(static_cast<double>(min_p)));
  if (top_k > 0 && top_k < n) cut = std::max(cut, kth_largest(p, n, top_k, s));
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) p[i] = p[i] >= cut ? exp_nonpositive(p[i] - m) : 0.f;
  const float total = fixed_sum(p, n);  // >= 1: the likeliest token's term
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) p[i] /= total;
  if (top_p < 1.f) keep_top_p(p, n, top_p, s);
  const float norm = fixed_sum(p, n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) p[i] /= norm;
}

// The token at uniform u of p's cumulative distribution in index order: the first entry whose running sum
// (float64) passes u times the total, found block by block (the blocks' sums, then within the block).
int64_t draw_row(const float* p, int64_t n, double u, std::vector<double>& blocks) {
  const int64_t nb = (n + kDrawBlock - 1) / kDrawBlock;
  blocks.resize(nb);
  double total = 0;
  for (int64_t b = 0; b < nb; ++b) {
    blocks[b] = fixed_sum<double>(p + b * kDrawBlock, std::min(kDrawBlock, n - b * kDrawBlock));
    total += blocks[b];
  }
  if (!std::isfinite(total) || !(total > 0)) return -1;  // NaN (nothing to draw from), or all zero
  const double target = u * total;
  double before = 0;
  int64_t b = 0;
  for (; b + 1 < nb && before + blocks[b] <= target; ++b) before += blocks[b];
  const int64_t end = std::min(n, (b + 1) * kDrawBlock);
  for (int64_t i = b * kDrawBlock; i < end; ++i) {
    before += p[i];
    if (before > target) return i;  // the sum moved here: p[i] > 0
  }
  for (int64_t i = end - 1; i >= 0; --i)  // the target at the block's end, rounded up: its last token
    if (p[i] > 0) return i;
  return -1;
}

void check_params(const at::Tensor& t, int64_t rows, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == rows && t.scalar_type() == dtype && t.is_contiguous(), "sample_probs: ",
              name, " must be a contiguous [R] tensor of ", c10::toString(dtype));
}

}  // namespace

namespace FLAGDEPLOY_OPS_NS {

at::Tensor sample_probs(const at::Tensor& logits_in, const at::Tensor& temperature, const at::Tensor& top_k,
                        const at::Tensor& top_p, const at::Tensor& min_p) {
  const at::ScalarType dtype = logits_in.scalar_type();
  TORCH_CHECK(logits_in.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16),
              "sample_probs: logits [R, V] float32 or bfloat16");
  const at::Tensor logits = logits_in.contiguous();
  const int64_t rows = logits.size(0), n = logits.size(1);
  check_params(temperature, rows, at::kFloat, "temperature");
  check_params(top_k, rows, at::kLong, "top_k");
  check_params(top_p, rows, at::kFloat, "top_p");
  check_params(min_p, rows, at::kFloat, "min_p");
  at::Tensor out = at::empty({rows, n}, logits.options().dtype(at::kFloat));
  const float *t = temperature.data_ptr<float>(), *pp = top_p.data_ptr<float>(), *mp = min_p.data_ptr<float>();
  const int64_t* k = top_k.data_ptr<int64_t>();
  float* po = out.data_ptr<float>();
  auto run = [&](const auto* px) {
    dynamic_for(rows, 1, [&](int64_t r0, int64_t r1) {
      Scratch s;
      for (int64_t r = r0; r < r1; ++r) probs_row(px + r * n, n, t[r], k[r], pp[r], mp[r], po + r * n, s);
    });
  };
  if (logits.scalar_type() == at::kFloat)
    run(logits.data_ptr<float>());
  else
    run(reinterpret_cast<const uint16_t*>(logits.data_ptr<at::BFloat16>()));
  return out;
}

at::Tensor draw(const at::Tensor& probs_in, const at::Tensor& u) {
  TORCH_CHECK(probs_in.dim() == 2 && probs_in.scalar_type() == at::kFloat, "draw: probs [R, V] float32");
  const at::Tensor probs = probs_in.contiguous();
  const int64_t rows = probs.size(0), n = probs.size(1);
  TORCH_CHECK(u.dim() == 1 && u.size(0) == rows && u.scalar_type() == at::kDouble && u.is_contiguous(),
              "draw: u must be a contiguous [R] float64 tensor");
  at::Tensor out = at::empty({rows}, probs.options().dtype(at::kLong));
  const float* pp = probs.data_ptr<float>();
  const double* pu = u.data_ptr<double>();
  int64_t* po = out.data_ptr<int64_t>();
  dynamic_for(rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<double> blocks;
    for (int64_t r = r0; r < r1; ++r) po[r] = draw_row(pp + r * n, n, pu[r], blocks);
  });
  return out;
}

}  // namespace FLAGDEPLOY_OPS_NS

TORCH_LIBRARY_FRAGMENT(FLAGDEPLOY_OPS_NS, m) {
  m.def("sample_probs(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p) -> Tensor");
  m.def("draw(Tensor probs, Tensor u) -> Tensor");
}

TORCH_LIBRARY_IMPL(FLAGDEPLOY_OPS_NS, CPU, m) {
  m.impl("sample_probs", &FLAGDEPLOY_OPS_NS::sample_probs);
  m.impl("draw", &FLAGDEPLOY_OPS_NS::draw);
}
