// Rotary embedding of q and k (rotate-half layout) and the step's k/v written into the paged caches, in
// one pass: the `rope_write_kv` op of flagdeploy.ops. Torch's form of it is a dozen small kernels (casts,
// a cat, chunks, four multiplies, two more cats, two index_copy_) costing ~100 us per layer of a decode
// step; this is a few microseconds. The arithmetic is the reference's: each half rotated in float32
// (x1 c - x2 s, x2 c + x1 s) and rounded to the input's dtype; the rotated k and the v go to their
// slots as they are.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

#include "bf16.h"
#include "dynamic_for.h"

#include "kernels.h"

namespace {

template <typename T>
inline T store(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return bf16_bits(v);
  }
}

// one head's row: out[i] and out[i + half] from x, with this token's cos/sin
template <typename T>
inline void rotate(const T* x, T* out, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    float a = as_float(x[i]), b = as_float(x[i + half]);
    out[i] = store<T>(a * c[i] - b * s[i]);
    out[i + half] = store<T>(b * c[i] + a * s[i]);
  }
}

// Rows [0, t) of q [t, h, d], k and v [t, kh, d] (strides in elements): each row's cos / sin the tables' row
// positions[i] (or i without positions); the rotated q to qo [t, h, d], the rotated k to ko (where not null) and to the
// row's slot of k_cache, v to v_cache's
template <typename T>
void rope_rows(const T* pq, int64_t qs0, int64_t qs1, const T* pk, int64_t ks0, int64_t ks1, const T* pv, int64_t vs0,
               int64_t vs1, int64_t t, int64_t h, int64_t kh, int64_t d, const float* pc, const float* ps, int64_t cs,
               const int64_t* positions, const int64_t* slot, T* kc, T* vc, T* qo, T* ko) {
  const int64_t half = d / 2, row = kh * d;  // row: one slot of a cache, [kv heads, head dim]
  dynamic_for(t, std::max<int64_t>(1, 4096 / std::max<int64_t>((h + kh) * d, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t i = t0; i < t1; ++i) {
      const int64_t at = positions ? positions[i] : i;
      const float *c = pc + at * cs, *s = ps + at * cs;
      for (int64_t j = 0; j < h; ++j) rotate(pq + i * qs0 + j * qs1, qo + (i * h + j) * d, c, s, half);
      T* kslot = kc + slot[i] * row;
      T* vslot = vc + slot[i] * row;
      for (int64_t j = 0; j < kh; ++j) {
        if (ko) {
          T* kr = ko + (i * kh + j) * d;
          rotate(pk + i * ks0 + j * ks1, kr, c, s, half);
          std::memcpy(kslot + j * d, kr, d * sizeof(T));
        } else {
          rotate(pk + i * ks0 + j * ks1, kslot + j * d, c, s, half);
        }
        std::memcpy(vslot + j * d, pv + i * vs0 + j * vs1, d * sizeof(T));
      }
    }
  });
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
         at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, at::Tensor& q_out, at::Tensor& k_out) {
  auto ptr = [](const at::Tensor& x) { return reinterpret_cast<T*>(x.data_ptr()); };
  rope_rows<T>(ptr(q), q.stride(0), q.stride(1), ptr(k), k.stride(0), k.stride(1), ptr(v), v.stride(0), v.stride(1),
               q.size(0), q.size(1), k.size(1), q.size(2), cos.data_ptr<float>(), sin.data_ptr<float>(), cos.stride(0),
               nullptr, slots.data_ptr<int64_t>(), ptr(k_cache), ptr(v_cache), ptr(q_out), ptr(k_out));
}

}  // namespace

namespace FLAGDEPLOY_OPS_NS {

void rope_write_kv_rows(const uint16_t* qkv, int64_t ld, int64_t rows, int64_t heads, int64_t kv_heads, int64_t d,
                        const float* cos, const float* sin, int64_t cs, const int64_t* positions, const int64_t* slots,
                        uint16_t* k_cache, uint16_t* v_cache, uint16_t* q_out) {
  const uint16_t *k = qkv + heads * d, *v = k + kv_heads * d;
  rope_rows<uint16_t>(qkv, ld, d, k, ld, d, v, ld, d, rows, heads, kv_heads, d, cos, sin, cs, positions, slots, k_cache,
                      v_cache, q_out, nullptr);
}

std::tuple<at::Tensor, at::Tensor> rope_write_kv(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                                 const at::Tensor& cos_in, const at::Tensor& sin_in, at::Tensor k_cache,
                                                 at::Tensor v_cache, const at::Tensor& slots_in) {
  const auto dt = q_in.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "rope_write_kv: float32 or bfloat16 q/k/v");
  TORCH_CHECK(k_in.scalar_type() == dt && v_in.scalar_type() == dt && k_cache.scalar_type() == dt &&
                  v_cache.scalar_type() == dt,
              "rope_write_kv: q, k, v and the caches must share one dtype");
  TORCH_CHECK(q_in.dim() == 3 && k_in.dim() == 3 && v_in.sizes() == k_in.sizes() && q_in.size(2) % 2 == 0,
              "rope_write_kv: q [T, H, D], k and v [T, KH, D], D even");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(-1) == q_in.size(2) &&
                  k_cache.size(-2) == k_in.size(1),
              "rope_write_kv: contiguous caches [blocks, block_size, KH, D]");
  // the last dimension must be dense; a head-split view of a fused projection's output keeps it so
  auto dense_rows = [](const at::Tensor& x) { return x.stride(2) == 1 ? x : x.contiguous(); };
  at::Tensor q = dense_rows(q_in), k = dense_rows(k_in), v = dense_rows(v_in);
  at::Tensor cos = cos_in.to(at::kFloat).contiguous(), sin = sin_in.to(at::kFloat).contiguous();
  at::Tensor slots = slots_in.to(at::kLong).contiguous();
  at::Tensor q_out = at::empty(q.sizes(), q.options()), k_out = at::empty(k.sizes(), k.options());
  if (dt == at::kFloat) {
    run<float>(q, k, v, cos, sin, k_cache, v_cache, slots, q_out, k_out);
  } else {
    run<uint16_t>(q, k, v, cos, sin, k_cache, v_cache, slots, q_out, k_out);
  }
  return {q_out, k_out};
}

}  // namespace FLAGDEPLOY_OPS_NS

TORCH_LIBRARY_FRAGMENT(FLAGDEPLOY_OPS_NS, m) {
  m.def("rope_write_kv(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slots) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(FLAGDEPLOY_OPS_NS, CPU, m) { m.impl("rope_write_kv", &FLAGDEPLOY_OPS_NS::rope_write_kv); }
